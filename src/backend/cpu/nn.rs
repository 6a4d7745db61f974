//! Neural-network kernels: softmax and log-softmax (numerically stable: the maximum is
//! subtracted first), one-hot encoding, gathering one element per position (`pick`) and the
//! fused softmax cross-entropy.

use super::num::{Float, Num};
use super::{chunk_len, pool, Work, PAR_MIN};
use crate::Element;

/// Softmax (or log-softmax with `log`) along the middle axis of `x` seen as `[outer, n, inner]`.
/// Sums accumulate in f64. Parallel over outer blocks for large inputs.
pub(crate) fn softmax<T: Float>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    out: &mut [T],
    log: bool,
) {
    debug_assert!(x.len() == outer * n * inner && out.len() == x.len());
    let block = n * inner;
    if block == 0 || outer == 0 {
        return;
    }
    let run = |x: &[T], out: &mut [T]| {
        for (x, out) in x.chunks_exact(block).zip(out.chunks_exact_mut(block)) {
            if inner == 1 {
                softmax_row(x, out, log);
            } else {
                softmax_columns(x, inner, out, log);
            }
        }
    };
    if x.len() < PAR_MIN || outer < 2 {
        return run(x, out);
    }
    let per_task = chunk_len(x.len()).div_ceil(block).max(1);
    let len = per_task * block;
    let work = Work::pass::<T>(x.len(), 2);
    pool::for_each_chunk_zip(out, len, x, len, work, |o, x| run(x, o));
}

fn softmax_row<T: Float>(x: &[T], out: &mut [T], log: bool) {
    let max = x[1..].iter().fold(x[0], |m, &v| m.maximum(v));
    if log {
        let sum: f64 = x.iter().map(|&v| v.sub(max).exp().to_f64()).sum();
        let shift = max.add(T::from_f64(sum.ln()));
        for (o, &v) in out.iter_mut().zip(x) {
            *o = v.sub(shift);
        }
    } else {
        let mut sum = 0.0f64;
        for (o, &v) in out.iter_mut().zip(x) {
            let e = v.sub(max).exp();
            *o = e;
            sum += e.to_f64();
        }
        let scale = T::from_f64(1.0 / sum);
        for o in out.iter_mut() {
            *o = o.mul(scale);
        }
    }
}

/// Softmax down the columns of a `[n, width]` block.
fn softmax_columns<T: Float>(x: &[T], width: usize, out: &mut [T], log: bool) {
    let mut max: Vec<T> = x[..width].to_vec();
    for row in x.chunks_exact(width).skip(1) {
        for (m, &v) in max.iter_mut().zip(row) {
            *m = m.maximum(v);
        }
    }
    let mut sum = vec![0.0f64; width];
    for (orow, row) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
        for (((o, &v), &m), s) in orow.iter_mut().zip(row).zip(&max).zip(&mut sum) {
            let e = v.sub(m).exp();
            *s += e.to_f64();
            if !log {
                *o = e;
            }
        }
    }
    if log {
        let shift: Vec<T> = max
            .iter()
            .zip(&sum)
            .map(|(&m, &s)| m.add(T::from_f64(s.ln())))
            .collect();
        for (orow, row) in out.chunks_exact_mut(width).zip(x.chunks_exact(width)) {
            for ((o, &v), &c) in orow.iter_mut().zip(row).zip(&shift) {
                *o = v.sub(c);
            }
        }
    } else {
        let scale: Vec<T> = sum.iter().map(|&s| T::from_f64(1.0 / s)).collect();
        for orow in out.chunks_exact_mut(width) {
            for (o, &c) in orow.iter_mut().zip(&scale) {
                *o = o.mul(c);
            }
        }
    }
}

/// An index as `i64` (exact for `i32`/`u8`; `i64` values beyond 2^53 round but stay far out of
/// any valid range).
#[inline(always)]
fn index<I: Element>(v: I) -> i64 {
    v.to_f64() as i64
}

/// The position and value of the first index not in `0..bound`, if any.
pub(crate) fn first_out_of_range<I: Element>(indices: &[I], bound: usize) -> Option<(usize, i64)> {
    indices.iter().enumerate().find_map(|(p, &v)| {
        let i = index(v);
        (i < 0 || i as u64 >= bound as u64).then_some((p, i))
    })
}

/// `out[p, indices[p]] = 1`, zeros elsewhere, for `out` of `[indices.len(), depth]`. Every
/// index must be in `0..depth` (checked by the caller; an index outside is skipped).
pub(crate) fn one_hot<I: Element, T: Element>(indices: &[I], depth: usize, out: &mut [T]) {
    out.fill(T::ZERO);
    if depth == 0 {
        return;
    }
    for (row, &v) in out.chunks_exact_mut(depth).zip(indices) {
        if let Some(slot) = usize::try_from(index(v)).ok().and_then(|i| row.get_mut(i)) {
            *slot = T::ONE;
        }
    }
}

/// `out[o, j] = x[o, indices[o, j], j]` for `x` seen as `[outer, n, inner]` and `indices`/`out`
/// as `[outer, inner]`. Every index must be in `0..n` (checked by the caller; an index outside
/// gives zero).
pub(crate) fn pick<T: Num, I: Element>(
    x: &[T],
    n: usize,
    inner: usize,
    indices: &[I],
    out: &mut [T],
) {
    if inner == 0 {
        return;
    }
    for (p, (o, &v)) in out.iter_mut().zip(indices).enumerate() {
        let (outer, j) = (p / inner, p % inner);
        *o = usize::try_from(index(v))
            .ok()
            .filter(|&i| i < n)
            .and_then(|i| x.get((outer * n + i) * inner + j))
            .copied()
            .unwrap_or(T::ZERO);
    }
}

/// Softmax cross-entropy of `x` (`[labels.len(), classes]`) against `labels` (each in
/// `0..classes`, checked by the caller; a row with a label outside adds nothing): returns the
/// mean over rows of `-log_softmax(x)[r, labels[r]]`, and writes `(softmax(x) - one_hot(labels))
/// / rows` into `grad` when given. Per row: the maximum `m`, `e = exp(x - m)` in `T`, their sum
/// `s` in f64 (in order); the log-probability `(x[label] - m) - ln s` and the gradient
/// `(e / s - [j == label]) / rows` in f64. So a row whose maximum dwarfs `ln s` (logits of
/// ±1e30) keeps its `ln s`, which `max + ln s` in `T` would round away.
pub(crate) fn softmax_cross_entropy<T: Float, I: Element>(
    x: &[T],
    classes: usize,
    labels: &[I],
    mut grad: Option<&mut [T]>,
) -> T {
    let rows = labels.len();
    debug_assert!(x.len() == rows * classes);
    let inv = 1.0 / rows as f64;
    let mut total = 0.0f64;
    if classes > 0 {
        for (r, (row, &label)) in x.chunks_exact(classes).zip(labels).enumerate() {
            let max = row[1..].iter().fold(row[0], |m, &v| m.maximum(v));
            let sum: f64 = row.iter().map(|&v| v.sub(max).exp().to_f64()).sum();
            let label = usize::try_from(index(label)).ok().filter(|&l| l < classes);
            if let Some(l) = label {
                total += row[l].sub(max).to_f64() - sum.ln();
            }
            if let Some(grad) = grad.as_deref_mut() {
                let out = &mut grad[r * classes..(r + 1) * classes];
                for (j, (o, &v)) in out.iter_mut().zip(row).enumerate() {
                    let p = v.sub(max).exp().to_f64() / sum;
                    let hot = if label == Some(j) { 1.0 } else { 0.0 };
                    *o = T::from_f64((p - hot) * inv);
                }
            }
        }
    }
    T::from_f64(-(total / rows as f64))
}

/// A dense layer's epilogue on its product `out` (`[rows, bias.len()]` row-major, or any rows of
/// `cols` without a bias): the bias added to every row, then with `relu` negatives (and NaN)
/// kept as `max(0, v)` gives them, as `add` then `relu` would.
pub(crate) fn bias_act<T: Num>(out: &mut [T], cols: usize, bias: Option<&[T]>, relu: bool) {
    if cols == 0 {
        return;
    }
    for row in out.chunks_exact_mut(cols) {
        if let Some(bias) = bias {
            for (o, &b) in row.iter_mut().zip(bias) {
                *o = o.add(b);
            }
        }
        if relu {
            for o in row.iter_mut() {
                *o = o.relu();
            }
        }
    }
}

/// The backward of a dense layer's bias and activation over `g` `[rows, cols]`: with `relu`
/// (`y`, the layer's output, and `dz`), `dz = g` where `y > 0` and 0 elsewhere (a selection, so
/// a NaN gradient where the unit was off gives 0, as PyTorch's `threshold_backward`); the bias
/// gradient, each column of `dz` (or `g`) summed down the rows in order, into `db`, or added to
/// it with `accumulate`. Row by row, so every access is sequential; the sum's order per column
/// is the CUDA kernel's.
pub(crate) fn bias_act_grad<T: Num + PartialOrd>(
    (rows, cols): (usize, usize),
    g: &[T],
    mut relu: Option<(&[T], &mut [T])>,
    db: &mut [T],
    accumulate: bool,
) {
    if !accumulate {
        db.fill(T::ZERO);
    }
    if cols == 0 {
        return;
    }
    for r in 0..rows {
        let at = r * cols;
        let g = &g[at..at + cols];
        match relu.as_mut() {
            Some((y, dz)) => {
                let (y, dz) = (&y[at..at + cols], &mut dz[at..at + cols]);
                for (((d, &g), &y), s) in dz.iter_mut().zip(g).zip(y).zip(db.iter_mut()) {
                    *d = if y > T::ZERO { g } else { T::ZERO };
                    *s = s.add(*d);
                }
            }
            None => {
                for (&g, s) in g.iter().zip(db.iter_mut()) {
                    *s = s.add(g);
                }
            }
        }
    }
}
