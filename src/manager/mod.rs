//! Managers: the tree that owns every array (DJL's `NDManager`, with atomic moves).
//!
//! ```text
//! system                      (process-wide root; never closed)
//! └─ model "mlp"              (parameters; capped during training to catch leaks)
//!    └─ trainer               (owns workspace "batch")
//!       └─ batch #57          (a workspace cycle: every temporary of one step lives here)
//! ```

mod scope;

use std::fmt;
use std::sync::{Arc, LazyLock};

pub use scope::{ActiveScope, Scope};

use crate::arena::ManagerShared;
use crate::error::Ctx;
use crate::state;
use crate::workspace::{Workspace, WorkspaceConfig};
use crate::{Device, Result};

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

static SYSTEM: LazyLock<Manager> = LazyLock::new(|| Manager(Arc::clone(state::lock().system())));

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
        let mut state = state::lock();
        let system = state.system().key;
        match state.add_manager(&ctx, system, Device::Cpu) {
            Ok(m) => Manager(m),
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
        let mut state = state::lock();
        let system = state.system().key;
        state.add_manager(&ctx, system, device).map(Manager)
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

    /// A new child on `device` (`ctx` names the call).
    pub(crate) fn sub_manager(&self, ctx: Ctx, device: Device) -> Result<Manager> {
        if device.is_available() {
            crate::backend::prepare(&ctx, device)?;
        }
        let mut state = state::lock();
        state.manager(&self.0, &ctx)?;
        state.add_manager(&ctx, self.0.key, device).map(Manager)
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
        let state = state::lock();
        if state.live_manager(&self.0).is_none() {
            return Vec::new();
        }
        state
            .children_of(self.0.key)
            .into_iter()
            .map(|k| Manager(Arc::clone(&state.manager_entry(k).shared)))
            .collect()
    }

    /// The device its factories create on.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// `false` once closed.
    pub fn is_open(&self) -> bool {
        state::lock().live_manager(&self.0).is_some()
    }

    /// Whether [`cap`](Self::cap) was called (and the manager is open).
    pub fn is_capped(&self) -> bool {
        state::lock()
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
        state::before_close();
        let mut state = state::lock();
        if Arc::ptr_eq(&self.0, state.system()) {
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
        state::lock().cap(&self.0);
    }

    /// The workspace called `name` owned by this manager, created with `config` on first use;
    /// the same name with the same configuration returns the same workspace, with another
    /// configuration `InvalidConfig` (ND4J silently ignores the new one). Freed when this manager
    /// closes.
    #[track_caller]
    pub fn workspace(&self, name: &str, config: WorkspaceConfig) -> Result<Workspace> {
        let ctx = Ctx::new("Manager::workspace");
        state::lock().workspace(&ctx, &self.0, name, config)
    }
}
