//! Matrix products: cuBLAS for floats (split into batches cuBLAS accepts), a kernel for
//! integers, and the dense SGD update with momentum (a product `xᵀ·g` into the velocity, then
//! an `axpy` into the weights).

use cudarc::cublas::sys as blas;
use cudarc::driver::sys::CUdeviceptr;

use super::elementwise::axpy_raw;
use super::launch::{elements, linear, memset, same_gpu, scalar, Strided, MODE_SAME};
use crate::backend::cuda::device::{blas_error, Gpu};
use crate::backend::cuda::memory::DeviceBuffer;
use crate::backend::Batched;
use crate::error::Ctx;
use crate::{DType, Result};

// ---- matrix products ----

fn int_dim(ctx: &Ctx, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| {
        ctx.unsupported(format!(
            "cuBLAS products take dimensions up to {}; got {value}",
            i32::MAX
        ))
    })
}

/// Most products of one strided batched cuBLAS call: cuBLAS puts the batch in a grid dimension
/// limited to 65535 blocks, so larger batches are split into several calls.
const MAX_BLAS_BATCH: usize = 65_535;

/// `blas_batch` over any number of products: at most [`MAX_BLAS_BATCH`] per cuBLAS call.
#[allow(clippy::too_many_arguments)]
fn blas_gemm(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    dims: (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    scales: (f64, f64),
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    let elem = dtype.size_in_bytes() as u64;
    let mut done = 0;
    while done < batch {
        let count = (batch - done).min(MAX_BLAS_BATCH);
        let at = |base: CUdeviceptr, step: usize| base + (done * step) as u64 * elem;
        blas_batch(
            ctx,
            gpu,
            dtype,
            dims,
            (at(a, steps.0), ta),
            (at(b, steps.1), tb),
            at(c, steps.2),
            scales,
            (count, steps),
        )?;
        done += count;
    }
    Ok(())
}

/// `c = beta·c + alpha·op(a)·op(b)` for `batch` (at most [`MAX_BLAS_BATCH`]) row-major float
/// products (`a` `[m, k]`, or `[k, m]` with `ta`; `b` `[k, n]`, or `[n, k]` with `tb`), the
/// i-th at element offsets `i·steps`. A row-major product is the column-major product of the
/// transposes, so cuBLAS computes `cᵀ = op(b)ᵀ · op(a)ᵀ`.
#[allow(clippy::too_many_arguments)]
fn blas_batch(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    (beta, alpha): (f64, f64),
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    let op = |t: bool| {
        if t {
            blas::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let (bm, bn, bk) = (int_dim(ctx, n)?, int_dim(ctx, m)?, int_dim(ctx, k)?);
    let ldb = int_dim(ctx, if tb { k } else { n })?;
    let lda = int_dim(ctx, if ta { m } else { k })?;
    let ldc = int_dim(ctx, n)?;
    let count = int_dim(ctx, batch)?;
    let (sa, sb, sc) = (steps.0 as i64, steps.1 as i64, steps.2 as i64);
    gpu.bind(ctx)?;
    let mut handle = gpu.blas();
    handle.prepare(ctx, gpu)?;
    let h = handle.handle;
    // SAFETY: the handle is used under its lock on the device's stream; `a`, `b` and `c` are
    // locked storage of `gpu` holding the products' operands as described (cuBLAS reads within
    // the leading dimensions and strides given); alpha and beta are host values that outlive
    // the call (cuBLAS reads them before returning, in host pointer mode).
    let status = unsafe {
        match dtype {
            DType::F32 => {
                let (alpha, beta) = (alpha as f32, beta as f32);
                if batch == 1 {
                    blas::cublasSgemm_v2(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f32,
                        ldb,
                        a as *const f32,
                        lda,
                        &beta,
                        c as *mut f32,
                        ldc,
                    )
                } else {
                    blas::cublasSgemmStridedBatched(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f32,
                        ldb,
                        sb,
                        a as *const f32,
                        lda,
                        sa,
                        &beta,
                        c as *mut f32,
                        ldc,
                        sc,
                        count,
                    )
                }
            }
            _ => {
                if batch == 1 {
                    blas::cublasDgemm_v2(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f64,
                        ldb,
                        a as *const f64,
                        lda,
                        &beta,
                        c as *mut f64,
                        ldc,
                    )
                } else {
                    blas::cublasDgemmStridedBatched(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        &alpha,
                        b as *const f64,
                        ldb,
                        sb,
                        a as *const f64,
                        lda,
                        sa,
                        &beta,
                        c as *mut f64,
                        ldc,
                        sc,
                        count,
                    )
                }
            }
        }
    };
    status
        .result()
        .map_err(|e| blas_error(ctx, "cuBLAS gemm", e))
}

/// `c = beta·c + alpha·op(a)·op(b)` (or `= op(a)·op(b)` without `accumulate`) for integers.
#[allow(clippy::too_many_arguments)]
fn int_gemm(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (CUdeviceptr, bool),
    (b, tb): (CUdeviceptr, bool),
    c: CUdeviceptr,
    accumulate: Option<(f64, f64)>,
    (batch, steps): (usize, (usize, usize)),
) -> Result<()> {
    let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
    let (beta, alpha) = accumulate.unwrap_or((0.0, 1.0));
    let f = gpu.kernels.one(ctx, "matmul", dtype)?;
    let total = (batch * m * n) as u64;
    // SAFETY: matmul_<T>(const T* a, const T* b, T* c, u64 m, u64 k, u64 n, u64 a_rs, u64 a_cs,
    // u64 b_rs, u64 b_cs, u64 batch, u64 a_step, u64 b_step, int accumulate, T beta, T alpha);
    // locked storage of `gpu` holding the operands as described.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, total);
            pa = a, pb = b, pc = c, rows = m as u64, inner = k as u64, cols = n as u64,
            ars = a_rs as u64, acs = a_cs as u64, brs = b_rs as u64, bcs = b_cs as u64,
            count = batch as u64, astep = steps.0 as u64, bstep = steps.1 as u64,
            acc = i32::from(accumulate.is_some()), be = scalar(dtype, beta), al = scalar(dtype, alpha))
    }
}

/// The product with the edge cases handled: nothing to compute for an empty result, and for
/// `k == 0` the result is `beta·c` (or zeros), which cuBLAS would refuse (its leading dimension
/// would be 0).
#[allow(clippy::too_many_arguments)]
fn product(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    a: (CUdeviceptr, bool),
    b: (CUdeviceptr, bool),
    c: (CUdeviceptr, usize),
    accumulate: Option<(f64, f64)>,
    (batch, steps): (usize, (usize, usize, usize)),
) -> Result<()> {
    if m == 0 || n == 0 || batch == 0 {
        return Ok(());
    }
    let (c, c_len) = c;
    if k == 0 {
        return match accumulate {
            // `beta = 0` does not read `c` (a NaN there must not survive as 0·NaN).
            Some((beta, _)) if beta != 0.0 => {
                let f = gpu.kernels.one(ctx, "scale", dtype)?;
                // SAFETY: scale_<T>(T* x, u64 n, T v); `c` is locked storage of `gpu` with
                // `c_len` elements.
                unsafe {
                    launch!(ctx, gpu, f, linear(gpu, c_len as u64);
                        px = c, count = c_len as u64, v = scalar(dtype, beta))
                }
            }
            _ => memset(ctx, gpu, c, 0, c_len * dtype.size_in_bytes()),
        };
    }
    if dtype.is_float() {
        blas_gemm(
            ctx,
            gpu,
            dtype,
            (m, k, n),
            a,
            b,
            c,
            accumulate.unwrap_or((0.0, 1.0)),
            (batch, steps),
        )
    } else {
        int_gemm(
            ctx,
            gpu,
            dtype,
            (m, k, n),
            a,
            b,
            c,
            accumulate,
            (batch, (steps.0, steps.1)),
        )
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    ctx: &Ctx,
    dtype: DType,
    batch: Option<(Batched, usize)>,
    (m, k, n): (usize, usize, usize),
    a: &DeviceBuffer,
    b: &DeviceBuffer,
    out: &mut DeviceBuffer,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let c = (out.ptr(), elements(out, dtype) as usize);
    let (count, (m, steps)) = match batch {
        None => (1, (m, (0, 0, 0))),
        // A shared right operand: one product of (batch·m) rows.
        Some((Batched::Left, batch)) => (1, (batch * m, (0, 0, 0))),
        Some((Batched::Both, batch)) => (batch, (m, (m * k, k * n, m * n))),
        Some((Batched::Right, batch)) => (batch, (m, (0, k * n, m * n))),
    };
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (a.ptr(), false),
        (b.ptr(), false),
        c,
        None,
        (count, steps),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (&DeviceBuffer, bool),
    (b, tb): (&DeviceBuffer, bool),
    out: &mut DeviceBuffer,
    accumulate: Option<(f64, f64)>,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
    let c = (out.ptr(), elements(out, dtype) as usize);
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (a.ptr(), ta),
        (b.ptr(), tb),
        c,
        accumulate,
        (1, (0, 0, 0)),
    )
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_dense(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (x, g): (&DeviceBuffer, &DeviceBuffer),
    (v, w): (&mut DeviceBuffer, &mut DeviceBuffer),
    lr: f64,
    momentum: f64,
) -> Result<()> {
    let gpu = same_gpu(ctx, &[x.gpu(), g.gpu(), v.gpu(), w.gpu()])?;
    let len = m * n;
    if len == 0 {
        return Ok(());
    }
    // v ← momentum·v + xᵀ·g, then w ← w − lr·v: two launches, in stream order. Without
    // momentum the old v is not read (a plain product: cuBLAS with beta 0, or zeros for an
    // empty batch), as on the CPU: a NaN left in v does not survive.
    product(
        ctx,
        gpu,
        dtype,
        (m, k, n),
        (x.ptr(), true),
        (g.ptr(), false),
        (v.ptr(), len),
        (momentum != 0.0).then_some((momentum, 1.0)),
        (1, (0, 0, 0)),
    )?;
    axpy_raw(
        ctx,
        gpu,
        dtype,
        (w.ptr(), len as u64),
        -lr,
        (v.ptr(), MODE_SAME, Strided::none()),
    )
}
