//! Learned workspace cycles replayed as CUDA graphs ([`CycleGraph`]).
//!
//! The calls a cycle makes on its device's stream are of two kinds:
//! - **Stream calls** that a graph can hold: kernel launches, cuBLAS and cuBLASLt products,
//!   fills (device copies run as a kernel while a cycle records or replays, so that a changed
//!   address is a kernel argument). They reach the device through [`call`].
//! - **Boundaries**: everything else that touches the stream or waits for it (a host read, a
//!   host↔device transfer, a wait, a free). They announce themselves through [`boundary`].
//!
//! A workspace that asks for replay goes through three phases, one cycle each:
//! 1. *Learning*: its block is not sized yet; nothing is recorded.
//! 2. *Recording*: the first cycle with a learned block runs eagerly and keeps a copy of each
//!    stream call (kernel, launch shape, argument bytes; the products' arguments), cut into
//!    stretches at the boundaries. At the cycle's end each stretch is captured (stream capture
//!    on a stream of its own, where nothing runs) into one executable graph.
//! 3. *Replaying*: each stream call of the thread that opened the cycle is compared with the
//!    recorded one instead of being issued. A stretch's graph is launched when the stretch is
//!    complete: at the boundary that ends it, at the first call past it, or at the cycle's end.
//!    A kernel whose arguments differ only in their bytes (a learning rate, Adam's step count,
//!    another address) is the same launch with other arguments: they are written into the
//!    executable graph (`cuGraphExecKernelNodeSetParams`) before it is launched. Anything else
//!    that differs (another kernel or launch shape, a product's arguments, a call more or
//!    fewer, a boundary inside a stretch, another thread's op touching what the held calls use)
//!    is a divergence: the held-back calls of the stretch are issued as recorded, the
//!    diverging call is issued, the cycle finishes eagerly, and the graphs are dropped so that
//!    the next cycle records again. Nothing the user did not ask for ever runs, and every call
//!    that runs is the one an eager run makes, in the same order, so results are bit for bit
//!    those of an eager run.
//!
//! A graph's kernels read and write the workspace's block (and the model's arrays) at the
//! addresses recorded; the graphs allocate nothing. Dropping the [`CycleGraph`] (the workspace
//! closes) destroys them; an executable graph still running is freed by the driver when it
//! completes.

use std::cell::{Cell, RefCell};
use std::ffi::c_void;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use cudarc::driver::sys::{self, CUdeviceptr, CUfunction, CUstream};
use cudarc::driver::{result, CudaStream};
use parking_lot::Mutex;

use crate::backend::cuda::device::{self, Gpu};
use crate::backend::graph::{GraphReplayStats, GraphState};
use crate::error::Ctx;
use crate::memory::MAX_CUDA_DEVICES;
use crate::Result;

/// Words of a library call's arguments ([`LibCall`]).
pub(super) const LIB_WORDS: usize = 16;

/// A call into cuBLAS or cuBLASLt, kept as plain words so that it can be compared and issued
/// again on another stream by `issue`, the function of the file that made it.
#[derive(Clone, Copy)]
pub(super) struct LibCall {
    /// Which library function (compared, where `issue` is not).
    pub kind: u8,
    /// The arguments, encoded by the caller.
    pub words: [u64; LIB_WORDS],
    /// Issues the call with these words on a stream.
    pub issue: fn(&Ctx, &Gpu, &[u64; LIB_WORDS], CUstream) -> Result<()>,
}

/// A kernel launch as `launch_raw` makes it: the kernel, its launch shape, and one pointer per
/// parameter to that many bytes.
pub(super) struct KernelCall<'a> {
    pub f: CUfunction,
    pub name: &'static str,
    pub blocks: u32,
    pub threads: (u32, u32),
    pub params: &'a [*mut c_void],
    pub sizes: &'a [usize],
}

/// A stream call a graph can hold.
pub(super) enum Call<'a> {
    Kernel(KernelCall<'a>),
    Lib(LibCall),
    /// `bytes` bytes at `ptr` set to `value`.
    Fill {
        ptr: CUdeviceptr,
        value: u8,
        bytes: usize,
    },
}

/// A recorded stream call.
enum Recorded {
    Kernel {
        f: CUfunction,
        name: &'static str,
        blocks: u32,
        threads: (u32, u32),
        /// The arguments' bytes, back to back, and each one's (offset, size).
        bytes: Vec<u8>,
        spans: Vec<(usize, usize)>,
        /// Its node in the executable graph (null until captured).
        node: sys::CUgraphNode,
        /// Its arguments changed since the executable graph last got them.
        dirty: bool,
    },
    Lib(LibCall),
    Fill {
        ptr: CUdeviceptr,
        value: u8,
        bytes: usize,
    },
}

/// A recorded call and the op that made it.
struct Entry {
    op: &'static str,
    call: Recorded,
}

/// How a call compares with the recorded one.
enum Compare {
    Same,
    /// The same kernel and launch shape with other argument bytes (now in the recording).
    Updated,
    /// Something else: what differs.
    Differs(String),
}

/// Whether two argument slices of one length hold the same bytes. A kernel argument is almost
/// always a 4- or 8-byte word (an address, a count, a scalar), compared here as one; a slice
/// comparison would call `memcmp` for each argument of every replayed op.
#[inline]
fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    if let (Ok(x), Ok(y)) = (<&[u8; 8]>::try_from(a), <&[u8; 8]>::try_from(b)) {
        return x == y;
    }
    if let (Ok(x), Ok(y)) = (<&[u8; 4]>::try_from(a), <&[u8; 4]>::try_from(b)) {
        return x == y;
    }
    a == b
}

impl Entry {
    fn record(op: &'static str, call: &Call<'_>) -> Entry {
        let call = match call {
            Call::Kernel(k) => {
                let mut bytes = Vec::with_capacity(k.sizes.iter().sum());
                let mut spans = Vec::with_capacity(k.sizes.len());
                for (&p, &size) in k.params.iter().zip(k.sizes) {
                    spans.push((bytes.len(), size));
                    // SAFETY: `launch_raw`'s contract: each pointer holds its parameter's
                    // `size` bytes.
                    bytes.extend_from_slice(unsafe {
                        std::slice::from_raw_parts(p.cast::<u8>().cast_const(), size)
                    });
                }
                Recorded::Kernel {
                    f: k.f,
                    name: k.name,
                    blocks: k.blocks,
                    threads: k.threads,
                    bytes,
                    spans,
                    node: std::ptr::null_mut(),
                    dirty: false,
                }
            }
            Call::Lib(l) => Recorded::Lib(*l),
            &Call::Fill { ptr, value, bytes } => Recorded::Fill { ptr, value, bytes },
        };
        Entry { op, call }
    }

    /// Compares `call` (of op `op`) with this recorded one; an update of a kernel's argument
    /// bytes is applied to the recording.
    fn compare(&mut self, op: &'static str, call: &Call<'_>) -> Compare {
        // The same call site passes the same name: equal addresses spare the byte comparison.
        if !std::ptr::eq(op, self.op) && op != self.op {
            return Compare::Differs(format!(
                "`{op}` was called where `{}` was recorded",
                self.op
            ));
        }
        match (&mut self.call, call) {
            (
                Recorded::Kernel {
                    f,
                    name,
                    blocks,
                    threads,
                    bytes,
                    spans,
                    node,
                    dirty,
                },
                Call::Kernel(k),
            ) => {
                if *f != k.f || *blocks != k.blocks || *threads != k.threads {
                    return Compare::Differs(format!(
                        "kernel {} on {}×{}×{} threads where {name} on {blocks}×{}×{} was recorded",
                        k.name, k.blocks, k.threads.0, k.threads.1, threads.0, threads.1
                    ));
                }
                if spans.len() != k.sizes.len()
                    || spans.iter().zip(k.sizes).any(|(&(_, a), &b)| a != b)
                {
                    return Compare::Differs(format!("kernel {name} with other argument sizes"));
                }
                let mut same = true;
                for (&(at, size), &p) in spans.iter().zip(k.params) {
                    // SAFETY: as in `record`: the pointer holds `size` bytes.
                    let now =
                        unsafe { std::slice::from_raw_parts(p.cast::<u8>().cast_const(), size) };
                    let kept = &mut bytes[at..at + size];
                    if !same_bytes(kept, now) {
                        kept.copy_from_slice(now);
                        same = false;
                    }
                }
                if same {
                    Compare::Same
                } else if node.is_null() {
                    Compare::Differs(format!(
                        "kernel {name} with other arguments, and its graph node is unknown"
                    ))
                } else {
                    *dirty = true;
                    Compare::Updated
                }
            }
            (Recorded::Lib(kept), Call::Lib(now)) => {
                if kept.kind == now.kind && kept.words == now.words {
                    Compare::Same
                } else {
                    Compare::Differs("a matrix product with other arguments".into())
                }
            }
            (
                &mut Recorded::Fill { ptr, value, bytes },
                &Call::Fill {
                    ptr: p,
                    value: v,
                    bytes: b,
                },
            ) => {
                if (ptr, value, bytes) == (p, v, b) {
                    Compare::Same
                } else {
                    Compare::Differs("a fill of other bytes".into())
                }
            }
            (kept, _) => Compare::Differs(format!(
                "a {} where a {} was recorded",
                kind_of(call),
                match kept {
                    Recorded::Kernel { .. } => "kernel",
                    Recorded::Lib(_) => "matrix product",
                    Recorded::Fill { .. } => "fill",
                }
            )),
        }
    }

    /// Issues the recorded call on `stream`.
    fn issue(&self, ctx: &Ctx, gpu: &Gpu, stream: CUstream) -> Result<()> {
        gpu.bind(ctx)?;
        match &self.call {
            Recorded::Kernel {
                f,
                blocks,
                threads,
                bytes,
                spans,
                ..
            } => {
                let mut params = argument_pointers(bytes, spans);
                // SAFETY: the same kernel, launch shape and argument bytes as a launch that
                // `launch_raw`'s caller vouched for; the driver copies the arguments before
                // returning (it only reads through the pointers); the memory they address is
                // held as it was then (the caller's arrays and the workspace block).
                unsafe {
                    result::launch_kernel(
                        *f,
                        (*blocks, 1, 1),
                        (threads.0, threads.1, 1),
                        0,
                        stream,
                        &mut params,
                    )
                }
                .map_err(|e| gpu.failed(ctx, "cuLaunchKernel", e))
            }
            Recorded::Lib(l) => (l.issue)(ctx, gpu, &l.words, stream),
            &Recorded::Fill { ptr, value, bytes } => {
                issue_fill(ctx, gpu, ptr, value, bytes, stream)
            }
        }
    }
}

/// One pointer per recorded kernel argument, into `bytes` at each span's offset, as
/// `cuLaunchKernel` and a kernel node's parameters take them (the driver only reads them).
fn argument_pointers(bytes: &[u8], spans: &[(usize, usize)]) -> Vec<*mut c_void> {
    spans
        .iter()
        .map(|&(at, _)| bytes[at..].as_ptr().cast_mut().cast())
        .collect()
}

fn kind_of(call: &Call<'_>) -> &'static str {
    match call {
        Call::Kernel(_) => "kernel",
        Call::Lib(_) => "matrix product",
        Call::Fill { .. } => "fill",
    }
}

fn issue_fill(
    ctx: &Ctx,
    gpu: &Gpu,
    ptr: CUdeviceptr,
    value: u8,
    bytes: usize,
    stream: CUstream,
) -> Result<()> {
    // SAFETY: `ptr` holds `bytes` bytes of device memory of this context (`memset`'s contract).
    unsafe { result::memset_d8_async(ptr, value, bytes, stream) }
        .map_err(|e| gpu.failed(ctx, "cuMemsetD8Async", e))
}

/// Issues `call` on `stream` now.
fn issue(ctx: &Ctx, gpu: &Gpu, call: &Call<'_>, stream: CUstream) -> Result<()> {
    gpu.bind(ctx)?;
    match call {
        Call::Kernel(k) => {
            // `launch_raw` passes its own parameter pointers, which the driver only reads.
            let mut params = k.params.to_vec();
            // SAFETY: `launch_raw`'s contract, which its caller keeps.
            unsafe {
                result::launch_kernel(
                    k.f,
                    (k.blocks, 1, 1),
                    (k.threads.0, k.threads.1, 1),
                    0,
                    stream,
                    &mut params,
                )
            }
            .map_err(|e| gpu.failed(ctx, "cuLaunchKernel", e))
        }
        Call::Lib(l) => (l.issue)(ctx, gpu, &l.words, stream),
        &Call::Fill { ptr, value, bytes } => issue_fill(ctx, gpu, ptr, value, bytes, stream),
    }
}

/// One recorded stretch, captured: the calls and their executable graph.
struct Stretch {
    entries: Vec<Entry>,
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

/// What a replay-enabled workspace is doing in its open cycle.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// No cycle open, or the open one is not recorded or checked.
    Idle,
    /// Issuing calls and recording them.
    Recording,
    /// Checking calls against stretch `stretch`, `pos` of its calls matched and held back.
    Replaying { stretch: usize, pos: usize },
    /// The cycle diverged: the rest runs eagerly.
    Eager,
}

/// A workspace's recorder and replayer (behind [`CycleGraph`]).
struct Replay {
    ordinal: usize,
    mode: Mode,
    /// Recording: the stretches so far (the last one growing).
    tape: Vec<Vec<Entry>>,
    /// The captured stretches (empty: nothing captured).
    stretches: Vec<Stretch>,
    /// What a replayed cycle stands for, for the timeline.
    summary: Arc<str>,
    stats: GraphReplayStats,
    /// Captures that failed in a row (a recorded address freed before the cycle's end, by a
    /// workspace that grew in it): at [`MAX_FAILED_CAPTURES`] recording stops for good.
    failed_captures: u32,
    /// What the calls held back in the current stretch touch.
    held: Held,
}

/// Failed captures in a row after which a workspace stops recording.
const MAX_FAILED_CAPTURES: u32 = 3;

/// A workspace's graph replay on one CUDA device; `None` from [`CycleGraph::new`] where the
/// workspace is not on one.
pub(crate) struct CycleGraph(Arc<Shared>);

struct Shared {
    /// Set while the cycle replays (calls may be held back): other threads' calls on the device
    /// make it diverge first (see [`flush_others`]).
    replaying: AtomicBool,
    replay: Mutex<Replay>,
}

thread_local! {
    /// The cycle this thread records or replays, and its device (`usize::MAX`: none).
    static ACTIVE: RefCell<Option<Arc<Shared>>> = const { RefCell::new(None) };
    static ACTIVE_ON: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// One device range an op of this thread holds locked: `[start, end)`, written or only read,
/// and the id its [`Noted`] guard removes it by.
#[derive(Clone, Copy)]
struct Access {
    start: u64,
    end: u64,
    write: bool,
    id: u64,
}

/// The device ranges of the arrays this thread's op has locked now: what its calls touch
/// (besides the backend's own scratch, used by one op at a time). Empty: not known.
struct Footprint {
    accesses: Vec<Access>,
    /// The id of the last access noted.
    last: u64,
}

thread_local! {
    static FOOTPRINT: RefCell<Footprint> = const {
        RefCell::new(Footprint {
            accesses: Vec::new(),
            last: 0,
        })
    };
}

thread_local! {
    /// Device arrays this thread's op holds locked that were locked while no cycle replayed
    /// (see [`note_unreplayed`]): known, and touched by no held call.
    static UNREPLAYED: Cell<u32> = const { Cell::new(0) };
}

/// An array's device bytes locked by this thread's op (see [`note`] and [`note_unreplayed`]);
/// dropping it (with the lock) forgets them. Id 0: locked while no cycle replayed.
pub(crate) struct Noted(u64);

/// Notes that this thread's op holds a device array locked that it locked while no cycle
/// replayed on any device, until the returned guard drops. Its ranges are not kept: a cycle
/// that began replaying since holds no call that touches the array and conflicts with this op
/// (such a call's op would have needed the array's lock after this op took it, which only a
/// reader beside a reader gets). What matters is that this op's footprint is known: an op
/// that locked nothing may touch anything.
#[inline]
pub(crate) fn note_unreplayed() -> Noted {
    UNREPLAYED.with(|n| n.set(n.get().saturating_add(1)));
    Noted(0)
}

/// Notes that this thread's op has `len` bytes at `ptr` locked, for writing or reading, until
/// the returned guard drops. Another thread's replayed cycle holds calls back only as long as
/// no op touches what they touch (see [`flush_others`]).
pub(crate) fn note(ptr: CUdeviceptr, len: usize, write: bool) -> Noted {
    FOOTPRINT.with(|f| {
        let mut f = f.borrow_mut();
        let id = f.last.wrapping_add(1).max(1);
        f.last = id;
        f.accesses.push(Access {
            start: ptr,
            end: ptr.saturating_add(len as u64),
            write,
            id,
        });
        Noted(id)
    })
}

impl Drop for Noted {
    #[inline]
    fn drop(&mut self) {
        if self.0 == 0 {
            UNREPLAYED.with(|n| n.set(n.get().saturating_sub(1)));
        } else {
            forget(self.0);
        }
    }
}

/// Removes access `id` from this thread's footprint.
#[inline(never)]
fn forget(id: u64) {
    FOOTPRINT.with(|f| {
        let accesses = &mut f.borrow_mut().accesses;
        if let Some(at) = accesses.iter().rposition(|a| a.id == id) {
            accesses.swap_remove(at);
        }
    });
}

/// What the calls a replayed cycle holds back touch: the ranges of their ops' locked arrays, or
/// `unknown` where a call came without them.
#[derive(Default)]
struct Held {
    ranges: Vec<(u64, u64, bool)>,
    unknown: bool,
}

impl Held {
    fn clear(&mut self) {
        self.ranges.clear();
        self.unknown = false;
    }

    /// Adds what this thread's op touches now (the last call's ranges again are skipped: an
    /// op's calls come one after another).
    fn add_footprint(&mut self) {
        FOOTPRINT.with(|f| {
            let f = f.borrow();
            if f.accesses.is_empty() {
                self.unknown = true;
            }
            for a in &f.accesses {
                let range = (a.start, a.end, a.write);
                if !self.ranges.iter().rev().take(4).any(|&r| r == range) {
                    self.ranges.push(range);
                }
            }
        });
    }

    /// Whether this thread's op now may touch what the held calls touch: it writes what they
    /// read or write, or reads what they write (or either side is not known).
    fn conflicts_with_footprint(&self) -> bool {
        if self.unknown {
            return true;
        }
        FOOTPRINT.with(|f| {
            let f = &f.borrow().accesses;
            (f.is_empty() && UNREPLAYED.with(Cell::get) == 0)
                || f.iter().any(|a| {
                    self.ranges
                        .iter()
                        .any(|&(s, e, w)| s < a.end && a.start < e && (w || a.write))
                })
        })
    }
}

/// Cycles replaying on any device: while none does, an op's locked arrays are only counted
/// ([`note_unreplayed`]), not noted. (An op that locked an array before a cycle began replaying
/// cannot conflict with that cycle's held calls through it: they would need the same array,
/// whose lock the op holds.)
static ANY_REPLAYING: AtomicUsize = AtomicUsize::new(0);

/// Whether any cycle replays now (ops note their locked device arrays only then).
#[inline]
pub(crate) fn any_replaying() -> bool {
    ANY_REPLAYING.load(Ordering::Relaxed) != 0
}

/// Cycles replaying per device (their calls may be held back).
static REPLAYING: [AtomicUsize; MAX_CUDA_DEVICES] =
    [const { AtomicUsize::new(0) }; MAX_CUDA_DEVICES];
/// Those cycles, for other threads to make them diverge.
static REGISTRY: [Mutex<Vec<Arc<Shared>>>; MAX_CUDA_DEVICES] =
    [const { Mutex::new(Vec::new()) }; MAX_CUDA_DEVICES];
/// Per device, the stream captures are made on (nothing runs on it).
static CAPTURE_STREAMS: [Mutex<Option<Arc<CudaStream>>>; MAX_CUDA_DEVICES] =
    [const { Mutex::new(None) }; MAX_CUDA_DEVICES];

fn slot(ordinal: usize) -> usize {
    ordinal.min(MAX_CUDA_DEVICES - 1)
}

/// Whether stream calls on device `ordinal` must go through [`call`]: this thread records or
/// replays a cycle on it, or another thread's cycle replays there. One thread-local read and
/// one relaxed load otherwise.
#[inline]
pub(super) fn watching(ordinal: usize) -> bool {
    ACTIVE_ON.with(Cell::get) == ordinal || REPLAYING[slot(ordinal)].load(Ordering::Relaxed) != 0
}

/// Runs `f` with this thread's cycle on device `ordinal`, if any.
fn with_active<R>(ordinal: usize, f: impl FnOnce(Option<&Arc<Shared>>) -> R) -> R {
    if ACTIVE_ON.with(Cell::get) != ordinal {
        return f(None);
    }
    ACTIVE.with(|a| f(a.borrow().as_ref()))
}

/// Issues `call` on `gpu`'s stream, or (in a recorded or replayed cycle of this thread)
/// records it, or checks it against the recording and holds it back.
pub(super) fn call(ctx: &Ctx, gpu: &Gpu, call: Call<'_>) -> Result<()> {
    with_active(gpu.ordinal, |mine| {
        flush_others(ctx, gpu, mine, true)?;
        match mine {
            Some(shared) => shared.replay.lock().call(ctx, gpu, shared, call),
            None => issue(ctx, gpu, &call, gpu.cu_stream()),
        }
    })
}

/// Before a call on `gpu`'s stream that no graph holds (a transfer, a host read, a wait, a
/// free): the calls held back so far must reach the device first.
pub(super) fn boundary(ctx: &Ctx, gpu: &Gpu) -> Result<()> {
    boundary_of(ctx, gpu, true)
}

/// [`boundary`]; `known`: what the call touches is the op's locked arrays (a transfer or read
/// of them), else it may touch anything (a free, a wait for the whole device).
fn boundary_of(ctx: &Ctx, gpu: &Gpu, known: bool) -> Result<()> {
    if !watching(gpu.ordinal) {
        return Ok(());
    }
    with_active(gpu.ordinal, |mine| {
        flush_others(ctx, gpu, mine, known)?;
        match mine {
            Some(shared) => shared.replay.lock().boundary(ctx, gpu, shared),
            None => Ok(()),
        }
    })
}

/// [`boundary`] for the device layer's frees (registered with it), which have no op to name.
fn boundary_hook(gpu: &Gpu) {
    let ctx = Ctx::new("(a free of device memory)");
    // A failure here is the device's: the free that follows reports it. The memory freed may
    // be any held call's, whatever the op's locked arrays.
    let _ = boundary_of(&ctx, gpu, false);
}

/// Another thread's cycle replaying on `gpu` whose held calls touch what this thread's op
/// touches (one of the two writing), or either side not known, diverges now (its held calls are
/// issued first): this op may depend on them, and must not run before. Ops on arrays the held
/// calls do not write, writing none they use (two inference workers reading one model), go on.
fn flush_others(ctx: &Ctx, gpu: &Gpu, mine: Option<&Arc<Shared>>, known: bool) -> Result<()> {
    let at = slot(gpu.ordinal);
    let replaying = REPLAYING[at].load(Ordering::Acquire);
    let own = mine.is_some_and(|m| m.replaying.load(Ordering::Relaxed));
    if replaying <= usize::from(own) {
        return Ok(());
    }
    let others: Vec<Arc<Shared>> = REGISTRY[at]
        .lock()
        .iter()
        .filter(|s| !mine.is_some_and(|m| Arc::ptr_eq(m, s)))
        .cloned()
        .collect();
    for other in others {
        let mut replay = other.replay.lock();
        if let Mode::Replaying { stretch, pos } = replay.mode {
            if pos > 0 && (!known || replay.held.conflicts_with_footprint()) {
                let why = format!(
                    "another thread's `{}` on cuda:{} touched what this cycle's held calls use",
                    ctx.op, gpu.ordinal
                );
                replay.diverge(ctx, gpu, &other, why, stretch, pos)?;
            }
        }
    }
    Ok(())
}

impl CycleGraph {
    /// Graph replay for a workspace on device `ordinal`.
    pub(crate) fn new(ordinal: usize) -> Option<CycleGraph> {
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| device::on_stream_boundary(boundary_hook));
        Some(CycleGraph(Arc::new(Shared {
            replaying: AtomicBool::new(false),
            replay: Mutex::new(Replay {
                ordinal,
                mode: Mode::Idle,
                tape: Vec::new(),
                stretches: Vec::new(),
                summary: Arc::from(""),
                stats: GraphReplayStats {
                    state: GraphState::Learning,
                    ..GraphReplayStats::default()
                },
                failed_captures: 0,
                held: Held::default(),
            }),
        })))
    }

    /// A cycle opened on this thread; `learned`: the workspace's block is sized, so the
    /// cycle's addresses are those of the next ones.
    pub(crate) fn begin(&self, learned: bool) {
        let mut replay = self.0.replay.lock();
        replay.mode = Mode::Idle;
        if !learned || replay.gave_up() || !self.thread_is_free() {
            // Not learned, given up, or a cycle of another workspace records on this thread
            // already (it records this one's calls too).
            return;
        }
        if replay.stretches.is_empty() {
            replay.mode = Mode::Recording;
            replay.tape.clear();
            replay.tape.push(Vec::new());
        } else {
            replay.mode = Mode::Replaying { stretch: 0, pos: 0 };
            self.0.replaying.store(true, Ordering::Relaxed);
            REGISTRY[slot(replay.ordinal)]
                .lock()
                .push(Arc::clone(&self.0));
            REPLAYING[slot(replay.ordinal)].fetch_add(1, Ordering::Release);
            ANY_REPLAYING.fetch_add(1, Ordering::Release);
        }
        ACTIVE.with(|a| *a.borrow_mut() = Some(Arc::clone(&self.0)));
        ACTIVE_ON.with(|a| a.set(replay.ordinal));
    }

    /// Whether no other workspace's cycle records or replays on this thread (one whose cycle
    /// ended on another thread is forgotten here).
    fn thread_is_free(&self) -> bool {
        ACTIVE.with(|a| match a.borrow().as_ref() {
            None => true,
            Some(s) if Arc::ptr_eq(s, &self.0) => true,
            Some(s) => s.replay.try_lock().is_some_and(|r| r.mode == Mode::Idle),
        })
    }

    /// The open cycle ends: a recorded one is captured, a replayed one's last graph launched
    /// (or, short of the recording, its held calls issued). Returns, for a replayed cycle,
    /// what it stood for.
    pub(crate) fn end(&self, ctx: &Ctx) -> Option<Arc<str>> {
        ACTIVE.with(|a| {
            let mut a = a.borrow_mut();
            if a.as_ref().is_some_and(|s| Arc::ptr_eq(s, &self.0)) {
                *a = None;
                ACTIVE_ON.with(|o| o.set(usize::MAX));
            }
        });
        let mut replay = self.0.replay.lock();
        let gpu = device::existing(replay.ordinal)?;
        let mode = std::mem::replace(&mut replay.mode, Mode::Idle);
        match mode {
            Mode::Recording => {
                replay.capture(ctx, gpu);
                None
            }
            Mode::Replaying { stretch, pos } => {
                let n = replay.stretches.len();
                let last_complete =
                    stretch + 1 == n && pos == replay.stretches[stretch].entries.len();
                let launched = if last_complete {
                    replay.launch(ctx, gpu, stretch).map_err(|e| e.to_string())
                } else if stretch >= n {
                    Ok(())
                } else {
                    let recorded: usize = replay.stretches.iter().map(|s| s.entries.len()).sum();
                    let made = replay.stretches[..stretch]
                        .iter()
                        .map(|s| s.entries.len())
                        .sum::<usize>()
                        + pos;
                    Err(format!(
                        "the cycle ended after {made} of the {recorded} recorded calls"
                    ))
                };
                match launched {
                    Ok(()) => {
                        replay.stop_replaying(&self.0);
                        replay.stats.replays += 1;
                        Some(Arc::clone(&replay.summary))
                    }
                    Err(why) => {
                        // The held calls run eagerly; an error of theirs shows at the next
                        // wait, as an eager run's would.
                        let _ = replay.diverge(ctx, gpu, &self.0, why, stretch, pos);
                        replay.mode = Mode::Idle;
                        None
                    }
                }
            }
            Mode::Idle | Mode::Eager => None,
        }
    }

    /// The workspace's block was replaced: the recorded addresses are gone.
    pub(crate) fn forget(&self) {
        let mut replay = self.0.replay.lock();
        replay.drop_graphs();
        if !replay.gave_up() {
            replay.stats.state = GraphState::Learning;
        }
    }

    /// The figures now.
    pub(crate) fn stats(&self) -> GraphReplayStats {
        self.0.replay.lock().stats.clone()
    }
}

impl Drop for CycleGraph {
    fn drop(&mut self) {
        let mut replay = self.0.replay.lock();
        if matches!(replay.mode, Mode::Replaying { .. }) {
            replay.stop_replaying(&self.0);
        }
        replay.drop_graphs();
    }
}

impl Replay {
    /// Whether recording stopped for good ([`MAX_FAILED_CAPTURES`] failed captures in a row:
    /// none is tried again, so the count stays there).
    fn gave_up(&self) -> bool {
        self.failed_captures >= MAX_FAILED_CAPTURES
    }

    fn call(&mut self, ctx: &Ctx, gpu: &Gpu, shared: &Arc<Shared>, call: Call<'_>) -> Result<()> {
        match self.mode {
            Mode::Recording => {
                issue(ctx, gpu, &call, gpu.cu_stream())?;
                if let Some(last) = self.tape.last_mut() {
                    last.push(Entry::record(ctx.op, &call));
                }
                Ok(())
            }
            Mode::Replaying {
                mut stretch,
                mut pos,
            } => {
                // A complete stretch whose boundary did not come: launched now.
                while stretch < self.stretches.len() && pos == self.stretches[stretch].entries.len()
                {
                    self.launch(ctx, gpu, stretch)?;
                    stretch += 1;
                    pos = 0;
                    self.mode = Mode::Replaying { stretch, pos };
                }
                let compared = match self.stretches.get_mut(stretch) {
                    Some(s) => s.entries[pos].compare(ctx.op, &call),
                    None => Compare::Differs(format!(
                        "`{}` was called after the last recorded call",
                        ctx.op
                    )),
                };
                match compared {
                    Compare::Same => {
                        self.held.add_footprint();
                        self.mode = Mode::Replaying {
                            stretch,
                            pos: pos + 1,
                        };
                        Ok(())
                    }
                    Compare::Updated => {
                        self.held.add_footprint();
                        self.stats.updated_arguments += 1;
                        self.mode = Mode::Replaying {
                            stretch,
                            pos: pos + 1,
                        };
                        Ok(())
                    }
                    Compare::Differs(why) => {
                        self.diverge(ctx, gpu, shared, why, stretch, pos)?;
                        issue(ctx, gpu, &call, gpu.cu_stream())
                    }
                }
            }
            Mode::Idle | Mode::Eager => issue(ctx, gpu, &call, gpu.cu_stream()),
        }
    }

    fn boundary(&mut self, ctx: &Ctx, gpu: &Gpu, shared: &Arc<Shared>) -> Result<()> {
        match self.mode {
            Mode::Recording => {
                if self.tape.last().is_some_and(|t| !t.is_empty()) {
                    self.tape.push(Vec::new());
                }
                Ok(())
            }
            Mode::Replaying { stretch, pos } if pos > 0 => {
                if pos == self.stretches[stretch].entries.len() {
                    self.launch(ctx, gpu, stretch)?;
                    self.mode = Mode::Replaying {
                        stretch: stretch + 1,
                        pos: 0,
                    };
                    Ok(())
                } else {
                    let why = format!(
                        "`{}` reads or waits after {pos} of the {} calls of a recorded stretch",
                        ctx.op,
                        self.stretches[stretch].entries.len()
                    );
                    self.diverge(ctx, gpu, shared, why, stretch, pos)
                }
            }
            _ => Ok(()),
        }
    }

    /// Launches the graph of stretch `s`, its changed kernel arguments written in first.
    fn launch(&mut self, ctx: &Ctx, gpu: &Gpu, s: usize) -> Result<()> {
        gpu.bind(ctx)?;
        let stretch = &mut self.stretches[s];
        for entry in &mut stretch.entries {
            if let Recorded::Kernel {
                f,
                blocks,
                threads,
                bytes,
                spans,
                node,
                dirty,
                ..
            } = &mut entry.call
            {
                if !*dirty {
                    continue;
                }
                let mut params = argument_pointers(bytes, spans);
                let node_params = sys::CUDA_KERNEL_NODE_PARAMS {
                    func: *f,
                    gridDimX: *blocks,
                    gridDimY: 1,
                    gridDimZ: 1,
                    blockDimX: threads.0,
                    blockDimY: threads.1,
                    blockDimZ: 1,
                    sharedMemBytes: 0,
                    kernelParams: params.as_mut_ptr(),
                    extra: std::ptr::null_mut(),
                    kern: std::ptr::null_mut(),
                    ctx: std::ptr::null_mut(),
                };
                // SAFETY: `node` is a kernel node of this executable graph, of the same kernel
                // and launch shape; the driver copies the arguments before returning.
                unsafe {
                    sys::cuGraphExecKernelNodeSetParams_v2(stretch.exec, *node, &node_params)
                }
                .result()
                .map_err(|e| gpu.failed(ctx, "cuGraphExecKernelNodeSetParams", e))?;
                *dirty = false;
            }
        }
        // SAFETY: a live executable graph of this context, launched on its device's stream in
        // order with everything else; it reads and writes memory held as when it was recorded.
        unsafe { sys::cuGraphLaunch(stretch.exec, gpu.cu_stream()) }
            .result()
            .map_err(|e| gpu.failed(ctx, "cuGraphLaunch", e))?;
        self.held.clear();
        Ok(())
    }

    /// The cycle diverged at call `pos` of stretch `s`: the held calls of the stretch are
    /// issued as recorded, the cycle finishes eagerly, and the graphs are dropped.
    fn diverge(
        &mut self,
        ctx: &Ctx,
        gpu: &Gpu,
        shared: &Arc<Shared>,
        why: String,
        s: usize,
        pos: usize,
    ) -> Result<()> {
        tracing::debug!(target: "ndscope::workspace", "graph replay fell back: {why}");
        self.stats.fallbacks += 1;
        self.stats.last_fallback = Some(why);
        self.mode = Mode::Eager;
        self.held.clear();
        self.stop_replaying(shared);
        let issued = match self.stretches.get(s) {
            Some(stretch) => stretch.entries[..pos.min(stretch.entries.len())]
                .iter()
                .try_for_each(|e| e.issue(ctx, gpu, gpu.cu_stream())),
            None => Ok(()),
        };
        self.drop_graphs();
        if !self.gave_up() {
            self.stats.state = GraphState::Learning;
        }
        issued
    }

    fn stop_replaying(&mut self, shared: &Arc<Shared>) {
        if shared.replaying.swap(false, Ordering::Relaxed) {
            let at = slot(self.ordinal);
            REGISTRY[at].lock().retain(|s| !Arc::ptr_eq(s, shared));
            REPLAYING[at].fetch_sub(1, Ordering::Release);
            ANY_REPLAYING.fetch_sub(1, Ordering::Release);
        }
    }

    /// Destroys the graphs (an executable graph still running is freed when it completes).
    fn drop_graphs(&mut self) {
        if self.stretches.is_empty() {
            return;
        }
        let bound = device::existing(self.ordinal).is_some_and(|g| g.ctx.bind_to_thread().is_ok());
        for s in self.stretches.drain(..) {
            if bound {
                // SAFETY: made by `capture` on this context and destroyed once, here.
                unsafe {
                    let _ = sys::cuGraphExecDestroy(s.exec);
                    let _ = sys::cuGraphDestroy(s.graph);
                }
            }
        }
        self.stats.calls = 0;
        self.stats.graphs = 0;
    }

    /// Captures the recorded stretches into executable graphs.
    fn capture(&mut self, ctx: &Ctx, gpu: &Gpu) {
        let tape: Vec<Vec<Entry>> = std::mem::take(&mut self.tape)
            .into_iter()
            .filter(|t| !t.is_empty())
            .collect();
        if tape.is_empty() {
            return;
        }
        let mut stretches = Vec::with_capacity(tape.len());
        for entries in tape {
            match capture_stretch(ctx, gpu, entries) {
                Ok(s) => stretches.push(s),
                Err(why) => {
                    self.stretches = stretches;
                    self.drop_graphs();
                    self.failed_captures += 1;
                    if self.failed_captures < MAX_FAILED_CAPTURES {
                        // The next cycle records again.
                        tracing::debug!(
                            target: "ndscope::workspace",
                            "capturing a recorded cycle failed, recording the next: {why}"
                        );
                        self.stats.last_fallback = Some(format!("capturing failed: {why}"));
                        return;
                    }
                    tracing::warn!(
                        target: "ndscope::workspace",
                        "graph replay is off for this workspace: capturing its cycle failed \
                         {MAX_FAILED_CAPTURES} times in a row, last: {why}"
                    );
                    self.stats.state = GraphState::Failed(why);
                    return;
                }
            }
        }
        self.failed_captures = 0;
        self.stats.captures += 1;
        self.stats.calls = stretches.iter().map(|s| s.entries.len()).sum();
        self.stats.graphs = stretches.len();
        self.stats.state = GraphState::Captured;
        self.summary = summarise(&stretches);
        self.stretches = stretches;
    }
}

/// "N graph launches for M calls: op ×k, …", in the order the ops first came.
fn summarise(stretches: &[Stretch]) -> Arc<str> {
    let mut ops: Vec<(&'static str, usize)> = Vec::new();
    for e in stretches.iter().flat_map(|s| &s.entries) {
        match ops.iter_mut().find(|(op, _)| *op == e.op) {
            Some((_, n)) => *n += 1,
            None => ops.push((e.op, 1)),
        }
    }
    let calls: usize = ops.iter().map(|&(_, n)| n).sum();
    let mut out = format!(
        "{} graph launch{} for {calls} calls:",
        stretches.len(),
        if stretches.len() == 1 { "" } else { "es" }
    );
    for (i, (op, n)) in ops.iter().enumerate() {
        let sep = if i == 0 { " " } else { ", " };
        let _ = if *n == 1 {
            write!(out, "{sep}{op}")
        } else {
            write!(out, "{sep}{op} ×{n}")
        };
    }
    Arc::from(out)
}

/// The stream captures are made on for `gpu`, made at the first.
fn capture_stream(gpu: &Gpu) -> std::result::Result<Arc<CudaStream>, String> {
    let mut s = CAPTURE_STREAMS[slot(gpu.ordinal)].lock();
    if let Some(stream) = s.as_ref() {
        return Ok(Arc::clone(stream));
    }
    let stream = gpu
        .ctx
        .new_stream()
        .map_err(|e| format!("creating the capture stream failed: {e:?}"))?;
    *s = Some(Arc::clone(&stream));
    Ok(stream)
}

/// Captures one stretch's calls into an executable graph, noting each kernel's node.
fn capture_stretch(
    ctx: &Ctx,
    gpu: &Gpu,
    mut entries: Vec<Entry>,
) -> std::result::Result<Stretch, String> {
    let stream = capture_stream(gpu)?;
    let _one_at_a_time = CAPTURE_STREAMS[slot(gpu.ordinal)].lock();
    gpu.bind(ctx).map_err(|e| e.to_string())?;
    let s = stream.cu_stream();
    // SAFETY: a stream of this context, not capturing (captures on it are serialised by the
    // lock above); thread-local mode: other threads' calls are not affected.
    unsafe {
        sys::cuStreamBeginCapture_v2(
            s,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
    }
    .result()
    .map_err(|e| format!("cuStreamBeginCapture failed: {e:?}"))?;
    let mut failed = None;
    for entry in &mut entries {
        if let Err(e) = entry.issue(ctx, gpu, s) {
            failed = Some(format!("recording `{}` failed: {e}", entry.op));
            break;
        }
        if let Recorded::Kernel { node, .. } = &mut entry.call {
            match last_node(s) {
                Ok(n) => *node = n,
                Err(why) => {
                    failed = Some(why);
                    break;
                }
            }
        }
    }
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above, on this thread; `graph` receives the graph or null.
    let ended = unsafe { sys::cuStreamEndCapture(s, &mut graph) }.result();
    let destroy_graph = |graph: sys::CUgraph| {
        if !graph.is_null() {
            // SAFETY: the graph made by this capture, destroyed once.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
        }
    };
    if let Some(why) = failed {
        destroy_graph(graph);
        return Err(why);
    }
    if let Err(e) = ended {
        destroy_graph(graph);
        return Err(format!("cuStreamEndCapture failed: {e:?}"));
    }
    let mut exec: sys::CUgraphExec = std::ptr::null_mut();
    // SAFETY: `graph` is the graph just captured; `exec` receives its executable graph.
    if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
        destroy_graph(graph);
        return Err(format!("cuGraphInstantiateWithFlags failed: {e:?}"));
    }
    Ok(Stretch {
        entries,
        graph,
        exec,
    })
}

/// The node the last call captured on stream `s` made (the capture's one current dependency).
fn last_node(s: CUstream) -> std::result::Result<sys::CUgraphNode, String> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    let mut deps: *const sys::CUgraphNode = std::ptr::null();
    let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
    let mut count = 0usize;
    // SAFETY: out-parameters only; `s` is capturing.
    unsafe {
        sys::cuStreamGetCaptureInfo_v3(
            s,
            &mut status,
            &mut id,
            &mut graph,
            &mut deps,
            &mut edges,
            &mut count,
        )
    }
    .result()
    .map_err(|e| format!("cuStreamGetCaptureInfo failed: {e:?}"))?;
    if count != 1 || deps.is_null() {
        return Err(format!(
            "a captured kernel left {count} current nodes on the capture stream, not 1"
        ));
    }
    // SAFETY: the driver returned `count` (1) nodes at `deps`, valid until the next call on
    // the stream.
    Ok(unsafe { *deps })
}

// SAFETY: the raw handles (kernel functions, graph nodes, graphs) are used under the replay's
// mutex only; the driver allows using them from any thread with the context current.
unsafe impl Send for Replay {}

#[cfg(test)]
mod tests {
    use super::same_bytes;

    #[test]
    fn argument_bytes_compare_equal_exactly_when_every_byte_is_equal() {
        for len in [0usize, 1, 2, 4, 7, 8, 12, 16, 24] {
            let a: Vec<u8> = (0..len).map(|i| i as u8 ^ 0x5a).collect();
            assert!(same_bytes(&a, &a.clone()), "{len} equal bytes");
            for at in 0..len {
                let mut b = a.clone();
                b[at] ^= 0x80;
                assert!(!same_bytes(&a, &b), "{len} bytes differing at {at}");
            }
        }
    }
}
