//! The CPU backend: the backend contract (`backend/contract.rs`) on host buffers, what [`crate::backend`]'s entry
//! points run when every operand is on the host. Each op picks the element type and calls the
//! loops of this module's siblings; the kernels are generic parameters there, so each loop is
//! compiled per op and dtype. The elementwise families dispatch from the rows of
//! `backend::op_table` to the kernels of `num.rs`.

use super::buffer::HostBuffer;
use super::elementwise::{self, broadcast_zip, broadcast_zip_inplace};
use super::num::{CastTo, Float, Num};
use super::wide::{self, dispatch_half, Half};
use super::{bf16, matmul, nn, optim, packed, random, reduce, sgd, shape};
use crate::backend::contract::{
    AdamCoeffs, Backend, Draw, ElementwiseOps, Gemm, Lanes, Linear, MatmulOps, Mnk, NnOps, Operand,
    OperandMut, OptimOps, ReduceOps, SgdCoeffs, SgdStep, ShapeOps, StepTensors, SumOf, TransferOps,
};
use crate::backend::op_table::{binary_ops, compare_ops, unary_ops};
use crate::backend::{Batched, Binary, Compare, Unary};
use crate::dtype::{dispatch, dispatch_float};
use crate::error::Ctx;
use crate::{DType, Element, Error, Result};

/// The CPU backend (host memory, the worker pool).
pub(crate) struct Cpu;

macro_rules! cpu_binary {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident)),* $(,)?) => {
        /// Runs `$body` with `$f` bound to the kernel of binary op `$op` (a `Num` method named
        /// after the op) for element type `$t`.
        macro_rules! with_binary {
            ($op:expr, $t:ty, $f:ident => $body:expr) => {
                match $op {
                    $(Binary::$variant => {
                        let $f = <$t as Num>::$name;
                        $body
                    })*
                }
            };
        }
    };
}
binary_ops!(cpu_binary);

macro_rules! cpu_compare {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $cmp:tt)),* $(,)?) => {
        /// Runs `$body` with `$f` bound to the predicate of comparison `$op` (generic over the
        /// operand type, IEEE for floats: NaN compares false).
        macro_rules! with_compare {
            ($op:expr, $f:ident => $body:expr) => {
                match $op {
                    $(Compare::$variant => {
                        #[inline(always)]
                        fn $f<T: PartialOrd>(x: T, y: T) -> bool {
                            x $cmp y
                        }
                        $body
                    })*
                }
            };
        }
    };
}
compare_ops!(cpu_compare);

/// The CPU kernel of one unary row: a `Num` method for every dtype, a `Float` method for
/// floats (the front-end refused other dtypes).
macro_rules! unary_kernel {
    (any, $name:ident, $dtype:expr, $a:expr, $out:expr) => {
        dispatch!($dtype, T => elementwise::map($a.as_slice::<T>(), $out.as_mut_slice::<T>(), <T as Num>::$name))
    };
    (float, $name:ident, $dtype:expr, $a:expr, $out:expr) => {
        dispatch_float!($dtype, T => elementwise::map($a.as_slice::<T>(), $out.as_mut_slice::<T>(), <T as Float>::$name), _ => {})
    };
}

macro_rules! cpu_unary {
    ($($(#[doc = $doc:literal])* ($variant:ident, $name:ident, $dtypes:ident)),* $(,)?) => {
        /// `out = op(a)`: the row's kernel, per dtype.
        fn unary_host(op: Unary, dtype: DType, a: &HostBuffer, out: &mut HostBuffer) {
            match op {
                $(Unary::$variant => unary_kernel!($dtypes, $name, dtype, a, out),)*
            }
        }
    };
}
unary_ops!(cpu_unary);

/// `true` if an integer division by `divisor` would divide by zero.
fn zero_divisor<T: Num>(op: Binary, divisor: &[T]) -> bool {
    op == Binary::Div && !T::DTYPE.is_float() && divisor.iter().any(|v| v.is_zero())
}

impl Backend for Cpu {
    type Buffer = HostBuffer;
}

impl TransferOps for Cpu {
    #[inline]
    fn read<T: Element>(_: &Ctx, src: &HostBuffer, dst: &mut [T]) -> Result<()> {
        elementwise::copy(&src.as_slice::<T>()[..dst.len()], dst);
        Ok(())
    }

    #[inline]
    fn write<T: Element>(_: &Ctx, dst: &mut HostBuffer, data: &[T]) -> Result<()> {
        elementwise::copy(data, dst.as_mut_slice::<T>());
        Ok(())
    }

    #[inline]
    fn upload(_: &Ctx, src: &HostBuffer, dst: &mut HostBuffer) -> Result<()> {
        copy_bytes(src, dst);
        Ok(())
    }

    #[inline]
    fn download(_: &Ctx, src: &HostBuffer, dst: &mut HostBuffer) -> Result<()> {
        copy_bytes(src, dst);
        Ok(())
    }

    #[inline]
    fn copy(_: &Ctx, src: &HostBuffer, dst: &mut HostBuffer) -> Result<()> {
        copy_bytes(src, dst);
        Ok(())
    }

    fn convert(
        _: &Ctx,
        (from, to): (DType, DType),
        src: &HostBuffer,
        dst: &mut HostBuffer,
    ) -> Result<()> {
        if from == to {
            copy_bytes(src, dst);
            return Ok(());
        }
        dispatch!(from, S => dispatch!(to, D => {
            elementwise::map(src.as_slice::<S>(), dst.as_mut_slice::<D>(), <S as CastTo<D>>::cast);
        }));
        Ok(())
    }

    #[inline]
    fn zero(_: &Ctx, dst: &mut HostBuffer) -> Result<()> {
        dst.as_bytes_mut().fill(0);
        Ok(())
    }
}

impl ElementwiseOps for Cpu {
    fn fill(_: &Ctx, dtype: DType, dst: &mut HostBuffer, value: f64) -> Result<()> {
        dispatch!(dtype, T => {
            let v = T::from_f64(value);
            elementwise::map_inplace(dst.as_mut_slice::<T>(), move |_| v);
        });
        Ok(())
    }

    fn arange(_: &Ctx, dtype: DType, dst: &mut HostBuffer, start: f64, step: f64) -> Result<()> {
        dispatch!(dtype, T => {
            for (i, o) in dst.as_mut_slice::<T>().iter_mut().enumerate() {
                *o = T::from_f64(start + i as f64 * step);
            }
        });
        Ok(())
    }

    fn eye(_: &Ctx, dtype: DType, dst: &mut HostBuffer, n: usize) -> Result<()> {
        dst.as_bytes_mut().fill(0);
        dispatch!(dtype, T => {
            let data = dst.as_mut_slice::<T>();
            for i in 0..n {
                data[i * n + i] = T::ONE;
            }
        });
        Ok(())
    }

    fn randn(_: &Ctx, dtype: DType, dst: &mut HostBuffer, draw: Draw) -> Result<()> {
        dispatch!(dtype, T => random::fill_normal(dst.as_mut_slice::<T>(), draw.seed, draw.start));
        Ok(())
    }

    fn rand(
        _: &Ctx,
        dtype: DType,
        dst: &mut HostBuffer,
        draw: Draw,
        (low, high): (f64, f64),
    ) -> Result<()> {
        dispatch!(dtype, T => random::fill_uniform(
            dst.as_mut_slice::<T>(), draw.seed, draw.start, low, high
        ));
        Ok(())
    }

    fn binary(
        _: &Ctx,
        op: Binary,
        dtype: DType,
        (a, a_dims): Operand<'_, HostBuffer>,
        (b, b_dims): Operand<'_, HostBuffer>,
        (out, out_dims): OperandMut<'_, HostBuffer>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        dispatch!(dtype, T => {
            let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
            if zero_divisor(op, b) {
                return Err(on_zero());
            }
            let out = out.as_mut_slice::<T>();
            with_binary!(op, T, f => broadcast_zip(a, a_dims, b, b_dims, out, out_dims, f));
        });
        Ok(())
    }

    fn binary_scalar(
        _: &Ctx,
        op: Binary,
        dtype: DType,
        a: &HostBuffer,
        value: f64,
        out: &mut HostBuffer,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            // Half arrays meet the scalar in f32 (PyTorch's opmath), rounded once.
            let y = value as f32;
            let (a, out) = (a.as_slice::<H>(), out.as_mut_slice::<H>());
            with_binary!(op, f32, f => elementwise::map(a, out, move |x: H| H::narrow(f(x.widen(), y))));
            return Ok(());
        }, _ => {});
        dispatch!(dtype, T => {
            let y = T::from_f64(value);
            let (a, out) = (a.as_slice::<T>(), out.as_mut_slice::<T>());
            with_binary!(op, T, f => elementwise::map(a, out, move |x| f(x, y)));
        });
        Ok(())
    }

    fn compare(
        _: &Ctx,
        op: Compare,
        dtype: DType,
        (a, a_dims): Operand<'_, HostBuffer>,
        (b, b_dims): Operand<'_, HostBuffer>,
        (out, out_dims): OperandMut<'_, HostBuffer>,
    ) -> Result<()> {
        dispatch!(dtype, T => {
            let (a, b) = (a.as_slice::<T>(), b.as_slice::<T>());
            let out = out.as_mut_slice::<u8>();
            with_compare!(op, f => broadcast_zip(a, a_dims, b, b_dims, out, out_dims, |x: T, y: T| u8::from(f(x, y))));
        });
        Ok(())
    }

    fn compare_scalar(
        _: &Ctx,
        op: Compare,
        dtype: DType,
        a: &HostBuffer,
        value: f64,
        out: &mut HostBuffer,
    ) -> Result<()> {
        let out = out.as_mut_slice::<u8>();
        dispatch_float!(dtype, T => {
            // Floats compare in their own precision, so `x.eq_scalar(0.1)` finds the f32 0.1.
            let y = T::from_f64(value);
            with_compare!(op, f => elementwise::map(a.as_slice::<T>(), out, move |x: T| u8::from(f(x, y))));
        }, _ => {
            // Integers compare exactly against the f64 value, so `x.gt_scalar(2.5)` is false
            // for 2 (no truncation of the scalar).
            dispatch!(dtype, T => {
                with_compare!(op, f => elementwise::map(a.as_slice::<T>(), out, move |x: T| u8::from(f(x.to_f64(), value))));
            })
        });
        Ok(())
    }

    fn unary(_: &Ctx, op: Unary, dtype: DType, a: &HostBuffer, out: &mut HostBuffer) -> Result<()> {
        unary_host(op, dtype, a, out);
        Ok(())
    }

    fn pow_scalar(
        _: &Ctx,
        dtype: DType,
        a: &HostBuffer,
        exponent: f64,
        out: &mut HostBuffer,
    ) -> Result<()> {
        dispatch!(dtype, T => {
            elementwise::map(a.as_slice::<T>(), out.as_mut_slice::<T>(), move |x| x.pow_f64(exponent));
        });
        Ok(())
    }

    fn binary_inplace(
        _: &Ctx,
        op: Binary,
        dtype: DType,
        (x, x_dims): OperandMut<'_, HostBuffer>,
        src: Option<Operand<'_, HostBuffer>>,
        on_zero: &dyn Fn() -> Error,
    ) -> Result<()> {
        dispatch!(dtype, T => {
            if let Some((b, b_dims)) = src {
                let b = b.as_slice::<T>();
                if zero_divisor(op, b) {
                    return Err(on_zero());
                }
                with_binary!(op, T, f => broadcast_zip_inplace(x.as_mut_slice::<T>(), x_dims, b, b_dims, f));
            } else {
                let x = x.as_mut_slice::<T>();
                if zero_divisor(op, x) {
                    return Err(on_zero());
                }
                with_binary!(op, T, f => elementwise::map_inplace(x, |v| f(v, v)));
            }
        });
        Ok(())
    }

    fn scale_inplace(_: &Ctx, dtype: DType, x: &mut HostBuffer, value: f64) -> Result<()> {
        dispatch_half!(dtype, H => {
            let y = value as f32;
            elementwise::map_inplace(x.as_mut_slice::<H>(), move |v| H::narrow(v.widen() * y));
            return Ok(());
        }, _ => {});
        dispatch!(dtype, T => {
            let y = T::from_f64(value);
            elementwise::map_inplace(x.as_mut_slice::<T>(), move |v| v.mul(y));
        });
        Ok(())
    }

    fn axpy(
        _: &Ctx,
        dtype: DType,
        (x, x_dims): OperandMut<'_, HostBuffer>,
        alpha: f64,
        src: Option<Operand<'_, HostBuffer>>,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            // `x + alpha·y` in f32, rounded once.
            let a = alpha as f32;
            let target = x.as_mut_slice::<H>();
            let f = move |v: H, y: H| H::narrow(v.widen() + a * y.widen());
            match src {
                Some((b, b_dims)) => broadcast_zip_inplace(target, x_dims, b.as_slice::<H>(), b_dims, f),
                None => elementwise::map_inplace(target, move |v| f(v, v)),
            }
            return Ok(());
        }, _ => {});
        dispatch!(dtype, T => {
            let a = T::from_f64(alpha);
            let target = x.as_mut_slice::<T>();
            match src {
                Some((b, b_dims)) => broadcast_zip_inplace(target, x_dims, b.as_slice::<T>(), b_dims, move |v, y| v.add(a.mul(y))),
                None => elementwise::map_inplace(target, move |v| v.add(a.mul(v))),
            }
        });
        Ok(())
    }

    fn assign(
        _: &Ctx,
        dtype: DType,
        (x, x_dims): OperandMut<'_, HostBuffer>,
        (src, src_dims): Operand<'_, HostBuffer>,
    ) -> Result<()> {
        dispatch!(dtype, T => broadcast_zip_inplace(
            x.as_mut_slice::<T>(), x_dims, src.as_slice::<T>(), src_dims, |_, y| y
        ));
        Ok(())
    }
}

impl ReduceOps for Cpu {
    fn sum(
        _: &Ctx,
        SumOf { from, to, mean }: SumOf,
        (a, dims): Operand<'_, HostBuffer>,
        mask: &[bool],
        out: &mut HostBuffer,
    ) -> Result<()> {
        let count: usize = dims
            .iter()
            .zip(mask)
            .filter(|(_, &r)| r)
            .map(|(&d, _)| d)
            .product();
        let count = count as f64;
        dispatch_float!(from, T => {
            let x = a.as_slice::<T>();
            let conv = |v: T| v.to_f64();
            let add = |p: f64, q: f64| p + q;
            if from == DType::F64 && !mean {
                reduce::fold_axes(x, dims, mask, out.as_mut_slice::<f64>(), 0.0, &conv, &add);
            } else {
                let out = out.as_mut_slice::<T>();
                let mut acc = vec![0.0f64; out.len()];
                reduce::fold_axes(x, dims, mask, &mut acc, 0.0, &conv, &add);
                for (o, s) in out.iter_mut().zip(acc) {
                    *o = T::from_f64(if mean { s / count } else { s });
                }
            }
        }, _ => {
            debug_assert_eq!(to, if mean { DType::F64 } else { DType::I64 });
            dispatch!(from, T => {
                let x = a.as_slice::<T>();
                let conv = |v: T| v.to_i64();
                let add = |p: i64, q: i64| p.wrapping_add(q);
                if mean {
                    let out = out.as_mut_slice::<f64>();
                    let mut acc = vec![0i64; out.len()];
                    reduce::fold_axes(x, dims, mask, &mut acc, 0, &conv, &add);
                    for (o, s) in out.iter_mut().zip(acc) {
                        *o = s as f64 / count;
                    }
                } else {
                    reduce::fold_axes(x, dims, mask, out.as_mut_slice::<i64>(), 0, &conv, &add);
                }
            })
        });
        Ok(())
    }

    fn sum_all(
        _: &Ctx,
        SumOf { from, to, mean }: SumOf,
        a: &HostBuffer,
        out: &mut HostBuffer,
    ) -> Result<()> {
        let n = a.as_bytes().len() / from.size_in_bytes().max(1);
        dispatch_float!(from, T => {
            let sum = reduce::sum_float(a.as_slice::<T>());
            let value = if mean { sum / n as f64 } else { sum };
            out.as_mut_slice::<T>()[0] = T::from_f64(value);
        }, _ => {
            debug_assert_eq!(to, if mean { DType::F64 } else { DType::I64 });
            dispatch!(from, T => {
                let sum = reduce::sum_int(a.as_slice::<T>());
                if mean {
                    out.as_mut_slice::<f64>()[0] = sum as f64 / n as f64;
                } else {
                    out.as_mut_slice::<i64>()[0] = sum;
                }
            })
        });
        Ok(())
    }

    fn max_axis(
        _: &Ctx,
        dtype: DType,
        a: &HostBuffer,
        Lanes { outer, len, inner }: Lanes,
        out: &mut HostBuffer,
    ) -> Result<()> {
        dispatch!(dtype, T => reduce::fold_axis(
            a.as_slice::<T>(), outer, len, inner, out.as_mut_slice::<T>(),
            &|v: T| v, &|p: T, q: T| Num::maximum(p, q),
        ));
        Ok(())
    }

    fn argmax_axis(
        _: &Ctx,
        dtype: DType,
        a: &HostBuffer,
        Lanes { outer, len, inner }: Lanes,
        out: &mut HostBuffer,
    ) -> Result<()> {
        dispatch!(dtype, T => reduce::argmax_axis(
            a.as_slice::<T>(), outer, len, inner, out.as_mut_slice::<i64>(),
        ));
        Ok(())
    }
}

impl MatmulOps for Cpu {
    fn matmul(
        _: &Ctx,
        dtype: DType,
        batch: Option<(Batched, usize)>,
        Mnk { m, k, n }: Mnk,
        a: &HostBuffer,
        b: &HostBuffer,
        out: &mut HostBuffer,
    ) -> Result<()> {
        if dtype == DType::BF16 && bf16::available() {
            // bf16 products on AVX512-BF16: f32 accumulation, the result rounded once.
            let (a, b) = (a.as_slice::<half::bf16>(), b.as_slice::<half::bf16>());
            let out = out.as_mut_slice::<half::bf16>();
            let mut wide_out = wide::Wide::scratch(out.len()); // written entirely by the kernel
            let product = |dims: (usize, usize, usize),
                           a: &[half::bf16],
                           b: &[half::bf16],
                           out: &mut [f32]| {
                let done = bf16::gemm_bf16(dims, (a, false), (b, false), out, None);
                assert!(done, "bf16 kernel refused after `available`");
            };
            match batch {
                None => product((m, k, n), a, b, &mut wide_out),
                Some(batch) => {
                    matmul::batched_with(batch, (m, k, n), a, b, &mut wide_out, &product)
                }
            }
            wide::narrow(&wide_out, out);
            return Ok(());
        }
        dispatch_half!(dtype, H => {
            // Products of halves: f32 operands, f32 accumulation, the result rounded once.
            let (a, b) = (wide::widen(a.as_slice::<H>()), wide::widen(b.as_slice::<H>()));
            let out = out.as_mut_slice::<H>();
            let mut wide_out = wide::Wide::zeros(out.len());
            match batch {
                None => matmul::matmul(m, k, n, &a, &b, &mut wide_out),
                Some(batch) => matmul::matmul_batched(batch, (m, k, n), &a, &b, &mut wide_out),
            }
            wide::narrow(&wide_out, out);
        }, _ => dispatch!(dtype, T => {
            let (a, b, out) = (a.as_slice::<T>(), b.as_slice::<T>(), out.as_mut_slice::<T>());
            match batch {
                None => matmul::matmul(m, k, n, a, b, out),
                Some(batch) => matmul::matmul_batched(batch, (m, k, n), a, b, out),
            }
        }));
        Ok(())
    }

    fn gemm(
        ctx: &Ctx,
        dtype: DType,
        spec: Gemm,
        a: &HostBuffer,
        b: &HostBuffer,
        out: &mut HostBuffer,
    ) -> Result<()> {
        let Mnk { m, k, n } = spec.dims;
        let accumulate = spec.accumulate.map(|s| (s.beta as f32, s.alpha as f32));
        spec.check_rounded(ctx, dtype)?;
        if let Some(operands) = spec.operands {
            // Halves multiplied into f32 (`dtype`): accumulated in f32, no rounding to the half
            // type; bf16 on the AVX512-BF16 kernel where the CPU has it, else widened exactly.
            debug_assert_eq!(dtype, DType::F32);
            if operands == DType::BF16 && bf16::available() {
                let (a, b) = (a.as_slice::<half::bf16>(), b.as_slice::<half::bf16>());
                let out = out.as_mut_slice::<f32>();
                if bf16::gemm_bf16(
                    (m, k, n),
                    (a, spec.trans_a),
                    (b, spec.trans_b),
                    out,
                    accumulate,
                ) {
                    return Ok(());
                }
            }
            dispatch_half!(operands, H => {
                let (a, b) = (wide::widen(a.as_slice::<H>()), wide::widen(b.as_slice::<H>()));
                matmul::gemm_general(
                    (m, k, n), (&a, spec.trans_a), (&b, spec.trans_b),
                    out.as_mut_slice::<f32>(), accumulate,
                );
                return Ok(());
            }, _ => {});
        }
        if dtype == DType::BF16 && bf16::available() {
            let left = (a.as_slice::<half::bf16>(), spec.trans_a);
            let out = out.as_mut_slice::<half::bf16>();
            let mut wide_out = match spec.accumulate {
                Some(_) => wide::widen(out),
                None => wide::Wide::scratch(out.len()), // written, not read
            };
            let (dims, tb) = ((m, k, n), spec.trans_b);
            let done = if spec.rounded_b {
                let right = (b.as_slice::<f32>(), tb);
                bf16::gemm_bf16_rounded_b(dims, left, right, &mut wide_out, accumulate)
            } else {
                let right = (b.as_slice::<half::bf16>(), tb);
                bf16::gemm_bf16(dims, left, right, &mut wide_out, accumulate)
            };
            if done {
                wide::narrow(&wide_out, out);
                return Ok(());
            }
        }
        if spec.rounded_b {
            rounded_gemm(dtype, spec, a, b, out);
            return Ok(());
        }
        dispatch_half!(dtype, H => {
            let (a, b) = (wide::widen(a.as_slice::<H>()), wide::widen(b.as_slice::<H>()));
            let out = out.as_mut_slice::<H>();
            let mut wide_out = match spec.accumulate {
                Some(_) => wide::widen(out),
                None => wide::Wide::zeros(out.len()),
            };
            matmul::gemm_general(
                (m, k, n), (&a, spec.trans_a), (&b, spec.trans_b), &mut wide_out,
                spec.accumulate.map(|s| (s.beta as f32, s.alpha as f32)),
            );
            wide::narrow(&wide_out, out);
            return Ok(());
        }, _ => {});
        dispatch!(dtype, T => matmul::gemm_general(
            (m, k, n), (a.as_slice::<T>(), spec.trans_a), (b.as_slice::<T>(), spec.trans_b),
            out.as_mut_slice::<T>(),
            spec.accumulate.map(|s| (T::from_f64(s.beta), T::from_f64(s.alpha)))
        ));
        Ok(())
    }

    fn linear(
        ctx: &Ctx,
        dtype: DType,
        spec: Linear,
        (x, w): (&HostBuffer, &HostBuffer),
        bias: Option<&HostBuffer>,
        out: &mut HostBuffer,
    ) -> Result<()> {
        spec.check_rounded(ctx, dtype)?;
        let Linear {
            dims,
            relu,
            rounded_w,
        } = spec;
        if dtype == DType::BF16 && bf16::available() {
            // The product (AVX512-BF16) and its epilogue in f32, rounded once.
            let x = x.as_slice::<half::bf16>();
            let bias = bias.map(|b| wide::widen(b.as_slice::<half::bf16>()));
            let out = out.as_mut_slice::<half::bf16>();
            let mut wide_out = wide::Wide::scratch(out.len()); // written entirely by the kernel
            let (mkn, left) = ((dims.m, dims.k, dims.n), (x, false));
            let done = if rounded_w {
                let w = (w.as_slice::<f32>(), false);
                bf16::gemm_bf16_rounded_b(mkn, left, w, &mut wide_out, None)
            } else {
                let w = (w.as_slice::<half::bf16>(), false);
                bf16::gemm_bf16(mkn, left, w, &mut wide_out, None)
            };
            assert!(done, "bf16 kernel refused after `available`");
            nn::bias_act(&mut wide_out, dims.n, bias.as_deref(), relu);
            wide::narrow(&wide_out, out);
            return Ok(());
        }
        dispatch_half!(dtype, H => {
            // The product and its epilogue in f32, rounded once.
            let x = wide::widen(x.as_slice::<H>());
            let w = if rounded_w {
                wide::widen_rounded::<H>(w.as_slice::<f32>(), None)
            } else {
                wide::widen(w.as_slice::<H>())
            };
            let bias = bias.map(|b| wide::widen(b.as_slice::<H>()));
            let out = out.as_mut_slice::<H>();
            let mut wide_out = wide::Wide::zeros(out.len());
            matmul::matmul(dims.m, dims.k, dims.n, &x, &w, &mut wide_out);
            nn::bias_act(&mut wide_out, dims.n, bias.as_deref(), relu);
            wide::narrow(&wide_out, out);
            return Ok(());
        }, _ => {});
        Cpu::matmul(ctx, dtype, None, dims, x, w, out)?;
        dispatch_float!(dtype, T => nn::bias_act(
            out.as_mut_slice::<T>(), dims.n, bias.map(|b| b.as_slice::<T>()), relu
        ), _ => {});
        Ok(())
    }

    fn sgd_dense(
        _: &Ctx,
        dtype: DType,
        dims: Mnk,
        (x, g): (&HostBuffer, &HostBuffer),
        (v, w): (&mut HostBuffer, &mut HostBuffer),
        step: SgdStep,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            let (x, g) = (wide::widen(x.as_slice::<H>()), wide::widen(g.as_slice::<H>()));
            let (v, w) = (v.as_mut_slice::<H>(), w.as_mut_slice::<H>());
            let (mut wv, mut ww) = (wide::widen(v), wide::widen(w));
            sgd::sgd_dense(dims, (&x, &g), (&mut wv, &mut ww), (step.lr as f32, step.momentum as f32));
            wide::narrow(&wv, v);
            wide::narrow(&ww, w);
            return Ok(());
        }, _ => {});
        dispatch_float!(dtype, T => sgd::sgd_dense(
            dims, (x.as_slice::<T>(), g.as_slice::<T>()),
            (v.as_mut_slice::<T>(), w.as_mut_slice::<T>()),
            (T::from_f64(step.lr), T::from_f64(step.momentum))
        ), _ => {});
        Ok(())
    }
}

/// [`Gemm::rounded_b`] without the AVX512-BF16 kernel: `a` and `out` in the half type `dtype`,
/// `b` f32 rounded to it as it is widened, the result rounded once.
fn rounded_gemm(dtype: DType, spec: Gemm, a: &HostBuffer, b: &HostBuffer, out: &mut HostBuffer) {
    let Mnk { m, k, n } = spec.dims;
    let accumulate = spec.accumulate.map(|s| (s.beta as f32, s.alpha as f32));
    dispatch_half!(dtype, H => {
        let a = wide::widen(a.as_slice::<H>());
        // op(b) widened as stored [k, n] (a transposed one transposed as it is widened: the f32
        // kernel reads a transposed right operand slowly).
        let b = wide::widen_rounded::<H>(b.as_slice::<f32>(), spec.trans_b.then_some((n, k)));
        let out = out.as_mut_slice::<H>();
        let mut wide_out = match spec.accumulate {
            Some(_) => wide::widen(out),
            None => wide::Wide::zeros(out.len()),
        };
        matmul::gemm_general((m, k, n), (&a, spec.trans_a), (&b, false), &mut wide_out, accumulate);
        wide::narrow(&wide_out, out);
    }, _ => {});
}

impl OptimOps for Cpu {
    fn sgd_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut HostBuffer,
        p: &mut HostBuffer,
        velocity: Option<&mut HostBuffer>,
        step: SgdCoeffs,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            // The step in f32 on widened copies; each stored value rounded once.
            let (grad, p) = (grad.as_mut_slice::<H>(), p.as_mut_slice::<H>());
            let (mut wg, mut wp) = (wide::widen(grad), wide::widen(p));
            let velocity = velocity.map(|v| v.as_mut_slice::<H>());
            let mut wv = velocity.as_deref().map(wide::widen);
            optim::sgd_update(&mut wg, &mut wp, wv.as_deref_mut(), step);
            wide::narrow(&wg, grad);
            wide::narrow(&wp, p);
            if let (Some(v), Some(wv)) = (velocity, wv) {
                wide::narrow(&wv, v);
            }
            return Ok(());
        }, _ => {});
        dispatch_float!(dtype, T => optim::sgd_update(
            grad.as_mut_slice::<T>(),
            p.as_mut_slice::<T>(),
            velocity.map(|v| v.as_mut_slice::<T>()),
            step,
        ), _ => return Err(ctx.unsupported(format!("`{}` on {dtype}: floats only", ctx.op))));
        Ok(())
    }

    fn adam_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut HostBuffer,
        p: &mut HostBuffer,
        (m, v): (&mut HostBuffer, &mut HostBuffer),
        step: AdamCoeffs,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            let (grad, p) = (grad.as_mut_slice::<H>(), p.as_mut_slice::<H>());
            let (m, v) = (m.as_mut_slice::<H>(), v.as_mut_slice::<H>());
            let (mut wg, mut wp) = (wide::widen(grad), wide::widen(p));
            let (mut wm, mut wv) = (wide::widen(m), wide::widen(v));
            optim::adam_update(&mut wg, &mut wp, (&mut wm, &mut wv), step);
            for (wide, half) in [(&wg, grad), (&wp, p), (&wm, m), (&wv, v)] {
                wide::narrow(wide, half);
            }
            return Ok(());
        }, _ => {});
        dispatch_float!(dtype, T => optim::adam_update(
            grad.as_mut_slice::<T>(),
            p.as_mut_slice::<T>(),
            (m.as_mut_slice::<T>(), v.as_mut_slice::<T>()),
            step,
        ), _ => return Err(ctx.unsupported(format!("`{}` on {dtype}: floats only", ctx.op))));
        Ok(())
    }

    fn sgd_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<HostBuffer>,
        step: SgdCoeffs,
    ) -> Result<()> {
        if skipped(ctx, tensors, step.zero_grad)? {
            return Ok(());
        }
        for i in 0..tensors.len() {
            let t = tensors.tensor(i).ok_or_else(|| not_host(ctx, i))?;
            let [velocity, _] = t.state;
            Self::sgd_update(ctx, dtype, t.grad, t.p, velocity, step)?;
        }
        Ok(())
    }

    fn adam_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<HostBuffer>,
        step: AdamCoeffs,
    ) -> Result<()> {
        if skipped(ctx, tensors, step.zero_grad)? {
            return Ok(());
        }
        let mut step = step;
        if let Some(count) = tensors.step_count() {
            // The bias corrections of the step the count says comes next (as `AdamUpdate`
            // computes them), and one more step taken.
            let taken = count.as_slice::<f64>().first().copied().unwrap_or(0.0);
            let t = taken + 1.0;
            step.step_size = step.lr / (1.0 - step.beta1.powf(t));
            step.bias2_sqrt = (1.0 - step.beta2.powf(t)).sqrt();
            if let Some(c) = count.as_mut_slice::<f64>().first_mut() {
                *c = t;
            }
        }
        for i in 0..tensors.len() {
            let t = tensors.tensor(i).ok_or_else(|| not_host(ctx, i))?;
            match t.state {
                [Some(m), Some(v)] => Self::adam_update(ctx, dtype, t.grad, t.p, (m, v), step)?,
                _ => return Err(ctx.invalid(format!("tensor {i} of an Adam step has no moments"))),
            }
        }
        Ok(())
    }
}

/// Whether a multi-tensor step is skipped by its flag (anything but 0, NaN included); if so,
/// the gradients are zeroed when the step zeroes them, and nothing else changes.
fn skipped(ctx: &Ctx, tensors: &mut dyn StepTensors<HostBuffer>, zero_grad: bool) -> Result<bool> {
    let skip = match tensors.skip_flag() {
        Some(flag) => flag.as_slice::<f32>().first().is_some_and(|&v| v != 0.0),
        None => false,
    };
    if skip && zero_grad {
        for i in 0..tensors.len() {
            let t = tensors.tensor(i).ok_or_else(|| not_host(ctx, i))?;
            t.grad.as_bytes_mut().fill(0);
        }
    }
    Ok(skip)
}

/// The error for tensor `i` of a multi-tensor list that is not in host memory.
fn not_host(ctx: &Ctx, i: usize) -> Error {
    ctx.device_mismatch(format!(
        "`{}`: tensor {i} of the list is not in host memory (move it with to_device)",
        ctx.op
    ))
}

impl NnOps for Cpu {
    fn bias_act_grad(
        _: &Ctx,
        dtype: DType,
        rows_cols: (usize, usize),
        g: &HostBuffer,
        relu: Option<(&HostBuffer, &mut HostBuffer)>,
        db: &mut HostBuffer,
        accumulate: bool,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            // The bias gradient summed in f32, each stored value rounded once.
            let g = wide::widen(g.as_slice::<H>());
            let db = db.as_mut_slice::<H>();
            let mut wdb = if accumulate { wide::widen(db) } else { wide::Wide::zeros(db.len()) };
            match relu {
                Some((y, dz)) => {
                    let y = wide::widen(y.as_slice::<H>());
                    let dz = dz.as_mut_slice::<H>();
                    let mut wdz = wide::Wide::zeros(dz.len());
                    nn::bias_act_grad(rows_cols, &g, Some((&y, &mut wdz)), &mut wdb, accumulate);
                    wide::narrow(&wdz, dz);
                }
                None => nn::bias_act_grad(rows_cols, &g, None, &mut wdb, accumulate),
            }
            wide::narrow(&wdb, db);
            return Ok(());
        }, _ => {});
        dispatch_float!(dtype, T => nn::bias_act_grad(
            rows_cols,
            g.as_slice::<T>(),
            relu.map(|(y, dz)| (y.as_slice::<T>(), dz.as_mut_slice::<T>())),
            db.as_mut_slice::<T>(),
            accumulate,
        ), _ => {});
        Ok(())
    }

    fn softmax(
        _: &Ctx,
        dtype: DType,
        a: &HostBuffer,
        Lanes { outer, len, inner }: Lanes,
        out: &mut HostBuffer,
        log: bool,
    ) -> Result<()> {
        dispatch_half!(dtype, H => {
            let a = wide::widen(a.as_slice::<H>());
            let out = out.as_mut_slice::<H>();
            let mut wide_out = wide::Wide::zeros(out.len());
            nn::softmax(&a, outer, len, inner, &mut wide_out, log);
            wide::narrow(&wide_out, out);
        }, _ => dispatch_float!(dtype, T => nn::softmax(
            a.as_slice::<T>(), outer, len, inner, out.as_mut_slice::<T>(), log
        ), _ => {}));
        Ok(())
    }

    fn first_bad_index(
        _: &Ctx,
        dtype: DType,
        indices: &HostBuffer,
        bound: usize,
    ) -> Result<Option<(usize, i64)>> {
        Ok(dispatch!(dtype, I => nn::first_out_of_range(indices.as_slice::<I>(), bound)))
    }

    fn one_hot(
        _: &Ctx,
        (from, to): (DType, DType),
        indices: &HostBuffer,
        depth: usize,
        out: &mut HostBuffer,
    ) -> Result<Option<(usize, i64)>> {
        dispatch!(from, I => {
            let idx = indices.as_slice::<I>();
            if let Some(bad) = nn::first_out_of_range(idx, depth) {
                return Ok(Some(bad));
            }
            dispatch!(to, T => nn::one_hot(idx, depth, out.as_mut_slice::<T>()));
        });
        Ok(None)
    }

    fn pick(
        _: &Ctx,
        (dtype, from): (DType, DType),
        x: &HostBuffer,
        (n, inner): (usize, usize),
        indices: &HostBuffer,
        out: &mut HostBuffer,
    ) -> Result<Option<(usize, i64)>> {
        dispatch!(from, I => {
            let idx = indices.as_slice::<I>();
            if let Some(bad) = nn::first_out_of_range(idx, n) {
                return Ok(Some(bad));
            }
            dispatch!(dtype, T => nn::pick(x.as_slice::<T>(), n, inner, idx, out.as_mut_slice::<T>()));
        });
        Ok(None)
    }

    fn softmax_cross_entropy(
        ctx: &Ctx,
        (dtype, from): (DType, DType),
        logits: &HostBuffer,
        (_, classes): (usize, usize),
        labels: &HostBuffer,
        (loss, grad): (&mut HostBuffer, Option<&mut HostBuffer>),
    ) -> Result<Option<(usize, i64)>> {
        dispatch!(from, I => {
            let idx = labels.as_slice::<I>();
            if let Some(bad) = nn::first_out_of_range(idx, classes) {
                return Ok(Some(bad));
            }
            dispatch_half!(dtype, H => {
                let x = wide::widen(logits.as_slice::<H>());
                let grad = grad.map(|g| g.as_mut_slice::<H>());
                let mut wide_grad = grad.as_ref().map(|g| wide::Wide::zeros(g.len()));
                let l = nn::softmax_cross_entropy(&x, classes, idx, wide_grad.as_deref_mut());
                loss.as_mut_slice::<H>()[0] = H::from_f64(f64::from(l));
                if let (Some(g), Some(w)) = (grad, wide_grad) {
                    wide::narrow(&w, g);
                }
                return Ok(None);
            }, _ => {});
            dispatch_float!(dtype, T => {
                let grad = grad.map(|g| g.as_mut_slice::<T>());
                loss.as_mut_slice::<T>()[0] =
                    nn::softmax_cross_entropy(logits.as_slice::<T>(), classes, idx, grad);
            }, _ => return Err(ctx.unsupported(format!("`{}` on {dtype}: floats only", ctx.op))));
        });
        Ok(None)
    }
}

impl ShapeOps for Cpu {
    fn transpose(
        _: &Ctx,
        dtype: DType,
        src: &HostBuffer,
        (rows, cols): (usize, usize),
        dst: &mut HostBuffer,
    ) -> Result<()> {
        dispatch!(dtype, T => shape::transpose(src.as_slice::<T>(), rows, cols, dst.as_mut_slice::<T>()));
        Ok(())
    }

    fn permute(
        _: &Ctx,
        dtype: DType,
        (src, dims): Operand<'_, HostBuffer>,
        perm: &[usize],
        dst: &mut HostBuffer,
    ) -> Result<()> {
        dispatch!(dtype, T => shape::permute(src.as_slice::<T>(), dims, perm, dst.as_mut_slice::<T>()));
        Ok(())
    }

    fn narrow(
        _: &Ctx,
        elem: usize,
        src: &HostBuffer,
        Lanes { outer, len, inner }: Lanes,
        start: usize,
        dst: &mut HostBuffer,
    ) -> Result<()> {
        shape::narrow(
            src.as_bytes(),
            outer,
            len,
            inner * elem,
            start,
            dst.as_bytes_mut(),
        );
        Ok(())
    }

    fn interleave(
        _: &Ctx,
        srcs: &[&HostBuffer],
        row_bytes: &[usize],
        outer: usize,
        dst: &mut HostBuffer,
    ) -> Result<()> {
        let srcs: Vec<&[u8]> = srcs.iter().map(|b| b.as_bytes()).collect();
        shape::interleave(&srcs, row_bytes, outer, dst.as_bytes_mut());
        Ok(())
    }
}

/// An array's bytes copied (on the pool's threads when they are many: `elementwise::copy`).
#[inline]
fn copy_bytes(src: &HostBuffer, dst: &mut HostBuffer) {
    elementwise::copy(src.as_bytes(), dst.as_bytes_mut());
}

// ---- CPU only: packed right operands (a `Dense` layer's f32 weights) ----

/// Columns per panel of a packed right operand.
pub(crate) const PACK_COLUMNS: usize = packed::NR;

/// Packs the f32 `[k, n]` operand `b` into `out` for [`packed_matmul`].
pub(crate) fn pack_rhs((k, n): (usize, usize), b: &HostBuffer, out: &mut HostBuffer) {
    packed::pack(k, n, b.as_slice::<f32>(), out.as_mut_slice::<f32>());
}

/// `out = a · b (+ bias) (then ReLU)` for f32 `a` `[m, k]` and `b` packed by [`pack_rhs`].
pub(crate) fn packed_matmul(
    dims: Mnk,
    a: &HostBuffer,
    b: &HostBuffer,
    bias: Option<&HostBuffer>,
    relu: bool,
    out: &mut HostBuffer,
) {
    let epilogue = packed::Epilogue {
        bias: bias.map(HostBuffer::as_slice::<f32>),
        relu,
    };
    packed::packed_matmul(
        dims,
        a.as_slice::<f32>(),
        b.as_slice::<f32>(),
        epilogue,
        out.as_mut_slice::<f32>(),
    );
}
