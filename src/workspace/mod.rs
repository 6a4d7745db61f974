//! Workspaces: ND4J's `MemoryWorkspace` policies, mapped onto manager scopes.
//!
//! A workspace is one memory block owned by a manager. Each cycle is a sub-manager of the owner
//! (a [`Scope`](crate::Scope)); arrays created in it (or in its sub-managers) bump-allocate from
//! the block, and closing the scope ends the cycle and keeps the memory for the next one. After
//! the block is sized (learned), a steady loop allocates nothing from the system. The cycle's
//! scope is made by the state (`crate::state`) and handed out by `handle.rs`; the allocator is
//! `alloc.rs`.
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
mod handle;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};

use parking_lot::Mutex;

pub use config::{
    AllocationPolicy, LearningPolicy, LocationPolicy, MirroringPolicy, ResetPolicy, SpillPolicy,
    WorkspaceConfig, WorkspaceConfigBuilder,
};
pub use handle::destroy_all_workspaces_for_current_thread;

use crate::arena::{ArrayKey, CycleTag, ManagerKey, ManagerShared, Place, WorkspaceKey};
pub use crate::backend::graph::{GraphReplayStats, GraphState};
use crate::backend::{Block, CycleGraph};
use crate::error::{Bytes, Ctx, Site};
use crate::observe::{self, CycleEnd, Event, NO_MANAGER};
use crate::{Device, Error, Result};

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
#[inline(always)]
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
    /// Graph replay's figures ([`WorkspaceConfig::graph_replay`]; state `Off` where it is not
    /// asked for or the workspace is not on a CUDA device).
    pub graph: GraphReplayStats,
}

/// What a [`Workspace`] handle points to (and its arena entry, [`WorkspaceEntry::shared`]).
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

use alloc::{Allocator, BlockChange, BlockState, CycleFigures, Policy};
pub(crate) use alloc::{Checkpoint, Plan};

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
    /// Graph replay of learned cycles (a CUDA workspace that asked for it).
    graph: Option<CycleGraph>,
}

impl WorkspaceEntry {
    fn config(&self) -> &WorkspaceConfig {
        &self.shared.config
    }

    fn capacity(&self) -> usize {
        self.block.as_ref().map_or(0, |b| b.capacity())
    }

    /// The workspace's figures now.
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
            graph: self
                .graph
                .as_ref()
                .map_or_else(GraphReplayStats::default, CycleGraph::stats),
        }
    }

    /// The allocator's policies, from the configuration.
    #[inline]
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
    #[inline(always)]
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
    #[inline]
    pub fn overlapping(&self, offset: usize, len: usize) -> Vec<ArrayKey> {
        if self.block_arrays.is_empty() {
            return Vec::new();
        }
        self.overlapping_tracked(offset, len)
    }

    /// [`overlapping`](Self::overlapping) where arrays are tracked.
    fn overlapping_tracked(&self, offset: usize, len: usize) -> Vec<ArrayKey> {
        let mut hits = Vec::new();
        let end = offset + len;
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
    #[inline]
    pub fn note_block_array(&mut self, key: ArrayKey, place: Place) {
        if let Place::Block { offset, len, .. } = place {
            if self.config().reset() == ResetPolicy::EndOfBuffer && self.in_current_block(place) {
                self.block_arrays.insert(offset, (key, len));
            }
        }
    }

    /// Forgets the array `key` that was at `place` (closed, or moved out).
    #[inline]
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
        if let Some(graph) = &self.graph {
            graph.forget();
        }
        let replaced = self.block.replace(Arc::new(block)).is_some();
        block_allocated(self, old_capacity);
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
        if let Some(graph) = &self.graph {
            // Learned: the block is sized, or cycles have run that allocated nothing from it
            // (all their arrays live elsewhere, so their addresses do not depend on it).
            let learned = self.block.is_some()
                || (self.alloc.cycles() > 0 && self.alloc.max_cycle_bytes() == 0);
            graph.begin(learned);
        }
        cycle_opened(self, scope);
    }

    /// The generation the next cycle will have.
    pub fn next_generation(&self) -> u64 {
        self.generation + 1
    }

    /// Sizes the block now (`Workspace::initialize`): from `initial_size`, else from the largest
    /// cycle seen.
    pub fn initialize(&mut self, ctx: &Ctx) -> Result<()> {
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
    pub fn end_cycle(&mut self, ctx: &Ctx, scope: u64) {
        let generation = self.open.map_or(self.generation, |tag| tag.generation);
        self.open = None;
        let replayed = self.graph.as_ref().and_then(|g| g.end(ctx));
        let policy = self.policy();
        let figures =
            self.alloc
                .end_cycle(&policy, self.block.is_some(), spill_warning_threshold());
        cycle_ended(self, generation, scope, figures, replayed.as_deref());
        match self.alloc.growth(
            &policy,
            self.block.as_ref().map(|b| b.capacity()),
            |bytes| self.config().block_size_for(bytes),
        ) {
            BlockChange::Keep => {}
            BlockChange::Learn { demand } => {
                let grown = self.grow_to(ctx, demand);
                learned(self, demand, &grown);
            }
            BlockChange::Reallocate { demand } => {
                let old_capacity = self.capacity();
                let grown = self.grow_to(ctx, demand);
                if matches!(grown, Ok(true)) {
                    self.alloc.reallocated();
                    crate::memory::reallocated(self.device);
                }
                reallocated(self, old_capacity, &grown);
            }
        }
    }
}

impl WorkspaceEntry {
    /// A new workspace `name` of `owner` with `config` (its key is set when the arena inserts
    /// it): the device its block lives on follows the owner's device and the mirroring policy.
    /// ND4J allocates `initial_size` at creation whatever the learning policy.
    pub fn new(
        ctx: &Ctx,
        owner: &Arc<ManagerShared>,
        name: &str,
        config: WorkspaceConfig,
    ) -> Result<WorkspaceEntry> {
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
        let graph = match (device, config.graph_replay()) {
            (Device::Cuda(ordinal), true) => CycleGraph::new(ordinal),
            _ => None,
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
            graph,
        };
        let initial = entry.config().initial_size();
        if initial > 0 {
            entry.grow_to(ctx, initial)?;
        }
        Ok(entry)
    }

    /// The open arrays whose bytes are in the block (circular workspaces), to close when the
    /// workspace is destroyed.
    pub fn block_array_keys(&self) -> Vec<ArrayKey> {
        self.block_arrays.values().map(|&(k, _)| k).collect()
    }

    /// Whether it keeps the open arrays of earlier cycles (see [`Policy::keep_open`]).
    pub fn keeps_open_arrays(&self) -> bool {
        self.keep_open
    }

    /// Makes it keep the open arrays of earlier cycles: `Workspace::keep_open_arrays`.
    pub fn keep_open_arrays(&mut self) {
        self.keep_open = true;
    }

    /// An allocation of `bytes` (aligned) at `site` spilled, in the cycle whose scope is `scope`.
    pub fn spilled(&self, scope: Option<u64>, bytes: usize, site: Site) {
        crate::memory::spilled(self.device);
        if observe::on() {
            observe::emit(Event::Spilled {
                workspace: &self.shared.name,
                scope: scope.unwrap_or(NO_MANAGER),
                device: self.device,
                bytes,
                site,
            });
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
}

// What a workspace tells the outside about its cycles: `tracing` events (debug for cycles and
// blocks, info for learning decisions, warnings for spills past a threshold and blocks that could
// not be allocated) and the memory events (see `crate::observe`).

/// Bytes a learned cycle may spill before a warning; see [`set_spill_warning_threshold`].
static SPILL_WARNING: AtomicUsize = AtomicUsize::new(0);

/// Sets how many bytes a cycle of a workspace whose block is already learned may spill before
/// ndscope logs a warning (a `tracing` event at level WARN, target `ndscope::workspace`): such a
/// cycle outgrew its block and pays for its own buffers. The default, 0, warns at any spill.
/// A workspace warns again only when a cycle spills more than the most it warned about, so a
/// loop that spills the same every step warns once; the other cycles log at DEBUG. Spills
/// while the block is still being learned are expected and never warn. Process-wide.
///
/// ```
/// use ndscope::workspace::{set_spill_warning_threshold, spill_warning_threshold};
/// set_spill_warning_threshold(1 << 20);     // only spills past 1 MiB a cycle
/// assert_eq!(spill_warning_threshold(), 1 << 20);
/// set_spill_warning_threshold(0);
/// ```
pub fn set_spill_warning_threshold(bytes: usize) {
    SPILL_WARNING.store(bytes, Ordering::Relaxed);
}

/// The threshold set by [`set_spill_warning_threshold`].
pub fn spill_warning_threshold() -> usize {
    SPILL_WARNING.load(Ordering::Relaxed)
}

/// A cycle opened as manager `scope`.
fn cycle_opened(ws: &WorkspaceEntry, scope: u64) {
    tracing::debug!(
        target: "ndscope::workspace",
        workspace = &*ws.shared.name,
        cycle = ws.generation,
        "workspace '{}': cycle {} opened",
        ws.shared.name,
        ws.generation
    );
    if observe::on() {
        observe::emit(Event::CycleOpened {
            workspace: &ws.shared.name,
            cycle: ws.generation,
            scope,
            device: ws.device,
        });
    }
}

/// Cycle `cycle` (scope `scope`) ended with `figures` (the block is not yet learned or grown for
/// the next one); the allocator decided whether its spills deserve a warning.
fn cycle_ended(
    ws: &WorkspaceEntry,
    cycle: u64,
    scope: u64,
    figures: CycleFigures,
    replayed: Option<&str>,
) {
    let CycleFigures {
        bytes,
        spilled_bytes,
        spilled_count,
        warn,
    } = figures;
    let capacity = ws.capacity();
    let name = &ws.shared.name;
    if warn {
        tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            cycle,
            spilled_bytes,
            spilled_count,
            capacity,
            "workspace '{name}': cycle {cycle} spilled {} in {spilled_count} allocations past its {} block ({:?} spill policy){}",
            Bytes(spilled_bytes),
            Bytes(capacity),
            ws.config().spill(),
            match ws.config().spill() {
                SpillPolicy::Reallocate => "; the block grows at the end of the cycle",
                _ => "; the block never grows under this policy: raise initial_size or use SpillPolicy::Reallocate",
            }
        );
    } else {
        tracing::debug!(
            target: "ndscope::workspace",
            workspace = &**name,
            cycle,
            bytes,
            spilled_bytes,
            "workspace '{name}': cycle {cycle} ended: {} ({} spilled in {spilled_count} allocations)",
            Bytes(bytes),
            Bytes(spilled_bytes)
        );
    }
    if observe::on() {
        let end = CycleEnd {
            cycle,
            scope,
            device: ws.device,
            bytes,
            spilled_bytes,
            spilled_count,
            capacity,
        };
        observe::emit(Event::CycleClosed {
            workspace: name,
            end,
            replayed,
        });
    }
}

/// The block was learned from `demand` bytes (or could not be allocated).
fn learned(ws: &WorkspaceEntry, demand: usize, grown: &Result<bool>) {
    let name = &ws.shared.name;
    match grown {
        Ok(_) => tracing::info!(
            target: "ndscope::workspace",
            workspace = &**name,
            demand,
            capacity = ws.capacity(),
            "workspace '{name}': learned its block after {} cycles ({:?}): {} for a cycle of {} ({:?})",
            ws.alloc.cycles(),
            ws.config().learning(),
            Bytes(ws.capacity()),
            Bytes(demand),
            ws.config().allocation()
        ),
        Err(e) => tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            demand,
            "workspace '{name}': could not allocate its learned block, so it keeps spilling: {e}"
        ),
    }
}

/// The block was to grow from `old` bytes for a cycle that outgrew it (`Reallocate`).
fn reallocated(ws: &WorkspaceEntry, old: usize, grown: &Result<bool>) {
    let name = &ws.shared.name;
    match grown {
        Ok(true) => tracing::info!(
            target: "ndscope::workspace",
            workspace = &**name,
            old,
            capacity = ws.capacity(),
            "workspace '{name}': block grew from {} to {} for a cycle of {} (Reallocate)",
            Bytes(old),
            Bytes(ws.capacity()),
            Bytes(ws.alloc.max_cycle_bytes())
        ),
        Ok(false) => {}
        Err(e) => tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            "workspace '{name}': could not grow its {} block, so it keeps spilling: {e}",
            Bytes(old)
        ),
    }
}

/// A new block was allocated (replacing one of `old` bytes, or none when `old` is 0).
fn block_allocated(ws: &WorkspaceEntry, old: usize) {
    let Some(block) = &ws.block else {
        return;
    };
    tracing::debug!(
        target: "ndscope::workspace",
        workspace = &*ws.shared.name,
        capacity = block.capacity(),
        old,
        "workspace '{}': block of {} allocated on {}",
        ws.shared.name,
        Bytes(block.capacity()),
        block.memory_device()
    );
    if observe::on() {
        observe::emit(Event::BlockAllocated {
            workspace: &ws.shared.name,
            owner: ws.shared.owner.id,
            block: block.id(),
            address: block.address(),
            device: block.memory_device(),
            capacity: block.capacity(),
        });
    }
}
