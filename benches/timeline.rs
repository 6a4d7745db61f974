//! The memory recorder (issue: seeing memory over time): what recording costs per operation,
//! on against off in the same run, and how long each export of 1M events takes.
//!
//! - `recording_overhead`: a 1-element `add` and the `close` of its result (two recorded events:
//!   an allocation and a free), with recording off and on. The recorder keeps its default
//!   1,000,000 events, so it is full after the first half million iterations and from then on
//!   also drops one event per event: the steady state of a long recording. Target: on ≤ 1.5×
//!   off.
//! - `export_1m_events`: a recording of exactly 1,000,000 events from a workspace training
//!   loop (cycles, scopes, allocations in the block, frees, copies out), written as a Chrome
//!   trace and as a PyTorch snapshot to a file. Target: ≤ 2 s each.

// criterion's macros generate undocumented public functions.
#![allow(missing_docs)]

#[path = "common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use ndscope::{DType, Manager, RecordOptions, Recording, WorkspaceConfig};

fn recording_overhead(c: &mut Criterion) {
    let m = Manager::new_base();
    let a = m.ones([1], DType::F32).unwrap();
    let x = m.ones([1], DType::F32).unwrap();
    let group = "recording_overhead";
    let mut g = c.benchmark_group(group);
    g.measurement_time(Duration::from_secs(5));
    common::bench(
        &mut g,
        group,
        "1-element add + close, recording off",
        || a.add(black_box(&x)).unwrap().close().unwrap(),
    );
    ndscope::start_recording(RecordOptions::default()).unwrap();
    common::bench(&mut g, group, "1-element add + close, recording on", || {
        a.add(black_box(&x)).unwrap().close().unwrap()
    });
    let recording = ndscope::stop_recording().unwrap();
    // Off again, after the recording: the machine's drift shows as a difference of the two offs.
    common::bench(
        &mut g,
        group,
        "1-element add + close, recording off again",
        || a.add(black_box(&x)).unwrap().close().unwrap(),
    );
    g.finish();
    m.close().unwrap();
    println!(
        "\nrecording kept {} events, dropped {}",
        recording.events().len(),
        recording.dropped()
    );
}

/// The same comparison in paired rounds, robust to a shared machine's drift: each round times
/// 100k operations with recording off, then, with a fresh recording of the default size filled
/// first (so it drops an event for each new one, as a long recording does), 100k with it on.
/// Prints the median of the per-round ratios and their range.
fn paired_rounds(_: &mut Criterion) {
    const N: u32 = 100_000;
    let m = Manager::new_base();
    let a = m.ones([1], DType::F32).unwrap();
    let x = m.ones([1], DType::F32).unwrap();
    let op = || a.add(black_box(&x)).unwrap().close().unwrap();
    let timed = |n: u32| {
        let start = Instant::now();
        for _ in 0..n {
            op();
        }
        start.elapsed().as_nanos() as f64 / f64::from(n)
    };
    let mut ratios = Vec::new();
    let (mut offs, mut ons) = (Vec::new(), Vec::new());
    for _ in 0..11 {
        let off = timed(N);
        ndscope::start_recording(RecordOptions::default()).unwrap();
        for _ in 0..510_000 {
            op();
        }
        let on = timed(N);
        let recording = ndscope::stop_recording().unwrap();
        assert!(recording.dropped() > 0, "the buffer was full");
        drop(recording);
        ratios.push(on / off);
        offs.push(off);
        ons.push(on);
    }
    m.close().unwrap();
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let (lo, hi) = (
        ratios.iter().copied().fold(f64::INFINITY, f64::min),
        ratios.iter().copied().fold(0.0, f64::max),
    );
    let r = median(&mut ratios);
    println!(
        "
paired rounds (11 × 100k ops): off {}, on {} (full buffer); on / off median {r:.3} (range {lo:.3}–{hi:.3})",
        common::human(median(&mut offs)),
        common::human(median(&mut ons)),
    );
    common::note("recording_overhead/paired ratio", r);
}

/// A recording of exactly `n` events from a small training loop.
fn loop_recording(n: usize) -> Recording {
    ndscope::start_recording(RecordOptions::default().with_max_entries(n)).unwrap();
    let model = Manager::new_base().with_name("model");
    let w = model.ones([16, 16], DType::F32).unwrap();
    let trainer = model.new_sub_manager().unwrap().with_name("trainer");
    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    let step = || {
        ws.cycle(|batch| {
            let x = batch.ones([8, 16], DType::F32)?;
            let h = x.matmul(&w)?.relu()?;
            let y = h.mul(&h)?.sum_all()?;
            batch.ret(&y)
        })
        .unwrap()
        .close()
        .unwrap();
    };
    // Events per step, counted on a few steps; then enough steps to fill the buffer (which
    // keeps exactly the last `n`).
    for _ in 0..10 {
        step();
    }
    let per_step = ndscope::recording_snapshot().unwrap().events().len() / 10;
    for _ in 0..n / per_step.max(1) + 10 {
        step();
    }
    let recording = ndscope::stop_recording().unwrap();
    model.close().unwrap();
    recording
}

fn export_1m_events(c: &mut Criterion) {
    let recording = loop_recording(1_000_000);
    assert_eq!(recording.events().len(), 1_000_000);
    let dir = std::env::temp_dir();
    let trace = dir.join(format!("ndscope-bench-{}.json", std::process::id()));
    let snapshot = dir.join(format!("ndscope-bench-{}.pickle", std::process::id()));
    let group = "export_1m_events";
    let mut g = c.benchmark_group(group);
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(15));
    g.bench_function("Chrome trace (JSON) to a file", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                recording.write_chrome_trace(&trace).unwrap();
            }
            let elapsed = start.elapsed();
            common::record(&format!("{group}/chrome"), elapsed, iters);
            elapsed
        })
    });
    g.bench_function("PyTorch snapshot (pickle) to a file", |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                recording.write_memory_snapshot(&snapshot).unwrap();
            }
            let elapsed = start.elapsed();
            common::record(&format!("{group}/snapshot"), elapsed, iters);
            elapsed
        })
    });
    g.finish();
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    println!(
        "\n1M events: Chrome trace {:.1} MB, PyTorch snapshot {:.1} MB",
        size(&trace) as f64 / 1e6,
        size(&snapshot) as f64 / 1e6
    );
    let _ = std::fs::remove_file(&trace);
    let _ = std::fs::remove_file(&snapshot);
}

fn summary(_: &mut Criterion) {
    println!("\nsummary (medians of the last samples, this run):");
    let g = "recording_overhead";
    common::ratio(
        "recording on / off (target ≤ 1.5)",
        &format!("{g}/1-element add + close, recording on"),
        &format!("{g}/1-element add + close, recording off"),
    );
    common::ratio(
        "off again / off (drift)",
        &format!("{g}/1-element add + close, recording off again"),
        &format!("{g}/1-element add + close, recording off"),
    );
    for (name, key) in [
        ("Chrome trace", "export_1m_events/chrome"),
        ("PyTorch snapshot", "export_1m_events/snapshot"),
    ] {
        if let Some(ns) = common::median_ns(key) {
            println!(
                "  export of 1M events, {name}: {} (target ≤ 2 s)",
                common::human(ns)
            );
        }
    }
    common::save("timeline", &[]);
}

criterion_group!(
    benches,
    recording_overhead,
    paired_rounds,
    export_1m_events,
    summary
);
criterion_main!(benches);
