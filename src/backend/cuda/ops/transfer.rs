//! Moving bytes: host↔device copies (through page-locked staging memory unless the host side is
//! page-locked), device-to-device copies, zeroing, and dtype conversion.

use cudarc::driver::result;
use cudarc::driver::sys::{self, CUdeviceptr};

use super::capture;
use super::error::{reporting, wait_all};
use super::launch::{elements, linear, memset, same_gpu};
use super::Cuda;
use crate::backend::contract::TransferOps;
use crate::backend::cpu::buffer::HostBuffer;
use crate::backend::cpu::elementwise;
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::{Gpu, STAGING};
use crate::error::Ctx;
use crate::{DType, Element, Result};

// ---- transfers and copies ----

/// Copies host `bytes` to device address `dst` of `gpu`. From pageable memory through the two
/// staging buffers, double-buffered: chunk i+1 is copied into one buffer while chunk i goes to
/// the device from the other, each buffer reused only after the event recorded after its last
/// copy. The copy into a buffer runs on the CPU pool's threads (`elementwise::copy`): on one
/// core, staging ran at 10 GB/s on an H200's host, less than half of a plain pageable
/// `cuMemcpyHtoD` there (22.7 GB/s) and a fifth of the DMA from page-locked memory (52.8 GB/s);
/// on several, the DMA, not the host, bounds the pipeline. From page-locked memory directly,
/// one copy, waiting (on an event) for it since the source is only borrowed.
fn host_to_device(
    ctx: &Ctx,
    gpu: &Gpu,
    bytes: &[u8],
    dst: CUdeviceptr,
    pinned: bool,
) -> Result<()> {
    if bytes.is_empty() {
        return Ok(());
    }
    gpu.bind(ctx)?;
    capture::boundary(ctx, gpu)?;
    let stream = gpu.cu_stream();
    if pinned {
        // SAFETY: `bytes` is page-locked host memory borrowed for this call, which waits for the
        // copy to finish; `dst` holds `bytes.len()` bytes of device memory of this context.
        unsafe { result::memcpy_htod_async(dst, bytes, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyHtoDAsync", e))?;
        return wait_all(ctx, gpu);
    }
    let mut staging = gpu.staging(ctx)?;
    let start = staging.take(bytes.len().div_ceil(STAGING));
    for (i, chunk) in bytes.chunks(STAGING).enumerate() {
        let b = (start + i) % 2;
        staging.wait(ctx, gpu, b)?;
        // SAFETY: the staging buffer holds STAGING bytes, is used only under the staging lock
        // we hold, and its last copy has finished (`wait`); the chunk is at most STAGING bytes.
        let staged = unsafe { std::slice::from_raw_parts_mut(staging.bufs[b], chunk.len()) };
        elementwise::copy(chunk, staged);
        let staged: &[u8] = staged;
        // SAFETY: the staged bytes stay untouched until the event recorded next completes;
        // `dst + offset` lies inside the destination.
        unsafe { result::memcpy_htod_async(dst + (i * STAGING) as u64, staged, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyHtoDAsync", e))?;
        staging.record(ctx, gpu, b)?;
    }
    Ok(())
}

/// Copies `out.len()` bytes at device address `src` of `gpu` to the host, after all work queued
/// before (a synchronisation: errors of earlier kernels are reported here). Into pageable memory
/// through the staging buffers, chunk i copied out (on the pool's threads, as `host_to_device`
/// copies in) while chunk i+1 comes from the device.
fn device_to_host(
    ctx: &Ctx,
    gpu: &Gpu,
    src: CUdeviceptr,
    out: &mut [u8],
    pinned: bool,
) -> Result<()> {
    if out.is_empty() {
        return wait_all(ctx, gpu);
    }
    gpu.bind(ctx)?;
    capture::boundary(ctx, gpu)?;
    let stream = gpu.cu_stream();
    if pinned {
        // SAFETY: `out` is page-locked host memory borrowed for this call, which waits for the
        // copy to finish; `src` holds `out.len()` bytes of device memory of this context.
        unsafe { result::memcpy_dtoh_async(out, src, stream) }
            .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoHAsync", e))?;
        return wait_all(ctx, gpu);
    }
    let len = out.len();
    let chunks = len.div_ceil(STAGING);
    let mut staging = gpu.staging(ctx)?;
    let start = staging.take(chunks);
    for i in 0..=chunks {
        if i < chunks {
            let b = (start + i) % 2;
            staging.wait(ctx, gpu, b)?;
            let n = STAGING.min(len - i * STAGING);
            // SAFETY: the staging buffer is free (`wait`) and holds at least `n` bytes, which the
            // device writes before the event recorded next completes.
            let slot = unsafe { std::slice::from_raw_parts_mut(staging.bufs[b], n) };
            // SAFETY: `src + offset` lies inside the source.
            unsafe { result::memcpy_dtoh_async(slot, src + (i * STAGING) as u64, stream) }
                .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoHAsync", e))?;
            staging.record(ctx, gpu, b)?;
        }
        if i > 0 {
            let j = i - 1;
            let b = (start + j) % 2;
            staging.wait(ctx, gpu, b)?;
            let n = STAGING.min(len - j * STAGING);
            // SAFETY: the copy into the buffer has finished (`wait`); it holds `n` bytes.
            let staged = unsafe { std::slice::from_raw_parts(staging.bufs[b].cast_const(), n) };
            elementwise::copy(staged, &mut out[j * STAGING..j * STAGING + n]);
        }
    }
    Ok(())
}

/// The bytes of a slice of elements.
fn bytes_of<T: Element>(data: &[T]) -> &[u8] {
    // SAFETY: element types are plain numbers without padding; the length is in bytes.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), std::mem::size_of_val(data)) }
}

/// Copies `bytes` bytes between two device addresses of `gpu`, in stream order.
pub(super) fn copy_bytes(
    ctx: &Ctx,
    gpu: &Gpu,
    src: CUdeviceptr,
    dst: CUdeviceptr,
    bytes: usize,
) -> Result<()> {
    if capture::watching(gpu.ordinal) {
        // In a recorded or replayed cycle a device copy is a kernel (`cast` to the same type,
        // by the widest word both ends align to): a source or destination that changes from
        // one cycle to the next (a prefetched batch copied in) is then an argument written into
        // the graph, not a divergence.
        let word = [8u64, 4, 1]
            .into_iter()
            .find(|&w| (src | dst | bytes as u64).is_multiple_of(w))
            .unwrap_or(1);
        let dtype = match word {
            8 => DType::I64,
            4 => DType::I32,
            _ => DType::U8,
        };
        let n = bytes as u64 / word;
        let f = gpu.kernels.two(ctx, "cast", dtype, dtype)?;
        // SAFETY: cast_<T>_<T>(const T* a, T* out, u64 n): `n` words of `word` bytes at both
        // addresses, which hold `bytes` bytes of device memory of this context (locked storage
        // of the callers) and are aligned to `word`.
        return unsafe { launch!(ctx, gpu, f, linear(gpu, n); a = src, out = dst, count = n) };
    }
    gpu.bind(ctx)?;
    // SAFETY: both ranges are `bytes` of device memory of this context, held by locked storage
    // (callers pass their arrays' addresses and sizes).
    unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, gpu.cu_stream()) }
        .result()
        .map_err(|e| gpu.failed(ctx, "cuMemcpyDtoDAsync", e))
}

impl TransferOps for Cuda {
    fn read<T: Element>(ctx: &Ctx, src: &DeviceBuffer, dst: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(dst);
        // SAFETY: element types are plain numbers valid for every bit pattern; the length is in
        // bytes.
        let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), bytes) };
        let gpu = src.gpu();
        reporting(ctx, gpu, || device_to_host(ctx, gpu, src.ptr(), out, false))
    }

    fn write<T: Element>(ctx: &Ctx, dst: &mut DeviceBuffer, data: &[T]) -> Result<()> {
        host_to_device(ctx, dst.gpu(), bytes_of(data), dst.ptr(), false)
    }

    fn upload(ctx: &Ctx, src: &HostBuffer, dst: &mut DeviceBuffer) -> Result<()> {
        host_to_device(ctx, dst.gpu(), src.as_bytes(), dst.ptr(), src.is_pinned())
    }

    fn download(ctx: &Ctx, src: &DeviceBuffer, dst: &mut HostBuffer) -> Result<()> {
        let pinned = dst.is_pinned();
        let gpu = src.gpu();
        reporting(ctx, gpu, || {
            device_to_host(ctx, gpu, src.ptr(), dst.as_bytes_mut(), pinned)
        })
    }

    fn copy(ctx: &Ctx, src: &DeviceBuffer, dst: &mut DeviceBuffer) -> Result<()> {
        let bytes = src.bytes().min(dst.bytes());
        if bytes == 0 {
            return Ok(());
        }
        let (from, to) = (src.gpu(), dst.gpu());
        if from.ordinal != to.ordinal {
            // Between two devices: through the host.
            let mut host = vec![0u8; bytes];
            device_to_host(ctx, from, src.ptr(), &mut host, false)?;
            return host_to_device(ctx, to, &host, dst.ptr(), false);
        }
        copy_bytes(ctx, from, src.ptr(), dst.ptr(), bytes)
    }

    fn convert(
        ctx: &Ctx,
        (from, to): (DType, DType),
        src: &DeviceBuffer,
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        if from == to {
            return Cuda::copy(ctx, src, dst);
        }
        let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
        let n = elements(dst, to);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.two(ctx, "cast", from, to)?;
        // SAFETY: cast_<from>_<to>(const S* a, D* out, u64 n); both are locked storage of `gpu`.
        unsafe { launch!(ctx, gpu, f, linear(gpu, n); a = src.ptr(), out = dst.ptr(), count = n) }
    }

    fn zero(ctx: &Ctx, dst: &mut DeviceBuffer) -> Result<()> {
        memset(ctx, dst.gpu(), dst.ptr(), 0, dst.bytes())
    }
}
