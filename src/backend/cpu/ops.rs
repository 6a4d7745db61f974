//! The op families on host buffers: what [`crate::backend`]'s entry points run when every
//! operand is on the host. Each function picks the element type and calls the loops of this
//! module's siblings; the closures are generic parameters there, so each loop is compiled per op
//! and dtype.

use super::buffer::HostBuffer;
use super::elementwise::{self, broadcast_zip, broadcast_zip_inplace};
use super::num::{CastTo, Float, Num};
use super::{matmul, nn, packed, random, reduce, sgd, shape};
use crate::backend::{Batched, Binary, Compare, Unary};
use crate::dtype::{dispatch, dispatch_float};
use crate::{DType, Element, Error, Result};

/// Runs `$body` with `$f` bound to the closure of binary op `$op` for element type `$t`.
macro_rules! with_binary {
    ($op:expr, $t:ty, $f:ident => $body:expr) => {
        match $op {
            Binary::Add => {
                let $f = |x: $t, y: $t| x.add(y);
                $body
            }
            Binary::Sub => {
                let $f = |x: $t, y: $t| x.sub(y);
                $body
            }
            Binary::Mul => {
                let $f = |x: $t, y: $t| x.mul(y);
                $body
            }
            Binary::Div => {
                let $f = |x: $t, y: $t| x.div(y);
                $body
            }
            Binary::Maximum => {
                let $f = |x: $t, y: $t| x.max_nan(y);
                $body
            }
            Binary::Minimum => {
                let $f = |x: $t, y: $t| x.min_nan(y);
                $body
            }
        }
    };
}

/// Runs `$body` with `$f` bound to the predicate of comparison `$op` (generic over the operand
/// type, IEEE for floats: NaN compares false).
macro_rules! with_compare {
    ($op:expr, $f:ident => $body:expr) => {
        match $op {
            Compare::Gt => {
                #[inline(always)]
                fn $f<T: PartialOrd>(x: T, y: T) -> bool {
                    x > y
                }
                $body
            }
            Compare::Lt => {
                #[inline(always)]
                fn $f<T: PartialOrd>(x: T, y: T) -> bool {
                    x < y
                }
                $body
            }
            Compare::Eq => {
                #[inline(always)]
                fn $f<T: PartialOrd>(x: T, y: T) -> bool {
                    x == y
                }
                $body
            }
        }
    };
}

/// `true` if an integer division by `divisor` would divide by zero.
fn zero_divisor<T: Num>(op: Binary, divisor: &[T]) -> bool {
    op == Binary::Div && !T::DTYPE.is_float() && divisor.iter().any(|v| v.is_zero())
}

// ---- copy / convert ----

pub(crate) fn read<T: Element>(src: &HostBuffer, dst: &mut [T]) {
    dst.copy_from_slice(&src.as_slice::<T>()[..dst.len()]);
}

pub(crate) fn write<T: Element>(dst: &mut HostBuffer, data: &[T]) {
    dst.as_mut_slice::<T>().copy_from_slice(data);
}

pub(crate) fn copy(src: &HostBuffer, dst: &mut HostBuffer) {
    dst.as_bytes_mut().copy_from_slice(src.as_bytes());
}

pub(crate) fn convert(from: DType, to: DType, src: &HostBuffer, dst: &mut HostBuffer) {
    if from == to {
        return copy(src, dst);
    }
    dispatch!(from, S => dispatch!(to, D => {
        elementwise::map(src.as_slice::<S>(), dst.as_mut_slice::<D>(), <S as CastTo<D>>::cast);
    }));
}

// ---- fill / random ----

pub(crate) fn zero(dst: &mut HostBuffer) {
    dst.as_bytes_mut().fill(0);
}

pub(crate) fn fill(dtype: DType, dst: &mut HostBuffer, value: f64) {
    dispatch!(dtype, T => {
        let v = T::from_f64(value);
        elementwise::map_inplace(dst.as_mut_slice::<T>(), move |_| v);
    })
}

pub(crate) fn arange(dtype: DType, dst: &mut HostBuffer, start: f64, step: f64) {
    dispatch!(dtype, T => {
        for (i, o) in dst.as_mut_slice::<T>().iter_mut().enumerate() {
            *o = T::from_f64(start + i as f64 * step);
        }
    })
}

pub(crate) fn eye(dtype: DType, dst: &mut HostBuffer, n: usize) {
    zero(dst);
    dispatch!(dtype, T => {
        let data = dst.as_mut_slice::<T>();
        for i in 0..n {
            data[i * n + i] = T::ONE;
        }
    })
}

pub(crate) fn randn(dtype: DType, dst: &mut HostBuffer, seed: u64, start: u64) {
    dispatch!(dtype, T => random::fill_normal(dst.as_mut_slice::<T>(), seed, start))
}

pub(crate) fn rand(dtype: DType, dst: &mut HostBuffer, seed: u64, start: u64, low: f64, high: f64) {
    dispatch!(dtype, T => random::fill_uniform(dst.as_mut_slice::<T>(), seed, start, low, high))
}

// ---- binary / compare / unary ----

pub(crate) fn binary(
    op: Binary,
    dtype: DType,
    (a, a_dims): (&HostBuffer, &[usize]),
    (b, b_dims): (&HostBuffer, &[usize]),
    (out, out_dims): (&mut HostBuffer, &[usize]),
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    dispatch!(dtype, T => {
        let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
        if zero_divisor(op, b) {
            return Err(on_zero());
        }
        let out = out.as_mut_slice::<T>();
        with_binary!(op, T, f => broadcast_zip(a, a_dims, b, b_dims, out, out_dims, f));
    });
    Ok(())
}

pub(crate) fn binary_scalar(
    op: Binary,
    dtype: DType,
    a: &HostBuffer,
    value: f64,
    out: &mut HostBuffer,
) {
    dispatch!(dtype, T => {
        let y = T::from_f64(value);
        let (a, out) = (a.as_slice::<T>(), out.as_mut_slice::<T>());
        with_binary!(op, T, f => elementwise::map(a, out, move |x| f(x, y)));
    });
}

pub(crate) fn compare(
    op: Compare,
    dtype: DType,
    (a, a_dims): (&HostBuffer, &[usize]),
    (b, b_dims): (&HostBuffer, &[usize]),
    (out, out_dims): (&mut HostBuffer, &[usize]),
) {
    dispatch!(dtype, T => {
        let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
        let out = out.as_mut_slice::<u8>();
        with_compare!(op, f => broadcast_zip(a, a_dims, b, b_dims, out, out_dims, |x: T, y: T| u8::from(f(x, y))));
    });
}

pub(crate) fn compare_scalar(
    op: Compare,
    dtype: DType,
    a: &HostBuffer,
    value: f64,
    out: &mut HostBuffer,
) {
    let out = out.as_mut_slice::<u8>();
    dispatch_float!(dtype, T => {
        // Floats compare in their own precision, so `x.eq_scalar(0.1)` finds the f32 0.1.
        let y = T::from_f64(value);
        with_compare!(op, f => elementwise::map(a.as_slice::<T>(), out, move |x: T| u8::from(f(x, y))));
    }, _ => {
        // Integers compare exactly against the f64 value, so `x.gt_scalar(2.5)` is false for 2
        // (no truncation of the scalar).
        dispatch!(dtype, T => {
            with_compare!(op, f => elementwise::map(a.as_slice::<T>(), out, move |x: T| u8::from(f(x.to_f64(), value))));
        })
    });
}

fn float_map(
    dtype: DType,
    a: &HostBuffer,
    out: &mut HostBuffer,
    f32_fn: impl Fn(f32) -> f32 + Sync,
    f64_fn: impl Fn(f64) -> f64 + Sync,
) {
    match dtype {
        DType::F32 => elementwise::map(a.as_slice::<f32>(), out.as_mut_slice(), f32_fn),
        _ => elementwise::map(a.as_slice::<f64>(), out.as_mut_slice(), f64_fn),
    }
}

pub(crate) fn unary(op: Unary, dtype: DType, a: &HostBuffer, out: &mut HostBuffer) {
    match op {
        Unary::Exp => return float_map(dtype, a, out, Float::exp, Float::exp),
        Unary::Log => return float_map(dtype, a, out, Float::ln, Float::ln),
        Unary::Sqrt => return float_map(dtype, a, out, Float::sqrt, Float::sqrt),
        Unary::Tanh => return float_map(dtype, a, out, Float::tanh, Float::tanh),
        Unary::Sigmoid => return float_map(dtype, a, out, Float::sigmoid, Float::sigmoid),
        Unary::Neg | Unary::Abs | Unary::Square | Unary::Relu => {}
    }
    dispatch!(dtype, T => {
        let (a, out) = (a.as_slice::<T>(), out.as_mut_slice::<T>());
        match op {
            Unary::Neg => elementwise::map(a, out, |x| x.neg()),
            Unary::Abs => elementwise::map(a, out, |x| x.abs()),
            Unary::Square => elementwise::map(a, out, |x| x.mul(x)),
            _ => elementwise::map(a, out, |x| x.max_nan(T::ZERO)),
        }
    });
}

pub(crate) fn pow_scalar(dtype: DType, a: &HostBuffer, exponent: f64, out: &mut HostBuffer) {
    dispatch!(dtype, T => {
        elementwise::map(a.as_slice::<T>(), out.as_mut_slice::<T>(), move |x| x.pow_f64(exponent));
    });
}

// ---- in place ----

pub(crate) fn binary_inplace(
    op: Binary,
    dtype: DType,
    (x, x_dims): (&mut HostBuffer, &[usize]),
    src: Option<(&HostBuffer, &[usize])>,
    on_zero: &dyn Fn() -> Error,
) -> Result<()> {
    dispatch!(dtype, T => {
        if let Some((b, b_dims)) = src {
            let b = b.as_slice::<T>();
            if zero_divisor(op, b) {
                return Err(on_zero());
            }
            with_binary!(op, T, f => broadcast_zip_inplace(x.as_mut_slice::<T>(), x_dims, b, b_dims, f));
        } else {
            let x = x.as_mut_slice::<T>();
            if zero_divisor(op, x) {
                return Err(on_zero());
            }
            with_binary!(op, T, f => elementwise::map_inplace(x, |v| f(v, v)));
        }
    });
    Ok(())
}

pub(crate) fn scale_inplace(dtype: DType, x: &mut HostBuffer, value: f64) {
    dispatch!(dtype, T => {
        let y = T::from_f64(value);
        elementwise::map_inplace(x.as_mut_slice::<T>(), move |v| v.mul(y));
    });
}

pub(crate) fn axpy(
    dtype: DType,
    (x, x_dims): (&mut HostBuffer, &[usize]),
    alpha: f64,
    src: Option<(&HostBuffer, &[usize])>,
) {
    dispatch!(dtype, T => {
        let a = T::from_f64(alpha);
        let target = x.as_mut_slice::<T>();
        match src {
            Some((b, b_dims)) => broadcast_zip_inplace(target, x_dims, b.as_slice::<T>(), b_dims, move |v, y| v.add(a.mul(y))),
            None => elementwise::map_inplace(target, move |v| v.add(a.mul(v))),
        }
    });
}

pub(crate) fn assign(
    dtype: DType,
    (x, x_dims): (&mut HostBuffer, &[usize]),
    (src, src_dims): (&HostBuffer, &[usize]),
) {
    dispatch!(dtype, T => broadcast_zip_inplace(
        x.as_mut_slice::<T>(), x_dims, src.as_slice::<T>(), src_dims, |_, y| y
    ));
}

// ---- reductions ----

pub(crate) fn sum(
    from: DType,
    to: DType,
    (a, dims): (&HostBuffer, &[usize]),
    mask: &[bool],
    out: &mut HostBuffer,
    mean: bool,
) {
    let count: usize = dims
        .iter()
        .zip(mask)
        .filter(|(_, &r)| r)
        .map(|(&d, _)| d)
        .product();
    let count = count as f64;
    dispatch_float!(from, T => {
        let x = a.as_slice::<T>();
        let conv = |v: T| v.to_f64();
        let add = |p: f64, q: f64| p + q;
        if from == DType::F64 && !mean {
            reduce::fold_axes(x, dims, mask, out.as_mut_slice::<f64>(), 0.0, &conv, &add);
        } else {
            let out = out.as_mut_slice::<T>();
            let mut acc = vec![0.0f64; out.len()];
            reduce::fold_axes(x, dims, mask, &mut acc, 0.0, &conv, &add);
            for (o, s) in out.iter_mut().zip(acc) {
                *o = T::from_f64(if mean { s / count } else { s });
            }
        }
    }, _ => {
        debug_assert_eq!(to, if mean { DType::F64 } else { DType::I64 });
        dispatch!(from, T => {
            let x = a.as_slice::<T>();
            let conv = |v: T| v.to_i64();
            let add = |p: i64, q: i64| p.wrapping_add(q);
            if mean {
                let out = out.as_mut_slice::<f64>();
                let mut acc = vec![0i64; out.len()];
                reduce::fold_axes(x, dims, mask, &mut acc, 0, &conv, &add);
                for (o, s) in out.iter_mut().zip(acc) {
                    *o = s as f64 / count;
                }
            } else {
                reduce::fold_axes(x, dims, mask, out.as_mut_slice::<i64>(), 0, &conv, &add);
            }
        })
    });
}

pub(crate) fn sum_all(from: DType, to: DType, a: &HostBuffer, out: &mut HostBuffer, mean: bool) {
    let n = a.as_bytes().len() / from.size_in_bytes().max(1);
    dispatch_float!(from, T => {
        let sum = reduce::sum_float(a.as_slice::<T>());
        let value = if mean { sum / n as f64 } else { sum };
        out.as_mut_slice::<T>()[0] = T::from_f64(value);
    }, _ => {
        debug_assert_eq!(to, if mean { DType::F64 } else { DType::I64 });
        dispatch!(from, T => {
            let sum = reduce::sum_int(a.as_slice::<T>());
            if mean {
                out.as_mut_slice::<f64>()[0] = sum as f64 / n as f64;
            } else {
                out.as_mut_slice::<i64>()[0] = sum;
            }
        })
    });
}

pub(crate) fn max_axis(
    dtype: DType,
    a: &HostBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut HostBuffer,
) {
    dispatch!(dtype, T => reduce::fold_axis(
        a.as_slice::<T>(), outer, n, inner, out.as_mut_slice::<T>(),
        &|v: T| v, &|p: T, q: T| p.max_nan(q),
    ));
}

pub(crate) fn argmax_axis(
    dtype: DType,
    a: &HostBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut HostBuffer,
) {
    dispatch!(dtype, T => reduce::argmax_axis(
        a.as_slice::<T>(), outer, n, inner, out.as_mut_slice::<i64>(),
    ));
}

// ---- matrix products ----

pub(crate) fn matmul(
    dtype: DType,
    batch: Option<(Batched, usize)>,
    (m, k, n): (usize, usize, usize),
    a: &HostBuffer,
    b: &HostBuffer,
    out: &mut HostBuffer,
) {
    dispatch!(dtype, T => {
        let (a, b, out) = (a.as_slice::<T>(), b.as_slice::<T>(), out.as_mut_slice::<T>());
        match batch {
            None => matmul::matmul(m, k, n, a, b, out),
            Some((which, batch)) => matmul::matmul_batched(which, batch, m, k, n, a, b, out),
        }
    });
}

pub(crate) fn gemm(
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (a, ta): (&HostBuffer, bool),
    (b, tb): (&HostBuffer, bool),
    out: &mut HostBuffer,
    accumulate: Option<(f64, f64)>,
) {
    dispatch!(dtype, T => matmul::gemm_general(
        m, k, n, a.as_slice::<T>(), ta, b.as_slice::<T>(), tb, out.as_mut_slice::<T>(),
        accumulate.map(|(beta, alpha)| (T::from_f64(beta), T::from_f64(alpha)))
    ));
}

pub(crate) const PACK_COLUMNS: usize = packed::NR;

pub(crate) fn pack_rhs((k, n): (usize, usize), b: &HostBuffer, out: &mut HostBuffer) {
    packed::pack(k, n, b.as_slice::<f32>(), out.as_mut_slice::<f32>());
}

pub(crate) fn packed_matmul(
    (m, k, n): (usize, usize, usize),
    a: &HostBuffer,
    b: &HostBuffer,
    bias: Option<&HostBuffer>,
    relu: bool,
    out: &mut HostBuffer,
) {
    packed::packed_matmul(
        m,
        k,
        n,
        a.as_slice::<f32>(),
        b.as_slice::<f32>(),
        bias.map(HostBuffer::as_slice::<f32>),
        relu,
        out.as_mut_slice::<f32>(),
    );
}

pub(crate) fn sgd_dense(
    dtype: DType,
    (m, k, n): (usize, usize, usize),
    (x, g): (&HostBuffer, &HostBuffer),
    (v, w): (&mut HostBuffer, &mut HostBuffer),
    lr: f64,
    momentum: f64,
) {
    dispatch_float!(dtype, T => sgd::sgd_dense(
        m, k, n, x.as_slice::<T>(), g.as_slice::<T>(), v.as_mut_slice::<T>(),
        w.as_mut_slice::<T>(), T::from_f64(lr), T::from_f64(momentum)
    ), _ => {});
}

// ---- neural-network ops ----

pub(crate) fn softmax(
    dtype: DType,
    a: &HostBuffer,
    (outer, n, inner): (usize, usize, usize),
    out: &mut HostBuffer,
    log: bool,
) {
    match dtype {
        DType::F32 => nn::softmax(
            a.as_slice::<f32>(),
            outer,
            n,
            inner,
            out.as_mut_slice(),
            log,
        ),
        _ => nn::softmax(
            a.as_slice::<f64>(),
            outer,
            n,
            inner,
            out.as_mut_slice(),
            log,
        ),
    }
}

pub(crate) fn first_bad_index(
    dtype: DType,
    indices: &HostBuffer,
    bound: usize,
) -> Option<(usize, i64)> {
    dispatch!(dtype, I => nn::first_out_of_range(indices.as_slice::<I>(), bound))
}

pub(crate) fn one_hot(
    (from, to): (DType, DType),
    indices: &HostBuffer,
    depth: usize,
    out: &mut HostBuffer,
) -> Option<(usize, i64)> {
    dispatch!(from, I => {
        let idx = indices.as_slice::<I>();
        if let Some(bad) = nn::first_out_of_range(idx, depth) {
            return Some(bad);
        }
        dispatch!(to, T => nn::one_hot(idx, depth, out.as_mut_slice::<T>()));
    });
    None
}

pub(crate) fn pick(
    (dtype, from): (DType, DType),
    x: &HostBuffer,
    (n, inner): (usize, usize),
    indices: &HostBuffer,
    out: &mut HostBuffer,
) -> Option<(usize, i64)> {
    dispatch!(from, I => {
        let idx = indices.as_slice::<I>();
        if let Some(bad) = nn::first_out_of_range(idx, n) {
            return Some(bad);
        }
        dispatch!(dtype, T => nn::pick(x.as_slice::<T>(), n, inner, idx, out.as_mut_slice::<T>()));
    });
    None
}

// ---- shape / gather ----

pub(crate) fn transpose(
    dtype: DType,
    src: &HostBuffer,
    (rows, cols): (usize, usize),
    dst: &mut HostBuffer,
) {
    dispatch!(dtype, T => shape::transpose(src.as_slice::<T>(), rows, cols, dst.as_mut_slice::<T>()));
}

pub(crate) fn permute(
    dtype: DType,
    (src, dims): (&HostBuffer, &[usize]),
    perm: &[usize],
    dst: &mut HostBuffer,
) {
    dispatch!(dtype, T => shape::permute(src.as_slice::<T>(), dims, perm, dst.as_mut_slice::<T>()));
}

pub(crate) fn narrow(
    elem: usize,
    src: &HostBuffer,
    (outer, n, inner): (usize, usize, usize),
    start: usize,
    dst: &mut HostBuffer,
) {
    shape::narrow(
        src.as_bytes(),
        outer,
        n,
        inner * elem,
        start,
        dst.as_bytes_mut(),
    );
}

pub(crate) fn interleave(
    srcs: &[&HostBuffer],
    row_bytes: &[usize],
    outer: usize,
    dst: &mut HostBuffer,
) {
    let srcs: Vec<&[u8]> = srcs.iter().map(|b| b.as_bytes()).collect();
    shape::interleave(&srcs, row_bytes, outer, dst.as_bytes_mut());
}
