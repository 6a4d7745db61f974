//! The fused elementwise optimizer steps on the host: SGD (momentum, Nesterov, weight decay) and
//! Adam/AdamW, each one pass over the parameters, their gradient and their state, split over the
//! worker pool above `PAR_MIN` elements. The arithmetic is the element type's, operation for
//! operation as the CUDA kernels (`cuda/kernels/optim.cu`) do it.

use super::num::{Float, Num};
use super::pool::{self, SendPtr};
use super::{chunk_len, PAR_MIN};
use crate::backend::contract::{AdamCoeffs, SgdCoeffs};

/// Runs `f(start, end)` over the index ranges of `len` elements: on the calling thread below
/// `PAR_MIN`, else in chunks of `chunk_len(len)` on the pool (each range to one call only).
fn split(len: usize, f: impl Fn(usize, usize) + Sync) {
    if len < PAR_MIN {
        f(0, len);
    } else {
        pool::for_each_range(len, chunk_len(len), |range| f(range.start, range.end));
    }
}

pub(crate) fn sgd_update<T: Num>(
    grad: &[T],
    p: &mut [T],
    velocity: Option<&mut [T]>,
    step: SgdCoeffs,
) {
    let len = p.len();
    assert!(
        grad.len() == len && velocity.as_ref().is_none_or(|v| v.len() == len),
        "sgd_update: operands of different lengths"
    );
    let (lr, mu, wd) = (
        T::from_f64(step.lr),
        T::from_f64(step.momentum),
        T::from_f64(step.weight_decay),
    );
    let decay = step.weight_decay != 0.0;
    let nesterov = step.nesterov;
    let pp = SendPtr(p.as_mut_ptr());
    let vp = velocity.map(|v| SendPtr(v.as_mut_ptr()));
    split(len, |start, end| {
        // SAFETY: `split` hands each range [start, end) of `0..len` to one call only, so the
        // parts are disjoint; `p` and the velocity are distinct slices of `len` elements, both
        // mutably borrowed until this function returns.
        let p = unsafe { std::slice::from_raw_parts_mut(pp.get().add(start), end - start) };
        let grad = &grad[start..end];
        match vp {
            None => {
                for (p, &g) in p.iter_mut().zip(grad) {
                    let g = if decay { g.add(wd.mul(*p)) } else { g };
                    *p = p.sub(lr.mul(g));
                }
            }
            Some(vp) => {
                // SAFETY: as for `p`.
                let v = unsafe { std::slice::from_raw_parts_mut(vp.get().add(start), end - start) };
                for ((p, v), &g) in p.iter_mut().zip(v.iter_mut()).zip(grad) {
                    let g = if decay { g.add(wd.mul(*p)) } else { g };
                    *v = mu.mul(*v).add(g);
                    let d = if nesterov { g.add(mu.mul(*v)) } else { *v };
                    *p = p.sub(lr.mul(d));
                }
            }
        }
    });
}

/// One Adam step: `decay ? p *= decay : g = grad + wd·p; m = β1·m + (1−β1)·g;
/// v = β2·v + (1−β2)·g²; p -= step_size·m / (√v / bias2_sqrt + eps)`. All slices have `p`'s
/// length.
pub(crate) fn adam_update<T: Float>(
    grad: &[T],
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
    let (b1, c1, b2, c2) = (
        t(step.beta1),
        t(1.0 - step.beta1),
        t(step.beta2),
        t(1.0 - step.beta2),
    );
    let (eps, wd, step_size, bias2) = (
        t(step.eps),
        t(step.weight_decay),
        t(step.step_size),
        t(step.bias2_sqrt),
    );
    let coupled = step.decay.is_none() && step.weight_decay != 0.0;
    let decay = step.decay.map(t);
    let (pp, mp, vp) = (
        SendPtr(p.as_mut_ptr()),
        SendPtr(m.as_mut_ptr()),
        SendPtr(v.as_mut_ptr()),
    );
    split(len, |start, end| {
        let n = end - start;
        // SAFETY: `split` hands each range [start, end) of `0..len` to one call only, so the
        // parts are disjoint; `p`, `m` and `v` are distinct slices of `len` elements, mutably
        // borrowed until this function returns.
        let (p, m, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(pp.get().add(start), n),
                std::slice::from_raw_parts_mut(mp.get().add(start), n),
                std::slice::from_raw_parts_mut(vp.get().add(start), n),
            )
        };
        let grad = &grad[start..end];
        for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grad) {
            let mut x = *p;
            let g = if coupled { g.add(wd.mul(x)) } else { g };
            if let Some(decay) = decay {
                x = x.mul(decay);
            }
            *m = b1.mul(*m).add(c1.mul(g));
            *v = b2.mul(*v).add(c2.mul(g.mul(g)));
            let denom = v.sqrt().div(bias2).add(eps);
            *p = x.sub(step_size.mul(m.div(denom)));
        }
    });
}
