//! [`HostBuffer`]: an array's storage in host memory, a span of host bytes owned by one array
//! (not the public `HostArray`, whose data the caller owns, nor a CUDA device's page-locked
//! staging buffers).
//!
//! A buffer is either its own heap allocation (freed, and its reservation released, when the
//! buffer drops) or a slice of a workspace [`Block`] (RAM, a mapped file or page-locked memory):
//! the slice holds an `Arc` to that block, so the block outlives every slice. Buffers live in
//! the `RwLock` of their array, which is what makes sharing them between threads sound.

use std::alloc::Layout;
use std::mem::ManuallyDrop;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::backend::block::{Block, STORAGE_ALIGN};
use crate::error::Ctx;
use crate::memory;
use crate::{Device, Element, Result};

/// Host bytes of one array: what `Storage::Host` holds, the host counterpart of the CUDA
/// `DeviceBuffer` (so the name stays: `Storage::Host(HostBuffer)` is one idea, an array's
/// storage in host memory).
///
/// Unlike the public [`HostArray`](crate::HostArray), which the caller owns, it belongs to an
/// array inside a manager, may be a slice of a workspace block, and is only reached through the
/// array's data lock. Unlike a CUDA device's `StagingBuffers` (page-locked memory that bytes
/// pass through on their way to or from a device), it holds an array's elements.
pub(crate) struct HostBuffer {
    ptr: NonNull<u8>,
    bytes: usize,
    backing: Backing,
}

enum Backing {
    /// Zero bytes; `ptr` is dangling but aligned.
    Empty,
    /// Our own allocation with this layout, reserved on this device.
    Heap { layout: Layout, device: Device },
    /// A slice of a block kept alive by this handle.
    Block(#[cfg_attr(not(feature = "cuda"), allow(dead_code))] Arc<Block>),
}

// SAFETY: a `HostBuffer` is the only handle to its bytes (its own allocation, or a block slice that
// the block's allocator hands to one buffer at a time). It is only reached through the `RwLock`
// of its array, which serialises writers against readers, so moving it or sharing `&HostBuffer`
// across threads is sound.
unsafe impl Send for HostBuffer {}
// SAFETY: see `Send`: `&HostBuffer` only gives shared (read) access to the bytes.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    fn dangling() -> NonNull<u8> {
        // SAFETY: STORAGE_ALIGN is non-zero, so the pointer is non-null; it is never dereferenced
        // for a zero-byte buffer.
        unsafe { NonNull::new_unchecked(STORAGE_ALIGN as *mut u8) }
    }

    /// A zero-byte buffer.
    pub fn empty() -> HostBuffer {
        HostBuffer {
            ptr: HostBuffer::dangling(),
            bytes: 0,
            backing: Backing::Empty,
        }
    }

    /// A zeroed heap buffer of `bytes`, reserved against `device`'s limit first.
    pub fn heap(ctx: &Ctx, device: Device, bytes: usize) -> Result<HostBuffer> {
        if bytes == 0 {
            return Ok(HostBuffer::empty());
        }
        let layout = Layout::from_size_align(bytes, STORAGE_ALIGN)
            .map_err(|_| memory::system_refused(ctx, device, bytes))?;
        memory::reserve(ctx, device, bytes)?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        match NonNull::new(ptr) {
            Some(ptr) => {
                memory::driver_allocated(device);
                Ok(HostBuffer {
                    ptr,
                    bytes,
                    backing: Backing::Heap { layout, device },
                })
            }
            None => {
                memory::release(device, bytes);
                Err(memory::system_refused(ctx, device, bytes))
            }
        }
    }

    /// Adopts a `Vec`'s allocation without copying, reserving its capacity against the CPU limit.
    /// On error the vector is dropped and nothing is reserved.
    pub fn from_vec<T: Element>(ctx: &Ctx, data: Vec<T>) -> Result<HostBuffer> {
        let data = ManuallyDrop::new(data);
        let capacity_bytes = data.capacity() * std::mem::size_of::<T>();
        if capacity_bytes == 0 {
            drop(ManuallyDrop::into_inner(data));
            return Ok(HostBuffer::empty());
        }
        // A Vec's capacity always forms a valid array layout.
        let Ok(layout) = Layout::array::<T>(data.capacity()) else {
            drop(ManuallyDrop::into_inner(data));
            return Err(memory::system_refused(ctx, Device::Cpu, capacity_bytes));
        };
        if let Err(e) = memory::reserve(ctx, Device::Cpu, capacity_bytes) {
            drop(ManuallyDrop::into_inner(data));
            return Err(e);
        }
        let ptr = data.as_ptr() as *mut u8;
        Ok(HostBuffer {
            // SAFETY: a Vec with non-zero capacity has a non-null pointer.
            ptr: unsafe { NonNull::new_unchecked(ptr) },
            bytes: data.len() * std::mem::size_of::<T>(),
            backing: Backing::Heap {
                layout,
                device: Device::Cpu,
            },
        })
    }

    /// A slice of `bytes` at `base`, inside `block`, which it keeps allocated.
    ///
    /// # Safety
    /// `base` must be valid for reads and writes of `bytes` bytes for as long as `block` lives,
    /// aligned to `STORAGE_ALIGN`, initialised, and not handed to any other live buffer.
    #[inline]
    pub unsafe fn block_slice(block: Arc<Block>, base: *mut u8, bytes: usize) -> HostBuffer {
        if bytes == 0 {
            return HostBuffer::empty();
        }
        HostBuffer {
            // SAFETY: the caller guarantees `base` points into a live block, so it is non-null.
            ptr: unsafe { NonNull::new_unchecked(base) },
            bytes,
            backing: Backing::Block(block),
        }
    }

    /// The address of the first byte, 0 for a zero-byte buffer (for the memory timeline).
    pub fn address(&self) -> u64 {
        match self.backing {
            Backing::Empty => 0,
            _ => self.ptr.as_ptr() as usize as u64,
        }
    }

    /// `true` if the bytes are a slice of a block (their previous contents are stale).
    pub fn is_block(&self) -> bool {
        matches!(self.backing, Backing::Block(_))
    }

    // Used by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// `true` if the bytes are page-locked (a slice of a pinned block): the CUDA driver copies
    /// them to and from a device directly.
    pub fn is_pinned(&self) -> bool {
        matches!(&self.backing, Backing::Block(block) if block.is_pinned())
    }

    /// The elements, read-only.
    #[inline]
    pub fn as_slice<T: Element>(&self) -> &[T] {
        debug_assert_eq!(self.ptr.as_ptr() as usize % std::mem::align_of::<T>(), 0);
        // SAFETY: `ptr` is valid for `bytes` bytes (an allocation or block slice we own, or
        // dangling with 0 bytes), aligned for every element type (64-byte aligned, or a Vec<T>
        // adopted for this very T), and initialised (heap buffers are zeroed, blocks are zeroed
        // when created and only ever hold element values). `&self` excludes writers.
        unsafe {
            std::slice::from_raw_parts(
                self.ptr.as_ptr() as *const T,
                self.bytes / std::mem::size_of::<T>(),
            )
        }
    }

    /// The elements, writable.
    #[inline]
    pub fn as_mut_slice<T: Element>(&mut self) -> &mut [T] {
        debug_assert_eq!(self.ptr.as_ptr() as usize % std::mem::align_of::<T>(), 0);
        // SAFETY: as in `as_slice`; `&mut self` gives exclusive access.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr() as *mut T,
                self.bytes / std::mem::size_of::<T>(),
            )
        }
    }

    /// The raw bytes, read-only.
    pub fn as_bytes(&self) -> &[u8] {
        // SAFETY: as in `as_slice`, for `u8`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.bytes) }
    }

    /// The raw bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_mut_slice`, for `u8`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.bytes) }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let Backing::Heap { layout, device } = self.backing {
            // SAFETY: `ptr` was allocated by the global allocator with exactly `layout` (our own
            // allocation, or the adopted Vec's array layout) and is freed only here.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
            memory::release(device, layout.size());
        }
    }
}
