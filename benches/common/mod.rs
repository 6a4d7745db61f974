//! Shared by the benches: every timing criterion takes is also kept here, so a bench can print
//! ratios between its measurements (medians over the last samples, all from the same run) and
//! save them to `target/ndscope-bench/<bench>.json` for `benches/peers/` scripts.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::measurement::WallTime;
use criterion::BenchmarkGroup;
use ndscope::{DType, Manager, Workspace, WorkspaceConfig};

static SAMPLES: Mutex<BTreeMap<String, Vec<f64>>> = Mutex::new(BTreeMap::new());

/// Benchmarks `f` as `group/name`, recording nanoseconds per call of every sample.
pub fn bench(g: &mut BenchmarkGroup<'_, WallTime>, group: &str, name: &str, mut f: impl FnMut()) {
    let key = format!("{group}/{name}");
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let start = Instant::now();
            for _ in 0..iters {
                f();
            }
            let elapsed = start.elapsed();
            record(&key, elapsed, iters);
            elapsed
        })
    });
}

/// Records one sample of `iters` calls taking `elapsed` under `key`.
pub fn record(key: &str, elapsed: Duration, iters: u64) {
    let ns = elapsed.as_nanos() as f64 / iters.max(1) as f64;
    if let Ok(mut s) = SAMPLES.lock() {
        s.entry(key.to_string()).or_default().push(ns);
    }
}

/// Records a figure that is not a time (a count), saved under `key` as it is.
pub fn note(key: &str, value: f64) {
    if let Ok(mut s) = SAMPLES.lock() {
        s.insert(key.to_string(), vec![value]);
    }
}

/// The median ns per call of `key` over its last samples (warm-up samples come first).
pub fn median_ns(key: &str) -> Option<f64> {
    let s = SAMPLES.lock().ok()?;
    let all = s.get(key)?;
    let mut tail: Vec<f64> = all[all.len().saturating_sub(10)..].to_vec();
    tail.sort_by(|a, b| a.total_cmp(b));
    tail.get(tail.len() / 2).copied()
}

/// Formats nanoseconds with a unit.
pub fn human(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.2} µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

/// Prints `label: a / b = ratio` for two recorded keys, if both ran (a filtered run may skip).
pub fn ratio(label: &str, a: &str, b: &str) -> Option<f64> {
    let (x, y) = (median_ns(a)?, median_ns(b)?);
    let r = x / y;
    println!("  {label}: {} / {} = {r:.3}", human(x), human(y));
    Some(r)
}

/// Writes every recorded median to `target/ndscope-bench/<bench>.json`.
pub fn save(bench: &str, extra: &[(&str, f64)]) {
    let dir = std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "target".into());
    let dir = std::path::Path::new(&dir).join("ndscope-bench");
    let keys: Vec<String> = SAMPLES
        .lock()
        .map(|s| s.keys().cloned().collect())
        .unwrap_or_default();
    let mut fields: Vec<String> = keys
        .iter()
        .filter_map(|k| median_ns(k).map(|v| format!("  \"{k}\": {v:.1}")))
        .collect();
    fields.extend(extra.iter().map(|(k, v)| format!("  \"{k}\": {v}")));
    let text = format!("{{\n{}\n}}\n", fields.join(",\n"));
    if std::fs::create_dir_all(&dir).is_ok() {
        let _ = std::fs::write(dir.join(format!("{bench}.json")), text);
    }
}

/// Arrays per cycle of [`carved_workspace`].
pub const CARVED: u64 = 256;

/// A workspace of `owner` that learned cycles of [`CARVED`] f32 arrays of `len` elements, so
/// that every array of such a cycle is carved from its block.
pub fn carved_workspace(owner: &Manager, len: usize) -> Workspace {
    let ws = owner
        .workspace("carved", WorkspaceConfig::default())
        .unwrap();
    for _ in 0..2 {
        ws.cycle(|s| {
            for _ in 0..CARVED {
                s.empty([len], DType::F32)?;
            }
            Ok(())
        })
        .unwrap();
    }
    ws
}

/// Creates and closes `iters` arrays of `len` elements carved from `ws`'s block (see
/// [`carved_workspace`]), opening a cycle for each [`CARVED`] (the opens and closes count).
pub fn create_close_carved(ws: &Workspace, len: usize, iters: u64) {
    let mut left = iters;
    while left > 0 {
        let n = left.min(CARVED);
        let scope = ws.open().unwrap();
        for _ in 0..n {
            let a = scope
                .empty(std::hint::black_box([len]), DType::F32)
                .unwrap();
            a.close().unwrap();
        }
        drop(scope);
        left -= n;
    }
}
