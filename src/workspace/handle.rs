//! The workspace handle's operations that take the arena lock: opening a cycle (a sub-manager
//! of the owner, as a [`Scope`]), the figures, sizing and destroying the block. They live above
//! the state (`crate::state`) and the manager, which the workspace itself (the block allocator
//! and the cycle state machine, below both) knows nothing of.

use std::sync::Arc;

use crate::error::Ctx;
use crate::state;
use crate::{Manager, Result, Scope};

use super::{Workspace, WorkspaceStats};

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
        let manager = state::lock().open_cycle(&ctx, &self.0)?;
        Ok(Scope::new(Manager(manager)))
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

    /// The workspace's figures. After [`destroy`](Self::destroy), the figures at destruction.
    pub fn stats(&self) -> WorkspaceStats {
        let state = state::lock();
        match state.live_workspace(&self.0) {
            Some(ws) => ws.stats(),
            None => self.0.final_stats.lock().clone().unwrap_or_default(),
        }
    }

    /// Allocates the block now, from `initial_size` or the largest cycle seen so far, instead of
    /// waiting for the learning policy. Does nothing if the block exists.
    #[track_caller]
    pub fn initialize(&self) -> Result<()> {
        let ctx = Ctx::new("Workspace::initialize");
        let mut state = state::lock();
        state.initialize_workspace(&ctx, &self.0)
    }

    /// Frees the block now: ends an open cycle (closing its arrays), closes arrays still living
    /// in the block, and removes the workspace from its owner. Idempotent.
    #[track_caller]
    pub fn destroy(&self) -> Result<()> {
        let ctx = Ctx::new("Workspace::destroy");
        let mut state = state::lock();
        if state.live_workspace(&self.0).is_some() {
            state.destroy_workspace(&ctx, self.0.key);
        }
        Ok(())
    }

    /// Makes a circular workspace keep the open arrays of earlier cycles: an allocation that
    /// would overwrite one spills instead, and the block grows (with `SpillPolicy::Reallocate`)
    /// to the policy's size for the largest cycle. For the prefetcher's ring, whose batches
    /// stay readable until the consumer lets them go.
    pub(crate) fn keep_open_arrays(&self, ctx: &Ctx) -> Result<()> {
        state::lock().keep_open_arrays(ctx, &self.0)
    }

    /// Whether [`destroy`](Self::destroy) ran or the owner closed.
    pub fn is_destroyed(&self) -> bool {
        state::lock().live_workspace(&self.0).is_none()
    }
}

/// Destroys every live workspace created on the calling thread, as ND4J's
/// `destroyAllWorkspacesForCurrentThread` (say, after evaluation, when a thread's workspaces are
/// no longer needed), and returns how many it destroyed. Each is destroyed as by
/// [`Workspace::destroy`]: an open cycle ends, arrays still in its block are closed, the block is
/// freed. Workspaces of other threads are left alone; one created here but used from another
/// thread since is destroyed too (the creator decides). Freeing never depends on the thread:
/// [`Workspace::destroy`] and closing the owner work from any thread.
///
/// ```
/// use ndscope::{destroy_all_workspaces_for_current_thread, Manager, WorkspaceConfig};
/// let m = Manager::new_base();
/// let ws = m.workspace("eval", WorkspaceConfig::default())?;
/// let other = std::thread::spawn({
///     let m = m.clone();
///     move || m.workspace("theirs", WorkspaceConfig::default()).map(|_| ())
/// });
/// other.join().unwrap()?;
/// assert!(destroy_all_workspaces_for_current_thread() >= 1);
/// assert!(ws.is_destroyed());
/// assert!(!m.workspace("theirs", WorkspaceConfig::default())?.is_destroyed());
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn destroy_all_workspaces_for_current_thread() -> usize {
    let ctx = Ctx::new("destroy_all_workspaces_for_current_thread");
    let me = std::thread::current().id();
    let mut state = state::lock();
    let mine = state.workspaces_created_by(me);
    for &key in &mine {
        state.destroy_workspace(&ctx, key);
    }
    mine.len()
}
