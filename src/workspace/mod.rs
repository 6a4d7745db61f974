//! Workspaces: ND4J's `MemoryWorkspace` policies, mapped onto manager scopes.
//!
//! A workspace is one memory block owned by a manager. Each cycle is a sub-manager of the owner
//! (a [`Scope`](crate::Scope)); arrays created in it (or in its sub-managers) bump-allocate from
//! the block, and closing the scope ends the cycle and keeps the memory for the next one. After
//! the block is sized (learned), a steady loop allocates nothing from the system. The cycle's
//! scope is made in the manager layer (`manager/cycle.rs`); the allocator is `alloc.rs`.
//!
//! ```
//! use ndscope::{DType, Manager, WorkspaceConfig};
//! let trainer = Manager::new_base().with_name("trainer");
//! let ws = trainer.workspace("batch", WorkspaceConfig::default())?;
//! for _ in 0..3 {
//!     let batch = ws.open()?;                 // one cycle
//!     let x = batch.ones([64, 64], DType::F32)?;
//!     let y = x.add(&x)?;                     // lands in the cycle too (first input's owner)
//!     assert_eq!(y.sum_all()?.to_scalar::<f32>()?, 8192.0);
//! }                                           // each drop ends a cycle
//! let stats = ws.stats();
//! assert!(stats.initialized);                 // learned from the first cycle
//! assert_eq!(stats.cycles, 3);
//! trainer.close()?;                           // frees the block
//! # Ok::<(), ndscope::Error>(())
//! ```

mod alloc;
mod config;
mod events;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;

pub use config::{
    AllocationPolicy, LearningPolicy, LocationPolicy, MirroringPolicy, ResetPolicy, SpillPolicy,
    WorkspaceConfig, WorkspaceConfigBuilder,
};
pub use events::{set_spill_warning_threshold, spill_warning_threshold};

use crate::arena::{
    self, ArrayKey, ArrayShared, CloseReason, CycleTag, ManagerKey, ManagerShared, Owner, Place,
    State, WorkspaceKey,
};
use crate::backend::{Block, Storage};
use crate::error::{Ctx, Site};
use crate::{DType, Device, Error, Result, Shape};

/// Every allocation in a workspace is rounded up to this many bytes.
pub const ALIGNMENT: usize = 64;

/// Rounds `bytes` up to [`ALIGNMENT`].
pub(crate) fn align_up(bytes: usize) -> Option<usize> {
    bytes
        .checked_add(ALIGNMENT - 1)
        .map(|b| b & !(ALIGNMENT - 1))
}

/// A process-wide switch for debugging workspace problems, as ND4J's `DebugMode`. Also set by
/// the environment variable `NDSCOPE_WORKSPACE_DEBUG=spill_everything|bypass`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DebugMode {
    /// Every workspace allocation spills (gets its own buffer), still counted in the stats: shows
    /// whether a bug comes from block reuse.
    SpillEverything,
    /// Workspaces are ignored: arrays get ordinary buffers and are not counted.
    Bypass,
}

static DEBUG: LazyLock<AtomicU8> = LazyLock::new(|| {
    let mode = match std::env::var("NDSCOPE_WORKSPACE_DEBUG") {
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "spill_everything" => 1,
            "bypass" => 2,
            "" | "off" | "none" => 0,
            _ => {
                // Said on stderr too: without a log subscriber a typo would go unnoticed.
                let message = format!(
                    "ignoring NDSCOPE_WORKSPACE_DEBUG={v:?}: expected spill_everything, bypass or \
                     off; the debug mode stays off"
                );
                eprintln!("ndscope: {message}");
                tracing::warn!("ndscope: {message}");
                0
            }
        },
        Err(_) => 0,
    };
    AtomicU8::new(mode)
});

/// Sets the workspace debug mode for the whole process (`None` turns it off). Takes effect for
/// allocations made after the call.
pub fn set_debug_mode(mode: Option<DebugMode>) {
    let value = match mode {
        None => 0,
        Some(DebugMode::SpillEverything) => 1,
        Some(DebugMode::Bypass) => 2,
    };
    DEBUG.store(value, Ordering::Relaxed);
}

/// The workspace debug mode in effect.
pub fn debug_mode() -> Option<DebugMode> {
    match DEBUG.load(Ordering::Relaxed) {
        1 => Some(DebugMode::SpillEverything),
        2 => Some(DebugMode::Bypass),
        _ => None,
    }
}

/// A workspace's figures.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct WorkspaceStats {
    /// Bytes in the block (0 before it is learned).
    pub capacity: usize,
    /// The allocation offset in the block. Under `BlockLeft` it is 0 between cycles.
    pub used: usize,
    /// Cycles ended.
    pub cycles: u64,
    /// The largest cycle's demand in bytes (aligned; block and spills).
    pub max_cycle_bytes: usize,
    /// The last ended cycle's demand in bytes.
    pub last_cycle_bytes: usize,
    /// Bytes spilled since creation (aligned).
    pub spilled_bytes: usize,
    /// Allocations spilled since creation.
    pub spilled_count: u64,
    /// Times the block was replaced by a larger one (`SpillPolicy::Reallocate`).
    pub reallocations: u64,
    /// Cycles opened.
    pub generation: u64,
    /// Whether the block exists.
    pub initialized: bool,
}

pub(crate) struct WorkspaceShared {
    pub key: WorkspaceKey,
    pub name: Arc<str>,
    pub config: WorkspaceConfig,
    /// The manager that owns it (and frees it when it closes).
    pub owner: Arc<ManagerShared>,
    /// The stats at destruction, kept for `Workspace::stats` afterwards.
    pub final_stats: Mutex<Option<WorkspaceStats>>,
    /// The thread that created it, for [`destroy_all_workspaces_for_current_thread`].
    pub creator: std::thread::ThreadId,
}

pub(crate) use alloc::Checkpoint;
use alloc::{Allocator, BlockState, Growth, Plan, Policy};

/// A workspace's state in the arena: the block allocator and the cycle state machine.
pub(crate) struct WorkspaceEntry {
    pub shared: Arc<WorkspaceShared>,
    pub owner: ManagerKey,
    /// Where the block's arrays are.
    pub device: Device,
    /// For a CUDA owner's `MirroringPolicy::HostOnly` workspace: the device whose page-locked
    /// host memory the block is.
    pinned_for: Option<usize>,
    pub block: Option<Arc<Block>>,
    pub open: Option<CycleTag>,
    generation: u64,
    /// Where allocations go in the block, and the cycle's counters. Its count of live slices is
    /// the storage carved from the current block for arrays that are open (or being created or
    /// moved in). Every such storage holds a reference to the block, so more references than
    /// `1 + live` mean a closed array's bytes are still in use by a kernel (their free waits for
    /// it): then no part of the block may be handed out.
    alloc: Allocator,
    /// Circular workspaces only: open arrays whose bytes are in the block, by offset, so a wrap
    /// can close the ones it overwrites.
    block_arrays: BTreeMap<usize, (ArrayKey, usize)>,
    /// Circular workspaces only (the prefetcher's ring): see [`Policy::keep_open`].
    keep_open: bool,
}

impl WorkspaceEntry {
    fn config(&self) -> &WorkspaceConfig {
        &self.shared.config
    }

    fn capacity(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.capacity())
    }

    pub fn stats(&self) -> WorkspaceStats {
        WorkspaceStats {
            capacity: self.capacity(),
            used: self.alloc.offset(),
            cycles: self.alloc.cycles(),
            max_cycle_bytes: self.alloc.max_cycle_bytes(),
            last_cycle_bytes: self.alloc.last_cycle_bytes(),
            spilled_bytes: self.alloc.spilled_bytes(),
            spilled_count: self.alloc.spilled_count(),
            reallocations: self.alloc.reallocations(),
            generation: self.generation,
            initialized: self.block.is_some(),
        }
    }

    /// The allocator's policies, from the configuration.
    fn policy(&self) -> Policy {
        let config = self.config();
        Policy {
            reset: config.reset(),
            spill: config.spill(),
            learning: config.learning(),
            cycles_before_initialization: config.cycles_before_initialization() as u64,
            keep_open: self.keep_open,
        }
    }

    /// Decides where `aligned` bytes go in the open cycle, changing nothing (the allocator
    /// decides; the debug mode overrides it). `WorkspaceFull` under `SpillPolicy::Fail`.
    pub fn plan(&self, ctx: &Ctx, aligned: usize) -> Result<Plan> {
        match debug_mode() {
            Some(DebugMode::Bypass) => return Ok(Plan::Bypass),
            Some(DebugMode::SpillEverything) => return Ok(Plan::Spill),
            None => {}
        }
        let block = match &self.block {
            None => BlockState::None,
            // An array closed while a kernel used it still holds its bytes (its free waits for
            // the kernel): see `alloc`.
            Some(block) if Arc::strong_count(block) > 1 + self.alloc.live() => BlockState::Held {
                capacity: block.capacity(),
            },
            Some(block) => BlockState::Free {
                capacity: block.capacity(),
            },
        };
        self.alloc
            .plan(&self.policy(), block, aligned)
            .map_err(|full| Error::WorkspaceFull {
                op: ctx.op,
                at: ctx.at,
                workspace: self.shared.name.to_string(),
                requested: full.requested,
                used: full.used,
                capacity: full.capacity,
            })
    }

    /// Records an allocation planned by [`plan`](Self::plan).
    pub fn commit(&mut self, plan: Plan, aligned: usize) {
        self.alloc.commit(plan, aligned);
    }

    /// The allocator's counters now, to undo a batch of allocations.
    pub fn checkpoint(&self) -> Checkpoint {
        self.alloc.checkpoint()
    }

    /// Undoes the allocations made since `c` (their storage is dropped by the caller).
    pub fn restore(&mut self, c: Checkpoint) {
        self.alloc.restore(c);
    }

    /// Whether moving the array at `place` (in this workspace's cycle `cycle`, which is not open
    /// any more) to another owner must copy its bytes out: it survives in the current block of a
    /// circular workspace, which overwrites it when the buffer comes round.
    pub fn survivor_must_move(&self, block: u64) -> bool {
        alloc::survivors_overwritten(self.config().reset())
            && self.block.as_ref().is_some_and(|b| b.id() == block)
    }

    /// Whether `ret` out of the open cycle keeps the bytes in place (no copy).
    pub fn ret_in_place(&self) -> bool {
        alloc::ret_in_place(self.config().reset())
    }

    /// Whether `place` is in the current block.
    fn in_current_block(&self, place: Place) -> bool {
        matches!((place, &self.block), (Place::Block { block, .. }, Some(current)) if block == current.id())
    }

    /// The open arrays whose bytes overlap `[offset, offset + len)` (circular workspaces).
    pub fn overlapping(&self, offset: usize, len: usize) -> Vec<ArrayKey> {
        let end = offset + len;
        let mut hits = Vec::new();
        // The array starting before `offset` may reach into the range.
        if let Some((&start, &(key, alen))) = self.block_arrays.range(..offset).next_back() {
            if start + alen > offset {
                hits.push(key);
            }
        }
        hits.extend(
            self.block_arrays
                .range(offset..end)
                .map(|(_, &(key, _))| key),
        );
        hits
    }

    /// Records the array `key` placed at `place` of this workspace's block (circular
    /// workspaces track where their arrays lie).
    pub fn note_block_array(&mut self, key: ArrayKey, place: Place) {
        if let Place::Block { offset, len, .. } = place {
            if self.config().reset() == ResetPolicy::EndOfBuffer && self.in_current_block(place) {
                self.block_arrays.insert(offset, (key, len));
            }
        }
    }

    /// Forgets the array `key` that was at `place` (closed, or moved out).
    pub fn forget_block_array(&mut self, key: ArrayKey, place: Place) {
        let Place::Block { offset, .. } = place else {
            return;
        };
        if !self.in_current_block(place) {
            return;
        }
        self.alloc.release();
        if let Some(&(k, _)) = self.block_arrays.get(&offset) {
            if k == key {
                self.block_arrays.remove(&offset);
            }
        }
    }

    /// Allocates the block for `demand` bytes (policy applied). A block of 0 bytes is none.
    fn grow_to(&mut self, ctx: &Ctx, demand: usize) -> Result<bool> {
        let size = self.config().block_size_for(demand);
        if size == 0 || size <= self.capacity() {
            return Ok(false);
        }
        let block = match (self.config().location(), self.device) {
            (LocationPolicy::Mmap, _) => {
                Block::mmap(ctx, size, self.config().mmap_path(), &self.shared.name)?
            }
            (LocationPolicy::Ram, Device::Cpu) => match self.pinned_for {
                Some(ordinal) => Block::pinned(ctx, ordinal, size)?,
                None => Block::ram(ctx, size)?,
            },
            (LocationPolicy::Ram, Device::Cuda(ordinal)) => Block::device(ctx, ordinal, size)?,
        };
        let old_capacity = self.capacity();
        let replaced = self.block.replace(Arc::new(block)).is_some();
        events::block_allocated(self, old_capacity);
        // Arrays still in the old block keep it alive through their buffers and stay valid; the
        // new block starts empty.
        self.block_arrays.clear();
        self.alloc.block_replaced();
        Ok(replaced)
    }

    /// The cycle `tag` opened, as the scope manager with id `scope` (the manager layer made it):
    /// the allocator starts it where the last one left off.
    pub fn cycle_opened(&mut self, tag: CycleTag, scope: u64) {
        self.generation = tag.generation;
        self.open = Some(tag);
        self.alloc.open_cycle();
        events::cycle_opened(self, scope);
    }

    /// The generation the next cycle will have.
    pub fn next_generation(&self) -> u64 {
        self.generation + 1
    }

    /// Sizes the block now (`Workspace::initialize`): from `initial_size`, else from the largest
    /// cycle seen.
    fn initialize(&mut self, ctx: &Ctx) -> Result<()> {
        if self.block.is_some() {
            return Ok(());
        }
        let demand = self.alloc.initial_demand(self.config().initial_size());
        if self.config().block_size_for(demand) == 0 {
            return Err(ctx.invalid(format!(
                "workspace '{}' has nothing to size its block from: initial_size is 0 and no cycle has allocated yet",
                self.shared.name
            )));
        }
        self.grow_to(ctx, demand).map(|_| ())
    }

    /// Ends the open cycle: stats, learning, growth and reset. Never fails: a block that cannot
    /// be allocated (memory limit) leaves the workspace spilling, as before.
    fn end_cycle(&mut self, ctx: &Ctx, scope: u64) {
        let generation = self.open.map_or(self.generation, |tag| tag.generation);
        self.open = None;
        let policy = self.policy();
        let figures = self.alloc.end_cycle(
            &policy,
            self.block.is_some(),
            events::spill_warning_threshold(),
        );
        events::cycle_ended(self, generation, scope, figures);
        match self.alloc.growth(
            &policy,
            self.block.as_ref().map(|b| b.capacity()),
            |bytes| self.config().block_size_for(bytes),
        ) {
            Growth::Keep => {}
            Growth::Learn { demand } => {
                let grown = self.grow_to(ctx, demand);
                events::learned(self, demand, &grown);
            }
            Growth::Reallocate { demand } => {
                let old_capacity = self.capacity();
                let grown = self.grow_to(ctx, demand);
                if matches!(grown, Ok(true)) {
                    self.alloc.reallocated();
                    crate::memory::reallocated(self.device);
                }
                events::reallocated(self, old_capacity, &grown);
            }
        }
    }
}

/// A workspace owned by a manager; a cheap handle. See the [module docs](self).
#[derive(Clone)]
pub struct Workspace(pub(crate) Arc<WorkspaceShared>);

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("name", &self.0.name)
            .field(
                "owner",
                &format_args!("Manager({})", self.0.owner.describe()),
            )
            .finish()
    }
}

impl Workspace {
    /// The workspace's name, unique within its owner.
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The configuration.
    pub fn config(&self) -> &WorkspaceConfig {
        &self.0.config
    }

    /// The workspace's figures. After [`destroy`](Self::destroy), the figures at destruction.
    pub fn stats(&self) -> WorkspaceStats {
        let state = arena::lock();
        match state.live_workspace(&self.0) {
            Some(ws) => ws.stats(),
            None => self.0.final_stats.lock().clone().unwrap_or_default(),
        }
    }

    /// Allocates the block now, from `initial_size` or the largest cycle seen so far, instead of
    /// waiting for the learning policy. Does nothing if the block exists.
    #[track_caller]
    pub fn initialize(&self) -> Result<()> {
        let ctx = Ctx::new("Workspace::initialize");
        let mut state = arena::lock();
        let ws = state.workspace_mut(&ctx, &self.0)?;
        ws.initialize(&ctx)
    }

    /// Frees the block now: ends an open cycle (closing its arrays), closes arrays still living
    /// in the block, and removes the workspace from its owner. Idempotent.
    #[track_caller]
    pub fn destroy(&self) -> Result<()> {
        let ctx = Ctx::new("Workspace::destroy");
        let mut state = arena::lock();
        if state.live_workspace(&self.0).is_some() {
            state.destroy_workspace(&ctx, self.0.key);
        }
        Ok(())
    }

    /// Makes a circular workspace keep the open arrays of earlier cycles: an allocation that
    /// would overwrite one spills instead, and the block grows (with `SpillPolicy::Reallocate`)
    /// to the policy's size for the largest cycle. For the prefetcher's ring, whose batches
    /// stay readable until the consumer lets them go.
    pub(crate) fn keep_open_arrays(&self, ctx: &Ctx) -> Result<()> {
        let mut state = arena::lock();
        state.workspace_mut(ctx, &self.0)?.keep_open = true;
        Ok(())
    }

    /// Whether [`destroy`](Self::destroy) ran or the owner closed.
    pub fn is_destroyed(&self) -> bool {
        arena::lock().live_workspace(&self.0).is_none()
    }
}

/// Destroys every live workspace created on the calling thread, as ND4J's
/// `destroyAllWorkspacesForCurrentThread` (say, after evaluation, when a thread's workspaces are
/// no longer needed), and returns how many it destroyed. Each is destroyed as by
/// [`Workspace::destroy`]: an open cycle ends, arrays still in its block are closed, the block is
/// freed. Workspaces of other threads are left alone; one created here but used from another
/// thread since is destroyed too (the creator decides). Freeing never depends on the thread:
/// [`Workspace::destroy`] and closing the owner work from any thread.
///
/// ```
/// use ndscope::{destroy_all_workspaces_for_current_thread, Manager, WorkspaceConfig};
/// let m = Manager::new_base();
/// let ws = m.workspace("eval", WorkspaceConfig::default())?;
/// let other = std::thread::spawn({
///     let m = m.clone();
///     move || m.workspace("theirs", WorkspaceConfig::default()).map(|_| ())
/// });
/// other.join().unwrap()?;
/// assert!(destroy_all_workspaces_for_current_thread() >= 1);
/// assert!(ws.is_destroyed());
/// assert!(!m.workspace("theirs", WorkspaceConfig::default())?.is_destroyed());
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn destroy_all_workspaces_for_current_thread() -> usize {
    let ctx = Ctx::new("destroy_all_workspaces_for_current_thread");
    let me = std::thread::current().id();
    let mut state = arena::lock();
    let mine: Vec<WorkspaceKey> = state
        .workspaces
        .iter()
        .filter(|(_, ws)| ws.shared.creator == me)
        .map(|(key, _)| key)
        .collect();
    for &key in &mine {
        state.destroy_workspace(&ctx, key);
    }
    mine.len()
}

/// Storage for a new array, and where it lives.
pub(crate) struct Allocation {
    pub buffer: Storage,
    pub place: Place,
}

impl State {
    /// The entry of the workspace `shared` if it exists (identity checked, as for arrays).
    pub(crate) fn live_workspace(&self, shared: &WorkspaceShared) -> Option<&WorkspaceEntry> {
        self.workspaces
            .get(shared.key)
            .filter(|e| std::ptr::eq(Arc::as_ptr(&e.shared), shared))
    }

    pub(crate) fn workspace_mut(
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
    pub(crate) fn workspace(
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
        let pinned_for = match (owner.device, config.mirroring()) {
            (Device::Cuda(ordinal), MirroringPolicy::HostOnly) => Some(ordinal),
            _ => None,
        };
        let device = match (owner.device, config.mirroring(), config.location()) {
            (Device::Cpu, _, _) => Device::Cpu,
            (Device::Cuda(_), _, LocationPolicy::Mmap) => {
                return Err(ctx.unsupported(format!(
                    "LocationPolicy::Mmap on manager {} of device {}: memory-mapped blocks are CPU only",
                    owner.describe(),
                    owner.device
                )))
            }
            (Device::Cuda(_), MirroringPolicy::HostOnly, _) => Device::Cpu,
            (cuda, MirroringPolicy::Full, _) => cuda,
        };
        let mut entry = WorkspaceEntry {
            shared: Arc::new(WorkspaceShared {
                key: WorkspaceKey::default(),
                name: Arc::from(name),
                config,
                owner: Arc::clone(owner),
                final_stats: Mutex::new(None),
                creator: std::thread::current().id(),
            }),
            owner: owner.key,
            device,
            pinned_for,
            block: None,
            open: None,
            generation: 0,
            alloc: Allocator::default(),
            block_arrays: BTreeMap::new(),
            keep_open: false,
        };
        // ND4J allocates `initial_size` at creation whatever the learning policy.
        let initial = entry.config().initial_size();
        if initial > 0 {
            entry.grow_to(ctx, initial)?;
        }
        let key = self.workspaces.insert_with_key(|key| {
            // The key is only known now; the shared part is not yet visible to anyone.
            let shared = Arc::get_mut(&mut entry.shared).map(|s| s.key = key);
            debug_assert!(shared.is_some());
            entry
        });
        self.managers[owner.key].workspaces.push(key);
        Ok(Workspace(Arc::clone(&self.workspaces[key].shared)))
    }

    /// Ends the cycle of workspace `ws` whose scope has just closed.
    pub(crate) fn end_cycle(&mut self, ctx: &Ctx, ws: WorkspaceKey) {
        // The scope's id is only recorded: looked up only while recording.
        let scope = if crate::observe::on() {
            self.workspaces
                .get(ws)
                .and_then(|w| w.open)
                .and_then(|tag| self.managers.get(tag.scope))
                .map_or(crate::observe::NO_MANAGER, |m| m.shared.id)
        } else {
            crate::observe::NO_MANAGER
        };
        if let Some(ws) = self.workspaces.get_mut(ws) {
            ws.end_cycle(ctx, scope);
        }
    }

    /// Frees a workspace: its open cycle, the arrays in its block, the block.
    pub(crate) fn destroy_workspace(&mut self, ctx: &Ctx, key: WorkspaceKey) {
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
        let survivors: Vec<ArrayKey> = ws.block_arrays.values().map(|&(k, _)| k).collect();
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
    pub(crate) fn allocate(
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
            let evict = ws.overlapping(offset, aligned);
            let name = Arc::clone(&ws.shared.name);
            // A ring that keeps its open arrays (the prefetcher's) spills rather than evict.
            if (ws.keep_open && !evict.is_empty()) || !self.evict(&evict, &name, ctx.at) {
                plan = Plan::Spill;
            }
        }
        let ws = &mut self.workspaces[cycle.ws];
        match plan {
            Plan::Block { offset, wrap } => {
                let block = ws
                    .block
                    .as_ref()
                    .map(Arc::clone)
                    .ok_or_else(|| ctx.invalid("workspace block vanished"))?;
                // SAFETY: `plan` placed `[offset, offset + aligned)` clear of the open cycle's
                // arrays; the older arrays there were closed just now, with their bytes freed
                // (`evict` refused arrays in use), and no closed array's bytes are still held
                // (`plan` checks), so the range belongs to this array alone.
                let buffer = unsafe { block.carve(offset, bytes) }
                    .ok_or_else(|| ctx.invalid("workspace slice outside its block"))?;
                ws.commit(Plan::Block { offset, wrap }, aligned);
                Ok(Allocation {
                    buffer,
                    place: Place::Block {
                        cycle,
                        offset,
                        len: aligned,
                        block: block.id(),
                    },
                })
            }
            plan @ (Plan::Spill | Plan::Bypass) => {
                let allocation = heap(ctx)?;
                if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                    ws.commit(plan, aligned);
                    if plan == Plan::Spill {
                        // The scope's id is only recorded: looked up only while recording.
                        let scope = crate::observe::on()
                            .then(|| self.managers.get(cycle.scope).map(|m| m.shared.id))
                            .flatten();
                        events::spilled(ws, scope, aligned, ctx.at);
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
            let _ = array.closed.set(reason.clone());
            let storage = guard.take();
            drop(guard);
            drop(storage);
            self.remove_array(array.key, reason.clone());
        }
        true
    }

    /// The stats of the workspaces owned by `manager`, with their names.
    pub(crate) fn workspace_stats_of(&self, manager: ManagerKey) -> Vec<(String, WorkspaceStats)> {
        self.managers.get(manager).map_or_else(Vec::new, |m| {
            m.workspaces
                .iter()
                .filter_map(|&k| self.workspaces.get(k))
                .map(|ws| (ws.shared.name.to_string(), ws.stats()))
                .collect()
        })
    }
}
