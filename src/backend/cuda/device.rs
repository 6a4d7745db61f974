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

use super::kernels::Kernels;
use crate::backend::ALLOW_TF32;
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
    gpus: Vec<Slot>,
}

/// One device's setup: done once it succeeds. A failed setup is not kept: what it had created
/// is released, its reason is remembered for messages, and the next use tries again.
#[derive(Default)]
struct Slot {
    gpu: OnceLock<Gpu>,
    /// Serialises setups of this device (a cold NVRTC compile takes seconds).
    setup: Mutex<()>,
    /// Why the last setup failed.
    failed: Mutex<Option<String>>,
}

static BACKEND: OnceLock<Backend> = OnceLock::new();

/// `name (description)` of a driver error, e.g. `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub(crate) fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// The `Backend` error for a failed driver call.
pub(crate) fn driver_error(ctx: &Ctx, what: &str, e: DriverError) -> Error {
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!("{what} failed: {}", describe(e)),
    }
}

fn backend() -> &'static Backend {
    BACKEND.get_or_init(|| {
        let (count, reason) = probe();
        Backend {
            count,
            reason,
            gpus: (0..count.min(memory::MAX_CUDA_DEVICES))
                .map(|_| Slot::default())
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
    (count, String::new())
}

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
        .and_then(|slot| slot.failed.lock().clone())
    {
        Some(why) => why,
        None => format!("ordinal {ordinal} cannot be used by ndscope"),
    }
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
}

/// The device of `ordinal`, set up on first use. `DeviceUnavailable` if it is absent or its
/// setup failed; a failed setup releases what it created and is tried again on the next call.
///
/// Callers holding the arena lock must only reach set-up devices: the lock-taking front-ends
/// call [`prepare`] first, so a cold setup (an NVRTC compile) never stalls other threads.
pub(crate) fn gpu(ctx: &Ctx, ordinal: usize) -> Result<&'static Gpu> {
    let b = backend();
    let Some(slot) = b.gpus.get(ordinal) else {
        return Err(ctx.unavailable(Device::Cuda(ordinal)));
    };
    if let Some(gpu) = slot.gpu.get() {
        return Ok(gpu);
    }
    let _setup = slot.setup.lock();
    if let Some(gpu) = slot.gpu.get() {
        return Ok(gpu);
    }
    match Gpu::new(ordinal) {
        Ok(gpu) => {
            *slot.failed.lock() = None;
            Ok(slot.gpu.get_or_init(|| gpu))
        }
        Err(why) => {
            *slot.failed.lock() = Some(why.clone());
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
pub(crate) fn prepare(ctx: &Ctx, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => gpu(ctx, ordinal).map(|_| ()),
    }
}

/// The set-up device of `ordinal`, which must exist (a buffer of it does).
pub(crate) fn existing(ordinal: usize) -> Option<&'static Gpu> {
    backend().gpus.get(ordinal).and_then(|slot| slot.gpu.get())
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
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| fail("reading the compute capability", e))?;
        let sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| fail("reading the multiprocessor count", e))?;
        if !ctx.has_async_alloc() {
            return Err(
                "the device does not support stream-ordered allocation (cuMemAllocAsync)".into(),
            );
        }
        keep_freed_memory_cached(&ctx).map_err(|e| fail("configuring the memory pool", e))?;
        let kernels = Kernels::load(&ctx, major, minor)?;
        let blas = Blas::new(&ctx, &stream, ordinal)?;
        let staging = Staging::new(&ctx, ordinal)?;
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
        })
    }

    pub fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Makes this device's context current on the calling thread.
    pub fn bind(&self, ctx: &Ctx) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(ctx, "making the CUDA context current", e))
    }

    pub fn blas(&self) -> MutexGuard<'_, Blas> {
        self.blas.lock()
    }

    pub fn staging(&self) -> MutexGuard<'_, Staging> {
        self.staging.lock()
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
            Err(e) => Err(driver_error(ctx, "cuMemAllocAsync", e)),
        }
    }

    /// Gives memory from [`malloc`](Self::malloc) back, ordered after all work queued so far.
    pub fn free(&self, ptr: CUdeviceptr) {
        // A failure here means the context is gone (process exit) or broken; the memory goes
        // with it, and a later call reports the error.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: `ptr` came from `malloc` on this stream and is freed once.
            let _ = unsafe { result::free_async(ptr, self.cu_stream()) };
        }
    }
}

/// A `Backend` error for a failure that may come from an earlier asynchronous kernel.
pub(crate) fn sticky(ctx: &Ctx, gpu: &Gpu, e: DriverError) -> Error {
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
    workspace: CUdeviceptr,
}

impl Drop for Blas {
    /// Runs only for a device whose setup failed (a set-up device lives in a static).
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: the handle and the workspace were created by `Blas::new` on this context and
        // stream and are released once, here.
        unsafe {
            let _ = cudarc::cublas::result::destroy_handle(self.handle);
            if self.workspace != 0 {
                let _ = result::free_async(self.workspace, self.stream);
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
        let mut this = Blas {
            handle,
            tf32: false,
            ctx: Arc::clone(ctx),
            stream: stream.cu_stream(),
            workspace: 0,
        };
        // SAFETY: the handle was just created; the stream belongs to the current context; the
        // workspace is device memory of that context, freed when this struct is dropped.
        unsafe {
            cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _)
                .map_err(|e| format!("setting the cuBLAS stream failed: {e:?}"))?;
            this.workspace = result::malloc_async(stream.cu_stream(), BLAS_WORKSPACE)
                .map_err(|e| format!("allocating the cuBLAS workspace failed: {}", describe(e)))?;
            memory::driver_allocated(Device::Cuda(ordinal));
            blas::cublasSetWorkspace_v2(handle, this.workspace as *mut _, BLAS_WORKSPACE)
                .result()
                .map_err(|e| format!("setting the cuBLAS workspace failed: {e:?}"))?;
            blas::cublasSetMathMode(handle, blas::cublasMath_t::CUBLAS_DEFAULT_MATH)
                .result()
                .map_err(|e| format!("setting the cuBLAS math mode failed: {e:?}"))?;
        }
        Ok(this)
    }

    /// Sets the math mode to what [`ALLOW_TF32`] says, if it changed.
    pub fn apply_math_mode(&mut self, ctx: &Ctx) -> Result<()> {
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

/// Two page-locked host buffers for host↔device copies, each with an event that marks when the
/// copy that last used it has finished.
pub(crate) struct Staging {
    pub bufs: HostBuffers,
    pub events: [CudaEvent; 2],
    /// Whether the event of each buffer was recorded since the buffer was last waited for.
    pub pending: [bool; 2],
}

// SAFETY: the buffers are page-locked host memory owned by this struct, used under its mutex.
unsafe impl Send for Staging {}

/// The two staging buffers (null until allocated), freed on drop, which happens only for a
/// device whose setup failed (a set-up device lives in a static).
pub(crate) struct HostBuffers(pub [*mut u8; 2]);

impl std::ops::Index<usize> for HostBuffers {
    type Output = *mut u8;
    fn index(&self, i: usize) -> &*mut u8 {
        &self.0[i]
    }
}

impl Drop for HostBuffers {
    fn drop(&mut self) {
        for &buf in &self.0 {
            if !buf.is_null() {
                // SAFETY: allocated by `cuMemHostAlloc` in `Staging::new` (whose context is
                // current: dropped right there or in `Gpu::new` on the same thread) and freed
                // once, here.
                let _ = unsafe { result::free_host(buf.cast()) };
            }
        }
    }
}

impl Staging {
    fn new(ctx: &Arc<CudaContext>, ordinal: usize) -> std::result::Result<Staging, String> {
        let fail = |what: &str, e: DriverError| format!("{what} failed: {}", describe(e));
        ctx.bind_to_thread()
            .map_err(|e| fail("binding the context", e))?;
        let mut bufs = HostBuffers([std::ptr::null_mut(); 2]);
        for buf in &mut bufs.0 {
            // SAFETY: the context is current (bound above).
            let ptr = unsafe {
                result::malloc_host(STAGING, sys::CU_MEMHOSTALLOC_PORTABLE)
                    .map_err(|e| fail("allocating page-locked staging memory", e))?
            };
            memory::driver_allocated(Device::Cuda(ordinal));
            *buf = ptr.cast();
        }
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
        })
    }

    /// Waits until staging buffer `b` is free again.
    pub fn wait(&mut self, ctx: &Ctx, gpu: &Gpu, b: usize) -> Result<()> {
        if self.pending[b] {
            self.events[b]
                .synchronize()
                .map_err(|e| sticky(ctx, gpu, e))?;
            self.pending[b] = false;
        }
        Ok(())
    }

    /// Marks buffer `b` in use by the work queued so far.
    pub fn record(&mut self, ctx: &Ctx, gpu: &Gpu, b: usize) -> Result<()> {
        self.events[b]
            .record(&gpu.stream)
            .map_err(|e| driver_error(ctx, "cuEventRecord", e))?;
        self.pending[b] = true;
        Ok(())
    }
}

/// Device memory that grows on demand and is reused by each op under its mutex: partial
/// results of two-pass reductions, accumulators, flags read back to the host. Stream order
/// makes reuse safe: the next op's kernels run after this op's.
pub(crate) struct Scratch {
    pub memory: CUdeviceptr,
    pub bytes: usize,
}

impl Scratch {
    /// At least `bytes` of scratch on `gpu` (reallocated only when it grows; the old block is
    /// freed in stream order).
    pub fn ensure(&mut self, ctx: &Ctx, gpu: &Gpu, bytes: usize) -> Result<CUdeviceptr> {
        if bytes <= self.bytes {
            return Ok(self.memory);
        }
        let size = bytes.next_power_of_two().max(64 << 10);
        memory::reserve(ctx, gpu.device(), size)?;
        let ptr = match gpu.malloc(ctx, size) {
            Ok(ptr) => ptr,
            Err(e) => {
                memory::release(gpu.device(), size);
                return Err(e);
            }
        };
        if self.bytes > 0 {
            gpu.free(self.memory);
            memory::release(gpu.device(), self.bytes);
        }
        self.memory = ptr;
        self.bytes = size;
        Ok(ptr)
    }
}
