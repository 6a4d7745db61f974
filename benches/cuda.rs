//! The CUDA backend against the driver and cuBLAS it builds on, on device 0 (issue: CUDA).
//! Needs `--features cuda` and a GPU; without one it prints why and measures nothing.
//!
//! - `alloc`: create + close of a 1 MiB array in a learned workspace cycle, against the same
//!   cycle on the CPU, `cuMemAlloc` + `cuMemFree` of the same bytes (the driver, synchronous)
//!   and `cuMemAllocAsync` + `cuMemFreeAsync` (its stream-ordered pool). The first two rows
//!   create every array in one open cycle (all but the first spill); the `carved` rows run
//!   cycles whose every array is carved from the block.
//! - `cycle`: driver allocations per learned cycle of an MLP step (printed; must be 0).
//! - `matmul_4096_f32`: `matmul` of two 4096² f32 matrices (strict FP32), against cuBLAS's
//!   sgemm called directly.
//! - `mlp_step_b256`, `mlp_step_b16`: the MLP training step of `benches/training.rs`
//!   (784→1024→1024→10, SGD with momentum) in a workspace cycle, eager and replayed as a CUDA
//!   graph (`WorkspaceConfig::graph_replay`).
//! - `replay_check`: the host's cost per op of a replayed cycle of 64 in-place ops (each op
//!   checked against the recording, not launched; the graph launch and the wait are outside the
//!   timing), beside the same 64 ops launched eagerly (host side only) and the same ops on a
//!   1-element CPU array (the front-end's own cost: validation, locks, a kernel of nothing).
//! - `h2d_256MiB`: `to_device` of 256 MiB from pageable memory (double-buffered through the
//!   page-locked staging buffers) and from page-locked memory (a `MirroringPolicy::HostOnly`
//!   workspace's array, copied directly), against a pageable `cuMemcpyHtoD` of the same bytes.
//! - `d2h_256MiB`: `to_device(Cpu)` of 256 MiB into pageable memory, and a page-locked round
//!   trip (to the GPU and back into the HostOnly workspace), against a pageable `cuMemcpyDtoH`.
//!
//! Every timing ends with a synchronisation of the device, so it counts the GPU's work. The
//! medians go to `target/ndscope-bench/cuda.json`, which `benches/peers/cuda_peer.py` reads to
//! put them beside PyTorch's figures from the same machine.

#![allow(missing_docs)]

#[path = "../examples/mlp/mod.rs"]
mod mlp;

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use cudarc::cublas::{result as blas, sys as blas_sys};
use cudarc::driver::{result, CudaContext};
use ndscope::{manual_seed, memory_usage, DType, Device, Manager, WorkspaceConfig};

const GPU: Device = Device::Cuda(0);

fn available() -> bool {
    if Device::cuda_count() > 0 {
        return true;
    }
    let why = Manager::new_base_on(GPU)
        .err()
        .map_or_else(String::new, |e| e.to_string());
    println!("cuda bench skipped: no usable CUDA device ({why})");
    false
}

/// Times `iters` calls of `f`, then a synchronisation of the device.
fn timed(key: &str, iters: u64, mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    GPU.synchronize().expect("the device reported an error");
    let elapsed = start.elapsed();
    common::record(key, elapsed, iters);
    elapsed
}

fn alloc(c: &mut Criterion) {
    if !available() {
        return;
    }
    let bytes = 1usize << 20;
    let owner = Manager::new_base_on(GPU).unwrap().with_name("bench");
    let ws = owner
        .workspace("cycle", WorkspaceConfig::default())
        .unwrap();
    // Learn the block.
    for _ in 0..2 {
        ws.cycle(|s| s.empty([bytes / 4], DType::F32).map(|_| ()))
            .unwrap();
    }
    let mut g = c.benchmark_group("alloc");
    g.bench_function("ndscope empty + close in a learned workspace cycle", |b| {
        let scope = ws.open().unwrap();
        b.iter_custom(|iters| {
            timed("alloc/ndscope", iters, || {
                let a = scope.empty([bytes / 4], DType::F32).unwrap();
                a.close().unwrap();
            })
        });
        drop(scope);
    });
    // The same cycle on the CPU.
    let cpu_owner = Manager::new_base().with_name("bench-cpu");
    let cpu_ws = cpu_owner
        .workspace("cycle", WorkspaceConfig::default())
        .unwrap();
    for _ in 0..2 {
        cpu_ws
            .cycle(|s| s.empty([bytes / 4], DType::F32).map(|_| ()))
            .unwrap();
    }
    g.bench_function("cpu: empty + close in a learned workspace cycle", |b| {
        let scope = cpu_ws.open().unwrap();
        b.iter_custom(|iters| {
            timed("alloc/cpu", iters, || {
                let a = scope.empty([bytes / 4], DType::F32).unwrap();
                a.close().unwrap();
            })
        });
        drop(scope);
    });
    cpu_owner.close().unwrap();
    // The rows above create every array in one open cycle, so all but the first spill (the
    // block is learned for one array; closing an array does not give its bytes back to the
    // bump allocator). Here every array is carved from the block: the workspace learned cycles
    // of `common::CARVED` arrays, and the loop runs such cycles (their open and close included).
    for (device, key, what) in [
        (GPU, "alloc/ndscope_carved", "ndscope"),
        (Device::Cpu, "alloc/cpu_carved", "cpu"),
    ] {
        let owner = Manager::new_base_on(device)
            .unwrap()
            .with_name("bench-carved");
        let ws = common::carved_workspace(&owner, bytes / 4);
        let name = format!(
            "{what}: empty + close carved from the block ({} per cycle)",
            common::CARVED
        );
        g.bench_function(name.as_str(), |b| {
            b.iter_custom(|iters| {
                let start = Instant::now();
                common::create_close_carved(&ws, bytes / 4, iters);
                GPU.synchronize().expect("the device reported an error");
                let elapsed = start.elapsed();
                common::record(key, elapsed, iters);
                elapsed
            })
        });
        owner.close().unwrap();
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    g.bench_function("baseline: cuMemAlloc + cuMemFree", |b| {
        b.iter_custom(|iters| {
            timed("alloc/cuMemAlloc+cuMemFree", iters, || {
                ctx.bind_to_thread().unwrap();
                // SAFETY: a fresh allocation freed at once, never used.
                unsafe {
                    let p = result::malloc_sync(black_box(bytes)).unwrap();
                    result::free_sync(p).unwrap();
                }
            })
        });
    });
    g.bench_function("baseline: cuMemAllocAsync + cuMemFreeAsync", |b| {
        b.iter_custom(|iters| {
            timed("alloc/cuMemAllocAsync+cuMemFreeAsync", iters, || {
                ctx.bind_to_thread().unwrap();
                // SAFETY: a fresh allocation on `stream`, freed at once on it, never used.
                unsafe {
                    let p = result::malloc_async(stream.cu_stream(), black_box(bytes)).unwrap();
                    result::free_async(p, stream.cu_stream()).unwrap();
                }
            })
        });
    });
    g.finish();
    owner.close().unwrap();
}

/// One MLP on the GPU, its workspace and a batch.
struct Step {
    model: Manager,
    trainer: Manager,
    ws: ndscope::Workspace,
    layers: ndscope::LayerWorkspaceMgr,
    net: mlp::Mlp,
    x: ndscope::NDArray,
    y: ndscope::NDArray,
}

impl Step {
    fn new(batch: usize) -> Step {
        Step::with(batch, WorkspaceConfig::default())
    }

    fn with(batch: usize, config: WorkspaceConfig) -> Step {
        manual_seed(2);
        let model = Manager::new_base_on(GPU).unwrap().with_name("model");
        let net = mlp::Mlp::new(&model, &[784, 1024, 1024, 10]).unwrap();
        model.cap();
        let trainer = Manager::new_base_on(GPU).unwrap().with_name("trainer");
        let ws = trainer.workspace("batch", config).unwrap();
        let layers = ndscope::LayerWorkspaceMgr::training(&trainer).unwrap();
        let x = trainer.randn([batch, 784], DType::F32).unwrap();
        let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
        let y = trainer.from_slice(&labels, [batch]).unwrap();
        Step {
            model,
            trainer,
            ws,
            layers,
            net,
            x,
            y,
        }
    }

    fn run(&self) {
        self.ws
            .cycle(|_| {
                self.net
                    .train_step(&self.layers, &self.x, &self.y, 0.01, 0.9)
                    .map(|_| ())
            })
            .unwrap();
    }

    fn close(self) {
        self.model.close().unwrap();
        self.trainer.close().unwrap();
    }
}

fn cycle(_c: &mut Criterion) {
    if !available() {
        return;
    }
    let step = Step::new(256);
    for _ in 0..3 {
        step.run();
    }
    GPU.synchronize().unwrap();
    let before = memory_usage(GPU).driver_allocations;
    let cycles = 100;
    for _ in 0..cycles {
        step.run();
    }
    GPU.synchronize().unwrap();
    let made = memory_usage(GPU).driver_allocations - before;
    println!(
        "cycle: {made} driver allocations in {cycles} learned cycles of the MLP step at batch 256 ({} per cycle)",
        made as f64 / cycles as f64
    );
    common::note(
        "cycle/driver_allocations_per_cycle",
        made as f64 / cycles as f64,
    );
    step.close();
}

fn matmul(c: &mut Criterion) {
    if !available() {
        return;
    }
    let n = 4096usize;
    ndscope::set_allow_tf32(false);
    let m = Manager::new_base_on(GPU).unwrap();
    let a = m.randn([n, n], DType::F32).unwrap();
    let b = m.randn([n, n], DType::F32).unwrap();
    let ws = m.workspace("out", WorkspaceConfig::default()).unwrap();
    let mut g = c.benchmark_group("matmul_4096_f32");
    g.sample_size(20);
    g.bench_function("ndscope matmul", |bench| {
        bench.iter_custom(|iters| {
            timed("matmul_4096_f32/ndscope", iters, || {
                ws.cycle(|_| a.matmul(&b).map(|_| ())).unwrap();
            })
        })
    });
    // The same product through cuBLAS directly, on its own context's stream.
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let handle = blas::create_handle().unwrap();
    let bytes = n * n * 4;
    // SAFETY: three n×n f32 buffers on `stream`, freed below; the handle runs on that stream.
    let (pa, pb, pc) = unsafe {
        blas::set_stream(handle, stream.cu_stream() as _).unwrap();
        (
            result::malloc_async(stream.cu_stream(), bytes).unwrap(),
            result::malloc_async(stream.cu_stream(), bytes).unwrap(),
            result::malloc_async(stream.cu_stream(), bytes).unwrap(),
        )
    };
    g.bench_function("baseline: cublasSgemm", |bench| {
        bench.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                let (alpha, beta) = (1.0f32, 0.0f32);
                let dim = n as i32;
                // SAFETY: the buffers hold n×n f32 each (contents irrelevant for timing).
                unsafe {
                    blas_sys::cublasSgemm_v2(
                        handle,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        blas_sys::cublasOperation_t::CUBLAS_OP_N,
                        dim,
                        dim,
                        dim,
                        &alpha,
                        pa as *const f32,
                        dim,
                        pb as *const f32,
                        dim,
                        &beta,
                        pc as *mut f32,
                        dim,
                    )
                    .result()
                    .unwrap();
                }
            }
            stream.synchronize().unwrap();
            let elapsed = start.elapsed();
            common::record("matmul_4096_f32/cublas", elapsed, iters);
            elapsed
        })
    });
    g.finish();
    m.close().unwrap();
}

fn mlp_steps(c: &mut Criterion) {
    if !available() {
        return;
    }
    let replay = WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .unwrap();
    for batch in [256usize, 16] {
        let name = format!("mlp_step_b{batch}");
        let mut g = c.benchmark_group(&name);
        g.sample_size(20);
        let step = Step::new(batch);
        let key = format!("{name}/ndscope");
        g.bench_function("ndscope step in a workspace cycle", |b| {
            b.iter_custom(|iters| timed(&key, iters, || step.run()))
        });
        step.close();
        let step = Step::with(batch, replay.clone());
        let key = format!("{name}/ndscope_replayed");
        g.bench_function("ndscope step replayed as a CUDA graph", |b| {
            b.iter_custom(|iters| timed(&key, iters, || step.run()))
        });
        let graph = step.ws.stats().graph;
        println!(
            "{name}: graph replay {}: replayed {} cycles, {} fallbacks ({:?}), {} calls in {} graph(s)",
            graph.state, graph.replays, graph.fallbacks, graph.last_fallback, graph.calls, graph.graphs
        );
        g.finish();
        step.close();
    }
}

/// Ops per cycle of `replay_check`.
const CHECKED_OPS: usize = 64;

fn replay_check(c: &mut Criterion) {
    if !available() {
        return;
    }
    let mut g = c.benchmark_group("replay_check");
    g.sample_size(30);
    let replay = WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .unwrap();
    for (name, device, config) in [
        ("cuda_replayed", GPU, replay),
        ("cuda_eager", GPU, WorkspaceConfig::default()),
        ("cpu_1_element", Device::Cpu, WorkspaceConfig::default()),
    ] {
        let m = Manager::new_base_on(device).unwrap();
        let ws = m.workspace("ops", config).unwrap();
        let x = m.zeros([1], DType::F32).unwrap();
        let cycle = || {
            let scope = ws.open().unwrap();
            for _ in 0..CHECKED_OPS {
                x.mul_scalar_(1.0).unwrap();
            }
            scope.close().unwrap();
        };
        for _ in 0..4 {
            cycle();
        }
        let key = format!("replay_check/{name}");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                // Host side only: the cycle's ops, each timed without its end (the graph launch
                // or nothing) and the wait, both outside.
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    let scope = ws.open().unwrap();
                    let start = Instant::now();
                    for _ in 0..CHECKED_OPS {
                        x.mul_scalar_(1.0).unwrap();
                    }
                    spent += start.elapsed();
                    scope.close().unwrap();
                }
                device.synchronize().unwrap();
                common::record(&key, spent / CHECKED_OPS as u32, iters);
                spent / CHECKED_OPS as u32
            })
        });
        if name == "cuda_replayed" {
            let graph = ws.stats().graph;
            assert_eq!(graph.fallbacks, 0, "{graph:?}");
            println!("replay_check: {graph:?}");
        }
        m.close().unwrap();
    }
    g.finish();
}

fn h2d(c: &mut Criterion) {
    if !available() {
        return;
    }
    let bytes = 256usize << 20;
    let host = Manager::new_base();
    let src = host.zeros([bytes / 4], DType::F32).unwrap();
    let mut g = c.benchmark_group("h2d_256MiB");
    g.sample_size(10);
    g.bench_function(
        "ndscope to_device from pageable memory (double-buffered staging)",
        |b| {
            b.iter_custom(|iters| {
                timed("h2d_256MiB/ndscope", iters, || {
                    src.to_device(GPU).unwrap().close().unwrap();
                })
            })
        },
    );
    // Page-locked: arrays of a HostOnly workspace's block (learned in the first cycles).
    let owner = Manager::new_base_on(GPU).unwrap().with_name("bench-pinned");
    let pinned = WorkspaceConfig::builder()
        .mirroring(ndscope::MirroringPolicy::HostOnly)
        .build()
        .unwrap();
    let ws = owner.workspace("pinned", pinned).unwrap();
    let upload = || {
        ws.cycle(|c| {
            let a = c.empty([bytes / 4], DType::F32)?;
            a.to_device(GPU)?.close()
        })
        .unwrap()
    };
    upload();
    upload();
    g.bench_function("ndscope to_device from page-locked memory (direct)", |b| {
        b.iter_custom(|iters| timed("h2d_256MiB/ndscope_pinned", iters, upload))
    });
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let data = vec![0u8; bytes];
    // SAFETY: one device buffer of `bytes`, freed below.
    let dst = unsafe { result::malloc_async(stream.cu_stream(), bytes).unwrap() };
    g.bench_function("baseline: pageable cuMemcpyHtoD", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                // SAFETY: `dst` holds `bytes`; a synchronous copy from pageable memory.
                unsafe { result::memcpy_htod_sync(dst, &data).unwrap() };
            }
            let elapsed = start.elapsed();
            common::record("h2d_256MiB/pageable", elapsed, iters);
            elapsed
        })
    });
    g.finish();
    let mut g = c.benchmark_group("d2h_256MiB");
    g.sample_size(10);
    let on_gpu = src.to_device(GPU).unwrap();
    g.bench_function(
        "ndscope to_device(Cpu) into pageable memory (double-buffered staging)",
        |b| {
            b.iter_custom(|iters| {
                timed("d2h_256MiB/ndscope", iters, || {
                    on_gpu.to_device(Device::Cpu).unwrap().close().unwrap();
                })
            })
        },
    );
    let round_trip = || {
        ws.cycle(|c| {
            let a = c.empty([bytes / 4], DType::F32)?;
            let g = a.to_device(GPU)?;
            let back = g.to_device(Device::Cpu)?;
            g.close()?;
            back.close()
        })
        .unwrap()
    };
    round_trip();
    round_trip();
    g.bench_function(
        "ndscope page-locked round trip (to the GPU and back, direct)",
        |b| b.iter_custom(|iters| timed("d2h_256MiB/ndscope_pinned_round_trip", iters, round_trip)),
    );
    let mut back = vec![0u8; bytes];
    g.bench_function("baseline: pageable cuMemcpyDtoH", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                // SAFETY: `dst` holds `bytes`; a synchronous copy to pageable memory.
                unsafe { result::memcpy_dtoh_sync(&mut back, dst).unwrap() };
            }
            let elapsed = start.elapsed();
            common::record("d2h_256MiB/pageable", elapsed, iters);
            elapsed
        })
    });
    g.finish();
    on_gpu.close().unwrap();
    owner.close().unwrap();
    host.close().unwrap();
}

fn summary(_c: &mut Criterion) {
    if Device::cuda_count() == 0 {
        return;
    }
    println!("\nratios (medians of the last samples, this run):");
    common::ratio(
        "cuMemAlloc+cuMemFree / ndscope create+close",
        "alloc/cuMemAlloc+cuMemFree",
        "alloc/ndscope",
    );
    common::ratio(
        "cpu create+close / ndscope create+close (learned cycle)",
        "alloc/cpu",
        "alloc/ndscope",
    );
    common::ratio(
        "cuMemAllocAsync+cuMemFreeAsync / ndscope create+close",
        "alloc/cuMemAllocAsync+cuMemFreeAsync",
        "alloc/ndscope",
    );
    common::ratio(
        "cuBLAS sgemm / ndscope matmul (4096² f32)",
        "matmul_4096_f32/cublas",
        "matmul_4096_f32/ndscope",
    );
    for batch in [256, 16] {
        common::ratio(
            &format!("eager / replayed MLP step (batch {batch})"),
            &format!("mlp_step_b{batch}/ndscope"),
            &format!("mlp_step_b{batch}/ndscope_replayed"),
        );
    }
    common::ratio(
        "cuda replayed / cpu 1-element: host cost per op of a replayed cycle vs the front-end's own",
        "replay_check/cuda_replayed",
        "replay_check/cpu_1_element",
    );
    common::ratio(
        "cuda eager / cuda replayed: host cost per op",
        "replay_check/cuda_eager",
        "replay_check/cuda_replayed",
    );
    common::ratio(
        "pageable memcpy / ndscope to_device (256 MiB)",
        "h2d_256MiB/pageable",
        "h2d_256MiB/ndscope",
    );
    common::ratio(
        "pageable memcpy / ndscope to_device from page-locked memory (256 MiB)",
        "h2d_256MiB/pageable",
        "h2d_256MiB/ndscope_pinned",
    );
    common::ratio(
        "pageable memcpy / ndscope to_device(Cpu) (256 MiB)",
        "d2h_256MiB/pageable",
        "d2h_256MiB/ndscope",
    );
    common::save("cuda", &[]);
}

criterion_group!(
    benches,
    alloc,
    cycle,
    matmul,
    mlp_steps,
    replay_check,
    h2d,
    summary
);
criterion_main!(benches);
