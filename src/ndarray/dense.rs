//! [`Dense`]: a fully connected layer prepared for inference, its weights packed once.

use crate::backend::contract::{Linear, MatmulOps, Mnk};
use crate::backend::{self, AnyDevice};
use crate::error::Ctx;
use crate::{DType, Device, NDArray, Result, Shape};

use super::exec::{self, Target};
use super::ops::{check_device, check_same};

/// What a [`Dense`] layer applies to `x · w + b`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Activation {
    /// Nothing: the layer gives `x · w + b`.
    #[default]
    Identity,
    /// `max(0, x · w + b)`.
    Relu,
}

/// A fully connected layer for inference, `y = act(x · w + b)`, with its weights packed once
/// into the layout the CPU product kernel reads (as ONNX Runtime and oneDNN pre-pack the
/// constant weights of a model, or `torch.jit.freeze` does for PyTorch's CPU linear layers).
///
/// A product of `x` by a plain `[k, n]` array rearranges `w` on every call; for inference, where
/// the weights do not change between calls, the packed copy saves that work, and the bias and
/// activation are applied as the result is written, so [`forward`](Dense::forward) is one op
/// and makes one array. On the MLP 784→1024→1024→10 that made a batch-64 `ParallelInference`
/// 1.16× faster than `matmul`, `add` and `relu`, and a batch-1 `Predictor` call 2.9× faster (see
/// the README's benchmark table).
///
/// **Memory.** The packed copy is an array of the weights' manager (`[⌈n/16⌉, k, 16]` f32, the
/// size of `w` rounded up to 16 columns), counted there and shown in its reports; it is closed
/// when the `Dense` is dropped (or [`close`](Dense::close)d), or with that manager. So make
/// layers before a [`Predictor`](crate::Predictor) caps the model: packing into a capped
/// manager is refused with `Capped`, as any new array there is.
///
/// **A snapshot.** The packed copy holds the weights as they were when packed. After changing
/// `w` (a training step), call [`repack`](Dense::repack).
///
/// Weights that are not f32 on the CPU (f64, or on a GPU) are not packed: `forward` then runs
/// `matmul`, `add` and the activation, closing the intermediate arrays.
///
/// ```
/// use ndscope::{Activation, Dense, Manager};
/// let model = Manager::new_base().with_name("model");
/// let w = model.from_slice(&[1.0f32, -1.0, 2.0, 0.5, 0.0, 1.0], [2, 3])?;
/// let b = model.from_slice(&[0.0f32, 1.0, -4.0], [3])?;
/// let layer = Dense::new(&w, Some(&b), Activation::Relu)?;
/// assert!(layer.is_packed());
/// let x = model.from_slice(&[1.0f32, 2.0], [1, 2])?;
/// // [1·1 + 2·0.5 + 0, 1·(−1) + 0 + 1, 2 + 2 − 4] = [2, 0, 0]
/// assert_eq!(layer.forward(&x)?.to_vec::<f32>()?, vec![2.0, 0.0, 0.0]);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
pub struct Dense {
    w: NDArray,
    bias: Option<NDArray>,
    activation: Activation,
    /// `w` packed (f32 on the CPU only).
    packed: Option<NDArray>,
    k: usize,
    n: usize,
}

impl Dense {
    /// A layer with weights `w` (`[in, out]`, a float dtype), an optional bias (`[out]`, same
    /// dtype and device) and an activation. f32 weights on the CPU are packed into a new array
    /// of `w`'s manager.
    ///
    /// Errors: `ShapeMismatch` for weights that are not 2-D or a bias that is not `[out]`,
    /// `DTypeMismatch` for integer weights or a bias of another dtype, `DeviceMismatch`,
    /// `ArrayClosed`, and `Capped` when `w`'s manager takes no new arrays. Nothing is created
    /// on an error.
    #[track_caller]
    pub fn new(w: &NDArray, bias: Option<&NDArray>, activation: Activation) -> Result<Dense> {
        let ctx = Ctx::new("Dense::new");
        let (k, n) = check_layer(&ctx, w, bias, w)?;
        let mut layer = Dense {
            w: w.clone(),
            bias: bias.cloned(),
            activation,
            packed: None,
            k,
            n,
        };
        if Self::packs(w) {
            let packed = exec::op1_into(
                &ctx,
                w,
                (Target::OwnerOf(w), w.device()),
                Shape::new(&[n.div_ceil(backend::PACK_COLUMNS), k, backend::PACK_COLUMNS]),
                DType::F32,
                |w, out| backend::pack_rhs(&ctx, (k, n), w, out),
            )?;
            if let Some(name) = w.name() {
                packed.set_name(&format!("{name} (packed)"));
            }
            layer.packed = Some(packed);
        }
        Ok(layer)
    }

    fn packs(w: &NDArray) -> bool {
        w.dtype() == DType::F32 && w.device() == Device::Cpu
    }

    /// `act(x · w + b)` for `x` of shape `[…, in]`, giving `[…, out]` (as PyTorch's `Linear`:
    /// every leading axis is a batch axis). The result is placed as any op's result: in the
    /// active scope or workspace cycle.
    ///
    /// Errors: `ShapeMismatch` when the last axis of `x` is not `in` (or `x` is a scalar),
    /// `DTypeMismatch`, `DeviceMismatch`, and `ArrayClosed` when `x`, the weights or the packed
    /// copy were closed. Nothing is created on an error.
    #[track_caller]
    pub fn forward(&self, x: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("Dense::forward");
        if let Some((x, w, b)) = lowered_layer(x, &self.w, self.bias.as_ref())? {
            // Under autocast: the unpacked product in the low dtype.
            return x.linear(&w, b.as_ref(), self.activation);
        }
        let out = {
            // Recorded as one op (its unpacked path's steps are not).
            let _pause = super::autograd::recording().then(super::autograd::Pause::new);
            self.forward_unrecorded(ctx, x)?
        };
        let all = [x, &self.w, self.bias.as_ref().unwrap_or(x)];
        let inputs = &all[..2 + usize::from(self.bias.is_some())];
        let relu = self.activation == Activation::Relu;
        super::autograd::record(&ctx, inputs, &out, || super::autograd::Backward::Dense {
            relu,
        });
        Ok(out)
    }

    fn forward_unrecorded(&self, ctx: Ctx, x: &NDArray) -> Result<NDArray> {
        check_same(&ctx, x, &self.w)?;
        let (k, n) = (self.k, self.n);
        let Some((_, lead)) = x.dims().split_last().filter(|(&last, _)| last == k) else {
            return Err(ctx.shape(format!(
                "the input must be [..., {k}] for weights {}, got {} {}",
                self.w.shape(),
                x.0.describe(),
                x.shape()
            )));
        };
        let m = lead.iter().product::<usize>();
        let mut dims = lead.to_vec();
        dims.push(n);
        let shape = Shape::new(&dims);
        let relu = self.activation == Activation::Relu;
        let Some(packed) = &self.packed else {
            return self.unpacked(&ctx, x, m, shape);
        };
        // The inputs on the stack (no list allocated per call): the bias last, when there is one.
        let all = [x, packed, self.bias.as_ref().unwrap_or(x)];
        let inputs = &all[..2 + usize::from(self.bias.is_some())];
        exec::op(&ctx, inputs, shape, DType::F32, |buffers, out| {
            backend::packed_matmul(
                &ctx,
                Mnk { m, k, n },
                (buffers[0], buffers[1]),
                buffers.get(2).copied(),
                relu,
                out,
            )
        })
    }

    /// `forward` without a packed copy: the fused product of [`NDArray::linear`] (on CUDA one
    /// cuBLASLt launch with the bias and activation as its epilogue).
    fn unpacked(&self, ctx: &Ctx, x: &NDArray, m: usize, shape: Shape) -> Result<NDArray> {
        let relu = self.activation == Activation::Relu;
        linear_unrecorded(ctx, x, &self.w, self.bias.as_ref(), relu, (m, shape))
    }

    /// Packs the weights again, for a layer whose `w` changed since it was made (a training
    /// step, `copy_from`, a load). Allocates nothing. Does nothing when the weights are not
    /// packed.
    ///
    /// Errors: `ArrayClosed` when the weights or the packed copy were closed.
    #[track_caller]
    pub fn repack(&self) -> Result<()> {
        let ctx = Ctx::new("Dense::repack");
        let Some(packed) = &self.packed else {
            return Ok(());
        };
        let (k, n) = (self.k, self.n);
        exec::inplace_with(&ctx, packed, &self.w, |out, w| match w {
            Some(w) => backend::pack_rhs(&ctx, (k, n), w, out),
            None => Err(ctx.invalid("the packed copy is the weights array itself")),
        })
    }

    /// Whether the weights are packed (f32 on the CPU).
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }

    /// The packed copy of the weights, an array of the weights' manager (`None` when not
    /// packed).
    pub fn packed(&self) -> Option<&NDArray> {
        self.packed.as_ref()
    }

    /// The weights, `[in, out]`.
    pub fn weights(&self) -> &NDArray {
        &self.w
    }

    /// The bias, `[out]`.
    pub fn bias(&self) -> Option<&NDArray> {
        self.bias.as_ref()
    }

    /// The activation.
    pub fn activation(&self) -> Activation {
        self.activation
    }

    /// `(in, out)`: the last axis of an input and of an output.
    pub fn features(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// Closes the packed copy now (dropping the layer does the same). The weights and bias
    /// stay open: they belong to the model.
    ///
    /// Errors: what [`NDArray::close`] gives for the packed copy (`ManagerClosed` when its
    /// manager closed first is not an error here: the copy is gone either way).
    pub fn close(mut self) -> Result<()> {
        self.close_packed()
    }

    fn close_packed(&mut self) -> Result<()> {
        match self.packed.take() {
            Some(p) if p.is_open() => p.close(),
            _ => Ok(()),
        }
    }
}

impl Drop for Dense {
    fn drop(&mut self) {
        // Closed with its manager already, or closed by the user: nothing left to free.
        let _ = self.close_packed();
    }
}

/// A layer's input, weights and bias in the autocast dtype (PyTorch's autocast converts
/// `linear`'s bias too), when a guard is open and any of them is a float of another dtype; the
/// weights stay f32 where the product reads them rounded ([`reads_rounded`]).
#[allow(clippy::type_complexity)]
fn lowered_layer(
    x: &NDArray,
    w: &NDArray,
    bias: Option<&NDArray>,
) -> Result<Option<(NDArray, NDArray, Option<NDArray>)>> {
    if super::autocast::autocast_dtype().is_none() {
        return Ok(None);
    }
    let lx = super::autocast::lowered(x)?;
    let lw = if reads_rounded(x, w) {
        None
    } else {
        super::autocast::lowered(w)?
    };
    let lb = bias.map(super::autocast::lowered).transpose()?.flatten();
    if lx.is_none() && lw.is_none() && lb.is_none() {
        return Ok(None);
    }
    Ok(Some((
        lx.unwrap_or_else(|| x.clone()),
        lw.unwrap_or_else(|| w.clone()),
        lb.or_else(|| bias.cloned()),
    )))
}

/// Whether a layer under autocast with input `x` reads its f32 weights `w` rounded to the half
/// type as its product reads them, so that no half copy of them is made (none kept in the
/// step's workspace): where the device's products do for the layer's sizes
/// ([`backend::rounds_operands`]: the CPU always, CUDA for small products), for weights that are
/// not the result of a recorded op (a parameter, or weights outside autograd), whose gradient,
/// a product of halves, then goes straight into their f32 gradient. Backward reads them
/// rounded again wherever the forward did (the weights' dtype says so), whatever the sizes.
fn reads_rounded(x: &NDArray, w: &NDArray) -> bool {
    let &[k, n] = w.dims() else {
        return false;
    };
    let m = x
        .dims()
        .split_last()
        .map_or(1, |(_, lead)| lead.iter().product::<usize>());
    w.dtype() == DType::F32
        && backend::rounds_operands(w.device(), (m, k, n))
        && !super::autograd::is_recorded_result(w)
}

/// Whether `x · w` is a layer under autocast reading f32 weights rounded to `x`'s half type.
fn rounded_layer(x: &NDArray, w: &NDArray) -> bool {
    super::autocast::autocast_dtype() == Some(x.dtype())
        && x.dtype() != w.dtype()
        && reads_rounded(x, w)
}

/// The checks of a layer's weights `[in, out]` (floats) and bias `[out]` (of the dtype and
/// device of `like`: the weights, or the input of a layer reading its weights rounded):
/// `(in, out)`, or the error naming what is wrong.
fn check_layer(
    ctx: &Ctx,
    w: &NDArray,
    bias: Option<&NDArray>,
    like: &NDArray,
) -> Result<(usize, usize)> {
    let &[k, n] = w.dims() else {
        return Err(ctx.shape(format!(
            "the weights must be 2-D [in, out], got {} {}",
            w.0.describe(),
            w.shape()
        )));
    };
    if !w.dtype().is_float() {
        return Err(ctx.dtype(
            w.dtype(),
            format!("the weights must be floats, got {}", w.0.describe()),
        ));
    }
    if let Some(b) = bias {
        check_same(ctx, like, b)?;
        if b.dims() != [n] {
            return Err(ctx.shape(format!(
                "the bias must be [{n}] for weights {}, got {} {}",
                w.shape(),
                b.0.describe(),
                b.shape()
            )));
        }
    }
    Ok((k, n))
}

/// `act(x · w + b)` as one op: `x` `[m, k]` flat, the result of `shape` (`[…, n]`), in `x`'s
/// dtype (f32 weights read rounded to it when they differ: [`rounded_layer`]).
fn linear_unrecorded(
    ctx: &Ctx,
    x: &NDArray,
    w: &NDArray,
    bias: Option<&NDArray>,
    relu: bool,
    (m, shape): (usize, Shape),
) -> Result<NDArray> {
    let (k, n) = (w.dims()[0], w.dims()[1]);
    let dtype = x.dtype();
    let spec = Linear {
        dims: Mnk { m, k, n },
        relu,
        rounded_w: w.dtype() != dtype,
    };
    // The inputs on the stack (no list allocated per call): the bias last, when there is one.
    let all = [x, w, bias.unwrap_or(x)];
    let inputs = &all[..2 + usize::from(bias.is_some())];
    exec::op(ctx, inputs, shape, dtype, |buffers, out| {
        AnyDevice::linear(
            ctx,
            dtype,
            spec,
            (buffers[0], buffers[1]),
            buffers.get(2).copied(),
            out,
        )
    })
}

impl NDArray {
    /// A dense layer in one op, `act(self · w + bias)`, for `self` of shape `[…, in]`, weights
    /// `w` `[in, out]` and an optional bias `[out]` (one float dtype, one device), giving
    /// `[…, out]` (every leading axis is a batch axis, as in PyTorch's `Linear`, whose weight
    /// is stored `[out, in]`). The result is placed as any op's result.
    ///
    /// It computes what `matmul`, `add` and `relu` compute, with one array made instead of
    /// three: on the CPU the bias and activation are applied in one pass over the product; on
    /// CUDA the product runs through cuBLASLt with the bias and ReLU as its epilogue, one
    /// launch (where cuBLASLt cannot be loaded, a cuBLAS product and one kernel; under
    /// [`autocast`](crate::autocast) with f32 weights and a product of up to 2^25
    /// multiply-adds, one launch of a kernel of ours that reads the weights rounded, so that no
    /// half copy of them is made, as the CPU's products always do). The gradient
    /// (with a [`GradientCollector`](crate::GradientCollector)) is fused too: the ReLU mask and
    /// the bias gradient in one pass, the bias gradient written straight into the bias's
    /// `gradient()`, the weight gradient left as a pending product.
    ///
    /// Where they differ from the three ops: cuBLASLt's ReLU gives 0 for a NaN (the `relu` op
    /// and the CPU keep NaN), and the gradient where a unit was off is 0 even when the
    /// incoming gradient is NaN (PyTorch's `threshold_backward` does the same).
    ///
    /// Errors: `ShapeMismatch` when `w` is not 2-D, the last axis of `self` is not `in` (or
    /// `self` is a scalar), or the bias is not `[out]`; `DTypeMismatch` for integer or mixed
    /// dtypes; `DeviceMismatch`; `ArrayClosed`. Nothing is created on an error.
    ///
    /// ```
    /// use ndscope::{Activation, Manager};
    /// let m = Manager::new_base();
    /// let x = m.from_slice(&[1.0f32, 2.0], [1, 2])?;
    /// let w = m.from_slice(&[1.0f32, -1.0, 2.0, 0.5, 0.0, 1.0], [2, 3])?;
    /// let b = m.from_slice(&[0.0f32, 1.0, -4.0], [3])?;
    /// // relu([1 + 1, −1 + 0 + 1, 2 + 2 − 4]) = [2, 0, 0]
    /// let y = x.linear(&w, Some(&b), Activation::Relu)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![2.0, 0.0, 0.0]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn linear(
        &self,
        w: &NDArray,
        bias: Option<&NDArray>,
        activation: Activation,
    ) -> Result<NDArray> {
        let ctx = Ctx::new("linear");
        if let Some((x, w, b)) = lowered_layer(self, w, bias)? {
            return x.linear(&w, b.as_ref(), activation);
        }
        let rounded = rounded_layer(self, w);
        let (k, n) = check_layer(&ctx, w, bias, if rounded { self } else { w })?;
        if rounded {
            check_device(&ctx, self, w)?;
        } else {
            check_same(&ctx, self, w)?;
        }
        let Some((_, lead)) = self.dims().split_last().filter(|(&last, _)| last == k) else {
            return Err(ctx.shape(format!(
                "the input must be [..., {k}] for weights {}, got {} {}",
                w.shape(),
                self.0.describe(),
                self.shape()
            )));
        };
        let m = lead.iter().product::<usize>();
        let mut dims = lead.to_vec();
        dims.push(n);
        let relu = activation == Activation::Relu;
        let out = linear_unrecorded(&ctx, self, w, bias, relu, (m, Shape::new(&dims)))?;
        let all = [self, w, bias.unwrap_or(self)];
        let inputs = &all[..2 + usize::from(bias.is_some())];
        super::autograd::record(&ctx, inputs, &out, || super::autograd::Backward::Dense {
            relu,
        });
        Ok(out)
    }
}
