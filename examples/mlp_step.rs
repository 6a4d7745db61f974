//! Times the MLP training step of `benches/training.rs` (784→1024→1024→10, softmax
//! cross-entropy, SGD with momentum 0.9, one workspace cycle per step) and prints the median
//! milliseconds per step: with autograd (a gradient collector and the `Sgd` optimizer) by
//! default, or the hand-written backward pass with `--manual-backward`.
//! `benches/peers/mlp_step.py` runs it in turns with the same step in PyTorch, so both are
//! timed under the same machine conditions.
//!
//! On a GPU (`--features cuda`, `--device cuda`) the steps are timed in groups of ten, each
//! ending with a synchronisation of the device, so the time counts the GPU's work, and the
//! learned step is replayed as a CUDA graph (`WorkspaceConfig::graph_replay`; `--no-graph`
//! launches every op instead). It prints how the replay went.
//!
//! ```text
//! cargo run --release --example mlp_step -- --batch 16 --steps 300
//! cargo run --release --example mlp_step -- --batch 16 --steps 300 --manual-backward
//! cargo run --release --features cuda --example mlp_step -- --batch 16 --device cuda
//! cargo run --release --features cuda --example mlp_step -- --batch 16 --device cuda --no-graph
//! cargo run --release --features cuda --example mlp_step -- --batch 1024 --device cuda \
//!     --dtype bf16 --sizes 4096,4096,4096,10
//! ```
//!
//! `--dtype bf16|f16` runs the autograd step in mixed precision (autocast in the half type,
//! f32 parameters and optimizer, a `GradScaler` for f16); `--sizes` sets the layer widths.
//!
//! On the CPU a second line gives the step's GFLOP/s (its products: forward, weight gradients,
//! and input gradients but the first layer's) and their share of the CPU's f32 FMA peak, which
//! [`ndscope::measure_cpu_peak`] measures on [`ndscope::num_threads`] threads after the timed
//! steps (the f32 peak whatever `--dtype` says):
//!
//! ```text
//! batch 256: 14.3609 ms/step (median of 30 steps, autograd, sizes [784, 1024, 1024, 10]) on cpu
//! batch 256: 170.5 GFLOP/s, 73% of the CPU's FMA peak of 233.3 GFLOP/s f32 (2 threads × 116.7, avx512f FMA, measured)
//! ```

#[path = "mlp/mod.rs"]
mod mlp;

use std::process::ExitCode;
use std::time::Instant;

use ndscope::{
    manual_seed, measure_cpu_peak, num_threads, DType, Device, GraphReplayStats, LayerWorkspaceMgr,
    Manager, Optimizer, Result, Sgd, WorkspaceConfig,
};

fn main() -> ExitCode {
    let mut batch = 16usize;
    let mut steps = 300usize;
    let mut device = Device::Cpu;
    let mut manual = false;
    let mut graph = true;
    let mut dtype = DType::F32;
    let mut sizes = vec![784, 1024, 1024, 10];
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--manual-backward" {
            manual = true;
            continue;
        }
        if flag == "--no-graph" {
            graph = false;
            continue;
        }
        let value = args.next();
        let number = value.as_deref().and_then(|v| v.parse::<usize>().ok());
        match (flag.as_str(), number, value.as_deref()) {
            ("--batch", Some(v), _) if v > 0 => batch = v,
            ("--steps", Some(v), _) if v > 0 => steps = v,
            ("--device", _, Some("cpu")) => device = Device::Cpu,
            ("--device", _, Some("cuda")) => device = Device::Cuda(0),
            ("--dtype", _, Some("f32")) => dtype = DType::F32,
            ("--dtype", _, Some("bf16")) => dtype = DType::BF16,
            ("--dtype", _, Some("f16")) => dtype = DType::F16,
            ("--sizes", _, Some(list))
                if list.split(',').count() >= 2
                    && list
                        .split(',')
                        .all(|w| w.parse::<usize>().is_ok_and(|w| w > 0)) =>
            {
                sizes = list.split(',').filter_map(|w| w.parse().ok()).collect();
            }
            _ => {
                eprintln!(
                    "usage: mlp_step [--batch N] [--steps N] [--device cpu|cuda] [--manual-backward] \
                     [--no-graph] [--dtype f32|bf16|f16] [--sizes A,B,...] (positive numbers)"
                );
                return ExitCode::from(2);
            }
        }
    }
    let graph = graph && !device.is_cpu();
    if manual && dtype != DType::F32 {
        eprintln!("mlp_step: --manual-backward computes in f32: it takes no --dtype bf16 or f16");
        return ExitCode::from(2);
    }
    match run(batch, steps, device, manual, graph, dtype, &sizes) {
        Ok((ms, replay, flops)) => {
            let how = if manual {
                "hand-written backward"
            } else {
                "autograd"
            };
            let replayed = if graph {
                ", replayed as a CUDA graph"
            } else {
                ""
            };
            let precision = match dtype {
                DType::F32 => String::new(),
                low => format!(", {low} mixed precision"),
            };
            println!(
                "batch {batch}: {ms:.4} ms/step (median of {steps} steps, {how}{replayed}{precision}, \
                 sizes {sizes:?}) on {device}"
            );
            if graph {
                println!(
                    "graph replay: {}, {} replays, {} fallbacks{}, {} calls in {} graph(s) per step",
                    replay.state,
                    replay.replays,
                    replay.fallbacks,
                    replay
                        .last_fallback
                        .map_or_else(String::new, |why| format!(" (last: {why})")),
                    replay.calls,
                    replay.graphs
                );
            }
            if device.is_cpu() {
                // After the timed steps, so the measurement does not warm or cool the timing.
                let peak = match measure_cpu_peak(num_threads()) {
                    Ok(peak) => peak,
                    Err(e) => {
                        eprintln!("mlp_step: {e}");
                        return ExitCode::FAILURE;
                    }
                };
                let gflops = flops / (ms * 1e-3) / 1e9;
                println!(
                    "batch {batch}: {gflops:.1} GFLOP/s, {:.0}% of the CPU's FMA peak of {peak}",
                    100.0 * gflops / peak.gflops
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlp_step: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The median milliseconds of `steps` training steps at `batch` on `device`, after 10 warm-up
/// steps (on a GPU: of groups of 10 steps, each group ending with a synchronisation), the
/// workspace's graph replay figures, and the floating-point operations of one step's products.
fn run(
    batch: usize,
    steps: usize,
    device: Device,
    manual: bool,
    graph: bool,
    dtype: DType,
    sizes: &[usize],
) -> Result<(f64, GraphReplayStats, f64)> {
    let trainer = Manager::new_base_on(device)?.with_name("trainer");
    let config = WorkspaceConfig::builder().graph_replay(graph).build()?;
    let ws = trainer.workspace("batch", config)?;
    let layers = LayerWorkspaceMgr::training(&trainer)?;
    manual_seed(2);
    let model = Manager::new_base_on(device)?.with_name("model");
    let net = if manual {
        mlp::Mlp::new(&model, sizes)?
    } else {
        mlp::Mlp::with_gradients(&model, sizes)?
    };
    let sgd = Sgd {
        momentum: 0.9,
        ..Sgd::new(0.01)
    };
    let mut optimizer = if manual {
        None
    } else {
        Some(Optimizer::new(net.parameters(), sgd)?)
    };
    let precision = mlp::Precision::new(&model, dtype)?;
    model.cap();
    let (inputs, classes) = (sizes[0], sizes[sizes.len() - 1]);
    let x = trainer.randn([batch, inputs], DType::F32)?;
    let x = if dtype == DType::F32 {
        x
    } else {
        x.to_dtype(dtype)?
    };
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % classes as i64).collect();
    let y = trainer.from_vec(labels, [batch])?;
    let group = if device.is_cpu() { 1 } else { 10 };
    let mut times = Vec::with_capacity(steps / group + 1);
    for i in 0..(steps + 10).div_ceil(group) {
        let start = Instant::now();
        for _ in 0..group {
            match optimizer.as_mut() {
                Some(opt) => {
                    ws.cycle(|_| net.autograd_step_in(&precision, opt, &x, &y).map(|_| ()))?
                }
                None => ws.cycle(|_| net.train_step(&layers, &x, &y, 0.01, 0.9).map(|_| ()))?,
            }
        }
        device.synchronize()?;
        if i * group >= 10 {
            times.push(start.elapsed().as_secs_f64() * 1e3 / group as f64);
        }
    }
    times.sort_by(f64::total_cmp);
    let replay = ws.stats().graph;
    let flops = net.step_flops(batch);
    model.close()?;
    trainer.close()?;
    Ok((times[times.len() / 2], replay, flops))
}
