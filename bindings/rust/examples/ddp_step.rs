use dparallel::{Ddp, DdpOptions, Device, Library, Module, ProcessGroup, Tensor};

fn main() -> dparallel::Result<()> {
    let lib = Library::open(None)?; // $DP_LIBRARY, else libdparallel.so.0
    let pg = ProcessGroup::from_env(&lib)?; // RANK, WORLD_SIZE, DP_STORE_ADDR, DP_STORE_PORT: dp-run sets them
    let (rank, world) = (pg.rank() as f32, pg.size() as f32);
    let mut model = Module::new(&lib)?;
    model.register_parameter("w", &Tensor::from_slice(&lib, &[1.0f32, 2.0], &[2], Device::cpu(0))?, true)?;
    let mut ddp = Ddp::new(&model, &pg, &DdpOptions::default())?; // every rank now holds rank 0's "w"

    // One step. Your backward writes each gradient and marks it ready...
    ddp.pre_forward()?;
    model.grad("w")?.as_mut_slice::<f32>()?.copy_from_slice(&[rank, 2.0 * rank]);
    ddp.mark_grad_ready("w")?;
    // ...and once finish_backward returns, the gradients hold the average over the ranks.
    ddp.finish_backward()?;
    let mean = (world - 1.0) / 2.0;
    assert_eq!(model.grad("w")?.as_slice::<f32>()?, &[mean, 2.0 * mean]);
    let grad = model.grad("w")?.to_vec::<f32>()?;
    for (w, g) in model.parameter("w")?.as_mut_slice::<f32>()?.iter_mut().zip(&grad) {
        *w -= 0.5 * g; // SGD, the same on every rank
    }
    println!("rank {rank}: w = {:?}", model.parameter("w")?.to_vec::<f32>()?);
    Ok(())
}
