//! The error paths of the Rust binding:
//!
//!   errors            bad arguments give Err naming the argument; a forward
//!                     closure that panics or fails gives Err in the caller
//!                     (DP_EUSER with its message), never an abort; a library
//!                     of another ABI major, or none, is refused.
//!   errors --reload   loads, uses (device workers included), drops every
//!                     handle and dlcloses the library, three times over.

use std::process::ExitCode;

use dparallel::{
    parallel_apply, DType, Device, Error, Library, Module, ProcessGroup, ProcessGroupOptions, ReduceOp, Replica,
    ReplicaSet, Result, Store, Tensor, DP_EINVAL, DP_EIO, DP_ETIMEOUT, DP_EUNSUPPORTED, DP_EUSER,
};

struct Checks {
    failures: usize,
}

impl Checks {
    /// `result` must be Err with `code` and a message holding every `needle`.
    fn expect_err<T: std::fmt::Debug>(&mut self, what: &str, result: Result<T>, code: i32, needles: &[&str]) {
        match result {
            Ok(v) => {
                eprintln!("FAIL: {what}: succeeded ({v:?})");
                self.failures += 1;
            }
            Err(e) => {
                let missing: Vec<&&str> = needles.iter().filter(|n| !e.message().contains(**n)).collect();
                if e.code() != code || !missing.is_empty() {
                    eprintln!("FAIL: {what}: got {e}; want code {code} and a message naming {needles:?}");
                    self.failures += 1;
                } else {
                    println!("ok: {what}: {e}");
                }
            }
        }
    }

    fn expect(&mut self, what: &str, ok: bool, detail: String) {
        if ok {
            println!("ok: {what}");
        } else {
            eprintln!("FAIL: {what}: {detail}");
            self.failures += 1;
        }
    }
}

/// A module with one parameter "w" of `n` floats on `device`.
fn small_module(lib: &Library, n: i64, device: Device) -> Result<Module> {
    let mut m = Module::new(lib)?;
    m.register_parameter("w", &Tensor::from_slice(lib, &vec![1.0f32; n as usize], &[n], device)?, true)?;
    Ok(m)
}

/// Doubles the input on the replica's device.
fn double(r: Replica<'_>) -> Result<Tensor> {
    let v: Vec<f32> = r.input.as_slice::<f32>()?.iter().map(|x| 2.0 * x).collect();
    Tensor::from_vec(r.module.library(), v, &r.input.shape(), r.device)
}

fn argument_errors(lib: &Library, c: &mut Checks) -> Result<()> {
    let cpu0 = Device::cpu(0);
    c.expect_err(
        "a negative extent names shape[0]",
        Tensor::zeros(lib, DType::F32, &[-2], cpu0),
        DP_EINVAL,
        &["shape[0]", "-2"],
    );
    c.expect_err(
        "a vector the shape does not fit names shape",
        Tensor::from_vec(lib, vec![1.0f32; 3], &[2, 2], cpu0),
        DP_EINVAL,
        &["shape", "[2, 2]", "3 elements"],
    );
    c.expect_err(
        "a vector for a cuda device names device",
        Tensor::from_vec(lib, vec![1.0f32; 4], &[4], Device::cuda(0)),
        DP_EINVAL,
        &["device", "cuda:0"],
    );
    let mut m = Module::new(lib)?;
    let t = Tensor::zeros(lib, DType::F32, &[3], cpu0)?;
    c.expect_err(
        "a dotted parameter name names 'name'",
        m.register_parameter("a.b", &t, true),
        DP_EINVAL,
        &["'name'", "a.b"],
    );
    c.expect_err("a NUL in a name names 'name'", m.register_parameter("a\0b", &t, true), DP_EINVAL, &["name"]);
    c.expect_err("an unknown parameter is named", m.parameter("nope"), DP_EINVAL, &["nope"]);
    c.expect_err(
        "a device listed twice names both indices",
        ReplicaSet::new(&m, &[cpu0, cpu0]),
        DP_EINVAL,
        &["devices[0]", "devices[1]"],
    );
    c.expect_err(
        "an f64 view of an f32 tensor names the dtypes",
        t.as_slice::<f64>().map(|s| s.len()),
        DP_EINVAL,
        &["tensor", "float32", "float64"],
    );
    c.expect_err("a parse error names the text", lib.parse_device("gpu:x"), DP_EINVAL, &["gpu:x"]);
    Ok(())
}

fn callback_errors(lib: &Library, c: &mut Checks) -> Result<()> {
    let devices = [Device::cpu(0), Device::cpu(1)];
    let model = small_module(lib, 4, devices[0])?;
    let replicas = model.replicate(&devices, false)?;
    let replica_refs: Vec<&Module> = replicas.iter().collect();
    let inputs = [
        Tensor::from_slice(lib, &[1.0f32, 2.0], &[2], devices[0])?,
        Tensor::from_slice(lib, &[3.0f32, 4.0], &[2], devices[1])?,
    ];
    let input_refs: Vec<&Tensor> = inputs.iter().collect();

    println!("(a panic message from the forward closure of replica 1 follows)");
    c.expect_err(
        "a panic in parallel_apply's closure is DP_EUSER naming the replica and the panic",
        parallel_apply(&replica_refs, &input_refs, Some(&devices), |r| {
            if r.index == 1 {
                panic!("boom in replica {}", r.index);
            }
            double(r)
        }),
        DP_EUSER,
        &["replica 1", "panicked", "boom in replica 1"],
    );
    c.expect_err(
        "an Err from the closure is DP_EUSER with its message",
        parallel_apply(&replica_refs, &input_refs, None, |r| {
            if r.index == 0 {
                return Err(Error::new(DP_EINVAL, "rows: the closure refused its input"));
            }
            double(r)
        }),
        DP_EUSER,
        &["replica 0", "the closure refused its input"],
    );

    // The library and this process carry on.
    let outputs = parallel_apply(&replica_refs, &input_refs, None, double)?;
    let got: Vec<Vec<f32>> = outputs.iter().map(|t| t.to_vec::<f32>()).collect::<Result<_>>()?;
    let on: Vec<Device> = outputs.iter().map(|t| t.device()).collect();
    c.expect(
        "parallel_apply works after the failures",
        got == vec![vec![2.0, 4.0], vec![6.0, 8.0]] && on == devices,
        format!("outputs {got:?} on {on:?}"),
    );

    let mut set = ReplicaSet::new(&model, &devices)?;
    let batch = Tensor::from_slice(lib, &[1.0f32, 2.0, 3.0, 4.0], &[4], devices[0])?;
    println!("(panic messages from both replicas follow)");
    c.expect_err(
        "panics on every replica of a replica set are all reported",
        set.apply(&batch, 0, devices[0], |r| -> Result<Tensor> { panic!("replica set panic {}", r.index) }),
        DP_EUSER,
        &["replica set panic 0", "replica set panic 1"],
    );
    let out = set.apply(&batch, 0, devices[0], double)?.to_vec::<f32>()?;
    c.expect("the replica set works after the panics", out == [2.0, 4.0, 6.0, 8.0], format!("output {out:?}"));

    let mut model = model;
    println!("(a panic message from data_parallel's single-device closure follows)");
    c.expect_err(
        "a panic in data_parallel on one device (run on this thread) is DP_EUSER",
        model.data_parallel(&batch, &devices[..1], devices[0], 0, |_| -> Result<Tensor> { panic!("single device") }),
        DP_EUSER,
        &["single device"],
    );
    Ok(())
}

fn loading_errors(c: &mut Checks) {
    c.expect_err(
        "a library of another ABI major is refused",
        Library::open_requesting_abi_major(None, 1),
        DP_EUNSUPPORTED,
        &["ABI major 1"],
    );
    c.expect_err(
        "a missing library names its path",
        Library::open(Some("/nonexistent/libdparallel.so.0")),
        DP_EIO,
        &["/nonexistent/libdparallel.so.0"],
    );
}

fn environment_errors(lib: &Library, c: &mut Checks) {
    // A world size but no rank: the missing variable is named.
    std::env::set_var("WORLD_SIZE", "2");
    std::env::remove_var("RANK");
    std::env::remove_var("OMPI_COMM_WORLD_RANK");
    c.expect_err(
        "a process group without RANK names it",
        ProcessGroup::from_env(lib).map(|_| ()),
        DP_EINVAL,
        &["RANK is not set"],
    );
}

/// A file store and a one-rank group made from explicit options.
fn store_and_group(lib: &Library, c: &mut Checks) -> Result<()> {
    let path = std::env::temp_dir().join(format!("dp-rust-store-{}", std::process::id()));
    let path = path.to_str().expect("a UTF-8 temporary path");
    let store = Store::file(lib, path, 1)?;
    store.set("greeting", b"hello")?;
    let value = store.get("greeting")?;
    let counter = store.add("counter", 5)? + store.add("counter", -2)?;
    c.expect("the store gives back what was set", value == b"hello" && counter == 8, format!("{value:?}, {counter}"));
    store.set_timeout(50)?;
    c.expect_err("a missing key times out naming it", store.get("absent-key"), DP_ETIMEOUT, &["absent-key"]);

    let options = ProcessGroupOptions { rank: Some(0), world_size: Some(1), store: Some(&store), ..Default::default() };
    let pg = ProcessGroup::new(lib, &options)?;
    let mut t = Tensor::from_slice(lib, &[1.5f32, -2.0], &[2], Device::cpu(0))?;
    pg.all_reduce(&mut t, ReduceOp::Max)?;
    let got = t.to_vec::<f32>()?;
    c.expect(
        "a one-rank group from options reduces in place",
        pg.rank() == 0 && pg.size() == 1 && got == [1.5, -2.0],
        format!("rank {} of {}, {got:?}", pg.rank(), pg.size()),
    );
    let bad = ProcessGroupOptions { rank: Some(3), world_size: Some(2), store: Some(&store), ..Default::default() };
    c.expect_err("a rank past the world size names rank", ProcessGroup::new(lib, &bad), DP_EINVAL, &["rank"]);
    Ok(())
}

/// Three rounds of load, use, drop everything, dlclose.
fn reload() -> Result<bool> {
    let devices = [Device::cpu(0), Device::cpu(1)];
    for round in 1..=3 {
        let lib = Library::open(None)?;
        let model = small_module(&lib, 8, devices[0])?;
        let mut set = ReplicaSet::new(&model, &devices)?;
        let batch = Tensor::from_slice(&lib, &[1.0f32, 2.0], &[2], devices[0])?;
        let out = set.apply(&batch, 0, devices[0], double)?.to_vec::<f32>()?;
        if out != [2.0, 4.0] {
            eprintln!("FAIL: round {round}: output {out:?}");
            return Ok(false);
        }
        drop(set);
        drop(batch);
        drop(model);
        drop(lib); // the last reference: dlclose
        println!("round {round}: loaded, ran on {devices:?}, closed");
    }
    Ok(true)
}

fn main() -> ExitCode {
    let reload_mode = match std::env::args().nth(1).as_deref() {
        None => false,
        Some("--reload") => true,
        Some(other) => {
            eprintln!("usage: errors [--reload] (not '{other}')");
            return ExitCode::from(2);
        }
    };
    if reload_mode {
        return match reload() {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("errors --reload: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let mut c = Checks { failures: 0 };
    let lib = match Library::open(None) {
        Ok(lib) => lib,
        Err(e) => {
            eprintln!("errors: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = argument_errors(&lib, &mut c)
        .and_then(|_| callback_errors(&lib, &mut c))
        .and_then(|_| store_and_group(&lib, &mut c));
    loading_errors(&mut c);
    environment_errors(&lib, &mut c);
    if let Err(e) = outcome {
        eprintln!("FAIL: unexpected error: {e}");
        c.failures += 1;
    }
    println!("{} failure(s)", c.failures);
    if c.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
