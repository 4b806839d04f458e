//! The call pattern of mistral.rs's distributed module and of candle's
//! `llama_multiprocess` example (their public shape, written anew here),
//! compiled against `cuda_peer::compat::nccl` by default and against
//! `cudarc::nccl` with `--features cudarc-nccl`: the two builds differ in
//! the one `use` line below, the diff docs/switching-from-nccl.md shows. CI
//! type-checks both (`cargo check`); nothing runs it there.
//!
//! Run by hand (one process per GPU): `RANK=r WORLD_SIZE=n compat-check`,
//! every rank with the same `COMPAT_CHECK_ID_FILE` (rank 0 writes the id
//! there, the others wait for it).

#[cfg(not(feature = "cudarc-nccl"))]
use cuda_peer::compat::nccl::safe::{Comm, Id, NcclType, ReduceOp};
#[cfg(feature = "cudarc-nccl")]
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp};

use cuda_peer::cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Errors as the frameworks report them: the communicator's through `e.0`.
type Result<T> = std::result::Result<T, String>;

/// Rank 0 makes the id and publishes its bytes in `file` (written aside,
/// then renamed, so no rank reads half of it); the other ranks wait for the
/// file and rebuild the id from its bytes.
fn exchange_id(rank: usize, file: &Path) -> Result<Id> {
    if rank == 0 {
        let id = Id::new().map_err(|e| format!("Id::new: {:?}", e.0))?;
        let bytes: Vec<u8> = id.internal().iter().map(|c| c.to_ne_bytes()[0]).collect();
        let aside = file.with_extension("tmp");
        std::fs::write(&aside, &bytes).map_err(|e| format!("{}: {e}", aside.display()))?;
        std::fs::rename(&aside, file).map_err(|e| format!("{}: {e}", file.display()))?;
        return Ok(id);
    }
    while !file.exists() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let bytes = std::fs::read(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let internal: [c_char; 128] = bytes
        .iter()
        .map(|&b| c_char::from_ne_bytes([b]))
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|v: Vec<c_char>| format!("{}: {} bytes, an id has 128", file.display(), v.len()))?;
    Ok(Id::uninit(internal))
}

/// One rank's device stream and communicator (candle's example keeps the
/// communicator in an `Rc`, shared by the layers that reduce).
fn join(rank: usize, world_size: usize, id_file: &Path) -> Result<(Arc<CudaStream>, Rc<Comm>)> {
    let id = exchange_id(rank, id_file)?;
    let ctx = CudaContext::new(rank).map_err(|e| format!("device {rank}: {e:?}"))?;
    let stream = ctx.default_stream();
    let comm = match Comm::from_rank(stream.clone(), rank, world_size, id) {
        Ok(comm) => Rc::new(comm),
        Err(e) => return Err(format!("rank {rank}: communicator: {:?}", e.0)),
    };
    Ok((stream, comm))
}

/// The row-parallel layer's sum over the ranks (mistral.rs's `AllReduce`
/// op): a new buffer holds the sum of every rank's part.
struct SumAllReduce {
    comm: Rc<Comm>,
    stream: Arc<CudaStream>,
}

impl SumAllReduce {
    fn bf16(&self, part: &CudaView<'_, bf16>) -> Result<CudaSlice<bf16>> {
        let mut sum = self.stream.alloc_zeros::<bf16>(part.len()).map_err(|e| format!("{e:?}"))?;
        self.comm.all_reduce(part, &mut sum, &ReduceOp::Sum).map_err(|e| format!("all_reduce: {:?}", e.0))?;
        Ok(sum)
    }

    fn f32(&self, part: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let mut sum = self.stream.alloc_zeros::<f32>(part.len()).map_err(|e| format!("{e:?}"))?;
        self.comm.all_reduce(part, &mut sum, &ReduceOp::Sum).map_err(|e| format!("all_reduce: {:?}", e.0))?;
        Ok(sum)
    }
}

/// The column-parallel layer's gather (mistral.rs's `AllGather` op): every
/// rank's part, in rank order.
fn all_gather<T: NcclType + DeviceRepr + ValidAsZeroBits>(comm: &Comm, stream: &Arc<CudaStream>, part: &CudaSlice<T>) -> Result<CudaSlice<T>> {
    let mut all = stream.alloc_zeros::<T>(part.len() * comm.world_size()).map_err(|e| format!("{e:?}"))?;
    comm.all_gather(part, &mut all).map_err(|e| format!("all_gather: {:?}", e.0))?;
    Ok(all)
}

/// Rank 0's weights on every rank.
fn broadcast_from_rank0(comm: &Comm, weights: &mut CudaSlice<f32>) -> Result<()> {
    let send = if comm.rank() == 0 { Some(weights.clone()) } else { None };
    let sent = comm.broadcast(send.as_ref(), weights, 0);
    comparable(&sent);
    sent.map_err(|e| format!("broadcast: {:?}", e.0))?;
    Ok(())
}

/// Code that keeps errors in an `enum` deriving `PartialEq, Eq` (or compares
/// them) needs cudarc's traits on the error and status types: both builds
/// must have them.
fn comparable<T: Eq + Clone, E: Eq + Clone + std::fmt::Debug>(_: &std::result::Result<T, E>) {}

/// A pipeline stage's exchange (cubecl's and pipeline parallelism's
/// send/recv): each rank sends its part to the next rank and receives the
/// previous rank's, in one group (cudarc's `Comm::group`, views by value).
fn ring_shift(comm: &Comm, stream: &Arc<CudaStream>, part: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
    let (rank, n) = (comm.rank() as i32, comm.world_size() as i32);
    let mut from_prev = stream.alloc_zeros::<f32>(part.len()).map_err(|e| format!("{e:?}"))?;
    {
        let mut group = comm.group();
        group.send(part.slice(..), (rank + 1) % n).map_err(|e| format!("send: {:?}", e.0))?;
        group.recv(from_prev.slice_mut(..), (rank + n - 1) % n).map_err(|e| format!("recv: {:?}", e.0))?;
    }
    Ok(from_prev)
}

fn run(rank: usize, world_size: usize, id_file: &Path) -> Result<()> {
    let (stream, comm) = join(rank, world_size, id_file)?;
    let (rank, world_size) = (comm.rank(), comm.world_size());
    let n = 1 << 16;
    let op = SumAllReduce { comm: comm.clone(), stream: stream.clone() };

    let mut weights = stream.clone_htod(&vec![rank as f32; n]).map_err(|e| format!("{e:?}"))?;
    broadcast_from_rank0(&comm, &mut weights)?;
    let sum = op.f32(&weights)?;
    let halves = stream.clone_htod(&vec![bf16::from_f32(1.0); 2 * n]).map_err(|e| format!("{e:?}"))?;
    let sum_bf16 = op.bf16(&halves.slice(n..))?;
    let gathered = all_gather(&comm, &stream, &sum_bf16)?;
    let mine = stream.clone_htod(&vec![rank as f32 + 1.0; n]).map_err(|e| format!("{e:?}"))?;
    let shifted = stream.clone_dtoh(&ring_shift(&comm, &stream, &mine)?).map_err(|e| format!("{e:?}"))?;
    let prev = ((rank + world_size - 1) % world_size) as f32 + 1.0;

    let sum = stream.clone_dtoh(&sum).map_err(|e| format!("{e:?}"))?;
    let gathered = stream.clone_dtoh(&gathered).map_err(|e| format!("{e:?}"))?;
    // Rank 0's zeros summed; `world_size` ones summed, from every rank.
    let ok = sum.iter().all(|&x| x == 0.0)
        && gathered.len() == n * world_size
        && gathered.iter().all(|x| x.to_f32() == world_size as f32)
        && shifted.iter().all(|&x| x == prev);
    if !ok {
        return Err(format!("rank {rank}: wrong results"));
    }
    println!("rank {rank} of {world_size}: ok");
    Ok(())
}

fn main() {
    let var = |name: &str, default: usize| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
    let (rank, world_size) = (var("RANK", 0), var("WORLD_SIZE", 1));
    let id_file = std::env::var_os("COMPAT_CHECK_ID_FILE").map(PathBuf::from).unwrap_or_else(|| std::env::temp_dir().join("compat-check.id"));
    if let Err(e) = run(rank, world_size, &id_file) {
        eprintln!("compat-check: {e}");
        std::process::exit(1);
    }
}
