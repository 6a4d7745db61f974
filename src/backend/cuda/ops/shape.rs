//! Shape ops that move elements: `transpose`, `permute` (through `gather`), and the pitched row
//! copies of `narrow` and `interleave`.

use cudarc::driver::sys::CUdeviceptr;

use super::elementwise::gather;
use super::launch::{linear, same_gpu, size, tiles32, Src};
use super::Cuda;
use crate::backend::contract::{Lanes, ShapeOps};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::Gpu;
use crate::backend::layout::contiguous_strides;
use crate::error::Ctx;
use crate::{DType, Result};

// ---- shape / gather ----

/// Copies `rows` rows of `cols` elements of `elem` bytes between pitched layouts.
fn copy_rows(
    ctx: &Ctx,
    gpu: &Gpu,
    elem: usize,
    (src, src_pitch): (CUdeviceptr, usize),
    (dst, dst_pitch): (CUdeviceptr, usize),
    (rows, cols): (usize, usize),
) -> Result<()> {
    let total = (rows * cols) as u64;
    if total == 0 {
        return Ok(());
    }
    let f = gpu.kernels.sized(ctx, "copy_rows", elem)?;
    // SAFETY: copy_rows_b<N>(const T* src, T* dst, u64 rows, u64 cols, u64 src_pitch,
    // u64 dst_pitch); both ranges lie inside locked storage of `gpu`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, total);
            ps = src, pd = dst, r = rows as u64, c = cols as u64, sp = src_pitch as u64,
            dp = dst_pitch as u64)
    }
}

impl ShapeOps for Cuda {
    fn transpose(
        ctx: &Ctx,
        dtype: DType,
        src: &DeviceBuffer,
        (rows, cols): (usize, usize),
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let f = gpu.kernels.sized(ctx, "transpose", dtype.size_in_bytes())?;
        let cfg = tiles32(gpu, (rows, cols), (32, 8));
        // SAFETY: transpose_b<N>(const T* src, T* dst, u64 rows, u64 cols); locked storage of `gpu`
        // holding rows·cols elements each.
        unsafe {
            launch!(ctx, gpu, f, cfg;
                ps = src.ptr(), pd = dst.ptr(), r = rows as u64, c = cols as u64)
        }
    }

    fn permute(
        ctx: &Ctx,
        dtype: DType,
        (src, dims): Src<'_>,
        perm: &[usize],
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
        let in_strides = contiguous_strides(dims);
        let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let strides: Vec<usize> = perm.iter().map(|&p| in_strides[p]).collect();
        gather(
            ctx,
            gpu,
            dtype.size_in_bytes(),
            (src.ptr(), size(dims), strides),
            (dst.ptr(), &out_dims),
        )
    }

    fn narrow(
        ctx: &Ctx,
        elem: usize,
        src: &DeviceBuffer,
        Lanes {
            outer,
            len: n,
            inner,
        }: Lanes,
        start: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[src.gpu(), dst.gpu()])?;
        let row = dst.bytes().checked_div(outer * elem).unwrap_or(0);
        let offset = (start * inner * elem) as u64;
        copy_rows(
            ctx,
            gpu,
            elem,
            (src.ptr() + offset, n * inner),
            (dst.ptr(), row),
            (outer, row),
        )
    }

    fn interleave(
        ctx: &Ctx,
        srcs: &[&DeviceBuffer],
        row_bytes: &[usize],
        outer: usize,
        dst: &mut DeviceBuffer,
    ) -> Result<()> {
        let mut gpus: Vec<&Gpu> = srcs.iter().map(|s| s.gpu()).collect();
        gpus.push(dst.gpu());
        let gpu = same_gpu(ctx, &gpus)?;
        let total: usize = row_bytes.iter().sum();
        // Rows are whole elements: copy them as the widest element size dividing every length.
        let elem = [8, 4, 1]
            .into_iter()
            .find(|&e| total.is_multiple_of(e) && row_bytes.iter().all(|b| b.is_multiple_of(e)))
            .unwrap_or(1);
        let mut at = 0;
        for (src, &len) in srcs.iter().zip(row_bytes) {
            copy_rows(
                ctx,
                gpu,
                elem,
                (src.ptr(), len / elem),
                (dst.ptr() + at as u64, total / elem),
                (outer, len / elem),
            )?;
            at += len;
        }
        Ok(())
    }
}
