//! A model test of the workspace cycle state machine: random configurations and random sequences
//! of cycle operations, applied to a real workspace and to a plain reference model. After every
//! step the workspace's stats must equal the model's, every array the model holds open must be
//! open and still hold its own values (no two live arrays ever share bytes), and every array the
//! model closed must be closed. Memory counters are process-wide: this is the only test here.

use ndscope::{
    memory_usage, AllocationPolicy, DType, Device, Error, LearningPolicy, Manager, NDArray,
    ResetPolicy, Scope, SpillPolicy, Workspace, WorkspaceConfig, WorkspaceStats,
};
use proptest::prelude::*;

const ALIGN: usize = 64;

#[derive(Clone, Debug)]
struct Conf {
    reset: ResetPolicy,
    spill: SpillPolicy,
    learning: LearningPolicy,
    cycles_before: usize,
    strict: bool,
    limit: f64,
    initial: usize,
    min: usize,
    max: usize,
}

#[derive(Clone, Debug)]
enum Op {
    Open,
    Close,
    /// A new f32 array of this many elements in the open cycle.
    Alloc(usize),
    /// `add_scalar` on a cycle-owned array (a result of the same size in the cycle).
    Compute(usize),
    Ret(usize),
    Detach(usize),
    CloseArray(usize),
}

fn conf_strategy() -> impl Strategy<Value = Conf> {
    (
        prop_oneof![Just(ResetPolicy::BlockLeft), Just(ResetPolicy::EndOfBuffer)],
        prop_oneof![
            Just(SpillPolicy::External),
            Just(SpillPolicy::Reallocate),
            Just(SpillPolicy::Fail)
        ],
        prop_oneof![
            Just(LearningPolicy::FirstLoop),
            Just(LearningPolicy::OverTime),
            Just(LearningPolicy::None)
        ],
        1usize..4,
        any::<bool>(),
        prop_oneof![Just(0.0), Just(0.3), Just(1.0)],
        prop_oneof![Just(0usize), 512usize..6000],
        prop_oneof![Just(0usize), 256usize..2048],
        prop_oneof![Just(0usize), 2048usize..8192],
    )
        .prop_map(
            |(reset, spill, learning, cycles_before, strict, limit, initial, min, max)| Conf {
                reset,
                spill,
                learning,
                cycles_before: if learning == LearningPolicy::OverTime {
                    cycles_before
                } else {
                    0
                },
                strict,
                limit,
                initial,
                min,
                max,
            },
        )
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => Just(Op::Open),
        2 => Just(Op::Close),
        6 => (0usize..400).prop_map(Op::Alloc),
        2 => any::<usize>().prop_map(Op::Compute),
        2 => any::<usize>().prop_map(Op::Ret),
        1 => any::<usize>().prop_map(Op::Detach),
        1 => any::<usize>().prop_map(Op::CloseArray),
    ]
}

fn build(conf: &Conf) -> Option<WorkspaceConfig> {
    WorkspaceConfig::builder()
        .reset(conf.reset)
        .spill(conf.spill)
        .learning(conf.learning)
        .cycles_before_initialization(conf.cycles_before)
        .allocation(if conf.strict {
            AllocationPolicy::Strict
        } else {
            AllocationPolicy::Overallocate
        })
        .overallocation_limit(conf.limit)
        .initial_size(conf.initial)
        .min_size(conf.min)
        .max_size(conf.max)
        .build()
        .ok()
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Where {
    /// In the open cycle's scope; `Some(offset, len)` if in the block.
    Cycle(Option<(usize, usize)>),
    /// Outside any cycle, in its own buffer (trainer-owned or detached).
    Heap,
    /// Outside the cycle but still in the block (circular `ret`): evictable.
    Survivor(usize, usize),
    /// In a block that has since been replaced: valid until closed.
    OldBlock,
}

struct Live {
    handle: NDArray,
    value: f32,
    len: usize,
    at: Where,
}

/// The reference: plain arithmetic on the documented policies.
struct Model {
    conf: Conf,
    capacity: usize,
    initialized: bool,
    offset: usize,
    cycle_start: usize,
    wrapped: bool,
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

enum Slot {
    Block(usize, bool),
    Spill,
    Full,
}

impl Model {
    fn new(conf: Conf) -> Model {
        let mut m = Model {
            conf,
            capacity: 0,
            initialized: false,
            offset: 0,
            cycle_start: 0,
            wrapped: false,
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
        if m.conf.initial > 0 {
            m.grow(m.conf.initial);
        }
        m
    }

    fn block_size(&self, demand: usize) -> usize {
        let grown = if self.conf.strict {
            demand
        } else {
            demand + (demand as f64 * self.conf.limit).floor() as usize
        };
        let grown = grown.max(self.conf.min);
        if self.conf.max > 0 {
            grown.min(self.conf.max)
        } else {
            grown
        }
    }

    /// Returns true when a new block replaced the old one.
    fn grow(&mut self, demand: usize) -> bool {
        let size = self.block_size(demand);
        if size == 0 || size <= self.capacity {
            return false;
        }
        let replaced = self.initialized;
        self.capacity = size;
        self.initialized = true;
        self.offset = 0;
        self.cycle_start = 0;
        self.wrapped = false;
        let _ = replaced;
        true
    }

    fn plan(&self, aligned: usize) -> Slot {
        if !self.initialized {
            return Slot::Spill;
        }
        let fits = |start: usize, limit: usize| start + aligned <= limit;
        let slot = match (self.conf.reset, self.wrapped) {
            (ResetPolicy::BlockLeft, _) => {
                fits(self.offset, self.capacity).then_some(Slot::Block(self.offset, false))
            }
            (ResetPolicy::EndOfBuffer, false) => {
                if fits(self.offset, self.capacity) {
                    Some(Slot::Block(self.offset, false))
                } else if fits(0, self.cycle_start) {
                    Some(Slot::Block(0, true))
                } else {
                    None
                }
            }
            (ResetPolicy::EndOfBuffer, true) => {
                fits(self.offset, self.cycle_start).then_some(Slot::Block(self.offset, false))
            }
        };
        match slot {
            Some(s) => s,
            None if self.conf.spill == SpillPolicy::Fail => Slot::Full,
            None => Slot::Spill,
        }
    }

    fn commit(&mut self, slot: &Slot, aligned: usize) {
        match *slot {
            Slot::Block(off, wrap) => {
                self.wrapped |= wrap;
                self.offset = off + aligned;
                self.cycle_bytes += aligned;
            }
            Slot::Spill => {
                self.cycle_bytes += aligned;
                self.spilled_bytes += aligned;
                self.spilled_count += 1;
            }
            Slot::Full => {}
        }
    }

    fn open_cycle(&mut self) {
        self.open = true;
        self.generation += 1;
        self.cycle_start = self.offset;
        self.wrapped = false;
        self.cycle_bytes = 0;
    }

    /// Returns true when the block was replaced.
    fn end_cycle(&mut self) -> bool {
        self.open = false;
        self.cycles += 1;
        self.last_cycle = self.cycle_bytes;
        self.max_cycle = self.max_cycle.max(self.cycle_bytes);
        self.cycle_bytes = 0;
        if self.conf.reset == ResetPolicy::BlockLeft {
            self.offset = 0;
        }
        self.wrapped = false;
        if !self.initialized {
            let demand = match self.conf.learning {
                LearningPolicy::FirstLoop => self.last_cycle,
                LearningPolicy::OverTime if self.cycles >= self.conf.cycles_before as u64 => {
                    self.max_cycle
                }
                _ => 0,
            };
            demand > 0 && self.grow(demand)
        } else if self.conf.spill == SpillPolicy::Reallocate
            && self.max_cycle > self.capacity
            && self.grow(self.max_cycle)
        {
            self.reallocations += 1;
            true
        } else {
            false
        }
    }

    fn stats(&self) -> WorkspaceStats {
        WorkspaceStats {
            capacity: self.capacity,
            used: self.offset,
            cycles: self.cycles,
            max_cycle_bytes: self.max_cycle,
            last_cycle_bytes: self.last_cycle,
            spilled_bytes: self.spilled_bytes,
            spilled_count: self.spilled_count,
            reallocations: self.reallocations,
            generation: self.generation,
            initialized: self.initialized,
        }
    }
}

struct Harness {
    trainer: Manager,
    ws: Workspace,
    cycle: Option<Scope>,
    model: Model,
    live: Vec<Live>,
    closed: Vec<NDArray>,
    next_value: f32,
}

impl Harness {
    fn evict_overlapping(&mut self, off: usize, len: usize) {
        let mut i = 0;
        while i < self.live.len() {
            if let Where::Survivor(o, l) = self.live[i].at {
                if o < off + len && off < o + l {
                    let gone = self.live.swap_remove(i);
                    self.closed.push(gone.handle);
                    continue;
                }
            }
            i += 1;
        }
    }

    fn new_in_cycle(
        &mut self,
        len: usize,
        make: impl FnOnce(&Scope, f32) -> Result<NDArray, Error>,
    ) -> Result<(), TestCaseError> {
        let Some(cycle) = self.cycle.as_ref() else {
            return Ok(());
        };
        let value = self.next_value;
        self.next_value += 1.0;
        let aligned = (len * 4).div_ceil(ALIGN) * ALIGN;
        let slot = if len == 0 {
            Slot::Spill
        } else {
            self.model.plan(aligned)
        };
        let result = make(cycle, value);
        match (&slot, result) {
            (Slot::Full, Err(Error::WorkspaceFull { .. })) => return Ok(()),
            (Slot::Full, other) => {
                return Err(TestCaseError::fail(format!(
                    "expected WorkspaceFull, got {other:?}"
                )))
            }
            (_, Err(e)) => return Err(TestCaseError::fail(format!("allocation failed: {e}"))),
            (_, Ok(handle)) => {
                let at = match slot {
                    Slot::Block(off, _) if len > 0 => {
                        self.evict_overlapping(off, aligned);
                        Where::Cycle(Some((off, aligned)))
                    }
                    _ => Where::Cycle(None),
                };
                if len > 0 {
                    self.model.commit(&slot, aligned);
                }
                self.live.push(Live {
                    handle,
                    value,
                    len,
                    at,
                });
            }
        }
        Ok(())
    }

    fn cycle_owned(&self, pick: usize) -> Option<usize> {
        let idx: Vec<usize> = (0..self.live.len())
            .filter(|&i| matches!(self.live[i].at, Where::Cycle(_)))
            .collect();
        (!idx.is_empty()).then(|| idx[pick % idx.len()])
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Open => {
                if self.cycle.is_some() {
                    let busy = matches!(self.ws.open(), Err(Error::WorkspaceBusy { .. }));
                    prop_assert!(busy, "a second open must be WorkspaceBusy");
                } else {
                    self.cycle = Some(
                        self.ws
                            .open()
                            .map_err(|e| TestCaseError::fail(e.to_string()))?,
                    );
                    self.model.open_cycle();
                }
            }
            Op::Close => {
                if let Some(cycle) = self.cycle.take() {
                    cycle
                        .close()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    let mut i = 0;
                    while i < self.live.len() {
                        if matches!(self.live[i].at, Where::Cycle(_)) {
                            let gone = self.live.swap_remove(i);
                            self.closed.push(gone.handle);
                        } else {
                            i += 1;
                        }
                    }
                    if self.model.end_cycle() {
                        for l in &mut self.live {
                            if matches!(l.at, Where::Survivor(..)) {
                                l.at = Where::OldBlock;
                            }
                        }
                    }
                }
            }
            Op::Alloc(len) => {
                self.new_in_cycle(len, |c, v| c.full([len], v as f64, DType::F32))?;
            }
            Op::Compute(pick) => {
                if let Some(i) = self.cycle_owned(pick) {
                    let src = self.live[i].handle.clone();
                    let len = self.live[i].len;
                    let value = self.live[i].value;
                    // The result's value is value + 1; the harness records `next_value`, so
                    // shift the source instead: result = src + (next - value).
                    let next = self.next_value;
                    self.new_in_cycle(len, |_, _| src.add_scalar((next - value) as f64))?;
                }
            }
            Op::Ret(pick) => {
                if let (Some(i), Some(cycle)) = (self.cycle_owned(pick), self.cycle.as_ref()) {
                    cycle
                        .ret(&self.live[i].handle)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    self.live[i].at = match (self.model.conf.reset, self.live[i].at) {
                        (ResetPolicy::EndOfBuffer, Where::Cycle(Some((o, l)))) => {
                            Where::Survivor(o, l)
                        }
                        _ => Where::Heap,
                    };
                }
            }
            Op::Detach(pick) => {
                if let Some(i) = self.cycle_owned(pick) {
                    self.live[i]
                        .handle
                        .detach()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    self.live[i].at = Where::Heap;
                }
            }
            Op::CloseArray(pick) => {
                if !self.live.is_empty() {
                    let gone = self.live.swap_remove(pick % self.live.len());
                    gone.handle
                        .close()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    self.closed.push(gone.handle);
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.ws.stats(), self.model.stats());
        for l in &self.live {
            prop_assert!(l.handle.is_open(), "model holds {:?} open", l.at);
            let data = l
                .handle
                .to_vec::<f32>()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(data.len(), l.len);
            prop_assert!(
                data.iter().all(|&v| v == l.value),
                "array {:?} at {:?} should hold {} everywhere",
                l.handle,
                l.at,
                l.value
            );
        }
        for c in &self.closed {
            prop_assert!(!c.is_open(), "model closed {:?}", c);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn workspace_cycles_match_the_model(conf in conf_strategy(), ops in prop::collection::vec(op_strategy(), 1..80)) {
        let Some(config) = build(&conf) else {
            return Ok(());
        };
        let base = memory_usage(Device::Cpu).in_use;
        let trainer = Manager::new_base().with_name("trainer");
        let ws = trainer.workspace("batch", config).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut h = Harness {
            trainer: trainer.clone(),
            ws,
            cycle: None,
            model: Model::new(conf),
            live: Vec::new(),
            closed: Vec::new(),
            next_value: 1.0,
        };
        h.check()?;
        for op in &ops {
            h.apply(op)?;
            h.check()?;
        }
        for l in &h.live {
            if matches!(l.at, Where::Heap) && l.handle.is_detached() {
                l.handle.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        drop(h.cycle.take());
        h.trainer.close().map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(memory_usage(Device::Cpu).in_use, base, "everything given back");
    }
}
