//! The manager tree in the arena: creating managers and closing subtrees.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::arena::{
    self, ArrayList, CloseReason, Lender, ManagerEntry, ManagerKey, ManagerShared, Owner, State,
};
use crate::error::Ctx;
use crate::observe::{self, Event};
use crate::{Device, Manager, Result};

impl State {
    /// A new open child of `parent` on `device`. It inherits the parent's workspace cycle (so a
    /// sub-scope of a cycle allocates from the same block), but not its cap.
    pub(crate) fn add_manager(
        &mut self,
        ctx: &Ctx,
        parent: ManagerKey,
        device: Device,
    ) -> Result<Manager> {
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        let parent_entry = self
            .managers
            .get(parent)
            .ok_or_else(|| ctx.invalid("parent manager vanished"))?;
        let parent_shared = Arc::clone(&parent_entry.shared);
        let alloc = parent_entry.alloc;
        let old_first = parent_entry.first_child;
        let id = arena::next_manager_id();
        let key = self.managers.insert_with_key(|key| ManagerEntry {
            shared: Arc::new(ManagerShared {
                key,
                id,
                device,
                name: Mutex::new(None),
                parent: Some(parent_shared),
            }),
            parent: Some(parent),
            first_child: None,
            prev_sibling: None,
            next_sibling: old_first,
            arrays: ArrayList::default(),
            capped: false,
            alloc,
            cycle_of: None,
            workspaces: Vec::new(),
        });
        if let Some(old) = old_first {
            self.managers[old].prev_sibling = Some(key);
        }
        self.managers[parent].first_child = Some(key);
        let shared = Arc::clone(&self.managers[key].shared);
        if observe::on() {
            observe::emit(Event::ManagerOpened {
                manager: Arc::clone(&shared) as observe::Handle,
                id: shared.id,
                device: shared.device,
            });
        }
        Ok(Manager(shared))
    }

    /// The open children of `key`, newest first.
    pub(crate) fn children_of(&self, key: ManagerKey) -> Vec<ManagerKey> {
        let mut out = Vec::new();
        let mut child = self.managers.get(key).and_then(|m| m.first_child);
        while let Some(c) = child {
            out.push(c);
            child = self.managers[c].next_sibling;
        }
        out
    }

    /// `key` and all its descendants, each before its own descendants.
    fn subtree(&self, key: ManagerKey) -> Vec<ManagerKey> {
        let mut order = vec![key];
        let mut i = 0;
        while i < order.len() {
            let children = self.children_of(order[i]);
            order.extend(children);
            i += 1;
        }
        order
    }

    /// Whether `key` is `ancestor` or one of its descendants.
    pub(crate) fn is_within(&self, mut key: ManagerKey, ancestor: ManagerKey) -> bool {
        loop {
            if key == ancestor {
                return true;
            }
            match self.managers.get(key).and_then(|m| m.parent) {
                Some(parent) => key = parent,
                None => return false,
            }
        }
    }

    /// Closes `key` and its subtree, children first. Each manager frees the arrays it owns and
    /// gives each borrowed array back to the manager it came from (or closes it if that one is
    /// closed already), frees its workspaces and, if it is a workspace cycle, ends the cycle.
    ///
    /// The subtree closes as one: a lender that is closing in the same call is passed over, and
    /// the array goes back to the nearest lender outside the subtree (or is closed if there is
    /// none). So the outcome never depends on the order in which siblings were created.
    pub(crate) fn close_manager(&mut self, ctx: &Ctx, key: ManagerKey) {
        if !self.managers.contains_key(key) {
            return;
        }
        let order = self.subtree(key);
        // The managers closing in this call, by identity (a lender's key alone could name a
        // newer manager in a reused slot).
        let mut closing: Vec<usize> = order
            .iter()
            .map(|&k| Arc::as_ptr(&self.managers[k].shared) as usize)
            .collect();
        closing.sort_unstable();
        for manager in order.into_iter().rev() {
            self.close_one(ctx, manager, &closing);
        }
    }

    fn close_one(&mut self, ctx: &Ctx, key: ManagerKey, closing: &[usize]) {
        let cycle_of = self.managers[key].cycle_of;
        let shared = Arc::clone(&self.managers[key].shared);
        while let Some(array) = self.managers[key].arrays.head {
            let name = Arc::clone(&shared);
            // Lenders closing in this same call are passed over; if all are, the array goes
            // down with its original owner, the last one passed over.
            let mut original: Option<(ManagerKey, Arc<ManagerShared>)> = None;
            let back = loop {
                match self.arrays[array].returns.pop() {
                    Some(Lender {
                        owner: Owner::Manager(lender),
                        shared: Some(shared),
                    }) if closing
                        .binary_search(&(Arc::as_ptr(&shared) as usize))
                        .is_ok() =>
                    {
                        original = Some((lender, shared));
                    }
                    other => break other,
                }
            };
            match back {
                Some(lender) if self.lender_is_open(&lender) => {
                    self.return_borrowed(ctx, array, lender, name);
                }
                Some(lender) => {
                    self.remove_array(
                        array,
                        CloseReason::ReturnTargetClosed {
                            borrower: name,
                            original: lender.describe(),
                        },
                    );
                }
                None => {
                    let (owner, shared) = original.unwrap_or((key, name));
                    let reason = self.closing_reason(owner, shared);
                    self.remove_array(array, reason);
                }
            }
        }
        let workspaces = std::mem::take(&mut self.managers[key].workspaces);
        for ws in workspaces {
            self.destroy_workspace(ctx, ws);
        }
        if let Some(ws) = cycle_of {
            self.end_cycle(ctx, ws);
        }
        // Unlink from the parent's children.
        let entry = &self.managers[key];
        let (parent, prev, next) = (entry.parent, entry.prev_sibling, entry.next_sibling);
        if let Some(prev) = prev {
            self.managers[prev].next_sibling = next;
        } else if let Some(parent) = parent {
            self.managers[parent].first_child = next;
        }
        if let Some(next) = next {
            self.managers[next].prev_sibling = prev;
        }
        if observe::on() {
            observe::emit(Event::ManagerClosed {
                id: shared.id,
                device: shared.device,
            });
        }
        self.managers.remove(key);
    }

    /// Why an array owned by `key` (closing now) is closed: its workspace cycle ended, or its
    /// manager closed.
    fn closing_reason(&self, key: ManagerKey, shared: Arc<ManagerShared>) -> CloseReason {
        let cycle = self.managers.get(key).and_then(|m| m.cycle_of);
        match cycle.and_then(|ws| self.workspaces.get(ws)) {
            Some(ws) => CloseReason::CycleEnded {
                workspace: Arc::clone(&ws.shared.name),
                cycle: ws.open.map_or(0, |tag| tag.generation),
                manager: shared,
            },
            None => CloseReason::ManagerClosed { manager: shared },
        }
    }

    /// Whether the owner an array goes back to still exists (by identity: its key may have
    /// been reused).
    fn lender_is_open(&self, lender: &Lender) -> bool {
        match (lender.owner, &lender.shared) {
            (Owner::Manager(_), Some(shared)) => self.live_manager(shared).is_some(),
            (Owner::Manager(_), None) => false,
            (Owner::Detached, _) => true,
        }
    }
}
