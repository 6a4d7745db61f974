//! The fused optimizer steps on one device (`kernels/optim.cu`): SGD and Adam/AdamW, one kernel
//! per dtype each, one pass over the elements.

use super::launch::{elements, linear, same_gpu, scalar};
use super::Cuda;
use crate::backend::contract::{AdamCoeffs, OptimOps, SgdCoeffs};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::error::Ctx;
use crate::{DType, Result};

/// `flags` bits of `sgd_update_<T>` (the `SGD_*` defines of `kernels/optim.cu`).
const SGD_WEIGHT_DECAY: i32 = 1;
const SGD_VELOCITY: i32 = 2;
const SGD_NESTEROV: i32 = 4;
const SGD_ZERO_GRAD: i32 = 8;

/// `mode` bits of `adam_update_<T>` (the `ADAM_*` defines of `kernels/optim.cu`): the weight
/// decay added to the gradient, or decoupled; the gradient zeroed once read.
const ADAM_COUPLED: i32 = 1;
const ADAM_DECOUPLED: i32 = 2;
const ADAM_ZERO_GRAD: i32 = 4;

impl OptimOps for Cuda {
    fn sgd_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut DeviceBuffer,
        p: &mut DeviceBuffer,
        velocity: Option<&mut DeviceBuffer>,
        step: SgdCoeffs,
    ) -> Result<()> {
        let gpu = match &velocity {
            Some(v) => same_gpu(ctx, &[p.gpu(), grad.gpu(), v.gpu()])?,
            None => same_gpu(ctx, &[p.gpu(), grad.gpu()])?,
        };
        let n = elements(p, dtype);
        if n == 0 {
            return Ok(());
        }
        let mut flags = 0;
        if step.weight_decay != 0.0 {
            flags |= SGD_WEIGHT_DECAY;
        }
        if step.zero_grad {
            flags |= SGD_ZERO_GRAD;
        }
        let vel = match velocity {
            Some(v) => {
                flags |= SGD_VELOCITY;
                if step.nesterov {
                    flags |= SGD_NESTEROV;
                }
                v.ptr()
            }
            None => 0,
        };
        let f = gpu.kernels.one(ctx, "sgd_update", dtype)?;
        // SAFETY: sgd_update_<T>(T* p, T* grad, T* vel, u64 n, T lr, T mu, T wd, int flags);
        // `p`, `grad` and the velocity are locked storage of `gpu` holding `n` elements each
        // (the front-end checked the shapes), `grad` written only with SGD_ZERO_GRAD; `vel` is
        // only read with SGD_VELOCITY set.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n);
                pp = p.ptr(), pg = grad.ptr(), pv = vel, count = n,
                lr = scalar(dtype, step.lr), mu = scalar(dtype, step.momentum),
                wd = scalar(dtype, step.weight_decay), fl = flags)
        }
    }

    fn adam_update(
        ctx: &Ctx,
        dtype: DType,
        grad: &mut DeviceBuffer,
        p: &mut DeviceBuffer,
        (m, v): (&mut DeviceBuffer, &mut DeviceBuffer),
        step: AdamCoeffs,
    ) -> Result<()> {
        let gpu = same_gpu(ctx, &[p.gpu(), grad.gpu(), m.gpu(), v.gpu()])?;
        let n = elements(p, dtype);
        if n == 0 {
            return Ok(());
        }
        let mut mode = match step.decay {
            Some(_) => ADAM_DECOUPLED,
            None if step.weight_decay != 0.0 => ADAM_COUPLED,
            None => 0,
        };
        if step.zero_grad {
            mode |= ADAM_ZERO_GRAD;
        }
        let s = |value: f64| scalar(dtype, value);
        let f = gpu.kernels.one(ctx, "adam_update", dtype)?;
        // SAFETY: adam_update_<T>(T* p, T* grad, T* m1, T* m2, u64 n, T b1, T c1, T b2, T c2,
        // T eps, T wd, T decay, T step_size, T bias2, int mode); the four buffers are locked
        // storage of `gpu` holding `n` elements each (the front-end checked the shapes), `grad`
        // written only with ADAM_ZERO_GRAD.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n);
                pp = p.ptr(), pg = grad.ptr(), pm = m.ptr(), pv = v.ptr(), count = n,
                b1 = s(step.beta1), c1 = s(1.0 - step.beta1),
                b2 = s(step.beta2), c2 = s(1.0 - step.beta2),
                eps = s(step.eps), wd = s(step.weight_decay), decay = s(step.decay.unwrap_or(1.0)),
                step_size = s(step.step_size), bias2 = s(step.bias2_sqrt), md = mode)
        }
    }
}
