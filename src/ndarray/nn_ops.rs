//! Matrix products and the neural-network ops: `matmul` (2-D and batched 3-D), `matmul_t` and
//! `addmm_` (transposed operands without copies), `softmax`, `log_softmax`, `one_hot`, `pick`,
//! `softmax_cross_entropy`.

use crate::backend::contract::{Accumulate, Gemm, Lanes, MatmulOps, Mnk, NnOps, SgdStep, ShapeOps};
use crate::backend::{self, AnyDevice, Batched};
use crate::error::Ctx;
use crate::{DType, NDArray, Result, Shape};

use super::autograd::{record, tracked, Backward};
use super::exec;
use super::ops::{check_device, check_same, normalize_axis};
use super::reduce_ops::split_at_axis;
pub use super::transpose::Transpose;

/// `(m, k, n)` of `op(a) · op(b)` for 2-D operands, or `ShapeMismatch`.
fn product_dims(
    ctx: &Ctx,
    a: &NDArray,
    b: &NDArray,
    t: Transpose,
) -> Result<(usize, usize, usize)> {
    let (ta, tb) = t.flags();
    let (&[ar, ac], &[br, bc]) = (a.dims(), b.dims()) else {
        return Err(ctx.shape(format!(
            "`{}` needs 2-D operands, got {} and {}",
            ctx.op,
            a.shape(),
            b.shape()
        )));
    };
    let (m, k) = if ta { (ac, ar) } else { (ar, ac) };
    let (k2, n) = if tb { (bc, br) } else { (br, bc) };
    if k != k2 {
        return Err(ctx.shape(format!(
            "`{}` of {} and {} with {t:?}: inner dimensions {k} and {k2} differ",
            ctx.op,
            a.shape(),
            b.shape()
        )));
    }
    Ok((m, k, n))
}

/// `true` for the dtypes that can hold indices.
fn is_index_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::I32 | DType::I64 | DType::U8)
}

impl NDArray {
    /// The matrix product. Shapes:
    /// - `[m, k] · [k, n] → [m, n]`;
    /// - `[b, m, k] · [b, k, n] → [b, m, n]` (one product per batch entry);
    /// - `[b, m, k] · [k, n] → [b, m, n]` (the right operand shared by the batch);
    /// - `[m, k] · [b, k, n] → [b, m, n]` (the left operand shared).
    ///
    /// Both operands must have one dtype and device. Floats use `gemm`; integers wrap. Other
    /// ranks, inner dimensions that differ or batch sizes that differ give `ShapeMismatch`.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let x = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], [2, 2, 2])?;
    /// let w = m.from_slice(&[1.0f32, 0.0, 0.0, 2.0], [2, 2])?;
    /// let y = x.matmul(&w)?;
    /// assert_eq!(y.dims(), &[2, 2, 2]);
    /// assert_eq!(y.to_vec::<f32>()?, vec![1.0, 4.0, 3.0, 8.0, 5.0, 12.0, 7.0, 16.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn matmul(&self, other: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("matmul");
        if let Some((a, b)) = lowered_pair(self, other)? {
            return a.matmul(&b);
        }
        let out = self.matmul_unrecorded(ctx, other)?;
        record(&ctx, &[self, other], &out, || Backward::Matmul);
        Ok(out)
    }

    fn matmul_unrecorded(&self, ctx: Ctx, other: &NDArray) -> Result<NDArray> {
        check_same(&ctx, self, other)?;
        let (batch, which, m, k, k2, n) = match (self.dims(), other.dims()) {
            (&[m, k], &[k2, n]) => (None, Batched::Left, m, k, k2, n),
            (&[b, m, k], &[b2, k2, n]) => {
                if b != b2 {
                    return Err(ctx.shape(format!(
                        "matmul of {} and {}: batch sizes {b} and {b2} differ",
                        self.shape(),
                        other.shape()
                    )));
                }
                (Some(b), Batched::Both, m, k, k2, n)
            }
            (&[b, m, k], &[k2, n]) => (Some(b), Batched::Left, m, k, k2, n),
            (&[m, k], &[b, k2, n]) => (Some(b), Batched::Right, m, k, k2, n),
            _ => {
                return Err(ctx.shape(format!(
                    "matmul needs 2-D or 3-D (batched) operands, got {} and {}",
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
        let shape = match batch {
            None => Shape::new(&[m, n]),
            Some(b) => Shape::new(&[b, m, n]),
        };
        let dtype = self.dtype();
        let batch = batch.map(|b| (which, b));
        exec::op2(&ctx, self, other, shape, dtype, |a, b, out| {
            AnyDevice::matmul(&ctx, dtype, batch, Mnk { m, k, n }, a, b, out)
        })
    }

    /// The 2-D matrix product with either operand read transposed, without copying it:
    /// `matmul_t(&b, Transpose::Left)` is `aᵀ · b`, `Transpose::Right` is `a · bᵀ`. Shapes are
    /// checked after transposing (`ShapeMismatch`); dtype and device as for [`matmul`].
    ///
    /// [`matmul`]: NDArray::matmul
    ///
    /// ```
    /// use ndscope::{Manager, Transpose};
    /// let m = Manager::new_base();
    /// let x = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])?;
    /// let gram = x.matmul_t(&x, Transpose::Right)?;        // x · xᵀ, [2, 2]
    /// assert_eq!(gram.to_vec::<f32>()?, vec![14.0, 32.0, 32.0, 77.0]);
    /// assert_eq!(x.matmul_t(&x, Transpose::Left)?.dims(), &[3, 3]);   // xᵀ · x
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn matmul_t(&self, other: &NDArray, transpose: Transpose) -> Result<NDArray> {
        let ctx = Ctx::new("matmul_t");
        if let Some((a, b)) = lowered_pair(self, other)? {
            return a.matmul_t(&b, transpose);
        }
        let out = self.matmul_t_unrecorded(ctx, other, transpose)?;
        record(&ctx, &[self, other], &out, || {
            let (left, right) = transpose.flags();
            Backward::MatmulT { left, right }
        });
        Ok(out)
    }

    fn matmul_t_unrecorded(
        &self,
        ctx: Ctx,
        other: &NDArray,
        transpose: Transpose,
    ) -> Result<NDArray> {
        check_same(&ctx, self, other)?;
        let (m, k, n) = product_dims(&ctx, self, other, transpose)?;
        let (ta, tb) = transpose.flags();
        let dtype = self.dtype();
        if tb && dtype.is_float() && backend::prefers_materialized_transpose(self.device()) {
            return self.matmul_right_transposed(&ctx, other, ta, (m, k, n));
        }
        exec::op2(
            &ctx,
            self,
            other,
            Shape::new(&[m, n]),
            dtype,
            |a, b, out| {
                let spec = Gemm::plain(Mnk { m, k, n }, ta, tb);
                AnyDevice::gemm(&ctx, dtype, spec, a, b, out)
            },
        )
    }

    /// `op(self) · op(w)` in `self`'s half type with `w` f32, each of its values read rounded to
    /// that type as the product packs it ([`Gemm::rounded_b`]): the gradient of a layer that
    /// read its f32 weights rounded (on a device where [`backend::rounds_operands`]). Not
    /// recorded.
    pub(crate) fn matmul_t_rounded(&self, w: &NDArray, transpose: Transpose) -> Result<NDArray> {
        let ctx = Ctx::new("matmul_t");
        super::ops::check_device(&ctx, self, w)?;
        if !self.dtype().is_half() || w.dtype() != DType::F32 {
            return Err(ctx.dtype(
                w.dtype(),
                format!(
                    "a product reading f32 weights rounded takes a half operand and f32 weights, \
                     got {} and {}",
                    self.dtype(),
                    w.dtype()
                ),
            ));
        }
        let (m, k, n) = product_dims(&ctx, self, w, transpose)?;
        let (ta, tb) = transpose.flags();
        let dtype = self.dtype();
        exec::op2(&ctx, self, w, Shape::new(&[m, n]), dtype, |a, b, out| {
            let spec = Gemm {
                rounded_b: true,
                ..Gemm::plain(Mnk { m, k, n }, ta, tb)
            };
            AnyDevice::gemm(&ctx, dtype, spec, a, b, out)
        })
    }

    /// `op(a) · bᵀ` for floats. `gemm` is fast only when its destination is contiguous along
    /// the long side, and reading `bᵀ` through strides into a row-major `[m, n]` result is several
    /// times slower than a plain product (measured 13× for `[16, 1024] · [1024, 1024]ᵀ`). So:
    /// a short result (`m ≤ n / 8`) is computed as `cᵀ = b · op(a)ᵀ`, then transposed (small);
    /// a tall one transposes `b` once, then runs the plain product. Both temporaries are arrays
    /// placed like the result (workspace memory inside a cycle) and closed at once.
    fn matmul_right_transposed(
        &self,
        ctx: &Ctx,
        other: &NDArray,
        ta: bool,
        (m, k, n): (usize, usize, usize),
    ) -> Result<NDArray> {
        let dtype = self.dtype();
        if m.saturating_mul(8) <= n {
            let ct = exec::op2(ctx, self, other, Shape::new(&[n, m]), dtype, |a, b, out| {
                let spec = Gemm::plain(Mnk { m: n, k, n: m }, false, !ta);
                AnyDevice::gemm(ctx, dtype, spec, b, a, out)
            })?;
            let c = exec::op1(ctx, &ct, Shape::new(&[m, n]), dtype, |ct, out| {
                AnyDevice::transpose(ctx, dtype, ct, (n, m), out)
            });
            ct.close()?;
            return c;
        }
        // `other` is stored [n, k]; its transpose [k, n] is placed like the result (first input
        // `self`), not with `other`'s owner, which may be a capped model.
        let bt = exec::op(
            ctx,
            &[self, other],
            Shape::new(&[k, n]),
            dtype,
            |inputs, out| AnyDevice::transpose(ctx, dtype, inputs[1], (n, k), out),
        )?;
        let c = exec::op2(ctx, self, &bt, Shape::new(&[m, n]), dtype, |a, b, out| {
            let spec = Gemm::plain(Mnk { m, k, n }, ta, false);
            AnyDevice::gemm(ctx, dtype, spec, a, b, out)
        });
        bt.close()?;
        c
    }

    /// In place, `self = beta · self + alpha · op(a) · op(b)` (PyTorch's `addmm_`), in one pass
    /// of the matrix kernel: no temporary for the product. With `Transpose::Left` this
    /// accumulates a weight gradient `xᵀ · g` straight into a momentum buffer. `self` must be
    /// `[m, n]` for `op(a)` `[m, k]` and `op(b)` `[k, n]` (`ShapeMismatch`); all three share one
    /// dtype and device, except that an f32 `self` takes `a` and `b` in one half type (`F16` or
    /// `BF16`: the product accumulated and kept in f32, never rounded to the half type, as a
    /// mixed-precision step writes a weight gradient into its f32 parameter's gradient); for
    /// integer arrays `beta` and `alpha` must be whole numbers that fit.
    /// `a` or `b` may not be `self` (`InvalidArgument`). Allocates nothing; on error nothing
    /// changes.
    ///
    /// ```
    /// use ndscope::{Manager, Transpose};
    /// let m = Manager::new_base();
    /// let x = m.from_slice(&[1.0f32, 2.0], [1, 2])?;          // a batch of one sample
    /// let g = m.from_slice(&[3.0f32], [1, 1])?;               // its gradient
    /// let v = m.from_slice(&[10.0f32, 10.0], [2, 1])?;        // momentum buffer
    /// v.addmm_(&x, &g, Transpose::Left, 0.9, 1.0)?;           // v = 0.9·v + xᵀ·g
    /// assert_eq!(v.to_vec::<f32>()?, vec![12.0, 15.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn addmm_(
        &self,
        a: &NDArray,
        b: &NDArray,
        transpose: Transpose,
        beta: f64,
        alpha: f64,
    ) -> Result<()> {
        let ctx = Ctx::new("addmm_");
        // Halves multiplied into an f32 target: accumulated and kept in f32.
        let operands = (self.dtype() == DType::F32 && a.dtype().is_half()).then(|| a.dtype());
        if operands.is_some() {
            check_same(&ctx, a, b)?;
            check_device(&ctx, self, a)?;
        } else {
            check_same(&ctx, self, a)?;
            check_same(&ctx, self, b)?;
        }
        if *a == *self || *b == *self {
            return Err(ctx.invalid(format!(
                "the target {} of addmm_ cannot also be an operand of the product",
                self.0.describe()
            )));
        }
        let (m, k, n) = product_dims(&ctx, a, b, transpose)?;
        if self.dims() != [m, n] {
            return Err(ctx.shape(format!(
                "addmm_ target {} has shape {}, but the product of {} and {} with {transpose:?} is [{m}, {n}]",
                self.0.describe(),
                self.shape(),
                a.shape(),
                b.shape()
            )));
        }
        self.check_int_scalar(&ctx, "beta", beta)?;
        self.check_int_scalar(&ctx, "alpha", alpha)?;
        let (ta, tb) = transpose.flags();
        let dtype = self.dtype();
        exec::inplace_with2(&ctx, self, a, b, |out, a, b| {
            let spec = Gemm {
                dims: Mnk { m, k, n },
                trans_a: ta,
                trans_b: tb,
                accumulate: Some(Accumulate { alpha, beta }),
                operands,
                rounded_b: false,
            };
            AnyDevice::gemm(&ctx, dtype, spec, a, b, out)
        })
    }

    /// One step of SGD with momentum (the rule of PyTorch's `optim.SGD`) for the weights of a
    /// dense layer, taking the weight gradient as the product `xᵀ·g` of the layer's input `x`
    /// (`[batch, fan_in]`) and output gradient `g` (`[batch, fan_out]`), without materialising
    /// it:
    ///
    /// `velocity ← momentum · velocity + xᵀ·g;  self ← self − lr · velocity`
    ///
    /// `self` and `velocity` are `[fan_in, fan_out]` and change in place; with `momentum == 0`
    /// the old velocity is not read. It computes what `velocity.addmm_(x, g, Transpose::Left,
    /// momentum, 1.0)` followed by `self.axpy_(-lr, &velocity)` computes, but reads and writes
    /// each element of `self` and `velocity` once: at small batch a step is bound by that memory
    /// traffic, not by arithmetic. The fused kernel runs for f32 on CPUs with AVX-512 and
    /// batches up to 64; other cases run the two ops.
    ///
    /// All four arrays share one float dtype and device (`DTypeMismatch`, `DeviceMismatch`);
    /// shapes must match as above (`ShapeMismatch`); `self` and `velocity` are distinct and
    /// neither is `x` or `g`, and `lr` and `momentum` are finite (`InvalidArgument`). Allocates
    /// nothing; on error nothing changes.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let w = m.from_slice(&[1.0f32, 1.0], [2, 1])?;   // weights [fan_in 2, fan_out 1]
    /// let v = m.from_slice(&[10.0f32, 0.0], [2, 1])?;  // their velocity
    /// let x = m.from_slice(&[1.0f32, 2.0], [1, 2])?;   // a batch of one input
    /// let g = m.from_slice(&[3.0f32], [1, 1])?;        // its output gradient
    /// w.sgd_dense_update_(&v, &x, &g, 0.5, 0.9)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![12.0, 6.0]);  // 0.9·v + xᵀ·g
    /// assert_eq!(w.to_vec::<f32>()?, vec![-5.0, -2.0]); // w − 0.5·v
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn sgd_dense_update_(
        &self,
        velocity: &NDArray,
        x: &NDArray,
        g: &NDArray,
        lr: f64,
        momentum: f64,
    ) -> Result<()> {
        let ctx = Ctx::new("sgd_dense_update_");
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(self.dtype_error(&ctx, "a float dtype (f32, f64, f16, bf16)"));
        }
        for other in [velocity, x, g] {
            check_same(&ctx, self, other)?;
        }
        if *self == *velocity || [x, g].iter().any(|a| **a == *self || **a == *velocity) {
            return Err(ctx.invalid(format!(
                "the weights {} and velocity {} must be two distinct arrays, neither of them x {} or g {}",
                self.0.describe(),
                velocity.0.describe(),
                x.0.describe(),
                g.0.describe()
            )));
        }
        for (what, value) in [("lr", lr), ("momentum", momentum)] {
            if !value.is_finite() {
                return Err(ctx.invalid(format!("{what} must be finite, got {value}")));
            }
        }
        let (&[m, n], &[k, m2], &[k2, n2]) = (self.dims(), x.dims(), g.dims()) else {
            return Err(ctx.shape(format!(
                "sgd_dense_update_ needs 2-D weights, x and g, got {}, {} and {}",
                self.shape(),
                x.shape(),
                g.shape()
            )));
        };
        if velocity.dims() != self.dims() || m2 != m || n2 != n || k2 != k {
            return Err(ctx.shape(format!(
                "weights {} need velocity [{m}, {n}], x [batch, {m}] and g [batch, {n}] with one batch, got velocity {}, x {} and g {}",
                self.shape(),
                velocity.shape(),
                x.shape(),
                g.shape()
            )));
        }
        exec::inplace2_with2(&ctx, (self, velocity), (x, g), |w, v, x, g| {
            let step = SgdStep { lr, momentum };
            AnyDevice::sgd_dense(&ctx, dtype, Mnk { m, k, n }, (x, g), (v, w), step)
        })
    }

    fn softmax_impl(&self, ctx: Ctx, axis: isize, log: bool) -> Result<NDArray> {
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.softmax_impl(ctx, axis, log);
        }
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(self.dtype_error(&ctx, "a float dtype (f32, f64, f16, bf16)"));
        }
        let index = normalize_axis(&ctx, axis, self.shape())?;
        let (outer, len, inner) = split_at_axis(self.dims(), index);
        let lanes = Lanes { outer, len, inner };
        let out = exec::op1(&ctx, self, self.shape().clone(), dtype, |a, out| {
            AnyDevice::softmax(&ctx, dtype, a, lanes, out, log)
        })?;
        record(&ctx, &[self], &out, || {
            if log {
                Backward::LogSoftmax { axis: index }
            } else {
                Backward::Softmax { axis: index }
            }
        });
        Ok(out)
    }

    /// `exp(x) / sum(exp(x))` along `axis` (negative counts from the end), for floats.
    /// Numerically stable: the maximum along the axis is subtracted first, so large inputs do
    /// not overflow.
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let p = m.from_slice(&[1000.0f64, 1000.0], [1, 2])?.softmax(-1)?;
    /// assert_eq!(p.to_vec::<f64>()?, vec![0.5, 0.5]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn softmax(&self, axis: isize) -> Result<NDArray> {
        self.softmax_impl(Ctx::new("softmax"), axis, false)
    }

    /// `x - max - log(sum(exp(x - max)))` along `axis` (negative counts from the end), for
    /// floats: the logarithm of [`softmax`](Self::softmax), computed without overflow or
    /// `log(0)`.
    #[track_caller]
    pub fn log_softmax(&self, axis: isize) -> Result<NDArray> {
        self.softmax_impl(Ctx::new("log_softmax"), axis, true)
    }

    /// The one-hot encoding of an integer index array (`I32`, `I64` or `U8`): shape
    /// `[..., depth]` of `dtype`, 1 at each index and 0 elsewhere. An index that is negative or
    /// not below `depth` gives `InvalidArgument` (on the CPU checked before anything is written;
    /// on a CUDA device checked by the kernel without waiting for the device, and reported by
    /// the next wait on it, a read or `Device::synchronize`, naming `one_hot` and this call's
    /// site).
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let labels = m.from_slice(&[2i64, 0], [2])?;
    /// let y = labels.one_hot(3, DType::F32)?;
    /// assert_eq!(y.dims(), &[2, 3]);
    /// assert_eq!(y.to_vec::<f32>()?, vec![0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn one_hot(&self, depth: usize, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("one_hot");
        let from = self.dtype();
        if !is_index_dtype(from) {
            return Err(self.dtype_error(&ctx, "integer indices (i32, i64 or u8)"));
        }
        let mut out = self.dims().to_vec();
        out.push(depth);
        let shape = Shape::new(&out);
        crate::shape::check(&ctx, &shape, dtype)?;
        // Checked before allocating; on the host checked again under the lock the kernel holds,
        // in case another thread changed the indices in between.
        let bad = |found| index_error(&ctx, self, found, depth, "depth");
        check_indices(&ctx, self, depth, bad)?;
        exec::op1(
            &ctx,
            self,
            shape,
            dtype,
            |idx, out| match AnyDevice::one_hot(&ctx, (from, dtype), idx, depth, out)? {
                Some(found) => Err(bad(found)),
                None => Ok(()),
            },
        )
    }

    /// Gathers one element per position along `axis` (negative counts from the end):
    /// `indices` has `self`'s shape without `axis`, and so does the result, with
    /// `result[.., i, ..] = self[.., indices[.., i, ..], ..]` (the index taking `axis`'s place).
    /// For `x` of `[N, C]` and `indices` of `[N]` with axis 1 this is `x[i, indices[i]]`, the
    /// probability of each row's label.
    ///
    /// `indices` must be `I32`, `I64` or `U8` (`DTypeMismatch`) and on `self`'s device; a wrong
    /// shape gives `ShapeMismatch`, an index that is negative or not below the size of `axis`
    /// gives `InvalidArgument` (on a CUDA device from the next wait on the device, a read or
    /// `Device::synchronize`, naming `pick` and this call's site: the kernel checks the indices
    /// without waiting).
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let probs = m.from_slice(&[0.1f32, 0.9, 0.8, 0.2, 0.5, 0.5], [3, 2])?;
    /// let labels = m.from_slice(&[1i64, 0, 1], [3])?;
    /// assert_eq!(probs.pick(&labels, 1)?.to_vec::<f32>()?, vec![0.9, 0.8, 0.5]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn pick(&self, indices: &NDArray, axis: isize) -> Result<NDArray> {
        let ctx = Ctx::new("pick");
        check_device(&ctx, self, indices)?;
        let from = indices.dtype();
        if !is_index_dtype(from) {
            return Err(indices.dtype_error(&ctx, "integer indices (i32, i64 or u8)"));
        }
        let index = normalize_axis(&ctx, axis, self.shape())?;
        let mut expected = self.dims().to_vec();
        expected.remove(index);
        if indices.dims() != expected.as_slice() {
            return Err(ctx.shape(format!(
                "pick along axis {axis} of shape {} needs indices of shape {}, got {}",
                self.shape(),
                Shape::new(&expected),
                indices.shape()
            )));
        }
        let (_, n, inner) = split_at_axis(self.dims(), index);
        let bad = |found| index_error(&ctx, indices, found, n, "the size of the axis");
        check_indices(&ctx, indices, n, bad)?;
        let dtype = self.dtype();
        let out = exec::op2(
            &ctx,
            self,
            indices,
            indices.shape().clone(),
            dtype,
            |x, idx, out| match AnyDevice::pick(&ctx, (dtype, from), x, (n, inner), idx, out)? {
                Some(found) => Err(bad(found)),
                None => Ok(()),
            },
        )?;
        record(&ctx, &[self, indices], &out, || Backward::Pick {
            axis: index,
        });
        Ok(out)
    }

    /// The softmax cross-entropy of logits `self` (`[rows, classes]`, a float dtype) against
    /// integer `labels` (`[rows]`: `I32`, `I64` or `U8`, each the class of its row): the mean
    /// over rows of `-log_softmax(self, 1)[r, labels[r]]`, a 0-d array of `self`'s dtype: what
    /// `self.log_softmax(1)?.pick(labels, 1)?.mean_all()?.neg()` computes, in one pass (on a
    /// CUDA device one kernel launch). Numerically stable: each row's maximum is subtracted
    /// first, and sums, logarithms and the mean are taken in f64 (so logits as large as ±1e30
    /// give finite, accurate values). Zero rows give NaN, as the mean of nothing does.
    ///
    /// While a [`GradientCollector`](crate::GradientCollector) records it, the pass also
    /// computes the gradient `(softmax(self) - one_hot(labels)) / rows` (an op result placed as
    /// the loss is) and the tape saves it: backward multiplies it by the output gradient, and
    /// `backward(&loss)` with the loss at the root hands it on as it is (no kernel at all).
    ///
    /// Errors, before anything is created: `DTypeMismatch` for integer logits or labels of
    /// another dtype; `ShapeMismatch` for logits that are not 2-D or labels that are not
    /// `[rows]`; `DeviceMismatch`. A label that is negative or not below `classes` gives
    /// `InvalidArgument` naming its position and value (on a CUDA device from the next wait on
    /// the device, a read or `Device::synchronize`, naming `softmax_cross_entropy` and this
    /// call's site: the kernel checks the labels without waiting).
    ///
    /// ```
    /// use ndscope::Manager;
    /// let m = Manager::new_base();
    /// let logits = m.from_slice(&[0.0f64, 0.0, 2.0, 0.0], [2, 2])?;
    /// let labels = m.from_slice(&[1i64, 0], [2])?;
    /// let loss = logits.softmax_cross_entropy(&labels)?;
    /// let expected = (2.0f64.ln() + (1.0 + (-2.0f64).exp()).ln()) / 2.0;
    /// assert!((loss.to_vec::<f64>()?[0] - expected).abs() < 1e-15);
    /// assert_eq!(loss.dims(), &[] as &[usize]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn softmax_cross_entropy(&self, labels: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("softmax_cross_entropy");
        if let Some(wide) = super::autocast::widened(self)? {
            return wide.softmax_cross_entropy(labels);
        }
        let dtype = self.dtype();
        if !dtype.is_float() {
            return Err(self.dtype_error(&ctx, "float logits (f32, f64, f16, bf16)"));
        }
        let from = labels.dtype();
        if !is_index_dtype(from) {
            return Err(labels.dtype_error(&ctx, "integer labels (i32, i64 or u8)"));
        }
        check_device(&ctx, self, labels)?;
        let &[rows, classes] = self.dims() else {
            return Err(ctx.shape(format!(
                "softmax_cross_entropy needs 2-D logits [rows, classes], got {} of shape {}",
                self.0.describe(),
                self.shape()
            )));
        };
        if labels.dims() != [rows] {
            return Err(ctx.shape(format!(
                "softmax_cross_entropy of logits of shape {} needs labels of shape [{rows}], got \
                 {} of shape {}",
                self.shape(),
                labels.0.describe(),
                labels.shape()
            )));
        }
        let bad = |found| index_error(&ctx, labels, found, classes, "the number of classes");
        check_indices(&ctx, labels, classes, bad)?;
        let saved = tracked(&[self]).then(|| (self.shape().clone(), dtype));
        let (loss, grad) = exec::op_pair(
            &ctx,
            &[self, labels],
            (Shape::scalar(), dtype),
            saved,
            |b, loss, grad| {
                let out = (loss, grad);
                match AnyDevice::softmax_cross_entropy(
                    &ctx,
                    (dtype, from),
                    b[0],
                    (rows, classes),
                    b[1],
                    out,
                )? {
                    Some(found) => Err(bad(found)),
                    None => Ok(()),
                }
            },
        )?;
        if let Some(grad) = grad {
            record(&ctx, &[self, labels, &grad], &loss, || {
                Backward::SoftmaxCrossEntropy
            });
        }
        Ok(loss)
    }
}

/// Checks on the host that every index of `indices` (of the integer dtype it has) lies in
/// `0..bound`, the first one outside given to `bad`; a device answers at once and checks in
/// its kernels instead (see `NnOps::first_bad_index`).
fn check_indices(
    ctx: &Ctx,
    indices: &NDArray,
    bound: usize,
    bad: impl Fn((usize, i64)) -> crate::Error,
) -> Result<()> {
    let from = indices.dtype();
    exec::read_all(ctx, &[indices], |b| {
        match AnyDevice::first_bad_index(ctx, from, b[0], bound)? {
            Some(found) => Err(bad(found)),
            None => Ok(()),
        }
    })
}

/// `InvalidArgument` naming the first index of `array` found outside `0..bound`: the one at flat
/// `position`, whose value is `value`.
fn index_error(
    ctx: &Ctx,
    array: &NDArray,
    (position, value): (usize, i64),
    bound: usize,
    what: &str,
) -> crate::Error {
    ctx.invalid(format!(
        "index {value} at flat position {position} of {} (shape {}) is out of range: it must \
         be at least 0 and below {what}, {bound}",
        array.0.describe(),
        array.shape()
    ))
}

/// Both operands in the autocast dtype when a guard is open and either is a float of another
/// dtype.
fn lowered_pair(a: &NDArray, b: &NDArray) -> Result<Option<(NDArray, NDArray)>> {
    let (la, lb) = (super::autocast::lowered(a)?, super::autocast::lowered(b)?);
    if la.is_none() && lb.is_none() {
        return Ok(None);
    }
    Ok(Some((
        la.unwrap_or_else(|| a.clone()),
        lb.unwrap_or_else(|| b.clone()),
    )))
}
