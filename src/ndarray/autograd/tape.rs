//! The thread's tape: the op records of the open collector, and the hook every differentiable
//! op calls after computing its result ([`record`]), which costs one thread-local read when no
//! collector records.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::backend::{Binary, Unary};
use crate::error::{Ctx, Site};
use crate::ndarray::hooks;
use crate::{NDArray, Result, Shape};

/// How backward turns an op's output gradient into its inputs' gradients, with what it needs
/// beyond the inputs' and output's handles (their shapes, dtypes and devices answer always).
#[derive(Clone, Debug)]
pub(crate) enum Backward {
    /// An elementwise unary op.
    Unary(Unary),
    /// A broadcasting binary op.
    Binary(Binary),
    /// `x ± c`: the gradient passes unchanged.
    Shift,
    /// `x · c` (and `x / c` as `x · 1/c`).
    Scale(f64),
    /// `x ^ p`.
    PowScalar(f64),
    /// `sum` (or `mean`, scaled by `scale`) into `keep`: the input's shape with the reduced
    /// axes set to 1.
    Sum { keep: Shape, scale: f64 },
    /// `max` over `axis` (the gradient goes to the arg-max element).
    Max { axis: usize },
    /// `matmul`, 2-D or batched (the case is read from the inputs' shapes).
    Matmul,
    /// `matmul_t` (2-D), with which operands are read transposed (`Transpose`'s flags: this
    /// room sits below the matrix ops).
    MatmulT { left: bool, right: bool },
    /// `Dense::forward`: `act(x · w + b)`; inputs `x`, `w` and the bias if any.
    Dense { relu: bool },
    /// `reshape`, `squeeze`, `unsqueeze`: the gradient takes the input's shape back.
    Reshape,
    /// `transpose` (2-D).
    Transpose,
    /// `permute` with these axes.
    Permute(Shape),
    /// `broadcast_to`: the gradient is summed back to the input's shape.
    BroadcastTo,
    /// `narrow` of `axis` from `start`.
    Narrow { axis: usize, start: usize },
    /// `concat` along `axis`.
    Concat { axis: usize },
    /// `stack` along `axis`.
    Stack { axis: usize },
    /// `softmax` over `axis`.
    Softmax { axis: usize },
    /// `log_softmax` over `axis`.
    LogSoftmax { axis: usize },
    /// `pick` along `axis`; inputs `x` and the indices.
    Pick { axis: usize },
    /// `softmax_cross_entropy`; inputs the logits, the labels, and the logits' gradient for a
    /// unit seed that the forward pass computed (saved): the gradient is that times the output
    /// gradient, or that itself for an implicit seed of ones.
    SoftmaxCrossEntropy,
    /// `to_dtype` (between floats), `duplicate`, `to_device`: the gradient converted back.
    Convert,
    /// An op with no gradient: `backward` through it is an error naming it.
    None,
}

impl Backward {
    /// Which inputs' values backward reads (bit `i` for input `i`), and whether it reads the
    /// output's: those are the tape's saved arrays, checked open and unchanged before backward
    /// runs.
    fn saves(&self) -> (u8, bool) {
        match self {
            Backward::Unary(op) => match op {
                Unary::Neg | Unary::Gelu => (0, false),
                Unary::Abs | Unary::Square | Unary::Log => (1, false),
                Unary::Relu | Unary::Exp | Unary::Sqrt | Unary::Tanh | Unary::Sigmoid => (0, true),
            },
            Backward::Binary(op) => match op {
                Binary::Add | Binary::Sub => (0, false),
                _ => (0b11, false),
            },
            Backward::PowScalar(_) | Backward::Max { .. } => (1, false),
            Backward::Matmul | Backward::MatmulT { .. } => (0b11, false),
            Backward::Dense { relu } => (0b11, *relu),
            Backward::Softmax { .. } | Backward::LogSoftmax { .. } => (0, true),
            Backward::Pick { .. } => (0b10, false),
            Backward::SoftmaxCrossEntropy => (0b100, false),
            _ => (0, false),
        }
    }
}

/// Where an input's gradient goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Track {
    /// Nowhere: it does not depend on an array that requires gradients.
    No,
    /// Into its `gradient()` array.
    Leaf,
    /// Into the output gradient of this node of the tape.
    Node(u32),
}

/// Most inputs a record holds inline (more, for `concat`/`stack`, go to `more`).
pub(crate) const INLINE_INPUTS: usize = 3;

/// One recorded op.
pub(crate) struct Node {
    pub op: &'static str,
    pub at: Site,
    pub backward: Backward,
    /// The inputs, with where their gradients go and their versions when recorded.
    pub inputs: [Option<(NDArray, Track, u64)>; INLINE_INPUTS],
    /// Inputs past the inline ones (`concat`, `stack` of more than three arrays).
    pub more: Vec<(NDArray, Track)>,
    /// Bit `i`: backward reads input `i`'s values.
    pub saved: u8,
    /// The result, its version when recorded, and whether backward reads it.
    pub output: NDArray,
    pub out_version: u64,
    pub saves_output: bool,
    /// The gradient of the output accumulated so far (during `backward`).
    pub grad: Option<NDArray>,
    /// Whether the output gradient reaches this node (during `backward`).
    pub reached: bool,
}

impl Node {
    /// Input `i` with its track.
    pub fn input(&self, i: usize) -> Option<(&NDArray, Track)> {
        match i.checked_sub(INLINE_INPUTS) {
            None => self.inputs[i].as_ref().map(|(a, t, _)| (a, *t)),
            Some(j) => self.more.get(j).map(|(a, t)| (a, *t)),
        }
    }

    /// Every input with its track, inline ones first.
    pub fn all_inputs(&self) -> impl Iterator<Item = (&NDArray, Track)> {
        self.inputs
            .iter()
            .flatten()
            .map(|(a, t, _)| (a, *t))
            .chain(self.more.iter().map(|(a, t)| (a, *t)))
    }
}

/// The thread's tape.
pub(crate) struct Tape {
    /// The open collector's tape id (0: none open). A new id after each `backward`, so arrays
    /// computed before it are no longer found on it.
    pub id: u32,
    pub nodes: Vec<Node>,
    /// Where the open collector was opened.
    pub opened_at: Option<Site>,
    /// `no_gradient` depth.
    pub paused: u32,
}

thread_local! {
    pub(crate) static TAPE: RefCell<Tape> = const {
        RefCell::new(Tape { id: 0, nodes: Vec::new(), opened_at: None, paused: 0 })
    };
}

static NEXT_TAPE: AtomicU32 = AtomicU32::new(1);

pub(crate) fn next_tape_id() -> u32 {
    // Ids wrap after 4 billion tapes; 0 is skipped (it means "none").
    loop {
        let id = NEXT_TAPE.fetch_add(1, Ordering::Relaxed);
        if id != 0 {
            return id;
        }
    }
}

/// A collector records while it is open and not paused: then the tape watches the thread's
/// ops (the dispatch path's switch, one thread-local read when no collector records).
fn update_recording(tape: &Tape) {
    hooks::set_watching(tape.id != 0 && tape.paused == 0);
}

/// Whether ops on this thread are recorded now.
#[inline]
pub(crate) fn recording() -> bool {
    hooks::watching()
}

/// Opens the thread's tape, or `InvalidArgument` when one is open.
pub(super) fn open(ctx: &Ctx) -> Result<()> {
    TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        if tape.id != 0 {
            let at = tape
                .opened_at
                .map_or_else(|| "?".to_string(), |s| s.to_string());
            return Err(ctx.invalid(format!(
                "a gradient collector is already open on this thread (opened at {at}): close \
                 it first (one per thread at a time)"
            )));
        }
        tape.id = next_tape_id();
        tape.opened_at = Some(ctx.at);
        tape.nodes.clear();
        update_recording(&tape);
        Ok(())
    })
}

/// Closes the thread's tape, dropping its records (their capacity is kept).
pub(super) fn close() {
    let nodes = TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        tape.id = 0;
        tape.opened_at = None;
        update_recording(&tape);
        std::mem::take(&mut tape.nodes)
    });
    // Dropped outside the borrow (dropping handles runs no op, but stays out of the cell).
    let mut nodes = nodes;
    nodes.clear();
    TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        if tape.nodes.capacity() < nodes.capacity() {
            tape.nodes = nodes;
        }
    });
}

/// Turns recording off on this thread while it lives (nests).
pub(crate) struct Pause {
    _thread: PhantomData<*const ()>,
}

impl Pause {
    pub fn new() -> Pause {
        TAPE.with(|t| {
            let mut tape = t.borrow_mut();
            tape.paused += 1;
            update_recording(&tape);
        });
        Pause {
            _thread: PhantomData,
        }
    }
}

impl Drop for Pause {
    fn drop(&mut self) {
        TAPE.with(|t| {
            let mut tape = t.borrow_mut();
            tape.paused = tape.paused.saturating_sub(1);
            update_recording(&tape);
        });
    }
}

/// The node key stored in an array: `(tape id << 32) | index`.
fn key(tape: u32, index: u32) -> u64 {
    (u64::from(tape) << 32) | u64::from(index)
}

/// Where `a`'s gradient goes on tape `id`.
pub(crate) fn track(a: &NDArray, id: u32) -> Track {
    let node = a.0.grad.node.load(Ordering::Relaxed);
    if node != 0 && (node >> 32) as u32 == id {
        Track::Node(node as u32)
    } else if a.0.grad.requires.load(Ordering::Relaxed) {
        Track::Leaf
    } else {
        Track::No
    }
}

/// Whether `a` is the result of an op recorded on this thread's current tape (its gradient
/// flows back through that op, not into `a` as a leaf's).
pub(crate) fn is_recorded_result(a: &NDArray) -> bool {
    TAPE.with(|t| {
        let id = t.borrow().id;
        id != 0 && matches!(track(a, id), Track::Node(_))
    })
}

/// Whether an op on `inputs` would be recorded now: a collector records and one of them depends
/// on an array that requires gradients. An op whose record saves work done for its backward
/// does that work only then.
pub(crate) fn tracked(inputs: &[&NDArray]) -> bool {
    if !recording() {
        return false;
    }
    TAPE.with(|t| {
        let id = t.borrow().id;
        id != 0 && inputs.iter().any(|a| track(a, id) != Track::No)
    })
}

/// Records an op on this thread's tape when a collector records and one of `inputs` depends on
/// an array that requires gradients: `out` computed from `inputs` by `ctx.op`, differentiated
/// by `backward()` (called only then). Integer results are never recorded.
#[inline]
pub(crate) fn record(
    ctx: &Ctx,
    inputs: &[&NDArray],
    out: &NDArray,
    backward: impl FnOnce() -> Backward,
) {
    if !recording() {
        return;
    }
    record_slow(ctx, inputs, out, backward);
}

#[inline(never)]
fn record_slow(ctx: &Ctx, inputs: &[&NDArray], out: &NDArray, backward: impl FnOnce() -> Backward) {
    if !out.dtype().is_float() {
        return;
    }
    TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        let id = tape.id;
        if id == 0 {
            return;
        }
        let mut any = false;
        let mut tracks = [Track::No; INLINE_INPUTS];
        for (i, a) in inputs.iter().enumerate() {
            let t = track(a, id);
            any |= t != Track::No;
            if i < INLINE_INPUTS {
                tracks[i] = t;
            }
        }
        if !any {
            return;
        }
        let backward = backward();
        let (saved, saves_output) = backward.saves();
        let mut fixed: [Option<(NDArray, Track, u64)>; INLINE_INPUTS] = [None, None, None];
        let mut more = Vec::new();
        for (i, a) in inputs.iter().enumerate() {
            if i < INLINE_INPUTS {
                let version = a.0.grad.version.load(Ordering::Relaxed);
                fixed[i] = Some(((*a).clone(), tracks[i], version));
            } else {
                more.push(((*a).clone(), track(a, id)));
            }
        }
        let index = tape.nodes.len() as u32;
        tape.nodes.push(Node {
            op: ctx.op,
            at: ctx.at,
            backward,
            inputs: fixed,
            more,
            saved,
            output: out.clone(),
            out_version: out.0.grad.version.load(Ordering::Relaxed),
            saves_output,
            grad: None,
            reached: false,
        });
        out.0.grad.node.store(key(id, index), Ordering::Relaxed);
    });
}

/// Refuses an in-place op that reads `sources` while a collector records and one of them is
/// tracked: the op would not be recorded, so the gradient would be wrong.
#[inline]
pub(crate) fn check_inplace_sources(ctx: &Ctx, sources: &[&NDArray]) -> Result<()> {
    if !recording() {
        return Ok(());
    }
    let id = TAPE.with(|t| t.borrow().id);
    for s in sources {
        if track(s, id) != Track::No {
            return Err(ctx.invalid(format!(
                "in-place `{}` reads {}, which a recording gradient collector tracks: in-place \
                 ops are not recorded, so its gradient would be lost (use the op that returns a \
                 new array, or run it in no_gradient)",
                ctx.op,
                s.0.describe()
            )));
        }
    }
    Ok(())
}
