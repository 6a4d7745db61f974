//! A model test of the workspace cycle state machine: random configurations and random sequences
//! of cycle operations, applied to a real workspace and to a plain reference. Where each
//! allocation goes and what `stats()` says come from the ring model of `tests/model/block.rs`
//! (written from DESIGN.md §4, not from the allocator); which arrays a circular workspace
//! overwrites comes from the list of live byte ranges kept here. After every step the workspace's
//! stats must equal the reference's, every array the reference holds open must be open and still
//! hold its own values (no two live arrays ever share bytes), and every array it closed must be
//! closed. Memory counters are process-wide: this is the only test here.

#[path = "model/block.rs"]
mod block;

use block::{aligned, overlap, BlockModel, Placement};

use ndscope::{
    memory_usage, AllocationPolicy, DType, Device, Error, LearningPolicy, Manager, NDArray,
    ResetPolicy, Scope, SpillPolicy, Workspace, WorkspaceConfig,
};
use proptest::prelude::*;

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

/// Where a live array's bytes are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Where {
    /// Owned by the open cycle; `Some((block, start, len))` if its bytes are in the block.
    Cycle(Option<(usize, usize, usize)>),
    /// Outside any cycle, in its own buffer (trainer-owned or detached).
    Heap,
    /// Outside the cycle but still in block number `block` (circular `ret`): it stays valid
    /// until a later allocation in that block overlaps it.
    Survivor {
        block: usize,
        start: usize,
        len: usize,
    },
}

impl Where {
    /// The live byte range `(block, start, len)` the array occupies, if it is in a block.
    fn range(self) -> Option<(usize, usize, usize)> {
        match self {
            Where::Cycle(range) => range,
            Where::Survivor { block, start, len } => Some((block, start, len)),
            Where::Heap => None,
        }
    }
}

struct Live {
    handle: NDArray,
    value: f32,
    len: usize,
    at: Where,
}

struct Harness {
    trainer: Manager,
    ws: Workspace,
    cycle: Option<Scope>,
    /// The plain reference for placement and figures (`tests/model/block.rs`).
    model: BlockModel,
    /// The live arrays: with `Where::range`, the list of live byte ranges of the block.
    live: Vec<Live>,
    /// Arrays the reference closed, and whether a circular allocation overwrote them.
    closed: Vec<(NDArray, bool)>,
    next_value: f32,
}

impl Harness {
    /// Closes (in the reference) the arrays of earlier cycles whose live range overlaps
    /// `[start, start + len)` of block number `block`, and checks that no array of this cycle
    /// does: no two live ranges may share a byte.
    fn overwrite(&mut self, block: usize, start: usize, len: usize) -> Result<(), TestCaseError> {
        let mut i = 0;
        while i < self.live.len() {
            let l = &self.live[i];
            match (l.at, l.at.range()) {
                (at, Some((b, s, n))) if b == block && overlap((s, n), (start, len)) => {
                    prop_assert!(
                        matches!(at, Where::Survivor { .. }),
                        "the reference placed [{start}, +{len}) over a live array of this cycle at {at:?}"
                    );
                    let gone = self.live.swap_remove(i);
                    self.closed.push((gone.handle, true));
                }
                _ => i += 1,
            }
        }
        Ok(())
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
        let size = aligned(len * 4);
        let placement = if len == 0 {
            Placement::Spill
        } else {
            self.model.place(size)
        };
        let result = make(cycle, value);
        match (placement, result) {
            (Placement::Full, Err(Error::WorkspaceFull { .. })) => Ok(()),
            (Placement::Full, other) => Err(TestCaseError::fail(format!(
                "expected WorkspaceFull, got {other:?}"
            ))),
            (_, Err(e)) => Err(TestCaseError::fail(format!("allocation failed: {e}"))),
            (_, Ok(handle)) => {
                let at = match placement {
                    Placement::Block(start) => {
                        let (block, _) = self.model.current().expect("placed in a block");
                        self.overwrite(block, start, size)?;
                        Where::Cycle(Some((block, start, size)))
                    }
                    _ => Where::Cycle(None),
                };
                if len > 0 {
                    self.model.commit(placement, size);
                }
                self.live.push(Live {
                    handle,
                    value,
                    len,
                    at,
                });
                Ok(())
            }
        }
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
                            self.closed.push((gone.handle, false));
                        } else {
                            i += 1;
                        }
                    }
                    // A new block leaves the survivors where they are, in the old one (no later
                    // allocation lands there).
                    self.model.end_cycle();
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
                    // A circular workspace keeps the array in place (zero-copy); otherwise it is
                    // copied out.
                    self.live[i].at = match (self.model.circular(), self.live[i].at) {
                        (true, Where::Cycle(Some((block, start, len)))) => {
                            Where::Survivor { block, start, len }
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
                    self.closed.push((gone.handle, false));
                }
            }
        }
        Ok(())
    }

    fn check(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.ws.stats(), self.model.stats());
        for l in &self.live {
            prop_assert!(l.handle.is_open(), "the reference holds {:?} open", l.at);
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
        for (c, overwritten) in &self.closed {
            prop_assert!(!c.is_open(), "the reference closed {:?}", c);
            let why = match c.to_vec::<f32>() {
                Err(e @ Error::ArrayClosed { .. }) => e.to_string(),
                other => return Err(TestCaseError::fail(format!("{c:?} read as {other:?}"))),
            };
            prop_assert_eq!(
                why.contains("overwritten"),
                *overwritten,
                "{:?}: {}",
                c,
                why
            );
        }
        Ok(())
    }
}

/// Ops per case (fewer under Miri, which interprets every step about a thousand times slower).
const MAX_OPS: usize = if cfg!(miri) { 20 } else { 80 };

proptest! {
    #![proptest_config(ProptestConfig {
        cases: if cfg!(miri) { 5 } else { 1000 },
        // Miri runs without file access.
        failure_persistence: if cfg!(miri) {
            None
        } else {
            ProptestConfig::default().failure_persistence
        },
        ..ProptestConfig::default()
    })]

    #[test]
    fn workspace_cycles_match_the_model(conf in conf_strategy(), ops in prop::collection::vec(op_strategy(), 1..MAX_OPS)) {
        let Some(config) = build(&conf) else {
            return Ok(());
        };
        let base = memory_usage(Device::Cpu).in_use;
        let trainer = Manager::new_base().with_name("trainer");
        let ws = trainer.workspace("batch", config.clone()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        let mut h = Harness {
            trainer: trainer.clone(),
            ws,
            cycle: None,
            model: BlockModel::new(config.clone()),
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
