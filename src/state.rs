//! The state behind the arena lock: one [`State`] (every array, manager and workspace of the
//! process, in the arena's slot maps), the lock that guards it ([`lock`], the [`Arena`] guard)
//! and the work that waits for the lock's release ([`Deferred`]). Every change of ownership, every
//! array created or closed and every workspace cycle goes through a method here; other rooms read
//! entries through the accessors and never touch the maps.
//!
//! The methods come in sections: the lock and deferred work; creating and reading entries;
//! arrays; the manager tree; ownership moves; workspaces; workspace cycles; the errors decided
//! here.
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
//!
//! A closed array whose bytes were freed at once keeps its metadata (`ArrayShared`) in a short
//! list, and a new array reuses the newest of them if no handle holds it any more (`Arc::get_mut`
//! says so): a learned cycle's create + close then allocates nothing at all. A handle that is
//! still held keeps its array's shape, id and close reason: its metadata is never reused.

use std::sync::atomic::Ordering;
use std::sync::{Arc, LazyLock, OnceLock};

use parking_lot::{Mutex, MutexGuard};
use slotmap::SlotMap;

use crate::arena::{
    self, ArrayEntry, ArrayKey, ArrayList, ArrayShared, CloseReason, CycleTag, Lender,
    ManagerEntry, ManagerKey, ManagerShared, NewArray, Owner, Place, WorkspaceKey,
};
use crate::backend::contract::TransferOps;
use crate::backend::{AnyDevice, Storage};
use crate::error::{Ctx, Site};
use crate::locks::{self, Held, Rank};
use crate::memory;
use crate::observe::{self, Event, NO_MANAGER};
use crate::workspace::{
    align_up, Checkpoint, Plan, Workspace, WorkspaceConfig, WorkspaceEntry, WorkspaceShared,
    WorkspaceStats,
};
use crate::{DType, Device, Error, Result, Shape};

// ---------------------------------------------------------------------------------------------
// The lock, and the work that waits for its release
// ---------------------------------------------------------------------------------------------

/// Every array, manager and workspace of the process, behind the arena lock. The fields are
/// private: other rooms read entries through the accessors and change them through the methods
/// below, which keep the owners' lists, the counters and the memory events in step.
pub(crate) struct State {
    arrays: SlotMap<ArrayKey, ArrayEntry>,
    managers: SlotMap<ManagerKey, ManagerEntry>,
    workspaces: SlotMap<WorkspaceKey, WorkspaceEntry>,
    system: Arc<ManagerShared>,
    /// Arrays owned by nobody.
    detached: ArrayList,
    /// Work for [`Arena`]'s drop.
    pending: Vec<Deferred>,
    /// The metadata of recently closed arrays, newest last, for new arrays to reuse once their
    /// last handle is gone (see [`State::insert_array`]); at most [`SPARE_ARRAYS`].
    spare: Vec<Arc<ArrayShared>>,
}

/// How many closed arrays' metadata the arena keeps for reuse: enough for the arrays a cycle
/// closes at once, little memory (a few hundred bytes each, their bytes already freed).
const SPARE_ARRAYS: usize = 256;

/// The arena lock and the state it guards (taken through [`lock`] only).
static ARENA: LazyLock<Mutex<State>> = LazyLock::new(|| Mutex::new(State::new()));

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
        let queued = locks::leave_arena();
        if self.guard.pending.is_empty() && !queued {
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

/// Work a layer above registers to run before a manager closes (see [`before_close`]).
static BEFORE_CLOSE: OnceLock<fn()> = OnceLock::new();

/// Registers `f` to run on the closing thread before any manager closes (once; later calls
/// change nothing). Autograd settles the thread's pending weight gradients there, while the
/// arrays they read are still open.
pub(crate) fn set_before_close(f: fn()) {
    let _ = BEFORE_CLOSE.set(f);
}

/// Runs the registered work before a manager closes, with no lock held.
#[inline]
pub(crate) fn before_close() {
    if let Some(f) = BEFORE_CLOSE.get() {
        f();
    }
}

/// Locks the arena (first in the lock order: see `crate::locks`).
#[inline]
pub(crate) fn lock() -> Arena {
    let held = locks::acquire(Rank::Arena, 0);
    let guard = ARENA.lock();
    locks::enter_arena();
    Arena { guard, held }
}

/// Work that waits for an array's data lock, done after the arena lock is released.
enum Deferred {
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
                        Some(old) => {
                            let _noted = (old.note_locked(false), to.note_locked(true));
                            AnyDevice::copy(&ctx, old, &mut to)
                        }
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
                            array.key(),
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

// ---------------------------------------------------------------------------------------------
// Creating the state, and reading entries
// ---------------------------------------------------------------------------------------------

impl State {
    fn new() -> State {
        let mut managers = SlotMap::with_key();
        let id = arena::next_manager_id();
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
            spare: Vec::new(),
        }
    }

    /// The system manager (the root of the tree; never closed).
    #[inline]
    pub fn system(&self) -> &Arc<ManagerShared> {
        &self.system
    }

    /// The entry of the open array `key` (a key read from a live entry: a list, an owner).
    #[inline]
    pub fn array_entry(&self, key: ArrayKey) -> &ArrayEntry {
        &self.arrays[key]
    }

    /// The entry of the open manager `key` (a key read from a live entry).
    #[inline]
    pub fn manager_entry(&self, key: ManagerKey) -> &ManagerEntry {
        &self.managers[key]
    }

    /// The arrays owned by nobody.
    #[inline]
    pub fn detached(&self) -> &ArrayList {
        &self.detached
    }

    /// Every open array, in no particular order.
    pub fn arrays(&self) -> impl Iterator<Item = &ArrayEntry> {
        self.arrays.values()
    }

    /// Every open manager, in no particular order.
    pub fn managers(&self) -> impl Iterator<Item = &ManagerEntry> {
        self.managers.values()
    }

    /// Every live workspace, in no particular order.
    pub fn workspaces(&self) -> impl Iterator<Item = &WorkspaceEntry> {
        self.workspaces.values()
    }

    /// The workspace `key` if it is live.
    #[inline]
    pub fn workspace_entry(&self, key: WorkspaceKey) -> Option<&WorkspaceEntry> {
        self.workspaces.get(key)
    }

    /// The entry of `array` if it is open. Checks identity, not only the key: a closed array's
    /// slotmap slot is reused, and after its version wraps (2³¹ reuses, which a steady loop
    /// reaches) an old key would name another array.
    #[inline]
    pub fn live_array(&self, array: &ArrayShared) -> Option<&ArrayEntry> {
        self.arrays
            .get(array.key())
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
            .ok_or_else(|| arena::manager_closed(shared, ctx))
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
    fn describe_manager(&self, key: ManagerKey) -> String {
        self.managers
            .get(key)
            .map_or_else(|| "a closed manager".to_string(), |m| m.shared.describe())
    }
}

// ---------------------------------------------------------------------------------------------
// Arrays: the owners' lists, creating and closing
// ---------------------------------------------------------------------------------------------

/// Storage for a new array, and where it lives.
pub(crate) struct Allocation {
    pub buffer: Storage,
    pub place: Place,
    /// The array's bytes (checked by `crate::shape::check`), which `buffer` holds.
    pub bytes: usize,
}

impl State {
    fn list_mut(&mut self, owner: Owner) -> &mut ArrayList {
        match owner {
            Owner::Manager(key) => &mut self.managers[key].arrays,
            Owner::Detached => &mut self.detached,
        }
    }

    /// Puts `key` at the head of its owner's list. The entry's `owner` must be set already.
    #[inline]
    fn link(&mut self, key: ArrayKey) {
        let entry = &self.arrays[key];
        let (owner, bytes) = (entry.owner, entry.shared.nbytes());
        let next = self.list_mut(owner).head;
        let entry = &mut self.arrays[key];
        entry.prev = None;
        entry.next = next;
        self.link_neighbours(key, (next, owner), bytes);
    }

    /// Makes `key`, whose entry already links to `next` (the head of `owner`'s list), the head:
    /// rewrites the list and the old head (not the entry: `insert_array` made it so).
    #[inline]
    fn link_neighbours(
        &mut self,
        key: ArrayKey,
        (next, owner): (Option<ArrayKey>, Owner),
        bytes: usize,
    ) {
        let list = self.list_mut(owner);
        list.head = Some(key);
        list.len += 1;
        list.bytes += bytes;
        if let Some(next) = next {
            self.arrays[next].prev = Some(key);
        }
    }

    /// Takes `key` out of its owner's list.
    #[inline]
    fn unlink(&mut self, key: ArrayKey) {
        let entry = &mut self.arrays[key];
        let links = (entry.prev.take(), entry.next.take(), entry.owner);
        let bytes = entry.shared.nbytes();
        self.unlink_neighbours(key, links, bytes);
    }

    /// Takes `key`, whose links were `(prev, next, owner)`, out of its owner's list by
    /// rewriting its neighbours and the list (not its entry: `remove_array` has removed it).
    #[inline]
    fn unlink_neighbours(
        &mut self,
        key: ArrayKey,
        (prev, next, owner): (Option<ArrayKey>, Option<ArrayKey>, Owner),
        bytes: usize,
    ) {
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

    /// Inserts a new open array `array`, with its storage, owned by `owner`.
    #[inline(always)]
    pub fn insert_array(
        &mut self,
        array: NewArray,
        allocation: Allocation,
        owner: Owner,
    ) -> Arc<ArrayShared> {
        let device = array.device;
        let Allocation {
            buffer,
            place,
            bytes,
        } = allocation;
        let id = arena::next_array_id();
        // The newest closed array's metadata, if nothing else holds it any more, is reused in
        // place (one still held stays with its holders: the last of them frees it). Either way
        // it is made before its entry and given its key once inserted: the slot then takes a
        // small value, not the metadata's fields through a closure (measured: ~10 ns less).
        let placeholder = ArrayKey::default();
        let data = Some(buffer);
        let shared = match self.spare.pop() {
            Some(mut spare) => match Arc::get_mut(&mut spare) {
                Some(reused) => {
                    reused.renew(id, array, bytes, data);
                    spare
                }
                None => Arc::new(ArrayShared::new(placeholder, id, array, bytes, data)),
            },
            None => Arc::new(ArrayShared::new(placeholder, id, array, bytes, data)),
        };
        // Inserted at the head of its owner's list, linked to the old head as it is made.
        let next = self.list_mut(owner).head;
        let key = self.arrays.insert_with_key(|_| ArrayEntry {
            shared,
            owner,
            returns: Vec::new(),
            prev: None,
            next,
            place,
        });
        self.arrays[key].shared.set_key(key);
        self.link_neighbours(key, (next, owner), bytes);
        memory::array_opened(device, bytes);
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
        let Some(entry) = self.arrays.remove(key) else {
            return;
        };
        let links = (entry.prev, entry.next, entry.owner);
        self.unlink_neighbours(key, links, entry.shared.nbytes());
        if let Place::Block { cycle, .. } = entry.place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.forget_block_array(key, entry.place);
            }
        }
        memory::array_closed(entry.shared.device, entry.shared.nbytes());
        // The reason is set exactly once: the key was live until now.
        // SAFETY: `&mut self` is the state the array lives in.
        unsafe { entry.shared.closed.set(reason) };
        if observe::on() {
            self.emit_freed(&entry);
        }
        if let Some(freed) = self.free_storage(entry.shared) {
            if self.spare.len() < SPARE_ARRAYS {
                self.spare.push(freed);
            }
        }
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

    /// Frees a removed array's bytes now if its data lock is free (and gives the array back,
    /// for [`SPARE_ARRAYS`]), else after the arena lock is released.
    fn free_storage(&mut self, array: Arc<ArrayShared>) -> Option<Arc<ArrayShared>> {
        // Dropped in place, under the data lock (moving the storage out first cost more).
        let freed = match array.data.try_write() {
            Some(mut data) => {
                *data = None;
                true
            }
            None => false,
        };
        if freed {
            Some(array)
        } else {
            self.pending.push(Deferred::Free(array));
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Managers: the tree
// ---------------------------------------------------------------------------------------------

impl State {
    /// A new open child of `parent` on `device`. It inherits the parent's workspace cycle (so a
    /// sub-scope of a cycle allocates from the same block), but not its cap.
    pub fn add_manager(
        &mut self,
        ctx: &Ctx,
        parent: ManagerKey,
        device: Device,
    ) -> Result<Arc<ManagerShared>> {
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        let parent_entry = self
            .managers
            .get(parent)
            .ok_or_else(|| ctx.invalid("parent manager vanished"))?;
        let parent_shared = Arc::clone(&parent_entry.shared);
        let alloc = parent_entry.alloc;
        let old_first = parent_entry.first_child;
        let id = arena::next_manager_id();
        let key = self.managers.insert_with_key(|key| ManagerEntry {
            shared: Arc::new(ManagerShared {
                key,
                id,
                device,
                name: Mutex::new(None),
                parent: Some(parent_shared),
            }),
            parent: Some(parent),
            first_child: None,
            prev_sibling: None,
            next_sibling: old_first,
            arrays: ArrayList::default(),
            capped: false,
            alloc,
            cycle_of: None,
            workspaces: Vec::new(),
        });
        if let Some(old) = old_first {
            self.managers[old].prev_sibling = Some(key);
        }
        self.managers[parent].first_child = Some(key);
        let shared = Arc::clone(&self.managers[key].shared);
        if observe::on() {
            observe::emit(Event::ManagerOpened {
                manager: Arc::clone(&shared) as observe::Handle,
                id: shared.id,
                device: shared.device,
            });
        }
        Ok(shared)
    }

    /// Caps the manager `shared` if it is open (`Manager::cap`).
    pub fn cap(&mut self, shared: &ManagerShared) {
        if let Some(m) = self
            .managers
            .get_mut(shared.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), shared))
        {
            m.capped = true;
        }
    }

    /// The open children of `key`, newest first.
    pub fn children_of(&self, key: ManagerKey) -> Vec<ManagerKey> {
        let mut out = Vec::new();
        let mut child = self.managers.get(key).and_then(|m| m.first_child);
        while let Some(c) = child {
            out.push(c);
            child = self.managers[c].next_sibling;
        }
        out
    }

    /// `key` and all its descendants, each before its own descendants.
    fn subtree(&self, key: ManagerKey) -> Vec<ManagerKey> {
        let mut order = vec![key];
        let mut i = 0;
        while i < order.len() {
            let children = self.children_of(order[i]);
            order.extend(children);
            i += 1;
        }
        order
    }

    /// Whether `key` is `ancestor` or one of its descendants.
    fn is_within(&self, mut key: ManagerKey, ancestor: ManagerKey) -> bool {
        loop {
            if key == ancestor {
                return true;
            }
            match self.managers.get(key).and_then(|m| m.parent) {
                Some(parent) => key = parent,
                None => return false,
            }
        }
    }

    /// Closes `key` and its subtree, children first. Each manager frees the arrays it owns and
    /// gives each borrowed array back to the manager it came from (or closes it if that one is
    /// closed already), frees its workspaces and, if it is a workspace cycle, ends the cycle.
    ///
    /// The subtree closes as one: a lender that is closing in the same call is passed over, and
    /// the array goes back to the nearest lender outside the subtree (or is closed if there is
    /// none). So the outcome never depends on the order in which siblings were created.
    pub fn close_manager(&mut self, ctx: &Ctx, key: ManagerKey) {
        if !self.managers.contains_key(key) {
            return;
        }
        let order = self.subtree(key);
        // The managers closing in this call, by identity (a lender's key alone could name a
        // newer manager in a reused slot).
        let mut closing: Vec<usize> = order
            .iter()
            .map(|&k| Arc::as_ptr(&self.managers[k].shared) as usize)
            .collect();
        closing.sort_unstable();
        for manager in order.into_iter().rev() {
            self.close_one(ctx, manager, &closing);
        }
    }

    fn close_one(&mut self, ctx: &Ctx, key: ManagerKey, closing: &[usize]) {
        let cycle_of = self.managers[key].cycle_of;
        let shared = Arc::clone(&self.managers[key].shared);
        while let Some(array) = self.managers[key].arrays.head {
            let name = Arc::clone(&shared);
            // Lenders closing in this same call are passed over; if all are, the array goes
            // down with its original owner, the last one passed over.
            let mut original: Option<(ManagerKey, Arc<ManagerShared>)> = None;
            let back = loop {
                match self.arrays[array].returns.pop() {
                    Some(Lender {
                        owner: Owner::Manager(lender),
                        shared: Some(shared),
                    }) if closing
                        .binary_search(&(Arc::as_ptr(&shared) as usize))
                        .is_ok() =>
                    {
                        original = Some((lender, shared));
                    }
                    other => break other,
                }
            };
            match back {
                Some(lender) if self.lender_is_open(&lender) => {
                    self.return_borrowed(ctx, array, lender, name);
                }
                Some(lender) => {
                    self.remove_array(
                        array,
                        CloseReason::ReturnTargetClosed {
                            borrower: name,
                            original: lender.describe(),
                        },
                    );
                }
                None => {
                    let (owner, shared) = original.unwrap_or((key, name));
                    let reason = self.closing_reason(owner, shared);
                    self.remove_array(array, reason);
                }
            }
        }
        let workspaces = std::mem::take(&mut self.managers[key].workspaces);
        for ws in workspaces {
            self.destroy_workspace(ctx, ws);
        }
        if let Some(ws) = cycle_of {
            self.end_cycle(ctx, ws);
        }
        // Unlink from the parent's children.
        let entry = &self.managers[key];
        let (parent, prev, next) = (entry.parent, entry.prev_sibling, entry.next_sibling);
        if let Some(prev) = prev {
            self.managers[prev].next_sibling = next;
        } else if let Some(parent) = parent {
            self.managers[parent].first_child = next;
        }
        if let Some(next) = next {
            self.managers[next].prev_sibling = prev;
        }
        if observe::on() {
            observe::emit(Event::ManagerClosed {
                id: shared.id,
                device: shared.device,
            });
        }
        self.managers.remove(key);
    }

    /// Why an array owned by `key` (closing now) is closed: its workspace cycle ended, or its
    /// manager closed.
    fn closing_reason(&self, key: ManagerKey, shared: Arc<ManagerShared>) -> CloseReason {
        let cycle = self.managers.get(key).and_then(|m| m.cycle_of);
        match cycle.and_then(|ws| self.workspaces.get(ws)) {
            Some(ws) => CloseReason::CycleEnded {
                workspace: Arc::clone(&ws.shared.name),
                cycle: ws.open.map_or(0, |tag| tag.generation),
                manager: shared,
            },
            None => CloseReason::ManagerClosed { manager: shared },
        }
    }

    /// Whether the owner an array goes back to still exists (by identity: its key may have
    /// been reused).
    fn lender_is_open(&self, lender: &Lender) -> bool {
        match (lender.owner, &lender.shared) {
            (Owner::Manager(_), Some(shared)) => self.live_manager(shared).is_some(),
            (Owner::Manager(_), None) => false,
            (Owner::Detached, _) => true,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Ownership moves: attach, temp_attach (borrow), detach, ret, and giving borrowed arrays back
// ---------------------------------------------------------------------------------------------

/// The kinds of move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    Attach,
    TempAttach,
    Detach,
    Ret,
}

/// What one array of a move needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ArrayMove {
    /// Already where it should be.
    Stay,
    /// Becomes owned by the target; any pending return is cancelled.
    Own,
    /// Borrowed by the target; goes back to its current owner when the target closes.
    Borrow,
}

impl State {
    /// Whether moving `key` to `target` must copy its bytes out of a workspace cycle: they live in
    /// an open cycle's block and the target is not inside that cycle's scope, or they are a
    /// survivor of a circular workspace's ended cycle (which the buffer will overwrite when it
    /// comes round: moved to another owner, it is copied out so that the move keeps it, as
    /// ND4J's `detach`). `ret` out of an open circular cycle is zero-copy.
    fn copy_needed(&self, key: ArrayKey, target: Owner, kind: Move) -> bool {
        let Place::Block { cycle, block, .. } = self.arrays[key].place else {
            return false;
        };
        let Some(ws) = self.workspaces.get(cycle.ws) else {
            return false;
        };
        if ws.open != Some(cycle) {
            return ws.survivor_must_move(block);
        }
        match target {
            Owner::Detached => true,
            Owner::Manager(m) => {
                !(self.is_within(m, cycle.scope) || (kind == Move::Ret && ws.ret_in_place()))
            }
        }
    }

    /// Moves `arrays` to `target` (with `target_shared` naming it), all or nothing.
    pub fn move_arrays(
        &mut self,
        ctx: &Ctx,
        arrays: &[&ArrayShared],
        target: Owner,
        target_shared: Option<&Arc<ManagerShared>>,
        kind: Move,
    ) -> Result<()> {
        // 1. The target.
        let mut target_capped = false;
        if let (Owner::Manager(_), Some(shared)) = (target, target_shared) {
            let entry = self.manager(shared, ctx)?;
            target_capped = entry.capped;
            if kind == Move::TempAttach && shared.key == self.system.key {
                return Err(ctx.system("the system manager cannot borrow arrays"));
            }
        }
        // 2. Each array, checked before anything moves.
        let mut plan: Vec<(ArrayKey, ArrayMove)> = Vec::with_capacity(arrays.len());
        // The arrays that need a copy, in plan order (their metadata outlives their entries).
        let mut to_copy: Vec<&ArrayShared> = Vec::new();
        for array in arrays {
            let entry = self.array(array, ctx)?;
            let key = array.key();
            if plan.iter().any(|(k, _)| *k == key) {
                continue;
            }
            let step = match kind {
                // Attaching to the manager that already holds it (owning or borrowing) changes
                // nothing: a borrowed array stays borrowed and will still go back.
                Move::Attach | Move::Ret if entry.owner == target => ArrayMove::Stay,
                Move::Attach | Move::Ret => {
                    if let (true, Some(shared)) = (target_capped, target_shared) {
                        let what = format!("array {} would be attached to it", array.describe());
                        return Err(capped(ctx, shared, what));
                    }
                    ArrayMove::Own
                }
                Move::TempAttach if entry.owner == target => ArrayMove::Stay,
                Move::TempAttach => ArrayMove::Borrow,
                Move::Detach if entry.owner == Owner::Detached && !entry.is_borrowed() => {
                    ArrayMove::Stay
                }
                Move::Detach => ArrayMove::Own,
            };
            if step != ArrayMove::Stay && self.copy_needed(key, target, kind) {
                to_copy.push(array);
            }
            plan.push((key, step));
        }
        // 3. Storage for the copies; undone in full if one fails.
        let checkpoint = self.target_checkpoint(target);
        let mut copies: Vec<(ArrayKey, Allocation)> = Vec::new();
        for array in to_copy {
            // A copy made for an earlier array of this move may take the place of this one (a
            // circular cycle's block wraps over the survivors of its ended cycles): it is closed
            // then, its copy is still made (the ring's space is spent as for any allocation),
            // and the commit below skips it as it skips any array gone.
            let key = array.key();
            match self.allocate(ctx, target, &array.shape, array.dtype, array.device) {
                Ok(allocation) => copies.push((key, allocation)),
                Err(e) => {
                    drop(copies);
                    self.restore_target(target, checkpoint);
                    return Err(e);
                }
            }
        }
        // 4. Commit: nothing below fails.
        for (key, allocation) in copies {
            if self.arrays.contains_key(key) {
                self.relocate(ctx, key, allocation);
            }
        }
        for (key, step) in plan {
            if !self.arrays.contains_key(key) {
                continue;
            }
            match step {
                ArrayMove::Stay => {}
                ArrayMove::Own => {
                    self.arrays[key].returns.clear();
                    self.set_owner(key, target);
                }
                ArrayMove::Borrow => {
                    let current = self.arrays[key].owner;
                    let shared = match current {
                        Owner::Manager(m) => Some(Arc::clone(&self.managers[m].shared)),
                        Owner::Detached => None,
                    };
                    self.arrays[key].returns.push(Lender {
                        owner: current,
                        shared,
                    });
                    self.set_owner(key, target);
                }
            }
        }
        Ok(())
    }

    fn target_checkpoint(&self, target: Owner) -> Option<Checkpoint> {
        let Owner::Manager(m) = target else {
            return None;
        };
        let cycle = self.managers.get(m)?.alloc?;
        Some(self.workspaces.get(cycle.ws)?.checkpoint())
    }

    fn restore_target(&mut self, target: Owner, checkpoint: Option<Checkpoint>) {
        let (Owner::Manager(m), Some(checkpoint)) = (target, checkpoint) else {
            return;
        };
        if let Some(cycle) = self.managers.get(m).and_then(|e| e.alloc) {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.restore(checkpoint);
            }
        }
    }

    /// Moves an array's bytes to new storage (out of a workspace cycle): the bookkeeping now,
    /// the copy now too if no kernel holds the array's data lock, else after the arena lock is
    /// released (see the module docs). Until the copy is done the old bytes stay in use, and
    /// their workspace hands out no part of its block. A device that fails the copy (a broken
    /// CUDA context) closes the array, saying so.
    fn relocate(&mut self, ctx: &Ctx, key: ArrayKey, allocation: Allocation) {
        let Allocation {
            buffer: mut to,
            place,
            ..
        } = allocation;
        let entry = &mut self.arrays[key];
        let array = Arc::clone(&entry.shared);
        let old_place = std::mem::replace(&mut entry.place, place);
        if let Place::Block { cycle, .. } = old_place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.forget_block_array(key, old_place);
            }
        }
        if let Place::Block { cycle, .. } = place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.note_block_array(key, place);
            }
        }
        if observe::on() {
            let entry = &self.arrays[key];
            let array = &entry.shared;
            observe::emit(Event::ArrayRelocated {
                array: array.id,
                site: array.created_at,
                device: array.device,
                bytes: array.nbytes(),
                manager: self.owner_id(entry.owner),
                address: to.address(),
                from: old_place.span(),
                to: entry.place.span(),
            });
        }
        let seq = array.moves.fetch_add(1, Ordering::AcqRel) + 1;
        let Some(mut data) = array.data.try_write() else {
            self.pending.push(Deferred::Relocate {
                array: Arc::clone(&array),
                to,
                seq,
                ctx: *ctx,
            });
            return;
        };
        let copied = match data.as_ref() {
            Some(old) => {
                let _noted = (old.note_locked(false), to.note_locked(true));
                AnyDevice::copy(ctx, old, &mut to)
            }
            None => Ok(()),
        };
        let old = if copied.is_ok() {
            data.replace(to)
        } else {
            None
        };
        drop(data);
        drop(old);
        if let Err(e) = copied {
            self.remove_array(
                key,
                CloseReason::CopyFailed {
                    error: e.to_string(),
                },
            );
        }
    }

    /// Gives a borrowed array back to `lender` as its borrower `borrower` closes (bypassing any
    /// cap), copying it out of the borrower's workspace cycle if it was copied in.
    fn return_borrowed(
        &mut self,
        ctx: &Ctx,
        key: ArrayKey,
        lender: Lender,
        borrower: Arc<ManagerShared>,
    ) {
        if self.copy_needed(key, lender.owner, Move::Attach) {
            let array = Arc::clone(&self.arrays[key].shared);
            match self.allocate(ctx, lender.owner, &array.shape, array.dtype, array.device) {
                Ok(allocation) => {
                    self.relocate(ctx, key, allocation);
                    if !self.arrays.contains_key(key) {
                        return;
                    }
                }
                Err(e) => {
                    self.remove_array(
                        key,
                        CloseReason::ReturnCopyFailed {
                            borrower,
                            original: lender.describe(),
                            error: e.to_string(),
                        },
                    );
                    return;
                }
            }
        }
        self.set_owner(key, lender.owner);
    }
}

// ---------------------------------------------------------------------------------------------
// Workspaces: creating, destroying, allocating from their blocks
// ---------------------------------------------------------------------------------------------

impl State {
    /// The entry of the workspace `shared` if it exists (identity checked, as for arrays).
    pub fn live_workspace(&self, shared: &WorkspaceShared) -> Option<&WorkspaceEntry> {
        self.workspaces
            .get(shared.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), shared))
    }

    fn workspace_mut(
        &mut self,
        ctx: &Ctx,
        shared: &WorkspaceShared,
    ) -> Result<&mut WorkspaceEntry> {
        if self.live_workspace(shared).is_some() {
            return Ok(&mut self.workspaces[shared.key]);
        }
        if self.live_manager(&shared.owner).is_none() {
            return Err(arena::manager_closed(&shared.owner, ctx));
        }
        Err(ctx.invalid(format!("workspace '{}' was destroyed", shared.name)))
    }

    /// `Manager::workspace`: the named workspace of `owner`, created on first use.
    pub fn workspace(
        &mut self,
        ctx: &Ctx,
        owner: &Arc<ManagerShared>,
        name: &str,
        config: WorkspaceConfig,
    ) -> Result<Workspace> {
        let entry = self.manager(owner, ctx)?;
        for &key in &entry.workspaces {
            let ws = &self.workspaces[key];
            if &*ws.shared.name == name {
                if ws.shared.config == config {
                    return Ok(Workspace(Arc::clone(&ws.shared)));
                }
                return Err(ctx.config(format!(
                    "workspace '{name}' of manager {} exists with another configuration \
                     ({:?}); asked for {:?}. Use another name, or destroy it first",
                    owner.describe(),
                    ws.shared.config,
                    config
                )));
            }
        }
        let mut entry = WorkspaceEntry::new(ctx, owner, name, config)?;
        let key = self.workspaces.insert_with_key(|key| {
            // The key is only known now; the shared part is not yet visible to anyone.
            let shared = Arc::get_mut(&mut entry.shared).map(|s| s.key = key);
            debug_assert!(shared.is_some());
            entry
        });
        self.managers[owner.key].workspaces.push(key);
        Ok(Workspace(Arc::clone(&self.workspaces[key].shared)))
    }

    /// `Workspace::initialize`: sizes the block of the workspace `shared` now.
    pub fn initialize_workspace(&mut self, ctx: &Ctx, shared: &WorkspaceShared) -> Result<()> {
        self.workspace_mut(ctx, shared)?.initialize(ctx)
    }

    /// Makes the workspace `shared` keep the open arrays of earlier cycles (see
    /// `Workspace::keep_open_arrays`).
    pub fn keep_open_arrays(&mut self, ctx: &Ctx, shared: &WorkspaceShared) -> Result<()> {
        self.workspace_mut(ctx, shared)?.keep_open_arrays();
        Ok(())
    }

    /// The keys of the live workspaces created on the thread `creator`.
    pub fn workspaces_created_by(&self, creator: std::thread::ThreadId) -> Vec<WorkspaceKey> {
        self.workspaces
            .iter()
            .filter(|(_, ws)| ws.shared.creator == creator)
            .map(|(key, _)| key)
            .collect()
    }

    /// Frees a workspace: its open cycle, the arrays in its block, the block.
    pub fn destroy_workspace(&mut self, ctx: &Ctx, key: WorkspaceKey) {
        let Some(ws) = self.workspaces.get(key) else {
            return;
        };
        if let Some(open) = ws.open {
            self.close_manager(ctx, open.scope);
        }
        let Some(ws) = self.workspaces.get(key) else {
            return;
        };
        let name = Arc::clone(&ws.shared.name);
        let survivors = ws.block_array_keys();
        for array in survivors {
            if self.arrays.contains_key(array) {
                self.remove_array(
                    array,
                    CloseReason::WorkspaceDestroyed {
                        workspace: Arc::clone(&name),
                    },
                );
            }
        }
        if let Some(ws) = self.workspaces.remove(key) {
            *ws.shared.final_stats.lock() = Some(WorkspaceStats {
                capacity: 0,
                used: 0,
                initialized: false,
                ..ws.stats()
            });
            if let Some(owner) = self.managers.get_mut(ws.owner) {
                owner.workspaces.retain(|&k| k != key);
            }
        }
    }

    /// Storage for a new `shape`/`dtype` array landing in `owner`: from the block of the
    /// workspace cycle the owner allocates from, else its own zeroed buffer. Checks the memory
    /// limit; changes nothing on error.
    #[inline(always)]
    pub fn allocate(
        &mut self,
        ctx: &Ctx,
        owner: Owner,
        shape: &Shape,
        dtype: DType,
        device: Device,
    ) -> Result<Allocation> {
        let bytes = crate::shape::check(ctx, shape, dtype)?;
        let heap = |ctx: &Ctx| -> Result<Allocation> {
            Ok(Allocation {
                buffer: Storage::alloc(ctx, device, bytes)?,
                place: Place::Heap,
                bytes,
            })
        };
        let cycle = match owner {
            Owner::Manager(m) => self.managers[m].alloc,
            Owner::Detached => None,
        };
        let Some(cycle) = cycle else {
            return heap(ctx);
        };
        let Some(ws) = self.workspaces.get(cycle.ws) else {
            return heap(ctx);
        };
        if ws.open != Some(cycle) || ws.device != device || bytes == 0 {
            return heap(ctx);
        }
        let aligned = align_up(bytes).ok_or_else(|| ctx.invalid("allocation size overflows"))?;
        let mut plan = ws.plan(ctx, aligned)?;
        if let Plan::Block { offset, .. } = plan {
            // A circular workspace reuses the bytes of arrays kept from earlier cycles: they are
            // closed now ("overwritten"). One that a kernel is using right now cannot be, so the
            // allocation spills instead. (If this allocation belongs to a move that is then
            // refused, they stay closed: they were only kept until the buffer came round.)
            // (Only a circular workspace tracks where its arrays lie: any other finds none, and
            // skips the eviction.)
            let evict = ws.overlapping(offset, aligned);
            if !evict.is_empty() {
                let name = Arc::clone(&ws.shared.name);
                // A ring that keeps its open arrays (the prefetcher's) spills rather than evict.
                if ws.keeps_open_arrays() || !self.evict(&evict, &name, ctx.at) {
                    plan = Plan::Spill;
                }
            }
        }
        let ws = &mut self.workspaces[cycle.ws];
        match plan {
            Plan::Block { offset, wrap } => {
                let block = ws
                    .block
                    .as_ref()
                    .ok_or_else(|| ctx.invalid("workspace block vanished"))?;
                // SAFETY: `plan` placed `[offset, offset + aligned)` clear of the open cycle's
                // arrays; the older arrays there were closed just now, with their bytes freed
                // (`evict` refused arrays in use), and no closed array's bytes are still held
                // (`plan` checks), so the range belongs to this array alone.
                let Some(buffer) = (unsafe { block.carve(offset, bytes) }) else {
                    return Err(ctx.invalid("workspace slice outside its block"));
                };
                let block = block.id();
                ws.commit(Plan::Block { offset, wrap }, aligned);
                Ok(Allocation {
                    buffer,
                    place: Place::Block {
                        cycle,
                        offset,
                        len: aligned,
                        block,
                    },
                    bytes,
                })
            }
            plan @ (Plan::Spill | Plan::Bypass) => {
                let allocation = heap(ctx)?;
                if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                    ws.commit(plan, aligned);
                    if plan == Plan::Spill {
                        // The scope's id is only recorded: looked up only while recording.
                        let scope = observe::on()
                            .then(|| self.managers.get(cycle.scope).map(|m| m.shared.id))
                            .flatten();
                        ws.spilled(scope, aligned, ctx.at);
                    }
                }
                Ok(allocation)
            }
        }
    }

    /// Closes the arrays `keys` that an allocation of circular workspace `workspace` overwrites,
    /// freeing their bytes now. If a kernel holds the data lock of any of them, closes none and
    /// returns `false`.
    fn evict(&mut self, keys: &[ArrayKey], workspace: &Arc<str>, at: Site) -> bool {
        let arrays: Vec<Arc<ArrayShared>> = keys
            .iter()
            .filter_map(|&k| self.arrays.get(k).map(|e| Arc::clone(&e.shared)))
            .collect();
        let mut guards = Vec::with_capacity(arrays.len());
        for array in &arrays {
            match array.data.try_write() {
                Some(guard) => guards.push(guard),
                None => return false,
            }
        }
        let reason = CloseReason::Overwritten {
            workspace: Arc::clone(workspace),
            at,
        };
        for (array, mut guard) in arrays.iter().zip(guards) {
            // Closed (with its reason) before its bytes go, so a reader that comes next sees why.
            // SAFETY: `&mut self` is the state the array lives in.
            unsafe { array.closed.set(reason.clone()) };
            let storage = guard.take();
            drop(guard);
            drop(storage);
            self.remove_array(array.key(), reason.clone());
        }
        true
    }

    /// The stats of the workspaces owned by `manager`, with their names.
    pub fn workspace_stats_of(&self, manager: ManagerKey) -> Vec<(String, WorkspaceStats)> {
        self.managers.get(manager).map_or_else(Vec::new, |m| {
            m.workspaces
                .iter()
                .filter_map(|&k| self.workspaces.get(k))
                .map(|ws| (ws.shared.name.to_string(), ws.stats()))
                .collect()
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Workspace cycles: a cycle is a sub-manager of the workspace's owner
// ---------------------------------------------------------------------------------------------

impl State {
    /// `Workspace::open`: a new cycle of the workspace `shared`, as a new sub-manager of its owner
    /// (the manager layer wraps it in a `Scope`).
    pub fn open_cycle(
        &mut self,
        ctx: &Ctx,
        shared: &WorkspaceShared,
    ) -> Result<Arc<ManagerShared>> {
        let ws = self.workspace_mut(ctx, shared)?;
        if let Some(open) = ws.open {
            let cycle = self.describe_manager(open.scope);
            return Err(Error::WorkspaceBusy {
                op: ctx.op,
                at: ctx.at,
                workspace: shared.name.to_string(),
                cycle,
            });
        }
        let generation = ws.next_generation();
        let (owner, device) = (ws.owner, ws.device);
        let name = format!("{}#{generation}", shared.name);
        let manager = self.add_manager(ctx, owner, device)?;
        *manager.name.lock() = Some(Arc::from(name.as_str()));
        let key = manager.key;
        let tag = CycleTag {
            ws: shared.key,
            generation,
            scope: key,
        };
        let entry = &mut self.managers[key];
        entry.alloc = Some(tag);
        entry.cycle_of = Some(shared.key);
        self.workspaces[shared.key].cycle_opened(tag, manager.id);
        Ok(manager)
    }

    /// Ends the cycle of workspace `ws` whose scope has just closed.
    fn end_cycle(&mut self, ctx: &Ctx, ws: WorkspaceKey) {
        // The scope's id is only recorded: looked up only while recording.
        let scope = if observe::on() {
            self.workspaces
                .get(ws)
                .and_then(|w| w.open)
                .and_then(|tag| self.managers.get(tag.scope))
                .map_or(NO_MANAGER, |m| m.shared.id)
        } else {
            NO_MANAGER
        };
        if let Some(ws) = self.workspaces.get_mut(ws) {
            ws.end_cycle(ctx, scope);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Errors decided here
// ---------------------------------------------------------------------------------------------

/// The `Capped` error for an array refused by the capped manager `shared` (`what` says what was
/// refused): built where the cap is decided, logged (debug) and emitted as a memory event.
pub(crate) fn capped(ctx: &Ctx, shared: &ManagerShared, what: String) -> Error {
    let described = shared.describe();
    tracing::debug!(target: "ndscope::manager", manager = %described, op = ctx.op, at = %ctx.at, "capped manager refused an array: {what}");
    if observe::on() {
        observe::emit(Event::Capped {
            site: ctx.at,
            op: ctx.op,
            what: &what,
            device: shared.device,
            manager: shared.id,
        });
    }
    Error::Capped {
        op: ctx.op,
        at: ctx.at,
        manager: described,
        what,
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

    /// Inserts an open f32 array of shape `dims` with its own host storage, owned by `owner`.
    fn insert_f32(state: &mut State, ctx: &Ctx, owner: Owner, dims: &[usize]) -> Arc<ArrayShared> {
        let bytes = dims.iter().product::<usize>() * 4;
        let storage = Storage::alloc(ctx, Device::Cpu, bytes).unwrap();
        state.insert_array(
            NewArray {
                shape: Shape::new(dims),
                dtype: DType::F32,
                device: Device::Cpu,
                created_at: ctx.at,
            },
            Allocation {
                buffer: storage,
                place: Place::Heap,
                bytes,
            },
            owner,
        )
    }

    /// A handle whose key names a live entry that is not its own (what a stale handle looks like
    /// once its slotmap slot's version has wrapped around) is refused, for arrays and managers.
    #[test]
    fn a_reused_key_does_not_reach_another_entry() {
        let ctx = Ctx::new("test");
        let mut state = State::new();
        let owner = state.system.key;
        let live = insert_f32(&mut state, &ctx, Owner::Manager(owner), &[4]);
        let stale = ArrayShared::new(
            live.key(),
            u64::MAX,
            NewArray {
                shape: Shape::new(&[4]),
                dtype: DType::F32,
                device: Device::Cpu,
                created_at: ctx.at,
            },
            16,
            None,
        );
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
        state.remove_array(live.key(), CloseReason::Discarded);
    }

    /// A closed array's metadata is reused for a new array once its last handle is gone, and
    /// never while a handle holds it: that handle keeps its shape, id and close reason.
    #[test]
    fn a_closed_arrays_metadata_is_reused_only_once_nothing_holds_it() {
        let ctx = Ctx::new("test");
        let mut state = State::new();
        let owner = Owner::Manager(state.system.key);
        let insert = |state: &mut State, dims: &[usize]| insert_f32(state, &ctx, owner, dims);
        let held = insert(&mut state, &[4]);
        held.grad.version.fetch_add(3, Ordering::Relaxed);
        *held.name.lock() = Some(Arc::from("held"));
        state.remove_array(held.key(), CloseReason::Discarded);
        // A handle still holds it: the next array gets new metadata.
        let fresh = insert(&mut state, &[2, 3]);
        assert!(!std::ptr::eq(Arc::as_ptr(&fresh), Arc::as_ptr(&held)));
        assert!(held.closed.is_closed());
        assert_eq!(held.shape.dims(), &[4]);
        assert_eq!(held.describe(), format!("'held' (a{})", held.id));
        assert!(
            held.closed.reason().contains("failed"),
            "{}",
            held.closed.reason()
        );
        assert!(state.array(&fresh, &ctx).is_ok());

        // Once the last handle is gone, the next array reuses it, renewed in full.
        drop(held);
        let gone = insert(&mut state, &[5]);
        gone.grad.version.fetch_add(3, Ordering::Relaxed);
        *gone.name.lock() = Some(Arc::from("gone"));
        let (old, old_id) = (Arc::as_ptr(&gone), gone.id);
        state.remove_array(gone.key(), CloseReason::Discarded);
        state.remove_array(fresh.key(), CloseReason::Discarded);
        drop(fresh);
        drop(gone);
        let spare = state.spare.len();
        // The newest first: `fresh`'s, then `gone`'s.
        let newest = insert(&mut state, &[3]);
        assert_eq!(state.spare.len(), spare - 1);
        assert!(!std::ptr::eq(Arc::as_ptr(&newest), old));
        let renewed = insert(&mut state, &[7, 1]);
        assert_eq!(state.spare.len(), spare - 2);
        assert!(
            std::ptr::eq(Arc::as_ptr(&renewed), old),
            "the freed metadata is reused"
        );
        assert!(renewed.id > old_id);
        assert!(!renewed.closed.is_closed());
        assert_eq!(renewed.shape.dims(), &[7, 1]);
        assert_eq!(renewed.nbytes(), 28);
        assert!(renewed.name.lock().is_none());
        assert_eq!(renewed.grad.version.load(Ordering::Relaxed), 0);
        assert_eq!(renewed.key(), {
            let entry = state.array(&renewed, &ctx).unwrap();
            entry.shared.key()
        });
        assert!(renewed.data.read().is_some());
        state.remove_array(renewed.key(), CloseReason::Discarded);
        state.remove_array(newest.key(), CloseReason::Discarded);
    }
}
