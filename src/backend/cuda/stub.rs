//! The CUDA backend's items in a build without the `cuda` feature. Its device types have no
//! values, so every function taking one is unreachable and compiles to nothing; the functions
//! that create device memory say why they cannot. The op families are generated from the
//! backend contract (`backend/contract.rs`), so their signatures are not written here.

use std::ptr::NonNull;
use std::sync::Arc;

use crate::backend::contract::{
    backend_contract, first_tensor, AdamCoeffs, Backend, Draw, ElementwiseOps, Gemm, Lanes, Linear,
    MatmulOps, Mnk, NnOps, Operand, OperandMut, OptimOps, ReduceOps, SgdCoeffs, SgdStep, ShapeOps,
    StepTensors, SumOf, TransferOps,
};
use crate::backend::cpu::buffer::HostBuffer;
use crate::backend::{Batched, Binary, Block, Compare, Storage, Unary};
use crate::error::Ctx;
use crate::{DType, Device, Element, Error, Result};

/// Memory of a CUDA device: none exists in this build.
pub(crate) enum DeviceBuffer {}

/// A workspace block's device allocation: none exists in this build.
pub(crate) enum DeviceMemory {}

/// Page-locked host memory: none exists in this build.
pub(crate) enum PinnedMemory {}

/// A workspace's CUDA graph replay: none exists in this build (no workspace is on a CUDA
/// device).
pub(crate) enum CycleGraph {}

impl CycleGraph {
    pub(crate) fn new(_ordinal: usize) -> Option<CycleGraph> {
        None
    }

    pub(crate) fn begin(&self, _learned: bool) {
        match *self {}
    }

    pub(crate) fn end(&self, _ctx: &Ctx) -> Option<Arc<str>> {
        match *self {}
    }

    pub(crate) fn forget(&self) {
        match *self {}
    }

    pub(crate) fn stats(&self) -> crate::backend::graph::GraphReplayStats {
        match *self {}
    }
}

/// An array's device bytes noted as locked: none exist in this build.
pub(crate) struct Noted;

/// No cycle replays in this build.
pub(crate) fn any_replaying() -> bool {
    false
}

/// Nothing to note: no device memory exists in this build.
pub(crate) fn note(_ptr: u64, _len: usize, _write: bool) -> Noted {
    Noted
}

/// Nothing to note: no device memory exists in this build.
pub(crate) fn note_unreplayed() -> Noted {
    Noted
}

/// An NCCL rendezvous id: none exists in this build.
#[derive(Clone, Copy, Debug)]
pub(crate) enum NcclId {}

/// An NCCL communicator: none exists in this build.
#[derive(Debug)]
pub(crate) enum Communicator {}

impl NcclId {
    pub(crate) fn to_bytes(self) -> [u8; 128] {
        match self {}
    }

    /// No NCCL in this build.
    pub(crate) fn from_bytes(ctx: &Ctx, _bytes: [u8; 128]) -> Result<NcclId> {
        Err(ctx.unsupported(WHY))
    }
}

/// No NCCL in this build.
pub(crate) fn nccl_unique_id(ctx: &Ctx) -> Result<NcclId> {
    Err(ctx.unsupported(WHY))
}

impl Communicator {
    pub(crate) fn init(
        ctx: &Ctx,
        _ordinal: usize,
        id: NcclId,
        _rank: usize,
        _ranks: usize,
    ) -> Result<Communicator> {
        let _ = ctx;
        match id {}
    }

    pub(crate) fn ordinal(&self) -> usize {
        match *self {}
    }

    pub(crate) fn all_reduce_sum(
        &self,
        _ctx: &Ctx,
        _buffers: &mut [(&mut DeviceBuffer, DType, usize)],
    ) -> Result<()> {
        match *self {}
    }

    pub(crate) fn wait(
        &self,
        _ctx: &Ctx,
        _deadline: std::time::Instant,
        _waited: std::time::Duration,
    ) -> Result<()> {
        match *self {}
    }

    pub(crate) fn abort(&self) {
        match *self {}
    }

    pub(crate) fn measuring<R>(
        &self,
        _group_bytes: usize,
        _call: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        match *self {}
    }
}

const WHY: &str = "ndscope was built without the `cuda` feature";

pub(crate) fn device_count() -> usize {
    0
}

pub(crate) fn unavailable_reason(_ordinal: usize) -> String {
    WHY.to_string()
}

/// Nothing to set up for the CPU; no CUDA device exists in this build.
pub(crate) fn prepare(ctx: &Ctx, device: Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(ordinal) => Err(unavailable(ctx, ordinal)),
    }
}

/// No CUDA device exists in this build: nothing is held.
pub(crate) fn release_cached(_ordinal: usize) -> usize {
    0
}

fn unavailable(ctx: &Ctx, ordinal: usize) -> Error {
    ctx.unavailable(Device::Cuda(ordinal))
}

impl DeviceBuffer {
    pub fn alloc(ctx: &Ctx, ordinal: usize, _bytes: usize) -> Result<DeviceBuffer> {
        Err(unavailable(ctx, ordinal))
    }

    pub fn address(&self) -> u64 {
        match *self {}
    }

    pub fn bytes(&self) -> usize {
        match *self {}
    }
}

impl DeviceMemory {
    pub fn alloc(ctx: &Ctx, ordinal: usize, _bytes: usize) -> Result<DeviceMemory> {
        Err(unavailable(ctx, ordinal))
    }

    pub fn carve(&self, _block: Arc<Block>, _offset: usize, _bytes: usize) -> Storage {
        match *self {}
    }

    pub fn address(&self) -> u64 {
        match *self {}
    }
}

impl PinnedMemory {
    pub fn alloc(ctx: &Ctx, ordinal: usize, _bytes: usize) -> Result<PinnedMemory> {
        Err(unavailable(ctx, ordinal))
    }

    pub fn base(&self) -> NonNull<u8> {
        match *self {}
    }
}

pub(crate) fn synchronize(ctx: &Ctx, ordinal: usize) -> Result<()> {
    Err(unavailable(ctx, ordinal))
}

/// The CUDA backend of this build: its buffers have no values, so no op can be called.
pub(crate) struct Cuda;

impl Backend for Cuda {
    type Buffer = DeviceBuffer;
}

/// Implements every op family of the contract for [`Cuda`], each method matching on a buffer
/// parameter (`=> witness` in the contract) whose type has no values: the signatures come from
/// the contract itself, so the stub cannot drift from the real backend.
macro_rules! uninhabited_backend {
    ($(
        $(#[doc = $family_doc:literal])*
        trait $family:ident {
            $(
                $(#[doc = $doc:literal])*
                fn $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),* $(,)?)
                    -> $ret:ty => $witness:expr;
            )*
        }
    )*) => {
        $(
            impl $family for Cuda {
                $(
                    #[allow(unused_variables)]
                    fn $name $(<$g: $bound>)? ($($arg: $ty),*) -> $ret {
                        match *$witness {}
                    }
                )*
            }
        )*
    };
}
backend_contract!(uninhabited_backend);
