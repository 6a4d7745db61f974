//! One SGD-with-momentum step of a dense layer's weights, fused with their gradient product:
//! `v ← μ·v + xᵀ·g; w ← w − lr·v`, with `x` stored `[k, m]` (the layer input, `k` the batch),
//! `g` stored `[k, n]` (the output gradient), `v` and `w` `[m, n]`.
//!
//! Why fused: at small batch a training step is bound by memory traffic, not arithmetic. The
//! weights and their velocities (15 MB for a 784→1024→1024 network) do not stay in cache between
//! steps, and the unfused pair — `v.addmm_(x, g)` then `w.axpy_(−lr, v)` — reads `v` twice.
//! Here each tile of `v` and `w` is read once and written once: the gradient tile is computed in
//! registers from `x` and `g` (both small and cache-resident), added to `v`, and applied to `w`.
//!
//! The kernel needs AVX-512F and f32; otherwise the step runs unfused, through gemm and an
//! elementwise pass, with the same result up to rounding.

use std::cell::RefCell;

use super::elementwise::zip_inplace;
use super::matmul::gemm_general;
use super::num::Num;
use super::pool::{self, SendPtr};
use crate::backend::contract::Mnk;

/// Rows of `v`/`w` per register tile.
const MR: usize = 4;
/// Vectors of 16 lanes per tile row.
const NV: usize = 4;
/// Columns per register tile.
const NR: usize = 16 * NV;
/// Longest batch the kernel takes; longer ones run unfused. Measured on a 1024² layer: the fused
/// step is 1.25–1.3× faster at batch 16 and 1.07× at 64: the more arithmetic per element of
/// `v`, the less the saved memory traffic matters, so larger batches are left to gemm.
const MAX_K: usize = 64;

thread_local! {
    /// The calling thread's packing space (`x` in row tiles, `g` in column tiles), kept between
    /// calls so a training loop packs without allocating.
    static PACK: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// `v ← momentum·v + xᵀ·g; w ← w − lr·v` (with `momentum == 0`, `v ← xᵀ·g`: the old `v` is not
/// read). `x` is `[k, m]`, `g` `[k, n]`, `v` and `w` `[m, n]`, all row-major and contiguous.
pub(crate) fn sgd_dense<T: Num>(
    dims: Mnk,
    (x, g): (&[T], &[T]),
    (v, w): (&mut [T], &mut [T]),
    (lr, momentum): (T, T),
) {
    let Mnk { m, k, n } = dims;
    // Checked in release builds too: the fused kernel writes through raw pointers.
    assert!(
        x.len() == k * m && g.len() == k * n && v.len() == m * n && w.len() == m * n,
        "sgd_dense: operand lengths do not fit m {m}, k {k}, n {n}"
    );
    if m == 0 || n == 0 {
        return;
    }
    if k > 0 && k <= MAX_K && fused_available::<T>() {
        let cast = |s: &[T]| {
            // SAFETY: T is f32 (checked by `fused_available`), so the slice is an `&[f32]`.
            unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<f32>(), s.len()) }
        };
        let (x, g) = (cast(x), cast(g));
        // SAFETY: as above; `v` and `w` are distinct `&mut` slices, each reborrowed once.
        let (v, w) = unsafe {
            (
                std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<f32>(), v.len()),
                std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<f32>(), w.len()),
            )
        };
        let (lr, momentum) = (lr.to_f64() as f32, momentum.to_f64() as f32);
        return fused(dims, (x, g), (v, w), (lr, momentum));
    }
    let accumulate = (momentum != T::ZERO).then_some((momentum, T::ONE));
    gemm_general((m, k, n), (x, true), (g, false), v, accumulate);
    let neg_lr = T::ZERO.sub(lr);
    zip_inplace(w, v, move |w, v| w.add(neg_lr.mul(v)));
}

/// Whether the fused kernel runs for `T` on this machine.
fn fused_available<T: Num>() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        T::DTYPE == crate::DType::F32 && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Row tiles per task of the fused kernel: runs of tiles, as many as the size gives (never as
/// the thread count): each tile is computed the same way whichever task has it, so the result
/// does not depend on the split, and the split does not depend on the threads. At most 16 runs
/// (long contiguous runs were measured a little faster than many short ones), each with at
/// least `MIN_WORK` multiply-adds, so a small update wakes few threads.
pub(crate) fn tiles_per_task(m: usize, k: usize, n: usize) -> usize {
    const MIN_WORK: usize = 48 * 48 * 48;
    const MAX_RUNS: usize = super::MAX_TASKS / 4;
    let tiles = m.div_ceil(MR);
    if m * n * k < MIN_WORK {
        tiles.max(1)
    } else {
        tiles.div_ceil(MAX_RUNS).max(MIN_WORK.div_ceil(MR * n * k))
    }
}

fn fused(
    dims: Mnk,
    (x, g): (&[f32], &[f32]),
    (v, w): (&mut [f32], &mut [f32]),
    (lr, momentum): (f32, f32),
) {
    let Mnk { m, k, n } = dims;
    let tiles = m.div_ceil(MR);
    let chunks = n.div_ceil(NR);
    let mut fresh = (Vec::new(), Vec::new());
    PACK.with(|cell| {
        let mut held = cell.try_borrow_mut();
        let (xpack, gpack) = match held.as_deref_mut() {
            Ok((a, b)) => (a, b),
            Err(_) => (&mut fresh.0, &mut fresh.1),
        };
        // x as [tile][p][MR] and g as [chunk][p][NR], zero-padded: each tile of the kernel then
        // reads contiguous memory (rows of x and g lie m and n elements apart, which for the
        // usual power-of-two widths puts them all in the same L1 sets).
        xpack.clear();
        xpack.resize(tiles * k * MR, 0.0);
        for (t, tile) in xpack.chunks_exact_mut(k * MR).enumerate() {
            let rows = (m - t * MR).min(MR);
            for (p, dst) in tile.chunks_exact_mut(MR).enumerate() {
                dst[..rows].copy_from_slice(&x[p * m + t * MR..][..rows]);
            }
        }
        gpack.clear();
        gpack.resize(chunks * k * NR, 0.0);
        for (c, chunk) in gpack.chunks_exact_mut(k * NR).enumerate() {
            let cols = (n - c * NR).min(NR);
            for (p, dst) in chunk.chunks_exact_mut(NR).enumerate() {
                dst[..cols].copy_from_slice(&g[p * n + c * NR..][..cols]);
            }
        }
        let (xpack, gpack): (&[f32], &[f32]) = (xpack, gpack);
        let (vp, wp) = (SendPtr(v.as_mut_ptr()), SendPtr(w.as_mut_ptr()));
        let per_task = tiles_per_task(m, k, n);
        let work = super::Work::product(m, k, n);
        pool::run(tiles.div_ceil(per_task), work, &|task| {
            let first = task * per_task;
            let last = (first + per_task).min(tiles);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `fused` runs only with AVX-512F (`fused_available`). The packs hold
            // `tiles` tiles of k·MR and `chunks` chunks of k·NR; `v` and `w` point to m·n
            // elements each (`sgd_dense`'s contract). This task touches only rows
            // first·MR .. min(last·MR, m) of `v` and `w`, which no other task touches, and both
            // stay mutably borrowed until `run` returns.
            unsafe {
                avx512::rows(
                    (m, k, n),
                    (xpack, gpack),
                    (vp.get(), wp.get()),
                    first..last,
                    (lr, momentum),
                )
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (first, last, xpack, gpack, vp, wp);
        });
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{MR, NR, NV};

    /// Row tiles `tiles` of `v` and `w`, all columns.
    ///
    /// # Safety
    /// AVX-512F must be available; `xpack` must hold `m.div_ceil(MR)` tiles of `k·MR`, `gpack`
    /// `n.div_ceil(NR)` chunks of `k·NR` elements; `v` and `w` must point to `m·n` elements, and
    /// nothing else may access the rows of `tiles` meanwhile.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn rows(
        (m, k, n): (usize, usize, usize),
        (xpack, gpack): (&[f32], &[f32]),
        (v, w): (*mut f32, *mut f32),
        tiles: Range<usize>,
        rates: (f32, f32),
    ) {
        let chunks = n.div_ceil(NR);
        assert!(xpack.len() >= tiles.end * k * MR && gpack.len() == chunks * k * NR);
        for t in tiles {
            let rows = (m - t * MR).min(MR);
            let xt = &xpack[t * k * MR..(t + 1) * k * MR];
            for c in 0..chunks {
                let cols = (n - c * NR).min(NR);
                let masks: [__mmask16; NV] = std::array::from_fn(|q| {
                    let lanes = cols.saturating_sub(16 * q).min(16);
                    ((1u32 << lanes) - 1) as __mmask16
                });
                let gc = &gpack[c * k * NR..(c + 1) * k * NR];
                let offset = t * MR * n + c * NR;
                prefetch_ahead(m, n, t, c, chunks, v, w);
                // SAFETY: the tile's rows t·MR .. t·MR+rows ≤ m and the masked columns
                // c·NR .. c·NR+cols ≤ n lie inside `v` and `w`; `xt` and `gc` hold k·MR and
                // k·NR elements.
                unsafe {
                    tile(
                        (k, n),
                        (xt, gc),
                        (v.add(offset), w.add(offset)),
                        (rows, masks),
                        rates,
                    )
                };
            }
        }
    }

    /// Tiles a chunk ahead of (t, c) this far, in chunks: each row of a tile is its own stream
    /// (rows lie `n` elements apart, a page apart at n = 1024), which hardware prefetchers pick
    /// up late, and `v` and `w` usually come from memory, not cache.
    const AHEAD: usize = 2;

    /// Asks for the cache lines of `v` and `w` under the tile `AHEAD` chunks after (t, c),
    /// continuing into the next row of tiles.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn prefetch_ahead(
        m: usize,
        n: usize,
        t: usize,
        c: usize,
        chunks: usize,
        v: *mut f32,
        w: *mut f32,
    ) {
        let (pt, pc) = if c + AHEAD < chunks {
            (t, c + AHEAD)
        } else {
            (t + 1, c + AHEAD - chunks)
        };
        if pt * MR >= m || pc >= chunks {
            return;
        }
        let cols = (n - pc * NR).min(NR);
        for r in pt * MR..(pt * MR + MR).min(m) {
            for l in (0..cols).step_by(16) {
                // A prefetch is a hint that never faults. `at` < m·n, so the addresses lie inside
                // `v` and `w`; they are computed with wrapping arithmetic all the same.
                let at = r * n + pc * NR + l;
                _mm_prefetch::<_MM_HINT_T0>(v.wrapping_add(at).cast::<i8>());
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(at).cast::<i8>());
            }
        }
    }

    /// One tile of up to `MR` rows × `NR` columns. All `MR` rows are computed (padding rows of
    /// the pack are zeros); `rows` are stored, each in the masked columns.
    ///
    /// # Safety
    /// As for [`rows`], for this tile: `v` and `w` point to its first element, rows `ld` apart.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile(
        (k, ld): (usize, usize),
        (xt, gc): (&[f32], &[f32]),
        (v, w): (*mut f32, *mut f32),
        (rows, masks): (usize, [__mmask16; NV]),
        (lr, momentum): (f32, f32),
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        for (xs, gs) in xt.chunks_exact(MR).zip(gc.chunks_exact(NR)).take(k) {
            // SAFETY: `gs` holds NR = 16·NV elements, so each 16-lane load is inside it.
            let gv: [__m512; NV] =
                std::array::from_fn(|q| unsafe { _mm512_loadu_ps(gs.as_ptr().add(16 * q)) });
            for (acc, &xr) in acc.iter_mut().zip(xs) {
                let xb = _mm512_set1_ps(xr);
                for (acc, &gv) in acc.iter_mut().zip(&gv) {
                    *acc = _mm512_fmadd_ps(xb, gv, *acc);
                }
            }
        }
        let mu = _mm512_set1_ps(momentum);
        let step = _mm512_set1_ps(lr);
        for (r, acc) in acc.iter().enumerate().take(rows) {
            for (q, (&acc, &mask)) in acc.iter().zip(&masks).enumerate() {
                if mask == 0 {
                    // Past the last column: even forming the address could leave the
                    // allocation (the last row of `v` and `w`).
                    continue;
                }
                // SAFETY: row r < rows of the tile; vector q starts at a column below n (its
                // mask is not empty), so the address lies inside the row; only the masked
                // columns are loaded and stored.
                unsafe {
                    let vp = v.add(r * ld + 16 * q);
                    let wp = w.add(r * ld + 16 * q);
                    let new_v = if momentum == 0.0 {
                        acc
                    } else {
                        _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, vp), mu, acc)
                    };
                    _mm512_mask_storeu_ps(vp, mask, new_v);
                    let new_w = _mm512_fnmadd_ps(new_v, step, _mm512_maskz_loadu_ps(mask, wp));
                    _mm512_mask_storeu_ps(wp, mask, new_w);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The unfused definition, in f64.
    fn reference(
        (m, k, n): (usize, usize, usize),
        x: &[f32],
        g: &[f32],
        v: &mut [f64],
        w: &mut [f64],
        lr: f64,
        momentum: f64,
    ) {
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k)
                    .map(|p| x[p * m + i] as f64 * g[p * n + j] as f64)
                    .sum();
                let old = if momentum == 0.0 { 0.0 } else { v[i * n + j] };
                v[i * n + j] = momentum * old + dot;
                w[i * n + j] -= lr * v[i * n + j];
            }
        }
    }

    #[test]
    fn fused_and_unfused_steps_agree_with_the_definition() {
        let shapes = [
            (1, 1, 1),
            (5, 3, 7),
            (9, 16, 65),
            (64, 16, 1024),
            (37, 64, 100),
        ];
        for &(m, k, n) in &shapes {
            let x: Vec<f32> = (0..k * m).map(|i| (i % 13) as f32 * 0.25 - 1.5).collect();
            let g: Vec<f32> = (0..k * n).map(|i| (i % 7) as f32 * 0.5 - 1.0).collect();
            for momentum in [0.9, 0.0] {
                let mut v: Vec<f32> = (0..m * n).map(|i| (i % 5) as f32).collect();
                let mut w: Vec<f32> = (0..m * n).map(|i| (i % 3) as f32 - 1.0).collect();
                let mut rv: Vec<f64> = v.iter().map(|&x| x as f64).collect();
                let mut rw: Vec<f64> = w.iter().map(|&x| x as f64).collect();
                if momentum == 0.0 {
                    v.fill(f32::NAN); // not read without momentum
                }
                for _ in 0..2 {
                    sgd_dense(
                        Mnk { m, k, n },
                        (&x, &g),
                        (&mut v, &mut w),
                        (0.1, momentum as f32),
                    );
                    reference((m, k, n), &x, &g, &mut rv, &mut rw, 0.1, momentum);
                }
                for (i, (got, want)) in v.iter().zip(&rv).chain(w.iter().zip(&rw)).enumerate() {
                    assert!(
                        (*got as f64 - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "({m},{k},{n}) μ {momentum} at {i}: {got} vs {want}"
                    );
                }
            }
        }
        // f64 and batches past MAX_K take the unfused path.
        let (m, k, n) = (3, 70, 4);
        let x: Vec<f64> = (0..k * m).map(|i| (i % 4) as f64).collect();
        let g: Vec<f64> = (0..k * n).map(|i| (i % 3) as f64).collect();
        let (mut v, mut w) = (vec![1.0; m * n], vec![2.0; m * n]);
        sgd_dense(Mnk { m, k, n }, (&x, &g), (&mut v, &mut w), (0.5, 0.5));
        for i in 0..m {
            for j in 0..n {
                let dot: f64 = (0..k).map(|p| x[p * m + i] * g[p * n + j]).sum();
                assert_eq!(v[i * n + j], 0.5 + dot);
                assert_eq!(w[i * n + j], 2.0 - 0.5 * (0.5 + dot));
            }
        }
    }

    /// Operand lengths that do not fit the dimensions are refused in release builds too (the
    /// fused kernel writes through raw pointers).
    #[test]
    #[should_panic(expected = "sgd_dense: operand lengths")]
    fn operand_lengths_are_checked_in_release_builds() {
        let (m, k, n) = (2, 3, 4);
        let (x, g) = (vec![1.0f32; k * m], vec![1.0f32; k * n]);
        let (mut v, mut w) = (vec![0.0f32; m * n + 1], vec![0.0f32; m * n]);
        sgd_dense(Mnk { m, k, n }, (&x, &g), (&mut v, &mut w), (0.1, 0.9));
    }

    /// Outputs whose last row ends in vectors with no column of the matrix (n = 16 + 1 with four
    /// 16-lane vectors per chunk): the fused kernel skips them without forming their addresses,
    /// which would lie past the end of `v` and `w` (exact-size buffers here). Miri checks the
    /// address arithmetic where AVX-512 can run under it; everywhere the values are checked.
    #[test]
    fn fully_masked_vectors_of_the_last_row_are_skipped() {
        for &(m, k, n) in &[(1, 1, 1), (5, 2, 17), (4, 3, 16), (7, 1, 33)] {
            let x: Vec<f32> = (0..k * m).map(|i| i as f32 * 0.5).collect();
            let g: Vec<f32> = (0..k * n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let mut v = vec![1.0f32; m * n];
            let mut w = vec![2.0f32; m * n];
            sgd_dense(Mnk { m, k, n }, (&x, &g), (&mut v, &mut w), (0.5, 0.5));
            for i in 0..m {
                for j in 0..n {
                    let dot: f32 = (0..k).map(|p| x[p * m + i] * g[p * n + j]).sum();
                    assert_eq!(v[i * n + j], 0.5 + dot, "v ({m},{k},{n}) at {i},{j}");
                    assert_eq!(w[i * n + j], 2.0 - 0.5 * (0.5 + dot), "w at {i},{j}");
                }
            }
        }
    }
}
