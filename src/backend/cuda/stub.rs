//! The CUDA backend's items in a build without the `cuda` feature. Its device types have no
//! values, so every function taking one is unreachable and compiles to nothing; the functions
//! that create device memory say why they cannot.

use std::ptr::NonNull;
use std::sync::Arc;

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

type Src<'a> = (&'a DeviceBuffer, &'a [usize]);
type Dst<'a> = (&'a mut DeviceBuffer, &'a [usize]);

pub(crate) fn read<T: Element>(_: &Ctx, src: &DeviceBuffer, _: &mut [T]) -> Result<()> {
    match *src {}
}
pub(crate) fn write<T: Element>(_: &Ctx, dst: &mut DeviceBuffer, _: &[T]) -> Result<()> {
    match *dst {}
}
pub(crate) fn upload(_: &Ctx, _: &HostBuffer, dst: &mut DeviceBuffer) -> Result<()> {
    match *dst {}
}
pub(crate) fn download(_: &Ctx, src: &DeviceBuffer, _: &mut HostBuffer) -> Result<()> {
    match *src {}
}
pub(crate) fn copy(_: &Ctx, src: &DeviceBuffer, _: &mut DeviceBuffer) -> Result<()> {
    match *src {}
}
pub(crate) fn convert(
    _: &Ctx,
    _: DType,
    _: DType,
    src: &DeviceBuffer,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *src {}
}
pub(crate) fn zero(_: &Ctx, dst: &mut DeviceBuffer) -> Result<()> {
    match *dst {}
}
pub(crate) fn fill(_: &Ctx, _: DType, dst: &mut DeviceBuffer, _: f64) -> Result<()> {
    match *dst {}
}
pub(crate) fn arange(_: &Ctx, _: DType, dst: &mut DeviceBuffer, _: f64, _: f64) -> Result<()> {
    match *dst {}
}
pub(crate) fn eye(_: &Ctx, _: DType, dst: &mut DeviceBuffer, _: usize) -> Result<()> {
    match *dst {}
}
pub(crate) fn randn(_: &Ctx, _: DType, dst: &mut DeviceBuffer, _: u64, _: u64) -> Result<()> {
    match *dst {}
}
#[allow(clippy::too_many_arguments)]
pub(crate) fn rand(
    _: &Ctx,
    _: DType,
    dst: &mut DeviceBuffer,
    _: u64,
    _: u64,
    _: f64,
    _: f64,
) -> Result<()> {
    match *dst {}
}
#[allow(clippy::too_many_arguments)]
pub(crate) fn binary(
    _: &Ctx,
    _: Binary,
    _: DType,
    a: Src<'_>,
    _: Src<'_>,
    _: Dst<'_>,
    _: &dyn Fn() -> Error,
) -> Result<()> {
    match *a.0 {}
}
pub(crate) fn binary_scalar(
    _: &Ctx,
    _: Binary,
    _: DType,
    a: &DeviceBuffer,
    _: f64,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn compare(
    _: &Ctx,
    _: Compare,
    _: DType,
    a: Src<'_>,
    _: Src<'_>,
    _: Dst<'_>,
) -> Result<()> {
    match *a.0 {}
}
pub(crate) fn compare_scalar(
    _: &Ctx,
    _: Compare,
    _: DType,
    a: &DeviceBuffer,
    _: f64,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn unary(
    _: &Ctx,
    _: Unary,
    _: DType,
    a: &DeviceBuffer,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn pow_scalar(
    _: &Ctx,
    _: DType,
    a: &DeviceBuffer,
    _: f64,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn binary_inplace(
    _: &Ctx,
    _: Binary,
    _: DType,
    x: Dst<'_>,
    _: Option<Src<'_>>,
    _: &dyn Fn() -> Error,
) -> Result<()> {
    match *x.0 {}
}
pub(crate) fn scale_inplace(_: &Ctx, _: DType, x: &mut DeviceBuffer, _: f64) -> Result<()> {
    match *x {}
}
pub(crate) fn axpy(_: &Ctx, _: DType, x: Dst<'_>, _: f64, _: Option<Src<'_>>) -> Result<()> {
    match *x.0 {}
}
pub(crate) fn assign(_: &Ctx, _: DType, x: Dst<'_>, _: Src<'_>) -> Result<()> {
    match *x.0 {}
}
pub(crate) fn sum(
    _: &Ctx,
    _: DType,
    _: DType,
    a: Src<'_>,
    _: &[bool],
    _: &mut DeviceBuffer,
    _: bool,
) -> Result<()> {
    match *a.0 {}
}
pub(crate) fn sum_all(
    _: &Ctx,
    _: DType,
    _: DType,
    a: &DeviceBuffer,
    _: &mut DeviceBuffer,
    _: bool,
) -> Result<()> {
    match *a {}
}
pub(crate) fn max_axis(
    _: &Ctx,
    _: DType,
    a: &DeviceBuffer,
    _: (usize, usize, usize),
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn argmax_axis(
    _: &Ctx,
    _: DType,
    a: &DeviceBuffer,
    _: (usize, usize, usize),
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn matmul(
    _: &Ctx,
    _: DType,
    _: Option<(Batched, usize)>,
    _: (usize, usize, usize),
    a: &DeviceBuffer,
    _: &DeviceBuffer,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *a {}
}
pub(crate) fn gemm(
    _: &Ctx,
    _: DType,
    _: (usize, usize, usize),
    a: (&DeviceBuffer, bool),
    _: (&DeviceBuffer, bool),
    _: &mut DeviceBuffer,
    _: Option<(f64, f64)>,
) -> Result<()> {
    match *a.0 {}
}
pub(crate) fn sgd_dense(
    _: &Ctx,
    _: DType,
    _: (usize, usize, usize),
    xg: (&DeviceBuffer, &DeviceBuffer),
    _: (&mut DeviceBuffer, &mut DeviceBuffer),
    _: f64,
    _: f64,
) -> Result<()> {
    match *xg.0 {}
}
pub(crate) fn softmax(
    _: &Ctx,
    _: DType,
    a: &DeviceBuffer,
    _: (usize, usize, usize),
    _: &mut DeviceBuffer,
    _: bool,
) -> Result<()> {
    match *a {}
}
pub(crate) fn first_bad_index(
    _: &Ctx,
    _: DType,
    indices: &DeviceBuffer,
    _: usize,
) -> Result<Option<(usize, i64)>> {
    match *indices {}
}
pub(crate) fn one_hot(
    _: &Ctx,
    _: (DType, DType),
    indices: &DeviceBuffer,
    _: usize,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *indices {}
}
pub(crate) fn pick(
    _: &Ctx,
    _: (DType, DType),
    x: &DeviceBuffer,
    _: (usize, usize),
    _: &DeviceBuffer,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *x {}
}
pub(crate) fn transpose(
    _: &Ctx,
    _: DType,
    src: &DeviceBuffer,
    _: (usize, usize),
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *src {}
}
pub(crate) fn permute(
    _: &Ctx,
    _: DType,
    src: Src<'_>,
    _: &[usize],
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *src.0 {}
}
pub(crate) fn narrow(
    _: &Ctx,
    _: usize,
    src: &DeviceBuffer,
    _: (usize, usize, usize),
    _: usize,
    _: &mut DeviceBuffer,
) -> Result<()> {
    match *src {}
}
pub(crate) fn interleave(
    _: &Ctx,
    _: &[&DeviceBuffer],
    _: &[usize],
    _: usize,
    dst: &mut DeviceBuffer,
) -> Result<()> {
    match *dst {}
}
