//! [`DeviceBuffer`]: an array's storage in the memory of one CUDA device, the device
//! counterpart of the host's `HostBuffer` (`backend/cpu/buffer.rs`). Either its own allocation
//! ([`DeviceMemory`], reserved against the device's limit) or a slice of a workspace [`Block`]'s
//! device memory, which it keeps alive.

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;

use super::device::{gpu, Gpu};
use super::memory::DeviceMemory;
use crate::backend::block::Block;
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
        match DeviceMemory::reused(ctx, gpu, bytes) {
            Ok(memory) => Ok(DeviceBuffer {
                ptr: memory.ptr(),
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

    /// Storage for `[offset, offset + bytes)` of a workspace block's device memory `memory`,
    /// keeping `block` (which owns it) alive. The caller (the block's carving) checked the
    /// range.
    #[inline]
    pub fn block_slice(
        block: Arc<Block>,
        memory: &DeviceMemory,
        offset: usize,
        bytes: usize,
    ) -> DeviceBuffer {
        DeviceBuffer {
            ptr: memory.ptr() + offset as u64,
            bytes,
            gpu: memory.gpu(),
            backing: if bytes == 0 {
                Backing::Empty
            } else {
                Backing::Block(block)
            },
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
