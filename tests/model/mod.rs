//! The model test's reference: a plain model of managers and arrays (vectors and maps, nothing
//! clever) and the [`Op`] enum that drives both it and the real library.
//!
//! Shared by the proptest state-machine test (`tests/model.rs`) and the fuzz target
//! (`fuzz/fuzz_targets/ownership.rs`, through `#[path]`), so it depends on nothing but `ndscope`.
//!
//! [`Harness::apply`] runs one [`Op`] on the library and on the model, checks that both agree on
//! the result (`Ok`, or which error), that a failed op changed nothing, and then
//! [`Harness::check`]s every handle, every manager's report and the memory counters against the
//! model. The contract encoded here is DESIGN.md §2 plus the decisions stated in the doc comments
//! of `Manager` and `NDArray`.
//!
//! The memory counters are process-wide: only one harness may exist at a time in a process, and
//! nothing else in that process may create arrays while it lives.

#![allow(dead_code)] // each of the two users needs a different part

use std::collections::BTreeMap;

use ndscope::{memory_usage, ArrayId, DType, Device, Error, Manager, ManagerId, NDArray};

/// Array lengths are taken modulo this, so equal lengths (needed by [`Op::BinaryOp`]) are common.
pub const LENGTHS: usize = 5;

/// One step of a test. Indices are taken modulo the current number of managers (the system
/// manager is manager 0) or arrays, so every op can be applied to any state; an op on an array
/// index when there is no array yet does nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)] // `BinaryOp` is the name the test plan uses
pub enum Op {
    /// `None`: `Manager::new_base()`; `Some(p)`: `managers[p].new_sub_manager()`.
    CreateManager { parent: Option<usize> },
    /// `managers[manager].zeros([len % LENGTHS], F32)`.
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
            Err(e) => panic!("an error the model never expects: {e}"),
        }
    }
}

/// An op with its indices resolved against the current state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Skip,
    NewBase,
    NewSub { parent: usize },
    CreateArray { manager: usize, len: usize },
    Add { a: usize, b: usize },
    Attach { array: usize, manager: usize },
    TempAttach { array: usize, manager: usize },
    Detach { array: usize },
    Ret { manager: usize, array: usize },
    Cap { manager: usize },
    CloseArray { array: usize },
    CloseManager { manager: usize },
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

#[derive(Clone, Debug)]
struct ModelManager {
    /// `None` only for the system manager (index 0).
    parent: Option<usize>,
    open: bool,
    capped: bool,
}

#[derive(Clone, Debug)]
struct ModelArray {
    len: usize,
    open: bool,
    holder: Holder,
    /// Where it goes back to, innermost borrow last. Empty when it is not borrowed.
    lenders: Vec<Holder>,
}

impl ModelArray {
    fn bytes(&self) -> usize {
        self.len * 4
    }
}

/// The reference: DESIGN.md §2 written as plainly as possible.
#[derive(Clone, Debug)]
struct Model {
    managers: Vec<ModelManager>,
    arrays: Vec<ModelArray>,
}

const SYSTEM: usize = 0;

impl Model {
    fn new() -> Model {
        Model {
            managers: vec![ModelManager {
                parent: None,
                open: true,
                capped: false,
            }],
            arrays: Vec::new(),
        }
    }

    fn resolve(&self, op: &Op) -> Step {
        let managers = self.managers.len();
        let arrays = self.arrays.len();
        let array = |i: usize| i % arrays;
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
                manager: 1 + manager % (managers - 1),
            },
            Op::Cap { .. } => Step::Skip,
            Op::CloseManager { manager } => Step::CloseManager {
                manager: manager % managers,
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
        }
    }

    fn capped(&self, m: usize) -> bool {
        self.managers[m].open && self.managers[m].capped
    }

    /// Applies `step`: returns what the library must answer, and changes the model only when
    /// that is `Ok`.
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
                self.add_array(len, Holder::Manager(manager));
                Outcome::Ok
            }
            Step::Add { a, b } => {
                if !self.arrays[a].open || !self.arrays[b].open {
                    return Outcome::ArrayClosed;
                }
                // Placement: the holder of the first input (the borrower while borrowed).
                let holder = self.arrays[a].holder;
                if let Holder::Manager(m) = holder {
                    if self.capped(m) {
                        return Outcome::Capped;
                    }
                }
                self.add_array(self.arrays[a].len, holder);
                Outcome::Ok
            }
            Step::Attach { array, manager } => self.attach(array, manager),
            Step::TempAttach { array, manager } => {
                if !self.managers[manager].open {
                    return Outcome::ManagerClosed;
                }
                if manager == SYSTEM {
                    return Outcome::SystemManager;
                }
                if !self.arrays[array].open {
                    return Outcome::ArrayClosed;
                }
                let a = &mut self.arrays[array];
                // Borrowing into the manager that already holds it changes nothing. No cap check.
                if a.holder != Holder::Manager(manager) {
                    a.lenders.push(a.holder);
                    a.holder = Holder::Manager(manager);
                }
                Outcome::Ok
            }
            Step::Detach { array } => {
                let a = &mut self.arrays[array];
                if !a.open {
                    return Outcome::ArrayClosed;
                }
                a.holder = Holder::Detached;
                a.lenders.clear();
                Outcome::Ok
            }
            Step::Ret { manager, array } => {
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
                self.attach(array, parent)
            }
            Step::Cap { manager } => {
                if self.managers[manager].open {
                    self.managers[manager].capped = true;
                }
                Outcome::Ok
            }
            Step::CloseArray { array } => {
                let a = &mut self.arrays[array];
                a.open = false;
                a.lenders.clear();
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
        }
    }

    fn add_manager(&mut self, parent: usize) {
        self.managers.push(ModelManager {
            parent: Some(parent),
            open: true,
            capped: false,
        });
    }

    fn add_array(&mut self, len: usize, holder: Holder) {
        self.arrays.push(ModelArray {
            len,
            open: true,
            holder,
            lenders: Vec::new(),
        });
    }

    /// `attach` (and `ret`, into the parent): a permanent move that cancels any pending return.
    fn attach(&mut self, array: usize, manager: usize) -> Outcome {
        if !self.managers[manager].open {
            return Outcome::ManagerClosed;
        }
        if !self.arrays[array].open {
            return Outcome::ArrayClosed;
        }
        // Attaching to the manager that holds it changes nothing (no new array lands there, so
        // no cap check); in particular an array borrowed by `manager` stays borrowed.
        if self.arrays[array].holder == Holder::Manager(manager) {
            return Outcome::Ok;
        }
        if self.capped(manager) {
            return Outcome::Capped;
        }
        let a = &mut self.arrays[array];
        a.holder = Holder::Manager(manager);
        a.lenders.clear();
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
    /// or there is none. The outcome does not depend on the order of siblings.
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
            for a in &mut self.arrays {
                if !a.open || a.holder != Holder::Manager(k) {
                    continue;
                }
                let lender = loop {
                    match a.lenders.pop() {
                        Some(Holder::Manager(l)) if closing.contains(&l) => continue,
                        other => break other,
                    }
                };
                match lender {
                    Some(Holder::Manager(l)) if self.managers[l].open => {
                        a.holder = Holder::Manager(l);
                    }
                    Some(Holder::Detached) => a.holder = Holder::Detached,
                    Some(Holder::Manager(_)) | None => {
                        a.open = false;
                        a.lenders.clear();
                    }
                }
            }
            self.managers[k].open = false;
        }
    }

    fn open_bytes(&self) -> usize {
        self.arrays
            .iter()
            .filter(|a| a.open)
            .map(ModelArray::bytes)
            .sum()
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
    /// `to_vec::<f32>()`: zeros while open, `ArrayClosed` after.
    data: Result<Vec<f32>, Outcome>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct ManagerView {
    id: ManagerId,
    open: bool,
    capped: bool,
    parent: Option<ManagerId>,
    children: Vec<ManagerId>,
    report_open: bool,
    report_capped: bool,
    /// `report().arrays`: id → bytes.
    owned: BTreeMap<ArrayId, usize>,
    /// `report().borrowed`: id → (bytes, lent_by).
    borrowed: BTreeMap<ArrayId, (usize, Option<ManagerId>)>,
    /// `report().detached` (system manager only): id → bytes.
    detached: BTreeMap<ArrayId, usize>,
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
    /// `memory_usage(Cpu).in_use` above the harness's baseline.
    in_use: usize,
    /// `memory_usage(Cpu).arrays` above the baseline.
    open_arrays: usize,
}

fn ids(ms: &[Manager]) -> Vec<ManagerId> {
    ms.iter().map(Manager::id).collect()
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
            baseline: cpu_usage(),
            history: Vec::new(),
        }
    }

    /// `(in_use, arrays)` of the CPU when the harness was made.
    pub fn baseline(&self) -> (usize, usize) {
        self.baseline
    }

    /// Applies `op` to the library and to the model and checks that they agree: on the result,
    /// on nothing changing when it is an error, and then on everything [`check`](Self::check)
    /// compares.
    pub fn apply(&mut self, op: &Op) {
        self.history.push(op.clone());
        let step = self.model.resolve(op);
        let before = self.model.clone();
        let expected = self.model.apply(step);
        let real_before = (expected != Outcome::Ok).then(|| self.observe());
        let actual = self.run(step);
        assert_eq!(
            actual,
            expected,
            "{}: the library answered {actual:?}, the model expects {expected:?}",
            self.context(step)
        );
        if let Some(real_before) = real_before {
            // The model did not change (it changes on `Ok` only), and neither may the library.
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

    /// Closes every manager and array the harness created (through [`apply`](Self::apply), so
    /// this is checked too), then checks that the memory counters are back at the baseline and
    /// that the system manager holds nothing.
    pub fn finish(mut self) {
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
        let system = Manager::system().report();
        assert!(
            system.arrays.is_empty()
                && system.borrowed.is_empty()
                && system.detached.is_empty()
                && system.children.is_empty(),
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
                let result = self.managers[manager].zeros([len], DType::F32);
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
        }
    }

    /// Compares the library with the model: for every array handle `is_open()`, `manager()`,
    /// `is_detached()` and `to_vec()`; for every manager handle `is_open()`, `is_capped()`,
    /// `parent()`, `children()` and its `report()` (open, capped, owned and borrowed arrays with
    /// their bytes and lenders, detached arrays, children, totals); and the CPU memory counters.
    pub fn check(&self) {
        let real = self.observe();
        let model = self.expect();
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
            .map(|a| ArrayView {
                id: a.id(),
                open: a.is_open(),
                holder: match a.manager() {
                    Ok(m) => HolderView::Manager(m.id()),
                    Err(Error::InvalidArgument { .. }) => HolderView::Detached,
                    Err(Error::ArrayClosed { .. }) => HolderView::Closed,
                    Err(e) => panic!("NDArray::manager gave an unexpected error: {e}"),
                },
                detached: a.is_detached(),
                data: a.to_vec::<f32>().map_err(|e| Outcome::of(&Err::<(), _>(e))),
            })
            .collect();
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
                    owned: report.arrays.iter().map(|a| (a.id, a.bytes)).collect(),
                    borrowed: report
                        .borrowed
                        .iter()
                        .map(|a| (a.id, (a.bytes, a.lent_by)))
                        .collect(),
                    detached: report.detached.iter().map(|a| (a.id, a.bytes)).collect(),
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
            in_use: in_use.wrapping_sub(self.baseline.0),
            open_arrays: open_arrays.wrapping_sub(self.baseline.1),
        }
    }

    /// The snapshot the model predicts (ids are taken from the library's handles, which the
    /// model pairs index for index).
    fn expect(&self) -> Snapshot {
        let model = &self.model;
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
                    Ok(vec![0.0; a.len])
                } else {
                    Err(Outcome::ArrayClosed)
                },
            })
            .collect();
        let open_arrays = || model.arrays.iter().enumerate().filter(|(_, a)| a.open);
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
                    .map(|(i, a)| (self.arrays[i].id(), a.bytes()))
                    .collect();
                let borrowed = held(true)
                    .map(|(i, a)| {
                        let lent_by = match a.lenders.last() {
                            Some(Holder::Manager(l)) => Some(manager_id(*l)),
                            _ => None,
                        };
                        (self.arrays[i].id(), (a.bytes(), lent_by))
                    })
                    .collect();
                let detached_here = |a: &ModelArray| k == SYSTEM && a.holder == Holder::Detached;
                let detached = open_arrays()
                    .filter(|(_, a)| detached_here(a))
                    .map(|(i, a)| (self.arrays[i].id(), a.bytes()))
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
        Snapshot {
            arrays,
            managers,
            in_use: model.open_bytes(),
            open_arrays: model.arrays.iter().filter(|a| a.open).count(),
        }
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // Also runs while a failed check unwinds: close everything this harness created so the
        // process-wide counters return to the baseline for the next case.
        for m in self.managers.iter().skip(1) {
            let _ = m.close();
        }
        for a in &self.arrays {
            let _ = a.close();
        }
    }
}
