//! Gradients: arrays that require them ([`NDArray::set_requires_gradient`]), the
//! [`GradientCollector`] whose tape records the ops on them, and `backward`.
//!
//! # Where the memory goes
//!
//! The tape is a list of op records on the thread (its capacity kept from one collector to the
//! next, so a steady training loop does not grow it). A record holds **handles** to the arrays
//! its backward reads, never copies: they stay where the forward pass put them (the active
//! scope; a workspace cycle in a training step). `backward`'s temporaries (the intermediate
//! gradients) are op results like any other: in the thread's active scope, else in the
//! collector's manager. Only the last step writes into the `gradient()` arrays, which belong to
//! the manager of the array they are the gradient of.
//!
//! # Safety of the values
//!
//! Before computing anything, `backward` checks every array the tape saved: one closed since
//! (its scope ended, `close()`, a circular workspace overwrote it) gives `ArrayClosed` naming
//! the array, the op that saved it and where that op was called; one written in place since
//! (every in-place op bumps an array's version) gives `InvalidArgument`, as PyTorch's "modified
//! by an inplace operation". Nothing is accumulated then. An in-place op that reads an array
//! the open collector tracks is refused when it is called (it would not be recorded).

mod backward;
mod leaf;
pub(crate) mod pending;
mod tape;

use std::marker::PhantomData;
use std::panic::Location;
use std::sync::Arc;

use crate::arena::ArrayShared;
use crate::error::Ctx;
use crate::manager::Manager;
use crate::ndarray::hooks::{ExecObserver, Observer};
use crate::{NDArray, Result};

pub(crate) use tape::{
    check_inplace_sources, is_recorded_result, record, recording, tracked, Backward, Pause,
};

/// The tape observes how ops run: exec settles a gradient's pending product before any access
/// to its bytes, and asks before an in-place op reads arrays the recording collector tracks.
impl ExecObserver for Observer {
    #[inline]
    fn settle(ctx: &Ctx, array: &Arc<ArrayShared>) -> Result<()> {
        pending::settle(ctx, array)
    }

    #[inline]
    fn inplace_reads(ctx: &Ctx, sources: &[&NDArray]) -> Result<()> {
        check_inplace_sources(ctx, sources)
    }
}

/// Records the ops of this thread on a tape while it is open, for [`backward`](Self::backward)
/// (DJL's `GradientCollector`, PyTorch's autograd recording). Made by
/// [`Manager::gradient_collector`] or [`gradient_collector`]; one per thread at a time (a second
/// is an error); threads record independently. Closing or dropping it frees the tape.
///
/// Every op on this thread with an input that requires gradients, or that was computed from
/// one while the collector records, is recorded. [`no_gradient`] (or a [`NoGradientGuard`])
/// turns recording off for a while; `Predictor` and `ParallelInference` never record.
///
/// ```
/// use ndscope::{DType, Manager};
/// let model = Manager::new_base();
/// let w = model.from_slice(&[1.0f32, 2.0, 3.0], [3])?.with_name("w");
/// w.set_requires_gradient(true)?;
/// let step = model.sub_scope()?;
/// {
///     let _active = step.activate();
///     let collector = step.gradient_collector()?;
///     let loss = w.square()?.sum_all()?;        // Σ w²
///     collector.backward(&loss)?;               // d/dw = 2w, added into w's gradient
/// }
/// assert_eq!(w.gradient()?.to_vec::<f32>()?, vec![2.0, 4.0, 6.0]);
/// assert_eq!(w.gradient()?.name().as_deref(), Some("w.grad"));
/// step.close()?;                                // the tape's arrays go with the step
/// # Ok::<(), ndscope::Error>(())
/// ```
#[must_use = "the tape records only while the collector lives"]
pub struct GradientCollector {
    manager: Manager,
    opened_at: &'static Location<'static>,
    /// Not `Send`: the tape is this thread's.
    _thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for GradientCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GradientCollector")
            .field("manager", &self.manager)
            .field("opened_at", &self.opened_at)
            .finish()
    }
}

impl Manager {
    /// Opens a [`GradientCollector`] on this thread (DJL's `trainer.newGradientCollector()`).
    /// `backward`'s temporaries go to the thread's active scope, else to this manager.
    ///
    /// Errors: `InvalidArgument` when a collector is already open on this thread (naming where
    /// it was opened); `Capped` when this manager is capped (backward's temporaries would be
    /// left in it); `ManagerClosed`.
    #[track_caller]
    pub fn gradient_collector(&self) -> Result<GradientCollector> {
        let ctx = Ctx::new("Manager::gradient_collector");
        if self.is_capped() {
            return Err(crate::state::capped(
                &ctx,
                &self.0,
                "a gradient collector would leave backward's temporaries in it (open it on the \
                 step's scope instead)"
                    .to_string(),
            ));
        }
        tape::open(&ctx)?;
        Ok(GradientCollector {
            manager: self.clone(),
            opened_at: ctx.at,
            _thread: PhantomData,
        })
    }
}

/// Opens a [`GradientCollector`] for the thread's active scope (see
/// [`Manager::gradient_collector`]). `InvalidArgument` when no scope is active.
#[track_caller]
pub fn gradient_collector() -> Result<GradientCollector> {
    let ctx = Ctx::new("gradient_collector");
    match Manager::active() {
        Some(m) => m.gradient_collector(),
        None => Err(ctx.invalid(
            "no scope is active on this thread: activate one (Manager::activate, Manager::scope, \
             a workspace cycle) or call Manager::gradient_collector",
        )),
    }
}

impl GradientCollector {
    /// Computes the gradient of the scalar `loss` (one element) with respect to every array
    /// that requires gradients and that it depends on, and **adds** it into their
    /// [`gradient`](NDArray::gradient) arrays in place (zero them with an optimizer's
    /// `zero_gradients`, or `fill_(0.0)`). The tape is then freed; recording goes on on a new
    /// one.
    ///
    /// Errors (on any, no gradient array changed): `ShapeMismatch` when `loss` has more than one
    /// element (use [`backward_with`](Self::backward_with)); `InvalidArgument` when `loss` was
    /// not recorded by this collector (computed outside it, before it, or `backward` already
    /// ran through it), when an array the tape saved was written in place since, or when an op
    /// on the way has no gradient; `ArrayClosed` when an array the tape saved was closed.
    #[track_caller]
    pub fn backward(&self, loss: &NDArray) -> Result<()> {
        let ctx = Ctx::new("GradientCollector::backward");
        if loss.size() != 1 {
            return Err(ctx.shape(format!(
                "backward needs a scalar loss (one element), got {} of shape {} (use backward_with \
                 and a seed of its shape)",
                loss.0.describe(),
                loss.shape()
            )));
        }
        backward::run(&ctx, &self.manager, loss, None)
    }

    /// [`backward`](Self::backward) from `y` of any shape, seeded with `seed` (the gradient of
    /// some scalar with respect to `y`; same shape, dtype and device as `y`).
    #[track_caller]
    pub fn backward_with(&self, y: &NDArray, seed: &NDArray) -> Result<()> {
        let ctx = Ctx::new("GradientCollector::backward_with");
        if seed.shape() != y.shape() || seed.dtype() != y.dtype() || seed.device() != y.device() {
            return Err(ctx.shape(format!(
                "the seed must have the shape, dtype and device of {}: {} {} on {}, got {} {} on {}",
                y.0.describe(),
                y.shape(),
                y.dtype(),
                y.device(),
                seed.shape(),
                seed.dtype(),
                seed.device()
            )));
        }
        backward::run(&ctx, &self.manager, y, Some(seed))
    }

    /// The manager that receives `backward`'s temporaries when no scope is active.
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// Closes the collector and frees its tape (as dropping it does).
    pub fn close(self) {}
}

impl Drop for GradientCollector {
    fn drop(&mut self) {
        tape::close();
    }
}

/// Runs `f` with recording off on this thread (PyTorch's `torch.no_grad()`): ops in it are not
/// recorded even while a collector is open. Nests.
pub fn no_gradient<R>(f: impl FnOnce() -> R) -> R {
    let _guard = NoGradientGuard::new();
    f()
}

/// While it lives, ops on this thread are not recorded (see [`no_gradient`]). Guards nest. Not
/// `Send`.
#[must_use = "recording is off only while the guard lives"]
pub struct NoGradientGuard {
    _pause: Pause,
}

impl NoGradientGuard {
    /// Turns recording off on this thread until the guard is dropped.
    pub fn new() -> NoGradientGuard {
        NoGradientGuard {
            _pause: Pause::new(),
        }
    }
}

impl Default for NoGradientGuard {
    fn default() -> Self {
        NoGradientGuard::new()
    }
}

impl std::fmt::Debug for NoGradientGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NoGradientGuard")
    }
}

/// Whether a gradient collector is open and recording on this thread (PyTorch's
/// `torch.is_grad_enabled`, which is also off inside `no_grad`).
pub fn is_grad_enabled() -> bool {
    recording()
}
