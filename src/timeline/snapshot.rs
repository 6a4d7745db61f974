//! The PyTorch memory snapshot: the dictionary `torch.cuda.memory._snapshot()` returns, which
//! PyTorch's memory viewer (`MemoryViz.js`, behind `memory_viz` and
//! `torch.cuda._memory_viz`) reads.
//!
//! ```text
//! {'segments': [{'device', 'address', 'total_size', 'allocated_size', 'active_size',
//!                'requested_size', 'stream', 'segment_type', 'segment_pool_id',
//!                'is_expandable', 'frames', 'blocks': [{'address', 'size', 'requested_size',
//!                                                        'state', 'frames'}]}],
//!  'device_traces': [[{'action', 'addr', 'size', 'stream', 'time_us', 'frames',
//!                      'category'?, 'device_free'?}]],
//!  'allocator_settings': {}, 'ndscope': {...}}
//! ```
//!
//! A workspace block is a segment whose blocks are the arrays in it (the gaps between them
//! `inactive`); an array with its own buffer (outside workspaces, or spilled) is a segment of
//! one block. The trace has `segment_alloc`/`alloc` for an allocation,
//! `free_requested`/`free_completed`/`segment_free` for a free (the viewer merges the first two
//! into one `free`), `oom` for a refusal, and ends with a `snapshot` entry. Each allocation's
//! category is the name of the manager that allocated it or of its nearest named ancestor
//! below the system manager (a workspace cycle's scope, `batch#57`, counts as `batch`), or
//! `unknown`. The viewer builds its category list
//! from the trace and, when there is one, needs `unknown` in it (it fails otherwise): the
//! closing `snapshot` entry carries it. Device index 0 is the CPU; `i + 1` is `cuda:i`.

use std::collections::HashMap;
use std::io::{self, Write};
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use super::event::Data;
use super::pickle::Pickler;
use super::recording::Recording;
use super::replay::{LiveArray, OpenManager, Replay};
use crate::arena::ArrayShared;
use crate::error::Site;
use crate::observe::BlockSpan;
use crate::Device;

/// The viewer's device index of a device.
fn device_index(device: Device) -> usize {
    match device {
        Device::Cpu => 0,
        Device::Cuda(ordinal) => ordinal + 1,
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Action {
    Alloc,
    FreeRequested,
    FreeCompleted,
    SegmentAlloc,
    SegmentFree,
    Oom,
    Snapshot,
}

impl Action {
    const ALL: [Action; 7] = [
        Action::Alloc,
        Action::FreeRequested,
        Action::FreeCompleted,
        Action::SegmentAlloc,
        Action::SegmentFree,
        Action::Oom,
        Action::Snapshot,
    ];

    fn name(self) -> &'static str {
        match self {
            Action::Alloc => "alloc",
            Action::FreeRequested => "free_requested",
            Action::FreeCompleted => "free_completed",
            Action::SegmentAlloc => "segment_alloc",
            Action::SegmentFree => "segment_free",
            Action::Oom => "oom",
            Action::Snapshot => "snapshot",
        }
    }
}

const NONE: u32 = u32::MAX;

/// One trace entry, before it is written.
struct Entry {
    action: Action,
    addr: u64,
    size: u64,
    time_us: i64,
    /// Index into `Builder::frames`, or `NONE` for an empty list.
    frames: u32,
    /// Index into `Builder::categories`, or `NONE`.
    category: u32,
    /// For `oom`: bytes the device had free under its limit.
    device_free: Option<u64>,
}

/// A frame list: one frame, the creation site, named after the array.
struct Frame {
    file: &'static str,
    line: u32,
    name: String,
}

/// What makes two frame lists the same: site, array name, dtype and shape.
type FrameKey = (usize, Option<Arc<str>>, u8, crate::Shape);

#[derive(Default)]
struct Builder {
    traces: Vec<Vec<Entry>>,
    frames: Vec<Frame>,
    frame_ids: HashMap<FrameKey, u32>,
    site_ids: HashMap<usize, u32>,
    categories: Vec<String>,
    category_ids: HashMap<String, u32>,
    /// Category per manager id, found once.
    manager_categories: HashMap<u64, u32>,
}

impl Builder {
    fn push(&mut self, device: Device, entry: Entry) {
        let index = device_index(device);
        if self.traces.len() <= index {
            self.traces.resize_with(index + 1, Vec::new);
        }
        self.traces[index].push(entry);
    }

    fn category(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.category_ids.get(name) {
            return id;
        }
        let id = self.categories.len() as u32;
        self.categories.push(name.to_string());
        self.category_ids.insert(name.to_string(), id);
        id
    }

    /// The category of allocations by manager `id`: the nearest manager up its tree with a
    /// name, a cycle's `#N` left out; `unknown` without one.
    fn manager_category(&mut self, replay: &Replay, id: u64) -> u32 {
        if let Some(&c) = self.manager_categories.get(&id) {
            return c;
        }
        let name = replay
            .managers
            .get(&id)
            .and_then(|open: &OpenManager| category_name(&open.shared));
        let c = self.category(name.as_deref().unwrap_or("unknown"));
        self.manager_categories.insert(id, c);
        c
    }

    /// The frame list of an array: its creation site, named after its name, dtype and shape.
    fn array_frames(&mut self, array: Option<&Arc<ArrayShared>>, site: Site) -> u32 {
        match array {
            Some(array) => {
                let name = array.name.lock().clone();
                let key = (
                    site as *const _ as usize,
                    name.clone(),
                    array.dtype as u8,
                    array.shape.clone(),
                );
                if let Some(&id) = self.frame_ids.get(&key) {
                    return id;
                }
                let label = match &name {
                    Some(name) => format!("'{name}' {} {}", array.dtype, array.shape),
                    None => format!("{} {}", array.dtype, array.shape),
                };
                let id = self.add_frame(site, label);
                self.frame_ids.insert(key, id);
                id
            }
            None => self.site_frames(site),
        }
    }

    /// The frame list of a bare site.
    fn site_frames(&mut self, site: Site) -> u32 {
        let key = site as *const _ as usize;
        if let Some(&id) = self.site_ids.get(&key) {
            return id;
        }
        let id = self.add_frame(site, String::new());
        self.site_ids.insert(key, id);
        id
    }

    /// A frame list naming something that has no source location (a workspace block).
    fn named_frame(&mut self, what: &str) -> u32 {
        self.frames.push(Frame {
            file: "",
            line: 0,
            name: what.to_string(),
        });
        (self.frames.len() - 1) as u32
    }

    fn add_frame(&mut self, site: Site, name: String) -> u32 {
        self.frames.push(Frame {
            file: site.file(),
            line: site.line(),
            name,
        });
        (self.frames.len() - 1) as u32
    }
}

/// The category name for a manager: its own name or its nearest named ancestor's below the
/// system manager, without a cycle's `#N`.
fn category_name(shared: &Arc<crate::arena::ManagerShared>) -> Option<String> {
    let mut current = Some(shared);
    while let Some(m) = current {
        if m.parent.is_none() && !Arc::ptr_eq(m, shared) {
            break;
        }
        if let Some(name) = m.name.lock().as_deref() {
            let base = match name.rsplit_once('#') {
                Some((base, n)) if !base.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                    base
                }
                _ => name,
            };
            return Some(base.to_string());
        }
        current = m.parent.as_ref();
    }
    None
}

/// Writes the snapshot of `rec`.
pub(super) fn write(rec: &Recording, out: &mut dyn Write) -> io::Result<()> {
    let start_us = rec
        .started_wall
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as i64);
    let time_us = |ns: u64| start_us + (ns / 1000) as i64;
    let mut b = Builder::default();
    let mut replay = rec.base.clone();
    let mut closed = None;
    for e in &rec.events {
        let t = time_us(e.time_ns);
        match &e.data {
            Data::Alloc {
                array,
                address,
                span,
            } if e.bytes > 0 => {
                let frames = b.array_frames(Some(array), array.created_at);
                let category = b.manager_category(&replay, e.manager);
                let at = ArrayBytes {
                    device: e.device(),
                    address: *address,
                    bytes: e.bytes,
                    span,
                    time_us: t,
                    frames,
                };
                alloc_entries(&mut b, &at, category);
            }
            Data::Free { array, site, span } => {
                if let Some(live) = replay.arrays.get(array) {
                    if let (Some(address), true) = (live.address, e.bytes > 0) {
                        let frames = b.array_frames(Some(&live.shared), site);
                        let at = ArrayBytes {
                            device: e.device(),
                            address,
                            bytes: e.bytes,
                            span,
                            time_us: t,
                            frames,
                        };
                        free_entries(&mut b, &at);
                    }
                }
            }
            Data::Relocate(r) => {
                if let (Some(live), true) = (replay.arrays.get(&r.array), e.bytes > 0) {
                    let frames = b.array_frames(Some(&live.shared), r.site);
                    let category = b.manager_category(&replay, live.allocated_by);
                    let to = ArrayBytes {
                        device: e.device(),
                        address: r.address,
                        bytes: e.bytes,
                        span: &r.to,
                        time_us: t,
                        frames,
                    };
                    alloc_entries(&mut b, &to, category);
                    if let Some(old) = live.address {
                        let from = ArrayBytes {
                            address: old,
                            span: &r.from,
                            ..to
                        };
                        free_entries(&mut b, &from);
                    }
                }
            }
            Data::BlockAlloc { address, .. } => {
                let category = b.manager_category(&replay, e.manager);
                b.push(
                    e.device(),
                    Entry {
                        action: Action::SegmentAlloc,
                        addr: *address,
                        size: e.bytes as u64,
                        time_us: t,
                        frames: NONE,
                        category,
                        device_free: None,
                    },
                );
            }
            Data::BlockFree { block } => {
                if let Some(block) = replay.blocks.get(block) {
                    b.push(
                        e.device(),
                        Entry {
                            action: Action::SegmentFree,
                            addr: block.address,
                            size: block.capacity as u64,
                            time_us: t,
                            frames: NONE,
                            category: NONE,
                            device_free: None,
                        },
                    );
                }
            }
            Data::OutOfMemory {
                site,
                in_use,
                limit,
                ..
            } => {
                let frames = b.site_frames(site);
                b.push(
                    e.device(),
                    Entry {
                        action: Action::Oom,
                        addr: 0,
                        size: e.bytes as u64,
                        time_us: t,
                        frames,
                        category: NONE,
                        device_free: Some(limit.map_or(0, |l| l.saturating_sub(*in_use)) as u64),
                    },
                );
            }
            _ => {}
        }
        replay.apply_with(e, &mut closed);
    }
    // The closing `snapshot` entry, which also puts `unknown` in the viewer's category list.
    let unknown = b.category("unknown");
    let end = time_us(rec.duration_ns);
    let devices: Vec<usize> = (0..b.traces.len().max(1)).collect();
    for index in devices {
        let device = if index == 0 {
            Device::Cpu
        } else {
            Device::Cuda(index - 1)
        };
        let has = b.traces.get(index).is_some_and(|t| !t.is_empty());
        if has || index == 0 {
            b.push(
                device,
                Entry {
                    action: Action::Snapshot,
                    addr: 0,
                    size: 0,
                    time_us: end,
                    frames: NONE,
                    category: unknown,
                    device_free: None,
                },
            );
        }
    }
    let segments = segments(&mut b, &replay);
    emit(rec, &b, &segments, out)
}

/// An array's bytes as the trace entries of one allocation or free show them.
struct ArrayBytes<'a> {
    device: Device,
    address: u64,
    bytes: usize,
    /// Where in a workspace block the bytes are; `None` for an array with its own buffer (a
    /// segment of its own).
    span: &'a Option<BlockSpan>,
    time_us: i64,
    frames: u32,
}

impl ArrayBytes<'_> {
    fn entry(&self, action: Action, category: u32) -> Entry {
        Entry {
            action,
            addr: self.address,
            size: self.bytes as u64,
            time_us: self.time_us,
            frames: self.frames,
            category,
            device_free: None,
        }
    }
}

fn alloc_entries(b: &mut Builder, at: &ArrayBytes<'_>, category: u32) {
    if at.span.is_none() {
        b.push(at.device, at.entry(Action::SegmentAlloc, category));
    }
    b.push(at.device, at.entry(Action::Alloc, category));
}

fn free_entries(b: &mut Builder, at: &ArrayBytes<'_>) {
    b.push(at.device, at.entry(Action::FreeRequested, NONE));
    b.push(at.device, at.entry(Action::FreeCompleted, NONE));
    if at.span.is_none() {
        b.push(at.device, at.entry(Action::SegmentFree, NONE));
    }
}

struct Segment {
    device: usize,
    address: u64,
    total: u64,
    /// Bytes of the arrays in it.
    requested: u64,
    /// Bytes of its allocated blocks (aligned).
    allocated: u64,
    /// Its frame list: the workspace's name, or the array's creation site.
    frames: u32,
    blocks: Vec<SegmentBlock>,
}

struct SegmentBlock {
    address: u64,
    size: u64,
    requested: u64,
    active: bool,
    frames: u32,
}

/// The segments at the end: each workspace block with its arrays, and each array with its own
/// buffer.
fn segments(b: &mut Builder, replay: &Replay) -> Vec<Segment> {
    let mut in_blocks: HashMap<u64, Vec<&LiveArray>> = HashMap::new();
    let mut out = Vec::new();
    let mut arrays: Vec<&LiveArray> = replay.arrays.values().collect();
    arrays.sort_by_key(|a| (a.address, a.shared.id));
    for live in arrays {
        let Some(address) = live.address else {
            continue;
        };
        match live.span {
            Some(span) if replay.blocks.contains_key(&span.block) => {
                in_blocks.entry(span.block).or_default().push(live);
            }
            _ if live.bytes() > 0 => {
                let frames = b.array_frames(Some(&live.shared), live.site());
                let size = live.span.map_or(live.bytes(), |s| s.len) as u64;
                out.push(Segment {
                    device: device_index(live.device()),
                    address,
                    total: size,
                    requested: live.bytes() as u64,
                    allocated: size,
                    frames,
                    blocks: vec![SegmentBlock {
                        address,
                        size,
                        requested: live.bytes() as u64,
                        active: true,
                        frames,
                    }],
                });
            }
            _ => {}
        }
    }
    let mut blocks: Vec<(&u64, &super::replay::LiveBlock)> = replay.blocks.iter().collect();
    blocks.sort_by_key(|(_, block)| block.address);
    for (id, block) in blocks {
        let mut arrays = in_blocks.remove(id).unwrap_or_default();
        arrays.sort_by_key(|a| a.span.map_or(0, |s| s.offset));
        let mut segment = Segment {
            device: device_index(block.device),
            address: block.address,
            total: block.capacity as u64,
            requested: 0,
            allocated: 0,
            frames: match &block.workspace {
                Some(name) => b.named_frame(&format!("workspace '{name}'")),
                None => NONE,
            },
            blocks: Vec::new(),
        };
        // The blocks tile the segment: arrays in offset order, the gaps between them inactive.
        let mut at = 0u64;
        for live in arrays {
            let Some(span) = live.span else { continue };
            let (offset, len) = (span.offset as u64, span.len as u64);
            if offset < at || offset + len > segment.total {
                continue;
            }
            if offset > at {
                segment.blocks.push(SegmentBlock {
                    address: block.address + at,
                    size: offset - at,
                    requested: 0,
                    active: false,
                    frames: NONE,
                });
            }
            let frames = b.array_frames(Some(&live.shared), live.site());
            segment.blocks.push(SegmentBlock {
                address: block.address + offset,
                size: len,
                requested: live.bytes() as u64,
                active: true,
                frames,
            });
            segment.requested += live.bytes() as u64;
            segment.allocated += len;
            at = offset + len;
        }
        if at < segment.total {
            segment.blocks.push(SegmentBlock {
                address: block.address + at,
                size: segment.total - at,
                requested: 0,
                active: false,
                frames: NONE,
            });
        }
        out.push(segment);
    }
    out
}

/// The strings every entry repeats, each written once and memoized at its first use.
#[derive(Clone, Copy)]
enum DictKey {
    Action,
    Addr,
    Size,
    Stream,
    TimeUs,
    Frames,
    Category,
    DeviceFree,
    Filename,
    Line,
    Name,
}

const KEYS: [&str; 11] = [
    "action",
    "addr",
    "size",
    "stream",
    "time_us",
    "frames",
    "category",
    "device_free",
    "filename",
    "line",
    "name",
];

/// Memo indices of the keys and action names written so far.
#[derive(Default)]
struct Memo {
    keys: [Option<u32>; KEYS.len()],
    actions: [Option<u32>; Action::ALL.len()],
}

impl Memo {
    fn key(&mut self, p: &mut Pickler<'_>, key: DictKey) {
        let memo = &mut self.keys[key as usize];
        match *memo {
            Some(m) => p.get(m),
            None => *memo = Some(p.str_memo(KEYS[key as usize])),
        }
    }

    fn action(&mut self, p: &mut Pickler<'_>, action: Action) {
        let memo = &mut self.actions[action as usize];
        match *memo {
            Some(m) => p.get(m),
            None => *memo = Some(p.str_memo(action.name())),
        }
    }
}

fn emit(rec: &Recording, b: &Builder, segments: &[Segment], out: &mut dyn Write) -> io::Result<()> {
    let mut p = Pickler::new(out);
    let mut memo = Memo::default();
    p.empty_dict();
    p.mark();
    p.str("ndscope");
    p.empty_dict();
    p.mark();
    p.str("producer");
    p.str(concat!("ndscope ", env!("CARGO_PKG_VERSION")));
    p.str("dropped_events");
    p.uint(rec.dropped);
    p.str("max_entries");
    p.uint(rec.max_entries as u64);
    p.str("events");
    p.uint(rec.events.len() as u64);
    p.str("devices");
    let names: Vec<String> = (0..b.traces.len().max(1))
        .map(|i| match i {
            0 => "cpu".to_string(),
            i => format!("cuda:{}", i - 1),
        })
        .collect();
    p.list(&names, |p, name| {
        p.str(name);
        Ok(())
    })?;
    p.setitems();

    let mut frame_memo: Vec<Option<u32>> = vec![None; b.frames.len()];
    let mut category_memo: Vec<Option<u32>> = vec![None; b.categories.len()];
    let mut frames_of = |p: &mut Pickler<'_>, memo: &mut Memo, id: u32| {
        if id == NONE {
            p.empty_list();
            return;
        }
        let id = id as usize;
        if let Some(Some(m)) = frame_memo.get(id) {
            p.get(*m);
            return;
        }
        let f = &b.frames[id];
        p.empty_list();
        p.mark();
        p.empty_dict();
        p.mark();
        memo.key(p, DictKey::Filename);
        p.str(f.file);
        memo.key(p, DictKey::Line);
        p.int(f.line as i64);
        memo.key(p, DictKey::Name);
        p.str(&f.name);
        p.setitems();
        p.appends();
        let m = p.memoize();
        frame_memo[id] = Some(m);
    };

    p.str("device_traces");
    p.empty_list();
    p.mark();
    for trace in &b.traces {
        p.list(trace, |p, e| {
            p.empty_dict();
            p.mark();
            memo.key(p, DictKey::Action);
            memo.action(p, e.action);
            memo.key(p, DictKey::Addr);
            p.uint(e.addr);
            memo.key(p, DictKey::Size);
            p.uint(e.size);
            memo.key(p, DictKey::Stream);
            p.int(0);
            memo.key(p, DictKey::TimeUs);
            p.int(e.time_us);
            memo.key(p, DictKey::Frames);
            frames_of(p, &mut memo, e.frames);
            if e.category != NONE {
                memo.key(p, DictKey::Category);
                let c = e.category as usize;
                match category_memo[c] {
                    Some(m) => p.get(m),
                    None => category_memo[c] = Some(p.str_memo(&b.categories[c])),
                }
            }
            if let Some(free) = e.device_free {
                memo.key(p, DictKey::DeviceFree);
                p.uint(free);
            }
            p.setitems();
            Ok(())
        })?;
    }
    p.appends();

    p.str("segments");
    p.list(segments, |p, s| {
        p.empty_dict();
        p.mark();
        p.str("device");
        p.int(s.device as i64);
        p.str("address");
        p.uint(s.address);
        p.str("total_size");
        p.uint(s.total);
        p.str("allocated_size");
        p.uint(s.allocated);
        p.str("active_size");
        p.uint(s.allocated);
        p.str("requested_size");
        p.uint(s.requested);
        memo.key(p, DictKey::Stream);
        p.int(0);
        p.str("segment_type");
        p.str(if s.total < (1 << 20) {
            "small"
        } else {
            "large"
        });
        p.str("segment_pool_id");
        p.int(0);
        p.int(0);
        p.tuple2();
        p.str("is_expandable");
        p.bool(false);
        memo.key(p, DictKey::Frames);
        frames_of(p, &mut memo, s.frames);
        p.str("blocks");
        p.list(&s.blocks, |p, blk| {
            p.empty_dict();
            p.mark();
            p.str("address");
            p.uint(blk.address);
            memo.key(p, DictKey::Size);
            p.uint(blk.size);
            p.str("requested_size");
            p.uint(blk.requested);
            p.str("state");
            p.str(if blk.active {
                "active_allocated"
            } else {
                "inactive"
            });
            memo.key(p, DictKey::Frames);
            frames_of(p, &mut memo, blk.frames);
            p.setitems();
            Ok(())
        })?;
        p.setitems();
        Ok(())
    })?;

    p.str("allocator_settings");
    p.empty_dict();
    p.setitems();
    p.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_map_cpu_first_then_cuda_ordinals() {
        assert_eq!(device_index(Device::Cpu), 0);
        assert_eq!(device_index(Device::Cuda(0)), 1);
        assert_eq!(device_index(Device::Cuda(3)), 4);
    }
}
