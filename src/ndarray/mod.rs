//! [`NDArray`]: the array handle, its metadata, data access and ownership calls. Operations are
//! in `ops.rs` (elementwise, comparisons, in place), `reduce_ops.rs`, `shape_ops.rs`,
//! `nn_ops.rs` and `optim.rs` (the fused optimizer steps); factories (on `Manager`) in `factory.rs`.

pub(crate) mod autocast;
pub(crate) mod autograd;
pub(crate) mod collective;
mod convert;
mod dense;
pub(crate) mod exec;
mod factory;
mod hooks;
mod host;
mod list;
mod nn_ops;
mod ops;
mod optim;
mod reduce_ops;
mod shape_ops;
mod transpose;

use std::fmt;
use std::panic::Location;
use std::sync::Arc;

pub use autocast::{autocast, autocast_dtype, AutocastGuard};
pub use autograd::{
    gradient_collector, is_grad_enabled, no_gradient, GradientCollector, NoGradientGuard,
};
pub use dense::{Activation, Dense};
pub use factory::manual_seed;
pub use list::NDList;
pub use nn_ops::Transpose;
pub use optim::{AdamUpdate, SgdUpdate};
pub use shape_ops::{concat, stack};

use crate::arena::{ArrayShared, CloseReason, ManagerShared, Owner};
use crate::error::{Ctx, Site};
use crate::manager::Manager;
use crate::state::{self, Move};
use crate::{DType, Device, Error, Result, Shape};

/// An array's process-unique id, shown as `a12`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ArrayId(pub(crate) u64);

impl fmt::Display for ArrayId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a{}", self.0)
    }
}

/// An n-dimensional array: a cheap, cloneable handle (`Send + Sync`) to an array owned by a
/// [`Manager`]. Dropping a handle frees nothing; the array is freed when it or its manager is
/// closed, after which every use of any handle to it gives `Error::ArrayClosed` saying where it
/// was created and why it is closed.
///
/// Metadata (`shape`, `dtype`, `device`, …) is cached in the handle and always answers.
///
/// ```
/// use ndscope::{DType, Error, Manager};
/// let m = Manager::new_base();
/// let a = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2])?;
/// a.set_name("a");
/// let b = a.add_scalar(1.0)?.relu()?;
/// assert_eq!(b.to_vec::<f32>()?, vec![2.0, 3.0, 4.0, 5.0]);
/// a.close()?;
/// let err = a.to_vec::<f32>().unwrap_err();
/// assert!(err.to_string().contains("'a'"));      // names the array and why it is closed
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone)]
pub struct NDArray(pub(crate) Arc<ArrayShared>);

impl PartialEq for NDArray {
    /// Two handles are equal when they refer to the same array (not when their data is equal).
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for NDArray {}

impl fmt::Debug for NDArray {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NDArray({} {} {} on {}{})",
            self.0.describe(),
            self.dtype(),
            self.shape(),
            self.device(),
            if self.is_open() { "" } else { ", closed" }
        )
    }
}

impl NDArray {
    /// The array's id (`a12`).
    pub fn id(&self) -> ArrayId {
        ArrayId(self.0.id)
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.0.shape
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.0.shape.dims()
    }

    /// The number of dimensions.
    pub fn ndim(&self) -> usize {
        self.0.shape.ndim()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.dtype
    }

    /// The device its bytes are on.
    pub fn device(&self) -> Device {
        self.0.device
    }

    /// The number of elements.
    pub fn size(&self) -> usize {
        self.0.shape.size()
    }

    /// Bytes of data (`size × dtype size`).
    pub fn nbytes(&self) -> usize {
        self.0.nbytes()
    }

    /// The name, if one was set.
    pub fn name(&self) -> Option<String> {
        self.0.name.lock().as_deref().map(str::to_string)
    }

    /// Names the array (shown in errors, dumps and reports).
    pub fn set_name(&self, name: &str) {
        *self.0.name.lock() = Some(Arc::from(name));
        self.rename_gradient();
    }

    /// Names the array and returns it, for chaining.
    pub fn with_name(self, name: &str) -> Self {
        self.set_name(name);
        self
    }

    /// Where the array was created (the caller of the factory or op).
    pub fn created_at(&self) -> &'static Location<'static> {
        self.0.created_at
    }

    /// `false` once closed (by `close`, by its manager, by its workspace cycle ending, or by a
    /// circular workspace overwriting it).
    pub fn is_open(&self) -> bool {
        !self.0.closed.is_closed()
    }

    /// The manager that owns it now: while borrowed, the borrower. `InvalidArgument` for a
    /// detached array, `ArrayClosed` for a closed one.
    #[track_caller]
    pub fn manager(&self) -> Result<Manager> {
        let ctx = Ctx::new("NDArray::manager");
        let state = state::lock();
        let entry = state.array(&self.0, &ctx)?;
        match entry.owner {
            Owner::Manager(key) => Ok(Manager(Arc::clone(&state.manager_entry(key).shared))),
            Owner::Detached => Err(ctx.invalid(format!(
                "array {} is detached: no manager owns it (close it yourself)",
                self.0.describe()
            ))),
        }
    }

    /// Whether no manager owns it (after [`detach`](Self::detach)).
    pub fn is_detached(&self) -> bool {
        let state = state::lock();
        state
            .live_array(&self.0)
            .is_some_and(|e| e.owner == Owner::Detached)
    }

    /// Moves the array to `manager` for good. Checked first, then moved: on `Capped`,
    /// `ManagerClosed` or `ArrayClosed` nothing changes. If `manager` is borrowing it, it stays
    /// borrowed (it will still go back). Cancels a pending return of a borrowed array. Copies the
    /// bytes out of a workspace cycle the new owner is not part of.
    #[track_caller]
    pub fn attach(&self, manager: &Manager) -> Result<()> {
        self.move_to(
            Ctx::new("NDArray::attach"),
            Owner::Manager(manager.0.key),
            Some(&manager.0),
            Move::Attach,
        )
    }

    /// Lends the array to `manager` until it closes; then it goes back to the manager it came
    /// from (bypassing that manager's cap), or is closed if that one closed meanwhile. Chains
    /// unwind in reverse (A→B→C gives back C→B→A). No cap check; `SystemManager` if `manager`
    /// is the system manager. A later `attach`, `detach` or `close` cancels the return.
    #[track_caller]
    pub fn temp_attach(&self, manager: &Manager) -> Result<()> {
        self.move_to(
            Ctx::new("NDArray::temp_attach"),
            Owner::Manager(manager.0.key),
            Some(&manager.0),
            Move::TempAttach,
        )
    }

    /// Takes the array away from every manager: the caller must [`close`](Self::close) it.
    /// Detached arrays are listed under the system manager in reports, so they cannot hide.
    #[track_caller]
    pub fn detach(&self) -> Result<()> {
        self.move_to(
            Ctx::new("NDArray::detach"),
            Owner::Detached,
            None,
            Move::Detach,
        )
    }

    fn move_to(
        &self,
        ctx: Ctx,
        target: Owner,
        shared: Option<&Arc<ManagerShared>>,
        kind: Move,
    ) -> Result<()> {
        state::lock().move_arrays(&ctx, &[&*self.0], target, shared, kind)
    }

    /// Frees the array now. Idempotent. If another thread is computing on it, this waits for
    /// that kernel to finish.
    #[track_caller]
    pub fn close(&self) -> Result<()> {
        let at: Site = Location::caller();
        let mut state = state::lock();
        if state.live_array(&self.0).is_some() {
            state.remove_array(self.0.key(), CloseReason::ByUser { at });
        }
        Ok(())
    }

    /// The error for an unsupported dtype in `op`.
    pub(crate) fn dtype_error(&self, ctx: &Ctx, wanted: &str) -> Error {
        ctx.dtype(
            self.dtype(),
            format!(
                "`{}` needs {wanted}; array {} is {}",
                ctx.op,
                self.0.describe(),
                self.dtype()
            ),
        )
    }
}

/// The manager's calls that take or give arrays (here, in the arrays' room: the manager knows
/// nothing of `NDArray`).
impl Manager {
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
        state::lock().move_arrays(
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

    /// Moves `arrays` to this manager's parent, all or nothing (`ret`, `NDList`'s `ret_list`).
    pub(crate) fn ret_inner(&self, ctx: &Ctx, arrays: &[&NDArray]) -> Result<()> {
        let mut state = state::lock();
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
}
