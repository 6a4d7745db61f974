//! The model test's reference: a plain model of managers, arrays and workspaces (vectors and
//! maps, nothing clever) and the [`Op`] enum that drives both it and the real library.
//!
//! Shared by the proptest state-machine test (`tests/model.rs`) and the fuzz targets
//! (`fuzz/fuzz_targets/ownership.rs` and `workspace.rs`, through `#[path]`), so it depends on
//! nothing but `ndscope`.
//!
//! [`Harness::apply`] runs one [`Op`] on the library and on the model, checks that both agree on
//! the result (`Ok`, or which error), that a failed op changed nothing (unless the model says
//! what it changed), and then [`Harness::check`]s every handle against the model: ownership,
//! reports, workspace figures, the memory counters and the **contents** of every array. Every
//! array is made with its own values (from a counter) and the model keeps what each one must
//! hold, so two arrays sharing bytes, an array reading another's data, or data lost in a copy
//! out of a workspace all show up as a wrong `to_vec`.
//!
//! The contract encoded here is DESIGN.md §2 and §4 plus the decisions stated in the README and
//! the doc comments of `Manager`, `NDArray` and `Workspace`. Where each workspace allocation
//! goes comes from the plain ring model of [`block`], with the live byte ranges kept here.
//!
//! The memory counters are process-wide: only one harness may exist at a time in a process, and
//! nothing else in that process may create arrays while it lives.

#![allow(dead_code)] // each of the users needs a different part

pub mod block;

use std::collections::BTreeMap;

use ndscope::{
    memory_usage, ActiveScope, ArrayId, DType, Device, Error, LearningPolicy, Manager, ManagerId,
    NDArray, NDList, ResetPolicy, Scope, SpillPolicy, Workspace, WorkspaceConfig, WorkspaceStats,
};

use block::{aligned, overlap, BlockModel, Placement};

/// Array lengths are taken modulo this, so equal lengths (needed by [`Op::BinaryOp`]) are common.
/// Every non-empty array takes one 64-byte slot of a workspace block.
pub const LENGTHS: usize = 5;

/// The workspace configurations [`Op::CreateWorkspace`] picks from (modulo this).
pub const WORKSPACE_CONFIGS: usize = 6;

/// Workspace configuration `i % WORKSPACE_CONFIGS`. Block sizes are in 64-byte slots, the size
/// of every non-empty array of the model:
/// 0. ND4J's defaults: learned from the first cycle + 30%, external spills, reset every cycle;
/// 1. a fixed block of 4 slots, external spills past it;
/// 2. learned exactly from the first cycle, grown (`Reallocate`) when a cycle needs more;
/// 3. circular (`EndOfBuffer`), a fixed block of 4 slots: `ret`-ed arrays stay in place until a
///    later cycle's allocations come round and overwrite them;
/// 4. circular, learned + 50% and grown: arrays kept in a replaced block stay valid there;
/// 5. a fixed block of 3 slots that refuses what does not fit (`WorkspaceFull`).
pub fn workspace_config(i: usize) -> WorkspaceConfig {
    let strict = ndscope::AllocationPolicy::Strict;
    let builder = WorkspaceConfig::builder();
    let builder = match i % WORKSPACE_CONFIGS {
        0 => builder,
        1 => builder
            .learning(LearningPolicy::None)
            .initial_size(256)
            .allocation(strict),
        2 => builder.allocation(strict).spill(SpillPolicy::Reallocate),
        3 => builder
            .reset(ResetPolicy::EndOfBuffer)
            .learning(LearningPolicy::None)
            .initial_size(256)
            .allocation(strict),
        4 => builder
            .reset(ResetPolicy::EndOfBuffer)
            .overallocation_limit(0.5)
            .spill(SpillPolicy::Reallocate),
        _ => builder
            .learning(LearningPolicy::None)
            .initial_size(192)
            .allocation(strict)
            .spill(SpillPolicy::Fail),
    };
    builder
        .build()
        .expect("the model's workspace configurations are valid")
}

/// The values array number `index` of a harness is created with: distinct from every other
/// array's, exact in f32.
pub fn contents(index: usize, len: usize) -> Vec<f32> {
    (0..len).map(|i| (index * 8 + i + 1) as f32).collect()
}

/// Which `NDList` call [`Op::List`] makes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListAction {
    /// `list.attach(&managers[manager])`.
    Attach,
    /// `list.temp_attach(&managers[manager])`.
    TempAttach,
    /// `list.detach()`.
    Detach,
    /// `managers[manager].ret_list(&list)`.
    Ret,
    /// `list.close()`.
    Close,
}

impl ListAction {
    pub const ALL: [ListAction; 5] = [
        ListAction::Attach,
        ListAction::TempAttach,
        ListAction::Detach,
        ListAction::Ret,
        ListAction::Close,
    ];
}

/// One step of a test. Indices are taken modulo the current number of managers (the system
/// manager is manager 0), arrays or workspaces, so every op can be applied to any state; an op on
/// an array or workspace index when there is none yet does nothing. Several arrays (`arrays`,
/// `count`) are the first `1 + count % 3` of the three indices, repeats allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // `BinaryOp` is the name the test plan uses
pub enum Op {
    /// `None`: `Manager::new_base()`; `Some(p)`: `managers[p].new_sub_manager()`.
    CreateManager { parent: Option<usize> },
    /// A new f32 array of `len % LENGTHS` elements in `managers[manager]`, holding
    /// [`contents`] (made by `from_slice`, `from_vec` or `arange` in turn).
    CreateArray { manager: usize, len: usize },
    /// `arrays[a].add(&arrays[b'])`, where `b'` is the `b`-th (modulo) array of the same length
    /// as `arrays[a]`, so shapes always agree.
    BinaryOp { a: usize, b: usize },
    /// `arrays[array].attach(&managers[manager])`.
    Attach { array: usize, manager: usize },
    /// `arrays[array].temp_attach(&managers[manager])`.
    TempAttach { array: usize, manager: usize },
    /// `arrays[array].detach()`.
    Detach { array: usize },
    /// `managers[manager].ret(&arrays[array])`.
    Ret { manager: usize, array: usize },
    /// `managers[manager].cap()`, never the system manager (a cap is one-way and the system
    /// manager lives as long as the process): the index is taken among the other managers, and
    /// the op does nothing while there are none.
    Cap { manager: usize },
    /// `arrays[array].close()`.
    CloseArray { array: usize },
    /// `managers[manager].close()`.
    CloseManager { manager: usize },
    /// `managers[manager].workspace(name, workspace_config(config))` with a fresh name; never on
    /// the system manager (the index is taken among the others, as for `Cap`).
    CreateWorkspace { manager: usize, config: usize },
    /// `workspaces[workspace].open()`: the cycle's scope becomes the next manager.
    OpenCycle { workspace: usize },
    /// Closes the `workspace`-th (modulo) cycle open now, if any is.
    CloseCycle { workspace: usize },
    /// `managers[manager].activate()`: op results on this thread land there while it is the
    /// innermost active scope.
    Activate { manager: usize },
    /// Drops the innermost guard made by `Activate`.
    Deactivate,
    /// [`Op::CreateArray`] in the scope of the `workspace`-th (modulo) cycle open now.
    CycleArray { workspace: usize, len: usize },
    /// [`Op::Ret`] out of the scope of the `workspace`-th (modulo) cycle open now, of the
    /// `array`-th (modulo) array that scope holds (of any array if it holds none).
    CycleRet { workspace: usize, array: usize },
    /// [`Op::Activate`] of the scope of the `workspace`-th (modulo) cycle open now.
    ActivateCycle { workspace: usize },
    /// `managers[manager].attach_all(&arrays)`.
    AttachAll {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
    },
    /// `managers[manager].temp_attach_all(&arrays)`.
    TempAttachAll {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
    },
    /// An `NDList` of the arrays, and `action` on it.
    List {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
        action: ListAction,
    },
}

/// What an op gave: `Ok` or the kind of error. `Skipped` when the op had nothing to act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Ok,
    ArrayClosed,
    ManagerClosed,
    Capped,
    SystemManager,
    InvalidArgument,
    WorkspaceFull,
    WorkspaceBusy,
    Skipped,
}

impl Outcome {
    fn of<T>(result: &Result<T, Error>) -> Outcome {
        match result {
            Ok(_) => Outcome::Ok,
            Err(Error::ArrayClosed { .. }) => Outcome::ArrayClosed,
            Err(Error::ManagerClosed { .. }) => Outcome::ManagerClosed,
            Err(Error::Capped { .. }) => Outcome::Capped,
            Err(Error::SystemManager { .. }) => Outcome::SystemManager,
            Err(Error::InvalidArgument { .. }) => Outcome::InvalidArgument,
            Err(Error::WorkspaceFull { .. }) => Outcome::WorkspaceFull,
            Err(Error::WorkspaceBusy { .. }) => Outcome::WorkspaceBusy,
            Err(e) => panic!("an error the model never expects: {e}"),
        }
    }
}

/// Which kind of ownership move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Move {
    Attach,
    TempAttach,
    Detach,
    Ret,
}

/// An op with its indices resolved against the current state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Skip,
    NewBase,
    NewSub {
        parent: usize,
    },
    CreateArray {
        manager: usize,
        len: usize,
    },
    Add {
        a: usize,
        b: usize,
    },
    Attach {
        array: usize,
        manager: usize,
    },
    TempAttach {
        array: usize,
        manager: usize,
    },
    Detach {
        array: usize,
    },
    Ret {
        manager: usize,
        array: usize,
    },
    Cap {
        manager: usize,
    },
    CloseArray {
        array: usize,
    },
    CloseManager {
        manager: usize,
    },
    CreateWorkspace {
        manager: usize,
        config: usize,
    },
    OpenCycle {
        workspace: usize,
    },
    Activate {
        manager: usize,
    },
    Deactivate,
    AttachAll {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
    },
    TempAttachAll {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
    },
    List {
        arrays: [usize; 3],
        count: usize,
        manager: usize,
        action: ListAction,
    },
}

// ------------------------------------------------------------------------------------------------
// The reference model.

/// Who holds an array in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holder {
    /// The manager of this index (owning it, or borrowing it when `lenders` is not empty).
    Manager(usize),
    /// Nobody: after `detach`, or as the result of an op on a detached array.
    Detached,
}

/// Where an array's bytes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// Its own buffer (outside any workspace, a spill, or an empty array).
    Heap,
    /// `[start, start + len)` of block number `block` of workspace `ws`, allocated in cycle
    /// `generation`.
    Block {
        ws: usize,
        block: usize,
        start: usize,
        len: usize,
        generation: u64,
    },
}

/// Why a closed array is closed, as far as its `ArrayClosed` message must say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Why {
    /// A circular workspace's allocation overwrote it: the message says "overwritten".
    Overwritten,
    /// Its workspace was destroyed (its owner closed) while it lived in the block.
    Destroyed,
    /// Any other reason (by the user, its manager or cycle closed, …).
    Other,
}

#[derive(Clone, Debug)]
struct ModelManager {
    /// `None` only for the system manager (index 0).
    parent: Option<usize>,
    open: bool,
    capped: bool,
    /// The workspace cycle `(workspace, generation)` whose block its arrays come from: its own
    /// if it is a cycle's scope, else its parent's when it was created.
    alloc: Option<(usize, u64)>,
    /// The workspace it is the cycle scope of.
    cycle_of: Option<usize>,
    /// Workspaces it owns, oldest first.
    workspaces: Vec<usize>,
}

#[derive(Clone, Debug)]
struct ModelArray {
    len: usize,
    open: bool,
    holder: Holder,
    /// Where it goes back to, innermost borrow last. Empty when it is not borrowed.
    lenders: Vec<Holder>,
    /// What `to_vec` must give while it is open.
    values: Vec<f32>,
    place: Place,
    /// When it last joined its holder's list: a closing manager handles its arrays newest
    /// first, which decides the order of copies out of (or into) workspaces.
    joined: u64,
    why: Option<Why>,
}

impl ModelArray {
    fn bytes(&self) -> usize {
        self.len * 4
    }
}

#[derive(Clone, Debug)]
struct ModelWorkspace {
    owner: usize,
    block: BlockModel,
    /// The open cycle: its scope's manager index and generation.
    cycle: Option<(usize, u64)>,
    /// `false` once its owner closed (which destroys it).
    alive: bool,
    /// `stats()` after destruction.
    final_stats: Option<WorkspaceStats>,
}

/// The reference: DESIGN.md §2 and §4 written as plainly as possible.
#[derive(Clone, Debug)]
struct Model {
    managers: Vec<ModelManager>,
    arrays: Vec<ModelArray>,
    workspaces: Vec<ModelWorkspace>,
    /// Managers made active on this thread, innermost last.
    active: Vec<usize>,
    /// A clock for [`ModelArray::joined`].
    clock: u64,
}

const SYSTEM: usize = 0;

/// The arrays named by `arrays`/`count`, resolved modulo `n`.
fn pick(arrays: [usize; 3], count: usize, n: usize) -> ([usize; 3], usize) {
    (arrays.map(|i| i % n), 1 + count % 3)
}

impl Model {
    fn new() -> Model {
        Model {
            managers: vec![ModelManager {
                parent: None,
                open: true,
                capped: false,
                alloc: None,
                cycle_of: None,
                workspaces: Vec::new(),
            }],
            arrays: Vec::new(),
            workspaces: Vec::new(),
            active: Vec::new(),
            clock: 0,
        }
    }

    fn resolve(&self, op: &Op) -> Step {
        let managers = self.managers.len();
        let arrays = self.arrays.len();
        let workspaces = self.workspaces.len();
        let array = |i: usize| i % arrays;
        // Among the managers other than the system manager.
        let non_system = |i: usize| 1 + i % (managers - 1);
        match *op {
            Op::CreateManager { parent: None } => Step::NewBase,
            Op::CreateManager { parent: Some(p) } => Step::NewSub {
                parent: p % managers,
            },
            Op::CreateArray { manager, len } => Step::CreateArray {
                manager: manager % managers,
                len: len % LENGTHS,
            },
            Op::Cap { manager } if managers > 1 => Step::Cap {
                manager: non_system(manager),
            },
            Op::CreateWorkspace { manager, config } if managers > 1 => Step::CreateWorkspace {
                manager: non_system(manager),
                config: config % WORKSPACE_CONFIGS,
            },
            Op::Cap { .. } | Op::CreateWorkspace { .. } => Step::Skip,
            Op::CloseManager { manager } => Step::CloseManager {
                manager: manager % managers,
            },
            Op::Activate { manager } => Step::Activate {
                manager: manager % managers,
            },
            Op::Deactivate if self.active.is_empty() => Step::Skip,
            Op::Deactivate => Step::Deactivate,
            Op::OpenCycle { .. }
            | Op::CloseCycle { .. }
            | Op::CycleArray { .. }
            | Op::CycleRet { .. }
            | Op::ActivateCycle { .. }
                if workspaces == 0 =>
            {
                Step::Skip
            }
            Op::OpenCycle { workspace } => Step::OpenCycle {
                workspace: workspace % workspaces,
            },
            Op::CloseCycle { workspace } => match self.open_scope(workspace) {
                Some(scope) => Step::CloseManager { manager: scope },
                None => Step::Skip,
            },
            Op::CycleArray { workspace, len } => match self.open_scope(workspace) {
                Some(scope) => Step::CreateArray {
                    manager: scope,
                    len: len % LENGTHS,
                },
                None => Step::Skip,
            },
            Op::ActivateCycle { workspace } => match self.open_scope(workspace) {
                Some(scope) => Step::Activate { manager: scope },
                None => Step::Skip,
            },
            _ if arrays == 0 => Step::Skip,
            Op::BinaryOp { a, b } => {
                let a = array(a);
                let same: Vec<usize> = (0..arrays)
                    .filter(|&i| self.arrays[i].len == self.arrays[a].len)
                    .collect();
                Step::Add {
                    a,
                    b: same[b % same.len()],
                }
            }
            Op::Attach { array: x, manager } => Step::Attach {
                array: array(x),
                manager: manager % managers,
            },
            Op::TempAttach { array: x, manager } => Step::TempAttach {
                array: array(x),
                manager: manager % managers,
            },
            Op::Detach { array: x } => Step::Detach { array: array(x) },
            Op::Ret { manager, array: x } => Step::Ret {
                manager: manager % managers,
                array: array(x),
            },
            Op::CloseArray { array: x } => Step::CloseArray { array: array(x) },
            Op::CycleRet {
                workspace,
                array: x,
            } => match self.open_scope(workspace) {
                Some(scope) => {
                    let held: Vec<usize> = (0..arrays)
                        .filter(|&i| {
                            self.arrays[i].open && self.arrays[i].holder == Holder::Manager(scope)
                        })
                        .collect();
                    Step::Ret {
                        manager: scope,
                        array: if held.is_empty() {
                            array(x)
                        } else {
                            held[x % held.len()]
                        },
                    }
                }
                None => Step::Skip,
            },
            Op::AttachAll {
                arrays: xs,
                count,
                manager,
            } => {
                let (arrays, count) = pick(xs, count, arrays);
                Step::AttachAll {
                    arrays,
                    count,
                    manager: manager % managers,
                }
            }
            Op::TempAttachAll {
                arrays: xs,
                count,
                manager,
            } => {
                let (arrays, count) = pick(xs, count, arrays);
                Step::TempAttachAll {
                    arrays,
                    count,
                    manager: manager % managers,
                }
            }
            Op::List {
                arrays: xs,
                count,
                manager,
                action,
            } => {
                let (arrays, count) = pick(xs, count, arrays);
                Step::List {
                    arrays,
                    count,
                    manager: manager % managers,
                    action,
                }
            }
        }
    }

    /// The scope of the `w`-th (modulo) workspace cycle open now, if any is.
    fn open_scope(&self, w: usize) -> Option<usize> {
        let open: Vec<usize> = self
            .workspaces
            .iter()
            .filter_map(|ws| ws.cycle.map(|(scope, _)| scope))
            .collect();
        (!open.is_empty()).then(|| open[w % open.len()])
    }

    fn capped(&self, m: usize) -> bool {
        self.managers[m].open && self.managers[m].capped
    }

    /// Applies `step`: returns what the library must answer. The model changes on `Ok`, and on
    /// an error only where the contract says the library changes too (an op whose result, placed
    /// in a circular workspace, overwrote one of its own inputs).
    fn apply(&mut self, step: Step) -> Outcome {
        match step {
            Step::Skip => Outcome::Skipped,
            Step::NewBase => {
                self.add_manager(SYSTEM);
                Outcome::Ok
            }
            Step::NewSub { parent } => {
                if !self.managers[parent].open {
                    return Outcome::ManagerClosed;
                }
                self.add_manager(parent);
                Outcome::Ok
            }
            Step::CreateArray { manager, len } => {
                if !self.managers[manager].open {
                    return Outcome::ManagerClosed;
                }
                if self.capped(manager) {
                    return Outcome::Capped;
                }
                let holder = Holder::Manager(manager);
                let place = match self.allocate(holder, len) {
                    Ok(place) => place,
                    Err(outcome) => return outcome,
                };
                let values = contents(self.arrays.len(), len);
                self.add_array(len, holder, values, place);
                Outcome::Ok
            }
            Step::Add { a, b } => {
                if !self.arrays[a].open || !self.arrays[b].open {
                    return Outcome::ArrayClosed;
                }
                // Placement: the innermost active scope, else the holder of the first input
                // (the borrower while borrowed).
                let holder = match self.active.last() {
                    Some(&m) if !self.managers[m].open => return Outcome::ManagerClosed,
                    Some(&m) => Holder::Manager(m),
                    None => self.arrays[a].holder,
                };
                if let Holder::Manager(m) = holder {
                    if self.capped(m) {
                        return Outcome::Capped;
                    }
                }
                let values: Vec<f32> = self.arrays[a]
                    .values
                    .iter()
                    .zip(&self.arrays[b].values)
                    .map(|(x, y)| x + y)
                    .collect();
                let place = match self.allocate(holder, self.arrays[a].len) {
                    Ok(place) => place,
                    Err(outcome) => return outcome,
                };
                // The result's bytes may be where an input of an earlier cycle lay in a circular
                // workspace: that input is closed ("overwritten") before the kernel reads it, so
                // the op fails and its result is discarded.
                if !self.arrays[a].open || !self.arrays[b].open {
                    return Outcome::ArrayClosed;
                }
                self.add_array(self.arrays[a].len, holder, values, place);
                Outcome::Ok
            }
            Step::Attach { array, manager } => {
                self.move_arrays(&[array], Holder::Manager(manager), Move::Attach)
            }
            Step::TempAttach { array, manager } => {
                self.move_arrays(&[array], Holder::Manager(manager), Move::TempAttach)
            }
            Step::Detach { array } => self.move_arrays(&[array], Holder::Detached, Move::Detach),
            Step::Ret { manager, array } => self.ret(manager, &[array]),
            Step::Cap { manager } => {
                if self.managers[manager].open {
                    self.managers[manager].capped = true;
                }
                Outcome::Ok
            }
            Step::CloseArray { array } => {
                self.close_array(array, Why::Other);
                Outcome::Ok
            }
            Step::CloseManager { manager } => {
                if manager == SYSTEM {
                    return Outcome::SystemManager;
                }
                if self.managers[manager].open {
                    self.close_subtree(manager);
                }
                Outcome::Ok
            }
            Step::CreateWorkspace { manager, config } => {
                if !self.managers[manager].open {
                    return Outcome::ManagerClosed;
                }
                let w = self.workspaces.len();
                self.workspaces.push(ModelWorkspace {
                    owner: manager,
                    block: BlockModel::new(workspace_config(config)),
                    cycle: None,
                    alive: true,
                    final_stats: None,
                });
                self.managers[manager].workspaces.push(w);
                Outcome::Ok
            }
            Step::OpenCycle { workspace } => {
                let ws = &self.workspaces[workspace];
                if !ws.alive {
                    // Destroyed only by its owner closing.
                    return Outcome::ManagerClosed;
                }
                if ws.cycle.is_some() {
                    return Outcome::WorkspaceBusy;
                }
                let owner = ws.owner;
                let scope = self.add_manager(owner);
                let ws = &mut self.workspaces[workspace];
                ws.block.open_cycle();
                let generation = ws.block.generation();
                ws.cycle = Some((scope, generation));
                let m = &mut self.managers[scope];
                m.alloc = Some((workspace, generation));
                m.cycle_of = Some(workspace);
                Outcome::Ok
            }
            Step::Activate { manager } => {
                self.active.push(manager);
                Outcome::Ok
            }
            Step::Deactivate => {
                self.active.pop();
                Outcome::Ok
            }
            Step::AttachAll {
                arrays,
                count,
                manager,
            } => self.move_arrays(&arrays[..count], Holder::Manager(manager), Move::Attach),
            Step::TempAttachAll {
                arrays,
                count,
                manager,
            } => self.move_arrays(&arrays[..count], Holder::Manager(manager), Move::TempAttach),
            Step::List {
                arrays,
                count,
                manager,
                action,
            } => {
                let list = &arrays[..count];
                match action {
                    ListAction::Attach => {
                        self.move_arrays(list, Holder::Manager(manager), Move::Attach)
                    }
                    ListAction::TempAttach => {
                        self.move_arrays(list, Holder::Manager(manager), Move::TempAttach)
                    }
                    ListAction::Detach => self.move_arrays(list, Holder::Detached, Move::Detach),
                    ListAction::Ret => self.ret(manager, list),
                    ListAction::Close => {
                        for &a in list {
                            self.close_array(a, Why::Other);
                        }
                        Outcome::Ok
                    }
                }
            }
        }
    }

    /// A new open manager under `parent`; returns its index.
    fn add_manager(&mut self, parent: usize) -> usize {
        self.managers.push(ModelManager {
            parent: Some(parent),
            open: true,
            capped: false,
            alloc: self.managers[parent].alloc,
            cycle_of: None,
            workspaces: Vec::new(),
        });
        self.managers.len() - 1
    }

    fn add_array(&mut self, len: usize, holder: Holder, values: Vec<f32>, place: Place) {
        self.clock += 1;
        self.arrays.push(ModelArray {
            len,
            open: true,
            holder,
            lenders: Vec::new(),
            values,
            place,
            joined: self.clock,
            why: None,
        });
    }

    /// Moves array `a` to `holder`'s list (it joins at the head).
    fn set_holder(&mut self, a: usize, holder: Holder) {
        self.clock += 1;
        let array = &mut self.arrays[a];
        array.holder = holder;
        array.joined = self.clock;
    }

    fn close_array(&mut self, a: usize, why: Why) {
        let array = &mut self.arrays[a];
        if array.open {
            array.open = false;
            array.lenders.clear();
            array.why = Some(why);
        }
    }

    /// Where a new array of `len` elements held by `holder` gets its bytes: from the block of the
    /// workspace cycle `holder` allocates from, if that cycle is open, else its own buffer.
    /// Arrays of earlier cycles whose bytes the allocation takes are closed ("overwritten").
    /// `WorkspaceFull` changes nothing.
    fn allocate(&mut self, holder: Holder, len: usize) -> Result<Place, Outcome> {
        let Holder::Manager(m) = holder else {
            return Ok(Place::Heap);
        };
        let Some((w, generation)) = self.managers[m].alloc else {
            return Ok(Place::Heap);
        };
        let ws = &self.workspaces[w];
        if !ws.alive || ws.cycle.map(|c| c.1) != Some(generation) || len == 0 {
            return Ok(Place::Heap);
        }
        let size = aligned(len * 4);
        let placement = ws.block.place(size);
        let place = match placement {
            Placement::Full => return Err(Outcome::WorkspaceFull),
            Placement::Spill => Place::Heap,
            Placement::Block(start) => {
                let (block, _) = ws.block.current().expect("placed in a block");
                let range = (start, size);
                for i in 0..self.arrays.len() {
                    let a = &self.arrays[i];
                    if let (
                        true,
                        Place::Block {
                            ws: aw,
                            block: ab,
                            start: s,
                            len: l,
                            generation: g,
                        },
                    ) = (a.open, a.place)
                    {
                        if aw == w && ab == block && overlap((s, l), range) {
                            assert!(
                                g != generation,
                                "model: the ring placed {range:?} over array #{i} of the same cycle"
                            );
                            assert!(
                                self.workspaces[w].block.circular(),
                                "model: array #{i} outlived its cycle in a block that resets"
                            );
                            self.close_array(i, Why::Overwritten);
                        }
                    }
                }
                Place::Block {
                    ws: w,
                    block,
                    start,
                    len: size,
                    generation,
                }
            }
        };
        self.workspaces[w].block.commit(placement, size);
        Ok(place)
    }

    /// Whether moving array `a` to `target` copies its bytes: they are in the block of a cycle
    /// that is still open and `target` is not inside that cycle's scope (a `ret` out of an open
    /// circular cycle is zero-copy), or they are a survivor of an ended cycle in a circular
    /// workspace's current block, which the buffer will overwrite when it comes round (moved
    /// again, it is copied out so that the move keeps it).
    fn copy_needed(&self, a: usize, target: Holder, kind: Move) -> bool {
        let Place::Block {
            ws,
            block,
            generation,
            ..
        } = self.arrays[a].place
        else {
            return false;
        };
        let w = &self.workspaces[ws];
        if !w.alive {
            return false;
        }
        let survivor = || w.block.circular() && w.block.current().is_some_and(|(n, _)| n == block);
        let Some((scope, open)) = w.cycle else {
            return survivor();
        };
        if open != generation {
            return survivor();
        }
        match target {
            Holder::Detached => true,
            Holder::Manager(t) => {
                !(self.within(t, scope) || (kind == Move::Ret && w.block.circular()))
            }
        }
    }

    /// `ret` (and `ret_list`): a move to the parent of `manager`.
    fn ret(&mut self, manager: usize, arrays: &[usize]) -> Outcome {
        if !self.managers[manager].open {
            return Outcome::ManagerClosed;
        }
        let Some(parent) = self.managers[manager].parent else {
            return Outcome::SystemManager;
        };
        // An open manager's parent is open: closing a manager closes its subtree.
        assert!(
            self.managers[parent].open,
            "model: open child of a closed parent"
        );
        self.move_arrays(arrays, Holder::Manager(parent), Move::Ret)
    }

    /// Every ownership move, of one array or several (all or nothing): everything is checked
    /// before anything moves, then the copies out of (or into) workspaces are allocated, then
    /// the arrays move.
    fn move_arrays(&mut self, arrays: &[usize], target: Holder, kind: Move) -> Outcome {
        let mut capped = false;
        if let Holder::Manager(t) = target {
            if !self.managers[t].open {
                return Outcome::ManagerClosed;
            }
            if kind == Move::TempAttach && t == SYSTEM {
                return Outcome::SystemManager;
            }
            capped = self.capped(t);
        }
        #[derive(PartialEq)]
        enum Plan {
            Stay,
            Own,
            Borrow,
        }
        let mut plan: Vec<(usize, Plan, bool)> = Vec::new();
        for &a in arrays {
            let array = &self.arrays[a];
            if !array.open {
                return Outcome::ArrayClosed;
            }
            if plan.iter().any(|(p, _, _)| *p == a) {
                continue;
            }
            let step = match kind {
                // Attaching to the holder changes nothing (a borrowed array stays borrowed).
                Move::Attach | Move::Ret if array.holder == target => Plan::Stay,
                Move::Attach | Move::Ret if capped => return Outcome::Capped,
                Move::Attach | Move::Ret => Plan::Own,
                Move::TempAttach if array.holder == target => Plan::Stay,
                Move::TempAttach => Plan::Borrow,
                Move::Detach if array.holder == Holder::Detached && array.lenders.is_empty() => {
                    Plan::Stay
                }
                Move::Detach => Plan::Own,
            };
            let copy = step != Plan::Stay && self.copy_needed(a, target, kind);
            plan.push((a, step, copy));
        }
        // The copies' storage, in order; a refusal undoes the allocations made so far.
        let saved: Vec<BlockModel> = self.workspaces.iter().map(|w| w.block.clone()).collect();
        let mut copies = Vec::new();
        for (a, _, copy) in &plan {
            if *copy {
                match self.allocate(target, self.arrays[*a].len) {
                    Ok(place) => copies.push((*a, place)),
                    Err(outcome) => {
                        for (w, block) in self.workspaces.iter_mut().zip(saved) {
                            w.block = block;
                        }
                        return outcome;
                    }
                }
            }
        }
        for (a, place) in copies {
            if self.arrays[a].open {
                self.arrays[a].place = place;
            }
        }
        for (a, step, _) in plan {
            if !self.arrays[a].open {
                continue;
            }
            match step {
                Plan::Stay => {}
                Plan::Own => {
                    self.arrays[a].lenders.clear();
                    self.set_holder(a, target);
                }
                Plan::Borrow => {
                    let from = self.arrays[a].holder;
                    self.arrays[a].lenders.push(from);
                    self.set_holder(a, target);
                }
            }
        }
        Outcome::Ok
    }

    /// Open children of `m`, newest first (as `Manager::children`).
    fn children(&self, m: usize) -> Vec<usize> {
        (0..self.managers.len())
            .rev()
            .filter(|&c| self.managers[c].parent == Some(m) && self.managers[c].open)
            .collect()
    }

    /// Closes `m` and its subtree, children first. Each manager closes the arrays it owns and
    /// gives each array it borrows back to its nearest lender outside the closing subtree (lenders
    /// closing in the same call are passed over), or closes it if that lender is closed already
    /// or there is none. The outcome does not depend on the order of siblings. Then it destroys
    /// the workspaces it owns and, if it is a cycle's scope, ends the cycle.
    fn close_subtree(&mut self, m: usize) {
        let mut order = vec![m];
        let mut i = 0;
        while i < order.len() {
            let children = self.children(order[i]);
            order.extend(children);
            i += 1;
        }
        let closing = order.clone();
        for &k in order.iter().rev() {
            // Newest in the list first: copies back to lenders allocate in that order.
            while let Some(a) = (0..self.arrays.len())
                .filter(|&a| self.arrays[a].open && self.arrays[a].holder == Holder::Manager(k))
                .max_by_key(|&a| self.arrays[a].joined)
            {
                let lender = loop {
                    match self.arrays[a].lenders.pop() {
                        Some(Holder::Manager(l)) if closing.contains(&l) => continue,
                        other => break other,
                    }
                };
                match lender {
                    Some(Holder::Manager(l)) if self.managers[l].open => {
                        self.give_back(a, Holder::Manager(l));
                    }
                    Some(Holder::Detached) => self.give_back(a, Holder::Detached),
                    Some(Holder::Manager(_)) | None => self.close_array(a, Why::Other),
                }
            }
            for w in self.managers[k].workspaces.clone() {
                self.destroy_workspace(w);
            }
            if let Some(w) = self.managers[k].cycle_of {
                let ws = &mut self.workspaces[w];
                if ws.alive && ws.cycle.is_some_and(|(scope, _)| scope == k) {
                    ws.cycle = None;
                    ws.block.end_cycle();
                }
            }
            self.managers[k].open = false;
        }
    }

    /// A borrowed array going back to `lender` as its borrower closes: copied out of the
    /// borrower's workspace cycle if it was copied in (closed if that copy is refused).
    fn give_back(&mut self, a: usize, lender: Holder) {
        if self.copy_needed(a, lender, Move::Attach) {
            match self.allocate(lender, self.arrays[a].len) {
                Ok(place) => self.arrays[a].place = place,
                Err(_) => {
                    self.close_array(a, Why::Other);
                    return;
                }
            }
        }
        self.set_holder(a, lender);
    }

    /// A workspace whose owner closes: arrays still in its block are closed, the block goes.
    fn destroy_workspace(&mut self, w: usize) {
        if !self.workspaces[w].alive {
            return;
        }
        if let Some((scope, _)) = self.workspaces[w].cycle {
            self.close_subtree(scope);
        }
        let current = self.workspaces[w].block.current().map(|(b, _)| b);
        for a in 0..self.arrays.len() {
            if let (true, Place::Block { ws, block, .. }) =
                (self.arrays[a].open, self.arrays[a].place)
            {
                if ws == w && Some(block) == current {
                    assert!(
                        self.workspaces[w].block.circular(),
                        "model: array #{a} outlived its cycle in a block that resets"
                    );
                    self.close_array(a, Why::Destroyed);
                }
            }
        }
        let ws = &mut self.workspaces[w];
        ws.alive = false;
        ws.final_stats = Some(ws.block.destroyed_stats());
    }

    /// Bytes the CPU counters must show: open arrays in their own buffers, and every block that
    /// a live workspace or an open array still holds.
    fn in_use(&self) -> usize {
        let heap: usize = self
            .arrays
            .iter()
            .filter(|a| a.open && a.place == Place::Heap)
            .map(ModelArray::bytes)
            .sum();
        let mut blocks = 0;
        for (w, ws) in self.workspaces.iter().enumerate() {
            for (b, &size) in ws.block.blocks.iter().enumerate() {
                let current = ws.alive && b + 1 == ws.block.blocks.len();
                let held = self.arrays.iter().any(|a| {
                    a.open && matches!(a.place, Place::Block { ws, block, .. } if ws == w && block == b)
                });
                if current || held {
                    blocks += size;
                }
            }
        }
        heap + blocks
    }

    /// Whether manager `k` is `m` or below it.
    fn within(&self, mut k: usize, m: usize) -> bool {
        loop {
            if k == m {
                return true;
            }
            match self.managers[k].parent {
                Some(p) => k = p,
                None => return false,
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// What is compared: the same snapshot built from the library and from the model.

/// Who holds an array, as the library answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HolderView {
    Manager(ManagerId),
    Detached,
    Closed,
}

#[derive(Clone, Debug, PartialEq)]
struct ArrayView {
    id: ArrayId,
    /// `is_open()`.
    open: bool,
    /// `manager()`: `Ok(m)` → `m.id()`; `InvalidArgument` → detached; `ArrayClosed` → closed.
    holder: HolderView,
    /// `is_detached()`.
    detached: bool,
    /// `to_vec::<f32>()`: its own values while open, `ArrayClosed` after.
    data: Result<Vec<f32>, Outcome>,
    /// For a closed array, what its `ArrayClosed` message says about why.
    why: Option<Why>,
}

/// An array in a report: bytes, and whether they are in a workspace block.
type Entry = (usize, bool);

#[derive(Clone, Debug, PartialEq, Eq)]
struct ManagerView {
    id: ManagerId,
    open: bool,
    capped: bool,
    parent: Option<ManagerId>,
    children: Vec<ManagerId>,
    report_open: bool,
    report_capped: bool,
    /// `report().arrays`: id → (bytes, in_workspace).
    owned: BTreeMap<ArrayId, Entry>,
    /// `report().borrowed`: id → ((bytes, in_workspace), lent_by).
    borrowed: BTreeMap<ArrayId, (Entry, Option<ManagerId>)>,
    /// `report().detached` (system manager only): id → (bytes, in_workspace).
    detached: BTreeMap<ArrayId, Entry>,
    /// `report().children` ids.
    report_children: Vec<ManagerId>,
    /// `report().total_arrays()` and `total_bytes()`: every open array held in the subtree
    /// (owned or borrowed, each counted once, where `NDArray::manager()` says it is), plus the
    /// detached ones for the system manager.
    total_arrays: usize,
    total_bytes: usize,
}

#[derive(Clone, Debug, PartialEq)]
struct Snapshot {
    arrays: Vec<ArrayView>,
    managers: Vec<ManagerView>,
    /// `stats()` of every workspace.
    workspaces: Vec<WorkspaceStats>,
    /// `memory_usage(Cpu).in_use` above the harness's baseline.
    in_use: usize,
    /// `memory_usage(Cpu).arrays` above the baseline.
    open_arrays: usize,
}

fn ids(ms: &[Manager]) -> Vec<ManagerId> {
    ms.iter().map(Manager::id).collect()
}

/// What an `ArrayClosed` message says about why the array is closed.
fn why_closed(e: &Error) -> Why {
    let text = e.to_string();
    if text.contains("overwritten") {
        Why::Overwritten
    } else if text.contains("was destroyed") {
        Why::Destroyed
    } else {
        Why::Other
    }
}

// ------------------------------------------------------------------------------------------------
// The harness: the library's handles next to the model.

/// Runs ops on the library and the model side by side. Dropping it closes every manager and array
/// it created, so a failing case does not leave memory behind for the next one.
pub struct Harness {
    model: Model,
    /// The library's managers, index for index with the model's (0 is the system manager).
    managers: Vec<Manager>,
    /// The library's arrays, index for index with the model's.
    arrays: Vec<NDArray>,
    /// The library's workspaces, index for index with the model's.
    workspaces: Vec<Workspace>,
    /// The scopes of the cycles opened (each closes its manager when dropped).
    scopes: Vec<Scope>,
    /// The guards made by `Activate`, innermost last.
    guards: Vec<ActiveScope>,
    /// Memory in use and open arrays when the harness was made.
    baseline: (usize, usize),
    /// Ops applied so far, for failure messages.
    history: Vec<Op>,
}

/// `(in_use, arrays)` of the CPU.
pub fn cpu_usage() -> (usize, usize) {
    let usage = memory_usage(Device::Cpu);
    (usage.in_use, usage.arrays)
}

/// Runs `ops` (in turn, each slice after the last) on a fresh [`Harness`], closes everything and
/// checks that the process is back where it started, with nothing in use: each input of the
/// model test and of both fuzz targets. The previous input closed all it made, so each starts
/// from nothing too.
pub fn run_from_nothing(ops: &[&[Op]]) {
    assert_eq!(cpu_usage(), (0, 0), "(in_use, arrays) before the input");
    let mut harness = Harness::new();
    for ops in ops {
        harness.apply_all(ops);
    }
    harness.finish();
    assert_eq!(
        cpu_usage(),
        (0, 0),
        "(in_use, arrays) after closing everything"
    );
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

impl Harness {
    /// A harness over the current state of the process, whose memory counters are taken as its
    /// baseline.
    pub fn new() -> Harness {
        Harness {
            model: Model::new(),
            managers: vec![Manager::system()],
            arrays: Vec::new(),
            workspaces: Vec::new(),
            scopes: Vec::new(),
            guards: Vec::new(),
            baseline: cpu_usage(),
            history: Vec::new(),
        }
    }

    /// `(in_use, arrays)` of the CPU when the harness was made.
    pub fn baseline(&self) -> (usize, usize) {
        self.baseline
    }

    /// Applies `op` to the library and to the model and checks that they agree: on the result,
    /// on nothing changing when it is an error the model changes nothing for, and then on
    /// everything [`check`](Self::check) compares.
    pub fn apply(&mut self, op: &Op) {
        self.history.push(op.clone());
        let step = self.model.resolve(op);
        let before = self.model.clone();
        let expected = self.model.apply(step);
        let unchanged = expected != Outcome::Ok && self.expect(&before) == self.expect(&self.model);
        let real_before = unchanged.then(|| self.observe());
        let actual = self.run(step);
        assert_eq!(
            actual,
            expected,
            "{}: the library answered {actual:?}, the model expects {expected:?}",
            self.context(step)
        );
        if let Some(real_before) = real_before {
            // The model did not change, and neither may the library.
            assert_eq!(before.managers.len(), self.model.managers.len());
            assert_eq!(before.arrays.len(), self.model.arrays.len());
            let real_after = self.observe();
            if real_after != real_before {
                panic!(
                    "{}: the op failed with {actual:?} but changed the library's state:\n\
                     before: {real_before:#?}\nafter: {real_after:#?}",
                    self.context(step)
                );
            }
        }
        self.check();
    }

    /// Applies every op of `ops` in order.
    pub fn apply_all(&mut self, ops: &[Op]) {
        for op in ops {
            self.apply(op);
        }
    }

    /// Drops every active guard, closes every manager and array the harness created (through
    /// [`apply`](Self::apply), so this is checked too), then checks that the memory counters are
    /// back at the baseline and that the system manager holds nothing.
    pub fn finish(mut self) {
        while !self.guards.is_empty() {
            self.apply(&Op::Deactivate);
        }
        for m in 1..self.managers.len() {
            self.apply(&Op::CloseManager { manager: m });
        }
        for a in 0..self.arrays.len() {
            self.apply(&Op::CloseArray { array: a });
        }
        assert_eq!(
            cpu_usage(),
            self.baseline,
            "(in_use, arrays) after closing everything differ from the baseline"
        );
        for (w, ws) in self.workspaces.iter().enumerate() {
            assert!(ws.is_destroyed(), "workspace #{w} outlived its owner");
        }
        let system = Manager::system().report();
        assert!(
            system.arrays.is_empty()
                && system.borrowed.is_empty()
                && system.detached.is_empty()
                && system.children.is_empty()
                && system.workspaces.is_empty(),
            "the system manager still holds something after closing everything:\n{}",
            Manager::system().debug_dump(1)
        );
    }

    fn context(&self, step: Step) -> String {
        format!(
            "after {} ops {:?} (last one resolved as {step:?})",
            self.history.len(),
            self.history
        )
    }

    fn list(&self, arrays: [usize; 3], count: usize) -> Vec<NDArray> {
        arrays[..count]
            .iter()
            .map(|&a| self.arrays[a].clone())
            .collect()
    }

    /// Runs `step` on the library.
    fn run(&mut self, step: Step) -> Outcome {
        match step {
            Step::Skip => Outcome::Skipped,
            Step::NewBase => {
                self.managers.push(Manager::new_base());
                Outcome::Ok
            }
            Step::NewSub { parent } => {
                let result = self.managers[parent].new_sub_manager();
                let outcome = Outcome::of(&result);
                if let Ok(m) = result {
                    self.managers.push(m);
                }
                outcome
            }
            Step::CreateArray { manager, len } => {
                let index = self.arrays.len();
                let values = contents(index, len);
                let m = &self.managers[manager];
                let result = match index % 3 {
                    0 => m.from_slice(&values, [len]),
                    1 => m.from_vec(values.clone(), [len]),
                    _ => {
                        let first = f64::from(values.first().copied().unwrap_or(1.0));
                        m.arange(first, first + len as f64, 1.0, DType::F32)
                    }
                };
                let outcome = Outcome::of(&result);
                if let Ok(a) = result {
                    self.arrays.push(a);
                }
                outcome
            }
            Step::Add { a, b } => {
                let result = self.arrays[a].add(&self.arrays[b]);
                let outcome = Outcome::of(&result);
                if let Ok(c) = result {
                    self.arrays.push(c);
                }
                outcome
            }
            Step::Attach { array, manager } => {
                Outcome::of(&self.arrays[array].attach(&self.managers[manager]))
            }
            Step::TempAttach { array, manager } => {
                Outcome::of(&self.arrays[array].temp_attach(&self.managers[manager]))
            }
            Step::Detach { array } => Outcome::of(&self.arrays[array].detach()),
            Step::Ret { manager, array } => {
                let result = self.managers[manager].ret(&self.arrays[array]);
                if let Ok(returned) = &result {
                    assert!(
                        *returned == self.arrays[array],
                        "ret returned another array"
                    );
                }
                Outcome::of(&result)
            }
            Step::Cap { manager } => {
                self.managers[manager].cap();
                Outcome::Ok
            }
            Step::CloseArray { array } => Outcome::of(&self.arrays[array].close()),
            Step::CloseManager { manager } => Outcome::of(&self.managers[manager].close()),
            Step::CreateWorkspace { manager, config } => {
                let name = format!("w{}", self.workspaces.len());
                let result = self.managers[manager].workspace(&name, workspace_config(config));
                let outcome = Outcome::of(&result);
                if let Ok(ws) = result {
                    self.workspaces.push(ws);
                }
                outcome
            }
            Step::OpenCycle { workspace } => {
                let result = self.workspaces[workspace].open();
                let outcome = Outcome::of(&result);
                if let Ok(scope) = result {
                    self.managers.push(scope.manager().clone());
                    self.scopes.push(scope);
                }
                outcome
            }
            Step::Activate { manager } => {
                self.guards.push(self.managers[manager].activate());
                assert_eq!(Manager::active().as_ref(), Some(&self.managers[manager]));
                Outcome::Ok
            }
            Step::Deactivate => {
                self.guards.pop();
                Outcome::Ok
            }
            Step::AttachAll {
                arrays,
                count,
                manager,
            } => Outcome::of(&self.managers[manager].attach_all(&self.list(arrays, count))),
            Step::TempAttachAll {
                arrays,
                count,
                manager,
            } => Outcome::of(&self.managers[manager].temp_attach_all(&self.list(arrays, count))),
            Step::List {
                arrays,
                count,
                manager,
                action,
            } => {
                let list: NDList = self.list(arrays, count).into();
                let m = &self.managers[manager];
                match action {
                    ListAction::Attach => Outcome::of(&list.attach(m)),
                    ListAction::TempAttach => Outcome::of(&list.temp_attach(m)),
                    ListAction::Detach => Outcome::of(&list.detach()),
                    ListAction::Ret => {
                        let result = m.ret_list(&list);
                        if let Ok(returned) = &result {
                            assert!(*returned == list, "ret_list returned another list");
                        }
                        Outcome::of(&result)
                    }
                    ListAction::Close => Outcome::of(&list.close()),
                }
            }
        }
    }

    /// Compares the library with the model: for every array handle `is_open()`, `manager()`,
    /// `is_detached()`, `to_vec()` (its values) and why it is closed; for every manager handle
    /// `is_open()`, `is_capped()`, `parent()`, `children()` and its `report()` (open, capped,
    /// owned and borrowed arrays with their bytes, lenders and whether they are in a workspace,
    /// detached arrays, children, totals); every workspace's `stats()`; and the CPU memory
    /// counters.
    pub fn check(&self) {
        let real = self.observe();
        let model = self.expect(&self.model);
        if real == model {
            return;
        }
        let context = self.context(Step::Skip);
        for (i, (r, m)) in real.arrays.iter().zip(&model.arrays).enumerate() {
            assert_eq!(r, m, "{context}: array #{i} (library left, model right)");
        }
        for (i, (r, m)) in real.managers.iter().zip(&model.managers).enumerate() {
            assert_eq!(
                r,
                m,
                "{context}: manager #{i} (library left, model right)\n{}",
                Manager::system().debug_dump(1)
            );
        }
        for (i, (r, m)) in real.workspaces.iter().zip(&model.workspaces).enumerate() {
            assert_eq!(
                r, m,
                "{context}: stats of workspace #{i} (library left, model right)"
            );
        }
        assert_eq!(
            (real.in_use, real.open_arrays),
            (model.in_use, model.open_arrays),
            "{context}: (bytes in use, open arrays) above the baseline (library left, model right)"
        );
        unreachable!("snapshots differ but no part does");
    }

    /// The snapshot of the library, through the public API.
    fn observe(&self) -> Snapshot {
        let arrays = self
            .arrays
            .iter()
            .map(|a| {
                let data = a.to_vec::<f32>();
                ArrayView {
                    id: a.id(),
                    open: a.is_open(),
                    holder: match a.manager() {
                        Ok(m) => HolderView::Manager(m.id()),
                        Err(Error::InvalidArgument { .. }) => HolderView::Detached,
                        Err(Error::ArrayClosed { .. }) => HolderView::Closed,
                        Err(e) => panic!("NDArray::manager gave an unexpected error: {e}"),
                    },
                    detached: a.is_detached(),
                    why: data.as_ref().err().map(why_closed),
                    data: data.map_err(|e| Outcome::of(&Err::<(), _>(e))),
                }
            })
            .collect();
        let entry = |a: &ndscope::ArrayReport| (a.id, (a.bytes, a.in_workspace));
        let managers = self
            .managers
            .iter()
            .map(|m| {
                let report = m.report();
                assert_eq!(report.id, m.id(), "report of {m:?} has another id");
                ManagerView {
                    id: m.id(),
                    open: m.is_open(),
                    capped: m.is_capped(),
                    parent: m.parent().map(|p| p.id()),
                    children: ids(&m.children()),
                    report_open: report.open,
                    report_capped: report.capped,
                    owned: report.arrays.iter().map(entry).collect(),
                    borrowed: report
                        .borrowed
                        .iter()
                        .map(|a| (a.id, ((a.bytes, a.in_workspace), a.lent_by)))
                        .collect(),
                    detached: report.detached.iter().map(entry).collect(),
                    report_children: report.children.iter().map(|c| c.id).collect(),
                    total_arrays: report.total_arrays(),
                    total_bytes: report.total_bytes(),
                }
            })
            .collect();
        let (in_use, open_arrays) = cpu_usage();
        Snapshot {
            arrays,
            managers,
            workspaces: self.workspaces.iter().map(Workspace::stats).collect(),
            in_use: in_use.wrapping_sub(self.baseline.0),
            open_arrays: open_arrays.wrapping_sub(self.baseline.1),
        }
    }

    /// The snapshot `model` predicts (ids are taken from the library's handles, which the model
    /// pairs index for index).
    fn expect(&self, model: &Model) -> Snapshot {
        let manager_id = |i: usize| self.managers[i].id();
        let arrays = model
            .arrays
            .iter()
            .enumerate()
            .map(|(i, a)| ArrayView {
                id: self.arrays[i].id(),
                open: a.open,
                holder: match (a.open, a.holder) {
                    (false, _) => HolderView::Closed,
                    (true, Holder::Manager(m)) => HolderView::Manager(manager_id(m)),
                    (true, Holder::Detached) => HolderView::Detached,
                },
                detached: a.open && a.holder == Holder::Detached,
                data: if a.open {
                    Ok(a.values.clone())
                } else {
                    Err(Outcome::ArrayClosed)
                },
                why: a.why,
            })
            .collect();
        let open_arrays = || model.arrays.iter().enumerate().filter(|(_, a)| a.open);
        let entry = |a: &ModelArray| (a.bytes(), a.place != Place::Heap);
        let managers = model
            .managers
            .iter()
            .enumerate()
            .map(|(k, m)| {
                let children = if m.open {
                    model.children(k).into_iter().map(manager_id).collect()
                } else {
                    Vec::new()
                };
                let held = |borrowed: bool| {
                    open_arrays().filter(move |(_, a)| {
                        m.open && a.holder == Holder::Manager(k) && a.lenders.is_empty() != borrowed
                    })
                };
                let owned = held(false)
                    .map(|(i, a)| (self.arrays[i].id(), entry(a)))
                    .collect();
                let borrowed = held(true)
                    .map(|(i, a)| {
                        let lent_by = match a.lenders.last() {
                            Some(Holder::Manager(l)) => Some(manager_id(*l)),
                            _ => None,
                        };
                        (self.arrays[i].id(), (entry(a), lent_by))
                    })
                    .collect();
                let detached_here = |a: &ModelArray| k == SYSTEM && a.holder == Holder::Detached;
                let detached = open_arrays()
                    .filter(|(_, a)| detached_here(a))
                    .map(|(i, a)| (self.arrays[i].id(), entry(a)))
                    .collect();
                let in_subtree = |a: &ModelArray| match a.holder {
                    Holder::Manager(h) => m.open && model.within(h, k),
                    Holder::Detached => detached_here(a),
                };
                let total: Vec<&ModelArray> = open_arrays()
                    .map(|(_, a)| a)
                    .filter(|a| in_subtree(a))
                    .collect();
                ManagerView {
                    id: manager_id(k),
                    open: m.open,
                    capped: model.capped(k),
                    parent: m.parent.map(manager_id),
                    children: children.clone(),
                    report_open: m.open,
                    report_capped: model.capped(k),
                    owned,
                    borrowed,
                    detached,
                    report_children: children,
                    total_arrays: total.len(),
                    total_bytes: total.iter().map(|a| a.bytes()).sum(),
                }
            })
            .collect();
        let workspaces = model
            .workspaces
            .iter()
            .map(|w| w.final_stats.clone().unwrap_or_else(|| w.block.stats()))
            .collect();
        Snapshot {
            arrays,
            managers,
            workspaces,
            in_use: model.in_use(),
            open_arrays: model.arrays.iter().filter(|a| a.open).count(),
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Also runs while a failed check unwinds: drop the guards innermost first and close
        // everything this harness created, so the thread and the process-wide counters are back
        // at the baseline for the next case.
        while self.guards.pop().is_some() {}
        for m in self.managers.iter().skip(1) {
            let _ = m.close();
        }
        for a in &self.arrays {
            let _ = a.close();
        }
    }
}

/// Ops that start a case with workspaces to work on: for each `(config, open)`, a base manager
/// owning a workspace of that configuration, with a cycle open if `open`.
pub fn setup_ops(setup: &[(usize, bool)]) -> Vec<Op> {
    let mut ops = Vec::new();
    // Managers so far: the system manager, then each base manager and cycle scope made here.
    let mut managers = 1;
    for (w, &(config, open)) in setup.iter().enumerate() {
        ops.push(Op::CreateManager { parent: None });
        managers += 1;
        // Indices are taken among the managers other than the system one: the new base manager,
        // the last, is number `managers - 2` of those.
        ops.push(Op::CreateWorkspace {
            manager: managers - 2,
            config,
        });
        if open {
            ops.push(Op::OpenCycle { workspace: w });
            managers += 1;
        }
    }
    ops
}
