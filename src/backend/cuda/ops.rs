//! The op families on one CUDA device: kernel launches (`kernels.cu`), cuBLAS for float matrix
//! products, driver copies, and host↔device transfers through page-locked staging memory.
//!
//! Launches are asynchronous: a function returns once its work is queued on the device's
//! stream. Only reads (`to_vec`, `to_scalar`, `to_device(Cpu)`) and `Device::synchronize` wait,
//! for the events of their own copies. Input that only the device sees (an index outside its
//! range in `pick`/`one_hot`, an integer divisor of 0) is checked by the kernel itself, which
//! never uses it and records where it was ([`Checks`]); the next wait on that device reports it
//! as an error naming the op and the call site that queued it. No op waits for the device.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::thread::ThreadId;

use parking_lot::Mutex;

use cudarc::cublas::sys as blas;
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaEvent};

use super::buffer::DeviceBuffer;
use super::device::{blas_error, lock_or_try, pinned_alloc, sticky, Gpu, STAGING};
use super::kernels::{self, Function};
use crate::backend::cpu::buffer::HostBuffer;
use crate::backend::layout::{
    broadcast_strides, contiguous_strides, merge_dims, reduction_passes, Pass,
};
use crate::backend::{Batched, Binary, Compare, Unary};
use crate::dtype::dispatch;
use crate::error::{Ctx, Site};
use crate::memory::MAX_CUDA_DEVICES;
use crate::{DType, Element, Error, Result};

type Src<'a> = (&'a DeviceBuffer, &'a [usize]);
type Dst<'a> = (&'a mut DeviceBuffer, &'a [usize]);

/// Threads per block of the 1-d kernels.
const THREADS: u32 = 256;
/// Most dims of a strided iteration after merging (`MAXR` in kernels.cu).
const MAX_RANK: usize = 8;

// ---- launching ----

/// A launch configuration: blocks, and threads per block in x and y.
#[derive(Clone, Copy)]
struct Config {
    blocks: u32,
    threads: (u32, u32),
}

/// Blocks for a grid-stride loop over `n` items, `per_block` at a time: enough to fill the
/// device, at most one per `per_block` items.
fn blocks(gpu: &Gpu, n: u64, per_block: u64) -> u32 {
    let wanted = n.div_ceil(per_block.max(1)).max(1);
    wanted.min(u64::from(gpu.sms) * 16) as u32
}

fn linear(gpu: &Gpu, n: u64) -> Config {
    Config {
        blocks: blocks(gpu, n, u64::from(THREADS)),
        threads: (THREADS, 1),
    }
}

/// Launches `f` on `gpu`'s stream with `params`.
///
/// # Safety
/// `params` must point to one value per parameter of the kernel `f`, of the kernel's types and
/// in its order (`kernels.cu`), and every device address among them must be memory of `gpu`
/// that stays allocated until the kernel has run: the storage of arrays whose data locks the
/// caller holds (freed only in stream order after), or scratch memory of `gpu`.
unsafe fn launch_raw(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    cfg: Config,
    params: &mut [*mut c_void],
    sizes: &[usize],
) -> Result<()> {
    if kernels::checking_launches() {
        kernels::check_launch(ctx, f.1, sizes)?;
    }
    gpu.bind(ctx)?;
    // SAFETY: per the contract.
    unsafe {
        result::launch_kernel(
            f.0,
            (cfg.blocks, 1, 1),
            (cfg.threads.0, cfg.threads.1, 1),
            0,
            gpu.cu_stream(),
            params,
        )
    }
    .map_err(|e| gpu.failed(ctx, "cuLaunchKernel", e))
}

/// `launch!(ctx, gpu, f, cfg; name = value, ...)`: each value is kept in a local named `name`
/// and passed by address, in order, with the sizes of the values (checked against the
/// kernel's parameter list where launches are checked). Expands to a call of the unsafe
/// [`launch_raw`], whose contract the caller keeps (and says so in a `// SAFETY:` comment).
macro_rules! launch {
    ($ctx:expr, $gpu:expr, $f:expr, $cfg:expr; $($arg:ident = $val:expr),+ $(,)?) => {{
        $(let mut $arg = $val;)+
        let sizes = [$(Arg::bytes(&$arg)),+];
        let mut params = [$(std::ptr::addr_of_mut!($arg).cast::<c_void>()),+];
        launch_raw($ctx, $gpu, $f, $cfg, &mut params, &sizes)
    }};
}

/// A value passed to a kernel parameter.
trait Arg {
    /// The bytes of the parameter it fills: its size, or less for a [`Scalar`].
    fn bytes(&self) -> usize;
}

macro_rules! arg_by_size {
    ($($t:ty),+) => {
        $(impl Arg for $t {
            fn bytes(&self) -> usize {
                std::mem::size_of::<$t>()
            }
        })+
    };
}
arg_by_size!(u64, u32, i32, f64, Strided);

impl Arg for Scalar {
    fn bytes(&self) -> usize {
        self.size
    }
}

/// An element-typed kernel parameter (`T v`): the value converted as `T::from_f64`, in the
/// first bytes of an 8-byte slot.
/// `size` is the element's size (what the kernel reads; the launch check compares it).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Scalar {
    slot: [u8; 8],
    size: usize,
}

fn scalar(dtype: DType, value: f64) -> Scalar {
    let mut scalar = Scalar {
        slot: [0; 8],
        size: dtype.size_in_bytes(),
    };
    dispatch!(dtype, T => {
        let v = T::from_f64(value);
        // SAFETY: every element type is at most 8 bytes; the write is unaligned-safe.
        unsafe { std::ptr::write_unaligned(scalar.slot.as_mut_ptr().cast::<T>(), v) };
    });
    scalar
}

/// `struct Strided` of kernels.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct Strided {
    rank: i32,
    dims: [u64; MAX_RANK],
    sa: [u64; MAX_RANK],
    sb: [u64; MAX_RANK],
}

const MODE_SAME: i32 = 0;
const MODE_B_ONE: i32 = 1;
const MODE_A_ONE: i32 = 2;
const MODE_STRIDED32: i32 = 3;
const MODE_STRIDED64: i32 = 4;
const MODE_SELF: i32 = 5;

impl Strided {
    fn none() -> Strided {
        Strided {
            rank: 0,
            dims: [0; MAX_RANK],
            sa: [0; MAX_RANK],
            sb: [0; MAX_RANK],
        }
    }
}

fn size(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// How the elementwise kernels address operands `a` (strides `sa`) and `b` (`sb`) of an output
/// of `out` dims: the fast modes when an operand is whole or one element, else merged strides.
/// With `broadcasting`, an operand as long as the output has the output's layout (true of
/// NumPy broadcasting, not of a permutation).
fn addressing(
    ctx: &Ctx,
    out: &[usize],
    (a_len, sa): (usize, Vec<usize>),
    (b_len, sb): (usize, Vec<usize>),
    broadcasting: bool,
) -> Result<(i32, Strided)> {
    let n = size(out);
    if broadcasting {
        if a_len == n && b_len == n {
            return Ok((MODE_SAME, Strided::none()));
        }
        if b_len == 1 && a_len == n {
            return Ok((MODE_B_ONE, Strided::none()));
        }
        if a_len == 1 && b_len == n {
            return Ok((MODE_A_ONE, Strided::none()));
        }
    }
    let (dims, strides) = merge_dims(out, &[sa, sb]);
    if dims.len() > MAX_RANK {
        return Err(ctx.unsupported(format!(
            "`{}` on CUDA walks at most {MAX_RANK} dimensions after merging; shape {out:?} needs {}",
            ctx.op,
            dims.len()
        )));
    }
    let mut s = Strided::none();
    s.rank = dims.len() as i32;
    for (i, &d) in dims.iter().enumerate() {
        s.dims[i] = d as u64;
        s.sa[i] = strides[0][i] as u64;
        s.sb[i] = strides[1][i] as u64;
    }
    let fits = |v: usize| v <= u32::MAX as usize;
    let mode = if fits(n) && fits(a_len) && fits(b_len) {
        MODE_STRIDED32
    } else {
        MODE_STRIDED64
    };
    Ok((mode, s))
}

/// Addressing of a broadcast binary op.
fn broadcast(ctx: &Ctx, a: &[usize], b: &[usize], out: &[usize]) -> Result<(i32, Strided)> {
    addressing(
        ctx,
        out,
        (size(a), broadcast_strides(a, out)),
        (size(b), broadcast_strides(b, out)),
        true,
    )
}

/// Addressing of an in-place op whose source `b` broadcasts to `x` (the source is operand b).
fn inplace_source(ctx: &Ctx, x: &[usize], b: &[usize]) -> Result<(i32, Strided)> {
    addressing(
        ctx,
        x,
        (size(x), contiguous_strides(x)),
        (size(b), broadcast_strides(b, x)),
        true,
    )
}

fn same_gpu(ctx: &Ctx, gpus: &[&Gpu]) -> Result<&'static Gpu> {
    let first = gpus[0].ordinal;
    if let Some(other) = gpus.iter().find(|g| g.ordinal != first) {
        return Err(ctx.device_mismatch(format!(
            "`{}` got operands on cuda:{first} and cuda:{} (move one with to_device)",
            ctx.op, other.ordinal
        )));
    }
    super::device::existing(first).ok_or_else(|| ctx.unavailable(crate::Device::Cuda(first)))
}

fn elements(buffer: &DeviceBuffer, dtype: DType) -> u64 {
    (buffer.bytes() / dtype.size_in_bytes()) as u64
}

// ---- checks reported at the next wait ----

/// Bits of a check key that hold the position (kernels.cu's `report_bad`).
const POSITION_BITS: u32 = 40;
/// Checked launches a device may queue between two waits before one is forced.
const MAX_PENDING: usize = 1 << 16;
/// Errors kept for threads that have not waited since another thread's wait found them.
const MAX_FOUND: usize = 64;

/// What a checked launch refuses, to build its error when the device reports it.
enum Refusal {
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
struct Pending {
    op: &'static str,
    at: Site,
    /// The thread that queued it: its error goes to that thread's next wait.
    thread: ThreadId,
    refusal: Refusal,
}

impl Pending {
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
    pending: Vec<Pending>,
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
        super::device::on_release(release_checks);
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
fn checked_launch(
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
    checks.pending.push(Pending {
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
fn reporting<R>(ctx: &Ctx, gpu: &Gpu, wait: impl FnOnce() -> Result<R>) -> Result<R> {
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
fn wait_all(ctx: &Ctx, gpu: &Gpu) -> Result<()> {
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

// ---- transfers and copies ----

/// Copies host `bytes` to device address `dst` of `gpu`. From pageable memory through the two
/// staging buffers, double-buffered: chunk i+1 is copied into one buffer while chunk i goes to
/// the device from the other, each buffer reused only after the event recorded after its last
/// copy. From page-locked memory directly, one copy, waiting (on an event) for it since the
/// source is only borrowed.
fn host_to_device(
    ctx: &Ctx,
    gpu: &Gpu,
    bytes: &[u8],
    dst: CUdeviceptr,
    pinned: bool,
) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    gpu.bind(ctx)?;
    let stream = gpu.cu_stream();
    if pinned {
        // SAFETY: `bytes` is page-locked host memory borrowed for this call, which waits for the
        // copy to finish; `dst` holds `bytes.len()` bytes of device memory of this context.
        unsafe { result::memcpy_htod_async(dst, bytes, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyHtoDAsync", e))?;
        return wait_all(ctx, gpu);
    }
    let mut staging = gpu.staging(ctx)?;
    for (i, chunk) in bytes.chunks(STAGING).enumerate() {
        let b = i % 2;
        staging.wait(ctx, gpu, b)?;
        // SAFETY: the staging buffer holds STAGING bytes and its last copy has finished
        // (`wait`); the chunk is at most STAGING bytes.
        let staged = unsafe {
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), staging.bufs[b], chunk.len());
            std::slice::from_raw_parts(staging.bufs[b].cast_const(), chunk.len())
        };
        // SAFETY: the staged bytes stay untouched until the event recorded next completes;
        // `dst + offset` lies inside the destination.
        unsafe { result::memcpy_htod_async(dst + (i * STAGING) as u64, staged, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyHtoDAsync", e))?;
        staging.record(ctx, gpu, b)?;
    }
    Ok(())
}

/// Copies `out.len()` bytes at device address `src` of `gpu` to the host, after all work queued
/// before (a synchronisation: errors of earlier kernels are reported here).
fn device_to_host(
    ctx: &Ctx,
    gpu: &Gpu,
    src: CUdeviceptr,
    out: &mut [u8],
    pinned: bool,
) -> Result<()> {
    if out.is_empty() {
        return wait_all(ctx, gpu);
    }
    gpu.bind(ctx)?;
    let stream = gpu.cu_stream();
    if pinned {
        // SAFETY: `out` is page-locked host memory borrowed for this call, which waits for the
        // copy to finish; `src` holds `out.len()` bytes of device memory of this context.
        unsafe { result::memcpy_dtoh_async(out, src, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoHAsync", e))?;
        return wait_all(ctx, gpu);
    }
    let len = out.len();
    let chunks = len.div_ceil(STAGING);
    let mut staging = gpu.staging(ctx)?;
    for i in 0..=chunks {
        if i < chunks {
            let b = i % 2;
            staging.wait(ctx, gpu, b)?;
            let n = STAGING.min(len - i * STAGING);
            // SAFETY: the staging buffer is free (`wait`) and holds at least `n` bytes, which the
            // device writes before the event recorded next completes.
            let slot = unsafe { std::slice::from_raw_parts_mut(staging.bufs[b], n) };
            // SAFETY: `src + offset` lies inside the source.
            unsafe { result::memcpy_dtoh_async(slot, src + (i * STAGING) as u64, stream) }
                .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoHAsync", e))?;
            staging.record(ctx, gpu, b)?;
        }
        if i > 0 {
            let j = i - 1;
            let b = j % 2;
            staging.wait(ctx, gpu, b)?;
            let n = STAGING.min(len - j * STAGING);
            // SAFETY: the copy into the buffer has finished (`wait`); it holds `n` bytes.
            let staged = unsafe { std::slice::from_raw_parts(staging.bufs[b].cast_const(), n) };
            out[j * STAGING..j * STAGING + n].copy_from_slice(staged);
        }
    }
    Ok(())
}

/// The bytes of a slice of elements.
fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: element types are plain numbers without padding; the length is in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

pub(crate) fn read<T: Element>(ctx: &Ctx, src: &DeviceBuffer, dst: &mut [T]) -> Result<()> {
    let bytes = std::mem::size_of_val(dst);
    // SAFETY: element types are plain numbers valid for every bit pattern; the length is in
    // bytes.
    let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), bytes) };
    let gpu = src.gpu();
    reporting(ctx, gpu, || device_to_host(ctx, gpu, src.ptr(), out, false))
}

pub(crate) fn write<T: Element>(ctx: &Ctx, dst: &mut DeviceBuffer, data: &[T]) -> Result<()> {
    host_to_device(ctx, dst.gpu(), bytes_of(data), dst.ptr(), false)
}

pub(crate) fn upload(ctx: &Ctx, src: &HostBuffer, dst: &mut DeviceBuffer) -> Result<()> {
    host_to_device(ctx, dst.gpu(), src.as_bytes(), dst.ptr(), src.is_pinned())
}

pub(crate) fn download(ctx: &Ctx, src: &DeviceBuffer, dst: &mut HostBuffer) -> Result<()> {
    let pinned = dst.is_pinned();
    let gpu = src.gpu();
    reporting(ctx, gpu, || {
        device_to_host(ctx, gpu, src.ptr(), dst.as_bytes_mut(), pinned)
    })
}

pub(crate) fn copy(ctx: &Ctx, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<()> {
    let bytes = src.bytes().min(dst.bytes());
    if bytes == 0 {
        return Ok(());
    }
    let (from, to) = (src.gpu(), dst.gpu());
    if from.ordinal != to.ordinal {
        // Between two devices: through the host.
        let mut host = vec![0u8; bytes];
        device_to_host(ctx, from, src.ptr(), &mut host, false)?;
        return host_to_device(ctx, to, &host, dst.ptr(), false);
    }
    copy_bytes(ctx, from, src.ptr(), dst.ptr(), bytes)
}

/// Copies `bytes` bytes between two device addresses of `gpu`, in stream order.
fn copy_bytes(
    ctx: &Ctx,
    gpu: &Gpu,
    src: CUdeviceptr,
    dst: CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    gpu.bind(ctx)?;
    // SAFETY: both ranges are `bytes` of device memory of this context, held by locked storage
    // (callers pass their arrays' addresses and sizes).
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, gpu.cu_stream()) }
        .result()
        .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoDAsync", e))
}

/// Sets `bytes` bytes at `ptr` to `value`.
fn memset(ctx: &Ctx, gpu: &Gpu, ptr: CUdeviceptr, value: u8, bytes: usize) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    gpu.bind(ctx)?;
    // SAFETY: `ptr` holds `bytes` bytes of device memory of this context.
    unsafe { result::memset_d8_async(ptr, value, bytes, gpu.cu_stream()) }
        .map_err(|e| gpu.failed(ctx, "cuMemsetD8Async", e))
}

pub(crate) fn zero(ctx: &Ctx, dst: &mut DeviceBuffer) -> Result<()> {
    memset(ctx, dst.gpu(), dst.ptr(), 0, dst.bytes())
}

pub(crate) fn convert(
    ctx: &Ctx,
    from: DType,
    to: DType,
    src: &DeviceBuffer,
    dst: &mut DeviceBuffer,
) -> Result<()> {
    if from == to {
        return copy(ctx, src, dst);
    }
    let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
    let n = elements(dst, to);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.two(ctx, "cast", from, to)?;
    // SAFETY: cast_<from>_<to>(const S* a, D* out, u64 n); both are locked storage of `gpu`.
    unsafe { launch!(ctx, gpu, f, linear(gpu, n); a = src.ptr(), out = dst.ptr(), count = n) }
}

/// Waits for all work queued on device `ordinal` and reports errors of earlier kernels, and
/// bad input that a checked launch found since the last wait.
pub(crate) fn synchronize(ctx: &Ctx, ordinal: usize) -> Result<()> {
    let gpu = super::device::gpu(ctx, ordinal)?;
    reporting(ctx, gpu, || wait_all(ctx, gpu))
}

// ---- fill / random ----

pub(crate) fn fill(ctx: &Ctx, dtype: DType, dst: &mut DeviceBuffer, value: f64) -> Result<()> {
    let gpu = dst.gpu();
    let n = elements(dst, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "fill", dtype)?;
    // SAFETY: fill_<T>(T* out, u64 n, T v); `dst` is locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, v = scalar(dtype, value))
    }
}

pub(crate) fn arange(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut DeviceBuffer,
    start: f64,
    step: f64,
) -> Result<()> {
    let gpu = dst.gpu();
    let n = elements(dst, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "arange", dtype)?;
    // SAFETY: arange_<T>(T* out, u64 n, f64 start, f64 step); `dst` is locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, first = start, delta = step)
    }
}

pub(crate) fn eye(ctx: &Ctx, dtype: DType, dst: &mut DeviceBuffer, n: usize) -> Result<()> {
    let gpu = dst.gpu();
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "eye", dtype)?;
    let total = (n * n) as u64;
    // SAFETY: eye_<T>(T* out, u64 side); `dst` is locked storage of `gpu` of side² elements.
    unsafe { launch!(ctx, gpu, f, linear(gpu, total); out = dst.ptr(), side = n as u64) }
}

pub(crate) fn randn(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut DeviceBuffer,
    seed: u64,
    start: u64,
) -> Result<()> {
    let gpu = dst.gpu();
    let n = elements(dst, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "randn", dtype)?;
    // SAFETY: randn_<T>(T* out, u64 n, u64 seed, u64 start); `dst` is locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, s = seed, first = start)
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn rand(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut DeviceBuffer,
    seed: u64,
    start: u64,
    low: f64,
    high: f64,
) -> Result<()> {
    let gpu = dst.gpu();
    let n = elements(dst, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "rand", dtype)?;
    // SAFETY: rand_<T>(T* out, u64 n, u64 seed, u64 start, f64 low, f64 high); `dst` is locked
    // storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            out = dst.ptr(), count = n, s = seed, first = start, lo = low, hi = high)
    }
}

// ---- binary / compare / unary ----

/// Launches an elementwise kernel `(const A* a, const B* b, O* out, u64 n, int mode, Strided s)`
/// over `out_dims`, with `a` and `b` broadcast to it.
fn launch_broadcast(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    (a, a_dims): Src<'_>,
    (b, b_dims): Src<'_>,
    (out, out_dims): Dst<'_>,
) -> Result<()> {
    let n = size(out_dims) as u64;
    let (mode, strided) = broadcast(ctx, a_dims, b_dims, out_dims)?;
    // SAFETY: the kernels launched here (the binary ops and comparisons) take exactly these
    // parameters; the three buffers are locked storage of `gpu`, addressed within their sizes
    // by `mode` and `s`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            pa = a.ptr(), pb = b.ptr(), po = out.ptr(), count = n, m = mode, s = strided)
    }
}

/// Launches an elementwise kernel `(const A* a, O* out, u64 n, P extra)` over `n` elements.
fn launch_map<P: Copy + Arg>(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    (a, out): (&DeviceBuffer, &mut DeviceBuffer),
    n: u64,
    extra: P,
) -> Result<()> {
    // SAFETY: the kernels launched here (the scalar ops, scalar comparisons and `pow`) take
    // exactly these parameters, `P` being their last one's type (`T` as a `Scalar`, or f64);
    // both buffers are locked storage of `gpu` holding `n` elements.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            pa = a.ptr(), po = out.ptr(), count = n, e = extra)
    }
}

fn binary_name(op: Binary) -> (&'static str, &'static str, &'static str) {
    match op {
        Binary::Add => ("add", "add_scalar", "add_inplace"),
        Binary::Sub => ("sub", "sub_scalar", "sub_inplace"),
        Binary::Mul => ("mul", "mul_scalar", "mul_inplace"),
        Binary::Div => ("div", "div_scalar", "div_inplace"),
        Binary::Maximum => ("maximum", "maximum_scalar", "maximum_inplace"),
        Binary::Minimum => ("minimum", "minimum_scalar", "minimum_inplace"),
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn binary(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    (a, a_dims): Src<'_>,
    (b, b_dims): Src<'_>,
    (out, out_dims): Dst<'_>,
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let n = size(out_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    if op == Binary::Div && !dtype.is_float() {
        // The divisor is checked by the kernel; a 0 is reported at the next wait.
        let f = gpu.kernels.one(ctx, "div_checked", dtype)?;
        let (mode, strided) = broadcast(ctx, a_dims, b_dims, out_dims)?;
        return checked_launch(
            ctx,
            gpu,
            || Refusal::Zero(on_zero()),
            |flag, key| {
                // SAFETY: div_checked_<T>(const T* a, const T* b, T* out, u64 n, int mode,
                // Strided s, u64* flag, u64 key); the three buffers are locked storage of
                // `gpu`, addressed within their sizes by `mode` and `s`; `flag` is the
                // device's check word, which lives as long as the device.
                unsafe {
                    launch!(ctx, gpu, f, linear(gpu, n);
                        pa = a.ptr(), pb = b.ptr(), po = out.ptr(), count = n, m = mode,
                        s = strided, pf = flag, k = key)
                }
            },
        );
    }
    let f = gpu.kernels.one(ctx, binary_name(op).0, dtype)?;
    launch_broadcast(ctx, gpu, f, (a, a_dims), (b, b_dims), (out, out_dims))
}

pub(crate) fn binary_scalar(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    a: &DeviceBuffer,
    value: f64,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let n = elements(out, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, binary_name(op).1, dtype)?;
    launch_map(ctx, gpu, f, (a, out), n, scalar(dtype, value))
}

fn compare_name(op: Compare) -> (&'static str, &'static str) {
    match op {
        Compare::Gt => ("gt", "gt_scalar"),
        Compare::Lt => ("lt", "lt_scalar"),
        Compare::Eq => ("eq", "eq_scalar"),
    }
}

pub(crate) fn compare(
    ctx: &Ctx,
    op: Compare,
    dtype: DType,
    (a, a_dims): Src<'_>,
    (b, b_dims): Src<'_>,
    (out, out_dims): Dst<'_>,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let n = size(out_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, compare_name(op).0, dtype)?;
    launch_broadcast(ctx, gpu, f, (a, a_dims), (b, b_dims), (out, out_dims))
}

pub(crate) fn compare_scalar(
    ctx: &Ctx,
    op: Compare,
    dtype: DType,
    a: &DeviceBuffer,
    value: f64,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let n = elements(a, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, compare_name(op).1, dtype)?;
    launch_map(ctx, gpu, f, (a, out), n, value)
}

fn unary_name(op: Unary) -> &'static str {
    match op {
        Unary::Neg => "neg",
        Unary::Abs => "abs",
        Unary::Square => "square",
        Unary::Relu => "relu",
        Unary::Exp => "exp",
        Unary::Log => "log",
        Unary::Sqrt => "sqrt",
        Unary::Tanh => "tanh",
        Unary::Sigmoid => "sigmoid",
    }
}

pub(crate) fn unary(
    ctx: &Ctx,
    op: Unary,
    dtype: DType,
    a: &DeviceBuffer,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let n = elements(out, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, unary_name(op), dtype)?;
    // SAFETY: <op>_<T>(const T* a, T* out, u64 n); locked storage of `gpu`.
    unsafe { launch!(ctx, gpu, f, linear(gpu, n); pa = a.ptr(), po = out.ptr(), count = n) }
}

pub(crate) fn pow_scalar(
    ctx: &Ctx,
    dtype: DType,
    a: &DeviceBuffer,
    exponent: f64,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let n = elements(out, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "pow", dtype)?;
    launch_map(ctx, gpu, f, (a, out), n, exponent)
}

// ---- in place ----

/// The source operand of an in-place kernel: its address and addressing mode (the target
/// itself, `MODE_SELF`, when `src` is `None`).
fn inplace_operand(
    ctx: &Ctx,
    x: (&DeviceBuffer, &[usize]),
    src: Option<Src<'_>>,
) -> Result<(CUdeviceptr, i32, Strided)> {
    match src {
        None => Ok((x.0.ptr(), MODE_SELF, Strided::none())),
        Some((b, b_dims)) => {
            same_gpu(ctx, &[x.0.gpu(), b.gpu()])?;
            let (mode, s) = inplace_source(ctx, x.1, b_dims)?;
            Ok((b.ptr(), mode, s))
        }
    }
}

pub(crate) fn binary_inplace(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    (x, x_dims): Dst<'_>,
    src: Option<Src<'_>>,
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    let gpu = x.gpu();
    let n = size(x_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    let (b, mode, strided) = inplace_operand(ctx, (x, x_dims), src)?;
    if op == Binary::Div && !dtype.is_float() {
        // The divisor is checked by the kernel; a 0 is reported at the next wait.
        let f = gpu.kernels.one(ctx, "div_checked_inplace", dtype)?;
        return checked_launch(
            ctx,
            gpu,
            || Refusal::Zero(on_zero()),
            |flag, key| {
                // SAFETY: div_checked_inplace_<T>(T* x, const T* b, u64 n, int mode, Strided s,
                // u64* flag, u64 key); locked storage of `gpu`, the source addressed within its
                // size; `flag` is the device's check word.
                unsafe {
                    launch!(ctx, gpu, f, linear(gpu, n);
                        px = x.ptr(), pb = b, count = n, m = mode, s = strided, pf = flag,
                        k = key)
                }
            },
        );
    }
    let f = gpu.kernels.one(ctx, binary_name(op).2, dtype)?;
    // SAFETY: <op>_inplace_<T>(T* x, const T* b, u64 n, int mode, Strided s); locked storage of
    // `gpu`, the source addressed within its size.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            px = x.ptr(), pb = b, count = n, m = mode, s = strided)
    }
}

pub(crate) fn scale_inplace(
    ctx: &Ctx,
    dtype: DType,
    x: &mut DeviceBuffer,
    value: f64,
) -> Result<()> {
    let gpu = x.gpu();
    let n = elements(x, dtype);
    if n == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "scale", dtype)?;
    // SAFETY: scale_<T>(T* x, u64 n, T v); locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n); px = x.ptr(), count = n, v = scalar(dtype, value))
    }
}

pub(crate) fn axpy(
    ctx: &Ctx,
    dtype: DType,
    (x, x_dims): Dst<'_>,
    alpha: f64,
    src: Option<Src<'_>>,
) -> Result<()> {
    let gpu = x.gpu();
    let n = size(x_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    let (b, mode, strided) = inplace_operand(ctx, (x, x_dims), src)?;
    axpy_raw(ctx, gpu, dtype, (x.ptr(), n), alpha, (b, mode, strided))
}

/// `x += alpha · b` over `n` elements at `x`.
fn axpy_raw(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (x, n): (CUdeviceptr, u64),
    alpha: f64,
    (b, mode, strided): (CUdeviceptr, i32, Strided),
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "axpy", dtype)?;
    // SAFETY: axpy_<T>(T* x, const T* b, u64 n, T alpha, int mode, Strided s); both are locked
    // storage of `gpu` (callers pass their arrays' addresses), the source addressed within its
    // size.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            px = x, pb = b, count = n, a = scalar(dtype, alpha), m = mode, s = strided)
    }
}

/// `dst[i] = src[offset(i)]` for `dst` of `dst_dims` and source strides `src_strides` (per dst
/// dim), moving elements of `elem` bytes.
#[allow(clippy::too_many_arguments)]
fn gather(
    ctx: &Ctx,
    gpu: &Gpu,
    elem: usize,
    (src, src_len, src_strides): (CUdeviceptr, usize, Vec<usize>),
    (dst, dst_dims): (CUdeviceptr, &[usize]),
) -> Result<()> {
    let n = size(dst_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    // The length shortcut of `addressing` assumes an operand as long as the output is laid out
    // like it, which holds for broadcasting but not for a permutation: a gather is a plain copy
    // only when the source strides are the destination's own.
    if src_strides == contiguous_strides(dst_dims) {
        return copy_bytes(ctx, gpu, src, dst, n as usize * elem);
    }
    let unused = vec![0; dst_dims.len()];
    let (mode, strided) = addressing(ctx, dst_dims, (src_len, src_strides), (1, unused), false)?;
    let f = gpu.kernels.sized(ctx, "gather", elem)?;
    // SAFETY: gather_b<N>(const T* src, T* dst, u64 n, int mode, Strided s); locked storage of
    // `gpu`, the source addressed within its size.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            ps = src, pd = dst, count = n, m = mode, s = strided)
    }
}

pub(crate) fn assign(
    ctx: &Ctx,
    dtype: DType,
    (x, x_dims): Dst<'_>,
    (src, src_dims): Src<'_>,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[x.gpu(), src.gpu()])?;
    gather(
        ctx,
        gpu,
        dtype.size_in_bytes(),
        (
            src.ptr(),
            size(src_dims),
            broadcast_strides(src_dims, x_dims),
        ),
        (x.ptr(), x_dims),
    )
}

// ---- reductions ----

/// Slices the reduced axis of `pass` is split into, each reduced by its own blocks into a
/// partial result (a second launch reduces those): enough blocks to fill the device when the
/// rows (inner == 1) or the 32-column groups (inner > 1) are few and long; 1 otherwise.
fn chunks_for(gpu: &Gpu, pass: Pass) -> usize {
    let wanted = 4 * gpu.sms as usize;
    if pass.inner == 1 {
        if pass.n < (1 << 16) || pass.outer >= wanted {
            return 1;
        }
        return (pass.n / 8192).clamp(1, wanted / pass.outer.max(1)).max(1);
    }
    let groups = (pass.outer * pass.inner).div_ceil(32);
    if pass.n < (1 << 12) || groups >= wanted {
        return 1;
    }
    (pass.n / 1024).clamp(1, wanted / groups.max(1)).max(1)
}

/// Threads per row (a power of two, at most a block) for rows of `len` contiguous elements:
/// about four elements each, so short rows share a block and long ones get a whole block.
fn threads_per_row(len: usize) -> u32 {
    len.div_ceil(4)
        .next_power_of_two()
        .clamp(1, THREADS as usize) as u32
}

/// Launch shape of a kernel over `[outer, n, inner]` in `chunks` slices per row (kernels.cu's
/// `fold`, `argmax`, `softmax`), and the threads per row segment it uses when inner == 1:
/// 1-d blocks of `THREADS / tpr` row segments, or 32 × 8 blocks over 32 columns.
fn fold_config(gpu: &Gpu, pass: Pass, chunks: usize) -> (Config, u32) {
    if pass.inner == 1 {
        let tpr = threads_per_row(pass.n.div_ceil(chunks.max(1)));
        let cfg = Config {
            blocks: blocks(gpu, (pass.outer * chunks) as u64, u64::from(THREADS / tpr)),
            threads: (THREADS, 1),
        };
        (cfg, tpr)
    } else {
        let groups = (pass.outer * pass.inner).div_ceil(32) * chunks;
        let cfg = Config {
            blocks: blocks(gpu, groups as u64, 1),
            threads: (32, 8),
        };
        (cfg, 1)
    }
}

/// One `sum_<in>_<out>` launch.
#[allow(clippy::too_many_arguments)]
fn sum_launch(
    ctx: &Ctx,
    gpu: &Gpu,
    (x, from): (CUdeviceptr, DType),
    (out, to): (CUdeviceptr, DType),
    pass: Pass,
    chunks: usize,
    mean: Option<f64>,
) -> Result<()> {
    let f = gpu.kernels.two(ctx, "sum", from, to)?;
    let (cfg, tpr) = fold_config(gpu, pass, chunks);
    // SAFETY: sum_<in>_<out>(const In* x, Out* out, u64 outer, u64 n, u64 inner, u64 chunks,
    // int mean, f64 count, u32 tpr); `x` and `out` are locked storage or scratch of `gpu` sized
    // for the pass.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = x, po = out, outer = pass.outer as u64, len = pass.n as u64,
            inner = pass.inner as u64, parts = chunks as u64,
            m = i32::from(mean.is_some()), count = mean.unwrap_or(1.0), t = tpr)
    }
}

/// The accumulator dtype of sums of `from`.
fn accumulator(from: DType) -> DType {
    if from.is_float() {
        DType::F64
    } else {
        DType::I64
    }
}

/// Folds one pass of a sum from `x` (`from`) into `out` (`to`), through partial sums in
/// `partial` when the rows are long and few.
#[allow(clippy::too_many_arguments)]
fn sum_pass(
    ctx: &Ctx,
    gpu: &Gpu,
    x: (CUdeviceptr, DType),
    out: (CUdeviceptr, DType),
    pass: Pass,
    mean: Option<f64>,
    partial: CUdeviceptr,
) -> Result<()> {
    let chunks = chunks_for(gpu, pass);
    if chunks == 1 {
        return sum_launch(ctx, gpu, x, out, pass, 1, mean);
    }
    let acc = accumulator(x.1);
    sum_launch(ctx, gpu, x, (partial, acc), pass, chunks, None)?;
    // The partial sums, [outer, chunks, inner].
    let second = Pass {
        outer: pass.outer,
        n: chunks,
        inner: pass.inner,
    };
    sum_launch(ctx, gpu, (partial, acc), out, second, 1, mean)
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sum(
    ctx: &Ctx,
    from: DType,
    to: DType,
    (a, dims): Src<'_>,
    mask: &[bool],
    out: &mut DeviceBuffer,
    mean: bool,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    if out.bytes() == 0 {
        return Ok(());
    }
    let passes = reduction_passes(dims, mask);
    if passes.is_empty() {
        // Every reduced axis has size 1: the sum (and the mean) of one element is that element.
        return convert(ctx, from, to, a, out);
    }
    let count: usize = dims
        .iter()
        .zip(mask)
        .filter(|(_, &r)| r)
        .map(|(&d, _)| d)
        .product();
    sum_passes(
        ctx,
        gpu,
        (a.ptr(), from),
        (out.ptr(), to),
        &passes,
        mean.then_some(count as f64),
    )
}

/// Runs the passes of a sum, accumulating between passes in scratch memory.
fn sum_passes(
    ctx: &Ctx,
    gpu: &Gpu,
    x: (CUdeviceptr, DType),
    out: (CUdeviceptr, DType),
    passes: &[Pass],
    mean: Option<f64>,
) -> Result<()> {
    let acc = accumulator(x.1);
    // Scratch: two accumulator buffers (one pass's output is the next one's input), then the
    // partial sums of a split pass.
    let intermediate = &passes[..passes.len().saturating_sub(1)];
    let largest = intermediate
        .iter()
        .map(|p| p.outer * p.inner)
        .max()
        .unwrap_or(0);
    let partials = passes
        .iter()
        .map(|p| p.outer * p.inner * chunks_for(gpu, *p))
        .max()
        .unwrap_or(0);
    let word = acc.size_in_bytes();
    let mut scratch = gpu.scratch();
    let base = scratch.ensure(ctx, gpu, (2 * largest + partials + 1) * word)?;
    let tmp = [base, base + (largest * word) as u64];
    let partial = base + (2 * largest * word) as u64;
    let mut input = x;
    for (i, pass) in passes.iter().enumerate() {
        let last = i + 1 == passes.len();
        let target = if last { out } else { (tmp[i % 2], acc) };
        sum_pass(
            ctx,
            gpu,
            input,
            target,
            *pass,
            if last { mean } else { None },
            partial,
        )?;
        input = (target.0, acc);
    }
    Ok(())
}

pub(crate) fn sum_all(
    ctx: &Ctx,
    from: DType,
    to: DType,
    a: &DeviceBuffer,
    out: &mut DeviceBuffer,
    mean: bool,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let n = elements(a, from) as usize;
    let pass = Pass {
        outer: 1,
        n,
        inner: 1,
    };
    sum_passes(
        ctx,
        gpu,
        (a.ptr(), from),
        (out.ptr(), to),
        &[pass],
        mean.then_some(n as f64),
    )
}

fn max_launch(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (x, out): (CUdeviceptr, CUdeviceptr),
    pass: Pass,
    chunks: usize,
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "max", dtype)?;
    let (cfg, tpr) = fold_config(gpu, pass, chunks);
    // SAFETY: max_<T>(const T* x, T* out, u64 outer, u64 n, u64 inner, u64 chunks, u32 tpr);
    // locked storage or scratch of `gpu` sized for the pass.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = x, po = out, outer = pass.outer as u64, len = pass.n as u64,
            inner = pass.inner as u64, parts = chunks as u64, t = tpr)
    }
}

pub(crate) fn max_axis(
    ctx: &Ctx,
    dtype: DType,
    a: &DeviceBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    if outer * inner == 0 {
        return Ok(());
    }
    let pass = Pass { outer, n, inner };
    let chunks = chunks_for(gpu, pass);
    if chunks == 1 {
        return max_launch(ctx, gpu, dtype, (a.ptr(), out.ptr()), pass, 1);
    }
    let mut scratch = gpu.scratch();
    let partial = scratch.ensure(ctx, gpu, outer * chunks * inner * dtype.size_in_bytes())?;
    max_launch(ctx, gpu, dtype, (a.ptr(), partial), pass, chunks)?;
    // The partial maxima, [outer, chunks, inner].
    let second = Pass {
        outer,
        n: chunks,
        inner,
    };
    max_launch(ctx, gpu, dtype, (partial, out.ptr()), second, 1)
}

pub(crate) fn argmax_axis(
    ctx: &Ctx,
    dtype: DType,
    a: &DeviceBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let columns = (outer * inner) as u64;
    if columns == 0 {
        return Ok(());
    }
    let f = gpu.kernels.one(ctx, "argmax", dtype)?;
    let pass = Pass { outer, n, inner };
    // Few long rows are split into slices (inner == 1 only): partial (value, index) pairs in
    // scratch, then `argmax_parts`.
    let chunks = if inner == 1 { chunks_for(gpu, pass) } else { 1 };
    let (cfg, tpr) = fold_config(gpu, pass, chunks);
    if chunks == 1 {
        // SAFETY: argmax_<T>(const T* x, i64* out, u64 outer, u64 n, u64 inner, u32 tpr,
        // u64 chunks, T* part_v, i64* part_i); locked storage of `gpu`; with one chunk the
        // partial arrays are not touched (`out` stands in for them).
        return unsafe {
            launch!(ctx, gpu, f, cfg;
                px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64,
                i = inner as u64, t = tpr, parts = 1u64, pv = out.ptr(), pi = out.ptr())
        };
    }
    let segments = outer * chunks;
    let elem = dtype.size_in_bytes();
    let mut scratch = gpu.scratch();
    // The indices first (8-byte aligned), then the values.
    let part_i = scratch.ensure(ctx, gpu, segments * (8 + elem))?;
    let part_v = part_i + (segments * 8) as u64;
    // SAFETY: as above; `part_v` and `part_i` are scratch of `gpu` (held under its lock) with
    // room for `outer · chunks` values and indices.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64, i = inner as u64,
            t = tpr, parts = chunks as u64, pv = part_v, pi = part_i)?
    };
    let g = gpu.kernels.one(ctx, "argmax_parts", dtype)?;
    let (cfg, tpr) = fold_config(
        gpu,
        Pass {
            outer,
            n: chunks,
            inner: 1,
        },
        1,
    );
    // SAFETY: argmax_parts_<T>(const T* part_v, const i64* part_i, i64* out, u64 outer,
    // u64 chunks, u32 tpr); the scratch written just before (stream order) and `out`, locked
    // storage of `gpu` with `outer` indices.
    unsafe {
        launch!(ctx, gpu, g, cfg;
            pv = part_v, pi = part_i, po = out.ptr(), o = outer as u64, c = chunks as u64,
            t = tpr)
    }
}

// ---- matrix products ----

fn int_dim(ctx: &Ctx, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        ctx.unsupported(format!(
            "cuBLAS products take dimensions up to {}; got {value}",
            i32::MAX
        ))
    })
}

/// Most products of one strided batched cuBLAS call: cuBLAS puts the batch in a grid dimension
/// limited to 65535 blocks, so larger batches are split into several calls.
const MAX_BLAS_BATCH: usize = 65_535;

/// `blas_batch` over any number of products: at most [`MAX_BLAS_BATCH`] per cuBLAS call.
#[allow(clippy::too_many_arguments)]
fn blas_gemm(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    dims: (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    scales: (f64, f64),
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    let elem = dtype.size_in_bytes() as u64;
    let mut done = 0;
    while done < batch {
        let count = (batch - done).min(MAX_BLAS_BATCH);
        let at = |base: CUdeviceptr, step: usize| base + (done * step) as u64 * elem;
        blas_batch(
            ctx,
            gpu,
            dtype,
            dims,
            (at(a, steps.0), ta),
            (at(b, steps.1), tb),
            at(c, steps.2),
            scales,
            (count, steps),
        )?;
        done += count;
    }
    Ok(())
}

/// `c = beta·c + alpha·op(a)·op(b)` for `batch` (at most [`MAX_BLAS_BATCH`]) row-major float
/// products (`a` `[m, k]`, or `[k, m]` with `ta`; `b` `[k, n]`, or `[n, k]` with `tb`), the
/// i-th at element offsets `i·steps`. A row-major product is the column-major product of the
/// transposes, so cuBLAS computes `cᵀ = op(b)ᵀ · op(a)ᵀ`.
#[allow(clippy::too_many_arguments)]
fn blas_batch(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    (beta, alpha): (f64, f64),
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    let op = |t: bool| {
        if t {
            blas::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (bm, bn, bk) = (int_dim(ctx, n)?, int_dim(ctx, m)?, int_dim(ctx, k)?);
    let ldb = int_dim(ctx, if tb { k } else { n })?;
    let lda = int_dim(ctx, if ta { m } else { k })?;
    let ldc = int_dim(ctx, n)?;
    let count = int_dim(ctx, batch)?;
    let (sa, sb, sc) = (steps.0 as i64, steps.1 as i64, steps.2 as i64);
    gpu.bind(ctx)?;
    let mut handle = gpu.blas();
    handle.prepare(ctx, gpu)?;
    let h = handle.handle;
    // SAFETY: the handle is used under its lock on the device's stream; `a`, `b` and `c` are
    // locked storage of `gpu` holding the products' operands as described (cuBLAS reads within
    // the leading dimensions and strides given); alpha and beta are host values that outlive
    // the call (cuBLAS reads them before returning, in host pointer mode).
    let status = unsafe {
        match dtype {
            DType::F32 => {
                let (alpha, beta) = (alpha as f32, beta as f32);
                if batch == 1 {
                    blas::cublasSgemm_v2(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f32,
                        ldb,
                        a as *const f32,
                        lda,
                        &beta,
                        c as *mut f32,
                        ldc,
                    )
                } else {
                    blas::cublasSgemmStridedBatched(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f32,
                        ldb,
                        sb,
                        a as *const f32,
                        lda,
                        sa,
                        &beta,
                        c as *mut f32,
                        ldc,
                        sc,
                        count,
                    )
                }
            }
            _ => {
                if batch == 1 {
                    blas::cublasDgemm_v2(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f64,
                        ldb,
                        a as *const f64,
                        lda,
                        &beta,
                        c as *mut f64,
                        ldc,
                    )
                } else {
                    blas::cublasDgemmStridedBatched(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f64,
                        ldb,
                        sb,
                        a as *const f64,
                        lda,
                        sa,
                        &beta,
                        c as *mut f64,
                        ldc,
                        sc,
                        count,
                    )
                }
            }
        }
    };
    status
        .result()
        .map_err(|e| blas_error(ctx, "cuBLAS gemm", e))
}

/// `c = beta·c + alpha·op(a)·op(b)` (or `= op(a)·op(b)` without `accumulate`) for integers.
#[allow(clippy::too_many_arguments)]
fn int_gemm(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    accumulate: Option<(f64, f64)>,
    (batch, steps): (usize, (usize, usize)),
) -> Result<()> {
    let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
    let (beta, alpha) = accumulate.unwrap_or((0.0, 1.0));
    let f = gpu.kernels.one(ctx, "matmul", dtype)?;
    let total = (batch * m * n) as u64;
    // SAFETY: matmul_<T>(const T* a, const T* b, T* c, u64 m, u64 k, u64 n, u64 a_rs, u64 a_cs,
    // u64 b_rs, u64 b_cs, u64 batch, u64 a_step, u64 b_step, int accumulate, T beta, T alpha);
    // locked storage of `gpu` holding the operands as described.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, total);
            pa = a, pb = b, pc = c, rows = m as u64, inner = k as u64, cols = n as u64,
            ars = a_rs as u64, acs = a_cs as u64, brs = b_rs as u64, bcs = b_cs as u64,
            count = batch as u64, astep = steps.0 as u64, bstep = steps.1 as u64,
            acc = i32::from(accumulate.is_some()), be = scalar(dtype, beta), al = scalar(dtype, alpha))
    }
}

/// The product with the edge cases handled: nothing to compute for an empty result, and for
/// `k == 0` the result is `beta·c` (or zeros), which cuBLAS would refuse (its leading dimension
/// would be 0).
#[allow(clippy::too_many_arguments)]
fn product(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    a: (CUdeviceptr, bool),
    b: (CUdeviceptr, bool),
    c: (CUdeviceptr, usize),
    accumulate: Option<(f64, f64)>,
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let (c, c_len) = c;
    if k == 0 {
        return match accumulate {
            // `beta = 0` does not read `c` (a NaN there must not survive as 0·NaN).
            Some((beta, _)) if beta != 0.0 => {
                let f = gpu.kernels.one(ctx, "scale", dtype)?;
                // SAFETY: scale_<T>(T* x, u64 n, T v); `c` is locked storage of `gpu` with
                // `c_len` elements.
                unsafe {
                    launch!(ctx, gpu, f, linear(gpu, c_len as u64);
                        px = c, count = c_len as u64, v = scalar(dtype, beta))
                }
            }
            _ => memset(ctx, gpu, c, 0, c_len * dtype.size_in_bytes()),
        };
    }
    if dtype.is_float() {
        blas_gemm(
            ctx,
            gpu,
            dtype,
            (m, k, n),
            a,
            b,
            c,
            accumulate.unwrap_or((0.0, 1.0)),
            (batch, steps),
        )
    } else {
        int_gemm(
            ctx,
            gpu,
            dtype,
            (m, k, n),
            a,
            b,
            c,
            accumulate,
            (batch, (steps.0, steps.1)),
        )
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    ctx: &Ctx,
    dtype: DType,
    batch: Option<(Batched, usize)>,
    (m, k, n): (usize, usize, usize),
    a: &DeviceBuffer,
    b: &DeviceBuffer,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let c = (out.ptr(), elements(out, dtype) as usize);
    let (count, (m, steps)) = match batch {
        None => (1, (m, (0, 0, 0))),
        // A shared right operand: one product of (batch·m) rows.
        Some((Batched::Left, batch)) => (1, (batch * m, (0, 0, 0))),
        Some((Batched::Both, batch)) => (batch, (m, (m * k, k * n, m * n))),
        Some((Batched::Right, batch)) => (batch, (m, (0, k * n, m * n))),
    };
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (a.ptr(), false),
        (b.ptr(), false),
        c,
        None,
        (count, steps),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (&DeviceBuffer, bool),
    (b, tb): (&DeviceBuffer, bool),
    out: &mut DeviceBuffer,
    accumulate: Option<(f64, f64)>,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let c = (out.ptr(), elements(out, dtype) as usize);
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (a.ptr(), ta),
        (b.ptr(), tb),
        c,
        accumulate,
        (1, (0, 0, 0)),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_dense(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (x, g): (&DeviceBuffer, &DeviceBuffer),
    (v, w): (&mut DeviceBuffer, &mut DeviceBuffer),
    lr: f64,
    momentum: f64,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[x.gpu(), g.gpu(), v.gpu(), w.gpu()])?;
    let len = m * n;
    if len == 0 {
        return Ok(());
    }
    // v ← momentum·v + xᵀ·g, then w ← w − lr·v: two launches, in stream order. Without
    // momentum the old v is not read (a plain product: cuBLAS with beta 0, or zeros for an
    // empty batch), as on the CPU: a NaN left in v does not survive.
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (x.ptr(), true),
        (g.ptr(), false),
        (v.ptr(), len),
        (momentum != 0.0).then_some((momentum, 1.0)),
        (1, (0, 0, 0)),
    )?;
    axpy_raw(
        ctx,
        gpu,
        dtype,
        (w.ptr(), len as u64),
        -lr,
        (v.ptr(), MODE_SAME, Strided::none()),
    )
}

// ---- neural-network ops ----

/// Softmax of few long rows, each split into `chunks` slices over the device: three launches
/// of `softmax_split` (slice maxima, slice sums of exponentials, the result) with the partial
/// results in scratch.
fn softmax_split(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (a, out): (&DeviceBuffer, &mut DeviceBuffer),
    (outer, n, chunks): (usize, usize, usize),
    log: bool,
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "softmax_split", dtype)?;
    let segments = outer * chunks;
    let mut scratch = gpu.scratch();
    // The f64 sums first (8-byte aligned), then the maxima.
    let part_s = scratch.ensure(ctx, gpu, segments * (8 + dtype.size_in_bytes()))?;
    let part_m = part_s + (segments * 8) as u64;
    let cfg = Config {
        blocks: blocks(gpu, segments as u64, 1),
        threads: (THREADS, 1),
    };
    for phase in 0..3i32 {
        // SAFETY: softmax_split_<T>(const T* x, T* out, u64 outer, u64 n, u64 chunks, int log,
        // int phase, T* part_m, f64* part_s); `a` and `out` are locked storage of `gpu` with
        // outer·n elements; `part_m`/`part_s` scratch of `gpu` (under its lock) with room for
        // outer·chunks values each; the phases run in stream order.
        unsafe {
            launch!(ctx, gpu, f, cfg;
                px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64,
                c = chunks as u64, lg = i32::from(log), ph = phase, pm = part_m, ps = part_s)?
        };
    }
    Ok(())
}

pub(crate) fn softmax(
    ctx: &Ctx,
    dtype: DType,
    a: &DeviceBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut DeviceBuffer,
    log: bool,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
    let columns = (outer * inner) as u64;
    if columns == 0 || n == 0 {
        return Ok(());
    }
    if inner == 1 {
        let chunks = chunks_for(gpu, Pass { outer, n, inner });
        if chunks > 1 {
            return softmax_split(ctx, gpu, dtype, (a, out), (outer, n, chunks), log);
        }
    }
    let f = gpu.kernels.one(ctx, "softmax", dtype)?;
    let (cfg, tpr) = fold_config(gpu, Pass { outer, n, inner }, 1);
    // SAFETY: softmax_<T>(const T* x, T* out, u64 outer, u64 n, u64 inner, int log, u32 tpr);
    // locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64, i = inner as u64,
            lg = i32::from(log), t = tpr)
    }
}

/// Indices on a CUDA device are checked by the kernels that use them (`pick`, `one_hot`): a
/// bad one is reported at the next wait for the device, with the op and its call site, so
/// nothing is checked here and no op waits for the device.
pub(crate) fn first_bad_index(
    _ctx: &Ctx,
    _dtype: DType,
    _indices: &DeviceBuffer,
    _bound: usize,
) -> Result<Option<(usize, i64)>> {
    Ok(None)
}

/// The error for indices into an empty range, which every index is outside.
fn empty_range(ctx: &Ctx, count: u64, from: DType, what: &str) -> Error {
    ctx.invalid(format!(
        "the index at flat position 0 of the {count} {from} indices is out of range: it must be \
         at least 0 and below {what}, 0"
    ))
}

pub(crate) fn one_hot(
    ctx: &Ctx,
    (from, to): (DType, DType),
    indices: &DeviceBuffer,
    depth: usize,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[indices.gpu(), out.gpu()])?;
    let count = elements(indices, from);
    let total = count * depth as u64;
    if depth == 0 && count > 0 {
        // No index is below 0: known without looking.
        return Err(empty_range(ctx, count, from, "the depth"));
    }
    if total == 0 {
        return Ok(());
    }
    let f = gpu.kernels.two(ctx, "one_hot", from, to)?;
    let refusal = || Refusal::Index {
        count,
        from,
        bound: depth,
        what: "the depth",
    };
    checked_launch(ctx, gpu, refusal, |flag, key| {
        // SAFETY: one_hot_<I>_<T>(const I* idx, T* out, u64 count, u64 depth, u64* flag,
        // u64 key); locked storage of `gpu` (`out` holds count·depth elements); `flag` is the
        // device's check word.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, total);
                pi = indices.ptr(), po = out.ptr(), n = count, d = depth as u64, pf = flag,
                k = key)
        }
    })
}

pub(crate) fn pick(
    ctx: &Ctx,
    (dtype, from): (DType, DType),
    x: &DeviceBuffer,
    (n, inner): (usize, usize),
    indices: &DeviceBuffer,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[x.gpu(), indices.gpu(), out.gpu()])?;
    let count = elements(indices, from);
    if n == 0 && count > 0 {
        return Err(empty_range(ctx, count, from, "the size of the axis"));
    }
    if count == 0 || inner == 0 {
        return Ok(());
    }
    let f = gpu.kernels.two(ctx, "pick", dtype, from)?;
    let refusal = || Refusal::Index {
        count,
        from,
        bound: n,
        what: "the size of the axis",
    };
    checked_launch(ctx, gpu, refusal, |flag, key| {
        // SAFETY: pick_<T>_<I>(const T* x, const I* idx, T* out, u64 count, u64 n, u64 inner,
        // u64* flag, u64 key); locked storage of `gpu`; indices outside the axis read nothing;
        // `flag` is the device's check word.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, count);
                px = x.ptr(), pi = indices.ptr(), po = out.ptr(), c = count, len = n as u64,
                i = inner as u64, pf = flag, k = key)
        }
    })
}

// ---- shape / gather ----

pub(crate) fn transpose(
    ctx: &Ctx,
    dtype: DType,
    src: &DeviceBuffer,
    (rows, cols): (usize, usize),
    dst: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let f = gpu.kernels.sized(ctx, "transpose", dtype.size_in_bytes())?;
    let tiles = (rows.div_ceil(32) * cols.div_ceil(32)) as u64;
    let cfg = Config {
        blocks: blocks(gpu, tiles, 1),
        threads: (32, 8),
    };
    // SAFETY: transpose_b<N>(const T* src, T* dst, u64 rows, u64 cols); locked storage of `gpu`
    // holding rows·cols elements each.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            ps = src.ptr(), pd = dst.ptr(), r = rows as u64, c = cols as u64)
    }
}

pub(crate) fn permute(
    ctx: &Ctx,
    dtype: DType,
    (src, dims): Src<'_>,
    perm: &[usize],
    dst: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
    let in_strides = contiguous_strides(dims);
    let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
    gather(
        ctx,
        gpu,
        dtype.size_in_bytes(),
        (src.ptr(), size(dims), strides),
        (dst.ptr(), &out_dims),
    )
}

/// Copies `rows` rows of `cols` elements of `elem` bytes between pitched layouts.
#[allow(clippy::too_many_arguments)]
fn copy_rows(
    ctx: &Ctx,
    gpu: &Gpu,
    elem: usize,
    (src, src_pitch): (CUdeviceptr, usize),
    (dst, dst_pitch): (CUdeviceptr, usize),
    (rows, cols): (usize, usize),
) -> Result<()> {
    let total = (rows * cols) as u64;
    if total == 0 {
        return Ok(());
    }
    let f = gpu.kernels.sized(ctx, "copy_rows", elem)?;
    // SAFETY: copy_rows_b<N>(const T* src, T* dst, u64 rows, u64 cols, u64 src_pitch,
    // u64 dst_pitch); both ranges lie inside locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, total);
            ps = src, pd = dst, r = rows as u64, c = cols as u64, sp = src_pitch as u64,
            dp = dst_pitch as u64)
    }
}

pub(crate) fn narrow(
    ctx: &Ctx,
    elem: usize,
    src: &DeviceBuffer,
    (outer, n, inner): (usize, usize, usize),
    start: usize,
    dst: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
    let row = dst.bytes().checked_div(outer * elem).unwrap_or(0);
    let offset = (start * inner * elem) as u64;
    copy_rows(
        ctx,
        gpu,
        elem,
        (src.ptr() + offset, n * inner),
        (dst.ptr(), row),
        (outer, row),
    )
}

pub(crate) fn interleave(
    ctx: &Ctx,
    srcs: &[&DeviceBuffer],
    row_bytes: &[usize],
    outer: usize,
    dst: &mut DeviceBuffer,
) -> Result<()> {
    let mut gpus: Vec<&Gpu> = srcs.iter().map(|s| s.gpu()).collect();
    gpus.push(dst.gpu());
    let gpu = same_gpu(ctx, &gpus)?;
    let total: usize = row_bytes.iter().sum();
    // Rows are whole elements: copy them as the widest element size dividing every length.
    let elem = [8, 4, 1]
        .into_iter()
        .find(|&e| total.is_multiple_of(e) && row_bytes.iter().all(|b| b.is_multiple_of(e)))
        .unwrap_or(1);
    let mut at = 0;
    for (src, &len) in srcs.iter().zip(row_bytes) {
        copy_rows(
            ctx,
            gpu,
            elem,
            (src.ptr(), len / elem),
            (dst.ptr() + at as u64, total / elem),
            (outer, len / elem),
        )?;
        at += len;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the loaded CUDA driver is the CPU simulator of `shared/cudasim` (it exports
    /// `cudasim_stats`; a real driver does not).
    fn on_the_simulator() -> bool {
        // SAFETY: only asks whether the driver is already loaded (RTLD_NOLOAD loads nothing)
        // and looks a symbol up in it; the handle is closed again.
        unsafe {
            let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
            if lib.is_null() {
                return false;
            }
            let found = !libc::dlsym(lib, c"cudasim_stats".as_ptr()).is_null();
            libc::dlclose(lib);
            found
        }
    }

    /// Device 0, or `None` after saying why the test skips (a failure under
    /// `NDSCOPE_REQUIRE_GPU=1`).
    fn test_gpu(ctx: &Ctx) -> Option<&'static Gpu> {
        match super::super::device::gpu(ctx, 0) {
            Ok(gpu) => Some(gpu),
            Err(e) => {
                if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
                    panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU: {e}");
                }
                println!("skipped on cuda: {e}");
                None
            }
        }
    }

    /// The first f32 of device memory at `ptr`, read through the device address as a host
    /// address (the simulator's device pointers are host addresses).
    ///
    /// # Safety
    /// Only on the simulator, with `ptr` the start of a live allocation of at least 4 bytes.
    unsafe fn peek(ptr: CUdeviceptr) -> u32 {
        // SAFETY: per the contract; volatile, since the simulator writes it behind our back.
        unsafe { std::ptr::read_volatile(ptr as usize as *const u32) }
    }

    /// `synchronize` waits for work queued before it. Reading values through ndscope waits
    /// anyway, so this looks at the device memory directly, which only the simulator allows:
    /// it runs queued work as late as CUDA permits (when the host waits), so a fill queued
    /// and not waited for has not happened yet, and must have once `synchronize` returns.
    #[test]
    fn synchronize_runs_queued_work_before_returning() {
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        if !on_the_simulator() {
            println!("skipped: needs the CPU simulator of CUDA (host-readable device memory)");
            return;
        }
        if std::env::var_os("CUDASIM_SYNC").is_some_and(|v| v == "1") {
            println!("skipped: CUDASIM_SYNC=1 runs work at submission");
            return;
        }
        let n = 1024;
        let mut buf = DeviceBuffer::alloc(&ctx, gpu.ordinal, n * 4).unwrap();
        synchronize(&ctx, gpu.ordinal).unwrap();
        // SAFETY: on the simulator; `buf` is a live allocation of 4096 bytes.
        let before = unsafe { peek(buf.ptr()) };
        let value = if f32::from_bits(before) == 3.5 {
            4.5f32
        } else {
            3.5
        };
        fill(&ctx, DType::F32, &mut buf, f64::from(value)).unwrap();
        // SAFETY: as above.
        let queued = unsafe { peek(buf.ptr()) };
        assert_eq!(
            queued, before,
            "the fill ran before anything waited: the simulator runs work at submission"
        );
        synchronize(&ctx, gpu.ordinal).unwrap();
        // SAFETY: as above.
        let after = unsafe { peek(buf.ptr()) };
        assert_eq!(
            f32::from_bits(after),
            value,
            "synchronize returned before the fill queued ahead of it ran (bits {after:#x})"
        );
        drop(buf);
        synchronize(&ctx, gpu.ordinal).unwrap();
    }

    /// The driver running out of page-locked memory is `OutOfMemory` on the host, naming the
    /// size and the driver as what refused it (it was a generic backend error).
    #[test]
    fn page_locked_memory_exhaustion_is_out_of_memory() {
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        let oom = cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        match super::super::device::pinned_refusal(&ctx, gpu, 1 << 30, oom) {
            Error::OutOfMemory {
                device,
                requested,
                limit_source,
                ..
            } => {
                assert_eq!(device, crate::Device::Cpu);
                assert_eq!(requested, 1 << 30);
                assert_eq!(limit_source, crate::LimitSource::Driver);
            }
            other => panic!("expected OutOfMemory, got {other}"),
        }
    }

    /// After a device fault (a kernel writing outside every allocation), every later call on
    /// the device reports the same fault, naming the op that first met it and where that op was
    /// called. The fault leaves the device unusable for the process: run in a child process.
    #[test]
    fn a_device_fault_is_sticky_and_names_the_first_failing_op() {
        const NAME: &str =
            "backend::cuda::ops::tests::a_device_fault_is_sticky_and_names_the_first_failing_op";
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        if std::env::var_os("NDSCOPE_FAULT_CHILD").is_none() {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env("NDSCOPE_FAULT_CHILD", "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "the child run failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        let f = gpu.kernels.one(&ctx, "fill", DType::F32).unwrap();
        let bogus: CUdeviceptr = 1 << 12;
        // SAFETY: deliberately not: the kernel writes through an address outside every
        // allocation, which the device reports as a fault; this process is thrown away.
        unsafe {
            launch!(&ctx, gpu, f, linear(gpu, 1024); out = bogus, count = 1024u64, v = scalar(DType::F32, 1.0))
        }
        .unwrap();
        let first = Ctx::new("first_wait");
        let err = synchronize(&first, gpu.ordinal).expect_err("the fault is reported");
        let text = err.to_string();
        assert!(
            text.contains("the first op to fail was first_wait at"),
            "{text}"
        );
        assert!(text.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{text}");
        // Every later call, whatever it is, reports the same first failure.
        let later = Ctx::new("later");
        for err in [
            synchronize(&later, gpu.ordinal).expect_err("still faulted"),
            DeviceBuffer::alloc(&later, gpu.ordinal, 64)
                .err()
                .expect("no allocation on a faulted device"),
            gpu.bind(&later).expect_err("no context"),
        ] {
            let text = err.to_string();
            assert!(text.contains("unusable after a device fault"), "{text}");
            assert!(
                text.contains("the first op to fail was first_wait at"),
                "{text}"
            );
        }
    }
}
