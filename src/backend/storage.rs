//! [`Storage`]: the bytes of one array, on the host or on a CUDA device.

use super::cpu::buffer::HostBuffer;
use super::cuda::DeviceBuffer;
use crate::error::Ctx;
use crate::{Device, Element, Result};

/// The bytes of one array: a host buffer, or device memory of one CUDA device. Either its own
/// allocation or a slice of a workspace [`Block`](super::Block). It lives in the data lock of its
/// array, which is what makes sharing it between threads sound.
pub(crate) enum Storage {
    /// Host memory ([`HostBuffer`]), computed on by the CPU kernels.
    Host(HostBuffer),
    /// Memory of a CUDA device, computed on by its kernels and cuBLAS.
    Cuda(DeviceBuffer),
}

impl Storage {
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
