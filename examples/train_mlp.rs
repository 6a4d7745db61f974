//! The main job: train an MLP on a generated 10-class problem with the full manager tree.
//!
//! ```text
//! system
//! ├─ data      the generated samples
//! │  └─ prefetch   the next batches, cut on a background thread into a circular workspace
//! └─ model     parameters, their gradients and the optimizer's state; capped while training
//!    └─ trainer    owns workspace "batch" (and, with --manual-backward, the layer workspaces)
//!       ├─ batch#N                  one workspace cycle per step: the forward pass (the
//!       │                           tape's saved arrays), backward's temporaries, the results
//!       ├─ ws-all-layers-act#N      --manual-backward: the activations the backward pass reads
//!       ├─ ws-activation-grad#N     --manual-backward: the gradients handed down the layers
//!       └─ ws-layer-working-mem#N   --manual-backward: one layer's temporaries
//! ```
//!
//! By default a step is what a DJL or PyTorch user writes: a gradient collector records the
//! forward pass, `backward` fills the parameters' gradients, and an optimizer (`Sgd` with
//! momentum, or `Adam`) updates them in place. `--manual-backward` runs the hand-written
//! backward pass instead (fused weight updates, DL4J's layer workspaces), for comparison.
//!
//! Run it with `cargo run --release --example train_mlp -- [flags]`:
//!
//! ```text
//! --epochs N        passes over the training set (default 8)
//! --batch N         samples per step (default 128)
//! --hidden A,B,...  hidden layer widths (default 256,128)
//! --samples N       training samples (default 180000; 10000 more are held out)
//! --optimizer sgd|adam  the optimizer of the autograd step (default sgd)
//! --manual-backward the hand-written backward pass and SGD update instead of autograd
//! --lr X            learning rate (default 0.02 for sgd, 0.001 for adam)
//! --momentum X      SGD momentum (default 0.9)
//! --seed N          seed of every random number (default 7)
//! --no-workspace    plain scopes instead of workspace cycles, for the step and every layer
//!                   (LayerWorkspaceMgr::no_workspaces; to compare)
//! --no-prefetch     cut each batch in the step instead of on the prefetch thread (to compare)
//! --save PATH       write the trained parameters (w1, b1, …) to PATH as safetensors
//! --device cpu|cuda where to train (default cpu)
//! --devices N       data-parallel training over cuda:0..N in this process (ParallelTrainer:
//!                   one replica and thread per device, each batch split between them, the
//!                   gradients averaged with NCCL); autograd and f32 only, batches cut in the
//!                   step, held-out accuracy measured on replica 0
//! --procs N         the same with N processes, one device each, as `torchrun
//!                   --nproc-per-node N` launches them: this process starts N copies of
//!                   itself with RANK, WORLD_SIZE, LOCAL_RANK (= rank: cuda:rank),
//!                   MASTER_ADDR=127.0.0.1 and a free MASTER_PORT, and waits for them. A
//!                   process started with RANK and WORLD_SIZE set (by --procs or by torchrun)
//!                   is one rank: it trains on its share of each batch (rows split as the
//!                   trainer splits them) and rank 0 prints and checks the results
//! --dtype f32|bf16|f16  the autograd step's precision (default f32): bf16 or f16 is mixed
//!                   precision as PyTorch's AMP, the forward pass under autocast (products in
//!                   the half type, the loss in f32), f32 parameters, gradients and optimizer
//!                   state, and for f16 a GradScaler
//! --no-graph        on CUDA, launch every op of the step instead of replaying the learned
//!                   step as a CUDA graph (WorkspaceConfig::graph_replay); replay cuts the
//!                   batches in the step: a prefetched batch lies at another address of the
//!                   ring every step, and a product reading it cannot be rewritten in a graph,
//!                   where the step's own cut lands at the same place of its block each time
//! --trace PATH      record memory over the run and write it as a Chrome trace (Perfetto UI,
//!                   chrome://tracing)
//! --snapshot PATH   record memory over the run and write it as a PyTorch memory snapshot
//!                   (https://pytorch.org/memory_viz)
//! ```
//!
//! With `--trace` or `--snapshot`, the recording covers the whole run, from the data to the
//! closing of the model (the default run makes 1.49M events and keeps the last 1M: a 28 MB
//! trace and a 43 MB snapshot; `--epochs 1 --samples 20000` makes a small one).
//!
//! It prints per-epoch loss, accuracy, steps/s, live bytes on the device (which must stay flat)
//! and the allocations ndscope asked the system allocator or the CUDA driver for during the
//! epoch (0 once the workspaces have learned), how long the steps waited for the prefetch
//! thread, a `debug_dump` of the model at the end, and fails
//! (exit code 1) unless the loss fell, the held-out accuracy exceeds 90%, the live bytes stayed
//! flat and, with a workspace, no epoch after the first allocated.

#[path = "mlp/mod.rs"]
mod mlp;

use std::process::{Command, ExitCode};
use std::time::Instant;

use std::cell::RefCell;

use mlp::{make_data, Mlp, Precision};
use ndscope::{
    fmt_bytes, manual_seed, memory_usage, Adam, ArrayKind, DType, Device, DistributedConfig,
    LayerWorkspaceMgr, Manager, NDArray, Optimizer, OptimizerKind, ParallelTrainer, Prefetcher,
    RecordOptions, Sgd, WorkspaceConfig,
};

const FEATURES: usize = 784;
const CLASSES: usize = 10;
const HELD_OUT: usize = 10_000;
/// How far apart the blobs are, relative to their noise.
const SPREAD: f64 = 0.17;

struct Args {
    epochs: usize,
    batch: usize,
    hidden: Vec<usize>,
    samples: usize,
    lr: Option<f64>,
    momentum: f64,
    adam: bool,
    manual: bool,
    seed: u64,
    workspace: bool,
    prefetch: bool,
    graph: bool,
    save: Option<std::path::PathBuf>,
    device: Device,
    /// `--devices N`: data-parallel over this many CUDA devices.
    devices: Option<usize>,
    /// `--procs N`: launch this many ranks, one process each.
    procs: Option<usize>,
    /// This process is one rank of a world (RANK and WORLD_SIZE are set).
    distributed: Option<DistributedConfig>,
    dtype: DType,
    trace: Option<String>,
    snapshot: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        epochs: 8,
        batch: 128,
        hidden: vec![256, 128],
        samples: 180_000,
        lr: None,
        momentum: 0.9,
        adam: false,
        manual: false,
        seed: 7,
        workspace: true,
        prefetch: true,
        graph: true,
        save: None,
        device: Device::Cpu,
        devices: None,
        procs: None,
        distributed: None,
        dtype: DType::F32,
        trace: None,
        snapshot: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--epochs" => args.epochs = number(&value("--epochs")?)?,
            "--batch" => args.batch = number(&value("--batch")?)?,
            "--samples" => args.samples = number(&value("--samples")?)?,
            "--hidden" => {
                args.hidden = value("--hidden")?
                    .split(',')
                    .map(number)
                    .collect::<Result<_, _>>()?
            }
            "--lr" => args.lr = Some(float(&value("--lr")?)?),
            "--optimizer" => {
                args.adam = match value("--optimizer")?.as_str() {
                    "sgd" => false,
                    "adam" => true,
                    other => return Err(format!("--optimizer must be sgd or adam, not {other:?}")),
                }
            }
            "--manual-backward" => args.manual = true,
            "--momentum" => args.momentum = float(&value("--momentum")?)?,
            "--seed" => args.seed = number::<u64>(&value("--seed")?)?,
            "--no-workspace" => args.workspace = false,
            "--trace" => args.trace = Some(value("--trace")?),
            "--snapshot" => args.snapshot = Some(value("--snapshot")?),
            "--no-prefetch" => args.prefetch = false,
            "--no-graph" => args.graph = false,
            "--save" => args.save = Some(value("--save")?.into()),
            "--devices" => args.devices = Some(number(&value("--devices")?)?),
            "--procs" => args.procs = Some(number(&value("--procs")?)?),
            "--device" => {
                args.device = match value("--device")?.as_str() {
                    "cpu" => Device::Cpu,
                    "cuda" => Device::Cuda(0),
                    other => return Err(format!("--device must be cpu or cuda, not {other:?}")),
                }
            }
            "--dtype" => {
                args.dtype = match value("--dtype")?.as_str() {
                    "f32" => DType::F32,
                    "bf16" => DType::BF16,
                    "f16" => DType::F16,
                    other => return Err(format!("--dtype must be f32, bf16 or f16, not {other:?}")),
                }
            }
            "-h" | "--help" => {
                return Err("usage: train_mlp [--epochs N] [--batch N] [--hidden A,B] [--samples N] \
                            [--optimizer sgd|adam] [--manual-backward] [--lr X] [--momentum X] [--seed N] [--no-workspace] [--no-prefetch] [--save PATH] \
                            [--device cpu|cuda] [--devices N] [--procs N] [--dtype f32|bf16|f16] [--no-graph] [--trace PATH] [--snapshot PATH]"
                    .into())
            }
            other => return Err(format!("unknown flag {other:?} (try --help)")),
        }
    }
    if args.epochs == 0 || args.batch == 0 || args.samples < args.batch {
        return Err("--epochs and --batch must be positive and --samples at least --batch".into());
    }
    if args.hidden.contains(&0) {
        return Err("hidden widths must be positive".into());
    }
    // Replay on CUDA with workspace cycles. A prefetched batch lies at another address of the
    // ring every step (the first product reading it would diverge every time): the batches are
    // cut in the step then, at the same place of the block each time.
    args.graph = args.graph && args.workspace && !args.device.is_cpu();
    if args.graph {
        args.prefetch = false;
    }
    if args.manual && args.dtype != DType::F32 {
        return Err("--manual-backward computes in f32: it takes no --dtype bf16 or f16".into());
    }
    if std::env::var_os("RANK").is_some() && std::env::var_os("WORLD_SIZE").is_some() {
        // One rank of a world (launched by --procs or torchrun): one device, this rank's.
        let config = DistributedConfig::from_env().map_err(|e| e.to_string())?;
        args.procs = None;
        args.devices = Some(1);
        args.distributed = Some(config);
    }
    if let Some(n) = args.procs {
        if n == 0 {
            return Err("--procs must be at least 1".into());
        }
        if args.devices.is_some() {
            return Err("--procs runs one device per process: it takes no --devices".into());
        }
    }
    if let Some(n) = args.devices.or(args.procs) {
        if n == 0 {
            return Err("--devices must be at least 1".into());
        }
        if args.manual || args.dtype != DType::F32 {
            return Err(
                "--devices trains with autograd in f32 on CUDA devices: it takes no \
                 --manual-backward or --dtype bf16/f16 (and trains on cuda:0..N)"
                    .into(),
            );
        }
        args.device = Device::Cuda(0);
        args.prefetch = false;
        args.graph = false;
    }
    if args.manual && args.adam {
        return Err(
            "--manual-backward is plain SGD with momentum: it takes no --optimizer adam".into(),
        );
    }
    Ok(args)
}

fn number<T: std::str::FromStr>(text: &str) -> Result<T, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a valid number here"))
}

fn float(text: &str) -> Result<f64, String> {
    match text.trim().parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        _ => Err(format!("{text:?} is not a finite number")),
    }
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_mlp: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How a training step learns.
enum Learner {
    /// Autograd: a gradient collector per step, then this optimizer's step.
    Autograd(RefCell<Optimizer>),
    /// The hand-written backward pass, its arrays placed by these layer workspaces.
    Manual(Box<LayerWorkspaceMgr>),
}

/// One epoch's figures.
struct Epoch {
    loss: f64,
    accuracy: f64,
    steps_per_s: f64,
    live: usize,
    /// Allocations from the system allocator or the driver during the epoch.
    allocations: u64,
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let recording = args.trace.is_some() || args.snapshot.is_some();
    if recording {
        ndscope::start_recording(RecordOptions::default())?;
    }
    manual_seed(args.seed);
    if let Some(n) = args.procs {
        return launch(n);
    }
    if let Some(n) = args.devices {
        return run_parallel(&args, n);
    }
    let total = args.samples + HELD_OUT;

    let data = Manager::new_base_on(args.device)?.with_name("data");
    let model = Manager::new_base_on(args.device)?.with_name("model");
    let mut sizes = vec![FEATURES];
    sizes.extend(&args.hidden);
    sizes.push(CLASSES);
    let t0 = Instant::now();
    let (x, y) = make_data(&data, total, FEATURES, CLASSES, 3, SPREAD)?;
    // In mixed precision the samples are stored in the half type, as a half-precision dataset
    // is (half the data's memory; each step's batch needs no conversion).
    let x = match args.dtype {
        DType::F32 => x,
        low => {
            let half = x.to_dtype(low)?;
            x.close()?;
            half
        }
    };
    let lr = args.lr.unwrap_or(if args.adam { 0.001 } else { 0.02 });
    // The parameters (with their gradients, for autograd) and the optimizer's state are made
    // in the model before it is capped; they would be allowed after it too.
    let (net, optimizer) = if args.manual {
        (Mlp::new(&model, &sizes)?, None)
    } else {
        let net = Mlp::with_gradients(&model, &sizes)?;
        let params = net.parameters();
        let optimizer = if args.adam {
            Optimizer::new(&params, Adam::new(lr))?
        } else {
            Optimizer::new(
                &params,
                Sgd {
                    momentum: args.momentum,
                    ..Sgd::new(lr)
                },
            )?
        };
        (net, Some(RefCell::new(optimizer)))
    };
    // The loss scaler's state (f16) is made in the model before it is capped, as the rest.
    let precision = Precision::new(&model, args.dtype)?;
    model.cap(); // from here on, a temporary landing in the model fails at its line
    let trainer = model.new_sub_manager()?.with_name("trainer");
    let config = WorkspaceConfig::builder()
        .graph_replay(args.graph)
        .build()?;
    let ws = trainer.workspace("batch", config)?;
    // How a step learns: the optimizer of the autograd step, or, for the hand-written one,
    // where each kind of its arrays lives (DL4J's layer workspaces, or plain scopes).
    let learner = match optimizer {
        Some(optimizer) => Learner::Autograd(optimizer),
        None if args.workspace => Learner::Manual(Box::new(LayerWorkspaceMgr::training(&trainer)?)),
        None => Learner::Manual(Box::new(LayerWorkspaceMgr::no_workspaces(&trainer))),
    };
    let method = match (&learner, args.adam) {
        (Learner::Manual(_), _) => {
            format!(
                "hand-written backward, SGD lr {lr} momentum {}",
                args.momentum
            )
        }
        (Learner::Autograd(_), true) => format!("autograd, Adam lr {lr}"),
        (Learner::Autograd(_), false) => {
            format!("autograd, SGD lr {lr} momentum {}", args.momentum)
        }
    };
    let method = match (args.dtype, &precision.scaler) {
        (DType::F32, _) => method,
        (low, Some(_)) => format!("{method}, mixed precision ({low} autocast, GradScaler)"),
        (low, None) => format!("{method}, mixed precision ({low} autocast)"),
    };
    println!(
        "train_mlp: MLP {sizes:?}, {} training + {HELD_OUT} held-out samples, batch {}, {} epochs, \
         {method}, {}, {} on {} (data generated in {:.2} s)",
        args.samples,
        args.batch,
        args.epochs,
        if args.workspace { "workspace cycles" } else { "plain scopes" },
        match (args.prefetch, args.graph) {
            (true, _) => "batches prefetched",
            (false, false) => "batches cut in the step",
            (false, true) => "batches cut in the step, the step replayed as a CUDA graph",
        },
        args.device,
        t0.elapsed().as_secs_f64()
    );

    // One step in a fresh scope of the trainer: a workspace cycle, or a plain sub-scope.
    let in_step = |f: &dyn Fn(&Manager) -> ndscope::Result<(f64, i64)>| {
        if args.workspace {
            ws.cycle(f)
        } else {
            trainer.scope(f)
        }
    };
    let batch_of = |start: usize, len: usize| -> ndscope::Result<(NDArray, NDArray)> {
        Ok((x.narrow(0, start, len)?, y.narrow(0, start, len)?))
    };

    let steps = args.samples / args.batch;
    // Every training batch of every epoch, cut two ahead on a background thread into a
    // circular workspace (each valid until the step two later asks for its batch).
    let mut prefetched = if args.prefetch {
        let (x, y, batch) = (x.clone(), y.clone(), args.batch);
        let order = (0..args.epochs).flat_map(move |_| 0..steps);
        Some(Prefetcher::from_iter(
            &data,
            2,
            order,
            move |_scope, step| {
                let start = step * batch;
                Ok(vec![x.narrow(0, start, batch)?, y.narrow(0, start, batch)?].into())
            },
        )?)
    } else {
        None
    };
    let mut epochs: Vec<Epoch> = Vec::new();
    let train_start = Instant::now();
    for epoch in 1..=args.epochs {
        let started = Instant::now();
        let allocated_before = memory_usage(args.device).driver_allocations;
        let (mut loss, mut correct) = (0.0, 0i64);
        for step in 0..steps {
            let batch = match prefetched.as_mut() {
                Some(batches) => Some(batches.next().ok_or("the prefetcher ended early")??),
                None => None,
            };
            let (l, c) = in_step(&|_batch| {
                let (xb, yb) = match &batch {
                    Some(b) => (b.as_slice()[0].clone(), b.as_slice()[1].clone()),
                    None => batch_of(step * args.batch, args.batch)?,
                };
                let out = match &learner {
                    Learner::Autograd(opt) => {
                        net.autograd_step_in(&precision, &mut opt.borrow_mut(), &xb, &yb)?
                    }
                    Learner::Manual(layers) => {
                        net.train_step(layers, &xb, &yb, lr, args.momentum)?
                    }
                };
                Ok((
                    out.loss.to_scalar::<f32>()? as f64,
                    out.correct.to_scalar::<i64>()?,
                ))
            })?;
            loss += l;
            correct += c;
        }
        let e = Epoch {
            loss: loss / steps as f64,
            accuracy: correct as f64 / (steps * args.batch) as f64,
            steps_per_s: steps as f64 / started.elapsed().as_secs_f64(),
            live: memory_usage(args.device).in_use,
            allocations: memory_usage(args.device).driver_allocations - allocated_before,
        };
        println!(
            "epoch {epoch:>2}: loss {:.4}  train accuracy {:>6.2}%  {:>6.0} steps/s  live {} on {}  allocations {}",
            e.loss,
            100.0 * e.accuracy,
            e.steps_per_s,
            fmt_bytes(e.live),
            args.device,
            e.allocations
        );
        epochs.push(e);
    }
    let train_secs = train_start.elapsed().as_secs_f64();
    if let Some(batches) = &prefetched {
        let s = batches.stats();
        println!(
            "prefetch: {} batches cut on the background thread; the steps waited for {} of them, \
             {:.1} ms in all ({:.2}% of the training time)",
            s.consumed,
            s.waits,
            s.waited.as_secs_f64() * 1e3,
            100.0 * s.waited.as_secs_f64() / train_secs
        );
    }
    drop(prefetched);

    // Held-out accuracy, one cycle per batch of a workspace of its own: a forward pass over a
    // batch needs other memory than a training step, and sharing the step's learned block
    // would make every evaluation cycle spill.
    let eval_ws = trainer.workspace("eval", WorkspaceConfig::default())?;
    let mut held_correct = 0i64;
    let mut start = args.samples;
    while start < total {
        let len = args.batch.min(total - start);
        let count = |_: &Manager| -> ndscope::Result<i64> {
            let (xb, yb) = batch_of(start, len)?;
            net.correct_in(precision.low, &xb, &yb)?.to_scalar::<i64>()
        };
        held_correct += if args.workspace {
            eval_ws.cycle(count)?
        } else {
            trainer.scope(count)?
        };
        start += len;
    }
    let held_accuracy = held_out(held_correct, train_secs, steps * args.batch * args.epochs);
    if args.workspace {
        let s = ws.stats();
        println!(
            "workspace 'batch': {} cycles, block {} (learned from the first cycle), {} spilled in {} allocations, {} reallocations",
            s.cycles,
            fmt_bytes(s.capacity),
            fmt_bytes(s.spilled_bytes),
            s.spilled_count,
            s.reallocations
        );
        if args.graph {
            let g = ws.stats().graph;
            println!(
                "graph replay of 'batch': {}, {} replays, {} fallbacks{}, {} calls in {} graph(s) per step",
                g.state,
                g.replays,
                g.fallbacks,
                g.last_fallback
                    .map_or_else(String::new, |why| format!(" (last: {why})")),
                g.calls,
                g.graphs
            );
        }
        let s = eval_ws.stats();
        println!(
            "workspace 'eval': {} cycles, block {}, {} spilled in {} allocations",
            s.cycles,
            fmt_bytes(s.capacity),
            fmt_bytes(s.spilled_bytes),
            s.spilled_count
        );
        for kind in [
            ArrayKind::Activations,
            ArrayKind::ActivationGrad,
            ArrayKind::FfWorkingMem,
        ] {
            let layers = match &learner {
                Learner::Manual(layers) => Some(layers),
                Learner::Autograd(_) => None,
            };
            if let Some(lw) = layers.and_then(|l| l.workspace(kind)) {
                let s = lw.stats();
                println!(
                    "workspace '{}' ({kind}): {} cycles, block {}, {} reallocations",
                    lw.name(),
                    s.cycles,
                    fmt_bytes(s.capacity),
                    s.reallocations
                );
            }
        }
    }
    if let Some(path) = &args.save {
        net.parameters().save_safetensors(path)?;
        println!("saved the parameters to {}", path.display());
    }
    println!("\n{}", model.debug_dump(1));

    let verdict = check(&args, &epochs, held_accuracy);
    model.close()?;
    data.close()?;
    println!(
        "closed: {} in use on {} after closing the model and the data",
        fmt_bytes(memory_usage(args.device).in_use),
        args.device
    );
    if recording {
        write_recording(&args)?;
    }
    verdict.map_err(Into::into)
}

/// `--devices N`: data-parallel training over cuda:0..N with a [`ParallelTrainer`]. The data
/// and the source parameters are made on the host; each step's batch is split between the
/// replicas; the held-out accuracy is measured with replica 0's parameters. In a world of
/// processes (`--procs`, torchrun) this process is one rank on its device: every rank makes the
/// same data and parameters (the same seed), steps on its own rows of each batch, and rank 0
/// reports.
fn run_parallel(args: &Args, n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let lead = args.distributed.as_ref().is_none_or(|c| c.rank == 0);
    let total = args.samples + HELD_OUT;
    let host = Manager::new_base().with_name("data");
    let mut sizes = vec![FEATURES];
    sizes.extend(&args.hidden);
    sizes.push(CLASSES);
    let t0 = Instant::now();
    let (x, y) = make_data(&host, total, FEATURES, CLASSES, 3, SPREAD)?;
    let source = Mlp::with_gradients(&host, &sizes)?.parameters().into_vec();
    let lr = args.lr.unwrap_or(if args.adam { 0.001 } else { 0.02 });
    let optimizer: OptimizerKind = if args.adam {
        Adam::new(lr).into()
    } else {
        Sgd {
            momentum: args.momentum,
            ..Sgd::new(lr)
        }
        .into()
    };
    let model =
        |params: &[NDArray]| -> ndscope::Result<Mlp> { Ok(Mlp::from_parameters(params, CLASSES)) };
    let builder = ParallelTrainer::builder()
        .name("train_mlp")
        .optimizer(optimizer)
        .workspace(WorkspaceConfig::builder().graph_replay(false).build()?);
    let builder = match &args.distributed {
        Some(config) => builder.distributed(config.clone()),
        None => builder.devices(&(0..n).map(Device::Cuda).collect::<Vec<_>>()),
    };
    let mut trainer = builder.build(&source, model, |net: &Mlp, x: &NDArray, y: &NDArray| {
        Mlp::loss(&net.logits(x)?, y)
    })?;
    let devices = trainer.devices();
    // This process's rows of each batch: all of them, or its rank's share (as the trainer
    // splits a batch between devices: sizes differ by at most one, the larger first).
    let (world, rank) = args
        .distributed
        .as_ref()
        .map_or((1, 0), |c| (c.world_size, c.rank));
    let share = |r: usize| args.batch / world + usize::from(r < args.batch % world);
    let (offset, rows) = ((0..rank).map(share).sum::<usize>(), share(rank));
    let over = match &args.distributed {
        Some(c) => format!(
            "{} processes (one device each, this one rank {})",
            c.world_size, c.rank
        ),
        None => format!("{n} devices"),
    };
    if lead {
        println!(
            "train_mlp: MLP {sizes:?}, {} training + {HELD_OUT} held-out samples, batch {} split \
             over {over}, {} epochs, {optimizer:?}, data-parallel (ParallelTrainer, NCCL; \
             {} all-reduces in {} bucket(s), {} per step and device) (data generated in {:.2} s)",
            args.samples,
            args.batch,
            args.epochs,
            trainer.stats().collectives_per_step,
            trainer.stats().buckets,
            fmt_bytes(trainer.stats().bytes_per_step),
            t0.elapsed().as_secs_f64()
        );
    }
    // Where this process's memory is reported: its rank's device, or all of them.
    let on = match &args.distributed {
        Some(_) => devices[0].to_string(),
        None => format!("{n} devices"),
    };
    let live = || -> usize { devices.iter().map(|&d| memory_usage(d).in_use).sum() };
    let allocated = || -> u64 {
        devices
            .iter()
            .map(|&d| memory_usage(d).driver_allocations)
            .sum()
    };
    let steps = args.samples / args.batch;
    let mut epochs: Vec<Epoch> = Vec::new();
    let train_start = Instant::now();
    for epoch in 1..=args.epochs {
        let started = Instant::now();
        let allocated_before = allocated();
        let mut loss = 0.0;
        for step in 0..steps {
            let start = step * args.batch + offset;
            let xb = x.narrow(0, start, rows)?;
            let yb = y.narrow(0, start, rows)?;
            loss += f64::from(trainer.step(&xb, &yb)?.loss);
            xb.close()?;
            yb.close()?;
        }
        let e = Epoch {
            loss: loss / steps as f64,
            accuracy: f64::NAN,
            steps_per_s: steps as f64 / started.elapsed().as_secs_f64(),
            live: live(),
            allocations: allocated() - allocated_before,
        };
        if lead {
            println!(
                "epoch {epoch:>2}: loss {:.4}  {:>6.0} steps/s  live {} on {}  allocations {}",
                e.loss,
                e.steps_per_s,
                fmt_bytes(e.live),
                on,
                e.allocations
            );
        }
        epochs.push(e);
    }
    let train_secs = train_start.elapsed().as_secs_f64();
    if !lead {
        // The other ranks hold the same parameters: rank 0 measures and reports.
        trainer.close()?;
        host.close()?;
        return Ok(());
    }
    // Held-out accuracy with replica 0's parameters, one cycle per batch on its device.
    let net = model(trainer.parameters(0)?)?;
    let eval = Manager::new_base_on(devices[0])?.with_name("eval");
    let eval_ws = eval.workspace("eval", WorkspaceConfig::default())?;
    let mut held_correct = 0i64;
    let mut start = args.samples;
    while start < total {
        let len = args.batch.min(total - start);
        held_correct += eval_ws.cycle(|scope| {
            let xb = scope.from_host(&x.narrow(0, start, len)?.to_host()?)?;
            let yb = scope.from_host(&y.narrow(0, start, len)?.to_host()?)?;
            net.correct_in(None, &xb, &yb)?.to_scalar::<i64>()
        })?;
        start += len;
    }
    if let Some(path) = &args.save {
        net.parameters().save_safetensors(path)?;
        println!("saved replica 0's parameters to {}", path.display());
    }
    drop(net);
    let held_accuracy = held_out(held_correct, train_secs, steps * args.batch * args.epochs);
    let stats = trainer.stats();
    println!(
        "parallel trainer: {} steps, {} failed",
        stats.steps, stats.failed
    );
    println!("\n{}", trainer.debug_dump(1));
    let verdict = check(args, &epochs, held_accuracy);
    trainer.close()?;
    eval.close()?;
    host.close()?;
    println!(
        "closed: {} in use on {} after closing the trainer",
        fmt_bytes(live()),
        on
    );
    if args.trace.is_some() || args.snapshot.is_some() {
        write_recording(args)?;
    }
    verdict.map_err(Into::into)
}

/// The held-out accuracy of `correct` predictions, printed with the training time and the
/// rate over `samples` training samples.
fn held_out(correct: i64, train_secs: f64, samples: usize) -> f64 {
    let accuracy = correct as f64 / HELD_OUT as f64;
    println!(
        "held-out accuracy {:.2}% after {:.1} s of training ({:.0} samples/s)",
        100.0 * accuracy,
        train_secs,
        samples as f64 / train_secs
    );
    accuracy
}

/// The job's own checks: it learned, and memory stayed flat.
fn check(args: &Args, epochs: &[Epoch], held_accuracy: f64) -> Result<(), String> {
    let (first, last) = (&epochs[0], &epochs[epochs.len() - 1]);
    if epochs.len() > 1 && last.loss >= first.loss {
        return Err(format!(
            "the loss did not fall: {:.4} → {:.4}",
            first.loss, last.loss
        ));
    }
    if held_accuracy <= 0.90 {
        return Err(format!(
            "held-out accuracy {:.2}% is not above 90%",
            100.0 * held_accuracy
        ));
    }
    if epochs.iter().any(|e| e.live != first.live) {
        let lives: Vec<String> = epochs.iter().map(|e| fmt_bytes(e.live)).collect();
        return Err(format!("live bytes changed between epochs: {lives:?}"));
    }
    if args.workspace && epochs[1..].iter().any(|e| e.allocations > 0) {
        let counts: Vec<u64> = epochs.iter().map(|e| e.allocations).collect();
        return Err(format!(
            "epochs after the first allocated memory (per epoch: {counts:?}); a learned workspace should not"
        ));
    }
    Ok(())
}

/// Stops the memory recording and writes the files `--trace` and `--snapshot` asked for.
fn write_recording(args: &Args) -> ndscope::Result<()> {
    let Some(recording) = ndscope::stop_recording() else {
        return Ok(());
    };
    println!(
        "memory recording: {} events over {:.1} s ({} dropped)",
        recording.events().len(),
        recording.duration().as_secs_f64(),
        recording.dropped()
    );
    if let Some(path) = &args.trace {
        recording.write_chrome_trace(path)?;
        println!("wrote the Chrome trace to {path}: open it in https://ui.perfetto.dev or chrome://tracing");
    }
    if let Some(path) = &args.snapshot {
        recording.write_memory_snapshot(path)?;
        println!("wrote the PyTorch memory snapshot to {path}: open it in https://pytorch.org/memory_viz");
    }
    Ok(())
}

/// `--procs N`: starts `n` copies of this program with this one's arguments (less `--procs N`)
/// and torchrun's variables (rank `r` on `cuda:r`, rank 0 at `127.0.0.1` on a free port), and
/// waits for them all; the first that fails makes the others stop.
fn launch(n: usize) -> Result<(), Box<dyn std::error::Error>> {
    let exe = std::env::current_exe()?;
    let mut rest = Vec::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == "--procs" {
            it.next();
        } else {
            rest.push(a);
        }
    }
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    println!(
        "train_mlp: launching {n} ranks (RANK 0..{n}, MASTER_ADDR 127.0.0.1, MASTER_PORT {port})"
    );
    let mut children = Vec::with_capacity(n);
    for rank in 0..n {
        let child = Command::new(&exe)
            .args(&rest)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .spawn();
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(format!("cannot start rank {rank}: {e}").into());
            }
        }
    }
    let mut failed: Option<String> = None;
    let mut done = vec![false; n];
    while done.iter().any(|d| !d) {
        for (rank, c) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            if let Some(status) = c.try_wait()? {
                done[rank] = true;
                if !status.success() && failed.is_none() {
                    failed = Some(format!("rank {rank} failed ({status})"));
                }
            }
        }
        if failed.is_some() {
            // The others are told to stop (their trainers would fail the step anyway).
            for (rank, c) in children.iter_mut().enumerate() {
                if !done[rank] {
                    let _ = c.kill();
                    let _ = c.wait();
                    done[rank] = true;
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    match failed {
        Some(why) => Err(why.into()),
        None => Ok(()),
    }
}
