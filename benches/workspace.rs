//! Workspaces vs ordinary allocation (issue: workspaces), each as a ratio in one run:
//! (a) a cycle that creates, writes and frees a 64 MiB temporary;
//! (b) a replay of 50 arrays of mixed sizes (256 B – 4 MiB) per cycle: workspace vs no workspace
//!     vs the raw system allocator doing the same allocations;
//! (c) minor page faults per cycle after learning (`getrusage`), printed before the timings.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::hint::black_box;

use criterion::{criterion_group, Criterion};
use ndscope::{DType, Manager, Workspace, WorkspaceConfig};

const BIG: usize = 16 << 20; // f32 elements: 64 MiB

/// 50 sizes in bytes, log-uniform in [256 B, 4 MiB], fixed by a small LCG.
fn replay_sizes() -> Vec<usize> {
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    (0..50)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            let bytes = (256f64.ln() + u * ((4u64 << 20) as f64 / 256.0).ln()).exp();
            (bytes as usize).max(256) / 4 * 4
        })
        .collect()
}

fn big_cycle(m: &Manager) -> ndscope::Result<()> {
    black_box(m.full([BIG], 1.0, DType::F32)?);
    Ok(())
}

fn replay_cycle(m: &Manager, sizes: &[usize]) -> ndscope::Result<()> {
    for &bytes in sizes {
        black_box(m.zeros([bytes / 4], DType::F32)?);
    }
    Ok(())
}

fn raw_replay(sizes: &[usize]) {
    let mut ptrs = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let layout = Layout::from_size_align(bytes, 64).unwrap();
        // SAFETY: non-zero size; each pointer is freed below with its own layout.
        ptrs.push((unsafe { alloc_zeroed(layout) }, layout));
    }
    for (p, layout) in ptrs {
        // SAFETY: allocated above with this layout.
        unsafe { dealloc(black_box(p), layout) };
    }
}

fn minor_faults() -> i64 {
    // SAFETY: `getrusage` fills the zeroed struct we pass; RUSAGE_SELF is always valid.
    unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage.ru_minflt
    }
}

fn faults_per_cycle(cycles: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let before = minor_faults();
    for _ in 0..cycles {
        f();
    }
    (minor_faults() - before) as f64 / cycles as f64
}

fn setup() -> (Manager, Workspace, Workspace) {
    let trainer = Manager::new_base().with_name("trainer");
    let big = trainer
        .workspace("big", WorkspaceConfig::default())
        .unwrap();
    let replay = trainer
        .workspace("replay", WorkspaceConfig::default())
        .unwrap();
    (trainer, big, replay)
}

fn page_faults() {
    let (trainer, big, replay) = setup();
    let sizes = replay_sizes();
    let ws_big = faults_per_cycle(20, || big.cycle(big_cycle).unwrap());
    let heap_big = faults_per_cycle(20, || trainer.scope(big_cycle).unwrap());
    let ws_replay = faults_per_cycle(50, || replay.cycle(|c| replay_cycle(c, &sizes)).unwrap());
    let heap_replay = faults_per_cycle(50, || trainer.scope(|s| replay_cycle(s, &sizes)).unwrap());
    let raw_replay_faults = faults_per_cycle(50, || raw_replay(&sizes));
    println!("minor page faults per cycle after learning (getrusage):");
    println!("  64 MiB temporary: workspace {ws_big:.1}, no workspace {heap_big:.1}");
    println!(
        "  mixed replay:     workspace {ws_replay:.1}, no workspace {heap_replay:.1}, raw allocator {raw_replay_faults:.1}"
    );
    trainer.close().unwrap();
}

fn temporary_64mib(c: &mut Criterion) {
    let (trainer, big, _) = setup();
    let mut g = c.benchmark_group("cycle_64MiB_temporary");
    g.sample_size(20);
    g.bench_function("workspace", |b| b.iter(|| big.cycle(big_cycle).unwrap()));
    g.bench_function("no workspace", |b| {
        b.iter(|| trainer.scope(big_cycle).unwrap())
    });
    g.finish();
    trainer.close().unwrap();
}

fn mixed_replay(c: &mut Criterion) {
    let (trainer, _, replay) = setup();
    let sizes = replay_sizes();
    let total: usize = sizes.iter().sum();
    println!(
        "replay: 50 arrays per cycle, {:.1} MiB in all, largest {} KiB",
        total as f64 / (1 << 20) as f64,
        sizes.iter().max().unwrap() / 1024
    );
    let mut g = c.benchmark_group("cycle_mixed_replay_50_arrays");
    g.sample_size(30);
    g.bench_function("workspace", |b| {
        b.iter(|| replay.cycle(|c| replay_cycle(c, &sizes)).unwrap())
    });
    g.bench_function("no workspace", |b| {
        b.iter(|| trainer.scope(|s| replay_cycle(s, &sizes)).unwrap())
    });
    g.bench_function("raw system allocator", |b| b.iter(|| raw_replay(&sizes)));
    g.finish();
    trainer.close().unwrap();
}

criterion_group!(benches, temporary_64mib, mixed_replay);

fn main() {
    page_faults();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
