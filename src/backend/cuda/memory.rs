//! Device memory of arrays and workspace blocks, and page-locked host memory.
//!
//! An array's own device memory comes from the stream-ordered allocator
//! (`cuMemAllocAsync`) and goes back with `cuMemFreeAsync`, never `cuMemFree`, which would
//! synchronise the whole device. A workspace block is one such allocation, carved by offset.
//!
//! Memory of arrays that close is kept in a small per-device cache of freed allocations
//! ([`Cache`]) and handed to the next array of the same rounded size without asking the
//! driver: an array that spills from a learned workspace cycle, or a temporary made and closed
//! each step, costs no driver call once it has been seen. Reuse is safe without events because
//! every piece of work of a device runs on its one stream, in order. The cache holds at most
//! [`CACHE_ENTRIES`] allocations and [`CACHE_BYTES`] bytes per device, none larger than
//! [`CACHE_LARGEST`]; an allocation the driver refuses for lack of memory empties it and retries.

use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use super::device::{gpu, lock_or_try, pinned_alloc, Gpu};
use crate::backend::{Block, Storage};
use crate::error::Ctx;
use crate::locks;
use crate::memory;
use crate::Result;

/// The device memory of one array: its own allocation, or a slice of a workspace block.
pub(crate) struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
    gpu: &'static Gpu,
    backing: Backing,
}

enum Backing {
    /// Zero bytes; `ptr` is 0.
    Empty,
    /// Its own allocation, reserved against the device's limit (released on drop).
    Own(#[allow(dead_code)] DeviceMemory),
    /// A slice of a block, which it keeps alive.
    Block(#[allow(dead_code)] Arc<Block>),
}

impl DeviceBuffer {
    /// `bytes` of uninitialised memory on device `ordinal`, reserved against its limit first
    /// (a refusal by the limit or by the driver is `OutOfMemory`, and nothing is reserved).
    pub fn alloc(ctx: &Ctx, ordinal: usize, bytes: usize) -> Result<DeviceBuffer> {
        let gpu = gpu(ctx, ordinal)?;
        if bytes == 0 {
            return Ok(DeviceBuffer {
                ptr: 0,
                bytes: 0,
                gpu,
                backing: Backing::Empty,
            });
        }
        memory::reserve(ctx, gpu.device(), bytes)?;
        match DeviceMemory::reused(ctx, gpu, bytes) {
            Ok(memory) => Ok(DeviceBuffer {
                ptr: memory.ptr,
                bytes,
                gpu,
                backing: Backing::Own(memory),
            }),
            Err(e) => {
                memory::release(gpu.device(), bytes);
                Err(e)
            }
        }
    }

    /// The device address of the first byte.
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device address of the first byte, as the memory timeline records it.
    pub fn address(&self) -> u64 {
        self.ptr
    }

    /// Bytes of data.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The device it is on.
    pub fn gpu(&self) -> &'static Gpu {
        self.gpu
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if let Backing::Own(_) = self.backing {
            // The memory itself is freed (stream-ordered) when the field drops, after this.
            memory::release(self.gpu.device(), self.bytes);
        }
    }
}

/// One allocation of device memory, freed in stream order when dropped (or, for an array's
/// own memory, given to the device's [`Cache`]). Accounting against the memory limit is its
/// owner's business.
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
    fn reused(ctx: &Ctx, gpu: &'static Gpu, bytes: usize) -> Result<DeviceMemory> {
        let size = size_class(bytes);
        if size > CACHE_LARGEST {
            return DeviceMemory::on(ctx, gpu, bytes);
        }
        // The cache's lock is released before a malloc: on out-of-memory the malloc empties
        // the caches, this one included.
        let kept = cache(gpu).lock().take(size);
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

    /// Storage for `[offset, offset + bytes)` of this block's memory, keeping `block` alive.
    /// The caller (the block) checked the range.
    pub fn carve(&self, block: Arc<Block>, offset: usize, bytes: usize) -> Storage {
        Storage::Cuda(DeviceBuffer {
            ptr: self.ptr + offset as u64,
            bytes,
            gpu: self.gpu,
            backing: if bytes == 0 {
                Backing::Empty
            } else {
                Backing::Block(block)
            },
        })
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.cached {
            let evicted = cache(self.gpu).lock().put(self.size, self.ptr);
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

/// Most allocations a device's cache keeps.
pub(crate) const CACHE_ENTRIES: usize = 64;
/// Most bytes a device's cache keeps.
pub(crate) const CACHE_BYTES: usize = 256 << 20;
/// The largest allocation the cache keeps (larger ones go back to the driver at once).
pub(crate) const CACHE_LARGEST: usize = 64 << 20;

/// The size an array's own allocation of `bytes` is rounded up to, so arrays of nearly the
/// same size share allocations: 512 bytes up to 64 KiB, then a quarter of the power of two
/// below (at most 25 % more than asked).
fn size_class(bytes: usize) -> usize {
    if bytes <= 64 << 10 {
        return bytes.div_ceil(512) * 512;
    }
    let step = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 4;
    bytes.div_ceil(step).saturating_mul(step)
}

/// Freed device allocations of arrays of one device, by size class, oldest first. Held under
/// its mutex; the pointers belong to the device's context and are free for reuse (everything
/// queued before their free runs before whatever is queued after their reuse: one stream).
pub(crate) struct Cache {
    free: Vec<(usize, CUdeviceptr)>,
    bytes: usize,
}

impl Cache {
    const fn new() -> Cache {
        Cache {
            free: Vec::new(),
            bytes: 0,
        }
    }

    /// An allocation of exactly `size`, if one is kept (the most recently freed).
    fn take(&mut self, size: usize) -> Option<CUdeviceptr> {
        let at = self.free.iter().rposition(|&(s, _)| s == size)?;
        let (_, ptr) = self.free.remove(at);
        self.bytes -= size;
        Some(ptr)
    }

    /// Keeps `ptr` (of `size`); returns the allocations to free now: the oldest ones while the
    /// cache is over its limits.
    fn put(&mut self, size: usize, ptr: CUdeviceptr) -> Vec<(usize, CUdeviceptr)> {
        self.free.push((size, ptr));
        self.bytes += size;
        let mut evicted = Vec::new();
        while self.free.len() > CACHE_ENTRIES || self.bytes > CACHE_BYTES {
            let (s, p) = self.free.remove(0);
            self.bytes -= s;
            evicted.push((s, p));
        }
        evicted
    }

    /// Everything kept, emptying the cache.
    fn drain(&mut self) -> Vec<CUdeviceptr> {
        self.bytes = 0;
        self.free.drain(..).map(|(_, p)| p).collect()
    }
}

static CACHES: [Mutex<Cache>; memory::MAX_CUDA_DEVICES] =
    [const { Mutex::new(Cache::new()) }; memory::MAX_CUDA_DEVICES];

fn cache(gpu: &Gpu) -> &'static Mutex<Cache> {
    &CACHES[gpu.ordinal.min(memory::MAX_CUDA_DEVICES - 1)]
}

/// Gives the allocations the cache of `gpu` keeps back to the driver (in stream order);
/// returns their bytes. With `wait`, waits for the cache's lock; without, gives up (returning 0)
/// when another thread holds it.
pub(crate) fn release_array_cache(gpu: &Gpu, wait: bool) -> usize {
    let (bytes, freed) = {
        let Some(mut c) = lock_or_try(cache(gpu), wait) else {
            return 0;
        };
        (c.bytes, c.drain())
    };
    memory::cache_dropped(gpu.device(), bytes);
    for ptr in freed {
        gpu.free(ptr);
    }
    bytes
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
