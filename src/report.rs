//! Seeing memory: [`ManagerReport`] (structured), [`Growth`] (what leaked between two reports)
//! and the `debug_dump` text.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::panic::Location;
use std::sync::Arc;

use crate::arena::{ArrayEntry, ArrayKey, ArrayList, ManagerKey, Owner, Place};
use crate::error::Bytes;
use crate::manager::{Manager, ManagerId};
use crate::ndarray::ArrayId;
use crate::state::{self, State};
use crate::workspace::WorkspaceStats;
use crate::{DType, Device, Shape};

/// One array in a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArrayReport {
    /// The array's id.
    pub id: ArrayId,
    /// Its name, if set.
    pub name: Option<String>,
    /// Its shape.
    pub shape: Shape,
    /// Its dtype.
    pub dtype: DType,
    /// Its device.
    pub device: Device,
    /// Bytes of data.
    pub bytes: usize,
    /// Where it was created.
    pub created_at: &'static Location<'static>,
    /// For a borrowed array, the manager it goes back to (`None` if that is "detached").
    pub lent_by: Option<ManagerId>,
    /// Whether its bytes live in a workspace block.
    pub in_workspace: bool,
}

/// One workspace in a report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkspaceReport {
    /// The workspace's name.
    pub name: String,
    /// Its figures.
    pub stats: WorkspaceStats,
}

/// A snapshot of a manager's subtree, from [`Manager::report`].
#[derive(Clone, Debug)]
pub struct ManagerReport {
    /// The manager's id.
    pub id: ManagerId,
    /// Its name (or id).
    pub name: String,
    /// Its device.
    pub device: Device,
    /// Whether it is open.
    pub open: bool,
    /// Whether it is capped.
    pub capped: bool,
    /// Arrays it owns (not counting those it borrows).
    pub arrays: Vec<ArrayReport>,
    /// Arrays it borrows (they go back to their lender when it closes).
    pub borrowed: Vec<ArrayReport>,
    /// System manager only: arrays owned by nobody (detached), so they cannot hide.
    pub detached: Vec<ArrayReport>,
    /// Workspaces it owns.
    pub workspaces: Vec<WorkspaceReport>,
    /// Its open children, newest first.
    pub children: Vec<ManagerReport>,
}

impl Manager {
    /// A structured snapshot of this manager's subtree: arrays, borrowed arrays, workspaces,
    /// children. See [`ManagerReport`].
    pub fn report(&self) -> ManagerReport {
        build(self)
    }

    /// The subtree as indented text, one line per manager; `level >= 1` adds one line per array
    /// with its creation site, largest first. It ends with one line per device in use (the CPU
    /// always), starting `memory on <device>:`, with its [`crate::memory_usage`] figures: bytes
    /// and arrays in use, peak, limit, and the counters (allocations, frees, spills,
    /// reallocations, out-of-memory refusals, driver allocations).
    pub fn debug_dump(&self, level: usize) -> String {
        let report = self.report();
        let mut text = report.dump(level);
        push_memory_lines(&mut text, &report);
        text
    }
}

/// The report of `manager`'s subtree.
fn build(manager: &Manager) -> ManagerReport {
    let state = state::lock();
    if state.live_manager(&manager.0).is_none() {
        return ManagerReport {
            id: manager.id(),
            name: manager.name(),
            device: manager.device(),
            open: false,
            capped: false,
            arrays: Vec::new(),
            borrowed: Vec::new(),
            detached: Vec::new(),
            workspaces: Vec::new(),
            children: Vec::new(),
        };
    }
    build_node(&state, manager.0.key)
}

fn array_report(entry: &ArrayEntry) -> ArrayReport {
    let array = &entry.shared;
    ArrayReport {
        id: ArrayId(array.id),
        name: array.name.lock().as_deref().map(str::to_string),
        shape: array.shape.clone(),
        dtype: array.dtype,
        device: array.device,
        bytes: array.nbytes(),
        created_at: array.created_at,
        lent_by: entry.returns.last().and_then(|l| match l.owner {
            Owner::Manager(_) => l.shared.as_ref().map(|s| ManagerId(s.id)),
            Owner::Detached => None,
        }),
        in_workspace: matches!(entry.place, Place::Block { .. }),
    }
}

fn list_reports(state: &State, list: &ArrayList) -> (Vec<ArrayReport>, Vec<ArrayReport>) {
    let mut owned = Vec::with_capacity(list.len);
    let mut borrowed = Vec::new();
    let mut next: Option<ArrayKey> = list.head;
    while let Some(key) = next {
        let entry = state.array_entry(key);
        if entry.is_borrowed() {
            borrowed.push(array_report(entry));
        } else {
            owned.push(array_report(entry));
        }
        next = entry.next;
    }
    (owned, borrowed)
}

fn build_node(state: &State, key: ManagerKey) -> ManagerReport {
    let entry = state.manager_entry(key);
    let (arrays, borrowed) = list_reports(state, &entry.arrays);
    let detached = if key == state.system().key {
        list_reports(state, state.detached()).0
    } else {
        Vec::new()
    };
    ManagerReport {
        id: ManagerId(entry.shared.id),
        name: Manager(Arc::clone(&entry.shared)).name(),
        device: entry.shared.device,
        open: true,
        capped: entry.capped,
        arrays,
        borrowed,
        detached,
        workspaces: state
            .workspace_stats_of(key)
            .into_iter()
            .map(|(name, stats)| WorkspaceReport { name, stats })
            .collect(),
        children: state
            .children_of(key)
            .into_iter()
            .map(|child| build_node(state, child))
            .collect(),
    }
}

impl ManagerReport {
    /// Arrays held in the whole subtree: owned and borrowed ones, each counted once, with the
    /// manager holding it now (a borrowed array with its borrower, as [`NDArray::manager`]
    /// answers); detached ones under the system manager.
    ///
    /// [`NDArray::manager`]: crate::NDArray::manager
    pub fn total_arrays(&self) -> usize {
        self.arrays.len()
            + self.borrowed.len()
            + self.detached.len()
            + self
                .children
                .iter()
                .map(ManagerReport::total_arrays)
                .sum::<usize>()
    }

    /// Bytes of the arrays counted by [`total_arrays`](Self::total_arrays).
    pub fn total_bytes(&self) -> usize {
        self.arrays.iter().map(|a| a.bytes).sum::<usize>()
            + self.borrowed.iter().map(|a| a.bytes).sum::<usize>()
            + self.detached.iter().map(|a| a.bytes).sum::<usize>()
            + self
                .children
                .iter()
                .map(ManagerReport::total_bytes)
                .sum::<usize>()
    }

    /// This manager's report, or a descendant's, by id.
    pub fn find(&self, id: ManagerId) -> Option<&ManagerReport> {
        if self.id == id {
            return Some(self);
        }
        self.children.iter().find_map(|c| c.find(id))
    }

    fn visit<'a>(&'a self, f: &mut impl FnMut(&'a ManagerReport)) {
        f(self);
        for child in &self.children {
            child.visit(f);
        }
    }

    /// What grew since `earlier`: per manager, every creation site whose live array count or
    /// bytes increased, and every manager that did not exist then. Empty when nothing leaked.
    pub fn diff(&self, earlier: &ManagerReport) -> Growth {
        type Sites = BTreeMap<(String, u32, u32), (&'static Location<'static>, usize, usize)>;
        fn sites(report: &ManagerReport) -> Sites {
            let mut map = Sites::new();
            for a in report
                .arrays
                .iter()
                .chain(&report.borrowed)
                .chain(&report.detached)
            {
                let key = (
                    a.created_at.file().to_string(),
                    a.created_at.line(),
                    a.created_at.column(),
                );
                let e = map.entry(key).or_insert((a.created_at, 0, 0));
                e.1 += 1;
                e.2 += a.bytes;
            }
            map
        }
        let mut before: BTreeMap<ManagerId, &ManagerReport> = BTreeMap::new();
        earlier.visit(&mut |r| {
            before.insert(r.id, r);
        });
        let mut growth = Growth::default();
        self.visit(&mut |now| {
            let old = before.get(&now.id);
            if old.is_none() {
                growth.new_managers.push((now.id, now.name.clone()));
            }
            let old_sites = old.map(|r| sites(r)).unwrap_or_default();
            for (key, (site, count, bytes)) in sites(now) {
                let (count_before, bytes_before) =
                    old_sites.get(&key).map_or((0, 0), |&(_, c, b)| (c, b));
                if count > count_before || bytes > bytes_before {
                    growth.sites.push(SiteGrowth {
                        manager: now.id,
                        manager_name: now.name.clone(),
                        site,
                        count_before,
                        count_after: count,
                        bytes_before,
                        bytes_after: bytes,
                    });
                }
            }
        });
        growth
    }

    /// The report as indented text (what `Manager::debug_dump` returns, without its closing
    /// lines of device memory figures).
    pub fn dump(&self, level: usize) -> String {
        // About 70 bytes a line: reserving up front saves copying the text as it grows.
        let mut lines = 0;
        self.visit(&mut |r| {
            lines += 1 + if level >= 1 {
                r.arrays.len() + r.borrowed.len() + r.detached.len()
            } else {
                0
            };
        });
        let mut out = String::with_capacity(lines * 72);
        self.dump_into(&mut out, 0, level);
        out
    }

    fn dump_into(&self, out: &mut String, depth: usize, level: usize) {
        let indent = "  ".repeat(depth);
        let owned: usize = self.arrays.iter().map(|a| a.bytes).sum();
        let _ = write!(
            out,
            "{indent}{} ({}) {}: {} arrays ({})",
            self.name,
            self.id,
            self.device,
            self.arrays.len(),
            Bytes(owned)
        );
        if !self.borrowed.is_empty() {
            let bytes: usize = self.borrowed.iter().map(|a| a.bytes).sum();
            let _ = write!(out, ", {} borrowed ({})", self.borrowed.len(), Bytes(bytes));
        }
        if !self.detached.is_empty() {
            let bytes: usize = self.detached.iter().map(|a| a.bytes).sum();
            let _ = write!(out, ", {} detached ({})", self.detached.len(), Bytes(bytes));
        }
        if self.capped {
            out.push_str(", capped");
        }
        if !self.open {
            out.push_str(", closed");
        }
        for ws in &self.workspaces {
            let s = &ws.stats;
            let _ = write!(
                out,
                ", workspace '{}' [capacity {}, used {}, cycles {}, spilled {} in {}, reallocations {}]",
                ws.name,
                Bytes(s.capacity),
                Bytes(s.used),
                s.cycles,
                Bytes(s.spilled_bytes),
                s.spilled_count,
                s.reallocations
            );
            let g = &s.graph;
            if g.state != crate::workspace::GraphState::Off {
                let _ = write!(
                    out,
                    " graph replay [{}, {} calls in {} graph(s), {} captures, {} replays, {} fallbacks, {} arguments updated",
                    g.state, g.calls, g.graphs, g.captures, g.replays, g.fallbacks, g.updated_arguments
                );
                if let Some(why) = &g.last_fallback {
                    let _ = write!(out, ", last fallback: {why}");
                }
                out.push(']');
            }
        }
        out.push('\n');
        if level >= 1 {
            // The sort keys sit in the vector itself, so sorting 100k lines chases no pointers.
            let mut lines: Vec<(std::cmp::Reverse<usize>, ArrayId, &ArrayReport, &str)> = self
                .arrays
                .iter()
                .map(|a| (a, ""))
                .chain(self.borrowed.iter().map(|a| (a, "borrowed")))
                .chain(self.detached.iter().map(|a| (a, "detached")))
                .map(|(a, tag)| (std::cmp::Reverse(a.bytes), a.id, a, tag))
                .collect();
            lines.sort_unstable_by_key(|&(bytes, id, _, _)| (bytes, id));
            for (_, _, a, tag) in lines {
                let _ = write!(out, "{indent}  - {}", a.id);
                if let Some(name) = &a.name {
                    let _ = write!(out, " '{name}'");
                }
                let _ = write!(out, " {} {} {}", a.dtype, a.shape, Bytes(a.bytes));
                // An array's device is its own (a CPU manager may hold CUDA arrays): named when
                // it is not the manager's.
                if a.device != self.device {
                    let _ = write!(out, " on {}", a.device);
                }
                if !tag.is_empty() {
                    let _ = write!(out, " {tag}");
                }
                if let Some(lender) = a.lent_by {
                    let _ = write!(out, " from {lender}");
                }
                if a.in_workspace {
                    out.push_str(" [workspace]");
                }
                let _ = writeln!(out, " at {}", a.created_at);
            }
        }
        for child in &self.children {
            child.dump_into(out, depth + 1, level);
        }
    }
}

/// Appends one line per device the report's managers or arrays use (the CPU always) with its
/// [`crate::memory_usage`] figures, as `debug_dump` ends.
fn push_memory_lines(out: &mut String, report: &ManagerReport) {
    let mut devices = vec![Device::Cpu];
    report.visit(&mut |r| {
        devices.push(r.device);
        devices.extend(
            r.arrays
                .iter()
                .chain(&r.borrowed)
                .chain(&r.detached)
                .map(|a| a.device),
        );
    });
    devices.sort();
    devices.dedup();
    for device in devices {
        let u = crate::memory_usage(device);
        let limit = u
            .limit
            .map_or_else(|| "no limit".to_string(), |l| format!("limit {}", Bytes(l)));
        let _ = writeln!(
            out,
            "memory on {device}: {} in use by {} arrays (peak {}, {limit}); {} allocations ({}), \
             {} frees ({}), {} spills, {} reallocations, {} out-of-memory, {} driver allocations",
            Bytes(u.in_use),
            u.arrays,
            Bytes(u.peak),
            u.allocations,
            Bytes(u.allocated_bytes as usize),
            u.frees,
            Bytes(u.freed_bytes as usize),
            u.spills,
            u.reallocations,
            u.ooms,
            u.driver_allocations
        );
    }
}

/// Live arrays that grew at one creation site of one manager.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SiteGrowth {
    /// The manager holding them.
    pub manager: ManagerId,
    /// Its name.
    pub manager_name: String,
    /// Where the arrays were created.
    pub site: &'static Location<'static>,
    /// Live arrays from this site before.
    pub count_before: usize,
    /// Live arrays from this site after.
    pub count_after: usize,
    /// Their bytes before.
    pub bytes_before: usize,
    /// Their bytes after.
    pub bytes_after: usize,
}

/// What grew between two reports ([`ManagerReport::diff`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Growth {
    /// Creation sites whose live count or bytes grew, per manager.
    pub sites: Vec<SiteGrowth>,
    /// Managers present now that were not before.
    pub new_managers: Vec<(ManagerId, String)>,
}

impl Growth {
    /// `true` when nothing grew.
    pub fn is_empty(&self) -> bool {
        self.sites.is_empty() && self.new_managers.is_empty()
    }
}

impl fmt::Display for Growth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no growth");
        }
        for s in &self.sites {
            writeln!(
                f,
                "{}: manager '{}' ({}) holds {} live arrays created there ({}), was {} ({})",
                s.site,
                s.manager_name,
                s.manager,
                s.count_after,
                Bytes(s.bytes_after),
                s.count_before,
                Bytes(s.bytes_before)
            )?;
        }
        for (id, name) in &self.new_managers {
            writeln!(f, "new manager '{name}' ({id}) still open")?;
        }
        Ok(())
    }
}
