//! [`Predictor`]: DJL's inference tree (model → predictor → one context per call), where every
//! call runs in its own context scope and only owned data leaves it.

use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::error::{take_panic_message, Ctx};
use crate::{Device, Error, Manager, Result, Workspace, WorkspaceConfig};

/// A predictor's step: the input's borrowed form and the call's context manager in, owned data
/// out.
type StepFn<I, O> = dyn Fn(&Manager, &I) -> Result<O> + Send + Sync;

/// Runs a step closure over a model, one context scope per call (DJL's `Predictor`).
///
/// ```text
/// model "mlp"            parameters; capped by the predictor
/// └─ predictor           capped: a step cannot leave an array here either
///    └─ context-0        a workspace; each call is one cycle of it (or of context-1, … when
///                        several threads call at once)
/// ```
///
/// Every array a call creates lives in its context, which is the thread's active scope while
/// the step runs (op results land there) and closes when the call returns, on error and on
/// panic too: nothing of a call survives it. The step returns what leaves, as data the caller
/// owns (a [`HostArray`](crate::HostArray), a `Vec`, a number): DJL's `Translator` boundary.
/// An [`NDArray`](crate::NDArray) returned from a step is closed with the context, and says so
/// when used.
///
/// Building a predictor caps the model, and the predictor's own manager is capped: a step that
/// tries to leave an array in either (`ctx.ret(&y)`, `model.zeros(…)`, `y.attach(&model)`)
/// fails with `Error::Capped` at that line, before anything is allocated. This is the leak
/// DJL users hit with a manager kept inside a translator.
///
/// A predictor may be called from many threads at once: each concurrent call takes its own
/// context (a workspace named `context-N`), created on demand and reused afterwards, so memory
/// is bounded by the number of calls in flight at once. A step that panics gives
/// `Error::Panicked`; its context is closed and the predictor keeps working. Dropping the
/// predictor (on any thread) frees every context.
///
/// ```
/// use ndscope::{DType, Error, HostArray, Manager, Predictor};
/// let model = Manager::new_base().with_name("model");
/// let w = model.full([3, 2], 0.5, DType::F32)?.with_name("w");
/// let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
///     let x = ctx.from_host(x)?;              // in this call's context
///     x.matmul(&w)?.relu()?.to_host()         // temporaries die with the context
/// })?;
/// let y = predictor.predict(&HostArray::from_vec(vec![1.0f32, 2.0, 3.0], [1, 3])?)?;
/// assert_eq!(y.as_slice::<f32>()?, &[3.0, 3.0]);
/// assert!(model.is_capped());
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct Predictor<I: ?Sized, O> {
    model: Manager,
    manager: Manager,
    /// `None`: each call is a plain sub-scope of the predictor's manager.
    config: Option<WorkspaceConfig>,
    /// Contexts not in use by a call.
    idle: Mutex<Vec<Workspace>>,
    /// Contexts made so far (for their names).
    made: AtomicUsize,
    calls: AtomicU64,
    step: Box<StepFn<I, O>>,
}

impl<I: ?Sized, O> std::fmt::Debug for Predictor<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Predictor")
            .field("manager", &self.manager)
            .field("model", &self.model)
            .field("workspace", &self.config.is_some())
            .finish()
    }
}

/// Builds a [`Predictor`]: [`Predictor::builder`].
#[derive(Clone, Debug)]
pub struct PredictorBuilder {
    model: Manager,
    name: String,
    config: Option<WorkspaceConfig>,
    /// `None`: the model manager's device.
    device: Option<Device>,
}

impl PredictorBuilder {
    /// The predictor manager's name (default `"predictor"`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// The configuration of each context's workspace (default [`WorkspaceConfig::default`]:
    /// the first call is measured, later calls reuse one block).
    pub fn workspace(mut self, config: WorkspaceConfig) -> Self {
        self.config = Some(config);
        self
    }

    /// Each call runs in a plain sub-scope instead of a workspace cycle: ordinary allocations,
    /// still all freed when the call returns.
    pub fn no_workspace(mut self) -> Self {
        self.config = None;
        self
    }

    /// The device of the predictor's manager and its contexts (default: the model manager's),
    /// where `ctx.from_host(x)` and the factories put a call's arrays and where the context
    /// workspaces' blocks live. Give the device of the model's parameters when they are not on
    /// the model manager's own (a CPU manager holding arrays moved with
    /// [`to_device`](crate::NDArray::to_device)). [`build`](Self::build) gives
    /// `DeviceUnavailable` for an absent device.
    ///
    /// ```
    /// use ndscope::{DType, Device, HostArray, Manager, Predictor};
    /// let model = Manager::new_base().with_name("model");
    /// let w = model.full([2, 2], 1.0, DType::F32)?;
    /// let predictor = Predictor::builder(&model)
    ///     .device(Device::Cpu)
    ///     .build(move |ctx: &Manager, x: &HostArray| ctx.from_host(x)?.matmul(&w)?.to_host())?;
    /// assert_eq!(predictor.device(), Device::Cpu);
    /// let y = predictor.predict(&HostArray::from_vec(vec![1.0f32, 2.0], [1, 2])?)?;
    /// assert_eq!(y.as_slice::<f32>()?, &[3.0, 3.0]);
    /// assert!(Predictor::builder(&model).device(Device::Cuda(64)).build(|_, x: &u32| Ok(*x)).is_err());
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Makes the predictor: caps the model and creates the capped predictor manager under it.
    /// `ManagerClosed` if the model is closed; `DeviceUnavailable` if the contexts' device
    /// ([`device`](Self::device)) is absent or failed its setup (nothing is capped then).
    #[track_caller]
    pub fn build<I, O, F>(self, step: F) -> Result<Predictor<I, O>>
    where
        I: ?Sized,
        F: Fn(&Manager, &I) -> Result<O> + Send + Sync + 'static,
    {
        self.build_boxed(Box::new(step))
    }

    #[track_caller]
    pub(crate) fn build_boxed<I: ?Sized, O>(
        self,
        step: Box<StepFn<I, O>>,
    ) -> Result<Predictor<I, O>> {
        let ctx = Ctx::new("PredictorBuilder::build");
        let device = self.device.unwrap_or_else(|| self.model.device());
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        let manager = self.model.sub_manager(ctx, device)?.with_name(&self.name);
        self.model.cap();
        manager.cap();
        Ok(Predictor {
            model: self.model,
            manager,
            config: self.config,
            idle: Mutex::new(Vec::new()),
            made: AtomicUsize::new(0),
            calls: AtomicU64::new(0),
            step,
        })
    }
}

impl Predictor<(), ()> {
    /// A builder for a predictor over `model`. (An associated function of `Predictor<(), ()>`
    /// only so that `Predictor::builder(&model)` needs no type annotations: the predictor's
    /// input and output types are those of the step given to
    /// [`build`](PredictorBuilder::build).)
    pub fn builder(model: &Manager) -> PredictorBuilder {
        PredictorBuilder {
            model: model.clone(),
            name: "predictor".to_string(),
            config: Some(WorkspaceConfig::default()),
            device: None,
        }
    }
}

impl<I: ?Sized, O> Predictor<I, O> {
    /// A predictor over `model` running `step` in a workspace cycle per call (see
    /// [`builder`](Self::builder) for the options). Caps the model.
    #[track_caller]
    pub fn new<F>(model: &Manager, step: F) -> Result<Predictor<I, O>>
    where
        F: Fn(&Manager, &I) -> Result<O> + Send + Sync + 'static,
    {
        Predictor::builder(model).build(step)
    }

    /// Runs the step on `input` in a fresh context scope, active on this thread while the step
    /// runs, and closes the context before returning (also on error and panic). Errors: the
    /// step's own; `Panicked` if it panicked; `ManagerClosed` once the model or the predictor is
    /// closed.
    #[track_caller]
    pub fn predict(&self, input: &I) -> Result<O> {
        let ctx = Ctx::new("Predictor::predict");
        let context = self.take_context()?;
        // A predictor's step is never recorded, even inside a gradient collector.
        let _no_gradient = crate::NoGradientGuard::new();
        let result = panic::catch_unwind(AssertUnwindSafe(|| match &context {
            Some(ws) => ws.cycle(|c| (self.step)(c, input)),
            None => self.manager.scope(|c| (self.step)(c, input)),
        }));
        if let Some(ws) = context {
            self.idle.lock().push(ws);
        }
        self.calls.fetch_add(1, Ordering::Relaxed);
        match result {
            Ok(result) => result,
            Err(payload) => Err(Error::Panicked {
                op: ctx.op,
                at: ctx.at,
                during: format!("the step of predictor {}", self.manager.0.describe()),
                message: take_panic_message(payload),
            }),
        }
    }

    /// An idle context, or a new one. A context whose workspace was destroyed meanwhile
    /// ([`destroy_all_workspaces_for_current_thread`](crate::destroy_all_workspaces_for_current_thread))
    /// is dropped and replaced.
    fn take_context(&self) -> Result<Option<Workspace>> {
        let Some(config) = &self.config else {
            return Ok(None);
        };
        loop {
            let Some(ws) = self.idle.lock().pop() else {
                break;
            };
            if !ws.is_destroyed() {
                return Ok(Some(ws));
            }
        }
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        Ok(Some(
            self.manager
                .workspace(&format!("context-{n}"), config.clone())?,
        ))
    }

    /// The predictor's manager (a capped child of the model; contexts are its workspaces).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// The model manager.
    pub fn model(&self) -> &Manager {
        &self.model
    }

    /// The device of the predictor's manager and its contexts ([`PredictorBuilder::device`]).
    pub fn device(&self) -> Device {
        self.manager.device()
    }

    /// Calls made so far (including failed ones).
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Contexts created so far: the most calls that have been in flight at once (plus any that
    /// replaced a destroyed one). 0 without workspaces.
    pub fn contexts(&self) -> usize {
        self.made.load(Ordering::Relaxed)
    }

    /// The predictor's subtree as text ([`Manager::debug_dump`]): its contexts' workspaces,
    /// and any call in flight.
    pub fn debug_dump(&self, level: usize) -> String {
        self.manager.debug_dump(level)
    }

    /// Closes the predictor's manager now, freeing every context; later calls give
    /// `ManagerClosed`. Dropping the predictor does the same. The model stays open (and
    /// capped).
    #[track_caller]
    pub fn close(&self) -> Result<()> {
        self.idle.lock().clear();
        self.manager.close()
    }
}

impl<I: ?Sized, O> Drop for Predictor<I, O> {
    fn drop(&mut self) {
        // Never the system manager, the only one whose close fails.
        let _ = self.manager.close();
    }
}
