//! The fused elementwise optimizer steps on the host: SGD (momentum, Nesterov, weight decay) and
//! Adam/AdamW, each one pass over the parameters, their gradient and their state, split over the
//! worker pool above `PAR_MIN` elements. The arithmetic is the element type's, operation for
//! operation as the CUDA kernels (`cuda/kernels/optim.cu`) do it.

use super::num::{Float, Num};
use super::pool::{self, SendPtr};
use super::{chunk_len, Work, PAR_MIN};
use crate::backend::contract::{AdamCoeffs, SgdCoeffs};

/// Runs `f(start, end)` over the index ranges of `len` elements: on the calling thread below
/// `PAR_MIN`, else in chunks of `chunk_len(len)` on the pool (each range to one call only), on
/// the threads a pass of `bytes_per_element` bytes per element is worth.
fn split(len: usize, bytes_per_element: usize, f: impl Fn(usize, usize) + Sync) {
    if len < PAR_MIN {
        f(0, len);
    } else {
        let work = Work::Bytes(len.saturating_mul(bytes_per_element));
        pool::for_each_range(len, chunk_len(len), work, |range| f(range.start, range.end));
    }
}

/// The SGD coefficients in the element type.
#[derive(Clone, Copy)]
struct Sgd<T> {
    lr: T,
    mu: T,
    wd: T,
    decay: bool,
    nesterov: bool,
}

/// One SGD step (see `SgdCoeffs`), with `grad` set to zero after it is read when
/// `step.zero_grad` says so. All slices have `p`'s length.
pub(crate) fn sgd_update<T: Num>(
    grad: &mut [T],
    p: &mut [T],
    velocity: Option<&mut [T]>,
    step: SgdCoeffs,
) {
    let len = p.len();
    assert!(
        grad.len() == len && velocity.as_ref().is_none_or(|v| v.len() == len),
        "sgd_update: operands of different lengths"
    );
    let c = Sgd {
        lr: T::from_f64(step.lr),
        mu: T::from_f64(step.momentum),
        wd: T::from_f64(step.weight_decay),
        decay: step.weight_decay != 0.0,
        nesterov: step.nesterov,
    };
    let zero = step.zero_grad;
    let pp = SendPtr(p.as_mut_ptr());
    let gp = SendPtr(grad.as_mut_ptr());
    let vp = velocity.map(|v| SendPtr(v.as_mut_ptr()));
    split(len, 5 * size_of::<T>(), |start, end| {
        let n = end - start;
        // SAFETY: `split` hands each range [start, end) of `0..len` to one call only, so the
        // parts are disjoint; `p`, `grad` and the velocity are distinct slices of `len`
        // elements, all mutably borrowed until this function returns.
        let (p, grad) = unsafe {
            (
                std::slice::from_raw_parts_mut(pp.get().add(start), n),
                std::slice::from_raw_parts_mut(gp.get().add(start), n),
            )
        };
        match (vp, zero) {
            (None, false) => sgd_plain::<T, false>(p, grad, c),
            (None, true) => sgd_plain::<T, true>(p, grad, c),
            (Some(vp), zero) => {
                // SAFETY: as for `p`.
                let v = unsafe { std::slice::from_raw_parts_mut(vp.get().add(start), n) };
                if zero {
                    sgd_momentum::<T, true>(p, grad, v, c);
                } else {
                    sgd_momentum::<T, false>(p, grad, v, c);
                }
            }
        }
    });
}

// The loops take their operands as distinct `&mut` slices (arguments the compiler knows do
// not overlap), so they vectorize without run-time overlap checks.

/// Plain SGD over one range; `ZERO`: the gradient set to zero once read.
#[inline]
fn sgd_plain<T: Num, const ZERO: bool>(p: &mut [T], grad: &mut [T], c: Sgd<T>) {
    for (p, g) in p.iter_mut().zip(grad.iter_mut()) {
        let g0 = *g;
        if ZERO {
            *g = T::from_f64(0.0);
        }
        let g = if c.decay { g0.add(c.wd.mul(*p)) } else { g0 };
        *p = p.sub(c.lr.mul(g));
    }
}

/// SGD with momentum over one range; `ZERO`: the gradient set to zero once read.
#[inline]
fn sgd_momentum<T: Num, const ZERO: bool>(p: &mut [T], grad: &mut [T], v: &mut [T], c: Sgd<T>) {
    for ((p, v), g) in p.iter_mut().zip(v.iter_mut()).zip(grad.iter_mut()) {
        let g0 = *g;
        if ZERO {
            *g = T::from_f64(0.0);
        }
        let g = if c.decay { g0.add(c.wd.mul(*p)) } else { g0 };
        *v = c.mu.mul(*v).add(g);
        let d = if c.nesterov { g.add(c.mu.mul(*v)) } else { *v };
        *p = p.sub(c.lr.mul(d));
    }
}

/// The Adam coefficients in the element type.
#[derive(Clone, Copy)]
struct AdamC<T> {
    b1: T,
    c1: T,
    b2: T,
    c2: T,
    eps: T,
    wd: T,
    step_size: T,
    bias2: T,
    coupled: bool,
    decay: Option<T>,
}

/// One Adam step: `decay ? p *= decay : g = grad + wd·p; m = β1·m + (1−β1)·g;
/// v = β2·v + (1−β2)·g²; p -= step_size·m / (√v / bias2_sqrt + eps)`, with `grad` set to zero
/// after it is read when `step.zero_grad` says so. All slices have `p`'s length.
pub(crate) fn adam_update<T: Float>(
    grad: &mut [T],
    p: &mut [T],
    (m, v): (&mut [T], &mut [T]),
    step: AdamCoeffs,
) {
    let len = p.len();
    assert!(
        grad.len() == len && m.len() == len && v.len() == len,
        "adam_update: operands of different lengths"
    );
    let t = T::from_f64;
    let c = AdamC {
        b1: t(step.beta1),
        c1: t(1.0 - step.beta1),
        b2: t(step.beta2),
        c2: t(1.0 - step.beta2),
        eps: t(step.eps),
        wd: t(step.weight_decay),
        step_size: t(step.step_size),
        bias2: t(step.bias2_sqrt),
        coupled: step.decay.is_none() && step.weight_decay != 0.0,
        decay: step.decay.map(t),
    };
    let zero = step.zero_grad;
    let (pp, gp, mp, vp) = (
        SendPtr(p.as_mut_ptr()),
        SendPtr(grad.as_mut_ptr()),
        SendPtr(m.as_mut_ptr()),
        SendPtr(v.as_mut_ptr()),
    );
    split(len, 7 * size_of::<T>(), |start, end| {
        let n = end - start;
        // SAFETY: `split` hands each range [start, end) of `0..len` to one call only, so the
        // parts are disjoint; `p`, `grad`, `m` and `v` are distinct slices of `len` elements,
        // mutably borrowed until this function returns.
        let (p, grad, m, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(pp.get().add(start), n),
                std::slice::from_raw_parts_mut(gp.get().add(start), n),
                std::slice::from_raw_parts_mut(mp.get().add(start), n),
                std::slice::from_raw_parts_mut(vp.get().add(start), n),
            )
        };
        if zero {
            adam_range::<T, true>(p, grad, (m, v), c);
        } else {
            adam_range::<T, false>(p, grad, (m, v), c);
        }
    });
}

/// Adam over one range; `ZERO`: the gradient set to zero once read.
#[inline]
fn adam_range<T: Float, const ZERO: bool>(
    p: &mut [T],
    grad: &mut [T],
    (m, v): (&mut [T], &mut [T]),
    c: AdamC<T>,
) {
    let pmv = p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut());
    for (((p, m), v), g) in pmv.zip(grad.iter_mut()) {
        let g0 = *g;
        if ZERO {
            *g = T::from_f64(0.0);
        }
        let mut x = *p;
        let g = if c.coupled { g0.add(c.wd.mul(x)) } else { g0 };
        if let Some(decay) = c.decay {
            x = x.mul(decay);
        }
        *m = c.b1.mul(*m).add(c.c1.mul(g));
        *v = c.b2.mul(*v).add(c.c2.mul(g.mul(g)));
        let denom = v.sqrt().div(c.bias2).add(c.eps);
        *p = x.sub(c.step_size.mul(m.div(denom)));
    }
}
