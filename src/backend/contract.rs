//! The backend contract: the one list of the ops a backend runs, with their signatures, written
//! once in `backend_contract!`, one trait per op family ([`TransferOps`], [`ElementwiseOps`],
//! [`ReduceOps`], [`MatmulOps`], [`NnOps`], [`ShapeOps`], [`OptimOps`]) over a [`Backend`]'s buffer type. The
//! CPU backend (`cpu::ops::Cpu`) and the CUDA backend (`cuda::Cuda`, one family per file of
//! `cuda/ops/`) implement them; the CUDA-off stub's implementation is generated from the same
//! list (`cuda/stub.rs`), so its signatures are never written again. The entry points are a
//! third implementation, `ops::AnyDevice`, whose buffer is `Storage` on any device: each op
//! picks the CPU or CUDA backend from its operands' storage and calls it statically
//! (`<Cpu as ElementwiseOps>::unary(..)`), no trait object, no cost. So the compiler checks
//! every layer, front-end calls (`AnyDevice::unary(..)`) included, against one contract.
//!
//! Parameters that travel together are the small `Copy` structs below ([`Mnk`], [`Gemm`],
//! [`Lanes`], [`SumOf`], [`SgdStep`], [`SgdCoeffs`], [`AdamCoeffs`], [`Draw`]); the multi-tensor optimizer
//! steps take their tensors as a [`StepTensors`] list.
//!
//! Every op takes the op's [`Ctx`] first (for errors), returns `Result` (the CPU never fails
//! where the device may), and names its buffers `Self::Buffer`: host bytes for the CPU, memory
//! of one device for CUDA. A backend checks that the buffers of one call are on one device.

use super::{Batched, Binary, Compare, Unary};
use crate::backend::cpu::buffer::HostBuffer;
use crate::error::Ctx;
use crate::{DType, Element, Error, Result};

/// A buffer and the shape it holds (ops that broadcast or walk strides).
pub(crate) type Operand<'a, B> = (&'a B, &'a [usize]);

/// A buffer written by the op and the shape it holds.
pub(crate) type OperandMut<'a, B> = (&'a mut B, &'a [usize]);

/// The sizes of a matrix product `[m, k] · [k, n] → [m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mnk {
    /// Rows of the left operand and of the result.
    pub m: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Columns of the right operand and of the result.
    pub n: usize,
}

/// `out = beta·out + alpha·(the product)` instead of `out = (the product)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Accumulate {
    /// The factor of the product.
    pub alpha: f64,
    /// The factor of `out`'s old value; 0 does not read it (a NaN there does not survive).
    pub beta: f64,
}

/// A general matrix product `op(a) · op(b)`: `a` is stored `[m, k]` (`[k, m]` when
/// `trans_a`), `b` `[k, n]` (`[n, k]` when `trans_b`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Gemm {
    /// The product's sizes.
    pub dims: Mnk,
    /// `a` is stored transposed.
    pub trans_a: bool,
    /// `b` is stored transposed.
    pub trans_b: bool,
    /// Accumulate into `out` instead of overwriting it.
    pub accumulate: Option<Accumulate>,
    /// `a` and `b` hold this half type while `out` is f32: a product of halves accumulated and
    /// kept in f32 (a weight gradient of an autocast step, written into the f32 parameter's
    /// gradient). `None`: all three hold the product's dtype.
    pub operands: Option<DType>,
    /// `b` holds f32 values, each read rounded to the product's half dtype exactly as
    /// `to_dtype` rounds it (an autocast weight read without a half copy of it). Only on a
    /// device whose [`rounds_operands`](super::rounds_operands) says so.
    pub rounded_b: bool,
}

impl Gemm {
    /// `out = op(a) · op(b)`, all three in the product's dtype.
    pub fn plain(dims: Mnk, trans_a: bool, trans_b: bool) -> Gemm {
        Gemm {
            dims,
            trans_a,
            trans_b,
            accumulate: None,
            operands: None,
            rounded_b: false,
        }
    }

    /// Checks what a backend asked for [`Gemm::rounded_b`] needs: a product in a half `dtype`
    /// with its result in that type (no `operands`). One check for every backend.
    pub fn check_rounded(&self, ctx: &Ctx, dtype: DType) -> Result<()> {
        if self.rounded_b && (!dtype.is_half() || self.operands.is_some()) {
            return Err(no_rounded_read(ctx, dtype));
        }
        Ok(())
    }
}

/// The error of a product asked to read an f32 operand rounded outside a half product with a
/// result of that type.
fn no_rounded_read(ctx: &Ctx, dtype: DType) -> Error {
    ctx.unsupported(format!(
        "an f32 operand is read rounded to a half type (f16 or bf16) in a product computed in \
         and giving that type, not {dtype}"
    ))
}

/// A dense layer's forward product: `out = act(x · w + bias)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Linear {
    /// `x` `[m, k]`, `w` `[k, n]`.
    pub dims: Mnk,
    /// ReLU applied as the result is written (else none).
    pub relu: bool,
    /// `w` holds f32 values, each read rounded to the layer's half dtype (as
    /// [`Gemm::rounded_b`]).
    pub rounded_w: bool,
}

impl Linear {
    /// As [`Gemm::check_rounded`]: `rounded_w` needs a layer in a half `dtype`.
    pub fn check_rounded(&self, ctx: &Ctx, dtype: DType) -> Result<()> {
        if self.rounded_w && !dtype.is_half() {
            return Err(no_rounded_read(ctx, dtype));
        }
        Ok(())
    }
}

/// An array seen as `[outer, len, inner]`, the op running along the middle axis (reductions
/// along one axis, softmax, narrow).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Lanes {
    /// The product of the axes before the middle one.
    pub outer: usize,
    /// The middle axis's length.
    pub len: usize,
    /// The product of the axes after the middle one.
    pub inner: usize,
}

/// What a sum reads and writes: floats keep their dtype (accumulated in f64), integers give
/// `I64` sums and `F64` means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SumOf {
    /// The input's dtype.
    pub from: DType,
    /// The result's dtype.
    pub to: DType,
    /// The mean instead of the sum.
    pub mean: bool,
}

/// The hyper-parameters of an SGD-with-momentum step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SgdStep {
    /// The learning rate.
    pub lr: f64,
    /// The momentum (0 is plain SGD).
    pub momentum: f64,
}

/// The coefficients of an elementwise SGD step (PyTorch's `optim.SGD`, dampening 0), each
/// converted to the element type by the kernel: `g = grad + weight_decay·p`; with a velocity
/// `v = momentum·v + g` and `d = nesterov ? g + momentum·v : v`, else `d = g`; `p -= lr·d`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SgdCoeffs {
    /// The learning rate.
    pub lr: f64,
    /// The momentum (only read with a velocity).
    pub momentum: f64,
    /// The L2 penalty added to the gradient (0: not read).
    pub weight_decay: f64,
    /// Nesterov momentum (only with a velocity).
    pub nesterov: bool,
    /// Sets the gradient to zero in the same pass, after reading it (an optimizer's step);
    /// `false` leaves it unchanged.
    pub zero_grad: bool,
}

/// The coefficients of an elementwise Adam step (PyTorch's `optim.Adam` and `optim.AdamW`,
/// amsgrad off), the bias corrections computed once on the host:
/// `decoupled ? p *= decay : g = grad + weight_decay·p; m = β1·m + (1−β1)·g;
/// v = β2·v + (1−β2)·g²; p -= step_size·m / (√v / bias2_sqrt + eps)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamCoeffs {
    /// The learning rate (for bias corrections computed from a step count the device keeps).
    pub lr: f64,
    /// `β1`, the decay of the first moment.
    pub beta1: f64,
    /// `β2`, the decay of the second moment.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// The L2 penalty added to the gradient (not decoupled; 0: not read).
    pub weight_decay: f64,
    /// The decoupled weight decay's factor `1 − lr·weight_decay` (AdamW), or `None` (Adam).
    pub decay: Option<f64>,
    /// `lr / (1 − β1^t)`.
    pub step_size: f64,
    /// `√(1 − β2^t)`.
    pub bias2_sqrt: f64,
    /// Sets the gradient to zero in the same pass, after reading it (an optimizer's step);
    /// `false` leaves it unchanged.
    pub zero_grad: bool,
}

/// The buffers of one tensor of a multi-tensor optimizer step: its gradient, the parameter,
/// and its state (SGD's velocity in `state[0]`; Adam's moments `m`, `v`), `None` past what the
/// rule keeps.
pub(crate) struct StepTensor<'a, B> {
    /// The gradient, read (and zeroed in the same pass when the coefficients say so).
    pub grad: &'a mut B,
    /// The parameter, updated in place.
    pub p: &'a mut B,
    /// The state, updated in place.
    pub state: [Option<&'a mut B>; 2],
}

/// The tensors of a multi-tensor optimizer step, all of one float dtype and one device, each
/// tensor's buffers of one length and every buffer distinct: a list that hands out one tensor's
/// buffers at a time, so a caller holding many locked buffers builds no list of them.
pub(crate) trait StepTensors<B> {
    /// How many tensors there are.
    fn len(&self) -> usize;
    /// Tensor `i`'s buffers; `None` when `i` is out of range or its buffers are not of this
    /// backend.
    fn tensor(&mut self, i: usize) -> Option<StepTensor<'_, B>>;
    /// The step's skip flag, if it has one: a one-element f32 buffer on the tensors' device;
    /// when it holds anything but 0 (NaN included: a loss scaler's "non-finite gradient
    /// found"), the step changes no parameter and no state, and only zeroes the gradients it
    /// was asked to zero. Read by the device where it lies (no host round trip on a GPU).
    fn skip_flag(&mut self) -> Option<&B> {
        None
    }
    /// [`skip_flag`](Self::skip_flag), as the list of storages hands it out to the backend it
    /// is on.
    fn skip_flag_mut(&mut self) -> Option<&mut B> {
        None
    }
    /// An Adam step's own count of the steps taken (one f64 element on the tensors' device),
    /// if it keeps one: the bias corrections are then those of step `count + 1` (the
    /// coefficients' `step_size` and `bias2_sqrt` are not used), computed where the count lies,
    /// and the count goes up by one unless the skip flag skips the step. So a step skipped by a
    /// flag the host never reads is not counted, as PyTorch's GradScaler leaves Adam's step.
    fn step_count(&mut self) -> Option<&mut B> {
        None
    }
}

/// The first tensor of a multi-tensor step (the contract's witness of a buffer for the list
/// ops); `InvalidArgument` when the list is empty.
#[cfg_attr(feature = "cuda", allow(dead_code))]
pub(crate) fn first_tensor<'l, B>(
    ctx: &Ctx,
    tensors: &'l mut dyn StepTensors<B>,
) -> Result<StepTensor<'l, B>> {
    tensors
        .tensor(0)
        .ok_or_else(|| ctx.invalid("a multi-tensor step needs at least one tensor"))
}

/// Where random numbers are drawn: counters `start..` of the stream `seed` (the same numbers
/// on every device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Draw {
    /// The stream.
    pub seed: u64,
    /// The counter of the first element.
    pub start: u64,
}

/// The backend contract, handed to `$consumer` as a list of method signatures, each with its
/// docs and, after `=>`, a buffer parameter every call has (the stub matches on it: where the
/// backend's buffer type has no values, the method cannot be called).
macro_rules! backend_contract {
    ($consumer:ident) => {
        $consumer! {
            /// Copies within and across devices, conversions.
            trait TransferOps {
                /// Copies the first `dst.len()` elements of `src` into `dst` (a device read
                /// synchronises and reports earlier kernel errors as `Backend`).
                fn read<T: Element>(ctx: &Ctx, src: &Self::Buffer, dst: &mut [T]) -> Result<()> => src;
                /// Copies `data` into `dst` (same length).
                fn write<T: Element>(ctx: &Ctx, dst: &mut Self::Buffer, data: &[T]) -> Result<()> => dst;
                /// Copies the bytes of host memory `src` into `dst` (same length).
                fn upload(ctx: &Ctx, src: &HostBuffer, dst: &mut Self::Buffer) -> Result<()> => dst;
                /// Copies the bytes of `src` into host memory `dst` (same length).
                fn download(ctx: &Ctx, src: &Self::Buffer, dst: &mut HostBuffer) -> Result<()> => src;
                /// Copies the bytes of `src` into `dst` (same length).
                fn copy(ctx: &Ctx, src: &Self::Buffer, dst: &mut Self::Buffer) -> Result<()> => src;
                /// `dst = src` converted from `dtypes.0` to `dtypes.1` elementwise.
                fn convert(
                    ctx: &Ctx,
                    dtypes: (DType, DType),
                    src: &Self::Buffer,
                    dst: &mut Self::Buffer,
                ) -> Result<()> => src;
                /// Sets every byte of `dst` to 0.
                fn zero(ctx: &Ctx, dst: &mut Self::Buffer) -> Result<()> => dst;
            }

            /// Fills, random numbers, and the elementwise families (unary, binary, comparison,
            /// in place).
            trait ElementwiseOps {
                /// Sets every element of `dst` to `value` converted to `dtype`.
                fn fill(ctx: &Ctx, dtype: DType, dst: &mut Self::Buffer, value: f64) -> Result<()> => dst;
                /// `dst[i] = start + i·step` (computed in f64, then converted).
                fn arange(
                    ctx: &Ctx,
                    dtype: DType,
                    dst: &mut Self::Buffer,
                    start: f64,
                    step: f64,
                ) -> Result<()> => dst;
                /// The `n × n` identity into `dst` (which may hold anything).
                fn eye(ctx: &Ctx, dtype: DType, dst: &mut Self::Buffer, n: usize) -> Result<()> => dst;
                /// Standard normals drawn at `draw`.
                fn randn(ctx: &Ctx, dtype: DType, dst: &mut Self::Buffer, draw: Draw) -> Result<()> => dst;
                /// Uniforms in `[range.0, range.1)` drawn at `draw` (integers for integer dtypes).
                fn rand(
                    ctx: &Ctx,
                    dtype: DType,
                    dst: &mut Self::Buffer,
                    draw: Draw,
                    range: (f64, f64),
                ) -> Result<()> => dst;

                /// `out = op(a, b)` with NumPy broadcasting of `a` and `b` to `out`'s shape. An
                /// integer division whose divisor holds 0 gives `on_zero()` and writes nothing (or,
                /// on a device, reports it at the next wait).
                fn binary(
                    ctx: &Ctx,
                    op: Binary,
                    dtype: DType,
                    a: Operand<'_, Self::Buffer>,
                    b: Operand<'_, Self::Buffer>,
                    out: OperandMut<'_, Self::Buffer>,
                    on_zero: &dyn Fn() -> Error,
                ) -> Result<()> => a.0;
                /// `out = op(a, value)` with `value` converted to `dtype` (the front-end checked it
                /// fits).
                fn binary_scalar(
                    ctx: &Ctx,
                    op: Binary,
                    dtype: DType,
                    a: &Self::Buffer,
                    value: f64,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// `out = op(a, b)` as `U8` 0/1, broadcasting as [`ElementwiseOps::binary`].
                fn compare(
                    ctx: &Ctx,
                    op: Compare,
                    dtype: DType,
                    a: Operand<'_, Self::Buffer>,
                    b: Operand<'_, Self::Buffer>,
                    out: OperandMut<'_, Self::Buffer>,
                ) -> Result<()> => a.0;
                /// `out = op(a, value)` as `U8` 0/1: floats compare against `value` in their own
                /// precision, integers against the exact value.
                fn compare_scalar(
                    ctx: &Ctx,
                    op: Compare,
                    dtype: DType,
                    a: &Self::Buffer,
                    value: f64,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// `out = op(a)` elementwise (float-only ops get float dtypes: front-ends check).
                fn unary(
                    ctx: &Ctx,
                    op: Unary,
                    dtype: DType,
                    a: &Self::Buffer,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// `out = a^exponent` elementwise (integers through f64, truncated).
                fn pow_scalar(
                    ctx: &Ctx,
                    dtype: DType,
                    a: &Self::Buffer,
                    exponent: f64,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;

                /// `x = op(x, src)` with `src` broadcast to `x`'s shape; `src` `None` means `x`
                /// itself. An integer division whose divisor holds 0 gives `on_zero()` and changes
                /// nothing (or, on a device, reports it at the next wait).
                fn binary_inplace(
                    ctx: &Ctx,
                    op: Binary,
                    dtype: DType,
                    x: OperandMut<'_, Self::Buffer>,
                    src: Option<Operand<'_, Self::Buffer>>,
                    on_zero: &dyn Fn() -> Error,
                ) -> Result<()> => x.0;
                /// `x = x · value` in place.
                fn scale_inplace(ctx: &Ctx, dtype: DType, x: &mut Self::Buffer, value: f64) -> Result<()> => x;
                /// `x += alpha · src` in place, `src` broadcast to `x`'s shape (`None`: `x` itself).
                fn axpy(
                    ctx: &Ctx,
                    dtype: DType,
                    x: OperandMut<'_, Self::Buffer>,
                    alpha: f64,
                    src: Option<Operand<'_, Self::Buffer>>,
                ) -> Result<()> => x.0;
                /// `x = src` broadcast to `x`'s shape (a fresh `x` makes this `broadcast_to`).
                fn assign(
                    ctx: &Ctx,
                    dtype: DType,
                    x: OperandMut<'_, Self::Buffer>,
                    src: Operand<'_, Self::Buffer>,
                ) -> Result<()> => x.0;
            }

            /// Reductions.
            trait ReduceOps {
                /// The sum (or mean, as `of` says) of `a` over the axes marked in `mask` into `out`.
                fn sum(
                    ctx: &Ctx,
                    of: SumOf,
                    a: Operand<'_, Self::Buffer>,
                    mask: &[bool],
                    out: &mut Self::Buffer,
                ) -> Result<()> => a.0;
                /// The sum (or mean) of every element of `a` into the one element of `out`.
                fn sum_all(ctx: &Ctx, of: SumOf, a: &Self::Buffer, out: &mut Self::Buffer) -> Result<()> => a;
                /// The maximum (NaN wins) along the middle axis of `a` seen as `lanes`
                /// (`lanes.len ≥ 1`).
                fn max_axis(
                    ctx: &Ctx,
                    dtype: DType,
                    a: &Self::Buffer,
                    lanes: Lanes,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// The `I64` index of the maximum (first on ties, first NaN) along the middle axis
                /// of `a` seen as `lanes` (`lanes.len ≥ 1`).
                fn argmax_axis(
                    ctx: &Ctx,
                    dtype: DType,
                    a: &Self::Buffer,
                    lanes: Lanes,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
            }

            /// Matrix products and the fused dense SGD step.
            trait MatmulOps {
                /// `out = a · b` for `[m, k] · [k, n]`, or batched as `batch` says.
                fn matmul(
                    ctx: &Ctx,
                    dtype: DType,
                    batch: Option<(Batched, usize)>,
                    dims: Mnk,
                    a: &Self::Buffer,
                    b: &Self::Buffer,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// `out = op(a) · op(b)`, or accumulated into `out`, as `spec` says.
                fn gemm(
                    ctx: &Ctx,
                    dtype: DType,
                    spec: Gemm,
                    a: &Self::Buffer,
                    b: &Self::Buffer,
                    out: &mut Self::Buffer,
                ) -> Result<()> => a;
                /// A dense layer's forward pass in one product: `out = act(x · w + bias)` for
                /// `x` `[m, k]`, `w` `[k, n]`, `bias` `[n]` (floats, contiguous), the bias added
                /// and the activation applied as the product is written (on CUDA a cuBLASLt
                /// epilogue: one launch).
                fn linear(
                    ctx: &Ctx,
                    dtype: DType,
                    spec: Linear,
                    xw: (&Self::Buffer, &Self::Buffer),
                    bias: Option<&Self::Buffer>,
                    out: &mut Self::Buffer,
                ) -> Result<()> => xw.0;
                /// One SGD-with-momentum step of a dense layer: `v ← momentum·v + xᵀ·g;
                /// w ← w − lr·v`, with `x` `[k, m]`, `g` `[k, n]`, `v` and `w` `[m, n]` (floats).
                fn sgd_dense(
                    ctx: &Ctx,
                    dtype: DType,
                    dims: Mnk,
                    xg: (&Self::Buffer, &Self::Buffer),
                    vw: (&mut Self::Buffer, &mut Self::Buffer),
                    step: SgdStep,
                ) -> Result<()> => xg.0;
            }

            /// Neural-network ops.
            trait NnOps {
                /// Softmax (or log-softmax) along the middle axis of `a` seen as `lanes` (floats).
                fn softmax(
                    ctx: &Ctx,
                    dtype: DType,
                    a: &Self::Buffer,
                    lanes: Lanes,
                    out: &mut Self::Buffer,
                    log: bool,
                ) -> Result<()> => a;
                /// The backward of a dense layer's bias and activation over the output
                /// gradient `g` `[rows, cols]` (floats), in one pass: `dz = g` where the layer's
                /// output `y` is positive and 0 elsewhere (with `relu`: `y` and `dz` given;
                /// without, `dz` is `g` itself and neither is given), and the bias gradient,
                /// each column of `dz` summed down the rows in order, written into `db`, or
                /// added to it with `accumulate`.
                fn bias_act_grad(
                    ctx: &Ctx,
                    dtype: DType,
                    rows_cols: (usize, usize),
                    g: &Self::Buffer,
                    relu: Option<(&Self::Buffer, &mut Self::Buffer)>,
                    db: &mut Self::Buffer,
                    accumulate: bool,
                ) -> Result<()> => g;
                /// The flat position and value of the first index of `indices` (an integer dtype)
                /// outside `0..bound`, if any. A device answers `None`: its kernels check the
                /// indices they use and the next wait reports a bad one.
                fn first_bad_index(
                    ctx: &Ctx,
                    dtype: DType,
                    indices: &Self::Buffer,
                    bound: usize,
                ) -> Result<Option<(usize, i64)>> => indices;
                /// The one-hot encoding (`[len, depth]` of `dtypes.1`) of integer `indices`
                /// (`dtypes.0`). The host checks the indices and returns the first bad one without
                /// writing; a device writes zeros for bad ones, reports them at the next wait and
                /// returns `None`.
                fn one_hot(
                    ctx: &Ctx,
                    dtypes: (DType, DType),
                    indices: &Self::Buffer,
                    depth: usize,
                    out: &mut Self::Buffer,
                ) -> Result<Option<(usize, i64)>> => indices;
                /// `out[o, j] = x[o, indices[o, j], j]` for `x` (`dtypes.0`) seen as
                /// `[outer, n, inner]` (`n_inner`), `indices` of `dtypes.1`; bad indices as for
                /// [`NnOps::one_hot`].
                fn pick(
                    ctx: &Ctx,
                    dtypes: (DType, DType),
                    x: &Self::Buffer,
                    n_inner: (usize, usize),
                    indices: &Self::Buffer,
                    out: &mut Self::Buffer,
                ) -> Result<Option<(usize, i64)>> => x;
                /// Softmax cross-entropy over the rows of `logits` (`[rows, classes]` of
                /// `dtypes.0`, a float) against integer `labels` (`[rows]` of `dtypes.1`): writes
                /// the mean over rows of `-log_softmax(logits)[r, labels[r]]` (numerically stable,
                /// summed in f64) into the one element of `out.0`, and, when `out.1` is given, the
                /// gradient of that mean for a unit seed, `(softmax(logits) - one_hot(labels)) /
                /// rows`, into it (`[rows, classes]`). Bad labels as for [`NnOps::one_hot`].
                fn softmax_cross_entropy(
                    ctx: &Ctx,
                    dtypes: (DType, DType),
                    logits: &Self::Buffer,
                    rows_classes: (usize, usize),
                    labels: &Self::Buffer,
                    out: (&mut Self::Buffer, Option<&mut Self::Buffer>),
                ) -> Result<Option<(usize, i64)>> => logits;
            }

            /// The fused elementwise optimizer steps: one pass over the elements of the
            /// parameters, their gradient and their state, all of one float dtype and length.
            trait OptimOps {
                /// One SGD step of `p` by `grad` as `step` says, updating `velocity` with it
                /// (without one, plain SGD: momentum is not read). `grad` is written only with
                /// `step.zero_grad` (set to zero after it is read).
                fn sgd_update(
                    ctx: &Ctx,
                    dtype: DType,
                    grad: &mut Self::Buffer,
                    p: &mut Self::Buffer,
                    velocity: Option<&mut Self::Buffer>,
                    step: SgdCoeffs,
                ) -> Result<()> => grad;
                /// One Adam (or AdamW) step of `p` by `grad` as `step` says, updating the moments
                /// `mv` (first, second). `grad` is written only with `step.zero_grad` (set to
                /// zero after it is read).
                fn adam_update(
                    ctx: &Ctx,
                    dtype: DType,
                    grad: &mut Self::Buffer,
                    p: &mut Self::Buffer,
                    mv: (&mut Self::Buffer, &mut Self::Buffer),
                    step: AdamCoeffs,
                ) -> Result<()> => grad;
                /// [`OptimOps::sgd_update`] on every tensor of `tensors` (their state: the
                /// velocity in `state[0]`, for all of them or none), with exactly its
                /// arithmetic. A device runs one launch per group of tensors its kernel's
                /// parameter block holds.
                fn sgd_update_multi(
                    ctx: &Ctx,
                    dtype: DType,
                    tensors: &mut dyn StepTensors<Self::Buffer>,
                    step: SgdCoeffs,
                ) -> Result<()> => first_tensor(ctx, tensors)?.p;
                /// [`OptimOps::adam_update`] on every tensor of `tensors` (their state: the
                /// moments `m`, `v`), with exactly its arithmetic. A device runs one launch per
                /// group of tensors its kernel's parameter block holds.
                fn adam_update_multi(
                    ctx: &Ctx,
                    dtype: DType,
                    tensors: &mut dyn StepTensors<Self::Buffer>,
                    step: AdamCoeffs,
                ) -> Result<()> => first_tensor(ctx, tensors)?.p;
            }

            /// Copies that rearrange elements.
            trait ShapeOps {
                /// `dst = srcᵀ` for `src` of `[rows, cols]`.
                fn transpose(
                    ctx: &Ctx,
                    dtype: DType,
                    src: &Self::Buffer,
                    rows_cols: (usize, usize),
                    dst: &mut Self::Buffer,
                ) -> Result<()> => src;
                /// `dst` = `src` with its axes reordered: output axis `k` is input axis `perm[k]`.
                fn permute(
                    ctx: &Ctx,
                    dtype: DType,
                    src: Operand<'_, Self::Buffer>,
                    perm: &[usize],
                    dst: &mut Self::Buffer,
                ) -> Result<()> => src.0;
                /// For `src` seen as `lanes` of elements of `elem` bytes, copies
                /// `[outer, start..start + l, inner]` into `dst` (`l` from `dst`'s size).
                fn narrow(
                    ctx: &Ctx,
                    elem: usize,
                    src: &Self::Buffer,
                    lanes: Lanes,
                    start: usize,
                    dst: &mut Self::Buffer,
                ) -> Result<()> => src;
                /// Row `o` of `dst` is row `o` of every source in turn, row `o` of `srcs[k]` being
                /// the `row_bytes[k]` bytes at `o · row_bytes[k]` (`concat` and `stack`).
                fn interleave(
                    ctx: &Ctx,
                    srcs: &[&Self::Buffer],
                    row_bytes: &[usize],
                    outer: usize,
                    dst: &mut Self::Buffer,
                ) -> Result<()> => dst;
            }
        }
    };
}
#[cfg_attr(feature = "cuda", allow(unused_imports))]
pub(crate) use backend_contract;

macro_rules! define_backend {
    ($(
        $(#[doc = $family_doc:literal])*
        trait $family:ident {
            $(
                $(#[doc = $doc:literal])*
                fn $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?)
                    -> $ret:ty => $witness:expr;
            )*
        }
    )*) => {
        $(
            $(#[doc = $family_doc])*
            pub(crate) trait $family: Backend {
                $(
                    $(#[doc = $doc])*
                    fn $name $(<$g: $bound>)? ($($arg: $ty),*) -> $ret;
                )*
            }
        )*
    };
}
backend_contract!(define_backend);

/// A backend: its memory type, on which the op families ([`TransferOps`], [`ElementwiseOps`],
/// [`ReduceOps`], [`MatmulOps`], [`NnOps`], [`ShapeOps`], [`OptimOps`]) work. Implemented by the CPU backend,
/// the CUDA backend (without the `cuda` feature, the CUDA stub, whose buffers have no values),
/// and the entry points (`ops::AnyDevice`, over `Storage` on either).
pub(crate) trait Backend {
    /// The backend's memory: host bytes, or memory of one CUDA device.
    type Buffer;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rounded reads are refused outside a half product with a half result, on every
    /// backend alike (they all call these checks).
    #[test]
    fn a_rounded_read_needs_a_half_product_with_a_half_result() {
        let ctx = Ctx::new("gemm");
        let dims = Mnk { m: 2, k: 3, n: 4 };
        let rounded = Gemm {
            rounded_b: true,
            ..Gemm::plain(dims, false, true)
        };
        for dtype in [DType::BF16, DType::F16] {
            assert!(rounded.check_rounded(&ctx, dtype).is_ok());
            let into_f32 = Gemm {
                operands: Some(dtype),
                ..rounded
            };
            let err = into_f32.check_rounded(&ctx, DType::F32).unwrap_err();
            assert!(matches!(err, Error::Unsupported { .. }), "{err}");
        }
        assert!(rounded.check_rounded(&ctx, DType::F32).is_err());
        assert!(Gemm::plain(dims, false, false)
            .check_rounded(&ctx, DType::F32)
            .is_ok());
        let layer = Linear {
            dims,
            relu: true,
            rounded_w: true,
        };
        assert!(layer.check_rounded(&ctx, DType::BF16).is_ok());
        assert!(layer.check_rounded(&ctx, DType::F64).is_err());
        let plain = Linear {
            rounded_w: false,
            ..layer
        };
        assert!(plain.check_rounded(&ctx, DType::F64).is_ok());
    }
}
