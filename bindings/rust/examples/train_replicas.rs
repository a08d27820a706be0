//! Data-parallel training of the tanh MLP on two logical CPU devices with
//! the forward/backward written in Rust, checked against single-device
//! training on the full batch.
//!
//!   DP_LIBRARY=path/to/libdparallel.so train_replicas --mode replica-set
//!   DP_LIBRARY=path/to/libdparallel.so train_replicas --mode data-parallel

mod mlp;

use std::collections::HashSet;
use std::process::ExitCode;
use std::sync::Mutex;
use std::thread::ThreadId;

use dparallel::{DType, Device, Error, Library, Module, Replica, ReplicaSet, Result, Tensor, DP_EINVAL};
use mlp::{Config, CONFIG};

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    ReplicaSet,
    DataParallel,
}

/// The callback: this replica's shard forward and backward, straight over
/// the replica's tensors; returns its part of the loss on its device.
fn replica_step(c: &Config, r: Replica<'_>, seen: &Mutex<Vec<(usize, ThreadId)>>) -> Result<Tensor> {
    seen.lock().unwrap().push((r.index, std::thread::current().id()));
    let shape = r.input.shape();
    if shape.len() != 2 || shape[1] != 2 * c.width as i64 {
        return Err(Error::new(DP_EINVAL, format!("input: shape {shape:?}, want [rows, {}]", 2 * c.width)));
    }
    let rows = r.input.as_slice::<f32>()?;
    let loss = mlp::module_forward_backward(c, r.module, &rows, shape[0] as usize, 1, |_| Ok(()))?;
    Tensor::from_slice(r.module.library(), &[loss as f32], &[1], r.device)
}

fn run(mode: Mode) -> Result<bool> {
    let c = CONFIG;
    let lib = Library::open(None)?;
    let devices = [lib.parse_device("cpu:0")?, lib.parse_device("cpu:1")?];
    let host = Device::cpu(0);
    let init = mlp::init_network(&c, 42);
    let mut model: Module = mlp::build_module(&lib, &c, &init, devices[0])?;
    let data = mlp::make_dataset(&c);
    let (expected, reference_losses) = mlp::reference_training(&c, &data, &init);

    let mut input = Tensor::zeros(&lib, DType::F32, &[c.batch as i64, 2 * c.width as i64], host)?;
    let mut set = if mode == Mode::ReplicaSet { Some(ReplicaSet::new(&model, &devices)?) } else { None };
    let seen = Mutex::new(Vec::new());
    let mut ok = true;
    for step in 0..c.steps {
        // Written in place: the slice borrows the tensor.
        input.as_mut_slice::<f32>()?.copy_from_slice(&mlp::batch(&c, &data, step));
        let forward = |r: Replica<'_>| replica_step(&c, r, &seen);
        let losses = match set.as_mut() {
            Some(set) => {
                set.sync()?;
                let losses = set.apply(&input, 0, host, forward)?;
                model.zero_grad()?;
                set.reduce_gradients()?;
                losses
            }
            None => {
                model.zero_grad()?;
                model.data_parallel(&input, &devices, host, 0, forward)?
            }
        };
        mlp::module_sgd(&model, c.lr)?;
        let parts = losses.to_vec::<f32>()?;
        let loss: f64 = parts.iter().map(|&x| x as f64).sum();
        let want = reference_losses[step];
        let close = (loss - want).abs() <= 1e-5 * want.abs() + 1e-7;
        println!(
            "step {:2}/{}  loss {loss:.6} (single device {want:.6}) from {} replicas",
            step + 1,
            c.steps,
            parts.len()
        );
        if parts.len() != devices.len() || !close {
            eprintln!("FAIL: step {}: loss {loss} from {} parts, single-device loss {want}", step + 1, parts.len());
            ok = false;
        }
    }

    // Every replica ran every step, on the device workers, not on this thread.
    let seen = seen.into_inner().unwrap();
    let main_thread = std::thread::current().id();
    for index in 0..devices.len() {
        let calls: Vec<ThreadId> = seen.iter().filter(|(i, _)| *i == index).map(|(_, t)| *t).collect();
        let threads: HashSet<ThreadId> = calls.iter().copied().collect();
        if calls.len() != c.steps || threads.contains(&main_thread) {
            eprintln!(
                "FAIL: replica {index} ran {} times (want {}), on the calling thread: {}",
                calls.len(),
                c.steps,
                threads.contains(&main_thread)
            );
            ok = false;
        }
    }
    let first = reference_losses[0];
    let last = *reference_losses.last().unwrap();
    if !(last < 0.5 * first) {
        eprintln!("FAIL: the model did not learn: loss {first} -> {last}");
        ok = false;
    }
    let (bad, worst) = mlp::compare(&c, &model, &expected)?;
    println!(
        "parity with single-device training on the full batch: max |difference| {worst:.3e}, {bad} values outside rtol {} atol {}: {}",
        mlp::RTOL,
        mlp::ATOL,
        if bad == 0 { "OK" } else { "FAIL" }
    );
    Ok(ok && bad == 0)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mode = match args.get(1..).unwrap_or(&[]) {
        [flag, m] if flag == "--mode" && m == "replica-set" => Mode::ReplicaSet,
        [flag, m] if flag == "--mode" && m == "data-parallel" => Mode::DataParallel,
        [] => Mode::ReplicaSet,
        _ => {
            eprintln!("usage: train_replicas [--mode replica-set|data-parallel]");
            return ExitCode::from(2);
        }
    };
    match run(mode) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("train_replicas: {e}");
            ExitCode::FAILURE
        }
    }
}
