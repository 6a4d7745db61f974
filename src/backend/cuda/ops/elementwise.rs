//! Elementwise ops: fill and random numbers, binary ops, comparisons and unary ops with
//! broadcasting, the in-place ops (`binary_inplace`, `scale_inplace`, `axpy`), and `assign`
//! through `gather`.

use cudarc::driver::sys::CUdeviceptr;

use super::error::{checked_launch, Refusal};
use super::launch::{
    addressing, broadcast, elements, inplace_source, linear, opmath_scalar, same_gpu, scalar, size,
    Arg, Dst, Src, Strided, MODE_SELF,
};
use super::transfer::copy_bytes;
use super::Cuda;
use crate::backend::contract::{Draw, ElementwiseOps};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::Gpu;
use crate::backend::cuda::kernels::Function;
use crate::backend::layout::{broadcast_strides, contiguous_strides};
use crate::backend::{Binary, Compare, Unary};
use crate::error::Ctx;
use crate::{DType, Error, Result};

// ---- fill / random ----

// ---- binary / compare / unary ----

/// Launches an elementwise kernel `(const A* a, const B* b, O* out, u64 n, int mode, Strided s)`
/// over `out_dims`, with `a` and `b` broadcast to it.
fn launch_broadcast(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    (a, a_dims): Src<'_>,
    (b, b_dims): Src<'_>,
    (out, out_dims): Dst<'_>,
) -> Result<()> {
    let n = size(out_dims) as u64;
    let (mode, strided) = broadcast(ctx, a_dims, b_dims, out_dims)?;
    // SAFETY: the kernels launched here (the binary ops and comparisons) take exactly these
    // parameters; the three buffers are locked storage of `gpu`, addressed within their sizes
    // by `mode` and `s`.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            pa = a.ptr(), pb = b.ptr(), po = out.ptr(), count = n, m = mode, s = strided)
    }
}

/// Launches an elementwise kernel `(const A* a, O* out, u64 n, P extra)` over `n` elements.
fn launch_map<P: Copy + Arg>(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    (a, out): (&DeviceBuffer, &mut DeviceBuffer),
    n: u64,
    extra: P,
) -> Result<()> {
    // SAFETY: the kernels launched here (the scalar ops, scalar comparisons and `pow`) take
    // exactly these parameters, `P` being their last one's type (`T` as a `Scalar`, or f64);
    // both buffers are locked storage of `gpu` holding `n` elements.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            pa = a.ptr(), po = out.ptr(), count = n, e = extra)
    }
}

// ---- in place ----

/// The source operand of an in-place kernel: its address and addressing mode (the target
/// itself, `MODE_SELF`, when `src` is `None`).
fn inplace_operand(
    ctx: &Ctx,
    x: (&DeviceBuffer, &[usize]),
    src: Option<Src<'_>>,
) -> Result<(CUdeviceptr, i32, Strided)> {
    match src {
        None => Ok((x.0.ptr(), MODE_SELF, Strided::none())),
        Some((b, b_dims)) => {
            same_gpu(ctx, &[x.0.gpu(), b.gpu()])?;
            let (mode, s) = inplace_source(ctx, x.1, b_dims)?;
            Ok((b.ptr(), mode, s))
        }
    }
}

/// `x += alpha · b` over `n` elements at `x`.
pub(super) fn axpy_raw(
    ctx: &Ctx,
    gpu: &Gpu,
    dtype: DType,
    (x, n): (CUdeviceptr, u64),
    alpha: f64,
    (b, mode, strided): (CUdeviceptr, i32, Strided),
) -> Result<()> {
    let f = gpu.kernels.one(ctx, "axpy", dtype)?;
    // SAFETY: axpy_<T>(T* x, const T* b, u64 n, T alpha, int mode, Strided s); both are locked
    // storage of `gpu` (callers pass their arrays' addresses), the source addressed within its
    // size.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            px = x, pb = b, count = n, a = opmath_scalar(dtype, alpha), m = mode, s = strided)
    }
}

/// `dst[i] = src[offset(i)]` for `dst` of `dst_dims` and source strides `src_strides` (per dst
/// dim), moving elements of `elem` bytes.
pub(super) fn gather(
    ctx: &Ctx,
    gpu: &Gpu,
    elem: usize,
    (src, src_len, src_strides): (CUdeviceptr, usize, Vec<usize>),
    (dst, dst_dims): (CUdeviceptr, &[usize]),
) -> Result<()> {
    let n = size(dst_dims) as u64;
    if n == 0 {
        return Ok(());
    }
    // The length shortcut of `addressing` assumes an operand as long as the output is laid out
    // like it, which holds for broadcasting but not for a permutation: a gather is a plain copy
    // only when the source strides are the destination's own.
    if src_strides == contiguous_strides(dst_dims) {
        return copy_bytes(ctx, gpu, src, dst, n as usize * elem);
    }
    let unused = vec![0; dst_dims.len()];
    let (mode, strided) = addressing(ctx, dst_dims, (src_len, src_strides), (1, unused), false)?;
    let f = gpu.kernels.sized(ctx, "gather", elem)?;
    // SAFETY: gather_b<N>(const T* src, T* dst, u64 n, int mode, Strided s); locked storage of
    // `gpu`, the source addressed within its size.
    unsafe {
        launch!(ctx, gpu, f, linear(gpu, n);
            ps = src, pd = dst, count = n, m = mode, s = strided)
    }
}

impl ElementwiseOps for Cuda {
    fn fill(ctx: &Ctx, dtype: DType, dst: &mut DeviceBuffer, value: f64) -> Result<()> {
        let gpu = dst.gpu();
        let n = elements(dst, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "fill", dtype)?;
        // SAFETY: fill_<T>(T* out, u64 n, T v); `dst` is locked storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, v = scalar(dtype, value))
        }
    }

    fn arange(
        ctx: &Ctx,
        dtype: DType,
        dst: &mut DeviceBuffer,
        start: f64,
        step: f64,
    ) -> Result<()> {
        let gpu = dst.gpu();
        let n = elements(dst, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "arange", dtype)?;
        // SAFETY: arange_<T>(T* out, u64 n, f64 start, f64 step); `dst` is locked storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, first = start, delta = step)
        }
    }

    fn eye(ctx: &Ctx, dtype: DType, dst: &mut DeviceBuffer, n: usize) -> Result<()> {
        let gpu = dst.gpu();
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "eye", dtype)?;
        let total = (n * n) as u64;
        // SAFETY: eye_<T>(T* out, u64 side); `dst` is locked storage of `gpu` of side² elements.
        unsafe { launch!(ctx, gpu, f, linear(gpu, total); out = dst.ptr(), side = n as u64) }
    }

    fn randn(
        ctx: &Ctx,
        dtype: DType,
        dst: &mut DeviceBuffer,
        Draw { seed, start }: Draw,
    ) -> Result<()> {
        let gpu = dst.gpu();
        let n = elements(dst, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "randn", dtype)?;
        // SAFETY: randn_<T>(T* out, u64 n, u64 seed, u64 start); `dst` is locked storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n); out = dst.ptr(), count = n, s = seed, first = start)
        }
    }

    fn rand(
        ctx: &Ctx,
        dtype: DType,
        dst: &mut DeviceBuffer,
        Draw { seed, start }: Draw,
        (low, high): (f64, f64),
    ) -> Result<()> {
        let gpu = dst.gpu();
        let n = elements(dst, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "rand", dtype)?;
        // SAFETY: rand_<T>(T* out, u64 n, u64 seed, u64 start, f64 low, f64 high); `dst` is locked
        // storage of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n);
                out = dst.ptr(), count = n, s = seed, first = start, lo = low, hi = high)
        }
    }

    fn binary(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        (a, a_dims): Src<'_>,
        (b, b_dims): Src<'_>,
        (out, out_dims): Dst<'_>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
        let n = size(out_dims) as u64;
        if n == 0 {
            return Ok(());
        }
        if op == Binary::Div && !dtype.is_float() {
            // The divisor is checked by the kernel; a 0 is reported at the next wait.
            let f = gpu.kernels.one(ctx, "div_checked", dtype)?;
            let (mode, strided) = broadcast(ctx, a_dims, b_dims, out_dims)?;
            return checked_launch(
                ctx,
                gpu,
                || Refusal::Zero(on_zero()),
                |flag, key| {
                    // SAFETY: div_checked_<T>(const T* a, const T* b, T* out, u64 n, int mode,
                    // Strided s, u64* flag, u64 key); the three buffers are locked storage of
                    // `gpu`, addressed within their sizes by `mode` and `s`; `flag` is the
                    // device's check word, which lives as long as the device.
                    unsafe {
                        launch!(ctx, gpu, f, linear(gpu, n);
                            pa = a.ptr(), pb = b.ptr(), po = out.ptr(), count = n, m = mode,
                            s = strided, pf = flag, k = key)
                    }
                },
            );
        }
        let f = gpu.kernels.one(ctx, op.kernel_names().0, dtype)?;
        launch_broadcast(ctx, gpu, f, (a, a_dims), (b, b_dims), (out, out_dims))
    }

    fn binary_scalar(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        a: &DeviceBuffer,
        value: f64,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let n = elements(out, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, op.kernel_names().1, dtype)?;
        launch_map(ctx, gpu, f, (a, out), n, opmath_scalar(dtype, value))
    }

    fn compare(
        ctx: &Ctx,
        op: Compare,
        dtype: DType,
        (a, a_dims): Src<'_>,
        (b, b_dims): Src<'_>,
        (out, out_dims): Dst<'_>,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), b.gpu(), out.gpu()])?;
        let n = size(out_dims) as u64;
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, op.kernel_names().0, dtype)?;
        launch_broadcast(ctx, gpu, f, (a, a_dims), (b, b_dims), (out, out_dims))
    }

    fn compare_scalar(
        ctx: &Ctx,
        op: Compare,
        dtype: DType,
        a: &DeviceBuffer,
        value: f64,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let n = elements(a, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, op.kernel_names().1, dtype)?;
        launch_map(ctx, gpu, f, (a, out), n, value)
    }

    fn unary(
        ctx: &Ctx,
        op: Unary,
        dtype: DType,
        a: &DeviceBuffer,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let n = elements(out, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, op.kernel_name(), dtype)?;
        // SAFETY: <op>_<T>(const T* a, T* out, u64 n); locked storage of `gpu`.
        unsafe { launch!(ctx, gpu, f, linear(gpu, n); pa = a.ptr(), po = out.ptr(), count = n) }
    }

    fn pow_scalar(
        ctx: &Ctx,
        dtype: DType,
        a: &DeviceBuffer,
        exponent: f64,
        out: &mut DeviceBuffer,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[a.gpu(), out.gpu()])?;
        let n = elements(out, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "pow", dtype)?;
        launch_map(ctx, gpu, f, (a, out), n, exponent)
    }

    fn binary_inplace(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        (x, x_dims): Dst<'_>,
        src: Option<Src<'_>>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        let gpu = x.gpu();
        let n = size(x_dims) as u64;
        if n == 0 {
            return Ok(());
        }
        let (b, mode, strided) = inplace_operand(ctx, (x, x_dims), src)?;
        if op == Binary::Div && !dtype.is_float() {
            // The divisor is checked by the kernel; a 0 is reported at the next wait.
            let f = gpu.kernels.one(ctx, "div_checked_inplace", dtype)?;
            return checked_launch(
                ctx,
                gpu,
                || Refusal::Zero(on_zero()),
                |flag, key| {
                    // SAFETY: div_checked_inplace_<T>(T* x, const T* b, u64 n, int mode, Strided s,
                    // u64* flag, u64 key); locked storage of `gpu`, the source addressed within its
                    // size; `flag` is the device's check word.
                    unsafe {
                        launch!(ctx, gpu, f, linear(gpu, n);
                            px = x.ptr(), pb = b, count = n, m = mode, s = strided, pf = flag,
                            k = key)
                    }
                },
            );
        }
        let f = gpu.kernels.one(ctx, op.kernel_names().2, dtype)?;
        // SAFETY: <op>_inplace_<T>(T* x, const T* b, u64 n, int mode, Strided s); locked storage of
        // `gpu`, the source addressed within its size.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n);
                px = x.ptr(), pb = b, count = n, m = mode, s = strided)
        }
    }

    fn scale_inplace(ctx: &Ctx, dtype: DType, x: &mut DeviceBuffer, value: f64) -> Result<()> {
        let gpu = x.gpu();
        let n = elements(x, dtype);
        if n == 0 {
            return Ok(());
        }
        let f = gpu.kernels.one(ctx, "scale", dtype)?;
        // SAFETY: scale_<T>(T* x, u64 n, T v) (an f32 `v` for the half types); locked storage
        // of `gpu`.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n); px = x.ptr(), count = n, v = opmath_scalar(dtype, value))
        }
    }

    fn axpy(
        ctx: &Ctx,
        dtype: DType,
        (x, x_dims): Dst<'_>,
        alpha: f64,
        src: Option<Src<'_>>,
    ) -> Result<()> {
        let gpu = x.gpu();
        let n = size(x_dims) as u64;
        if n == 0 {
            return Ok(());
        }
        let (b, mode, strided) = inplace_operand(ctx, (x, x_dims), src)?;
        axpy_raw(ctx, gpu, dtype, (x.ptr(), n), alpha, (b, mode, strided))
    }

    fn assign(
        ctx: &Ctx,
        dtype: DType,
        (x, x_dims): Dst<'_>,
        (src, src_dims): Src<'_>,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[x.gpu(), src.gpu()])?;
        gather(
            ctx,
            gpu,
            dtype.size_in_bytes(),
            (
                src.ptr(),
                size(src_dims),
                broadcast_strides(src_dims, x_dims),
            ),
            (x.ptr(), x_dims),
        )
    }
}
