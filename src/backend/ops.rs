//! The entry points of the op families. Each runs the CPU kernels when every operand is host
//! storage and the CUDA backend when every operand is on one CUDA device; mixed operands give
//! `DeviceMismatch` (front-ends check devices first, with better messages: this is the
//! backstop).
//!
//! Shapes are passed as dims, dtypes as [`DType`]; the storage's byte length always matches
//! (front-ends allocate it from the same metadata).

use super::cpu::ops as cpu;
use super::cuda;
use super::{Batched, Binary, Compare, Storage, Unary};
use crate::error::Ctx;
use crate::{DType, Element, Error, Result};

/// Binds each named storage to its host buffer and runs `$host` when all are on the host, or to
/// its device buffer and runs `$cuda` when all are on CUDA devices (the CUDA backend checks they
/// are one device); mixed gives `DeviceMismatch`.
macro_rules! on_device {
    ($ctx:expr, ($($s:ident),+), host => $host:expr, cuda => $cuda:expr $(,)?) => {
        match ($($s,)+) {
            ($(Storage::Host($s),)+) => $host,
            ($(Storage::Cuda($s),)+) => $cuda,
            #[allow(unreachable_patterns)]
            _ => Err(mixed($ctx)),
        }
    };
}

fn mixed(ctx: &Ctx) -> Error {
    ctx.device_mismatch(format!(
        "`{}` got operands on different devices (move them with to_device)",
        ctx.op
    ))
}

// ---- copy / convert ----

/// Copies the first `dst.len()` elements of `src` into `dst` (a device read synchronises and
/// reports earlier kernel errors as `Backend`).
pub(crate) fn read<T: Element>(ctx: &Ctx, src: &Storage, dst: &mut [T]) -> Result<()> {
    match src {
        Storage::Host(src) => {
            cpu::read(src, dst);
            Ok(())
        }
        Storage::Cuda(src) => cuda::read(ctx, src, dst),
    }
}

/// Copies `data` into `dst` (same length).
pub(crate) fn write<T: Element>(ctx: &Ctx, dst: &mut Storage, data: &[T]) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::write(dst, data);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::write(ctx, dst, data),
    }
}

/// Copies the bytes of `src` into `dst` (same length), across devices too.
pub(crate) fn copy(ctx: &Ctx, src: &Storage, dst: &mut Storage) -> Result<()> {
    match (src, dst) {
        (Storage::Host(src), Storage::Host(dst)) => {
            cpu::copy(src, dst);
            Ok(())
        }
        (Storage::Host(src), Storage::Cuda(dst)) => cuda::upload(ctx, src, dst),
        (Storage::Cuda(src), Storage::Host(dst)) => cuda::download(ctx, src, dst),
        (Storage::Cuda(src), Storage::Cuda(dst)) => cuda::copy(ctx, src, dst),
    }
}

/// `dst = src` converted from `from` to `to` elementwise (same device).
pub(crate) fn convert(
    ctx: &Ctx,
    from: DType,
    to: DType,
    src: &Storage,
    dst: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (src, dst),
        host => { cpu::convert(from, to, src, dst); Ok(()) },
        cuda => cuda::convert(ctx, from, to, src, dst))
}

/// Waits for the work queued on `device` and reports errors of earlier asynchronous kernels.
pub(crate) fn synchronize(ctx: &Ctx, device: crate::Device) -> Result<()> {
    match device {
        crate::Device::Cpu => Ok(()),
        crate::Device::Cuda(ordinal) => cuda::synchronize(ctx, ordinal),
    }
}

// ---- fill / random ----

/// Sets every byte of `dst` to 0.
pub(crate) fn zero(ctx: &Ctx, dst: &mut Storage) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::zero(dst);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::zero(ctx, dst),
    }
}

/// Sets every element of `dst` to `value` converted to `dtype`.
pub(crate) fn fill(ctx: &Ctx, dtype: DType, dst: &mut Storage, value: f64) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::fill(dtype, dst, value);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::fill(ctx, dtype, dst, value),
    }
}

/// `dst[i] = start + i·step` (computed in f64, then converted).
pub(crate) fn arange(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut Storage,
    start: f64,
    step: f64,
) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::arange(dtype, dst, start, step);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::arange(ctx, dtype, dst, start, step),
    }
}

/// The `n × n` identity into `dst` (which may hold anything).
pub(crate) fn eye(ctx: &Ctx, dtype: DType, dst: &mut Storage, n: usize) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::eye(dtype, dst, n);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::eye(ctx, dtype, dst, n),
    }
}

/// Standard normals drawn at counters `start..` of the stream `seed`: the same numbers on
/// every device.
pub(crate) fn randn(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut Storage,
    seed: u64,
    start: u64,
) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::randn(dtype, dst, seed, start);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::randn(ctx, dtype, dst, seed, start),
    }
}

/// Uniforms in `[low, high)` drawn at counters `start..` of the stream `seed` (integers for
/// integer dtypes): the same numbers on every device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rand(
    ctx: &Ctx,
    dtype: DType,
    dst: &mut Storage,
    seed: u64,
    start: u64,
    low: f64,
    high: f64,
) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            cpu::rand(dtype, dst, seed, start, low, high);
            Ok(())
        }
        Storage::Cuda(dst) => cuda::rand(ctx, dtype, dst, seed, start, low, high),
    }
}

// ---- binary / compare / unary ----

/// `out = op(a, b)` with NumPy broadcasting of `a` and `b` to `out_dims`. An integer division
/// whose divisor holds 0 gives `on_zero()` and writes nothing.
#[allow(clippy::too_many_arguments)]
pub(crate) fn binary(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    (a, a_dims): (&Storage, &[usize]),
    (b, b_dims): (&Storage, &[usize]),
    (out, out_dims): (&mut Storage, &[usize]),
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    on_device!(ctx, (a, b, out),
        host => cpu::binary(op, dtype, (a, a_dims), (b, b_dims), (out, out_dims), on_zero),
        cuda => cuda::binary(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims), on_zero))
}

/// `out = op(a, value)` with `value` converted to `dtype` (the front-end checked it fits).
pub(crate) fn binary_scalar(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    a: &Storage,
    value: f64,
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::binary_scalar(op, dtype, a, value, out); Ok(()) },
        cuda => cuda::binary_scalar(ctx, op, dtype, a, value, out))
}

/// `out = op(a, b)` as `U8` 0/1, broadcasting as [`binary`].
pub(crate) fn compare(
    ctx: &Ctx,
    op: Compare,
    dtype: DType,
    (a, a_dims): (&Storage, &[usize]),
    (b, b_dims): (&Storage, &[usize]),
    (out, out_dims): (&mut Storage, &[usize]),
) -> Result<()> {
    on_device!(ctx, (a, b, out),
        host => { cpu::compare(op, dtype, (a, a_dims), (b, b_dims), (out, out_dims)); Ok(()) },
        cuda => cuda::compare(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims)))
}

/// `out = op(a, value)` as `U8` 0/1: floats compare against `value` in their own precision,
/// integers against the exact value.
pub(crate) fn compare_scalar(
    ctx: &Ctx,
    op: Compare,
    dtype: DType,
    a: &Storage,
    value: f64,
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::compare_scalar(op, dtype, a, value, out); Ok(()) },
        cuda => cuda::compare_scalar(ctx, op, dtype, a, value, out))
}

/// `out = op(a)` elementwise.
pub(crate) fn unary(
    ctx: &Ctx,
    op: Unary,
    dtype: DType,
    a: &Storage,
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::unary(op, dtype, a, out); Ok(()) },
        cuda => cuda::unary(ctx, op, dtype, a, out))
}

/// `out = a^exponent` elementwise (integers through f64, truncated).
pub(crate) fn pow_scalar(
    ctx: &Ctx,
    dtype: DType,
    a: &Storage,
    exponent: f64,
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::pow_scalar(dtype, a, exponent, out); Ok(()) },
        cuda => cuda::pow_scalar(ctx, dtype, a, exponent, out))
}

// ---- in place ----

/// `x = op(x, src)` with `src` broadcast to `x_dims`; `src` `None` means `x` itself. An integer
/// division whose divisor holds 0 gives `on_zero()` and changes nothing.
pub(crate) fn binary_inplace(
    ctx: &Ctx,
    op: Binary,
    dtype: DType,
    (x, x_dims): (&mut Storage, &[usize]),
    src: Option<(&Storage, &[usize])>,
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    match (x, src) {
        (Storage::Host(x), None) => cpu::binary_inplace(op, dtype, (x, x_dims), None, on_zero),
        (Storage::Host(x), Some((Storage::Host(s), s_dims))) => {
            cpu::binary_inplace(op, dtype, (x, x_dims), Some((s, s_dims)), on_zero)
        }
        (Storage::Cuda(x), None) => {
            cuda::binary_inplace(ctx, op, dtype, (x, x_dims), None, on_zero)
        }
        (Storage::Cuda(x), Some((Storage::Cuda(s), s_dims))) => {
            cuda::binary_inplace(ctx, op, dtype, (x, x_dims), Some((s, s_dims)), on_zero)
        }
        _ => Err(mixed(ctx)),
    }
}

/// `x = x · value` in place.
pub(crate) fn scale_inplace(ctx: &Ctx, dtype: DType, x: &mut Storage, value: f64) -> Result<()> {
    match x {
        Storage::Host(x) => {
            cpu::scale_inplace(dtype, x, value);
            Ok(())
        }
        Storage::Cuda(x) => cuda::scale_inplace(ctx, dtype, x, value),
    }
}

/// `x += alpha · src` in place, `src` broadcast to `x_dims` (`None`: `x` itself).
pub(crate) fn axpy(
    ctx: &Ctx,
    dtype: DType,
    (x, x_dims): (&mut Storage, &[usize]),
    alpha: f64,
    src: Option<(&Storage, &[usize])>,
) -> Result<()> {
    match (x, src) {
        (Storage::Host(x), None) => {
            cpu::axpy(dtype, (x, x_dims), alpha, None);
            Ok(())
        }
        (Storage::Host(x), Some((Storage::Host(s), s_dims))) => {
            cpu::axpy(dtype, (x, x_dims), alpha, Some((s, s_dims)));
            Ok(())
        }
        (Storage::Cuda(x), None) => cuda::axpy(ctx, dtype, (x, x_dims), alpha, None),
        (Storage::Cuda(x), Some((Storage::Cuda(s), s_dims))) => {
            cuda::axpy(ctx, dtype, (x, x_dims), alpha, Some((s, s_dims)))
        }
        _ => Err(mixed(ctx)),
    }
}

/// `x = src` broadcast to `x_dims` (a fresh `x` makes this `broadcast_to`).
pub(crate) fn assign(
    ctx: &Ctx,
    dtype: DType,
    (x, x_dims): (&mut Storage, &[usize]),
    (src, src_dims): (&Storage, &[usize]),
) -> Result<()> {
    on_device!(ctx, (x, src),
        host => { cpu::assign(dtype, (x, x_dims), (src, src_dims)); Ok(()) },
        cuda => cuda::assign(ctx, dtype, (x, x_dims), (src, src_dims)))
}

// ---- reductions ----

/// The sum (or mean) of `a` (`dims`) over the axes marked in `mask` into `out`: floats keep
/// their dtype (accumulated in f64), integers give `I64` sums and `F64` means (`to`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sum(
    ctx: &Ctx,
    from: DType,
    to: DType,
    (a, dims): (&Storage, &[usize]),
    mask: &[bool],
    out: &mut Storage,
    mean: bool,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::sum(from, to, (a, dims), mask, out, mean); Ok(()) },
        cuda => cuda::sum(ctx, from, to, (a, dims), mask, out, mean))
}

/// The sum (or mean) of every element of `a` into the one element of `out` (dtypes as [`sum`]).
pub(crate) fn sum_all(
    ctx: &Ctx,
    from: DType,
    to: DType,
    a: &Storage,
    out: &mut Storage,
    mean: bool,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::sum_all(from, to, a, out, mean); Ok(()) },
        cuda => cuda::sum_all(ctx, from, to, a, out, mean))
}

/// The maximum (NaN wins) along the middle axis of `a` seen as `[outer, n, inner]`, `n ≥ 1`.
pub(crate) fn max_axis(
    ctx: &Ctx,
    dtype: DType,
    a: &Storage,
    (outer, n, inner): (usize, usize, usize),
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::max_axis(dtype, a, (outer, n, inner), out); Ok(()) },
        cuda => cuda::max_axis(ctx, dtype, a, (outer, n, inner), out))
}

/// The `I64` index of the maximum (first on ties, first NaN) along the middle axis of `a` seen
/// as `[outer, n, inner]`, `n ≥ 1`.
pub(crate) fn argmax_axis(
    ctx: &Ctx,
    dtype: DType,
    a: &Storage,
    (outer, n, inner): (usize, usize, usize),
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::argmax_axis(dtype, a, (outer, n, inner), out); Ok(()) },
        cuda => cuda::argmax_axis(ctx, dtype, a, (outer, n, inner), out))
}

// ---- matrix products ----

/// `out = a · b` for `[m, k] · [k, n]`, or batched as `batch` says.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    ctx: &Ctx,
    dtype: DType,
    batch: Option<(Batched, usize)>,
    (m, k, n): (usize, usize, usize),
    a: &Storage,
    b: &Storage,
    out: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (a, b, out),
        host => { cpu::matmul(dtype, batch, (m, k, n), a, b, out); Ok(()) },
        cuda => cuda::matmul(ctx, dtype, batch, (m, k, n), a, b, out))
}

/// `out = op(a) · op(b)`, or with `accumulate = Some((beta, alpha))`,
/// `out = beta·out + alpha·op(a)·op(b)`; `a` is stored `[m, k]` (`[k, m]` when `ta`), `b`
/// `[k, n]` (`[n, k]` when `tb`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (&Storage, bool),
    (b, tb): (&Storage, bool),
    out: &mut Storage,
    accumulate: Option<(f64, f64)>,
) -> Result<()> {
    on_device!(ctx, (a, b, out),
        host => { cpu::gemm(dtype, (m, k, n), (a, ta), (b, tb), out, accumulate); Ok(()) },
        cuda => cuda::gemm(ctx, dtype, (m, k, n), (a, ta), (b, tb), out, accumulate))
}

/// Columns per panel of a packed right operand ([`pack_rhs`]).
pub(crate) const PACK_COLUMNS: usize = cpu::PACK_COLUMNS;

/// Packs the f32 `[k, n]` operand `b` into `out` (`⌈n/PACK_COLUMNS⌉·k·PACK_COLUMNS` f32) for
/// [`packed_matmul`]. CPU only: a `Dense` layer packs f32 weights on the CPU alone.
pub(crate) fn pack_rhs(
    ctx: &Ctx,
    (k, n): (usize, usize),
    b: &Storage,
    out: &mut Storage,
) -> Result<()> {
    match (b, out) {
        (Storage::Host(b), Storage::Host(out)) => {
            cpu::pack_rhs((k, n), b, out);
            Ok(())
        }
        _ => Err(ctx.unsupported("packed operands live in CPU memory only")),
    }
}

/// `out = a · b (+ bias) (then ReLU)` for f32 `a` `[m, k]` and `b` packed by [`pack_rhs`].
pub(crate) fn packed_matmul(
    ctx: &Ctx,
    (m, k, n): (usize, usize, usize),
    a: &Storage,
    packed: &Storage,
    bias: Option<&Storage>,
    relu: bool,
    out: &mut Storage,
) -> Result<()> {
    let bias = match bias {
        None => None,
        Some(Storage::Host(b)) => Some(b),
        Some(_) => return Err(mixed(ctx)),
    };
    match (a, packed, out) {
        (Storage::Host(a), Storage::Host(packed), Storage::Host(out)) => {
            cpu::packed_matmul((m, k, n), a, packed, bias, relu, out);
            Ok(())
        }
        _ => Err(mixed(ctx)),
    }
}

/// One SGD-with-momentum step of a dense layer: `v ← momentum·v + xᵀ·g; w ← w − lr·v`, with
/// `x` `[k, m]`, `g` `[k, n]`, `v` and `w` `[m, n]` (floats).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sgd_dense(
    ctx: &Ctx,
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (x, g): (&Storage, &Storage),
    (v, w): (&mut Storage, &mut Storage),
    lr: f64,
    momentum: f64,
) -> Result<()> {
    on_device!(ctx, (x, g, v, w),
        host => { cpu::sgd_dense(dtype, (m, k, n), (x, g), (v, w), lr, momentum); Ok(()) },
        cuda => cuda::sgd_dense(ctx, dtype, (m, k, n), (x, g), (v, w), lr, momentum))
}

// ---- neural-network ops ----

/// Softmax (or log-softmax) along the middle axis of `a` seen as `[outer, n, inner]` (floats).
pub(crate) fn softmax(
    ctx: &Ctx,
    dtype: DType,
    a: &Storage,
    (outer, n, inner): (usize, usize, usize),
    out: &mut Storage,
    log: bool,
) -> Result<()> {
    on_device!(ctx, (a, out),
        host => { cpu::softmax(dtype, a, (outer, n, inner), out, log); Ok(()) },
        cuda => cuda::softmax(ctx, dtype, a, (outer, n, inner), out, log))
}

/// The flat position and value of the first index of `indices` (an integer dtype) outside
/// `0..bound`, if any. On a CUDA device always `None`: the kernels that use the indices check
/// them and the next wait on the device reports a bad one (no synchronisation here).
pub(crate) fn first_bad_index(
    ctx: &Ctx,
    dtype: DType,
    indices: &Storage,
    bound: usize,
) -> Result<Option<(usize, i64)>> {
    match indices {
        Storage::Host(indices) => Ok(cpu::first_bad_index(dtype, indices, bound)),
        Storage::Cuda(indices) => cuda::first_bad_index(ctx, dtype, indices, bound),
    }
}

/// The one-hot encoding (`[len, depth]` of `to`) of integer `indices` (`from`). The host kernel
/// checks the indices again under the lock and reports the first bad one without writing; the
/// device kernel writes zeros for bad ones and reports them at the next wait on the device.
pub(crate) fn one_hot(
    ctx: &Ctx,
    (from, to): (DType, DType),
    indices: &Storage,
    depth: usize,
    out: &mut Storage,
) -> Result<Option<(usize, i64)>> {
    on_device!(ctx, (indices, out),
        host => Ok(cpu::one_hot((from, to), indices, depth, out)),
        cuda => cuda::one_hot(ctx, (from, to), indices, depth, out).map(|()| None))
}

/// `out[o, j] = x[o, indices[o, j], j]` for `x` seen as `[outer, n, inner]`; bad indices as for
/// [`one_hot`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn pick(
    ctx: &Ctx,
    (dtype, from): (DType, DType),
    x: &Storage,
    (n, inner): (usize, usize),
    indices: &Storage,
    out: &mut Storage,
) -> Result<Option<(usize, i64)>> {
    on_device!(ctx, (x, indices, out),
        host => Ok(cpu::pick((dtype, from), x, (n, inner), indices, out)),
        cuda => cuda::pick(ctx, (dtype, from), x, (n, inner), indices, out).map(|()| None))
}

// ---- shape / gather ----

/// `dst = srcᵀ` for `src` of `[rows, cols]`.
pub(crate) fn transpose(
    ctx: &Ctx,
    dtype: DType,
    src: &Storage,
    (rows, cols): (usize, usize),
    dst: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (src, dst),
        host => { cpu::transpose(dtype, src, (rows, cols), dst); Ok(()) },
        cuda => cuda::transpose(ctx, dtype, src, (rows, cols), dst))
}

/// `dst` = `src` (shape `dims`) with its axes reordered: output axis `k` is input axis `perm[k]`.
pub(crate) fn permute(
    ctx: &Ctx,
    dtype: DType,
    (src, dims): (&Storage, &[usize]),
    perm: &[usize],
    dst: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (src, dst),
        host => { cpu::permute(dtype, (src, dims), perm, dst); Ok(()) },
        cuda => cuda::permute(ctx, dtype, (src, dims), perm, dst))
}

/// For `src` seen as `[outer, n, inner]` elements of `elem` bytes, copies
/// `[outer, start..start + len, inner]` into `dst`.
pub(crate) fn narrow(
    ctx: &Ctx,
    elem: usize,
    src: &Storage,
    (outer, n, inner): (usize, usize, usize),
    start: usize,
    dst: &mut Storage,
) -> Result<()> {
    on_device!(ctx, (src, dst),
        host => { cpu::narrow(elem, src, (outer, n, inner), start, dst); Ok(()) },
        cuda => cuda::narrow(ctx, elem, src, (outer, n, inner), start, dst))
}

/// Row `o` of `dst` is row `o` of every source in turn, row `o` of `srcs[k]` being the
/// `row_bytes[k]` bytes at `o · row_bytes[k]` (`concat` and `stack`).
pub(crate) fn interleave(
    ctx: &Ctx,
    srcs: &[&Storage],
    row_bytes: &[usize],
    outer: usize,
    dst: &mut Storage,
) -> Result<()> {
    match dst {
        Storage::Host(dst) => {
            let mut hosts = Vec::with_capacity(srcs.len());
            for src in srcs {
                match src {
                    Storage::Host(src) => hosts.push(src),
                    Storage::Cuda(_) => return Err(mixed(ctx)),
                }
            }
            cpu::interleave(&hosts, row_bytes, outer, dst);
            Ok(())
        }
        Storage::Cuda(dst) => {
            let mut devices = Vec::with_capacity(srcs.len());
            for src in srcs {
                match src {
                    Storage::Cuda(src) => devices.push(src),
                    Storage::Host(_) => return Err(mixed(ctx)),
                }
            }
            cuda::interleave(ctx, &devices, row_bytes, outer, dst)
        }
    }
}
