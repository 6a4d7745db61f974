//! Seeing memory over time (DESIGN §8): the recorder, its bounded buffer, and its two exports —
//! a Chrome trace (Perfetto UI, `chrome://tracing`) and a PyTorch memory snapshot (PyTorch's
//! `memory_viz`), the latter loaded with Python's `pickle` when `python3` is present.
//!
//! The recorder is process-wide, so the tests of this file take turns (`TURN`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use ndscope::{
    set_memory_limit, start_recording, stop_recording, DType, Device, Error, EventKind, Manager,
    RecordOptions, Recording, Result, SpillPolicy, WorkspaceConfig,
};
use serde_json::Value;

static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ndscope-timeline-{}-{name}", std::process::id()))
}

/// model → trainer → workspace "batch" (Reallocate), three cycles; the third outgrows the
/// block. Returns the recording and the model's id.
fn training_like_run() -> Result<(Recording, Manager)> {
    start_recording(RecordOptions::default())?;
    let model = Manager::new_base().with_name("model");
    let w = model.ones([16, 16], DType::F32)?.with_name("w");
    let trainer = model.new_sub_manager()?.with_name("trainer");
    let conf = WorkspaceConfig::builder()
        .spill(SpillPolicy::Reallocate)
        .build()?;
    let ws = trainer.workspace("batch", conf)?;
    for step in 0..3 {
        ws.cycle(|batch| {
            let x = batch.ones([8, 16], DType::F32)?;
            let y = x.matmul(&w)?.relu()?;
            if step == 2 {
                batch.zeros([64, 64], DType::F32)?; // outgrows the learned block: spills
            }
            batch.ret(&y.sum_all()?)
        })?;
    }
    model.close()?;
    let recording = stop_recording().expect("recording was on");
    Ok((recording, model))
}

#[test]
fn recording_captures_each_kind_of_event_in_time_order() -> Result<()> {
    let _turn = turn();
    let (rec, model) = training_like_run()?;
    let kinds: Vec<EventKind> = rec.events().iter().map(|e| e.kind()).collect();
    for kind in [
        EventKind::ManagerOpen,
        EventKind::ManagerClose,
        EventKind::CycleOpen,
        EventKind::CycleClose,
        EventKind::Alloc,
        EventKind::Free,
        EventKind::Attach,
        EventKind::Relocate,
        EventKind::Spill,
        EventKind::BlockAlloc,
        EventKind::BlockFree,
    ] {
        assert!(kinds.contains(&kind), "no {kind:?} in {kinds:?}");
    }
    assert_eq!(rec.dropped(), 0);
    let times: Vec<_> = rec.events().iter().map(|e| e.time()).collect();
    assert!(
        times.windows(2).all(|w| w[0] <= w[1]),
        "events in time order"
    );
    assert!(rec.duration() >= *times.last().unwrap());
    // Three cycles, numbered 1..=3, the first learning, so allocations of later cycles are in
    // the block.
    let cycles: Vec<u64> = rec
        .events()
        .iter()
        .filter(|e| e.kind() == EventKind::CycleClose)
        .filter_map(|e| e.cycle())
        .collect();
    assert_eq!(cycles, vec![1, 2, 3]);
    assert!(rec
        .events()
        .iter()
        .any(|e| e.kind() == EventKind::Alloc && e.in_workspace()));
    // Every event names its thread and device; allocations their site, in this file.
    let me = rec.events()[0].thread();
    assert!(rec.threads().len() > me);
    for e in rec.events() {
        assert_eq!(e.device(), Device::Cpu);
        if e.kind() == EventKind::Alloc {
            assert!(
                e.site().is_some_and(|s| s.file().ends_with("timeline.rs")),
                "{e:?}"
            );
            assert!(e.array().is_some() && e.address().is_some() && e.manager().is_some());
        }
    }
    // The parameter's allocation: 1 KiB owned by the model.
    let w = rec
        .events()
        .iter()
        .find(|e| e.kind() == EventKind::Alloc)
        .expect("an allocation");
    assert_eq!((w.bytes(), w.manager()), (1024, Some(model.id())));
    let block = rec
        .events()
        .iter()
        .find(|e| e.kind() == EventKind::BlockAlloc)
        .expect("the learned block");
    assert_eq!(block.workspace(), Some("batch"));
    assert!(block.bytes() > 0 && block.address().is_some_and(|a| a != 0));
    Ok(())
}

#[test]
fn off_records_nothing_and_stop_returns_none() -> Result<()> {
    let _turn = turn();
    assert!(!ndscope::is_recording());
    assert!(stop_recording().is_none());
    assert!(ndscope::recording_snapshot().is_none());
    let m = Manager::new_base();
    m.zeros([4], DType::F32)?;
    m.close()?;
    start_recording(RecordOptions::default())?;
    let rec = stop_recording().expect("on");
    assert!(
        rec.events().is_empty(),
        "nothing happened while on: {:?}",
        rec.events()
    );
    Ok(())
}

#[test]
fn bad_options_and_a_second_start_are_refused_and_change_nothing() -> Result<()> {
    let _turn = turn();
    let err = start_recording(RecordOptions::default().with_max_entries(0)).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument { reason, .. } if reason.contains("max_entries")),
        "{err}"
    );
    assert!(!ndscope::is_recording());
    start_recording(RecordOptions::default().with_max_entries(100))?;
    let m = Manager::new_base();
    m.zeros([4], DType::F32)?;
    let err = start_recording(RecordOptions::default()).unwrap_err();
    assert!(err.to_string().contains("already running"), "{err}");
    assert!(err.to_string().contains(file!()), "says where: {err}");
    m.close()?;
    let rec = stop_recording().expect("the first recording goes on");
    assert_eq!(rec.max_entries(), 100);
    assert!(rec.events().iter().any(|e| e.kind() == EventKind::Alloc));
    Ok(())
}

#[test]
fn a_snapshot_copies_while_the_recording_goes_on() -> Result<()> {
    let _turn = turn();
    start_recording(RecordOptions::default())?;
    let m = Manager::new_base();
    m.zeros([4], DType::F32)?;
    let early = ndscope::recording_snapshot().expect("on");
    m.zeros([8], DType::F32)?;
    m.close()?;
    let rec = stop_recording().expect("on");
    assert!(rec.events().len() > early.events().len());
    let allocs = |r: &Recording| {
        r.events()
            .iter()
            .filter(|e| e.kind() == EventKind::Alloc)
            .count()
    };
    assert_eq!((allocs(&early), allocs(&rec)), (1, 2));
    Ok(())
}

#[test]
fn a_full_buffer_drops_the_oldest_events_and_counts_them() -> Result<()> {
    let _turn = turn();
    start_recording(RecordOptions::default().with_max_entries(10))?;
    let m = Manager::new_base().with_name("many");
    let mut last = None;
    for _ in 0..50 {
        let a = m.zeros([4], DType::F32)?;
        a.close()?;
        last = Some(a.id());
    }
    let keep = m.zeros([1000], DType::F32)?;
    let rec = stop_recording().expect("on");
    assert_eq!(rec.events().len(), 10);
    assert_eq!(
        rec.dropped(),
        102 - 10,
        "an open, 51 allocations and 50 frees"
    );
    let ids: Vec<_> = rec.events().iter().filter_map(|e| e.array()).collect();
    assert_eq!(ids.last(), Some(&keep.id()));
    assert!(ids.contains(&last.expect("ran")), "the newest are kept");

    // The exports start from the state before the oldest event kept: the bytes of `many` are
    // exact although most of its events were dropped.
    let trace = chrome_trace(&rec)?;
    let name = format!("bytes in use by 'many' ({})", m.id());
    let values = counter(&trace, &name);
    assert_eq!(values.last().copied(), Some(4000), "{values:?}");
    assert_eq!(trace["otherData"]["dropped_events"], 92);
    m.close()
}

#[test]
fn cap_refusals_and_out_of_memory_are_recorded_with_their_sites() -> Result<()> {
    let _turn = turn();
    let model = Manager::new_base().with_name("capped model");
    let w = model.ones([4], DType::F32)?;
    model.cap();
    start_recording(RecordOptions::default())?;
    let (refused, capped_line) = (w.add(&w), line!());
    assert!(matches!(refused, Err(Error::Capped { .. })));
    let in_use = ndscope::memory_usage(Device::Cpu).in_use;
    set_memory_limit(Device::Cpu, Some(in_use + 1024));
    let scratch = Manager::new_base();
    let (oom, oom_line) = (scratch.zeros([1 << 20], DType::F32), line!());
    set_memory_limit(Device::Cpu, None);
    assert!(matches!(oom, Err(Error::OutOfMemory { .. })));
    let rec = stop_recording().expect("on");
    let capped = rec
        .events()
        .iter()
        .find(|e| e.kind() == EventKind::Capped)
        .expect("the refusal");
    assert_eq!(capped.manager(), Some(model.id()));
    assert_eq!(capped.site().map(|s| s.line()), Some(capped_line));
    let oom = rec
        .events()
        .iter()
        .find(|e| e.kind() == EventKind::OutOfMemory)
        .expect("the refusal");
    assert_eq!(oom.bytes(), 4 << 20);
    assert_eq!(oom.site().map(|s| s.line()), Some(oom_line));

    let trace = chrome_trace(&rec)?;
    let instants: Vec<&str> = events(&trace)
        .filter(|e| e["ph"] == "i")
        .filter_map(|e| e["cat"].as_str())
        .collect();
    assert!(
        instants.contains(&"capped") && instants.contains(&"oom"),
        "{instants:?}"
    );
    scratch.close()?;
    model.close()
}

// ----------------------------------------------------------------------------------------------
// Chrome trace
// ----------------------------------------------------------------------------------------------

fn chrome_trace(rec: &Recording) -> Result<Value> {
    let mut bytes = Vec::new();
    rec.write_chrome_trace_to(&mut bytes)?;
    Ok(serde_json::from_slice(&bytes).expect("the trace is valid JSON"))
}

fn events(trace: &Value) -> impl Iterator<Item = &Value> {
    trace["traceEvents"]
        .as_array()
        .expect("traceEvents is a list")
        .iter()
}

/// The values of a counter track, in order.
fn counter(trace: &Value, name: &str) -> Vec<i64> {
    events(trace)
        .filter(|e| e["ph"] == "C" && e["name"] == name)
        .map(|e| e["args"]["bytes"].as_i64().expect("bytes"))
        .collect()
}

fn ns(v: &Value) -> u64 {
    (v.as_f64().expect("a number") * 1000.0).round() as u64
}

/// Checks that the complete slices of each thread nest (each lies inside the one it starts in,
/// or after it); returns them per thread as (start, end, name).
fn check_nesting(trace: &Value) -> BTreeMap<u64, Vec<(u64, u64, String)>> {
    let mut per_thread: BTreeMap<u64, Vec<(u64, u64, String)>> = BTreeMap::new();
    for e in events(trace).filter(|e| e["ph"] == "X") {
        let start = ns(&e["ts"]);
        let end = start + ns(&e["dur"]);
        let tid = e["tid"].as_u64().expect("tid");
        let name = e["name"].as_str().expect("name").to_string();
        per_thread.entry(tid).or_default().push((start, end, name));
    }
    for slices in per_thread.values_mut() {
        slices.sort_by_key(|&(s, e, _)| (s, std::cmp::Reverse(e)));
        let mut stack: Vec<(u64, u64, &str)> = Vec::new();
        for (s, e, name) in slices.iter() {
            while stack.last().is_some_and(|&(_, end, _)| end <= *s) {
                stack.pop();
            }
            if let Some(&(ps, pe, parent)) = stack.last() {
                assert!(
                    *e <= pe,
                    "'{name}' [{s}, {e}] overlaps '{parent}' [{ps}, {pe}] without nesting"
                );
            }
            stack.push((*s, *e, name));
        }
    }
    per_thread
}

#[test]
fn chrome_trace_parses_and_its_slices_nest() -> Result<()> {
    let _turn = turn();
    let (rec, model) = training_like_run()?;
    let path = temp("trace.json");
    rec.write_chrome_trace(&path)?;
    let trace: Value =
        serde_json::from_slice(&std::fs::read(&path).expect("written")).expect("valid JSON");
    let _ = std::fs::remove_file(&path);

    // Names of the process and of each thread that has events.
    let meta: Vec<&Value> = events(&trace).filter(|e| e["ph"] == "M").collect();
    assert!(meta.iter().any(|e| e["name"] == "process_name"
        && e["args"]["name"]
            .as_str()
            .is_some_and(|n| n.starts_with("ndscope"))));
    assert!(meta.iter().any(|e| e["name"] == "thread_name"));

    // Slices: model ⊃ trainer ⊃ batch#1..3, all on this thread, nested.
    let per_thread = check_nesting(&trace);
    let slices = per_thread.values().next().expect("one thread of slices");
    let find = |name: &str| {
        slices
            .iter()
            .find(|s| s.2 == name)
            .unwrap_or_else(|| panic!("no slice {name}: {slices:?}"))
    };
    let (m, t) = (find("model"), find("trainer"));
    assert!(m.0 <= t.0 && t.1 <= m.1);
    for cycle in ["batch#1", "batch#2", "batch#3"] {
        let c = find(cycle);
        assert!(t.0 <= c.0 && c.1 <= t.1, "{cycle} inside trainer");
    }
    let cycle3 = events(&trace)
        .find(|e| e["ph"] == "X" && e["name"] == "batch#3")
        .expect("cycle slice");
    assert_eq!(cycle3["cat"], "cycle");
    assert_eq!(cycle3["args"]["workspace"], "batch");
    assert!(cycle3["args"]["spilled_bytes"].as_u64() >= Some(16384));

    // Counters: per device and per top-level manager, back to where they started.
    let cpu = counter(&trace, "bytes in use on cpu");
    let by_model = counter(&trace, &format!("bytes in use by 'model' ({})", model.id()));
    assert!(cpu.len() > 3 && by_model.len() > 3);
    assert_eq!(
        by_model.first(),
        Some(&1024),
        "the parameter first: {by_model:?}"
    );
    assert_eq!(by_model.last(), Some(&0), "everything freed: {by_model:?}");
    assert_eq!(cpu.first(), cpu.last());
    assert!(by_model.iter().max() >= Some(&(1024 + 16384)));
    // Instants: the spill and the block.
    let cats: Vec<&str> = events(&trace)
        .filter(|e| e["ph"] == "i")
        .filter_map(|e| e["cat"].as_str())
        .collect();
    assert!(
        cats.contains(&"spill") && cats.contains(&"block"),
        "{cats:?}"
    );
    Ok(())
}

#[test]
fn overlapping_scopes_and_other_threads_keep_each_thread_nested() -> Result<()> {
    let _turn = turn();
    start_recording(RecordOptions::default())?;
    let a = Manager::new_base().with_name("a");
    let b = Manager::new_base().with_name("b");
    a.close()?; // a and b overlap without nesting
    let worker = std::thread::Builder::new()
        .name("worker".into())
        .spawn(|| -> Result<()> {
            Manager::new_base()
                .with_name("on worker")
                .scope(|s| s.zeros([4], DType::F32).map(|_| ()))
        })
        .expect("spawned");
    worker.join().expect("joined")?;
    b.close()?;
    let rec = stop_recording().expect("on");
    let trace = chrome_trace(&rec)?;
    let per_thread = check_nesting(&trace);
    assert_eq!(per_thread.len(), 2, "{per_thread:?}");
    let asynchronous: Vec<&Value> = events(&trace)
        .filter(|e| e["ph"] == "b" || e["ph"] == "e")
        .collect();
    assert_eq!(
        asynchronous.len(),
        2,
        "one overlapping scope: {asynchronous:?}"
    );
    let worker_tid = events(&trace)
        .find(|e| e["name"] == "thread_name" && e["args"]["name"] == "worker")
        .and_then(|e| e["tid"].as_u64())
        .expect("the worker thread is named");
    assert!(per_thread[&worker_tid].iter().any(|s| s.2 == "on worker"));
    Ok(())
}

// ----------------------------------------------------------------------------------------------
// PyTorch memory snapshot
// ----------------------------------------------------------------------------------------------

/// Checks the snapshot with Python's `pickle` and prints a JSON summary.
const CHECK_SNAPSHOT: &str = r#"
import json, pickle, sys
with open(sys.argv[1], "rb") as f:
    snap = pickle.load(f)
assert set(snap) >= {"segments", "device_traces", "allocator_settings"}, list(snap)
I64 = range(-2**63, 2**63)
def is_int(v):
    return type(v) is int and v in I64
for seg in snap["segments"]:
    for k in ("device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream"):
        assert is_int(seg[k]), (k, seg[k])
    addr = seg["address"]
    for b in seg["blocks"]:
        assert b["address"] == addr, ("blocks tile the segment", seg)
        assert is_int(b["size"]) and b["size"] > 0 and is_int(b["requested_size"])
        assert b["state"] in ("active_allocated", "inactive")
        addr += b["size"]
    assert addr == seg["address"] + seg["total_size"], ("blocks cover the segment", seg)
actions = {}
categories = []
live = {}
for trace in snap["device_traces"]:
    for e in trace:
        assert e["action"] in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "oom", "snapshot"), e
        for k in ("addr", "size", "stream", "time_us"):
            assert is_int(e[k]), (k, e)
        for fr in e["frames"]:
            assert set(fr) == {"filename", "line", "name"}, fr
        actions[e["action"]] = actions.get(e["action"], 0) + 1
        if "category" in e and e["category"] not in categories:
            categories.append(e["category"])
        if e["action"] == "alloc":
            assert e["addr"] not in live, ("allocated twice", e)
            live[e["addr"]] = e["size"]
        if e["action"] == "free_completed" and e["addr"] in live:
            assert live.pop(e["addr"]) == e["size"]
frames = sorted({f["filename"] for t in snap["device_traces"] for e in t for f in e["frames"]})
print(json.dumps({"actions": actions, "categories": categories, "segments": len(snap["segments"]),
                  "devices": len(snap["device_traces"]), "frames": frames,
                  "ndscope": {k: v for k, v in snap["ndscope"].items()},
                  "live_blocks": sum(1 for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated")}))
"#;

/// Runs `CHECK_SNAPSHOT` on `path`; `None` (saying why) when there is no `python3`.
fn python_check(path: &Path) -> Option<Value> {
    let output = match Command::new("python3")
        .arg("-c")
        .arg(CHECK_SNAPSHOT)
        .arg(path)
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            println!("skipped: python3 is not available ({e}); the snapshot was not loaded");
            return None;
        }
    };
    assert!(
        output.status.success(),
        "Python could not load the snapshot:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    Some(serde_json::from_slice(&output.stdout).expect("the summary is JSON"))
}

#[test]
fn memory_snapshot_loads_with_python_pickle() -> Result<()> {
    let _turn = turn();
    // Something live at the end too: a model that stays open, with a workspace block.
    let kept = Manager::new_base().with_name("kept");
    let (rec, _model) = {
        let r = training_like_run();
        let ws = kept.workspace("infer", WorkspaceConfig::default())?;
        ws.cycle(|s| s.ones([32], DType::F32).map(|_| ()))?;
        r?
    };
    start_recording(RecordOptions::default())?;
    let ws = kept.workspace("infer", WorkspaceConfig::default())?;
    let scope = ws.open()?;
    let live = scope.ones([32], DType::F32)?;
    let own = kept.zeros([100], DType::F32)?;
    let late = stop_recording().expect("on");
    let path = temp("snapshot.pickle");
    rec.write_memory_snapshot(&path)?;
    let late_path = temp("late.pickle");
    late.write_memory_snapshot(&late_path)?;

    if let Some(summary) = python_check(&path) {
        let allocs = rec
            .events()
            .iter()
            .filter(|e| e.kind() == EventKind::Alloc && e.bytes() > 0)
            .count() as u64;
        let relocations = rec
            .events()
            .iter()
            .filter(|e| e.kind() == EventKind::Relocate)
            .count() as u64;
        assert_eq!(summary["actions"]["alloc"], allocs + relocations);
        assert_eq!(
            summary["actions"]["free_requested"],
            summary["actions"]["free_completed"]
        );
        assert!(summary["actions"]["segment_alloc"].as_u64() > Some(1));
        assert_eq!(summary["actions"]["snapshot"], 1);
        let categories: Vec<&str> = summary["categories"]
            .as_array()
            .expect("list")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        for c in ["model", "batch", "unknown"] {
            assert!(categories.contains(&c), "{c} missing from {categories:?}");
        }
        assert!(summary["frames"]
            .as_array()
            .expect("list")
            .iter()
            .any(|f| f.as_str().is_some_and(|f| f.ends_with("timeline.rs"))));
        assert_eq!(summary["ndscope"]["dropped_events"], 0);
    }
    if let Some(summary) = python_check(&late_path) {
        // The live workspace block, with the array in it, and the array with its own buffer.
        assert!(summary["segments"].as_u64() >= Some(2), "{summary}");
        assert!(summary["live_blocks"].as_u64() >= Some(2), "{summary}");
    }
    for p in [&path, &late_path] {
        let _ = std::fs::remove_file(p);
    }
    drop((live, own));
    drop(scope);
    kept.close()
}

#[test]
fn snapshot_integers_fit_64_bits_and_unknown_is_a_category() -> Result<()> {
    let _turn = turn();
    start_recording(RecordOptions::default())?;
    let m = Manager::new_base(); // unnamed: its arrays are "unknown"
    m.zeros([4], DType::F32)?;
    m.close()?;
    let rec = stop_recording().expect("on");
    let mut bytes = Vec::new();
    rec.write_memory_snapshot_to(&mut bytes)?;
    // Protocol 4, ends with STOP, and no integer wider than 8 bytes (LONG1 n ≤ 8).
    assert_eq!(&bytes[..2], &[0x80, 4]);
    assert_eq!(bytes.last(), Some(&b'.'));
    let path = temp("unknown.pickle");
    std::fs::write(&path, &bytes).expect("written");
    if let Some(summary) = python_check(&path) {
        assert_eq!(summary["categories"], serde_json::json!(["unknown"]));
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

// ----------------------------------------------------------------------------------------------
// NDSCOPE_RECORD
// ----------------------------------------------------------------------------------------------

#[test]
#[ignore = "the workload of recording_from_the_environment_is_written_at_exit, run in a child process"]
fn child_workload_for_env_recording() {
    let m = Manager::new_base().with_name("from env");
    let ws = m.workspace("steps", WorkspaceConfig::default()).unwrap();
    for _ in 0..3 {
        ws.cycle(|s| s.ones([64], DType::F32).map(|_| ())).unwrap();
    }
    m.close().unwrap();
}

#[test]
fn recording_from_the_environment_is_written_at_exit() {
    let _turn = turn();
    let base = temp("env-run");
    let (json, pickle) = (
        PathBuf::from(format!("{}.json", base.display())),
        PathBuf::from(format!("{}.pickle", base.display())),
    );
    let status = Command::new(std::env::current_exe().expect("the test binary"))
        .args([
            "--exact",
            "child_workload_for_env_recording",
            "--ignored",
            "--test-threads=1",
        ])
        .env("NDSCOPE_RECORD", &base)
        .output()
        .expect("the child ran");
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stdout)
    );
    let trace: Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the trace was written at exit"))
            .expect("valid JSON");
    let names: HashMap<&str, usize> = events(&trace)
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["name"].as_str())
        .fold(HashMap::new(), |mut m, n| {
            *m.entry(n).or_default() += 1;
            m
        });
    assert!(
        names.contains_key("from env") && names.contains_key("steps#3"),
        "{names:?}"
    );
    assert!(std::fs::metadata(&pickle).is_ok_and(|m| m.len() > 0));
    if let Some(summary) = python_check(&pickle) {
        assert!(summary["actions"]["alloc"].as_u64() >= Some(3));
    }
    for p in [&json, &pickle] {
        let _ = std::fs::remove_file(p);
    }
}
