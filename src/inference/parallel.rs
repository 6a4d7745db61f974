//! [`ParallelInference`]: ND4J's `ParallelInference` over ndscope's managers — N worker
//! threads, each with its own predictor and workspace, over one model's parameters, fed by one
//! request queue with optional batching.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::predictor::{Predictor, PredictorBuilder};
use crate::error::Ctx;
use crate::{Device, Error, HostArray, Manager, NDArray, Result, WorkspaceConfig};

/// How long a worker with an empty queue, or a caller waiting for its answer, keeps polling
/// before it sleeps. A sleeping thread's wake-up costs tens of microseconds, more on a busy
/// machine, and a request goes through two of them (the worker's and the caller's); a short
/// poll takes both off the latency of back-to-back requests.
const SPIN: Duration = Duration::from_micros(100);

/// The longest poll: a service whose calls take longer than half of this sleeps between them.
const MAX_SPIN: Duration = Duration::from_millis(2);

/// How long to poll around a service whose calls take `recent` (nanoseconds, a running
/// average): [`SPIN`], or twice a call when that is longer (at most [`MAX_SPIN`]), so that a
/// caller waiting for its answer, and a worker waiting for the next request of a caller that
/// does as much work between two of them, still poll when it comes. With a fixed 100 µs, a
/// forward pass of 107 µs (a 1-thread pool) put both to sleep at every call: 50 µs of wake-ups.
fn spin_for(recent: u64) -> Duration {
    Duration::from_nanos(recent.saturating_mul(2)).clamp(SPIN, MAX_SPIN)
}

/// Polls `ready` for up to `limit`; whether it became true.
fn spin_until(limit: Duration, mut ready: impl FnMut() -> bool) -> bool {
    let start = Instant::now();
    let mut n = 0u32;
    while start.elapsed() < limit {
        if ready() {
            return true;
        }
        n = n.wrapping_add(1);
        if n.is_multiple_of(4) {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    ready()
}

/// The model's forward pass: a batch in the call's context in, the output out (also in the
/// context, or anywhere the step's ops put it; it is copied out before the context closes).
type Forward = dyn Fn(&Manager, &NDArray) -> Result<NDArray> + Send + Sync;

/// How workers take requests from the queue (ND4J's `InferenceMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InferenceMode {
    /// One request per forward pass.
    Sequential,
    /// Requests are joined along axis 0 into one forward pass: a worker takes a request, then
    /// waits for up to `max_requests` in all or until `max_wait` has passed since it took the
    /// first, whichever comes first. Only requests of the same dtype and the same dimensions
    /// after the first are joined. The forward must return one output row per input row
    /// (`ShapeMismatch` otherwise); each request gets its own rows back.
    Batched {
        /// The most requests in one forward pass (at least 1).
        max_requests: usize,
        /// How long a worker waits for more requests after the first.
        max_wait: Duration,
    },
}

/// What [`ParallelInference::shutdown`] does with requests not yet taken by a worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShutdownMode {
    /// Workers answer every queued request, then stop.
    Drain,
    /// Queued requests are answered `Error::ShutDown` at once; requests a worker has already
    /// taken (in flight) are finished.
    Refuse,
}

/// Counters of a [`ParallelInference`], from [`ParallelInference::stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InferenceStats {
    /// Requests accepted into the queue.
    pub submitted: u64,
    /// Requests answered with an output.
    pub completed: u64,
    /// Requests answered with an error by the step or the forward pass (panics included).
    pub failed: u64,
    /// Requests refused by a shutdown (or because no worker was left).
    pub refused: u64,
    /// Forward passes run (a batch of several requests counts once).
    pub batches: u64,
    /// The most requests joined in one forward pass.
    pub largest_batch: u64,
    /// Steps that panicked; each time, the worker's predictor was closed and replaced.
    pub panics: u64,
    /// Requests waiting in the queue now.
    pub queued: usize,
}

/// What a [`ParallelInference::shutdown`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Requests answered (with an output or the step's error) after the shutdown began: those
    /// in flight and, with [`ShutdownMode::Drain`], those queued.
    pub finished: u64,
    /// Requests answered `Error::ShutDown` because of this shutdown.
    pub refused: u64,
}

/// A request's answer, to wait for: [`ParallelInference::submit`].
#[derive(Debug)]
pub struct Pending {
    answer: mpsc::Receiver<Result<HostArray>>,
    service: Arc<str>,
    /// How long to poll for the answer before sleeping ([`spin_for`]).
    spin: Duration,
}

impl Pending {
    /// Waits for the answer. `ShutDown` if the service stopped without answering (which only
    /// happens if its worker threads died).
    #[track_caller]
    pub fn wait(self) -> Result<HostArray> {
        let ctx = Ctx::new("Pending::wait");
        let mut early = None;
        spin_until(self.spin, || match self.answer.try_recv() {
            Ok(answer) => {
                early = Some(answer);
                true
            }
            Err(mpsc::TryRecvError::Empty) => false,
            Err(mpsc::TryRecvError::Disconnected) => true,
        });
        if let Some(answer) = early {
            return answer;
        }
        self.answer
            .recv()
            .unwrap_or_else(|_| Err(lost(&ctx, &self.service)))
    }

    /// The answer if it has come, without waiting.
    #[track_caller]
    pub fn try_wait(&self) -> Option<Result<HostArray>> {
        let ctx = Ctx::new("Pending::try_wait");
        match self.answer.try_recv() {
            Ok(answer) => Some(answer),
            Err(mpsc::TryRecvError::Empty) => None,
            Err(mpsc::TryRecvError::Disconnected) => Some(Err(lost(&ctx, &self.service))),
        }
    }
}

fn lost(ctx: &Ctx, service: &str) -> Error {
    Error::ShutDown {
        op: ctx.op,
        at: ctx.at,
        service: service.to_string(),
        reason: "its workers stopped without answering this request".to_string(),
    }
}

struct Request {
    input: HostArray,
    answer: mpsc::SyncSender<Result<HostArray>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    Draining,
    Refusing,
}

struct Queue {
    requests: VecDeque<Request>,
    phase: Phase,
    /// A worker is gathering a batch: the others leave the queue to it meanwhile.
    gathering: bool,
    /// Worker threads still serving.
    alive: usize,
    /// Requests answered since the shutdown began.
    finished_in_shutdown: u64,
}

struct Shared {
    name: String,
    /// `parallel inference 'name'`, made once: every request's `Pending` shares it.
    description: Arc<str>,
    mode: InferenceMode,
    queue_limit: usize,
    queue: Mutex<Queue>,
    /// Room in the queue, or the service's state, changed (submitters wait on it).
    changed: Condvar,
    /// A request was queued, or the service's state changed (workers wait on it). Apart from
    /// `changed`, so that a new request wakes one worker, not every sleeping worker and
    /// submitter.
    work: Condvar,
    /// Idle workers polling `pushed` now (at most one: see `next_batch`).
    polling: AtomicUsize,
    /// Workers serving a batch now.
    serving: AtomicUsize,
    /// Requests ever queued: a worker polls it before sleeping on `work`.
    pushed: AtomicU64,
    /// A running average of how long a worker takes per batch, in nanoseconds (how long to
    /// poll: [`spin_for`]).
    recent_ns: AtomicU64,
    submitted: AtomicU64,
    completed: AtomicU64,
    failed: AtomicU64,
    refused: AtomicU64,
    batches: AtomicU64,
    largest_batch: AtomicU64,
    panics: AtomicU64,
}

thread_local! {
    /// Whether this worker holds the polling place, taken just before it answered (see
    /// [`Shared::answer_from_worker`]); its next [`Shared::next_batch`] polls with it.
    static HOLDS_POLL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl Shared {
    /// Answers a request from a worker, which first takes the polling place when it is free: a
    /// caller that sends its next request as soon as it has this answer then finds a poller,
    /// where it used to find none (the worker was still on its way back to the queue) and
    /// woke a sleeping one: a system call on the caller's path and a wake-up of about 10 µs.
    fn answer_from_worker(&self, request: Request, answer: Result<HostArray>) {
        if !HOLDS_POLL.with(std::cell::Cell::get)
            && self
                .polling
                .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            HOLDS_POLL.with(|h| h.set(true));
        }
        self.answer(request, answer);
    }

    /// Gives the polling place back if this worker holds it (it stops, or takes a request
    /// without polling).
    fn release_poll(&self) {
        if HOLDS_POLL.with(|h| h.replace(false)) {
            self.polling.store(0, Ordering::SeqCst);
        }
    }

    fn describe(&self) -> String {
        self.description.to_string()
    }

    fn refusal(&self, ctx: &Ctx, reason: &str) -> Error {
        Error::ShutDown {
            op: ctx.op,
            at: ctx.at,
            service: self.describe(),
            reason: reason.to_string(),
        }
    }

    /// The next batch for a worker, or `None` when it should stop.
    fn next_batch(&self) -> Option<Vec<Request>> {
        let mut q = self.queue.lock();
        let mut polled = false;
        loop {
            if q.phase == Phase::Refusing {
                self.release_poll();
                return None;
            }
            if !q.gathering {
                if !q.requests.is_empty() {
                    break;
                }
                if q.phase == Phase::Draining {
                    self.release_poll();
                    return None;
                }
            }
            // Poll briefly for the next request before sleeping (see `SPIN`), one idle worker
            // at a time: more would only take cores from the callers and the busy workers,
            // and a submitter wakes a sleeping worker when none polls. The place may be this
            // worker's already, taken when it answered.
            if !polled && !q.gathering {
                let held = HOLDS_POLL.with(|h| h.replace(false));
                if held
                    || self
                        .polling
                        .compare_exchange(0, 1, Ordering::SeqCst, Ordering::SeqCst)
                        .is_ok()
                {
                    polled = true;
                    let seen = self.pushed.load(Ordering::SeqCst);
                    drop(q);
                    spin_until(spin_for(self.recent_ns.load(Ordering::Relaxed)), || {
                        self.pushed.load(Ordering::Acquire) != seen
                    });
                    // Counted out before looking at the queue: a request queued after this is
                    // seen by the look below, or its submitter sees no poller and wakes a
                    // worker.
                    self.polling.store(0, Ordering::SeqCst);
                    q = self.queue.lock();
                    continue;
                }
            }
            // Held but not used (another worker gathers a batch): given back before sleeping.
            self.release_poll();
            self.work.wait(&mut q);
        }
        self.release_poll();
        let first = q.requests.pop_front()?;
        let mut batch = vec![first];
        if let InferenceMode::Batched {
            max_requests,
            max_wait,
        } = self.mode
        {
            q.gathering = true;
            let deadline = Instant::now() + max_wait;
            let mut expired = false;
            while batch.len() < max_requests {
                if let Some(front) = q.requests.front() {
                    if !joinable(&batch[0].input, &front.input) {
                        break;
                    }
                    if let Some(next) = q.requests.pop_front() {
                        batch.push(next);
                    }
                    continue;
                }
                if expired || q.phase != Phase::Running {
                    break;
                }
                expired = self.work.wait_until(&mut q, deadline).timed_out();
            }
            q.gathering = false;
        }
        // Room in the queue for submitters; the rest of the queue to another worker.
        self.changed.notify_all();
        if !q.requests.is_empty() {
            self.work.notify_one();
        }
        Some(batch)
    }

    fn answer(&self, request: Request, answer: Result<HostArray>) {
        match &answer {
            Ok(_) => self.completed.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.failed.fetch_add(1, Ordering::Relaxed),
        };
        // The caller may have stopped waiting (dropped its `Pending`): nothing to do then.
        let _ = request.answer.send(answer);
        let mut q = self.queue.lock();
        if q.phase != Phase::Running {
            q.finished_in_shutdown += 1;
        }
    }

    /// Wakes every waiting worker and submitter (the service's state changed).
    fn notify_everyone(&self) {
        self.changed.notify_all();
        self.work.notify_all();
    }

    /// Answers every queued request `ShutDown`; returns how many.
    fn refuse_queued(&self, ctx: &Ctx, reason: &str) -> u64 {
        let refused: Vec<Request> = self.queue.lock().requests.drain(..).collect();
        self.notify_everyone();
        for request in &refused {
            let _ = request.answer.send(Err(self.refusal(ctx, reason)));
        }
        self.refused
            .fetch_add(refused.len() as u64, Ordering::Relaxed);
        refused.len() as u64
    }
}

/// Whether two requests can share a forward pass: same dtype, same dimensions after the first.
fn joinable(a: &HostArray, b: &HostArray) -> bool {
    a.dtype() == b.dtype() && !b.dims().is_empty() && a.dims()[1..] == b.dims()[1..]
}

/// N worker threads, each with its own [`Predictor`] and workspace, over one model's
/// parameters (shared read-only: no copy per worker), answering requests from any number of
/// caller threads through one queue (ND4J's `ParallelInference`).
///
/// ```text
/// model "mlp"                parameters; capped
/// └─ parallel-inference      capped
///    ├─ worker-0             a predictor: its context workspace, one cycle per forward pass
///    └─ worker-1
/// ```
///
/// - **Requests and answers** are [`HostArray`]s, data the callers own. [`predict`] waits for
///   the answer; [`submit`] returns a [`Pending`] to wait on later. When the queue holds
///   `queue_limit` requests, both wait for room (backpressure), so memory stays bounded.
/// - **Batching** ([`InferenceMode::Batched`]) joins up to B requests, or whatever came within
///   T, into one forward pass. If a joined pass fails, its requests are run again one by one,
///   so each gets its own answer and one bad request cannot fail its neighbours.
/// - **A panicking step** answers its request(s) `Error::Panicked`; the worker closes its
///   predictor (freeing all its memory), makes a fresh one and goes on serving.
/// - **Shutdown** is explicit: [`shutdown`] with [`ShutdownMode::Drain`] answers every queued
///   request, [`ShutdownMode::Refuse`] answers them `Error::ShutDown`; requests in flight are
///   finished either way. Then the workers are joined and their managers closed: every byte
///   they held is freed. Later requests get `ShutDown`. Dropping the service shuts it down
///   with `Refuse`.
///
/// - **On a GPU**, the workers' contexts are on the model manager's device (or the one given to
///   [`ParallelInferenceBuilder::device`]): each request is copied onto it and each answer back
///   through the device's page-locked staging buffers, one copy each way; once a worker's
///   workspace is sized, a request allocates nothing on the device. The workers share the
///   device's one stream: several keep it busy while one waits for its answer.
///
/// [`predict`]: ParallelInference::predict
/// [`submit`]: ParallelInference::submit
/// [`shutdown`]: ParallelInference::shutdown
///
/// ```
/// use std::time::Duration;
/// use ndscope::{DType, HostArray, InferenceMode, Manager, ParallelInference, ShutdownMode};
/// let model = Manager::new_base().with_name("model");
/// let w = model.full([4, 2], 0.25, DType::F32)?;
/// let service = ParallelInference::builder(&model)
///     .workers(2)
///     .mode(InferenceMode::Batched { max_requests: 8, max_wait: Duration::from_micros(200) })
///     .build(move |_ctx, x| x.matmul(&w))?;
/// let answers: Vec<HostArray> = std::thread::scope(|s| {
///     let clients: Vec<_> = (0..4)
///         .map(|i| {
///             let service = &service;
///             s.spawn(move || service.predict(HostArray::from_vec(vec![i as f32; 4], [1, 4])?))
///         })
///         .collect();
///     clients.into_iter().map(|c| c.join().unwrap()).collect::<ndscope::Result<_>>()
/// })?;
/// assert_eq!(answers[3].as_slice::<f32>()?, &[3.0, 3.0]);
/// let report = service.shutdown(ShutdownMode::Drain)?;
/// assert_eq!(report.refused, 0);
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct ParallelInference {
    shared: Arc<Shared>,
    manager: Manager,
    workers: Mutex<Vec<JoinHandle<()>>>,
    worker_ids: Vec<ThreadId>,
}

impl fmt::Debug for ParallelInference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParallelInference")
            .field("name", &self.shared.name)
            .field("workers", &self.worker_ids.len())
            .field("mode", &self.shared.mode)
            .finish()
    }
}

/// Builds a [`ParallelInference`]: [`ParallelInference::builder`].
#[derive(Clone, Debug)]
pub struct ParallelInferenceBuilder {
    model: Manager,
    name: String,
    workers: usize,
    mode: InferenceMode,
    queue_limit: usize,
    workspace: Option<WorkspaceConfig>,
    /// `None`: the model manager's device.
    device: Option<Device>,
}

impl ParallelInferenceBuilder {
    /// The service's name (its manager's, and in errors); default `"parallel-inference"`.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// Worker threads (default: [`num_threads`](crate::num_threads), one per core).
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Sequential (default) or batched.
    pub fn mode(mut self, mode: InferenceMode) -> Self {
        self.mode = mode;
        self
    }

    /// Requests the queue holds before submitters wait for room (default 256).
    pub fn queue_limit(mut self, limit: usize) -> Self {
        self.queue_limit = limit;
        self
    }

    /// Each worker's context workspace (default [`WorkspaceConfig::default`]).
    pub fn workspace(mut self, config: WorkspaceConfig) -> Self {
        self.workspace = Some(config);
        self
    }

    /// Workers run each forward pass in a plain scope instead of a workspace cycle.
    pub fn no_workspace(mut self) -> Self {
        self.workspace = None;
        self
    }

    /// The device of the service's manager and of its workers' contexts (default: the model
    /// manager's), where each request's batch is put before the forward pass: give the
    /// parameters' device when it is not the model manager's own (see
    /// [`PredictorBuilder::device`]). [`build`](Self::build) gives `DeviceUnavailable` for an
    /// absent device.
    pub fn device(mut self, device: Device) -> Self {
        self.device = Some(device);
        self
    }

    /// Starts the workers, each with its own predictor running `forward` (called with the
    /// context manager and the input batch, as an array in that context). Caps the model.
    /// `InvalidConfig` for 0 workers, a queue limit of 0 or a batch limit of 0;
    /// `ManagerClosed` if the model is closed; `DeviceUnavailable` if the workers' device
    /// ([`device`](Self::device)) is absent or failed its setup. Nothing is capped on an error.
    #[track_caller]
    pub fn build<F>(self, forward: F) -> Result<ParallelInference>
    where
        F: Fn(&Manager, &NDArray) -> Result<NDArray> + Send + Sync + 'static,
    {
        let ctx = Ctx::new("ParallelInferenceBuilder::build");
        if self.workers == 0 {
            return Err(ctx.config("a parallel inference needs at least one worker"));
        }
        if self.queue_limit == 0 {
            return Err(ctx.config("queue_limit must be at least 1"));
        }
        if let InferenceMode::Batched {
            max_requests: 0, ..
        } = self.mode
        {
            return Err(ctx.config("InferenceMode::Batched needs max_requests of at least 1"));
        }
        let device = self.device.unwrap_or_else(|| self.model.device());
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        let forward: Arc<Forward> = Arc::new(forward);
        let manager = self.model.sub_manager(ctx, device)?.with_name(&self.name);
        self.model.cap();
        manager.cap();
        let shared = Arc::new(Shared {
            name: self.name.clone(),
            description: format!("parallel inference '{}'", self.name).into(),
            mode: self.mode,
            queue_limit: self.queue_limit,
            queue: Mutex::new(Queue {
                requests: VecDeque::new(),
                phase: Phase::Running,
                gathering: false,
                alive: self.workers,
                finished_in_shutdown: 0,
            }),
            changed: Condvar::new(),
            work: Condvar::new(),
            polling: AtomicUsize::new(0),
            recent_ns: AtomicU64::new(0),
            serving: AtomicUsize::new(0),
            pushed: AtomicU64::new(0),
            submitted: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            largest_batch: AtomicU64::new(0),
            panics: AtomicU64::new(0),
        });
        let factory = WorkerFactory {
            parent: manager.clone(),
            workspace: self.workspace.clone(),
            forward,
            batched: matches!(self.mode, InferenceMode::Batched { .. }),
        };
        // Stops what was started when a later worker cannot be made.
        let abort = |handles: Vec<JoinHandle<()>>, error: Error| -> Error {
            shared.queue.lock().alive = handles.len();
            let partial = ParallelInference {
                shared: Arc::clone(&shared),
                manager: manager.clone(),
                worker_ids: Vec::new(),
                workers: Mutex::new(handles),
            };
            let _ = partial.shutdown(ShutdownMode::Refuse);
            error
        };
        // With a worker per core or more, a worker computes alone while others serve too: pool
        // helpers joining its kernels would only compete with the other workers for the cores.
        let inline = self.workers >= crate::backend::cpu::pool::threads();
        let mut handles = Vec::with_capacity(self.workers);
        for index in 0..self.workers {
            // Made here, so that a failure is this call's error.
            let predictor = match factory.make(index) {
                Ok(p) => p,
                Err(e) => return Err(abort(handles, e)),
            };
            let worker_shared = Arc::clone(&shared);
            let worker_factory = factory.clone();
            let spawned = thread::Builder::new()
                .name(format!("{}-worker-{index}", self.name))
                .spawn(move || worker(worker_shared, worker_factory, index, predictor, inline));
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    let error = ctx.invalid(format!("cannot start a worker thread: {e}"));
                    return Err(abort(handles, error));
                }
            }
        }
        let worker_ids = handles.iter().map(|h| h.thread().id()).collect();
        Ok(ParallelInference {
            shared,
            manager,
            workers: Mutex::new(handles),
            worker_ids,
        })
    }
}

/// Makes a worker's predictor (again, after a panic).
#[derive(Clone)]
struct WorkerFactory {
    parent: Manager,
    workspace: Option<WorkspaceConfig>,
    forward: Arc<Forward>,
    batched: bool,
}

impl WorkerFactory {
    fn make(&self, index: usize) -> Result<Predictor<HostArray, HostArray>> {
        let builder = Predictor::builder(&self.parent).name(&format!("worker-{index}"));
        let builder: PredictorBuilder = match &self.workspace {
            Some(config) => builder.workspace(config.clone()),
            None => builder.no_workspace(),
        };
        let forward = Arc::clone(&self.forward);
        let batched = self.batched;
        builder.build_boxed(Box::new(move |ctx: &Manager, input: &HostArray| {
            let x = ctx.from_host(input)?;
            let y = forward(ctx, &x)?;
            if batched && y.dims().first() != input.dims().first() {
                return Err(Ctx::new("ParallelInference forward").shape(format!(
                    "in batched mode the forward must return one row per input row: input {} \
                     gave output {}",
                    input.shape(),
                    y.shape()
                )));
            }
            y.to_host()
        }))
    }
}

fn worker(
    shared: Arc<Shared>,
    factory: WorkerFactory,
    index: usize,
    mut predictor: Predictor<HostArray, HostArray>,
    inline: bool,
) {
    // Counts the worker out however it ends, a panic outside a step included (the step's own
    // are caught by the predictor), so no request waits for a worker that is gone.
    let _leaving = Leaving(&shared);
    while let Some(batch) = shared.next_batch() {
        // With a worker per core, a worker serving alone lets its kernels use the pool (as a
        // predictor called directly would: a lone batch-1 request costs what its model costs);
        // one serving beside others computes alone.
        let others = shared.serving.fetch_add(1, Ordering::SeqCst);
        if inline {
            crate::backend::cpu::pool::set_inline(others > 0);
        }
        let started = Instant::now();
        let served = serve(&shared, &mut predictor, batch, &factory, index);
        let took = started.elapsed().as_nanos().min(u128::from(u64::MAX)) as u64;
        let old = shared.recent_ns.load(Ordering::Relaxed);
        let average = if old == 0 {
            took
        } else {
            (old.saturating_mul(3) / 4).saturating_add(took / 4)
        };
        shared.recent_ns.store(average, Ordering::Relaxed);
        shared.serving.fetch_sub(1, Ordering::SeqCst);
        if !served {
            break;
        }
    }
    let _ = predictor.close();
}

/// Decrements the live workers when a worker thread ends (returns or unwinds); the last one
/// refuses what is still queued.
struct Leaving<'a>(&'a Shared);

impl Drop for Leaving<'_> {
    fn drop(&mut self) {
        let shared = self.0;
        shared.release_poll();
        let mut q = shared.queue.lock();
        q.alive -= 1;
        let last = q.alive == 0;
        drop(q);
        if last {
            // No worker is left to answer what is still queued (the service is stopping, or its
            // workers could not be remade): say so rather than leave callers waiting.
            let ctx = Ctx::new("ParallelInference worker");
            shared.refuse_queued(&ctx, "no worker is left to answer it");
        }
        shared.notify_everyone();
    }
}

/// Runs one batch and answers its requests. A predictor whose step panicked is closed (freeing
/// all it held) and replaced by a fresh one; returns `false` if none could be made (the closed
/// one answers the rest of the batch with `ManagerClosed`, and the worker stops).
fn serve(
    shared: &Shared,
    predictor: &mut Predictor<HostArray, HostArray>,
    batch: Vec<Request>,
    factory: &WorkerFactory,
    index: usize,
) -> bool {
    let count = batch.len() as u64;
    shared.batches.fetch_add(1, Ordering::Relaxed);
    shared.largest_batch.fetch_max(count, Ordering::Relaxed);
    let mut failed = false;
    let mut run = |input: &HostArray| {
        let answer = predictor.predict(input);
        if matches!(answer, Err(Error::Panicked { .. })) {
            shared.panics.fetch_add(1, Ordering::Relaxed);
            let _ = predictor.close();
            match factory.make(index) {
                Ok(fresh) => *predictor = fresh,
                Err(_) => failed = true,
            }
        }
        answer
    };
    if batch.len() == 1 {
        for request in batch {
            let answer = run(&request.input);
            shared.answer_from_worker(request, answer);
        }
    } else {
        let (inputs, answers): (Vec<HostArray>, Vec<_>) =
            batch.into_iter().map(|r| (r.input, r.answer)).unzip();
        let rows: Vec<usize> = inputs.iter().map(|x| x.dims()[0]).collect();
        let joined = HostArray::concat_rows(&inputs)
            .and_then(|x| run(&x))
            .and_then(|y| y.split_rows(&rows));
        match joined {
            Ok(parts) => {
                for ((input, answer), part) in inputs.into_iter().zip(answers).zip(parts) {
                    shared.answer_from_worker(Request { input, answer }, Ok(part));
                }
            }
            Err(_) => {
                // One by one, so each request gets its own answer (or error).
                for (input, answer) in inputs.into_iter().zip(answers) {
                    let result = run(&input);
                    shared.answer_from_worker(Request { input, answer }, result);
                }
            }
        }
    }
    !failed
}

impl ParallelInference {
    /// A builder for a parallel inference over `model`.
    pub fn builder(model: &Manager) -> ParallelInferenceBuilder {
        ParallelInferenceBuilder {
            model: model.clone(),
            name: "parallel-inference".to_string(),
            workers: crate::backend::cpu::pool::threads(),
            mode: InferenceMode::Sequential,
            queue_limit: 256,
            workspace: Some(WorkspaceConfig::default()),
            device: None,
        }
    }

    /// Runs `input` through the model on a worker and waits for the answer. Errors: the
    /// forward's own (e.g. `ShapeMismatch`), `Panicked`, `ShutDown` once a shutdown has begun,
    /// `InvalidArgument` for a 0-d input in batched mode.
    #[track_caller]
    pub fn predict(&self, input: HostArray) -> Result<HostArray> {
        self.submit(input)?.wait()
    }

    /// Queues `input` and returns at once with a [`Pending`] answer (waiting first for room
    /// if the queue is full). Errors as [`predict`](Self::predict).
    #[track_caller]
    pub fn submit(&self, input: HostArray) -> Result<Pending> {
        let ctx = Ctx::new("ParallelInference::submit");
        if matches!(self.shared.mode, InferenceMode::Batched { .. }) && input.dims().is_empty() {
            return Err(ctx.invalid(
                "a batched parallel inference joins requests along axis 0: a 0-d input has none",
            ));
        }
        let (tx, rx) = mpsc::sync_channel(1);
        let mut q = self.shared.queue.lock();
        loop {
            if q.phase != Phase::Running {
                return Err(self.shared.refusal(&ctx, "it no longer accepts requests"));
            }
            if q.alive == 0 {
                return Err(self.shared.refusal(&ctx, "no worker is left"));
            }
            if q.requests.len() < self.shared.queue_limit {
                break;
            }
            self.shared.changed.wait(&mut q);
        }
        q.requests.push_back(Request { input, answer: tx });
        self.shared.pushed.fetch_add(1, Ordering::SeqCst);
        let gathering = q.gathering;
        drop(q);
        self.shared.submitted.fetch_add(1, Ordering::Relaxed);
        // An idle worker polling `pushed` takes it; else wake one sleeping worker (all of them
        // while one gathers a batch: it must hear of the request, and may not be the first).
        if gathering {
            self.shared.work.notify_all();
        } else if self.shared.polling.load(Ordering::SeqCst) == 0 {
            self.shared.work.notify_one();
        }
        Ok(Pending {
            answer: rx,
            service: Arc::clone(&self.shared.description),
            spin: spin_for(self.shared.recent_ns.load(Ordering::Relaxed)),
        })
    }

    /// Stops the service: refuses new requests, answers or refuses the queued ones as `mode`
    /// says, finishes the requests in flight, joins the worker threads and closes their
    /// managers, freeing all their memory. Idempotent (a second call reports nothing more).
    /// `InvalidArgument` when called from one of the service's own workers (it would wait for
    /// itself).
    #[track_caller]
    pub fn shutdown(&self, mode: ShutdownMode) -> Result<ShutdownReport> {
        let ctx = Ctx::new("ParallelInference::shutdown");
        if self.worker_ids.contains(&thread::current().id()) {
            return Err(ctx.invalid(format!(
                "{} cannot be shut down from its own worker thread",
                self.shared.describe()
            )));
        }
        {
            let mut q = self.shared.queue.lock();
            q.phase = match (q.phase, mode) {
                (Phase::Refusing, _) | (_, ShutdownMode::Refuse) => Phase::Refusing,
                _ => Phase::Draining,
            };
        }
        self.shared.notify_everyone();
        let refused = match mode {
            ShutdownMode::Refuse => self.shared.refuse_queued(&ctx, "the service was shut down"),
            ShutdownMode::Drain => 0,
        };
        let handles: Vec<JoinHandle<()>> = std::mem::take(&mut *self.workers.lock());
        for handle in handles {
            // A worker that panicked outside a step (it catches the step's panics) is done all
            // the same; its requests were answered or are refused below.
            let _ = handle.join();
        }
        // Anything still queued (workers gone before draining it) is refused, not lost.
        let late = self.shared.refuse_queued(&ctx, "the service was shut down");
        self.manager.close()?;
        let finished = std::mem::take(&mut self.shared.queue.lock().finished_in_shutdown);
        Ok(ShutdownReport {
            finished,
            refused: refused + late,
        })
    }

    /// The service's counters.
    pub fn stats(&self) -> InferenceStats {
        let queued = self.shared.queue.lock().requests.len();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        InferenceStats {
            submitted: get(&self.shared.submitted),
            completed: get(&self.shared.completed),
            failed: get(&self.shared.failed),
            refused: get(&self.shared.refused),
            batches: get(&self.shared.batches),
            largest_batch: get(&self.shared.largest_batch),
            panics: get(&self.shared.panics),
            queued,
        }
    }

    /// The service's manager: a capped child of the model, parent of every worker's predictor.
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// The device of the workers' contexts ([`ParallelInferenceBuilder::device`]).
    pub fn device(&self) -> Device {
        self.manager.device()
    }

    /// Worker threads started.
    pub fn workers(&self) -> usize {
        self.worker_ids.len()
    }

    /// The service's subtree as text ([`Manager::debug_dump`]): each worker's predictor and
    /// its workspace.
    pub fn debug_dump(&self, level: usize) -> String {
        self.manager.debug_dump(level)
    }
}

impl Drop for ParallelInference {
    fn drop(&mut self) {
        if self.worker_ids.contains(&thread::current().id()) {
            // Dropped by its own worker (a step holding the last handle): tell the others to
            // stop, refuse what is queued; the threads end on their own.
            self.shared.queue.lock().phase = Phase::Refusing;
            self.shared.notify_everyone();
            let ctx = Ctx::new("ParallelInference::drop");
            self.shared.refuse_queued(&ctx, "the service was dropped");
            return;
        }
        let _ = self.shutdown(ShutdownMode::Refuse);
    }
}
