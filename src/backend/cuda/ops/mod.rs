//! The op families on one CUDA device: kernel launches (`kernels/*.cu`), cuBLAS for float
//! matrix products, driver copies, and host↔device transfers through page-locked staging memory.
//! One file per family, as in the CPU backend, each implementing its family's trait of the
//! backend contract for [`Cuda`].
//!
//! - `launch.rs`: launch configurations, kernel arguments, operand addressing, `same_gpu`.
//! - `error.rs`: the checks reported at the next wait, and waiting (`synchronize`).
//! - `capture.rs`: learned workspace cycles recorded, captured as CUDA graphs and replayed
//!   (every stream call passes through it while a cycle records or replays).
//! - `transfer.rs`: host↔device and device copies, `zero`, `convert`.
//! - `elementwise.rs`: fill and random, binary/compare/unary ops, in-place ops, `assign`.
//! - `reduce.rs`: sums, maxima, argmax.
//! - `matmul.rs`: matrix products and the dense SGD update.
//! - `nn.rs`: softmax, `one_hot`, `pick`.
//! - `optim.rs`: the fused SGD and Adam/AdamW steps.
//! - `shape.rs`: transpose, permute, narrow, interleave.
//! - `nccl.rs`: NCCL communicators and in-place all-reduces of device buffers (several-device
//!   training); `nccl_memory.rs`: the communicators' own device memory, measured and counted in
//!   `memory_usage(dev).cached` while they live.
//!
//! Launches are asynchronous: a function returns once its work is queued on the device's
//! stream. Only reads (`to_vec`, `to_scalar`, `to_device(Cpu)`) and `Device::synchronize` wait,
//! for the events of their own copies. Input that only the device sees (an index outside its
//! range in `pick`/`one_hot`, an integer divisor of 0) is checked by the kernel itself, which
//! never uses it and records where it was (`error.rs`); the next wait on that device reports it
//! as an error naming the op and the call site that queued it. No op waits for the device.

#[macro_use]
mod launch;
mod capture;
mod elementwise;
mod error;
mod matmul;
mod nccl;
mod nccl_memory;
mod nn;
mod optim;
mod reduce;
mod shape;
mod transfer;

pub(crate) use capture::{any_replaying, note, note_unreplayed, CycleGraph, Noted};
pub(crate) use error::synchronize;
pub(crate) use nccl::{nccl_unique_id, Communicator, NcclId};

/// The CUDA backend: the backend contract (`backend/contract.rs`) on device memory, one op
/// family per file of this directory (`impl ElementwiseOps for Cuda` in `elementwise.rs`, and so
/// on).
pub(crate) struct Cuda;

impl crate::backend::contract::Backend for Cuda {
    type Buffer = crate::backend::cuda::buffer::DeviceBuffer;
}

#[cfg(test)]
mod tests {
    use cudarc::driver::sys::{self, CUdeviceptr};

    use super::launch::{linear, scalar};
    use super::*;
    use crate::backend::contract::ElementwiseOps;
    use crate::backend::cuda::buffer::DeviceBuffer;
    use crate::backend::cuda::device::Gpu;
    use crate::error::Ctx;
    use crate::{DType, Error};

    /// Whether the loaded CUDA driver is the CPU simulator of `shared/cudasim` (it exports
    /// `cudasim_stats`; a real driver does not).
    fn on_the_simulator() -> bool {
        // SAFETY: only asks whether the driver is already loaded (RTLD_NOLOAD loads nothing)
        // and looks a symbol up in it; the handle is closed again.
        unsafe {
            let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
            if lib.is_null() {
                return false;
            }
            let found = !libc::dlsym(lib, c"cudasim_stats".as_ptr()).is_null();
            libc::dlclose(lib);
            found
        }
    }

    /// Device 0, or `None` after saying why the test skips (a failure under
    /// `NDSCOPE_REQUIRE_GPU=1`).
    fn test_gpu(ctx: &Ctx) -> Option<&'static Gpu> {
        match super::super::device::gpu(ctx, 0) {
            Ok(gpu) => Some(gpu),
            Err(e) => {
                if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
                    panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU: {e}");
                }
                println!("skipped on cuda: {e}");
                None
            }
        }
    }

    /// The first f32 of device memory at `ptr`, read through the device address as a host
    /// address (the simulator's device pointers are host addresses).
    ///
    /// # Safety
    /// Only on the simulator, with `ptr` the start of a live allocation of at least 4 bytes.
    unsafe fn peek(ptr: CUdeviceptr) -> u32 {
        // SAFETY: per the contract; volatile, since the simulator writes it behind our back.
        unsafe { std::ptr::read_volatile(ptr as usize as *const u32) }
    }

    /// `synchronize` waits for work queued before it. Reading values through ndscope waits
    /// anyway, so this looks at the device memory directly, which only the simulator allows:
    /// it runs queued work as late as CUDA permits (when the host waits), so a fill queued
    /// and not waited for has not happened yet, and must have once `synchronize` returns.
    #[test]
    fn synchronize_runs_queued_work_before_returning() {
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        if !on_the_simulator() {
            println!("skipped: needs the CPU simulator of CUDA (host-readable device memory)");
            return;
        }
        if std::env::var_os("CUDASIM_SYNC").is_some_and(|v| v == "1") {
            println!("skipped: CUDASIM_SYNC=1 runs work at submission");
            return;
        }
        let n = 1024;
        let mut buf = DeviceBuffer::alloc(&ctx, gpu.ordinal, n * 4).unwrap();
        synchronize(&ctx, gpu.ordinal).unwrap();
        // SAFETY: on the simulator; `buf` is a live allocation of 4096 bytes.
        let before = unsafe { peek(buf.ptr()) };
        let value = if f32::from_bits(before) == 3.5 {
            4.5f32
        } else {
            3.5
        };
        Cuda::fill(&ctx, DType::F32, &mut buf, f64::from(value)).unwrap();
        // SAFETY: as above.
        let queued = unsafe { peek(buf.ptr()) };
        assert_eq!(
            queued, before,
            "the fill ran before anything waited: the simulator runs work at submission"
        );
        synchronize(&ctx, gpu.ordinal).unwrap();
        // SAFETY: as above.
        let after = unsafe { peek(buf.ptr()) };
        assert_eq!(
            f32::from_bits(after),
            value,
            "synchronize returned before the fill queued ahead of it ran (bits {after:#x})"
        );
        drop(buf);
        synchronize(&ctx, gpu.ordinal).unwrap();
    }

    /// The driver running out of page-locked memory is `OutOfMemory` on the host, naming the
    /// size and the driver as what refused it (it was a generic backend error).
    #[test]
    fn page_locked_memory_exhaustion_is_out_of_memory() {
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        let oom = cudarc::driver::DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        match super::super::device::pinned_refusal(&ctx, gpu, 1 << 30, oom) {
            Error::OutOfMemory {
                device,
                requested,
                limit_source,
                ..
            } => {
                assert_eq!(device, crate::Device::Cpu);
                assert_eq!(requested, 1 << 30);
                assert_eq!(limit_source, crate::LimitSource::Driver);
            }
            other => panic!("expected OutOfMemory, got {other}"),
        }
    }

    /// After a device fault (a kernel writing outside every allocation), every later call on
    /// the device reports the same fault, naming the op that first met it and where that op was
    /// called. The fault leaves the device unusable for the process: run in a child process.
    #[test]
    fn a_device_fault_is_sticky_and_names_the_first_failing_op() {
        const NAME: &str =
            "backend::cuda::ops::tests::a_device_fault_is_sticky_and_names_the_first_failing_op";
        let ctx = Ctx::new("test");
        let Some(gpu) = test_gpu(&ctx) else { return };
        if std::env::var_os("NDSCOPE_FAULT_CHILD").is_none() {
            let exe = std::env::current_exe().unwrap();
            let out = std::process::Command::new(exe)
                .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
                .env("NDSCOPE_FAULT_CHILD", "1")
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success() && stdout.contains("1 passed"),
                "the child run failed:\n{stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            return;
        }
        let f = gpu.kernels.one(&ctx, "fill", DType::F32).unwrap();
        let bogus: CUdeviceptr = 1 << 12;
        // SAFETY: deliberately not: the kernel writes through an address outside every
        // allocation, which the device reports as a fault; this process is thrown away.
        unsafe {
            launch!(&ctx, gpu, f, linear(gpu, 1024); out = bogus, count = 1024u64, v = scalar(DType::F32, 1.0))
        }
        .unwrap();
        let first = Ctx::new("first_wait");
        let err = synchronize(&first, gpu.ordinal).expect_err("the fault is reported");
        let text = err.to_string();
        assert!(
            text.contains("the first op to fail was first_wait at"),
            "{text}"
        );
        assert!(text.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{text}");
        // Every later call, whatever it is, reports the same first failure.
        let later = Ctx::new("later");
        for err in [
            synchronize(&later, gpu.ordinal).expect_err("still faulted"),
            DeviceBuffer::alloc(&later, gpu.ordinal, 64)
                .err()
                .expect("no allocation on a faulted device"),
            gpu.bind(&later).expect_err("no context"),
        ] {
            let text = err.to_string();
            assert!(text.contains("unusable after a device fault"), "{text}");
            assert!(
                text.contains("the first op to fail was first_wait at"),
                "{text}"
            );
        }
    }

    /// The tests that make communicators take turns: the device's total is process-wide.
    static COMMS: std::sync::Mutex<()> = std::sync::Mutex::new(());

    const MIBS: usize = 1 << 20;

    /// A communicator of one rank on device 0, or `None` after saying why the test skips (no
    /// GPU: a failure under `NDSCOPE_REQUIRE_GPU=1`; no NCCL library).
    fn one_rank(ctx: &Ctx) -> Option<Communicator> {
        test_gpu(ctx)?;
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
        let dev = crate::Device::Cuda(0);
        // Another communicator stays meanwhile: a release counted twice would show (the
        // device's total never goes below 0).
        let Some(witness) = one_rank(&ctx) else {
            return;
        };
        witness.memory.add(7 * MIBS);
        let Some(comm) = one_rank(&ctx) else { return };
        let base = crate::memory::communicator_bytes(dev) - comm.memory.bytes();
        assert!(base >= 7 * MIBS);
        // What a measured group adds.
        comm.memory.add(5 * MIBS);
        let held = comm.memory.bytes();
        assert!(held >= 5 * MIBS);
        assert_eq!(crate::memory::communicator_bytes(dev), base + held);
        assert!(crate::memory_usage(dev).cached >= base + held);
        drop(comm);
        assert_eq!(
            crate::memory::communicator_bytes(dev),
            base,
            "destroyed: given back"
        );

        let Some(comm) = one_rank(&ctx) else { return };
        comm.memory.add(3 * MIBS);
        assert!(crate::memory::communicator_bytes(dev) >= base + 3 * MIBS);
        comm.abort();
        assert_eq!(comm.memory.bytes(), 0);
        assert_eq!(
            crate::memory::communicator_bytes(dev),
            base,
            "aborted: given back"
        );
        comm.abort();
        // A group after the abort is refused and counts nothing.
        let refused = comm.measuring(1 << 30, || Ok(()));
        assert!(refused.is_ok());
        assert_eq!(
            crate::memory::communicator_bytes(dev),
            base,
            "a second abort"
        );
        drop(comm);
        assert_eq!(
            crate::memory::communicator_bytes(dev),
            base,
            "dropped after the abort"
        );
        let witnessed = witness.memory.bytes();
        drop(witness);
        assert_eq!(crate::memory::communicator_bytes(dev), base - witnessed);
    }

    /// `measuring` around a group that allocates device memory outside ndscope (as NCCL does
    /// when it connects) while ndscope allocates an array: the former is the communicator's,
    /// the latter not; a group no larger than one measured before is not measured.
    #[test]
    fn the_first_and_every_larger_group_measure_what_the_device_grew_by_apart_from_ndscope() {
        let _turn = COMMS.lock().unwrap_or_else(|e| e.into_inner());
        let ctx = Ctx::new("test");
        let dev = crate::Device::Cuda(0);
        let Some(comm) = one_rank(&ctx) else { return };
        let m = crate::Manager::new_base_on(dev).expect("a manager on cuda:0");
        let gpu = super::super::device::gpu(&ctx, 0).expect("cuda:0");
        // Device memory of the driver's, as NCCL takes it (not from ndscope's pool).
        let take = |bytes: usize| {
            gpu.bind(&ctx).expect("bind");
            // SAFETY: a plain allocation on the current context, freed below.
            unsafe { cudarc::driver::result::malloc_sync(bytes) }.expect("cuMemAlloc")
        };
        let at_init = comm.memory.bytes();
        let (first, array) = comm
            .measuring(64, || {
                let array = m.zeros([MIBS], DType::F32)?; // 4 MiB of ndscope's
                Ok((take(8 * MIBS), array))
            })
            .expect("the first group");
        let after_first = comm.memory.bytes() - at_init;
        assert!(
            (8 * MIBS..12 * MIBS).contains(&after_first),
            "the first group counted {after_first} bytes, want 8 MiB (ndscope's 4 MiB apart)"
        );
        let smaller = comm
            .measuring(32, || Ok(take(8 * MIBS)))
            .expect("a smaller group");
        assert_eq!(
            comm.memory.bytes() - at_init,
            after_first,
            "a smaller group is not measured"
        );
        let larger = comm
            .measuring(128, || Ok(take(2 * MIBS)))
            .expect("a larger group");
        let after_larger = comm.memory.bytes() - at_init;
        assert!(
            after_larger >= after_first + 2 * MIBS,
            "a larger group is measured: {after_larger} after {after_first}"
        );
        assert!(crate::memory::communicator_bytes(dev) >= comm.memory.bytes());
        let total = crate::memory::communicator_bytes(dev);
        drop(comm);
        assert_eq!(
            crate::memory::communicator_bytes(dev),
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
}
