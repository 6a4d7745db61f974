//! The memory state a sequence of events leads to: live arrays with their addresses, workspace
//! blocks and open managers. The recorder keeps one as the state before its oldest event,
//! folding in each event it drops; the exports replay the kept events on a copy of it, which
//! also tracks bytes in use per device and per top-level manager ([`Totals`]).
//!
//! Folding a dropped event is on the recorder's hot path once its buffer is full, so it touches
//! one map entry per array event and keeps no running totals: those are summed from the live
//! arrays and blocks when an export starts.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use super::event::{Data, MemoryEvent};
use crate::arena::{ArrayShared, ManagerShared};
use crate::backend::Storage;
use crate::error::Site;
use crate::memory;
use crate::observe::{BlockSpan, NO_MANAGER};
use crate::state::State;
use crate::Device;

/// Hashes the process-unique ids (arrays, managers, blocks) the maps are keyed by: a multiply
/// spreads consecutive ids, and costs a few cycles where SipHash costs tens.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = (self.0 ^ id).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by ids.
pub(crate) type IdMap<V> = HashMap<u64, V, BuildHasherDefault<IdHasher>>;

/// An open array.
#[derive(Clone)]
pub(crate) struct LiveArray {
    /// The array's metadata (shape, dtype, name).
    pub shared: Arc<ArrayShared>,
    /// Address of its first byte; `None` when it could not be read.
    pub address: Option<u64>,
    pub span: Option<BlockSpan>,
    /// Its owner now (`NO_MANAGER` when detached): always an open manager.
    pub owner: u64,
    /// The manager it was created in (for the snapshot's category).
    pub allocated_by: u64,
}

impl LiveArray {
    pub fn bytes(&self) -> usize {
        self.shared.nbytes()
    }

    pub fn device(&self) -> Device {
        self.shared.device
    }

    pub fn site(&self) -> Site {
        self.shared.created_at
    }
}

/// A live workspace block.
#[derive(Clone)]
pub(crate) struct LiveBlock {
    pub address: u64,
    pub capacity: usize,
    pub device: Device,
    pub workspace: Option<Arc<str>>,
    /// The top-level manager of the workspace's owner when it was allocated.
    pub top: u64,
}

/// An open manager.
#[derive(Clone)]
pub(crate) struct OpenManager {
    pub shared: Arc<ManagerShared>,
    pub top: u64,
    pub opened_ns: u64,
    pub thread: u32,
    /// For the scope of a workspace cycle: the workspace and cycle number.
    pub cycle: Option<(Arc<str>, u64)>,
}

/// What an event changed: the device whose bytes changed, and up to two top-level managers.
#[derive(Clone, Copy, Default)]
pub(crate) struct Changes {
    pub device: Option<Device>,
    pub tops: [Option<u64>; 2],
}

/// Bytes in use per device and per top-level manager, kept by the exports' replays.
#[derive(Clone, Default)]
pub(crate) struct Totals {
    /// Per device: what was in use when recording started (arrays, blocks and anything else
    /// ndscope reserved), plus what arrays with their own buffer and blocks added since.
    pub device: BTreeMap<Device, i64>,
    /// Per top-level manager: its arrays with their own buffer (by their owner) and its
    /// workspaces' blocks. `NO_MANAGER` collects detached arrays.
    pub top: BTreeMap<u64, i64>,
}

#[derive(Clone, Default)]
pub(crate) struct Replay {
    pub arrays: IdMap<LiveArray>,
    pub blocks: IdMap<LiveBlock>,
    pub managers: IdMap<OpenManager>,
    /// The top-level managers seen, for their names.
    pub tops: IdMap<Arc<ManagerShared>>,
    /// Per device, bytes in use when recording started that no array or block accounts for
    /// (page-locked staging, a `Vec`'s spare capacity adopted by `from_vec`).
    pub device_extra: BTreeMap<Device, i64>,
    /// Kept only by the exports' copies (see [`with_totals`](Self::with_totals)).
    pub totals: Option<Totals>,
}

/// The manager itself if it is the system manager or one of its children, else the child of
/// the system manager it descends from.
fn top_of_shared(shared: &Arc<ManagerShared>) -> &Arc<ManagerShared> {
    let mut current = shared;
    while let Some(parent) = &current.parent {
        if parent.parent.is_none() {
            break;
        }
        current = parent;
    }
    current
}

impl Replay {
    /// The state of the arena now: every open manager, workspace block and array.
    pub fn baseline(state: &State, thread: u32) -> Replay {
        let mut r = Replay::default();
        for m in state.managers() {
            r.open_manager(&m.shared, 0, thread);
        }
        for m in state.managers() {
            if let Some(ws) = m.cycle_of.and_then(|k| state.workspace_entry(k)) {
                let cycle = ws.open.map_or(0, |tag| tag.generation);
                if let Some(open) = r.managers.get_mut(&m.shared.id) {
                    open.cycle = Some((Arc::clone(&ws.shared.name), cycle));
                }
            }
        }
        for ws in state.workspaces() {
            if let Some(block) = &ws.block {
                let top = r.top(ws.shared.owner.id);
                r.blocks.insert(
                    block.id(),
                    LiveBlock {
                        address: block.address(),
                        capacity: block.capacity(),
                        device: block.memory_device(),
                        workspace: Some(Arc::clone(&ws.shared.name)),
                        top,
                    },
                );
            }
        }
        for entry in state.arrays() {
            let array = &entry.shared;
            // Under the arena lock a data lock is only tried (see `crate::state`): an array a
            // kernel is writing now is listed without its address.
            let address = array
                .data
                .try_read()
                .and_then(|data| data.as_ref().map(Storage::address));
            let owner = state.owner_id(entry.owner);
            let span = entry.place.span();
            if let (Some(span), Some(address)) = (span, address) {
                // A block replaced by a larger one lives on while arrays are in it.
                let top = r.top(owner);
                let block = r.blocks.entry(span.block).or_insert(LiveBlock {
                    address: address.wrapping_sub(span.offset as u64),
                    capacity: 0,
                    device: array.device,
                    workspace: None,
                    top,
                });
                block.capacity = block.capacity.max(span.offset + span.len);
            }
            r.arrays.insert(
                array.id,
                LiveArray {
                    shared: Arc::clone(array),
                    address,
                    span,
                    owner,
                    allocated_by: owner,
                },
            );
        }
        let mut devices = vec![Device::Cpu];
        devices.extend(r.blocks.values().map(|b| b.device));
        devices.extend(r.arrays.values().map(LiveArray::device));
        devices.sort();
        devices.dedup();
        let accounted = r.sums().device;
        for device in devices {
            let in_use = memory::in_use(device) as i64;
            let known = accounted.get(&device).copied().unwrap_or(0);
            r.device_extra.insert(device, in_use - known);
        }
        r
    }

    /// The state at process start: the system manager alone.
    pub fn with_system(system: &Arc<ManagerShared>, thread: u32) -> Replay {
        let mut r = Replay::default();
        r.open_manager(system, 0, thread);
        r.device_extra
            .insert(Device::Cpu, memory::in_use(Device::Cpu) as i64);
        r
    }

    fn open_manager(&mut self, shared: &Arc<ManagerShared>, opened_ns: u64, thread: u32) {
        let top = top_of_shared(shared);
        self.tops.entry(top.id).or_insert_with(|| Arc::clone(top));
        self.managers.insert(
            shared.id,
            OpenManager {
                shared: Arc::clone(shared),
                top: top.id,
                opened_ns,
                thread,
                cycle: None,
            },
        );
    }

    /// The top-level manager of an open manager (`NO_MANAGER` for none or an unknown one).
    pub fn top(&self, manager: u64) -> u64 {
        self.managers.get(&manager).map_or(NO_MANAGER, |m| m.top)
    }

    /// Bytes per device and per top-level manager, summed from the live arrays with their own
    /// buffer and the blocks (without `device_extra`).
    fn sums(&self) -> Totals {
        let mut t = Totals::default();
        for a in self.arrays.values().filter(|a| a.span.is_none()) {
            *t.device.entry(a.device()).or_default() += a.bytes() as i64;
            *t.top.entry(self.top(a.owner)).or_default() += a.bytes() as i64;
        }
        for b in self.blocks.values() {
            *t.device.entry(b.device).or_default() += b.capacity as i64;
            *t.top.entry(b.top).or_default() += b.capacity as i64;
        }
        t
    }

    /// A copy that keeps [`Totals`] as events are applied, starting from this state's.
    pub fn with_totals(&self) -> Replay {
        let mut r = self.clone();
        let mut totals = self.sums();
        for (device, extra) in &self.device_extra {
            *totals.device.entry(*device).or_default() += extra;
        }
        r.totals = Some(totals);
        r
    }

    fn add(&mut self, changes: &mut Changes, device: Device, top: u64, bytes: i64) {
        if let Some(t) = &mut self.totals {
            *t.device.entry(device).or_default() += bytes;
            *t.top.entry(top).or_default() += bytes;
            changes.device = Some(device);
            changes.tops[0] = Some(top);
        }
    }

    /// Folds an event the recorder drops into its starting state (taking the event's array
    /// handle instead of cloning it).
    pub fn fold(&mut self, e: MemoryEvent) {
        match e.data {
            Data::Alloc {
                array,
                address,
                span,
            } => {
                self.arrays.insert(
                    array.id,
                    LiveArray {
                        shared: array,
                        address: Some(address),
                        span,
                        owner: e.manager,
                        allocated_by: e.manager,
                    },
                );
            }
            Data::Free { array, .. } => {
                self.arrays.remove(&array);
            }
            _ => {
                let mut closed = None;
                self.apply_with(&e, &mut closed);
            }
        }
    }

    /// Applies one event; returns what it changed in the totals (when kept). A `ManagerClose`
    /// hands the closed manager back through `closed`.
    pub fn apply_with(&mut self, e: &MemoryEvent, closed: &mut Option<OpenManager>) -> Changes {
        let mut changes = Changes::default();
        let device = e.device();
        match &e.data {
            Data::Alloc {
                array,
                address,
                span,
            } => {
                if span.is_none() {
                    let top = self.top(e.manager);
                    self.add(&mut changes, device, top, e.bytes as i64);
                }
                self.arrays.insert(
                    array.id,
                    LiveArray {
                        shared: Arc::clone(array),
                        address: Some(*address),
                        span: *span,
                        owner: e.manager,
                        allocated_by: e.manager,
                    },
                );
            }
            Data::Free { array, span, .. } => {
                let owner = self.arrays.remove(array).map_or(e.manager, |a| a.owner);
                if span.is_none() {
                    let top = self.top(owner);
                    self.add(&mut changes, device, top, -(e.bytes as i64));
                }
            }
            Data::Attach { array, .. } => {
                let new_top = self.top(e.manager);
                let Some(live) = self.arrays.get_mut(array) else {
                    return changes;
                };
                let old = std::mem::replace(&mut live.owner, e.manager);
                let heap = live.span.is_none();
                let old_top = self.top(old);
                if let (true, Some(t)) = (heap && old_top != new_top, &mut self.totals) {
                    *t.top.entry(old_top).or_default() -= e.bytes as i64;
                    *t.top.entry(new_top).or_default() += e.bytes as i64;
                    changes.tops = [Some(old_top), Some(new_top)];
                }
            }
            Data::Relocate(r) => {
                let owner = match self.arrays.get_mut(&r.array) {
                    Some(live) => {
                        live.address = Some(r.address);
                        live.span = r.to;
                        live.owner
                    }
                    None => e.manager,
                };
                let delta = match (r.from.is_none(), r.to.is_none()) {
                    (true, false) => -(e.bytes as i64),
                    (false, true) => e.bytes as i64,
                    _ => 0,
                };
                if delta != 0 {
                    let top = self.top(owner);
                    self.add(&mut changes, device, top, delta);
                }
            }
            Data::ManagerOpen { manager } => {
                self.open_manager(manager, e.time_ns, e.thread);
            }
            Data::ManagerClose => {
                *closed = self.managers.remove(&e.manager);
            }
            Data::CycleOpen { workspace, cycle } => {
                if let Some(open) = self.managers.get_mut(&e.manager) {
                    open.cycle = Some((Arc::clone(workspace), *cycle));
                }
            }
            Data::BlockAlloc {
                workspace,
                block,
                address,
            } => {
                let top = self.top(e.manager);
                self.blocks.insert(
                    *block,
                    LiveBlock {
                        address: *address,
                        capacity: e.bytes,
                        device,
                        workspace: Some(Arc::clone(workspace)),
                        top,
                    },
                );
                self.add(&mut changes, device, top, e.bytes as i64);
            }
            Data::BlockFree { block } => match self.blocks.remove(block) {
                Some(b) => self.add(&mut changes, device, b.top, -(e.bytes as i64)),
                None => {
                    // Allocated before recording and freed with nothing in it: only the
                    // device's total knew of it.
                    *self.device_extra.entry(device).or_default() -= e.bytes as i64;
                    if let Some(t) = &mut self.totals {
                        *t.device.entry(device).or_default() -= e.bytes as i64;
                        changes.device = Some(device);
                    }
                }
            },
            Data::CycleClose { .. }
            | Data::Spill { .. }
            | Data::Capped { .. }
            | Data::OutOfMemory { .. } => {}
        }
        changes
    }

    /// The name of a top-level manager's counter track.
    pub fn top_name(&self, top: u64) -> String {
        match self.tops.get(&top) {
            Some(shared) => shared.describe(),
            None => "detached arrays".to_string(),
        }
    }
}
