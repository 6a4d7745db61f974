//! The device memory of the NCCL communicators (`nccl.rs`), counted in
//! `memory_usage(dev).cached` while they live and given back when they are destroyed or aborted.
//!
//! NCCL before 2.29 has no call that says how much device memory a communicator holds (its
//! channel buffers, work FIFOs, the connections' buffers; 2.29 brought `ncclCommMemStats`), so
//! it is measured: the device's used memory as the driver reports it (`cuMemGetInfo`) just
//! before and just after NCCL sets something up, minus what ndscope's own memory grew by
//! meanwhile (`in_use` and `cached` of `memory_usage(dev)` without the communicators' term:
//! another thread of this process may allocate on the device at the same time), never below 0.
//! NCCL sets up at two moments:
//!
//! - `ncclCommInitRank` (the communicator, its channels and, before NCCL 2.22 or with
//!   `NCCL_RUNTIME_CONNECT=0`, every connection);
//! - the first collective that needs a connection not made yet (`NCCL_RUNTIME_CONNECT=1`, the
//!   default since 2.22: a ring, a tree or NVLS is connected in `ncclGroupEnd` by the first
//!   group that uses it, on the host, before the group returns).
//!
//! So the first group of a communicator is measured, and every later one that moves more bytes
//! than any measured before (a larger all-reduce may pick another algorithm, whose connections
//! are made then). Steady-state steps repeat their sizes and measure nothing: one atomic load
//! per group, no synchronisation ever (the driver's figure is read on the host, with no wait
//! for the device).
//!
//! What the figure cannot separate: memory NCCL allocates once per process with the first
//! communicator (its kernels' code, loaded with the first launch) is counted with that
//! communicator although destroying it does not give that back; a device shared with another
//! process that allocates during the interval counts that process's growth too.

use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;

use crate::backend::cuda::device::Gpu;
use crate::backend::cuda::driver::pretend;
use crate::error::Ctx;
use crate::{memory, Device, Result};

/// The two figures of one moment on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// The device's used memory (total minus free, `cuMemGetInfo`): every process's, every
    /// library's.
    pub used: u64,
    /// What ndscope holds on the device: its reservations (arrays, workspace blocks, spills),
    /// its caches and what its memory pool keeps after frees (`memory::held`).
    pub own: u64,
}

/// The figures of `gpu` now; `None` if the driver does not give them. The device's context
/// must be current on the calling thread.
fn snapshot(gpu: &Gpu) -> Option<Snapshot> {
    let (free, total) = cudarc::driver::result::mem_get_info().ok()?;
    Some(Snapshot {
        used: u64::try_from(total.saturating_sub(free)).ok()?,
        own: u64::try_from(memory::held(gpu.device())).ok()?,
    })
}

/// The bytes someone other than ndscope took on the device between `before` and
/// `after`: how much the device's used memory grew, minus how much ndscope's own grew (either
/// may have shrunk), never below 0.
pub(crate) fn grown(before: Snapshot, after: Snapshot) -> usize {
    let device = i128::from(after.used) - i128::from(before.used);
    let own = i128::from(after.own) - i128::from(before.own);
    usize::try_from((device - own).max(0)).unwrap_or(usize::MAX)
}

/// Extra bytes `NDSCOPE_CUDA_PRETEND` says NCCL took at `key` (for tests: the simulated NCCL
/// takes no device memory).
fn pretended(key: &str) -> usize {
    pretend(key).map_or(0, |bytes| usize::try_from(bytes).unwrap_or(0))
}

/// One communicator's device memory, as measured, and its share of the device's total
/// (`memory::communicator_bytes`).
#[derive(Debug)]
pub(crate) struct CommMemory {
    device: Device,
    /// Bytes counted for the communicator in the device's total; 0 once released.
    bytes: AtomicUsize,
    /// The most bytes of a group measured so far (0: none yet); `usize::MAX` once released, so
    /// that nothing is measured again.
    largest: AtomicUsize,
}

impl CommMemory {
    /// The device's figures just before `ncclCommInitRank`, with its context current; `None`
    /// if the driver does not give them (nothing is measured then).
    pub(crate) fn before_init(gpu: &Gpu) -> Option<Snapshot> {
        snapshot(gpu)
    }

    /// The memory of a communicator `ncclCommInitRank` just made on `gpu` (its context still
    /// current), from the figures of [`before_init`](Self::before_init), counted in the
    /// device's total.
    pub(crate) fn after_init(gpu: &Gpu, before: Option<Snapshot>) -> CommMemory {
        let memory = CommMemory {
            device: gpu.device(),
            bytes: AtomicUsize::new(0),
            largest: AtomicUsize::new(0),
        };
        let measured = before
            .zip(snapshot(gpu))
            .map_or(0, |(before, after)| grown(before, after));
        memory.add(measured.saturating_add(pretended("nccl_init")));
        memory
    }

    /// Counts `bytes` more for the communicator: while it is being made, or under its lock
    /// while it is live, so that nothing is added after [`release`](Self::release).
    pub(crate) fn add(&self, bytes: usize) {
        if bytes > 0 {
            self.bytes.fetch_add(bytes, Ordering::Relaxed);
            memory::communicators_hold(self.device, bytes);
        }
    }

    /// Takes the communicator's bytes out of the device's total (it was destroyed or aborted);
    /// once: later calls find 0.
    pub(crate) fn release(&self) {
        self.largest.store(usize::MAX, Ordering::Relaxed);
        let bytes = self.bytes.swap(0, Ordering::Relaxed);
        memory::communicators_released(self.device, bytes);
    }

    /// Runs `call`, one NCCL group of `group_bytes` bytes on the communicator of `gpu` whose
    /// handle `live` holds (`None` once destroyed or aborted), and, if it is the first group or
    /// moves more bytes than any measured before, counts what the device's memory grew by
    /// meanwhile as the communicator's (see the module's documentation). Other groups cost one
    /// atomic load.
    pub(crate) fn measuring<T, R>(
        &self,
        gpu: &Gpu,
        live: &Mutex<Option<T>>,
        group_bytes: usize,
        call: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let largest = self.largest.load(Ordering::Relaxed);
        if group_bytes <= largest {
            return call();
        }
        let bound = || gpu.bind(&Ctx::new("ncclGroupEnd")).ok();
        let before = bound().and_then(|()| snapshot(gpu));
        let result = call();
        let extra = if largest == 0 {
            pretended("nccl_connect")
        } else {
            0
        };
        let after = bound().and_then(|()| snapshot(gpu));
        let measured = before.zip(after).map_or(0, |(b, a)| grown(b, a));
        // Under the communicator's lock: an abort (which releases the bytes) comes before or
        // after, never between the check and the count.
        let guard = live.lock();
        if guard.is_some() {
            self.add(measured.saturating_add(extra));
            self.largest.fetch_max(group_bytes, Ordering::Relaxed);
        }
        drop(guard);
        result
    }

    /// The bytes counted for the communicator now (0 once released).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::{grown, Snapshot};

    const MIB: u64 = 1 << 20;

    fn at(used: u64, own: u64) -> Snapshot {
        Snapshot { used, own }
    }

    #[test]
    fn the_communicators_bytes_are_the_devices_growth_less_ndscopes_own() {
        // NCCL alone: all of the growth.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1096 * MIB, 600 * MIB)),
            96 << 20
        );
        // Another thread's array took 32 MiB more of ndscope's meanwhile: not NCCL's.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1128 * MIB, 632 * MIB)),
            96 << 20
        );
        // ndscope gave 64 MiB back meanwhile (its pool trimmed): NCCL's 96 MiB hide behind it.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1032 * MIB, 536 * MIB)),
            96 << 20
        );
        // Only ndscope's own memory changed: nothing is NCCL's.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1040 * MIB, 640 * MIB)),
            0
        );
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1000 * MIB, 600 * MIB)),
            0
        );
    }

    #[test]
    fn a_device_that_shrank_more_than_ndscope_gives_zero_never_a_wrapped_count() {
        // Another process freed 200 MiB while NCCL took 96: clamped at 0.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(896 * MIB, 600 * MIB)),
            0
        );
        // ndscope's grew more than the device (the figures are of different moments).
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1010 * MIB, 620 * MIB)),
            0
        );
        // Extremes do not overflow.
        assert_eq!(grown(at(0, u64::MAX), at(u64::MAX, 0)), usize::MAX);
        assert_eq!(grown(at(u64::MAX, 0), at(0, u64::MAX)), 0);
    }
}
