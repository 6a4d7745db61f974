//! Collectives over arrays of several devices, on the backend's NCCL communicators: the
//! in-place sum all-reduce of a replica's gradients (data-parallel training).

use super::exec;
use crate::backend::{self, Communicator};
use crate::error::Ctx;
use crate::{NDArray, Result};

/// Sums each of `arrays` over every rank of `comm` in place, in one NCCL group: every pending
/// product settled first (a weight gradient backward left uncomputed), then the arrays
/// write-locked and their all-reduces queued on the device's stream. Every rank passes arrays
/// of the same dtypes and sizes in the same order. Float arrays on `comm`'s device only.
pub(crate) fn all_reduce_sum_(ctx: &Ctx, comm: &Communicator, arrays: &[&NDArray]) -> Result<()> {
    for a in arrays {
        if !a.dtype().is_float() {
            return Err(a.dtype_error(ctx, "float arrays (gradients)"));
        }
        if a.device() != crate::Device::Cuda(comm.ordinal()) {
            return Err(ctx.device_mismatch(format!(
                "{} is on {}, the communicator's rank on cuda:{}",
                a.0.describe(),
                a.device(),
                comm.ordinal()
            )));
        }
    }
    exec::write_all(ctx, arrays, |storages| {
        let mut buffers: Vec<_> = storages
            .iter_mut()
            .zip(arrays)
            .map(|(s, a)| (&mut **s, a.dtype(), a.size()))
            .collect();
        backend::all_reduce_sum(ctx, comm, &mut buffers)
    })
}
