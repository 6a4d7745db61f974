//! Inference and data pipelines (issue: inference): the per-call overhead of a predictor, MLP
//! inference at batch 1 and 64, and how much of a data producer async prefetch hides. Each
//! group has a baseline measured in the same run:
//!
//! - predictor call on a 1-element model: the same work (a workspace cycle, `from_host`, one
//!   `add`, `to_host`) written out by hand without the predictor;
//! - batch 1 forward pass of 784→1024→1024→10 as `Dense` layers (packed weights): the same
//!   network as `matmul` + `add` + `relu`, and the same three products through the `gemm` crate
//!   directly (what ndscope ran before its small-batch kernel), single-threaded;
//! - batch 64: one predictor called on this thread (the pool splitting each product), against
//!   a parallel inference with one worker per core fed by four client threads, with `Dense`
//!   layers and with `matmul` + `add` + `relu`;
//! - prefetch: a loop whose data takes T and whose step takes T: the step alone (T), the two
//!   one after the other (2T), and with the data prefetched.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{bench, human, median_ns, ratio, record, save};
use criterion::{criterion_group, criterion_main, Criterion};
use mlp::Inference;
use ndscope::{
    manual_seed, DType, HostArray, Manager, NDArray, ParallelInference, Predictor, Prefetcher,
    ShutdownMode, WorkspaceConfig,
};

const SIZES: [usize; 4] = [784, 1024, 1024, 10];

fn predictor_overhead(c: &mut Criterion) {
    let group = "predictor_call_1_element";
    let model = Manager::new_base().with_name("model");
    let w = model.ones([1], DType::F32).unwrap();
    let x = HostArray::from_vec(vec![2.0f32], [1]).unwrap();
    let predictor = {
        let w = w.clone();
        Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
            ctx.from_host(x)?.add(&w)?.to_host()
        })
        .unwrap()
    };
    let by_hand = Manager::new_base();
    let ws = by_hand
        .workspace("context", WorkspaceConfig::default())
        .unwrap();
    let mut g = c.benchmark_group(group);
    bench(&mut g, group, "ndscope Predictor::predict", || {
        black_box(predictor.predict(black_box(&x)).unwrap());
    });
    bench(&mut g, group, "baseline: the same cycle by hand", || {
        black_box(
            ws.cycle(|ctx| ctx.from_host(black_box(&x))?.add(&w)?.to_host())
                .unwrap(),
        );
    });
    g.finish();
    drop(predictor);
    model.close().unwrap();
    by_hand.close().unwrap();
}

/// The MLP in `model`, He-initialised from a fixed seed, its layers packed.
fn mlp(model: &Manager) -> Arc<Inference> {
    manual_seed(9);
    let mut params = Vec::new();
    for (i, p) in SIZES.windows(2).enumerate() {
        let w = model.randn([p[0], p[1]], DType::F32).unwrap();
        w.mul_scalar_((2.0 / p[0] as f64).sqrt()).unwrap();
        params.push(w.with_name(&format!("w{}", i + 1)));
        let b = model.zeros([p[1]], DType::F32).unwrap();
        params.push(b.with_name(&format!("b{}", i + 1)));
    }
    Arc::new(Inference::from_parameters(&params.into()).unwrap().unwrap())
}

/// The network's forward pass: `Dense` layers, or `matmul` + `add` + `relu`.
fn forward(net: &Inference, dense: bool, x: &NDArray) -> ndscope::Result<NDArray> {
    if dense {
        net.logits(x)
    } else {
        net.logits_unpacked(x)
    }
}

/// A `Predictor` and a `ParallelInference` (default settings) over the same layers.
fn served(
    model: &Manager,
    net: &Arc<Inference>,
    dense: bool,
) -> (Predictor<HostArray, HostArray>, ParallelInference) {
    let predictor = {
        let net = Arc::clone(net);
        Predictor::new(model, move |ctx: &Manager, x: &HostArray| {
            forward(&net, dense, &ctx.from_host(x)?)?.to_host()
        })
        .unwrap()
    };
    let service = {
        let net = Arc::clone(net);
        ParallelInference::builder(model)
            .build(move |_ctx, x| forward(&net, dense, x))
            .unwrap()
    };
    (predictor, service)
}

fn input(batch: usize) -> HostArray {
    HostArray::from_vec(
        (0..batch * SIZES[0])
            .map(|i| ((i % 13) as f32 - 6.0) * 0.1)
            .collect(),
        [batch, SIZES[0]],
    )
    .unwrap()
}

fn mlp_batch_1(c: &mut Criterion) {
    let group = "mlp_inference_batch_1";
    let model = Manager::new_base().with_name("model");
    let net = mlp(&model);
    let plain: Vec<(Vec<f32>, Vec<f32>)> = net
        .layers
        .iter()
        .map(|(w, b)| (w.to_vec().unwrap(), b.to_vec().unwrap()))
        .collect();
    let (predictor, service) = served(&model, &net, true);
    let (unpacked, unpacked_service) = served(&model, &net, false);
    let x = input(1);
    let xs = x.as_slice::<f32>().unwrap().to_vec();
    let mut g = c.benchmark_group(group);
    g.sample_size(30);
    bench(&mut g, group, "ndscope Predictor::predict", || {
        black_box(predictor.predict(&x).unwrap());
    });
    bench(&mut g, group, "ndscope ParallelInference::predict", || {
        black_box(service.predict(x.clone()).unwrap());
    });
    bench(
        &mut g,
        group,
        "baseline: Predictor with matmul + add + relu",
        || {
            black_box(unpacked.predict(&x).unwrap());
        },
    );
    bench(
        &mut g,
        group,
        "baseline: gemm crate directly, one thread",
        || {
            let mut h = xs.clone();
            for (i, (w, b)) in plain.iter().enumerate() {
                let (k, n) = (SIZES[i], SIZES[i + 1]);
                let mut out = b.clone();
                // SAFETY: `h` holds 1×k, `w` k×n and `out` 1×n contiguous f32, row-major, not
                // aliasing; gemm computes out = 1·out + 1·h·w (the bias as the destination).
                unsafe {
                    gemm::gemm(
                        1,
                        n,
                        k,
                        out.as_mut_ptr(),
                        1,
                        n as isize,
                        true,
                        h.as_ptr(),
                        1,
                        k as isize,
                        w.as_ptr(),
                        1,
                        n as isize,
                        1.0f32,
                        1.0f32,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                if i + 2 < SIZES.len() {
                    out.iter_mut().for_each(|v| *v = v.max(0.0));
                }
                h = out;
            }
            black_box(h);
        },
    );
    g.finish();
    service.shutdown(ShutdownMode::Drain).unwrap();
    unpacked_service.shutdown(ShutdownMode::Drain).unwrap();
    drop((predictor, unpacked, net));
    model.close().unwrap();
}

/// Time per batch with four clients keeping every worker of `service` busy.
fn four_clients(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    key: &str,
    service: &ParallelInference,
    x: &HostArray,
) {
    let name = key.split_once('/').map_or(key, |(_, name)| name);
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let per = iters.div_ceil(4);
            let start = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..4 {
                    s.spawn(move || {
                        for _ in 0..per {
                            black_box(service.predict(x.clone()).unwrap());
                        }
                    });
                }
            });
            let elapsed = start.elapsed();
            record(key, elapsed, per * 4);
            elapsed.mul_f64(iters as f64 / (per * 4) as f64)
        })
    });
}

fn mlp_batch_64(c: &mut Criterion) {
    let group = "mlp_inference_batch_64";
    let model = Manager::new_base().with_name("model");
    let net = mlp(&model);
    let (predictor, service) = served(&model, &net, true);
    let (unpacked, unpacked_service) = served(&model, &net, false);
    let x = input(64);
    let mut g = c.benchmark_group(group);
    g.sample_size(20);
    bench(
        &mut g,
        group,
        "baseline: one Predictor on this thread",
        || {
            black_box(predictor.predict(&x).unwrap());
        },
    );
    four_clients(
        &mut g,
        &format!("{group}/ndscope ParallelInference, 4 clients"),
        &service,
        &x,
    );
    four_clients(
        &mut g,
        &format!("{group}/baseline: ParallelInference with matmul + add + relu, 4 clients"),
        &unpacked_service,
        &x,
    );
    g.finish();
    service.shutdown(ShutdownMode::Drain).unwrap();
    unpacked_service.shutdown(ShutdownMode::Drain).unwrap();
    drop((predictor, unpacked, net));
    model.close().unwrap();
}

/// Busy work of a fixed amount, calibrated to take about `t` on an idle core.
fn work(rounds: u64) -> u64 {
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..rounds {
        s = black_box(
            s.wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407),
        );
    }
    s
}

fn calibrate(t: Duration) -> u64 {
    let probe = 1_000_000;
    let mut best = Duration::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        black_box(work(probe));
        best = best.min(start.elapsed());
    }
    (probe as f64 * t.as_secs_f64() / best.as_secs_f64()) as u64
}

fn prefetch(c: &mut Criterion) {
    let group = "prefetch_data_t_step_t";
    let rounds = calibrate(Duration::from_micros(500));
    let owner = Manager::new_base().with_name("data");
    let make = move |scope: &Manager| -> ndscope::Result<NDArray> {
        let seed = work(rounds);
        scope.full([256], (seed % 7) as f64, DType::F32)
    };
    let step = move |batch: &NDArray| -> u64 { work(rounds) ^ batch.size() as u64 };
    let mut g = c.benchmark_group(group);
    g.sample_size(20);
    bench(&mut g, group, "baseline: the step alone (T)", || {
        black_box(work(rounds));
    });
    let scratch = owner
        .workspace("inline", WorkspaceConfig::default())
        .unwrap();
    bench(
        &mut g,
        group,
        "baseline: data then step, one thread (2T)",
        || {
            scratch.cycle(|s| Ok(black_box(step(&make(s)?)))).unwrap();
        },
    );
    let mut batches =
        Prefetcher::new(&owner, 2, move |scope| Ok(Some(vec![make(scope)?].into()))).unwrap();
    bench(&mut g, group, "ndscope with the data prefetched", || {
        let batch = batches.next().unwrap().unwrap();
        black_box(step(batch.get(0).unwrap()));
    });
    g.finish();
    drop(batches);
    owner.close().unwrap();
}

fn summary(_c: &mut Criterion) {
    println!("\nSummary (medians of the last samples, this run):");
    if let Some(ns) = median_ns("predictor_call_1_element/ndscope Predictor::predict") {
        println!(
            "  predictor call on a 1-element model: {} (target ≤ 2 µs)",
            human(ns)
        );
    }
    ratio(
        "predictor / the same cycle by hand",
        "predictor_call_1_element/ndscope Predictor::predict",
        "predictor_call_1_element/baseline: the same cycle by hand",
    );
    ratio(
        "batch 1: Predictor / gemm directly",
        "mlp_inference_batch_1/ndscope Predictor::predict",
        "mlp_inference_batch_1/baseline: gemm crate directly, one thread",
    );
    ratio(
        "batch 1: Predictor with Dense layers / with matmul + add + relu",
        "mlp_inference_batch_1/ndscope Predictor::predict",
        "mlp_inference_batch_1/baseline: Predictor with matmul + add + relu",
    );
    ratio(
        "batch 1: ParallelInference / Predictor",
        "mlp_inference_batch_1/ndscope ParallelInference::predict",
        "mlp_inference_batch_1/ndscope Predictor::predict",
    );
    if let Some(r) = ratio(
        "batch 64, time per batch: ParallelInference / one Predictor",
        "mlp_inference_batch_64/ndscope ParallelInference, 4 clients",
        "mlp_inference_batch_64/baseline: one Predictor on this thread",
    ) {
        println!("    throughput gain from the workers: {:.2}×", 1.0 / r);
    }
    if let Some(r) = ratio(
        "batch 64, time per batch: ParallelInference with Dense layers / with matmul + add + relu",
        "mlp_inference_batch_64/ndscope ParallelInference, 4 clients",
        "mlp_inference_batch_64/baseline: ParallelInference with matmul + add + relu, 4 clients",
    ) {
        println!("    throughput gain from packed layers: {:.2}×", 1.0 / r);
    }
    ratio(
        "prefetch: per step / T (target ≤ 1.2)",
        "prefetch_data_t_step_t/ndscope with the data prefetched",
        "prefetch_data_t_step_t/baseline: the step alone (T)",
    );
    ratio(
        "no prefetch: per step / T",
        "prefetch_data_t_step_t/baseline: data then step, one thread (2T)",
        "prefetch_data_t_step_t/baseline: the step alone (T)",
    );
    save("inference", &[]);
}

criterion_group!(
    benches,
    predictor_overhead,
    mlp_batch_1,
    mlp_batch_64,
    prefetch,
    summary
);
criterion_main!(benches);
