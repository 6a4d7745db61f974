//! The CUDA backend (cudarc: driver, cuBLAS, NVRTC kernels), or without the `cuda` feature a
//! stub with the same items whose device types have no values.

mod stub;
pub(crate) use stub::*;
