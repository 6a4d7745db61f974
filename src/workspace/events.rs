//! What a workspace tells the outside about its cycles: `tracing` events (debug for cycles and
//! blocks, info for learning decisions, warnings for spills past a threshold and blocks that
//! could not be allocated) and the memory events (see `crate::observe`).

use std::sync::atomic::{AtomicUsize, Ordering};

use super::alloc::CycleFigures;
use super::WorkspaceEntry;
use crate::error::{Bytes, Site};
use crate::observe::{self, CycleEnd, Event, NO_MANAGER};
use crate::Result;

/// Bytes a learned cycle may spill before a warning; see [`set_spill_warning_threshold`].
static SPILL_WARNING: AtomicUsize = AtomicUsize::new(0);

/// Sets how many bytes a cycle of a workspace whose block is already learned may spill before
/// ndscope logs a warning (a `tracing` event at level WARN, target `ndscope::workspace`): such a
/// cycle outgrew its block and pays for its own buffers. The default, 0, warns at any spill.
/// A workspace warns again only when a cycle spills more than the most it warned about, so a
/// loop that spills the same every step warns once; the other cycles log at DEBUG. Spills
/// while the block is still being learned are expected and never warn. Process-wide.
///
/// ```
/// use ndscope::workspace::{set_spill_warning_threshold, spill_warning_threshold};
/// set_spill_warning_threshold(1 << 20);     // only spills past 1 MiB a cycle
/// assert_eq!(spill_warning_threshold(), 1 << 20);
/// set_spill_warning_threshold(0);
/// ```
pub fn set_spill_warning_threshold(bytes: usize) {
    SPILL_WARNING.store(bytes, Ordering::Relaxed);
}

/// The threshold set by [`set_spill_warning_threshold`].
pub fn spill_warning_threshold() -> usize {
    SPILL_WARNING.load(Ordering::Relaxed)
}

/// A cycle opened as manager `scope`.
pub(super) fn cycle_opened(ws: &WorkspaceEntry, scope: u64) {
    tracing::debug!(
        target: "ndscope::workspace",
        workspace = &*ws.shared.name,
        cycle = ws.generation,
        "workspace '{}': cycle {} opened",
        ws.shared.name,
        ws.generation
    );
    if observe::on() {
        observe::emit(Event::CycleOpened {
            workspace: &ws.shared.name,
            cycle: ws.generation,
            scope,
            device: ws.device,
        });
    }
}

/// Cycle `cycle` (scope `scope`) ended with `figures` (the block is not yet learned or grown for
/// the next one); the allocator decided whether its spills deserve a warning.
pub(super) fn cycle_ended(ws: &WorkspaceEntry, cycle: u64, scope: u64, figures: CycleFigures) {
    let CycleFigures {
        bytes,
        spilled_bytes,
        spilled_count,
        warn,
    } = figures;
    let capacity = ws.capacity();
    let name = &ws.shared.name;
    if warn {
        tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            cycle,
            spilled_bytes,
            spilled_count,
            capacity,
            "workspace '{name}': cycle {cycle} spilled {} in {spilled_count} allocations past its {} block ({:?} spill policy){}",
            Bytes(spilled_bytes),
            Bytes(capacity),
            ws.config().spill(),
            match ws.config().spill() {
                super::SpillPolicy::Reallocate => "; the block grows at the end of the cycle",
                _ => "; the block never grows under this policy: raise initial_size or use SpillPolicy::Reallocate",
            }
        );
    } else {
        tracing::debug!(
            target: "ndscope::workspace",
            workspace = &**name,
            cycle,
            bytes,
            spilled_bytes,
            "workspace '{name}': cycle {cycle} ended: {} ({} spilled in {spilled_count} allocations)",
            Bytes(bytes),
            Bytes(spilled_bytes)
        );
    }
    if observe::on() {
        let end = CycleEnd {
            cycle,
            scope,
            device: ws.device,
            bytes,
            spilled_bytes,
            spilled_count,
            capacity,
        };
        observe::emit(Event::CycleClosed {
            workspace: name,
            end,
        });
    }
}

/// The block was learned from `demand` bytes (or could not be allocated).
pub(super) fn learned(ws: &WorkspaceEntry, demand: usize, grown: &Result<bool>) {
    let name = &ws.shared.name;
    match grown {
        Ok(_) => tracing::info!(
            target: "ndscope::workspace",
            workspace = &**name,
            demand,
            capacity = ws.capacity(),
            "workspace '{name}': learned its block after {} cycles ({:?}): {} for a cycle of {} ({:?})",
            ws.alloc.cycles(),
            ws.config().learning(),
            Bytes(ws.capacity()),
            Bytes(demand),
            ws.config().allocation()
        ),
        Err(e) => tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            demand,
            "workspace '{name}': could not allocate its learned block, so it keeps spilling: {e}"
        ),
    }
}

/// The block was to grow from `old` bytes for a cycle that outgrew it (`Reallocate`).
pub(super) fn reallocated(ws: &WorkspaceEntry, old: usize, grown: &Result<bool>) {
    let name = &ws.shared.name;
    match grown {
        Ok(true) => tracing::info!(
            target: "ndscope::workspace",
            workspace = &**name,
            old,
            capacity = ws.capacity(),
            "workspace '{name}': block grew from {} to {} for a cycle of {} (Reallocate)",
            Bytes(old),
            Bytes(ws.capacity()),
            Bytes(ws.alloc.max_cycle_bytes())
        ),
        Ok(false) => {}
        Err(e) => tracing::warn!(
            target: "ndscope::workspace",
            workspace = &**name,
            "workspace '{name}': could not grow its {} block, so it keeps spilling: {e}",
            Bytes(old)
        ),
    }
}

/// A new block was allocated (replacing one of `old` bytes, or none when `old` is 0).
pub(super) fn block_allocated(ws: &WorkspaceEntry, old: usize) {
    let Some(block) = &ws.block else {
        return;
    };
    tracing::debug!(
        target: "ndscope::workspace",
        workspace = &*ws.shared.name,
        capacity = block.capacity(),
        old,
        "workspace '{}': block of {} allocated on {}",
        ws.shared.name,
        Bytes(block.capacity()),
        block.memory_device()
    );
    if observe::on() {
        observe::emit(Event::BlockAllocated {
            workspace: &ws.shared.name,
            owner: ws.shared.owner.id,
            block: block.id(),
            address: block.address(),
            device: block.memory_device(),
            capacity: block.capacity(),
        });
    }
}

/// An allocation of `bytes` (aligned) at `site` spilled, in the cycle whose scope is `scope`.
pub(super) fn spilled(ws: &WorkspaceEntry, scope: Option<u64>, bytes: usize, site: Site) {
    crate::memory::spilled(ws.device);
    if observe::on() {
        observe::emit(Event::Spilled {
            workspace: &ws.shared.name,
            scope: scope.unwrap_or(NO_MANAGER),
            device: ws.device,
            bytes,
            site,
        });
    }
}
