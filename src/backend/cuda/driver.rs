//! What the CUDA driver and the environment say, for the rest of the backend to quote: a driver
//! error's name and description, and the values `NDSCOPE_CUDA_PRETEND` makes the backend see
//! in tests. A leaf: the devices (`device.rs`) and the kernels (`kernels.rs`) both use it.

use cudarc::driver::DriverError;

/// `name (description)` of a driver error, e.g. `CUDA_ERROR_OUT_OF_MEMORY (out of memory)`.
pub(crate) fn describe(e: DriverError) -> String {
    let name = e
        .error_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|_| format!("{:?}", e.0));
    match e.error_string() {
        Ok(text) => format!("{name} ({})", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// A value of `NDSCOPE_CUDA_PRETEND` (for tests: `driver=12040,cc=70,nvrtc_max=89` makes the
/// backend see that driver version, compute capability or newest NVRTC target instead of the
/// machine's; `nccl_init=N,nccl_connect=M` makes each NCCL communicator seem to take N bytes
/// of device memory more at its initialisation and M more at its first collective), or `None`.
pub(crate) fn pretend(key: &str) -> Option<i32> {
    let text = std::env::var("NDSCOPE_CUDA_PRETEND").ok()?;
    text.split(',').find_map(|pair| {
        let (k, v) = pair.split_once('=')?;
        (k.trim() == key).then(|| v.trim().parse().ok()).flatten()
    })
}
