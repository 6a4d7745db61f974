//! [`Storage`]: the bytes of one array, on the host or on a CUDA device, and how it is made: its
//! own allocation, an adopted `Vec`, or a slice carved from a workspace [`Block`].
//!
//! The order below it: raw memory regions (host RAM and mapped files in `block.rs`, device and
//! page-locked memory in `cuda/memory.rs`), then the workspace [`Block`] over them, then the two
//! buffers (`cpu/buffer.rs`, `cuda/buffer.rs`), each its own allocation or a slice of a block,
//! then `Storage` over the buffers. Carving a block into storage names both buffers, so it lives
//! here, at the top ([`Block::carve`]), not beside the block.

use std::sync::Arc;

use super::block::{Base, Block};
use super::cpu::buffer::HostBuffer;
use super::cuda::DeviceBuffer;
#[cfg(feature = "cuda")]
use super::cuda::DeviceMemory;
use crate::error::Ctx;
use crate::{Device, Element, Result};

/// The bytes of one array: a host buffer, or device memory of one CUDA device. Either its own
/// allocation or a slice of a workspace [`Block`]. It lives in the data lock of its
/// array, which is what makes sharing it between threads sound.
pub(crate) enum Storage {
    /// Host memory ([`HostBuffer`]), computed on by the CPU kernels.
    Host(HostBuffer),
    /// Memory of a CUDA device, computed on by its kernels and cuBLAS.
    Cuda(DeviceBuffer),
}

impl Storage {
    /// Notes, for graph replay, that the calling thread's op holds these bytes locked (for
    /// writing or reading) until the guard drops; nothing for host memory, and only that device
    /// bytes are locked (not which) while no cycle replays.
    #[inline(always)]
    pub fn note_locked(&self, write: bool) -> Option<crate::backend::cuda::Noted> {
        match self {
            Storage::Host(_) => None,
            Storage::Cuda(_) if !crate::backend::cuda::any_replaying() => {
                Some(crate::backend::cuda::note_unreplayed())
            }
            Storage::Cuda(buffer) => Some(crate::backend::cuda::note(
                buffer.address(),
                buffer.bytes(),
                write,
            )),
        }
    }

    /// Storage for `bytes` on `device`, reserved against the device's memory limit first. Host
    /// memory is zeroed; device memory is not (see [`may_be_stale`](Self::may_be_stale)).
    pub fn alloc(ctx: &Ctx, device: Device, bytes: usize) -> Result<Storage> {
        match device {
            Device::Cpu => HostBuffer::heap(ctx, device, bytes).map(Storage::Host),
            Device::Cuda(ordinal) => DeviceBuffer::alloc(ctx, ordinal, bytes).map(Storage::Cuda),
        }
    }

    /// Host storage that adopts a `Vec`'s allocation without copying.
    pub fn from_vec<T: Element>(ctx: &Ctx, data: Vec<T>) -> Result<Storage> {
        HostBuffer::from_vec(ctx, data).map(Storage::Host)
    }

    /// The address of the first byte (host pointer or device pointer), 0 for zero bytes. For
    /// the memory timeline only: it is never dereferenced.
    pub fn address(&self) -> u64 {
        match self {
            Storage::Host(buffer) => buffer.address(),
            Storage::Cuda(buffer) => buffer.address(),
        }
    }

    /// `true` when the bytes may hold data of an earlier array (a workspace block slice, or fresh
    /// device memory), so a factory that needs zeros must write them.
    pub fn may_be_stale(&self) -> bool {
        match self {
            Storage::Host(buffer) => buffer.is_block(),
            Storage::Cuda(_) => true,
        }
    }
}

impl Block {
    /// Storage for `[offset, offset + bytes)` of the block, keeping the block alive; `None` if
    /// the range does not lie inside it.
    ///
    /// # Safety
    /// The range must not overlap the storage of any other live array: the workspace's allocator
    /// hands each range to one array at a time, and closes the arrays a circular workspace wraps
    /// over before their range is handed out again.
    #[inline(always)]
    pub unsafe fn carve(self: &Arc<Block>, offset: usize, bytes: usize) -> Option<Storage> {
        let end = offset.checked_add(bytes)?;
        if end > self.capacity() {
            return None;
        }
        Some(match self.base() {
            Base::Host(base) => {
                // SAFETY: `offset + bytes <= capacity`, so the pointer stays inside the
                // allocation; the base is 64-byte aligned and offsets are multiples of the
                // workspace alignment; host blocks are zeroed when created and only ever hold
                // element values; the caller guarantees the range is handed to no other live
                // buffer.
                let buffer = unsafe {
                    HostBuffer::block_slice(Arc::clone(self), base.as_ptr().add(offset), bytes)
                };
                Storage::Host(buffer)
            }
            Base::Device(memory) => memory.carve(Arc::clone(self), offset, bytes),
        })
    }
}

#[cfg(feature = "cuda")]
impl DeviceMemory {
    /// Storage for `[offset, offset + bytes)` of this block's memory, keeping `block` alive.
    /// The caller ([`Block::carve`]) checked the range.
    #[inline]
    pub fn carve(&self, block: Arc<Block>, offset: usize, bytes: usize) -> Storage {
        Storage::Cuda(DeviceBuffer::block_slice(block, self, offset, bytes))
    }
}
