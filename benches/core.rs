//! Core overheads (issue: manager tree): create+close of a small array (and of one carved from a
//! learned workspace block), manager open+close, the per-op overhead of a 1-element `add`, and
//! `debug_dump` of 100k arrays. Each group has a baseline measured in the same run: the system
//! allocator doing the least an eager array library must do (allocate and free the result's
//! bytes), or formatting the same lines by hand.
//!
//! `tiny_ops_on_a_big_pool` runs first, on a 64-thread pool (`NDSCOPE_NUM_THREADS=64` unless
//! the variable is set): a 1-element `add` and a batch-1 `[1,784]·[784,1024]` `matmul`, which
//! the thread policy keeps on the calling thread, capped at 64 threads and at 1
//! (`ndscope::set_num_threads`); the two should cost the same. Later groups run capped at the
//! cores available.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::alloc::{alloc, alloc_zeroed, dealloc, Layout};
use std::fmt::Write as _;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};

mod common;
use ndscope::{DType, Manager};

/// The least an eager array library does per result: allocate its bytes zeroed, 64-byte
/// aligned as ndscope does, and free them.
fn alloc_free(bytes: usize) {
    let layout = Layout::from_size_align(black_box(bytes), 64).unwrap();
    // SAFETY: `bytes` is non-zero; the pointer is freed with the same layout right away.
    unsafe {
        let p = alloc_zeroed(layout);
        dealloc(black_box(p), layout);
    }
}

fn tiny_ops_on_a_big_pool(c: &mut Criterion) {
    if std::env::var_os("NDSCOPE_NUM_THREADS").is_none() {
        // Before the pool exists (this group runs first): it reads the variable once.
        std::env::set_var("NDSCOPE_NUM_THREADS", "64");
    }
    let full = ndscope::set_num_threads(usize::MAX);
    let m = Manager::new_base();
    let one = m.ones([1], DType::F32).unwrap();
    let x = m.ones([1, 784], DType::F32).unwrap();
    let w = m.ones([784, 1024], DType::F32).unwrap();
    let w2 = m.ones([1024, 1024], DType::F32).unwrap();
    let w3 = m.ones([1024, 10], DType::F32).unwrap();
    let b = m.ones([1024], DType::F32).unwrap();
    // A batch-1 forward pass of the 784→1024→1024→10 MLP: its 1024² product reads 4 MiB of
    // weights and takes 3 threads of the policy (one per 1.25 MiB), the rest stays on the
    // caller. On a pool larger than the machine this used to leave helpers spinning.
    let forward = || {
        let h = x.matmul(&w)?.add(&b)?.relu()?;
        let h = h.matmul(&w2)?.add(&b)?.relu()?;
        h.matmul(&w3)
    };
    let mut g = c.benchmark_group("tiny_ops_on_a_big_pool");
    for cap in [full, 1] {
        g.bench_function(format!("1-element add, {cap}-thread pool"), |b| {
            ndscope::set_num_threads(cap);
            b.iter(|| one.add(&one).unwrap().close().unwrap())
        });
        g.bench_function(
            format!("matmul [1,784]·[784,1024], {cap}-thread pool"),
            |b| {
                ndscope::set_num_threads(cap);
                b.iter(|| x.matmul(&w).unwrap().close().unwrap())
            },
        );
        let name = format!("batch-1 MLP forward, {cap}-thread pool");
        common::bench(&mut g, "tiny_ops_on_a_big_pool", &name, || {
            ndscope::set_num_threads(cap);
            let scope = m.sub_scope().unwrap();
            let _active = scope.activate();
            black_box(forward().unwrap());
        });
    }
    g.finish();
    common::ratio(
        &format!("batch-1 MLP forward, {full}-thread pool / 1-thread pool"),
        &format!("tiny_ops_on_a_big_pool/batch-1 MLP forward, {full}-thread pool"),
        "tiny_ops_on_a_big_pool/batch-1 MLP forward, 1-thread pool",
    );
    // The other groups run on as many threads as there are cores, as without this group.
    ndscope::set_num_threads(std::thread::available_parallelism().map_or(1, |n| n.get()));
    m.close().unwrap();
}

fn create_close(c: &mut Criterion) {
    let m = Manager::new_base();
    let mut g = c.benchmark_group("create_close_small_array");
    g.bench_function("ndscope zeros([4]) + close", |b| {
        b.iter(|| {
            let a = m.zeros(black_box([4]), DType::F32).unwrap();
            a.close().unwrap();
        })
    });
    g.bench_function("baseline: aligned alloc_zeroed + dealloc (16 B)", |b| {
        b.iter(|| alloc_free(16))
    });
    g.finish();
    m.close().unwrap();
}

/// Create + close of an array carved from a learned workspace block: what every temporary of a
/// steady training step or inference call costs in bookkeeping. A cycle of `common::CARVED`
/// 1 KiB arrays is learned first; each timed call opens such a cycle when the last one is used up
/// (the open and close are included), creates an array and closes it. The baseline is the
/// system allocator's aligned allocation and free of the same bytes, unzeroed.
fn carved_create_close(c: &mut Criterion) {
    let owner = Manager::new_base();
    let ws = common::carved_workspace(&owner, 256);
    let mut g = c.benchmark_group("carved_create_close");
    let key = "carved_create_close/ndscope empty + close, carved from a learned block";
    g.bench_function("ndscope empty + close, carved from a learned block", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            common::create_close_carved(&ws, 256, iters);
            let elapsed = start.elapsed();
            common::record(key, elapsed, iters);
            elapsed
        })
    });
    let baseline = "baseline: aligned alloc + dealloc (1 KiB)";
    common::bench(&mut g, "carved_create_close", baseline, || {
        let layout = Layout::from_size_align(black_box(1024), 64).unwrap();
        // SAFETY: the size is non-zero; the pointer is freed with the same layout right away.
        unsafe { dealloc(black_box(alloc(layout)), layout) }
    });
    g.finish();
    common::ratio(
        "carved create + close / aligned alloc + dealloc",
        key,
        &format!("carved_create_close/{baseline}"),
    );
    owner.close().unwrap();
}

fn manager_open_close(c: &mut Criterion) {
    let parent = Manager::new_base();
    let mut g = c.benchmark_group("manager_open_close");
    g.bench_function("ndscope new_sub_manager + close", |b| {
        b.iter(|| {
            let m = parent.new_sub_manager().unwrap();
            m.close().unwrap();
        })
    });
    g.bench_function("ndscope sub_scope (drop closes)", |b| {
        b.iter(|| {
            let s = parent.sub_scope().unwrap();
            black_box(&s);
        })
    });
    g.bench_function("baseline: Box<[u64; 8]> alloc + free", |b| {
        b.iter(|| black_box(Box::new([0u64; 8])))
    });
    g.finish();
    parent.close().unwrap();
}

fn per_op_overhead(c: &mut Criterion) {
    let m = Manager::new_base();
    let a = m.ones([1], DType::F32).unwrap();
    let x = m.ones([1], DType::F32).unwrap();
    let mut g = c.benchmark_group("per_op_overhead");
    // Results accumulate in a scope closed outside the timed region, so only the op is timed.
    g.bench_function("ndscope 1-element add", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters;
            while left > 0 {
                let n = left.min(10_000);
                let scope = m.sub_scope().unwrap();
                let _active = scope.activate();
                let start = Instant::now();
                for _ in 0..n {
                    black_box(a.add(&x).unwrap());
                }
                total += start.elapsed();
                left -= n;
            }
            total
        })
    });
    g.bench_function("ndscope 1-element add + close", |b| {
        b.iter(|| a.add(&x).unwrap().close().unwrap())
    });
    g.bench_function("ndscope 1-element add_ (in place)", |b| {
        b.iter(|| a.add_(black_box(&x)).unwrap())
    });
    g.bench_function("baseline: aligned alloc_zeroed + dealloc (4 B)", |b| {
        b.iter(|| alloc_free(4))
    });
    g.finish();
    m.close().unwrap();
}

fn dump_100k(c: &mut Criterion) {
    let m = Manager::new_base().with_name("big");
    let arrays: Vec<_> = (0..100_000)
        .map(|i| m.zeros([1 + i % 7], DType::F32).unwrap())
        .collect();
    for a in arrays.iter().step_by(10) {
        a.set_name("named");
    }
    let mut g = c.benchmark_group("debug_dump_100k_arrays");
    g.sample_size(20);
    g.bench_function("ndscope debug_dump(1)", |b| {
        b.iter(|| black_box(m.debug_dump(1)))
    });
    g.bench_function("ndscope debug_dump(0)", |b| {
        b.iter(|| black_box(m.debug_dump(0)))
    });
    g.bench_function("ndscope report()", |b| b.iter(|| black_box(m.report())));
    let lines: Vec<(u64, usize, &'static str, u32)> = (0..100_000u64)
        .map(|i| (i, 4 * (1 + i as usize % 7), file!(), 42))
        .collect();
    g.bench_function("baseline: format 100k similar lines", |b| {
        b.iter(|| {
            let mut out = String::new();
            for (id, bytes, file, line) in &lines {
                let _ = writeln!(
                    out,
                    "    - a{id} f32 [{}] {bytes} B at {file}:{line}:9",
                    bytes / 4
                );
            }
            black_box(out)
        })
    });
    g.finish();
    m.close().unwrap();
}

criterion_group!(
    benches,
    tiny_ops_on_a_big_pool,
    create_close,
    carved_create_close,
    manager_open_close,
    per_op_overhead,
    dump_100k
);
criterion_main!(benches);
