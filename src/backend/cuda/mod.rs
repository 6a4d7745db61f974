//! The CUDA backend (cudarc: driver, cuBLAS, NVRTC kernels), or without the `cuda` feature a
//! stub with the same items whose device types have no values.
//!
//! - `device.rs`: finding the libraries and devices without panicking; per device one context,
//!   one stream, one cuBLAS handle, staging and scratch memory.
//! - `driver.rs`: a driver error's description, and the test overrides of
//!   `NDSCOPE_CUDA_PRETEND` (a leaf under the devices and the kernels).
//! - `memory.rs`: raw memory regions: one allocation of device memory (stream-ordered), and
//!   page-locked host memory; `cache.rs`: the per-device cache of freed array memory.
//! - `buffer.rs`: an array's device memory, its own allocation or a slice of a workspace block.
//! - `kernels.rs` and `kernels/*.cu`: the kernels, one source file per op family (the shared
//!   device code in `common.cu`), compiled by NVRTC as one program and cached on disk.
//! - `ops/`: the op families, one file each (launch, error, transfer, elementwise, reduce,
//!   matmul, nn, shape).

#[cfg(feature = "cuda")]
mod buffer;
#[cfg(feature = "cuda")]
mod cache;
#[cfg(feature = "cuda")]
mod device;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod lt;
#[cfg(feature = "cuda")]
mod memory;
#[cfg(feature = "cuda")]
mod ops;

#[cfg(feature = "cuda")]
pub(crate) use buffer::DeviceBuffer;
#[cfg(feature = "cuda")]
pub(crate) use device::{device_count, prepare, release_cached, unavailable_reason};
#[cfg(feature = "cuda")]
pub(crate) use memory::{DeviceMemory, PinnedMemory};
#[cfg(feature = "cuda")]
pub(crate) use ops::*;

#[cfg(not(feature = "cuda"))]
mod stub;
#[cfg(not(feature = "cuda"))]
pub(crate) use stub::*;
