//! Compute backends. They know nothing of managers: they take raw buffers and shapes.
//!
//! `cpu/` holds the loops (with `gemm` for matrix products, and a worker pool of its own for large
//! elementwise work). The CUDA backend (cudarc: driver, cuBLAS, NVRTC kernels) comes with the
//! `cuda` feature's own issue; until then the feature builds and reports no devices.

pub(crate) mod cpu;

/// CUDA devices usable by this build: none until the CUDA backend lands.
pub(crate) fn cuda_count() -> usize {
    0
}
