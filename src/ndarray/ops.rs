//! Operation front-ends: validation (from handle metadata, before anything is allocated),
//! placement, and a call of the backend's entry point for the op family. This file holds the elementwise ops, comparisons
//! and in-place ops, and the helpers every front-end shares (broadcasting, dtype/device and
//! axis checks); reductions are in `reduce_ops.rs`, shape ops in `shape_ops.rs`, matrix
//! products and the NN ops in `nn_ops.rs`.
//!
//! Rules every op keeps: inputs of a binary op share one dtype (no implicit promotion) and one
//! device; shapes broadcast as in NumPy; a refused op allocates and changes nothing; results are
//! placed by `exec::Target::ResultOf` (active scope, else the first input's owner).

use crate::backend::contract::ElementwiseOps;
use crate::backend::op_table::{binary_ops, compare_ops, unary_ops};
use crate::backend::{AnyDevice, Binary, Compare, Unary};
use crate::dtype::dispatch;
use crate::error::Ctx;
use crate::{DType, Element, Error, NDArray, Result, Shape};

use super::autograd::{record, Backward};
use super::exec;

/// The NumPy broadcast of two shapes, or `ShapeMismatch` naming both.
pub(crate) fn broadcast_shapes(ctx: &Ctx, a: &Shape, b: &Shape) -> Result<Shape> {
    let (a, b) = (a.dims(), b.dims());
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => {
                return Err(ctx.shape(format!(
                    "shapes {} and {} do not broadcast: dimension {i} of the result is {da} in one and {db} in the other",
                    Shape::new(a),
                    Shape::new(b)
                )))
            }
        };
    }
    Ok(Shape::new(&out))
}

/// Both arrays must have the same dtype and device.
pub(crate) fn check_same(ctx: &Ctx, a: &NDArray, b: &NDArray) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(ctx.dtype(
            b.dtype(),
            format!(
                "`{}` needs operands of one dtype: {} is {} but {} is {} (convert with to_dtype)",
                ctx.op,
                a.0.describe(),
                a.dtype(),
                b.0.describe(),
                b.dtype()
            ),
        ));
    }
    if a.device() != b.device() {
        return Err(ctx.device_mismatch(format!(
            "{} is on {} but {} is on {} (move one with to_device)",
            a.0.describe(),
            a.device(),
            b.0.describe(),
            b.device()
        )));
    }
    Ok(())
}

/// Both arrays must be on one device (ops whose operands may differ in dtype, like `pick`).
pub(crate) fn check_device(ctx: &Ctx, a: &NDArray, b: &NDArray) -> Result<()> {
    if a.device() != b.device() {
        return Err(ctx.device_mismatch(format!(
            "{} is on {} but {} is on {} (move one with to_device)",
            a.0.describe(),
            a.device(),
            b.0.describe(),
            b.device()
        )));
    }
    Ok(())
}

/// `axis` as an index into the axes of `shape`; negative axes count from the end. Out of range
/// gives `InvalidArgument` naming the axis, the shape and the valid range.
pub(crate) fn normalize_axis(ctx: &Ctx, axis: isize, shape: &Shape) -> Result<usize> {
    normalize_axis_in(ctx, axis, shape, shape.ndim())
}

/// `axis` in `-count..count`, as an index in `0..count` (for `unsqueeze` and `stack`, whose
/// axis may also be one past the last).
pub(crate) fn normalize_axis_in(
    ctx: &Ctx,
    axis: isize,
    shape: &Shape,
    count: usize,
) -> Result<usize> {
    let n = count as isize;
    let index = if axis < 0 { axis + n } else { axis };
    if (0..n).contains(&index) {
        Ok(index as usize)
    } else if count == 0 {
        Err(ctx.invalid(format!(
            "`{}` got axis {axis}, but an array of shape {shape} has no axes",
            ctx.op
        )))
    } else {
        Err(ctx.invalid(format!(
            "`{}` got axis {axis}, out of range for shape {shape} (valid: {} to {})",
            ctx.op,
            -n,
            n - 1
        )))
    }
}

/// Which axes of `shape` the list `axes` names (negative from the end; empty names every axis).
/// A repeated or out-of-range axis gives `InvalidArgument`.
pub(crate) fn axes_mask(ctx: &Ctx, axes: &[isize], shape: &Shape) -> Result<Vec<bool>> {
    if axes.is_empty() {
        return Ok(vec![true; shape.ndim()]);
    }
    let mut mask = vec![false; shape.ndim()];
    for &axis in axes {
        let index = normalize_axis(ctx, axis, shape)?;
        if mask[index] {
            return Err(ctx.invalid(format!(
                "`{}` got axis {index} more than once in {axes:?} (shape {shape})",
                ctx.op
            )));
        }
        mask[index] = true;
    }
    Ok(mask)
}

// The public methods of the elementwise families, one per row of `backend::op_table`, with the
// row's docs.

macro_rules! unary_front_ends {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $dtypes:ident)),* $(,)?) => {
        impl NDArray {
            $(
                $(#[doc = $doc])*
                #[track_caller]
                pub fn $name(&self) -> Result<NDArray> {
                    self.unary(Ctx::new(stringify!($name)), Unary::$variant)
                }
            )*
        }
    };
}
unary_ops!(unary_front_ends);

macro_rules! binary_front_ends {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident)),* $(,)?) => {
        impl NDArray {
            $(
                $(#[doc = $doc])*
                #[track_caller]
                pub fn $name(&self, other: &NDArray) -> Result<NDArray> {
                    self.binary(Ctx::new(stringify!($name)), other, Binary::$variant)
                }
            )*
        }
    };
}
binary_ops!(binary_front_ends);

macro_rules! compare_front_ends {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $cmp:tt)),* $(,)?) => {
        impl NDArray {
            $(
                $(#[doc = $doc])*
                #[track_caller]
                pub fn $name(&self, other: &NDArray) -> Result<NDArray> {
                    self.compare(Ctx::new(stringify!($name)), other, Compare::$variant)
                }
            )*
        }
    };
}
compare_ops!(compare_front_ends);

fn division_by_zero(ctx: &Ctx, b: &NDArray) -> Error {
    ctx.invalid(format!(
        "integer division by zero: divisor {} contains 0",
        b.0.describe()
    ))
}

impl NDArray {
    fn binary(&self, ctx: Ctx, other: &NDArray, op: Binary) -> Result<NDArray> {
        if let Some((a, b)) = super::autocast::promoted(self, other)? {
            return a.binary(ctx, &b, op);
        }
        check_same(&ctx, self, other)?;
        let shape = broadcast_shapes(&ctx, self.shape(), other.shape())?;
        let dtype = self.dtype();
        let (sa, sb, so) = (self.shape().clone(), other.shape().clone(), shape.clone());
        let out = exec::op2(&ctx, self, other, shape, dtype, |a, b, out| {
            AnyDevice::binary(
                &ctx,
                op,
                dtype,
                (a, sa.dims()),
                (b, sb.dims()),
                (out, so.dims()),
                &|| division_by_zero(&ctx, other),
            )
        })?;
        record(&ctx, &[self, other], &out, || Backward::Binary(op));
        Ok(out)
    }

    fn compare(&self, ctx: Ctx, other: &NDArray, op: Compare) -> Result<NDArray> {
        check_same(&ctx, self, other)?;
        let shape = broadcast_shapes(&ctx, self.shape(), other.shape())?;
        let dtype = self.dtype();
        let (sa, sb, so) = (self.shape().clone(), other.shape().clone(), shape.clone());
        exec::op2(&ctx, self, other, shape, DType::U8, |a, b, out| {
            AnyDevice::compare(
                &ctx,
                op,
                dtype,
                (a, sa.dims()),
                (b, sb.dims()),
                (out, so.dims()),
            )
        })
    }

    fn compare_scalar(&self, ctx: Ctx, value: f64, op: Compare) -> Result<NDArray> {
        let dtype = self.dtype();
        exec::op1(&ctx, self, self.shape().clone(), DType::U8, |a, out| {
            AnyDevice::compare_scalar(&ctx, op, dtype, a, value, out)
        })
    }

    /// `self > value` elementwise: a `U8` array of 0 and 1. Float arrays compare against the
    /// value converted to their dtype; integer arrays against the exact value.
    #[track_caller]
    pub fn gt_scalar(&self, value: f64) -> Result<NDArray> {
        self.compare_scalar(Ctx::new("gt_scalar"), value, Compare::Gt)
    }

    /// `self < value` elementwise: a `U8` array of 0 and 1 (see [`gt_scalar`](Self::gt_scalar)).
    #[track_caller]
    pub fn lt_scalar(&self, value: f64) -> Result<NDArray> {
        self.compare_scalar(Ctx::new("lt_scalar"), value, Compare::Lt)
    }

    /// `self == value` elementwise: a `U8` array of 0 and 1 (see [`gt_scalar`](Self::gt_scalar)).
    #[track_caller]
    pub fn eq_scalar(&self, value: f64) -> Result<NDArray> {
        self.compare_scalar(Ctx::new("eq_scalar"), value, Compare::Eq)
    }

    /// For an integer array, `value` must be a whole number that fits its dtype: integer arrays
    /// do not become floats (no type promotion), and truncating 0.5 to 0 silently would be a trap.
    pub(crate) fn check_int_scalar(&self, ctx: &Ctx, what: &str, value: f64) -> Result<()> {
        let dtype = self.dtype();
        if dtype.is_float() {
            return Ok(());
        }
        let fits = dispatch!(dtype, T => T::from_f64(value).to_f64() == value);
        if fits {
            return Ok(());
        }
        Err(ctx.invalid(format!(
            "{what} {value} is not a whole number that fits {dtype}, the dtype of {} (convert the array with to_dtype first)",
            self.0.describe()
        )))
    }

    fn scalar_op(&self, ctx: Ctx, value: f64, op: Binary) -> Result<NDArray> {
        let dtype = self.dtype();
        self.check_int_scalar(&ctx, "scalar", value)?;
        if op == Binary::Div && !dtype.is_float() && (value as i64 == 0) {
            return Err(ctx.invalid(format!(
                "integer division by zero: divisor {value} is 0 in {dtype}"
            )));
        }
        let out = exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            AnyDevice::binary_scalar(&ctx, op, dtype, a, value, out)
        })?;
        record(&ctx, &[self], &out, || match op {
            Binary::Mul => Backward::Scale(value),
            Binary::Div => Backward::Scale(1.0 / value),
            Binary::Add | Binary::Sub => Backward::Shift,
            _ => Backward::None,
        });
        Ok(out)
    }

    /// `self + value`. For integer arrays `value` must be a whole number that fits the dtype
    /// (`InvalidArgument` otherwise; there is no promotion to float).
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("add_scalar"), value, Binary::Add)
    }

    /// `self - value` (integer arrays: see [`add_scalar`](Self::add_scalar)).
    #[track_caller]
    pub fn sub_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("sub_scalar"), value, Binary::Sub)
    }

    /// `self * value` (integer arrays: see [`add_scalar`](Self::add_scalar)).
    #[track_caller]
    pub fn mul_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("mul_scalar"), value, Binary::Mul)
    }

    /// `self / value`. For integer arrays `value` must be a non-zero whole number that fits the
    /// dtype; division truncates toward zero.
    #[track_caller]
    pub fn div_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("div_scalar"), value, Binary::Div)
    }

    /// `self` raised to the power `exponent` elementwise (integers through f64, truncated).
    #[track_caller]
    pub fn pow_scalar(&self, exponent: f64) -> Result<NDArray> {
        let ctx = Ctx::new("pow_scalar");
        let dtype = self.dtype();
        let out = exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            AnyDevice::pow_scalar(&ctx, dtype, a, exponent, out)
        })?;
        record(&ctx, &[self], &out, || Backward::PowScalar(exponent));
        Ok(out)
    }

    fn unary(&self, ctx: Ctx, op: Unary) -> Result<NDArray> {
        let dtype = self.dtype();
        if op.float_only() && !dtype.is_float() {
            return Err(self.dtype_error(&ctx, "a float dtype (f32, f64, f16, bf16)"));
        }
        let out = exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            AnyDevice::unary(&ctx, op, dtype, a, out)
        })?;
        record(&ctx, &[self], &out, || Backward::Unary(op));
        Ok(out)
    }

    /// For an in-place op with source `other`: same dtype and device, and `other` broadcasts to
    /// `self`'s shape (the target's shape cannot change).
    fn check_inplace_source(&self, ctx: &Ctx, other: &NDArray) -> Result<()> {
        check_same(ctx, self, other)?;
        let shape = broadcast_shapes(ctx, self.shape(), other.shape())?;
        if shape != *self.shape() {
            return Err(ctx.shape(format!(
                "in-place `{}` cannot change the target's shape: {} with {} broadcasts to {}",
                ctx.op,
                self.shape(),
                other.shape(),
                shape
            )));
        }
        Ok(())
    }

    fn inplace_binary(&self, ctx: Ctx, other: &NDArray, op: Binary) -> Result<()> {
        self.check_inplace_source(&ctx, other)?;
        let dtype = self.dtype();
        let (sx, sb) = (self.shape().clone(), other.shape().clone());
        exec::inplace_with(&ctx, self, other, |x, b| {
            AnyDevice::binary_inplace(
                &ctx,
                op,
                dtype,
                (x, sx.dims()),
                b.map(|b| (b, sb.dims())),
                &|| division_by_zero(&ctx, other),
            )
        })
    }

    /// `self += other` in place (broadcasting `other` to `self`'s shape); allocates nothing.
    #[track_caller]
    pub fn add_(&self, other: &NDArray) -> Result<()> {
        self.inplace_binary(Ctx::new("add_"), other, Binary::Add)
    }

    /// `self -= other` in place.
    #[track_caller]
    pub fn sub_(&self, other: &NDArray) -> Result<()> {
        self.inplace_binary(Ctx::new("sub_"), other, Binary::Sub)
    }

    /// `self *= other` in place.
    #[track_caller]
    pub fn mul_(&self, other: &NDArray) -> Result<()> {
        self.inplace_binary(Ctx::new("mul_"), other, Binary::Mul)
    }

    /// `self *= value` in place (integer arrays: see [`add_scalar`](Self::add_scalar)).
    #[track_caller]
    pub fn mul_scalar_(&self, value: f64) -> Result<()> {
        let ctx = Ctx::new("mul_scalar_");
        let dtype = self.dtype();
        self.check_int_scalar(&ctx, "scalar", value)?;
        exec::inplace(&ctx, self, |x| {
            AnyDevice::scale_inplace(&ctx, dtype, x, value)
        })
    }

    /// `self += alpha · x` in place, with `x` broadcast to `self`'s shape (BLAS `axpy`, the SGD
    /// update). Allocates nothing; `x` may be `self`. For integer arrays `alpha` must be a whole
    /// number that fits the dtype (`InvalidArgument` otherwise, as PyTorch); the arithmetic
    /// wraps. On any error `self` is unchanged.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let w = m.from_slice(&[1.0f32, 2.0, 3.0], [3])?;
    /// let grad = m.from_slice(&[10.0f32, 20.0, 30.0], [3])?;
    /// w.axpy_(-0.1, &grad)?;
    /// assert_eq!(w.to_vec::<f32>()?, vec![0.0, 0.0, 0.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn axpy_(&self, alpha: f64, x: &NDArray) -> Result<()> {
        let ctx = Ctx::new("axpy_");
        self.check_inplace_source(&ctx, x)?;
        let dtype = self.dtype();
        self.check_int_scalar(&ctx, "alpha", alpha)?;
        let (sx, sb) = (self.shape().clone(), x.shape().clone());
        exec::inplace_with(&ctx, self, x, |target, source| {
            AnyDevice::axpy(
                &ctx,
                dtype,
                (target, sx.dims()),
                alpha,
                source.map(|b| (b, sb.dims())),
            )
        })
    }

    /// Copies `src` into `self` in place, with `src` broadcast to `self`'s shape. Allocates
    /// nothing. `src` must have `self`'s dtype (`DTypeMismatch`; convert with `to_dtype`) and
    /// device. On any error `self` is unchanged.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let a = m.zeros([2, 3], ndscope::DType::I32)?;
    /// a.assign_(&m.from_slice(&[1i32, 2, 3], [3])?)?;
    /// assert_eq!(a.to_vec::<i32>()?, vec![1, 2, 3, 1, 2, 3]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn assign_(&self, src: &NDArray) -> Result<()> {
        let ctx = Ctx::new("assign_");
        self.check_inplace_source(&ctx, src)?;
        let dtype = self.dtype();
        let (sx, sb) = (self.shape().clone(), src.shape().clone());
        exec::inplace_with(&ctx, self, src, |target, source| match source {
            Some(b) => AnyDevice::assign(&ctx, dtype, (target, sx.dims()), (b, sb.dims())),
            // Assigning an array to itself changes nothing.
            None => Ok(()),
        })
    }

    /// Sets every element to `value` (converted to the dtype as `Manager::full` does) in place.
    /// Allocates nothing.
    #[track_caller]
    pub fn fill_(&self, value: f64) -> Result<()> {
        let ctx = Ctx::new("fill_");
        let dtype = self.dtype();
        exec::inplace(&ctx, self, |x| AnyDevice::fill(&ctx, dtype, x, value))?;
        if value == 0.0 {
            // A gradient filled with zeros is known to hold them (see `autograd::pending`).
            super::autograd::pending::mark_zero(&self.0);
        }
        Ok(())
    }
}
