//! The fused optimizer steps on one device (`kernels/optim.cu`): SGD and Adam/AdamW, one kernel
//! per dtype each, one pass over the elements; and their multi-tensor forms, one launch per
//! group of up to [`MT_TENSORS`] tensors, the tensors' addresses and sizes passed by value in a
//! [`TensorList`] kernel parameter (no copy to the device, no allocation: the launch can be
//! captured into a graph).

use super::launch::{elements, linear, same_gpu, scalar, Arg, Config, THREADS};
use super::Cuda;
use crate::backend::contract::{AdamCoeffs, OptimOps, SgdCoeffs, StepTensors};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::Gpu;
use crate::backend::cuda::kernels::PARAM_BLOCK;
use crate::error::Ctx;
use crate::{DType, Error, Result};

/// Tensors per multi-tensor launch (`MT_TENSORS` of `kernels/optim.cu`): with Adam's nine
/// scalars and its mode, the parameter block is 2,900 bytes, within the 4 KiB a launch passes.
pub(super) const MT_TENSORS: usize = 64;
/// Buffers per tensor in a [`TensorList`] (`MT_DEPTH`): gradient, parameter, two states.
const MT_DEPTH: usize = 4;
/// Elements per block of a multi-tensor launch (`MT_CHUNK`).
const MT_CHUNK: u64 = 4096;
/// The most blocks of one launch (the grid's x dimension).
const MAX_BLOCKS: u64 = i32::MAX as u64;

/// `struct TensorList` of `kernels/optim.cu`, field for field: the tensors of one multi-tensor
/// launch. Block `b` works on the elements `[(b − first)·MT_CHUNK, +MT_CHUNK)` of the tensor
/// `t` with `block_end[t − 1] = first ≤ b < block_end[t]`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct TensorList {
    /// The device addresses of each tensor's gradient, parameter and states (0: none).
    ptr: [[u64; MT_TENSORS]; MT_DEPTH],
    /// Each tensor's elements.
    n: [u64; MT_TENSORS],
    /// The end of each tensor's blocks (cumulative).
    block_end: [u32; MT_TENSORS],
    /// How many tensors are in the list.
    count: i32,
    /// The padding C puts before `skip`, spelled out so that its bytes are set (0): a
    /// recorded launch is compared byte for byte (`capture.rs`).
    pad: i32,
    /// The device address of the step's skip flag (one f32), or 0 for none.
    skip: u64,
}

// The largest multi-tensor parameter block (Adam's: the list, nine 8-byte scalars, the mode)
// fits what a launch may pass.
const _: () = assert!(std::mem::size_of::<TensorList>() + 9 * 8 + 4 <= PARAM_BLOCK);

/// Passed whole, by value: the launch check compares its size with the source's layout of
/// `struct TensorList`.
impl Arg for TensorList {
    fn bytes(&self) -> usize {
        std::mem::size_of::<TensorList>()
    }
}

impl TensorList {
    fn empty() -> TensorList {
        TensorList {
            ptr: [[0; MT_TENSORS]; MT_DEPTH],
            n: [0; MT_TENSORS],
            block_end: [0; MT_TENSORS],
            count: 0,
            pad: 0,
            skip: 0,
        }
    }
}

/// The error for tensor `i` of a multi-tensor list that is not device memory.
fn not_device(ctx: &Ctx, i: usize) -> Error {
    ctx.device_mismatch(format!(
        "`{}`: tensor {i} of the list is not in CUDA memory (move it with to_device)",
        ctx.op
    ))
}

/// Checks a multi-tensor list (every buffer on one device, each tensor's buffers of one length,
/// exactly `depth` buffers per tensor: gradient, parameter and `depth − 2` states), then calls
/// `launch(gpu, list, blocks)` once per group of up to [`MT_TENSORS`] non-empty tensors, in
/// order. Nothing is launched when a check fails.
fn each_launch(
    ctx: &Ctx,
    dtype: DType,
    tensors: &mut dyn StepTensors<DeviceBuffer>,
    depth: usize,
    mut launch: impl FnMut(&'static Gpu, &TensorList, u32) -> Result<()>,
) -> Result<()> {
    let mut gpu: Option<&'static Gpu> = None;
    for i in 0..tensors.len() {
        let t = tensors.tensor(i).ok_or_else(|| not_device(ctx, i))?;
        let [s0, s1] = &t.state;
        let buffers = [Some(&*t.grad), Some(&*t.p), s0.as_deref(), s1.as_deref()];
        for (k, buffer) in buffers.into_iter().enumerate() {
            match (buffer, k < depth) {
                (Some(b), true) => {
                    let first = *gpu.get_or_insert(b.gpu());
                    gpu = Some(same_gpu(ctx, &[first, b.gpu()])?);
                    if b.bytes() != t.p.bytes() {
                        return Err(ctx.shape(format!(
                            "tensor {i} of `{}`: its buffers hold {} and {} bytes",
                            ctx.op,
                            t.p.bytes(),
                            b.bytes()
                        )));
                    }
                }
                (None, false) => {}
                (Some(_), false) | (None, true) => {
                    return Err(ctx.invalid(format!(
                        "tensor {i} of `{}` has {} state buffers where the rule keeps {}",
                        ctx.op,
                        t.state.iter().flatten().count(),
                        depth - 2
                    )))
                }
            }
        }
    }
    let Some(gpu) = gpu else {
        return Ok(());
    };
    let skip = match tensors.skip_flag() {
        Some(flag) => {
            same_gpu(ctx, &[gpu, flag.gpu()])?;
            flag.ptr()
        }
        None => 0,
    };
    let empty = || TensorList {
        skip,
        ..TensorList::empty()
    };
    let mut list = empty();
    let mut blocks = 0u64;
    for i in 0..tensors.len() {
        let t = tensors.tensor(i).ok_or_else(|| not_device(ctx, i))?;
        let n = elements(t.p, dtype);
        if n == 0 {
            continue;
        }
        let need = n.div_ceil(MT_CHUNK);
        if need > MAX_BLOCKS {
            return Err(ctx.unsupported(format!(
                "`{}` on CUDA steps tensors of at most {} elements; tensor {i} has {n}",
                ctx.op,
                MAX_BLOCKS * MT_CHUNK
            )));
        }
        if list.count as usize == MT_TENSORS || blocks + need > MAX_BLOCKS {
            launch(gpu, &list, blocks as u32)?;
            list = empty();
            blocks = 0;
        }
        let c = list.count as usize;
        let [s0, s1] = &t.state;
        let addresses = [
            t.grad.ptr(),
            t.p.ptr(),
            s0.as_ref().map_or(0, |s| s.ptr()),
            s1.as_ref().map_or(0, |s| s.ptr()),
        ];
        for (row, address) in list.ptr.iter_mut().zip(addresses) {
            row[c] = address;
        }
        list.n[c] = n;
        blocks += need;
        list.block_end[c] = blocks as u32;
        list.count += 1;
    }
    if list.count > 0 {
        launch(gpu, &list, blocks as u32)?;
    }
    Ok(())
}

/// The launch configuration of a multi-tensor kernel over `blocks` blocks.
fn multi_config(blocks: u32) -> Config {
    Config {
        blocks,
        threads: (THREADS, 1),
    }
}

/// `flags` of `sgd_update_<T>` and `sgd_multi_<T>` for `step`, with or without a velocity.
fn sgd_flags(step: SgdCoeffs, velocity: bool) -> i32 {
    let mut flags = 0;
    if step.weight_decay != 0.0 {
        flags |= SGD_WEIGHT_DECAY;
    }
    if step.zero_grad {
        flags |= SGD_ZERO_GRAD;
    }
    if velocity {
        flags |= SGD_VELOCITY;
        if step.nesterov {
            flags |= SGD_NESTEROV;
        }
    }
    flags
}

/// `mode` of `adam_update_<T>` and `adam_multi_<T>` for `step`.
fn adam_mode(step: AdamCoeffs) -> i32 {
    let mut mode = match step.decay {
        Some(_) => ADAM_DECOUPLED,
        None if step.weight_decay != 0.0 => ADAM_COUPLED,
        None => 0,
    };
    if step.zero_grad {
        mode |= ADAM_ZERO_GRAD;
    }
    mode
}

/// The dtype of a step's coefficients: the arrays' own, or f32 for the half types, whose steps
/// compute in f32 (as on the CPU; the kernels of `kernels/half.cu` take f32 coefficients).
fn coefficients(dtype: DType) -> DType {
    if dtype.is_half() {
        DType::F32
    } else {
        dtype
    }
}

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
        let flags = sgd_flags(step, velocity.is_some());
        let vel = velocity.map_or(0, |v| v.ptr());
        let f = gpu.kernels.one(ctx, "sgd_update", dtype)?;
        // SAFETY: sgd_update_<T>(T* p, T* grad, T* vel, u64 n, T lr, T mu, T wd, int flags);
        // `p`, `grad` and the velocity are locked storage of `gpu` holding `n` elements each
        // (the front-end checked the shapes), `grad` written only with SGD_ZERO_GRAD; `vel` is
        // only read with SGD_VELOCITY set.
        unsafe {
            launch!(ctx, gpu, f, linear(gpu, n);
                pp = p.ptr(), pg = grad.ptr(), pv = vel, count = n,
                lr = scalar(coefficients(dtype), step.lr), mu = scalar(coefficients(dtype), step.momentum),
                wd = scalar(coefficients(dtype), step.weight_decay), fl = flags)
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
        let mode = adam_mode(step);
        let s = |value: f64| scalar(coefficients(dtype), value);
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
    fn sgd_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<DeviceBuffer>,
        step: SgdCoeffs,
    ) -> Result<()> {
        let velocity = match tensors.tensor(0) {
            Some(t) => t.state[0].is_some(),
            None => return Ok(()),
        };
        let flags = sgd_flags(step, velocity);
        let depth = if velocity { 3 } else { 2 };
        each_launch(ctx, dtype, tensors, depth, |gpu, list, blocks| {
            let f = gpu.kernels.one(ctx, "sgd_multi", dtype)?;
            // SAFETY: sgd_multi_<T>(TensorList l, T lr, T mu, T wd, int flags); every address
            // of `list` is locked storage of `gpu` (checked by `each_launch`) holding the
            // `list.n` elements of its tensor (its buffers are of one length), `blocks` is the
            // list's last block end, the velocity addresses are set (and read) only with
            // SGD_VELOCITY, gradients written only with SGD_ZERO_GRAD; `list.skip` is 0 or the
            // locked one-f32 flag of the step on `gpu` (checked by `each_launch`), only read.
            unsafe {
                launch!(ctx, gpu, f, multi_config(blocks);
                    l = *list,
                    lr = scalar(coefficients(dtype), step.lr), mu = scalar(coefficients(dtype), step.momentum),
                    wd = scalar(coefficients(dtype), step.weight_decay), fl = flags)
            }
        })
    }

    fn adam_update_multi(
        ctx: &Ctx,
        dtype: DType,
        tensors: &mut dyn StepTensors<DeviceBuffer>,
        step: AdamCoeffs,
    ) -> Result<()> {
        let mode = adam_mode(step);
        let s = |value: f64| scalar(coefficients(dtype), value);
        // The device's count of the steps taken, if the step keeps one.
        let count = match tensors.step_count() {
            Some(c) if c.bytes() < 8 => {
                return Err(ctx.invalid("an Adam step's count is one f64 element"));
            }
            Some(c) => Some((c.ptr(), c.gpu())),
            None => None,
        };
        let skip = tensors.skip_flag().map_or(0, |f| f.ptr());
        let mut device = None;
        each_launch(ctx, dtype, tensors, 4, |gpu, list, blocks| {
            if let Some((_, on)) = count {
                same_gpu(ctx, &[gpu, on])?;
            }
            device = Some(gpu);
            let f = gpu.kernels.one(ctx, "adam_multi", dtype)?;
            let cnt = count.map_or(0, |(ptr, _)| ptr);
            // SAFETY: adam_multi_<T>(TensorList l, T b1, T c1, T b2, T c2, T eps, T wd,
            // T decay, T step_size, T bias2, int mode, const double* count, double lr,
            // double b1d, double b2d); every address of `list` is locked storage of `gpu`
            // (checked by `each_launch`, the four of each tensor set) holding the `list.n`
            // elements of its tensor, `blocks` is the list's last block end, gradients written
            // only with ADAM_ZERO_GRAD; `list.skip` is 0 or the step's locked one-f32 flag on
            // `gpu`, only read; `count` is 0 or the step's locked f64 count on `gpu` (checked
            // above, at least 8 bytes), only read.
            unsafe {
                launch!(ctx, gpu, f, multi_config(blocks);
                    l = *list,
                    b1 = s(step.beta1), c1 = s(1.0 - step.beta1),
                    b2 = s(step.beta2), c2 = s(1.0 - step.beta2),
                    eps = s(step.eps), wd = s(step.weight_decay),
                    decay = s(step.decay.unwrap_or(1.0)),
                    step_size = s(step.step_size), bias2 = s(step.bias2_sqrt), md = mode,
                    cnt = cnt, lr = step.lr, b1d = step.beta1, b2d = step.beta2)
            }
        })?;
        if let (Some((cnt, _)), Some(gpu)) = (count, device) {
            let f = gpu.kernels.one(ctx, "adam_count", dtype)?;
            // SAFETY: adam_count_<T>(double* count, const float* skip): `cnt` is the step's
            // locked f64 count on `gpu` (checked above), one element written by one thread;
            // `skip` is 0 or the step's locked one-f32 flag on `gpu`, only read. Queued after
            // the step's launches, which read the count.
            unsafe {
                launch!(ctx, gpu, f, Config { blocks: 1, threads: (32, 1) }; c = cnt, k = skip)
            }?;
        }
        Ok(())
    }
}
