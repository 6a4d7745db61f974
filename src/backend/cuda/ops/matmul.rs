//! Matrix products: cuBLAS for floats (split into batches cuBLAS accepts), a kernel for
//! integers, and the dense SGD update with momentum (a product `xᵀ·g` into the velocity, then
//! an `axpy` into the weights).

use std::ffi::c_void;

use cudarc::cublas::sys as blas;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use super::capture::{self, Call, LibCall, LIB_WORDS};
use super::elementwise::axpy_raw;
use super::launch::{
    elements, linear, memset, opmath_scalar, same_gpu, scalar, tiles32, Strided, MODE_SAME,
};
use super::Cuda;
use crate::backend::contract::{Accumulate, Gemm, Linear, MatmulOps, Mnk, SgdStep};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::{blas_error, Gpu};
use crate::backend::cuda::lt::{Operands, Shape as LtShape};
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

/// Products on device memory: `c = beta·c + alpha·op(a)·op(b)` (or `c = op(a)·op(b)`, as
/// `spec` says), `batch` of them, the i-th at element offsets `i·steps` of `a`, `b` and `c`.
#[derive(Clone, Copy)]
struct Products {
    /// Sizes, transposes and accumulation of each product.
    spec: Gemm,
    /// The left operands.
    a: CUdeviceptr,
    /// The right operands.
    b: CUdeviceptr,
    /// The results, `c_len` elements in all.
    c: CUdeviceptr,
    /// Elements at `c`.
    c_len: usize,
    /// How many products.
    batch: usize,
    /// Element offsets between consecutive products in `a`, `b` and `c`.
    steps: (usize, usize, usize),
}

/// Most products of one strided batched cuBLAS call: cuBLAS puts the batch in a grid dimension
/// limited to 65535 blocks, so larger batches are split into several calls.
const MAX_BLAS_BATCH: usize = 65_535;

/// `blas_batch` over any number of products: at most [`MAX_BLAS_BATCH`] per cuBLAS call.
fn blas_gemm(ctx: &Ctx, gpu: &Gpu, dtype: DType, p: Products) -> Result<()> {
    let elem = dtype.size_in_bytes() as u64;
    let operand = p.spec.operands.unwrap_or(dtype).size_in_bytes() as u64;
    let mut done = 0;
    while done < p.batch {
        let count = (p.batch - done).min(MAX_BLAS_BATCH);
        let at = |base: CUdeviceptr, step: usize, elem: u64| base + (done * step) as u64 * elem;
        let part = Products {
            a: at(p.a, p.steps.0, operand),
            b: at(p.b, p.steps.1, operand),
            c: at(p.c, p.steps.2, elem),
            batch: count,
            ..p
        };
        blas_batch(ctx, gpu, dtype, part)?;
        done += count;
    }
    Ok(())
}

/// `p.batch` (at most [`MAX_BLAS_BATCH`]) row-major float products (`a` `[m, k]`, or `[k, m]`
/// with `trans_a`; `b` `[k, n]`, or `[n, k]` with `trans_b`). A row-major product is the
/// column-major product of the transposes, so cuBLAS computes `cᵀ = op(b)ᵀ · op(a)ᵀ`.
fn blas_batch(ctx: &Ctx, gpu: &Gpu, dtype: DType, p: Products) -> Result<()> {
    if capture::watching(gpu.ordinal) {
        let call = LibCall {
            kind: GEMM,
            words: p.encode(dtype),
            issue: gemm_on,
        };
        return capture::call(ctx, gpu, Call::Lib(call));
    }
    blas_batch_on(ctx, gpu, dtype, p, None)
}

/// A float dtype as the code of a recorded call's words (2 bits).
fn float_code(dtype: DType) -> u64 {
    match dtype {
        DType::F64 => 1,
        DType::F16 => 2,
        DType::BF16 => 3,
        _ => 0,
    }
}

/// The dtype of [`float_code`]'s code (the low 2 bits of `code`).
fn float_of(code: u64) -> DType {
    match code & 3 {
        1 => DType::F64,
        2 => DType::F16,
        3 => DType::BF16,
        _ => DType::F32,
    }
}

/// Kind of a recorded cuBLAS product ([`LibCall::kind`]).
const GEMM: u8 = 1;
/// Kind of a recorded cuBLASLt product with an epilogue.
const LT: u8 = 2;

impl Products {
    /// The product as the words of a recorded call.
    fn encode(&self, dtype: DType) -> [u64; LIB_WORDS] {
        let Mnk { m, k, n } = self.spec.dims;
        let acc = self.spec.accumulate;
        let flags = u64::from(self.spec.trans_a)
            | u64::from(self.spec.trans_b) << 1
            | u64::from(acc.is_some()) << 2
            | float_code(dtype) << 3
            | self.spec.operands.map_or(0, float_code) << 5;
        let (alpha, beta) = acc.map_or((0, 0), |a| (a.alpha.to_bits(), a.beta.to_bits()));
        let mut w = [0u64; LIB_WORDS];
        w[..15].copy_from_slice(&[
            flags,
            m as u64,
            k as u64,
            n as u64,
            alpha,
            beta,
            self.a,
            self.b,
            self.c,
            self.c_len as u64,
            self.batch as u64,
            self.steps.0 as u64,
            self.steps.1 as u64,
            self.steps.2 as u64,
            0,
        ]);
        w
    }

    /// The product and dtype of [`encode`](Self::encode)'s words.
    fn decode(w: &[u64; LIB_WORDS]) -> (DType, Products) {
        let flags = w[0];
        let dtype = float_of(flags >> 3);
        let accumulate = (flags & 4 != 0).then(|| Accumulate {
            alpha: f64::from_bits(w[4]),
            beta: f64::from_bits(w[5]),
        });
        let p = Products {
            spec: Gemm {
                dims: Mnk {
                    m: w[1] as usize,
                    k: w[2] as usize,
                    n: w[3] as usize,
                },
                trans_a: flags & 1 != 0,
                trans_b: flags & 2 != 0,
                accumulate,
                operands: match (flags >> 5) & 3 {
                    0 => None,
                    code => Some(float_of(code)),
                },
                rounded_b: false,
            },
            a: w[6],
            b: w[7],
            c: w[8],
            c_len: w[9] as usize,
            batch: w[10] as usize,
            steps: (w[11] as usize, w[12] as usize, w[13] as usize),
        };
        (dtype, p)
    }
}

/// A recorded cuBLAS product issued again on `stream` ([`LibCall::issue`]).
fn gemm_on(ctx: &Ctx, gpu: &Gpu, words: &[u64; LIB_WORDS], stream: CUstream) -> Result<()> {
    let (dtype, p) = Products::decode(words);
    blas_batch_on(ctx, gpu, dtype, p, Some(stream))
}

/// [`blas_batch`] on `stream` (the device's own when `None`).
fn blas_batch_on(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    p: Products,
    stream: Option<CUstream>,
) -> Result<()> {
    let Mnk { m, k, n } = p.spec.dims;
    let (ta, tb) = (p.spec.trans_a, p.spec.trans_b);
    let (a, b, c, batch, steps) = (p.a, p.b, p.c, p.batch, p.steps);
    let Accumulate { alpha, beta } = p.spec.accumulate.unwrap_or(Accumulate {
        alpha: 1.0,
        beta: 0.0,
    });
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
    let _on = OnStream::set(
        ctx,
        h,
        stream.filter(|&s| s != gpu.cu_stream()),
        gpu.cu_stream(),
    )?;
    // SAFETY: the handle is used under its lock on the device's stream; `a`, `b` and `c` are
    // locked storage of `gpu` holding the products' operands as described (cuBLAS reads within
    // the leading dimensions and strides given); alpha and beta are host values that outlive
    // the call (cuBLAS reads them before returning, in host pointer mode).
    let status = unsafe {
        match (dtype, p.spec.operands) {
            (DType::F32, None) => {
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
            (DType::F16 | DType::BF16, _) | (_, Some(_)) => {
                // Tensor-core products of halves: f32 accumulation, f32 alpha and beta, each
                // result rounded once to the half type, or kept in f32 (`operands`: halves
                // multiplied into an f32 `c`).
                let half = |t: DType| {
                    if t == DType::F16 {
                        blas::cudaDataType::CUDA_R_16F
                    } else {
                        blas::cudaDataType::CUDA_R_16BF
                    }
                };
                let (ty, c_ty) = match p.spec.operands {
                    Some(operands) => (half(operands), blas::cudaDataType::CUDA_R_32F),
                    None => (half(dtype), half(dtype)),
                };
                let (alpha, beta) = (alpha as f32, beta as f32);
                let alpha = (&alpha as *const f32).cast::<c_void>();
                let beta = (&beta as *const f32).cast::<c_void>();
                let compute = blas::cublasComputeType_t::CUBLAS_COMPUTE_32F;
                let algo = blas::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
                let (a, b, c) = (a as *const c_void, b as *const c_void, c as *mut c_void);
                if batch == 1 {
                    blas::cublasGemmEx(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        alpha,
                        b,
                        ty,
                        ldb,
                        a,
                        ty,
                        lda,
                        beta,
                        c,
                        c_ty,
                        ldc,
                        compute,
                        algo,
                    )
                } else {
                    blas::cublasGemmStridedBatchedEx(
                        h,
                        op(tb),
                        op(ta),
                        bm,
                        bn,
                        bk,
                        alpha,
                        b,
                        ty,
                        ldb,
                        sb,
                        a,
                        ty,
                        lda,
                        sa,
                        beta,
                        c,
                        c_ty,
                        ldc,
                        sc,
                        count,
                        compute,
                        algo,
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

/// A cuBLAS handle's stream set to another for one call (a capture), and set back after.
struct OnStream {
    handle: blas::cublasHandle_t,
    back: Option<CUstream>,
}

impl OnStream {
    fn set(
        ctx: &Ctx,
        handle: blas::cublasHandle_t,
        to: Option<CUstream>,
        back: CUstream,
    ) -> Result<OnStream> {
        if let Some(to) = to {
            // SAFETY: a live handle used under its mutex (held by the caller); `to` is a stream
            // of the handle's context.
            unsafe { blas::cublasSetStream_v2(handle, to as _) }
                .result()
                .map_err(|e| blas_error(ctx, "cublasSetStream", e))?;
        }
        Ok(OnStream {
            handle,
            back: to.map(|_| back),
        })
    }
}

impl Drop for OnStream {
    fn drop(&mut self) {
        if let Some(back) = self.back {
            // SAFETY: as in `set`; the caller still holds the handle's mutex (this guard is
            // dropped before it).
            let _ = unsafe { blas::cublasSetStream_v2(self.handle, back as _) };
        }
    }
}

/// One product with an epilogue, `out = act(x · w + bias)`, row-major `[m, k] · [k, n]`
/// (`bias` 0: none).
#[derive(Clone, Copy)]
struct LtCall {
    dtype: DType,
    dims: Mnk,
    x: CUdeviceptr,
    w: CUdeviceptr,
    bias: CUdeviceptr,
    relu: bool,
    out: CUdeviceptr,
}

impl LtCall {
    /// The product as the words of a recorded call.
    fn encode(&self) -> [u64; LIB_WORDS] {
        let Mnk { m, k, n } = self.dims;
        let mut words = [0u64; LIB_WORDS];
        words[..8].copy_from_slice(&[
            float_code(self.dtype) | u64::from(self.relu) << 2,
            m as u64,
            k as u64,
            n as u64,
            self.x,
            self.w,
            self.bias,
            self.out,
        ]);
        words
    }

    /// The product of [`encode`](Self::encode)'s words.
    fn decode(w: &[u64; LIB_WORDS]) -> LtCall {
        LtCall {
            dtype: float_of(w[0]),
            dims: Mnk {
                m: w[1] as usize,
                k: w[2] as usize,
                n: w[3] as usize,
            },
            x: w[4],
            w: w[5],
            bias: w[6],
            relu: w[0] & 4 != 0,
            out: w[7],
        }
    }
}

/// `out = act(x · w + bias)` through a cuBLASLt epilogue, one launch. `false` (nothing done)
/// where cuBLASLt cannot be loaded.
fn lt_linear(ctx: &Ctx, gpu: &Gpu, call: LtCall) -> Result<bool> {
    gpu.bind(ctx)?;
    if capture::watching(gpu.ordinal) {
        let available = {
            let mut handle = gpu.blas();
            handle.prepare(ctx, gpu)?;
            handle.lt().is_some()
        };
        if !available {
            return Ok(false);
        }
        let recorded = LibCall {
            kind: LT,
            words: call.encode(),
            issue: lt_on,
        };
        capture::call(ctx, gpu, Call::Lib(recorded))?;
        return Ok(true);
    }
    lt_linear_on(ctx, gpu, call, None)
}

/// A recorded cuBLASLt product issued again on `stream` ([`LibCall::issue`]).
fn lt_on(ctx: &Ctx, gpu: &Gpu, words: &[u64; LIB_WORDS], stream: CUstream) -> Result<()> {
    if lt_linear_on(ctx, gpu, LtCall::decode(words), Some(stream))? {
        Ok(())
    } else {
        Err(ctx.unsupported("cuBLASLt, used when the call was recorded, cannot be loaded now"))
    }
}

/// [`lt_linear`] on `stream` (the device's own when `None`).
fn lt_linear_on(ctx: &Ctx, gpu: &Gpu, call: LtCall, stream: Option<CUstream>) -> Result<bool> {
    let LtCall {
        dtype,
        dims: Mnk { m, k, n },
        x,
        w,
        bias,
        relu,
        out,
    } = call;
    gpu.bind(ctx)?;
    let mut handle = gpu.blas();
    handle.prepare(ctx, gpu)?;
    let (workspace, tf32) = (handle.workspace(), handle.tf32());
    let Some(lt) = handle.lt() else {
        return Ok(false);
    };
    let shape = LtShape {
        dtype,
        m,
        k,
        n,
        bias: bias != 0,
        relu,
        tf32: tf32 && dtype == DType::F32,
    };
    let ops = Operands {
        x,
        w,
        bias,
        out,
        workspace,
        stream: stream.unwrap_or_else(|| gpu.cu_stream()),
    };
    // SAFETY: `x`, `w`, the bias and `out` are locked storage of `gpu` of the sizes `shape`
    // gives (the front-end checked them); the workspace is cuBLAS's, used on the same stream
    // under the same mutex, held here.
    unsafe { lt.linear(ctx, shape, &ops) }?;
    Ok(true)
}

/// The products for integers.
fn int_gemm(ctx: &Ctx, gpu: &Gpu, dtype: DType, p: Products) -> Result<()> {
    let Mnk { m, k, n } = p.spec.dims;
    let (a, b, c, batch, steps) = (p.a, p.b, p.c, p.batch, p.steps);
    let accumulate = p.spec.accumulate;
    let (a_rs, a_cs) = if p.spec.trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if p.spec.trans_b { (1, k) } else { (n, 1) };
    let Accumulate { alpha, beta } = accumulate.unwrap_or(Accumulate {
        alpha: 1.0,
        beta: 0.0,
    });
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
fn product(ctx: &Ctx, gpu: &Gpu, dtype: DType, p: Products) -> Result<()> {
    let Mnk { m, k, n } = p.spec.dims;
    if m == 0 || n == 0 || p.batch == 0 {
        return Ok(());
    }
    let (c, c_len) = (p.c, p.c_len);
    if k == 0 {
        return match p.spec.accumulate {
            // `beta = 0` does not read `c` (a NaN there must not survive as 0·NaN).
            Some(Accumulate { beta, .. }) if beta != 0.0 => {
                let f = gpu.kernels.one(ctx, "scale", dtype)?;
                // SAFETY: scale_<T>(T* x, u64 n, T v) (an f32 `v` for the half types);
                // `c` is locked storage of `gpu` with `c_len` elements.
                unsafe {
                    launch!(ctx, gpu, f, linear(gpu, c_len as u64);
                        px = c, count = c_len as u64, v = opmath_scalar(dtype, beta))
                }
            }
            _ => memset(ctx, gpu, c, 0, c_len * dtype.size_in_bytes()),
        };
    }
    if dtype.is_float() {
        blas_gemm(ctx, gpu, dtype, p)
    } else {
        int_gemm(ctx, gpu, dtype, p)
    }
}

impl MatmulOps for Cuda {
    fn matmul(
        ctx: &Ctx,
        dtype: DType,
        batch: Option<(Batched, usize)>,
        Mnk { m, k, n }: Mnk,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
        let (count, (m, steps)) = match batch {
            None => (1, (m, (0, 0, 0))),
            // A shared right operand: one product of (batch·m) rows.
            Some((Batched::Left, batch)) => (1, (batch * m, (0, 0, 0))),
            Some((Batched::Both, batch)) => (batch, (m, (m * k, k * n, m * n))),
            Some((Batched::Right, batch)) => (batch, (m, (0, k * n, m * n))),
        };
        let spec = Gemm::plain(Mnk { m, k, n }, false, false);
        let products = Products {
            spec,
            a: a.ptr(),
            b: b.ptr(),
            c: out.ptr(),
            c_len: elements(out, dtype) as usize,
            batch: count,
            steps,
        };
        product(ctx, gpu, dtype, products)
    }

    fn gemm(
        ctx: &Ctx,
        dtype: DType,
        spec: Gemm,
        a: &DeviceBuffer,
        b: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
        spec.check_rounded(ctx, dtype)?;
        if spec.rounded_b {
            let call = Rounded {
                spec,
                a: a.ptr(),
                b: b.ptr(),
                c: out.ptr(),
                bias: 0,
                relu: false,
            };
            return rounded_product(ctx, gpu, dtype, call);
        }
        let products = Products {
            spec,
            a: a.ptr(),
            b: b.ptr(),
            c: out.ptr(),
            c_len: elements(out, dtype) as usize,
            batch: 1,
            steps: (0, 0, 0),
        };
        product(ctx, gpu, dtype, products)
    }

    fn linear(
        ctx: &Ctx,
        dtype: DType,
        spec: Linear,
        (x, w): (&DeviceBuffer, &DeviceBuffer),
        bias: Option<&DeviceBuffer>,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        spec.check_rounded(ctx, dtype)?;
        let Linear {
            dims,
            relu,
            rounded_w,
        } = spec;
        let gpu = match bias {
            Some(b) => same_gpu(ctx, &[x.gpu(), w.gpu(), b.gpu(), out.gpu()])?,
            None => same_gpu(ctx, &[x.gpu(), w.gpu(), out.gpu()])?,
        };
        let bias_ptr = bias.map_or(0, DeviceBuffer::ptr);
        if rounded_w {
            let call = Rounded {
                spec: Gemm::plain(dims, false, false),
                a: x.ptr(),
                b: w.ptr(),
                c: out.ptr(),
                bias: bias_ptr,
                relu,
            };
            return rounded_product(ctx, gpu, dtype, call);
        }
        let Mnk { m, k, n } = dims;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let call = LtCall {
            dtype,
            dims,
            x: x.ptr(),
            w: w.ptr(),
            bias: bias_ptr,
            relu,
            out: out.ptr(),
        };
        if k > 0 && lt_linear(ctx, gpu, call)? {
            return Ok(());
        }
        // Without cuBLASLt (or for k = 0, which it need not take): the product, then the bias
        // and activation in one kernel.
        Cuda::matmul(ctx, dtype, None, dims, x, w, out)?;
        if bias.is_none() && !relu {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "bias_act", dtype)?;
        let len = (m * n) as u64;
        // SAFETY: bias_act_<T>(T* out, const T* bias, u64 rows, u64 cols, int relu); `out` holds
        // m·n elements and the bias (when not null) n, locked storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, len);
                po = out.ptr(), pb = bias_ptr, r = m as u64, c = n as u64, act = i32::from(relu))
        }
    }

    fn sgd_dense(
        ctx: &Ctx,
        dtype: DType,
        dims: Mnk,
        (x, g): (&DeviceBuffer, &DeviceBuffer),
        (v, w): (&mut DeviceBuffer, &mut DeviceBuffer),
        SgdStep { lr, momentum }: SgdStep,
    ) -> Result<()> {
        let Mnk { m, n, .. } = dims;
        let gpu = same_gpu(ctx, &[x.gpu(), g.gpu(), v.gpu(), w.gpu()])?;
        let len = m * n;
        if len == 0 {
            return Ok(());
        }
        // v ← momentum·v + xᵀ·g, then w ← w − lr·v: two launches, in stream order. Without
        // momentum the old v is not read (a plain product: cuBLAS with beta 0, or zeros for an
        // empty batch), as on the CPU: a NaN left in v does not survive.
        let spec = Gemm {
            dims,
            trans_a: true,
            trans_b: false,
            accumulate: (momentum != 0.0).then_some(Accumulate {
                alpha: 1.0,
                beta: momentum,
            }),
            operands: None,
            rounded_b: false,
        };
        let products = Products {
            spec,
            a: x.ptr(),
            b: g.ptr(),
            c: v.ptr(),
            c_len: len,
            batch: 1,
            steps: (0, 0, 0),
        };
        product(ctx, gpu, dtype, products)?;
        axpy_raw(
            ctx,
            gpu,
            dtype,
            (w.ptr(), len as u64),
            -lr,
            (v.ptr(), MODE_SAME, Strided::none()),
        )
    }
}

/// A product reading an f32 operand rounded to a half type ([`Gemm::rounded_b`],
/// [`Linear::rounded_w`]): `c = act(alpha·op(a)·op(round(b)) [+ beta·c] [+ bias])` with `a`, `c`
/// and the bias (0: none) in the half dtype.
#[derive(Clone, Copy)]
struct Rounded {
    /// Sizes, transposes and accumulation (`operands` is `None`).
    spec: Gemm,
    /// The half left operand.
    a: CUdeviceptr,
    /// The f32 right operand, read rounded.
    b: CUdeviceptr,
    /// The half result, `[m, n]` row-major.
    c: CUdeviceptr,
    /// The half bias `[n]`, or 0.
    bias: CUdeviceptr,
    /// ReLU applied as the result is written.
    relu: bool,
}

/// cuBLAS takes operands of one type, so a product whose f32 right operand is read rounded
/// runs our own kernel (`gemm_rounded_<H>` in kernels/half.cu: f32 multiply-adds on shared-memory
/// tiles, not tensor cores). The front end asks for it only for small products
/// ([`backend::rounds_operands`](crate::backend::rounds_operands)), where the half copy it
/// saves would be larger than the activations. `k == 0` gives
/// `act(beta·c + bias)` (or the bias and zeros) as the other products do.
fn rounded_product(ctx: &Ctx, gpu: &Gpu, dtype: DType, call: Rounded) -> Result<()> {
    let Gemm {
        dims: Mnk { m, k, n },
        trans_a,
        trans_b,
        accumulate,
        ..
    } = call.spec;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (a_rs, a_cs) = if trans_a { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if trans_b { (1, k) } else { (n, 1) };
    let Accumulate { alpha, beta } = accumulate.unwrap_or(Accumulate {
        alpha: 1.0,
        beta: 0.0,
    });
    let f = gpu.kernels.one(ctx, "gemm_rounded", dtype)?;
    let cfg = tiles32(gpu, (m, n), (16, 16));
    // SAFETY: gemm_rounded_<H>(const H* a, const f32* b, H* c, const H* bias, u64 m, u64 k,
    // u64 n, u64 a_rs, u64 a_cs, u64 b_rs, u64 b_cs, int accumulate, f32 beta, f32 alpha,
    // int relu) with 16×16 threads per block; `a` holds op(a)'s m·k elements, `b` the k·n f32
    // ones, `c` m·n and the bias (when not null) n, all locked storage of `gpu` as the
    // strides describe (the callers checked the sizes).
    unsafe {
        launch!(ctx, gpu, f, cfg;
            pa = call.a, pb = call.b, pc = call.c, pbias = call.bias,
            rows = m as u64, inner = k as u64, cols = n as u64,
            ars = a_rs as u64, acs = a_cs as u64, brs = b_rs as u64, bcs = b_cs as u64,
            acc = i32::from(accumulate.is_some()), be = opmath_scalar(dtype, beta),
            al = opmath_scalar(dtype, alpha), act = i32::from(call.relu))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recorded product keeps its dtype, the half types too (a replay issues the same call).
    #[test]
    fn recorded_products_keep_their_dtype() {
        let mixes = [
            (DType::F32, None),
            (DType::F64, None),
            (DType::F16, None),
            (DType::BF16, None),
            (DType::F32, Some(DType::F16)),
            (DType::F32, Some(DType::BF16)),
        ];
        for (dtype, operands) in mixes {
            let p = Products {
                spec: Gemm {
                    dims: Mnk { m: 3, k: 5, n: 7 },
                    trans_a: true,
                    trans_b: false,
                    accumulate: Some(Accumulate {
                        alpha: 2.0,
                        beta: 0.5,
                    }),
                    operands,
                    rounded_b: false,
                },
                a: 0x1000,
                b: 0x2000,
                c: 0x3000,
                c_len: 21,
                batch: 4,
                steps: (15, 35, 21),
            };
            let (back, q) = Products::decode(&p.encode(dtype));
            assert_eq!((back, q.spec.operands), (dtype, operands));
            assert_eq!(q.encode(back), p.encode(dtype));
            assert!(q.spec.trans_a && !q.spec.trans_b);
            for relu in [false, true] {
                let call = LtCall {
                    dtype,
                    dims: Mnk { m: 3, k: 5, n: 7 },
                    x: 1,
                    w: 2,
                    bias: 3,
                    relu,
                    out: 4,
                };
                let back = LtCall::decode(&call.encode());
                assert_eq!((back.dtype, back.relu), (dtype, relu));
                assert_eq!(back.encode(), call.encode());
            }
        }
    }
}
