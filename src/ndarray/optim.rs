//! The fused optimizer steps: [`NDArray::sgd_update_`] ([`SgdUpdate`], PyTorch's `optim.SGD`)
//! and [`NDArray::adam_update_`] ([`AdamUpdate`], `optim.Adam` and `optim.AdamW`), each one
//! pass over the parameters, their gradient and their state, in place on any device.

use crate::backend::contract::{AdamCoeffs, OptimOps, SgdCoeffs};
use crate::backend::AnyDevice;
use crate::error::Ctx;
use crate::{DType, NDArray, Result};

use super::exec;
use super::ops::check_same;

/// The hyper-parameters of one SGD step ([`NDArray::sgd_update_`]), PyTorch's `optim.SGD` with
/// dampening 0. Start from [`SgdUpdate::new`] and set the fields to change:
///
/// ```
/// let step = ndscope::SgdUpdate { momentum: 0.9, nesterov: true, ..ndscope::SgdUpdate::new(0.01) };
/// assert_eq!((step.lr, step.weight_decay), (0.01, 0.0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdUpdate {
    /// The learning rate (finite, at least 0).
    pub lr: f64,
    /// The momentum (finite, at least 0); above 0 it needs a velocity.
    pub momentum: f64,
    /// The L2 penalty added to the gradient, `g = grad + weight_decay·p` (finite, at least 0).
    pub weight_decay: f64,
    /// Nesterov momentum, `d = g + momentum·v` instead of `v` (needs a momentum above 0).
    pub nesterov: bool,
}

impl SgdUpdate {
    /// Plain SGD at learning rate `lr`: no momentum, no weight decay, no Nesterov.
    pub fn new(lr: f64) -> SgdUpdate {
        SgdUpdate {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    /// Checks the hyper-parameters: `lr`, `momentum` and `weight_decay` finite and at least 0,
    /// Nesterov only with a momentum above 0 (`InvalidArgument` naming the one that is not).
    pub(crate) fn check(&self, ctx: &Ctx) -> Result<()> {
        check_non_negative(ctx, "lr", self.lr)?;
        check_non_negative(ctx, "momentum", self.momentum)?;
        check_non_negative(ctx, "weight_decay", self.weight_decay)?;
        if self.nesterov && self.momentum <= 0.0 {
            return Err(ctx.invalid("nesterov needs a momentum above 0"));
        }
        Ok(())
    }

    /// The kernels' coefficients, zeroing the gradient with `zero_grad`.
    fn coeffs(&self, zero_grad: bool) -> SgdCoeffs {
        SgdCoeffs {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
            zero_grad,
        }
    }
}

/// The hyper-parameters of one Adam or AdamW step ([`NDArray::adam_update_`]), PyTorch's
/// `optim.Adam` / `optim.AdamW` with amsgrad off. Start from [`AdamUpdate::new`] and set the
/// fields to change:
///
/// ```
/// let step = ndscope::AdamUpdate { weight_decay: 0.01, decoupled: true, ..ndscope::AdamUpdate::new(1e-3, 1) };
/// assert_eq!((step.beta1, step.beta2, step.eps), (0.9, 0.999, 1e-8));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamUpdate {
    /// The learning rate (finite, at least 0).
    pub lr: f64,
    /// The first moment's decay `β1`, in `[0, 1)`.
    pub beta1: f64,
    /// The second moment's decay `β2`, in `[0, 1)`.
    pub beta2: f64,
    /// Added to the denominator (finite, above 0).
    pub eps: f64,
    /// The weight decay (finite, at least 0): added to the gradient as an L2 penalty (Adam), or
    /// decoupled (AdamW).
    pub weight_decay: f64,
    /// AdamW: `p ← p·(1 − lr·weight_decay)` before the step instead of the L2 penalty.
    pub decoupled: bool,
    /// The step's number, from 1 (the bias corrections `1 − β^step`).
    pub step: u64,
}

impl AdamUpdate {
    /// Adam at learning rate `lr` for step number `step` (from 1), with PyTorch's defaults:
    /// `β1 = 0.9`, `β2 = 0.999`, `eps = 1e-8`, no weight decay.
    pub fn new(lr: f64, step: u64) -> AdamUpdate {
        AdamUpdate {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            decoupled: false,
            step,
        }
    }

    /// Checks the hyper-parameters: `lr` and `weight_decay` finite and at least 0, the betas in
    /// `[0, 1)`, `eps` finite and above 0, `step` at least 1 (`InvalidArgument` naming the one
    /// that is not).
    pub(crate) fn check(&self, ctx: &Ctx) -> Result<()> {
        check_non_negative(ctx, "lr", self.lr)?;
        check_non_negative(ctx, "weight_decay", self.weight_decay)?;
        for (what, beta) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&beta) {
                return Err(ctx.invalid(format!("{what} must be in [0, 1), got {beta}")));
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return Err(ctx.invalid(format!("eps must be finite and above 0, got {}", self.eps)));
        }
        if self.step == 0 {
            return Err(ctx.invalid("step counts from 1, got 0"));
        }
        Ok(())
    }

    /// The kernels' coefficients (the bias corrections computed here, once), zeroing the
    /// gradient with `zero_grad`.
    fn coeffs(&self, zero_grad: bool) -> AdamCoeffs {
        // β^t in f64, as Python's `beta ** step` (a step beyond 2^53 rounds: β^t is 0 there).
        let power = |beta: f64| beta.powf(self.step as f64);
        let bias1 = 1.0 - power(self.beta1);
        let bias2 = 1.0 - power(self.beta2);
        AdamCoeffs {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decay: self.decoupled.then_some(1.0 - self.lr * self.weight_decay),
            step_size: self.lr / bias1,
            bias2_sqrt: bias2.sqrt(),
            zero_grad,
        }
    }
}

/// `InvalidArgument` unless `value` is finite and at least 0.
fn check_non_negative(ctx: &Ctx, what: &str, value: f64) -> Result<()> {
    if value.is_finite() && value >= 0.0 {
        Ok(())
    } else {
        Err(ctx.invalid(format!("{what} must be finite and at least 0, got {value}")))
    }
}

impl NDArray {
    /// Checks an optimizer step's operands: `self` a float array, every other of its dtype,
    /// device and shape, and all of them distinct arrays.
    fn check_optim_operands(&self, ctx: &Ctx, grad: &NDArray, state: &[&NDArray]) -> Result<()> {
        if !self.dtype().is_float() {
            return Err(self.dtype_error(ctx, "a float dtype (f32, f64, f16, bf16)"));
        }
        for other in std::iter::once(grad).chain(state.iter().copied()) {
            check_same(ctx, self, other)?;
            if other.dims() != self.dims() {
                return Err(ctx.shape(format!(
                    "the parameters {} have shape {}, but {} has shape {}",
                    self.0.describe(),
                    self.shape(),
                    other.0.describe(),
                    other.shape()
                )));
            }
        }
        let all: [Option<&NDArray>; 4] = [
            Some(self),
            Some(grad),
            state.first().copied(),
            state.get(1).copied(),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                if let (Some(a), Some(b)) = (a, b) {
                    if a == b {
                        return Err(ctx.invalid(format!(
                            "the parameters, their gradient and their state must be distinct \
                             arrays; {} is passed twice",
                            a.0.describe()
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// One step of SGD (PyTorch's `optim.SGD`, dampening 0) on the parameters `self` in place,
    /// with their gradient `grad` and, for momentum, their `velocity` (which starts at zero and
    /// changes in place):
    ///
    /// `g = grad + weight_decay·self;  velocity ← momentum·velocity + g;
    /// d = nesterov ? g + momentum·velocity : velocity;  self ← self − lr·d`
    ///
    /// Without a velocity (momentum 0), `self ← self − lr·g`. One fused pass over the elements,
    /// on the CPU (in parallel for large arrays) or the array's GPU.
    ///
    /// All arrays share one float dtype and device (`DTypeMismatch`, `DeviceMismatch`) and
    /// `self`'s shape (`ShapeMismatch`), and are distinct arrays; the hyper-parameters are
    /// finite and at least 0, a momentum above 0 needs a velocity, and Nesterov a momentum above
    /// 0 (`InvalidArgument`, naming the parameter). `grad` is only read, but it is locked for
    /// writing while the step runs (the same kernel zeroes it for [`Optimizer::step`]).
    /// Allocates nothing; on error nothing changes.
    ///
    /// [`Optimizer::step`]: crate::Optimizer::step
    ///
    /// ```
    /// use ndscope::{Manager, SgdUpdate};
    /// let m = Manager::new_base();
    /// let p = m.from_slice(&[1.0f32, 2.0], [2])?;
    /// let grad = m.from_slice(&[10.0f32, -10.0], [2])?;
    /// let velocity = m.zeros([2], ndscope::DType::F32)?;
    /// let step = SgdUpdate { momentum: 0.5, ..SgdUpdate::new(0.1) };
    /// p.sgd_update_(&grad, Some(&velocity), step)?;
    /// assert_eq!(velocity.to_vec::<f32>()?, vec![10.0, -10.0]); // 0.5·0 + grad
    /// assert_eq!(p.to_vec::<f32>()?, vec![0.0, 3.0]);           // p − 0.1·velocity
    /// p.sgd_update_(&grad, Some(&velocity), step)?;
    /// assert_eq!(velocity.to_vec::<f32>()?, vec![15.0, -15.0]); // 0.5·10 + 10
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn sgd_update_(
        &self,
        grad: &NDArray,
        velocity: Option<&NDArray>,
        step: SgdUpdate,
    ) -> Result<()> {
        let ctx = Ctx::new("sgd_update_");
        let state = velocity.as_slice();
        self.check_optim_operands(&ctx, grad, state)?;
        step.check(&ctx)?;
        if step.momentum > 0.0 && velocity.is_none() {
            return Err(ctx.invalid(format!(
                "momentum {} needs a velocity array (zeros before the first step)",
                step.momentum
            )));
        }
        let dtype = self.dtype();
        let coeffs = step.coeffs(false);
        // Only read: refused while a collector tracks it, as any in-place op's source.
        crate::ndarray::autograd::check_inplace_sources(&ctx, &[grad])?;
        exec::inplace_state_grad(&ctx, self, state, grad, |p, [v, _], g| {
            AnyDevice::sgd_update(&ctx, dtype, g, p, v, coeffs)
        })
    }

    /// One step of Adam, or AdamW with `decoupled` (PyTorch's `optim.Adam` / `optim.AdamW`,
    /// amsgrad off), on the parameters `self` in place, with their gradient `grad` and their
    /// first and second moments `m` and `v` (which start at zero and change in place), `t`
    /// being `step.step`:
    ///
    /// `decoupled ? self ← self·(1 − lr·weight_decay) : g = grad + weight_decay·self;
    /// m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;
    /// self ← self − lr·m̂ / (√v̂ + eps)` with `m̂ = m/(1−β1^t)`, `v̂ = v/(1−β2^t)`.
    ///
    /// The bias corrections are computed once per call in f64; the elements are updated in one
    /// fused pass in their own precision, on the CPU (in parallel for large arrays) or the
    /// array's GPU.
    ///
    /// All arrays share one float dtype and device (`DTypeMismatch`, `DeviceMismatch`) and
    /// `self`'s shape (`ShapeMismatch`), and are distinct arrays; `lr` and `weight_decay` are
    /// finite and at least 0, the betas in `[0, 1)`, `eps` finite and above 0, `step` at least
    /// 1 (`InvalidArgument`, naming the parameter). `grad` is only read, but it is locked for
    /// writing while the step runs (the same kernel zeroes it for [`Optimizer::step`]).
    /// Allocates nothing; on error nothing changes.
    ///
    /// [`Optimizer::step`]: crate::Optimizer::step
    ///
    /// ```
    /// use ndscope::{AdamUpdate, DType, Manager};
    /// let mg = Manager::new_base();
    /// let p = mg.from_slice(&[1.0f64, -1.0], [2])?;
    /// let grad = mg.from_slice(&[0.5f64, -2.0], [2])?;
    /// let (m, v) = (mg.zeros([2], DType::F64)?, mg.zeros([2], DType::F64)?);
    /// p.adam_update_(&grad, &m, &v, AdamUpdate::new(0.1, 1))?;
    /// // The first step moves each parameter by about lr against its gradient's sign.
    /// let got = p.to_vec::<f64>()?;
    /// assert!((got[0] - 0.9).abs() < 1e-6 && (got[1] + 0.9).abs() < 1e-6);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn adam_update_(
        &self,
        grad: &NDArray,
        m: &NDArray,
        v: &NDArray,
        step: AdamUpdate,
    ) -> Result<()> {
        let ctx = Ctx::new("adam_update_");
        self.check_optim_operands(&ctx, grad, &[m, v])?;
        step.check(&ctx)?;
        let dtype = self.dtype();
        let coeffs = step.coeffs(false);
        // Only read: refused while a collector tracks it, as any in-place op's source.
        crate::ndarray::autograd::check_inplace_sources(&ctx, &[grad])?;
        exec::inplace_state_grad(&ctx, self, &[m, v], grad, |p, [m, v], g| match (m, v) {
            (Some(m), Some(v)) => AnyDevice::adam_update(&ctx, dtype, g, p, (m, v), coeffs),
            _ => Err(ctx.invalid("adam_update_ needs both moments")),
        })
    }

    /// One SGD step of many parameters of one dtype and device at once ([`Optimizer::step`]):
    /// `count` tensors of `depth` arrays each, `array(t, role)` giving tensor `t`'s gradient
    /// (role 0), parameter (1) and velocity (2, with momentum), every gradient set to zero in
    /// the same pass. The caller checked the operands (open, one dtype, device and shape per
    /// tensor, distinct) and `step`; pending gradients are settled first. One launch per group
    /// of tensors on a GPU; the same arithmetic as [`sgd_update_`](Self::sgd_update_). Reuses
    /// `locks`' memory.
    ///
    /// [`Optimizer::step`]: crate::Optimizer::step
    pub(crate) fn sgd_step_many<'a>(
        ctx: &Ctx,
        locks: &mut exec::ManyLocks,
        (dtype, count, depth): (DType, usize, usize),
        array: impl Fn(usize, usize) -> &'a NDArray,
        step: SgdUpdate,
        skip: Option<&'a NDArray>,
    ) -> Result<()> {
        let coeffs = step.coeffs(true);
        exec::locked_steps(ctx, locks, (count, depth), array, (skip, None), |tensors| {
            AnyDevice::sgd_update_multi(ctx, dtype, tensors, coeffs)
        })
    }

    /// One Adam (or AdamW) step of many parameters of one dtype and device at once, as
    /// [`sgd_step_many`](Self::sgd_step_many) (roles: gradient, parameter, `m`, `v`), with the
    /// arithmetic of [`adam_update_`](Self::adam_update_). With `counter` (one f64 element on
    /// the parameters' device: the steps taken), the bias corrections are those of step
    /// `counter + 1`, computed on that device, and the counter goes up unless `skip` skips the
    /// step (see `StepTensors::step_count`).
    pub(crate) fn adam_step_many<'a>(
        ctx: &Ctx,
        locks: &mut exec::ManyLocks,
        (dtype, count): (DType, usize),
        array: impl Fn(usize, usize) -> &'a NDArray,
        step: AdamUpdate,
        (skip, counter): (Option<&'a NDArray>, Option<&'a NDArray>),
    ) -> Result<()> {
        let coeffs = step.coeffs(true);
        exec::locked_steps(ctx, locks, (count, 4), array, (skip, counter), |tensors| {
            AnyDevice::adam_update_multi(ctx, dtype, tensors, coeffs)
        })
    }
}
