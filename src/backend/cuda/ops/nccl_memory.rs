//! The device memory of the NCCL communicators (`nccl.rs`), counted in
//! `memory_usage(dev).cached` while they live and given back when they are destroyed or aborted.
//!
//! NCCL before 2.29 has no call that says how much device memory a communicator holds (its
//! channel buffers, work FIFOs, the connections' buffers; 2.29 brought `ncclCommMemStats`), so
//! it is measured: the device's used memory
//! as the driver reports it (`cuMemGetInfo`) just before and just after NCCL sets something up,
//! minus what ndscope's own memory grew by meanwhile (`in_use` and `cached` of
//! `memory_usage(dev)` without the communicators' term: another thread of this process may
//! allocate on the device at the same time), never below 0. NCCL sets up at two moments:
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

use super::nccl::Communicator;
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

    /// Counts `bytes` more for the communicator. Callers hold the communicator's lock with the
    /// communicator live, so nothing is added after [`release`](Self::release).
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
}

impl Communicator {
    /// Runs `call`, one NCCL group of `group_bytes` bytes on this communicator, and, if it is
    /// the first group or moves more bytes than any measured before, counts what the device's
    /// memory grew by meanwhile as the communicator's (see the module's documentation). Other
    /// groups cost one atomic load.
    pub(crate) fn measuring<R>(
        &self,
        group_bytes: usize,
        call: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        let largest = self.memory.largest.load(Ordering::Relaxed);
        if group_bytes <= largest {
            return call();
        }
        let before = match self.gpu.bind(&Ctx::new("ncclGroupEnd")) {
            Ok(()) => snapshot(self.gpu),
            Err(_) => None,
        };
        let result = call();
        let extra = if largest == 0 {
            pretended("nccl_connect")
        } else {
            0
        };
        // `call` left the context current (or failed before NCCL ran: then little grew).
        let after = self
            .gpu
            .bind(&Ctx::new("ncclGroupEnd"))
            .ok()
            .and_then(|()| snapshot(self.gpu));
        let measured = before.zip(after).map_or(0, |(b, a)| grown(b, a));
        // Under the communicator's lock: an abort (which releases the bytes) comes before or
        // after, never between the check and the count.
        let live = self.comm.lock();
        if live.is_some() {
            self.memory.add(measured.saturating_add(extra));
            self.memory
                .largest
                .fetch_max(group_bytes, Ordering::Relaxed);
        }
        drop(live);
        result
    }

    /// The bytes of device memory counted for this communicator (0 once destroyed or aborted).
    #[cfg(test)]
    pub(crate) fn memory_bytes(&self) -> usize {
        self.memory.bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::super::nccl::{nccl_unique_id, Communicator};
    use super::{grown, Snapshot};
    use crate::backend::cuda::device;
    use crate::error::Ctx;
    use crate::{memory, DType, Device, Error, Manager};

    const MIB: u64 = 1 << 20;
    const MIBS: usize = 1 << 20;

    /// The tests that make communicators take turns: the device's total is process-wide.
    static COMMS: Mutex<()> = Mutex::new(());

    /// A communicator of one rank on device 0, or `None` after saying why the test skips (no
    /// GPU: a failure under `NDSCOPE_REQUIRE_GPU=1`; no NCCL library).
    fn one_rank(ctx: &Ctx) -> Option<Communicator> {
        if let Err(e) = device::gpu(ctx, 0) {
            if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
                panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU: {e}");
            }
            println!("skipped on cuda: {e}");
            return None;
        }
        match nccl_unique_id(ctx).and_then(|id| Communicator::init(ctx, 0, id, 0, 1)) {
            Ok(comm) => Some(comm),
            Err(e @ Error::Unsupported { .. }) => {
                println!("skipped: {e}");
                None
            }
            Err(e) => panic!("a communicator of one rank: {e}"),
        }
    }

    #[test]
    fn a_communicators_bytes_count_until_it_is_destroyed_or_aborted_and_go_back_once() {
        let _turn = COMMS.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = Ctx::new("test");
        let dev = Device::Cuda(0);
        // Another communicator stays meanwhile: a release counted twice would show (the
        // device's total never goes below 0).
        let Some(witness) = one_rank(&ctx) else {
            return;
        };
        witness.memory.add(7 * MIBS);
        let Some(comm) = one_rank(&ctx) else { return };
        let base = memory::communicator_bytes(dev) - comm.memory_bytes();
        assert!(base >= 7 * MIBS);
        // What a measured group adds.
        comm.memory.add(5 * MIBS);
        let held = comm.memory_bytes();
        assert!(held >= 5 * MIBS);
        assert_eq!(memory::communicator_bytes(dev), base + held);
        assert!(crate::memory_usage(dev).cached >= base + held);
        drop(comm);
        assert_eq!(
            memory::communicator_bytes(dev),
            base,
            "destroyed: given back"
        );

        let Some(comm) = one_rank(&ctx) else { return };
        comm.memory.add(3 * MIBS);
        assert!(memory::communicator_bytes(dev) >= base + 3 * MIBS);
        comm.abort();
        assert_eq!(comm.memory_bytes(), 0);
        assert_eq!(memory::communicator_bytes(dev), base, "aborted: given back");
        comm.abort();
        // A group after the abort is refused and counts nothing.
        let refused = comm.measuring(1 << 30, || Ok(()));
        assert!(refused.is_ok());
        assert_eq!(memory::communicator_bytes(dev), base, "a second abort");
        drop(comm);
        assert_eq!(
            memory::communicator_bytes(dev),
            base,
            "dropped after the abort"
        );
        let witnessed = witness.memory_bytes();
        drop(witness);
        assert_eq!(memory::communicator_bytes(dev), base - witnessed);
    }

    /// `measuring` around a group that allocates device memory outside ndscope (as NCCL does
    /// when it connects) while ndscope allocates an array: the former is the communicator's,
    /// the latter not; a group no larger than one measured before is not measured.
    #[test]
    fn the_first_and_every_larger_group_measure_what_the_device_grew_by_apart_from_ndscope() {
        let _turn = COMMS.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = Ctx::new("test");
        let dev = Device::Cuda(0);
        let Some(comm) = one_rank(&ctx) else { return };
        let m = Manager::new_base_on(dev).expect("a manager on cuda:0");
        let gpu = device::gpu(&ctx, 0).expect("cuda:0");
        // Device memory of the driver's, as NCCL takes it (not from ndscope's pool).
        let take = |bytes: usize| {
            gpu.bind(&ctx).expect("bind");
            // SAFETY: a plain allocation on the current context, freed below.
            unsafe { cudarc::driver::result::malloc_sync(bytes) }.expect("cuMemAlloc")
        };
        let at_init = comm.memory_bytes();
        let (first, array) = comm
            .measuring(64, || {
                let array = m.zeros([MIBS], DType::F32)?; // 4 MiB of ndscope's
                Ok((take(8 * MIBS), array))
            })
            .expect("the first group");
        let after_first = comm.memory_bytes() - at_init;
        assert!(
            (8 * MIBS..12 * MIBS).contains(&after_first),
            "the first group counted {after_first} bytes, want 8 MiB (ndscope's 4 MiB apart)"
        );
        let smaller = comm
            .measuring(32, || Ok(take(8 * MIBS)))
            .expect("a smaller group");
        assert_eq!(
            comm.memory_bytes() - at_init,
            after_first,
            "a smaller group is not measured"
        );
        let larger = comm
            .measuring(128, || Ok(take(2 * MIBS)))
            .expect("a larger group");
        let after_larger = comm.memory_bytes() - at_init;
        assert!(
            after_larger >= after_first + 2 * MIBS,
            "a larger group is measured: {after_larger} after {after_first}"
        );
        assert!(memory::communicator_bytes(dev) >= comm.memory_bytes());
        let total = memory::communicator_bytes(dev);
        drop(comm);
        assert_eq!(
            memory::communicator_bytes(dev),
            total - at_init - after_larger
        );
        gpu.bind(&ctx).expect("bind");
        for ptr in [first, smaller, larger] {
            // SAFETY: allocated by `take` above, freed once.
            unsafe { cudarc::driver::result::free_sync(ptr) }.expect("cuMemFree");
        }
        drop(array);
        m.close().expect("close");
    }

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
        // Another thread's array grew the pool by 32 MiB meanwhile: not NCCL's.
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1128 * MIB, 632 * MIB)),
            96 << 20
        );
        // The pool was trimmed by 64 MiB meanwhile: NCCL's 96 MiB hide behind it.
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
        // The pool grew more than the device (the figures are of different moments).
        assert_eq!(
            grown(at(1000 * MIB, 600 * MIB), at(1010 * MIB, 620 * MIB)),
            0
        );
        // Extremes do not overflow.
        assert_eq!(grown(at(0, u64::MAX), at(u64::MAX, 0)), usize::MAX);
        assert_eq!(grown(at(u64::MAX, 0), at(0, u64::MAX)), 0);
    }
}
