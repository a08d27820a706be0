//! The host's model, as examples/dp-train.c has it, in plain Rust loops: a
//! stack of Linear(width, width) layers with tanh between them, MSE loss
//! against a fixed random teacher network, SGD, and the same training run on
//! one device as the reference for the parity checks.

#![allow(dead_code)]

use dparallel::{Device, Library, Module, Result, Tensor, TensorSlice};

pub const RTOL: f64 = 1.3e-6;
pub const ATOL: f64 = 5e-5;

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub layers: usize,
    pub width: usize,
    pub batch: usize,
    pub steps: usize,
    pub lr: f32,
}

pub const CONFIG: Config = Config { layers: 3, width: 16, batch: 64, steps: 12, lr: 1.0 };

/// Parameter names as torch.nn.Sequential(Linear, Tanh, ..., Linear) gives them.
pub fn weight_name(layer: usize) -> String {
    format!("{}.weight", 2 * layer)
}
pub fn bias_name(layer: usize) -> String {
    format!("{}.bias", 2 * layer)
}

// ---- deterministic random numbers (splitmix64), as dp-train ----
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    fn uniform01(&mut self) -> f64 {
        (self.next() >> 11) as f64 * (1.0 / 9007199254740992.0)
    }
    pub fn normal(&mut self) -> f32 {
        let u = self.uniform01();
        let v = self.uniform01();
        ((-2.0 * (u + 1e-300).ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

/// Weights and biases per layer; weights are [out][in], row-major.
#[derive(Clone)]
pub struct Params {
    pub w: Vec<Vec<f32>>,
    pub b: Vec<Vec<f32>>,
}

/// Glorot normal weights, zero biases.
pub fn init_network(c: &Config, seed: u64) -> Params {
    let mut rng = Rng::new(seed);
    let std = 1.0 / (c.width as f32).sqrt();
    let w = (0..c.layers).map(|_| (0..c.width * c.width).map(|_| std * rng.normal()).collect()).collect();
    let b = (0..c.layers).map(|_| vec![0.0; c.width]).collect();
    Params { w, b }
}

/// Layer outputs for n rows of x (row pitch ld): acts[l] is n x width.
fn forward(c: &Config, w: &[&[f32]], b: &[&[f32]], x: &[f32], ld: usize, n: usize) -> Vec<Vec<f32>> {
    let wd = c.width;
    let mut acts: Vec<Vec<f32>> = Vec::with_capacity(c.layers);
    for l in 0..c.layers {
        let mut out = vec![0.0f32; n * wd];
        {
            let (input, pitch) = if l == 0 { (x, ld) } else { (&acts[l - 1][..], wd) };
            for r in 0..n {
                let row = &input[r * pitch..r * pitch + wd];
                for j in 0..wd {
                    let wrow = &w[l][j * wd..(j + 1) * wd];
                    let mut s = 0.0f32;
                    for i in 0..wd {
                        s += row[i] * wrow[i];
                    }
                    let v = s + b[l][j];
                    out[r * wd + j] = if l + 1 < c.layers { v.tanh() } else { v };
                }
            }
        }
        acts.push(out);
    }
    acts
}

/// Forward and backward over n rows of `rows` ([x | y], pitch 2*width):
/// adds to gw/gb these rows' part of the gradient of the loss over
/// `full_batch` rows (MSE, mean over rows and outputs), times `world` (a DDP
/// reducer divides the ranks' sum by the world size). Calls
/// `layer_done(l, gw[l], gb[l])` once layer l's gradients are final, last
/// layer first. Returns these rows'
/// part of the loss.
#[allow(clippy::too_many_arguments)]
pub fn forward_backward(
    c: &Config,
    w: &[&[f32]],
    b: &[&[f32]],
    gw: &mut [&mut [f32]],
    gb: &mut [&mut [f32]],
    rows: &[f32],
    n: usize,
    full_batch: usize,
    world: usize,
    mut layer_done: impl FnMut(usize, &[f32], &[f32]) -> Result<()>,
) -> Result<f64> {
    let wd = c.width;
    let ld = 2 * wd;
    let acts = forward(c, w, b, rows, ld, n);
    let pred = &acts[c.layers - 1];
    let scale = 2.0 * world as f32 / (full_batch * wd) as f32;
    let mut loss = 0.0f64;
    let mut dz = vec![0.0f32; n * wd];
    for r in 0..n {
        for j in 0..wd {
            let diff = pred[r * wd + j] - rows[r * ld + wd + j];
            loss += diff as f64 * diff as f64;
            dz[r * wd + j] = diff * scale;
        }
    }
    for l in (0..c.layers).rev() {
        let (input, pitch) = if l == 0 { (rows, ld) } else { (&acts[l - 1][..], wd) };
        for j in 0..wd {
            for i in 0..wd {
                let mut s = 0.0f32;
                for r in 0..n {
                    s += dz[r * wd + j] * input[r * pitch + i];
                }
                gw[l][j * wd + i] += s;
            }
            let mut s = 0.0f32;
            for r in 0..n {
                s += dz[r * wd + j];
            }
            gb[l][j] += s;
        }
        layer_done(l, gw[l], gb[l])?;
        if l == 0 {
            break;
        }
        let mut da = vec![0.0f32; n * wd];
        for r in 0..n {
            for i in 0..wd {
                let mut s = 0.0f32;
                for j in 0..wd {
                    s += dz[r * wd + j] * w[l][j * wd + i];
                }
                let a = input[r * pitch + i];
                da[r * wd + i] = s * (1.0 - a * a); // tanh' from its output
            }
        }
        dz = da;
    }
    Ok(loss / (full_batch * wd) as f64)
}

/// Synthetic regression data: rows [x | teacher(x)], x in a random
/// 16-dimensional subspace, the teacher a fixed random network (seed 7).
pub struct Dataset {
    pub rows: usize,
    pub pool: Vec<f32>,
}

pub fn make_dataset(c: &Config) -> Dataset {
    let wd = c.width;
    let rows = 4 * c.batch;
    let k = wd.min(16);
    let teacher = init_network(c, 7);
    let mut rng = Rng::new(8);
    let z: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
    let basis: Vec<f32> = (0..k * wd).map(|_| rng.normal() / (k as f32).sqrt()).collect();
    let mut x = vec![0.0f32; rows * wd];
    for r in 0..rows {
        for j in 0..wd {
            let mut s = 0.0f32;
            for t in 0..k {
                s += z[r * k + t] * basis[t * wd + j];
            }
            x[r * wd + j] = s;
        }
    }
    let tw: Vec<&[f32]> = teacher.w.iter().map(|v| &v[..]).collect();
    let tb: Vec<&[f32]> = teacher.b.iter().map(|v| &v[..]).collect();
    let acts = forward(c, &tw, &tb, &x, wd, rows);
    let y = &acts[c.layers - 1];
    let mut pool = vec![0.0f32; rows * 2 * wd];
    for r in 0..rows {
        pool[r * 2 * wd..r * 2 * wd + wd].copy_from_slice(&x[r * wd..(r + 1) * wd]);
        pool[r * 2 * wd + wd..(r + 1) * 2 * wd].copy_from_slice(&y[r * wd..(r + 1) * wd]);
    }
    Dataset { rows, pool }
}

/// Step `step`'s batch: a shuffled draw from the pool, the same for every run.
pub fn batch(c: &Config, d: &Dataset, step: usize) -> Vec<f32> {
    let pitch = 2 * c.width;
    let mut rng = Rng::new(1000 + step as u64);
    let mut order: Vec<usize> = (0..d.rows).collect();
    let mut out = vec![0.0f32; c.batch * pitch];
    for i in 0..c.batch {
        let j = i + (rng.next() % (d.rows - i) as u64) as usize;
        order.swap(i, j);
        out[i * pitch..(i + 1) * pitch].copy_from_slice(&d.pool[order[i] * pitch..(order[i] + 1) * pitch]);
    }
    out
}

/// The module tree "0.weight", "0.bias", "1" (tanh, no parameters), "2.weight", ...
pub fn build_module(lib: &Library, c: &Config, p: &Params, device: Device) -> Result<Module> {
    let mut root = Module::new(lib)?;
    let wd = c.width as i64;
    for l in 0..c.layers {
        let mut linear = Module::new(lib)?;
        let weight = Tensor::from_slice(lib, &p.w[l], &[wd, wd], device)?;
        let bias = Tensor::from_slice(lib, &p.b[l], &[wd], device)?;
        linear.register_parameter("weight", &weight, true)?;
        linear.register_parameter("bias", &bias, true)?;
        root.register_module(&(2 * l).to_string(), &linear)?;
        if l + 1 < c.layers {
            root.register_module(&(2 * l + 1).to_string(), &Module::new(lib)?)?;
        }
    }
    Ok(root)
}

/// The module's parameters and gradients as tensors, for one backward.
pub struct LayerTensors {
    pub w: Vec<Tensor>,
    pub b: Vec<Tensor>,
    pub gw: Vec<Tensor>,
    pub gb: Vec<Tensor>,
}

pub fn layer_tensors(c: &Config, m: &Module) -> Result<LayerTensors> {
    let mut t = LayerTensors { w: vec![], b: vec![], gw: vec![], gb: vec![] };
    for l in 0..c.layers {
        t.w.push(m.parameter(&weight_name(l))?);
        t.b.push(m.parameter(&bias_name(l))?);
        t.gw.push(m.grad(&weight_name(l))?);
        t.gb.push(m.grad(&bias_name(l))?);
    }
    Ok(t)
}

/// forward_backward over a module: its parameters read in place, each
/// layer's gradients accumulated in host buffers and copied into the
/// module's before `layer_done(l)` (a reducer reads and writes them from
/// then on, so no slice of them may live across that call).
pub fn module_forward_backward(
    c: &Config,
    m: &Module,
    rows: &[f32],
    n: usize,
    world: usize,
    mut layer_done: impl FnMut(usize) -> Result<()>,
) -> Result<f64> {
    let mut t = layer_tensors(c, m)?;
    let w_views: Vec<TensorSlice<f32>> = t.w.iter().map(|x| x.as_slice::<f32>()).collect::<Result<_>>()?;
    let b_views: Vec<TensorSlice<f32>> = t.b.iter().map(|x| x.as_slice::<f32>()).collect::<Result<_>>()?;
    let mut gw_host: Vec<Vec<f32>> = t.gw.iter().map(|x| x.to_vec::<f32>()).collect::<Result<_>>()?;
    let mut gb_host: Vec<Vec<f32>> = t.gb.iter().map(|x| x.to_vec::<f32>()).collect::<Result<_>>()?;
    let w: Vec<&[f32]> = w_views.iter().map(|v| &**v).collect();
    let b: Vec<&[f32]> = b_views.iter().map(|v| &**v).collect();
    let mut gw: Vec<&mut [f32]> = gw_host.iter_mut().map(|v| &mut v[..]).collect();
    let mut gb: Vec<&mut [f32]> = gb_host.iter_mut().map(|v| &mut v[..]).collect();
    let (module_gw, module_gb) = (&mut t.gw, &mut t.gb);
    forward_backward(c, &w, &b, &mut gw, &mut gb, rows, n, c.batch, world, |l, gw_l, gb_l| {
        module_gw[l].copy_from(gw_l)?;
        module_gb[l].copy_from(gb_l)?;
        layer_done(l)
    })
}

/// SGD on the module's parameters, in place.
pub fn module_sgd(m: &Module, lr: f32) -> Result<()> {
    for (name, mut p) in m.parameters()? {
        let g = m.grad(&name)?;
        let g = g.as_slice::<f32>()?;
        for (pv, gv) in p.as_mut_slice::<f32>()?.iter_mut().zip(g.iter()) {
            *pv -= lr * gv;
        }
    }
    Ok(())
}

/// Single-device training on the full batch of every step, from `init`;
/// returns the final parameters and each step's loss.
pub fn reference_training(c: &Config, d: &Dataset, init: &Params) -> (Params, Vec<f64>) {
    let mut p = init.clone();
    let mut losses = Vec::new();
    for step in 0..c.steps {
        let rows = batch(c, d, step);
        let mut gw: Vec<Vec<f32>> = (0..c.layers).map(|_| vec![0.0; c.width * c.width]).collect();
        let mut gb: Vec<Vec<f32>> = (0..c.layers).map(|_| vec![0.0; c.width]).collect();
        let loss = {
            let w: Vec<&[f32]> = p.w.iter().map(|v| &v[..]).collect();
            let b: Vec<&[f32]> = p.b.iter().map(|v| &v[..]).collect();
            let mut gwr: Vec<&mut [f32]> = gw.iter_mut().map(|v| &mut v[..]).collect();
            let mut gbr: Vec<&mut [f32]> = gb.iter_mut().map(|v| &mut v[..]).collect();
            forward_backward(c, &w, &b, &mut gwr, &mut gbr, &rows, c.batch, c.batch, 1, |_, _, _| Ok(()))
                .expect("reference")
        };
        losses.push(loss);
        for l in 0..c.layers {
            for (x, g) in p.w[l].iter_mut().zip(&gw[l]) {
                *x -= c.lr * g;
            }
            for (x, g) in p.b[l].iter_mut().zip(&gb[l]) {
                *x -= c.lr * g;
            }
        }
    }
    (p, losses)
}

/// Compares the module's parameters with `expected`: the number of values
/// outside rtol/atol (a NaN counts) and the largest difference.
pub fn compare(c: &Config, m: &Module, expected: &Params) -> Result<(usize, f64)> {
    let mut bad = 0;
    let mut worst = 0.0f64;
    for l in 0..c.layers {
        for (name, want) in [(weight_name(l), &expected.w[l]), (bias_name(l), &expected.b[l])] {
            let got = m.parameter(&name)?.to_vec::<f32>()?;
            if got.len() != want.len() {
                return Ok((usize::MAX, f64::INFINITY));
            }
            for (g, e) in got.iter().zip(want.iter()) {
                let diff = (*g as f64 - *e as f64).abs();
                // A NaN fails too.
                #[allow(clippy::neg_cmp_op_on_partial_ord)]
                if !(diff <= ATOL + RTOL * (*e as f64).abs()) {
                    bad += 1;
                }
                worst = worst.max(diff);
            }
        }
    }
    Ok((bad, worst))
}
