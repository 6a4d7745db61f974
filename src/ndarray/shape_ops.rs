//! Shape operations: `reshape`, `transpose`, `permute`, `broadcast_to`, `narrow`, `squeeze`,
//! `unsqueeze`, and the free functions [`concat`] and [`stack`].
//!
//! Every result is a new array holding a copy (placed like any op result), so it behaves as a
//! value: writing to it in place never changes the input.

use crate::backend::contract::{ElementwiseOps, Lanes, ShapeOps, TransferOps};
use crate::backend::AnyDevice;
use crate::error::Ctx;
use crate::{NDArray, Result, Shape};

use super::autograd::{record, Backward};
use super::exec;
use super::ops::{axes_mask, broadcast_shapes, check_same, normalize_axis, normalize_axis_in};
use super::reduce_ops::split_at_axis;

impl NDArray {
    /// A copy with the same bytes under a new shape.
    fn copy_with_shape(&self, ctx: &Ctx, shape: Shape) -> Result<NDArray> {
        let out = exec::op1(ctx, self, shape, self.dtype(), |src, dst| {
            AnyDevice::copy(ctx, src, dst)
        })?;
        record(ctx, &[self], &out, || Backward::Reshape);
        Ok(out)
    }

    /// The same elements, row-major, in a new shape with the same number of elements
    /// (`ShapeMismatch` otherwise).
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let a = m.arange(0.0, 6.0, 1.0, ndscope::DType::I64)?.reshape([2, 3])?;
    /// assert_eq!(a.dims(), &[2, 3]);
    /// assert!(a.reshape([4]).is_err());
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn reshape(&self, shape: impl Into<Shape>) -> Result<NDArray> {
        let ctx = Ctx::new("reshape");
        let shape = shape.into();
        if shape.checked_size() != Some(self.size()) {
            return Err(ctx.shape(format!(
                "cannot reshape {} ({} elements) to {} ({} elements)",
                self.shape(),
                self.size(),
                shape,
                shape
                    .checked_size()
                    .map_or_else(|| "too many".to_string(), |n| n.to_string())
            )));
        }
        self.copy_with_shape(&ctx, shape)
    }

    /// The transpose of a 2-D array: `[m, n] → [n, m]` (`ShapeMismatch` for other ranks; use
    /// [`permute`](Self::permute)). A cache-blocked copy, parallel for large matrices.
    #[track_caller]
    pub fn transpose(&self) -> Result<NDArray> {
        let ctx = Ctx::new("transpose");
        let &[rows, cols] = self.dims() else {
            return Err(ctx.shape(format!(
                "transpose needs a 2-D array, got shape {} (use permute for other ranks)",
                self.shape()
            )));
        };
        let dtype = self.dtype();
        let out = exec::op1(&ctx, self, Shape::new(&[cols, rows]), dtype, |src, dst| {
            AnyDevice::transpose(&ctx, dtype, src, (rows, cols), dst)
        })?;
        record(&ctx, &[self], &out, || Backward::Transpose);
        Ok(out)
    }

    /// The axes reordered: axis `k` of the result is axis `axes[k]` of `self`. `axes` must name
    /// every axis exactly once (`InvalidArgument` otherwise).
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let a = m.zeros([2, 3, 4], DType::F32)?;
    /// assert_eq!(a.permute(&[2, 0, 1])?.dims(), &[4, 2, 3]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn permute(&self, axes: &[usize]) -> Result<NDArray> {
        let ctx = Ctx::new("permute");
        let ndim = self.ndim();
        let mut seen = vec![false; ndim];
        let valid = axes.len() == ndim
            && axes
                .iter()
                .all(|&a| a < ndim && !std::mem::replace(&mut seen[a], true));
        if !valid {
            return Err(ctx.invalid(format!(
                "permute of shape {} needs each of the axes 0..{ndim} exactly once, got {axes:?}",
                self.shape()
            )));
        }
        let dims = self.shape().clone();
        let out: Vec<usize> = axes.iter().map(|&a| dims.dims()[a]).collect();
        let perm = axes.to_vec();
        let dtype = self.dtype();
        let out = exec::op1(&ctx, self, Shape::new(&out), dtype, |src, dst| {
            AnyDevice::permute(&ctx, dtype, (src, dims.dims()), &perm, dst)
        })?;
        record(&ctx, &[self], &out, || Backward::Permute(Shape::new(axes)));
        Ok(out)
    }

    /// A copy broadcast to `shape` (NumPy rules: dimensions are matched from the right, and a
    /// dimension of 1 stretches). `ShapeMismatch` if `self` does not broadcast to exactly
    /// `shape`.
    #[track_caller]
    pub fn broadcast_to(&self, shape: impl Into<Shape>) -> Result<NDArray> {
        let ctx = Ctx::new("broadcast_to");
        let shape = shape.into();
        let fits = shape.ndim() >= self.ndim()
            && broadcast_shapes(&ctx, self.shape(), &shape).is_ok_and(|s| s == shape);
        if !fits {
            return Err(ctx.shape(format!(
                "shape {} does not broadcast to {shape}",
                self.shape()
            )));
        }
        let dtype = self.dtype();
        let (from, to) = (self.shape().clone(), shape.clone());
        let out = exec::op1(&ctx, self, shape, dtype, |src, dst| {
            AnyDevice::assign(&ctx, dtype, (dst, to.dims()), (src, from.dims()))
        })?;
        record(&ctx, &[self], &out, || Backward::BroadcastTo);
        Ok(out)
    }

    /// The `len` elements from `start` along `axis` (negative counts from the end), the other
    /// axes whole. `InvalidArgument` if `axis` is out of range or `start + len` exceeds the
    /// axis.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let a = m.arange(0.0, 6.0, 1.0, DType::I32)?.reshape([2, 3])?;
    /// assert_eq!(a.narrow(1, 1, 2)?.to_vec::<i32>()?, vec![1, 2, 4, 5]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn narrow(&self, axis: isize, start: usize, len: usize) -> Result<NDArray> {
        let ctx = Ctx::new("narrow");
        let index = normalize_axis(&ctx, axis, self.shape())?;
        let size = self.dims()[index];
        if start.checked_add(len).is_none_or(|end| end > size) {
            return Err(ctx.invalid(format!(
                "narrow of axis {axis} (size {size}) of shape {} to {len} elements from {start} \
                 runs past its end",
                self.shape()
            )));
        }
        let mut out = self.dims().to_vec();
        out[index] = len;
        let (outer, n, inner) = split_at_axis(self.dims(), index);
        let lanes = Lanes {
            outer,
            len: n,
            inner,
        };
        let elem = self.dtype().size_in_bytes();
        let out = exec::op1(&ctx, self, Shape::new(&out), self.dtype(), |src, dst| {
            AnyDevice::narrow(&ctx, elem, src, lanes, start, dst)
        })?;
        record(&ctx, &[self], &out, || Backward::Narrow {
            axis: index,
            start,
        });
        Ok(out)
    }

    /// The array without the size-1 axes in `axes` (negative count from the end); an empty list
    /// removes every size-1 axis. Naming an axis whose size is not 1, or one twice, gives
    /// `InvalidArgument`.
    #[track_caller]
    pub fn squeeze(&self, axes: &[isize]) -> Result<NDArray> {
        let ctx = Ctx::new("squeeze");
        let mask = if axes.is_empty() {
            self.dims().iter().map(|&d| d == 1).collect()
        } else {
            let mask = axes_mask(&ctx, axes, self.shape())?;
            if let Some(axis) = (0..self.ndim()).find(|&i| mask[i] && self.dims()[i] != 1) {
                return Err(ctx.invalid(format!(
                    "squeeze of axis {axis} of shape {}: its size is {}, not 1",
                    self.shape(),
                    self.dims()[axis]
                )));
            }
            mask
        };
        let out: Vec<usize> = self
            .dims()
            .iter()
            .zip(&mask)
            .filter(|(_, &m)| !m)
            .map(|(&d, _)| d)
            .collect();
        self.copy_with_shape(&ctx, Shape::new(&out))
    }

    /// The array with a new axis of size 1 at `axis`, which may be one past the last: valid are
    /// `-(ndim + 1)..=ndim`, negative counting from the end (`-1` appends).
    #[track_caller]
    pub fn unsqueeze(&self, axis: isize) -> Result<NDArray> {
        let ctx = Ctx::new("unsqueeze");
        let index = normalize_axis_in(&ctx, axis, self.shape(), self.ndim() + 1)?;
        let mut out = self.dims().to_vec();
        out.insert(index, 1);
        self.copy_with_shape(&ctx, Shape::new(&out))
    }
}

/// The checks `concat` and `stack` share: at least one array, one dtype and one device.
fn check_list(ctx: &Ctx, arrays: &[NDArray]) -> Result<()> {
    let Some(first) = arrays.first() else {
        return Err(ctx.invalid(format!("`{}` needs at least one array", ctx.op)));
    };
    for a in &arrays[1..] {
        check_same(ctx, first, a)?;
    }
    Ok(())
}

/// The array of shape `out` that takes, for each of `outer` rows, `row_bytes[i]` bytes from
/// each input `i` in turn (what `concat` and `stack` are), placed like an op result on the first.
fn interleave(
    ctx: &Ctx,
    arrays: &[NDArray],
    out: Shape,
    row_bytes: &[usize],
    outer: usize,
) -> Result<NDArray> {
    let dtype = arrays[0].dtype();
    let inputs: Vec<&NDArray> = arrays.iter().collect();
    exec::op(ctx, &inputs, out, dtype, |srcs, dst| {
        AnyDevice::interleave(ctx, srcs, row_bytes, outer, dst)
    })
}

/// Joins arrays along an existing `axis` (negative counts from the end). They must share dtype,
/// device, rank and every other dimension. The result is placed like an op result on the first
/// array. An empty list or an out-of-range axis gives `InvalidArgument`; other dimensions that
/// differ give `ShapeMismatch`.
///
/// ```
/// use ndscope::{concat, Manager};
/// let m = Manager::new_base();
/// let a = m.from_slice(&[1i32, 2, 3, 4], [2, 2])?;
/// let b = m.from_slice(&[5i32, 6], [2, 1])?;
/// let c = concat(&[a, b], 1)?;
/// assert_eq!(c.dims(), &[2, 3]);
/// assert_eq!(c.to_vec::<i32>()?, vec![1, 2, 5, 3, 4, 6]);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn concat(arrays: &[NDArray], axis: isize) -> Result<NDArray> {
    let ctx = Ctx::new("concat");
    check_list(&ctx, arrays)?;
    let first = &arrays[0];
    let index = normalize_axis(&ctx, axis, first.shape())?;
    let mut total = 0usize;
    for a in arrays {
        let same = a.ndim() == first.ndim()
            && (0..a.ndim()).all(|i| i == index || a.dims()[i] == first.dims()[i]);
        if !same {
            return Err(ctx.shape(format!(
                "concat along axis {axis} needs every other dimension equal: {} and {} differ",
                first.shape(),
                a.shape()
            )));
        }
        total = total.checked_add(a.dims()[index]).ok_or_else(|| {
            ctx.invalid(format!(
                "concat along axis {axis}: the joined size overflows"
            ))
        })?;
    }
    let mut out = first.dims().to_vec();
    out[index] = total;
    let outer: usize = first.dims()[..index].iter().product();
    let inner: usize = first.dims()[index + 1..].iter().product();
    let bytes = first.dtype().size_in_bytes();
    let row_bytes: Vec<usize> = arrays
        .iter()
        .map(|a| a.dims()[index] * inner * bytes)
        .collect();
    let joined = interleave(&ctx, arrays, Shape::new(&out), &row_bytes, outer)?;
    if super::autograd::recording() {
        let inputs: Vec<&NDArray> = arrays.iter().collect();
        record(&ctx, &inputs, &joined, || Backward::Concat { axis: index });
    }
    Ok(joined)
}

/// Joins arrays of one shape along a new `axis`, which may be one past the last (valid are
/// `-(ndim + 1)..=ndim`). They must share dtype, device and shape (`ShapeMismatch` otherwise).
/// An empty list or an out-of-range axis gives `InvalidArgument`.
///
/// ```
/// use ndscope::{stack, Manager};
/// let m = Manager::new_base();
/// let a = m.from_slice(&[1.0f64, 2.0], [2])?;
/// let b = m.from_slice(&[3.0f64, 4.0], [2])?;
/// assert_eq!(stack(&[a.clone(), b.clone()], 0)?.to_vec::<f64>()?, vec![1.0, 2.0, 3.0, 4.0]);
/// assert_eq!(stack(&[a, b], 1)?.to_vec::<f64>()?, vec![1.0, 3.0, 2.0, 4.0]);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn stack(arrays: &[NDArray], axis: isize) -> Result<NDArray> {
    let ctx = Ctx::new("stack");
    check_list(&ctx, arrays)?;
    let first = &arrays[0];
    let index = normalize_axis_in(&ctx, axis, first.shape(), first.ndim() + 1)?;
    if let Some(a) = arrays.iter().find(|a| a.shape() != first.shape()) {
        return Err(ctx.shape(format!(
            "stack needs arrays of one shape: {} and {} differ",
            first.shape(),
            a.shape()
        )));
    }
    let mut out = first.dims().to_vec();
    out.insert(index, arrays.len());
    let outer: usize = first.dims()[..index].iter().product();
    let inner: usize = first.dims()[index..].iter().product();
    let row_bytes = vec![inner * first.dtype().size_in_bytes(); arrays.len()];
    let joined = interleave(&ctx, arrays, Shape::new(&out), &row_bytes, outer)?;
    if super::autograd::recording() {
        let inputs: Vec<&NDArray> = arrays.iter().collect();
        record(&ctx, &inputs, &joined, || Backward::Stack { axis: index });
    }
    Ok(joined)
}
