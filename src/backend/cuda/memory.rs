//! Raw memory regions of the CUDA backend, below the blocks and buffers made of them: one
//! allocation of device memory ([`DeviceMemory`]), and page-locked host memory
//! ([`PinnedMemory`]).
//!
//! Device memory comes from the stream-ordered allocator (`cuMemAllocAsync`) and goes back with
//! `cuMemFreeAsync`, never `cuMemFree`, which would synchronise the whole device. A workspace
//! block is one such allocation, carved by offset; an array's own memory is another.
//!
//! Memory of arrays that close is kept in a small per-device cache of freed allocations
//! ([`Cache`](cache::Cache)) and handed to the next array of the same rounded size without
//! asking the driver: an array that spills from a learned workspace cycle, or a temporary made
//! and closed each step, costs no driver call once it has been seen. Reuse is safe without
//! events because every piece of work of a device runs on its one stream, in order. The cache
//! holds at most [`CACHE_ENTRIES`](cache::CACHE_ENTRIES) allocations and
//! [`CACHE_BYTES`](cache::CACHE_BYTES) bytes per device, none larger than [`CACHE_LARGEST`]; an
//! allocation the driver refuses for lack of memory empties it and retries.

use std::ptr::NonNull;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use super::cache::{self, size_class, CACHE_LARGEST};
use super::device::{gpu, pinned_alloc, Gpu};
use crate::error::Ctx;
use crate::locks;
use crate::memory;
use crate::Result;

/// One allocation of device memory, freed in stream order when dropped (or, for an array's
/// own memory, given to the device's [`Cache`](cache::Cache)). Accounting against the memory
/// limit is its owner's business.
pub(crate) struct DeviceMemory {
    ptr: CUdeviceptr,
    gpu: &'static Gpu,
    /// Bytes allocated (the size class, for the cache), and whether it goes back to the cache.
    size: usize,
    cached: bool,
}

impl DeviceMemory {
    /// `bytes > 0` of device memory on `ordinal` (for a workspace block).
    pub fn alloc(ctx: &Ctx, ordinal: usize, bytes: usize) -> Result<DeviceMemory> {
        DeviceMemory::on(ctx, gpu(ctx, ordinal)?, bytes)
    }

    fn on(ctx: &Ctx, gpu: &'static Gpu, bytes: usize) -> Result<DeviceMemory> {
        Ok(DeviceMemory {
            ptr: gpu.malloc_or_release(ctx, bytes)?,
            gpu,
            size: bytes,
            cached: false,
        })
    }

    /// An array's own memory of at least `bytes`: from the device's cache if it holds an
    /// allocation of the same size class (no driver call), else from the driver. It goes back
    /// to the cache when dropped.
    pub fn reused(ctx: &Ctx, gpu: &'static Gpu, bytes: usize) -> Result<DeviceMemory> {
        let size = size_class(bytes);
        if size > CACHE_LARGEST {
            return DeviceMemory::on(ctx, gpu, bytes);
        }
        // The cache's lock is released before a malloc: on out-of-memory the malloc empties
        // the caches, this one included.
        let kept = cache::of(gpu.ordinal).lock().take(size);
        if kept.is_some() {
            memory::cache_dropped(gpu.device(), size);
        }
        let ptr = match kept {
            Some(ptr) => ptr,
            None => gpu.malloc_or_release(ctx, size)?,
        };
        Ok(DeviceMemory {
            ptr,
            gpu,
            size,
            cached: true,
        })
    }

    /// The device address of the first byte (for the memory timeline).
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device it is on.
    pub fn gpu(&self) -> &'static Gpu {
        self.gpu
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.cached {
            let evicted = cache::of(self.gpu.ordinal).lock().put(self.size, self.ptr);
            let device = self.gpu.device();
            memory::cache_held(device, self.size);
            for (size, ptr) in evicted {
                memory::cache_dropped(device, size);
                self.gpu.free(ptr);
            }
        } else {
            self.gpu.free(self.ptr);
        }
    }
}

/// Page-locked (pinned) host memory registered with the CUDA driver: copies to and from the
/// device run at full bus speed (a `MirroringPolicy::HostOnly` workspace block).
pub(crate) struct PinnedMemory {
    base: NonNull<u8>,
    gpu: &'static Gpu,
}

// SAFETY: plain host memory owned by this value; see `Block`, which hands out disjoint slices.
unsafe impl Send for PinnedMemory {}
// SAFETY: as above.
unsafe impl Sync for PinnedMemory {}

impl PinnedMemory {
    /// `bytes > 0` of zeroed page-locked host memory, registered with device `ordinal`'s
    /// driver. The driver running out of page-locked memory is `OutOfMemory` on the host.
    pub fn alloc(ctx: &Ctx, ordinal: usize, bytes: usize) -> Result<PinnedMemory> {
        let gpu = gpu(ctx, ordinal)?;
        gpu.bind(ctx)?;
        let base = pinned_alloc(ctx, gpu, bytes)?;
        // SAFETY: `base` points to `bytes` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(base.as_ptr(), 0, bytes) };
        Ok(PinnedMemory { base, gpu })
    }

    /// The first byte.
    pub fn base(&self) -> NonNull<u8> {
        self.base
    }
}

impl Drop for PinnedMemory {
    /// `cuMemFreeHost` waits for the device: never under the arena lock (where a workspace's
    /// block may drop), so it runs once this thread has released it.
    fn drop(&mut self) {
        let (base, gpu) = (self.base.as_ptr() as usize, self.gpu);
        locks::outside_arena(move || {
            if gpu.ctx.bind_to_thread().is_ok() {
                // SAFETY: allocated by `cuMemHostAlloc` and freed once; its arrays (which keep
                // the block alive) are gone.
                let _ = unsafe { result::free_host(base as *mut std::ffi::c_void) };
            }
        });
    }
}
