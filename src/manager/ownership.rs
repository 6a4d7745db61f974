//! Ownership moves: attach, temp_attach (borrow), detach, ret, and giving borrowed arrays back.
//!
//! Every move is checked in full before anything changes (DJL moves first and checks later, so a
//! refused attach orphans the array). A move that takes an array out of the workspace cycle its
//! bytes live in copies the bytes to where the new owner allocates (the heap, or the new owner's
//! own workspace: ND4J's `detach`/`leverageTo`), keeping the same handle valid.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::arena::{
    ArrayKey, ArrayShared, CloseReason, Deferred, Lender, ManagerShared, Owner, Place, State,
};
use crate::backend;
use crate::error::Ctx;
use crate::observe::{self, Event};
use crate::workspace::{Allocation, Checkpoint};
use crate::Result;

/// The kinds of move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Move {
    Attach,
    TempAttach,
    Detach,
    Ret,
}

/// What one array of a move needs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Already where it should be.
    Stay,
    /// Becomes owned by the target; any pending return is cancelled.
    Own,
    /// Borrowed by the target; goes back to its current owner when the target closes.
    Borrow,
}

impl State {
    /// Whether moving `key` to `target` must copy its bytes out of a workspace cycle: they live in
    /// an open cycle's block and the target is not inside that cycle's scope, or they are a
    /// survivor of a circular workspace's ended cycle (which the buffer will overwrite when it
    /// comes round: moved to another owner, it is copied out so that the move keeps it, as
    /// ND4J's `detach`). `ret` out of an open circular cycle is zero-copy.
    fn copy_needed(&self, key: ArrayKey, target: Owner, kind: Move) -> bool {
        let Place::Block { cycle, block, .. } = self.arrays[key].place else {
            return false;
        };
        let Some(ws) = self.workspaces.get(cycle.ws) else {
            return false;
        };
        if ws.open != Some(cycle) {
            return ws.survivor_must_move(block);
        }
        match target {
            Owner::Detached => true,
            Owner::Manager(m) => {
                !(self.is_within(m, cycle.scope) || (kind == Move::Ret && ws.ret_in_place()))
            }
        }
    }

    /// Moves `arrays` to `target` (with `target_shared` naming it), all or nothing.
    pub(crate) fn move_arrays(
        &mut self,
        ctx: &Ctx,
        arrays: &[&ArrayShared],
        target: Owner,
        target_shared: Option<&Arc<ManagerShared>>,
        kind: Move,
    ) -> Result<()> {
        // 1. The target.
        let mut capped = false;
        if let (Owner::Manager(_), Some(shared)) = (target, target_shared) {
            let entry = self.manager(shared, ctx)?;
            capped = entry.capped;
            if kind == Move::TempAttach && shared.key == self.system.key {
                return Err(ctx.system("the system manager cannot borrow arrays"));
            }
        }
        // 2. Each array, checked before anything moves.
        let mut plan: Vec<(ArrayKey, Step, bool)> = Vec::with_capacity(arrays.len());
        for array in arrays {
            let entry = self.array(array, ctx)?;
            let key = array.key;
            if plan.iter().any(|(k, _, _)| *k == key) {
                continue;
            }
            let step = match kind {
                // Attaching to the manager that already holds it (owning or borrowing) changes
                // nothing: a borrowed array stays borrowed and will still go back.
                Move::Attach | Move::Ret if entry.owner == target => Step::Stay,
                Move::Attach | Move::Ret => {
                    if let (true, Some(shared)) = (capped, target_shared) {
                        let what = format!("array {} would be attached to it", array.describe());
                        return Err(super::capped(ctx, shared, what));
                    }
                    Step::Own
                }
                Move::TempAttach if entry.owner == target => Step::Stay,
                Move::TempAttach => Step::Borrow,
                Move::Detach if entry.owner == Owner::Detached && !entry.is_borrowed() => {
                    Step::Stay
                }
                Move::Detach => Step::Own,
            };
            let copy = step != Step::Stay && self.copy_needed(key, target, kind);
            plan.push((key, step, copy));
        }
        // 3. Storage for the copies; undone in full if one fails.
        let checkpoint = self.target_checkpoint(target);
        let mut copies: Vec<(ArrayKey, Allocation)> = Vec::new();
        for &(key, _, copy) in &plan {
            if !copy {
                continue;
            }
            let array = Arc::clone(&self.arrays[key].shared);
            match self.allocate(ctx, target, &array.shape, array.dtype, array.device) {
                Ok(allocation) => copies.push((key, allocation)),
                Err(e) => {
                    drop(copies);
                    self.restore_target(target, checkpoint);
                    return Err(e);
                }
            }
        }
        // 4. Commit: nothing below fails.
        for (key, allocation) in copies {
            if self.arrays.contains_key(key) {
                self.relocate(ctx, key, allocation);
            }
        }
        for (key, step, _) in plan {
            if !self.arrays.contains_key(key) {
                continue;
            }
            match step {
                Step::Stay => {}
                Step::Own => {
                    self.arrays[key].returns.clear();
                    self.set_owner(key, target);
                }
                Step::Borrow => {
                    let current = self.arrays[key].owner;
                    let shared = match current {
                        Owner::Manager(m) => Some(Arc::clone(&self.managers[m].shared)),
                        Owner::Detached => None,
                    };
                    self.arrays[key].returns.push(Lender {
                        owner: current,
                        shared,
                    });
                    self.set_owner(key, target);
                }
            }
        }
        Ok(())
    }

    fn target_checkpoint(&self, target: Owner) -> Option<Checkpoint> {
        let Owner::Manager(m) = target else {
            return None;
        };
        let cycle = self.managers.get(m)?.alloc?;
        Some(self.workspaces.get(cycle.ws)?.checkpoint())
    }

    fn restore_target(&mut self, target: Owner, checkpoint: Option<Checkpoint>) {
        let (Owner::Manager(m), Some(checkpoint)) = (target, checkpoint) else {
            return;
        };
        if let Some(cycle) = self.managers.get(m).and_then(|e| e.alloc) {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.restore(checkpoint);
            }
        }
    }

    /// Moves an array's bytes to new storage (out of a workspace cycle): the bookkeeping now,
    /// the copy now too if no kernel holds the array's data lock, else after the arena lock is
    /// released (see `crate::arena`). Until the copy is done the old bytes stay in use, and
    /// their workspace hands out no part of its block. A device that fails the copy (a broken
    /// CUDA context) closes the array, saying so.
    fn relocate(&mut self, ctx: &Ctx, key: ArrayKey, allocation: Allocation) {
        let Allocation {
            buffer: mut to,
            place,
        } = allocation;
        let entry = &mut self.arrays[key];
        let array = Arc::clone(&entry.shared);
        let old_place = std::mem::replace(&mut entry.place, place);
        if let Place::Block { cycle, .. } = old_place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.forget_block_array(key, old_place);
            }
        }
        if let Place::Block { cycle, .. } = place {
            if let Some(ws) = self.workspaces.get_mut(cycle.ws) {
                ws.note_block_array(key, place);
            }
        }
        if observe::on() {
            let entry = &self.arrays[key];
            let array = &entry.shared;
            observe::emit(Event::ArrayRelocated {
                array: array.id,
                site: array.created_at,
                device: array.device,
                bytes: array.nbytes(),
                manager: self.owner_id(entry.owner),
                address: to.address(),
                from: old_place.span(),
                to: entry.place.span(),
            });
        }
        let seq = array.moves.fetch_add(1, Ordering::AcqRel) + 1;
        let Some(mut data) = array.data.try_write() else {
            self.pending.push(Deferred::Relocate {
                array: Arc::clone(&array),
                to,
                seq,
                ctx: *ctx,
            });
            return;
        };
        let copied = match data.as_ref() {
            Some(old) => backend::copy(ctx, old, &mut to),
            None => Ok(()),
        };
        let old = if copied.is_ok() {
            data.replace(to)
        } else {
            None
        };
        drop(data);
        drop(old);
        if let Err(e) = copied {
            self.remove_array(
                key,
                CloseReason::CopyFailed {
                    error: e.to_string(),
                },
            );
        }
    }

    /// Gives a borrowed array back to `lender` as its borrower `borrower` closes (bypassing any
    /// cap), copying it out of the borrower's workspace cycle if it was copied in.
    pub(crate) fn return_borrowed(
        &mut self,
        ctx: &Ctx,
        key: ArrayKey,
        lender: Lender,
        borrower: Arc<ManagerShared>,
    ) {
        if self.copy_needed(key, lender.owner, Move::Attach) {
            let array = Arc::clone(&self.arrays[key].shared);
            match self.allocate(ctx, lender.owner, &array.shape, array.dtype, array.device) {
                Ok(allocation) => {
                    self.relocate(ctx, key, allocation);
                    if !self.arrays.contains_key(key) {
                        return;
                    }
                }
                Err(e) => {
                    self.remove_array(
                        key,
                        CloseReason::ReturnCopyFailed {
                            borrower,
                            original: lender.describe(),
                            error: e.to_string(),
                        },
                    );
                    return;
                }
            }
        }
        self.set_owner(key, lender.owner);
    }
}
