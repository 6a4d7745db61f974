//! Copies that rearrange elements: transposes (cache-blocked), general permutations, and the
//! block copies behind `narrow`, `concat` and `stack`.
//!
//! Copies that only move whole runs of bytes work on bytes, so they are compiled once; the
//! ones that move single elements are generic over the element type.

use super::{chunk_len, pool, Work, PAR_MIN};
use crate::backend::layout::contiguous_strides;

/// Side of a transpose tile: a 32 × 32 tile of up to 8-byte elements is 8 KiB, in L1.
const TILE: usize = 32;

/// `dst[d0 + a·d_a + b] = src[s0 + a + b·s_b]` for `a < na`, `b < nb`: a strided 2-D transpose.
///
/// Each tile is read row by row from `src` into a small contiguous buffer (transposing there)
/// and written row by row to `dst`, so every cache line of `src` and `dst` is touched in one
/// burst. Scattering straight into `dst` instead thrashes the cache when the row stride is a
/// power of two (1024 × 1024 f32: every row of a tile maps to the same cache set).
fn transpose_tiles<T: Copy + Default>(
    (src, s0, s_b): (&[T], usize, usize),
    (na, nb): (usize, usize),
    (dst, d0, d_a): (&mut [T], usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if std::mem::size_of::<T>() == 4 && avx2() {
        // SAFETY: T is a 4-byte `Copy` element type (f32 or i32 here), so its bits can move
        // through f32 lanes unchanged: the kernel only loads, shuffles and stores, never
        // computes; AVX2 was just detected.
        return unsafe { transpose_4byte_avx2((src, s0, s_b), (na, nb), (dst, d0, d_a)) };
    }
    let mut buf = [[T::default(); TILE]; TILE];
    for ab in (0..na).step_by(TILE) {
        let h = TILE.min(na - ab);
        for bb in (0..nb).step_by(TILE) {
            let w = TILE.min(nb - bb);
            if h == TILE && w == TILE {
                // Full tile: constant bounds, so the copies unroll without bounds checks.
                for (b, column) in (0..TILE).map(|b| (b, s0 + (bb + b) * s_b + ab)) {
                    let row: &[T] = &src[column..column + TILE];
                    for (line, &v) in buf.iter_mut().zip(row) {
                        line[b] = v;
                    }
                }
                for (a, line) in buf.iter().enumerate() {
                    let to = d0 + (ab + a) * d_a + bb;
                    dst[to..to + TILE].copy_from_slice(line);
                }
                continue;
            }
            for b in 0..w {
                let from = s0 + (bb + b) * s_b + ab;
                for (line, &v) in buf.iter_mut().zip(&src[from..from + h]) {
                    line[b] = v;
                }
            }
            for (a, line) in buf.iter().enumerate().take(h) {
                let to = d0 + (ab + a) * d_a + bb;
                dst[to..to + w].copy_from_slice(&line[..w]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
}

/// [`transpose_tiles`] for 4-byte elements with AVX2: 8×8 blocks are transposed in registers
/// (unpack, shuffle, permute). Sixteen rows of `src` are read side by side, so every store to
/// `dst` fills whole 64-byte lines; the borders use the plain loop. About 5× faster than the
/// buffered scalar tiles for 1024 × 1024 f32.
///
/// # Safety
/// `T` must be 4 bytes, `Copy`, and valid for any bit pattern that was already a `T` (the
/// kernel only moves values), and the CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose_4byte_avx2<T: Copy + Default>(
    (src, s0, s_b): (&[T], usize, usize),
    (na, nb): (usize, usize),
    (dst, d0, d_a): (&mut [T], usize, usize),
) {
    use std::arch::x86_64::*;
    // Every element touched below: a < na, b < nb.
    let in_bounds = na == 0
        || nb == 0
        || (s0 + (na - 1) + (nb - 1) * s_b < src.len()
            && d0 + (na - 1) * d_a + (nb - 1) < dst.len());
    if !in_bounds {
        return;
    }
    let (sp, dp) = (src.as_ptr() as *const f32, dst.as_mut_ptr() as *mut f32);
    let full_b = nb / 16 * 16;
    let full_a = na / 8 * 8;
    // 32 destination rows at a time, each written from start to end as the source rows pass:
    // few write streams, every line filled once.
    for ab0 in (0..full_a).step_by(32) {
        for bb in (0..full_b).step_by(16) {
            for ab in (ab0..(ab0 + 32).min(full_a)).step_by(8) {
                for half in 0..2 {
                    let b = bb + half * 8;
                    // SAFETY: rows b..b+8 and columns ab..ab+8 are within na × nb, checked above.
                    let r: [__m256; 8] = std::array::from_fn(|i| unsafe {
                        _mm256_loadu_ps(sp.add(s0 + ab + (b + i) * s_b))
                    });
                    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
                    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
                    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
                    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
                    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
                    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
                    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
                    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
                    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                    let out = [
                        _mm256_permute2f128_ps::<0x20>(u0, u4),
                        _mm256_permute2f128_ps::<0x20>(u1, u5),
                        _mm256_permute2f128_ps::<0x20>(u2, u6),
                        _mm256_permute2f128_ps::<0x20>(u3, u7),
                        _mm256_permute2f128_ps::<0x31>(u0, u4),
                        _mm256_permute2f128_ps::<0x31>(u1, u5),
                        _mm256_permute2f128_ps::<0x31>(u2, u6),
                        _mm256_permute2f128_ps::<0x31>(u3, u7),
                    ];
                    for (c, v) in out.into_iter().enumerate() {
                        // SAFETY: column ab + c < na and rows b..b+8 < nb, checked above.
                        unsafe { _mm256_storeu_ps(dp.add(d0 + (ab + c) * d_a + b), v) };
                    }
                }
            }
        }
    }
    // Borders: the rows past the last full 16 and the columns past the last full 8.
    for b in 0..nb {
        let a_from = if b < full_b { full_a } else { 0 };
        for a in a_from..na {
            dst[d0 + a * d_a + b] = src[s0 + a + b * s_b];
        }
    }
}

/// `dst[j, i] = src[i, j]` for `src` of `rows × cols` (row-major) and `dst` of `cols × rows`.
/// Cache-blocked (see [`transpose_tiles`]); parallel over destination rows for large matrices.
pub(crate) fn transpose<T: Copy + Default + Send + Sync>(
    src: &[T],
    rows: usize,
    cols: usize,
    dst: &mut [T],
) {
    debug_assert!(src.len() == rows * cols && dst.len() == rows * cols);
    if dst.is_empty() {
        return;
    }
    if rows == 1 || cols == 1 {
        dst.copy_from_slice(src);
        return;
    }
    if dst.len() < PAR_MIN || pool::threads() < 2 {
        return transpose_tiles((src, 0, cols), (cols, rows), (dst, 0, rows));
    }
    // Whole tiles of destination rows per task.
    let per_task = chunk_len(dst.len()).div_ceil(rows).next_multiple_of(TILE);
    let work = Work::pass::<T>(dst.len(), 2);
    pool::for_each_chunk_mut(dst, per_task * rows, work, |t, d| {
        let count = d.len() / rows;
        transpose_tiles((src, t * per_task, cols), (count, rows), (d, 0, rows));
    });
}

/// The permutation `perm` of `src` (shape `dims`, row-major) into `dst`: output axis `k` is
/// input axis `perm[k]`.
///
/// Axes of size 1 are dropped and output axes that stay adjacent in the input merged. Then an
/// identity is one copy, a 2-D transpose uses [`transpose`], a permutation that keeps the last
/// axis copies whole rows, and any other is a set of strided 2-D transposes between the output
/// axis that is contiguous in the input and the last output axis.
pub(crate) fn permute<T: Copy + Default + Send + Sync>(
    src: &[T],
    dims: &[usize],
    perm: &[usize],
    dst: &mut [T],
) {
    debug_assert!(dims.len() == perm.len() && src.len() == dst.len());
    if dst.is_empty() {
        return;
    }
    let in_strides = contiguous_strides(dims);
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
        [] | [_] => dst.copy_from_slice(src),
        // Output [a, b] reading input [b, a]: a transpose.
        &[(a, 1), (b, s)] if s == a => transpose(src, b, a, dst),
        [.., (_, 1)] => gather_rows(src, &axes, dst),
        _ => gather_tiled(src, &axes, dst),
    }
}

/// Row-major strides of `dims`, in elements.
/// `dst` in row-major order of `axes` (size, source stride), read from `src`, whose last axis
/// is contiguous in `src`: whole rows are copied.
fn gather_rows<T: Copy + Send + Sync>(src: &[T], axes: &[(usize, usize)], dst: &mut [T]) {
    let Some(&(inner, inner_stride)) = axes.last() else {
        dst.copy_from_slice(src);
        return;
    };
    debug_assert_eq!(inner_stride, 1);
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
            row.copy_from_slice(&src[offset..offset + inner]);
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
    let work = Work::pass::<T>(dst.len(), 2);
    pool::for_each_chunk_mut(dst, rows_per_task * inner, work, |t, d| {
        run(t * rows_per_task, d)
    });
}

/// The offset in `src` of row-major index `flat` over `axes` (size, source stride).
fn offset_of(mut flat: usize, axes: &[(usize, usize)]) -> usize {
    let mut offset = 0;
    for &(size, stride) in axes.iter().rev() {
        offset += (flat % size) * stride;
        flat /= size;
    }
    offset
}

/// `dst` in row-major order of `axes` (size, source stride), read from `src`, when the last
/// axis is not contiguous in `src`. Some other output axis `p` is (the input's innermost axis
/// of size above 1 has stride 1, and merging keeps it), so for every index of the axes before
/// `p` (a contiguous region of `dst`; regions are split across the pool) and every index of the
/// axes between `p` and the last, the `axes[p] × axes[last]` block is a strided 2-D transpose.
fn gather_tiled<T: Copy + Default + Send + Sync>(
    src: &[T],
    axes: &[(usize, usize)],
    dst: &mut [T],
) {
    let last = axes.len() - 1;
    let Some(p) = axes.iter().position(|a| a.1 == 1) else {
        // Not reached for a permutation of a contiguous array; kept total for safety.
        return gather_elements(src, axes, dst);
    };
    let (na, (nb, s_b)) = (axes[p].0, axes[last]);
    let outer = &axes[..p];
    let middle = &axes[p + 1..last];
    let middle_count: usize = middle.iter().map(|a| a.0).product();
    let region = na * middle_count * nb;
    let run = |first: usize, dst: &mut [T]| {
        for (k, region_dst) in dst.chunks_exact_mut(region).enumerate() {
            let base = offset_of(first + k, outer);
            for mi in 0..middle_count {
                let s0 = base + offset_of(mi, middle);
                transpose_tiles(
                    (src, s0, s_b),
                    (na, nb),
                    (region_dst, mi * nb, middle_count * nb),
                );
            }
        }
    };
    let regions = dst.len() / region;
    if dst.len() < PAR_MIN || regions < 2 {
        return run(0, dst);
    }
    let per_task = chunk_len(dst.len()).div_ceil(region).max(1);
    let work = Work::pass::<T>(dst.len(), 2);
    pool::for_each_chunk_mut(dst, per_task * region, work, |t, d| run(t * per_task, d));
}

/// `dst` in row-major order of `axes`, one element at a time.
fn gather_elements<T: Copy>(src: &[T], axes: &[(usize, usize)], dst: &mut [T]) {
    for (flat, o) in dst.iter_mut().enumerate() {
        *o = src[offset_of(flat, axes)];
    }
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
    let work = Work::Bytes(dst.len() * 2);
    pool::for_each_chunk_mut(dst, rows_per_task * total, work, |t, d| {
        run(t * rows_per_task, d)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference_permute(src: &[u32], dims: &[usize], perm: &[usize]) -> Vec<u32> {
        let out_dims: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
        let st = contiguous_strides(dims);
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

#[cfg(test)]
mod transpose_tests {
    use super::transpose;

    fn check<T: Copy + Default + Send + Sync + PartialEq + std::fmt::Debug>(
        make: impl Fn(usize) -> T,
        rows: usize,
        cols: usize,
    ) {
        let src: Vec<T> = (0..rows * cols).map(&make).collect();
        let mut dst = vec![T::default(); rows * cols];
        transpose(&src, rows, cols, &mut dst);
        for i in 0..rows {
            for j in 0..cols {
                assert_eq!(
                    dst[j * rows + i],
                    src[i * cols + j],
                    "{rows}×{cols} at ({i}, {j})"
                );
            }
        }
    }

    #[test]
    fn four_byte_transposes_are_exact_including_borders() {
        for &(rows, cols) in &[
            (16, 8),
            (17, 9),
            (33, 70),
            (5, 300),
            (300, 5),
            (64, 64),
            (1024, 1024),
            (1000, 333),
        ] {
            check(|i| i as i32 - 7, rows, cols);
            // f32 bit patterns go through unchanged, NaN payloads included.
            check(
                |i| f32::from_bits(0x7fc0_0000 | i as u32).to_bits(),
                rows,
                cols,
            );
            check(|i| i as f64 * 0.5, rows, cols);
            check(|i| (i % 251) as u8, rows, cols);
        }
    }
}
