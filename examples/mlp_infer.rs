//! Times inference of an MLP 784→1024→1024→10 (f32, random weights) on the CPU, or on a GPU with
//! `--device cuda`, as `benches/peers/mlp_infer.py` times the same network in PyTorch, in turns
//! with it:
//!
//! - latency at batch 1: the median time of one request through a `ParallelInference` (one
//!   client, sequential mode) and through a `Predictor` called on this thread;
//! - throughput at batch 64: samples per second through a `ParallelInference` with
//!   `--workers` workers fed by `--clients` client threads, each sending 64-row requests.
//!
//! ```text
//! cargo run --release --example mlp_infer -- --what latency --requests 2000
//! cargo run --release --example mlp_infer -- --what throughput --batch 64 --requests 300
//! cargo run --release --features cuda --example mlp_infer -- --device cuda --what latency
//! ```
//!
//! The layers are [`Dense`] layers (weights packed once, bias and ReLU applied as the output is
//! written); `--layers matmul` runs the same network as `matmul`, `add` and `relu` instead.
//!
//! With `--device cuda` the parameters live on `cuda:0` and the predictor's and the workers'
//! contexts with them; requests and answers stay in host memory, as a server receives and sends
//! them: each call copies its input onto the device and its output back, through the device's
//! page-locked staging buffers, and waits once, for the answer. There the weights are not
//! packed (packing is for the CPU's product kernel): a `Dense` layer runs `matmul` (cuBLAS),
//! `add` and `relu` and closes its intermediate arrays as it goes, where `--layers matmul` keeps
//! them in the context until the call ends; the two differ only in the workspace's size. On the
//! GPU the service has 2 workers unless `--workers` says otherwise (they share the device's one
//! stream: more workers than that add no compute, only overlap of the host's share of a call).
//!
//! `--graph` (with `--device cuda`) replays the predictor's and the workers' learned context
//! cycles as CUDA graphs (`WorkspaceConfig::graph_replay`): a call is then one copy in, one
//! graph launch and one copy out. Workers replay side by side: they read the same parameters
//! and write only their own contexts, so neither makes the other fall back.
//!
//! It prints one line per figure, e.g. `latency batch 1: service p50 412.3 us; predictor p50
//! 398.0 us` and `throughput batch 64: 9120 samples/s (service, 2 workers, 4 clients)`; on the
//! GPU the lines end with `on cuda:0`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndscope::{
    manual_seed, DType, Device, HostArray, Manager, NDArray, ParallelInference, Predictor, Result,
    ShutdownMode, WorkspaceConfig,
};

#[path = "mlp/mod.rs"]
mod mlp;
use mlp::Inference;

const SIZES: [usize; 4] = [784, 1024, 1024, 10];

struct Args {
    what: String,
    batch: usize,
    requests: usize,
    clients: usize,
    /// `None`: one per core on the CPU, 2 on a GPU.
    workers: Option<usize>,
    /// `Dense` layers (true) or `matmul` + `add` + `relu`.
    dense: bool,
    device: Device,
    /// Replay learned context cycles as CUDA graphs.
    graph: bool,
}

fn main() -> ExitCode {
    let mut args = Args {
        what: "latency".into(),
        batch: 1,
        requests: 1000,
        clients: 4,
        workers: None,
        dense: true,
        device: Device::Cpu,
        graph: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--graph" {
            args.graph = true;
            continue;
        }
        let value = it.next();
        let number = value
            .as_deref()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|&n| n > 0);
        match (flag.as_str(), number, value.as_deref()) {
            ("--what", _, Some(w @ ("latency" | "throughput"))) => args.what = w.into(),
            ("--batch", Some(n), _) => args.batch = n,
            ("--requests", Some(n), _) => args.requests = n,
            ("--clients", Some(n), _) => args.clients = n,
            ("--workers", Some(n), _) => args.workers = Some(n),
            ("--layers", _, Some(l @ ("dense" | "matmul"))) => args.dense = l == "dense",
            ("--device", _, Some("cpu")) => args.device = Device::Cpu,
            ("--device", _, Some("cuda")) => args.device = Device::Cuda(0),
            _ => {
                eprintln!(
                    "usage: mlp_infer [--what latency|throughput] [--batch N] [--requests N] \
                     [--clients N] [--workers N] [--layers dense|matmul] [--device cpu|cuda] \
                     [--graph]"
                );
                return ExitCode::from(2);
            }
        }
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("mlp_infer: {e}");
            ExitCode::FAILURE
        }
    }
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn run(args: &Args) -> Result<()> {
    manual_seed(9);
    let model = Manager::new_base_on(args.device)?.with_name("model");
    let graph = args.graph && !args.device.is_cpu();
    let workers = args.workers.unwrap_or(match args.device {
        Device::Cpu => ndscope::num_threads(),
        Device::Cuda(_) => 2,
    });
    let config = WorkspaceConfig::builder().graph_replay(graph).build()?;
    // The CPU's lines are as they always were; the GPU's name the device.
    let on = match args.device {
        Device::Cpu => String::new(),
        device => format!(" on {device}"),
    };
    let mut params = Vec::new();
    for (i, pair) in SIZES.windows(2).enumerate() {
        let w = model.randn([pair[0], pair[1]], DType::F32)?;
        w.mul_scalar_((2.0 / pair[0] as f64).sqrt())?;
        params.push(w.with_name(&format!("w{}", i + 1)));
        params.push(
            model
                .zeros([pair[1]], DType::F32)?
                .with_name(&format!("b{}", i + 1)),
        );
    }
    let net =
        Inference::from_parameters(&params.into())?.ok_or(ndscope::Error::InvalidArgument {
            op: "mlp_infer",
            at: std::panic::Location::caller(),
            reason: "the parameters do not form an MLP".into(),
        })?;
    let dense = args.dense;
    let forward = Arc::new(move |x: &NDArray| {
        if dense {
            net.logits(x)
        } else {
            net.logits_unpacked(x)
        }
    });
    let input = HostArray::from_vec(
        (0..args.batch * SIZES[0])
            .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
            .collect(),
        [args.batch, SIZES[0]],
    )?;
    let service = {
        let forward = Arc::clone(&forward);
        ParallelInference::builder(&model)
            .workers(workers)
            .workspace(config.clone())
            .build(move |_ctx, x| forward(x))?
    };
    match args.what.as_str() {
        "latency" => {
            let predictor = {
                let forward = Arc::clone(&forward);
                Predictor::builder(&model).workspace(config.clone()).build(
                    move |ctx: &Manager, x: &HostArray| forward(&ctx.from_host(x)?)?.to_host(),
                )?
            };
            let (mut service_times, mut direct_times) = (Vec::new(), Vec::new());
            for i in 0..args.requests + 20 {
                let t = Instant::now();
                std::hint::black_box(service.predict(input.clone())?);
                let s = t.elapsed();
                let t = Instant::now();
                std::hint::black_box(predictor.predict(&input)?);
                if i >= 20 {
                    service_times.push(s);
                    direct_times.push(t.elapsed());
                }
            }
            println!(
                "latency batch {}: service p50 {:.1} us; predictor p50 {:.1} us{on}{}",
                args.batch,
                median(service_times).as_secs_f64() * 1e6,
                median(direct_times).as_secs_f64() * 1e6,
                if graph {
                    ", replayed as CUDA graphs"
                } else {
                    ""
                }
            );
            if graph {
                for ws in predictor.manager().report().workspaces {
                    let g = ws.stats.graph;
                    println!(
                        "predictor '{}': graph replay {}, {} replays, {} fallbacks{}",
                        ws.name,
                        g.state,
                        g.replays,
                        g.fallbacks,
                        g.last_fallback
                            .map_or_else(String::new, |why| format!(" (last: {why})"))
                    );
                }
            }
        }
        _ => {
            // Warm every worker's workspace, then time `requests` batches from the clients.
            for _ in 0..workers * 4 {
                service.predict(input.clone())?;
            }
            let per_client = args.requests.div_ceil(args.clients);
            let start = Instant::now();
            std::thread::scope(|s| -> Result<()> {
                let clients: Vec<_> = (0..args.clients)
                    .map(|_| {
                        let (service, input) = (&service, &input);
                        s.spawn(move || -> Result<()> {
                            for _ in 0..per_client {
                                std::hint::black_box(service.predict(input.clone())?);
                            }
                            Ok(())
                        })
                    })
                    .collect();
                for c in clients {
                    c.join().map_err(|_| ndscope::Error::Panicked {
                        op: "mlp_infer",
                        at: std::panic::Location::caller(),
                        during: "a client thread".into(),
                        message: "see its output above".into(),
                    })??;
                }
                Ok(())
            })?;
            let samples = (per_client * args.clients * args.batch) as f64;
            println!(
                "throughput batch {}: {:.0} samples/s (service, {} workers, {} clients){on}",
                args.batch,
                samples / start.elapsed().as_secs_f64(),
                workers,
                args.clients
            );
        }
    }
    service.shutdown(ShutdownMode::Drain)?;
    drop(forward);
    model.close()
}
