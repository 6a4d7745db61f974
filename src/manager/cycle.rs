//! Workspace cycles, made in the manager layer: a cycle is a sub-manager of the workspace's owner
//! (a [`Scope`]) whose arrays allocate from the workspace's block. The workspace (below) keeps
//! the block and decides where allocations go; this room makes and names the cycle's manager.

use std::sync::Arc;

use crate::arena::{self, CycleTag, State};
use crate::error::Ctx;
use crate::workspace::{Workspace, WorkspaceShared};
use crate::{Error, Manager, Result, Scope};

impl Workspace {
    /// The manager that owns the workspace (and frees it when it closes).
    pub fn owner(&self) -> Manager {
        Manager(Arc::clone(&self.0.owner))
    }

    /// Opens a cycle: a new sub-manager of the owner, named `"<name>#<generation>"`, whose arrays
    /// allocate from the block. Closing (or dropping) the scope ends the cycle.
    ///
    /// The scope is not made active by this call: op results go to the owner of their first
    /// input. Call [`Manager::activate`] on it (or use [`Workspace::cycle`]) to collect every
    /// temporary of a step there.
    ///
    /// Errors: `WorkspaceBusy` while another cycle is open, `ManagerClosed` once the owner has
    /// closed, `InvalidArgument` after [`destroy`](Self::destroy).
    #[track_caller]
    pub fn open(&self) -> Result<Scope> {
        let ctx = Ctx::new("Workspace::open");
        let manager = arena::lock().open_cycle(&ctx, &self.0)?;
        Ok(Scope::new(manager))
    }

    /// Runs `f` in one cycle, with the cycle's scope active on this thread, and ends the cycle
    /// afterwards (also on error or panic). Return data with `scope.ret(&x)`.
    #[track_caller]
    pub fn cycle<R>(&self, f: impl FnOnce(&Manager) -> Result<R>) -> Result<R> {
        let scope = self.open()?;
        let active = scope.activate();
        let result = f(&scope);
        drop(active);
        scope.close()?;
        result
    }
}

impl State {
    /// `Workspace::open`: a new cycle of the workspace `shared`, as a new sub-manager of its owner.
    fn open_cycle(&mut self, ctx: &Ctx, shared: &WorkspaceShared) -> Result<Manager> {
        let ws = self.workspace_mut(ctx, shared)?;
        if let Some(open) = ws.open {
            let cycle = self.describe_manager(open.scope);
            return Err(Error::WorkspaceBusy {
                op: ctx.op,
                at: ctx.at,
                workspace: shared.name.to_string(),
                cycle,
            });
        }
        let generation = ws.next_generation();
        let (owner, device) = (ws.owner, ws.device);
        let name = format!("{}#{generation}", shared.name);
        let manager = self.add_manager(ctx, owner, device)?;
        manager.set_name(&name);
        let key = manager.0.key;
        let tag = CycleTag {
            ws: shared.key,
            generation,
            scope: key,
        };
        let entry = &mut self.managers[key];
        entry.alloc = Some(tag);
        entry.cycle_of = Some(shared.key);
        self.workspaces[shared.key].cycle_opened(tag, manager.0.id);
        Ok(manager)
    }
}
