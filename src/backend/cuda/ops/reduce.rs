//! Reductions along axes (`sum`, `sum_all`, `max_axis`, `argmax_axis`): the passes, the launch
//! shapes of `fold` (shared with softmax), and the split of few long rows over the device.

use cudarc::driver::sys::CUdeviceptr;

use super::launch::{blocks, elements, same_gpu, Config, Src, THREADS};
use super::Cuda;
use crate::backend::contract::{Lanes, ReduceOps, SumOf, TransferOps};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::Gpu;
use crate::backend::layout::{reduction_passes, Pass};
use crate::error::Ctx;
use crate::{DType, Result};

// ---- reductions ----

/// Slices the reduced axis of `pass` is split into, each reduced by its own blocks into a
/// partial result (a second launch reduces those): enough blocks to fill the device when the
/// rows (inner == 1) or the 32-column groups (inner > 1) are few and long; 1 otherwise.
pub(super) fn chunks_for(gpu: &Gpu, pass: Pass) -> usize {
    let wanted = 4 * gpu.sms as usize;
    if pass.inner == 1 {
        if pass.n < (1 << 16) || pass.outer >= wanted {
            return 1;
        }
        return (pass.n / 8192).clamp(1, wanted / pass.outer.max(1)).max(1);
    }
    let groups = (pass.outer * pass.inner).div_ceil(32);
    if pass.n < (1 << 12) || groups >= wanted {
        return 1;
    }
    (pass.n / 1024).clamp(1, wanted / groups.max(1)).max(1)
}

/// Threads per row (a power of two, at most a block) for rows of `len` contiguous elements:
/// about four elements each, so short rows share a block and long ones get a whole block.
fn threads_per_row(len: usize) -> u32 {
    len.div_ceil(4)
        .next_power_of_two()
        .clamp(1, THREADS as usize) as u32
}

/// Launch shape of a kernel over `[outer, n, inner]` in `chunks` slices per row (`fold` and
/// `argmax` of kernels/reduce.cu, `softmax` of kernels/nn.cu), and the threads per row segment it uses when inner == 1:
/// 1-d blocks of `THREADS / tpr` row segments, or 32 × 8 blocks over 32 columns.
pub(super) fn fold_config(gpu: &Gpu, pass: Pass, chunks: usize) -> (Config, u32) {
    if pass.inner == 1 {
        let tpr = threads_per_row(pass.n.div_ceil(chunks.max(1)));
        let cfg = Config {
            blocks: blocks(gpu, (pass.outer * chunks) as u64, u64::from(THREADS / tpr)),
            threads: (THREADS, 1),
        };
        (cfg, tpr)
    } else {
        let groups = (pass.outer * pass.inner).div_ceil(32) * chunks;
        let cfg = Config {
            blocks: blocks(gpu, groups as u64, 1),
            threads: (32, 8),
        };
        (cfg, 1)
    }
}

/// One `sum_<in>_<out>` launch.
fn sum_launch(
    ctx: &Ctx,
    gpu: &Gpu,
    (x, from): (CUdeviceptr, DType),
    (out, to): (CUdeviceptr, DType),
    pass: Pass,
    chunks: usize,
    mean: Option<f64>,
) -> Result<()> {
    let f = gpu.kernels.two(ctx, "sum", from, to)?;
    let (cfg, tpr) = fold_config(gpu, pass, chunks);
    // SAFETY: sum_<in>_<out>(const In* x, Out* out, u64 outer, u64 n, u64 inner, u64 chunks,
    // int mean, f64 count, u32 tpr); `x` and `out` are locked storage or scratch of `gpu` sized
    // for the pass.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = x, po = out, outer = pass.outer as u64, len = pass.n as u64,
            inner = pass.inner as u64, parts = chunks as u64,
            m = i32::from(mean.is_some()), count = mean.unwrap_or(1.0), t = tpr)
    }
}

/// The accumulator dtype of sums of `from`.
fn accumulator(from: DType) -> DType {
    if from.is_float() {
        DType::F64
    } else {
        DType::I64
    }
}

/// Folds one pass of a sum from `x` (`from`) into `out` (`to`), through partial sums in
/// `partial` when the rows are long and few.
fn sum_pass(
    ctx: &Ctx,
    gpu: &Gpu,
    x: (CUdeviceptr, DType),
    out: (CUdeviceptr, DType),
    pass: Pass,
    mean: Option<f64>,
    partial: CUdeviceptr,
) -> Result<()> {
    let chunks = chunks_for(gpu, pass);
    if chunks == 1 {
        return sum_launch(ctx, gpu, x, out, pass, 1, mean);
    }
    let acc = accumulator(x.1);
    sum_launch(ctx, gpu, x, (partial, acc), pass, chunks, None)?;
    // The partial sums, [outer, chunks, inner].
    let second = Pass {
        outer: pass.outer,
        n: chunks,
        inner: pass.inner,
    };
    sum_launch(ctx, gpu, (partial, acc), out, second, 1, mean)
}

/// Runs the passes of a sum, accumulating between passes in scratch memory.
fn sum_passes(
    ctx: &Ctx,
    gpu: &Gpu,
    x: (CUdeviceptr, DType),
    out: (CUdeviceptr, DType),
    passes: &[Pass],
    mean: Option<f64>,
) -> Result<()> {
    let acc = accumulator(x.1);
    // Scratch: two accumulator buffers (one pass's output is the next one's input), then the
    // partial sums of a split pass.
    let intermediate = &passes[..passes.len().saturating_sub(1)];
    let largest = intermediate
        .iter()
        .map(|p| p.outer * p.inner)
        .max()
        .unwrap_or(0);
    let partials = passes
        .iter()
        .map(|p| p.outer * p.inner * chunks_for(gpu, *p))
        .max()
        .unwrap_or(0);
    let word = acc.size_in_bytes();
    let mut scratch = gpu.scratch();
    let base = scratch.ensure(ctx, gpu, (2 * largest + partials + 1) * word)?;
    let tmp = [base, base + (largest * word) as u64];
    let partial = base + (2 * largest * word) as u64;
    let mut input = x;
    for (i, pass) in passes.iter().enumerate() {
        let last = i + 1 == passes.len();
        let target = if last { out } else { (tmp[i % 2], acc) };
        sum_pass(
            ctx,
            gpu,
            input,
            target,
            *pass,
            if last { mean } else { None },
            partial,
        )?;
        input = (target.0, acc);
    }
    Ok(())
}

fn max_launch(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (x, out): (CUdeviceptr, CUdeviceptr),
    pass: Pass,
    chunks: usize,
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "max", dtype)?;
    let (cfg, tpr) = fold_config(gpu, pass, chunks);
    // SAFETY: max_<T>(const T* x, T* out, u64 outer, u64 n, u64 inner, u64 chunks, u32 tpr);
    // locked storage or scratch of `gpu` sized for the pass.
    unsafe {
        launch!(ctx, gpu, f, cfg;
            px = x, po = out, outer = pass.outer as u64, len = pass.n as u64,
            inner = pass.inner as u64, parts = chunks as u64, t = tpr)
    }
}

impl ReduceOps for Cuda {
    fn sum(
        ctx: &Ctx,
        SumOf { from, to, mean }: SumOf,
        (a, dims): Src<'_>,
        mask: &[bool],
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        if out.bytes() == 0 {
            return Ok(());
        }
        let passes = reduction_passes(dims, mask);
        if passes.is_empty() {
            // Every reduced axis has size 1: the sum (and the mean) of one element is that element.
            return Cuda::convert(ctx, (from, to), a, out);
        }
        let count: usize = dims
            .iter()
            .zip(mask)
            .filter(|(_, &r)| r)
            .map(|(&d, _)| d)
            .product();
        sum_passes(
            ctx,
            gpu,
            (a.ptr(), from),
            (out.ptr(), to),
            &passes,
            mean.then_some(count as f64),
        )
    }

    fn sum_all(
        ctx: &Ctx,
        SumOf { from, to, mean }: SumOf,
        a: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let n = elements(a, from) as usize;
        let pass = Pass {
            outer: 1,
            n,
            inner: 1,
        };
        sum_passes(
            ctx,
            gpu,
            (a.ptr(), from),
            (out.ptr(), to),
            &[pass],
            mean.then_some(n as f64),
        )
    }

    fn max_axis(
        ctx: &Ctx,
        dtype: DType,
        a: &DeviceBuffer,
        Lanes {
            outer,
            len: n,
            inner,
        }: Lanes,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        if outer * inner == 0 {
            return Ok(());
        }
        let pass = Pass { outer, n, inner };
        let chunks = chunks_for(gpu, pass);
        if chunks == 1 {
            return max_launch(ctx, gpu, dtype, (a.ptr(), out.ptr()), pass, 1);
        }
        let mut scratch = gpu.scratch();
        let partial = scratch.ensure(ctx, gpu, outer * chunks * inner * dtype.size_in_bytes())?;
        max_launch(ctx, gpu, dtype, (a.ptr(), partial), pass, chunks)?;
        // The partial maxima, [outer, chunks, inner].
        let second = Pass {
            outer,
            n: chunks,
            inner,
        };
        max_launch(ctx, gpu, dtype, (partial, out.ptr()), second, 1)
    }

    fn argmax_axis(
        ctx: &Ctx,
        dtype: DType,
        a: &DeviceBuffer,
        Lanes {
            outer,
            len: n,
            inner,
        }: Lanes,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let columns = (outer * inner) as u64;
        if columns == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "argmax", dtype)?;
        let pass = Pass { outer, n, inner };
        // Few long rows are split into slices (inner == 1 only): partial (value, index) pairs in
        // scratch, then `argmax_parts`.
        let chunks = if inner == 1 { chunks_for(gpu, pass) } else { 1 };
        let (cfg, tpr) = fold_config(gpu, pass, chunks);
        if chunks == 1 {
            // SAFETY: argmax_<T>(const T* x, i64* out, u64 outer, u64 n, u64 inner, u32 tpr,
            // u64 chunks, T* part_v, i64* part_i); locked storage of `gpu`; with one chunk the
            // partial arrays are not touched (`out` stands in for them).
            return unsafe {
                launch!(ctx, gpu, f, cfg;
                    px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64,
                    i = inner as u64, t = tpr, parts = 1u64, pv = out.ptr(), pi = out.ptr())
            };
        }
        let segments = outer * chunks;
        let elem = dtype.size_in_bytes();
        let mut scratch = gpu.scratch();
        // The indices first (8-byte aligned), then the values.
        let part_i = scratch.ensure(ctx, gpu, segments * (8 + elem))?;
        let part_v = part_i + (segments * 8) as u64;
        // SAFETY: as above; `part_v` and `part_i` are scratch of `gpu` (held under its lock) with
        // room for `outer · chunks` values and indices.
        unsafe {
            launch!(ctx, gpu, f, cfg;
                px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64, i = inner as u64,
                t = tpr, parts = chunks as u64, pv = part_v, pi = part_i)?
        };
        let g = gpu.kernels.one(ctx, "argmax_parts", dtype)?;
        let (cfg, tpr) = fold_config(
            gpu,
            Pass {
                outer,
                n: chunks,
                inner: 1,
            },
            1,
        );
        // SAFETY: argmax_parts_<T>(const T* part_v, const i64* part_i, i64* out, u64 outer,
        // u64 chunks, u32 tpr); the scratch written just before (stream order) and `out`, locked
        // storage of `gpu` with `outer` indices.
        unsafe {
            launch!(ctx, gpu, g, cfg;
                pv = part_v, pi = part_i, po = out.ptr(), o = outer as u64, c = chunks as u64,
                t = tpr)
        }
    }
}
