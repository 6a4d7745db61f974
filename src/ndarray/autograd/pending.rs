//! Weight gradients left as pending products: backward leaves `xᵀ · g` (a matrix product's
//! gradient with respect to a parameter whose gradient holds zeros) uncomputed in the gradient
//! array; the first access to that array's bytes computes it (every access path settles it
//! first, so no handle ever sees the zeros), and an SGD step fuses it into the parameter's
//! update instead (one pass over the parameter and its velocity, as the hand-written
//! `sgd_dense_update_`; the gradient is never written). Closing a manager on the thread settles
//! the thread's pending products first, while their operands (the step's arrays) are open.

use std::cell::{Cell, RefCell};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::tape::Pause;
use crate::arena::{ArrayShared, PendingProduct};
use crate::error::Ctx;
use crate::ndarray::transpose::Transpose;
use crate::{NDArray, Result};

thread_local! {
    /// The gradients this thread left a pending product in (settled when a manager closes on
    /// this thread, so the product's operands, usually the step's arrays, are still open).
    static PENDING: RefCell<Vec<Arc<ArrayShared>>> = const { RefCell::new(Vec::new()) };
    /// Set while this thread computes a pending product (its own writes skip the settling).
    static SETTLING: Cell<bool> = const { Cell::new(false) };
}

/// Whether the gradient array `grad` holds zeros: not written since it was last zeroed, and no
/// pending product.
pub(crate) fn known_zero(grad: &ArrayShared) -> bool {
    !grad.grad.has_pending.load(Ordering::Acquire)
        && grad.grad.zeroed.load(Ordering::Relaxed) == grad.grad.version.load(Ordering::Relaxed)
}

/// Records that `grad` holds zeros now (after it was filled with zeros).
pub(crate) fn mark_zero(grad: &ArrayShared) {
    grad.grad
        .zeroed
        .store(grad.grad.version.load(Ordering::Relaxed), Ordering::Relaxed);
}

/// Leaves `op(a) · op(b)` to be computed into `grad`, which holds zeros: the first access to
/// `grad` computes it, or an optimizer step fuses it into the parameter's update.
pub(crate) fn set_pending(grad: &NDArray, a: &NDArray, b: &NDArray, trans: (bool, bool)) {
    let mut slot = grad.0.grad.pending.lock();
    *slot = Some(PendingProduct {
        a: Arc::clone(&a.0),
        b: Arc::clone(&b.0),
        trans_a: trans.0,
        trans_b: trans.1,
        versions: (
            a.0.grad.version.load(Ordering::Relaxed),
            b.0.grad.version.load(Ordering::Relaxed),
        ),
    });
    grad.0.grad.has_pending.store(true, Ordering::Release);
    drop(slot);
    crate::state::set_before_close(settle_thread_pending);
    PENDING.with(|list| {
        let mut list = list.borrow_mut();
        if list.len() == list.capacity() {
            list.retain(|g| g.grad.has_pending.load(Ordering::Relaxed));
        }
        list.push(Arc::clone(&grad.0));
    });
}

/// Computes the pending product of every gradient this thread left one in (before a manager
/// closes, which may close its operands). A failure leaves the product pending: the next access
/// to the gradient reports it.
fn settle_thread_pending() {
    let list = PENDING.with(|list| std::mem::take(&mut *list.borrow_mut()));
    if list.is_empty() {
        PENDING.with(|l| *l.borrow_mut() = list);
        return;
    }
    let ctx = Ctx::new("Manager::close");
    let mut list = list;
    for grad in list.drain(..) {
        let _ = settle(&ctx, &grad);
    }
    PENDING.with(|l| {
        let mut l = l.borrow_mut();
        if l.capacity() < list.capacity() {
            list.append(&mut l);
            *l = list;
        }
    });
}

/// Computes `a`'s pending product, if it has one: called before any access to an array's bytes.
#[inline]
pub(crate) fn settle(ctx: &Ctx, a: &Arc<ArrayShared>) -> Result<()> {
    if !a.grad.has_pending.load(Ordering::Acquire) {
        return Ok(());
    }
    settle_slow(ctx, a)
}

#[inline(never)]
fn settle_slow(ctx: &Ctx, grad: &Arc<ArrayShared>) -> Result<()> {
    if SETTLING.with(Cell::get) {
        return Ok(());
    }
    // Held while the product is computed: another thread reading the gradient waits for it.
    let mut slot = grad.grad.pending.lock();
    let Some(p) = slot.as_ref() else {
        return Ok(());
    };
    let (a, b) = (NDArray(Arc::clone(&p.a)), NDArray(Arc::clone(&p.b)));
    check_operand(ctx, grad, &a, p.versions.0)?;
    check_operand(ctx, grad, &b, p.versions.1)?;
    let trans = Transpose::from_flags(p.trans_a, p.trans_b);
    SETTLING.with(|s| s.set(true));
    // The gradient holds zeros: the product overwrites it (beta 0), no read. Not recorded (an
    // operand may be tracked by a collector recording now).
    let result = {
        let _not_recorded = Pause::new();
        NDArray(Arc::clone(grad)).addmm_(&a, &b, trans, 0.0, 1.0)
    };
    SETTLING.with(|s| s.set(false));
    result?;
    *slot = None;
    grad.grad.has_pending.store(false, Ordering::Release);
    Ok(())
}

/// Checks the operands of `grad`'s pending product, if it has one (open, unchanged since
/// backward left it), without computing it: an optimizer step checks every gradient before it
/// writes anything.
pub(crate) fn check_pending(ctx: &Ctx, grad: &NDArray) -> Result<()> {
    if !grad.0.grad.has_pending.load(Ordering::Acquire) {
        return Ok(());
    }
    let slot = grad.0.grad.pending.lock();
    let Some(p) = slot.as_ref() else {
        return Ok(());
    };
    check_operand(ctx, &grad.0, &NDArray(Arc::clone(&p.a)), p.versions.0)?;
    check_operand(ctx, &grad.0, &NDArray(Arc::clone(&p.b)), p.versions.1)
}

/// A pending product's operand must be open and unchanged since backward left the product.
fn check_operand(ctx: &Ctx, grad: &ArrayShared, operand: &NDArray, version: u64) -> Result<()> {
    if !operand.is_open() {
        let reason = operand.0.closed.reason();
        return Err(crate::Error::ArrayClosed {
            op: ctx.op,
            at: ctx.at,
            array: operand.0.describe(),
            created_at: operand.created_at(),
            reason: format!(
                "{reason}; the gradient {} is the product of it and another array of the step, \
                 computed when the gradient is first used (read it, or step the optimizer, \
                 before the step's scope closes)",
                grad.describe()
            ),
        });
    }
    if operand.0.grad.version.load(Ordering::Relaxed) != version {
        return Err(ctx.invalid(format!(
            "{} was modified by an in-place operation after backward used it for the gradient \
             {}: its gradient would be wrong",
            operand.0.describe(),
            grad.describe()
        )));
    }
    Ok(())
}

/// Fuses the pending weight gradient `xᵀ · g` of `grad` (if backward left one) into the SGD
/// step of `param`: `v ← momentum · v + xᵀ · g; param ← param − lr · v` in one pass
/// (`sgd_dense_update_`), or `param ← param − lr · xᵀ · g` without a velocity. The gradient is
/// never written and still holds zeros afterwards. `Ok(false)` when there is nothing to fuse.
pub(crate) fn fused_sgd_step(
    ctx: &Ctx,
    param: &NDArray,
    grad: &NDArray,
    velocity: Option<&NDArray>,
    lr: f64,
    momentum: f64,
) -> Result<bool> {
    if !grad.0.grad.has_pending.load(Ordering::Acquire) {
        return Ok(false);
    }
    let mut slot = grad.0.grad.pending.lock();
    let Some(p) = slot.as_ref() else {
        return Ok(false);
    };
    // The fused kernels take operands of the parameter's dtype; a product of halves into an
    // f32 gradient (an autocast step's) is settled by `addmm_` instead.
    if !p.trans_a || p.trans_b || p.a.dtype != param.dtype() {
        return Ok(false);
    }
    let (x, g) = (NDArray(Arc::clone(&p.a)), NDArray(Arc::clone(&p.b)));
    check_operand(ctx, &grad.0, &x, p.versions.0)?;
    check_operand(ctx, &grad.0, &g, p.versions.1)?;
    {
        let _not_recorded = Pause::new();
        match velocity {
            Some(v) => param.sgd_dense_update_(v, &x, &g, lr, momentum)?,
            None => param.addmm_(&x, &g, Transpose::Left, 1.0, -lr)?,
        }
    }
    *slot = None;
    grad.0.grad.has_pending.store(false, Ordering::Release);
    Ok(true)
}

/// Drops `grad`'s pending product (the gradient is being zeroed); `true` if it had one.
pub(crate) fn drop_pending(grad: &NDArray) -> bool {
    if !grad.0.grad.has_pending.load(Ordering::Acquire) {
        return false;
    }
    let had = grad.0.grad.pending.lock().take().is_some();
    grad.0.grad.has_pending.store(false, Ordering::Release);
    had
}
