//! Data-parallel training of a small MLP with candle on every visible GPU,
//! with the gradients all-reduced in place through cuda-peer on candle's own
//! device buffers (no copy), on candle's own streams.
//!
//! Each of the N GPUs holds a replica of the weights and 1/N of a fixed
//! synthetic batch (fixed seed). Every step: forward and backward on each
//! GPU, then every gradient is averaged across the GPUs in place
//! (`Group::all_reduce_raw`, `ReduceOp::Avg`), then each replica takes the
//! same SGD step. The loss curve is checked against single-GPU training on
//! the full batch, and the time per step is printed with the all-reduce's
//! share. Last, a trained weight is copied from GPU 0 to GPU 1 through a
//! verified `Link`, into a new candle tensor, and compared.
//!
//! Exit codes: 0 checked, 1 a check failed, 2 no usable GPU.

use candle_core::backprop::GradStore;
use candle_core::cuda_backend::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{Device, Storage, Tensor, Var};
use cuda_peer::cudarc::driver::{CudaStream, DevicePtr};
use cuda_peer::{DType, Group, GroupOptions, Link, LinkOptions, RawBuffer, RawStream, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

const INPUTS: usize = 64;
const HIDDEN: usize = 512;
const OUTPUTS: usize = 16;
/// The full batch; divisible by 1..8 GPUs.
const BATCH: usize = 8 * 1024;
const STEPS: usize = 60;
const LR: f64 = 0.05;
/// Largest relative difference allowed between the data-parallel loss and
/// the single-GPU loss at any step: averaging N shards' gradients adds the
/// same terms as the full batch in another order (f32), so the curves agree
/// to rounding, which grows slowly over the steps.
const LOSS_RTOL: f64 = 1e-3;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// A small deterministic generator (64-bit LCG), so that every run and every
/// replica sees the same data and initial weights.
struct Lcg(u64);

impl Lcg {
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

/// The synthetic task on the host: inputs, targets `tanh(x A) + 0.1 sin(3 x B)`,
/// and the initial weights (w1, b1, w2, b2).
struct Problem {
    x: Vec<f32>,
    y: Vec<f32>,
    init: Vec<(Vec<f32>, Vec<usize>)>,
}

fn problem() -> Problem {
    let mut rng = Lcg(0x5eed_cafe);
    let x = rng.vec(BATCH * INPUTS, 1.0);
    let a = rng.vec(INPUTS * OUTPUTS, 0.3);
    let b = rng.vec(INPUTS * OUTPUTS, 0.3);
    let mut y = vec![0f32; BATCH * OUTPUTS];
    for i in 0..BATCH {
        for o in 0..OUTPUTS {
            let (mut s, mut t) = (0f32, 0f32);
            for k in 0..INPUTS {
                s += x[i * INPUTS + k] * a[k * OUTPUTS + o];
                t += x[i * INPUTS + k] * b[k * OUTPUTS + o];
            }
            y[i * OUTPUTS + o] = s.tanh() + 0.1 * (3.0 * t).sin();
        }
    }
    let init = vec![
        (rng.vec(INPUTS * HIDDEN, (1.0 / INPUTS as f32).sqrt()), vec![INPUTS, HIDDEN]),
        (vec![0.0; HIDDEN], vec![HIDDEN]),
        (rng.vec(HIDDEN * OUTPUTS, (1.0 / HIDDEN as f32).sqrt()), vec![HIDDEN, OUTPUTS]),
        (vec![0.0; OUTPUTS], vec![OUTPUTS]),
    ];
    Problem { x, y, init }
}

/// One replica: its device, weights and shard of the batch.
struct Replica {
    device: Device,
    vars: Vec<Var>,
    x: Tensor,
    y: Tensor,
}

impl Replica {
    fn new(device: Device, p: &Problem, rows: std::ops::Range<usize>) -> Res<Self> {
        let n = rows.len();
        let x = Tensor::from_slice(&p.x[rows.start * INPUTS..rows.end * INPUTS], (n, INPUTS), &device)?;
        let y = Tensor::from_slice(&p.y[rows.start * OUTPUTS..rows.end * OUTPUTS], (n, OUTPUTS), &device)?;
        let vars = p
            .init
            .iter()
            .map(|(v, shape)| Var::from_tensor(&Tensor::from_slice(v, shape.as_slice(), &device)?))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(Replica { device, vars, x, y })
    }

    /// Mean squared error of the MLP on this replica's shard.
    fn loss(&self) -> candle_core::Result<Tensor> {
        let [w1, b1, w2, b2] = [0, 1, 2, 3].map(|i| self.vars[i].as_tensor());
        let h = self.x.matmul(w1)?.broadcast_add(b1)?.relu()?;
        let out = h.matmul(w2)?.broadcast_add(b2)?;
        (out - &self.y)?.sqr()?.mean_all()
    }

    fn grads(&self, g: &GradStore) -> Res<Vec<Tensor>> {
        self.vars
            .iter()
            .map(|v| g.get(v.as_tensor()).cloned().ok_or_else(|| "a weight has no gradient".into()))
            .collect()
    }

    fn sgd(&self, grads: &[Tensor]) -> candle_core::Result<()> {
        for (v, g) in self.vars.iter().zip(grads) {
            v.set(&(v.as_tensor() - (g * LR)?)?)?;
        }
        Ok(())
    }

    fn stream(&self) -> Res<Arc<CudaStream>> {
        Ok(self.device.as_cuda_device()?.cuda_stream())
    }
}

/// Averages `grads[r]` (one tensor per replica, same shape) across the
/// replicas in place, on candle's own buffers and streams.
fn all_reduce_avg(group: &Group, grads: &[Tensor], streams: &[Arc<CudaStream>]) -> Res<()> {
    let count = grads[0].elem_count();
    // Read guards keep each tensor's storage in place while its pointer is
    // used. Writing through them is sound here: the gradients are fresh
    // tensors of this step (nothing else holds or reads them), contiguous,
    // and all of candle's work on them is on the same stream as ours.
    let storages: Vec<_> = grads.iter().map(|g| g.storage_and_layout()).collect();
    let mut bufs = Vec::with_capacity(grads.len());
    let mut events = Vec::with_capacity(grads.len());
    for (r, (storage, layout)) in storages.iter().enumerate() {
        if !layout.is_contiguous() || layout.shape().elem_count() != count {
            return Err(format!("gradient {r} is not contiguous with {count} elements").into());
        }
        let Storage::Cuda(cuda) = &**storage else {
            return Err("gradient not on a CUDA device".into());
        };
        let slice = cuda.as_cuda_slice::<f32>()?;
        // cudarc's guard orders our stream after the slice's last write and
        // records its read event when dropped, after the all-reduce is enqueued.
        let (ptr, event) = slice.device_ptr(&streams[r]);
        bufs.push(RawBuffer(ptr + (layout.start_offset() * 4) as u64));
        events.push(event);
    }
    let raw: Vec<RawStream> = streams.iter().map(|s| RawStream::of(s)).collect();
    // SAFETY: bufs[r] holds `count` f32 of replica r's gradient on GPU r, in
    // cudarc's (candle's) allocation on that device's primary context, whose
    // memory the group's peers reach; the storage guards keep it allocated,
    // and nothing else uses it until candle's stream, which is the group's
    // stream here, has passed the all-reduce. The replicas' buffers are
    // distinct allocations on distinct devices.
    unsafe { group.all_reduce_raw(&bufs, count, DType::F32, ReduceOp::Avg, &raw) }?;
    drop(events);
    Ok(())
}

fn synchronize(replicas: &[Replica]) -> Res<()> {
    for r in replicas {
        r.device.synchronize()?;
    }
    Ok(())
}

/// Trains `replicas` (one per GPU) for STEPS steps; returns the loss at each
/// step (before its update), the time per step and the all-reduce's time.
fn train(replicas: &[Replica], group: Option<&Group>) -> Res<(Vec<f64>, Duration, Duration)> {
    let streams = replicas.iter().map(Replica::stream).collect::<Res<Vec<_>>>()?;
    let mut losses = Vec::with_capacity(STEPS);
    let (mut total, mut reducing) = (Duration::ZERO, Duration::ZERO);
    for step in 0..STEPS {
        synchronize(replicas)?;
        let t0 = Instant::now();
        // Every GPU's forward and backward are enqueued before any loss is read.
        let mut all_grads = Vec::with_capacity(replicas.len());
        let mut step_losses = Vec::with_capacity(replicas.len());
        for r in replicas {
            let l = r.loss()?;
            all_grads.push(r.grads(&l.backward()?)?);
            step_losses.push(l);
        }
        let mut loss = 0f64;
        for l in &step_losses {
            loss += l.to_scalar::<f32>()? as f64 / replicas.len() as f64;
        }
        losses.push(loss);
        synchronize(replicas)?;
        let t1 = Instant::now();
        if let Some(group) = group {
            for k in 0..all_grads[0].len() {
                let per_rank: Vec<Tensor> = all_grads.iter().map(|g| g[k].clone()).collect();
                all_reduce_avg(group, &per_rank, &streams)?;
            }
        }
        synchronize(replicas)?;
        let t2 = Instant::now();
        for (r, g) in replicas.iter().zip(&all_grads) {
            r.sgd(g)?;
        }
        synchronize(replicas)?;
        if step >= 5 {
            // The first steps load kernels and grow candle's and cuBLAS's workspaces.
            total += t0.elapsed();
            reducing += t2 - t1;
        }
    }
    let timed = (STEPS - 5) as u32;
    Ok((losses, total / timed, reducing / timed))
}

/// Copies weight 0 of GPU 0's replica to GPU 1 through a verified link, into
/// a new candle tensor there, and checks it.
fn link_copy(replicas: &[Replica]) -> Res<bool> {
    let (a, b) = (&replicas[0], &replicas[1]);
    let (sa, sb) = (a.stream()?, b.stream()?);
    let mut link = Link::open(sa.context(), sb.context(), &LinkOptions::default())?;
    let w = a.vars[0].as_tensor();
    let dst = {
        let (storage, layout) = w.storage_and_layout();
        let Storage::Cuda(cuda) = &*storage else {
            return Err("weight not on a CUDA device".into());
        };
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            return Err("weight not contiguous from its start".into());
        }
        let src = cuda.as_cuda_slice::<f32>()?;
        let mut dst = sb.alloc_zeros::<f32>(w.elem_count())?;
        link.copy(src, &mut dst, &sb)?; // ordered on GPU 1's candle stream
        dst
    };
    let cuda_b = b.device.as_cuda_device()?.clone();
    let copied = Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, cuda_b)),
        w.shape().clone(),
        BackpropOp::none(),
        false,
    );
    let same = copied.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()? == w.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    println!(
        "# link GPU0 -> GPU1: {:?}; copied a {:?} weight into a candle tensor on GPU 1: {}",
        link.status(),
        w.shape(),
        if same { "identical" } else { "DIFFERENT" }
    );
    Ok(same)
}

fn run() -> Res<bool> {
    let n = cuda_peer::driver::device_count()?;
    let p = problem();
    // candle's devices with their own streams (not the per-thread default
    // stream, which would differ on cuda-peer's launcher threads).
    let devices = (0..n).map(Device::new_cuda_with_stream).collect::<candle_core::Result<Vec<_>>>()?;
    let shard = BATCH / n;
    let replicas = (0..n)
        .map(|r| Replica::new(devices[r].clone(), &p, r * shard..(r + 1) * shard))
        .collect::<Res<Vec<_>>>()?;
    let streams = replicas.iter().map(Replica::stream).collect::<Res<Vec<_>>>()?;
    let group = Group::new(streams, &GroupOptions::default())?;
    let bytes: usize = p.init.iter().map(|(v, _)| v.len() * 4).sum();
    println!("# candle_data_parallel: {n} GPU(s), MLP {INPUTS}-{HIDDEN}-{OUTPUTS} ({bytes} bytes of gradients in 4 tensors), batch {BATCH} ({shard} per GPU), {STEPS} SGD steps");
    for (k, (v, _)) in p.init.iter().enumerate() {
        println!("#   gradient {k}: {} bytes -> {:?}", v.len() * 4, group.all_reduce_algorithm(v.len() * 4));
    }
    let (dp, dp_step, dp_reduce) = train(&replicas, Some(&group))?;
    let single = [Replica::new(devices[0].clone(), &p, 0..BATCH)?];
    let (one, one_step, _) = train(&single, None)?;
    println!("{:>5} {:>14} {:>14} {:>10}", "step", "loss (N GPUs)", "loss (1 GPU)", "rel diff");
    let mut worst = 0f64;
    for (s, (a, b)) in dp.iter().zip(&one).enumerate() {
        let rel = (a - b).abs() / b.abs().max(1e-12);
        worst = worst.max(rel);
        if s % 10 == 0 || s == STEPS - 1 {
            println!("{s:>5} {a:>14.7} {b:>14.7} {rel:>10.2e}");
        }
    }
    let curves_match = worst <= LOSS_RTOL && dp[STEPS - 1] < dp[0];
    println!(
        "# loss curves: largest relative difference {worst:.2e} (bound {LOSS_RTOL:.0e}), loss {:.5} -> {:.5}: {}",
        dp[0],
        dp[STEPS - 1],
        if curves_match { "match" } else { "MISMATCH" }
    );
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "# time per step (host-synchronised between phases, mean of steps 5..{STEPS}): {:.1} us on {n} GPU(s), all-reduce {:.1} us ({:.1}%); {:.1} us on 1 GPU with the full batch",
        us(dp_step),
        us(dp_reduce),
        100.0 * dp_reduce.as_secs_f64() / dp_step.as_secs_f64(),
        us(one_step)
    );
    let linked = if n >= 2 {
        link_copy(&replicas)?
    } else {
        println!("# link copy skipped: one GPU");
        true
    };
    Ok(curves_match && linked)
}

fn main() {
    match cuda_peer::driver::device_count() {
        Ok(0) => {
            println!("candle_data_parallel: no usable CUDA device: none found");
            std::process::exit(2);
        }
        Err(e) => {
            println!("candle_data_parallel: no usable CUDA device: {e}");
            std::process::exit(2);
        }
        Ok(_) => {}
    }
    match run() {
        Ok(true) => println!("# OK"),
        Ok(false) => {
            println!("# FAILED");
            std::process::exit(1);
        }
        Err(e) => {
            println!("candle_data_parallel: {e}");
            std::process::exit(1);
        }
    }
}
