//! The handle types beyond training: module trees (listing, requires_grad,
//! save and load), replicate and reduce_gradients_from, tensor copies and
//! zero-copy vectors.
//!
//!   DP_LIBRARY=path/to/libdparallel.so handles

use std::process::ExitCode;

use dparallel::{DType, Device, Library, Module, Result, Tensor};

fn check(failures: &mut usize, what: &str, ok: bool, detail: String) {
    if ok {
        println!("ok: {what}");
    } else {
        eprintln!("FAIL: {what}: {detail}");
        *failures += 1;
    }
}

fn run() -> Result<usize> {
    let lib = Library::open(None)?;
    let mut failures = 0;
    let (cpu0, cpu1) = (Device::cpu(0), Device::cpu(1));

    // A tree: root.scale (buffer), root.fc.{weight, bias}.
    let mut fc = Module::new(&lib)?;
    fc.register_parameter("weight", &Tensor::from_slice(&lib, &[1.0f32, 2.0, 3.0, 4.0], &[2, 2], cpu0)?, true)?;
    fc.register_parameter("bias", &Tensor::from_vec(&lib, vec![0.5f32, -0.5], &[2], cpu0)?, true)?;
    let mut root = Module::new(&lib)?;
    root.register_buffer("scale", &Tensor::from_slice(&lib, &[2.0f64], &[1], cpu0)?, true)?;
    root.register_module("fc", &fc)?;
    let names: Vec<String> = root.parameters()?.into_iter().map(|(n, _)| n).collect();
    check(
        &mut failures,
        "parameters are listed with dotted names in registration order",
        names == ["fc.weight", "fc.bias"] && root.num_buffers() == 1,
        format!("{names:?}, {} buffers", root.num_buffers()),
    );
    root.set_requires_grad("fc.bias", false)?;
    check(
        &mut failures,
        "requires_grad is set per parameter",
        root.requires_grad("fc.weight")? && !root.requires_grad("fc.bias")?,
        "flags differ".into(),
    );
    root.set_requires_grad("fc.bias", true)?;

    // The same storage through every handle: writes through the child show in the root.
    fc.parameter("weight")?.as_mut_slice::<f32>()?[0] = 10.0;
    let seen = root.parameter("fc.weight")?.to_vec::<f32>()?;
    check(&mut failures, "a parameter is one storage under every name", seen[0] == 10.0, format!("{seen:?}"));

    // Replicas on cpu:0 and cpu:1; their gradients add into the root's.
    let replicas = root.replicate(&[cpu0, cpu1], false)?;
    let on: Vec<Device> =
        replicas.iter().map(|r| r.parameter("fc.weight").map(|t| t.device())).collect::<Result<_>>()?;
    check(&mut failures, "replicas live on their devices", on == [cpu0, cpu1], format!("{on:?}"));
    for (i, r) in replicas.iter().enumerate() {
        r.grad("fc.weight")?.as_mut_slice::<f32>()?.fill(i as f32 + 1.0);
    }
    root.zero_grad()?;
    let refs: Vec<&Module> = replicas.iter().collect();
    root.reduce_gradients_from(&refs)?;
    let g = root.grad("fc.weight")?.to_vec::<f32>()?;
    check(&mut failures, "reduce_gradients_from adds every replica's gradient", g == [3.0; 4], format!("{g:?}"));

    // Save, change, load back.
    let path = std::env::temp_dir().join(format!("dp-rust-handles-{}.safetensors", std::process::id()));
    let path = path.to_str().expect("a UTF-8 temporary path").to_string();
    root.save(&path)?;
    root.parameter("fc.bias")?.as_mut_slice::<f32>()?.fill(7.0);
    root.load(&path, true)?;
    let _ = std::fs::remove_file(&path);
    let bias = root.parameter("fc.bias")?.to_vec::<f32>()?;
    let scale = root.get_buffer("scale")?.map(|t| t.to_vec::<f64>()).transpose()?;
    check(
        &mut failures,
        "save then load restores parameters and buffers",
        bias == [0.5, -0.5] && scale == Some(vec![2.0]),
        format!("bias {bias:?}, scale {scale:?}"),
    );

    // Copies across devices are new storage.
    let w = root.parameter("fc.weight")?;
    let mut moved = w.to_device(cpu1)?;
    moved.as_mut_slice::<f32>()?[1] = -1.0;
    let (orig, copy) = (w.to_vec::<f32>()?, moved.to_vec::<f32>()?);
    check(
        &mut failures,
        "to_device copies onto the device",
        moved.device() == cpu1 && moved.shape() == [2, 2] && orig[1] == 2.0 && copy[1] == -1.0,
        format!("{moved:?}: {copy:?}, original {orig:?}"),
    );
    let t = Tensor::zeros(&lib, DType::I64, &[3], cpu0)?;
    check(
        &mut failures,
        "zeros are zero and typed",
        t.as_slice::<i64>()? == [0, 0, 0] && t.dtype()? == DType::I64 && t.nbytes() == 24,
        format!("{t:?}"),
    );
    Ok(failures)
}

fn main() -> ExitCode {
    match run() {
        Ok(0) => ExitCode::SUCCESS,
        Ok(n) => {
            eprintln!("{n} failure(s)");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("handles: {e}");
            ExitCode::FAILURE
        }
    }
}
