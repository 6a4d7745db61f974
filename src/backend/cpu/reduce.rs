//! Reductions. Float sums accumulate in eight lanes per 4096-element block (vectorised), blocks
//! are combined in f64, and large inputs are split across the pool; integer sums wrap in i64.
//!
//! Reductions over axes see the input as `[outer, n, inner]` (the reduced axis between the kept
//! ones): `inner == 1` is a reduction of contiguous rows (the last axis), `outer == 1` one of
//! whole rows into a row of accumulators (the first axis). Several reduced axes are folded one
//! group at a time, last first. Work is split across the pool by outer rows when there are
//! enough of them, else by columns or by slices of the reduced axis.

use super::num::Num;
use super::{chunk_len, pool, Work, PAR_MIN};
use crate::backend::layout::reduction_passes;
use crate::Element;

const BLOCK: usize = 4096;

fn block_sum_f64<T: Element>(block: &[T]) -> f64 {
    // Eight independent accumulators in the element type let the compiler vectorise; the
    // block is short enough that f32 rounding stays at the level of pairwise summation.
    let mut lanes = [0.0f64; 8];
    let mut chunks = block.chunks_exact(8);
    if T::DTYPE == crate::DType::F32 {
        let mut acc = [0.0f32; 8];
        for c in &mut chunks {
            for (l, &x) in acc.iter_mut().zip(c) {
                *l += x.to_f64() as f32;
            }
        }
        for (l, a) in lanes.iter_mut().zip(acc) {
            *l = a as f64;
        }
    } else {
        for c in &mut chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += x.to_f64();
            }
        }
    }
    let tail: f64 = chunks.remainder().iter().map(|x| x.to_f64()).sum();
    lanes.iter().sum::<f64>() + tail
}

/// The sum of a float slice, in f64.
pub(crate) fn sum_float<T: Element>(x: &[T]) -> f64 {
    if x.len() < PAR_MIN {
        return x.chunks(BLOCK).map(block_sum_f64).sum();
    }
    let chunk = chunk_len(x.len()).next_multiple_of(BLOCK);
    let part = |t: usize| {
        let c = pool::chunk_at(x, chunk, t);
        c.chunks(BLOCK).map(block_sum_f64).sum::<f64>()
    };
    let work = Work::pass::<T>(x.len(), 1);
    pool::fold_tasks(x.len().div_ceil(chunk), work, part, |a, b| a + b).unwrap_or(0.0)
}

/// The wrapping sum of an integer slice, in i64 (exact: elements convert with
/// [`Num::to_i64`], not through f64).
pub(crate) fn sum_int<T: Num>(x: &[T]) -> i64 {
    let int = |v: T| v.to_i64();
    if x.len() < PAR_MIN {
        return x.iter().fold(0i64, |acc, &v| acc.wrapping_add(int(v)));
    }
    let chunk = chunk_len(x.len());
    let part = |t: usize| {
        let c = pool::chunk_at(x, chunk, t);
        c.iter().fold(0i64, |acc, &v| acc.wrapping_add(int(v)))
    };
    let work = Work::pass::<T>(x.len(), 1);
    pool::fold_tasks(x.len().div_ceil(chunk), work, part, i64::wrapping_add).unwrap_or(0)
}

/// Outer blocks from which a reduction over an axis is split by whole blocks (each folded as on
/// one thread); with fewer, each block is split itself.
const SPLIT_OUTER: usize = 16;

/// Columns per tile of a column fold: the tile of accumulators stays in L1.
const COLUMN_TILE: usize = 512;

/// Folds a non-empty row with eight independent accumulators (so sums vectorise), then combines
/// the lanes pairwise.
#[inline]
fn fold_row<T, A, C, F>(row: &[T], conv: &C, comb: &F) -> A
where
    T: Copy,
    A: Copy,
    C: Fn(T) -> A,
    F: Fn(A, A) -> A,
{
    debug_assert!(!row.is_empty());
    if row.len() < 16 {
        return row[1..]
            .iter()
            .fold(conv(row[0]), |acc, &v| comb(acc, conv(v)));
    }
    let mut lanes: [A; 8] = std::array::from_fn(|l| conv(row[l]));
    let mut chunks = row[8..].chunks_exact(8);
    for c in &mut chunks {
        for (lane, &v) in lanes.iter_mut().zip(c) {
            *lane = comb(*lane, conv(v));
        }
    }
    let [l0, l1, l2, l3, l4, l5, l6, l7] = lanes;
    let mut acc = comb(
        comb(comb(l0, l1), comb(l2, l3)),
        comb(comb(l4, l5), comb(l6, l7)),
    );
    for &v in chunks.remainder() {
        acc = comb(acc, conv(v));
    }
    acc
}

/// Folds the `n` rows of `x` (`[n, width]`, `width == out.len()`) into `out`, column by column,
/// in tiles so the accumulators stay in cache.
fn fold_columns<T, A, C, F>(x: &[T], n: usize, width: usize, out: &mut [A], conv: &C, comb: &F)
where
    T: Copy,
    A: Copy,
    C: Fn(T) -> A,
    F: Fn(A, A) -> A,
{
    fold_column_range(x, n, width, 0, out, conv, comb);
}

/// Like [`fold_columns`] for columns `[first, first + out.len())` of the `[n, width]` block `x`.
fn fold_column_range<T, A, C, F>(
    x: &[T],
    n: usize,
    width: usize,
    first: usize,
    out: &mut [A],
    conv: &C,
    comb: &F,
) where
    T: Copy,
    A: Copy,
    C: Fn(T) -> A,
    F: Fn(A, A) -> A,
{
    debug_assert!(n >= 1 && x.len() == n * width && first + out.len() <= width);
    let mut start = 0;
    for tile in out.chunks_mut(COLUMN_TILE) {
        let (col, len) = (first + start, tile.len());
        for (o, &v) in tile.iter_mut().zip(&x[col..col + len]) {
            *o = conv(v);
        }
        for i in 1..n {
            let row = &x[i * width + col..i * width + col + len];
            for (o, &v) in tile.iter_mut().zip(row) {
                *o = comb(*o, conv(v));
            }
        }
        start += len;
    }
}

/// Folds `[outer, n, inner]` blocks of `x` (each `n * inner` long) into `out` (`[outer, inner]`)
/// on the calling thread.
fn fold_blocks<T, A, C, F>(x: &[T], n: usize, inner: usize, out: &mut [A], conv: &C, comb: &F)
where
    T: Copy,
    A: Copy,
    C: Fn(T) -> A,
    F: Fn(A, A) -> A,
{
    if inner == 1 {
        for (o, row) in out.iter_mut().zip(x.chunks_exact(n)) {
            *o = fold_row(row, conv, comb);
        }
    } else {
        for (o, block) in out.chunks_exact_mut(inner).zip(x.chunks_exact(n * inner)) {
            fold_columns(block, n, inner, o, conv, comb);
        }
    }
}

/// `out[o, j] = fold(conv(x[o, 0, j]), conv(x[o, 1, j]), …)` with `comb`, for `x` seen as
/// `[outer, n, inner]` with `n ≥ 1` and `out` as `[outer, inner]`. Parallel for large inputs.
pub(crate) fn fold_axis<T, A, C, F>(
    x: &[T],
    outer: usize,
    n: usize,
    inner: usize,
    out: &mut [A],
    conv: &C,
    comb: &F,
) where
    T: Copy + Send + Sync,
    A: Copy + Send + Sync,
    C: Fn(T) -> A + Sync,
    F: Fn(A, A) -> A + Sync,
{
    debug_assert!(n >= 1 && x.len() == outer * n * inner && out.len() == outer * inner);
    if out.is_empty() {
        return;
    }
    // Every choice below (serial or split, how, and where the chunks end) depends on the sizes
    // alone, so the order partial results are combined in is the same for any thread count.
    if x.len() < PAR_MIN {
        return fold_blocks(x, n, inner, out, conv, comb);
    }
    let block = n * inner;
    let work = Work::pass::<T>(x.len(), 1);
    if outer >= SPLIT_OUTER {
        let per_task = chunk_len(x.len()).div_ceil(block).max(1);
        pool::for_each_chunk_zip(out, per_task * inner, x, per_task * block, work, |o, x| {
            fold_blocks(x, n, inner, o, conv, comb)
        });
        return;
    }
    // Few outer blocks, each large: split each one.
    let task_len = chunk_len(block);
    let work = Work::pass::<T>(block, 1);
    for (x, out) in x.chunks_exact(block).zip(out.chunks_exact_mut(inner)) {
        if inner >= n && inner > COLUMN_TILE {
            // Wide: split the columns.
            let cols = task_len.div_ceil(n).max(COLUMN_TILE);
            pool::for_each_chunk_mut(out, cols, work, |t, o| {
                fold_column_range(x, n, inner, t * cols, o, conv, comb)
            });
        } else {
            // Tall: fold slices of the reduced axis into partial rows, then combine them in
            // order (the same order a sequential fold would use).
            let rows = task_len.div_ceil(inner).max(1);
            let len = rows * inner;
            let part = |t: usize| {
                let x = pool::chunk_at(x, len, t);
                let mut part = Vec::with_capacity(inner);
                let first = conv(x[0]);
                part.resize(inner, first);
                fold_blocks(x, x.len() / inner, inner, &mut part, conv, comb);
                part
            };
            let combine = |mut acc: Vec<A>, part: Vec<A>| {
                for (o, p) in acc.iter_mut().zip(part) {
                    *o = comb(*o, p);
                }
                acc
            };
            if let Some(total) = pool::fold_tasks(x.len().div_ceil(len), work, part, combine) {
                out.copy_from_slice(&total);
            }
        }
    }
}

/// Folds the axes of `x` (shape `dims`) marked in `reduced`, writing the kept axes, in order, to
/// `out`. An empty reduction (a reduced axis of size 0) writes `empty`.
///
/// Size-1 axes are ignored and adjacent axes of the same kind merged, so a reduction is one
/// [`fold_axis`] per run of reduced axes (a sum over the last or first axis of a contiguous
/// array is a single pass). Later passes fold the accumulators with `comb`.
pub(crate) fn fold_axes<T, A, C, F>(
    x: &[T],
    dims: &[usize],
    reduced: &[bool],
    out: &mut [A],
    empty: A,
    conv: &C,
    comb: &F,
) where
    T: Copy + Send + Sync,
    A: Copy + Send + Sync,
    C: Fn(T) -> A + Sync,
    F: Fn(A, A) -> A + Sync,
{
    debug_assert_eq!(dims.len(), reduced.len());
    if out.is_empty() {
        return;
    }
    if x.is_empty() {
        out.fill(empty);
        return;
    }
    let passes = reduction_passes(dims, reduced);
    let Some((first, rest)) = passes.split_first() else {
        // Every reduced axis has size 1: nothing to combine.
        super::elementwise::map(x, out, conv);
        return;
    };
    let Some((last, middle)) = rest.split_last() else {
        return fold_axis(x, first.outer, first.n, first.inner, out, conv, comb);
    };
    // Several runs: fold the last into accumulators, then fold the accumulators run by run
    // (each pass removes one run and merges its kept neighbours) until the first run, which
    // folds into `out`.
    let mut acc = vec![empty; first.outer * first.inner];
    fold_axis(x, first.outer, first.n, first.inner, &mut acc, conv, comb);
    let identity = |v: A| v;
    for p in middle {
        let mut next = vec![empty; p.outer * p.inner];
        fold_axis(&acc, p.outer, p.n, p.inner, &mut next, &identity, comb);
        acc = next;
    }
    fold_axis(&acc, last.outer, last.n, last.inner, out, &identity, comb);
}

/// Whether `v` beats the best so far for `argmax`: larger, or the first NaN (NaN is the
/// maximum, as in PyTorch). Ties keep the earlier index.
#[inline(always)]
fn beats<T: Num>(v: T, best: T) -> bool {
    v > best || (v.is_nan() && !best.is_nan())
}

/// The index of the maximum of a non-empty row (first on ties; first NaN if any).
fn argmax_row<T: Num>(row: &[T]) -> (T, usize) {
    let mut best = (row[0], 0);
    for (i, &v) in row.iter().enumerate().skip(1) {
        if beats(v, best.0) {
            best = (v, i);
        }
    }
    best
}

/// `argmax` over the `n` rows of a `[n, width]` block, into `out` (`width` long).
fn argmax_columns<T: Num>(x: &[T], n: usize, width: usize, out: &mut [i64]) {
    let mut best: Vec<T> = x[..width].to_vec();
    out.fill(0);
    for i in 1..n {
        let row = &x[i * width..(i + 1) * width];
        for ((b, o), &v) in best.iter_mut().zip(out.iter_mut()).zip(row) {
            if beats(v, *b) {
                *b = v;
                *o = i as i64;
            }
        }
    }
}

fn argmax_blocks<T: Num>(x: &[T], n: usize, inner: usize, out: &mut [i64]) {
    if inner == 1 {
        for (o, row) in out.iter_mut().zip(x.chunks_exact(n)) {
            *o = argmax_row(row).1 as i64;
        }
    } else {
        for (o, block) in out.chunks_exact_mut(inner).zip(x.chunks_exact(n * inner)) {
            argmax_columns(block, n, inner, o);
        }
    }
}

/// `out[o, j]` = the index along the middle axis of the maximum of `x` seen as
/// `[outer, n, inner]`, `n ≥ 1` (first on ties; the first NaN if any). Parallel for large inputs.
pub(crate) fn argmax_axis<T: Num>(x: &[T], outer: usize, n: usize, inner: usize, out: &mut [i64]) {
    debug_assert!(n >= 1 && x.len() == outer * n * inner && out.len() == outer * inner);
    if out.is_empty() {
        return;
    }
    if x.len() < PAR_MIN {
        return argmax_blocks(x, n, inner, out);
    }
    let block = n * inner;
    if outer >= SPLIT_OUTER {
        let per_task = chunk_len(x.len()).div_ceil(block).max(1);
        let work = Work::pass::<T>(x.len(), 1);
        pool::for_each_chunk_zip(out, per_task * inner, x, per_task * block, work, |o, x| {
            argmax_blocks(x, n, inner, o)
        });
        return;
    }
    for (x, out) in x.chunks_exact(block).zip(out.chunks_exact_mut(inner)) {
        if inner == 1 {
            // One long row: the best of each slice, then the best of those (earliest on ties).
            let len = chunk_len(n);
            let best_of = |t: usize| {
                let (v, i) = argmax_row(pool::chunk_at(x, len, t));
                (v, t * len + i)
            };
            let earlier_unless_beaten = |best: (T, usize), next: (T, usize)| {
                if beats(next.0, best.0) {
                    next
                } else {
                    best
                }
            };
            if let Some((_, i)) = pool::fold_tasks(
                x.len().div_ceil(len),
                Work::pass::<T>(block, 1),
                best_of,
                earlier_unless_beaten,
            ) {
                out[0] = i as i64;
            }
        } else {
            argmax_columns(x, n, inner, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_sums_are_accurate_and_parallel_sums_agree() {
        let x: Vec<f32> = (0..1_000_003).map(|i| ((i % 97) as f32) * 0.01).collect();
        let exact: f64 = x.iter().map(|&v| v as f64).sum();
        assert!((sum_float(&x) - exact).abs() < 1e-6 * exact);
        let small: Vec<f64> = vec![0.5; 17];
        assert_eq!(sum_float(&small), 8.5);
        let ints: Vec<i32> = (0..100_000).collect();
        assert_eq!(sum_int(&ints), 4_999_950_000);
    }
}
