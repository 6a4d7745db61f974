//! Memory events: the one interface through which the core (arena, manager, workspace, arrays,
//! blocks, memory accounting) tells an observer what happens to memory. The core emits an
//! [`Event`] and knows nothing of who listens, what is kept or how it is exported.
//!
//! The observer is bound once, at compile time: this module declares the type [`Recorder`] and
//! the trait [`Observer`], and exactly one module above the core implements `Observer` for
//! `Recorder` (the memory recorder, `timeline`). Coherence makes that impl unique, and a build
//! without it fails, so no event can go nowhere and no second listener can appear.
//!
//! Cost when nobody records: callers write `if observe::on() { observe::emit(…) }`, one relaxed
//! load and a predictable branch; the event is built only inside the branch, and [`emit`] is
//! out of line.
//!
//! Lower layers cannot name the arena's types, so an event carries the array or manager it is
//! about as a [`Handle`] (an `Arc` of the arena's own object, type-erased); the observer, which
//! sits above the arena, turns it back.
//!
//! Locks: events are emitted under the arena lock or none; the observer takes its own lock and
//! never the arena's while holding it.

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::error::Site;
use crate::Device;

/// The manager id of an event about no manager (a detached array, a freed block).
pub(crate) const NO_MANAGER: u64 = u64::MAX;

/// An array's or a manager's shared object (the arena's `ArrayShared` or `ManagerShared`), kept by
/// the observer to name it later.
pub(crate) type Handle = Arc<dyn Any + Send + Sync>;

/// Where a workspace-block array lies, as events report it: block id, offset and aligned
/// length. The arena's `Place::Block` gives it (`Place::span`), without the cycle the
/// observer does not need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockSpan {
    pub block: u64,
    pub offset: usize,
    pub len: usize,
}

/// The figures of a workspace cycle that just ended.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CycleEnd {
    pub cycle: u64,
    pub scope: u64,
    pub device: Device,
    pub bytes: usize,
    pub spilled_bytes: usize,
    pub spilled_count: u64,
    pub capacity: usize,
}

/// What happened. Manager ids are `NO_MANAGER` for none; `bytes` are the array's (or block's).
pub(crate) enum Event<'a> {
    /// An array was created, owned by manager `manager`, its bytes at `address` (in a workspace
    /// block at `span`, or its own buffer).
    ArrayAllocated {
        array: Handle,
        device: Device,
        bytes: usize,
        manager: u64,
        address: u64,
        span: Option<BlockSpan>,
    },
    /// An array left the arena.
    ArrayFreed {
        array: u64,
        site: Site,
        device: Device,
        bytes: usize,
        manager: u64,
        span: Option<BlockSpan>,
    },
    /// An array has a new owner, `manager`.
    ArrayAttached {
        array: u64,
        site: Site,
        device: Device,
        bytes: usize,
        manager: u64,
    },
    /// An array's bytes were copied to new storage at `address`.
    ArrayRelocated {
        array: u64,
        site: Site,
        device: Device,
        bytes: usize,
        manager: u64,
        address: u64,
        from: Option<BlockSpan>,
        to: Option<BlockSpan>,
    },
    /// A manager was created.
    ManagerOpened {
        manager: Handle,
        id: u64,
        device: Device,
    },
    /// A manager is closing (its arrays are freed already).
    ManagerClosed { id: u64, device: Device },
    /// A cycle of `workspace` opened, as the scope manager `scope`.
    CycleOpened {
        workspace: &'a Arc<str>,
        cycle: u64,
        scope: u64,
        device: Device,
    },
    /// A cycle of `workspace` ended; `replayed`: it was replayed as CUDA graphs, standing for
    /// these calls.
    CycleClosed {
        workspace: &'a Arc<str>,
        end: CycleEnd,
        replayed: Option<&'a str>,
    },
    /// `workspace` (owned by manager `owner`) allocated a block.
    BlockAllocated {
        workspace: &'a Arc<str>,
        owner: u64,
        block: u64,
        address: u64,
        device: Device,
        capacity: usize,
    },
    /// A workspace block was freed (its last user dropped it).
    BlockFreed {
        block: u64,
        device: Device,
        capacity: usize,
    },
    /// An allocation of `bytes` (aligned) for a cycle of `workspace` (scope `scope`) spilled.
    Spilled {
        workspace: &'a Arc<str>,
        scope: u64,
        device: Device,
        bytes: usize,
        site: Site,
    },
    /// The capped manager `manager` refused an array (`Error::Capped`).
    Capped {
        site: Site,
        op: &'static str,
        what: &'a str,
        device: Device,
        manager: u64,
    },
    /// An allocation of `requested` bytes was refused (`Error::OutOfMemory`).
    OutOfMemory {
        site: Site,
        op: &'static str,
        device: Device,
        requested: usize,
        in_use: usize,
        limit: Option<usize>,
    },
}

/// Who listens to memory events (implemented once, for [`Recorder`], by the memory recorder).
pub(crate) trait Observer: Sync {
    /// The arena was just created; `system` is its system manager (the only thing live). Called
    /// once, under the arena's creation, before any event.
    fn arena_created(&self, system: &Handle);

    /// One event. Called only while [`on`] (checked again by the observer: it may stop between).
    fn event(&self, event: Event<'_>);
}

/// The observer of this build. Its `Observer` impl lives with the memory recorder.
pub(crate) struct Recorder;

/// The observer, bound once (see the module docs).
static OBSERVER: &dyn Observer = &Recorder;

/// Whether events are wanted: set by the observer, read by every emitter.
static ON: AtomicBool = AtomicBool::new(false);

/// Whether events are wanted (a relaxed load: the branch every emitter costs when off).
#[inline(always)]
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Turns events on or off (the observer's switch).
pub(crate) fn set_on(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// Hands `event` to the observer. Callers check [`on`] first, so this stays off the hot path.
#[cold]
#[inline(never)]
pub(crate) fn emit(event: Event<'_>) {
    OBSERVER.event(event);
}

/// Tells the observer the arena exists (called once, by the arena, when it is created).
pub(crate) fn arena_created(system: Handle) {
    OBSERVER.arena_created(&system);
}
