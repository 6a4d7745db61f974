//! The CUDA devices: finding the libraries without panicking, and per device one context, one
//! stream, one cuBLAS handle with its workspace, the compiled kernels, page-locked staging
//! memory for host↔device copies and a scratch buffer for reductions and read-backs.
//!
//! Every piece of work of a device runs on its one stream, in order. So memory freed (with
//! `cuMemFreeAsync`) or reused by a workspace is never touched by a kernel still running from
//! before: no events are needed, and cudarc's per-allocation event tracking is off.

use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use cudarc::cublas::sys as blas;
use cudarc::driver::sys::{self, CUdeviceptr};
use cudarc::driver::{result, CudaContext, CudaEvent, CudaStream, DriverError};
use parking_lot::{Mutex, MutexGuard};

use super::cache;
use super::driver::{describe, pretend};
use super::kernels::Kernels;
use super::lt::Lt;
use crate::backend::settings::ALLOW_TF32;
use crate::error::Ctx;
use crate::memory;
use crate::{Device, Error, Result};

/// Bytes of each of the two page-locked staging buffers of a device.
pub(crate) const STAGING: usize = 4 << 20;

/// Bytes of cuBLAS's workspace (NVIDIA recommends 32 MiB on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// What this build and machine offer.
struct Backend {
    /// Usable devices (0 if any library or the driver is missing).
    count: usize,
    /// Why there are none, or fewer than asked for.
    reason: String,
    gpus: Vec<DeviceSetup>,
}

/// One device's setup state: its [`Gpu`] once set up, the lock that serialises setting it up,
/// and why the last try failed. Done once it succeeds. A failed setup is not kept: what it had
/// created is released, its reason is remembered for messages, and the next use tries again.
#[derive(Default)]
struct DeviceSetup {
    gpu: OnceLock<Gpu>,
    /// Serialises setups of this device (a cold NVRTC compile takes seconds).
    in_progress: Mutex<()>,
    /// Why the last setup failed.
    failed: Mutex<Option<String>>,
}

static BACKEND: OnceLock<Backend> = OnceLock::new();

/// The `Backend` error for a failed driver call.
pub(crate) fn driver_error(ctx: &Ctx, what: &str, e: DriverError) -> Error {
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!("{what} failed: {}", describe(e)),
    }
}

#[inline]
fn backend() -> &'static Backend {
    BACKEND.get_or_init(|| {
        let (count, reason) = probe();
        Backend {
            count,
            reason,
            gpus: (0..count.min(memory::MAX_CUDA_DEVICES))
                .map(|_| DeviceSetup::default())
                .collect(),
        }
    })
}

/// Counts the devices, checking first that the driver, cuBLAS and NVRTC libraries load (cudarc
/// panics on a call into a library it cannot load).
fn probe() -> (usize, String) {
    // SAFETY: these only try to open the shared libraries by name.
    let (driver, cublas, nvrtc) = unsafe {
        (
            sys::is_culib_present(),
            blas::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
        )
    };
    if !driver {
        return (
            0,
            "the CUDA driver library (libcuda.so.1) was not found: no NVIDIA driver is installed"
                .into(),
        );
    }
    if let Err(e) = result::init() {
        return (
            0,
            format!("the CUDA driver failed to start: {}", describe(e)),
        );
    }
    let count = match result::device::get_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) => return (0, format!("counting CUDA devices failed: {}", describe(e))),
    };
    if count == 0 {
        return (0, "the CUDA driver found no GPU".into());
    }
    if !cublas {
        return (
            0,
            "cuBLAS (libcublas.so.13) was not found on the library path".into(),
        );
    }
    if !nvrtc {
        return (
            0,
            "NVRTC (libnvrtc.so.13), which compiles ndscope's kernels, was not found on the library path"
                .into(),
        );
    }
    if let Err(why) = check_driver_version() {
        return (0, why);
    }
    (count, String::new())
}

/// The oldest Linux driver of each CUDA major version.
fn driver_for(cuda_major: i32) -> &'static str {
    match cuda_major {
        ..=11 => "450.80",
        12 => "525.60",
        _ => "580",
    }
}

/// The driver must run code of NVRTC's CUDA version (its CUBINs and PTX): a CUDA 13 NVRTC needs
/// a driver that supports CUDA 13.0 or newer.
fn check_driver_version() -> std::result::Result<(), String> {
    let driver = match pretend("driver") {
        Some(v) => v,
        None => {
            let mut v = 0;
            // SAFETY: one out-parameter; the driver library is loaded.
            unsafe { sys::cuDriverGetVersion(&mut v) }
                .result()
                .map_err(|e| format!("reading the driver's version failed: {}", describe(e)))?;
            v
        }
    };
    let nvrtc = super::kernels::nvrtc_version()?;
    let major: i32 = nvrtc
        .split('.')
        .next()
        .and_then(|m| m.parse().ok())
        .unwrap_or(0);
    if driver < major * 1000 {
        return Err(format!(
            "the NVIDIA driver supports CUDA {}.{}, older than the CUDA {nvrtc} of NVRTC, which \
             compiles ndscope's kernels: update the driver (CUDA {major} needs driver {} or \
             newer) or use an NVRTC as old as the driver",
            driver / 1000,
            driver % 1000 / 10,
            driver_for(major)
        ));
    }
    Ok(())
}

#[inline]
pub(crate) fn device_count() -> usize {
    backend().count
}

pub(crate) fn unavailable_reason(ordinal: usize) -> String {
    let b = backend();
    if b.count == 0 {
        return b.reason.clone();
    }
    if ordinal >= b.count {
        return format!("this machine has {} CUDA device(s)", b.count);
    }
    match b
        .gpus
        .get(ordinal)
        .and_then(|setup| setup.failed.lock().clone())
    {
        Some(why) => why,
        None => format!("ordinal {ordinal} cannot be used by ndscope"),
    }
}

/// A release of page-locked memory that a higher part of the backend keeps (the check flag of
/// `ops.rs`), registered by it so this file needs no import of it; run by
/// [`Gpu::release_caches`] except on out-of-memory, with whether the process is exiting.
static HOST_RELEASE: OnceLock<fn(&Gpu, bool)> = OnceLock::new();

/// `m` locked: waiting for it with `wait`, else only if no other thread holds it (`None`).
pub(crate) fn lock_or_try<T>(m: &Mutex<T>, wait: bool) -> Option<MutexGuard<'_, T>> {
    if wait {
        Some(m.lock())
    } else {
        m.try_lock()
    }
}

/// What a higher part of the backend (graph replay) must do before a free on a device's
/// stream: issue the calls it holds back, which may use the memory. Registered by it, so this
/// file needs no import of it.
static STREAM_BOUNDARY: OnceLock<fn(&Gpu)> = OnceLock::new();

/// Registers [`STREAM_BOUNDARY`] (once; later calls change nothing).
pub(crate) fn on_stream_boundary(boundary: fn(&Gpu)) {
    let _ = STREAM_BOUNDARY.set(boundary);
}

/// Registers [`HOST_RELEASE`] (once; later calls change nothing).
pub(crate) fn on_release(release: fn(&Gpu, bool)) {
    let _ = HOST_RELEASE.set(release);
}

/// Why the backend's caches are released ([`Gpu::release_caches`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// `ndscope::cuda::release_cached`: everything, waiting for each piece's lock.
    Explicit,
    /// An allocation the driver refused: device memory only, skipping pieces in use.
    OutOfMemory,
    /// The process exits: everything not in use by another thread.
    Exit,
}

/// One CUDA device in use.
pub(crate) struct Gpu {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// Streaming multiprocessors, for grid sizes.
    pub sms: u32,
    pub kernels: Kernels,
    blas: Mutex<Blas>,
    staging: Mutex<Staging>,
    scratch: Mutex<Scratch>,
    /// The first fatal fault of the device (an illegal address, a failed device assertion, …):
    /// the context cannot be used again, and every later call reports this, naming the op that
    /// first failed and where it was called.
    fault: OnceLock<String>,
}

/// The device of `ordinal`, set up on first use. `DeviceUnavailable` if it is absent or its
/// setup failed; a failed setup releases what it created and is tried again on the next call.
///
/// Callers holding the arena lock must only reach set-up devices: the lock-taking front-ends
/// call [`prepare`] first, so a cold setup (an NVRTC compile) never stalls other threads.
#[inline]
pub(crate) fn gpu(ctx: &Ctx, ordinal: usize) -> Result<&'static Gpu> {
    // Set up already (every call but the first ones): a load, no call.
    match backend()
        .gpus
        .get(ordinal)
        .and_then(|setup| setup.gpu.get())
    {
        Some(gpu) => Ok(gpu),
        None => set_up(ctx, ordinal),
    }
}

/// [`gpu`] for a device not set up yet (or that could not be).
#[inline(never)]
fn set_up(ctx: &Ctx, ordinal: usize) -> Result<&'static Gpu> {
    let b = backend();
    let Some(setup) = b.gpus.get(ordinal) else {
        return Err(ctx.unavailable(Device::Cuda(ordinal)));
    };
    if let Some(gpu) = setup.gpu.get() {
        return Ok(gpu);
    }
    let _setup = setup.in_progress.lock();
    if let Some(gpu) = setup.gpu.get() {
        return Ok(gpu);
    }
    match Gpu::new(ordinal) {
        Ok(gpu) => {
            *setup.failed.lock() = None;
            let gpu = setup.gpu.get_or_init(|| gpu);
            gpu.installed();
            Ok(gpu)
        }
        Err(why) => {
            *setup.failed.lock() = Some(why.clone());
            Err(Error::DeviceUnavailable {
                op: ctx.op,
                at: ctx.at,
                device: Device::Cuda(ordinal),
                reason: why,
            })
        }
    }
}

/// Sets up `device` if it is a CUDA device not set up yet (nothing for the CPU), reporting the
/// cause of a failed setup. Called before the arena lock is taken.
#[inline]
pub(crate) fn prepare(ctx: &Ctx, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => gpu(ctx, ordinal).map(|_| ()),
    }
}

/// The set-up device of `ordinal`, which must exist (a buffer of it does).
pub(crate) fn existing(ordinal: usize) -> Option<&'static Gpu> {
    backend()
        .gpus
        .get(ordinal)
        .and_then(|setup| setup.gpu.get())
}

/// Gives back what device `ordinal`'s backend holds that no array uses (nothing for a device
/// not set up); returns the bytes.
pub(crate) fn release_cached(ordinal: usize) -> usize {
    existing(ordinal).map_or(0, |gpu| gpu.release_caches(Release::Explicit))
}

/// Failed setups still to fake, from `NDSCOPE_CUDA_FAIL_SETUP` (a count; for tests of the
/// recovery from a failed setup: each of the first N setups fails after creating everything,
/// so all of it must be released).
fn injected_setup_failure() -> bool {
    use std::sync::atomic::AtomicUsize;
    static LEFT: OnceLock<AtomicUsize> = OnceLock::new();
    let left = LEFT.get_or_init(|| {
        let n = std::env::var("NDSCOPE_CUDA_FAIL_SETUP")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        AtomicUsize::new(n)
    });
    left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

impl Gpu {
    fn new(ordinal: usize) -> std::result::Result<Gpu, String> {
        let fail = |what: &str, e: DriverError| format!("{what} failed: {}", describe(e));
        let ctx = CudaContext::new(ordinal).map_err(|e| fail("creating the context", e))?;
        // SAFETY: ndscope runs all work of a device on one stream and never uses cudarc's
        // `CudaSlice`, so there is nothing for the tracking to synchronise.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx
            .new_stream()
            .map_err(|e| fail("creating the stream", e))?;
        let (major, minor) = match pretend("cc") {
            Some(cc) => (cc / 10, cc % 10),
            None => ctx
                .compute_capability()
                .map_err(|e| fail("reading the compute capability", e))?,
        };
        if (major, minor) < (7, 5) {
            let name = ctx.name().unwrap_or_else(|_| "a GPU".into());
            return Err(format!(
                "cuda:{ordinal} ({name}) has compute capability {major}.{minor}; ndscope needs \
                 7.5 (Turing) or newer"
            ));
        }
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| fail("reading the multiprocessor count", e))?;
        if !ctx.has_async_alloc() {
            return Err(
                "the device does not support stream-ordered allocation (cuMemAllocAsync)".into(),
            );
        }
        keep_freed_memory_cached(&ctx).map_err(|e| fail("configuring the memory pool", e))?;
        let kernels = Kernels::load(&ctx, ordinal, (major, minor))?;
        let blas = Blas::new(&ctx, &stream, ordinal)?;
        let staging = Staging::new(&ctx)?;
        if injected_setup_failure() {
            // `kernels`, `blas` and `staging` are dropped here, releasing what they hold.
            return Err("setting up the device failed: a failure injected by \
                        NDSCOPE_CUDA_FAIL_SETUP"
                .into());
        }
        Ok(Gpu {
            ordinal,
            ctx,
            stream,
            sms: sms.max(1) as u32,
            kernels,
            blas: Mutex::new(blas),
            staging: Mutex::new(staging),
            scratch: Mutex::new(Scratch {
                memory: 0,
                bytes: 0,
            }),
            fault: OnceLock::new(),
        })
    }

    /// What the device's own setup adds, after it succeeded: the probe of the driver pool's
    /// cached memory, and the exit hook that gives everything back.
    fn installed(&'static self) {
        memory::set_pool_probe(pool_cached);
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            // SAFETY: `atexit` only stores the pointer of a plain `extern "C"` function with no
            // arguments, which lives as long as the program.
            unsafe {
                libc::atexit(release_late_at_exit);
            }
        });
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Makes this device's context current on the calling thread; after a fatal fault, the
    /// fault's error instead (the context is unusable: every later call reports it).
    pub fn bind(&self, ctx: &Ctx) -> Result<()> {
        if let Some(fault) = self.fault.get() {
            return Err(self.fault_error(ctx, fault));
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| self.failed(ctx, "making the CUDA context current", e))?;
        exit_release_on_this_thread();
        Ok(())
    }

    fn fault_error(&self, ctx: &Ctx, fault: &str) -> Error {
        Error::Backend {
            op: ctx.op,
            at: ctx.at,
            reason: format!(
                "cuda:{} is unusable after a device fault; {fault}",
                self.ordinal
            ),
        }
    }

    /// The error for a failed driver call `what` of op `ctx`. A fatal fault (one that leaves
    /// the context unusable) is remembered with the op and site that first met it, and the
    /// same fault is returned from then on for every call on the device.
    pub fn failed(&self, ctx: &Ctx, what: &str, e: DriverError) -> Error {
        if !is_fatal(e) {
            return driver_error(ctx, what, e);
        }
        let first = self.fault.get_or_init(|| {
            format!(
                "the first op to fail was {} at {}: {what} failed: {}",
                ctx.op,
                ctx.at,
                describe(e)
            )
        });
        self.fault_error(ctx, first)
    }

    pub fn blas(&self) -> MutexGuard<'_, Blas> {
        self.blas.lock()
    }

    /// The staging buffers, allocated at their first use.
    pub fn staging(&self, ctx: &Ctx) -> Result<MutexGuard<'_, Staging>> {
        let mut staging = self.staging.lock();
        staging.ensure(ctx, self)?;
        Ok(staging)
    }

    pub fn scratch(&self) -> MutexGuard<'_, Scratch> {
        self.scratch.lock()
    }

    /// Device memory of `bytes` from the stream-ordered allocator, counted as a driver
    /// allocation. The caller accounts for it against the memory limit.
    pub fn malloc(&self, ctx: &Ctx, bytes: usize) -> Result<CUdeviceptr> {
        self.bind(ctx)?;
        // SAFETY: the stream belongs to this context; the memory is used on this stream only.
        match unsafe { result::malloc_async(self.cu_stream(), bytes) } {
            Ok(ptr) => {
                memory::driver_allocated(self.device());
                Ok(ptr)
            }
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(memory::driver_refused(ctx, self.device(), bytes))
            }
            Err(e) => Err(self.failed(ctx, "cuMemAllocAsync", e)),
        }
    }

    /// [`malloc`](Self::malloc), and when the driver is out of memory, once more after the
    /// backend's caches (those no other thread is using this moment) and the driver pool's
    /// unused memory have gone back, as PyTorch's caching allocator does.
    pub fn malloc_or_release(&self, ctx: &Ctx, bytes: usize) -> Result<CUdeviceptr> {
        match self.malloc(ctx, bytes) {
            Err(Error::OutOfMemory { .. }) => {
                self.release_caches(Release::OutOfMemory);
                self.malloc(ctx, bytes)
            }
            other => other,
        }
    }

    /// Gives back what the backend holds for reuse on this device and no array uses: the cache
    /// of freed array memory, the reduction scratch, cuBLAS's workspace, the staging buffers
    /// and the check flag (page-locked host memory: not on out-of-memory), and then (after the
    /// device's queued work, which may still use some of it) what the driver's pool keeps.
    /// Returns the bytes given back (without the pool's).
    pub fn release_caches(&self, why: Release) -> usize {
        // On out-of-memory the caller may hold one of the locks, at exit another thread may:
        // a piece whose lock is taken is skipped then, never waited for.
        let wait = why == Release::Explicit;
        let mut bytes = self.release_array_cache(wait);
        if let Some(mut scratch) = lock_or_try(&self.scratch, wait) {
            bytes += scratch.release(self);
        }
        if let Some(mut blas) = lock_or_try(&self.blas, wait) {
            bytes += blas.release_workspace(self);
        }
        // Page-locked host memory is no help to the device, and its free synchronises (the
        // caller may hold the arena lock): not on out-of-memory.
        if why != Release::OutOfMemory {
            if let Some(mut staging) = lock_or_try(&self.staging, wait) {
                bytes += staging.release(self);
            }
            if let Some(release) = HOST_RELEASE.get() {
                release(self, why == Release::Exit);
            }
        }
        self.trim_pool();
        bytes
    }

    /// Gives the allocations the cache of freed array memory keeps back to the driver (in
    /// stream order); returns their bytes. With `wait`, waits for the cache's lock; without,
    /// gives up (returning 0) when another thread holds it.
    fn release_array_cache(&self, wait: bool) -> usize {
        let (bytes, freed) = {
            let Some(mut c) = lock_or_try(cache::of(self.ordinal), wait) else {
                return 0;
            };
            c.drain()
        };
        memory::cache_dropped(self.device(), bytes);
        for ptr in freed {
            self.free(ptr);
        }
        bytes
    }

    /// Waits for the device's queued work (the frees just queued) and returns the driver
    /// pool's unused memory to the system.
    fn trim_pool(&self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the stream and the pool (the device's default one) live as long as the
        // context; neither call needs the context current.
        unsafe {
            if sys::cuStreamSynchronize(self.cu_stream()).result().is_err() {
                return;
            }
            if let Ok(pool) = result::device::get_default_mem_pool(self.ctx.cu_device()) {
                let _ = sys::cuMemPoolTrimTo(pool, 0);
            }
        }
    }

    /// Gives memory from [`malloc`](Self::malloc) back, ordered after all work queued so far.
    pub fn free(&self, ptr: CUdeviceptr) {
        // A failure here means the context is gone (process exit) or broken; the memory goes
        // with it, and a later call reports the error.
        if let Some(boundary) = STREAM_BOUNDARY.get() {
            boundary(self);
        }
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc` on this stream and is freed once.
            let _ = unsafe { result::free_async(ptr, self.cu_stream()) };
        }
    }
}

/// Bytes the driver's memory pool of `device` keeps for reuse beyond what is allocated from it
/// (0 for a device not set up, or where the driver does not say).
fn pool_cached(device: Device) -> usize {
    let Device::Cuda(ordinal) = device else {
        return 0;
    };
    let Some(gpu) = existing(ordinal) else {
        return 0;
    };
    let read = |attr| -> Option<u64> {
        let mut value: u64 = 0;
        // SAFETY: the pool is the default pool of a live context; both attributes are u64.
        unsafe {
            let pool = result::device::get_default_mem_pool(gpu.ctx.cu_device()).ok()?;
            sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast())
                .result()
                .ok()?;
        }
        Some(value)
    };
    use sys::CUmemPool_attribute::{
        CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT as RESERVED, CU_MEMPOOL_ATTR_USED_MEM_CURRENT as USED,
    };
    match (read(RESERVED), read(USED)) {
        (Some(reserved), Some(used)) => {
            usize::try_from(reserved.saturating_sub(used)).unwrap_or(usize::MAX)
        }
        _ => 0,
    }
}

/// Gives back, when the process exits, what every set-up device's backend holds that no array
/// uses, so a leak checker run over a program finds only what the program itself kept. A lock
/// another thread holds at exit is skipped, never waited for.
fn release_everything_at_exit(why: Release) {
    for setup in &backend().gpus {
        if let Some(gpu) = setup.gpu.get() {
            gpu.release_caches(why);
        }
    }
}

/// Whether the main thread used CUDA and armed [`ExitRelease`].
static MAIN_ARMED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Releases everything at exit while the main thread's thread-local data (the driver's included)
/// still lives: a thread-local value of the main thread, created after its first CUDA call, is
/// dropped at exit before the driver's own thread-local data of that thread. (An `atexit`
/// function runs after every thread-local value of the exiting thread is dropped: binding a
/// context there could touch the driver's dropped data.)
struct ExitRelease;

impl Drop for ExitRelease {
    fn drop(&mut self) {
        release_everything_at_exit(Release::Exit);
    }
}

thread_local! {
    /// Whether this thread was looked at by [`exit_release_on_this_thread`].
    static SEEN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    static EXIT_RELEASE: std::cell::Cell<Option<ExitRelease>> = const { std::cell::Cell::new(None) };
}

/// Arms [`ExitRelease`] on the main thread, after its first CUDA call (once per thread: one
/// thread-local load afterwards).
#[inline]
fn exit_release_on_this_thread() {
    if SEEN.try_with(|seen| seen.replace(true)).unwrap_or(true) {
        return;
    }
    // Only the main thread's thread-local data lives until the process exits.
    // SAFETY: plain system calls without arguments.
    if unsafe { libc::getpid() == libc::gettid() }
        && EXIT_RELEASE
            .try_with(|armed| armed.set(Some(ExitRelease)))
            .is_ok()
    {
        MAIN_ARMED.store(true, Ordering::Relaxed);
    }
}

/// At exit, for a main thread that never used CUDA itself (the work ran on other threads): the
/// driver's thread-local data of this thread was never made, so binding a context here is safe.
/// Where the main thread used CUDA, [`ExitRelease`] did the work before.
extern "C" fn release_late_at_exit() {
    if !MAIN_ARMED.load(Ordering::Relaxed) {
        release_everything_at_exit(Release::Exit);
    }
}

/// Whether `e` is a fault that leaves the context unusable (CUDA's "sticky" errors: the
/// process must restart to use the device again).
fn is_fatal(e: DriverError) -> bool {
    use sys::CUresult::*;
    matches!(
        e.0,
        CUDA_ERROR_ILLEGAL_ADDRESS
            | CUDA_ERROR_ASSERT
            | CUDA_ERROR_HARDWARE_STACK_ERROR
            | CUDA_ERROR_ILLEGAL_INSTRUCTION
            | CUDA_ERROR_MISALIGNED_ADDRESS
            | CUDA_ERROR_INVALID_ADDRESS_SPACE
            | CUDA_ERROR_INVALID_PC
            | CUDA_ERROR_LAUNCH_FAILED
            | CUDA_ERROR_ECC_UNCORRECTABLE
            | CUDA_ERROR_CONTEXT_IS_DESTROYED
    )
}

/// A `Backend` error for a failure that may come from an earlier asynchronous kernel (a fatal
/// fault is remembered by the device: see [`Gpu::failed`]).
pub(crate) fn sticky(ctx: &Ctx, gpu: &Gpu, e: DriverError) -> Error {
    if is_fatal(e) {
        return gpu.failed(ctx, "waiting for the device", e);
    }
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!(
            "cuda:{} reported an error from this or an earlier operation on its stream: {}",
            gpu.ordinal,
            describe(e)
        ),
    }
}

/// Lets the device's default memory pool keep freed memory for reuse instead of returning it to
/// the driver at each synchronisation, as PyTorch's caching allocator does.
fn keep_freed_memory_cached(ctx: &Arc<CudaContext>) -> std::result::Result<(), DriverError> {
    // SAFETY: the device handle comes from a live context; the attribute takes a u64.
    unsafe {
        let pool = result::device::get_default_mem_pool(ctx.cu_device())?;
        let mut threshold: u64 = u64::MAX;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()
    }
}

/// The device's cuBLAS handle (not thread-safe: used under its mutex).
pub(crate) struct Blas {
    pub handle: blas::cublasHandle_t,
    tf32: bool,
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
    /// cuBLAS's workspace, allocated at the first product (0 until then, and after
    /// [`release_workspace`](Blas::release_workspace)).
    workspace: CUdeviceptr,
    ordinal: usize,
    /// cuBLASLt for products with an epilogue: `None` until the first, then `Some(None)` where
    /// the library is missing.
    lt: Option<Option<Lt>>,
}

impl Drop for Blas {
    /// Runs only for a device whose setup failed (a set-up device lives in a static).
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the handle and the workspace were created on this context and stream and are
        // released once, here.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
            if self.workspace != 0 {
                let _ = result::free_async(self.workspace, self.stream);
                memory::cache_dropped(Device::Cuda(self.ordinal), BLAS_WORKSPACE);
            }
        }
    }
}

// SAFETY: the handle is only used under the mutex that holds this struct.
unsafe impl Send for Blas {}

impl Blas {
    fn new(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        ordinal: usize,
    ) -> std::result::Result<Blas, String> {
        ctx.bind_to_thread()
            .map_err(|e| format!("binding the context failed: {}", describe(e)))?;
        let handle = cudarc::cublas::result::create_handle()
            .map_err(|e| format!("creating the cuBLAS handle failed: {e:?}"))?;
        // Owned from here: a failure below drops it, destroying the handle and freeing the
        // workspace.
        let this = Blas {
            handle,
            tf32: false,
            ctx: Arc::clone(ctx),
            stream: stream.cu_stream(),
            workspace: 0,
            ordinal,
            lt: None,
        };
        // SAFETY: the handle was just created; the stream belongs to the current context.
        unsafe {
            cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| format!("setting the cuBLAS stream failed: {e:?}"))?;
            blas::cublasSetMathMode(handle, blas::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| format!("setting the cuBLAS math mode failed: {e:?}"))?;
        }
        Ok(this)
    }

    /// Readies the handle for a product: its workspace allocated (at the first product, and
    /// after a release) and its math mode what [`ALLOW_TF32`] says.
    pub fn prepare(&mut self, ctx: &Ctx, gpu: &Gpu) -> Result<()> {
        if self.workspace == 0 {
            let ptr = gpu.malloc_or_release(ctx, BLAS_WORKSPACE)?;
            // SAFETY: a live handle used under its mutex; `ptr` is BLAS_WORKSPACE bytes of
            // device memory of its context (256-byte aligned, as every allocation), kept until
            // `release_workspace` or drop.
            let set = unsafe {
                blas::cublasSetWorkspace_v2(self.handle, ptr as *mut _, BLAS_WORKSPACE).result()
            };
            if let Err(e) = set {
                gpu.free(ptr);
                return Err(blas_error(ctx, "cublasSetWorkspace", e));
            }
            self.workspace = ptr;
            memory::cache_held(gpu.device(), BLAS_WORKSPACE);
        }
        self.apply_math_mode(ctx)
    }

    /// cuBLASLt, made at the first call (the context is current: the caller bound it), or
    /// `None` where the library cannot be loaded.
    pub fn lt(&mut self) -> Option<&mut Lt> {
        self.lt.get_or_insert_with(Lt::new).as_mut()
    }

    /// The workspace and its size, after [`prepare`](Self::prepare).
    pub fn workspace(&self) -> (CUdeviceptr, usize) {
        (self.workspace, BLAS_WORKSPACE)
    }

    /// Whether f32 products may round their inputs to TF32 now (what [`prepare`](Self::prepare)
    /// applied).
    pub fn tf32(&self) -> bool {
        self.tf32
    }

    /// Frees the workspace (in stream order, after the products queued so far); the next
    /// product allocates it again. Returns the bytes given back.
    pub fn release_workspace(&mut self, gpu: &Gpu) -> usize {
        if self.workspace == 0 {
            return 0;
        }
        // SAFETY: a live handle used under its mutex: it forgets the workspace before it is
        // freed (the products queued before the free still run first: one stream).
        unsafe {
            let _ = blas::cublasSetWorkspace_v2(self.handle, std::ptr::null_mut(), 0);
        }
        gpu.free(self.workspace);
        self.workspace = 0;
        memory::cache_dropped(gpu.device(), BLAS_WORKSPACE);
        BLAS_WORKSPACE
    }

    /// Sets the math mode to what [`ALLOW_TF32`] says, if it changed.
    fn apply_math_mode(&mut self, ctx: &Ctx) -> Result<()> {
        let want = ALLOW_TF32.load(Ordering::Relaxed);
        if want == self.tf32 {
            return Ok(());
        }
        let mode = if want {
            blas::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            blas::cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: a live handle, used under its mutex.
        unsafe { blas::cublasSetMathMode(self.handle, mode) }
            .result()
            .map_err(|e| blas_error(ctx, "cublasSetMathMode", e))?;
        self.tf32 = want;
        Ok(())
    }
}

pub(crate) fn blas_error(ctx: &Ctx, what: &str, e: cudarc::cublas::result::CublasError) -> Error {
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!("{what} failed: {e:?}"),
    }
}

/// Two page-locked host buffers ([`StagingBuffers`]) for host↔device copies (allocated at the first
/// pageable copy, given back by [`release`](Staging::release)), each with an event that marks when
/// the copy that last used it has finished.
pub(crate) struct Staging {
    pub bufs: StagingBuffers,
    pub events: [CudaEvent; 2],
    /// Whether the event of each buffer was recorded since the buffer was last waited for.
    pub pending: [bool; 2],
    /// When each buffer's event was last recorded (a count of records): a wait on one event
    /// also frees the buffers whose events were recorded before it, on the device's one stream.
    recorded: [u64; 2],
    /// Records so far.
    records: u64,
    /// The buffer the next copy starts with: the one after the last used, so that a copy out
    /// right after a copy in (an inference call) does not wait for the copy in.
    next: usize,
}

// SAFETY: the buffers are page-locked host memory owned by this struct, used under its mutex.
unsafe impl Send for Staging {}

/// The two page-locked staging buffers of [`Staging`] (null until allocated), freed on drop,
/// which happens only for a device whose setup failed (a set-up device lives in a static), and
/// on release. Host memory, but no array's: bytes pass through them on their way between a
/// pageable host buffer (an array's `HostBuffer`, or a caller's slice) and the device. Not to be
/// confused with `HostBuffer` (an array's storage on the host) or the public `HostArray` (data
/// the caller owns).
pub(crate) struct StagingBuffers(pub [*mut u8; 2]);

impl std::ops::Index<usize> for StagingBuffers {
    type Output = *mut u8;
    fn index(&self, i: usize) -> &*mut u8 {
        &self.0[i]
    }
}

impl Drop for StagingBuffers {
    fn drop(&mut self) {
        for &buf in &self.0 {
            if !buf.is_null() {
                // SAFETY: allocated by `cuMemHostAlloc` in `Staging::ensure` and freed once,
                // here, after the copies that used it (`Staging::release` waits for them).
                let _ = unsafe { result::free_host(buf.cast()) };
            }
        }
    }
}

impl Staging {
    fn new(ctx: &Arc<CudaContext>) -> std::result::Result<Staging, String> {
        let fail = |what: &str, e: DriverError| format!("{what} failed: {}", describe(e));
        ctx.bind_to_thread()
            .map_err(|e| fail("binding the context", e))?;
        let bufs = StagingBuffers([std::ptr::null_mut(); 2]);
        // Blocking-sync events: a host waiting for a staging buffer sleeps instead of spinning.
        let blocking = Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC);
        let events = [
            ctx.new_event(blocking)
                .map_err(|e| fail("creating an event", e))?,
            ctx.new_event(blocking)
                .map_err(|e| fail("creating an event", e))?,
        ];
        Ok(Staging {
            bufs,
            events,
            pending: [false; 2],
            recorded: [0; 2],
            records: 0,
            next: 0,
        })
    }

    /// Allocates the two buffers if they are not (the context is current: `gpu.bind`).
    fn ensure(&mut self, ctx: &Ctx, gpu: &Gpu) -> Result<()> {
        if !self.bufs.0[0].is_null() {
            return Ok(());
        }
        gpu.bind(ctx)?;
        let mut bufs = StagingBuffers([std::ptr::null_mut(); 2]);
        for buf in &mut bufs.0 {
            *buf = pinned_alloc(ctx, gpu, STAGING)?.as_ptr();
        }
        self.bufs = bufs;
        self.pending = [false; 2];
        memory::cache_held(gpu.device(), 2 * STAGING);
        Ok(())
    }

    /// Frees the two buffers after the copies that use them; the next pageable copy allocates
    /// them again. Returns the bytes given back.
    fn release(&mut self, gpu: &Gpu) -> usize {
        if self.bufs.0[0].is_null() || gpu.ctx.bind_to_thread().is_err() {
            return 0;
        }
        for b in 0..2 {
            if self.pending[b] && self.events[b].synchronize().is_err() {
                // A device fault: the copy may never finish, so the memory stays.
                return 0;
            }
            self.pending[b] = false;
        }
        // Dropping the buffers frees them (the copies are done).
        self.bufs = StagingBuffers([std::ptr::null_mut(); 2]);
        memory::cache_dropped(gpu.device(), 2 * STAGING);
        2 * STAGING
    }

    /// The buffers a copy of `chunks` chunks uses, in order: chunk `i` goes through buffer
    /// `(start + i) % 2` for the `start` returned. The next copy starts after the last.
    pub fn take(&mut self, chunks: usize) -> usize {
        let start = self.next;
        self.next = (start + chunks) % 2;
        start
    }

    /// Waits until staging buffer `b` is free again. The device runs its work on one stream,
    /// in order, so the copies marked in the other buffer before this one's are finished too:
    /// its next use waits for nothing (no second synchronisation per call).
    pub fn wait(&mut self, ctx: &Ctx, gpu: &Gpu, b: usize) -> Result<()> {
        if self.pending[b] {
            self.events[b]
                .synchronize()
                .map_err(|e| sticky(ctx, gpu, e))?;
            self.pending[b] = false;
            let done = self.recorded[b];
            for (pending, &at) in self.pending.iter_mut().zip(&self.recorded) {
                if at < done {
                    *pending = false;
                }
            }
        }
        Ok(())
    }

    /// Marks buffer `b` in use by the work queued so far.
    pub fn record(&mut self, ctx: &Ctx, gpu: &Gpu, b: usize) -> Result<()> {
        self.events[b]
            .record(&gpu.stream)
            .map_err(|e| gpu.failed(ctx, "cuEventRecord", e))?;
        self.pending[b] = true;
        self.records += 1;
        self.recorded[b] = self.records;
        Ok(())
    }
}

/// `bytes` of page-locked host memory registered with `gpu`'s context (current), counted as a
/// driver allocation; the driver running out of page-locked memory is `OutOfMemory` on the host.
pub(crate) fn pinned_alloc(ctx: &Ctx, gpu: &Gpu, bytes: usize) -> Result<std::ptr::NonNull<u8>> {
    // SAFETY: the caller made the context current; the memory is owned by the caller.
    let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
        .map_err(|e| pinned_refusal(ctx, gpu, bytes, e))?;
    memory::driver_allocated(gpu.device());
    std::ptr::NonNull::new(ptr.cast::<u8>())
        .ok_or_else(|| memory::driver_refused(ctx, Device::Cpu, bytes))
}

/// The error for `cuMemHostAlloc` of `bytes` failing with `e`: out of page-locked memory is
/// `OutOfMemory` on the host (the driver refused it), anything else the driver's error.
pub(crate) fn pinned_refusal(ctx: &Ctx, gpu: &Gpu, bytes: usize, e: DriverError) -> Error {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        memory::driver_refused(ctx, Device::Cpu, bytes)
    } else {
        gpu.failed(ctx, "cuMemHostAlloc", e)
    }
}

/// The grain the reduction scratch grows by.
pub(crate) const SCRATCH_GRAIN: usize = 4 << 10;

/// Device memory that grows on demand and is reused by each op under its mutex: partial
/// results of two-pass reductions, accumulators, flags read back to the host. Stream order
/// makes reuse safe: the next op's kernels run after this op's. It is a cache (counted in
/// `DeviceUsage::cached`, not in use), sized to the largest need in [`SCRATCH_GRAIN`]s and given
/// back by [`release`](Scratch::release).
pub(crate) struct Scratch {
    pub memory: CUdeviceptr,
    pub bytes: usize,
}

impl Scratch {
    /// At least `bytes` of scratch on `gpu` (reallocated only when it grows; the old block is
    /// freed in stream order).
    pub fn ensure(&mut self, ctx: &Ctx, gpu: &Gpu, bytes: usize) -> Result<CUdeviceptr> {
        if bytes <= self.bytes && self.bytes > 0 {
            return Ok(self.memory);
        }
        let size = bytes.max(1).div_ceil(SCRATCH_GRAIN) * SCRATCH_GRAIN;
        self.release(gpu);
        let ptr = gpu.malloc_or_release(ctx, size)?;
        memory::cache_held(gpu.device(), size);
        self.memory = ptr;
        self.bytes = size;
        Ok(ptr)
    }

    /// Frees the scratch (in stream order); returns its bytes.
    pub fn release(&mut self, gpu: &Gpu) -> usize {
        let bytes = std::mem::take(&mut self.bytes);
        if bytes > 0 {
            gpu.free(self.memory);
            self.memory = 0;
            memory::cache_dropped(gpu.device(), bytes);
        }
        bytes
    }
}
