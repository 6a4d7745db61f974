//! Operation front-ends: validation (from handle metadata, before anything is allocated),
//! placement and dispatch to the CPU kernels.
//!
//! Rules every op keeps: inputs of a binary op share one dtype (no implicit promotion) and one
//! device; shapes broadcast as in NumPy; a refused op allocates and changes nothing; results are
//! placed by `exec::Target::ResultOf` (active scope, else the first input's owner).

use crate::backend::cpu::elementwise::{self, broadcast_zip, broadcast_zip_inplace};
use crate::backend::cpu::matmul::matmul;
use crate::backend::cpu::num::{Float, Num};
use crate::backend::cpu::reduce;
use crate::dtype::{dispatch, dispatch_float};
use crate::error::Ctx;
use crate::{DType, Element, Error, NDArray, Result, Shape};

use super::exec;

/// The binary elementwise operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Binary {
    Add,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
}

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

/// The unary elementwise operations defined for every dtype.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Unary {
    Neg,
    Abs,
    Square,
}

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

fn division_by_zero(ctx: &Ctx, b: &NDArray) -> Error {
    ctx.invalid(format!(
        "integer division by zero: divisor {} contains 0",
        b.0.describe()
    ))
}

impl NDArray {
    fn binary(&self, ctx: Ctx, other: &NDArray, op: Binary) -> Result<NDArray> {
        check_same(&ctx, self, other)?;
        let shape = broadcast_shapes(&ctx, self.shape(), other.shape())?;
        let dtype = self.dtype();
        let (sa, sb, so) = (self.shape().clone(), other.shape().clone(), shape.clone());
        exec::op2(&ctx, self, other, shape, dtype, |a, b, out| {
            dispatch!(dtype, T => {
                let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
                if op == Binary::Div && !dtype.is_float() && b.iter().any(|v| v.is_zero()) {
                    return Err(division_by_zero(&ctx, other));
                }
                let out = out.as_mut_slice::<T>();
                with_binary!(op, T, f => broadcast_zip(a, sa.dims(), b, sb.dims(), out, so.dims(), f));
            });
            Ok(())
        })
    }

    /// `self + other`, broadcasting.
    #[track_caller]
    pub fn add(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("add"), other, Binary::Add)
    }

    /// `self - other`, broadcasting.
    #[track_caller]
    pub fn sub(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("sub"), other, Binary::Sub)
    }

    /// `self * other` elementwise, broadcasting.
    #[track_caller]
    pub fn mul(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("mul"), other, Binary::Mul)
    }

    /// `self / other` elementwise, broadcasting. Integer division truncates toward zero; an
    /// integer divisor containing 0 gives `InvalidArgument`.
    #[track_caller]
    pub fn div(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("div"), other, Binary::Div)
    }

    /// The elementwise maximum, broadcasting; NaN wins.
    #[track_caller]
    pub fn maximum(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("maximum"), other, Binary::Maximum)
    }

    /// The elementwise minimum, broadcasting; NaN wins.
    #[track_caller]
    pub fn minimum(&self, other: &NDArray) -> Result<NDArray> {
        self.binary(Ctx::new("minimum"), other, Binary::Minimum)
    }

    fn scalar_op(&self, ctx: Ctx, value: f64, op: Binary) -> Result<NDArray> {
        let dtype = self.dtype();
        if op == Binary::Div && !dtype.is_float() && (value as i64 == 0) {
            return Err(ctx.invalid(format!(
                "integer division by zero: divisor {value} is 0 in {dtype}"
            )));
        }
        exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            dispatch!(dtype, T => {
                let y = T::from_f64(value);
                let (a, out) = (a.as_slice::<T>(), out.as_mut_slice::<T>());
                with_binary!(op, T, f => elementwise::map(a, out, |x| f(x, y)));
            });
            Ok(())
        })
    }

    /// `self + value` (the scalar converted to the array's dtype).
    #[track_caller]
    pub fn add_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("add_scalar"), value, Binary::Add)
    }

    /// `self - value`.
    #[track_caller]
    pub fn sub_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("sub_scalar"), value, Binary::Sub)
    }

    /// `self * value`.
    #[track_caller]
    pub fn mul_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("mul_scalar"), value, Binary::Mul)
    }

    /// `self / value`. For integer arrays a value that converts to 0 gives `InvalidArgument`.
    #[track_caller]
    pub fn div_scalar(&self, value: f64) -> Result<NDArray> {
        self.scalar_op(Ctx::new("div_scalar"), value, Binary::Div)
    }

    /// `self` raised to the power `exponent` elementwise (integers through f64, truncated).
    #[track_caller]
    pub fn pow_scalar(&self, exponent: f64) -> Result<NDArray> {
        let ctx = Ctx::new("pow_scalar");
        let dtype = self.dtype();
        exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            dispatch!(dtype, T => {
                elementwise::map(a.as_slice::<T>(), out.as_mut_slice::<T>(), |x| x.pow_f64(exponent));
            });
            Ok(())
        })
    }

    /// `max(self, 0)` elementwise.
    #[track_caller]
    pub fn relu(&self) -> Result<NDArray> {
        let ctx = Ctx::new("relu");
        let dtype = self.dtype();
        exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            dispatch!(dtype, T => {
                elementwise::map(a.as_slice::<T>(), out.as_mut_slice::<T>(), |x| x.max_nan(T::ZERO));
            });
            Ok(())
        })
    }

    fn unary(&self, ctx: Ctx, op: Unary) -> Result<NDArray> {
        let dtype = self.dtype();
        exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            dispatch!(dtype, T => {
                let (a, out) = (a.as_slice::<T>(), out.as_mut_slice::<T>());
                match op {
                    Unary::Neg => elementwise::map(a, out, |x| x.neg()),
                    Unary::Abs => elementwise::map(a, out, |x| x.abs()),
                    Unary::Square => elementwise::map(a, out, |x| x.mul(x)),
                }
            });
            Ok(())
        })
    }

    /// `-self` elementwise (integers wrap).
    #[track_caller]
    pub fn neg(&self) -> Result<NDArray> {
        self.unary(Ctx::new("neg"), Unary::Neg)
    }

    /// `|self|` elementwise (integers wrap at their minimum).
    #[track_caller]
    pub fn abs(&self) -> Result<NDArray> {
        self.unary(Ctx::new("abs"), Unary::Abs)
    }

    /// `self * self` elementwise.
    #[track_caller]
    pub fn square(&self) -> Result<NDArray> {
        self.unary(Ctx::new("square"), Unary::Square)
    }

    /// The square root elementwise (floats).
    #[track_caller]
    pub fn sqrt(&self) -> Result<NDArray> {
        self.float_unary(Ctx::new("sqrt"), Float::sqrt, Float::sqrt)
    }

    /// The hyperbolic tangent elementwise (floats).
    #[track_caller]
    pub fn tanh(&self) -> Result<NDArray> {
        self.float_unary(Ctx::new("tanh"), Float::tanh, Float::tanh)
    }

    /// `1 / (1 + e^-x)` elementwise (floats).
    #[track_caller]
    pub fn sigmoid(&self) -> Result<NDArray> {
        self.float_unary(Ctx::new("sigmoid"), Float::sigmoid, Float::sigmoid)
    }

    /// `e^x` elementwise (floats).
    #[track_caller]
    pub fn exp(&self) -> Result<NDArray> {
        self.float_unary(Ctx::new("exp"), Float::exp, Float::exp)
    }

    /// The natural logarithm elementwise (floats).
    #[track_caller]
    pub fn log(&self) -> Result<NDArray> {
        self.float_unary(Ctx::new("log"), Float::ln, Float::ln)
    }

    fn float_unary(
        &self,
        ctx: Ctx,
        f32_fn: impl Fn(f32) -> f32 + Sync,
        f64_fn: impl Fn(f64) -> f64 + Sync,
    ) -> Result<NDArray> {
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(self.dtype_error(&ctx, "f32 or f64"));
        }
        exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            match dtype {
                DType::F32 => elementwise::map(a.as_slice::<f32>(), out.as_mut_slice(), f32_fn),
                _ => elementwise::map(a.as_slice::<f64>(), out.as_mut_slice(), f64_fn),
            }
            Ok(())
        })
    }

    /// The sum of all elements as a 0-dimensional array: same dtype for floats, `I64` for
    /// integers (wrapping), as PyTorch.
    #[track_caller]
    pub fn sum_all(&self) -> Result<NDArray> {
        self.reduce_all(Ctx::new("sum_all"), false)
    }

    /// The mean of all elements as a 0-dimensional array: same dtype for floats, `F64` for
    /// integers. NaN for an empty array.
    #[track_caller]
    pub fn mean_all(&self) -> Result<NDArray> {
        self.reduce_all(Ctx::new("mean_all"), true)
    }

    fn reduce_all(&self, ctx: Ctx, mean: bool) -> Result<NDArray> {
        let from = self.dtype();
        let to = match (from.is_float(), mean) {
            (true, _) => from,
            (false, false) => DType::I64,
            (false, true) => DType::F64,
        };
        let n = self.size();
        exec::op1(&ctx, self, Shape::scalar(), to, |a, out| {
            dispatch_float!(from, T => {
                let sum = reduce::sum_float(a.as_slice::<T>());
                let value = if mean { sum / n as f64 } else { sum };
                out.as_mut_slice::<T>()[0] = T::from_f64(value);
            }, _ => {
                dispatch!(from, T => {
                    let sum = reduce::sum_int(a.as_slice::<T>());
                    if mean {
                        out.as_mut_slice::<f64>()[0] = sum as f64 / n as f64;
                    } else {
                        out.as_mut_slice::<i64>()[0] = sum;
                    }
                })
            });
            Ok(())
        })
    }

    /// The matrix product of 2-D arrays `[m, k] · [k, n] → [m, n]`.
    #[track_caller]
    pub fn matmul(&self, other: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("matmul");
        check_same(&ctx, self, other)?;
        let (a, b) = (self.dims(), other.dims());
        let (m, k, k2, n) = match (a, b) {
            (&[m, k], &[k2, n]) => (m, k, k2, n),
            _ => {
                return Err(ctx.shape(format!(
                    "matmul needs 2-D operands, got {} and {}",
                    self.shape(),
                    other.shape()
                )))
            }
        };
        if k != k2 {
            return Err(ctx.shape(format!(
                "matmul of {} and {}: inner dimensions {k} and {k2} differ",
                self.shape(),
                other.shape()
            )));
        }
        let dtype = self.dtype();
        exec::op2(
            &ctx,
            self,
            other,
            Shape::new(&[m, n]),
            dtype,
            |a, b, out| {
                dispatch!(dtype, T => matmul(m, k, n, a.as_slice::<T>(), b.as_slice::<T>(), out.as_mut_slice::<T>()));
                Ok(())
            },
        )
    }

    fn inplace_binary(&self, ctx: Ctx, other: &NDArray, op: Binary) -> Result<()> {
        check_same(&ctx, self, other)?;
        let shape = broadcast_shapes(&ctx, self.shape(), other.shape())?;
        if shape != *self.shape() {
            return Err(ctx.shape(format!(
                "in-place `{}` cannot change the target's shape: {} with {} broadcasts to {}",
                ctx.op,
                self.shape(),
                other.shape(),
                shape
            )));
        }
        let dtype = self.dtype();
        let (sx, sb) = (self.shape().clone(), other.shape().clone());
        exec::inplace_with(&ctx, self, other, |x, b| {
            dispatch!(dtype, T => {
                if let Some(b) = b {
                    let b = b.as_slice::<T>();
                    if op == Binary::Div && !dtype.is_float() && b.iter().any(|v| v.is_zero()) {
                        return Err(division_by_zero(&ctx, other));
                    }
                    with_binary!(op, T, f => broadcast_zip_inplace(x.as_mut_slice::<T>(), sx.dims(), b, sb.dims(), f));
                } else {
                    let x = x.as_mut_slice::<T>();
                    if op == Binary::Div && !dtype.is_float() && x.iter().any(|v| v.is_zero()) {
                        return Err(division_by_zero(&ctx, other));
                    }
                    with_binary!(op, T, f => elementwise::map_inplace(x, |v| f(v, v)));
                }
            });
            Ok(())
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

    /// `self *= value` in place.
    #[track_caller]
    pub fn mul_scalar_(&self, value: f64) -> Result<()> {
        let ctx = Ctx::new("mul_scalar_");
        let dtype = self.dtype();
        exec::inplace(&ctx, self, |x| {
            dispatch!(dtype, T => {
                let y = T::from_f64(value);
                elementwise::map_inplace(x.as_mut_slice::<T>(), |v| v.mul(y));
            });
            Ok(())
        })
    }
}
