//! An inference service: the MLP that `train_mlp --save PATH` wrote, served to several client
//! threads through `ParallelInference` (worker threads, each with its own predictor and
//! workspace over the model's shared parameters, requests batched as ND4J's `BATCHED` mode).
//!
//! ```text
//! system
//! └─ model                 the loaded parameters; capped
//!    ├─ reference          a single-threaded predictor: the answers to check against
//!    └─ mlp-service        the parallel inference
//!       ├─ worker-0        its predictor: workspace context-0, one cycle per forward pass
//!       └─ worker-1
//! ```
//!
//! Run it with `cargo run --release --example serve_mlp -- [flags]`:
//!
//! ```text
//! --model PATH      parameters saved by train_mlp --save (default: train a small MLP first,
//!                   save it to target/serve_mlp.safetensors and load that)
//! --clients N       client threads (default 4)
//! --requests N      requests per client (default 2000)
//! --rows N          samples per request (default 1)
//! --workers N       worker threads (default: one per core)
//! --batch N         most requests joined into one forward pass (default 16; 1 = sequential)
//! --wait-us N       how long a worker waits for more requests after the first (default 200)
//! ```
//!
//! It prints throughput, p50/p99 latency, the live bytes on the CPU after warming up and at
//! the end, the service's `debug_dump`, and exits non-zero if the live bytes grew, if any
//! answer differs from the single-threaded reference, or if a request failed.

#[path = "mlp/mod.rs"]
mod mlp;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use mlp::{make_data, Inference, Mlp};
use ndscope::{
    fmt_bytes, manual_seed, memory_usage, Device, HostArray, InferenceMode, LayerWorkspaceMgr,
    Manager, ParallelInference, Predictor, ShutdownMode, SpillPolicy, WorkspaceConfig,
};

struct Args {
    model: Option<PathBuf>,
    clients: usize,
    requests: usize,
    rows: usize,
    workers: usize,
    batch: usize,
    wait: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        model: None,
        clients: 4,
        requests: 2000,
        rows: 1,
        workers: ndscope::num_threads(),
        batch: 16,
        wait: Duration::from_micros(200),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        let number = |text: String| -> Result<usize, String> {
            match text.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!("{text:?} is not a positive number")),
            }
        };
        match flag.as_str() {
            "--model" => args.model = Some(value("--model")?.into()),
            "--clients" => args.clients = number(value("--clients")?)?,
            "--requests" => args.requests = number(value("--requests")?)?,
            "--rows" => args.rows = number(value("--rows")?)?,
            "--workers" => args.workers = number(value("--workers")?)?,
            "--batch" => args.batch = number(value("--batch")?)?,
            "--wait-us" => args.wait = Duration::from_micros(number(value("--wait-us")?)? as u64),
            "-h" | "--help" => {
                return Err(
                    "usage: serve_mlp [--model PATH] [--clients N] [--requests N] \
                            [--rows N] [--workers N] [--batch N] [--wait-us N]"
                        .into(),
                )
            }
            other => return Err(format!("unknown flag {other:?} (try --help)")),
        }
    }
    Ok(args)
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("serve_mlp: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Trains a small MLP for one epoch on the generated problem and saves its parameters.
fn train_small(path: &PathBuf) -> Result<(), Box<dyn std::error::Error>> {
    manual_seed(11);
    let data = Manager::new_base().with_name("data");
    let model = Manager::new_base().with_name("training");
    let (x, y) = make_data(&data, 20_000, 784, 10, 3, 0.17)?;
    let net = Mlp::new(&model, &[784, 256, 128, 10])?;
    model.cap();
    let trainer = model.new_sub_manager()?;
    let ws = trainer.workspace("batch", WorkspaceConfig::default())?;
    let layers = LayerWorkspaceMgr::training(&trainer)?;
    for step in 0..20_000 / 128 {
        ws.cycle(|_| {
            let (xb, yb) = (x.narrow(0, step * 128, 128)?, y.narrow(0, step * 128, 128)?);
            net.train_step(&layers, &xb, &yb, 0.02, 0.9).map(|_| ())
        })?;
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    net.parameters().save_safetensors(path)?;
    model.close()?;
    data.close()?;
    Ok(())
}

/// Whether two answers agree: the same class for every row, logits within 1e-4 relative. (A
/// batched forward pass may round differently from a single-row one in the last places.)
fn agree(a: &HostArray, b: &HostArray) -> Result<bool, ndscope::Error> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    let (x, y) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    let classes = *a.dims().last().unwrap_or(&1);
    let argmax = |row: &[f32]| {
        row.iter()
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (i, &v)| {
                if v > best.1 {
                    (i, v)
                } else {
                    best
                }
            })
            .0
    };
    let close = x
        .iter()
        .zip(y)
        .all(|(p, q)| (p - q).abs() <= 1e-4 * p.abs().max(q.abs()).max(1.0));
    let same_class = x
        .chunks(classes)
        .zip(y.chunks(classes))
        .all(|(r, s)| argmax(r) == argmax(s));
    Ok(close && same_class)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args()?;
    let path = match &args.model {
        Some(path) => path.clone(),
        None => {
            let target = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
            let path = PathBuf::from(target).join("serve_mlp.safetensors");
            let t = Instant::now();
            train_small(&path)?;
            println!(
                "serve_mlp: no --model given; trained a 784→256→128→10 MLP for one epoch in {:.1} s and saved it to {}",
                t.elapsed().as_secs_f64(),
                path.display()
            );
            path
        }
    };

    // The model: its parameters as saved, read-only from here on.
    let model = Manager::new_base().with_name("model");
    let params = model.load_safetensors(&path)?;
    let net = std::sync::Arc::new(
        Inference::from_parameters(&params)?
            .ok_or("the file does not hold an MLP's parameters (w1, b1, w2, b2, …)")?,
    );
    let (inputs, outputs) = net.io();
    println!(
        "serve_mlp: model {} from {} ({} layers, {inputs} → {outputs}, {})",
        model.name(),
        path.display(),
        net.layers.len(),
        fmt_bytes(params.iter().map(|a| a.nbytes()).sum())
    );

    // The requests: distinct samples of the generated problem, as host data.
    manual_seed(5);
    let samples = 512;
    let scratch = Manager::new_base().with_name("requests");
    let (x, _) = make_data(&scratch, samples * args.rows, inputs, outputs, 3, 0.17)?;
    let flat = x.to_vec::<f32>()?;
    scratch.close()?;
    let requests: Vec<HostArray> = flat
        .chunks(args.rows * inputs)
        .map(|rows| HostArray::from_slice(rows, [args.rows, inputs]))
        .collect::<ndscope::Result<_>>()?;

    // The single-threaded reference: one predictor, one request at a time.
    let reference = {
        let net = std::sync::Arc::clone(&net);
        Predictor::builder(&model)
            .name("reference")
            .build(move |ctx: &Manager, x: &HostArray| net.logits(&ctx.from_host(x)?)?.to_host())?
    };
    let expected: Vec<HostArray> = requests
        .iter()
        .map(|r| reference.predict(r))
        .collect::<ndscope::Result<_>>()?;

    // The service.
    let mode = if args.batch > 1 {
        InferenceMode::Batched {
            max_requests: args.batch,
            max_wait: args.wait,
        }
    } else {
        InferenceMode::Sequential
    };
    let service = {
        let net = std::sync::Arc::clone(&net);
        ParallelInference::builder(&model)
            .name("mlp-service")
            .workers(args.workers)
            .mode(mode)
            .workspace(
                WorkspaceConfig::builder()
                    .spill(SpillPolicy::Reallocate)
                    .build()?,
            )
            .build(move |_ctx, x| net.logits(x))?
    };
    println!(
        "serve_mlp: {} workers, {mode:?}, {} clients × {} requests of {} row(s)",
        args.workers, args.clients, args.requests, args.rows
    );

    // Warm-up: bursts of full batches from every client thread at once, so that each worker's
    // workspace grows to its largest cycle. Which worker takes which batch is up to the
    // scheduler (on a busy machine one worker may take them all), so bursts go on until the
    // live bytes have not changed for three rounds in a row.
    let (mut stable, mut rounds) = (0, 0);
    let mut live_start = memory_usage(Device::Cpu).in_use;
    while stable < 3 && rounds < 50 {
        std::thread::scope(|s| -> Result<(), String> {
            let bursts: Vec<_> = (0..args.clients)
                .map(|c| {
                    let (service, requests) = (&service, &requests);
                    s.spawn(move || -> ndscope::Result<()> {
                        let burst: Vec<_> = (0..args.batch * args.workers * 2)
                            .map(|i| service.submit(requests[(c * 131 + i) % samples].clone()))
                            .collect::<ndscope::Result<_>>()?;
                        burst.into_iter().try_for_each(|p| p.wait().map(drop))
                    })
                })
                .collect();
            bursts.into_iter().try_for_each(|b| match b.join() {
                Ok(result) => result.map_err(|e| format!("warm-up: {e}")),
                Err(_) => Err("a warm-up client thread panicked".into()),
            })
        })?;
        let live = memory_usage(Device::Cpu).in_use;
        stable = if live == live_start { stable + 1 } else { 0 };
        live_start = live;
        rounds += 1;
    }
    println!("warm-up: {rounds} rounds of bursts until the live bytes held for three");

    // The load: every client sends its requests one after another and checks each answer.
    let started = Instant::now();
    let results: Vec<Result<(Vec<Duration>, usize), String>> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..args.clients)
            .map(|c| {
                let (service, requests, expected) = (&service, &requests, &expected);
                s.spawn(move || -> Result<(Vec<Duration>, usize), String> {
                    let mut latencies = Vec::with_capacity(args.requests);
                    let mut wrong = 0;
                    for i in 0..args.requests {
                        let k = (c * 7919 + i * 31) % samples;
                        let t = Instant::now();
                        let answer = service
                            .predict(requests[k].clone())
                            .map_err(|e| format!("client {c}, request {i}: {e}"))?;
                        latencies.push(t.elapsed());
                        if !agree(&answer, &expected[k]).map_err(|e| e.to_string())? {
                            wrong += 1;
                        }
                    }
                    Ok((latencies, wrong))
                })
            })
            .collect();
        clients
            .into_iter()
            .map(|c| {
                c.join()
                    .unwrap_or_else(|_| Err("a client thread panicked".into()))
            })
            .collect()
    });
    let elapsed = started.elapsed();
    let live_end = memory_usage(Device::Cpu).in_use;

    let mut latencies = Vec::new();
    let mut wrong = 0;
    for result in results {
        let (l, w) = result?;
        latencies.extend(l);
        wrong += w;
    }
    latencies.sort();
    let total = latencies.len();
    let stats = service.stats();
    println!(
        "throughput {:.0} requests/s ({:.0} samples/s); latency p50 {:.1} µs, p99 {:.1} µs; \
         {} forward passes, {:.1} requests per pass on average (at most {})",
        total as f64 / elapsed.as_secs_f64(),
        (total * args.rows) as f64 / elapsed.as_secs_f64(),
        percentile(&latencies, 0.5).as_secs_f64() * 1e6,
        percentile(&latencies, 0.99).as_secs_f64() * 1e6,
        stats.batches,
        stats.submitted as f64 / stats.batches.max(1) as f64,
        stats.largest_batch
    );
    println!(
        "live bytes on the CPU: {} after warm-up, {} after {total} requests",
        fmt_bytes(live_start),
        fmt_bytes(live_end)
    );
    println!("\n{}", model.debug_dump(1));
    let report = service.shutdown(ShutdownMode::Drain)?;
    println!(
        "shut down: {} requests finished during shutdown, {} refused; {} live on the CPU with the \
         workers' memory freed",
        report.finished,
        report.refused,
        fmt_bytes(memory_usage(Device::Cpu).in_use)
    );

    if wrong > 0 {
        return Err(format!(
            "{wrong} of {total} answers differ from the single-threaded reference"
        )
        .into());
    }
    if stats.failed > 0 {
        return Err(format!("{} requests failed", stats.failed).into());
    }
    if live_end > live_start {
        return Err(format!(
            "live bytes grew under load: {} → {}",
            fmt_bytes(live_start),
            fmt_bytes(live_end)
        )
        .into());
    }
    println!("every answer matches the reference; memory stayed flat");
    drop(reference);
    model.close()?;
    Ok(())
}
