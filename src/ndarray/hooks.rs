//! The hooks of the op-dispatch path: what `exec` tells whoever observes how ops run, before it
//! locks an array's bytes. exec calls them and knows nothing of who listens.
//!
//! The observer is bound once, at compile time, as `crate::observe` binds the memory recorder:
//! this module declares the type [`Observer`] and the trait [`ExecObserver`], and exactly one
//! module above exec implements `ExecObserver` for `Observer` (the gradient tape, which settles
//! the weight gradients it left pending and refuses in-place reads of the arrays it tracks).
//! Coherence makes that impl unique, and a build without it fails, so no hook can go nowhere.
//! The calls are static (no `dyn`); another observer of this path joins that one impl.
//!
//! Cost when nobody listens, per hook: [`before_access`] is one acquire load of the array's own
//! flag (set only while a product is pending in it), [`before_inplace_reads`] one thread-local
//! read of [`watching`] (set by the observer while it watches this thread). The observer is
//! called only past them, out of line.

use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::arena::ArrayShared;
use crate::error::Ctx;
use crate::{NDArray, Result};

/// Who observes the dispatch path (implemented once, for [`Observer`], by the gradient tape).
pub(crate) trait ExecObserver {
    /// Computes the product left pending in `array` before its bytes are read or written, so
    /// no access sees the array without it. Called only when the array's pending flag is set.
    fn settle(ctx: &Ctx, array: &Arc<ArrayShared>) -> Result<()>;

    /// An in-place op is about to read `sources` (its target may be among them); an error
    /// refuses the op before anything is written. Called only while [`watching`].
    fn inplace_reads(ctx: &Ctx, sources: &[&NDArray]) -> Result<()>;
}

/// The observer of this build. Its `ExecObserver` impl lives with the gradient tape.
pub(crate) struct Observer;

thread_local! {
    /// Whether the observer watches this thread's in-place reads: the one read an in-place op
    /// makes when nobody does.
    static WATCHING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the observer watches this thread (a thread-local read).
#[inline]
pub(crate) fn watching() -> bool {
    WATCHING.with(Cell::get)
}

/// Turns watching this thread on or off (the observer's switch).
pub(crate) fn set_watching(on: bool) {
    WATCHING.with(|w| w.set(on));
}

/// Before any access to `array`'s bytes: settles the product pending in it, if any.
#[inline]
pub(crate) fn before_access(ctx: &Ctx, array: &Arc<ArrayShared>) -> Result<()> {
    if !array.grad.has_pending.load(Ordering::Acquire) {
        return Ok(());
    }
    settle(ctx, array)
}

#[inline(never)]
fn settle(ctx: &Ctx, array: &Arc<ArrayShared>) -> Result<()> {
    <Observer as ExecObserver>::settle(ctx, array)
}

/// Before an in-place op reads `sources`: the observer may refuse it.
#[inline]
pub(crate) fn before_inplace_reads(ctx: &Ctx, sources: &[&NDArray]) -> Result<()> {
    if !watching() {
        return Ok(());
    }
    inplace_reads(ctx, sources)
}

#[inline(never)]
fn inplace_reads(ctx: &Ctx, sources: &[&NDArray]) -> Result<()> {
    <Observer as ExecObserver>::inplace_reads(ctx, sources)
}
