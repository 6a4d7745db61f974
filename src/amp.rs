//! Loss scaling for f16 training: [`GradScaler`], PyTorch's `torch.amp.GradScaler`.
//!
//! f16 holds nothing below 6e-8: small gradients of an f16 forward pass (under
//! [`autocast`](crate::autocast)) round to zero. The scaler multiplies the loss by a large
//! factor before `backward`, so the gradients flow through f16 scaled up, divides them back
//! before the optimizer step, and skips the step when the scale was too large (an inf or NaN
//! gradient), lowering the scale; after `growth_interval` good steps it raises it again. bf16
//! has f32's range and needs no scaler.
//!
//! Everything the scaler decides stays on the parameters' device: the scale, the count of good
//! steps and the non-finite flag are one-element f32 arrays there, computed by ops, and the
//! optimizer's step reads the flag inside its own launches. A training step never waits for the
//! GPU to learn whether it was skipped.

use crate::error::Ctx;
use crate::{DType, Manager, NDArray, NoGradientGuard, Optimizer, Result};

/// The hyper-parameters of a [`GradScaler`]; the defaults are PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GradScalerOptions {
    /// The first scale (default 65536 = 2^16).
    pub init_scale: f64,
    /// What the scale is multiplied by after `growth_interval` steps without a non-finite
    /// gradient (default 2).
    pub growth_factor: f64,
    /// What the scale is multiplied by after a step with one (default 0.5).
    pub backoff_factor: f64,
    /// Good steps between two growths (default 2000).
    pub growth_interval: u32,
}

impl Default for GradScalerOptions {
    fn default() -> Self {
        GradScalerOptions {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
        }
    }
}

/// Dynamic loss scaling with PyTorch's `GradScaler` semantics: `scale` the loss, `backward`,
/// then [`step`](Self::step) (unscales the gradients, checks them for inf and NaN, and steps
/// the optimizer unless it found one) and [`update`](Self::update) (lowers the scale after a
/// skipped step, raises it after `growth_interval` good ones).
///
/// ```
/// use ndscope::{autocast, DType, GradScaler, Manager, Optimizer, Sgd};
/// let model = Manager::new_base();
/// let w = model.randn([4, 2], DType::F32)?;
/// w.set_requires_gradient(true)?;
/// let mut opt = Optimizer::new([&w], Sgd::new(0.1))?;
/// let mut scaler = GradScaler::new(&model)?;
/// let x = model.randn([3, 4], DType::F32)?;
/// let labels = model.from_slice(&[0i64, 1, 1], [3])?;
/// for _ in 0..2 {
///     let step = model.sub_scope()?;
///     {
///         let _active = step.activate();
///         let collector = step.gradient_collector()?;
///         let loss = {
///             let _f16 = autocast(DType::F16)?;
///             x.matmul(&w)?.softmax_cross_entropy(&labels)?    // an f16 product, f32 loss
///         };
///         collector.backward(&scaler.scale(&loss)?)?;
///         scaler.step(&mut opt)?;                              // unscale, check, step
///         scaler.update()?;
///     }
///     step.close()?;
/// }
/// assert_eq!(scaler.scale_value()?, 65536.0);
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct GradScaler {
    options: GradScalerOptions,
    /// The scale, one f32 element.
    scale: NDArray,
    /// Good steps since the scale last changed, one f32 element.
    good: NDArray,
    /// 0, or NaN when the last unscaled gradients held an inf or NaN; one f32 element.
    found: NDArray,
    /// `unscale_` ran since the last `update`.
    unscaled: bool,
}

impl GradScaler {
    /// A scaler with PyTorch's defaults, its state (three f32 scalars) made in `manager` (on
    /// its device, which must be the parameters').
    #[track_caller]
    pub fn new(manager: &Manager) -> Result<GradScaler> {
        Self::with_options(manager, GradScalerOptions::default())
    }

    /// A scaler with these options. `InvalidArgument` for a scale that is not finite and
    /// positive, a growth factor not above 1, a backoff factor not in (0, 1), or an interval of
    /// 0.
    #[track_caller]
    pub fn with_options(manager: &Manager, options: GradScalerOptions) -> Result<GradScaler> {
        let ctx = Ctx::new("GradScaler::new");
        let GradScalerOptions {
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
        } = options;
        if !(init_scale.is_finite() && init_scale > 0.0) {
            return Err(ctx.invalid(format!(
                "init_scale must be finite and above 0, got {init_scale}"
            )));
        }
        if !(growth_factor.is_finite() && growth_factor > 1.0) {
            return Err(ctx.invalid(format!(
                "growth_factor must be finite and above 1, got {growth_factor}"
            )));
        }
        if !(backoff_factor > 0.0 && backoff_factor < 1.0) {
            return Err(ctx.invalid(format!(
                "backoff_factor must lie in (0, 1), got {backoff_factor}"
            )));
        }
        if growth_interval == 0 {
            return Err(ctx.invalid("growth_interval must be at least 1"));
        }
        let scale = manager.full([], init_scale, DType::F32)?;
        let good = manager.zeros([], DType::F32)?;
        let found = manager.zeros([], DType::F32)?;
        for (a, name) in [
            (&scale, "grad-scaler.scale"),
            (&good, "grad-scaler.good-steps"),
            (&found, "grad-scaler.found-inf"),
        ] {
            a.set_name(name);
        }
        Ok(GradScaler {
            options,
            scale,
            good,
            found,
            unscaled: false,
        })
    }

    /// The options.
    pub fn options(&self) -> GradScalerOptions {
        self.options
    }

    /// `loss · scale`, recorded like any op (so `backward` of it gives scaled gradients). The
    /// result has the loss's dtype and is placed as any op's result.
    #[track_caller]
    pub fn scale(&self, loss: &NDArray) -> Result<NDArray> {
        let factor = if loss.dtype() == DType::F32 {
            self.scale.clone()
        } else {
            let _off = NoGradientGuard::new();
            self.scale.to_dtype(loss.dtype())?
        };
        loss.mul(&factor)
    }

    /// Divides every gradient of `optimizer`'s parameters by the scale, in place, and sets the
    /// non-finite flag when any of them holds an inf or NaN (PyTorch's `unscale_`: call it
    /// before clipping or reading the gradients; [`step`](Self::step) calls it otherwise).
    /// `InvalidArgument` when called twice before [`update`](Self::update).
    #[track_caller]
    pub fn unscale_(&mut self, optimizer: &Optimizer) -> Result<()> {
        let ctx = Ctx::new("GradScaler::unscale_");
        if self.unscaled {
            return Err(ctx.invalid(
                "unscale_ was already called since the last update (the gradients are unscaled)",
            ));
        }
        // Every gradient, and where it is, checked before any is changed.
        let grads = optimizer
            .parameters()
            .iter()
            .map(NDArray::gradient)
            .collect::<Result<Vec<_>>>()?;
        if let Some(g) = grads.iter().find(|g| g.device() != self.scale.device()) {
            return Err(ctx.device_mismatch(format!(
                "gradient {g:?} is on {}, the scaler's state on {}: make the scaler in a manager \
                 on the parameters' device",
                g.device(),
                self.scale.device()
            )));
        }
        let _off = NoGradientGuard::new();
        let inverse = self.scale.pow_scalar(-1.0)?;
        let mut found: Option<NDArray> = None;
        for g in &grads {
            let inv = if g.dtype() == DType::F32 {
                inverse.clone()
            } else {
                inverse.to_dtype(g.dtype())?
            };
            g.mul_(&inv)?;
            if g.size() == 0 {
                continue;
            }
            // An inf or NaN element makes the mean inf or NaN (accumulated in f64, so finite
            // gradients cannot overflow it), and 0·mean is then NaN, else 0: the flag, made of
            // one-element arrays only, compared nowhere on the host.
            let mut flag = g.mean_all()?.mul_scalar(0.0)?;
            if flag.dtype() != DType::F32 {
                flag = flag.to_dtype(DType::F32)?;
            }
            found = Some(match found {
                None => flag,
                Some(f) => f.add(&flag)?,
            });
        }
        match found {
            Some(f) => self.found.assign_(&f)?,
            None => self.found.fill_(0.0)?,
        }
        self.unscaled = true;
        Ok(())
    }

    /// Unscales the gradients (unless [`unscale_`](Self::unscale_) already did) and steps
    /// `optimizer`, skipping the step when a gradient held an inf or NaN: then no parameter or
    /// state changes and the gradients are zeroed (see [`Optimizer::step`]). The device decides
    /// (the optimizer's kernels read the flag): on the CPU a skipped step is not counted in
    /// [`Optimizer::steps`], as PyTorch's; on a GPU the host does not learn it and counts it in
    /// `steps`, but Adam's bias corrections follow a count the device keeps of the steps taken,
    /// so they go on from the last step taken there too (PyTorch's fused Adam does the same).
    #[track_caller]
    pub fn step(&mut self, optimizer: &mut Optimizer) -> Result<()> {
        let ctx = Ctx::new("GradScaler::step");
        if !self.unscaled {
            self.unscale_(optimizer)?;
        }
        optimizer.step_unless(&ctx, Some(&self.found))
    }

    /// The scale for the next step: times `backoff_factor` after a skipped step (and the count
    /// of good steps back to 0), times `growth_factor` after `growth_interval` good steps in a
    /// row; computed on the device.
    #[track_caller]
    pub fn update(&mut self) -> Result<()> {
        let _off = NoGradientGuard::new();
        let o = self.options;
        // ok: 1 after a good step, 0 after a skipped one (NaN == 0 is false).
        let ok = self.found.eq_scalar(0.0)?.to_dtype(DType::F32)?;
        self.good.assign_(&self.good.add_scalar(1.0)?.mul(&ok)?)?;
        let grow = self
            .good
            .eq_scalar(f64::from(o.growth_interval))?
            .to_dtype(DType::F32)?;
        // backoff after a skip, 1 after a good step, growth after the interval's last one.
        let factor = ok
            .mul_scalar(1.0 - o.backoff_factor)?
            .add_scalar(o.backoff_factor)?
            .add(&grow.mul_scalar(o.growth_factor - 1.0)?)?;
        self.scale.mul_(&factor)?;
        self.good.mul_(&grow.mul_scalar(-1.0)?.add_scalar(1.0)?)?;
        self.unscaled = false;
        Ok(())
    }

    /// The current scale, read back (a wait for the device on a GPU: for logs, not every step).
    #[track_caller]
    pub fn scale_value(&self) -> Result<f32> {
        self.scale.to_scalar::<f32>()
    }

    /// Whether the last unscaled gradients held an inf or NaN (so the step was skipped), read
    /// back (a wait for the device on a GPU).
    #[track_caller]
    pub fn found_non_finite(&self) -> Result<bool> {
        Ok(self.found.to_scalar::<f32>()? != 0.0)
    }

    /// Good steps in a row since the scale last changed, read back.
    #[track_caller]
    pub fn good_steps(&self) -> Result<u32> {
        Ok(self.good.to_scalar::<f32>()? as u32)
    }
}

impl std::fmt::Debug for GradScaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradScaler")
            .field("options", &self.options)
            .field("unscaled", &self.unscaled)
            .finish_non_exhaustive()
    }
}
