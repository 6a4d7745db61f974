//! Seeing memory over time: a bounded recorder of memory events, exported as a Chrome trace
//! (Perfetto UI, `chrome://tracing`) and as a PyTorch memory snapshot (PyTorch's `memory_viz`).
//!
//! While recording is on, every array allocation, free, move between managers and copy out of a
//! workspace, every manager opened and closed, every workspace cycle, block allocation and free,
//! spill, cap refusal and out-of-memory refusal is recorded with its time, thread, device,
//! manager, bytes and creation site, into a buffer of at most `max_entries` events (like
//! PyTorch's `_record_memory_history(max_entries=…)`): past that the oldest are dropped, and
//! counted. Off, each hook costs one relaxed load and a branch.
//!
//! ```
//! use ndscope::{DType, Manager, RecordOptions, WorkspaceConfig};
//! ndscope::start_recording(RecordOptions::default())?;
//! let trainer = Manager::new_base().with_name("trainer");
//! let ws = trainer.workspace("batch", WorkspaceConfig::default())?;
//! for _ in 0..3 {
//!     ws.cycle(|batch| {
//!         let x = batch.ones([64, 64], DType::F32)?;
//!         x.add(&x)?;
//!         Ok(())
//!     })?;
//! }
//! trainer.close()?;
//! let recording = ndscope::stop_recording().expect("it was recording");
//! assert!(recording.events().len() > 10);
//! let dir = std::env::temp_dir();
//! recording.write_chrome_trace(dir.join("ndscope-doc.trace.json"))?;   // Perfetto UI
//! recording.write_memory_snapshot(dir.join("ndscope-doc.pickle"))?;    // PyTorch's memory_viz
//! # Ok::<(), ndscope::Error>(())
//! ```
//!
//! Locks: hooks run under the arena lock (or none) and take the recorder's own lock; nothing
//! takes the arena lock while holding the recorder's.

mod chrome;
mod event;
mod pickle;
mod recording;
mod replay;
mod snapshot;

use std::cell::Cell;
use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use crate::arena::{ArrayShared, ManagerShared};
use crate::error::Ctx;
use crate::locks::{self, Held, Rank};
use crate::observe::{self, Event, Handle, NO_MANAGER};
use crate::state;
use crate::{Device, Error, Result};

use event::{device_code, Data, Relocation};
pub use event::{EventKind, MemoryEvent};
pub use recording::Recording;
use replay::Replay;

/// The recording in progress.
static RECORDER: Mutex<Option<Session>> = Mutex::new(None);

/// Locks the recorder (after the arena and data locks in the lock order: see `crate::locks`).
/// The order mark is returned first, so it is dropped after the guard.
fn lock_recorder() -> (Held, parking_lot::MutexGuard<'static, Option<Session>>) {
    let held = locks::acquire(Rank::Recorder, 0);
    (held, RECORDER.lock())
}

/// Whether a recording is on: the core's memory events are wanted (see [`crate::observe`]).
#[inline(always)]
fn on() -> bool {
    observe::on()
}

/// How to record, for [`start_recording`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordOptions {
    max_entries: usize,
}

impl Default for RecordOptions {
    /// At most 1,000,000 events (about 100 MB).
    fn default() -> Self {
        RecordOptions {
            max_entries: 1_000_000,
        }
    }
}

impl RecordOptions {
    /// Keeps at most `n` events; older ones are dropped (and counted in
    /// [`Recording::dropped`]). Each event takes about 100 bytes. Must be at least 1.
    ///
    /// ```
    /// let options = ndscope::RecordOptions::default().with_max_entries(10_000);
    /// assert_eq!(options.max_entries(), 10_000);
    /// ```
    pub fn with_max_entries(mut self, n: usize) -> Self {
        self.max_entries = n;
        self
    }

    /// The cap on events kept.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }
}

/// A recording while it runs: the recorder's state (the finished [`Recording`] is what it
/// hands out).
struct Session {
    started: Instant,
    started_wall: SystemTime,
    max_entries: usize,
    events: VecDeque<MemoryEvent>,
    dropped: u64,
    /// The state before the oldest event kept: what was live when recording started, with the
    /// dropped events applied.
    base: Replay,
    /// The thread that started it (baseline managers are drawn on its track).
    thread: u32,
}

impl Session {
    fn push(&mut self, event: MemoryEvent) {
        if self.events.len() >= self.max_entries {
            if let Some(old) = self.events.pop_front() {
                self.base.fold(old);
            }
            self.dropped += 1;
            if self.dropped == 1 {
                tracing::warn!(
                    target: "ndscope::timeline",
                    max_entries = self.max_entries,
                    "memory recording is full ({} events): the oldest events are being dropped",
                    self.max_entries
                );
            }
        }
        self.events.push_back(event);
    }

    fn recording(&self) -> Recording {
        Recording {
            events: self.events.iter().cloned().collect(),
            base: self.base.clone(),
            dropped: self.dropped,
            max_entries: self.max_entries,
            duration_ns: self.started.elapsed().as_nanos() as u64,
            started_wall: self.started_wall,
            thread: self.thread,
            threads: THREADS.lock().clone(),
            pid: std::process::id(),
        }
    }
}

/// Names of the threads that recorded events, by index.
static THREADS: Mutex<Vec<String>> = Mutex::new(Vec::new());
static NEXT_THREAD: AtomicU32 = AtomicU32::new(0);

thread_local! {
    static THREAD: Cell<u32> = const { Cell::new(u32::MAX) };
}

/// This thread's index in [`THREADS`], registering its name on first use.
fn thread_index() -> u32 {
    THREAD
        .try_with(|t| {
            let id = t.get();
            if id != u32::MAX {
                return id;
            }
            let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
            let current = std::thread::current();
            let name = match current.name() {
                Some(name) => name.to_string(),
                None => format!("thread {id}"),
            };
            let mut names = THREADS.lock();
            if names.len() <= id as usize {
                names.resize(id as usize + 1, String::new());
            }
            names[id as usize] = name;
            t.set(id);
            id
        })
        .unwrap_or(u32::MAX - 1)
}

/// Starts recording into `recorder` (locked and empty) from the starting state `base`.
fn install(recorder: &mut Option<Session>, options: &RecordOptions, base: Replay, thread: u32) {
    *recorder = Some(Session {
        started: Instant::now(),
        started_wall: SystemTime::now(),
        max_entries: options.max_entries,
        // Reserved whole (up to 4M events), so filling it never copies; the pages are only
        // touched as events arrive.
        events: VecDeque::with_capacity(options.max_entries.min(1 << 22)),
        dropped: 0,
        base,
        thread,
    });
    observe::set_on(true);
}

/// Records one event, timed under the recorder's lock so the buffer stays in time order.
fn record(device: Device, manager: u64, bytes: usize, data: Data) {
    let thread = thread_index();
    let (_held, mut guard) = lock_recorder();
    let Some(recorder) = guard.as_mut() else {
        return;
    };
    let time_ns = recorder.started.elapsed().as_nanos() as u64;
    recorder.push(MemoryEvent {
        time_ns,
        thread,
        device: device_code(device),
        manager,
        bytes,
        data,
    });
}

// ----------------------------------------------------------------------------------------------
// The observer: the core's memory events become recorded events.
// ----------------------------------------------------------------------------------------------

impl observe::Observer for observe::Recorder {
    fn arena_created(&self, system: &Handle) {
        if let Ok(system) = Arc::clone(system).downcast::<ManagerShared>() {
            start_from_env(&system);
        }
    }

    /// Called while `on()`; `record` checks again under the recorder's lock (a recording may
    /// stop in between).
    fn event(&self, event: Event<'_>) {
        let (device, manager, bytes, data) = match event {
            Event::ArrayAllocated {
                array,
                device,
                bytes,
                manager,
                address,
                span,
            } => {
                let Ok(array) = array.downcast::<ArrayShared>() else {
                    return;
                };
                let data = Data::Alloc {
                    array,
                    address,
                    span,
                };
                (device, manager, bytes, data)
            }
            Event::ArrayFreed {
                array,
                site,
                device,
                bytes,
                manager,
                span,
            } => (device, manager, bytes, Data::Free { array, site, span }),
            Event::ArrayAttached {
                array,
                site,
                device,
                bytes,
                manager,
            } => (device, manager, bytes, Data::Attach { array, site }),
            Event::ArrayRelocated {
                array,
                site,
                device,
                bytes,
                manager,
                address,
                from,
                to,
            } => {
                let data = Data::Relocate(Box::new(Relocation {
                    array,
                    site,
                    address,
                    from,
                    to,
                }));
                (device, manager, bytes, data)
            }
            Event::ManagerOpened {
                manager,
                id,
                device,
            } => {
                let Ok(manager) = manager.downcast::<ManagerShared>() else {
                    return;
                };
                (device, id, 0, Data::ManagerOpen { manager })
            }
            Event::ManagerClosed { id, device } => (device, id, 0, Data::ManagerClose),
            Event::CycleOpened {
                workspace,
                cycle,
                scope,
                device,
            } => {
                let data = Data::CycleOpen {
                    workspace: Arc::clone(workspace),
                    cycle,
                };
                (device, scope, 0, data)
            }
            Event::CycleClosed {
                workspace,
                end,
                replayed,
            } => {
                let data = Data::CycleClose {
                    workspace: Arc::clone(workspace),
                    cycle: end.cycle,
                    spilled_bytes: end.spilled_bytes,
                    spilled_count: end.spilled_count,
                    capacity: end.capacity,
                    replayed: replayed.map(Arc::from),
                };
                (end.device, end.scope, end.bytes, data)
            }
            Event::BlockAllocated {
                workspace,
                owner,
                block,
                address,
                device,
                capacity,
            } => {
                let data = Data::BlockAlloc {
                    workspace: Arc::clone(workspace),
                    block,
                    address,
                };
                (device, owner, capacity, data)
            }
            Event::BlockFreed {
                block,
                device,
                capacity,
            } => (device, NO_MANAGER, capacity, Data::BlockFree { block }),
            Event::Spilled {
                workspace,
                scope,
                device,
                bytes,
                site,
            } => {
                let data = Data::Spill {
                    workspace: Arc::clone(workspace),
                    site,
                };
                (device, scope, bytes, data)
            }
            Event::Capped {
                site,
                op,
                what,
                device,
                manager,
            } => {
                let data = Data::Capped {
                    site,
                    op,
                    what: Arc::from(what),
                };
                (device, manager, 0, data)
            }
            Event::OutOfMemory {
                site,
                op,
                device,
                requested,
                in_use,
                limit,
            } => {
                let data = Data::OutOfMemory {
                    site,
                    op,
                    in_use,
                    limit,
                };
                (device, NO_MANAGER, requested, data)
            }
        };
        record(device, manager, bytes, data);
    }
}

// ----------------------------------------------------------------------------------------------
// Starting and stopping
// ----------------------------------------------------------------------------------------------

/// Starts recording memory events (see [Seeing memory over time](crate#seeing-memory-over-time)).
/// What is live now (arrays, managers, workspace blocks) is taken as the starting state, so the
/// exports show it.
///
/// Errors: `InvalidArgument` if `max_entries` is 0, or if a recording is already running
/// (started by an earlier call or by `NDSCOPE_RECORD`); nothing changes then.
///
/// ```
/// ndscope::start_recording(ndscope::RecordOptions::default().with_max_entries(1000))?;
/// assert!(ndscope::is_recording());
/// let recording = ndscope::stop_recording().expect("it was recording");
/// assert_eq!(recording.dropped(), 0);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn start_recording(options: RecordOptions) -> Result<()> {
    let ctx = Ctx::new("start_recording");
    if options.max_entries == 0 {
        return Err(ctx.invalid("max_entries must be at least 1"));
    }
    let thread = thread_index();
    // The arena lock first (the order every hook keeps), so no event is missed or counted twice
    // between the starting state and the first event.
    let state = state::lock();
    let (_held, mut guard) = lock_recorder();
    if guard.is_some() {
        return Err(ctx.invalid(
            "a memory recording is already running (started by start_recording or \
             NDSCOPE_RECORD); call stop_recording first",
        ));
    }
    install(
        &mut guard,
        &options,
        Replay::baseline(&state, thread),
        thread,
    );
    drop(guard);
    drop(state);
    tracing::debug!(target: "ndscope::timeline", max_entries = options.max_entries, "memory recording started");
    Ok(())
}

/// Stops recording and returns what was recorded; `None` if no recording was running.
pub fn stop_recording() -> Option<Recording> {
    let (_held, mut guard) = lock_recorder();
    observe::set_on(false);
    let recorder = guard.take()?;
    drop(guard);
    let recording = recorder.recording();
    tracing::debug!(target: "ndscope::timeline", events = recording.events.len(), dropped = recording.dropped, "memory recording stopped");
    Some(recording)
}

/// A copy of what has been recorded so far, while the recording goes on; `None` if no recording
/// is running. Like PyTorch's `torch.cuda.memory._snapshot()`.
pub fn recording_snapshot() -> Option<Recording> {
    let (_held, guard) = lock_recorder();
    guard.as_ref().map(Session::recording)
}

/// Whether a recording is running.
pub fn is_recording() -> bool {
    on()
}

/// The files `NDSCOPE_RECORD` asked for, opened when the recording started and written at
/// exit: (Chrome trace, PyTorch snapshot), each with its path.
struct ExitFiles {
    path: PathBuf,
    trace: Option<(PathBuf, File)>,
    snapshot: Option<(PathBuf, File)>,
}

static EXIT_FILES: Mutex<Option<ExitFiles>> = Mutex::new(None);

/// Says on stderr and in the log (once: this runs once per process) that `NDSCOPE_RECORD`
/// cannot be honoured.
fn env_problem(message: &str) {
    eprintln!("ndscope: {message}");
    tracing::error!(target: "ndscope::timeline", "{message}");
}

/// Opens (creates or truncates) a file `NDSCOPE_RECORD` will write at exit.
fn open_output(path: Option<PathBuf>) -> std::result::Result<Option<(PathBuf, File)>, String> {
    let Some(path) = path else {
        return Ok(None);
    };
    match File::create(&path) {
        Ok(file) => Ok(Some((path, file))),
        Err(e) => Err(format!(
            "NDSCOPE_RECORD: cannot write {}: {e}; no memory recording will be made",
            path.display()
        )),
    }
}

/// Starts a recording if `NDSCOPE_RECORD=path` is set (called once, when the arena is created:
/// nothing is live yet but the system manager). The files are written when the process exits:
/// `path` as a Chrome trace if it ends in `.json`, as a PyTorch snapshot if it ends in `.pickle`
/// or `.pkl`, else both, at `path.json` and `path.pickle`. `NDSCOPE_RECORD_MAX_ENTRIES` sets the
/// cap on events.
fn start_from_env(system: &Arc<ManagerShared>) {
    let Some(path) = std::env::var_os("NDSCOPE_RECORD").filter(|p| !p.is_empty()) else {
        return;
    };
    let path = PathBuf::from(path);
    let mut options = RecordOptions::default();
    if let Some(raw) = std::env::var_os("NDSCOPE_RECORD_MAX_ENTRIES") {
        let text = raw.to_string_lossy();
        match text.trim().parse::<usize>() {
            Ok(n) if n > 0 => options = options.with_max_entries(n),
            _ => env_problem(&format!(
                "ignoring NDSCOPE_RECORD_MAX_ENTRIES={text:?}: expected a positive whole number \
                 of events; the recording keeps the default {}",
                options.max_entries()
            )),
        }
    }
    // The files are opened now, so a path that cannot be written is said at once, not
    // discovered at exit when nobody reads the log.
    let (trace, snapshot) = env_outputs(&path);
    let files = open_output(trace).and_then(|trace| {
        open_output(snapshot).map(|snapshot| ExitFiles {
            path: path.clone(),
            trace,
            snapshot,
        })
    });
    let files = match files {
        Ok(files) => files,
        Err(message) => {
            env_problem(&message);
            return;
        }
    };
    let thread = thread_index();
    let (_held, mut guard) = lock_recorder();
    if guard.is_some() {
        return;
    }
    install(
        &mut guard,
        &options,
        Replay::with_system(system, thread),
        thread,
    );
    drop(guard);
    *EXIT_FILES.lock() = Some(files);
    if !at_exit(write_at_exit) {
        tracing::warn!(
            target: "ndscope::timeline",
            "NDSCOPE_RECORD: this platform cannot run code at exit; call ndscope::stop_recording() and write the files yourself"
        );
    }
}

/// The paths `NDSCOPE_RECORD=path` writes: (Chrome trace, PyTorch snapshot).
pub(crate) fn env_outputs(path: &Path) -> (Option<PathBuf>, Option<PathBuf>) {
    let text = path.to_string_lossy();
    if text.ends_with(".json") {
        (Some(path.to_path_buf()), None)
    } else if text.ends_with(".pickle") || text.ends_with(".pkl") {
        (None, Some(path.to_path_buf()))
    } else {
        (
            Some(PathBuf::from(format!("{text}.json"))),
            Some(PathBuf::from(format!("{text}.pickle"))),
        )
    }
}

/// Runs `f` when the process exits normally (returning from `main` or `std::process::exit`),
/// through the C library's `atexit`. Returns `false` where that is not available.
fn at_exit(f: extern "C" fn()) -> bool {
    #[cfg(any(unix, windows))]
    {
        // SAFETY: `atexit` only stores the pointer of a plain `extern "C"` function with no
        // arguments, which lives as long as the program; it is called once, at exit.
        unsafe { libc::atexit(f) == 0 }
    }
    #[cfg(not(any(unix, windows)))]
    {
        let _ = f;
        false
    }
}

/// The exit hook `NDSCOPE_RECORD` installs: writes the recording to the asked path.
extern "C" fn write_at_exit() {
    let Some(files) = EXIT_FILES.lock().take() else {
        return;
    };
    let path = files.path;
    // Another thread may hold the recorder's lock as the process exits: wait a little, no more.
    let recording = match RECORDER.try_lock_for(Duration::from_secs(2)) {
        Some(mut guard) => {
            observe::set_on(false);
            guard.take().map(|r| r.recording())
        }
        None => None,
    };
    let Some(recording) = recording else {
        tracing::error!(target: "ndscope::timeline", path = %path.display(), "NDSCOPE_RECORD: the recording was stopped before exit, or is busy; nothing written");
        return;
    };
    let mut written = Vec::new();
    if let Some((trace, file)) = files.trace {
        match recording.write_chrome_trace_to(file) {
            Ok(()) => written.push(trace),
            Err(e) => env_problem(&format!("NDSCOPE_RECORD: {}: {e}", trace.display())),
        }
    }
    if let Some((snapshot, file)) = files.snapshot {
        match recording.write_memory_snapshot_to(file) {
            Ok(()) => written.push(snapshot),
            Err(e) => env_problem(&format!("NDSCOPE_RECORD: {}: {e}", snapshot.display())),
        }
    }
    for path in written {
        tracing::info!(target: "ndscope::timeline", path = %path.display(), events = recording.events.len(), dropped = recording.dropped, "NDSCOPE_RECORD: wrote the memory recording");
    }
}

// ----------------------------------------------------------------------------------------------
// Exporting a recording
// ----------------------------------------------------------------------------------------------

/// A recording's exports. Its data and readers are in `recording.rs`, below the two formats
/// (`chrome.rs`, `snapshot.rs`) that read it; its exports are here, above them.
impl Recording {
    /// Writes the recording as a Chrome trace (JSON), which Perfetto UI
    /// (<https://ui.perfetto.dev>, "Open trace file") and `chrome://tracing` ("Load") open:
    /// counter tracks of bytes in use per device and per top-level manager, workspace cycles and
    /// scopes as nested slices per thread, instants for spills, cap refusals, out-of-memory
    /// refusals and block allocations.
    ///
    /// Errors: `Io` if the file cannot be written.
    #[track_caller]
    pub fn write_chrome_trace(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("Recording::write_chrome_trace");
        write_file(&ctx, path.as_ref(), |w| chrome::write(self, w))
    }

    /// Writes the Chrome trace to `writer` (see [`write_chrome_trace`](Self::write_chrome_trace)).
    #[track_caller]
    pub fn write_chrome_trace_to(&self, writer: impl Write) -> Result<()> {
        let ctx = Ctx::new("Recording::write_chrome_trace_to");
        write_buffered(&ctx, Path::new("<writer>"), writer, |w| {
            chrome::write(self, w)
        })
    }

    /// Writes the recording as a PyTorch memory snapshot (the pickle that
    /// `torch.cuda.memory._snapshot()` returns), which PyTorch's memory viewer
    /// (<https://pytorch.org/memory_viz>, or `python -m torch.cuda._memory_viz trace_plot`)
    /// opens: segments (workspace blocks, and each array with its own buffer) with the blocks
    /// that tile them, and one trace per device of `alloc`, `free_requested`/`free_completed`,
    /// `segment_alloc`, `segment_free` and `oom` events whose frames are the creation sites, with
    /// categories from manager names. Device index 0 is the CPU, index `i + 1` is `cuda:i`.
    ///
    /// Errors: `Io` if the file cannot be written.
    #[track_caller]
    pub fn write_memory_snapshot(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("Recording::write_memory_snapshot");
        write_file(&ctx, path.as_ref(), |w| snapshot::write(self, w))
    }

    /// Writes the PyTorch memory snapshot to `writer` (see
    /// [`write_memory_snapshot`](Self::write_memory_snapshot)).
    #[track_caller]
    pub fn write_memory_snapshot_to(&self, writer: impl Write) -> Result<()> {
        let ctx = Ctx::new("Recording::write_memory_snapshot_to");
        write_buffered(&ctx, Path::new("<writer>"), writer, |w| {
            snapshot::write(self, w)
        })
    }
}

/// Writes through a 1 MiB buffer to `writer`; an I/O error names it `name`.
fn write_buffered<W: Write>(
    ctx: &Ctx,
    name: &Path,
    writer: W,
    body: impl FnOnce(&mut BufWriter<W>) -> std::io::Result<()>,
) -> Result<()> {
    let mut w = BufWriter::with_capacity(1 << 20, writer);
    body(&mut w)
        .and_then(|()| w.flush())
        .map_err(|e| io_error(ctx, name, e))
}

fn io_error(ctx: &Ctx, path: &Path, source: std::io::Error) -> Error {
    Error::Io {
        op: ctx.op,
        at: ctx.at,
        path: path.to_path_buf(),
        source,
    }
}

fn write_file(
    ctx: &Ctx,
    path: &Path,
    body: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let file = File::create(path).map_err(|e| io_error(ctx, path, e))?;
    write_buffered(ctx, path, file, |w| body(w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_paths_pick_the_format_from_the_extension() {
        let (t, s) = env_outputs(Path::new("run.json"));
        assert_eq!(
            (t.as_deref(), s.as_deref()),
            (Some(Path::new("run.json")), None)
        );
        let (t, s) = env_outputs(Path::new("run.pickle"));
        assert_eq!(
            (t.as_deref(), s.as_deref()),
            (None, Some(Path::new("run.pickle")))
        );
        let (t, s) = env_outputs(Path::new("out/run"));
        assert_eq!(t.as_deref(), Some(Path::new("out/run.json")));
        assert_eq!(s.as_deref(), Some(Path::new("out/run.pickle")));
    }
}
