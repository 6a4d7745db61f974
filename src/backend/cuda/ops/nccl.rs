//! NCCL collectives between the CUDA devices of this process (cudarc's `nccl` bindings, the
//! library loaded at run time like the others): one [`Communicator`] per rank, made in the
//! rank's own thread with its device's context current, and in-place sum all-reduces of device
//! buffers on the device's one stream, in stream order with every op.
//!
//! No collective of ndscope's own: every byte that moves between devices is moved by NCCL.

use std::ffi::CStr;
use std::time::{Duration, Instant};

use cudarc::driver::CudaEvent;
use cudarc::nccl::sys as nccl;
use parking_lot::Mutex;

use super::capture;
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::{gpu, Gpu};
use crate::error::Ctx;
use crate::{DType, Error, Result};

/// A rendezvous id from `ncclGetUniqueId`: every rank of one communicator joins with it.
#[derive(Clone, Copy)]
pub(crate) struct NcclId(nccl::ncclUniqueId);

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclId")
    }
}

impl NcclId {
    /// The id's 128 bytes, to pass to the ranks of other processes.
    pub(crate) fn to_bytes(self) -> [u8; 128] {
        // `internal` is `c_char`: signed or not by platform; the bits are what travels.
        self.0.internal.map(|c| c as u8)
    }

    /// The id another process's `ncclGetUniqueId` made, from its bytes.
    pub(crate) fn from_bytes(_ctx: &Ctx, bytes: [u8; 128]) -> Result<NcclId> {
        Ok(NcclId(nccl::ncclUniqueId {
            internal: bytes.map(|b| b as std::ffi::c_char),
        }))
    }
}

/// Whether the NCCL library loads (cudarc panics on a call into a library it cannot load).
fn present() -> bool {
    // SAFETY: only tries to open the shared library by name.
    unsafe { nccl::is_culib_present() }
}

/// NCCL's text for a result code.
fn describe(code: nccl::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for every code (the
    // library is loaded: checked before any communicator exists).
    let text = unsafe { nccl::ncclGetErrorString(code) };
    if text.is_null() {
        return format!("{code:?}");
    }
    // SAFETY: non-null, NUL-terminated and static (above).
    let text = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("{code:?} ({text})")
}

fn nccl_error(ctx: &Ctx, what: &str, code: nccl::ncclResult_t) -> Error {
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!("{what} failed: {}", describe(code)),
    }
}

fn check(ctx: &Ctx, what: &str, code: nccl::ncclResult_t) -> Result<()> {
    match code {
        nccl::ncclResult_t::ncclSuccess => Ok(()),
        code => Err(nccl_error(ctx, what, code)),
    }
}

/// A fresh rendezvous id (`ncclGetUniqueId`); `DeviceUnavailable`-like `Unsupported` when the
/// NCCL library is not found.
pub(crate) fn nccl_unique_id(ctx: &Ctx) -> Result<NcclId> {
    if !present() {
        return Err(ctx.unsupported(
            "NCCL (libnccl.so.2), which several-device training needs, was not found on the \
             library path",
        ));
    }
    let mut id = nccl::ncclUniqueId { internal: [0; 128] };
    // SAFETY: one out-parameter of the right type; the library is loaded.
    check(ctx, "ncclGetUniqueId", unsafe {
        nccl::ncclGetUniqueId(&mut id)
    })?;
    Ok(NcclId(id))
}

/// The NCCL data type of `dtype` (float types only: gradients).
fn nccl_type(ctx: &Ctx, dtype: DType) -> Result<nccl::ncclDataType_t> {
    Ok(match dtype {
        DType::F32 => nccl::ncclDataType_t::ncclFloat32,
        DType::F64 => nccl::ncclDataType_t::ncclFloat64,
        DType::F16 => nccl::ncclDataType_t::ncclFloat16,
        DType::BF16 => nccl::ncclDataType_t::ncclBfloat16,
        other => {
            return Err(ctx.invalid(format!(
                "an all-reduce of gradients takes float arrays, got {other}"
            )))
        }
    })
}

/// One rank of an NCCL communicator, on one device. `Send + Sync`: its calls are made by the
/// rank's thread; [`abort`](Self::abort) may come from any thread (to free ranks that wait for a
/// rank that failed). Dropped: destroyed (`ncclCommDestroy`, after its queued work), or nothing
/// if aborted.
pub(crate) struct Communicator {
    /// `None` once aborted or destroyed.
    comm: Mutex<Option<CommPtr>>,
    /// The event [`wait`](Self::wait) records and polls, made at its first use.
    done: Mutex<Option<CudaEvent>>,
    gpu: &'static Gpu,
    rank: usize,
    ranks: usize,
    /// Its device memory, counted in `memory_usage(dev).cached` until it is destroyed or
    /// aborted (`nccl_memory.rs`).
    pub(super) memory: super::nccl_memory::CommMemory,
}

struct CommPtr(nccl::ncclComm_t);

// SAFETY: an NCCL communicator handle may be used from any thread (NCCL only asks that one
// thread at a time issues calls on it, which the mutex around it ensures).
unsafe impl Send for CommPtr {}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("device", &self.gpu.device())
            .field("rank", &self.rank)
            .field("ranks", &self.ranks)
            .finish()
    }
}

impl Communicator {
    /// Joins rank `rank` of `ranks` of the communicator `id` on CUDA device `ordinal`
    /// (`ncclCommInitRank`, which waits until every rank has joined), its context made current
    /// on the calling thread first.
    pub(crate) fn init(
        ctx: &Ctx,
        ordinal: usize,
        id: NcclId,
        rank: usize,
        ranks: usize,
    ) -> Result<Communicator> {
        let gpu = gpu(ctx, ordinal)?;
        gpu.bind(ctx)?;
        if !present() {
            return Err(ctx.unsupported("NCCL (libnccl.so.2) was not found on the library path"));
        }
        let (Ok(n), Ok(r)) = (i32::try_from(ranks), i32::try_from(rank)) else {
            return Err(ctx.invalid(format!("rank {rank} of {ranks} is out of NCCL's range")));
        };
        let mut comm: nccl::ncclComm_t = std::ptr::null_mut();
        let before = super::nccl_memory::CommMemory::before_init(gpu);
        // SAFETY: an out-parameter, the id from ncclGetUniqueId (copied by value) and the
        // rank's numbers; the device's context is current on this thread (NCCL takes the
        // rank's device from it).
        check(ctx, "ncclCommInitRank", unsafe {
            nccl::ncclCommInitRank(&mut comm, n, id.0, r)
        })?;
        Ok(Communicator {
            comm: Mutex::new(Some(CommPtr(comm))),
            done: Mutex::new(None),
            gpu,
            rank,
            ranks,
            memory: super::nccl_memory::CommMemory::after_init(gpu, before),
        })
    }

    /// Runs `call`, one NCCL group of `group_bytes` bytes on this communicator, counting the
    /// device memory NCCL took for it if it is the communicator's first group or its largest
    /// yet (`nccl_memory.rs`).
    pub(crate) fn measuring<R>(
        &self,
        group_bytes: usize,
        call: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        self.memory
            .measuring(self.gpu, &self.comm, group_bytes, call)
    }

    /// The rank's device ordinal.
    pub(crate) fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    /// Sums `buffers` (each `count` elements of its dtype, on this rank's device) over every
    /// rank in place, one `ncclAllReduce` each inside one `ncclGroupStart`/`ncclGroupEnd`,
    /// queued on the device's stream after everything queued before (the held calls of a
    /// replayed cycle go first). Every rank must pass the same counts and dtypes in the same
    /// order.
    pub(crate) fn all_reduce_sum(
        &self,
        ctx: &Ctx,
        buffers: &mut [(&mut DeviceBuffer, DType, usize)],
    ) -> Result<()> {
        for (buffer, dtype, count) in buffers.iter() {
            if buffer.gpu().ordinal != self.gpu.ordinal {
                return Err(ctx.device_mismatch(format!(
                    "an all-reduce of rank {} (cuda:{}) got a buffer on cuda:{}",
                    self.rank,
                    self.gpu.ordinal,
                    buffer.gpu().ordinal
                )));
            }
            if count.saturating_mul(dtype.size_in_bytes()) > buffer.bytes() {
                return Err(ctx.invalid(format!(
                    "an all-reduce of {count} {dtype} elements over a buffer of {} bytes",
                    buffer.bytes()
                )));
            }
            nccl_type(ctx, *dtype)?;
        }
        let guard = self.comm.lock();
        let Some(comm) = guard.as_ref() else {
            return Err(ctx.invalid(format!(
                "the NCCL communicator of rank {} (cuda:{}) was aborted",
                self.rank, self.gpu.ordinal
            )));
        };
        self.gpu.bind(ctx)?;
        capture::boundary(ctx, self.gpu)?;
        let stream = self.gpu.cu_stream() as nccl::cudaStream_t;
        // SAFETY: no arguments; matched by the ncclGroupEnd below on every path.
        check(ctx, "ncclGroupStart", unsafe { nccl::ncclGroupStart() })?;
        let mut first_error = None;
        for (buffer, dtype, count) in buffers.iter_mut() {
            let ptr = buffer.ptr() as *mut std::ffi::c_void;
            let kind = match nccl_type(ctx, *dtype) {
                Ok(kind) => kind,
                Err(e) => {
                    first_error = Some(e);
                    break;
                }
            };
            // SAFETY: in place (send and receive the same buffer, which NCCL allows): `count`
            // elements of `dtype` lie inside the buffer (checked above), device memory of this
            // rank's device held by the caller's write lock until the call is queued (the
            // device's one stream orders it with every later use); the stream is this device's.
            let code = unsafe {
                nccl::ncclAllReduce(
                    ptr.cast_const(),
                    ptr,
                    *count,
                    kind,
                    nccl::ncclRedOp_t::ncclSum,
                    comm.0,
                    stream,
                )
            };
            if let Err(e) = check(ctx, "ncclAllReduce", code) {
                first_error = Some(e);
                break;
            }
        }
        // SAFETY: closes the group opened above.
        let end = check(ctx, "ncclGroupEnd", unsafe { nccl::ncclGroupEnd() });
        match first_error {
            Some(e) => Err(e),
            None => end,
        }
    }

    /// Waits until everything queued on the rank's device so far has run (this communicator's
    /// collectives included), polling the device and NCCL's asynchronous error instead of
    /// blocking, so that a collective that cannot complete is found: an asynchronous NCCL error
    /// (a peer process that died, mismatched calls) aborts the communicator and is returned;
    /// `deadline` passing aborts it and gives `TimedOut` (`waited`: the timeout, for the
    /// message); a communicator aborted meanwhile (by another thread) is an error too. A failed
    /// kernel or copy is left for the caller's next synchronisation to report, as always.
    pub(crate) fn wait(&self, ctx: &Ctx, deadline: Instant, waited: Duration) -> Result<()> {
        self.gpu.bind(ctx)?;
        capture::boundary(ctx, self.gpu)?;
        let mut done = self.done.lock();
        if done.is_none() {
            let event = self
                .gpu
                .ctx
                .new_event(None)
                .map_err(|e| self.gpu.failed(ctx, "cuEventCreate", e))?;
            *done = Some(event);
        }
        let Some(event) = done.as_ref() else {
            return Err(ctx.unsupported("the communicator's wait event vanished"));
        };
        event
            .record(&self.gpu.stream)
            .map_err(|e| self.gpu.failed(ctx, "cuEventRecord", e))?;
        // Spin for a millisecond (a collective usually completes within microseconds of the
        // last rank's arrival, a step's kernels within a fraction of a millisecond), then
        // sleep 100 µs between looks.
        let spin_until = Instant::now() + Duration::from_millis(1);
        loop {
            match event.try_is_complete() {
                Ok(true) => {}
                Ok(false) => {
                    self.async_error(ctx)?;
                    if Instant::now() >= deadline {
                        self.abort();
                        return Err(Error::TimedOut {
                            op: ctx.op,
                            at: ctx.at,
                            what: format!(
                                "the NCCL work of rank {} of {} (cuda:{})",
                                self.rank, self.ranks, self.gpu.ordinal
                            ),
                            waited,
                            why: "a rank it exchanges with did not come; its communicator was \
                                  aborted"
                                .to_string(),
                        });
                    }
                    if Instant::now() < spin_until {
                        std::thread::yield_now();
                    } else {
                        std::thread::sleep(Duration::from_micros(100));
                    }
                    continue;
                }
                // A failed kernel or copy: the caller's synchronisation reports it (with the
                // device's fault bookkeeping); NCCL's own error first, if it has one.
                Err(_) => {}
            }
            return self.async_error(ctx);
        }
    }

    /// NCCL's asynchronous error of this communicator (`ncclCommGetAsyncError`): a failure
    /// aborts the communicator and is returned; an aborted communicator is an error.
    fn async_error(&self, ctx: &Ctx) -> Result<()> {
        let guard = self.comm.lock();
        let Some(comm) = guard.as_ref() else {
            return Err(Error::Backend {
                op: ctx.op,
                at: ctx.at,
                reason: format!(
                    "the NCCL communicator of rank {} of {} (cuda:{}) was aborted while this \
                     rank waited for its collectives",
                    self.rank, self.ranks, self.gpu.ordinal
                ),
            });
        };
        let mut state = nccl::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator (held under its lock) and an out-parameter.
        let code = unsafe { nccl::ncclCommGetAsyncError(comm.0, &mut state) };
        drop(guard);
        let failed = match (code, state) {
            (nccl::ncclResult_t::ncclSuccess, nccl::ncclResult_t::ncclSuccess)
            | (nccl::ncclResult_t::ncclSuccess, nccl::ncclResult_t::ncclInProgress) => None,
            (nccl::ncclResult_t::ncclSuccess, state) => Some(state),
            (code, _) => Some(code),
        };
        match failed {
            None => Ok(()),
            Some(code) => {
                self.abort();
                Err(Error::Backend {
                    op: ctx.op,
                    at: ctx.at,
                    reason: format!(
                        "NCCL reports an asynchronous error on rank {} of {} (cuda:{}): {}; \
                         the communicator was aborted",
                        self.rank,
                        self.ranks,
                        self.gpu.ordinal,
                        describe(code)
                    ),
                })
            }
        }
    }

    /// Aborts the communicator (`ncclCommAbort`): its queued collectives do nothing, and the
    /// other ranks' collectives that wait for them end with an error instead of waiting
    /// forever. Idempotent; later calls on it are refused.
    pub(crate) fn abort(&self) {
        if let Some(comm) = self.comm.lock().take() {
            // The device's context current, as NCCL expects for its cleanup.
            let _ = self.gpu.bind(&Ctx::new("ncclCommAbort"));
            // SAFETY: a live communicator, taken out of the slot so that no call uses it again.
            let _ = unsafe { nccl::ncclCommAbort(comm.0) };
            // Its memory is given back (still under the lock: no group counts more after).
            self.memory.release();
        }
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        if let Some(comm) = self.comm.get_mut().take() {
            let _ = self.gpu.bind(&Ctx::new("ncclCommDestroy"));
            // SAFETY: a live communicator, never used again; destroy waits for its queued work.
            let _ = unsafe { nccl::ncclCommDestroy(comm.0) };
            self.memory.release();
        }
    }
}
