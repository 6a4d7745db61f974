//! The arrays whose gradients are accumulated (PyTorch's leaves with `requires_grad`, DJL's
//! `setRequiresGradient`), and their `gradient()` arrays.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::pending::mark_zero;
use crate::error::Ctx;
use crate::ndarray::exec::{self, Target};
use crate::{NDArray, Result};

impl NDArray {
    /// Marks the array as one whose gradient a [`GradientCollector`](crate::GradientCollector)'s
    /// `backward` computes (`true`) or not (`false`). The first time, its gradient array is made:
    /// zeroed, of the same shape, dtype and device, **owned by the same manager** (so a model's
    /// gradients are the model's and close with it; allowed on a capped manager, as
    /// `restore_safetensors` is; for an array borrowed with `temp_attach`, the manager it goes
    /// back to, not the borrower) and named `"<name>.grad"`. Turning it off keeps that array.
    ///
    /// Errors: `DTypeMismatch` for an integer array (gradients need floats); `ArrayClosed`;
    /// `OutOfMemory` when the gradient does not fit.
    #[track_caller]
    pub fn set_requires_gradient(&self, requires: bool) -> Result<()> {
        let ctx = Ctx::new("NDArray::set_requires_gradient");
        if !requires {
            self.0.grad.requires.store(false, Ordering::Relaxed);
            return Ok(());
        }
        if !self.dtype().is_float() {
            return Err(self.dtype_error(
                &ctx,
                "a float dtype (f32, f64, f16, bf16) to have a gradient",
            ));
        }
        let mut slot = self.0.grad.array.lock();
        let missing = slot.as_ref().is_none_or(|g| g.closed.is_closed());
        if missing {
            let grad = self.new_companion(&ctx, "grad")?;
            *slot = Some(Arc::clone(&grad.0));
        }
        drop(slot);
        self.0.grad.requires.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// A new zeroed array of this array's shape, dtype and device that belongs with it: its
    /// gradient, an optimizer's state. Placed as a gradient is (in the manager the array
    /// belongs to, allowed on a capped one), known to hold zeros, named `"<name>.<what>"`
    /// (`"a12.<what>"` for an unnamed array). On error nothing is left.
    pub(crate) fn new_companion(&self, ctx: &Ctx, what: &str) -> Result<NDArray> {
        let (array, dirty) = exec::new_array(
            ctx,
            Target::GradientOf(self),
            self.shape().clone(),
            self.dtype(),
            self.device(),
        )?;
        if dirty {
            if let Err(e) = array.fill_(0.0) {
                exec::discard(&array);
                return Err(e);
            }
        }
        mark_zero(&array.0);
        array.set_name(&companion_name(self, what));
        Ok(array)
    }

    /// A one-element f64 zero in the manager that holds `self`, named `<self>.<what>`: an
    /// optimizer's count kept on the parameter's device.
    pub(crate) fn new_companion_count(&self, ctx: &Ctx, what: &str) -> Result<NDArray> {
        let (array, _) = exec::new_array(
            ctx,
            Target::GradientOf(self),
            [1].into(),
            crate::DType::F64,
            self.device(),
        )?;
        if let Err(e) = array.fill_(0.0) {
            exec::discard(&array);
            return Err(e);
        }
        array.set_name(&companion_name(self, what));
        Ok(array)
    }

    /// Whether [`set_requires_gradient(true)`](Self::set_requires_gradient) is in force. Results
    /// of ops on such arrays do not require gradients themselves: they are recorded on the tape
    /// while a collector is open, and only these arrays receive gradients.
    pub fn requires_gradient(&self) -> bool {
        self.0.grad.requires.load(Ordering::Relaxed)
    }

    /// The gradient array (DJL's `getGradient`, PyTorch's `.grad`): the same array every call,
    /// which `backward` adds into in place and an optimizer's `step` zeroes.
    ///
    /// Errors: `InvalidArgument` when the array does not require gradients (call
    /// [`set_requires_gradient(true)`](Self::set_requires_gradient) first); `ArrayClosed` when
    /// the gradient was closed (with its manager, or by `close`).
    #[track_caller]
    pub fn gradient(&self) -> Result<NDArray> {
        let ctx = Ctx::new("NDArray::gradient");
        if !self.requires_gradient() {
            return Err(ctx.invalid(format!(
                "{} does not require gradients, so it has no gradient (call \
                 set_requires_gradient(true) on it before recording)",
                self.0.describe()
            )));
        }
        self.gradient_array(&ctx)
    }

    /// The gradient array, for a caller that checked the array requires gradients:
    /// `ArrayClosed` (for `ctx`) when it was closed.
    pub(crate) fn gradient_array(&self, ctx: &Ctx) -> Result<NDArray> {
        let grad = self.0.grad.array.lock().clone();
        match grad {
            Some(grad) if !grad.closed.is_closed() => Ok(NDArray(grad)),
            Some(grad) => Err(grad.closed_error(ctx)),
            None => Err(ctx.invalid(format!("{} has no gradient array", self.0.describe()))),
        }
    }

    /// The gradient array if the array requires gradients and it is open (for `backward`).
    pub(crate) fn gradient_if_open(&self) -> Option<NDArray> {
        let grad = self.0.grad.array.lock().clone()?;
        (!grad.closed.is_closed()).then_some(NDArray(grad))
    }

    /// Renames the gradient after the array was renamed.
    pub(crate) fn rename_gradient(&self) {
        let grad = self.0.grad.array.lock().clone();
        if let Some(grad) = grad {
            *grad.name.lock() = Some(Arc::from(companion_name(self, "grad").as_str()));
        }
    }
}

/// `"<name>.<what>"`, or `"a12.<what>"` for an unnamed array.
fn companion_name(a: &NDArray, what: &str) -> String {
    match a.name() {
        Some(name) => format!("{name}.{what}"),
        None => format!("{}.{what}", a.id()),
    }
}
