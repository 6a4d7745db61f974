//! [`ParallelTrainer`]: data-parallel training in one process over several CUDA devices (DJL's
//! `Trainer` over several devices, PyTorch's `DistributedDataParallel` with one thread per
//! device): one replica of the parameters per device, each batch split between them, the
//! gradients averaged by NCCL all-reduce, the same optimizer step on every replica.

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::backend::{nccl_unique_id, Communicator, NcclId};
use crate::distributed::{fetch_id, post_and_read, serve_id, Board, DistributedConfig, Seen};
use crate::error::{take_panic_message, Ctx};
use crate::ndarray::collective::all_reduce_sum_;
use crate::{
    gradient_collector, DType, Device, Error, HostArray, Manager, ManagerReport, NDArray,
    Optimizer, OptimizerKind, Result, Sgd, WorkspaceConfig,
};

/// The default bucket size of the gradients' all-reduce (PyTorch DDP's `bucket_cap_mb`).
const BUCKET_BYTES: usize = 25 << 20;

/// The op name of a step's errors.
const STEP: &str = "ParallelTrainer::step";

/// The default timeout of a step (and of the setup): 10 minutes, PyTorch's for NCCL.
pub const DEFAULT_TRAINER_TIMEOUT: Duration = Duration::from_secs(600);

/// How much longer than the timeout the trainer waits for a replica's own answer (its waits
/// in NCCL end at the timeout and say so) before it counts the replica as stuck.
const MARGIN: Duration = Duration::from_millis(250);

/// What a replica's thread is doing, for the trainer to say where a rank stopped.
const IDLE: u8 = 0;
const CLOSURE: u8 = 1;
const EXCHANGE: u8 = 2;
const UPDATE: u8 = 3;

/// Builds a replica's model from that device's copies of the source parameters.
type MakeModel<M> = dyn Fn(&[NDArray]) -> Result<M> + Send + Sync;

/// A replica's step: the model, its shard of the inputs and of the labels, the loss out (the
/// mean over the shard).
type StepFn<M> = dyn Fn(&M, &NDArray, &NDArray) -> Result<NDArray> + Send + Sync;

/// A step's batch, checked and split: its rows, each shard's rows, the shards of `x` and `y`.
type Prepared = (usize, Vec<usize>, Vec<HostArray>, Vec<HostArray>);

/// What one [`ParallelTrainer::step`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct ParallelStep {
    /// The loss over the whole batch: the replicas' shard losses weighted by their rows (the
    /// mean over the batch when each shard's loss is the mean over its rows).
    pub loss: f32,
    /// Each replica's loss on its shard, in the order of the devices.
    pub shard_losses: Vec<f32>,
    /// The rows of each replica's shard.
    pub rows: Vec<usize>,
}

/// Counters of a [`ParallelTrainer`], from [`ParallelTrainer::stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParallelTrainerStats {
    /// Steps that updated every replica.
    pub steps: u64,
    /// Steps that failed (no replica updated, unless the trainer is [`broken`](Self::broken)).
    pub failed: u64,
    /// Gradient buckets: NCCL groups per step on each device.
    pub buckets: usize,
    /// All-reduce calls per step on each device (one per parameter).
    pub collectives_per_step: usize,
    /// Bytes all-reduced per step on each device (the gradients' size).
    pub bytes_per_step: usize,
    /// A step failed after its all-reduce was queued (distributed: or its exchange of the
    /// ranks' parts failed): the communicators were aborted and every later step is refused.
    pub broken: bool,
}

/// Builds a [`ParallelTrainer`]: [`ParallelTrainer::builder`].
#[derive(Clone, Debug)]
pub struct ParallelTrainerBuilder {
    name: String,
    devices: Vec<Device>,
    workspace: WorkspaceConfig,
    optimizer: OptimizerKind,
    bucket_bytes: usize,
    distributed: Option<DistributedConfig>,
    timeout: Duration,
}

impl ParallelTrainerBuilder {
    /// The trainer's name (its manager's, and in errors); default `"parallel-trainer"`.
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    /// The devices, one replica each, rank `i` on `devices[i]`: CUDA devices, distinct, at
    /// least one ([`build`](Self::build) refuses others with `InvalidArgument`).
    pub fn devices(mut self, devices: &[Device]) -> Self {
        self.devices = devices.to_vec();
        self
    }

    /// Each replica's step workspace (default [`WorkspaceConfig::default`]): one cycle per
    /// step. Graph replay is refused (`InvalidConfig`): the all-reduce's NCCL calls are not
    /// recorded into a cycle's graph yet.
    pub fn workspace(mut self, config: WorkspaceConfig) -> Self {
        self.workspace = config;
        self
    }

    /// The optimizer every replica runs ([`Sgd`], [`Adam`](crate::Adam),
    /// [`AdamW`](crate::AdamW)); default `Sgd::new(0.01)`.
    pub fn optimizer(mut self, kind: impl Into<OptimizerKind>) -> Self {
        self.optimizer = kind.into();
        self
    }

    /// The most gradient bytes in one NCCL group (default 25 MiB, PyTorch DDP's); at least one
    /// gradient per bucket.
    pub fn bucket_bytes(mut self, bytes: usize) -> Self {
        self.bucket_bytes = bytes;
        self
    }

    /// The longest a step may take, and the setup (default [`DEFAULT_TRAINER_TIMEOUT`], 10
    /// minutes: PyTorch's NCCL timeout). A rank that stops answering (its step closure does
    /// not return, its collectives wait for a rank that never comes, its process died) then
    /// makes the step fail on every rank with `ReplicaFailed` naming it, its source
    /// `TimedOut`, instead of a hang; the communicators are aborted, the trainer refuses later
    /// steps, and [`close`](ParallelTrainer::close) frees everything (without waiting for a
    /// thread still inside the step closure: it ends on its own when the closure returns).
    /// NCCL's asynchronous errors (a peer process that died) end the wait before the timeout.
    /// `build` refuses a timeout of 0 (`InvalidConfig`).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This process is rank `config.rank` of a world of `config.world_size` processes, one
    /// device each (PyTorch's `DistributedDataParallel` under `torchrun`; see
    /// [`DistributedConfig::from_env`]). The devices are then exactly one (default
    /// `cuda:{local_rank}`). [`build`](Self::build) meets the other processes first: rank 0
    /// makes the NCCL unique id and serves it over TCP on `master_addr:master_port` until every
    /// other rank has fetched it; the others fetch it (retrying until the config's timeout).
    /// Every process must build with the same source parameters (the same bits: the replicas
    /// stay identical only if they start so), optimizer and bucket size.
    ///
    /// [`step`](ParallelTrainer::step) then takes this process's own batch (DDP's semantics):
    /// the gradient is the mean over every rank's rows (batches of different sizes are
    /// weighted by their rows). Before the gradients' all-reduce, every rank all-reduces a
    /// small vector (per rank: whether its forward and backward succeeded, its rows, its loss,
    /// its device): a failed rank still joins it, so every rank learns of the failure, none
    /// enters the gradients' all-reduce, and every rank returns `ReplicaFailed` naming the
    /// first failed rank. A step refused for its input (rows, shapes) still joins it too. A
    /// rank that stops answering instead (hangs, or its process dies) is found by the
    /// [`timeout`](Self::timeout) or NCCL's asynchronous error, and named through rank 0's
    /// failure board: after the rendezvous rank 0 keeps listening on the master address for
    /// the trainer's life, and a rank whose step cannot finish posts whether its own step hung
    /// or it waited for the others.
    ///
    /// ```no_run
    /// use ndscope::{DistributedConfig, Manager, NDArray, ParallelTrainer};
    /// // Launched by `torchrun --nproc-per-node 2 ...`: RANK, WORLD_SIZE, LOCAL_RANK,
    /// // MASTER_ADDR and MASTER_PORT are set.
    /// let source = Manager::new_base();
    /// ndscope::manual_seed(0); // the same parameters in every process
    /// let w = source.randn([32, 10], ndscope::DType::F32)?;
    /// let mut trainer = ParallelTrainer::builder()
    ///     .distributed(DistributedConfig::from_env()?)
    ///     .build(
    ///         &[w],
    ///         |params: &[NDArray]| Ok(params[0].clone()),
    ///         |w: &NDArray, x: &NDArray, y: &NDArray| x.matmul(w)?.softmax_cross_entropy(y),
    ///     )?;
    /// // This rank's batch (its own rows of the data).
    /// let x = source.randn([64, 32], ndscope::DType::F32)?;
    /// let y = source.from_vec((0..64).map(|i| i % 10).collect::<Vec<i64>>(), [64])?;
    /// let report = trainer.step(&x, &y)?;
    /// println!("loss over every rank's rows: {}", report.loss);
    /// trainer.close()?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    pub fn distributed(mut self, config: DistributedConfig) -> Self {
        self.distributed = Some(config);
        self
    }

    /// Starts one thread per device. Each makes its device's NCCL rank, copies `source` (the
    /// parameters, float arrays on any device) to its device in its replica's manager (the
    /// same bits on every device), sets them to require gradients, calls `model` with the
    /// copies (in the order of `source`) to build its model, makes its optimizer over them and
    /// its step workspace. `step` is called with a replica's model and its shard of a batch (in
    /// the step's workspace cycle, a gradient collector recording) and returns the loss, the
    /// mean over the shard.
    ///
    /// Errors, after which nothing is left running or allocated: `InvalidArgument` for no
    /// devices, a CPU device, a device listed twice, no source parameters or an integer one;
    /// `InvalidConfig` for graph replay or a bucket size of 0; `DeviceUnavailable` for an absent
    /// device; `Unsupported` without NCCL; in a distributed world, `InvalidArgument` for other
    /// than one device, `InvalidConfig` for a bad config or a world size other than rank 0's,
    /// `Io` when rank 0 cannot listen, when the other ranks do not all come within the timeout,
    /// or when rank 0 cannot be reached within it; the model closure's or the optimizer's errors
    /// (`Panicked` for a panic) as `ReplicaFailed` naming the device. A rank whose
    /// `ncclCommInitRank` itself fails leaves the others in theirs until NCCL gives up (as
    /// with NCCL everywhere: nothing of ndscope's runs before every rank has joined).
    #[track_caller]
    pub fn build<M, F, S>(self, source: &[NDArray], model: F, step: S) -> Result<ParallelTrainer>
    where
        M: 'static,
        F: Fn(&[NDArray]) -> Result<M> + Send + Sync + 'static,
        S: Fn(&M, &NDArray, &NDArray) -> Result<NDArray> + Send + Sync + 'static,
    {
        let ctx = Ctx::new("ParallelTrainerBuilder::build");
        let mut devices = self.devices.clone();
        if let Some(config) = &self.distributed {
            config.validate(&ctx)?;
            if devices.is_empty() {
                devices = vec![Device::Cuda(config.local_rank)];
            }
            if devices.len() != 1 {
                return Err(ctx.invalid(format!(
                    "a process of a distributed world drives exactly one device (its rank's), \
                     got {} devices",
                    devices.len()
                )));
            }
        }
        check_devices(&ctx, &devices)?;
        if self.workspace.graph_replay() {
            return Err(ctx.config(
                "a parallel trainer's workspaces cannot replay graphs yet: the gradients' NCCL \
                 all-reduce is not recorded into a cycle's graph (turn graph_replay off)",
            ));
        }
        if self.bucket_bytes == 0 {
            return Err(ctx.config("bucket_bytes must be at least 1"));
        }
        if self.timeout.is_zero() {
            return Err(ctx.config("the timeout must be longer than 0"));
        }
        if source.is_empty() {
            return Err(ctx.invalid("a parallel trainer needs at least one parameter, got none"));
        }
        for p in source {
            if !p.is_open() {
                return Err(p.0.closed_error(&ctx));
            }
            if !p.dtype().is_float() {
                return Err(ctx.invalid(format!(
                    "parameter {} is {}: parameters are float arrays",
                    p.0.describe(),
                    p.dtype()
                )));
            }
        }
        // The NCCL ranks: this process's devices, or this process's one rank of the world.
        let started = Instant::now();
        let mut board = None;
        let (id, first_rank, world) = match &self.distributed {
            None => (nccl_unique_id(&ctx)?, 0, devices.len()),
            Some(config) => {
                let id = if config.rank == 0 {
                    let id = nccl_unique_id(&ctx)?;
                    if config.world_size > 1 {
                        let listener = serve_id(&ctx, config, id.to_bytes())?;
                        // Rank 0 keeps listening: the failure board.
                        board = Some(Board::serve(listener, config.world_size).map_err(|e| {
                            ctx.invalid(format!("cannot start rank 0's failure board: {e}"))
                        })?);
                    }
                    id
                } else {
                    NcclId::from_bytes(&ctx, fetch_id(&ctx, config)?)?
                };
                (id, config.rank, config.world_size)
            }
        };
        let ranks = devices.len();
        let root = Manager::new_base().with_name(&self.name);
        let make: Arc<MakeModel<M>> = Arc::new(model);
        let step: Arc<StepFn<M>> = Arc::new(step);
        let (reply_tx, replies) = mpsc::channel();
        let mut workers = Vec::with_capacity(ranks);
        let mut failure = None;
        for (slot, &device) in devices.iter().enumerate() {
            let rank = first_rank + slot;
            let setup = Setup {
                name: self.name.clone(),
                slot,
                rank,
                ranks: world,
                distributed: self.distributed.is_some(),
                device,
                id,
                root: root.clone(),
                source: source.to_vec(),
                workspace: self.workspace.clone(),
                optimizer: self.optimizer,
                bucket_bytes: self.bucket_bytes,
                timeout: self.timeout,
                phase: Arc::new(AtomicU8::new(IDLE)),
            };
            let phase = Arc::clone(&setup.phase);
            let (job_tx, jobs) = mpsc::channel();
            let replies = reply_tx.clone();
            let (make, step) = (Arc::clone(&make), Arc::clone(&step));
            let spawned = thread::Builder::new()
                .name(format!("{}-{rank}", self.name))
                .spawn(move || worker(setup, make, step, jobs, replies));
            match spawned {
                Ok(handle) => workers.push(Worker {
                    device,
                    jobs: job_tx,
                    handle: Some(handle),
                    phase,
                    hung: false,
                }),
                Err(e) => {
                    failure = Some(ctx.invalid(format!("cannot start a trainer thread: {e}")));
                    break;
                }
            }
        }
        drop(reply_tx);
        let mut trainer = ParallelTrainer {
            name: self.name,
            root,
            workers,
            replies,
            comms: Vec::new(),
            params: vec![Vec::new(); ranks],
            stats: ParallelTrainerStats::default(),
            closed: false,
            distributed: self.distributed,
            timeout: self.timeout,
            board,
            ordinals: Vec::new(),
        };
        if let Some(e) = failure {
            // The threads already started wait in ncclCommInitRank for a rank that never comes
            // (until NCCL gives up): they are told to stop and left to end on their own, not
            // waited for.
            for w in &mut trainer.workers {
                w.handle.take();
            }
            let _ = trainer.close();
            return Err(e);
        }
        // Every rank reports its setup.
        let mut ready = Vec::with_capacity(ranks);
        let mut first_error: Option<Error> = None;
        let deadline = started + self.timeout;
        let mut answered = vec![false; ranks];
        for _ in 0..ranks {
            let reply = match trainer.replies.recv_timeout(left(deadline)) {
                Ok(reply) => reply,
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    // Stuck in ncclCommInitRank (a rank of the world never came) or in the
                    // model closure: abandoned, not waited for.
                    let slot = answered.iter().position(|a| !a).unwrap_or(0);
                    for (w, a) in trainer.workers.iter_mut().zip(&answered) {
                        w.hung |= !*a;
                    }
                    let what = format!(
                        "the setup of rank {} ({})",
                        first_rank + slot,
                        trainer.workers.get(slot).map_or(Device::Cpu, |w| w.device)
                    );
                    let e = trainer.timed_out(&ctx, what, "NCCL's rendezvous of every rank, or the model closure, did not finish; the trainer was closed");
                    first_error.get_or_insert(trainer.replica_error(&ctx, slot, 0, false, e));
                    break;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            };
            if let Some(a) = answered.get_mut(reply.0) {
                *a = true;
            }
            match reply {
                (rank, Reply::Ready(Ok(r))) => ready.push((rank, r)),
                (rank, Reply::Ready(Err(e))) => {
                    first_error.get_or_insert(trainer.replica_error(&ctx, rank, 0, false, e));
                }
                (rank, _) => {
                    first_error.get_or_insert_with(|| {
                        trainer.replica_error(
                            &ctx,
                            rank,
                            0,
                            false,
                            ctx.invalid("the trainer thread stopped during its setup"),
                        )
                    });
                }
            }
        }
        let mut comms = vec![None; ranks];
        for (rank, r) in ready {
            trainer.params[rank] = r.params;
            comms[rank] = Some(r.comm);
            trainer.stats.buckets = r.buckets;
            trainer.stats.collectives_per_step = r.collectives;
            trainer.stats.bytes_per_step = r.bytes;
            trainer.ordinals = r.ordinals;
        }
        trainer.comms = comms.into_iter().flatten().collect();
        if trainer.workers.iter().any(|w| w.hung) {
            // The ranks that did set up may wait for the stuck ones: abort theirs.
            trainer.stats.broken = true;
            trainer.abort_all();
        }
        if let Some(e) = first_error {
            let _ = trainer.close();
            return Err(e);
        }
        Ok(trainer)
    }
}

fn check_devices(ctx: &Ctx, devices: &[Device]) -> Result<()> {
    if devices.is_empty() {
        return Err(ctx.invalid("a parallel trainer needs at least one device, got none"));
    }
    for (i, d) in devices.iter().enumerate() {
        if d.is_cpu() {
            return Err(ctx.invalid(format!(
                "a parallel trainer runs on CUDA devices (NCCL), got {d} at {i} in the list"
            )));
        }
        if let Some(j) = devices[..i].iter().position(|e| e == d) {
            return Err(ctx.invalid(format!(
                "device {d} is listed twice (at {j} and {i}); each replica needs its own device"
            )));
        }
        if !d.is_available() {
            return Err(ctx.unavailable(*d));
        }
    }
    Ok(())
}

/// One device's thread, as the trainer holds it.
struct Worker {
    device: Device,
    jobs: mpsc::Sender<Job>,
    handle: Option<JoinHandle<()>>,
    /// What the thread is doing (`IDLE`, `CLOSURE`, `EXCHANGE`, `UPDATE`).
    phase: Arc<AtomicU8>,
    /// It did not answer within the timeout: `close` does not wait for it.
    hung: bool,
}

enum Job {
    /// Run the step on this shard (`batch`: the rows of the whole batch), done by `deadline`.
    Step {
        x: HostArray,
        y: HostArray,
        batch: usize,
        deadline: Instant,
    },
    /// Every rank's step succeeded: all-reduce and update (`true`), or one failed: drop the
    /// gradients (`false`).
    Go(bool),
    /// Abort the communicator if it may wait for a failed rank, close everything, stop.
    Stop { abort: bool },
    /// Distributed: this process's step was refused before it ran; join the other ranks'
    /// exchange as failed (so that they learn of it) by `deadline`, reply `Skipped`.
    Skip { deadline: Instant },
}

/// One rank's part of a distributed step, from the exchange before the gradients' all-reduce.
#[derive(Clone, Copy, Debug)]
struct RankStep {
    ok: bool,
    rows: usize,
    loss: f32,
    ordinal: usize,
}

/// What a rank's setup hands back.
struct Ready {
    comm: Arc<Communicator>,
    params: Vec<NDArray>,
    buckets: usize,
    collectives: usize,
    bytes: usize,
    /// Distributed: every rank's device ordinal (empty otherwise).
    ordinals: Vec<usize>,
}

enum Reply {
    Ready(Result<Ready>),
    /// Forward and backward done (the gradients scaled; distributed: with every rank's part),
    /// or the error, and, distributed, whether the communicator may now be unusable (the
    /// trainer aborts it and is broken): the exchange failed (`Waited`: whose fault is not
    /// known here), or this rank failed after it while the others go on to the all-reduce
    /// (`Culprit`).
    Computed(Result<Option<Vec<RankStep>>>, Option<Seen>),
    /// Distributed: the exchange of a refused step joined (`true`: it failed, the trainer is
    /// broken).
    Skipped(bool),
    /// The update done with the shard's loss (`Some`), dropped (`None`), or the error, and
    /// whether it came from waiting for the collectives (a rank that did not come, an NCCL
    /// error) rather than from this replica's own work.
    Updated(Result<Option<f32>>, bool),
    /// The thread ended.
    Gone,
}

/// What a device's thread starts from.
struct Setup {
    name: String,
    /// The replica's place in this process's trainer (its replies' key).
    slot: usize,
    /// Its NCCL rank, of `ranks`.
    rank: usize,
    ranks: usize,
    /// One rank of a world of processes: steps exchange every rank's part first.
    distributed: bool,
    device: Device,
    id: NcclId,
    root: Manager,
    source: Vec<NDArray>,
    workspace: WorkspaceConfig,
    optimizer: OptimizerKind,
    bucket_bytes: usize,
    timeout: Duration,
    phase: Arc<AtomicU8>,
}

/// Says the thread is gone however it ends (returns or unwinds), so the trainer never waits
/// for it.
struct Leaving {
    rank: usize,
    replies: mpsc::Sender<(usize, Reply)>,
}

impl Drop for Leaving {
    fn drop(&mut self) {
        let _ = self.replies.send((self.rank, Reply::Gone));
    }
}

/// A replica: what its thread owns.
struct Replica<M> {
    comm: Arc<Communicator>,
    /// Distributed: this rank and the world size.
    world: Option<(usize, usize)>,
    ordinal: usize,
    model: M,
    params: Vec<NDArray>,
    optimizer: Optimizer,
    /// The parameters' indices per bucket (the last parameters first, as backward makes their
    /// gradients first).
    buckets: Vec<Vec<usize>>,
    ws: crate::Workspace,
    replica: Manager,
    steps: Manager,
    /// The current step's deadline, and the timeout it comes from.
    deadline: Instant,
    timeout: Duration,
    phase: Arc<AtomicU8>,
    /// Distributed: every rank's device ordinal, from the setup.
    ordinals: Vec<usize>,
}

/// `f`'s result, or its panic as `Panicked` (op `op`, which ran `during`).
#[track_caller]
fn caught<R>(op: &'static str, during: &str, f: impl FnOnce() -> Result<R>) -> Result<R> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let ctx = Ctx::new(op);
            Err(Error::Panicked {
                op: ctx.op,
                at: ctx.at,
                during: during.to_string(),
                message: take_panic_message(payload),
            })
        }
    }
}

fn setup<M>(s: &Setup, make: &MakeModel<M>) -> Result<Replica<M>> {
    let ctx = Ctx::new("ParallelTrainerBuilder::build");
    let ordinal = match s.device {
        Device::Cuda(o) => o,
        Device::Cpu => return Err(ctx.invalid("a replica's device is a CUDA device")),
    };
    let deadline = Instant::now() + s.timeout;
    let comm = Arc::new(Communicator::init(&ctx, ordinal, s.id, s.rank, s.ranks)?);
    let built = setup_replica(s, make, &comm, ordinal);
    if !s.distributed {
        return built;
    }
    // Every process's rank learns whether every other one is ready: one that failed its setup
    // must not leave the others waiting in their first step's exchange.
    let failed = setup_barrier(&ctx, &comm, s, built.is_ok(), deadline);
    match (built, failed) {
        (Ok(mut r), Ok((failed, ordinals))) if failed.is_empty() => {
            r.ordinals = ordinals;
            Ok(r)
        }
        (Ok(r), failed) => {
            dismantle(r, false);
            Err(match failed {
                Ok((failed, _)) => Error::Backend {
                    op: ctx.op,
                    at: ctx.at,
                    reason: format!(
                        "rank(s) {} of {} failed their setup (their processes report why)",
                        failed
                            .iter()
                            .map(usize::to_string)
                            .collect::<Vec<_>>()
                            .join(", "),
                        s.ranks
                    ),
                },
                Err(e) => e,
            })
        }
        (Err(e), _) => Err(e),
    }
}

/// Distributed: a sum all-reduce of two slots per rank (1 when set up, its device ordinal), in
/// a manager of its own on the rank's device, waited for until `deadline`; the ranks that are
/// not set up, and every rank's device ordinal.
fn setup_barrier(
    ctx: &Ctx,
    comm: &Communicator,
    s: &Setup,
    ok: bool,
    deadline: Instant,
) -> Result<(Vec<usize>, Vec<usize>)> {
    let m = Manager::new_base_on(s.device)?.with_name("setup-barrier");
    let ordinal = match s.device {
        Device::Cuda(o) => o,
        Device::Cpu => 0,
    };
    let flags = (|| {
        let mut flags = vec![0.0f32; 2 * s.ranks];
        if let Some(mine) = flags.get_mut(2 * s.rank..2 * s.rank + 2) {
            mine.copy_from_slice(&[if ok { 1.0 } else { 0.0 }, ordinal as f32]);
        }
        let flags = m.from_vec(flags, [2 * s.ranks])?;
        all_reduce_sum_(ctx, comm, &[&flags])?;
        comm.wait(ctx, deadline, s.timeout)?;
        flags.to_vec::<f32>()
    })();
    let _ = m.close();
    let flags = flags?;
    let failed = flags
        .chunks(2)
        .enumerate()
        .filter(|(_, f)| f[0] != 1.0)
        .map(|(i, _)| i)
        .collect();
    Ok((failed, flags.chunks(2).map(|f| f[1] as usize).collect()))
}

/// A replica's parts of `setup`, on its communicator.
fn setup_replica<M>(
    s: &Setup,
    make: &MakeModel<M>,
    comm: &Arc<Communicator>,
    ordinal: usize,
) -> Result<Replica<M>> {
    let comm = Arc::clone(comm);
    let replica = s
        .root
        .new_sub_manager_on(s.device)?
        .with_name(&format!("replica-{}", s.rank));
    let steps = s
        .root
        .new_sub_manager_on(s.device)?
        .with_name(&format!("steps-{}", s.rank));
    let made = (|| {
        let params = {
            let _active = replica.activate();
            let mut params = Vec::with_capacity(s.source.len());
            for p in &s.source {
                // `to_device` keeps the source's owner: the copy moves to the replica.
                let copy = p.to_device(s.device)?;
                if let Err(e) = copy.attach(&replica) {
                    let _ = copy.close();
                    return Err(e);
                }
                if let Some(name) = p.name() {
                    copy.set_name(&name);
                }
                copy.set_requires_gradient(true)?;
                params.push(copy);
            }
            params
        };
        let model = {
            let _active = replica.activate();
            caught(
                "ParallelTrainerBuilder::build",
                &format!("the model closure of parallel trainer '{}'", s.name),
                || make(&params),
            )?
        };
        let optimizer = Optimizer::new(&params, s.optimizer)?;
        replica.cap();
        let ws = steps.workspace("step", s.workspace.clone())?;
        // Buckets from the last parameter back.
        let mut buckets: Vec<Vec<usize>> = Vec::new();
        let mut filled = 0usize;
        for i in (0..params.len()).rev() {
            let bytes = params[i].nbytes();
            match buckets.last_mut() {
                Some(b) if filled + bytes <= s.bucket_bytes => {
                    b.push(i);
                    filled += bytes;
                }
                _ => {
                    buckets.push(vec![i]);
                    filled = bytes;
                }
            }
        }
        Ok((params, model, optimizer, ws, buckets))
    })();
    match made {
        Ok((params, model, optimizer, ws, buckets)) => Ok(Replica {
            comm,
            world: s.distributed.then_some((s.rank, s.ranks)),
            ordinal,
            model,
            params,
            optimizer,
            buckets,
            ws,
            replica,
            steps,
            deadline: Instant::now() + s.timeout,
            timeout: s.timeout,
            phase: Arc::clone(&s.phase),
            ordinals: Vec::new(),
        }),
        Err(e) => {
            let _ = steps.close();
            let _ = replica.close();
            Err(e)
        }
    }
}

fn worker<M>(
    s: Setup,
    make: Arc<MakeModel<M>>,
    step: Arc<StepFn<M>>,
    jobs: mpsc::Receiver<Job>,
    replies: mpsc::Sender<(usize, Reply)>,
) {
    let rank = s.slot;
    let leaving = Leaving {
        rank,
        replies: replies.clone(),
    };
    let made = caught(
        "ParallelTrainerBuilder::build",
        &format!("the setup of parallel trainer '{}' on {}", s.name, s.device),
        || setup(&s, &*make),
    );
    let mut r = match made {
        Ok(r) => r,
        Err(e) => {
            let _ = replies.send((rank, Reply::Ready(Err(e))));
            // Waits for the trainer's stop (it may abort every communicator first).
            while let Ok(job) = jobs.recv() {
                if let Job::Stop { .. } = job {
                    break;
                }
            }
            drop(leaving);
            return;
        }
    };
    let ready = Ready {
        comm: Arc::clone(&r.comm),
        params: r.params.clone(),
        buckets: r.buckets.len(),
        collectives: r.params.len(),
        bytes: r.params.iter().map(NDArray::nbytes).sum(),
        ordinals: r.ordinals.clone(),
    };
    let _ = replies.send((rank, Reply::Ready(Ok(ready))));
    let during = format!("the step of parallel trainer '{}' on {}", s.name, s.device);
    let mut abort = false;
    while let Ok(job) = jobs.recv() {
        match job {
            Job::Step {
                x,
                y,
                batch,
                deadline,
            } => {
                r.deadline = deadline;
                let go_on = run_step(
                    &mut r,
                    &*step,
                    &during,
                    (x, y, batch),
                    &jobs,
                    &replies,
                    rank,
                );
                r.phase.store(IDLE, Ordering::Relaxed);
                if !go_on {
                    break;
                }
            }
            Job::Go(_) => {}
            Job::Skip { deadline } => {
                r.deadline = deadline;
                r.phase.store(EXCHANGE, Ordering::Relaxed);
                let broken = exchange(&r, None, None).is_err();
                r.phase.store(IDLE, Ordering::Relaxed);
                let _ = replies.send((rank, Reply::Skipped(broken)));
            }
            Job::Stop { abort: a } => {
                abort = a;
                break;
            }
        }
    }
    dismantle(r, abort);
    drop(leaving);
}

/// Closes a replica: its model, optimizer and managers, then its communicator (aborted first
/// with `abort`; destroyed after its queued work unless the trainer still holds it).
fn dismantle<M>(r: Replica<M>, abort: bool) {
    if abort {
        r.comm.abort();
    }
    let Replica {
        comm,
        model,
        params,
        optimizer,
        ws,
        replica,
        steps,
        ..
    } = r;
    drop(model);
    optimizer.close();
    drop(params);
    drop(ws);
    let _ = steps.close();
    let _ = replica.close();
    // Destroyed here (after its queued work) unless the trainer still holds it.
    drop(comm);
}

/// One step on this replica; `false` when the trainer said stop meanwhile.
fn run_step<M>(
    r: &mut Replica<M>,
    step: &StepFn<M>,
    during: &str,
    (x, y, batch): (HostArray, HostArray, usize),
    jobs: &mpsc::Receiver<Job>,
    replies: &mpsc::Sender<(usize, Reply)>,
    rank: usize,
) -> bool {
    let rows = x.dims().first().copied().unwrap_or(0);
    r.phase.store(CLOSURE, Ordering::Relaxed);
    let (scope, computed) = match r.ws.open() {
        Ok(scope) => {
            let computed = caught(STEP, during, || {
                let _active = scope.activate();
                let x = scope.from_host(&x)?;
                let y = scope.from_host(&y)?;
                let collector = gradient_collector()?;
                let loss = step(&r.model, &x, &y)?;
                collector.backward(&loss)?;
                collector.close();
                if r.world.is_some() {
                    // Every rank's loss travels with the exchange.
                    let value = loss_value(&loss)?;
                    return Ok((loss, value));
                }
                // Each shard's gradient is the mean over its rows: weighted by its share of
                // the batch, the sum over the ranks is the mean over the whole batch (uneven
                // shards too).
                if rows != batch {
                    scale_gradients(r, rows as f64 / batch as f64)?;
                }
                Ok((loss, 0.0))
            });
            (Some(scope), computed)
        }
        Err(e) => (None, Err(e)),
    };
    let (reply, broken, loss) = if r.world.is_some() {
        // Every rank joins the exchange, failed or not: none enters the gradients' all-reduce
        // unless every rank will.
        r.phase.store(EXCHANGE, Ordering::Relaxed);
        let local = computed.as_ref().ok().map(|(_, v)| (rows, *v));
        match exchange(r, scope.as_ref(), local) {
            Err(e) => (Err(e), Some(Seen::Waited), None),
            Ok(world) => match computed {
                Err(e) => (Err(e), None, None),
                Ok((loss, _)) => match remote_failure(r, &world) {
                    Some(e) => (Err(e), None, None),
                    None => {
                        let total: usize = world.iter().map(|w| w.rows).sum();
                        let scaled = if rows != total {
                            caught(STEP, during, || {
                                scale_gradients(r, rows as f64 / total as f64)
                            })
                        } else {
                            Ok(())
                        };
                        match scaled {
                            // The others go on to the all-reduce: this rank cannot follow.
                            Err(e) => (Err(e), Some(Seen::Culprit), None),
                            Ok(()) => (Ok(Some(world)), None, Some(loss)),
                        }
                    }
                },
            },
        }
    } else {
        match computed {
            Ok((loss, _)) => (Ok(None), None, Some(loss)),
            Err(e) => (Err(e), None, None),
        }
    };
    let _ = replies.send((rank, Reply::Computed(reply, broken)));
    wait_go(r, (scope, loss), jobs, replies, rank, during)
}

/// Multiplies every gradient of the replica by `scale`.
fn scale_gradients<M>(r: &Replica<M>, scale: f64) -> Result<()> {
    for p in &r.params {
        p.gradient()?.mul_scalar_(scale)?;
    }
    Ok(())
}

/// A scalar loss's value.
fn loss_value(loss: &NDArray) -> Result<f32> {
    if loss.dtype() == DType::F32 {
        loss.to_scalar::<f32>()
    } else {
        loss.to_dtype(DType::F32)?.to_scalar::<f32>()
    }
}

/// Distributed: every rank's part of the step, from a sum all-reduce of a vector with four
/// slots per rank (succeeded, rows, loss, device ordinal), each rank filling its own (`local`:
/// its rows and loss, `None` when its step failed or was refused). In the step's cycle
/// (`scope`) or, without one, in the step manager.
fn exchange<M>(
    r: &Replica<M>,
    scope: Option<&crate::Scope>,
    local: Option<(usize, f32)>,
) -> Result<Vec<RankStep>> {
    let ctx = Ctx::new(STEP);
    let Some((me, world)) = r.world else {
        return Err(ctx.invalid("an exchange of rank parts outside a distributed world"));
    };
    let mut slots = vec![0.0f64; 4 * world];
    if let Some(mine) = slots.get_mut(4 * me..4 * me + 4) {
        let (ok, rows, loss) = match local {
            Some((rows, loss)) => (1.0, rows as f64, f64::from(loss)),
            None => (0.0, 0.0, 0.0),
        };
        mine.copy_from_slice(&[ok, rows, loss, r.ordinal as f64]);
    }
    let flags = match scope {
        Some(scope) => scope.from_vec(slots, [4 * world])?,
        None => r.steps.from_vec(slots, [4 * world])?,
    };
    let summed = all_reduce_sum_(&ctx, &r.comm, &[&flags])
        .and_then(|()| r.comm.wait(&ctx, r.deadline, r.timeout))
        .and_then(|()| flags.to_vec::<f64>());
    let _ = flags.close();
    let summed = summed?;
    Ok(summed
        .chunks(4)
        .map(|c| RankStep {
            // A rank's slot is 1.0 or 0.0 plus the others' zeros: exact.
            ok: c[0] == 1.0,
            rows: c[1] as usize,
            loss: c[2] as f32,
            ordinal: c[3] as usize,
        })
        .collect())
}

/// Distributed: `ReplicaFailed` naming the first other rank whose step failed, if any.
fn remote_failure<M>(r: &Replica<M>, world: &[RankStep]) -> Option<Error> {
    let failed: Vec<usize> = world
        .iter()
        .enumerate()
        .filter(|(_, w)| !w.ok)
        .map(|(i, _)| i)
        .collect();
    let &first = failed.first()?;
    let ctx = Ctx::new(STEP);
    let me = r.world.map_or(0, |(me, _)| me);
    let list: Vec<String> = failed.iter().map(usize::to_string).collect();
    Some(Error::ReplicaFailed {
        op: ctx.op,
        at: ctx.at,
        device: Device::Cuda(world[first].ordinal),
        rank: first,
        step: 0,
        after_all_reduce: false,
        source: Box::new(Error::Backend {
            op: ctx.op,
            at: ctx.at,
            reason: format!(
                "rank(s) {} of {} failed or refused their step (their processes report why); \
                 rank {me} dropped its gradients",
                list.join(", "),
                world.len()
            ),
        }),
    })
}

/// Waits for the trainer's decision after the forward and backward passes, carries it out, and
/// ends the step's cycle (`scope`) before it answers.
fn wait_go<M>(
    r: &mut Replica<M>,
    (scope, loss): (Option<crate::Scope>, Option<NDArray>),
    jobs: &mpsc::Receiver<Job>,
    replies: &mpsc::Sender<(usize, Reply)>,
    rank: usize,
    during: &str,
) -> bool {
    let go = match jobs.recv() {
        Ok(Job::Go(go)) => go,
        Ok(Job::Stop { abort }) => {
            if abort {
                r.comm.abort();
            }
            let _ = r.optimizer.zero_gradients();
            return false;
        }
        Ok(Job::Step { .. } | Job::Skip { .. }) | Err(_) => {
            let _ = r.optimizer.zero_gradients();
            return false;
        }
    };
    let waited = std::cell::Cell::new(false);
    let updated = match (go, loss) {
        (true, Some(loss)) => caught(STEP, during, || {
            let ctx = Ctx::new("ParallelTrainer::step");
            r.phase.store(UPDATE, Ordering::Relaxed);
            for bucket in &r.buckets {
                let mut grads = Vec::with_capacity(bucket.len());
                for &i in bucket {
                    grads.push(r.params[i].gradient()?);
                }
                let refs: Vec<&NDArray> = grads.iter().collect();
                all_reduce_sum_(&ctx, &r.comm, &refs)?;
            }
            r.optimizer.step()?;
            // The collectives done (or found hung or failed) before anything is read.
            waited.set(true);
            r.comm.wait(&ctx, r.deadline, r.timeout)?;
            waited.set(false);
            loss_value(&loss).map(Some)
        }),
        _ => caught(STEP, during, || r.optimizer.zero_gradients().map(|_| None)),
    };
    let waited = updated.is_err() && waited.get();
    // The step's cycle ends before the trainer hears of it: when `step` returns, no array of
    // the step is alive on any device.
    drop(scope);
    let _ = replies.send((rank, Reply::Updated(updated, waited)));
    true
}

/// Data-parallel training over several CUDA devices in one process: one replica of the model
/// per device, one thread each, gradients averaged with NCCL (DJL's `Trainer` over several
/// devices; PyTorch's `DistributedDataParallel`, one thread per device instead of a process).
///
/// ```text
/// parallel-trainer        (CPU; closed by close/drop: every byte on every device freed)
/// ├─ replica-0            cuda:0: the parameters, their gradients and the optimizer's state; capped
/// ├─ steps-0              cuda:0: owns workspace "step", one cycle per step
/// ├─ replica-1            cuda:1 ...
/// └─ steps-1
/// ```
///
/// - **Replicas**: made from one source set (`to_device` copies: the same bits on every
///   device). Every replica runs the same optimizer on the same averaged gradients, so the
///   replicas stay bit-identical (NCCL's sum gives every rank the same bits).
/// - **A step** ([`step`](Self::step)) splits the batch's rows into one contiguous shard per
///   device (sizes differ by at most one, the larger first), and each thread, in a cycle of its
///   workspace: copies its shard onto its device, runs the step closure under a gradient
///   collector, runs backward, scales its gradients by its share of the batch (shard rows /
///   batch rows), then, once every rank has come that far, sums the gradients over the ranks
///   with `ncclAllReduce` (`ncclSum`, in place, queued on the device's stream), in buckets of
///   up to [`bucket_bytes`](ParallelTrainerBuilder::bucket_bytes) (one NCCL group each, the
///   last parameters first), and runs its optimizer step. The result: the parameters 1-device
///   training on the whole batch gives, up to float rounding.
/// - **No overlap with backward yet**: every collective is queued after the whole backward
///   pass. Each device has one stream (every op in order, no events: DESIGN §5), so a
///   collective queued during backward would still run after the kernels queued before it;
///   overlap needs a second stream per device with an event per bucket, and a hook when a
///   gradient is final (a weight gradient is often a pending product, computed only when it is
///   read). For the MLP [32, 64, 64, 10] that is 1 group of 6 all-reduces and 27,688 bytes per
///   step and device ([`stats`](Self::stats)).
/// - **Failures**: a rank whose step fails (an error or a panic of the closure, a device error)
///   makes every rank drop its gradients without exchanging them, so no replica changes and
///   the trainer goes on; `step` returns `ReplicaFailed` naming the device. No rank ever waits
///   in a collective for a rank that failed before it. A failure after the all-reduce was
///   queued aborts every communicator (`ncclCommAbort`) and the trainer refuses later steps.
/// - **Timeouts**: a rank that stops answering (a step closure that does not return, a
///   collective that waits for a rank that never comes, a peer process that died: NCCL's
///   asynchronous error) fails the step after at most
///   [`timeout`](ParallelTrainerBuilder::timeout) with `ReplicaFailed` naming it (source
///   `TimedOut` for a hang); the communicators are aborted and the trainer refuses later steps.
///   Across processes every rank names the same one, through rank 0's failure board.
/// - **Several processes**, one rank each, as `torchrun` launches them:
///   [`ParallelTrainerBuilder::distributed`] with a [`DistributedConfig`] (from torchrun's
///   environment or given in code). Each process then steps on its own batch; the gradients
///   are averaged over every rank's rows, and a rank that fails makes every rank's step fail.
/// - **Graph replay** of the step workspaces is refused for now (the NCCL calls are not
///   recorded into a cycle's graph).
///
/// ```no_run
/// use ndscope::{DType, Device, Manager, NDArray, ParallelTrainer, Sgd};
/// let source = Manager::new_base();
/// let w = source.randn([32, 10], DType::F32)?;
/// let mut trainer = ParallelTrainer::builder()
///     .devices(&[Device::Cuda(0), Device::Cuda(1)])
///     .optimizer(Sgd { momentum: 0.9, ..Sgd::new(0.01) })
///     .build(
///         &[w],
///         |params: &[NDArray]| Ok(params[0].clone()),
///         |w: &NDArray, x: &NDArray, y: &NDArray| x.matmul(w)?.softmax_cross_entropy(y),
///     )?;
/// let x = source.randn([64, 32], DType::F32)?;
/// let y = source.from_vec((0..64).map(|i| i % 10).collect::<Vec<i64>>(), [64])?;
/// let report = trainer.step(&x, &y)?;
/// println!("loss {}", report.loss);
/// trainer.close()?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct ParallelTrainer {
    name: String,
    root: Manager,
    workers: Vec<Worker>,
    replies: mpsc::Receiver<(usize, Reply)>,
    comms: Vec<Arc<Communicator>>,
    params: Vec<Vec<NDArray>>,
    stats: ParallelTrainerStats,
    closed: bool,
    distributed: Option<DistributedConfig>,
    timeout: Duration,
    /// Distributed, rank 0: the failure board the ranks post on when a step fails.
    board: Option<Board>,
    /// Distributed: every rank's device ordinal.
    ordinals: Vec<usize>,
}

/// A reply, or why none came.
enum Got {
    Reply(usize, Reply),
    TimedOut,
    Gone,
}

/// The time left until `deadline` (at least a millisecond: a wait that has run out still
/// looks once).
fn left(deadline: Instant) -> Duration {
    deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1))
}

impl fmt::Debug for ParallelTrainer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ParallelTrainer")
            .field("name", &self.name)
            .field("devices", &self.devices())
            .field("stats", &self.stats)
            .finish()
    }
}

impl ParallelTrainer {
    /// A builder: no devices yet, [`WorkspaceConfig::default`], `Sgd::new(0.01)`, buckets of
    /// 25 MiB.
    pub fn builder() -> ParallelTrainerBuilder {
        ParallelTrainerBuilder {
            name: "parallel-trainer".to_string(),
            devices: Vec::new(),
            workspace: WorkspaceConfig::default(),
            optimizer: OptimizerKind::Sgd(Sgd::new(0.01)),
            bucket_bytes: BUCKET_BYTES,
            distributed: None,
            timeout: DEFAULT_TRAINER_TIMEOUT,
        }
    }

    /// A reply, waited for until `deadline`.
    fn next(&self, deadline: Instant) -> Got {
        match self.replies.recv_timeout(left(deadline)) {
            Ok((slot, reply)) => Got::Reply(slot, reply),
            Err(mpsc::RecvTimeoutError::Timeout) => Got::TimedOut,
            Err(mpsc::RecvTimeoutError::Disconnected) => Got::Gone,
        }
    }

    /// A step's next reply (its replica marked in `answered`), `None` when the threads are
    /// gone, or, past `deadline`, the error naming the replica that did not answer (step
    /// `number`, in its update's part with `update`; counted as failed).
    fn step_reply(
        &mut self,
        ctx: &Ctx,
        deadline: Instant,
        answered: &mut [bool],
        (number, update): (u64, bool),
    ) -> Result<Option<(usize, Reply)>> {
        match self.next(deadline) {
            Got::Reply(slot, reply) => {
                if let Some(a) = answered.get_mut(slot) {
                    *a = true;
                }
                Ok(Some((slot, reply)))
            }
            Got::TimedOut => {
                let e = self.unanswered(ctx, answered, number, update);
                self.stats.failed += 1;
                Err(e)
            }
            Got::Gone => Ok(None),
        }
    }

    /// `TimedOut` for `what`, waited for this trainer's timeout.
    fn timed_out(&self, ctx: &Ctx, what: String, why: &str) -> Error {
        Error::TimedOut {
            op: ctx.op,
            at: ctx.at,
            what,
            waited: self.timeout,
            why: format!("the parallel trainer's timeout (ParallelTrainerBuilder::timeout); {why}"),
        }
    }

    /// Single process: the step timed out in `phase` (`CLOSURE`: forward and backward,
    /// `UPDATE`: the all-reduce and the optimizer). The replicas that did not answer are
    /// abandoned, every communicator aborted; the error names the first.
    fn stalled(&mut self, ctx: &Ctx, answered: &[bool], number: u64, update: bool) -> Error {
        self.stats.broken = true;
        self.abort_all();
        for (w, a) in self.workers.iter_mut().zip(answered) {
            w.hung |= !*a;
        }
        let slot = answered.iter().position(|a| !a).unwrap_or(0);
        let phase = self
            .workers
            .get(slot)
            .map_or(IDLE, |w| w.phase.load(Ordering::Relaxed));
        let doing = if phase == CLOSURE {
            "its step closure (forward and backward)"
        } else {
            "its gradients' all-reduce and optimizer step"
        };
        let what = format!(
            "{doing} on rank {} ({})",
            slot,
            self.workers.get(slot).map_or(Device::Cpu, |w| w.device)
        );
        let e = self.timed_out(
            ctx,
            what,
            "every rank's communicator was aborted and the trainer refuses later steps",
        );
        self.replica_error(ctx, slot, number, update, e)
    }

    /// Distributed: this rank cannot finish step `number` (`local`): its exchange or
    /// all-reduce failed or timed out, a fault it cannot attribute (`seen` is `Waited`), or its
    /// own step failed or did not return (`Culprit`: this rank is named). Aborts the
    /// communicator, posts what it saw on rank 0's board and reads the other ranks' posts: the
    /// rank to name is the first whose own step failed or hung, else the first that never
    /// posted (its process died or hangs), else rank 0 if its board does not answer, else this
    /// one.
    fn blame(&mut self, ctx: &Ctx, number: u64, seen: Seen, update: bool, local: Error) -> Error {
        self.stats.broken = true;
        self.abort_all();
        let Some(config) = self.distributed.clone() else {
            return self.replica_error(ctx, 0, number, update, local);
        };
        let me = config.rank;
        let mine = match self.workers.first().map(|w| w.device) {
            Some(Device::Cuda(o)) => o,
            _ => 0,
        };
        let grace = (self.timeout / 2).clamp(Duration::from_secs(1), Duration::from_secs(30));
        let device = |rank: usize, ordinal: Option<usize>| {
            Device::Cuda(
                ordinal
                    .or_else(|| self.ordinals.get(rank).copied())
                    .unwrap_or(0),
            )
        };
        let named = |rank: usize, ordinal: Option<usize>, source: Error| Error::ReplicaFailed {
            op: ctx.op,
            at: ctx.at,
            device: device(rank, ordinal),
            rank,
            step: number,
            after_all_reduce: update,
            source: Box::new(source),
        };
        if seen == Seen::Culprit {
            // This rank's own fault: said once for the others to read, not waited on.
            let _ = post_and_read(&config, number, seen, mine, Duration::ZERO);
            return named(me, Some(mine), local);
        }
        let posts = match post_and_read(&config, number, seen, mine, grace) {
            Ok(posts) => posts,
            Err(why) if me != 0 => {
                let source = Error::Backend {
                    op: ctx.op,
                    at: ctx.at,
                    reason: format!(
                        "rank 0 does not answer: its failure board at {} cannot be reached \
                         ({why}), so its process died or hangs; on this rank: {local}",
                        config.master()
                    ),
                };
                return named(0, None, source);
            }
            Err(_) => return named(me, Some(mine), local),
        };
        if let Some(&(rank, _, ordinal)) = posts
            .iter()
            .filter(|p| p.1 == Seen::Culprit)
            .min_by_key(|p| p.0)
        {
            let what = format!("the step of rank {rank} (cuda:{ordinal})");
            let source = self.timed_out(
                ctx,
                what,
                &format!(
                    "rank {rank} reported that its own step failed or did not return; this \
                     rank's communicator was aborted"
                ),
            );
            return named(rank, Some(ordinal), source);
        }
        let absent = (0..config.world_size).find(|r| posts.iter().all(|p| p.0 != *r));
        match absent {
            Some(rank) => {
                let reason = format!(
                    "rank {rank} stopped answering: it did not report on rank 0's board within \
                     {:.1} s of this rank's failure, so its process died or hangs; on this \
                     rank: {local}",
                    grace.as_secs_f64()
                );
                let source = match local {
                    Error::TimedOut { .. } => {
                        self.timed_out(ctx, format!("rank {rank}'s part of step {number}"), &reason)
                    }
                    _ => Error::Backend {
                        op: ctx.op,
                        at: ctx.at,
                        reason,
                    },
                };
                named(rank, None, source)
            }
            // Every rank waited: a collective failed on all of them (a network error).
            None => named(me, Some(mine), local),
        }
    }

    /// `ReplicaFailed` for the replica in `slot` (its rank: its place in the world).
    fn replica_error(&self, ctx: &Ctx, slot: usize, step: u64, after: bool, e: Error) -> Error {
        Error::ReplicaFailed {
            op: ctx.op,
            at: ctx.at,
            device: self.workers.get(slot).map_or(Device::Cpu, |w| w.device),
            rank: self.distributed.as_ref().map_or(0, |c| c.rank) + slot,
            step,
            after_all_reduce: after,
            source: Box::new(e),
        }
    }

    /// One training step on a batch: `x` `[batch, ...]` and `y` `[batch, ...]` (the labels),
    /// on the host or any device, split into one shard of rows per device (see the type's
    /// docs). Returns the losses once every replica is updated.
    ///
    /// Errors, after which no replica changed: `InvalidArgument` for a 0-d input, `x` and `y`
    /// with different rows, or fewer rows than devices (a replica would get none); `ShutDown`
    /// once closed or broken; `ReplicaFailed` naming the first device that failed, with its
    /// error (`Panicked` for a panic of the step closure).
    ///
    /// In a distributed world ([`ParallelTrainerBuilder::distributed`]) `x` and `y` are this
    /// rank's own batch (not split), the result's `shard_losses` and `rows` are every rank's,
    /// and `loss` is the mean over every rank's rows. A refused batch still takes part in the
    /// ranks' exchange (as a failure), so that the other ranks fail too instead of waiting;
    /// another rank's failure is `ReplicaFailed` naming that rank and its device ordinal, with
    /// a `Backend` error as its source (the failed process reports the real error). A failure
    /// of the exchange itself breaks the trainer (its communicator aborted).
    #[track_caller]
    pub fn step(&mut self, x: &NDArray, y: &NDArray) -> Result<ParallelStep> {
        let ctx = Ctx::new("ParallelTrainer::step");
        if self.closed || self.stats.broken {
            return Err(Error::ShutDown {
                op: ctx.op,
                at: ctx.at,
                service: format!("parallel trainer '{}'", self.name),
                reason: if self.closed {
                    "it was closed".to_string()
                } else {
                    "a step failed after a collective was queued (the gradients' all-reduce, \
                     or in a distributed world the ranks' exchange) and its communicators were \
                     aborted; close it"
                        .to_string()
                },
            });
        }
        let ranks = self.workers.len();
        let number = self.stats.steps + self.stats.failed;
        let (batch, rows, xs, ys) = match self.prepare(&ctx, x, y) {
            Ok(prepared) => prepared,
            Err(e) => {
                if self.distributed.is_some() {
                    // The other ranks wait in the exchange: join it as failed.
                    self.skip();
                    self.stats.failed += 1;
                }
                return Err(e);
            }
        };
        let deadline = Instant::now() + self.timeout;
        // The replicas' own waits end at the deadline and say so: a little longer here.
        let wait_until = deadline + MARGIN;
        for (w, (x, y)) in self.workers.iter().zip(xs.into_iter().zip(ys)) {
            let job = Job::Step {
                x,
                y,
                batch,
                deadline,
            };
            if w.jobs.send(job).is_err() {
                // A thread is gone: nothing was sent to the rest yet beyond this step's shard.
                self.stats.broken = true;
                return Err(ctx.invalid(format!(
                    "the thread of {} is gone; close the trainer",
                    w.device
                )));
            }
        }
        // Forward and backward on every rank.
        let mut first_error: Option<Error> = None;
        let mut gone = false;
        // Distributed: the ranks' exchange failed here (this rank cannot tell whose fault), or
        // this rank failed after it: what to post on rank 0's board.
        let mut unattributed: Option<(Error, Seen)> = None;
        let mut world: Option<Vec<RankStep>> = None;
        let mut answered = vec![false; ranks];
        for _ in 0..ranks {
            let Some((slot, reply)) =
                self.step_reply(&ctx, wait_until, &mut answered, (number, false))?
            else {
                gone = true;
                break;
            };
            match reply {
                Reply::Computed(Ok(parts), broken) => {
                    world = parts;
                    if broken.is_some() {
                        gone = true;
                    }
                }
                Reply::Computed(Err(e), Some(seen)) if self.distributed.is_some() => {
                    gone = true;
                    unattributed = Some((e, seen));
                }
                Reply::Computed(Err(e), broken) => {
                    if broken.is_some() {
                        // The exchange failed: the other ranks may wait for this one.
                        gone = true;
                    }
                    if first_error.is_none() {
                        first_error = Some(match e {
                            Error::ReplicaFailed {
                                op,
                                at,
                                device,
                                rank,
                                after_all_reduce,
                                source,
                                ..
                            } if self.distributed.is_some() => Error::ReplicaFailed {
                                op,
                                at,
                                device,
                                rank,
                                step: number,
                                after_all_reduce,
                                source,
                            },
                            e => self.replica_error(&ctx, slot, number, false, e),
                        });
                    }
                }
                _ => {
                    gone = true;
                    if first_error.is_none() {
                        first_error = Some(self.replica_error(
                            &ctx,
                            slot,
                            number,
                            false,
                            ctx.invalid("its thread stopped"),
                        ));
                    }
                }
            }
        }
        let go = first_error.is_none() && unattributed.is_none();
        for w in &self.workers {
            let _ = w.jobs.send(Job::Go(go));
        }
        if let Some((local, seen)) = unattributed {
            let e = self.blame(&ctx, number, seen, false, local);
            self.stats.failed += 1;
            return Err(e);
        }
        if gone {
            self.stats.broken = true;
            self.abort_all();
            self.stats.failed += 1;
            return Err(first_error.unwrap_or_else(|| ctx.invalid("a trainer thread is gone")));
        }
        // The update (or the dropped gradients) on every rank.
        let mut losses = vec![0.0f32; ranks];
        let mut late: Option<Error> = None;
        let mut answered = vec![false; ranks];
        for _ in 0..ranks {
            let Some((slot, reply)) =
                self.step_reply(&ctx, wait_until, &mut answered, (number, go))?
            else {
                self.stats.broken = true;
                break;
            };
            match reply {
                Reply::Updated(Ok(loss), _) => {
                    if let (Some(l), Some(at)) = (loss, losses.get_mut(slot)) {
                        *at = l;
                    }
                }
                Reply::Updated(Err(e), waited) => {
                    if late.is_some() {
                        continue;
                    }
                    if go && self.distributed.is_some() {
                        // Its collectives failed or timed out (whose fault?), or its own update
                        // failed (this rank's: said on the board for the others).
                        let seen = if waited { Seen::Waited } else { Seen::Culprit };
                        late = Some(self.blame(&ctx, number, seen, true, e));
                    } else {
                        late = Some(self.replica_error(&ctx, slot, number, go, e));
                        if go {
                            // Others may wait in the collective for this rank: abort it.
                            self.stats.broken = true;
                            self.abort_all();
                        }
                    }
                }
                _ => {
                    self.stats.broken = true;
                    self.abort_all();
                    late.get_or_insert_with(|| {
                        self.replica_error(
                            &ctx,
                            slot,
                            number,
                            go,
                            ctx.invalid("its thread stopped"),
                        )
                    });
                }
            }
        }
        if let Some(e) = first_error.or(late) {
            self.stats.failed += 1;
            return Err(e);
        }
        self.stats.steps += 1;
        if let Some(world) = world {
            // Distributed: every rank's rows and loss, from the exchange.
            let total: usize = world.iter().map(|w| w.rows).sum();
            let loss = world
                .iter()
                .map(|w| f64::from(w.loss) * w.rows as f64)
                .sum::<f64>()
                / total.max(1) as f64;
            return Ok(ParallelStep {
                loss: loss as f32,
                shard_losses: world.iter().map(|w| w.loss).collect(),
                rows: world.iter().map(|w| w.rows).collect(),
            });
        }
        let loss = losses
            .iter()
            .zip(&rows)
            .map(|(&l, &n)| f64::from(l) * n as f64)
            .sum::<f64>()
            / batch as f64;
        Ok(ParallelStep {
            loss: loss as f32,
            shard_losses: losses,
            rows,
        })
    }

    /// A step's batch, checked and split into one shard per replica: the batch's rows, each
    /// shard's rows, and the shards of `x` and `y`.
    fn prepare(&self, ctx: &Ctx, x: &NDArray, y: &NDArray) -> Result<Prepared> {
        let ranks = self.workers.len();
        let (Some(&batch), Some(&labels)) = (x.dims().first(), y.dims().first()) else {
            return Err(ctx.invalid(format!(
                "a step splits its batch along axis 0: x {} and y {} need one",
                x.shape(),
                y.shape()
            )));
        };
        if batch != labels {
            return Err(ctx.invalid(format!(
                "x has {batch} rows and y {labels}: one label row per input row"
            )));
        }
        if batch < ranks {
            return Err(ctx.invalid(format!(
                "a batch of {batch} rows cannot be split over {ranks} devices: each replica \
                 needs at least one row"
            )));
        }
        let rows: Vec<usize> = (0..ranks)
            .map(|i| batch / ranks + usize::from(i < batch % ranks))
            .collect();
        let xs = x.to_host()?.split_rows(&rows)?;
        let ys = y.to_host()?.split_rows(&rows)?;
        Ok((batch, rows, xs, ys))
    }

    /// The step's replicas did not all answer by the deadline (`update`: in the update's part):
    /// the ones that did not are abandoned and named (single process), or, distributed, this
    /// rank's board post says whether its own step hung (`Culprit`) or it waited for the others.
    fn unanswered(&mut self, ctx: &Ctx, answered: &[bool], number: u64, update: bool) -> Error {
        if self.distributed.is_none() {
            return self.stalled(ctx, answered, number, update);
        }
        let phase = self
            .workers
            .first()
            .map_or(IDLE, |w| w.phase.load(Ordering::Relaxed));
        for w in &mut self.workers {
            w.hung = true;
        }
        let me = self.distributed.as_ref().map_or(0, |c| c.rank);
        let device = self.workers.first().map_or(Device::Cpu, |w| w.device);
        let (seen, what) = if phase == CLOSURE {
            (
                Seen::Culprit,
                format!("the step closure of rank {me} ({device})"),
            )
        } else {
            (
                Seen::Waited,
                format!("the collectives of rank {me} ({device})"),
            )
        };
        let local = self.timed_out(
            ctx,
            what,
            "its communicator was aborted and the trainer refuses later steps",
        );
        self.blame(ctx, number, seen, update, local)
    }

    /// Distributed: this process's step was refused; its rank joins the other ranks' exchange
    /// as failed. A failed exchange breaks the trainer.
    fn skip(&mut self) {
        let mut broken = true;
        let deadline = Instant::now() + self.timeout;
        if let Some(w) = self.workers.first() {
            if w.jobs.send(Job::Skip { deadline }).is_ok() {
                if let Got::Reply(_, Reply::Skipped(b)) = self.next(deadline + MARGIN) {
                    broken = b;
                }
            }
        }
        if broken {
            self.stats.broken = true;
            self.abort_all();
        }
    }

    /// Aborts every rank's communicator (from this thread: a rank waiting in a collective for a
    /// rank that failed stops waiting).
    fn abort_all(&self) {
        for comm in &self.comms {
            comm.abort();
        }
    }

    /// The devices, rank order.
    pub fn devices(&self) -> Vec<Device> {
        self.workers.iter().map(|w| w.device).collect()
    }

    /// The number of replicas (devices) of this process (1 in a distributed world).
    pub fn replicas(&self) -> usize {
        self.workers.len()
    }

    /// The world this process is one rank of, when built with
    /// [`distributed`](ParallelTrainerBuilder::distributed).
    pub fn distributed(&self) -> Option<&DistributedConfig> {
        self.distributed.as_ref()
    }

    /// Replica `rank`'s parameters (on its device, in the order of the source parameters), to
    /// read between steps. `InvalidArgument` for a rank out of range. `rank` is the replica's
    /// place in this process (0 in a distributed world, whatever the process's rank).
    #[track_caller]
    pub fn parameters(&self, rank: usize) -> Result<&[NDArray]> {
        self.params.get(rank).map(Vec::as_slice).ok_or_else(|| {
            Ctx::new("ParallelTrainer::parameters").invalid(format!(
                "rank {rank} of a trainer with {} replicas",
                self.workers.len()
            ))
        })
    }

    /// The trainer's manager: the parent of every replica's managers.
    pub fn manager(&self) -> &Manager {
        &self.root
    }

    /// The counters, and the per-step collective figures.
    pub fn stats(&self) -> ParallelTrainerStats {
        self.stats.clone()
    }

    /// The trainer's subtree ([`Manager::report`]): each replica and its step workspace.
    pub fn report(&self) -> ManagerReport {
        self.root.report()
    }

    /// The trainer's subtree as text ([`Manager::debug_dump`]).
    pub fn debug_dump(&self, level: usize) -> String {
        self.root.debug_dump(level)
    }

    /// Stops the threads (each closes its replica's managers and destroys its communicator,
    /// aborting it first if the trainer is broken), then closes the trainer's manager: every
    /// byte the trainer held on every device is freed. Idempotent. `InvalidArgument` when
    /// called from a step closure of this trainer (it would wait for itself).
    #[track_caller]
    pub fn close(&mut self) -> Result<()> {
        let ctx = Ctx::new("ParallelTrainer::close");
        if self
            .workers
            .iter()
            .any(|w| w.handle.as_ref().map(|h| h.thread().id()) == Some(thread::current().id()))
        {
            return Err(ctx.invalid("a parallel trainer cannot be closed from its own thread"));
        }
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        let abort = self.stats.broken;
        for w in &self.workers {
            let _ = w.jobs.send(Job::Stop { abort });
        }
        // The communicators are destroyed by the threads, once the trainer lets go of them.
        self.comms.clear();
        for w in &mut self.workers {
            // A thread still inside the step closure is not waited for: it ends on its own
            // when the closure returns (its arrays are closed below meanwhile).
            let handle = w.handle.take();
            if let (Some(h), false) = (handle, w.hung) {
                let _ = h.join();
            }
        }
        self.params.clear();
        // Rank 0's board goes once this process's rank has left.
        self.board.take();
        self.root.close()
    }
}

impl Drop for ParallelTrainer {
    fn drop(&mut self) {
        let _ = self.close();
    }
}
