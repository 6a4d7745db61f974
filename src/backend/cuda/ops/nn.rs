//! Neural-network ops: softmax and log-softmax (split over the device for few long rows), the
//! index ops `one_hot` and `pick` and the fused softmax cross-entropy, whose indices the kernels
//! check (reported at the next wait).

use super::error::{checked_launch, Refusal};
use super::launch::{blocks, elements, linear, same_gpu, Config, THREADS};
use super::reduce::{chunks_for, fold_config};
use super::Cuda;
use crate::backend::contract::{Lanes, NnOps};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::Gpu;
use crate::backend::layout::Pass;
use crate::error::Ctx;
use crate::{DType, Error, Result};

// ---- neural-network ops ----

/// Softmax of few long rows, each split into `chunks` slices over the device: three launches
/// of `softmax_split` (slice maxima, slice sums of exponentials, the result) with the partial
/// results in scratch.
fn softmax_split(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (a, out): (&DeviceBuffer, &mut DeviceBuffer),
    (outer, n, chunks): (usize, usize, usize),
    log: bool,
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "softmax_split", dtype)?;
    let segments = outer * chunks;
    let mut scratch = gpu.scratch();
    // The f64 sums first (8-byte aligned), then the maxima.
    let part_s = scratch.ensure(ctx, gpu, segments * (8 + dtype.size_in_bytes()))?;
    let part_m = part_s + (segments * 8) as u64;
    let cfg = Config {
        blocks: blocks(gpu, segments as u64, 1),
        threads: (THREADS, 1),
    };
    for phase in 0..3i32 {
        // SAFETY: softmax_split_<T>(const T* x, T* out, u64 outer, u64 n, u64 chunks, int log,
        // int phase, T* part_m, f64* part_s); `a` and `out` are locked storage of `gpu` with
        // outer·n elements; `part_m`/`part_s` scratch of `gpu` (under its lock) with room for
        // outer·chunks values each; the phases run in stream order.
        unsafe {
            launch!(ctx, gpu, f, cfg;
                px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64,
                c = chunks as u64, lg = i32::from(log), ph = phase, pm = part_m, ps = part_s)?
        };
    }
    Ok(())
}

/// The error for indices into an empty range, which every index is outside.
fn empty_range(ctx: &Ctx, count: u64, from: DType, what: &str) -> Error {
    ctx.invalid(format!(
        "the index at flat position 0 of the {count} {from} indices is out of range: it must be \
         at least 0 and below {what}, 0"
    ))
}

impl NnOps for Cuda {
    fn bias_act_grad(
        ctx: &Ctx,
        dtype: DType,
        (rows, cols): (usize, usize),
        g: &DeviceBuffer,
        relu: Option<(&DeviceBuffer, &mut DeviceBuffer)>,
        db: &mut DeviceBuffer,
        accumulate: bool,
    ) -> Result<()> {
        let gpu = match &relu {
            Some((y, dz)) => same_gpu(ctx, &[g.gpu(), y.gpu(), dz.gpu(), db.gpu()])?,
            None => same_gpu(ctx, &[g.gpu(), db.gpu()])?,
        };
        if cols == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "bias_act_grad", dtype)?;
        let (y, dz) = relu.map_or((0, 0), |(y, dz)| (y.ptr(), dz.ptr()));
        // SAFETY: bias_act_grad_<T>(const T* g, const T* y, T* dz, T* db, u64 rows, u64 cols,
        // int relu, int acc); `g` (and with relu `y`, `dz`) hold rows·cols elements and `db`
        // cols, locked storage of `gpu`; without relu `y` and `dz` are never read.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, cols as u64);
                pg = g.ptr(), py = y, pz = dz, pb = db.ptr(), r = rows as u64, c = cols as u64,
                act = i32::from(y != 0), acc = i32::from(accumulate))
        }
    }

    fn softmax(
        ctx: &Ctx,
        dtype: DType,
        a: &DeviceBuffer,
        Lanes {
            outer,
            len: n,
            inner,
        }: Lanes,
        out: &mut DeviceBuffer,
        log: bool,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let columns = (outer * inner) as u64;
        if columns == 0 || n == 0 {
            return Ok(());
        }
        if inner == 1 {
            let chunks = chunks_for(gpu, Pass { outer, n, inner });
            if chunks > 1 {
                return softmax_split(ctx, gpu, dtype, (a, out), (outer, n, chunks), log);
            }
        }
        let f = gpu.kernels.one(ctx, "softmax", dtype)?;
        let (cfg, tpr) = fold_config(gpu, Pass { outer, n, inner }, 1);
        // SAFETY: softmax_<T>(const T* x, T* out, u64 outer, u64 n, u64 inner, int log, u32 tpr);
        // locked storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, cfg;
                px = a.ptr(), po = out.ptr(), o = outer as u64, len = n as u64, i = inner as u64,
                lg = i32::from(log), t = tpr)
        }
    }

    /// Indices on a CUDA device are checked by the kernels that use them (`pick`, `one_hot`): a
    /// bad one is reported at the next wait for the device, with the op and its call site, so
    /// nothing is checked here and no op waits for the device.
    fn first_bad_index(
        _ctx: &Ctx,
        _dtype: DType,
        _indices: &DeviceBuffer,
        _bound: usize,
    ) -> Result<Option<(usize, i64)>> {
        Ok(None)
    }

    fn one_hot(
        ctx: &Ctx,
        (from, to): (DType, DType),
        indices: &DeviceBuffer,
        depth: usize,
        out: &mut DeviceBuffer,
    ) -> Result<Option<(usize, i64)>> {
        let gpu = same_gpu(ctx, &[indices.gpu(), out.gpu()])?;
        let count = elements(indices, from);
        let total = count * depth as u64;
        if depth == 0 && count > 0 {
            // No index is below 0: known without looking.
            return Err(empty_range(ctx, count, from, "the depth"));
        }
        if total == 0 {
            return Ok(None);
        }
        let f = gpu.kernels.two(ctx, "one_hot", from, to)?;
        let refusal = || Refusal::Index {
            count,
            from,
            bound: depth,
            what: "the depth",
        };
        checked_launch(ctx, gpu, refusal, |flag, key| {
            // SAFETY: one_hot_<I>_<T>(const I* idx, T* out, u64 count, u64 depth, u64* flag,
            // u64 key); locked storage of `gpu` (`out` holds count·depth elements); `flag` is the
            // device's check word.
            unsafe {
                launch!(ctx, gpu, f, linear(gpu, total);
                    pi = indices.ptr(), po = out.ptr(), n = count, d = depth as u64, pf = flag,
                    k = key)
            }
        })
        .map(|()| None)
    }

    fn pick(
        ctx: &Ctx,
        (dtype, from): (DType, DType),
        x: &DeviceBuffer,
        (n, inner): (usize, usize),
        indices: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<Option<(usize, i64)>> {
        let gpu = same_gpu(ctx, &[x.gpu(), indices.gpu(), out.gpu()])?;
        let count = elements(indices, from);
        if n == 0 && count > 0 {
            return Err(empty_range(ctx, count, from, "the size of the axis"));
        }
        if count == 0 || inner == 0 {
            return Ok(None);
        }
        let f = gpu.kernels.two(ctx, "pick", dtype, from)?;
        let refusal = || Refusal::Index {
            count,
            from,
            bound: n,
            what: "the size of the axis",
        };
        checked_launch(ctx, gpu, refusal, |flag, key| {
            // SAFETY: pick_<T>_<I>(const T* x, const I* idx, T* out, u64 count, u64 n, u64 inner,
            // u64* flag, u64 key); locked storage of `gpu`; indices outside the axis read nothing;
            // `flag` is the device's check word.
            unsafe {
                launch!(ctx, gpu, f, linear(gpu, count);
                    px = x.ptr(), pi = indices.ptr(), po = out.ptr(), c = count, len = n as u64,
                    i = inner as u64, pf = flag, k = key)
            }
        })
        .map(|()| None)
    }

    /// One launch of one block whatever the size (the mean is reduced in the block, in a fixed
    /// order): `rows` below the block's threads give each row a group of threads (a power of
    /// two, no more than the classes need).
    fn softmax_cross_entropy(
        ctx: &Ctx,
        (dtype, from): (DType, DType),
        logits: &DeviceBuffer,
        (rows, classes): (usize, usize),
        labels: &DeviceBuffer,
        (loss, grad): (&mut DeviceBuffer, Option<&mut DeviceBuffer>),
    ) -> Result<Option<(usize, i64)>> {
        let mut buffers = vec![logits.gpu(), labels.gpu(), loss.gpu()];
        buffers.extend(grad.as_deref().map(DeviceBuffer::gpu));
        let gpu = same_gpu(ctx, &buffers)?;
        if classes == 0 && rows > 0 {
            return Err(empty_range(ctx, rows as u64, from, "the number of classes"));
        }
        let f = gpu.kernels.two(ctx, "softmax_ce", dtype, from)?;
        let tpr = (THREADS as usize / rows.max(1))
            .min(classes.next_power_of_two())
            .max(1);
        // The largest power of two not above `tpr`.
        let tpr = (1usize << tpr.ilog2()) as u32;
        let cfg = Config {
            blocks: 1,
            threads: (THREADS, 1),
        };
        let grad_ptr = grad.as_deref().map_or(0, DeviceBuffer::ptr);
        let refusal = || Refusal::Index {
            count: rows as u64,
            from,
            bound: classes,
            what: "the number of classes",
        };
        checked_launch(ctx, gpu, refusal, |flag, key| {
            // SAFETY: softmax_ce_<T>_<I>(const T* x, const I* labels, T* loss, T* grad, u64 rows,
            // u64 classes, u32 tpr, u64* flag, u64 key); locked storage of `gpu`: `logits` (and
            // `grad`, when not null) hold rows·classes elements, `labels` rows, `loss` one;
            // labels outside the classes read nothing; `tpr` is a power of two dividing the
            // block's THREADS; `flag` is the device's check word.
            unsafe {
                launch!(ctx, gpu, f, cfg;
                    px = logits.ptr(), pl = labels.ptr(), po = loss.ptr(), pg = grad_ptr,
                    r = rows as u64, c = classes as u64, t = tpr, pf = flag, k = key)
            }
        })
        .map(|()| None)
    }
}
