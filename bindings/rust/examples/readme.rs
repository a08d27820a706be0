use dparallel::{Device, Library, Module, ReplicaSet, Tensor};

fn main() -> dparallel::Result<()> {
    let lib = Library::open(None)?; // $DP_LIBRARY, else libdparallel.so.0
    let mut model = Module::new(&lib)?;
    model.register_parameter("w", &Tensor::from_slice(&lib, &[3.0f32], &[1], Device::cpu(0))?, true)?;
    let mut set = ReplicaSet::new(&model, &[Device::cpu(0), Device::cpu(1)])?;
    let x = Tensor::from_vec(&lib, vec![1.0f32, 2.0, 3.0, 4.0], &[4], Device::cpu(0))?;
    let y = set.apply(&x, 0, Device::cpu(0), |r| {
        let w = r.module.parameter("w")?.as_slice::<f32>()?[0]; // on cpu:0 and cpu:1 at once
        let out: Vec<f32> = r.input.as_slice::<f32>()?.iter().map(|v| w * v).collect();
        Tensor::from_vec(r.module.library(), out, &r.input.shape(), r.device)
    })?;
    assert_eq!(y.as_slice::<f32>()?, &[3.0, 6.0, 9.0, 12.0]);
    Ok(())
}
