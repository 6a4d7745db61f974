//! Optimizers: an [`Optimizer`] running [`Sgd`], [`Adam`] or [`AdamW`] (DJL's `Optimizer` and
//! `trainer.step()`, PyTorch's `torch.optim`) holds a model's parameters and their state and
//! updates them in place with the arithmetic of the fused steps [`NDArray::sgd_update_`] and
//! [`NDArray::adam_update_`], all the parameters of a device and dtype in one multi-tensor pass
//! (one kernel launch on a GPU), then zeroes their gradients.
//!
//! # Where the memory goes
//!
//! The state (SGD's velocity when the momentum is above 0; Adam's and AdamW's first and second
//! moments) is made **once**, when the optimizer is made, zeroed, in the manager that holds each
//! parameter, as its [`gradient`](NDArray::gradient) is (allowed on a capped model; closed with
//! it), and named `"<parameter name>.velocity"`, `".m"` and `".v"` (`"a12.velocity"` for an
//! unnamed one). [`Optimizer::step`] then allocates nothing at all: no array, no heap memory,
//! so it runs inside a learned workspace step that must allocate nothing.

use std::borrow::Borrow;
use std::collections::HashMap;

use crate::error::Ctx;
use crate::ndarray::autograd::pending;
use crate::ndarray::exec::ManyLocks;
use crate::{AdamUpdate, DType, Device, NDArray, NoGradientGuard, Result, SgdUpdate};

/// Stochastic gradient descent (PyTorch's `optim.SGD` with dampening 0, DJL's `Sgd`):
///
/// `g = grad + weight_decay·p;  v ← momentum·v + g;  d = nesterov ? g + momentum·v : v;
/// p ← p − lr·d` (without momentum, `p ← p − lr·g`, and no velocity is kept).
///
/// ```
/// let sgd = ndscope::Sgd { momentum: 0.9, nesterov: true, ..ndscope::Sgd::new(0.01) };
/// assert_eq!((sgd.lr, sgd.weight_decay), (0.01, 0.0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// The learning rate (finite, at least 0).
    pub lr: f64,
    /// The momentum (finite, at least 0); above 0 a velocity is kept per parameter.
    pub momentum: f64,
    /// The L2 penalty added to the gradient, `g = grad + weight_decay·p` (finite, at least 0).
    pub weight_decay: f64,
    /// Nesterov momentum (needs a momentum above 0).
    pub nesterov: bool,
}

impl Sgd {
    /// Plain SGD at learning rate `lr`: no momentum, no weight decay, no Nesterov.
    pub fn new(lr: f64) -> Sgd {
        Sgd {
            lr,
            momentum: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }

    fn update(&self) -> SgdUpdate {
        SgdUpdate {
            lr: self.lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
            nesterov: self.nesterov,
        }
    }
}

/// Adam (PyTorch's `optim.Adam`, amsgrad off), the weight decay added to the gradient as an L2
/// penalty, `g = grad + weight_decay·p`, then, at step `t` (from 1):
///
/// `m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²;  p ← p − lr·m̂ / (√v̂ + eps)` with
/// `m̂ = m/(1−β1^t)`, `v̂ = v/(1−β2^t)`.
///
/// ```
/// let adam = ndscope::Adam::new(1e-3);
/// assert_eq!((adam.betas, adam.eps, adam.weight_decay), ((0.9, 0.999), 1e-8, 0.0));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// The learning rate (finite, at least 0).
    pub lr: f64,
    /// The moments' decays `(β1, β2)`, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator (finite, above 0).
    pub eps: f64,
    /// The L2 penalty added to the gradient (finite, at least 0).
    pub weight_decay: f64,
}

impl Adam {
    /// Adam at learning rate `lr` with PyTorch's defaults: betas `(0.9, 0.999)`, eps `1e-8`, no
    /// weight decay.
    pub fn new(lr: f64) -> Adam {
        Adam {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

/// AdamW (PyTorch's `optim.AdamW`, amsgrad off): Adam with the weight decay decoupled from the
/// gradient, `p ← p·(1 − lr·weight_decay)` before [`Adam`]'s update (which then sees the plain
/// gradient).
///
/// ```
/// let adamw = ndscope::AdamW::new(1e-3);
/// assert_eq!((adamw.betas, adamw.eps, adamw.weight_decay), ((0.9, 0.999), 1e-8, 0.01));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// The learning rate (finite, at least 0).
    pub lr: f64,
    /// The moments' decays `(β1, β2)`, each in `[0, 1)`.
    pub betas: (f64, f64),
    /// Added to the denominator (finite, above 0).
    pub eps: f64,
    /// The decoupled weight decay (finite, at least 0).
    pub weight_decay: f64,
}

impl AdamW {
    /// AdamW at learning rate `lr` with PyTorch's defaults: betas `(0.9, 0.999)`, eps `1e-8`,
    /// weight decay `0.01`.
    pub fn new(lr: f64) -> AdamW {
        AdamW {
            lr,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Which rule an [`Optimizer`] runs, with its hyper-parameters. Made from [`Sgd`], [`Adam`] or
/// [`AdamW`] with `into()` (as [`Optimizer::new`] does).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerKind {
    /// Stochastic gradient descent.
    Sgd(Sgd),
    /// Adam, weight decay as an L2 penalty.
    Adam(Adam),
    /// AdamW, decoupled weight decay.
    AdamW(AdamW),
}

impl From<Sgd> for OptimizerKind {
    fn from(sgd: Sgd) -> OptimizerKind {
        OptimizerKind::Sgd(sgd)
    }
}

impl From<Adam> for OptimizerKind {
    fn from(adam: Adam) -> OptimizerKind {
        OptimizerKind::Adam(adam)
    }
}

impl From<AdamW> for OptimizerKind {
    fn from(adamw: AdamW) -> OptimizerKind {
        OptimizerKind::AdamW(adamw)
    }
}

impl OptimizerKind {
    /// The learning rate.
    pub fn lr(&self) -> f64 {
        match self {
            OptimizerKind::Sgd(s) => s.lr,
            OptimizerKind::Adam(a) => a.lr,
            OptimizerKind::AdamW(a) => a.lr,
        }
    }

    fn with_lr(mut self, lr: f64) -> OptimizerKind {
        match &mut self {
            OptimizerKind::Sgd(s) => s.lr = lr,
            OptimizerKind::Adam(a) => a.lr = lr,
            OptimizerKind::AdamW(a) => a.lr = lr,
        }
        self
    }

    /// The fused Adam step's parameters at step `step`, for Adam and AdamW.
    fn adam_update(&self, step: u64) -> Option<AdamUpdate> {
        let (lr, (beta1, beta2), eps, weight_decay, decoupled) = match *self {
            OptimizerKind::Sgd(_) => return None,
            OptimizerKind::Adam(a) => (a.lr, a.betas, a.eps, a.weight_decay, false),
            OptimizerKind::AdamW(a) => (a.lr, a.betas, a.eps, a.weight_decay, true),
        };
        Some(AdamUpdate {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decoupled,
            step,
        })
    }

    /// `InvalidArgument` naming the first hyper-parameter out of range (the fused steps' own
    /// checks).
    fn check(&self, ctx: &Ctx) -> Result<()> {
        match (self, self.adam_update(1)) {
            (OptimizerKind::Sgd(s), _) => s.update().check(ctx),
            (_, Some(update)) => update.check(ctx),
            (_, None) => Ok(()),
        }
    }

    /// The names of the state kept per parameter.
    fn state_names(&self) -> &'static [&'static str] {
        match self {
            OptimizerKind::Sgd(s) if s.momentum == 0.0 => &[],
            OptimizerKind::Sgd(_) => &["velocity"],
            OptimizerKind::Adam(_) | OptimizerKind::AdamW(_) => &["m", "v"],
        }
    }
}

/// One parameter's gradient and state.
#[derive(Debug)]
struct Slot {
    /// The parameter's gradient array (looked up again before each step, in case it was made
    /// anew after being closed).
    grad: NDArray,
    /// The velocity (SGD with momentum), the moments `[m, v]` (Adam, AdamW), or nothing.
    state: Vec<NDArray>,
}

/// A model's parameters with an optimizer's rule and state: DJL's `Optimizer` with
/// `trainer.step()`, PyTorch's `torch.optim` optimizers with `opt.step(); opt.zero_grad()`.
///
/// # Contract
///
/// - **Where the state lives.** [`new`](Self::new) makes the state once, zeroed, in the manager
///   that holds each parameter (as its gradient is: allowed on a capped model, closed with
///   it): SGD's `"<name>.velocity"` when the momentum is above 0, Adam's and AdamW's `"<name>.m"`
///   and `"<name>.v"`. Nothing else is ever allocated for it.
/// - **What [`step`](Self::step) does.** For the parameters of each device and dtype, one
///   multi-tensor pass (on a GPU one kernel launch per 64 parameters) that updates every
///   parameter and its state in place from its [`gradient`](NDArray::gradient) and sets the
///   gradient to zero once read, ready for the next `backward` (which adds into it), with the
///   arithmetic of [`NDArray::sgd_update_`] and [`NDArray::adam_update_`] bit for bit. A
///   weight gradient backward left to compute (`xᵀ·g`) is fused into the parameter's update on
///   the CPU (SGD without weight decay or Nesterov), and on a GPU computed by one matrix
///   product written straight into the gradient before the launch. Adam's step count (its bias
///   corrections) goes up by one per `step`.
/// - **Zero allocations.** `step` and [`zero_gradients`](Self::zero_gradients) make no array and
///   no heap allocation, so they run inside a learned workspace step that allocates nothing.
/// - **Not recorded.** `step` runs with recording off ([`NoGradientGuard`]), so it may be called
///   while a [`GradientCollector`](crate::GradientCollector) is open: nothing goes on its tape.
///   (A parameter the open tape saved and `step` then changes makes that tape's `backward`
///   refuse, as any in-place write does.)
/// - **Checked first.** Every parameter, gradient and state array is checked open (and every
///   parameter still requiring gradients) before any is changed: on error nothing changed.
///
/// ```
/// use ndscope::{Manager, Optimizer, Sgd};
/// let model = Manager::new_base();
/// let w = model.from_slice(&[1.0f32, -2.0], [2])?.with_name("w");
/// w.set_requires_gradient(true)?;
/// let mut optimizer = Optimizer::new([&w], Sgd::new(0.25))?;
/// for _ in 0..2 {
///     let step = model.sub_scope()?;
///     {
///         let _active = step.activate();
///         let collector = step.gradient_collector()?;
///         let loss = w.square()?.sum_all()?;    // Σ w², gradient 2w
///         collector.backward(&loss)?;
///     }
///     optimizer.step()?;                        // w ← w − 0.25·2w, then w's gradient ← 0
///     step.close()?;
/// }
/// assert_eq!(w.to_vec::<f32>()?, vec![0.25, -0.5]);
/// assert_eq!(w.gradient()?.to_vec::<f32>()?, vec![0.0, 0.0]);
/// assert_eq!(optimizer.steps(), 2);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Debug)]
pub struct Optimizer {
    kind: OptimizerKind,
    params: Vec<NDArray>,
    slots: Vec<Slot>,
    steps: u64,
    /// The parameters' indices grouped by device and dtype (one multi-tensor step each), in
    /// the order of their first parameter.
    groups: Vec<(Device, DType, Vec<usize>)>,
    /// Adam on a GPU: each group's count of the steps taken, kept on the device (see
    /// [`Counter`]); `None` elsewhere.
    counters: Vec<Option<Counter>>,
    /// What a step reuses (boxed: the optimizer stays small to move).
    scratch: Box<Scratch>,
}

/// An Adam group's count of the steps taken, on its GPU. Unused (the host's count gives the
/// bias corrections) until a step with a skip flag the host does not read (a loss scaler's);
/// from then on the device keeps the count, adding one per step the flag does not skip, and
/// the kernels take the bias corrections from it.
#[derive(Debug)]
struct Counter {
    count: NDArray,
    live: bool,
}

/// The memory a step reuses, so that it allocates nothing.
#[derive(Debug)]
struct Scratch {
    /// The indices of a group that the multi-tensor step takes.
    batch: Vec<usize>,
    /// The memory of the step's locks.
    locks: ManyLocks,
}

impl Optimizer {
    /// An optimizer running `kind` ([`Sgd`], [`Adam`], [`AdamW`]) over `params` (a slice, a
    /// `Vec`, an [`NDList`](crate::NDList), or any iterator of arrays), which must be open,
    /// distinct, of a float dtype and require gradients
    /// ([`set_requires_gradient(true)`](NDArray::set_requires_gradient)). Makes each
    /// parameter's state, zeroed, in the manager that holds it (see the contract above).
    ///
    /// Errors, after which nothing was made: `InvalidArgument` for a hyper-parameter out of
    /// range (naming it), no parameters, a parameter passed twice, or one that does not require
    /// gradients (naming it and its place in the list); `DTypeMismatch` for an integer
    /// parameter; `ArrayClosed` for a closed parameter or gradient; `OutOfMemory` when the state
    /// does not fit.
    #[track_caller]
    pub fn new<P: Borrow<NDArray>>(
        params: impl IntoIterator<Item = P>,
        kind: impl Into<OptimizerKind>,
    ) -> Result<Optimizer> {
        let ctx = Ctx::new("Optimizer::new");
        let kind = kind.into();
        kind.check(&ctx)?;
        let params: Vec<NDArray> = params.into_iter().map(|p| p.borrow().clone()).collect();
        if params.is_empty() {
            return Err(ctx.invalid("an optimizer needs at least one parameter, got none"));
        }
        let mut seen = HashMap::with_capacity(params.len());
        let mut grads = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            if !p.is_open() {
                return Err(p.0.closed_error(&ctx));
            }
            if !p.dtype().is_float() {
                return Err(p.dtype_error(&ctx, "float parameters (f32, f64, f16 or bf16)"));
            }
            if let Some(first) = seen.insert(p.id(), i) {
                return Err(ctx.invalid(format!(
                    "parameter {} is passed twice (at {first} and {i} in the list); each \
                     parameter is optimized once",
                    p.0.describe()
                )));
            }
            grads.push(gradient(&ctx, p, i)?);
        }
        let mut slots: Vec<Slot> = Vec::with_capacity(params.len());
        for (p, grad) in params.iter().zip(grads) {
            let mut state = Vec::with_capacity(kind.state_names().len());
            for what in kind.state_names() {
                match p.new_companion(&ctx, what) {
                    Ok(array) => state.push(array),
                    Err(e) => {
                        for array in slots.iter().flat_map(|s| &s.state).chain(&state) {
                            // Closing an array of ours cannot fail (it is idempotent).
                            let _ = array.close();
                        }
                        return Err(e);
                    }
                }
            }
            slots.push(Slot { grad, state });
        }
        let mut groups: Vec<(Device, DType, Vec<usize>)> = Vec::new();
        for (i, p) in params.iter().enumerate() {
            let (device, dtype) = (p.device(), p.dtype());
            match groups.iter_mut().find(|g| (g.0, g.1) == (device, dtype)) {
                Some(group) => group.2.push(i),
                None => groups.push((device, dtype, vec![i])),
            }
        }
        let mut counters = Vec::with_capacity(groups.len());
        for (device, _, group) in &groups {
            let adam = !matches!(kind, OptimizerKind::Sgd(_));
            let counter = match (adam, device, group.first()) {
                (true, Device::Cuda(_), Some(&first)) => {
                    match params[first].new_companion_count(&ctx, "steps") {
                        Ok(count) => Some(Counter { count, live: false }),
                        Err(e) => {
                            let made = counters.iter().flatten().map(|c: &Counter| &c.count);
                            for array in slots.iter().flat_map(|s| &s.state).chain(made) {
                                let _ = array.close();
                            }
                            return Err(e);
                        }
                    }
                }
                _ => None,
            };
            counters.push(counter);
        }
        let largest = groups.iter().map(|g| g.2.len()).max().unwrap_or(0);
        Ok(Optimizer {
            kind,
            params,
            slots,
            steps: 0,
            groups,
            counters,
            scratch: Box::new(Scratch {
                batch: Vec::with_capacity(largest),
                locks: ManyLocks::with_capacity(largest * (2 + kind.state_names().len())),
            }),
        })
    }

    /// One optimizer step (DJL's `trainer.step()`, PyTorch's `opt.step(); opt.zero_grad()`):
    /// each parameter is updated in place from its gradient, and the gradient set to zero, by
    /// one multi-tensor pass per device and dtype (one kernel launch on a GPU for up to 64
    /// parameters). Allocates nothing; not recorded by an open collector. See the contract on
    /// [`Optimizer`].
    ///
    /// Errors, checked before anything changes: `ArrayClosed` for a closed parameter, gradient
    /// or state array (naming it), or for a closed operand of a weight gradient backward left
    /// to compute; `InvalidArgument` for a parameter that no longer requires gradients, or such
    /// an operand changed in place since.
    #[track_caller]
    pub fn step(&mut self) -> Result<()> {
        self.step_unless(&Ctx::new("Optimizer::step"), None)
    }

    /// [`step`](Self::step), skipped where the one-element f32 array `skip` holds anything but
    /// 0 (a loss scaler's non-finite flag): then no parameter or state changes and the
    /// gradients are only zeroed. The flag is read by the device it is on (the parameters'),
    /// inside the step's launches, so a GPU step does not wait for it. On the CPU a skipped
    /// step is not counted in [`steps`](Self::steps); on a GPU the host does not learn whether
    /// it was skipped, and counts it, while Adam's groups count the steps taken on the device
    /// (their `Counter`) and take the bias corrections from that count.
    #[track_caller]
    pub(crate) fn step_unless(&mut self, ctx: &Ctx, skip: Option<&NDArray>) -> Result<()> {
        let ctx = *ctx;
        if let Some(flag) = skip {
            if flag.dtype() != DType::F32 || flag.size() != 1 {
                return Err(ctx.invalid(format!(
                    "a step's skip flag is one f32 element, got {} {} {}",
                    flag.0.describe(),
                    flag.dtype(),
                    flag.shape()
                )));
            }
            if let Some(p) = self.params.iter().find(|p| p.device() != flag.device()) {
                return Err(ctx.device_mismatch(format!(
                    "the skip flag {} is on {}, parameter {} on {}",
                    flag.0.describe(),
                    flag.device(),
                    p.0.describe(),
                    p.device()
                )));
            }
        }
        self.check_ready(&ctx)?;
        let step = self.steps + 1;
        let _not_recorded = NoGradientGuard::new();
        let taken = self.steps;
        let Optimizer {
            kind,
            params,
            slots,
            groups,
            counters,
            scratch,
            ..
        } = self;
        let Scratch { batch, locks } = &mut **scratch;
        let kind = *kind;
        let depth = 2 + kind.state_names().len();
        for ((device, dtype, group), counter) in groups.iter().zip(counters.iter_mut()) {
            batch.clear();
            for &i in group {
                // On the CPU, a weight gradient that backward left pending (`xᵀ · g`, see
                // `autograd::pending`) goes straight into the update: one pass over the
                // parameter and its velocity, the gradient never written (it stays zero). On a
                // GPU the multi-tensor step settles it first: one product written into the
                // gradient (which holds zeros), then the one launch reads it.
                // A flagged step runs the multi-tensor kernels, which read the flag.
                let fused = match kind {
                    OptimizerKind::Sgd(sgd)
                        if skip.is_none()
                            && *device == Device::Cpu
                            && sgd.weight_decay == 0.0
                            && !sgd.nesterov =>
                    {
                        let slot = &slots[i];
                        pending::fused_sgd_step(
                            &ctx,
                            &params[i],
                            &slot.grad,
                            slot.state.first(),
                            sgd.lr,
                            sgd.momentum,
                        )?
                    }
                    _ => false,
                };
                if fused {
                    pending::mark_zero(&slots[i].grad.0);
                } else {
                    batch.push(i);
                }
            }
            if batch.is_empty() {
                continue;
            }
            // Roles: 0 the gradient, 1 the parameter, then the state (`check_ready` saw
            // `depth - 2` state arrays for every parameter).
            let array = |t: usize, role: usize| {
                let i = batch[t];
                match role {
                    0 => &slots[i].grad,
                    1 => &params[i],
                    r => &slots[i].state[r - 2],
                }
            };
            match kind {
                OptimizerKind::Sgd(sgd) => NDArray::sgd_step_many(
                    &ctx,
                    locks,
                    (*dtype, batch.len(), depth),
                    array,
                    sgd.update(),
                    skip,
                )?,
                kind => match kind.adam_update(step) {
                    Some(update) => {
                        // On a GPU a flagged step may be skipped without the host knowing:
                        // from the first one on, the device counts the steps taken.
                        let count = match counter {
                            Some(c) => {
                                if skip.is_some() && !c.live {
                                    c.count.fill_(taken as f64)?;
                                    c.live = true;
                                }
                                c.live.then_some(&c.count)
                            }
                            None => None,
                        };
                        NDArray::adam_step_many(
                            &ctx,
                            locks,
                            (*dtype, batch.len()),
                            array,
                            update,
                            (skip, count),
                        )?
                    }
                    None => return Err(missing_state(&ctx, &params[batch[0]])),
                },
            }
            // Zero now: known, so `zero_gradients` and the next backward skip it.
            for &i in batch.iter() {
                pending::mark_zero(&slots[i].grad.0);
            }
        }
        // A skip flag in host memory costs nothing to read: a skipped CPU step is not counted
        // (Adam's bias corrections continue from the last step taken, as PyTorch's).
        let skipped = match skip {
            Some(flag) if flag.device() == Device::Cpu => flag.to_scalar::<f32>()? != 0.0,
            _ => false,
        };
        if !skipped {
            self.steps = step;
        }
        Ok(())
    }

    /// Sets every parameter's gradient to zero (PyTorch's `opt.zero_grad()`), without a step.
    /// Allocates nothing.
    ///
    /// Errors, checked before any gradient changes: `ArrayClosed` for a closed parameter or
    /// gradient; `InvalidArgument` for a parameter that no longer requires gradients.
    #[track_caller]
    pub fn zero_gradients(&self) -> Result<()> {
        let ctx = Ctx::new("Optimizer::zero_gradients");
        for (i, p) in self.params.iter().enumerate() {
            if !p.is_open() {
                return Err(p.0.closed_error(&ctx));
            }
            gradient(&ctx, p, i)?;
        }
        let _not_recorded = NoGradientGuard::new();
        for (i, p) in self.params.iter().enumerate() {
            zero(&gradient(&ctx, p, i)?)?;
        }
        Ok(())
    }

    /// The learning rate.
    pub fn lr(&self) -> f64 {
        self.kind.lr()
    }

    /// Sets the learning rate for the next steps (schedules are the caller's). `InvalidArgument`
    /// unless it is finite and at least 0; then nothing changes.
    #[track_caller]
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        let ctx = Ctx::new("Optimizer::set_lr");
        let kind = self.kind.with_lr(lr);
        kind.check(&ctx)?;
        self.kind = kind;
        Ok(())
    }

    /// The rule and its hyper-parameters.
    pub fn kind(&self) -> &OptimizerKind {
        &self.kind
    }

    /// The parameters, in the order given to [`new`](Self::new).
    pub fn parameters(&self) -> &[NDArray] {
        &self.params
    }

    /// The steps taken so far (Adam's bias corrections use `steps() + 1` at the next one). On a
    /// GPU a step skipped by a loss scaler's flag is counted here (the host does not read the
    /// flag), but not by the count the device keeps for Adam's bias corrections from the first
    /// flagged step on (see [`GradScaler::step`](crate::GradScaler::step)).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The state kept for `param`: `[velocity]` (SGD with momentum), `[m, v]` (Adam, AdamW),
    /// empty (plain SGD); `None` when `param` is not one of the parameters.
    pub fn state(&self, param: &NDArray) -> Option<&[NDArray]> {
        let i = self.params.iter().position(|p| p == param)?;
        self.slots.get(i).map(|s| s.state.as_slice())
    }

    /// Closes the state arrays now (they close with their managers otherwise); the parameters
    /// and their gradients stay.
    pub fn close(self) {
        let counts = self.counters.iter().flatten().map(|c| &c.count);
        for array in self.slots.iter().flat_map(|s| &s.state).chain(counts) {
            // Closing is idempotent and cannot fail.
            let _ = array.close();
        }
    }

    /// Checks every parameter, gradient and state array before a step, taking each gradient
    /// again (one made anew after the old one was closed replaces it).
    fn check_ready(&mut self, ctx: &Ctx) -> Result<()> {
        for (i, (p, slot)) in self.params.iter().zip(&mut self.slots).enumerate() {
            if !p.is_open() {
                return Err(p.0.closed_error(ctx));
            }
            let grad = gradient(ctx, p, i)?;
            if grad != slot.grad {
                slot.grad = grad;
            }
            if let Some(closed) = slot.state.iter().find(|s| !s.is_open()) {
                return Err(closed.0.closed_error(ctx));
            }
            if slot.state.len() != self.kind.state_names().len() {
                return Err(missing_state(ctx, p));
            }
            pending::check_pending(ctx, &slot.grad)?;
        }
        Ok(())
    }
}

/// The open gradient of parameter `p` (number `i` in the list): `InvalidArgument` when it does
/// not require gradients, `ArrayClosed` when its gradient was closed.
fn gradient(ctx: &Ctx, p: &NDArray, i: usize) -> Result<NDArray> {
    if !p.requires_gradient() {
        return Err(ctx.invalid(format!(
            "parameter {} (at {i} in the list) does not require gradients: call \
             set_requires_gradient(true) on it (an optimizer updates parameters from their \
             gradients)",
            p.0.describe()
        )));
    }
    p.gradient_array(ctx)
}

/// The error for a parameter whose state does not match the rule (never, by construction).
fn missing_state(ctx: &Ctx, p: &NDArray) -> crate::Error {
    ctx.invalid(format!(
        "the optimizer's state for parameter {} does not match its rule",
        p.0.describe()
    ))
}

/// Sets a gradient to zero: a pending product is dropped, and a gradient known to hold zeros
/// (not written since it was last zeroed) is not written again.
fn zero(grad: &NDArray) -> Result<()> {
    pending::drop_pending(grad);
    if pending::known_zero(&grad.0) {
        return Ok(());
    }
    grad.fill_(0.0)
}
