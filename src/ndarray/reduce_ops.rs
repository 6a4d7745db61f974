//! Reductions: `sum`, `mean` (over any set of axes), `max`, `argmax` (over one axis), and the
//! whole-array `sum_all`, `mean_all`.
//!
//! Dtypes follow PyTorch: float sums and means keep the dtype (accumulating in f64); integer
//! sums are `I64` (wrapping), integer means `F64`; `max` keeps the dtype (NaN wins); `argmax`
//! is `I64`.

use crate::backend::contract::{Lanes, ReduceOps, SumOf};
use crate::backend::AnyDevice;
use crate::error::Ctx;
use crate::{DType, NDArray, Result, Shape};

use super::autograd::{record, Backward};
use super::exec;
use super::ops::{axes_mask, normalize_axis};

/// The shape left after reducing the axes in `mask`: dropped, or kept as 1 with `keep_dims`.
fn reduced_shape(dims: &[usize], mask: &[bool], keep_dims: bool) -> Shape {
    let out: Vec<usize> = dims
        .iter()
        .zip(mask)
        .filter_map(|(&d, &r)| match (r, keep_dims) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    Shape::new(&out)
}

/// `dims` seen as `[outer, dims[axis], inner]`.
pub(crate) fn split_at_axis(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    let outer = dims[..axis].iter().product();
    let inner = dims[axis + 1..].iter().product();
    (outer, dims[axis], inner)
}

impl NDArray {
    /// The sum over `axes` (negative axes count from the end; an empty list means every axis,
    /// as in PyTorch). With `keep_dims` the reduced axes stay as size 1. Floats keep their
    /// dtype (accumulated in f64); integers give `I64` (wrapping). A repeated or out-of-range
    /// axis gives `InvalidArgument`. Summing over an empty axis gives 0.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let a = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])?;
    /// assert_eq!(a.sum(&[-1], false)?.to_vec::<f32>()?, vec![6.0, 15.0]);
    /// let cols = a.sum(&[0], true)?;
    /// assert_eq!(cols.dims(), &[1, 3]);
    /// assert_eq!(cols.to_vec::<f32>()?, vec![5.0, 7.0, 9.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn sum(&self, axes: &[isize], keep_dims: bool) -> Result<NDArray> {
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.sum(axes, keep_dims);
        }
        self.sum_or_mean(Ctx::new("sum"), axes, keep_dims, false)
    }

    /// The mean over `axes` (as [`sum`](Self::sum)). Floats keep their dtype; integers give
    /// `F64`. The mean over an empty axis is NaN.
    #[track_caller]
    pub fn mean(&self, axes: &[isize], keep_dims: bool) -> Result<NDArray> {
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.mean(axes, keep_dims);
        }
        self.sum_or_mean(Ctx::new("mean"), axes, keep_dims, true)
    }

    fn sum_or_mean(
        &self,
        ctx: Ctx,
        axes: &[isize],
        keep_dims: bool,
        mean: bool,
    ) -> Result<NDArray> {
        let mask = axes_mask(&ctx, axes, self.shape())?;
        let shape = reduced_shape(self.dims(), &mask, keep_dims);
        let from = self.dtype();
        let to = match (from.is_float(), mean) {
            (true, _) => from,
            (false, false) => DType::I64,
            (false, true) => DType::F64,
        };
        let dims = self.shape().clone();
        let out = exec::op1(&ctx, self, shape, to, |a, out| {
            AnyDevice::sum(&ctx, SumOf { from, to, mean }, (a, dims.dims()), &mask, out)
        })?;
        record(&ctx, &[self], &out, || {
            let keep = reduced_shape(self.dims(), &mask, true);
            let count = self.size() / keep.size().max(1);
            Backward::Sum {
                keep,
                scale: if mean { 1.0 / count.max(1) as f64 } else { 1.0 },
            }
        });
        Ok(out)
    }

    /// The checks `max` and `argmax` share: `axis` in range and not empty.
    fn check_max_axis(&self, ctx: &Ctx, axis: isize) -> Result<usize> {
        let index = normalize_axis(ctx, axis, self.shape())?;
        if self.dims()[index] == 0 {
            return Err(ctx.invalid(format!(
                "`{}` over axis {axis} of shape {}: the axis is empty, so it has no maximum",
                ctx.op,
                self.shape()
            )));
        }
        Ok(index)
    }

    /// The maximum along `axis` (negative counts from the end), keeping the dtype; NaN wins (as
    /// PyTorch). With `keep_dims` the axis stays as size 1. An empty or out-of-range axis gives
    /// `InvalidArgument`.
    #[track_caller]
    pub fn max(&self, axis: isize, keep_dims: bool) -> Result<NDArray> {
        let ctx = Ctx::new("max");
        let index = self.check_max_axis(&ctx, axis)?;
        let mut mask = vec![false; self.ndim()];
        mask[index] = true;
        let shape = reduced_shape(self.dims(), &mask, keep_dims);
        let (outer, len, inner) = split_at_axis(self.dims(), index);
        let lanes = Lanes { outer, len, inner };
        let dtype = self.dtype();
        let out = exec::op1(&ctx, self, shape, dtype, |a, out| {
            AnyDevice::max_axis(&ctx, dtype, a, lanes, out)
        })?;
        record(&ctx, &[self], &out, || Backward::Max { axis: index });
        Ok(out)
    }

    /// The index of the maximum along `axis` (negative counts from the end), as `I64`, with the
    /// axis removed. Ties give the first index; for floats the first NaN counts as the maximum
    /// (as PyTorch). An empty or out-of-range axis gives `InvalidArgument`.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let logits = m.from_slice(&[0.1f32, 0.7, 0.2, 0.9, 0.05, 0.05], [2, 3])?;
    /// assert_eq!(logits.argmax(-1)?.to_vec::<i64>()?, vec![1, 0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn argmax(&self, axis: isize) -> Result<NDArray> {
        let ctx = Ctx::new("argmax");
        let index = self.check_max_axis(&ctx, axis)?;
        let mut mask = vec![false; self.ndim()];
        mask[index] = true;
        let shape = reduced_shape(self.dims(), &mask, false);
        let (outer, len, inner) = split_at_axis(self.dims(), index);
        let lanes = Lanes { outer, len, inner };
        let dtype = self.dtype();
        exec::op1(&ctx, self, shape, DType::I64, |a, out| {
            AnyDevice::argmax_axis(&ctx, dtype, a, lanes, out)
        })
    }

    /// The sum of all elements as a 0-dimensional array: same dtype for floats, `I64` for
    /// integers (wrapping), as PyTorch.
    #[track_caller]
    pub fn sum_all(&self) -> Result<NDArray> {
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.sum_all();
        }
        self.reduce_all(Ctx::new("sum_all"), false)
    }

    /// The mean of all elements as a 0-dimensional array: same dtype for floats, `F64` for
    /// integers. NaN for an empty array.
    #[track_caller]
    pub fn mean_all(&self) -> Result<NDArray> {
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.mean_all();
        }
        self.reduce_all(Ctx::new("mean_all"), true)
    }

    fn reduce_all(&self, ctx: Ctx, mean: bool) -> Result<NDArray> {
        let from = self.dtype();
        let to = match (from.is_float(), mean) {
            (true, _) => from,
            (false, false) => DType::I64,
            (false, true) => DType::F64,
        };
        let out = exec::op1(&ctx, self, Shape::scalar(), to, |a, out| {
            AnyDevice::sum_all(&ctx, SumOf { from, to, mean }, a, out)
        })?;
        record(&ctx, &[self], &out, || Backward::Sum {
            keep: Shape::new(&vec![1; self.ndim()]),
            scale: if mean {
                1.0 / self.size().max(1) as f64
            } else {
                1.0
            },
        });
        Ok(out)
    }
}
