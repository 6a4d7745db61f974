//! Device memory of arrays and workspace blocks, and page-locked host memory.
//!
//! An array's own device memory comes from the stream-ordered allocator
//! (`cuMemAllocAsync`) and goes back with `cuMemFreeAsync`, never `cuMemFree`, which would
//! synchronise the whole device. A workspace block is one such allocation, carved by offset.

use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{result, sys};

use super::device::{driver_error, gpu, Gpu};
use crate::backend::{Block, Storage};
use crate::error::Ctx;
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
        match DeviceMemory::on(ctx, gpu, bytes) {
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

/// One allocation of device memory, freed in stream order when dropped. Accounting against the
/// memory limit is its owner's business.
pub(crate) struct DeviceMemory {
    ptr: CUdeviceptr,
    gpu: &'static Gpu,
}

impl DeviceMemory {
    /// `bytes > 0` of device memory on `ordinal` (for a workspace block).
    pub fn alloc(ctx: &Ctx, ordinal: usize, bytes: usize) -> Result<DeviceMemory> {
        DeviceMemory::on(ctx, gpu(ctx, ordinal)?, bytes)
    }

    fn on(ctx: &Ctx, gpu: &'static Gpu, bytes: usize) -> Result<DeviceMemory> {
        Ok(DeviceMemory {
            ptr: gpu.malloc(ctx, bytes)?,
            gpu,
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
        self.gpu.free(self.ptr);
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
    /// driver.
    pub fn alloc(ctx: &Ctx, ordinal: usize, bytes: usize) -> Result<PinnedMemory> {
        let gpu = gpu(ctx, ordinal)?;
        gpu.bind(ctx)?;
        // SAFETY: the context is current; the memory is zeroed below before anyone reads it.
        let ptr = unsafe { result::malloc_host(bytes, sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map_err(|e| driver_error(ctx, "cuMemHostAlloc", e))?;
        let Some(base) = NonNull::new(ptr.cast::<u8>()) else {
            return Err(memory::driver_refused(ctx, crate::Device::Cpu, bytes));
        };
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
    fn drop(&mut self) {
        if self.gpu.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `cuMemHostAlloc` and freed once; its arrays (which keep the
            // block alive) are gone.
            let _ = unsafe { result::free_host(self.base.as_ptr().cast()) };
        }
    }
}
