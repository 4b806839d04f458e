//! A llama-shaped decoder (seeded random weights) run tensor-parallel with
//! candle, one process per GPU, launched by `cuda-peer-run -n W -- <binary>`
//! (or torchrun): the row-parallel layers' partial sums are all-reduced
//! through `cuda_peer::compat::nccl`, or, built with `--features nccl`,
//! through `cudarc::nccl::safe` (NCCL). The two builds differ in the one
//! `use` line below and in how a communicator is made when two ranks share a
//! GPU (`new_comm`: NCCL refuses that, cuda-peer needs
//! `CommOptions::share_devices`, which `compat::nccl::Comm::from_rank` has
//! no argument for).
//!
//! Each decoder layer: RMSNorm, q/k/v projections column-parallel (each rank
//! holds heads/W query heads and kv_heads/W key/value heads), rotary
//! embeddings, grouped-query attention over a KV cache, o_proj row-parallel
//! (all-reduce), RMSNorm, SwiGLU MLP with gate/up column-parallel
//! (intermediate/W columns) and down row-parallel (all-reduce). The
//! embedding, the norms and the LM head are replicated, so every rank
//! computes the same logits and picks the same token.
//!
//! The weights: element (r, c) of a full matrix is a pure function of the
//! seed, the matrix and (r, c) (a splitmix64 hash, uniform with the stated
//! standard deviation), and each rank generates only its shard's elements.
//! So the model is the same for every W: W=1 gives the reference.
//!
//! Greedy decoding of a fixed prompt, three passes over the same tokens: a
//! recorded pass (logits copied to the host: checksum, top-2 margins; also
//! the warm-up), a timed pass (argmax on the device, only the token read
//! back), and a timing pass in which every all-reduce is bracketed by stream
//! synchronisations so that the host clock measures it alone (see
//! README.md for what that measures).
//!
//! `compare REF.json OTHER.json` checks a run against the reference.
//!
//! Exit codes: 0 ok, 1 a failure or a check that failed, 2 no usable GPU,
//! 3 a layout this build cannot run (NCCL with two ranks on one GPU), 64 a
//! bad argument.

// The one line that picks the communicator (see compat-check/ and
// docs/switching-from-nccl.md).
#[cfg(not(feature = "nccl"))]
use cuda_peer::compat::nccl;
#[cfg(feature = "nccl")]
use cudarc::nccl::safe as nccl;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Device, Layout, Shape, Tensor, D};
use half::bf16;
use nccl::{Comm, Id, ReduceOp};
use serde_json::{json, Value};
use std::cell::Cell;
use std::ffi::c_char;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

type Res<T> = Result<T, String>;

/// Which communicator this binary was built with.
const BUILD: &str = if cfg!(feature = "nccl") { "nccl" } else { "cuda-peer" };

/// The prompt: fixed token ids (taken modulo the vocabulary).
const PROMPT: [u32; 16] = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 1576, 3];

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

// ---------------------------------------------------------------------------
// Arguments

#[derive(Clone, Debug)]
struct Config {
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    intermediate: usize,
    vocab: usize,
    rope_theta: f64,
    eps: f64,
    dtype: DType,
    seed: u64,
    tokens: usize,
}

impl Config {
    fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    fn check(&self, world: usize) -> Res<()> {
        let c = self;
        let bad = |m: String| Err(m);
        if c.layers == 0 || c.hidden == 0 || c.heads == 0 || c.kv_heads == 0 || c.intermediate == 0 || c.vocab == 0 || c.tokens == 0 {
            return bad("every size must be positive".into());
        }
        if c.hidden % c.heads != 0 || c.head_dim() % 2 != 0 {
            return bad(format!("hidden {} must be heads {} times an even head size", c.hidden, c.heads));
        }
        if c.heads % c.kv_heads != 0 {
            return bad(format!("heads {} must be a multiple of kv-heads {}", c.heads, c.kv_heads));
        }
        if c.kv_heads % world != 0 || c.intermediate % world != 0 {
            return bad(format!(
                "world size {world} must divide kv-heads {} (and so heads {}) and intermediate {}",
                c.kv_heads, c.heads, c.intermediate
            ));
        }
        Ok(())
    }

    fn json(&self) -> Value {
        json!({
            "layers": self.layers, "hidden": self.hidden, "heads": self.heads, "kv_heads": self.kv_heads,
            "head_dim": self.head_dim(), "intermediate": self.intermediate, "vocab": self.vocab,
            "rope_theta": self.rope_theta, "rms_eps": self.eps, "dtype": format!("{:?}", self.dtype).to_lowercase(),
            "seed": self.seed, "new_tokens": self.tokens, "prompt_len": PROMPT.len(),
        })
    }
}

struct Args {
    cfg: Config,
    out: Option<PathBuf>,
    id_dir: Option<PathBuf>,
    cpu: bool,
    sim_ranks: usize,
    threads: Option<usize>,
    id_only: bool,
}

const USAGE: &str = "usage: candle_tensor_parallel [--layers N] [--hidden N] [--heads N] [--kv-heads N] [--intermediate N]
       [--vocab N] [--tokens N] [--seed N] [--dtype bf16|f32] [--rope-theta X] [--small]
       [--out PATH.json] [--id-dir DIR] [--threads N] [--cpu [--sim-ranks W]]
       candle_tensor_parallel compare REF.json OTHER.json [--tol X]
Run one process per GPU: cuda-peer-run -n W -- candle_tensor_parallel ... (W=1 without a launcher).
Defaults: 8 layers, hidden 4096, 32 heads, 8 kv heads, intermediate 14336, vocab 32000, bf16, 32 tokens.
--small: 2 layers, hidden 512, 8 heads, 4 kv heads, intermediate 1024, vocab 4096.
--id-only: only rank 0's id passed to the others through the id file (checks a launcher's setup).
--cpu: on the CPU, one process; --sim-ranks W runs W ranks as threads summing on the host (checks the sharding).";

fn parse_args(args: &[String]) -> Res<Args> {
    let mut cfg = Config {
        layers: 8,
        hidden: 4096,
        heads: 32,
        kv_heads: 8,
        intermediate: 14336,
        vocab: 32000,
        rope_theta: 10000.0,
        eps: 1e-5,
        dtype: DType::BF16,
        seed: 0x7e57_5eed,
        tokens: 32,
    };
    let mut a = Args { cfg: cfg.clone(), out: None, id_dir: None, cpu: false, sim_ranks: 1, threads: None, id_only: false };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut val = || it.next().cloned().ok_or_else(|| format!("{flag} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|_| format!("{flag} {v}: not a number"));
        match flag.as_str() {
            "--layers" => cfg.layers = num(val()?)?,
            "--hidden" => cfg.hidden = num(val()?)?,
            "--heads" => cfg.heads = num(val()?)?,
            "--kv-heads" => cfg.kv_heads = num(val()?)?,
            "--intermediate" => cfg.intermediate = num(val()?)?,
            "--vocab" => cfg.vocab = num(val()?)?,
            "--tokens" => cfg.tokens = num(val()?)?,
            "--seed" => cfg.seed = num(val()?)? as u64,
            "--rope-theta" => cfg.rope_theta = val()?.parse().map_err(|_| "--rope-theta: not a number".to_string())?,
            "--dtype" => {
                cfg.dtype = match val()?.as_str() {
                    "bf16" => DType::BF16,
                    "f32" => DType::F32,
                    other => return Err(format!("--dtype {other}: bf16 or f32")),
                }
            }
            "--small" => {
                (cfg.layers, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.intermediate, cfg.vocab) = (2, 512, 8, 4, 1024, 4096);
            }
            "--out" => a.out = Some(PathBuf::from(val()?)),
            "--id-dir" => a.id_dir = Some(PathBuf::from(val()?)),
            "--threads" => a.threads = Some(num(val()?)?.max(1)),
            "--cpu" => a.cpu = true,
            "--id-only" => a.id_only = true,
            "--sim-ranks" => a.sim_ranks = num(val()?)?.max(1),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if a.sim_ranks > 1 && !a.cpu {
        return Err("--sim-ranks needs --cpu".into());
    }
    a.cfg = cfg;
    Ok(a)
}

// ---------------------------------------------------------------------------
// Weights: a pure function of (seed, matrix, row, column)

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// One full matrix of the model: `rows` x `cols` (stored [in, out], so that
/// a layer is `x.matmul(w)`), element (r, c) = `mean + std * u(r, c)`, u
/// uniform on [-sqrt 3, sqrt 3) (unit variance).
struct Full {
    id: u64,
    rows: usize,
    cols: usize,
    mean: f32,
    std: f32,
}

struct Gen<'a> {
    cfg: &'a Config,
    device: &'a Device,
    threads: usize,
    elements: Cell<u64>,
}

impl Gen<'_> {
    /// Rows `rs` and columns `cs` of `m`, as a tensor on the device.
    fn shard(&self, m: &Full, rs: std::ops::Range<usize>, cs: std::ops::Range<usize>) -> Res<Tensor> {
        assert!(rs.end <= m.rows && cs.end <= m.cols);
        let key = splitmix64(self.cfg.seed ^ splitmix64(m.id));
        let (nr, nc) = (rs.len(), cs.len());
        let mut vals = vec![0f32; nr * nc];
        let per = nr.div_ceil(self.threads).max(1);
        let scale = m.std * 3f32.sqrt();
        std::thread::scope(|s| {
            for (t, chunk) in vals.chunks_mut(per * nc).enumerate() {
                let (rs, cs) = (rs.clone(), cs.clone());
                s.spawn(move || {
                    for (i, row) in chunk.chunks_mut(nc).enumerate() {
                        let r = rs.start + t * per + i;
                        for (j, v) in row.iter_mut().enumerate() {
                            let idx = (r * m.cols + cs.start + j) as u64;
                            let h = splitmix64(key.wrapping_add(idx.wrapping_mul(0xD1B5_4A32_D192_ED03)));
                            let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                            *v = m.mean + scale * u;
                        }
                    }
                });
            }
        });
        self.elements.set(self.elements.get() + vals.len() as u64);
        let t = match self.cfg.dtype {
            DType::BF16 => Tensor::from_vec(vals.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(), (nr, nc), self.device),
            _ => Tensor::from_vec(vals, (nr, nc), self.device),
        };
        t.map_err(err("uploading a weight"))
    }
}

struct LayerW {
    attn_norm: Tensor,
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
    wo: Tensor,
    mlp_norm: Tensor,
    wg: Tensor,
    wu: Tensor,
    wd: Tensor,
}

struct Model {
    cfg: Config,
    device: Device,
    /// Query and key/value heads on this rank.
    heads: usize,
    kv_heads: usize,
    embed: Tensor,
    layers: Vec<LayerW>,
    final_norm: Tensor,
    lm_head: Tensor,
    cos: Tensor,
    sin: Tensor,
}

impl Model {
    /// Rank `rank` of `world`'s shard of the model.
    fn new(cfg: &Config, device: &Device, rank: usize, world: usize, threads: usize) -> Res<(Model, u64)> {
        let g = Gen { cfg, device, threads, elements: Cell::new(0) };
        let (h, hd, inter) = (cfg.hidden, cfg.head_dim(), cfg.intermediate);
        let (nh, nkv) = (cfg.heads / world, cfg.kv_heads / world);
        let (q_cols, kv_cols, i_cols) =
            (rank * nh * hd..(rank + 1) * nh * hd, rank * nkv * hd..(rank + 1) * nkv * hd, rank * (inter / world)..(rank + 1) * (inter / world));
        let lin = |id: u64, rows: usize, cols: usize| Full { id, rows, cols, mean: 0.0, std: 1.0 / (rows as f32).sqrt() };
        let norm = |id: u64| Full { id, rows: 1, cols: h, mean: 1.0, std: 0.1 };
        let embed = g.shard(&Full { id: 1, rows: cfg.vocab, cols: h, mean: 0.0, std: 1.0 }, 0..cfg.vocab, 0..h)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers as u64 {
            let id = 16 + 16 * l;
            layers.push(LayerW {
                attn_norm: g.shard(&norm(id), 0..1, 0..h)?,
                wq: g.shard(&lin(id + 1, h, cfg.heads * hd), 0..h, q_cols.clone())?,
                wk: g.shard(&lin(id + 2, h, cfg.kv_heads * hd), 0..h, kv_cols.clone())?,
                wv: g.shard(&lin(id + 3, h, cfg.kv_heads * hd), 0..h, kv_cols.clone())?,
                wo: g.shard(&lin(id + 4, cfg.heads * hd, h), q_cols.clone(), 0..h)?,
                mlp_norm: g.shard(&norm(id + 5), 0..1, 0..h)?,
                wg: g.shard(&lin(id + 6, h, inter), 0..h, i_cols.clone())?,
                wu: g.shard(&lin(id + 7, h, inter), 0..h, i_cols.clone())?,
                wd: g.shard(&lin(id + 8, inter, h), i_cols.clone(), 0..h)?,
            });
        }
        // The final norm and the LM head: the model's (bf16) values, computed in f32,
        // so that the logits are not rounded to bf16 (whose steps, 1/64 at 2 to 4,
        // would make exact ties between the top logits common).
        let f32 = |t: Tensor| t.to_dtype(DType::F32).map_err(err("to f32"));
        let final_norm = f32(g.shard(&norm(2), 0..1, 0..h)?)?;
        let lm_head = f32(g.shard(&lin(3, h, cfg.vocab), 0..h, 0..cfg.vocab)?)?;
        // Rotary tables (the rotate-half form), positions 0..max.
        let max = PROMPT.len() + cfg.tokens + 1;
        let half = hd / 2;
        let mut cos = Vec::with_capacity(max * half);
        let mut sin = Vec::with_capacity(max * half);
        for p in 0..max {
            for i in 0..half {
                let a = p as f64 / cfg.rope_theta.powf(2.0 * i as f64 / hd as f64);
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        let table = |v: Vec<f32>| Tensor::from_vec(v, (max, half), device).and_then(|t| t.to_dtype(cfg.dtype)).map_err(err("rotary table"));
        let (cos, sin) = (table(cos)?, table(sin)?);
        let m = Model { cfg: cfg.clone(), device: device.clone(), heads: nh, kv_heads: nkv, embed, layers, final_norm, lm_head, cos, sin };
        Ok((m, g.elements.get()))
    }
}

// ---------------------------------------------------------------------------
// The all-reduce

/// The sum over the ranks of a row-parallel layer's partial output.
enum Reducer {
    /// One rank: the partial is the whole.
    Alone,
    /// Through the communicator (`compat::nccl` or NCCL), on candle's stream.
    Comm(Comm),
    /// CPU ranks as threads of this process (`--cpu --sim-ranks W`): summed
    /// on the host in rank order.
    Sim(Arc<SimHub>, usize),
}

struct SimHub {
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

/// What the timing pass measures: the host time between a stream
/// synchronisation before each all-reduce and one after it.
#[derive(Default)]
struct Timing {
    on: Cell<bool>,
    calls: Cell<u64>,
    time: Cell<Duration>,
    bytes: Cell<u64>,
}

/// candle's custom op around `all_reduce`: a new buffer holds the sum of
/// every rank's `send` (as candle's `llama_multiprocess` example does it).
struct AllReduceSum<'a>(&'a Comm);

impl AllReduceSum<'_> {
    fn reduce<
        T: candle_core::cuda_backend::CudaDType + nccl::NcclType + cuda_peer::cudarc::driver::DeviceRepr + cuda_peer::cudarc::driver::ValidAsZeroBits,
    >(
        &self,
        s: &CudaStorage,
        start: usize,
        end: usize,
    ) -> candle_core::Result<CudaStorage> {
        let send = s.as_cuda_slice::<T>()?.slice(start..end);
        let mut recv = s.device.cuda_stream().alloc_zeros::<T>(end - start).map_err(candle_core::Error::wrap)?;
        self.0.all_reduce(&send, &mut recv, &ReduceOp::Sum).map_err(|e| candle_core::Error::Msg(format!("all_reduce: {:?}", e.0)))?;
        Ok(CudaStorage::wrap_cuda_slice(recv, s.device.clone()))
    }
}

impl CustomOp1 for AllReduceSum<'_> {
    fn name(&self) -> &'static str {
        "all-reduce-sum"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        candle_core::bail!("all-reduce-sum: a tensor on the CPU")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let Some((start, end)) = l.contiguous_offsets() else { candle_core::bail!("all-reduce-sum: a tensor that is not contiguous") };
        let out = match s.dtype() {
            DType::BF16 => self.reduce::<bf16>(s, start, end)?,
            DType::F32 => self.reduce::<f32>(s, start, end)?,
            dt => candle_core::bail!("all-reduce-sum: {dt:?}"),
        };
        Ok((out, l.shape().clone()))
    }
}

impl Reducer {
    fn sum(&self, x: &Tensor, timing: &Timing) -> candle_core::Result<Tensor> {
        match self {
            Reducer::Alone => Ok(x.clone()),
            Reducer::Sim(hub, rank) => {
                hub.slots.lock().unwrap()[*rank] = Some(x.clone());
                hub.barrier.wait();
                let parts: Vec<Tensor> = hub.slots.lock().unwrap().iter().map(|t| t.clone().unwrap()).collect();
                hub.barrier.wait();
                let mut acc = parts[0].clone();
                for p in &parts[1..] {
                    acc = (acc + p)?;
                }
                Ok(acc)
            }
            Reducer::Comm(comm) => {
                let x = x.contiguous()?;
                if !timing.on.get() {
                    return x.apply_op1_no_bwd(&AllReduceSum(comm));
                }
                x.device().synchronize()?;
                let t0 = Instant::now();
                let y = x.apply_op1_no_bwd(&AllReduceSum(comm))?;
                y.device().synchronize()?;
                timing.time.set(timing.time.get() + t0.elapsed());
                timing.calls.set(timing.calls.get() + 1);
                timing.bytes.set(timing.bytes.get() + (x.elem_count() * x.dtype().size_in_bytes()) as u64);
                Ok(y)
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The forward pass

fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> candle_core::Result<Tensor> {
    let dt = x.dtype();
    let xf = x.to_dtype(DType::F32)?;
    let rms = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    xf.broadcast_div(&rms)?.to_dtype(dt)?.broadcast_mul(w)
}

/// Rotary embedding (rotate-half) of `x` [t, heads, head_dim] at positions
/// whose tables are `cos`, `sin` [t, head_dim / 2].
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
    let (t, _, hd) = x.dims3()?;
    let (cos, sin) = (cos.reshape((t, 1, hd / 2))?, sin.reshape((t, 1, hd / 2))?);
    let x1 = x.narrow(D::Minus1, 0, hd / 2)?;
    let x2 = x.narrow(D::Minus1, hd / 2, hd / 2)?;
    let a = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let b = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[a, b], D::Minus1)
}

fn softmax_last(x: &Tensor) -> candle_core::Result<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Per layer: keys and values so far, [kv_heads, positions, head_dim].
type Cache = Vec<Option<(Tensor, Tensor)>>;

impl Model {
    /// The logits (f32, [vocab]) after `ids` at positions `pos..`, the
    /// cache extended with them.
    fn forward(&self, ids: &[u32], pos: usize, cache: &mut Cache, red: &Reducer, timing: &Timing) -> candle_core::Result<Tensor> {
        let c = &self.cfg;
        let (t, hd, nh, nkv) = (ids.len(), c.head_dim(), self.heads, self.kv_heads);
        let group = nh / nkv;
        let ids_t = Tensor::new(ids, &self.device)?;
        let mut x = self.embed.index_select(&ids_t, 0)?; // [t, hidden]
        let cos = self.cos.narrow(0, pos, t)?;
        let sin = self.sin.narrow(0, pos, t)?;
        let positions = pos + t;
        let mask = if t > 1 {
            let m: Vec<f32> = (0..t).flat_map(|i| (0..positions).map(move |j| if j > pos + i { f32::NEG_INFINITY } else { 0.0 })).collect();
            Some(Tensor::from_vec(m, (1, t, positions), &self.device)?)
        } else {
            None
        };
        let scale = 1.0 / (hd as f64).sqrt();
        for (l, w) in self.layers.iter().enumerate() {
            let h = rms_norm(&x, &w.attn_norm, c.eps)?;
            let q = h.matmul(&w.wq)?.reshape((t, nh, hd))?;
            let k = h.matmul(&w.wk)?.reshape((t, nkv, hd))?;
            let v = h.matmul(&w.wv)?.reshape((t, nkv, hd))?;
            let q = rope(&q, &cos, &sin)?.transpose(0, 1)?.contiguous()?; // [nh, t, hd]
            let k = rope(&k, &cos, &sin)?.transpose(0, 1)?.contiguous()?; // [nkv, t, hd]
            let v = v.transpose(0, 1)?.contiguous()?;
            let (k, v) = match cache[l].take() {
                Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 1)?, Tensor::cat(&[&pv, &v], 1)?),
                None => (k, v),
            };
            cache[l] = Some((k.clone(), v.clone()));
            // Grouped-query attention: each key/value head serves `group` query heads.
            let (k, v) = if group > 1 {
                let expand = |x: &Tensor| x.unsqueeze(1)?.expand((nkv, group, positions, hd))?.reshape((nh, positions, hd));
                (expand(&k)?, expand(&v)?)
            } else {
                (k, v)
            };
            let att = (q.matmul(&k.t()?)? * scale)?.to_dtype(DType::F32)?; // [nh, t, positions]
            let att = match &mask {
                Some(m) => att.broadcast_add(m)?,
                None => att,
            };
            let att = softmax_last(&att)?.to_dtype(c.dtype)?;
            let o = att.matmul(&v)?.transpose(0, 1)?.reshape((t, nh * hd))?;
            // o_proj, row-parallel: this rank's heads' share of the sum.
            let part = o.matmul(&w.wo)?;
            x = (x + red.sum(&part, timing)?)?;
            let h = rms_norm(&x, &w.mlp_norm, c.eps)?;
            let gated = (h.matmul(&w.wg)?.silu()? * h.matmul(&w.wu)?)?;
            // down, row-parallel: this rank's columns' share of the sum.
            let part = gated.matmul(&w.wd)?;
            x = (x + red.sum(&part, timing)?)?;
        }
        let h = rms_norm(&x.narrow(0, t - 1, 1)?.to_dtype(DType::F32)?, &self.final_norm, c.eps)?;
        h.matmul(&self.lm_head)?.squeeze(0)
    }
}

// ---------------------------------------------------------------------------
// Decoding

/// What the recorded pass gives.
struct Record {
    tokens: Vec<u32>,
    /// Sum and sum of absolute values of every step's logits.
    checksum: f64,
    abs_checksum: f64,
    /// Top-1 minus top-2 logit at each step.
    margins: Vec<f32>,
    /// The first step's (the prompt's) logits: every `vocab / 256`-th one.
    first_sample: Vec<f32>,
    first_std: f64,
}

fn prompt(cfg: &Config) -> Vec<u32> {
    PROMPT.iter().map(|&t| t % cfg.vocab as u32).collect()
}

/// Greedy decoding of `cfg.tokens` tokens. `record`: logits to the host each
/// step; else the argmax on the device and only the token read back.
/// Returns the tokens, the record if asked, the prefill's and the decode
/// steps' wall time.
fn decode(m: &Model, red: &Reducer, timing: &Timing, record: bool) -> candle_core::Result<(Vec<u32>, Option<Record>, Duration, Duration)> {
    let mut cache: Cache = vec![None; m.cfg.layers];
    let mut input = prompt(&m.cfg);
    let mut pos = 0;
    let mut tokens = Vec::with_capacity(m.cfg.tokens);
    let mut rec = Record { tokens: vec![], checksum: 0.0, abs_checksum: 0.0, margins: vec![], first_sample: vec![], first_std: 0.0 };
    m.device.synchronize()?;
    let t0 = Instant::now();
    let mut prefill = Duration::ZERO;
    for step in 0..m.cfg.tokens {
        let logits = m.forward(&input, pos, &mut cache, red, timing)?;
        pos += input.len();
        let next = if record {
            let v = logits.to_vec1::<f32>()?;
            let (mut best, mut second, mut arg) = (f32::NEG_INFINITY, f32::NEG_INFINITY, 0u32);
            for (i, &x) in v.iter().enumerate() {
                rec.checksum += x as f64;
                rec.abs_checksum += x.abs() as f64;
                if x > best {
                    (second, best, arg) = (best, x, i as u32);
                } else if x > second {
                    second = x;
                }
            }
            rec.margins.push(best - second);
            if step == 0 {
                let stride = (v.len() / 256).max(1);
                rec.first_sample = v.iter().step_by(stride).copied().collect();
                let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
                rec.first_std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
            }
            arg
        } else {
            logits.argmax(0)?.to_scalar::<u32>()?
        };
        if step == 0 {
            prefill = t0.elapsed();
            // The timing pass counts the decode steps only.
            timing.calls.set(0);
            timing.time.set(Duration::ZERO);
            timing.bytes.set(0);
        }
        tokens.push(next);
        input = vec![next];
    }
    let total = t0.elapsed();
    rec.tokens = tokens.clone();
    Ok((tokens, record.then_some(rec), prefill, total - prefill))
}

// ---------------------------------------------------------------------------
// Ranks, the id, the communicator

struct Place {
    rank: usize,
    world: usize,
    local_rank: usize,
    local_world: usize,
}

fn env_usize(name: &str) -> Res<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| format!("{name}={v}: not a number")),
        Err(_) => Ok(None),
    }
}

/// torchrun's variables, as cuda-peer-run sets them; one rank without them.
fn place() -> Res<Place> {
    let rank = env_usize("RANK")?.unwrap_or(0);
    let world = env_usize("WORLD_SIZE")?.unwrap_or(1);
    let local_rank = env_usize("LOCAL_RANK")?.unwrap_or(rank);
    let local_world = env_usize("LOCAL_WORLD_SIZE")?.unwrap_or(world);
    if world == 0 || rank >= world {
        return Err(format!("RANK {rank} of WORLD_SIZE {world}"));
    }
    Ok(Place { rank, world, local_rank, local_world })
}

/// This user's id (the owner of /proc/self).
fn my_uid() -> Res<u32> {
    Ok(std::fs::metadata("/proc/self").map_err(err("/proc/self"))?.uid())
}

/// A directory only this user can use: made 0700 if missing; refused if it
/// is a link, not ours, or open to others.
fn private_dir(dir: &Path) -> Res<()> {
    if let Err(e) = std::fs::DirBuilder::new().mode(0o700).create(dir) {
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            return Err(format!("{}: {e}", dir.display()));
        }
    }
    let md = std::fs::symlink_metadata(dir).map_err(err("id directory"))?;
    if !md.is_dir() || md.uid() != my_uid()? || md.mode() & 0o077 != 0 {
        return Err(format!("{}: not a directory of this user's with mode 0700 (owner {}, mode {:o})", dir.display(), md.uid(), md.mode() & 0o7777));
    }
    Ok(())
}

/// FNV-1a, for a file name that tells jobs apart.
fn fnv64(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// Where rank 0 leaves the id for the others: `--id-dir`, else
/// `CANDLE_TP_ID_DIR`, else `$XDG_RUNTIME_DIR/candle_tensor_parallel`, else
/// `/tmp/candle_tensor_parallel-<uid>`; the file's name is a hash of the
/// job's rendezvous and secret (MASTER_ADDR, MASTER_PORT,
/// CUDA_PEER_JOB_SECRET: what cuda-peer-run gives every rank of one job).
fn id_file(arg: Option<&Path>) -> Res<PathBuf> {
    let dir = match (arg, std::env::var_os("CANDLE_TP_ID_DIR"), std::env::var_os("XDG_RUNTIME_DIR")) {
        (Some(d), _, _) => d.to_path_buf(),
        (None, Some(d), _) => PathBuf::from(d),
        (None, None, Some(x)) => PathBuf::from(x).join("candle_tensor_parallel"),
        (None, None, None) => std::env::temp_dir().join(format!("candle_tensor_parallel-{}", my_uid()?)),
    };
    private_dir(&dir)?;
    let port = std::env::var("MASTER_PORT").map_err(|_| "no MASTER_PORT: start the ranks with cuda-peer-run (or torchrun)".to_string())?;
    let job = format!("{}:{port}:{}", std::env::var("MASTER_ADDR").unwrap_or_default(), std::env::var("CUDA_PEER_JOB_SECRET").unwrap_or_default());
    Ok(dir.join(format!("id-{:016x}", fnv64(&job))))
}

/// Rank 0 makes the id and writes its 128 bytes (a 0600 file, written aside
/// and renamed); the others wait for it (120 s) and check it is this user's
/// and private before reading it.
fn exchange_id(rank: usize, file: &Path) -> Res<Id> {
    if rank == 0 {
        let id = Id::new().map_err(|e| format!("Id::new: {:?}", e.0))?;
        let bytes: Vec<u8> = id.internal().iter().map(|c| c.to_ne_bytes()[0]).collect();
        let aside = file.with_extension(format!("tmp{}", std::process::id()));
        let _ = std::fs::remove_file(file);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&aside).map_err(err("id file"))?;
        std::io::Write::write_all(&mut f, &bytes).map_err(err("id file"))?;
        drop(f);
        std::fs::rename(&aside, file).map_err(err("id file"))?;
        return Ok(id);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Ok(md) = std::fs::symlink_metadata(file) {
            if !md.is_file() || md.uid() != my_uid()? || md.permissions().mode() & 0o077 != 0 || md.len() != 128 {
                return Err(format!("{}: not a private 128-byte file of this user's", file.display()));
            }
            let bytes = std::fs::read(file).map_err(err("id file"))?;
            let internal: [c_char; 128] = std::array::from_fn(|i| c_char::from_ne_bytes([bytes[i]]));
            return Ok(Id::uninit(internal));
        }
        if Instant::now() > deadline {
            return Err(format!("{}: rank 0 wrote no id in 120 s", file.display()));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The communicator of rank `rank` on `stream`; `share`: other ranks of this
/// host are on the same GPU.
#[cfg(not(feature = "nccl"))]
fn new_comm(stream: Arc<cuda_peer::cudarc::driver::CudaStream>, rank: usize, world: usize, id: Id, share: bool) -> Res<Comm> {
    if !share {
        return Comm::from_rank(stream, rank, world, id).map_err(|e| format!("Comm::from_rank: {:?}", e.0));
    }
    // compat::nccl::Comm::from_rank takes no options: the cuda-peer communicator
    // underneath, made with share_devices, wrapped.
    let id = cuda_peer::Id::try_from(id).map_err(|e| format!("{:?}", e.0))?;
    let opts = cuda_peer::CommOptions::default().share_devices(true);
    cuda_peer::Comm::from_rank_with(stream, rank, world, id, &opts).map(Comm::from).map_err(|e| format!("Comm::from_rank_with: {e:?}"))
}

#[cfg(feature = "nccl")]
fn new_comm(stream: Arc<cudarc::driver::CudaStream>, rank: usize, world: usize, id: Id, share: bool) -> Res<Comm> {
    if share {
        return Err("NCCL cannot run two ranks on one GPU: needs a GPU per rank".into());
    }
    Comm::from_rank(stream, rank, world, id).map_err(|e| format!("Comm::from_rank: {:?}", e.0))
}

/// Every rank's `vals` agree: the Max all-reduce of (v, !v) is (max, !min).
fn ranks_agree(comm: &Comm, device: &Device, vals: &[u64]) -> Res<bool> {
    let stream = device.as_cuda_device().map_err(err("device"))?.cuda_stream();
    let mine: Vec<u64> = vals.iter().flat_map(|&v| [v, !v]).collect();
    let send = stream.clone_htod(&mine).map_err(err("htod"))?;
    let mut recv = stream.alloc_zeros::<u64>(mine.len()).map_err(err("alloc"))?;
    comm.all_reduce(&send, &mut recv, &ReduceOp::Max).map_err(|e| format!("all_reduce: {:?}", e.0))?;
    let got = stream.clone_dtoh(&recv).map_err(err("dtoh"))?;
    Ok(got == mine)
}

fn hash_tokens(t: &[u32]) -> u64 {
    t.iter().fold(0x5eed, |h, &x| splitmix64(h ^ x as u64))
}

// ---------------------------------------------------------------------------
// One rank's run

struct Outcome {
    record: Record,
    gen_s: f64,
    gen_elements: u64,
    prefill: Duration,
    decode: Duration,
    synced_decode: Duration,
    timing: Timing,
    tokens_match_passes: bool,
}

fn run_rank(cfg: &Config, device: &Device, rank: usize, world: usize, threads: usize, red: &Reducer) -> Res<Outcome> {
    let t0 = Instant::now();
    let (model, gen_elements) = Model::new(cfg, device, rank, world, threads)?;
    device.synchronize().map_err(err("synchronize"))?;
    let gen_s = t0.elapsed().as_secs_f64();
    let ce = |e: candle_core::Error| format!("rank {rank}: {e}");
    let none = Timing::default();
    let (_, record, _, _) = decode(&model, red, &none, true).map_err(ce)?;
    let record = record.unwrap();
    let (timed, _, prefill, dec) = decode(&model, red, &none, false).map_err(ce)?;
    let timing = Timing::default();
    timing.on.set(true);
    let (synced, _, _, synced_decode) = decode(&model, red, &timing, false).map_err(ce)?;
    let tokens_match_passes = timed == record.tokens && synced == record.tokens;
    Ok(Outcome { record, gen_s, gen_elements, prefill, decode: dec, synced_decode, timing, tokens_match_passes })
}

/// The result line and JSON of rank 0.
fn report(cfg: &Config, a: &Args, p: &Place, backend: &str, devices: usize, o: &Outcome, ranks_agree: bool) -> Res<Value> {
    let steps = (cfg.tokens - 1).max(1) as f64;
    let ms_tok = o.decode.as_secs_f64() * 1e3 / steps;
    let synced_ms_tok = o.synced_decode.as_secs_f64() * 1e3 / steps;
    let total_synced = o.synced_decode.as_secs_f64();
    // The timing pass's all-reduce time, over its decode steps (the prefill's excluded).
    let calls = o.timing.calls.get();
    let ar_s = o.timing.time.get().as_secs_f64();
    let per_call_us = if calls > 0 { ar_s * 1e6 / calls as f64 } else { 0.0 };
    let share = if total_synced > 0.0 { ar_s / total_synced } else { 0.0 };
    let r = &o.record;
    println!(
        "candle_tensor_parallel: build={BUILD} backend={backend} world={} devices={devices} dtype={:?} tokens={:?} logits_checksum={:.6e} abs={:.6e} \
         tokens/s={:.1} ms/token={:.3} prefill_ms={:.2} allreduce_share={:.1}% (timing pass: {:.3} ms/token, {} calls, {:.1} us/call) ranks_agree={ranks_agree}",
        p.world,
        cfg.dtype,
        r.tokens,
        r.checksum,
        r.abs_checksum,
        1e3 / ms_tok,
        ms_tok,
        o.prefill.as_secs_f64() * 1e3,
        100.0 * share,
        synced_ms_tok,
        calls,
        per_call_us,
    );
    let v = json!({
        "build": BUILD,
        "backend": backend,
        "world_size": p.world,
        "local_world_size": p.local_world,
        "devices": devices,
        "cpu": a.cpu,
        "config": cfg.json(),
        "weights": "element (r, c) of each full matrix = splitmix64 hash of (seed, matrix, r, c): each rank generates its shard, the same model for every W",
        "prompt": prompt(cfg),
        "tokens": r.tokens,
        "logits_checksum": r.checksum,
        "logits_abs_checksum": r.abs_checksum,
        "top2_margins": r.margins,
        "first_logits_sample": r.first_sample,
        "first_logits_std": r.first_std,
        "weight_gen_s": o.gen_s,
        "weight_elements_this_rank": o.gen_elements,
        "prefill_ms": o.prefill.as_secs_f64() * 1e3,
        "decode_ms_per_token": ms_tok,
        "tokens_per_s": 1e3 / ms_tok,
        "timing_pass": {
            "what": "every all_reduce bracketed by stream synchronisations (device idle before, result complete after); host clock; includes waiting for the slower rank",
            "decode_ms_per_token": synced_ms_tok,
            "allreduce_calls": calls,
            "allreduce_us_per_call": per_call_us,
            "allreduce_ms_per_token": ar_s * 1e3 / steps,
            "allreduce_bytes_per_call": if calls > 0 { o.timing.bytes.get() / calls } else { 0 },
            "allreduce_share_of_decode": share,
        },
        "tokens_same_in_all_passes": o.tokens_match_passes,
        "ranks_agree": ranks_agree,
    });
    if let Some(out) = &a.out {
        if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(err("--out"))?;
        }
        std::fs::write(out, serde_json::to_string_pretty(&v).unwrap() + "\n").map_err(err("--out"))?;
    }
    Ok(v)
}

fn threads_for(a: &Args, local_world: usize) -> usize {
    a.threads.unwrap_or_else(|| (std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) / local_world.max(1)).max(1))
}

/// Exit code and message.
type Fail = (i32, String);

/// `--id-only`: the id's exchange alone (no GPU needed for the cuda-peer
/// build's `Id::new`), to check a launcher's setup.
fn main_id_only(a: &Args) -> Result<bool, Fail> {
    let p = place().map_err(|e| (64, e))?;
    let file = id_file(a.id_dir.as_deref()).map_err(|e| (1, e))?;
    let id = exchange_id(p.rank, &file).map_err(|e| (1, e))?;
    let sum: u64 = id.internal().iter().map(|&c| c.to_ne_bytes()[0] as u64).sum();
    println!("candle_tensor_parallel: rank {} of {}: id via {} (byte sum {sum})", p.rank, p.world, file.display());
    if p.rank == 0 {
        // No communicator says when the others have read it: give them 2 s.
        std::thread::sleep(Duration::from_secs(2));
        let _ = std::fs::remove_file(&file);
    }
    Ok(true)
}

fn main_gpu(a: &Args) -> Result<bool, Fail> {
    let p = place().map_err(|e| (64, e))?;
    a.cfg.check(p.world).map_err(|e| (64, e))?;
    let devices = match cuda_peer::driver::device_count() {
        Ok(0) => return Err((2, "no usable CUDA device: none found".into())),
        Err(e) => return Err((2, format!("no usable CUDA device: {e}"))),
        Ok(n) => n,
    };
    let ordinal = p.local_rank % devices;
    let share = p.local_world > devices;
    if share && cfg!(feature = "nccl") {
        return Err((3, format!("{} ranks on {devices} GPU(s): NCCL needs a GPU per rank (the cuda-peer build shares them)", p.local_world)));
    }
    let device = Device::new_cuda_with_stream(ordinal).map_err(|e| (2, format!("device {ordinal}: {e}")))?;
    let (red, backend) = if p.world == 1 {
        (Reducer::Alone, "none")
    } else {
        let file = id_file(a.id_dir.as_deref()).map_err(|e| (1, e))?;
        let id = exchange_id(p.rank, &file).map_err(|e| (1, e))?;
        let stream = device.as_cuda_device().map_err(|e| (1, e.to_string()))?.cuda_stream();
        let comm = new_comm(stream, p.rank, p.world, id, share).map_err(|e| (1, format!("rank {}: {e}", p.rank)));
        if p.rank == 0 {
            let _ = std::fs::remove_file(&file); // every rank has joined (or failed)
        }
        (Reducer::Comm(comm?), BUILD)
    };
    let o = run_rank(&a.cfg, &device, p.rank, p.world, threads_for(a, p.local_world), &red).map_err(|e| (1, e))?;
    let agree = match &red {
        Reducer::Comm(comm) => ranks_agree(comm, &device, &[hash_tokens(&o.record.tokens), o.record.checksum.to_bits()]).map_err(|e| (1, e))?,
        _ => true,
    };
    if p.rank == 0 {
        report(&a.cfg, a, &p, backend, devices, &o, agree).map_err(|e| (1, e))?;
    } else if !agree {
        eprintln!("candle_tensor_parallel: rank {}: the ranks' tokens or logits differ", p.rank);
    }
    Ok(agree && o.tokens_match_passes)
}

fn main_cpu(a: &Args) -> Result<bool, Fail> {
    let w = a.sim_ranks;
    a.cfg.check(w).map_err(|e| (64, e))?;
    let threads = threads_for(a, w);
    let outcomes: Vec<Res<Outcome>> = if w == 1 {
        vec![run_rank(&a.cfg, &Device::Cpu, 0, 1, threads, &Reducer::Alone)]
    } else {
        let hub = Arc::new(SimHub { slots: Mutex::new(vec![None; w]), barrier: Barrier::new(w) });
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..w)
                .map(|r| {
                    let hub = hub.clone();
                    s.spawn(move || run_rank(&a.cfg, &Device::Cpu, r, w, threads, &Reducer::Sim(hub, r)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("a rank's thread panicked".into()))).collect()
        })
    };
    let outcomes = outcomes.into_iter().collect::<Res<Vec<_>>>().map_err(|e| (1, e))?;
    let agree = outcomes.iter().all(|o| o.record.tokens == outcomes[0].record.tokens && o.record.checksum == outcomes[0].record.checksum);
    let p = Place { rank: 0, world: w, local_rank: 0, local_world: w };
    let backend = if w == 1 { "none" } else { "cpu-threads" };
    report(&a.cfg, a, &p, backend, 0, &outcomes[0], agree).map_err(|e| (1, e))?;
    Ok(agree && outcomes[0].tokens_match_passes)
}

// ---------------------------------------------------------------------------
// compare

fn compare(args: &[String]) -> Result<bool, Fail> {
    let usage = || (64, "usage: candle_tensor_parallel compare REF.json OTHER.json [--tol X]".to_string());
    let (r, o) = match args {
        [r, o, ..] => (r, o),
        _ => return Err(usage()),
    };
    let tol_arg = match &args[2..] {
        [] => None,
        [f, t] if f == "--tol" => Some(t.parse::<f64>().map_err(|_| usage())?),
        _ => return Err(usage()),
    };
    let load = |p: &String| -> Result<Value, Fail> {
        let s = std::fs::read_to_string(p).map_err(|e| (1, format!("{p}: {e}")))?;
        serde_json::from_str(&s).map_err(|e| (1, format!("{p}: {e}")))
    };
    let (r, o) = (load(r)?, load(o)?);
    if r["config"] != o["config"] {
        return Err((1, format!("different models: {} vs {}", r["config"], o["config"])));
    }
    let f32s = |v: &Value| -> Vec<f64> { v.as_array().map(|a| a.iter().filter_map(Value::as_f64).collect()).unwrap_or_default() };
    let u32s = |v: &Value| -> Vec<u64> { v.as_array().map(|a| a.iter().filter_map(Value::as_u64).collect()).unwrap_or_default() };
    // The tolerance on a logit, in units of the reference's logit standard
    // deviation: bf16 keeps 8 significant bits, and a sum split over the ranks
    // rounds each part (and the residual stream after it) differently.
    let std = r["first_logits_std"].as_f64().unwrap_or(1.0);
    let bf16 = r["config"]["dtype"] == "bf16";
    let tol = tol_arg.unwrap_or(if bf16 { 0.1 } else { 1e-3 }) * std;
    let (rs, os) = (f32s(&r["first_logits_sample"]), f32s(&o["first_logits_sample"]));
    let max_diff = rs.iter().zip(&os).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    let logits_ok = rs.len() == os.len() && !rs.is_empty() && max_diff <= tol;
    let (rt, ot) = (u32s(&r["tokens"]), u32s(&o["tokens"]));
    let margins = f32s(&r["top2_margins"]);
    let first_diff = rt.iter().zip(&ot).position(|(a, b)| a != b);
    let tokens_ok = match first_diff {
        None => rt.len() == ot.len(),
        // A flip where the reference's top two logits are closer than the
        // tolerance is a near-tie: the rest of the sequences differ after it.
        Some(k) => margins.get(k).is_some_and(|&m| m <= tol),
    };
    println!(
        "compare: {} (W={}) vs {} (W={}): first-step logits max |diff| {:.4} (tolerance {:.4} = {} x logit std {:.4}): {}; tokens: {}",
        r["backend"],
        r["world_size"],
        o["backend"],
        o["world_size"],
        max_diff,
        tol,
        tol / std,
        std,
        if logits_ok { "ok" } else { "OUT OF TOLERANCE" },
        match first_diff {
            None if tokens_ok => "identical".to_string(),
            None => "different lengths".to_string(),
            Some(k) => format!(
                "first differ at step {k} ({} vs {}), reference top-2 margin there {:.4}: {}",
                rt[k],
                ot[k],
                margins.get(k).copied().unwrap_or(f64::NAN),
                if tokens_ok { "a near-tie, allowed" } else { "NOT a near-tie" }
            ),
        }
    );
    Ok(logits_ok && tokens_ok)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let r = if args.first().map(String::as_str) == Some("compare") {
        compare(&args[1..])
    } else {
        match parse_args(&args) {
            Err(e) => Err((64, e)),
            Ok(a) if a.cpu => main_cpu(&a),
            Ok(a) if a.id_only => main_id_only(&a),
            Ok(a) => main_gpu(&a),
        }
    };
    match r {
        Ok(true) => {}
        Ok(false) => {
            eprintln!("candle_tensor_parallel: FAILED");
            std::process::exit(1);
        }
        Err((code, e)) => {
            eprintln!("candle_tensor_parallel: {e}");
            std::process::exit(code);
        }
    }
}
