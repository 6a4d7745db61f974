//! The arena: every array, manager and workspace of the process lives in one of three `slotmap`s
//! behind one lock, addressed by generational keys.
//!
//! # Locks
//!
//! There are two kinds: the arena lock (`ARENA`, one `parking_lot::Mutex<State>`, taken through
//! [`lock`]) and each array's data lock (`ArrayShared::data`, an `RwLock<Option<Storage>>`). The
//! order is written down here and every function keeps it:
//!
//! 1. **Never take the arena lock while holding a data lock.** Kernels run with data locks held
//!    and the arena lock released, so computing never blocks ownership changes elsewhere.
//! 2. **Whoever holds the arena lock never waits for a data lock**: it only *tries* one. So a
//!    kernel running on an array never stalls the threads that need the arena (any op, any
//!    `close`, `is_open`, `report`) — only the thread that closes or moves that very array.
//! 3. Several data locks are taken in address order ([`crate::ndarray`] does this), so two
//!    in-place ops on crossed arrays cannot deadlock.
//!
//! Debug builds check 1 and 3 where the locks are taken: `crate::locks` gives each lock a rank
//! (arena, then data locks by address, then the recorder's) and panics on a wait out of order.
//!
//! Closing an array removes it from the arena (under the arena lock) and then frees its bytes:
//! at once if its data lock is free, else later, by the closing thread, after it has released
//! the arena lock ([`Arena`]'s drop waits for the kernel, then frees). Moving an array out of a
//! workspace copies its bytes the same way. Meanwhile the kernel finishes on valid memory, and a
//! kernel that starts after the close finds `None` in the data lock and reports `ArrayClosed`.
//! A workspace hands out no part of its block while an array closed this way still holds its
//! bytes (it spills instead: see `WorkspaceEntry::plan`), so no new array is ever written where
//! a kernel still reads an old one.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};

use parking_lot::{Mutex, MutexGuard, RwLock};
use slotmap::SlotMap;

pub(crate) use crate::backend::Storage;

use crate::error::{Ctx, Site};
use crate::locks::{self, Held, Rank};
use crate::memory;
use crate::observe::{self, BlockSpan, Event, NO_MANAGER};
use crate::workspace::WorkspaceEntry;
use crate::{DType, Device, Error, Result, Shape};

slotmap::new_key_type! {
    /// An array's key in the arena (a generational `slotmap` key).
    pub(crate) struct ArrayKey;
    /// A manager's key in the arena.
    pub(crate) struct ManagerKey;
    /// A workspace's key in the arena.
    pub(crate) struct WorkspaceKey;
}

static NEXT_ARRAY_ID: AtomicU64 = AtomicU64::new(0);
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(0);

pub(crate) fn next_array_id() -> u64 {
    NEXT_ARRAY_ID.fetch_add(1, Ordering::Relaxed)
}

pub(crate) fn next_manager_id() -> u64 {
    NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed)
}

/// What an `NDArray` handle points to: the part of an array shared by its handles and its
/// arena entry ([`ArrayEntry::shared`]), named like [`ManagerShared`] and `WorkspaceShared`.
/// The metadata never changes after creation (only the name may be set); the data lock holds
/// the buffer until the array is closed.
pub(crate) struct ArrayShared {
    pub key: ArrayKey,
    pub id: u64,
    pub shape: Shape,
    pub dtype: DType,
    pub device: Device,
    pub created_at: Site,
    pub name: Mutex<Option<Arc<str>>>,
    /// Set, under the arena lock, when the array leaves the arena.
    pub closed: OnceLock<CloseReason>,
    /// Moves of the bytes to new storage (copy-out of a workspace) so far: a deferred copy
    /// checks it is still the latest.
    pub moves: AtomicU64,
    pub data: RwLock<Option<Storage>>,
}

impl ArrayShared {
    /// `'name' (a12)` or `a12`.
    pub fn describe(&self) -> String {
        match &*self.name.lock() {
            Some(name) => format!("'{name}' (a{})", self.id),
            None => format!("a{}", self.id),
        }
    }

    pub fn nbytes(&self) -> usize {
        self.shape.size() * self.dtype.size_in_bytes()
    }

    /// The `ArrayClosed` error for this array.
    pub fn closed_error(&self, ctx: &Ctx) -> Error {
        let reason = match self.closed.get() {
            Some(reason) => reason.to_string(),
            None => "it was closed".to_string(),
        };
        Error::ArrayClosed {
            op: ctx.op,
            at: ctx.at,
            array: self.describe(),
            created_at: self.created_at,
            reason,
        }
    }
}

/// Why an array left the arena; shown in `ArrayClosed` messages.
#[derive(Clone)]
pub(crate) enum CloseReason {
    ByUser {
        at: Site,
    },
    ManagerClosed {
        manager: Arc<ManagerShared>,
    },
    CycleEnded {
        workspace: Arc<str>,
        cycle: u64,
        manager: Arc<ManagerShared>,
    },
    Overwritten {
        workspace: Arc<str>,
        at: Site,
    },
    WorkspaceDestroyed {
        workspace: Arc<str>,
    },
    ReturnTargetClosed {
        borrower: Arc<ManagerShared>,
        original: String,
    },
    ReturnCopyFailed {
        borrower: Arc<ManagerShared>,
        original: String,
        error: String,
    },
    CopyFailed {
        error: String,
    },
    Discarded,
}

impl fmt::Display for CloseReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CloseReason::ByUser { at } => write!(f, "closed by the user at {at}"),
            CloseReason::ManagerClosed { manager } => {
                write!(f, "its manager {} was closed", manager.describe())
            }
            CloseReason::CycleEnded {
                workspace,
                cycle,
                manager,
            } => write!(
                f,
                "workspace cycle ended (cycle {cycle} of workspace '{workspace}', manager {})",
                manager.describe()
            ),
            CloseReason::Overwritten { workspace, at } => write!(
                f,
                "overwritten by circular workspace '{workspace}': an allocation at {at} reused its memory"
            ),
            CloseReason::WorkspaceDestroyed { workspace } => {
                write!(f, "its workspace '{workspace}' was destroyed")
            }
            CloseReason::ReturnTargetClosed { borrower, original } => write!(
                f,
                "its borrower {} closed, and the manager it was borrowed from, {original}, was already closed",
                borrower.describe()
            ),
            CloseReason::ReturnCopyFailed {
                borrower,
                original,
                error,
            } => write!(
                f,
                "its borrower {} closed and it could not be copied back to {original}: {error}",
                borrower.describe()
            ),
            CloseReason::CopyFailed { error } => write!(
                f,
                "moving it out of its workspace failed to copy its bytes: {error}"
            ),
            CloseReason::Discarded => f.write_str("the operation that created it failed"),
        }
    }
}

/// Who holds an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    Manager(ManagerKey),
    /// Owned by nobody (after `detach`); listed under the system manager.
    Detached,
}

/// Identifies one cycle of one workspace, and the manager scope that is that cycle.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CycleTag {
    pub ws: WorkspaceKey,
    pub generation: u64,
    pub scope: ManagerKey,
}

/// Where an array's bytes live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Place {
    /// Its own allocation (including workspace spills).
    Heap,
    /// `[offset, offset + len)` of the workspace block with id `block`, allocated during
    /// `cycle`.
    Block {
        cycle: CycleTag,
        offset: usize,
        len: usize,
        block: u64,
    },
}

impl Place {
    /// The block span of a workspace-block place, as memory events give it.
    pub fn span(self) -> Option<BlockSpan> {
        match self {
            Place::Heap => None,
            Place::Block {
                offset, len, block, ..
            } => Some(BlockSpan { block, offset, len }),
        }
    }
}

/// An owner an array was borrowed from, to give it back to.
#[derive(Clone)]
pub(crate) struct Lender {
    pub owner: Owner,
    /// For naming it in messages after it closed.
    pub shared: Option<Arc<ManagerShared>>,
}

impl Lender {
    pub fn describe(&self) -> String {
        match &self.shared {
            Some(shared) => shared.describe(),
            None => "nobody (detached)".to_string(),
        }
    }
}

pub(crate) struct ArrayEntry {
    pub shared: Arc<ArrayShared>,
    pub owner: Owner,
    /// Borrow chain: the owners to give the array back to, innermost last. Empty when owned.
    pub returns: Vec<Lender>,
    pub prev: Option<ArrayKey>,
    pub next: Option<ArrayKey>,
    pub place: Place,
}

impl ArrayEntry {
    pub fn is_borrowed(&self) -> bool {
        !self.returns.is_empty()
    }
}

/// An intrusive doubly-linked list of arrays (through `ArrayEntry::prev/next`).
#[derive(Default, Clone, Copy)]
pub(crate) struct ArrayList {
    pub head: Option<ArrayKey>,
    pub len: usize,
    pub bytes: usize,
}

/// What a `Manager` handle points to (and its arena entry, [`ManagerEntry::shared`)); lives as
/// long as any handle does.
pub(crate) struct ManagerShared {
    pub key: ManagerKey,
    pub id: u64,
    pub device: Device,
    pub name: Mutex<Option<Arc<str>>>,
    pub parent: Option<Arc<ManagerShared>>,
}

impl ManagerShared {
    /// `'name' (m12)` or `m12`.
    pub fn describe(&self) -> String {
        match &*self.name.lock() {
            Some(name) => format!("'{name}' (m{})", self.id),
            None => format!("m{}", self.id),
        }
    }
}

pub(crate) struct ManagerEntry {
    pub shared: Arc<ManagerShared>,
    pub parent: Option<ManagerKey>,
    pub first_child: Option<ManagerKey>,
    pub prev_sibling: Option<ManagerKey>,
    pub next_sibling: Option<ManagerKey>,
    pub arrays: ArrayList,
    pub capped: bool,
    /// The workspace cycle whose block serves this manager's allocations: its own if it is a
    /// cycle scope, else inherited from its parent when it was created.
    pub alloc: Option<CycleTag>,
    /// Set if this manager is the scope of a workspace cycle.
    pub cycle_of: Option<WorkspaceKey>,
    /// Workspaces owned by this manager (freed when it closes).
    pub workspaces: Vec<WorkspaceKey>,
}

pub(crate) struct State {
    pub arrays: SlotMap<ArrayKey, ArrayEntry>,
    pub managers: SlotMap<ManagerKey, ManagerEntry>,
    pub workspaces: SlotMap<WorkspaceKey, WorkspaceEntry>,
    pub system: Arc<ManagerShared>,
    /// Arrays owned by nobody.
    pub detached: ArrayList,
    /// Work for [`Arena`]'s drop.
    pub pending: Vec<Deferred>,
}

pub(crate) static ARENA: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::new()));

/// The locked arena. Dropping it unlocks, then finishes the work that had to wait for a data
/// lock (see the module docs): freeing the bytes of arrays closed while a kernel used them, and
/// copying arrays moved out of a workspace while a kernel used them.
pub(crate) struct Arena {
    guard: MutexGuard<'static, State>,
    /// The arena lock's place in the lock order (dropped after the guard).
    held: Held,
}

impl std::ops::Deref for Arena {
    type Target = State;
    #[inline]
    fn deref(&self) -> &State {
        &self.guard
    }
}

impl std::ops::DerefMut for Arena {
    #[inline]
    fn deref_mut(&mut self) -> &mut State {
        &mut self.guard
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        locks::set_under_arena(false);
        if self.guard.pending.is_empty() && !locks::outside_work_waiting() {
            return;
        }
        let pending = std::mem::take(&mut self.guard.pending);
        // The deferred work runs with the arena lock released (it waits for data locks, or for
        // a device: `locks::outside_arena`).
        self.held.release();
        MutexGuard::unlocked(&mut self.guard, || {
            for work in pending {
                work.finish();
            }
            locks::run_outside_work();
        });
    }
}

/// Locks the arena (first in the lock order: see `crate::locks`).
#[inline]
pub(crate) fn lock() -> Arena {
    let held = locks::acquire(Rank::Arena, 0);
    let guard = ARENA.lock();
    locks::set_under_arena(true);
    Arena { guard, held }
}

/// Work that waits for an array's data lock, done after the arena lock is released.
pub(crate) enum Deferred {
    /// Free the bytes of a closed array (once the kernel using them is done).
    Free(Arc<ArrayShared>),
    /// Copy an array's bytes into `to` and switch it over, unless a later move (`moves` no
    /// longer `seq`) superseded this one or the array was closed meanwhile.
    Relocate {
        array: Arc<ArrayShared>,
        to: Storage,
        seq: u64,
        ctx: Ctx,
    },
}

impl Deferred {
    fn finish(self) {
        match self {
            Deferred::Free(array) => {
                let held = locks::acquire(Rank::Data, Arc::as_ptr(&array) as usize);
                let storage = array.data.write().take();
                drop(held);
                drop(storage);
            }
            Deferred::Relocate {
                array,
                mut to,
                seq,
                ctx,
            } => {
                let failed = {
                    let _held = locks::acquire(Rank::Data, Arc::as_ptr(&array) as usize);
                    let mut data = array.data.write();
                    if array.moves.load(Ordering::Acquire) != seq {
                        return;
                    }
                    let copied = match data.as_ref() {
                        Some(old) => crate::backend::copy(&ctx, old, &mut to),
                        None => return,
                    };
                    match copied {
                        Ok(()) => {
                            let old = data.replace(to);
                            drop(data);
                            drop(old);
                            None
                        }
                        Err(e) => Some(e),
                    }
                };
                if let Some(e) = failed {
                    let mut state = lock();
                    if state.live_array(&array).is_some() {
                        state.remove_array(
                            array.key,
                            CloseReason::CopyFailed {
                                error: e.to_string(),
                            },
                        );
                    }
                }
            }
        }
    }
}

impl State {
    fn new() -> State {
        let mut managers = SlotMap::with_key();
        let id = next_manager_id();
        let system_key = managers.insert_with_key(|key| ManagerEntry {
            shared: Arc::new(ManagerShared {
                key,
                id,
                device: Device::Cpu,
                name: Mutex::new(Some(Arc::from("system"))),
                parent: None,
            }),
            parent: None,
            first_child: None,
            prev_sibling: None,
            next_sibling: None,
            arrays: ArrayList::default(),
            capped: false,
            alloc: None,
            cycle_of: None,
            workspaces: Vec::new(),
        });
        let system = Arc::clone(&managers[system_key].shared);
        observe::arena_created(Arc::clone(&system) as observe::Handle);
        State {
            arrays: SlotMap::with_key(),
            managers,
            workspaces: SlotMap::with_key(),
            system,
            detached: ArrayList::default(),
            pending: Vec::new(),
        }
    }

    /// The entry of `array` if it is open. Checks identity, not only the key: a closed array's
    /// slotmap slot is reused, and after its version wraps (2³¹ reuses, which a steady loop
    /// reaches) an old key would name another array.
    #[inline]
    pub fn live_array(&self, array: &ArrayShared) -> Option<&ArrayEntry> {
        self.arrays
            .get(array.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), array))
    }

    /// The entry of the manager `shared` if it is open (identity checked as for
    /// [`live_array`](Self::live_array)).
    #[inline]
    pub fn live_manager(&self, shared: &ManagerShared) -> Option<&ManagerEntry> {
        self.managers
            .get(shared.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), shared))
    }

    /// [`live_manager`](Self::live_manager), writable.
    #[inline]
    pub fn live_manager_mut(&mut self, shared: &ManagerShared) -> Option<&mut ManagerEntry> {
        self.managers
            .get_mut(shared.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), shared))
    }

    /// The live entry of an array, or its `ArrayClosed` error.
    #[inline]
    pub fn array(&self, array: &ArrayShared, ctx: &Ctx) -> Result<&ArrayEntry> {
        self.live_array(array)
            .ok_or_else(|| array.closed_error(ctx))
    }

    /// The live entry of a manager, or its `ManagerClosed` error.
    #[inline]
    pub fn manager(&self, shared: &ManagerShared, ctx: &Ctx) -> Result<&ManagerEntry> {
        self.live_manager(shared)
            .ok_or_else(|| manager_closed(shared, ctx))
    }

    /// The id of the manager `owner` names, or `NO_MANAGER` (detached, or no longer in the
    /// arena): how memory events name owners.
    pub fn owner_id(&self, owner: Owner) -> u64 {
        match owner {
            Owner::Manager(key) => self.managers.get(key).map_or(NO_MANAGER, |m| m.shared.id),
            Owner::Detached => NO_MANAGER,
        }
    }

    /// `'name' (m12)` of a live manager key.
    pub fn describe_manager(&self, key: ManagerKey) -> String {
        self.managers
            .get(key)
            .map_or_else(|| "a closed manager".to_string(), |m| m.shared.describe())
    }

    fn list_mut(&mut self, owner: Owner) -> &mut ArrayList {
        match owner {
            Owner::Manager(key) => &mut self.managers[key].arrays,
            Owner::Detached => &mut self.detached,
        }
    }

    /// Puts `key` at the head of its owner's list. The entry's `owner` must be set already.
    pub fn link(&mut self, key: ArrayKey) {
        let entry = &self.arrays[key];
        let owner = entry.owner;
        let bytes = entry.shared.nbytes();
        let list = self.list_mut(owner);
        let old_head = list.head.replace(key);
        list.len += 1;
        list.bytes += bytes;
        if let Some(old) = old_head {
            self.arrays[old].prev = Some(key);
        }
        let entry = &mut self.arrays[key];
        entry.prev = None;
        entry.next = old_head;
    }

    /// Takes `key` out of its owner's list.
    pub fn unlink(&mut self, key: ArrayKey) {
        let entry = &self.arrays[key];
        let (prev, next, owner) = (entry.prev, entry.next, entry.owner);
        let bytes = entry.shared.nbytes();
        if let Some(prev) = prev {
            self.arrays[prev].next = next;
        }
        if let Some(next) = next {
            self.arrays[next].prev = prev;
        }
        let list = self.list_mut(owner);
        if list.head == Some(key) {
            list.head = next;
        }
        list.len -= 1;
        list.bytes -= bytes;
        let entry = &mut self.arrays[key];
        entry.prev = None;
        entry.next = None;
    }

    /// Moves `key` to `owner`'s list.
    pub fn set_owner(&mut self, key: ArrayKey, owner: Owner) {
        self.unlink(key);
        self.arrays[key].owner = owner;
        self.link(key);
        if observe::on() {
            self.emit_attached(key);
        }
    }

    /// Inserts a new open array owned by `owner`.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_array(
        &mut self,
        shape: Shape,
        dtype: DType,
        device: Device,
        created_at: Site,
        buffer: Storage,
        owner: Owner,
        place: Place,
    ) -> Arc<ArrayShared> {
        let id = next_array_id();
        let key = self.arrays.insert_with_key(|key| ArrayEntry {
            shared: Arc::new(ArrayShared {
                key,
                id,
                shape,
                dtype,
                device,
                created_at,
                name: Mutex::new(None),
                closed: OnceLock::new(),
                moves: AtomicU64::new(0),
                data: RwLock::new(Some(buffer)),
            }),
            owner,
            returns: Vec::new(),
            prev: None,
            next: None,
            place,
        });
        self.link(key);
        memory::array_opened(device, self.arrays[key].shared.nbytes());
        if let Place::Block { cycle, .. } = place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.note_block_array(key, place);
            }
        }
        if observe::on() {
            self.emit_allocated(key);
        }
        Arc::clone(&self.arrays[key].shared)
    }

    /// Closes an array: takes it out of the arena, records why, and frees its bytes: now if no
    /// kernel holds its data lock, else once the kernel is done, after the arena lock is released
    /// (see the module docs).
    pub fn remove_array(&mut self, key: ArrayKey, reason: CloseReason) {
        self.unlink(key);
        let Some(entry) = self.arrays.remove(key) else {
            return;
        };
        if let Place::Block { cycle, .. } = entry.place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.forget_block_array(key, entry.place);
            }
        }
        memory::array_closed(entry.shared.device, entry.shared.nbytes());
        // The reason is set exactly once: the key was live until now.
        let _ = entry.shared.closed.set(reason);
        if observe::on() {
            self.emit_freed(&entry);
        }
        self.free_storage(entry.shared);
    }

    /// The memory event of the array `key` just created (off the hot path: called only while
    /// events are on).
    #[cold]
    #[inline(never)]
    fn emit_allocated(&self, key: ArrayKey) {
        let entry = &self.arrays[key];
        let array = &entry.shared;
        let address = array
            .data
            .try_read()
            .and_then(|data| data.as_ref().map(Storage::address))
            .unwrap_or(0);
        observe::emit(Event::ArrayAllocated {
            array: Arc::clone(array) as observe::Handle,
            device: array.device,
            bytes: array.nbytes(),
            manager: self.owner_id(entry.owner),
            address,
            span: entry.place.span(),
        });
    }

    /// The memory event of `entry`, just taken out of the arena.
    #[cold]
    #[inline(never)]
    fn emit_freed(&self, entry: &ArrayEntry) {
        let array = &entry.shared;
        observe::emit(Event::ArrayFreed {
            array: array.id,
            site: array.created_at,
            device: array.device,
            bytes: array.nbytes(),
            manager: self.owner_id(entry.owner),
            span: entry.place.span(),
        });
    }

    /// The memory event of the array `key`, which has a new owner.
    #[cold]
    #[inline(never)]
    fn emit_attached(&self, key: ArrayKey) {
        let entry = &self.arrays[key];
        let array = &entry.shared;
        observe::emit(Event::ArrayAttached {
            array: array.id,
            site: array.created_at,
            device: array.device,
            bytes: array.nbytes(),
            manager: self.owner_id(entry.owner),
        });
    }

    /// Frees a removed array's bytes now if its data lock is free, else after the arena lock is
    /// released.
    fn free_storage(&mut self, array: Arc<ArrayShared>) {
        let taken = array.data.try_write().map(|mut data| data.take());
        match taken {
            Some(storage) => drop(storage),
            None => self.pending.push(Deferred::Free(array)),
        }
    }
}

/// The `ManagerClosed` error for a manager.
pub(crate) fn manager_closed(shared: &ManagerShared, ctx: &Ctx) -> Error {
    Error::ManagerClosed {
        op: ctx.op,
        at: ctx.at,
        manager: shared.describe(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work that waits for a device (freeing page-locked memory synchronises it) queued under
    /// the arena lock runs right after the lock is released, on the same thread, never under it.
    #[test]
    fn work_for_outside_the_arena_lock_runs_after_it_is_released() {
        use std::sync::atomic::AtomicUsize;
        use std::sync::Arc;
        // 1: ran with the arena unlocked; 2: ran under it.
        let seen = Arc::new(AtomicUsize::new(0));
        let record = |seen: &Arc<AtomicUsize>| {
            let seen = Arc::clone(seen);
            move || {
                let under = locks::under_arena();
                seen.store(if under { 2 } else { 1 }, Ordering::SeqCst);
            }
        };
        {
            let _arena = lock();
            assert!(locks::under_arena());
            locks::outside_arena(record(&seen));
            assert_eq!(seen.load(Ordering::SeqCst), 0, "it waits for the release");
        }
        assert_eq!(
            seen.load(Ordering::SeqCst),
            1,
            "it ran once the lock was released"
        );
        // Outside the lock it runs at once.
        seen.store(0, Ordering::SeqCst);
        locks::outside_arena(record(&seen));
        assert_eq!(seen.load(Ordering::SeqCst), 1);
    }

    /// A handle whose key names a live entry that is not its own (what a stale handle looks like
    /// once its slotmap slot's version has wrapped around) is refused, for arrays and managers.
    #[test]
    fn a_reused_key_does_not_reach_another_entry() {
        let ctx = Ctx::new("test");
        let mut state = State::new();
        let owner = state.system.key;
        let storage = Storage::alloc(&ctx, Device::Cpu, 16).unwrap();
        let live = state.insert_array(
            Shape::new(&[4]),
            DType::F32,
            Device::Cpu,
            ctx.at,
            storage,
            Owner::Manager(owner),
            Place::Heap,
        );
        let stale = ArrayShared {
            key: live.key,
            id: u64::MAX,
            shape: Shape::new(&[4]),
            dtype: DType::F32,
            device: Device::Cpu,
            created_at: ctx.at,
            name: Mutex::new(None),
            closed: OnceLock::new(),
            moves: AtomicU64::new(0),
            data: RwLock::new(None),
        };
        assert!(state.array(&live, &ctx).is_ok());
        assert!(matches!(
            state.array(&stale, &ctx),
            Err(Error::ArrayClosed { .. })
        ));
        let manager = Arc::clone(&state.managers[owner].shared);
        let stale_manager = ManagerShared {
            key: owner,
            id: u64::MAX,
            device: Device::Cpu,
            name: Mutex::new(None),
            parent: None,
        };
        assert!(state.manager(&manager, &ctx).is_ok());
        assert!(matches!(
            state.manager(&stale_manager, &ctx),
            Err(Error::ManagerClosed { .. })
        ));
        state.remove_array(live.key, CloseReason::Discarded);
    }
}
