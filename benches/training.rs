//! Training speed (issue: training on CPU), each as a ratio in one run:
//! - `matmul` 1024² f32 through ndscope vs calling the `gemm` crate directly (target ≥ 0.95);
//! - an MLP training step 784→1024→1024→10 at batch 256 vs its FLOP floor at the measured
//!   matmul rate (target ≥ 0.75 of it);
//! - the same step at batch 16 (bound by memory traffic and per-op overhead);
//! - the same steps with autograd (a gradient collector, `backward`, the `Sgd` optimizer) vs
//!   the hand-written backward pass (targets ≤ 1.15× at batch 256, ≤ 1.3× at batch 16);
//! - the recording overhead of autograd: a 1-element op on an array that requires gradients,
//!   with and without a recording collector (target ≤ 150 ns more per op);
//! - the weight update of its 1024×1024 layer at batch 16: `sgd_dense_update_` (one pass) vs
//!   `addmm_` then `axpy_`;
//! - elementwise `add` of 1M f32, and a copy of its 4 MiB (`reshape`, on the pool's threads), vs
//!   a memcpy of the same bytes on one thread;
//! - `from_slice` of 256 MiB (beyond any cache) into a workspace block vs one thread's memcpy.
//!
//! Medians are saved to `target/ndscope-bench/training.json`. `benches/peers/mlp_step.py` times
//! the same step against PyTorch on the same machine.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

#[path = "common/mod.rs"]
mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use std::hint::black_box;
use std::time::{Duration, Instant};

use common::{bench, human, median_ns, ratio, record, save};
use criterion::{criterion_group, Criterion};
use ndscope::{
    manual_seed, DType, LayerWorkspaceMgr, Manager, Optimizer, Sgd, Transpose, Workspace,
    WorkspaceConfig,
};

const N: usize = 1024;

fn trainer() -> (Manager, Workspace) {
    let t = Manager::new_base().with_name("trainer");
    let ws = t.workspace("bench", WorkspaceConfig::default()).unwrap();
    (t, ws)
}

fn matmul(c: &mut Criterion) {
    let group = "matmul_1024_f32";
    let (t, ws) = trainer();
    manual_seed(1);
    let a = t.randn([N, N], DType::F32).unwrap();
    let b = t.randn([N, N], DType::F32).unwrap();
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let mut out = vec![0f32; N * N];
    let mut g = c.benchmark_group(group);
    g.sample_size(20);
    bench(&mut g, group, "gemm crate directly", || {
        // SAFETY: the slices hold N·N elements each, laid out row-major as the strides say, and
        // `out` aliases neither input.
        unsafe {
            gemm::gemm(
                N,
                N,
                N,
                out.as_mut_ptr(),
                1,
                N as isize,
                false,
                av.as_ptr(),
                1,
                N as isize,
                bv.as_ptr(),
                1,
                N as isize,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::Rayon(0),
            )
        };
        black_box(&out);
    });
    bench(&mut g, group, "ndscope in a workspace cycle", || {
        ws.cycle(|_| a.matmul(&b).map(|r| black_box(r).size()))
            .unwrap();
    });
    bench(&mut g, group, "ndscope in a plain scope", || {
        t.scope(|_| a.matmul(&b).map(|r| black_box(r).size()))
            .unwrap();
    });
    g.finish();
    t.close().unwrap();
}

fn mlp_step(c: &mut Criterion, batch: usize, group: &str) {
    let (t, ws) = trainer();
    manual_seed(2);
    let model = Manager::new_base().with_name("model");
    let sizes = [784, 1024, 1024, 10];
    let net = mlp::Mlp::new(&model, &sizes).unwrap();
    // The same network (same random stream) trained with autograd.
    manual_seed(2);
    let auto = mlp::Mlp::with_gradients(&model, &sizes).unwrap();
    let sgd = Sgd {
        momentum: 0.9,
        ..Sgd::new(0.01)
    };
    let mut optimizer = Optimizer::new(auto.parameters(), sgd).unwrap();
    model.cap();
    // The autograd step's own workspace, learned from its own first cycle: the hand-written
    // step puts most of its arrays in layer workspaces, so the block `ws` learns from it is
    // too small for a step whose arrays all land in the cycle (it would spill every cycle).
    let ws_auto = t
        .workspace("bench-autograd", WorkspaceConfig::default())
        .unwrap();
    let x = t.randn([batch, 784], DType::F32).unwrap();
    let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
    let y = t.from_vec(labels, [batch]).unwrap();
    // DL4J's layer workspaces, and plain scopes for the step in a plain scope.
    let layers = LayerWorkspaceMgr::training(&t).unwrap();
    let plain = LayerWorkspaceMgr::no_workspaces(&t);
    let mut g = c.benchmark_group(group);
    g.sample_size(if batch >= 256 { 20 } else { 50 });
    bench(&mut g, group, "ndscope step in a workspace cycle", || {
        ws.cycle(|_| {
            net.train_step(&layers, &x, &y, 0.01, 0.9)
                .map(|o| black_box(o.loss).size())
        })
        .unwrap();
    });
    bench(&mut g, group, "ndscope step in a plain scope", || {
        t.scope(|_| {
            net.train_step(&plain, &x, &y, 0.01, 0.9)
                .map(|o| black_box(o.loss).size())
        })
        .unwrap();
    });
    bench(
        &mut g,
        group,
        "ndscope autograd step in a workspace cycle",
        || {
            ws_auto
                .cycle(|_| {
                    auto.autograd_step(&mut optimizer, &x, &y)
                        .map(|o| black_box(o.loss).size())
                })
                .unwrap();
        },
    );
    g.finish();
    println!(
        "  {group}: {:.2} GFLOP per step",
        net.step_flops(batch) / 1e9
    );
    model.close().unwrap();
    t.close().unwrap();
}

fn mlp_steps(c: &mut Criterion) {
    mlp_step(c, 256, "mlp_step_b256");
    mlp_step(c, 16, "mlp_step_b16");
}

/// Runs `iters` 1-element `add`s of `p` (which requires gradients) and times them, in batches of
/// 10,000 in a scope each, with a recording collector open on the scope or not. The scope is
/// opened and closed (and the collector with it) outside the timed region.
fn timed_adds(
    m: &Manager,
    p: &ndscope::NDArray,
    x: &ndscope::NDArray,
    iters: u64,
    collect: bool,
) -> Duration {
    let mut total = Duration::ZERO;
    let mut left = iters;
    while left > 0 {
        let n = left.min(10_000);
        let scope = m.sub_scope().unwrap();
        {
            let _active = scope.activate();
            let collector = collect.then(|| scope.gradient_collector().unwrap());
            let start = Instant::now();
            for _ in 0..n {
                black_box(p.add(x).unwrap());
            }
            total += start.elapsed();
            drop(collector);
        }
        scope.close().unwrap();
        left -= n;
    }
    total
}

fn recording_overhead(c: &mut Criterion) {
    let group = "autograd_recording_1_element_add";
    let m = Manager::new_base();
    let p = m.ones([1], DType::F32).unwrap();
    p.set_requires_gradient(true).unwrap();
    let x = m.ones([1], DType::F32).unwrap();
    let mut g = c.benchmark_group(group);
    for (name, collect) in [("no collector", false), ("recording collector", true)] {
        let key = format!("{group}/{name}");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let elapsed = timed_adds(&m, &p, &x, iters, collect);
                record(&key, elapsed, iters);
                elapsed
            })
        });
    }
    g.finish();
    m.close().unwrap();
}

fn sgd_update(c: &mut Criterion) {
    let group = "sgd_update_1024x1024_b16";
    let (t, _ws) = trainer();
    manual_seed(3);
    let x = t.randn([16, N], DType::F32).unwrap();
    let g = t.randn([16, N], DType::F32).unwrap();
    let w = t.randn([N, N], DType::F32).unwrap();
    let v = t.zeros([N, N], DType::F32).unwrap();
    let mut gr = c.benchmark_group(group);
    gr.sample_size(50);
    bench(&mut gr, group, "sgd_dense_update_ (one pass)", || {
        w.sgd_dense_update_(&v, &x, &g, 1e-6, 0.9).unwrap()
    });
    bench(&mut gr, group, "addmm_ then axpy_", || {
        v.addmm_(&x, &g, Transpose::Left, 0.9, 1.0).unwrap();
        w.axpy_(-1e-6, &v).unwrap();
    });
    gr.finish();
    t.close().unwrap();
}

fn add_vs_memcpy(c: &mut Criterion) {
    let group = "add_1M_f32";
    let (t, ws) = trainer();
    let a = t.ones([1 << 20], DType::F32).unwrap();
    let b = t.ones([1 << 20], DType::F32).unwrap();
    let src = vec![1f32; 1 << 20];
    let mut dst = vec![0f32; 1 << 20];
    let mut g = c.benchmark_group(group);
    bench(&mut g, group, "ndscope add in a workspace cycle", || {
        ws.cycle(|_| a.add(&b).map(|r| black_box(r).size()))
            .unwrap();
    });
    bench(&mut g, group, "ndscope add_ in place", || {
        a.add_(&b).unwrap()
    });
    bench(
        &mut g,
        group,
        "ndscope copy (reshape) in a workspace cycle",
        || {
            ws.cycle(|_| a.reshape([1024, 1024]).map(|r| black_box(r).size()))
                .unwrap();
        },
    );
    bench(&mut g, group, "memcpy of the same 4 MiB", || {
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
    });
    g.finish();
    t.close().unwrap();
}

/// A large copy from memory the cache does not hold: 256 MiB of a host slice into a learned
/// workspace block (`from_slice`, its copy on the pool's threads, as the staging copies of a
/// GPU transfer are), against one thread's memcpy into a buffer allocated once.
fn copy_256mib(c: &mut Criterion) {
    let group = "copy_256MiB";
    let len = 64 << 20; // f32
    let (t, ws) = trainer();
    let src = vec![1f32; len];
    let mut dst = vec![0f32; len];
    let mut g = c.benchmark_group(group);
    g.sample_size(10);
    bench(
        &mut g,
        group,
        "ndscope from_slice in a workspace cycle",
        || {
            ws.cycle(|m| {
                m.from_slice(black_box(&src), [len])
                    .map(|r| black_box(r).size())
            })
            .unwrap();
        },
    );
    bench(
        &mut g,
        group,
        "memcpy of the same 256 MiB on one thread",
        || {
            dst.copy_from_slice(black_box(&src));
            black_box(&dst);
        },
    );
    g.finish();
    t.close().unwrap();
}

criterion_group!(
    benches,
    matmul,
    mlp_steps,
    recording_overhead,
    sgd_update,
    add_vs_memcpy,
    copy_256mib
);

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();

    println!("\nratios (medians of the last samples, all measured in this run):");
    ratio(
        "matmul 1024² f32, gemm direct / ndscope (target ≥ 0.95)",
        "matmul_1024_f32/gemm crate directly",
        "matmul_1024_f32/ndscope in a workspace cycle",
    );
    let mut extra = Vec::new();
    if let Some(gemm_ns) = median_ns("matmul_1024_f32/gemm crate directly") {
        let rate = 2.0 * (N * N * N) as f64 / gemm_ns; // FLOP per ns = GFLOP/s
        println!("  matmul rate: {rate:.0} GFLOP/s");
        extra.push(("matmul_gflops", rate));
        let model = Manager::new_base();
        let net = mlp::Mlp::new(&model, &[784, 1024, 1024, 10]).unwrap();
        for (batch, group) in [(256, "mlp_step_b256"), (16, "mlp_step_b16")] {
            let floor = net.step_flops(batch) / rate;
            if let Some(step) = median_ns(&format!("{group}/ndscope step in a workspace cycle")) {
                println!(
                    "  MLP step batch {batch}: FLOP floor {} / step {} = {:.3}{}",
                    human(floor),
                    human(step),
                    floor / step,
                    if batch == 256 {
                        " (target ≥ 0.75)"
                    } else {
                        ""
                    }
                );
            }
        }
        model.close().unwrap();
    }
    for (batch, target) in [(256, "1.15"), (16, "1.3")] {
        let group = format!("mlp_step_b{batch}");
        ratio(
            &format!("MLP step batch {batch}, autograd / hand-written (target ≤ {target})"),
            &format!("{group}/ndscope autograd step in a workspace cycle"),
            &format!("{group}/ndscope step in a workspace cycle"),
        );
    }
    let recording = "autograd_recording_1_element_add";
    if let (Some(with), Some(without)) = (
        median_ns(&format!("{recording}/recording collector")),
        median_ns(&format!("{recording}/no collector")),
    ) {
        println!(
            "  autograd recording overhead per op: {} with a collector - {} without = {} (target ≤ 150 ns)",
            human(with),
            human(without),
            human(with - without)
        );
        extra.push(("autograd_recording_overhead_ns", with - without));
    }
    ratio(
        "SGD update 1024² at batch 16, addmm_ + axpy_ / sgd_dense_update_",
        "sgd_update_1024x1024_b16/addmm_ then axpy_",
        "sgd_update_1024x1024_b16/sgd_dense_update_ (one pass)",
    );
    ratio(
        "add 1M f32 / memcpy 4 MiB",
        "add_1M_f32/ndscope add in a workspace cycle",
        "add_1M_f32/memcpy of the same 4 MiB",
    );
    ratio(
        "add_ 1M f32 in place / memcpy 4 MiB",
        "add_1M_f32/ndscope add_ in place",
        "add_1M_f32/memcpy of the same 4 MiB",
    );
    ratio(
        "copy of 4 MiB (reshape) / memcpy 4 MiB on one thread",
        "add_1M_f32/ndscope copy (reshape) in a workspace cycle",
        "add_1M_f32/memcpy of the same 4 MiB",
    );
    ratio(
        "from_slice of 256 MiB / memcpy 256 MiB on one thread",
        "copy_256MiB/ndscope from_slice in a workspace cycle",
        "copy_256MiB/memcpy of the same 256 MiB on one thread",
    );
    save("training", &extra);
}
