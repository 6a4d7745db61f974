//! The compute seam. Backends know nothing of managers: they take [`Storage`], shapes and
//! dtypes.
//!
//! - [`Storage`] is the one storage type of every array, workspace block slice and spill:
//!   host bytes or memory of one CUDA device. [`Block`] is a workspace's memory block, carved
//!   into storage by offset.
//! - The entry points, in `ops.rs`: [`AnyDevice`], an implementation of the backend contract
//!   (`contract.rs`) over [`Storage`], one trait per op family (transfer, elementwise, reduce,
//!   matmul, nn, shape). Each op dispatches on the storage of its operands: all on the host
//!   runs the CPU backend (`cpu/`), all on one CUDA device the CUDA backend (`cuda/`), both
//!   implementing the same contract; the elementwise ops are rows of the tables in
//!   `op_table.rs`. The front-ends in `crate::ndarray` validate and place, then call these
//!   (`AnyDevice::unary(..)`, the family's trait in scope); they never touch a kernel or a host
//!   slice.
//! - Without the `cuda` feature, `cuda/` is a stub with the same items whose device types have
//!   no values, so no `#[cfg]` spreads through the crate.

pub(crate) mod block;
pub(crate) mod contract;
pub(crate) mod cpu;
pub(crate) mod cuda;
pub(crate) mod graph;
pub(crate) mod layout;
pub(crate) mod op_table;
mod ops;
pub(crate) mod settings;
mod storage;

pub(crate) use block::Block;
pub(crate) use cuda::{nccl_unique_id, Communicator, CycleGraph, NcclId};
pub(crate) use op_table::{Binary, Compare, Unary};
pub(crate) use ops::*;
pub(crate) use settings::ALLOW_TF32;
pub(crate) use storage::Storage;

use crate::error::Ctx;

/// Which operands of a batched product carry the batch axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Batched {
    /// `[b, m, k] · [b, k, n]`.
    Both,
    /// `[b, m, k] · [k, n]`: the right operand is shared.
    Left,
    /// `[m, k] · [b, k, n]`: the left operand is shared.
    Right,
}

/// CUDA devices usable by this build on this machine (0 without the `cuda` feature, a driver
/// or a GPU; never a panic).
pub(crate) fn cuda_count() -> usize {
    cuda::device_count()
}

/// Sets up `device` on its first use (a CUDA device: context, kernels, cuBLAS), reporting why
/// it cannot be used. Called before the arena lock, so that a slow setup (a cold kernel compile)
/// never runs under it; a failed setup is tried again on the next call.
#[inline]
pub(crate) fn prepare(ctx: &crate::error::Ctx, device: crate::Device) -> crate::Result<()> {
    cuda::prepare(ctx, device)
}

/// Gives back what the CUDA backend holds on device `ordinal` that no array uses; returns the
/// bytes (0 for a device not set up).
pub(crate) fn cuda_release_cached(ordinal: usize) -> usize {
    cuda::release_cached(ordinal)
}

/// Why CUDA device `ordinal` cannot be used, for `DeviceUnavailable` messages.
pub(crate) fn cuda_unavailable_reason(ordinal: usize) -> String {
    cuda::unavailable_reason(ordinal)
}

/// Whether `op(a) · bᵀ` on `device` runs faster with `b` transposed into a temporary first (the
/// CPU's gemm reads a transposed right operand slowly; cuBLAS does not).
pub(crate) fn prefers_materialized_transpose(device: crate::Device) -> bool {
    device.is_cpu()
}

/// The most multiply-adds (`m·k·n`) of a product that CUDA runs with an f32 operand read
/// rounded, 2^25 (train_mlp's first layer at batch 128 is 25.7 million). cuBLAS takes operands
/// of one type, so such a product runs our own kernel, f32 multiply-adds on shared-memory tiles
/// instead of tensor cores: for products this small it should cost about what a launch and the
/// cast it replaces cost (not yet timed on a GPU), and the half copy of the weights it saves is
/// larger than the activations (a layer `[m, k] · [k, n]` with `m·k·n ≤ 2^25` and `k·n` large
/// has a small batch `m`). Larger products convert the weights once per guard and run on
/// tensor cores.
pub(crate) const ROUNDED_PRODUCT_MAX_MACS: usize = 1 << 25;

/// Whether a product `[m, k] · [k, n]` on `device` reads an f32 operand rounded to a half type
/// as it reads it ([`Gemm::rounded_b`](contract::Gemm::rounded_b),
/// [`Linear::rounded_w`](contract::Linear)): an autocast layer then needs no half copy of its
/// f32 weights. The CPU packs every operand it multiplies anyway, so it always does; CUDA up to
/// [`ROUNDED_PRODUCT_MAX_MACS`].
pub(crate) fn rounds_operands(device: crate::Device, (m, k, n): (usize, usize, usize)) -> bool {
    match device {
        crate::Device::Cpu => true,
        crate::Device::Cuda(_) => m
            .checked_mul(k)
            .and_then(|mk| mk.checked_mul(n))
            .is_some_and(|macs| macs <= ROUNDED_PRODUCT_MAX_MACS),
    }
}

// Methods of lower-layer types that need the backend: they live here, so that `device.rs` and
// `error.rs` (layer 0) import nothing above them.

impl crate::Device {
    /// The number of CUDA devices usable by this build on this machine.
    ///
    /// Never panics: it is 0 without the `cuda` feature, without a driver, or without a GPU.
    pub fn cuda_count() -> usize {
        cuda_count()
    }

    /// Waits until all work queued on the device has finished, and reports an error an earlier
    /// asynchronous kernel ran into as `Error::Backend`, and bad input a kernel found since the
    /// last wait (an index out of range in `pick`/`one_hot`, an integer divisor of 0) as the
    /// `InvalidArgument` of the op that queued it, with its call site. The host thread sleeps
    /// while it waits (a blocking-sync event), it does not spin. CUDA ops return once their work is
    /// queued; reads (`to_vec`, `to_scalar`) wait by themselves, so this is for timing and for
    /// checking errors at a chosen point. Does nothing for the CPU, whose ops finish before they
    /// return. `DeviceUnavailable` for an absent device.
    ///
    /// ```
    /// use ndscope::Device;
    /// Device::Cpu.synchronize()?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn synchronize(&self) -> crate::Result<()> {
        let ctx = Ctx::new("Device::synchronize");
        if !self.is_available() {
            return Err(ctx.unavailable(*self));
        }
        synchronize(&ctx, *self)
    }
}

impl Ctx {
    /// `DeviceUnavailable` for `device`, saying why it cannot be used here.
    pub(crate) fn unavailable(&self, device: crate::Device) -> crate::Error {
        let reason = match device {
            crate::Device::Cpu => "the CPU is always available".to_string(),
            crate::Device::Cuda(ordinal) => cuda_unavailable_reason(ordinal),
        };
        crate::Error::DeviceUnavailable {
            op: self.op,
            at: self.at,
            device,
            reason,
        }
    }
}

/// Sums each `(storage, dtype, count)` over every rank of `comm` in place (one NCCL group):
/// the storages must be memory of `comm`'s device (`DeviceMismatch` otherwise, nothing queued).
/// Every rank passes the same dtypes and counts in the same order. The communicator's first
/// group, and any larger than those before, measure what NCCL allocated for it (its
/// connections are made then).
pub(crate) fn all_reduce_sum(
    ctx: &Ctx,
    comm: &Communicator,
    buffers: &mut [(&mut Storage, crate::DType, usize)],
) -> crate::Result<()> {
    let mut device = Vec::with_capacity(buffers.len());
    let mut group_bytes = 0usize;
    for (storage, dtype, count) in buffers.iter_mut() {
        group_bytes = group_bytes.saturating_add(count.saturating_mul(dtype.size_in_bytes()));
        match &mut **storage {
            Storage::Cuda(buffer) => device.push((buffer, *dtype, *count)),
            Storage::Host(_) => {
                return Err(ctx.device_mismatch(
                    "an NCCL all-reduce takes CUDA device memory, got host memory",
                ))
            }
        }
    }
    comm.measuring(group_bytes, || comm.all_reduce_sum(ctx, &mut device))
}
