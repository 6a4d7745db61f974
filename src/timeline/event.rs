//! What the recorder keeps: one [`MemoryEvent`] per memory event, its [`EventKind`] and its own
//! data. The recorder (the parent module) makes them; the replay and the exporters read them.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::arena::{ArrayShared, ManagerShared};
use crate::error::Site;
use crate::observe::{BlockSpan, NO_MANAGER};
use crate::{ArrayId, Device, ManagerId};

/// What a [`MemoryEvent`] records.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventKind {
    /// An array was created (in a workspace block, or with its own buffer).
    Alloc,
    /// An array was closed (by the user, its manager, its cycle, a circular overwrite, …).
    Free,
    /// An array's bytes were copied to new storage (moved out of or into a workspace).
    Relocate,
    /// An array changed owner (`attach`, `ret`, `temp_attach`, `detach`, a borrow returning).
    Attach,
    /// A manager was created (including the scope of a workspace cycle).
    ManagerOpen,
    /// A manager was closed.
    ManagerClose,
    /// A workspace cycle opened.
    CycleOpen,
    /// A workspace cycle ended.
    CycleClose,
    /// A workspace allocated a block (learned, initialised or grown).
    BlockAlloc,
    /// A workspace block was freed.
    BlockFree,
    /// A workspace allocation did not fit the block and got its own buffer.
    Spill,
    /// A capped manager refused an array (`Error::Capped`).
    Capped,
    /// An allocation was refused (`Error::OutOfMemory`).
    OutOfMemory,
}

/// An event's own data.
#[derive(Clone)]
pub(crate) enum Data {
    Alloc {
        array: Arc<ArrayShared>,
        address: u64,
        span: Option<BlockSpan>,
    },
    Free {
        array: u64,
        site: Site,
        span: Option<BlockSpan>,
    },
    /// Boxed: moves are rare, and every event is as large as the largest kind.
    Relocate(Box<Relocation>),
    Attach {
        array: u64,
        site: Site,
    },
    ManagerOpen {
        manager: Arc<ManagerShared>,
    },
    ManagerClose,
    CycleOpen {
        workspace: Arc<str>,
        cycle: u64,
    },
    CycleClose {
        workspace: Arc<str>,
        cycle: u64,
        spilled_bytes: usize,
        spilled_count: u64,
        capacity: usize,
        /// Replayed as CUDA graphs: what the launches stood for.
        replayed: Option<Arc<str>>,
    },
    BlockAlloc {
        workspace: Arc<str>,
        block: u64,
        address: u64,
    },
    BlockFree {
        block: u64,
    },
    Spill {
        workspace: Arc<str>,
        site: Site,
    },
    Capped {
        site: Site,
        op: &'static str,
        what: Arc<str>,
    },
    OutOfMemory {
        site: Site,
        op: &'static str,
        in_use: usize,
        limit: Option<usize>,
    },
}

/// A copy of an array to new storage.
#[derive(Clone)]
pub(crate) struct Relocation {
    pub array: u64,
    pub site: Site,
    pub address: u64,
    pub from: Option<BlockSpan>,
    pub to: Option<BlockSpan>,
}

/// A device in 4 bytes: 0 for the CPU, `i + 1` for `cuda:i`.
#[inline]
pub(super) fn device_code(device: Device) -> u32 {
    match device {
        Device::Cpu => 0,
        Device::Cuda(ordinal) => u32::try_from(ordinal).map_or(u32::MAX, |o| o.saturating_add(1)),
    }
}

/// One recorded event. Read it with its methods; a [`Recording`](crate::Recording) holds them in time order.
#[derive(Clone)]
pub struct MemoryEvent {
    pub(super) time_ns: u64,
    pub(super) thread: u32,
    pub(super) device: u32,
    pub(super) manager: u64,
    pub(super) bytes: usize,
    pub(super) data: Data,
}

impl MemoryEvent {
    /// When it happened, from the start of the recording.
    pub fn time(&self) -> Duration {
        Duration::from_nanos(self.time_ns)
    }

    /// The thread it happened on: an index into [`Recording::threads`](crate::Recording::threads).
    pub fn thread(&self) -> usize {
        self.thread as usize
    }

    /// What happened.
    pub fn kind(&self) -> EventKind {
        match self.data {
            Data::Alloc { .. } => EventKind::Alloc,
            Data::Free { .. } => EventKind::Free,
            Data::Relocate(_) => EventKind::Relocate,
            Data::Attach { .. } => EventKind::Attach,
            Data::ManagerOpen { .. } => EventKind::ManagerOpen,
            Data::ManagerClose => EventKind::ManagerClose,
            Data::CycleOpen { .. } => EventKind::CycleOpen,
            Data::CycleClose { .. } => EventKind::CycleClose,
            Data::BlockAlloc { .. } => EventKind::BlockAlloc,
            Data::BlockFree { .. } => EventKind::BlockFree,
            Data::Spill { .. } => EventKind::Spill,
            Data::Capped { .. } => EventKind::Capped,
            Data::OutOfMemory { .. } => EventKind::OutOfMemory,
        }
    }

    /// The device whose memory it concerns.
    pub fn device(&self) -> Device {
        match self.device {
            0 => Device::Cpu,
            code => Device::Cuda(code as usize - 1),
        }
    }

    /// The manager involved: the array's owner (after the event, for `Attach`), the manager
    /// opened or closed, the cycle's scope, the workspace's owner for block events, the capped
    /// manager. `None` for a detached array and for out-of-memory refusals.
    pub fn manager(&self) -> Option<ManagerId> {
        (self.manager != NO_MANAGER).then_some(ManagerId(self.manager))
    }

    /// The array involved (allocations, frees, moves).
    pub fn array(&self) -> Option<ArrayId> {
        match &self.data {
            Data::Alloc { array, .. } => Some(ArrayId(array.id)),
            Data::Free { array, .. } | Data::Attach { array, .. } => Some(ArrayId(*array)),
            Data::Relocate(r) => Some(ArrayId(r.array)),
            _ => None,
        }
    }

    /// Bytes: of the array (its data), of the block, of the cycle's demand (`CycleClose`), the
    /// spilled allocation (aligned), or the refused request (`OutOfMemory`); 0 otherwise.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The address of the array's or block's first byte (host or device pointer), where the
    /// event allocates: `Alloc`, `Relocate` (the new storage) and `BlockAlloc`. 0 for an empty
    /// array.
    pub fn address(&self) -> Option<u64> {
        match &self.data {
            Data::Alloc { address, .. } | Data::BlockAlloc { address, .. } => Some(*address),
            Data::Relocate(r) => Some(r.address),
            _ => None,
        }
    }

    /// Where the array involved was created, or where the refused or spilled call was made.
    pub fn site(&self) -> Option<Site> {
        match &self.data {
            Data::Alloc { array, .. } => Some(array.created_at),
            Data::Relocate(r) => Some(r.site),
            Data::Free { site, .. }
            | Data::Attach { site, .. }
            | Data::Spill { site, .. }
            | Data::Capped { site, .. }
            | Data::OutOfMemory { site, .. } => Some(site),
            _ => None,
        }
    }

    /// The workspace involved (cycles, block allocations, spills).
    pub fn workspace(&self) -> Option<&str> {
        match &self.data {
            Data::CycleOpen { workspace, .. }
            | Data::CycleClose { workspace, .. }
            | Data::BlockAlloc { workspace, .. }
            | Data::Spill { workspace, .. } => Some(workspace),
            _ => None,
        }
    }

    /// The workspace cycle's number (`CycleOpen`, `CycleClose`).
    pub fn cycle(&self) -> Option<u64> {
        match &self.data {
            Data::CycleOpen { cycle, .. } | Data::CycleClose { cycle, .. } => Some(*cycle),
            _ => None,
        }
    }

    /// For a `CycleClose` of a cycle replayed as CUDA graphs
    /// ([`WorkspaceConfig::graph_replay`](crate::WorkspaceConfig)): the graph launches and
    /// the calls they stood for, by op (`"1 graph launch for 16 calls: linear ×3, …"`).
    pub fn replayed(&self) -> Option<&str> {
        match &self.data {
            Data::CycleClose { replayed, .. } => replayed.as_deref(),
            _ => None,
        }
    }

    /// Whether the array's bytes are (after the event) in a workspace block.
    pub fn in_workspace(&self) -> bool {
        match &self.data {
            Data::Alloc { span, .. } | Data::Free { span, .. } => span.is_some(),
            Data::Relocate(r) => r.to.is_some(),
            _ => false,
        }
    }
}

impl fmt::Debug for MemoryEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("MemoryEvent");
        d.field("time", &self.time())
            .field("thread", &self.thread)
            .field("kind", &self.kind())
            .field("device", &self.device())
            .field("manager", &self.manager())
            .field("bytes", &self.bytes);
        if let Some(array) = self.array() {
            d.field("array", &array);
        }
        if let Some(workspace) = self.workspace() {
            d.field("workspace", &workspace);
        }
        if let Some(site) = self.site() {
            d.field("site", &format_args!("{site}"));
        }
        d.finish()
    }
}
