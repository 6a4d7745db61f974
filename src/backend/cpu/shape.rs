//! Copies that rearrange elements: transposes (cache-blocked), general permutations, and the
//! block copies behind `narrow`, `concat` and `stack`.
//!
//! Copies that only move whole runs of bytes work on bytes, so they are compiled once; the
//! ones that move single elements are generic over the element type.

use rayon::prelude::*;

use super::{chunk_len, PAR_MIN};

/// Side of a transpose tile: 32 × 32 elements of up to 8 bytes is 8 KiB, which fits in L1 with
/// room for the destination rows.
const TILE: usize = 32;

/// `dst[j, i] = src[i, j]` for `src` of `rows × cols` (row-major) and `dst` of `cols × rows`.
/// Tiled so reads and writes both stay within cache lines; parallel over destination rows for
/// large matrices.
pub(crate) fn transpose<T: Copy + Send + Sync>(src: &[T], rows: usize, cols: usize, dst: &mut [T]) {
    debug_assert!(src.len() == rows * cols && dst.len() == rows * cols);
    if dst.is_empty() {
        return;
    }
    if rows == 1 || cols == 1 {
        dst.copy_from_slice(src);
        return;
    }
    if dst.len() < PAR_MIN || rayon::current_num_threads() < 2 {
        return transpose_rows(src, rows, cols, 0, dst);
    }
    // Whole tiles of destination rows per task.
    let per_task = chunk_len(dst.len()).div_ceil(rows).next_multiple_of(TILE);
    dst.par_chunks_mut(per_task * rows)
        .enumerate()
        .for_each(|(t, d)| transpose_rows(src, rows, cols, t * per_task, d));
}

/// Writes destination rows `[first, first + dst.len() / rows)` of the transpose of `src`.
fn transpose_rows<T: Copy>(src: &[T], rows: usize, cols: usize, first: usize, dst: &mut [T]) {
    let count = dst.len() / rows;
    for jb in (0..count).step_by(TILE) {
        let je = (jb + TILE).min(count);
        for ib in (0..rows).step_by(TILE) {
            let ie = (ib + TILE).min(rows);
            for i in ib..ie {
                let src_row = &src[i * cols + first + jb..i * cols + first + je];
                for (jj, &v) in src_row.iter().enumerate() {
                    dst[(jb + jj) * rows + i] = v;
                }
            }
        }
    }
}

/// The permutation `perm` of `src` (shape `dims`, row-major) into `dst`: output axis `k` is
/// input axis `perm[k]`.
///
/// Axes of size 1 are dropped and output axes that stay adjacent in the input merged, so a
/// permutation that is really a (batched) 2-D transpose uses [`transpose`], one that keeps the
/// last axis copies whole rows, and an identity is one copy.
pub(crate) fn permute<T: Copy + Send + Sync>(
    src: &[T],
    dims: &[usize],
    perm: &[usize],
    dst: &mut [T],
) {
    debug_assert!(dims.len() == perm.len() && src.len() == dst.len());
    if dst.is_empty() {
        return;
    }
    let in_strides = strides(dims);
    // (size, input stride) per output axis, merged.
    let mut axes: Vec<(usize, usize)> = Vec::with_capacity(dims.len());
    for &p in perm {
        let (size, stride) = (dims[p], in_strides[p]);
        if size == 1 {
            continue;
        }
        match axes.last_mut() {
            Some(last) if last.1 == stride * size => *last = (last.0 * size, stride),
            _ => axes.push((size, stride)),
        }
    }
    match axes.as_slice() {
        [] | [(_, 1)] => dst.copy_from_slice(src),
        // Output [a, b] reading input [b, a]: a transpose.
        &[(a, 1), (b, s)] if s == a => transpose(src, b, a, dst),
        // Output [c, a, b] reading input [c, b, a]: a batched transpose.
        &[(_, sc), (a, 1), (b, s)] if s == a && sc == a * b => {
            for (s, d) in src.chunks_exact(a * b).zip(dst.chunks_exact_mut(a * b)) {
                transpose(s, b, a, d);
            }
        }
        _ => gather(src, &axes, dst),
    }
}

/// Row-major strides of `dims`, in elements.
fn strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// `dst` in row-major order of `axes` (size, source stride), read from `src`.
fn gather<T: Copy + Send + Sync>(src: &[T], axes: &[(usize, usize)], dst: &mut [T]) {
    let Some(&(inner, inner_stride)) = axes.last() else {
        dst.copy_from_slice(src);
        return;
    };
    let outer = &axes[..axes.len() - 1];
    let run = |first_row: usize, dst: &mut [T]| {
        // Odometer over the outer axes, starting at `first_row`.
        let mut index = vec![0; outer.len()];
        let mut offset = 0;
        let mut rest = first_row;
        for (k, &(size, stride)) in outer.iter().enumerate().rev() {
            index[k] = rest % size;
            rest /= size;
            offset += index[k] * stride;
        }
        for row in dst.chunks_exact_mut(inner) {
            if inner_stride == 1 {
                row.copy_from_slice(&src[offset..offset + inner]);
            } else {
                for (j, o) in row.iter_mut().enumerate() {
                    *o = src[offset + j * inner_stride];
                }
            }
            for (k, &(size, stride)) in outer.iter().enumerate().rev() {
                index[k] += 1;
                offset += stride;
                if index[k] < size {
                    break;
                }
                index[k] = 0;
                offset -= stride * size;
            }
        }
    };
    if dst.len() < PAR_MIN || dst.len() / inner < 2 {
        return run(0, dst);
    }
    let rows_per_task = chunk_len(dst.len()).div_ceil(inner).max(1);
    dst.par_chunks_mut(rows_per_task * inner)
        .enumerate()
        .for_each(|(t, d)| run(t * rows_per_task, d));
}

/// For `src` seen as `[outer, n, inner]` (bytes), copies `[outer, start..start + len, inner]`
/// into `dst`. `inner` is in bytes.
pub(crate) fn narrow(
    src: &[u8],
    outer: usize,
    n: usize,
    inner: usize,
    start: usize,
    dst: &mut [u8],
) {
    let len = dst.len().checked_div(outer * inner).unwrap_or(0);
    if len == 0 {
        return;
    }
    for (o, d) in dst.chunks_exact_mut(len * inner).enumerate() {
        let from = (o * n + start) * inner;
        d.copy_from_slice(&src[from..from + len * inner]);
    }
}

/// Concatenates, for each of `outer` rows, the row of every source: row `o` of `dst` is
/// `srcs[0][o] ++ srcs[1][o] ++ …`, where row `o` of `srcs[k]` is the `row_bytes[k]` bytes at
/// `o * row_bytes[k]`. `concat` and `stack` are both this copy.
pub(crate) fn interleave(srcs: &[&[u8]], row_bytes: &[usize], outer: usize, dst: &mut [u8]) {
    let total: usize = row_bytes.iter().sum();
    if total == 0 || outer == 0 {
        return;
    }
    let run = |first: usize, dst: &mut [u8]| {
        for (o, d) in dst.chunks_exact_mut(total).enumerate() {
            let o = first + o;
            let mut at = 0;
            for (src, &len) in srcs.iter().zip(row_bytes) {
                d[at..at + len].copy_from_slice(&src[o * len..(o + 1) * len]);
                at += len;
            }
        }
    };
    if dst.len() < PAR_MIN * 4 || outer < 2 {
        return run(0, dst);
    }
    let rows_per_task = (chunk_len(dst.len() / 4) * 4).div_ceil(total).max(1);
    dst.par_chunks_mut(rows_per_task * total)
        .enumerate()
        .for_each(|(t, d)| run(t * rows_per_task, d));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_permute(src: &[u32], dims: &[usize], perm: &[usize]) -> Vec<u32> {
        let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let st = strides(dims);
        let n: usize = dims.iter().product();
        (0..n)
            .map(|flat| {
                let mut rest = flat;
                let mut offset = 0;
                for k in (0..out_dims.len()).rev() {
                    offset += (rest % out_dims[k]) * st[perm[k]];
                    rest /= out_dims[k];
                }
                src[offset]
            })
            .collect()
    }

    #[test]
    fn permutations_match_the_index_formula() {
        let cases: &[(&[usize], &[usize])] = &[
            (&[3, 5], &[1, 0]),
            (&[1, 7], &[1, 0]),
            (&[2, 3, 4], &[0, 2, 1]),
            (&[2, 3, 4], &[2, 0, 1]),
            (&[2, 3, 4], &[1, 0, 2]),
            (&[2, 1, 4, 3], &[3, 1, 0, 2]),
            (&[300, 257], &[1, 0]),
            (&[4, 90, 130], &[0, 2, 1]),
            (&[40, 30, 50], &[2, 1, 0]),
            (&[40, 30, 50], &[1, 0, 2]),
        ];
        for &(dims, perm) in cases {
            let n: usize = dims.iter().product();
            let src: Vec<u32> = (0..n as u32).collect();
            let mut dst = vec![0; n];
            permute(&src, dims, perm, &mut dst);
            assert_eq!(
                dst,
                reference_permute(&src, dims, perm),
                "{dims:?} {perm:?}"
            );
        }
    }
}
