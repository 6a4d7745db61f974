//! cuBLASLt, for products with an epilogue: a dense layer's bias and ReLU applied as the product
//! is written, so `act(x · w + b)` is one launch. The handle is made at the first such product
//! (none where the library is missing: those products then run as a cuBLAS product and a
//! kernel), and a plan (descriptor, layouts, the heuristic's algorithm) once per shape: a
//! learned training step asks for the same few shapes every time, so after the first step a
//! product costs one attribute write (the bias pointer) and the `cublasLtMatmul` call.
//!
//! Used under the device's cuBLAS mutex (`device::Blas` holds the [`Lt`]), on the device's
//! stream, with cuBLAS's workspace (one stream: the two libraries never run at once).

use std::ffi::c_void;
use std::mem::size_of;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

use crate::error::Ctx;
use crate::{DType, Error, Result};

/// Most plans kept; the oldest goes first (a model has a handful of layer shapes).
const MAX_PLANS: usize = 64;

/// What a plan is made for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// The element type of every operand: f32, f64, or f16/bf16 (computed in f32, with f32
    /// alpha and beta, each output rounded once).
    pub dtype: DType,
    /// Row-major `[m, k] · [k, n]`.
    pub m: usize,
    pub k: usize,
    pub n: usize,
    /// A bias is added (`[n]`).
    pub bias: bool,
    /// ReLU after the bias.
    pub relu: bool,
    /// f32 products may round their inputs to TF32 (`ALLOW_TF32`).
    pub tf32: bool,
}

/// One product's descriptor, layouts (A, B, and C = D) and algorithm.
struct Plan {
    shape: Shape,
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Plan {
    /// Destroys the descriptor and layouts (errors are ignored: nothing is left to do).
    fn destroy(&self) {
        // SAFETY: made by `Lt::plan`, destroyed once (the plan is dropped from the list).
        unsafe {
            let _ = lt::destroy_matmul_desc(self.desc);
            for layout in self.layouts.into_iter().filter(|l| !l.is_null()) {
                let _ = lt::destroy_matrix_layout(layout);
            }
        }
    }
}

/// The device's cuBLASLt handle and plans.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    plans: Vec<Plan>,
}

// SAFETY: the handle and plans are used only under the device's cuBLAS mutex, which holds this.
unsafe impl Send for Lt {}

/// Operands of one product: device addresses of `x` (`[m, k]`), `w` (`[k, n]`), the bias
/// (`[n]`, 0 for none) and `out` (`[m, n]`), all row-major, and the workspace.
pub(crate) struct Operands {
    pub x: CUdeviceptr,
    pub w: CUdeviceptr,
    pub bias: CUdeviceptr,
    pub out: CUdeviceptr,
    pub workspace: (CUdeviceptr, usize),
    pub stream: CUstream,
}

fn failed(ctx: &Ctx, what: &str, e: CublasError) -> Error {
    Error::Backend {
        op: ctx.op,
        at: ctx.at,
        reason: format!("cuBLASLt {what} failed: {e:?}"),
    }
}

impl Lt {
    /// The handle, or `None` where cuBLASLt cannot be loaded (then products with an epilogue
    /// fall back to cuBLAS and a kernel). The caller has made the device's context current.
    pub fn new() -> Option<Lt> {
        // SAFETY: only tries to open the shared library by name.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        let handle = lt::create_handle().ok()?;
        Some(Lt {
            handle,
            plans: Vec::new(),
        })
    }

    /// Runs `out = act(x · w + bias)` as `shape` says, on `ops.stream`.
    ///
    /// # Safety
    /// The addresses in `ops` are device memory of the context the handle was made on, holding
    /// the operands as `shape` describes, kept allocated until the product has run; the
    /// workspace is that many bytes of device memory, 256-byte aligned, used by nothing else on
    /// another stream.
    pub unsafe fn linear(&mut self, ctx: &Ctx, shape: Shape, ops: &Operands) -> Result<()> {
        let plan = self.plan(ctx, shape, ops.workspace.1)?;
        let plan = &self.plans[plan];
        let ptr_size = size_of::<*const c_void>();
        if shape.bias {
            let bias = ops.bias as *const c_void;
            // SAFETY: a live descriptor; the attribute takes a device pointer, passed by
            // address with its size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    plan.desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                    (&bias as *const *const c_void).cast(),
                    ptr_size,
                )
            }
            .map_err(|e| failed(ctx, "setting the bias", e))?;
        }
        let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) = if shape.dtype == DType::F64 {
            (
                (&one64 as *const f64).cast(),
                (&zero64 as *const f64).cast(),
            )
        } else {
            (
                (&one32 as *const f32).cast(),
                (&zero32 as *const f32).cast(),
            )
        };
        let [a, b, c] = plan.layouts;
        // Row-major `out = x · w` is column-major `outᵀ = wᵀ · xᵀ`: A is `w` seen as `[n, k]`
        // column-major, B is `x` seen as `[k, m]`, D (and C, not read: beta 0) `out` as
        // `[n, m]`; the bias runs along D's rows, the layer's outputs.
        // SAFETY: per this function's contract; alpha and beta are host values read before
        // the call returns (host pointer mode); the plan's algorithm came from the heuristic
        // for this descriptor and these layouts.
        unsafe {
            lt::matmul(
                self.handle,
                plan.desc,
                alpha,
                beta,
                ops.w as *const c_void,
                a,
                ops.x as *const c_void,
                b,
                ops.out as *const c_void,
                c,
                ops.out as *mut c_void,
                c,
                &plan.algo,
                ops.workspace.0 as *mut c_void,
                ops.workspace.1,
                ops.stream as sys::cudaStream_t,
            )
        }
        .map_err(|e| failed(ctx, "cublasLtMatmul", e))
    }

    /// The index of the plan for `shape`, made now if there is none.
    fn plan(&mut self, ctx: &Ctx, shape: Shape, workspace: usize) -> Result<usize> {
        if let Some(i) = self.plans.iter().position(|p| p.shape == shape) {
            return Ok(i);
        }
        if self.plans.len() >= MAX_PLANS {
            self.plans.remove(0).destroy();
        }
        let plan = self.make(ctx, shape, workspace)?;
        self.plans.push(plan);
        Ok(self.plans.len() - 1)
    }

    fn make(&self, ctx: &Ctx, shape: Shape, workspace: usize) -> Result<Plan> {
        use sys::cublasComputeType_t as Compute;
        use sys::cudaDataType_t as Type;
        // (compute type, scale type of alpha and beta, operand type)
        let (compute, scale, ty) = match (shape.dtype, shape.tf32) {
            (DType::F64, _) => (
                Compute::CUBLAS_COMPUTE_64F,
                Type::CUDA_R_64F,
                Type::CUDA_R_64F,
            ),
            (DType::F16, _) => (
                Compute::CUBLAS_COMPUTE_32F,
                Type::CUDA_R_32F,
                Type::CUDA_R_16F,
            ),
            (DType::BF16, _) => (
                Compute::CUBLAS_COMPUTE_32F,
                Type::CUDA_R_32F,
                Type::CUDA_R_16BF,
            ),
            (DType::F32, true) => (
                Compute::CUBLAS_COMPUTE_32F_FAST_TF32,
                Type::CUDA_R_32F,
                Type::CUDA_R_32F,
            ),
            (DType::F32, false) => (
                Compute::CUBLAS_COMPUTE_32F,
                Type::CUDA_R_32F,
                Type::CUDA_R_32F,
            ),
            (other, _) => {
                return Err(ctx.unsupported(format!("cuBLASLt products of {other}")));
            }
        };
        let epilogue = match (shape.bias, shape.relu) {
            (false, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            (false, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU,
            (true, false) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (true, true) => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
        };
        let dim = |v: usize| -> Result<(u64, i64)> {
            i64::try_from(v)
                .map(|l| (v as u64, l.max(1)))
                .map_err(|_| ctx.unsupported(format!("a cuBLASLt dimension of {v}")))
        };
        let ((m, _), (k, ldk), (n, ldn)) = (dim(shape.m)?, dim(shape.k)?, dim(shape.n)?);
        let desc =
            lt::create_matmul_desc(compute, scale).map_err(|e| failed(ctx, "a descriptor", e))?;
        let mut plan = Plan {
            shape,
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        // From here a failure destroys what was made (layouts not made yet are null, skipped).
        let made = (|| {
            // SAFETY: a live descriptor; the epilogue attribute is a 32-bit enum, passed by
            // address with its size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    desc,
                    sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&epilogue as *const sys::cublasLtEpilogue_t).cast(),
                    size_of::<sys::cublasLtEpilogue_t>(),
                )
            }
            .map_err(|e| failed(ctx, "setting the epilogue", e))?;
            let layout = |rows: u64, cols: u64, ld: i64| {
                lt::create_matrix_layout(ty, rows, cols, ld)
                    .map_err(|e| failed(ctx, "a matrix layout", e))
            };
            plan.layouts[0] = layout(n, k, ldn)?;
            plan.layouts[1] = layout(k, m, ldk)?;
            plan.layouts[2] = layout(n, m, ldn)?;
            let pref = lt::create_matmul_pref().map_err(|e| failed(ctx, "a preference", e))?;
            let bytes = workspace as u64;
            // SAFETY: a live preference; the attribute is a u64 passed by address with its
            // size; the heuristic reads live descriptor and layouts; the preference is
            // destroyed once, after.
            let heuristic = unsafe {
                let set = lt::set_matmul_pref_attribute(
                    pref,
                    sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    (&bytes as *const u64).cast(),
                    size_of::<u64>(),
                );
                let [a, b, c] = plan.layouts;
                let found = set.and_then(|()| {
                    lt::get_matmul_algo_heuristic(self.handle, desc, a, b, c, c, pref)
                });
                let _ = lt::destroy_matmul_pref(pref);
                found
            };
            heuristic.map_err(|e| failed(ctx, "choosing an algorithm", e))
        })();
        match made {
            Ok(found) => {
                plan.algo = found.algo;
                Ok(plan)
            }
            Err(e) => {
                plan.destroy();
                Err(e)
            }
        }
    }
}

impl Drop for Lt {
    /// Runs when the device's cuBLAS state is dropped (a device whose setup failed); the
    /// context is current there.
    fn drop(&mut self) {
        for plan in &self.plans {
            plan.destroy();
        }
        // SAFETY: the handle was made by `new` and is destroyed once, here.
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
