//! The entry points of the op families: [`AnyDevice`], the third implementation of the backend
//! contract (`contract.rs`), whose buffer is [`Storage`] on any device. Each op runs the CPU
//! backend when every operand is host storage and the CUDA backend when every operand is on one
//! CUDA device; mixed operands give `DeviceMismatch` (front-ends check devices first, with better
//! messages: this is the backstop). Because it implements the same traits as `Cpu` and `Cuda`,
//! the compiler checks these signatures against the contract too: none is written here by hand.
//!
//! Shapes are passed as dims, dtypes as [`DType`]; the storage's byte length always matches
//! (front-ends allocate it from the same metadata). What each op does is documented once, on
//! its method of the contract; front-ends call it with the family's trait in scope
//! (`AnyDevice::unary(..)`), and every call below it is static (`<Cpu as ElementwiseOps>::unary`):
//! no trait object, no cost. The few ops outside the contract (waiting on a device, the packed
//! CPU product) stay free functions at the end.

use super::contract::{
    AdamCoeffs, Backend, Draw, ElementwiseOps, Gemm, Lanes, Linear, MatmulOps, Mnk, NnOps, Operand,
    OperandMut, OptimOps, ReduceOps, SgdCoeffs, SgdStep, ShapeOps, StepTensor, StepTensors, SumOf,
    TransferOps,
};
use super::cpu::buffer::HostBuffer;
use super::cpu::ops::{self as cpu, Cpu};
use super::cuda::{self, Cuda};
use super::{Batched, Binary, Compare, Storage, Unary};
use crate::error::Ctx;
use crate::{DType, Element, Error, Result};

/// Binds each named storage to its host buffer and runs `$host` when all are on the host, or to
/// its device buffer and runs `$cuda` when all are on CUDA devices (the CUDA backend checks they
/// are one device); mixed gives `DeviceMismatch`.
macro_rules! on_device {
    ($ctx:expr, ($($s:ident),+), host => $host:expr, cuda => $cuda:expr $(,)?) => {
        match ($($s,)+) {
            ($(Storage::Host($s),)+) => $host,
            ($(Storage::Cuda($s),)+) => $cuda,
            #[allow(unreachable_patterns)]
            _ => Err(mixed($ctx)),
        }
    };
}

fn mixed(ctx: &Ctx) -> Error {
    ctx.device_mismatch(format!(
        "`{}` got operands on different devices (move them with to_device)",
        ctx.op
    ))
}

/// The backend of [`Storage`] on any device: each op picks the CPU or the CUDA backend from its
/// operands' storage (named for where its buffers live, like `Cpu` and `Cuda`; the crate's
/// `dispatch!` already names the choice of a dtype).
pub(crate) struct AnyDevice;

impl Backend for AnyDevice {
    type Buffer = Storage;
}

impl TransferOps for AnyDevice {
    fn read<T: Element>(ctx: &Ctx, src: &Storage, dst: &mut [T]) -> Result<()> {
        match src {
            Storage::Host(src) => Cpu::read(ctx, src, dst),
            Storage::Cuda(src) => Cuda::read(ctx, src, dst),
        }
    }

    fn write<T: Element>(ctx: &Ctx, dst: &mut Storage, data: &[T]) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::write(ctx, dst, data),
            Storage::Cuda(dst) => Cuda::write(ctx, dst, data),
        }
    }

    /// Host storage `dst` is a plain host copy.
    fn upload(ctx: &Ctx, src: &HostBuffer, dst: &mut Storage) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::upload(ctx, src, dst),
            Storage::Cuda(dst) => Cuda::upload(ctx, src, dst),
        }
    }

    /// Host storage `src` is a plain host copy.
    fn download(ctx: &Ctx, src: &Storage, dst: &mut HostBuffer) -> Result<()> {
        match src {
            Storage::Host(src) => Cpu::download(ctx, src, dst),
            Storage::Cuda(src) => Cuda::download(ctx, src, dst),
        }
    }

    /// Across devices too: host to device uploads, device to host downloads.
    fn copy(ctx: &Ctx, src: &Storage, dst: &mut Storage) -> Result<()> {
        match (src, dst) {
            (Storage::Host(src), Storage::Host(dst)) => Cpu::copy(ctx, src, dst),
            (Storage::Host(src), Storage::Cuda(dst)) => Cuda::upload(ctx, src, dst),
            (Storage::Cuda(src), Storage::Host(dst)) => Cuda::download(ctx, src, dst),
            (Storage::Cuda(src), Storage::Cuda(dst)) => Cuda::copy(ctx, src, dst),
        }
    }

    fn convert(ctx: &Ctx, dtypes: (DType, DType), src: &Storage, dst: &mut Storage) -> Result<()> {
        on_device!(ctx, (src, dst),
            host => Cpu::convert(ctx, dtypes, src, dst),
            cuda => Cuda::convert(ctx, dtypes, src, dst))
    }

    fn zero(ctx: &Ctx, dst: &mut Storage) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::zero(ctx, dst),
            Storage::Cuda(dst) => Cuda::zero(ctx, dst),
        }
    }
}

impl ElementwiseOps for AnyDevice {
    fn fill(ctx: &Ctx, dtype: DType, dst: &mut Storage, value: f64) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::fill(ctx, dtype, dst, value),
            Storage::Cuda(dst) => Cuda::fill(ctx, dtype, dst, value),
        }
    }

    fn arange(ctx: &Ctx, dtype: DType, dst: &mut Storage, start: f64, step: f64) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::arange(ctx, dtype, dst, start, step),
            Storage::Cuda(dst) => Cuda::arange(ctx, dtype, dst, start, step),
        }
    }

    fn eye(ctx: &Ctx, dtype: DType, dst: &mut Storage, n: usize) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::eye(ctx, dtype, dst, n),
            Storage::Cuda(dst) => Cuda::eye(ctx, dtype, dst, n),
        }
    }

    fn randn(ctx: &Ctx, dtype: DType, dst: &mut Storage, draw: Draw) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::randn(ctx, dtype, dst, draw),
            Storage::Cuda(dst) => Cuda::randn(ctx, dtype, dst, draw),
        }
    }

    fn rand(
        ctx: &Ctx,
        dtype: DType,
        dst: &mut Storage,
        draw: Draw,
        range: (f64, f64),
    ) -> Result<()> {
        match dst {
            Storage::Host(dst) => Cpu::rand(ctx, dtype, dst, draw, range),
            Storage::Cuda(dst) => Cuda::rand(ctx, dtype, dst, draw, range),
        }
    }

    fn binary(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        (a, a_dims): Operand<'_, Storage>,
        (b, b_dims): Operand<'_, Storage>,
        (out, out_dims): OperandMut<'_, Storage>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        on_device!(ctx, (a, b, out),
            host => Cpu::binary(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims), on_zero),
            cuda => Cuda::binary(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims), on_zero))
    }

    fn binary_scalar(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        a: &Storage,
        value: f64,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::binary_scalar(ctx, op, dtype, a, value, out),
            cuda => Cuda::binary_scalar(ctx, op, dtype, a, value, out))
    }

    fn compare(
        ctx: &Ctx,
        op: Compare,
        dtype: DType,
        (a, a_dims): Operand<'_, Storage>,
        (b, b_dims): Operand<'_, Storage>,
        (out, out_dims): OperandMut<'_, Storage>,
    ) -> Result<()> {
        on_device!(ctx, (a, b, out),
            host => Cpu::compare(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims)),
            cuda => Cuda::compare(ctx, op, dtype, (a, a_dims), (b, b_dims), (out, out_dims)))
    }

    fn compare_scalar(
        ctx: &Ctx,
        op: Compare,
        dtype: DType,
        a: &Storage,
        value: f64,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::compare_scalar(ctx, op, dtype, a, value, out),
            cuda => Cuda::compare_scalar(ctx, op, dtype, a, value, out))
    }

    fn unary(ctx: &Ctx, op: Unary, dtype: DType, a: &Storage, out: &mut Storage) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::unary(ctx, op, dtype, a, out),
            cuda => Cuda::unary(ctx, op, dtype, a, out))
    }

    fn pow_scalar(
        ctx: &Ctx,
        dtype: DType,
        a: &Storage,
        exponent: f64,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::pow_scalar(ctx, dtype, a, exponent, out),
            cuda => Cuda::pow_scalar(ctx, dtype, a, exponent, out))
    }

    fn binary_inplace(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        (x, x_dims): OperandMut<'_, Storage>,
        src: Option<Operand<'_, Storage>>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        match (x, src) {
            (Storage::Host(x), None) => {
                Cpu::binary_inplace(ctx, op, dtype, (x, x_dims), None, on_zero)
            }
            (Storage::Host(x), Some((Storage::Host(s), s_dims))) => {
                Cpu::binary_inplace(ctx, op, dtype, (x, x_dims), Some((s, s_dims)), on_zero)
            }
            (Storage::Cuda(x), None) => {
                Cuda::binary_inplace(ctx, op, dtype, (x, x_dims), None, on_zero)
            }
            (Storage::Cuda(x), Some((Storage::Cuda(s), s_dims))) => {
                Cuda::binary_inplace(ctx, op, dtype, (x, x_dims), Some((s, s_dims)), on_zero)
            }
            _ => Err(mixed(ctx)),
        }
    }

    fn scale_inplace(ctx: &Ctx, dtype: DType, x: &mut Storage, value: f64) -> Result<()> {
        match x {
            Storage::Host(x) => Cpu::scale_inplace(ctx, dtype, x, value),
            Storage::Cuda(x) => Cuda::scale_inplace(ctx, dtype, x, value),
        }
    }

    fn axpy(
        ctx: &Ctx,
        dtype: DType,
        (x, x_dims): OperandMut<'_, Storage>,
        alpha: f64,
        src: Option<Operand<'_, Storage>>,
    ) -> Result<()> {
        match (x, src) {
            (Storage::Host(x), None) => Cpu::axpy(ctx, dtype, (x, x_dims), alpha, None),
            (Storage::Host(x), Some((Storage::Host(s), s_dims))) => {
                Cpu::axpy(ctx, dtype, (x, x_dims), alpha, Some((s, s_dims)))
            }
            (Storage::Cuda(x), None) => Cuda::axpy(ctx, dtype, (x, x_dims), alpha, None),
            (Storage::Cuda(x), Some((Storage::Cuda(s), s_dims))) => {
                Cuda::axpy(ctx, dtype, (x, x_dims), alpha, Some((s, s_dims)))
            }
            _ => Err(mixed(ctx)),
        }
    }

    fn assign(
        ctx: &Ctx,
        dtype: DType,
        (x, x_dims): OperandMut<'_, Storage>,
        (src, src_dims): Operand<'_, Storage>,
    ) -> Result<()> {
        on_device!(ctx, (x, src),
            host => Cpu::assign(ctx, dtype, (x, x_dims), (src, src_dims)),
            cuda => Cuda::assign(ctx, dtype, (x, x_dims), (src, src_dims)))
    }
}

impl ReduceOps for AnyDevice {
    fn sum(
        ctx: &Ctx,
        of: SumOf,
        (a, dims): Operand<'_, Storage>,
        mask: &[bool],
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::sum(ctx, of, (a, dims), mask, out),
            cuda => Cuda::sum(ctx, of, (a, dims), mask, out))
    }

    fn sum_all(ctx: &Ctx, of: SumOf, a: &Storage, out: &mut Storage) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::sum_all(ctx, of, a, out),
            cuda => Cuda::sum_all(ctx, of, a, out))
    }

    fn max_axis(
        ctx: &Ctx,
        dtype: DType,
        a: &Storage,
        lanes: Lanes,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::max_axis(ctx, dtype, a, lanes, out),
            cuda => Cuda::max_axis(ctx, dtype, a, lanes, out))
    }

    fn argmax_axis(
        ctx: &Ctx,
        dtype: DType,
        a: &Storage,
        lanes: Lanes,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::argmax_axis(ctx, dtype, a, lanes, out),
            cuda => Cuda::argmax_axis(ctx, dtype, a, lanes, out))
    }
}

impl MatmulOps for AnyDevice {
    fn matmul(
        ctx: &Ctx,
        dtype: DType,
        batch: Option<(Batched, usize)>,
        dims: Mnk,
        a: &Storage,
        b: &Storage,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, b, out),
            host => Cpu::matmul(ctx, dtype, batch, dims, a, b, out),
            cuda => Cuda::matmul(ctx, dtype, batch, dims, a, b, out))
    }

    fn linear(
        ctx: &Ctx,
        dtype: DType,
        spec: Linear,
        (x, w): (&Storage, &Storage),
        bias: Option<&Storage>,
        out: &mut Storage,
    ) -> Result<()> {
        match bias {
            None => on_device!(ctx, (x, w, out),
                host => Cpu::linear(ctx, dtype, spec, (x, w), None, out),
                cuda => Cuda::linear(ctx, dtype, spec, (x, w), None, out)),
            Some(b) => on_device!(ctx, (x, w, b, out),
                host => Cpu::linear(ctx, dtype, spec, (x, w), Some(b), out),
                cuda => Cuda::linear(ctx, dtype, spec, (x, w), Some(b), out)),
        }
    }

    fn gemm(
        ctx: &Ctx,
        dtype: DType,
        spec: Gemm,
        a: &Storage,
        b: &Storage,
        out: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (a, b, out),
            host => Cpu::gemm(ctx, dtype, spec, a, b, out),
            cuda => Cuda::gemm(ctx, dtype, spec, a, b, out))
    }

    fn sgd_dense(
        ctx: &Ctx,
        dtype: DType,
        dims: Mnk,
        (x, g): (&Storage, &Storage),
        (v, w): (&mut Storage, &mut Storage),
        step: SgdStep,
    ) -> Result<()> {
        on_device!(ctx, (x, g, v, w),
            host => Cpu::sgd_dense(ctx, dtype, dims, (x, g), (v, w), step),
            cuda => Cuda::sgd_dense(ctx, dtype, dims, (x, g), (v, w), step))
    }
}

impl OptimOps for AnyDevice {
    fn sgd_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut Storage,
        p: &mut Storage,
        velocity: Option<&mut Storage>,
        step: SgdCoeffs,
    ) -> Result<()> {
        match velocity {
            None => on_device!(ctx, (grad, p),
                host => Cpu::sgd_update(ctx, dtype, grad, p, None, step),
                cuda => Cuda::sgd_update(ctx, dtype, grad, p, None, step)),
            Some(v) => on_device!(ctx, (grad, p, v),
                host => Cpu::sgd_update(ctx, dtype, grad, p, Some(v), step),
                cuda => Cuda::sgd_update(ctx, dtype, grad, p, Some(v), step)),
        }
    }

    fn adam_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut Storage,
        p: &mut Storage,
        (m, v): (&mut Storage, &mut Storage),
        step: AdamCoeffs,
    ) -> Result<()> {
        on_device!(ctx, (grad, p, m, v),
            host => Cpu::adam_update(ctx, dtype, grad, p, (m, v), step),
            cuda => Cuda::adam_update(ctx, dtype, grad, p, (m, v), step))
    }

    fn sgd_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<Storage>,
        step: SgdCoeffs,
    ) -> Result<()> {
        on_one_backend(
            ctx,
            tensors,
            |host| Cpu::sgd_update_multi(ctx, dtype, host, step),
            |device| Cuda::sgd_update_multi(ctx, dtype, device, step),
        )
    }

    fn adam_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<Storage>,
        step: AdamCoeffs,
    ) -> Result<()> {
        on_one_backend(
            ctx,
            tensors,
            |host| Cpu::adam_update_multi(ctx, dtype, host, step),
            |device| Cuda::adam_update_multi(ctx, dtype, device, step),
        )
    }
}

/// The tensors of a multi-tensor list of storage, seen as the buffers of one backend (`pick`
/// takes a storage's buffer there, `None` when it is elsewhere).
struct OnBackend<'s, 'l, B> {
    inner: &'s mut (dyn StepTensors<Storage> + 'l),
    pick: fn(&mut Storage) -> Option<&mut B>,
}

impl<B> StepTensors<B> for OnBackend<'_, '_, B> {
    fn len(&self) -> usize {
        self.inner.len()
    }

    fn tensor(&mut self, i: usize) -> Option<StepTensor<'_, B>> {
        let pick = self.pick;
        let t = self.inner.tensor(i)?;
        let [a, b] = t.state;
        let state = [
            match a {
                Some(a) => Some(pick(a)?),
                None => None,
            },
            match b {
                Some(b) => Some(pick(b)?),
                None => None,
            },
        ];
        Some(StepTensor {
            grad: pick(t.grad)?,
            p: pick(t.p)?,
            state,
        })
    }

    fn skip_flag(&mut self) -> Option<&B> {
        let pick = self.pick;
        // The flag is read only; `pick` takes a mutable reference to choose the variant.
        self.inner.skip_flag_mut().and_then(pick).map(|b| &*b)
    }

    fn step_count(&mut self) -> Option<&mut B> {
        let pick = self.pick;
        self.inner.step_count().and_then(pick)
    }
}

fn host_buffer(s: &mut Storage) -> Option<&mut HostBuffer> {
    match s {
        Storage::Host(h) => Some(h),
        Storage::Cuda(_) => None,
    }
}

fn device_buffer(s: &mut Storage) -> Option<&mut cuda::DeviceBuffer> {
    match s {
        Storage::Cuda(d) => Some(d),
        Storage::Host(_) => None,
    }
}

/// Runs a multi-tensor op on the CPU backend when every buffer of `tensors` is host storage,
/// on the CUDA backend when every one is device memory (the backend checks they are one
/// device); mixed gives `DeviceMismatch`, before anything runs. An empty list does nothing.
fn on_one_backend(
    ctx: &Ctx,
    tensors: &mut dyn StepTensors<Storage>,
    host: impl FnOnce(&mut dyn StepTensors<HostBuffer>) -> Result<()>,
    device: impl FnOnce(&mut dyn StepTensors<cuda::DeviceBuffer>) -> Result<()>,
) -> Result<()> {
    let on_host = match tensors.tensor(0) {
        None => return Ok(()),
        Some(t) => matches!(t.p, Storage::Host(_)),
    };
    if on_host {
        let mut list = OnBackend {
            inner: tensors,
            pick: host_buffer,
        };
        if (0..list.len()).any(|i| list.tensor(i).is_none()) {
            return Err(mixed(ctx));
        }
        host(&mut list)
    } else {
        let mut list = OnBackend {
            inner: tensors,
            pick: device_buffer,
        };
        if (0..list.len()).any(|i| list.tensor(i).is_none()) {
            return Err(mixed(ctx));
        }
        device(&mut list)
    }
}

impl NnOps for AnyDevice {
    fn bias_act_grad(
        ctx: &Ctx,
        dtype: DType,
        rows_cols: (usize, usize),
        g: &Storage,
        relu: Option<(&Storage, &mut Storage)>,
        db: &mut Storage,
        accumulate: bool,
    ) -> Result<()> {
        match relu {
            None => on_device!(ctx, (g, db),
                host => Cpu::bias_act_grad(ctx, dtype, rows_cols, g, None, db, accumulate),
                cuda => Cuda::bias_act_grad(ctx, dtype, rows_cols, g, None, db, accumulate)),
            Some((y, dz)) => on_device!(ctx, (g, y, dz, db),
                host => Cpu::bias_act_grad(ctx, dtype, rows_cols, g, Some((y, dz)), db, accumulate),
                cuda => Cuda::bias_act_grad(ctx, dtype, rows_cols, g, Some((y, dz)), db, accumulate)),
        }
    }

    fn softmax(
        ctx: &Ctx,
        dtype: DType,
        a: &Storage,
        lanes: Lanes,
        out: &mut Storage,
        log: bool,
    ) -> Result<()> {
        on_device!(ctx, (a, out),
            host => Cpu::softmax(ctx, dtype, a, lanes, out, log),
            cuda => Cuda::softmax(ctx, dtype, a, lanes, out, log))
    }

    fn first_bad_index(
        ctx: &Ctx,
        dtype: DType,
        indices: &Storage,
        bound: usize,
    ) -> Result<Option<(usize, i64)>> {
        match indices {
            Storage::Host(indices) => Cpu::first_bad_index(ctx, dtype, indices, bound),
            Storage::Cuda(indices) => Cuda::first_bad_index(ctx, dtype, indices, bound),
        }
    }

    fn one_hot(
        ctx: &Ctx,
        dtypes: (DType, DType),
        indices: &Storage,
        depth: usize,
        out: &mut Storage,
    ) -> Result<Option<(usize, i64)>> {
        on_device!(ctx, (indices, out),
            host => Cpu::one_hot(ctx, dtypes, indices, depth, out),
            cuda => Cuda::one_hot(ctx, dtypes, indices, depth, out))
    }

    fn pick(
        ctx: &Ctx,
        dtypes: (DType, DType),
        x: &Storage,
        n_inner: (usize, usize),
        indices: &Storage,
        out: &mut Storage,
    ) -> Result<Option<(usize, i64)>> {
        on_device!(ctx, (x, indices, out),
            host => Cpu::pick(ctx, dtypes, x, n_inner, indices, out),
            cuda => Cuda::pick(ctx, dtypes, x, n_inner, indices, out))
    }

    fn softmax_cross_entropy(
        ctx: &Ctx,
        dtypes: (DType, DType),
        logits: &Storage,
        rows_classes: (usize, usize),
        labels: &Storage,
        (loss, grad): (&mut Storage, Option<&mut Storage>),
    ) -> Result<Option<(usize, i64)>> {
        match (logits, labels, loss, grad) {
            (Storage::Host(x), Storage::Host(l), Storage::Host(loss), None) => {
                Cpu::softmax_cross_entropy(ctx, dtypes, x, rows_classes, l, (loss, None))
            }
            (Storage::Host(x), Storage::Host(l), Storage::Host(loss), Some(Storage::Host(g))) => {
                Cpu::softmax_cross_entropy(ctx, dtypes, x, rows_classes, l, (loss, Some(g)))
            }
            (Storage::Cuda(x), Storage::Cuda(l), Storage::Cuda(loss), None) => {
                Cuda::softmax_cross_entropy(ctx, dtypes, x, rows_classes, l, (loss, None))
            }
            (Storage::Cuda(x), Storage::Cuda(l), Storage::Cuda(loss), Some(Storage::Cuda(g))) => {
                Cuda::softmax_cross_entropy(ctx, dtypes, x, rows_classes, l, (loss, Some(g)))
            }
            #[allow(unreachable_patterns)]
            _ => Err(mixed(ctx)),
        }
    }
}

impl ShapeOps for AnyDevice {
    fn transpose(
        ctx: &Ctx,
        dtype: DType,
        src: &Storage,
        rows_cols: (usize, usize),
        dst: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (src, dst),
            host => Cpu::transpose(ctx, dtype, src, rows_cols, dst),
            cuda => Cuda::transpose(ctx, dtype, src, rows_cols, dst))
    }

    fn permute(
        ctx: &Ctx,
        dtype: DType,
        (src, dims): Operand<'_, Storage>,
        perm: &[usize],
        dst: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (src, dst),
            host => Cpu::permute(ctx, dtype, (src, dims), perm, dst),
            cuda => Cuda::permute(ctx, dtype, (src, dims), perm, dst))
    }

    fn narrow(
        ctx: &Ctx,
        elem: usize,
        src: &Storage,
        lanes: Lanes,
        start: usize,
        dst: &mut Storage,
    ) -> Result<()> {
        on_device!(ctx, (src, dst),
            host => Cpu::narrow(ctx, elem, src, lanes, start, dst),
            cuda => Cuda::narrow(ctx, elem, src, lanes, start, dst))
    }

    /// Every source must be on `dst`'s device.
    fn interleave(
        ctx: &Ctx,
        srcs: &[&Storage],
        row_bytes: &[usize],
        outer: usize,
        dst: &mut Storage,
    ) -> Result<()> {
        match dst {
            Storage::Host(dst) => {
                let mut hosts = Vec::with_capacity(srcs.len());
                for src in srcs {
                    match src {
                        Storage::Host(src) => hosts.push(src),
                        Storage::Cuda(_) => return Err(mixed(ctx)),
                    }
                }
                Cpu::interleave(ctx, &hosts, row_bytes, outer, dst)
            }
            Storage::Cuda(dst) => {
                let mut devices = Vec::with_capacity(srcs.len());
                for src in srcs {
                    match src {
                        Storage::Cuda(src) => devices.push(src),
                        Storage::Host(_) => return Err(mixed(ctx)),
                    }
                }
                Cuda::interleave(ctx, &devices, row_bytes, outer, dst)
            }
        }
    }
}

// ---- ops outside the contract ----

/// Waits for the work queued on `device` and reports errors of earlier asynchronous kernels.
pub(crate) fn synchronize(ctx: &Ctx, device: crate::Device) -> Result<()> {
    match device {
        crate::Device::Cpu => Ok(()),
        crate::Device::Cuda(ordinal) => cuda::synchronize(ctx, ordinal),
    }
}

/// Columns per panel of a packed right operand ([`pack_rhs`]).
pub(crate) const PACK_COLUMNS: usize = cpu::PACK_COLUMNS;

/// Packs the f32 `[k, n]` operand `b` into `out` (`⌈n/PACK_COLUMNS⌉·k·PACK_COLUMNS` f32) for
/// [`packed_matmul`]. CPU only: a `Dense` layer packs f32 weights on the CPU alone.
pub(crate) fn pack_rhs(
    ctx: &Ctx,
    (k, n): (usize, usize),
    b: &Storage,
    out: &mut Storage,
) -> Result<()> {
    match (b, out) {
        (Storage::Host(b), Storage::Host(out)) => {
            cpu::pack_rhs((k, n), b, out);
            Ok(())
        }
        _ => Err(ctx.unsupported("packed operands live in CPU memory only")),
    }
}

/// `out = a · b (+ bias) (then ReLU)` for f32 `a` `[m, k]` and `b` packed by [`pack_rhs`].
pub(crate) fn packed_matmul(
    ctx: &Ctx,
    dims: Mnk,
    (a, packed): (&Storage, &Storage),
    bias: Option<&Storage>,
    relu: bool,
    out: &mut Storage,
) -> Result<()> {
    let bias = match bias {
        None => None,
        Some(Storage::Host(b)) => Some(b),
        Some(_) => return Err(mixed(ctx)),
    };
    match (a, packed, out) {
        (Storage::Host(a), Storage::Host(packed), Storage::Host(out)) => {
            cpu::packed_matmul(dims, a, packed, bias, relu, out);
            Ok(())
        }
        _ => Err(mixed(ctx)),
    }
}
