//! Managers: the tree that owns every array (DJL's `NDManager`, with atomic moves).
//!
//! ```text
//! system                      (process-wide root; never closed)
//! └─ model "mlp"              (parameters; capped during training to catch leaks)
//!    └─ trainer               (owns workspace "batch")
//!       └─ batch #57          (a workspace cycle: every temporary of one step lives here)
//! ```

mod cycle;
mod ownership;
mod scope;
mod tree;

use std::fmt;
use std::sync::{Arc, LazyLock};

pub(crate) use ownership::Move;
pub use scope::{ActiveScope, Scope};

use crate::arena::{self, ManagerShared, Owner};
use crate::error::Ctx;
use crate::observe::{self, Event};
use crate::report::{self, ManagerReport};
use crate::workspace::{Workspace, WorkspaceConfig};
use crate::{Device, Error, NDArray, NDList, Result};

/// A manager's process-unique id, shown as `m12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ManagerId(pub(crate) u64);

impl fmt::Display for ManagerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "m{}", self.0)
    }
}

/// A node of the manager tree: owns arrays, sub-managers and workspaces, and frees all of them
/// when it is closed. A cheap, cloneable handle (`Send + Sync`); dropping a handle frees nothing.
///
/// ```
/// use ndscope::{DType, Error, Manager};
/// let model = Manager::new_base().with_name("model");
/// let w = model.ones([2, 2], DType::F32)?;
/// model.cap();                                   // no new arrays may land in `model` now
/// let trainer = model.new_sub_manager()?.with_name("trainer");
/// let y = trainer.scope(|batch| {
///     let x = batch.full([2, 2], 3.0, DType::F32)?;
///     let y = w.mul(&x)?;                        // lands in `batch`: the active scope
///     batch.ret(&y)                              // survives the scope, now in `trainer`
/// })?;
/// assert_eq!(y.to_vec::<f32>()?, vec![3.0; 4]);
/// assert!(matches!(w.add(&w), Err(Error::Capped { .. })));  // would land in `model`
/// model.close()?;                                // frees w, trainer and y
/// assert!(matches!(y.to_vec::<f32>(), Err(Error::ArrayClosed { .. })));
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone)]
pub struct Manager(pub(crate) Arc<ManagerShared>);

static SYSTEM: LazyLock<Manager> = LazyLock::new(|| Manager(Arc::clone(&arena::lock().system)));

impl PartialEq for Manager {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Manager {}

impl fmt::Debug for Manager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Manager({})", self.0.describe())
    }
}

impl Manager {
    /// The process-wide root manager. It is never closed: `close()` on it gives
    /// `Error::SystemManager`. Detached arrays are listed under it in reports.
    pub fn system() -> Manager {
        SYSTEM.clone()
    }

    /// A new CPU manager, child of the system manager.
    pub fn new_base() -> Manager {
        let ctx = Ctx::new("Manager::new_base");
        let mut state = arena::lock();
        let system = state.system.key;
        match state.add_manager(&ctx, system, Device::Cpu) {
            Ok(m) => m,
            // The system manager is never closed and the CPU is always available.
            Err(e) => unreachable!("a base CPU manager cannot fail to open: {e}"),
        }
    }

    /// A new manager on `device`, child of the system manager. `DeviceUnavailable` if the
    /// device is absent (any CUDA device without the `cuda` feature or a GPU) or its setup (on
    /// its first use: context, kernels, cuBLAS) failed, with the cause; a failed setup keeps
    /// nothing and is tried again on the next call.
    #[track_caller]
    pub fn new_base_on(device: Device) -> Result<Manager> {
        let ctx = Ctx::new("Manager::new_base_on");
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        crate::backend::prepare(&ctx, device)?;
        let mut state = arena::lock();
        let system = state.system.key;
        state.add_manager(&ctx, system, device)
    }

    /// A new child on this manager's device. `ManagerClosed` if this manager is closed. The cap
    /// is not inherited; a child of a workspace cycle allocates from the same block.
    #[track_caller]
    pub fn new_sub_manager(&self) -> Result<Manager> {
        self.sub_manager(Ctx::new("Manager::new_sub_manager"), self.device())
    }

    /// A new child on `device`.
    #[track_caller]
    pub fn new_sub_manager_on(&self, device: Device) -> Result<Manager> {
        self.sub_manager(Ctx::new("Manager::new_sub_manager_on"), device)
    }

    fn sub_manager(&self, ctx: Ctx, device: Device) -> Result<Manager> {
        if device.is_available() {
            crate::backend::prepare(&ctx, device)?;
        }
        let mut state = arena::lock();
        state.manager(&self.0, &ctx)?;
        state.add_manager(&ctx, self.0.key, device)
    }

    /// A new child wrapped in a [`Scope`], which closes it when dropped (also on panic).
    #[track_caller]
    pub fn sub_scope(&self) -> Result<Scope> {
        Ok(Scope::new(self.sub_manager(
            Ctx::new("Manager::sub_scope"),
            self.device(),
        )?))
    }

    /// Runs `f` in a fresh sub-scope, active on this thread while `f` runs (so op results land
    /// in it), and closes the scope afterwards: on success, on error and on panic. Keep data with
    /// `scope.ret(&x)`.
    #[track_caller]
    pub fn scope<R>(&self, f: impl FnOnce(&Manager) -> Result<R>) -> Result<R> {
        let scope = self.sub_scope()?;
        let active = scope.activate();
        let result = f(&scope);
        drop(active);
        scope.close()?;
        result
    }

    /// The manager's id (`m12`).
    pub fn id(&self) -> ManagerId {
        ManagerId(self.0.id)
    }

    /// The name if one was set, else the id (`"m12"`).
    pub fn name(&self) -> String {
        match &*self.0.name.lock() {
            Some(name) => name.to_string(),
            None => format!("m{}", self.0.id),
        }
    }

    /// Names the manager (shown in errors, dumps and reports).
    pub fn set_name(&self, name: &str) {
        *self.0.name.lock() = Some(Arc::from(name));
    }

    /// Names the manager and returns it, for chaining.
    pub fn with_name(self, name: &str) -> Self {
        self.set_name(name);
        self
    }

    /// The parent; `None` for the system manager. Answered also after closing.
    pub fn parent(&self) -> Option<Manager> {
        self.0.parent.as_ref().map(|p| Manager(Arc::clone(p)))
    }

    /// The open children, newest first; empty once closed.
    pub fn children(&self) -> Vec<Manager> {
        let state = arena::lock();
        if state.live_manager(&self.0).is_none() {
            return Vec::new();
        }
        state
            .children_of(self.0.key)
            .into_iter()
            .map(|k| Manager(Arc::clone(&state.managers[k].shared)))
            .collect()
    }

    /// The device its factories create on.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// `false` once closed.
    pub fn is_open(&self) -> bool {
        arena::lock().live_manager(&self.0).is_some()
    }

    /// Whether [`cap`](Self::cap) was called (and the manager is open).
    pub fn is_capped(&self) -> bool {
        arena::lock()
            .live_manager(&self.0)
            .is_some_and(|m| m.capped)
    }

    /// Closes the manager and its whole subtree, children first: frees every array owned in it,
    /// gives each borrowed array back to the manager it came from (or closes it if that one is
    /// closed too), frees its workspaces, and ends its workspace cycle if it is one. Idempotent.
    /// `SystemManager` for the system manager.
    #[track_caller]
    pub fn close(&self) -> Result<()> {
        let ctx = Ctx::new("Manager::close");
        let mut state = arena::lock();
        if Arc::ptr_eq(&self.0, &state.system) {
            return Err(ctx.system("the system manager is never closed"));
        }
        if state.live_manager(&self.0).is_some() {
            state.close_manager(&ctx, self.0.key);
        }
        Ok(())
    }

    /// Refuses new arrays from now on (one-way): factories, `attach`, `ret` into it, and op
    /// results that would land in it fail with `Capped` before any memory is allocated. Still
    /// allowed: closing it, sub-managers, borrowing into or out of it, and borrowed arrays coming
    /// back to it. Capping a closed manager does nothing.
    pub fn cap(&self) {
        if let Some(m) = arena::lock().live_manager_mut(&self.0) {
            m.capped = true;
        }
    }

    /// Attaches every array to this manager, all or nothing (see [`NDArray::attach`]).
    #[track_caller]
    pub fn attach_all(&self, arrays: &[NDArray]) -> Result<()> {
        self.move_all(Ctx::new("Manager::attach_all"), arrays, Move::Attach)
    }

    /// Borrows every array into this manager, all or nothing (see [`NDArray::temp_attach`]).
    #[track_caller]
    pub fn temp_attach_all(&self, arrays: &[NDArray]) -> Result<()> {
        self.move_all(
            Ctx::new("Manager::temp_attach_all"),
            arrays,
            Move::TempAttach,
        )
    }

    fn move_all(&self, ctx: Ctx, arrays: &[NDArray], kind: Move) -> Result<()> {
        let inners: Vec<_> = arrays.iter().map(|a| &*a.0).collect();
        arena::lock().move_arrays(
            &ctx,
            &inners,
            Owner::Manager(self.0.key),
            Some(&self.0),
            kind,
        )
    }

    /// Attaches `array` to this manager's **parent** (the system manager for a base manager) and
    /// returns its handle: the array survives this manager closing. Its bytes are copied out of
    /// this manager's workspace cycle if they live there (zero-copy under
    /// `ResetPolicy::EndOfBuffer`). `Capped` if the parent is capped; `SystemManager` on the
    /// system manager, which has no parent.
    #[track_caller]
    pub fn ret(&self, array: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("Manager::ret");
        self.ret_inner(&ctx, &[array])?;
        Ok(array.clone())
    }

    /// [`ret`](Self::ret) for every array of the list, all or nothing.
    #[track_caller]
    pub fn ret_list(&self, list: &NDList) -> Result<NDList> {
        let ctx = Ctx::new("Manager::ret_list");
        let arrays: Vec<&NDArray> = list.iter().collect();
        self.ret_inner(&ctx, &arrays)?;
        Ok(list.clone())
    }

    fn ret_inner(&self, ctx: &Ctx, arrays: &[&NDArray]) -> Result<()> {
        let mut state = arena::lock();
        state.manager(&self.0, ctx)?;
        let Some(parent) = self.0.parent.as_ref() else {
            return Err(ctx.system("the system manager has no parent to return arrays to"));
        };
        let inners: Vec<_> = arrays.iter().map(|a| &*a.0).collect();
        state.move_arrays(
            ctx,
            &inners,
            Owner::Manager(parent.key),
            Some(parent),
            Move::Ret,
        )
    }

    /// Makes this manager the thread's active scope while the guard lives: op results computed on
    /// this thread are attached to it (guards nest).
    pub fn activate(&self) -> ActiveScope {
        ActiveScope::push(self)
    }

    /// The thread's innermost active manager, if any.
    pub fn active() -> Option<Manager> {
        scope::active()
    }

    /// A structured snapshot of this manager's subtree: arrays, borrowed arrays, workspaces,
    /// children. See [`ManagerReport`].
    pub fn report(&self) -> ManagerReport {
        report::build(self)
    }

    /// The subtree as indented text, one line per manager; `level >= 1` adds one line per array
    /// with its creation site, largest first. It ends with one line per device in use (the CPU
    /// always), starting `memory on <device>:`, with its [`crate::memory_usage`] figures: bytes
    /// and arrays in use, peak, limit, and the counters (allocations, frees, spills,
    /// reallocations, out-of-memory refusals, driver allocations).
    pub fn debug_dump(&self, level: usize) -> String {
        let report = self.report();
        let mut text = report.dump(level);
        crate::report::push_memory_lines(&mut text, &report);
        text
    }

    /// The workspace called `name` owned by this manager, created with `config` on first use;
    /// the same name with the same configuration returns the same workspace, with another
    /// configuration `InvalidConfig` (ND4J silently ignores the new one). Freed when this manager
    /// closes.
    #[track_caller]
    pub fn workspace(&self, name: &str, config: WorkspaceConfig) -> Result<Workspace> {
        let ctx = Ctx::new("Manager::workspace");
        arena::lock().workspace(&ctx, &self.0, name, config)
    }
}

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
