//! A plain reference for one workspace: where each allocation of a cycle goes in the block, and
//! the figures `Workspace::stats` reports. Shared by the ownership model test
//! (`tests/model/mod.rs`), the workspace model test (`tests/workspace_model.rs`) and the fuzz
//! targets, so it depends on nothing but `ndscope`'s public configuration types.
//!
//! It is written from the rules of DESIGN.md §4 and the README's Workspaces section, not from
//! the allocator's code:
//!
//! - Every allocation takes its size rounded up to 64 bytes. Empty arrays take nothing.
//! - Before the block exists every allocation spills.
//! - The block is a ring of `capacity` bytes that each cycle walks once, in allocation order,
//!   from where it starts: at 0 under `BlockLeft` (the block is reset every cycle), and where
//!   the previous cycle stopped under `EndOfBuffer` (circular). An allocation goes right after
//!   the previous one if it ends inside the block and the walk has not come round to where the
//!   cycle started; a circular cycle that reaches the end of the block skips its tail, once,
//!   and goes on at 0. What does not fit spills (`External`, `Reallocate`) or is refused
//!   (`Fail`).
//! - The caller keeps the live ranges: an allocation in the block closes every array of an
//!   earlier cycle whose range it overlaps ("overwritten"); no two live ranges ever overlap.
//! - Block sizes: demand (`Strict`) or demand + ⌊demand × limit⌋ (`Overallocate`), at least
//!   `min_size`, at most `max_size` if set; a block of 0 bytes is none, and a block is only ever
//!   replaced by a larger one. `initial_size` sizes it at creation; learning sizes it at the end
//!   of a cycle (`FirstLoop`: that cycle; `OverTime`: the largest cycle, once
//!   `cycles_before_initialization` cycles have ended); `Reallocate` grows it at the end of a
//!   cycle that needed more than it has. A new block starts empty; arrays in the old one stay
//!   valid there.

#![allow(dead_code)] // each user needs a different part

use ndscope::{
    AllocationPolicy, LearningPolicy, ResetPolicy, SpillPolicy, WorkspaceConfig, WorkspaceStats,
};

/// Workspace allocations are rounded up to this many bytes (`ndscope::workspace::ALIGNMENT`).
pub const ALIGN: usize = 64;

/// The bytes a workspace allocation of `bytes` takes.
pub fn aligned(bytes: usize) -> usize {
    bytes.div_ceil(ALIGN) * ALIGN
}

/// Whether the byte ranges `[a.0, a.0 + a.1)` and `[b.0, b.0 + b.1)` share a byte.
pub fn overlap(a: (usize, usize), b: (usize, usize)) -> bool {
    a.1 > 0 && b.1 > 0 && a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

/// Where one allocation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// At this byte of the current block.
    Block(usize),
    /// In its own buffer.
    Spill,
    /// Refused with `WorkspaceFull` (`SpillPolicy::Fail`).
    Full,
}

/// One workspace as the reference sees it.
#[derive(Clone, Debug)]
pub struct BlockModel {
    config: WorkspaceConfig,
    /// Sizes of every block this workspace has had, oldest first; the last one is current.
    pub blocks: Vec<usize>,
    /// Where the open cycle started.
    start: usize,
    /// The end of the last allocation placed in the current block (what `stats().used` shows).
    used: usize,
    /// The ranges the open cycle has placed in the current block, in order (closed arrays
    /// included: their bytes stay taken until the cycle ends).
    cycle: Vec<(usize, usize)>,
    open: bool,
    cycles: u64,
    generation: u64,
    cycle_bytes: usize,
    max_cycle: usize,
    last_cycle: usize,
    spilled_bytes: usize,
    spilled_count: u64,
    reallocations: u64,
}

impl BlockModel {
    /// A new workspace with `config`: its block exists at once if `initial_size` asks for one.
    pub fn new(config: WorkspaceConfig) -> BlockModel {
        let mut m = BlockModel {
            config,
            blocks: Vec::new(),
            start: 0,
            used: 0,
            cycle: Vec::new(),
            open: false,
            cycles: 0,
            generation: 0,
            cycle_bytes: 0,
            max_cycle: 0,
            last_cycle: 0,
            spilled_bytes: 0,
            spilled_count: 0,
            reallocations: 0,
        };
        let initial = m.config.initial_size();
        if initial > 0 {
            m.grow(initial);
        }
        m
    }

    pub fn config(&self) -> &WorkspaceConfig {
        &self.config
    }

    pub fn circular(&self) -> bool {
        self.config.reset() == ResetPolicy::EndOfBuffer
    }

    /// The current block's number (index into [`blocks`](Self::blocks)) and size.
    pub fn current(&self) -> Option<(usize, usize)> {
        self.blocks
            .last()
            .map(|&size| (self.blocks.len() - 1, size))
    }

    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Cycles opened so far (the generation of the open or last cycle).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The block size for `demand` bytes under the allocation policy and the size bounds.
    pub fn block_size(&self, demand: usize) -> usize {
        let grown = match self.config.allocation() {
            AllocationPolicy::Strict => demand,
            AllocationPolicy::Overallocate => {
                demand + (demand as f64 * self.config.overallocation_limit()).floor() as usize
            }
        };
        let grown = grown.max(self.config.min_size());
        match self.config.max_size() {
            0 => grown,
            max => grown.min(max),
        }
    }

    /// Makes a new, empty block for `demand` if that gives a larger one.
    fn grow(&mut self, demand: usize) -> bool {
        let size = self.block_size(demand);
        if size == 0 || size <= self.current().map_or(0, |(_, s)| s) {
            return false;
        }
        self.blocks.push(size);
        self.start = 0;
        self.used = 0;
        self.cycle.clear();
        true
    }

    pub fn open_cycle(&mut self) {
        assert!(!self.open, "reference: a cycle is already open");
        self.open = true;
        self.generation += 1;
        self.start = if self.circular() { self.used } else { 0 };
        self.cycle.clear();
        self.cycle_bytes = 0;
    }

    /// Where an allocation of `aligned` bytes (> 0) of the open cycle goes. Changes nothing.
    pub fn place(&self, aligned: usize) -> Placement {
        assert!(self.open && aligned > 0);
        let refused = if self.config.spill() == SpillPolicy::Fail {
            Placement::Full
        } else {
            Placement::Spill
        };
        let Some((_, capacity)) = self.current() else {
            return Placement::Spill;
        };
        // How far round the ring this cycle has walked: it wrapped if it placed something before
        // its start (its walk then includes the tail it skipped).
        let wrapped = self.cycle.iter().any(|&(at, _)| at < self.start);
        let walked = if wrapped {
            capacity - self.start + self.used
        } else {
            self.used - self.start
        };
        if self.used + aligned <= capacity && walked + aligned <= capacity {
            return Placement::Block(self.used);
        }
        // Skip the rest of the block and go on at 0: once per cycle, circular only, and not
        // past the cycle's own start.
        if self.circular() && !wrapped && capacity - self.start + aligned <= capacity {
            return Placement::Block(0);
        }
        refused
    }

    /// Records an allocation of `aligned` bytes placed by [`place`](Self::place).
    pub fn commit(&mut self, placement: Placement, aligned: usize) {
        match placement {
            Placement::Block(at) => {
                let range = (at, aligned);
                assert!(
                    self.cycle.iter().all(|&r| !overlap(r, range)),
                    "reference: {range:?} overlaps this cycle's ranges {:?}",
                    self.cycle
                );
                self.cycle.push(range);
                self.used = at + aligned;
                self.cycle_bytes += aligned;
            }
            Placement::Spill => {
                self.cycle_bytes += aligned;
                self.spilled_bytes += aligned;
                self.spilled_count += 1;
            }
            Placement::Full => {}
        }
    }

    /// Ends the open cycle: figures, learning and growth. Returns whether a new block was made.
    pub fn end_cycle(&mut self) -> bool {
        assert!(self.open, "reference: no open cycle to end");
        self.open = false;
        self.cycles += 1;
        self.last_cycle = self.cycle_bytes;
        self.max_cycle = self.max_cycle.max(self.cycle_bytes);
        self.cycle_bytes = 0;
        self.cycle.clear();
        if !self.circular() {
            self.used = 0;
        }
        if self.current().is_none() {
            let demand = match self.config.learning() {
                LearningPolicy::FirstLoop => self.last_cycle,
                LearningPolicy::OverTime
                    if self.cycles >= self.config.cycles_before_initialization() as u64 =>
                {
                    self.max_cycle
                }
                _ => 0,
            };
            demand > 0 && self.grow(demand)
        } else if self.config.spill() == SpillPolicy::Reallocate
            && self.max_cycle > self.current().map_or(0, |(_, s)| s)
            && self.grow(self.max_cycle)
        {
            self.reallocations += 1;
            true
        } else {
            false
        }
    }

    pub fn stats(&self) -> WorkspaceStats {
        WorkspaceStats {
            capacity: self.current().map_or(0, |(_, s)| s),
            used: self.used,
            cycles: self.cycles,
            max_cycle_bytes: self.max_cycle,
            last_cycle_bytes: self.last_cycle,
            spilled_bytes: self.spilled_bytes,
            spilled_count: self.spilled_count,
            reallocations: self.reallocations,
            generation: self.generation,
            initialized: self.current().is_some(),
            graph: Default::default(),
        }
    }

    /// The figures `stats()` keeps after the workspace is destroyed: the counters, without a
    /// block.
    pub fn destroyed_stats(&self) -> WorkspaceStats {
        WorkspaceStats {
            capacity: 0,
            used: 0,
            initialized: false,
            ..self.stats()
        }
    }
}
