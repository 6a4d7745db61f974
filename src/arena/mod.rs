//! The arena: every array, manager and workspace of the process lives in one of three `slotmap`s,
//! addressed by generational keys. This room holds the keys, the entries (what an array or a
//! manager is, who owns an array, where its bytes live) and the owner table's pieces (the
//! intrusive lists, the borrow chain); the maps themselves, the lock that guards them and every
//! change to them are `crate::state`'s.

use std::cell::UnsafeCell;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::backend::Storage;
use crate::error::{Ctx, Site};
use crate::observe::BlockSpan;
use crate::{DType, Device, Error, Shape};

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

/// A new array's process-unique id. Called under the arena lock only (by
/// `State::insert_array`), which orders every call: a plain load and store suffice, no
/// read-modify-write.
pub(crate) fn next_array_id() -> u64 {
    let id = NEXT_ARRAY_ID.load(Ordering::Relaxed);
    NEXT_ARRAY_ID.store(id.wrapping_add(1), Ordering::Relaxed);
    id
}

/// A new manager's process-unique id.
pub(crate) fn next_manager_id() -> u64 {
    NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed)
}

/// What an `NDArray` handle points to: the part of an array shared by its handles and its
/// arena entry ([`ArrayEntry::shared`]), named like [`ManagerShared`] and `WorkspaceShared`.
/// The metadata never changes while it is shared (only the name may be set); the data lock holds
/// the buffer until the array is closed. Once closed and held by no handle, it may be renewed
/// for a new array ([`renew`](Self::renew)).
pub(crate) struct ArrayShared {
    /// Its key in the arena ([`key`](Self::key)): set when it is inserted, and again when a
    /// closed array's metadata is reused for a new array, before any handle to it exists.
    key: AtomicU64,
    pub id: u64,
    pub shape: Shape,
    pub dtype: DType,
    /// The bytes of its elements, computed once (every create and close counts them).
    nbytes: usize,
    pub device: Device,
    pub created_at: Site,
    pub name: Mutex<Option<Arc<str>>>,
    /// Set, under the arena lock, when the array leaves the arena.
    pub closed: Closed,
    /// Moves of the bytes to new storage (copy-out of a workspace) so far: a deferred copy
    /// checks it is still the latest.
    pub moves: AtomicU64,
    pub data: RwLock<Option<Storage>>,
    /// What gradients need of it (see `crate::ndarray::autograd`).
    pub grad: GradFields,
}

/// An array's autograd fields: lock-free reads on every op while a gradient collector records.
pub(crate) struct GradFields {
    /// Set by `NDArray::set_requires_gradient`: a leaf whose gradient is accumulated.
    pub requires: AtomicBool,
    /// The gradient array (same owner, same shape), made when gradients are first required.
    pub array: Mutex<Option<Arc<ArrayShared>>>,
    /// Bumped by every in-place write: a saved array whose version changed before `backward`
    /// would give a wrong gradient, so `backward` refuses it.
    pub version: AtomicU64,
    /// The tape node that computed it: `(tape id << 32) | node index`, 0 for none.
    pub node: AtomicU64,
    /// For a gradient array: its version when it was last known to hold zeros (`u64::MAX`:
    /// not known), so a zeroed gradient is not zeroed again and backward may overwrite it.
    pub zeroed: AtomicU64,
    /// For a gradient array: a weight gradient `op(a) · op(b)` that backward left to be
    /// computed when the gradient is first read or written (or fused into an optimizer step,
    /// which then never writes the gradient). `has_pending` is read on every access.
    pub pending: Mutex<Option<PendingProduct>>,
    pub has_pending: AtomicBool,
}

impl Default for GradFields {
    fn default() -> Self {
        GradFields {
            requires: AtomicBool::new(false),
            array: Mutex::new(None),
            version: AtomicU64::new(0),
            node: AtomicU64::new(0),
            zeroed: AtomicU64::new(u64::MAX),
            pending: Mutex::new(None),
            has_pending: AtomicBool::new(false),
        }
    }
}

/// What a new array is: its metadata, as `State::insert_array` takes it.
pub(crate) struct NewArray {
    pub shape: Shape,
    pub dtype: DType,
    pub device: Device,
    pub created_at: Site,
}

/// A matrix product not computed yet: `op(a) · op(b)` with `a` and `b` at these versions.
pub(crate) struct PendingProduct {
    pub a: Arc<ArrayShared>,
    pub b: Arc<ArrayShared>,
    pub trans_a: bool,
    pub trans_b: bool,
    pub versions: (u64, u64),
}

impl ArrayShared {
    /// `'name' (a12)` or `a12`.
    pub fn describe(&self) -> String {
        match &*self.name.lock() {
            Some(name) => format!("'{name}' (a{})", self.id),
            None => format!("a{}", self.id),
        }
    }

    /// The metadata of a new array `key` of `bytes` bytes (its data lock holding `data`, nothing
    /// else set).
    pub fn new(
        key: ArrayKey,
        id: u64,
        array: NewArray,
        bytes: usize,
        data: Option<Storage>,
    ) -> ArrayShared {
        let NewArray {
            shape,
            dtype,
            device,
            created_at,
        } = array;
        ArrayShared {
            key: AtomicU64::new(slotmap::Key::data(&key).as_ffi()),
            id,
            nbytes: bytes,
            shape,
            dtype,
            device,
            created_at,
            name: Mutex::new(None),
            closed: Closed::default(),
            moves: AtomicU64::new(0),
            data: RwLock::new(data),
            grad: Default::default(),
        }
    }

    /// Makes this closed array's allocation the metadata of a new array, as [`new`](Self::new)
    /// would (its key is given by [`set_key`](Self::set_key) once inserted): the arena reuses
    /// the `ArrayShared` of an array that was closed and whose last handle is gone (it is
    /// reached through `&mut`, so nobody else sees it), to spare a steady cycle an allocation
    /// and a free per array. Every field is named, so a new field cannot be left out.
    #[inline(always)]
    pub fn renew(&mut self, id: u64, array: NewArray, bytes: usize, data: Option<Storage>) {
        let ArrayShared {
            key: _,
            id: old_id,
            shape: old_shape,
            dtype: old_dtype,
            nbytes,
            device: old_device,
            created_at: old_created_at,
            name,
            closed,
            moves,
            data: old_data,
            grad,
        } = self;
        *old_id = id;
        *nbytes = bytes;
        *old_shape = array.shape;
        *old_dtype = array.dtype;
        *old_device = array.device;
        *old_created_at = array.created_at;
        *name.get_mut() = None;
        closed.reopen();
        *moves.get_mut() = 0;
        *old_data.get_mut() = data;
        let GradFields {
            requires,
            array,
            version,
            node,
            zeroed,
            pending,
            has_pending,
        } = grad;
        *requires.get_mut() = false;
        *array.get_mut() = None;
        *version.get_mut() = 0;
        *node.get_mut() = 0;
        *zeroed.get_mut() = u64::MAX;
        *pending.get_mut() = None;
        *has_pending.get_mut() = false;
    }

    /// Its key in the arena.
    #[inline]
    pub fn key(&self) -> ArrayKey {
        slotmap::KeyData::from_ffi(self.key.load(Ordering::Relaxed)).into()
    }

    /// Gives it the key of the arena entry it was just inserted as (before any handle to it
    /// exists: the arena's `&mut` orders this before every read).
    pub fn set_key(&self, key: ArrayKey) {
        self.key
            .store(slotmap::Key::data(&key).as_ffi(), Ordering::Relaxed);
    }

    /// The bytes of its elements.
    #[inline]
    pub fn nbytes(&self) -> usize {
        self.nbytes
    }

    /// The `ArrayClosed` error for this array.
    pub fn closed_error(&self, ctx: &Ctx) -> Error {
        Error::ArrayClosed {
            op: ctx.op,
            at: ctx.at,
            array: self.describe(),
            created_at: self.created_at,
            reason: self.closed.reason(),
        }
    }
}

/// Whether an array left the arena, and why: set once, under the arena lock, when it does; read
/// without any lock by every `is_open` (the flag), and by the messages that give the reason.
#[derive(Default)]
pub(crate) struct Closed {
    /// Set (release) once `reason` is written; never cleared while the array is shared.
    flag: AtomicBool,
    /// Written once, before `flag` is set, by the state the array lives in (under its lock);
    /// read only after `flag` was seen set (acquire), so never while it is written.
    reason: UnsafeCell<Option<CloseReason>>,
}

// SAFETY: `reason` is written only by `set`, whose callers hold `&mut` of the state the array
// lives in (the arena lock), so two writes never race, and only while `flag` is clear; it is
// read only after `flag` was seen set with acquire ordering, which orders the read after the
// write, and nothing writes it after that. (`reopen` takes `&mut self`.) `CloseReason` is
// `Send + Sync`.
unsafe impl Sync for Closed {}

impl Closed {
    /// Whether the array was closed.
    #[inline]
    pub fn is_closed(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Records why the array was closed; a later call changes nothing (the first reason stays).
    ///
    /// # Safety
    /// The caller holds `&mut` of the state the array lives in (the arena lock): every caller
    /// is a `State` method.
    #[inline]
    pub unsafe fn set(&self, reason: CloseReason) {
        // The caller's `&mut` state orders every `set`: a relaxed load sees the last one.
        if self.flag.load(Ordering::Relaxed) {
            return;
        }
        // SAFETY: the flag is clear, so no reader looks at `reason` yet, and the caller's `&mut`
        // state keeps every other `set` out (see the `Sync` impl).
        unsafe { *self.reason.get() = Some(reason) };
        self.flag.store(true, Ordering::Release);
    }

    /// Why the array was closed, for an `ArrayClosed` message.
    pub fn reason(&self) -> String {
        if !self.is_closed() {
            return "it was closed".to_string();
        }
        // SAFETY: the flag was seen set (acquire), so the write is done and none follows.
        match unsafe { &*self.reason.get() } {
            Some(reason) => reason.to_string(),
            None => "it was closed".to_string(),
        }
    }

    /// Open again (for reusing a closed array's metadata, which nobody else holds).
    #[inline]
    fn reopen(&mut self) {
        *self.flag.get_mut() = false;
        *self.reason.get_mut() = None;
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
    /// The lender's name, for messages.
    pub fn describe(&self) -> String {
        match &self.shared {
            Some(shared) => shared.describe(),
            None => "nobody (detached)".to_string(),
        }
    }
}

/// An open array's entry in the arena: its owner, borrow chain, place in its owner's list and
/// where its bytes live.
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
    /// Whether it is borrowed (it goes back to a lender when its holder closes).
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

/// An open manager's entry in the arena: its place in the tree, its arrays, cap, workspace cycle
/// and workspaces.
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

/// The `ManagerClosed` error for a manager.
pub(crate) fn manager_closed(shared: &ManagerShared, ctx: &Ctx) -> Error {
    Error::ManagerClosed {
        op: ctx.op,
        at: ctx.at,
        manager: shared.describe(),
    }
}
