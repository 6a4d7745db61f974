//! CUDA-specific controls (PyTorch's `torch.cuda`): what the backend holds for reuse beyond the
//! memory of live arrays, and giving it back.
//!
//! The backend keeps, per device, memory that makes steady-state work cheaper: a cache of freed
//! array allocations by size class, the reduction scratch, two page-locked staging buffers for
//! pageable copies, cuBLAS's workspace, and what the driver's memory pool keeps after frees.
//! [`memory_usage`](crate::memory_usage) counts them in `cached`, apart from `in_use`.
//! [`release_cached`] gives them back (like `torch.cuda.empty_cache`); the next op that needs
//! one of them allocates it again. A refused allocation releases them and tries once more by
//! itself, and they are released when the process exits.
//!
//! `cached` also counts the device memory of the live NCCL communicators of a
//! [`ParallelTrainer`](crate::ParallelTrainer) ([`communicator_bytes`]), which only closing the
//! trainer gives back.

use crate::error::Ctx;
use crate::{Device, Result};

/// Gives back everything the CUDA backend holds on `device` that no array uses (the cached
/// array allocations, scratch, staging buffers, cuBLAS workspace and the driver pool's unused
/// memory), after the device's queued work. Returns the bytes given back (without the pool's,
/// which the driver does not report per release). Arrays and workspaces are untouched.
///
/// Errors: `InvalidArgument` for [`Device::Cpu`] (the host allocator keeps no cache of
/// ndscope's), `DeviceUnavailable` for a CUDA device that does not exist or cannot be used.
/// A device not used yet holds nothing: `Ok(0)`, without setting it up.
///
/// ```
/// use ndscope::{cuda, Device};
/// match cuda::release_cached(Device::Cuda(0)) {
///     Ok(bytes) => println!("gave back {bytes} bytes"),
///     Err(e) => println!("no CUDA device: {e}"),
/// }
/// assert!(cuda::release_cached(Device::Cpu).is_err());
/// ```
#[track_caller]
pub fn release_cached(device: Device) -> Result<usize> {
    let ctx = Ctx::new("cuda::release_cached");
    match device {
        Device::Cpu => Err(ctx.invalid(
            "the CPU has no backend cache to release: release_cached takes a CUDA device",
        )),
        Device::Cuda(ordinal) => {
            if !device.is_available() {
                return Err(ctx.unavailable(device));
            }
            Ok(crate::backend::cuda_release_cached(ordinal))
        }
    }
}

/// Bytes of device memory the live NCCL communicators on `device` hold (those of
/// [`ParallelTrainer`](crate::ParallelTrainer)s, one per device and trainer), counted in
/// [`memory_usage(device).cached`](crate::DeviceUsage::cached) until they are destroyed (the
/// trainer closed or dropped) or aborted; 0 on the CPU and without communicators.
///
/// NCCL does not report its memory, so it is measured: how much the device's used memory grew
/// (as the driver reports it) while `ncclCommInitRank` ran, and while the communicator's first
/// collective (and any larger than those before) made its connections, minus what ndscope's
/// own memory pool grew meanwhile, never below 0. Memory NCCL allocates once per process with
/// the first communicator (its kernels' code) is counted with it, though destroying it does not
/// give that back; another process allocating on the same device at that moment is counted
/// too. The figure is read on the host, with no wait for the device.
///
/// ```
/// use ndscope::{cuda, Device};
/// assert_eq!(cuda::communicator_bytes(Device::Cpu), 0);
/// let held = cuda::communicator_bytes(Device::Cuda(0));
/// assert!(ndscope::memory_usage(Device::Cuda(0)).cached >= held);
/// ```
pub fn communicator_bytes(device: Device) -> usize {
    crate::memory::communicator_bytes(device)
}
