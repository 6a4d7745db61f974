//! Temporary: the contract over the CUDA backend's free functions (removed when the CUDA
//! backend implements it itself).
#![allow(missing_docs)]

use super::contract::{Backend, Draw, Gemm, Lanes, Mnk, Operand, OperandMut, SgdStep, SumOf};
use super::cpu::buffer::HostBuffer;
use super::cuda::{self, DeviceBuffer};
use super::{Batched, Binary, Compare, Unary};
use crate::error::Ctx;
use crate::{DType, Element, Error, Result};

pub(crate) struct Cuda;

type B = DeviceBuffer;

impl Backend for Cuda {
    type Buffer = DeviceBuffer;
    fn read<T: Element>(ctx: &Ctx, src: &B, dst: &mut [T]) -> Result<()> {
        cuda::read(ctx, src, dst)
    }
    fn write<T: Element>(ctx: &Ctx, dst: &mut B, data: &[T]) -> Result<()> {
        cuda::write(ctx, dst, data)
    }
    fn upload(ctx: &Ctx, src: &HostBuffer, dst: &mut B) -> Result<()> {
        cuda::upload(ctx, src, dst)
    }
    fn download(ctx: &Ctx, src: &B, dst: &mut HostBuffer) -> Result<()> {
        cuda::download(ctx, src, dst)
    }
    fn copy(ctx: &Ctx, src: &B, dst: &mut B) -> Result<()> {
        cuda::copy(ctx, src, dst)
    }
    fn convert(ctx: &Ctx, (f, t): (DType, DType), src: &B, dst: &mut B) -> Result<()> {
        cuda::convert(ctx, f, t, src, dst)
    }
    fn zero(ctx: &Ctx, dst: &mut B) -> Result<()> {
        cuda::zero(ctx, dst)
    }
    fn fill(ctx: &Ctx, dtype: DType, dst: &mut B, value: f64) -> Result<()> {
        cuda::fill(ctx, dtype, dst, value)
    }
    fn arange(ctx: &Ctx, dtype: DType, dst: &mut B, start: f64, step: f64) -> Result<()> {
        cuda::arange(ctx, dtype, dst, start, step)
    }
    fn eye(ctx: &Ctx, dtype: DType, dst: &mut B, n: usize) -> Result<()> {
        cuda::eye(ctx, dtype, dst, n)
    }
    fn randn(ctx: &Ctx, dtype: DType, dst: &mut B, d: Draw) -> Result<()> {
        cuda::randn(ctx, dtype, dst, d.seed, d.start)
    }
    fn rand(ctx: &Ctx, dtype: DType, dst: &mut B, d: Draw, (l, h): (f64, f64)) -> Result<()> {
        cuda::rand(ctx, dtype, dst, d.seed, d.start, l, h)
    }
    fn binary(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        a: Operand<'_, B>,
        b: Operand<'_, B>,
        out: OperandMut<'_, B>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        cuda::binary(ctx, op, dtype, a, b, out, on_zero)
    }
    fn binary_scalar(ctx: &Ctx, op: Binary, dtype: DType, a: &B, v: f64, out: &mut B) -> Result<()> {
        cuda::binary_scalar(ctx, op, dtype, a, v, out)
    }
    fn compare(
        ctx: &Ctx,
        op: Compare,
        dtype: DType,
        a: Operand<'_, B>,
        b: Operand<'_, B>,
        out: OperandMut<'_, B>,
    ) -> Result<()> {
        cuda::compare(ctx, op, dtype, a, b, out)
    }
    fn compare_scalar(ctx: &Ctx, op: Compare, dtype: DType, a: &B, v: f64, out: &mut B) -> Result<()> {
        cuda::compare_scalar(ctx, op, dtype, a, v, out)
    }
    fn unary(ctx: &Ctx, op: Unary, dtype: DType, a: &B, out: &mut B) -> Result<()> {
        cuda::unary(ctx, op, dtype, a, out)
    }
    fn pow_scalar(ctx: &Ctx, dtype: DType, a: &B, e: f64, out: &mut B) -> Result<()> {
        cuda::pow_scalar(ctx, dtype, a, e, out)
    }
    fn binary_inplace(
        ctx: &Ctx,
        op: Binary,
        dtype: DType,
        x: OperandMut<'_, B>,
        src: Option<Operand<'_, B>>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        cuda::binary_inplace(ctx, op, dtype, x, src, on_zero)
    }
    fn scale_inplace(ctx: &Ctx, dtype: DType, x: &mut B, v: f64) -> Result<()> {
        cuda::scale_inplace(ctx, dtype, x, v)
    }
    fn axpy(ctx: &Ctx, dtype: DType, x: OperandMut<'_, B>, alpha: f64, src: Option<Operand<'_, B>>) -> Result<()> {
        cuda::axpy(ctx, dtype, x, alpha, src)
    }
    fn assign(ctx: &Ctx, dtype: DType, x: OperandMut<'_, B>, src: Operand<'_, B>) -> Result<()> {
        cuda::assign(ctx, dtype, x, src)
    }
    fn sum(ctx: &Ctx, of: SumOf, a: Operand<'_, B>, mask: &[bool], out: &mut B) -> Result<()> {
        cuda::sum(ctx, of.from, of.to, a, mask, out, of.mean)
    }
    fn sum_all(ctx: &Ctx, of: SumOf, a: &B, out: &mut B) -> Result<()> {
        cuda::sum_all(ctx, of.from, of.to, a, out, of.mean)
    }
    fn max_axis(ctx: &Ctx, dtype: DType, a: &B, l: Lanes, out: &mut B) -> Result<()> {
        cuda::max_axis(ctx, dtype, a, (l.outer, l.len, l.inner), out)
    }
    fn argmax_axis(ctx: &Ctx, dtype: DType, a: &B, l: Lanes, out: &mut B) -> Result<()> {
        cuda::argmax_axis(ctx, dtype, a, (l.outer, l.len, l.inner), out)
    }
    fn matmul(ctx: &Ctx, dtype: DType, batch: Option<(Batched, usize)>, d: Mnk, a: &B, b: &B, out: &mut B) -> Result<()> {
        cuda::matmul(ctx, dtype, batch, (d.m, d.k, d.n), a, b, out)
    }
    fn gemm(ctx: &Ctx, dtype: DType, s: Gemm, a: &B, b: &B, out: &mut B) -> Result<()> {
        let d = s.dims;
        cuda::gemm(ctx, dtype, (d.m, d.k, d.n), (a, s.trans_a), (b, s.trans_b), out, s.accumulate.map(|x| (x.beta, x.alpha)))
    }
    fn sgd_dense(ctx: &Ctx, dtype: DType, d: Mnk, xg: (&B, &B), vw: (&mut B, &mut B), s: SgdStep) -> Result<()> {
        cuda::sgd_dense(ctx, dtype, (d.m, d.k, d.n), xg, vw, s.lr, s.momentum)
    }
    fn softmax(ctx: &Ctx, dtype: DType, a: &B, l: Lanes, out: &mut B, log: bool) -> Result<()> {
        cuda::softmax(ctx, dtype, a, (l.outer, l.len, l.inner), out, log)
    }
    fn first_bad_index(ctx: &Ctx, dtype: DType, i: &B, bound: usize) -> Result<Option<(usize, i64)>> {
        cuda::first_bad_index(ctx, dtype, i, bound)
    }
    fn one_hot(ctx: &Ctx, d: (DType, DType), i: &B, depth: usize, out: &mut B) -> Result<Option<(usize, i64)>> {
        cuda::one_hot(ctx, d, i, depth, out).map(|()| None)
    }
    fn pick(ctx: &Ctx, d: (DType, DType), x: &B, ni: (usize, usize), i: &B, out: &mut B) -> Result<Option<(usize, i64)>> {
        cuda::pick(ctx, d, x, ni, i, out).map(|()| None)
    }
    fn transpose(ctx: &Ctx, dtype: DType, src: &B, rc: (usize, usize), dst: &mut B) -> Result<()> {
        cuda::transpose(ctx, dtype, src, rc, dst)
    }
    fn permute(ctx: &Ctx, dtype: DType, src: Operand<'_, B>, perm: &[usize], dst: &mut B) -> Result<()> {
        cuda::permute(ctx, dtype, src, perm, dst)
    }
    fn narrow(ctx: &Ctx, elem: usize, src: &B, l: Lanes, start: usize, dst: &mut B) -> Result<()> {
        cuda::narrow(ctx, elem, src, (l.outer, l.len, l.inner), start, dst)
    }
    fn interleave(ctx: &Ctx, srcs: &[&B], rb: &[usize], outer: usize, dst: &mut B) -> Result<()> {
        cuda::interleave(ctx, srcs, rb, outer, dst)
    }
}
