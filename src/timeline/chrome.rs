//! The Chrome trace (JSON Trace Event Format), which Perfetto UI and `chrome://tracing` open.
//!
//! - Counter tracks (`ph: "C"`): bytes in use per device, and per top-level manager (the
//!   children of the system manager: arrays with their own buffer by their owner's, workspace
//!   blocks by their workspace owner's).
//! - Slices (`ph: "X"`) per thread: every manager from open to close on the thread that opened
//!   it, so workspace cycles (`batch#57`) nest in their trainer, in their model. A manager whose
//!   lifetime overlaps a sibling's without nesting (closed on another thread, or out of order)
//!   goes to an async track (`ph: "b"`/`"e"`) instead, so the thread's slices always nest.
//! - Instants (`ph: "i"`, on their thread): spills, cap refusals, out-of-memory refusals,
//!   workspace blocks allocated and freed.
//! - Process and thread names (`ph: "M"`).
//!
//! Times are microseconds from the start of the recording (`ts`, `dur`).

use std::collections::{BTreeMap, HashMap};
use std::io::{self, Write};

use serde::Serialize;

use super::event::Data;
use super::recording::Recording;
use super::replay::{OpenManager, Replay};
use crate::error::Bytes;
use crate::observe::NO_MANAGER;
use crate::Device;

/// One event of the trace, as the Trace Event Format writes it (not a recorded `MemoryEvent`).
#[derive(Serialize)]
struct TraceEvent<'a, A: Serialize> {
    name: &'a str,
    ph: &'static str,
    ts: f64,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    dur: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cat: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    s: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<u64>,
    args: A,
}

impl<'a, A: Serialize> TraceEvent<'a, A> {
    fn new(name: &'a str, ph: &'static str, ns: u64, pid: u32, args: A) -> Self {
        TraceEvent {
            name,
            ph,
            ts: us(ns),
            pid,
            tid: None,
            dur: None,
            cat: None,
            s: None,
            id: None,
            args,
        }
    }
}

/// Nanoseconds as (fractional) microseconds.
fn us(ns: u64) -> f64 {
    ns as f64 / 1000.0
}

#[derive(Serialize)]
struct Counter {
    bytes: i64,
}

#[derive(Serialize)]
struct Name<'a> {
    name: &'a str,
}

#[derive(Serialize, Default)]
struct SliceArgs {
    manager: String,
    device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    workspace: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cycle: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    cycle_bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    spilled_bytes: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    spilled_count: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    block_capacity: Option<usize>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    open_at_end: bool,
}

#[derive(Serialize)]
struct InstantArgs<'a> {
    bytes: usize,
    device: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    manager: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    workspace: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    op: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
}

#[derive(Serialize)]
struct Meta<'a> {
    producer: &'a str,
    events: usize,
    dropped_events: u64,
    max_entries: usize,
}

/// A manager's lifetime, drawn as a slice.
struct Slice {
    start: u64,
    end: u64,
    thread: u32,
    id: u64,
    name: String,
    cycle: bool,
    args: SliceArgs,
}

/// A figure of a cycle that ended, kept until its scope's manager closes.
struct CycleFigures {
    bytes: usize,
    spilled_bytes: usize,
    spilled_count: u64,
    capacity: usize,
}

/// Writes one JSON object per call, comma-separated.
struct Out<'w> {
    w: &'w mut dyn Write,
    first: bool,
}

impl Out<'_> {
    fn emit<T: Serialize>(&mut self, event: &T) -> io::Result<()> {
        if self.first {
            self.first = false;
        } else {
            self.w.write_all(b",\n")?;
        }
        serde_json::to_writer(&mut *self.w, event).map_err(io::Error::from)
    }
}

fn slice_of(open: OpenManager, end: u64, figures: Option<CycleFigures>, at_end: bool) -> Slice {
    let shared = &open.shared;
    let name = match &*shared.name.lock() {
        Some(name) => name.to_string(),
        None => format!("m{}", shared.id),
    };
    let mut args = SliceArgs {
        manager: shared.describe(),
        device: shared.device.to_string(),
        open_at_end: at_end,
        ..SliceArgs::default()
    };
    let cycle = open.cycle.is_some();
    if let Some((workspace, n)) = open.cycle {
        args.workspace = Some(workspace.to_string());
        args.cycle = Some(n);
    }
    if let Some(f) = figures {
        args.cycle_bytes = Some(f.bytes);
        args.spilled_bytes = Some(f.spilled_bytes);
        args.spilled_count = Some(f.spilled_count);
        args.block_capacity = Some(f.capacity);
    }
    Slice {
        start: open.opened_ns,
        end: end.max(open.opened_ns),
        thread: open.thread,
        id: shared.id,
        name,
        cycle,
        args,
    }
}

pub(super) fn write(rec: &Recording, w: &mut dyn Write) -> io::Result<()> {
    let pid = rec.pid;
    let producer = concat!("ndscope ", env!("CARGO_PKG_VERSION"));
    write!(w, "{{\"displayTimeUnit\":\"ms\",\"otherData\":")?;
    serde_json::to_writer(
        &mut *w,
        &Meta {
            producer,
            events: rec.events.len(),
            dropped_events: rec.dropped,
            max_entries: rec.max_entries,
        },
    )
    .map_err(io::Error::from)?;
    w.write_all(b",\"traceEvents\":[\n")?;
    let mut out = Out { w, first: true };

    let process = format!("ndscope (pid {pid})");
    out.emit(&TraceEvent::new(
        "process_name",
        "M",
        0,
        pid,
        Name { name: &process },
    ))?;

    let mut replay = rec.base.with_totals();
    // Counter track names, made once.
    let mut device_tracks: BTreeMap<Device, String> = BTreeMap::new();
    let mut top_tracks: HashMap<u64, String> = HashMap::new();
    let device_track = |tracks: &mut BTreeMap<Device, String>, d: Device| -> String {
        tracks
            .entry(d)
            .or_insert_with(|| format!("bytes in use on {d}"))
            .clone()
    };
    let top_track = |tracks: &mut HashMap<u64, String>, replay: &Replay, top: u64| -> String {
        tracks
            .entry(top)
            .or_insert_with(|| format!("bytes in use by {}", replay.top_name(top)))
            .clone()
    };

    // The starting values.
    let starting = replay.totals.clone().unwrap_or_default();
    for (device, bytes) in starting.device {
        let name = device_track(&mut device_tracks, device);
        out.emit(&TraceEvent::new(&name, "C", 0, pid, Counter { bytes }))?;
    }
    for (top, bytes) in starting.top {
        let name = top_track(&mut top_tracks, &replay, top);
        out.emit(&TraceEvent::new(&name, "C", 0, pid, Counter { bytes }))?;
    }

    let mut slices: Vec<Slice> = Vec::new();
    let mut figures: HashMap<u64, CycleFigures> = HashMap::new();
    let mut threads: Vec<u32> = vec![rec.thread];
    for e in &rec.events {
        threads.push(e.thread);
        let mut closed = None;
        let changes = replay.apply_with(e, &mut closed);
        let totals = replay.totals.as_ref();
        if let Some(device) = changes.device {
            let bytes = totals
                .and_then(|t| t.device.get(&device))
                .copied()
                .unwrap_or(0);
            let name = device_track(&mut device_tracks, device);
            out.emit(&TraceEvent::new(
                &name,
                "C",
                e.time_ns,
                pid,
                Counter { bytes },
            ))?;
        }
        for top in changes.tops.into_iter().flatten() {
            let bytes = totals.and_then(|t| t.top.get(&top)).copied().unwrap_or(0);
            let name = top_track(&mut top_tracks, &replay, top);
            out.emit(&TraceEvent::new(
                &name,
                "C",
                e.time_ns,
                pid,
                Counter { bytes },
            ))?;
        }
        if let Some(open) = closed {
            let f = figures.remove(&open.shared.id);
            if open.shared.parent.is_some() {
                slices.push(slice_of(open, e.time_ns, f, false));
            }
        }
        let manager_name = || replay.managers.get(&e.manager).map(|m| m.shared.describe());
        match &e.data {
            Data::CycleClose {
                spilled_bytes,
                spilled_count,
                capacity,
                ..
            } => {
                figures.insert(
                    e.manager,
                    CycleFigures {
                        bytes: e.bytes,
                        spilled_bytes: *spilled_bytes,
                        spilled_count: *spilled_count,
                        capacity: *capacity,
                    },
                );
            }
            Data::Spill { workspace, site } => {
                let name = format!("spill {} ({workspace})", Bytes(e.bytes));
                let args = InstantArgs {
                    bytes: e.bytes,
                    device: e.device().to_string(),
                    manager: manager_name(),
                    workspace: Some(workspace),
                    at: Some(site.to_string()),
                    op: None,
                    detail: None,
                };
                emit_instant(&mut out, &name, "spill", e.time_ns, pid, e.thread, args)?;
            }
            Data::Capped { site, op, what } => {
                let manager = manager_name();
                let name = format!(
                    "capped: {}",
                    manager.as_deref().unwrap_or("a closed manager")
                );
                let args = InstantArgs {
                    bytes: e.bytes,
                    device: e.device().to_string(),
                    manager,
                    workspace: None,
                    at: Some(site.to_string()),
                    op: Some(op),
                    detail: Some(what.to_string()),
                };
                emit_instant(&mut out, &name, "capped", e.time_ns, pid, e.thread, args)?;
            }
            Data::OutOfMemory {
                site,
                op,
                in_use,
                limit,
            } => {
                let name = format!("out of memory: {} on {}", Bytes(e.bytes), e.device());
                let detail = format!(
                    "{} in use, limit {}",
                    Bytes(*in_use),
                    limit.map_or_else(|| "none".to_string(), |l| Bytes(l).to_string())
                );
                let args = InstantArgs {
                    bytes: e.bytes,
                    device: e.device().to_string(),
                    manager: None,
                    workspace: None,
                    at: Some(site.to_string()),
                    op: Some(op),
                    detail: Some(detail),
                };
                emit_instant(&mut out, &name, "oom", e.time_ns, pid, e.thread, args)?;
            }
            Data::BlockAlloc {
                workspace, address, ..
            } => {
                let name = format!("workspace '{workspace}' block: {}", Bytes(e.bytes));
                let args = InstantArgs {
                    bytes: e.bytes,
                    device: e.device().to_string(),
                    manager: manager_name(),
                    workspace: Some(workspace),
                    at: None,
                    op: None,
                    detail: Some(format!("address {address:#x}")),
                };
                emit_instant(&mut out, &name, "block", e.time_ns, pid, e.thread, args)?;
            }
            Data::BlockFree { .. } => {
                let name = format!("block freed: {}", Bytes(e.bytes));
                let args = InstantArgs {
                    bytes: e.bytes,
                    device: e.device().to_string(),
                    manager: None,
                    workspace: None,
                    at: None,
                    op: None,
                    detail: None,
                };
                emit_instant(&mut out, &name, "block", e.time_ns, pid, e.thread, args)?;
            }
            _ => {}
        }
    }

    // Managers still open at the end, and the final counter values.
    let end = rec
        .duration_ns
        .max(rec.events.last().map_or(0, |e| e.time_ns));
    let still_open: Vec<OpenManager> = replay.managers.values().cloned().collect();
    for open in still_open {
        if open.shared.parent.is_some() {
            let f = figures.remove(&open.shared.id);
            slices.push(slice_of(open, end, f, true));
        }
    }
    let totals = replay.totals.clone().unwrap_or_default();
    for (device, bytes) in &totals.device {
        let name = device_track(&mut device_tracks, *device);
        out.emit(&TraceEvent::new(
            &name,
            "C",
            end,
            pid,
            Counter { bytes: *bytes },
        ))?;
    }
    for (top, bytes) in &totals.top {
        if *top == NO_MANAGER && *bytes == 0 && !top_tracks.contains_key(top) {
            continue;
        }
        let name = top_track(&mut top_tracks, &replay, *top);
        out.emit(&TraceEvent::new(
            &name,
            "C",
            end,
            pid,
            Counter { bytes: *bytes },
        ))?;
    }

    write_slices(&mut out, slices, pid)?;

    threads.sort_unstable();
    threads.dedup();
    for t in threads {
        let name = rec
            .threads
            .get(t as usize)
            .filter(|n| !n.is_empty())
            .cloned()
            .unwrap_or_else(|| format!("thread {t}"));
        let mut meta = TraceEvent::new("thread_name", "M", 0, pid, Name { name: &name });
        meta.tid = Some(t);
        out.emit(&meta)?;
    }
    out.w.write_all(b"\n]}\n")
}

fn emit_instant(
    out: &mut Out<'_>,
    name: &str,
    cat: &'static str,
    ns: u64,
    pid: u32,
    thread: u32,
    args: InstantArgs<'_>,
) -> io::Result<()> {
    let mut e = TraceEvent::new(name, "i", ns, pid, args);
    e.tid = Some(thread);
    e.s = Some("t");
    e.cat = Some(cat);
    out.emit(&e)
}

/// Writes the slices of each thread so that they nest: sorted by start (longer first), each
/// slice either lies inside the one below it on the stack or, if it overlaps without nesting,
/// goes to an async track.
fn write_slices(out: &mut Out<'_>, mut slices: Vec<Slice>, pid: u32) -> io::Result<()> {
    slices.sort_by(|a, b| {
        (a.thread, a.start, std::cmp::Reverse(a.end), a.id).cmp(&(
            b.thread,
            b.start,
            std::cmp::Reverse(b.end),
            b.id,
        ))
    });
    let mut stack: Vec<(u32, u64)> = Vec::new();
    for s in slices {
        while let Some(&(thread, end)) = stack.last() {
            if thread != s.thread || end <= s.start {
                stack.pop();
            } else {
                break;
            }
        }
        let nests = stack.last().is_none_or(|&(_, end)| s.end <= end);
        let cat = if s.cycle { "cycle" } else { "scope" };
        if nests {
            stack.push((s.thread, s.end));
            let mut e = TraceEvent::new(&s.name, "X", s.start, pid, &s.args);
            e.tid = Some(s.thread);
            e.dur = Some(us(s.end - s.start));
            e.cat = Some(cat);
            out.emit(&e)?;
        } else {
            for (ph, ns) in [("b", s.start), ("e", s.end)] {
                let mut e = TraceEvent::new(&s.name, ph, ns, pid, &s.args);
                e.tid = Some(s.thread);
                e.cat = Some("scope (overlapping)");
                e.id = Some(s.id);
                out.emit(&e)?;
            }
        }
    }
    Ok(())
}
