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
