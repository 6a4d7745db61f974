//! The workspace allocator: where each allocation of a cycle goes in the block (bump, circular
//! wrap, spill: a [`Plan`]), and what the block becomes when a cycle ends (learning, growth,
//! reset). Offsets and sizes only: no locks, arrays, managers or devices. The workspace entry
//! (`super`) asks it and carries out its answers (carving the block, closing overwritten arrays,
//! allocating a new block); the manager asks the workspace, never decides its policy.

use super::config::{LearningPolicy, ResetPolicy, SpillPolicy};

/// The allocator's decision of where one allocation goes: made by [`plan`](Allocator::plan),
/// carried out by the workspace entry, recorded by [`commit`](Allocator::commit). Carried out,
/// a `Block` plan becomes the array's `Place::Block` (the arena's record of where its bytes
/// live).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plan {
    /// `[offset, offset + aligned)` of the block; `wrap` when a circular workspace wraps to 0.
    Block { offset: usize, wrap: bool },
    /// Its own buffer, counted as a spill.
    Spill,
    /// Its own buffer, not counted (debug bypass).
    Bypass,
}

/// The block is full and the spill policy is `Fail`: the figures for `Error::WorkspaceFull`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Full {
    pub requested: usize,
    pub used: usize,
    pub capacity: usize,
}

/// The block as the allocator sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// No block yet: everything spills (that is how a cycle is measured).
    None,
    /// A block of `capacity` bytes whose every closed array's bytes are freed.
    Free { capacity: usize },
    /// A block some of whose bytes a closed array still holds (a kernel is reading them): nothing
    /// of it may be handed out until they are freed.
    Held { capacity: usize },
}

/// The policies the allocator follows (from the workspace's configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Policy {
    pub reset: ResetPolicy,
    pub spill: SpillPolicy,
    pub learning: LearningPolicy,
    pub cycles_before_initialization: u64,
    /// Circular workspaces only (the prefetcher's ring): an allocation never overwrites an open
    /// array of an earlier cycle (it spills instead), and at the end of a cycle the block grows
    /// to the policy's size for the largest cycle when that is larger than the block.
    pub keep_open: bool,
}

/// What the block should become when a cycle ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockChange {
    /// Nothing to do.
    Keep,
    /// The block is learned now, sized for `demand` bytes.
    Learn { demand: usize },
    /// The block is to grow for `demand` bytes (`SpillPolicy::Reallocate`).
    Reallocate { demand: usize },
}

/// The figures of the cycle that just ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CycleFigures {
    /// Its demand (aligned; block and spills).
    pub bytes: usize,
    /// What it spilled.
    pub spilled_bytes: usize,
    pub spilled_count: u64,
    /// Whether its spills are worth a warning (a learned block outgrown past the threshold, by
    /// more than the most warned about so far).
    pub warn: bool,
}

/// The counters an allocation changes, saved so a batch of allocations can be undone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Checkpoint {
    offset: usize,
    wrapped: bool,
    cycle_bytes: usize,
    spilled_bytes: usize,
    spilled_count: u64,
    live: usize,
}

/// The allocator's state: the bump offset, the open cycle's extent, and the counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Allocator {
    offset: usize,
    /// Circular workspaces: the offset when the current cycle opened, and whether the cycle has
    /// wrapped past the end since. The open cycle's arrays occupy `[cycle_start, offset)`, or
    /// `[cycle_start, capacity) ∪ [0, offset)` once wrapped; nothing may be placed there.
    cycle_start: usize,
    wrapped: bool,
    cycles: u64,
    cycle_bytes: usize,
    max_cycle_bytes: usize,
    last_cycle_bytes: usize,
    spilled_bytes: usize,
    spilled_count: u64,
    reallocations: u64,
    /// Slices of the current block handed out for arrays that are open (or being created or
    /// moved in).
    live: usize,
    /// `(spilled_bytes, spilled_count)` when the open cycle opened, for its own spills.
    spilled_at_open: (usize, u64),
    /// The most a learned cycle spilled so far, to warn once per new maximum, not every cycle.
    warned_spill: usize,
}

impl Allocator {
    /// The bump offset.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Cycles ended.
    pub fn cycles(&self) -> u64 {
        self.cycles
    }
    /// The largest cycle's demand.
    pub fn max_cycle_bytes(&self) -> usize {
        self.max_cycle_bytes
    }
    /// The last ended cycle's demand.
    pub fn last_cycle_bytes(&self) -> usize {
        self.last_cycle_bytes
    }
    /// Bytes spilled since creation.
    pub fn spilled_bytes(&self) -> usize {
        self.spilled_bytes
    }
    /// Allocations spilled since creation.
    pub fn spilled_count(&self) -> u64 {
        self.spilled_count
    }
    /// Times the block grew (`Reallocate`).
    pub fn reallocations(&self) -> u64 {
        self.reallocations
    }
    /// Slices of the current block handed out and not yet given back.
    pub fn live(&self) -> usize {
        self.live
    }

    /// Decides where `aligned` bytes go in the open cycle, changing nothing. `Err` only under
    /// `SpillPolicy::Fail` when the block cannot take them.
    #[inline]
    pub fn plan(&self, policy: &Policy, block: BlockState, aligned: usize) -> Result<Plan, Full> {
        let capacity = match block {
            // Before the block exists every allocation spills, whatever the policy.
            BlockState::None => return Ok(Plan::Spill),
            // A moment of a race between threads, not a cycle that outgrew the block: spill,
            // whatever the policy.
            BlockState::Held { .. } => return Ok(Plan::Spill),
            BlockState::Free { capacity } => capacity,
        };
        let fits = |start: usize, end_limit: usize| {
            start
                .checked_add(aligned)
                .is_some_and(|end| end <= end_limit)
        };
        let at = |offset: usize, wrap: bool| Plan::Block { offset, wrap };
        let plan = match policy.reset {
            ResetPolicy::BlockLeft => fits(self.offset, capacity).then(|| at(self.offset, false)),
            ResetPolicy::EndOfBuffer if !self.wrapped => {
                if fits(self.offset, capacity) {
                    Some(at(self.offset, false))
                } else if fits(0, self.cycle_start) {
                    Some(at(0, true))
                } else {
                    None
                }
            }
            // Wrapped: up to where the open cycle began.
            ResetPolicy::EndOfBuffer => {
                fits(self.offset, self.cycle_start).then(|| at(self.offset, false))
            }
        };
        match (plan, policy.spill) {
            (Some(plan), _) => Ok(plan),
            (None, SpillPolicy::External | SpillPolicy::Reallocate) => Ok(Plan::Spill),
            (None, SpillPolicy::Fail) => Err(Full {
                requested: aligned,
                used: self.offset,
                capacity,
            }),
        }
    }

    /// Records an allocation planned by [`plan`](Self::plan) (a block slice is live from now).
    pub fn commit(&mut self, plan: Plan, aligned: usize) {
        match plan {
            Plan::Block { offset, wrap } => {
                self.wrapped |= wrap;
                self.offset = offset + aligned;
                self.cycle_bytes += aligned;
                self.live += 1;
            }
            Plan::Spill => {
                self.cycle_bytes += aligned;
                self.spilled_bytes += aligned;
                self.spilled_count += 1;
            }
            Plan::Bypass => {}
        }
    }

    /// A block slice was given back (its array closed or moved out).
    pub fn release(&mut self) {
        self.live = self.live.saturating_sub(1);
    }

    /// The counters now, to undo what follows with [`restore`](Self::restore).
    pub fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            offset: self.offset,
            wrapped: self.wrapped,
            cycle_bytes: self.cycle_bytes,
            spilled_bytes: self.spilled_bytes,
            spilled_count: self.spilled_count,
            live: self.live,
        }
    }

    /// Undoes the allocations made since `c`.
    pub fn restore(&mut self, c: Checkpoint) {
        self.offset = c.offset;
        self.wrapped = c.wrapped;
        self.cycle_bytes = c.cycle_bytes;
        self.spilled_bytes = c.spilled_bytes;
        self.spilled_count = c.spilled_count;
        self.live = c.live;
    }

    /// A cycle opens: it starts where the last one left off.
    pub fn open_cycle(&mut self) {
        self.cycle_start = self.offset;
        self.wrapped = false;
        self.cycle_bytes = 0;
        self.spilled_at_open = (self.spilled_bytes, self.spilled_count);
    }

    /// The open cycle ends: its figures, and the reset (`BlockLeft` starts over at 0;
    /// `EndOfBuffer` goes on from where it is). `learned` says whether a block exists, and
    /// `warn_above` is the spill warning threshold.
    pub fn end_cycle(&mut self, policy: &Policy, learned: bool, warn_above: usize) -> CycleFigures {
        self.cycles += 1;
        self.last_cycle_bytes = self.cycle_bytes;
        self.max_cycle_bytes = self.max_cycle_bytes.max(self.cycle_bytes);
        self.cycle_bytes = 0;
        let spilled_bytes = self.spilled_bytes.saturating_sub(self.spilled_at_open.0);
        let spilled_count = self.spilled_count.saturating_sub(self.spilled_at_open.1);
        let warn = learned && spilled_bytes > warn_above && spilled_bytes > self.warned_spill;
        if warn {
            self.warned_spill = spilled_bytes;
        }
        if policy.reset == ResetPolicy::BlockLeft {
            self.offset = 0;
        }
        self.wrapped = false;
        CycleFigures {
            bytes: self.last_cycle_bytes,
            spilled_bytes,
            spilled_count,
            warn,
        }
    }

    /// What the block should become after the cycle that just ended: learned (no block yet, and
    /// the learning policy has seen enough; a cycle that allocated nothing teaches nothing), or
    /// grown (`Reallocate`, a cycle larger than the block; with `keep_open`, also a block smaller
    /// than `block_size` gives the largest cycle).
    pub fn growth(
        &self,
        policy: &Policy,
        capacity: Option<usize>,
        block_size: impl Fn(usize) -> usize,
    ) -> BlockChange {
        match capacity {
            None => {
                let demand = match policy.learning {
                    LearningPolicy::FirstLoop => self.last_cycle_bytes,
                    LearningPolicy::OverTime
                        if self.cycles >= policy.cycles_before_initialization =>
                    {
                        self.max_cycle_bytes
                    }
                    LearningPolicy::OverTime | LearningPolicy::None => 0,
                };
                if demand > 0 {
                    BlockChange::Learn { demand }
                } else {
                    BlockChange::Keep
                }
            }
            Some(capacity)
                if policy.spill == SpillPolicy::Reallocate
                    && (self.max_cycle_bytes > capacity
                        || (policy.keep_open && block_size(self.max_cycle_bytes) > capacity)) =>
            {
                BlockChange::Reallocate {
                    demand: self.max_cycle_bytes,
                }
            }
            Some(_) => BlockChange::Keep,
        }
    }

    /// The demand to size the block from now (`Workspace::initialize`): `initial_size`, else the
    /// largest cycle seen.
    pub fn initial_demand(&self, initial_size: usize) -> usize {
        if initial_size > 0 {
            initial_size
        } else {
            self.max_cycle_bytes
        }
    }

    /// A new block was allocated (the first, or a replacement): it starts empty.
    pub fn block_replaced(&mut self) {
        self.live = 0;
        self.offset = 0;
        self.cycle_start = 0;
        self.wrapped = false;
    }

    /// The block grew for a cycle larger than it (`Reallocate`).
    pub fn reallocated(&mut self) {
        self.reallocations += 1;
    }
}

/// Whether the arrays an ended cycle left in the current block will be overwritten when the
/// buffer comes round (a circular workspace's survivors): moved to another owner, they must be
/// copied out first.
pub(crate) fn survivors_overwritten(reset: ResetPolicy) -> bool {
    reset == ResetPolicy::EndOfBuffer
}

/// Whether `ret` out of an open cycle leaves the bytes where they are (a circular workspace keeps
/// them until the buffer comes round).
pub(crate) fn ret_in_place(reset: ResetPolicy) -> bool {
    reset == ResetPolicy::EndOfBuffer
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(reset: ResetPolicy, spill: SpillPolicy) -> Policy {
        Policy {
            reset,
            spill,
            learning: LearningPolicy::FirstLoop,
            cycles_before_initialization: 0,
            keep_open: false,
        }
    }

    const FREE: BlockState = BlockState::Free { capacity: 256 };

    /// Plans and commits `aligned` bytes.
    fn take(a: &mut Allocator, p: &Policy, block: BlockState, aligned: usize) -> Plan {
        let plan = a.plan(p, block, aligned).expect("placed");
        a.commit(plan, aligned);
        plan
    }

    #[test]
    fn bump_allocates_in_order_and_an_exact_fit_takes_the_last_byte() {
        let p = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        let first = take(&mut a, &p, FREE, 64);
        assert_eq!(
            first,
            Plan::Block {
                offset: 0,
                wrap: false
            }
        );
        assert_eq!(
            take(&mut a, &p, FREE, 128),
            Plan::Block {
                offset: 64,
                wrap: false
            }
        );
        // 64 bytes left: exactly 64 fits, one more byte would not.
        assert_eq!(a.plan(&p, FREE, 65), Ok(Plan::Spill));
        assert_eq!(
            take(&mut a, &p, FREE, 64),
            Plan::Block {
                offset: 192,
                wrap: false
            }
        );
        assert_eq!(a.offset(), 256);
        assert_eq!(a.live(), 3);
        assert_eq!(a.plan(&p, FREE, 64), Ok(Plan::Spill));
    }

    #[test]
    fn no_block_or_a_held_block_spills_whatever_the_policy() {
        let a = Allocator::default();
        for spill in [
            SpillPolicy::External,
            SpillPolicy::Fail,
            SpillPolicy::Reallocate,
        ] {
            let p = policy(ResetPolicy::BlockLeft, spill);
            assert_eq!(a.plan(&p, BlockState::None, 64), Ok(Plan::Spill));
            assert_eq!(
                a.plan(&p, BlockState::Held { capacity: 256 }, 64),
                Ok(Plan::Spill)
            );
        }
    }

    #[test]
    fn a_full_block_spills_or_fails_by_policy() {
        let mut a = Allocator::default();
        a.open_cycle();
        let external = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        take(&mut a, &external, FREE, 256);
        assert_eq!(a.plan(&external, FREE, 64), Ok(Plan::Spill));
        let reallocate = policy(ResetPolicy::BlockLeft, SpillPolicy::Reallocate);
        assert_eq!(a.plan(&reallocate, FREE, 64), Ok(Plan::Spill));
        let fail = policy(ResetPolicy::BlockLeft, SpillPolicy::Fail);
        assert_eq!(
            a.plan(&fail, FREE, 64),
            Err(Full {
                requested: 64,
                used: 256,
                capacity: 256
            })
        );
        // Sizes that overflow never fit.
        assert_eq!(a.plan(&external, FREE, usize::MAX), Ok(Plan::Spill));
    }

    #[test]
    fn spills_are_counted_and_a_bypass_is_not() {
        let p = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        a.commit(Plan::Spill, 128);
        a.commit(Plan::Bypass, 1024);
        assert_eq!((a.spilled_bytes(), a.spilled_count()), (128, 1));
        let end = a.end_cycle(&p, false, 0);
        assert_eq!(end.bytes, 128);
        assert_eq!((end.spilled_bytes, end.spilled_count), (128, 1));
        // Not learned yet: spills are expected, no warning.
        assert!(!end.warn);
    }

    #[test]
    fn block_left_resets_to_zero_and_end_of_buffer_goes_on() {
        let left = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &left, FREE, 128);
        a.end_cycle(&left, true, 0);
        assert_eq!(a.offset(), 0);

        let circular = policy(ResetPolicy::EndOfBuffer, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &circular, FREE, 128);
        a.end_cycle(&circular, true, 0);
        assert_eq!(a.offset(), 128);
        a.open_cycle();
        assert_eq!(
            take(&mut a, &circular, FREE, 64),
            Plan::Block {
                offset: 128,
                wrap: false
            }
        );
    }

    #[test]
    fn a_circular_block_wraps_to_zero_only_below_where_the_cycle_began() {
        let p = policy(ResetPolicy::EndOfBuffer, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 192);
        a.end_cycle(&p, true, 0);
        // Cycle 2 begins at 192: 64 fit at the end, then it wraps to 0.
        a.open_cycle();
        assert_eq!(
            take(&mut a, &p, FREE, 64),
            Plan::Block {
                offset: 192,
                wrap: false
            }
        );
        assert_eq!(
            take(&mut a, &p, FREE, 128),
            Plan::Block {
                offset: 0,
                wrap: true
            }
        );
        // Wrapped: room up to 192 only (exact fit), never over the cycle's own arrays.
        assert_eq!(a.plan(&p, FREE, 128), Ok(Plan::Spill));
        assert_eq!(
            take(&mut a, &p, FREE, 64),
            Plan::Block {
                offset: 128,
                wrap: false
            }
        );
        assert_eq!(a.plan(&p, FREE, 64), Ok(Plan::Spill));
        let fail = policy(ResetPolicy::EndOfBuffer, SpillPolicy::Fail);
        assert!(a.plan(&fail, FREE, 64).is_err());
    }

    #[test]
    fn a_circular_cycle_that_does_not_fit_at_the_end_nor_before_its_start_spills() {
        let p = policy(ResetPolicy::EndOfBuffer, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 64);
        a.end_cycle(&p, true, 0);
        a.open_cycle(); // begins at 64
        take(&mut a, &p, FREE, 128); // [64, 192)
                                     // 64 left at the end, and [0, 64) before the start: 128 fits in neither.
        assert_eq!(a.plan(&p, FREE, 128), Ok(Plan::Spill));
        assert_eq!(
            take(&mut a, &p, FREE, 64),
            Plan::Block {
                offset: 192,
                wrap: false
            }
        );
        assert_eq!(
            take(&mut a, &p, FREE, 64),
            Plan::Block {
                offset: 0,
                wrap: true
            }
        );
    }

    #[test]
    fn checkpoint_and_restore_undo_allocations() {
        let p = policy(ResetPolicy::EndOfBuffer, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 192);
        let saved = a.clone();
        let c = a.checkpoint();
        take(&mut a, &p, FREE, 64);
        a.commit(Plan::Spill, 64);
        assert_ne!(a, saved);
        a.restore(c);
        assert_eq!(a, saved);
    }

    #[test]
    fn learning_first_loop_over_time_and_none() {
        let mut p = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        // A cycle that allocated nothing teaches nothing.
        a.open_cycle();
        a.end_cycle(&p, false, 0);
        assert_eq!(a.growth(&p, None, |b| b), BlockChange::Keep);
        a.open_cycle();
        a.commit(Plan::Spill, 128);
        a.end_cycle(&p, false, 0);
        assert_eq!(
            a.growth(&p, None, |b| b),
            BlockChange::Learn { demand: 128 }
        );

        p.learning = LearningPolicy::OverTime;
        p.cycles_before_initialization = 4;
        let mut a = Allocator::default();
        for bytes in [64, 192, 128] {
            a.open_cycle();
            a.commit(Plan::Spill, bytes);
            a.end_cycle(&p, false, 0);
            assert_eq!(a.growth(&p, None, |b| b), BlockChange::Keep);
        }
        a.open_cycle();
        a.commit(Plan::Spill, 64);
        a.end_cycle(&p, false, 0);
        // After 4 cycles: the largest seen.
        assert_eq!(
            a.growth(&p, None, |b| b),
            BlockChange::Learn { demand: 192 }
        );

        p.learning = LearningPolicy::None;
        assert_eq!(a.growth(&p, None, |b| b), BlockChange::Keep);
        assert_eq!(a.initial_demand(0), 192);
        assert_eq!(a.initial_demand(1000), 1000);
    }

    #[test]
    fn reallocate_grows_for_a_larger_cycle_and_other_policies_keep() {
        let p = policy(ResetPolicy::BlockLeft, SpillPolicy::Reallocate);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 256);
        a.commit(Plan::Spill, 64);
        a.end_cycle(&p, true, 0);
        assert_eq!(
            a.growth(&p, Some(256), |b| b),
            BlockChange::Reallocate { demand: 320 }
        );
        assert_eq!(a.growth(&p, Some(320), |b| b), BlockChange::Keep);
        let external = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        assert_eq!(a.growth(&external, Some(256), |b| b), BlockChange::Keep);
        // A ring that keeps its open arrays grows to the policy's size for its largest cycle,
        // even when that cycle fits the block.
        let ring = Policy {
            keep_open: true,
            ..p
        };
        assert_eq!(a.growth(&ring, Some(320), |b| b), BlockChange::Keep);
        assert_eq!(
            a.growth(&ring, Some(320), |b| 3 * b),
            BlockChange::Reallocate { demand: 320 }
        );
        assert_eq!(a.growth(&p, Some(320), |b| 3 * b), BlockChange::Keep);
        a.block_replaced();
        a.reallocated();
        assert_eq!((a.reallocations(), a.offset(), a.live()), (1, 0, 0));
    }

    #[test]
    fn a_new_block_starts_empty_even_mid_cycle() {
        let p = policy(ResetPolicy::EndOfBuffer, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 192);
        a.block_replaced();
        assert_eq!(a.reallocations(), 0);
        assert_eq!(
            take(&mut a, &p, FREE, 256),
            Plan::Block {
                offset: 0,
                wrap: false
            }
        );
    }

    #[test]
    fn spill_warnings_come_once_per_new_maximum_and_only_when_learned() {
        let p = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        let cycle = |a: &mut Allocator, spill: usize, learned: bool, threshold: usize| {
            a.open_cycle();
            a.commit(Plan::Spill, spill);
            a.end_cycle(&p, learned, threshold).warn
        };
        assert!(!cycle(&mut a, 128, false, 0));
        assert!(cycle(&mut a, 128, true, 0));
        assert!(!cycle(&mut a, 128, true, 0));
        assert!(cycle(&mut a, 192, true, 0));
        assert!(!cycle(&mut a, 256, true, 512));
    }

    #[test]
    fn releasing_slices_counts_down_to_zero() {
        let p = policy(ResetPolicy::BlockLeft, SpillPolicy::External);
        let mut a = Allocator::default();
        a.open_cycle();
        take(&mut a, &p, FREE, 64);
        a.release();
        a.release();
        assert_eq!(a.live(), 0);
    }

    #[test]
    fn circular_policy_questions() {
        assert!(survivors_overwritten(ResetPolicy::EndOfBuffer));
        assert!(!survivors_overwritten(ResetPolicy::BlockLeft));
        assert!(ret_in_place(ResetPolicy::EndOfBuffer));
        assert!(!ret_in_place(ResetPolicy::BlockLeft));
    }
}
