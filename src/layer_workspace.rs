//! [`LayerWorkspaceMgr`]: DL4J's `LayerWorkspaceMgr` — the kinds of arrays a layer's forward
//! and backward pass makes, each mapped by one configuration to where it lives.

use std::fmt;

use parking_lot::Mutex;

use crate::error::Ctx;
use crate::{DType, Manager, NDArray, Result, Scope, Shape, Workspace, WorkspaceConfig};

/// The kinds of arrays in a network's forward and backward pass (DL4J's `ArrayType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ArrayKind {
    /// The network's input.
    Input,
    /// Layer outputs kept for the backward pass (DL4J's `ACTIVATIONS`).
    Activations,
    /// Gradients with respect to activations, handed down the backward pass
    /// (`ACTIVATION_GRAD`).
    ActivationGrad,
    /// Temporaries of one layer's forward pass (`FF_WORKING_MEM`).
    FfWorkingMem,
    /// Temporaries of one layer's backward pass (`BP_WORKING_MEM`).
    BpWorkingMem,
    /// Temporaries of the parameter update (`UPDATER_WORKING_MEM`).
    UpdaterWorkingMem,
}

impl ArrayKind {
    /// Every kind, in declaration order.
    pub const ALL: [ArrayKind; 6] = [
        ArrayKind::Input,
        ArrayKind::Activations,
        ArrayKind::ActivationGrad,
        ArrayKind::FfWorkingMem,
        ArrayKind::BpWorkingMem,
        ArrayKind::UpdaterWorkingMem,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

impl fmt::Display for ArrayKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Where the arrays of one [`ArrayKind`] live.
#[derive(Clone, Debug, PartialEq)]
pub enum Placement {
    /// Cycles of the workspace of this name, owned by the manager's owner: each
    /// [`LayerWorkspaceMgr::open`] of the kind is one cycle. Kinds that name the same workspace
    /// share its open cycle (DL4J puts forward and backward working memory in one).
    Workspace {
        /// The workspace's name.
        name: String,
        /// Its configuration.
        config: WorkspaceConfig,
    },
    /// A plain sub-scope of the owner per [`LayerWorkspaceMgr::open`]: ordinary allocations,
    /// still freed when the scope closes.
    Scope,
    /// Scoped out (DL4J's `scopeOut`): straight into this manager, with no scope to open.
    Manager(Manager),
}

#[derive(Clone, Debug)]
enum Target {
    Workspace(Workspace),
    Scope,
    Manager(Manager),
}

/// The manager a kind's arrays go to now, and who opened it.
#[derive(Clone, Debug)]
struct Open {
    manager: Manager,
    /// The kind whose `open` created the scope (kinds sharing a workspace borrow it).
    opened_by: ArrayKind,
}

/// Array kinds mapped to scopes and workspaces by one configuration (DL4J's
/// `LayerWorkspaceMgr`): a layer asks for "an activation" or "forward working memory", and the
/// configuration decides whether that is a workspace cycle, a plain scope or a fixed manager.
/// Switching a network between workspaces and none is then one line
/// ([`no_workspaces`](Self::no_workspaces)).
///
/// A kind placed in a workspace or a scope must be opened ([`open`](Self::open), or
/// [`scope`](Self::scope) which also makes it the active scope while a closure runs) before
/// arrays of that kind are made; [`create`](Self::create) and
/// [`leverage_to`](Self::leverage_to) then put arrays there. `leverage_to` moves an array into
/// the kind's scope, copying it into that scope's workspace when it lives in another one
/// (ND4J's `leverageTo`); a kind that is not open gives `InvalidArgument` naming it, where DL4J
/// throws "workspace not open" from deep inside a layer.
///
/// ```
/// use ndscope::{ArrayKind, DType, LayerWorkspaceMgr, Manager, WorkspaceConfig};
/// let trainer = Manager::new_base().with_name("trainer");
/// let mgr = LayerWorkspaceMgr::builder(&trainer)
///     .workspace(ArrayKind::Activations, "activations", WorkspaceConfig::default())
///     .workspace(ArrayKind::FfWorkingMem, "layer-working", WorkspaceConfig::default())
///     .build()?;
/// let w = trainer.full([4, 4], 0.5, DType::F32)?;
/// let x = trainer.ones([2, 4], DType::F32)?;
/// let acts = mgr.open(ArrayKind::Activations)?;          // lives for the whole pass
/// let h = mgr.scope(ArrayKind::FfWorkingMem, |_| {        // one layer's temporaries
///     let z = x.matmul(&w)?.relu()?;                      // in "layer-working"
///     mgr.leverage_to(ArrayKind::Activations, &z)         // kept: copied to "activations"
/// })?;
/// assert_eq!(h.to_vec::<f32>()?, vec![2.0; 8]);           // the layer's scope is gone; h lives
/// drop(acts);                                              // ends the activations cycle
/// assert!(!h.is_open());
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct LayerWorkspaceMgr {
    owner: Manager,
    placements: [Placement; 6],
    targets: [Target; 6],
    open: Mutex<[Option<Open>; 6]>,
}

impl fmt::Debug for LayerWorkspaceMgr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LayerWorkspaceMgr")
            .field("owner", &self.owner)
            .field("placements", &self.placements)
            .finish()
    }
}

/// Builds a [`LayerWorkspaceMgr`]: [`LayerWorkspaceMgr::builder`]. Kinds not configured are
/// placed in plain scopes ([`Placement::Scope`]).
#[derive(Clone, Debug)]
pub struct LayerWorkspaceMgrBuilder {
    owner: Manager,
    placements: [Placement; 6],
}

impl LayerWorkspaceMgrBuilder {
    /// Places `kind` in cycles of the workspace `name` (DL4J's `with(type, name, conf)`).
    pub fn workspace(mut self, kind: ArrayKind, name: &str, config: WorkspaceConfig) -> Self {
        self.placements[kind.index()] = Placement::Workspace {
            name: name.to_string(),
            config,
        };
        self
    }

    /// Places `kind` in plain sub-scopes (DL4J's `noWorkspaceFor`).
    pub fn no_workspace(mut self, kind: ArrayKind) -> Self {
        self.placements[kind.index()] = Placement::Scope;
        self
    }

    /// Puts `kind` straight into `manager`, with no scope (DL4J's `defaultScopedOut`).
    pub fn scoped_out(mut self, kind: ArrayKind, manager: &Manager) -> Self {
        self.placements[kind.index()] = Placement::Manager(manager.clone());
        self
    }

    /// Places `kind` as `placement` says.
    pub fn place(mut self, kind: ArrayKind, placement: Placement) -> Self {
        self.placements[kind.index()] = placement;
        self
    }

    /// Creates the workspaces on the owner (the same name with the same configuration is one
    /// workspace). `ManagerClosed` if the owner is closed; `InvalidConfig` if one name is given
    /// two configurations, or names an existing workspace of the owner with another one.
    #[track_caller]
    pub fn build(self) -> Result<LayerWorkspaceMgr> {
        let ctx = Ctx::new("LayerWorkspaceMgrBuilder::build");
        for (i, a) in self.placements.iter().enumerate() {
            for b in &self.placements[i + 1..] {
                if let (
                    Placement::Workspace {
                        name: na,
                        config: ca,
                    },
                    Placement::Workspace {
                        name: nb,
                        config: cb,
                    },
                ) = (a, b)
                {
                    if na == nb && ca != cb {
                        return Err(ctx.config(format!(
                            "workspace '{na}' is given two configurations: {ca:?} and {cb:?}"
                        )));
                    }
                }
            }
        }
        let mut targets = Vec::with_capacity(6);
        for placement in &self.placements {
            targets.push(match placement {
                Placement::Workspace { name, config } => {
                    Target::Workspace(self.owner.workspace(name, config.clone())?)
                }
                Placement::Scope => {
                    if !self.owner.is_open() {
                        return Err(ctx.config(format!("the owner {:?} is closed", self.owner)));
                    }
                    Target::Scope
                }
                Placement::Manager(m) => Target::Manager(m.clone()),
            });
        }
        let targets: [Target; 6] = match targets.try_into() {
            Ok(t) => t,
            Err(_) => return Err(ctx.invalid("internal: one target per kind")),
        };
        Ok(LayerWorkspaceMgr {
            owner: self.owner,
            placements: self.placements,
            targets,
            open: Mutex::new(Default::default()),
        })
    }
}

/// An open scope of one [`ArrayKind`], from [`LayerWorkspaceMgr::open`] (DL4J's
/// `notifyScopeEntered`). Closes it when dropped (also on panic), closing its arrays, unless it
/// shares the cycle another kind opened. Derefs to the scope's [`Manager`].
#[must_use = "the kind's scope closes when this guard drops"]
pub struct KindScope<'a> {
    mgr: &'a LayerWorkspaceMgr,
    kind: ArrayKind,
    manager: Manager,
    /// The scope this guard opened (none when it shares another kind's, or is scoped out).
    scope: Option<Scope>,
}

impl fmt::Debug for KindScope<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KindScope")
            .field("kind", &self.kind)
            .field("manager", &self.manager)
            .finish()
    }
}

impl std::ops::Deref for KindScope<'_> {
    type Target = Manager;
    fn deref(&self) -> &Manager {
        &self.manager
    }
}

impl KindScope<'_> {
    /// The kind.
    pub fn kind(&self) -> ArrayKind {
        self.kind
    }

    /// Closes the scope now, reporting errors that `drop` must ignore.
    #[track_caller]
    pub fn close(mut self) -> Result<()> {
        self.release();
        match self.scope.take() {
            Some(scope) => scope.close(),
            None => Ok(()),
        }
    }

    /// Forgets this kind's open scope (and the kinds sharing it, if this guard opened it).
    fn release(&self) {
        let mut open = self.mgr.open.lock();
        if self.scope.is_some() {
            for slot in open.iter_mut() {
                if slot.as_ref().is_some_and(|o| o.opened_by == self.kind) {
                    *slot = None;
                }
            }
        } else if open[self.kind.index()]
            .as_ref()
            .is_some_and(|o| o.manager == self.manager)
        {
            open[self.kind.index()] = None;
        }
    }
}

impl Drop for KindScope<'_> {
    fn drop(&mut self) {
        self.release();
        // `Scope`'s own drop closes the manager.
        self.scope.take();
    }
}

impl LayerWorkspaceMgr {
    /// A builder; workspaces and scopes belong to `owner` (a trainer, say).
    pub fn builder(owner: &Manager) -> LayerWorkspaceMgrBuilder {
        LayerWorkspaceMgrBuilder {
            owner: owner.clone(),
            placements: std::array::from_fn(|_| Placement::Scope),
        }
    }

    /// Every kind in plain scopes of `owner`: no workspace at all (DL4J's `noWorkspaces()`;
    /// here arrays are still freed when their scope closes). `ManagerClosed`-free: a closed
    /// owner makes each `open` fail instead.
    pub fn no_workspaces(owner: &Manager) -> LayerWorkspaceMgr {
        LayerWorkspaceMgr {
            owner: owner.clone(),
            placements: std::array::from_fn(|_| Placement::Scope),
            targets: std::array::from_fn(|_| Target::Scope),
            open: Mutex::new(Default::default()),
        }
    }

    /// DL4J's layout for training: activations in workspace `"ws-all-layers-act"` (open for a
    /// whole forward and backward pass), forward and backward working memory sharing
    /// `"ws-layer-working-mem"` (one cycle per layer), activation gradients in
    /// `"ws-activation-grad"`, updater working memory in `"ws-updater"`; the input in plain
    /// scopes. Each workspace learns over its first cycles and grows to the largest (spill
    /// `Reallocate`), so layers of different sizes settle into one block each.
    #[track_caller]
    pub fn training(owner: &Manager) -> Result<LayerWorkspaceMgr> {
        let config = WorkspaceConfig::builder()
            .spill(crate::SpillPolicy::Reallocate)
            .build()?;
        LayerWorkspaceMgr::builder(owner)
            .workspace(ArrayKind::Activations, "ws-all-layers-act", config.clone())
            .workspace(
                ArrayKind::FfWorkingMem,
                "ws-layer-working-mem",
                config.clone(),
            )
            .workspace(
                ArrayKind::BpWorkingMem,
                "ws-layer-working-mem",
                config.clone(),
            )
            .workspace(
                ArrayKind::ActivationGrad,
                "ws-activation-grad",
                config.clone(),
            )
            .workspace(ArrayKind::UpdaterWorkingMem, "ws-updater", config)
            .build()
    }

    /// The owner of the workspaces and scopes.
    pub fn owner(&self) -> &Manager {
        &self.owner
    }

    /// Where `kind` is placed.
    pub fn placement(&self, kind: ArrayKind) -> &Placement {
        &self.placements[kind.index()]
    }

    /// Whether `kind` is scoped out (goes straight into a fixed manager).
    pub fn is_scoped_out(&self, kind: ArrayKind) -> bool {
        matches!(self.targets[kind.index()], Target::Manager(_))
    }

    /// The workspace `kind` is placed in, if any (for its [`stats`](Workspace::stats)).
    pub fn workspace(&self, kind: ArrayKind) -> Option<&Workspace> {
        match &self.targets[kind.index()] {
            Target::Workspace(ws) => Some(ws),
            _ => None,
        }
    }

    /// Opens `kind`'s scope: a cycle of its workspace, or a plain sub-scope of the owner. If
    /// another open kind is placed in the same workspace, `kind` shares that cycle (and the
    /// guard does not close it). For a scoped-out kind, the guard is its manager. Not made
    /// active: use [`scope`](Self::scope) or `activate()` on the guard for op results to land
    /// there. Errors: `InvalidArgument` if `kind` is open already; `WorkspaceBusy` if its
    /// workspace has a cycle open elsewhere; `ManagerClosed`.
    #[track_caller]
    pub fn open(&self, kind: ArrayKind) -> Result<KindScope<'_>> {
        let ctx = Ctx::new("LayerWorkspaceMgr::open");
        let mut open = self.open.lock();
        if let Some(current) = &open[kind.index()] {
            return Err(ctx.invalid(format!(
                "array kind {kind} is open already (in manager {:?}); close its scope first",
                current.manager
            )));
        }
        let (manager, scope) = match &self.targets[kind.index()] {
            Target::Manager(m) => (m.clone(), None),
            Target::Scope => {
                let scope = self.owner.sub_scope()?;
                scope.set_name(&format!("{kind}"));
                (scope.manager().clone(), Some(scope))
            }
            Target::Workspace(ws) => {
                let sharing = ArrayKind::ALL.iter().find_map(|&other| {
                    let shares = matches!(&self.targets[other.index()],
                        Target::Workspace(o) if o.name() == ws.name());
                    open[other.index()]
                        .as_ref()
                        .filter(|o| shares && o.opened_by == other)
                        .map(|o| o.manager.clone())
                });
                match sharing {
                    Some(m) => (m, None),
                    None => {
                        let scope = ws.open()?;
                        (scope.manager().clone(), Some(scope))
                    }
                }
            }
        };
        let opened_by = if scope.is_some() {
            kind
        } else {
            // Shared or scoped out: recorded as opened by the kind that owns the scope, so the
            // shared cycle's closing forgets it too.
            ArrayKind::ALL
                .iter()
                .copied()
                .find(|&k| {
                    open[k.index()]
                        .as_ref()
                        .is_some_and(|o| o.manager == manager && o.opened_by == k)
                })
                .unwrap_or(kind)
        };
        open[kind.index()] = Some(Open {
            manager: manager.clone(),
            opened_by,
        });
        Ok(KindScope {
            mgr: self,
            kind,
            manager,
            scope,
        })
    }

    /// Runs `f` with `kind`'s scope open and active on this thread (op results land there),
    /// then closes it (also on error and panic). Return what must outlive it with
    /// [`leverage_to`](Self::leverage_to) another kind.
    #[track_caller]
    pub fn scope<R>(&self, kind: ArrayKind, f: impl FnOnce(&Manager) -> Result<R>) -> Result<R> {
        let scope = self.open(kind)?;
        let active = scope.activate();
        let result = f(&scope);
        drop(active);
        scope.close()?;
        result
    }

    /// The manager `kind`'s arrays go to now. `InvalidArgument` if `kind` is not open (and not
    /// scoped out).
    #[track_caller]
    pub fn manager(&self, kind: ArrayKind) -> Result<Manager> {
        let ctx = Ctx::new("LayerWorkspaceMgr::manager");
        self.current(&ctx, kind)
    }

    fn current(&self, ctx: &Ctx, kind: ArrayKind) -> Result<Manager> {
        if let Target::Manager(m) = &self.targets[kind.index()] {
            return Ok(m.clone());
        }
        self.open.lock()[kind.index()]
            .as_ref()
            .map(|o| o.manager.clone())
            .ok_or_else(|| {
                ctx.invalid(format!(
                    "array kind {kind} is not open: open its scope first \
                     (LayerWorkspaceMgr::open or ::scope); it is placed in {}",
                    match &self.placements[kind.index()] {
                        Placement::Workspace { name, .. } => format!("workspace '{name}'"),
                        Placement::Scope => "plain scopes".to_string(),
                        Placement::Manager(m) => format!("manager {m:?}"),
                    }
                ))
            })
    }

    /// An array of zeros of `kind` (in its open scope). Errors as [`Manager::zeros`], and
    /// `InvalidArgument` if `kind` is not open.
    #[track_caller]
    pub fn create(
        &self,
        kind: ArrayKind,
        shape: impl Into<Shape>,
        dtype: DType,
    ) -> Result<NDArray> {
        let ctx = Ctx::new("LayerWorkspaceMgr::create");
        self.current(&ctx, kind)?.zeros(shape, dtype)
    }

    /// Moves `array` into `kind`'s open scope (copying it into that scope's workspace, or out
    /// of its own, when needed: ND4J's `leverageTo`) and returns its handle, which stays valid
    /// until that scope closes. Errors as [`NDArray::attach`], and `InvalidArgument` if `kind`
    /// is not open.
    #[track_caller]
    pub fn leverage_to(&self, kind: ArrayKind, array: &NDArray) -> Result<NDArray> {
        let ctx = Ctx::new("LayerWorkspaceMgr::leverage_to");
        let target = self.current(&ctx, kind)?;
        array.attach(&target)?;
        Ok(array.clone())
    }
}
