//! Data-parallel training of a small MLP with candle on every visible GPU,
//! one thread per GPU, with the gradients all-reduced in place through
//! cuda-peer's per-rank communicator on candle's own device buffers (no
//! copy), on candle's own streams.
//!
//! Each of the N GPUs holds a replica of the weights and 1/N of a fixed
//! synthetic batch (fixed seed), and is driven by a thread of its own with
//! its own `cuda_peer::Comm` (`Comm::from_devices` on the replicas' candle
//! streams, as `ncclCommInitAll` would make them). Every step, on every
//! rank's thread: forward and backward, then each gradient is averaged
//! across the ranks in place (`Comm::all_reduce_in_place`, `ReduceOp::Avg`,
//! from a candle in-place op, which holds the tensor's storage for writing),
//! then the same SGD step. The loss curve is checked against single-GPU
//! training on the full batch, and the time per step is printed with the
//! all-reduce's share. Last, a trained weight is copied from GPU 0 to GPU 1
//! through a verified `Link`, into a new candle tensor, and compared.
//!
//! `--ranks N` runs N ranks laid round-robin over the GPUs (default: one per
//! GPU; ranks may share one, as for a test on a machine with one GPU).
//!
//! Exit codes: 0 checked, 1 a check failed, 2 no usable GPU, 64 a bad
//! argument.

use candle_core::backprop::GradStore;
use candle_core::cuda_backend::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, Device, InplaceOp1, Layout, Storage, Tensor, Var};
use cuda_peer::cudarc::driver::CudaStream;
use cuda_peer::{Comm, Link, LinkOptions, ReduceOp};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

const INPUTS: usize = 64;
const HIDDEN: usize = 512;
const OUTPUTS: usize = 16;
/// The full batch: a multiple of 840 (the least common multiple of 1..8),
/// so that 1 to 8 ranks get equal shards of all of it.
const BATCH: usize = 8 * 840;
const STEPS: usize = 60;
const LR: f64 = 0.05;
/// Largest relative difference allowed between the data-parallel loss and
/// the single-GPU loss at any step: averaging N shards' gradients adds the
/// same terms as the full batch in another order (f32), so the curves agree
/// to rounding, which grows slowly over the steps.
const LOSS_RTOL: f64 = 1e-3;

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

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
        self.vars.iter().map(|v| g.get(v.as_tensor()).cloned().ok_or_else(|| "a weight has no gradient".into())).collect()
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

/// The in-place average of a gradient across the ranks of `comm`, as a
/// candle in-place op: candle hands the op its storage behind the tensor's
/// write lock, so the all-reduce writes candle's own buffer, on candle's
/// stream (the communicator's), with no copy and no `unsafe`.
struct AllReduceAvg<'a>(&'a Comm);

impl InplaceOp1 for AllReduceAvg<'_> {
    fn name(&self) -> &'static str {
        "cuda-peer all-reduce (avg)"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        candle_core::bail!("{}: the gradients are on the CPU", self.name())
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> candle_core::Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else { candle_core::bail!("{}: a gradient that is not contiguous", self.name()) };
        let mut grad = storage.as_cuda_slice_mut::<f32>()?.slice_mut(start..end);
        self.0.all_reduce_in_place(&mut grad, ReduceOp::Avg).map_err(candle_core::Error::wrap)
    }
}

/// What one rank's training gives: the loss on its shard at each step
/// (before its update), the mean time per step and of the all-reduce.
struct Trained {
    losses: Vec<f64>,
    step: Duration,
    reduce: Duration,
}

/// Trains `replica` for STEPS steps on the calling thread, its gradients
/// averaged through `comm` (none: alone). The ranks' threads meet at
/// `barrier` between the phases, so that each phase's time is every
/// rank's.
fn train(replica: &Replica, comm: Option<&Comm>, barrier: &Barrier) -> Res<Trained> {
    let mut losses = Vec::with_capacity(STEPS);
    let (mut total, mut reducing) = (Duration::ZERO, Duration::ZERO);
    for step in 0..STEPS {
        replica.device.synchronize()?;
        barrier.wait();
        let t0 = Instant::now();
        let l = replica.loss()?;
        let grads = replica.grads(&l.backward()?)?;
        losses.push(l.to_scalar::<f32>()? as f64);
        replica.device.synchronize()?;
        barrier.wait();
        let t1 = Instant::now();
        if let Some(comm) = comm {
            for g in &grads {
                g.inplace_op1(&AllReduceAvg(comm))?;
            }
        }
        replica.device.synchronize()?;
        let t2 = Instant::now();
        replica.sgd(&grads)?;
        replica.device.synchronize()?;
        if step >= 5 {
            // The first steps load kernels and grow candle's and cuBLAS's workspaces.
            total += t0.elapsed();
            reducing += t2 - t1;
        }
    }
    let timed = (STEPS - 5) as u32;
    Ok(Trained { losses, step: total / timed, reduce: reducing / timed })
}

/// Trains every replica on a thread of its own, rank r through `comms[r]`;
/// returns the mean of the ranks' losses at each step (the full batch's
/// loss: equal shards) and the slowest rank's times.
fn train_data_parallel(replicas: &[Replica], comms: &[Comm]) -> Res<Trained> {
    let barrier = Barrier::new(replicas.len());
    let per_rank: Vec<Res<Trained>> = std::thread::scope(|s| {
        let barrier = &barrier;
        let handles: Vec<_> = replicas.iter().zip(comms).map(|(r, c)| s.spawn(move || train(r, Some(c), barrier))).collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank's thread panicked".into()))).collect()
    });
    let per_rank = per_rank.into_iter().collect::<Res<Vec<_>>>()?;
    let n = per_rank.len() as f64;
    Ok(Trained {
        losses: (0..STEPS).map(|s| per_rank.iter().map(|t| t.losses[s]).sum::<f64>() / n).collect(),
        step: per_rank.iter().map(|t| t.step).max().unwrap_or_default(),
        reduce: per_rank.iter().map(|t| t.reduce).max().unwrap_or_default(),
    })
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
    let copied = Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, cuda_b)), w.shape().clone(), BackpropOp::none(), false);
    let same = copied.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()? == w.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    println!(
        "# link GPU0 -> GPU1: {:?}; copied a {:?} weight into a candle tensor on GPU 1: {}",
        link.status(),
        w.shape(),
        if same { "identical" } else { "DIFFERENT" }
    );
    Ok(same)
}

fn run(gpus: usize, ranks: Option<usize>) -> Res<bool> {
    let n = ranks.unwrap_or(gpus);
    let p = problem();
    // candle's devices, rank r on GPU r % gpus, each with a stream of its own
    // (not the per-thread default stream, which differs between the
    // threads): the stream its rank's communicator enqueues on.
    let devices = (0..n).map(|r| Device::new_cuda_with_stream(r % gpus)).collect::<candle_core::Result<Vec<_>>>()?;
    let shard = BATCH / n;
    let replicas = (0..n).map(|r| Replica::new(devices[r].clone(), &p, r * shard..(r + 1) * shard)).collect::<Res<Vec<_>>>()?;
    let streams = replicas.iter().map(Replica::stream).collect::<Res<Vec<_>>>()?;
    let comms = Comm::from_devices(streams)?;
    let bytes: usize = p.init.iter().map(|(v, _)| v.len() * 4).sum();
    println!("# candle_data_parallel: {n} rank(s) on {gpus} GPU(s), MLP {INPUTS}-{HIDDEN}-{OUTPUTS} ({bytes} bytes of gradients in 4 tensors), batch {BATCH} ({shard} per rank), {STEPS} SGD steps");
    println!("#   one thread and one cuda_peer::Comm per rank (Comm::from_devices on candle's streams): {:?}", comms[0].engine());
    let dp = train_data_parallel(&replicas, &comms)?;
    let (dp_step, dp_reduce) = (dp.step, dp.reduce);
    let dp = dp.losses;
    let single = Replica::new(devices[0].clone(), &p, 0..BATCH)?;
    let alone = train(&single, None, &Barrier::new(1))?;
    let (one, one_step) = (alone.losses, alone.step);
    println!("{:>5} {:>14} {:>14} {:>10}", "step", "loss (N ranks)", "loss (1 GPU)", "rel diff");
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
        "# time per step (host-synchronised between phases, mean of steps 5..{STEPS}, the slowest rank): {:.1} us on {n} rank(s), all-reduce {:.1} us ({:.1}%); {:.1} us on 1 GPU with the full batch",
        us(dp_step),
        us(dp_reduce),
        100.0 * dp_reduce.as_secs_f64() / dp_step.as_secs_f64(),
        us(one_step)
    );
    let linked = if n >= 2 && gpus >= 2 {
        link_copy(&replicas)?
    } else {
        println!("# link copy skipped: ranks 0 and 1 are not on two GPUs");
        true
    };
    Ok(curves_match && linked)
}

/// `--ranks N` (1 to 8), if given; anything else is a usage error.
fn ranks_arg() -> Result<Option<usize>, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [] => Ok(None),
        [flag, n] if flag == "--ranks" => match n.parse::<usize>() {
            Ok(n) if (1..=8).contains(&n) => Ok(Some(n)),
            _ => Err(format!("--ranks {n}: expected 1 to 8")),
        },
        _ => Err(format!("usage: candle_data_parallel [--ranks N]; got {args:?}")),
    }
}

fn main() {
    // Checked before any GPU is opened.
    let ranks = ranks_arg().unwrap_or_else(|e| {
        eprintln!("candle_data_parallel: {e}");
        std::process::exit(64)
    });
    let gpus = match cuda_peer::driver::device_count() {
        Ok(0) => {
            println!("candle_data_parallel: no usable CUDA device: none found");
            std::process::exit(2);
        }
        Err(e) => {
            println!("candle_data_parallel: no usable CUDA device: {e}");
            std::process::exit(2);
        }
        Ok(n) => n,
    };
    match run(gpus, ranks) {
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
