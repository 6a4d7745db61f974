//! Errors found on the device, reported at the next wait: the check flag of the checked
//! launches (an index out of range, an integer divisor of 0), and waiting for a device
//! (`wait_all`, `synchronize`), where those reports and earlier kernel failures surface.

use std::ptr::NonNull;
use std::thread::ThreadId;

use parking_lot::Mutex;

use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaEvent};

use super::capture;
use super::launch::memset;
use crate::backend::cuda::device::{self, lock_or_try, pinned_alloc, sticky, Gpu};
use crate::error::{Ctx, Site};
use crate::memory::MAX_CUDA_DEVICES;
use crate::{DType, Error, Result};

// ---- checks reported at the next wait ----

/// Bits of a check key that hold the position (`report_bad` of kernels/common.cu).
const POSITION_BITS: u32 = 40;
/// Checked launches a device may queue between two waits before one is forced.
const MAX_PENDING: usize = 1 << 16;
/// Errors kept for threads that have not waited since another thread's wait found them.
const MAX_FOUND: usize = 64;

/// What a checked launch refuses, to build its error when the device reports it.
pub(super) enum Refusal {
    /// An index outside `0..bound` (`what`) among `count` indices of dtype `from`.
    Index {
        count: u64,
        from: DType,
        bound: usize,
        what: &'static str,
    },
    /// An integer division whose divisor held 0: the front-end's error.
    Zero(Error),
}

/// One checked launch queued since the last wait.
struct QueuedCheck {
    op: &'static str,
    at: Site,
    /// The thread that queued it: its error goes to that thread's next wait.
    thread: ThreadId,
    refusal: Refusal,
}

impl QueuedCheck {
    fn error(self, ordinal: usize, position: u64) -> Error {
        let found = format!(
            "(found by the kernel on cuda:{ordinal}, reported at the next wait for the device)"
        );
        match self.refusal {
            Refusal::Index {
                count,
                from,
                bound,
                what,
            } => Error::InvalidArgument {
                op: self.op,
                at: self.at,
                reason: format!(
                    "the index at flat position {position} of the {count} {from} indices is out \
                     of range: it must be at least 0 and below {what}, {bound} {found}"
                ),
            },
            Refusal::Zero(Error::InvalidArgument { op, at, reason }) => Error::InvalidArgument {
                op,
                at,
                reason: format!("{reason} (at flat position {position} of the result) {found}"),
            },
            Refusal::Zero(e) => e,
        }
    }
}

/// The device-side flag of a device's checked launches: one word of device memory, all ones
/// while no kernel found bad input, else the smallest `key + position` reported; a page-locked
/// word it is copied to before each wait; and what each key stands for.
struct Checks {
    word: CUdeviceptr,
    host: NonNull<u64>,
    pending: Vec<QueuedCheck>,
    /// Errors found by another thread's wait, for the thread that queued the op.
    found: Vec<(ThreadId, Error)>,
}

// SAFETY: `host` is page-locked memory owned by this struct, used under its mutex.
unsafe impl Send for Checks {}

static CHECKS: [Mutex<Option<Checks>>; MAX_CUDA_DEVICES] =
    [const { Mutex::new(None) }; MAX_CUDA_DEVICES];

fn checks_of(gpu: &Gpu) -> &'static Mutex<Option<Checks>> {
    &CHECKS[gpu.ordinal.min(MAX_CUDA_DEVICES - 1)]
}

impl Checks {
    /// The flag of `gpu`, set to all ones (in stream order).
    fn new(ctx: &Ctx, gpu: &Gpu) -> Result<Checks> {
        device::on_release(release_checks);
        let word = gpu.malloc(ctx, 8)?;
        // The context is current (`malloc` bound it); 8 bytes, freed by `release_checks`.
        let host = match pinned_alloc(ctx, gpu, 8) {
            Ok(p) => p.cast::<u64>(),
            Err(e) => {
                gpu.free(word);
                return Err(e);
            }
        };
        if let Err(e) = memset(ctx, gpu, word, 0xff, 8) {
            gpu.free(word);
            // SAFETY: allocated just above by `cuMemHostAlloc`, unused.
            let _ = unsafe { result::free_host(host.as_ptr().cast()) };
            return Err(e);
        }
        Ok(Checks {
            word,
            host,
            pending: Vec::new(),
            found: Vec::new(),
        })
    }
}

/// Frees the check flag of `gpu` when no checked launch waits for a report (the next checked
/// launch makes it again). `exiting`: pending reports no longer matter, and the flag is left
/// alone if another thread holds it (never waited for). The free of its page-locked word synchronises: never called on an
/// allocation's out-of-memory path. Its 8 + 8 bytes are not counted as cached.
pub(crate) fn release_checks(gpu: &Gpu, exiting: bool) {
    let Some(mut guard) = lock_or_try(checks_of(gpu), !exiting) else {
        return;
    };
    if guard
        .as_ref()
        .is_some_and(|c| exiting || (c.pending.is_empty() && c.found.is_empty()))
    {
        if let Some(checks) = guard.take() {
            gpu.free(checks.word);
            if gpu.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by `cuMemHostAlloc` in `Checks::new`; a copy into it is
                // queued only by `reporting`, which waits for it under this lock; freed once.
                let _ = unsafe { result::free_host(checks.host.as_ptr().cast()) };
            }
        }
    }
}

/// Queues a checked launch on `gpu`: `launch(flag, key)` runs the kernel, which reports bad
/// input into `flag` with `key`; `refusal` says what the error will be. Forces a wait (the
/// only one) when `MAX_PENDING` checked launches are queued without one.
pub(super) fn checked_launch(
    ctx: &Ctx,
    gpu: &Gpu,
    refusal: impl FnOnce() -> Refusal,
    launch: impl FnOnce(CUdeviceptr, u64) -> Result<()>,
) -> Result<()> {
    if checks_of(gpu)
        .lock()
        .as_ref()
        .is_some_and(|c| c.pending.len() >= MAX_PENDING)
    {
        synchronize(ctx, gpu.ordinal)?;
    }
    let mut guard = checks_of(gpu).lock();
    if guard.is_none() {
        *guard = Some(Checks::new(ctx, gpu)?);
    }
    let Some(checks) = guard.as_mut() else {
        return Err(ctx.unsupported("the check flag of the device vanished"));
    };
    let key = (checks.pending.len() as u64) << POSITION_BITS;
    launch(checks.word, key)?;
    checks.pending.push(QueuedCheck {
        op: ctx.op,
        at: ctx.at,
        thread: std::thread::current().id(),
        refusal: refusal(),
    });
    Ok(())
}

/// Runs `wait` (which waits for everything queued on `gpu` so far, or at least for work queued
/// after this call's copy) and then reports the first bad input that a checked launch queued
/// before it found, as that launch's error, to the thread that queued it: to this one now, to
/// another at its next wait. Costs one 8-byte copy when checked launches are pending, nothing
/// otherwise.
pub(super) fn reporting<R>(ctx: &Ctx, gpu: &Gpu, wait: impl FnOnce() -> Result<R>) -> Result<R> {
    capture::boundary(ctx, gpu)?;
    let mut guard = checks_of(gpu).lock();
    let Some(checks) = guard
        .as_mut()
        .filter(|c| !c.pending.is_empty() || !c.found.is_empty())
    else {
        drop(guard);
        return wait();
    };
    let me = std::thread::current().id();
    let copied = !checks.pending.is_empty();
    if copied {
        gpu.bind(ctx)?;
        // SAFETY: `host` is 8 bytes of page-locked memory of this struct, read only after
        // `wait` (below) has waited for work queued after this copy; `word` is 8 bytes of
        // device memory.
        unsafe {
            sys::cuMemcpyDtoHAsync_v2(checks.host.as_ptr().cast(), checks.word, 8, gpu.cu_stream())
        }
        .result()
        .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoHAsync", e))?;
    }
    let value = wait()?;
    if copied {
        // SAFETY: the copy into `host` has completed (`wait`); nothing else writes it.
        let word = unsafe { std::ptr::read_volatile(checks.host.as_ptr()) };
        let pending = std::mem::take(&mut checks.pending);
        if word != u64::MAX {
            memset(ctx, gpu, checks.word, 0xff, 8)?;
            let index = (word >> POSITION_BITS) as usize;
            let position = word & ((1 << POSITION_BITS) - 1);
            let (thread, error) = match pending.into_iter().nth(index) {
                Some(p) => (p.thread, p.error(gpu.ordinal, position)),
                None => (
                    me,
                    ctx.unsupported(format!(
                        "the check flag of cuda:{} holds {word:#x}, which no queued op wrote",
                        gpu.ordinal
                    )),
                ),
            };
            checks.found.push((thread, error));
            // A thread that never waits again would leave its error here: keep the latest few.
            if checks.found.len() > MAX_FOUND {
                checks.found.remove(0);
            }
        }
    }
    match checks.found.iter().position(|(t, _)| *t == me) {
        Some(at) => Err(checks.found.remove(at).1),
        None => Ok(value),
    }
}

// ---- waiting ----

/// Per device, an event created with `CU_EVENT_BLOCKING_SYNC`: waiting for it puts the host
/// thread to sleep until the device signals, where a stream synchronisation in the default
/// scheduling mode spins a CPU core. (The context keeps its default flags: it may be the
/// primary context another library in the process shares.)
struct Waiter(CudaEvent);

static WAITERS: [Mutex<Option<Waiter>>; MAX_CUDA_DEVICES] =
    [const { Mutex::new(None) }; MAX_CUDA_DEVICES];

/// Waits, without spinning, until everything queued on `gpu` so far has run; reports an error
/// of an earlier asynchronous kernel.
pub(super) fn wait_all(ctx: &Ctx, gpu: &Gpu) -> Result<()> {
    capture::boundary(ctx, gpu)?;
    let mut waiter = WAITERS[gpu.ordinal.min(MAX_CUDA_DEVICES - 1)].lock();
    if waiter.is_none() {
        let event = gpu
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| gpu.failed(ctx, "cuEventCreate", e))?;
        *waiter = Some(Waiter(event));
    }
    let Some(Waiter(event)) = waiter.as_ref() else {
        return Err(ctx.unsupported("the wait event of the device vanished"));
    };
    gpu.bind(ctx)?;
    event
        .record(&gpu.stream)
        .map_err(|e| gpu.failed(ctx, "cuEventRecord", e))?;
    event.synchronize().map_err(|e| sticky(ctx, gpu, e))
}

/// Waits for all work queued on device `ordinal` and reports errors of earlier kernels, and
/// bad input that a checked launch found since the last wait.
pub(crate) fn synchronize(ctx: &Ctx, ordinal: usize) -> Result<()> {
    let gpu = device::gpu(ctx, ordinal)?;
    reporting(ctx, gpu, || wait_all(ctx, gpu))
}
