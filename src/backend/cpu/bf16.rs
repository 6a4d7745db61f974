//! Products of bf16 operands on CPUs with AVX512-BF16: `out = op(a) · op(b)` (or
//! `out = β·out + α·op(a)·op(b)`) in f32, computed by `vdpbf16ps` on the bf16 operands
//! themselves, where the widening path (`wide.rs`) converts both operands to f32 and runs the f32
//! kernel. Each `vdpbf16ps` multiplies 32 pairs of bf16 and adds each pair's two products into
//! one f32 lane: twice the multiply-adds of an f32 FMA of the same width, from operands half the
//! size.
//!
//! # Layout
//!
//! An f32 lane of `vdpbf16ps` takes two bf16 of each operand: the values at depth `2p` and
//! `2p + 1` (a *pair*), the lower one in the lower half of the 32-bit lane. So the operands are
//! read as pairs (a `u32` each), an odd depth `k` padded with a zero at depth `k`:
//!
//! - `op(b)` is packed, once per product, into *strips* of 16 columns: for each pair `p`, the
//!   16 columns' pairs (one zmm), strip after strip, the last strip's missing columns zero;
//! - `op(a)` is read in place when it is stored `[m, k]` with `k` even (a row's pairs are
//!   adjacent); with `k` odd its rows are copied with the zero after them; stored transposed
//!   (`[k, m]`), it is packed into strips of 16 rows as `op(b)` is into strips of columns.
//!
//! The micro-kernel keeps an `8 × 48` tile of the result in 24 zmm accumulators (fewer at the
//! edges), and for each pair loads three vectors of `op(b)` and broadcasts one pair of each of
//! the 8 rows of `op(a)`. The depth is cut into blocks of [`KC`] pairs (a `KC × 48` panel of
//! `op(b)`, 24 KiB, stays in L1 while the rows of `op(a)` stream past it); the first block
//! writes the tile (`α·acc`, or `β·out + α·acc`), the next ones add theirs (`out + α·acc`).
//!
//! # Determinism
//!
//! The product is cut into blocks by `matmul::split` and run on the pool as `gemm_general`
//! does. Every element of the result is computed by the same operations whatever block it falls
//! in and whatever thread runs it: the depth blocks depend on `k` only, and an element's
//! accumulator sums its pairs in order. So the result is bit-identical on 1 thread or 16.
//!
//! # Rounding
//!
//! `vdpbf16ps` does not compute exactly what the widening path does: it treats denormal inputs
//! as zero and flushes denormal results to zero (whatever MXCSR says), and it rounds the sum of
//! each pair's two products (and the accumulator) once in f32 where an f32 FMA chain rounds after
//! each product. Products of bf16 are exact in f32, so results usually agree with the widening
//! path to the last few bits of f32 (far below bf16's precision, once the result is rounded to
//! bf16), but they are not bit-identical to it, and subnormal operands or results become zero.
//! Infinities and NaN propagate as in f32 arithmetic.

use half::bf16;

/// Pairs of depth per block of the depth (512 values of `k`): a `KC × 48` panel of packed
/// `op(b)` is 24 KiB, which stays in L1 while the micro-kernel runs down the rows of `op(a)`.
const KC: usize = 128;

/// Rows of the micro-kernel's tile. A multiple of the row split's alignment (8): a tile never
/// straddles two blocks, nor two strips of a packed `op(a)`.
const MR: usize = 8;

/// Strips of 16 columns in the micro-kernel's tile (48 columns).
const NS: usize = 3;

/// Columns (rows of a transposed `op(a)`) per packed strip: one zmm of f32 lanes.
const STRIP: usize = 16;

/// Whether this CPU runs the kernel (AVX-512 F and BW with AVX512-BF16). Detected once.
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *AVAILABLE.get_or_init(|| {
            std::arch::is_x86_feature_detected!("avx512f")
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512bf16")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[m×n] = op(a) · op(b)` in f32 from bf16 operands, or with `accumulate = Some((β, α))`,
/// `out = β·out + α·op(a)·op(b)`, with the semantics of `matmul::gemm_general`: row-major; `a`
/// stored `[m, k]`, or `[k, m]` when `ta`; `b` stored `[k, n]`, or `[n, k]` when `tb`; without
/// `accumulate` (or with `β = 0`) `out` is written, not read. Returns `false`, having done
/// nothing, when the CPU lacks AVX512-BF16 ([`available`]): the caller then widens.
///
/// See the module's documentation for how the rounding differs from the widening path.
pub(crate) fn gemm_bf16(
    (m, k, n): (usize, usize, usize),
    (a, ta): (&[bf16], bool),
    (b, tb): (&[bf16], bool),
    out: &mut [f32],
    accumulate: Option<(f32, f32)>,
) -> bool {
    if !available() {
        return false;
    }
    // Checked in release builds too: the kernel reads through raw pointers.
    assert!(
        a.len() == m * k && b.len() == k * n && out.len() == m * n,
        "gemm_bf16: operand lengths {}, {}, {} do not fit [{m}, {k}] · [{k}, {n}]",
        a.len(),
        b.len(),
        out.len()
    );
    if m == 0 || n == 0 {
        return true;
    }
    // `β = 0` does not read `out` (as in `gemm_general`): a NaN there must not survive as 0·NaN.
    let (beta, alpha) = match accumulate {
        Some((s, q)) if s == 0.0 => (None, q),
        Some((s, q)) => (Some(s), q),
        None => (None, 1.0),
    };
    if k == 0 {
        match beta {
            Some(s) => out.iter_mut().for_each(|o| *o *= s),
            None => out.iter_mut().for_each(|o| *o = 0.0),
        }
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    x86::product((m, k, n), (a, ta), (b, tb), out, (beta, alpha));
    true
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::super::matmul::{split, Split};
    use super::super::pool::{self, SendPtr};
    use super::super::wide::Wide;
    use super::{KC, MR, NS, STRIP};

    /// See [`gemm_bf16`], whose checks this assumes (`k ≥ 1`, `m, n ≥ 1`, lengths).
    /// `(beta, alpha)`: `out = beta·out + alpha·product` with `beta = Some`, else
    /// `out = alpha·product`.
    pub(super) fn product(
        (m, k, n): (usize, usize, usize),
        (a, ta): (&[bf16], bool),
        (b, tb): (&[bf16], bool),
        out: &mut [f32],
        (beta, alpha): (Option<f32>, f32),
    ) {
        let kp = k.div_ceil(2);
        let strips = n.div_ceil(STRIP);
        let mut packed_b = Packed::zeros(strips * kp * STRIP);
        if tb {
            pack_pairs(b, n, k, packed_b.as_mut_slice());
        } else {
            // SAFETY: `available` said the CPU has AVX-512 F and BW (`gemm_bf16` checked it).
            unsafe { interleave(b, k, n, packed_b.as_mut_slice()) };
        }
        let mut packed_a = None;
        let left = if ta {
            let buf = packed_a.insert(Packed::zeros(m.div_ceil(STRIP) * kp * STRIP));
            // SAFETY: as above.
            unsafe { interleave(a, k, m, buf.as_mut_slice()) };
            Left::Strips(buf.as_ptr())
        } else if k % 2 == 0 {
            Left::Rows(a.as_ptr().cast::<u32>(), kp)
        } else {
            let buf = packed_a.insert(Packed::zeros(m * kp));
            let rows = buf.as_mut_slice();
            for (dst, src) in rows.chunks_exact_mut(kp).zip(a.chunks_exact(k)) {
                for (d, s) in dst.iter_mut().zip(src.chunks(2)) {
                    let hi = s.get(1).map_or(0, |h| u32::from(h.to_bits()));
                    *d = u32::from(s[0].to_bits()) | (hi << 16);
                }
            }
            Left::Rows(buf.as_ptr(), kp)
        };
        let job = Job {
            n,
            kp,
            left,
            b: packed_b.as_ptr(),
            out: SendPtr(out.as_mut_ptr()),
            beta,
            alpha,
        };
        let Split {
            by_cols,
            block: size,
            tasks,
        } = split(m, n, k);
        // For each `run` below: the CPU has the features (checked by `gemm_bf16`); the blocks'
        // ranges lie inside `0..m` × `0..n`, start at multiples of 16 columns or 8 rows (`split`
        // aligns its blocks so), and are disjoint, so concurrent blocks write disjoint parts of
        // `out`, which outlives the pool's run; the packed operands are only read.
        if tasks < 2 {
            // SAFETY: see above; one block, the whole result.
            return unsafe { job.run(0..m, 0..n) };
        }
        let part = |t: usize| t * size..((t + 1) * size).min(if by_cols { n } else { m });
        let work = super::super::Work::product(m, k, n);
        if by_cols {
            // SAFETY: see above; task t computes block t of whole columns.
            pool::run(tasks, work, &|t| unsafe { job.run(0..m, part(t)) });
        } else {
            // SAFETY: see above; task t computes block t of whole rows.
            pool::run(tasks, work, &|t| unsafe { job.run(part(t), 0..n) });
        }
    }

    /// Packs `src`, `k` rows of `width` bf16 (row-major), into strips of 16 columns of pairs:
    /// `dst[((j / 16)·kp + p)·16 + j % 16] = src[2p][j] | src[2p + 1][j] << 16`, a missing row
    /// `k` (odd `k`) and the columns past `width` zero. `dst` holds `width.div_ceil(16)·kp·16`.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512 F and BW.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn interleave(src: &[bf16], k: usize, width: usize, dst: &mut [u32]) {
        let (kp, strips) = (k.div_ceil(2), width.div_ceil(STRIP));
        assert!(src.len() == k * width && dst.len() == strips * kp * STRIP);
        // permutex2var indices: 0..32 pick from the first operand, 32..64 from the second.
        let lo: [i16; 32] = std::array::from_fn(|i| (i / 2 + (i % 2) * 32) as i16);
        let hi: [i16; 32] = std::array::from_fn(|i| (16 + i / 2 + (i % 2) * 32) as i16);
        // SAFETY: reads 64 bytes from arrays of 64 bytes.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr().cast()),
                _mm512_loadu_si512(hi.as_ptr().cast()),
            )
        };
        let src = src.as_ptr().cast::<i16>();
        let dst = dst.as_mut_ptr();
        for p in 0..kp {
            for c in (0..width).step_by(2 * STRIP) {
                let left = width - c;
                let mask: u32 = if left >= 32 { !0 } else { (1 << left) - 1 };
                // SAFETY: rows 2p (< k) and 2p + 1 (when < k) exist; the mask limits the loads
                // to columns c.. < width of the row (masked lanes are not read).
                let (x, y) = unsafe {
                    let x = _mm512_maskz_loadu_epi16(mask, src.add(2 * p * width + c));
                    let y = if 2 * p + 1 < k {
                        _mm512_maskz_loadu_epi16(mask, src.add((2 * p + 1) * width + c))
                    } else {
                        _mm512_setzero_si512()
                    };
                    (x, y)
                };
                let s = c / STRIP;
                // SAFETY: strip s < strips (c < width) and p < kp: 16 u32 inside `dst`; strip
                // s + 1 only when it exists.
                unsafe {
                    _mm512_storeu_si512(
                        dst.add((s * kp + p) * STRIP).cast(),
                        _mm512_permutex2var_epi16(x, lo, y),
                    );
                    if s + 1 < strips {
                        _mm512_storeu_si512(
                            dst.add(((s + 1) * kp + p) * STRIP).cast(),
                            _mm512_permutex2var_epi16(x, hi, y),
                        );
                    }
                }
            }
        }
    }

    /// The blocks' shared, read-only description of a product.
    struct Job {
        n: usize,
        kp: usize,
        left: Left,
        /// Packed `op(b)` (see `interleave`), `n.div_ceil(16)·kp·16` u32.
        b: *const u32,
        out: SendPtr<f32>,
        beta: Option<f32>,
        alpha: f32,
    }

    // SAFETY: the pointers are read only (`a`, `b`) or written in disjoint blocks (`out`, see
    // `product`), and the buffers they point to outlive the pool's run.
    unsafe impl Sync for Job {}

    impl Job {
        /// Computes `out[rows, cols]`.
        ///
        /// # Safety
        ///
        /// The CPU has AVX512-BF16, F and BW; `rows` ⊂ `0..m` starts at a multiple of 8, `cols`
        /// ⊂ `0..n` at a multiple of 16; no other thread touches `out[rows, cols]` meanwhile.
        unsafe fn run(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
            assert!(rows.start % MR == 0 && cols.start % STRIP == 0);
            let (n, kp) = (self.n, self.kp);
            for pc in (0..kp).step_by(KC) {
                let kc = KC.min(kp - pc);
                let store = match (pc, self.beta) {
                    (0, None) => Store::Write,
                    (0, Some(beta)) => Store::Scale(beta),
                    _ => Store::Scale(1.0),
                };
                let mut c = cols.start;
                while c < cols.end {
                    let w = (cols.end - c).min(NS * STRIP);
                    let mut masks = [0u16; NS];
                    for (s, m) in masks.iter_mut().enumerate() {
                        let left = w.saturating_sub(s * STRIP).min(STRIP);
                        *m = ((1u32 << left) - 1) as u16;
                    }
                    // SAFETY: strip c / 16 exists (c < n) and pc < kp.
                    let b = unsafe { self.b.add((c / STRIP * kp + pc) * STRIP) };
                    let mut i = rows.start;
                    while i < rows.end {
                        let r = (rows.end - i).min(MR);
                        // SAFETY: row i < m, pair pc < kp of the operand's layout.
                        let a = unsafe {
                            match self.left {
                                Left::Rows(p, stride) => Left::Rows(p.add(i * stride + pc), stride),
                                Left::Strips(p) => {
                                    Left::Strips(p.add((i / STRIP * kp + pc) * STRIP + i % STRIP))
                                }
                            }
                        };
                        let tile = Tile {
                            kc,
                            a,
                            b,
                            b_stride: kp * STRIP,
                            // SAFETY: (i, c) lies inside the m × n result.
                            c: unsafe { self.out.get().add(i * n + c) },
                            ldc: n,
                            masks,
                            store,
                            alpha: self.alpha,
                        };
                        // SAFETY: the tile's r rows and w columns lie inside the block (and the
                        // result); its pairs inside the packed operands (see `kernel`).
                        unsafe { tile.dispatch(r, w.div_ceil(STRIP)) };
                        i += r;
                    }
                    c += w;
                }
            }
        }
    }

    /// How a tile's sums reach the result.
    #[derive(Clone, Copy)]
    enum Store {
        /// `out = α·acc` (`out` not read).
        Write,
        /// `out = s·out + α·acc`.
        Scale(f32),
    }

    /// One call of the micro-kernel: a tile of at most `MR` rows and `NS` strips of the result
    /// over `kc` pairs.
    struct Tile {
        kc: usize,
        /// The tile's first row's pair.
        a: Left,
        /// The tile's first strip's first pair; the next strips `b_stride` u32 further.
        b: *const u32,
        b_stride: usize,
        /// The tile's first element; rows `ldc` apart.
        c: *mut f32,
        ldc: usize,
        /// The columns of each strip that are in the tile.
        masks: [u16; NS],
        store: Store,
        alpha: f32,
    }

    impl Tile {
        /// Runs the kernel for `r` rows (1..=8) and `s` strips (1..=3).
        ///
        /// # Safety
        ///
        /// As [`kernel`].
        unsafe fn dispatch(&self, r: usize, s: usize) {
            macro_rules! go {
                ($($r:literal)*) => {
                    match (r, s, self.a) {
                        $(
                            ($r, 1, Left::Rows(..)) => kernel::<$r, 1, false>(self),
                            ($r, 2, Left::Rows(..)) => kernel::<$r, 2, false>(self),
                            ($r, 3, Left::Rows(..)) => kernel::<$r, 3, false>(self),
                            ($r, 1, Left::Strips(..)) => kernel::<$r, 1, true>(self),
                            ($r, 2, Left::Strips(..)) => kernel::<$r, 2, true>(self),
                            ($r, 3, Left::Strips(..)) => kernel::<$r, 3, true>(self),
                        )*
                        _ => unreachable!("bf16 tile of {r} rows and {s} strips"),
                    }
                };
            }
            // SAFETY: the caller's promises are the kernel's.
            unsafe { go!(1 2 3 4 5 6 7 8) }
        }
    }

    /// The micro-kernel: `R` rows × `S` strips of 16 columns of the result from `t.kc` pairs
    /// (`STRIPS`: `t.a` is `Left::Strips`, else `Left::Rows`).
    ///
    /// # Safety
    ///
    /// The CPU has AVX512-BF16, F and BW. For `p < kc`, `r < R`, `s < S`: the pair of row `r`
    /// at `t.a` (rows `stride` apart, or 1 apart in a strip the `R` rows do not leave), and
    /// `t.b[s·b_stride + p·16 .. +16]` are readable; the tile's elements `c[r·ldc + s·16 + j]`
    /// for the columns `j` set in `masks[s]` are writable (and readable with `Store::Scale`),
    /// touched by no other thread.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
    unsafe fn kernel<const R: usize, const S: usize, const STRIPS: bool>(t: &Tile) {
        let (a, stride) = match t.a {
            Left::Rows(p, stride) => (p, stride),
            Left::Strips(p) => (p, 0),
        };
        // Offset of pair p of row r: r·stride + p, or r + 16·p in a strip.
        let (row_step, pair_step) = if STRIPS { (1, STRIP) } else { (stride, 1) };
        let mut acc = [[_mm512_setzero_ps(); S]; R];
        for p in 0..t.kc {
            let mut b = [_mm512_setzero_si512(); S];
            for (s, b) in b.iter_mut().enumerate() {
                // SAFETY: pair p < kc of strip s < S (the caller's promise).
                *b = unsafe { _mm512_loadu_si512(t.b.add(s * t.b_stride + p * STRIP).cast()) };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: pair p of row r (the caller's promise); read unaligned (a bf16 array
                // is only 2-aligned).
                let pair = unsafe { a.add(r * row_step + p * pair_step).read_unaligned() };
                let x = _mm512_set1_epi32(pair as i32);
                for (acc, &y) in acc.iter_mut().zip(&b) {
                    // SAFETY: __m512i and __m512bh are both 64 bytes of plain bits.
                    let (x, y) = unsafe {
                        (
                            std::mem::transmute::<__m512i, __m512bh>(x),
                            std::mem::transmute::<__m512i, __m512bh>(y),
                        )
                    };
                    *acc = _mm512_dpbf16_ps(*acc, x, y);
                }
            }
        }
        let alpha = _mm512_set1_ps(t.alpha);
        for (r, acc) in acc.iter().enumerate() {
            for (s, &acc) in acc.iter().enumerate() {
                let mask = t.masks[s];
                // SAFETY: the columns of the mask in row r, strip s of the tile (the caller's
                // promise); masked lanes are neither read nor written.
                unsafe {
                    let c = t.c.add(r * t.ldc + s * STRIP);
                    let v = match t.store {
                        Store::Write => _mm512_mul_ps(alpha, acc),
                        Store::Scale(beta) => {
                            let old = _mm512_maskz_loadu_ps(mask, c);
                            _mm512_fmadd_ps(alpha, acc, _mm512_mul_ps(old, _mm512_set1_ps(beta)))
                        }
                    };
                    _mm512_mask_storeu_ps(c, mask, v);
                }
            }
        }
    }

    /// A buffer of `len` zeroed `u32` (the thread's reusable f32 buffers of `wide.rs`, reinterpreted).
    struct Packed(Wide);

    impl Packed {
        fn zeros(len: usize) -> Packed {
            Packed(Wide::zeros(len))
        }

        fn as_mut_slice(&mut self) -> &mut [u32] {
            let w: &mut [f32] = &mut self.0;
            // SAFETY: f32 and u32 have the same size and alignment and every bit pattern is valid
            // for both; the slice is reborrowed mutably once, for the borrow of `self`.
            unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr().cast::<u32>(), w.len()) }
        }

        fn as_ptr(&self) -> *const u32 {
            self.0.as_ptr().cast::<u32>()
        }
    }

    /// How the micro-kernel finds the pairs of `op(a)`.
    #[derive(Clone, Copy)]
    enum Left {
        /// Row-major pairs: pair `p` of row `i` is the `u32` at `ptr[i·stride + p]`.
        Rows(*const u32, usize),
        /// Strips of 16 rows: pair `p` of row `i` is at `ptr[((i / 16)·kp + p)·16 + i % 16]`.
        Strips(*const u32),
    }

    /// Packs `src`, `width` rows of `k` bf16 (row-major: `op(b)` stored transposed, `[n, k]`), into
    /// the strips of `interleave`: `dst[((j / 16)·kp + p)·16 + j % 16] = src[j][2p] | src[j][2p+1]
    /// << 16`, the missing value past an odd `k` and the columns past `width` zero (`dst` zeroed).
    fn pack_pairs(src: &[bf16], width: usize, k: usize, dst: &mut [u32]) {
        let kp = k.div_ceil(2);
        assert!(src.len() == width * k && dst.len() == width.div_ceil(STRIP) * kp * STRIP);
        for (j, row) in src.chunks_exact(k).enumerate() {
            let (s, lane) = (j / STRIP, j % STRIP);
            let strip = &mut dst[s * kp * STRIP..(s + 1) * kp * STRIP];
            for (p, pair) in row.chunks(2).enumerate() {
                let hi = pair.get(1).map_or(0, |h| u32::from(h.to_bits()));
                strip[p * STRIP + lane] = u32::from(pair[0].to_bits()) | (hi << 16);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::matmul::split;
    use crate::backend::cpu::pool;

    /// Deterministic values in [-1, 1), rounded to bf16.
    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                bf16::from_f64((x >> 11) as f64 / (1u64 << 52) as f64 - 1.0)
            })
            .collect()
    }

    /// `x` stored `[rows, cols]`, transposed to `[cols, rows]`.
    fn transpose(x: &[bf16], rows: usize, cols: usize) -> Vec<bf16> {
        (0..rows * cols)
            .map(|i| x[(i % rows) * cols + i / rows])
            .collect()
    }

    /// The exact product (f64) of `a` `[m, k]` and `b` `[k, n]`, with the sums of the products'
    /// magnitudes (for the tolerance).
    fn reference(m: usize, k: usize, n: usize, a: &[bf16], b: &[bf16]) -> Vec<(f64, f64)> {
        let mut out = vec![(0.0, 0.0); m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let prod = a[i * k + p].to_f64() * b[p * n + j].to_f64();
                    out[i * n + j].0 += prod;
                    out[i * n + j].1 += prod.abs();
                }
            }
        }
        out
    }

    /// Error bound of an f32 sum of `k` terms of total magnitude `mag` (recursive summation).
    fn bound(k: usize, mag: f64) -> f64 {
        (k as f64 + 2.0) * f64::from(f32::EPSILON) * mag + 1e-30
    }

    #[test]
    fn products_agree_with_the_definition_for_every_layout_and_edge() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let shapes = [
            (1, 1, 1),
            (1, 7, 33),
            (1, 600, 50),
            (5, 1, 17),
            (7, 3, 1),
            (50, 600, 1),
            (8, 16, 48),
            (9, 17, 49),
            (16, 33, 97),
            (17, 2, 16),
            (33, 130, 47),
            (67, 257, 129),
            (24, 513, 40),
            (100, 300, 70),
        ];
        for (si, &(m, k, n)) in shapes.iter().enumerate() {
            let a = values(m * k, 2 * si as u64 + 1);
            let b = values(k * n, 2 * si as u64 + 2);
            let want = reference(m, k, n, &a, &b);
            let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                let a_in = if ta { &at } else { &a };
                let b_in = if tb { &bt } else { &b };
                let init: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 - 3.0).collect();
                for acc in [
                    None,
                    Some((0.5f32, 2.0f32)),
                    Some((0.0, -3.0)),
                    Some((1.0, 1.0)),
                ] {
                    let mut out = match acc {
                        // β = 0 must not read `out`: NaN there must not survive.
                        Some((0.0, _)) | None => vec![f32::NAN; m * n],
                        Some(_) => init.clone(),
                    };
                    assert!(gemm_bf16((m, k, n), (a_in, ta), (b_in, tb), &mut out, acc));
                    let (beta, alpha) =
                        acc.map_or((0.0, 1.0), |(s, q)| (f64::from(s), f64::from(q)));
                    for (i, (&got, &(exact, mag))) in out.iter().zip(&want).enumerate() {
                        let old = if beta == 0.0 {
                            0.0
                        } else {
                            beta * f64::from(init[i])
                        };
                        let expect = old + alpha * exact;
                        let tol = bound(k, alpha.abs() * mag)
                            + 2.0 * f64::from(f32::EPSILON) * (old.abs() + expect.abs());
                        assert!(
                            (f64::from(got) - expect).abs() <= tol,
                            "[{m}, {k}]·[{k}, {n}] ta {ta} tb {tb} acc {acc:?}: element {i} is \
                             {got}, expected {expect} ± {tol}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn an_empty_depth_gives_zeros_or_the_scaled_result() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let mut out = vec![f32::NAN; 6];
        assert!(gemm_bf16(
            (2, 0, 3),
            (&[], false),
            (&[], false),
            &mut out,
            None
        ));
        assert_eq!(out, vec![0.0; 6]);
        let mut out = vec![2.0; 6];
        assert!(gemm_bf16(
            (2, 0, 3),
            (&[], true),
            (&[], true),
            &mut out,
            Some((0.5, 9.0))
        ));
        assert_eq!(out, vec![1.0; 6]);
    }

    #[test]
    fn infinities_and_nan_propagate() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let (m, k, n) = (3, 5, 20);
        let mut a = vec![bf16::ONE; m * k];
        let b = vec![bf16::ONE; k * n];
        a[0] = bf16::INFINITY;
        a[k] = bf16::NAN;
        let mut out = vec![0.0; m * n];
        assert!(gemm_bf16(
            (m, k, n),
            (&a, false),
            (&b, false),
            &mut out,
            None
        ));
        assert!(out[..n].iter().all(|&x| x == f32::INFINITY));
        assert!(out[n..2 * n].iter().all(|x| x.is_nan()));
        assert!(out[2 * n..].iter().all(|&x| x == 5.0));
    }

    /// The result's bits do not depend on the threads: the blocks of `split` run on the pool
    /// give what they give run in order on the calling thread.
    #[test]
    fn results_are_bit_identical_on_one_thread_and_on_the_pool() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        for (m, k, n) in [
            (200, 300, 700),
            (700, 301, 200),
            (128, 784, 1024),
            (1000, 64, 40),
        ] {
            assert!(
                split(m, n, k).tasks > 1,
                "[{m}, {k}]·[{k}, {n}] is not split"
            );
            let a = values(m * k, 11);
            let b = values(k * n, 12);
            for (ta, tb) in [(false, false), (true, false), (false, true)] {
                let run = |inline: bool| {
                    let mut out = vec![1.5f32; m * n];
                    pool::set_inline(inline);
                    let done = gemm_bf16((m, k, n), (&a, ta), (&b, tb), &mut out, Some((0.5, 2.0)));
                    pool::set_inline(false);
                    assert!(done);
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                };
                assert!(
                    run(true) == run(false),
                    "[{m}, {k}]·[{k}, {n}] ta {ta} tb {tb}"
                );
            }
        }
    }
}
