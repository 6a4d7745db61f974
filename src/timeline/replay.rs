//! The memory state a sequence of events leads to: live arrays with their addresses, workspace
//! blocks, open managers, and bytes in use per device and per top-level manager. The recorder
//! keeps one as the state before its oldest event (applying each event it drops), and the
//! exports replay the kept events on a copy of it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use super::{Data, MemoryEvent, Slot, NO_MANAGER};
use crate::arena::{memory, ArrayInner, ManagerShared, State};
use crate::backend::Storage;
use crate::error::Site;
use crate::Device;

/// Hashes the process-unique ids (arrays, managers, blocks) the maps are keyed by: a multiply
/// spreads consecutive ids, and costs a few cycles where SipHash costs tens. The recorder
/// applies every event it drops to these maps, so this is on its hot path once it is full.
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
    /// The array's metadata (shape, dtype, name), when known.
    pub inner: Option<Arc<ArrayInner>>,
    pub bytes: usize,
    pub device: Device,
    pub site: Site,
    /// Address of its first byte; `None` when it could not be read.
    pub address: Option<u64>,
    pub slot: Option<Slot>,
    /// The manager that allocated it (for the snapshot's category).
    pub allocated_by: u64,
    /// Its current owner's top-level manager (for the counter tracks).
    pub top: u64,
}

/// A live workspace block.
#[derive(Clone)]
pub(crate) struct LiveBlock {
    pub address: u64,
    pub capacity: usize,
    pub device: Device,
    pub workspace: Option<Arc<str>>,
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

#[derive(Clone, Default)]
pub(crate) struct Replay {
    pub arrays: IdMap<LiveArray>,
    pub blocks: IdMap<LiveBlock>,
    pub managers: IdMap<OpenManager>,
    /// Bytes in use per device: what was in use when recording started, plus what the events
    /// since allocated and freed (arrays with their own buffer, and blocks).
    pub device_bytes: BTreeMap<Device, i64>,
    /// The same bytes per top-level manager (arrays by their owner's, blocks by their
    /// workspace owner's). `NO_MANAGER` collects detached arrays.
    pub top_bytes: BTreeMap<u64, i64>,
    /// The top-level managers seen, for their names.
    pub tops: IdMap<Arc<ManagerShared>>,
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
        for (_, m) in state.managers.iter() {
            r.open_manager(&m.shared, 0, thread);
        }
        for (_, m) in state.managers.iter() {
            if let Some(ws) = m.cycle_of.and_then(|k| state.workspaces.get(k)) {
                let cycle = ws.open.map_or(0, |tag| tag.generation);
                if let Some(open) = r.managers.get_mut(&m.shared.id) {
                    open.cycle = Some((Arc::clone(&ws.shared.name), cycle));
                }
            }
        }
        let mut devices = vec![Device::Cpu];
        for (_, ws) in state.workspaces.iter() {
            if let Some(block) = &ws.block {
                let owner = ws.shared.owner.0.id;
                let top = r.top(owner);
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
                *r.top_bytes.entry(top).or_default() += block.capacity() as i64;
                devices.push(block.memory_device());
            }
        }
        for (_, entry) in state.arrays.iter() {
            let inner = &entry.inner;
            // Under the arena lock a data lock is only tried (see `crate::arena`): an array a
            // kernel is writing now is listed without its address.
            let address = inner
                .data
                .try_read()
                .and_then(|data| data.as_ref().map(Storage::address));
            let manager = match entry.owner {
                crate::arena::Owner::Manager(key) => {
                    state.managers.get(key).map_or(NO_MANAGER, |m| m.shared.id)
                }
                crate::arena::Owner::Detached => NO_MANAGER,
            };
            let slot = Slot::of(entry.place);
            if let (Some(slot), Some(address)) = (slot, address) {
                // A block replaced by a larger one lives on while arrays are in it.
                let top = r.top(manager);
                let block = r.blocks.entry(slot.block).or_insert(LiveBlock {
                    address: address.wrapping_sub(slot.offset as u64),
                    capacity: 0,
                    device: inner.device,
                    workspace: None,
                    top,
                });
                block.capacity = block.capacity.max(slot.offset + slot.len);
            }
            let top = r.top(manager);
            if slot.is_none() {
                *r.top_bytes.entry(top).or_default() += inner.nbytes() as i64;
            }
            devices.push(inner.device);
            r.arrays.insert(
                inner.id,
                LiveArray {
                    inner: Some(Arc::clone(inner)),
                    bytes: inner.nbytes(),
                    device: inner.device,
                    site: inner.created_at,
                    address,
                    slot,
                    allocated_by: manager,
                    top,
                },
            );
        }
        devices.sort();
        devices.dedup();
        for device in devices {
            r.device_bytes.insert(device, memory::in_use(device) as i64);
        }
        r
    }

    /// The state at process start: the system manager alone.
    pub fn with_system(system: &Arc<ManagerShared>, thread: u32) -> Replay {
        let mut r = Replay::default();
        r.open_manager(system, 0, thread);
        r.device_bytes
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

    fn add(&mut self, device: Device, top: u64, bytes: i64) {
        *self.device_bytes.entry(device).or_default() += bytes;
        *self.top_bytes.entry(top).or_default() += bytes;
    }

    /// Applies one event; returns what it changed. A `ManagerClose` returns the closed manager
    /// through `closed`.
    pub fn apply_with(&mut self, e: &MemoryEvent, closed: &mut Option<OpenManager>) -> Changes {
        let mut changes = Changes::default();
        match &e.data {
            Data::Alloc {
                array,
                address,
                slot,
            } => {
                let top = self.top(e.manager);
                if slot.is_none() {
                    self.add(e.device, top, e.bytes as i64);
                    changes.device = Some(e.device);
                    changes.tops[0] = Some(top);
                }
                self.arrays.insert(
                    array.id,
                    LiveArray {
                        inner: Some(Arc::clone(array)),
                        bytes: e.bytes,
                        device: e.device,
                        site: array.created_at,
                        address: Some(*address),
                        slot: *slot,
                        allocated_by: e.manager,
                        top,
                    },
                );
            }
            Data::Free { array, slot, .. } => {
                let top = match self.arrays.remove(array) {
                    Some(live) => live.top,
                    None => self.top(e.manager),
                };
                if slot.is_none() {
                    self.add(e.device, top, -(e.bytes as i64));
                    changes.device = Some(e.device);
                    changes.tops[0] = Some(top);
                }
            }
            Data::Attach { array, .. } => {
                let new_top = self.top(e.manager);
                if let Some(live) = self.arrays.get_mut(array) {
                    let old_top = std::mem::replace(&mut live.top, new_top);
                    if live.slot.is_none() && old_top != new_top {
                        let bytes = live.bytes as i64;
                        *self.top_bytes.entry(old_top).or_default() -= bytes;
                        *self.top_bytes.entry(new_top).or_default() += bytes;
                        changes.tops = [Some(old_top), Some(new_top)];
                    }
                }
            }
            Data::Relocate {
                array,
                address,
                from,
                to,
                ..
            } => {
                let top = match self.arrays.get_mut(array) {
                    Some(live) => {
                        live.address = Some(*address);
                        live.slot = *to;
                        live.top
                    }
                    None => self.top(e.manager),
                };
                let delta = match (from.is_none(), to.is_none()) {
                    (true, false) => -(e.bytes as i64),
                    (false, true) => e.bytes as i64,
                    _ => 0,
                };
                if delta != 0 {
                    self.add(e.device, top, delta);
                    changes.device = Some(e.device);
                    changes.tops[0] = Some(top);
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
                        device: e.device,
                        workspace: Some(Arc::clone(workspace)),
                        top,
                    },
                );
                self.add(e.device, top, e.bytes as i64);
                changes.device = Some(e.device);
                changes.tops[0] = Some(top);
            }
            Data::BlockFree { block } => {
                *self.device_bytes.entry(e.device).or_default() -= e.bytes as i64;
                changes.device = Some(e.device);
                // A block unknown here was allocated before recording and freed with nothing
                // in it: only the device's total knew of it.
                if let Some(b) = self.blocks.remove(block) {
                    *self.top_bytes.entry(b.top).or_default() -= e.bytes as i64;
                    changes.tops[0] = Some(b.top);
                }
            }
            Data::CycleClose { .. }
            | Data::Spill { .. }
            | Data::Capped { .. }
            | Data::OutOfMemory { .. } => {}
        }
        changes
    }

    /// Applies one event, forgetting what it changed.
    pub fn apply(&mut self, e: &MemoryEvent) {
        let mut closed = None;
        self.apply_with(e, &mut closed);
    }

    /// The name of a top-level manager's counter track.
    pub fn top_name(&self, top: u64) -> String {
        match self.tops.get(&top) {
            Some(shared) => shared.describe(),
            None => "detached arrays".to_string(),
        }
    }
}
