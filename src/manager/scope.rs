//! [`Scope`] (a manager closed on drop) and [`ActiveScope`] (the thread's current manager for op
//! results).

use std::cell::RefCell;
use std::marker::PhantomData;
use std::ops::Deref;

use std::sync::Arc;

use crate::error::Ctx;
use crate::{Manager, Result};

/// A manager that is closed when this guard drops, also while unwinding from a panic. Derefs to
/// [`Manager`]. Made by [`Manager::sub_scope`] and [`Workspace::open`](crate::Workspace::open).
///
/// ```
/// use ndscope::{DType, Manager};
/// let parent = Manager::new_base();
/// let kept = {
///     let scope = parent.sub_scope()?;
///     let tmp = scope.ones([3], DType::F32)?;
///     let total = tmp.sum_all()?;
///     scope.ret(&total)?               // survives: now owned by `parent`
/// };                                   // scope closed here, `tmp` freed
/// assert_eq!(kept.to_scalar::<f32>()?, 3.0);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[must_use = "a Scope closes its manager when dropped"]
#[derive(Debug)]
pub struct Scope {
    manager: Manager,
    /// Set by [`Scope::close`], so `drop` does not close again.
    closed: bool,
}

impl Scope {
    pub(crate) fn new(manager: Manager) -> Scope {
        Scope {
            manager,
            closed: false,
        }
    }

    /// The manager (also reachable through `Deref`).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// Closes the manager now, reporting errors instead of ignoring them as `drop` must.
    #[track_caller]
    pub fn close(mut self) -> Result<()> {
        self.closed = true;
        self.manager.close()
    }
}

impl Deref for Scope {
    type Target = Manager;
    fn deref(&self) -> &Manager {
        &self.manager
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        // A scope is never the system manager, the only manager whose close fails.
        if !self.closed {
            let _ = self.manager.close();
        }
    }
}

impl Manager {
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

    /// Makes this manager the thread's active scope while the guard lives: op results computed on
    /// this thread are attached to it (guards nest).
    pub fn activate(&self) -> ActiveScope {
        ActiveScope::push(self)
    }

    /// The thread's innermost active manager, if any.
    pub fn active() -> Option<Manager> {
        active()
    }
}

thread_local! {
    static ACTIVE: RefCell<Vec<Manager>> = const { RefCell::new(Vec::new()) };
}

/// While this guard lives, op results computed on this thread are attached to its manager.
/// Guards nest; dropping one restores the one before. Not `Send`: it belongs to its thread.
/// Made by [`Manager::activate`].
#[must_use = "the manager is active only while the guard lives"]
#[derive(Debug)]
pub struct ActiveScope {
    /// The manager's identity (its shared part's address; a key could be reused).
    manager: usize,
    _not_send: PhantomData<*const ()>,
}

impl ActiveScope {
    pub(crate) fn push(manager: &Manager) -> ActiveScope {
        ACTIVE.with(|stack| stack.borrow_mut().push(manager.clone()));
        ActiveScope {
            manager: Arc::as_ptr(&manager.0) as usize,
            _not_send: PhantomData,
        }
    }
}

impl Drop for ActiveScope {
    fn drop(&mut self) {
        ACTIVE.with(|stack| {
            let mut stack = stack.borrow_mut();
            // Normally the top; guards dropped out of order remove their own entry only.
            if let Some(pos) = stack
                .iter()
                .rposition(|m| Arc::as_ptr(&m.0) as usize == self.manager)
            {
                stack.remove(pos);
            }
        });
    }
}

/// The innermost active manager of this thread.
pub(crate) fn active() -> Option<Manager> {
    ACTIVE.with(|stack| stack.borrow().last().cloned())
}
