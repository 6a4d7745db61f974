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
//! - `op(b)` is packed into *strips* of 16 columns: for each pair `p`, the 16 columns' pairs
//!   (one zmm), strip after strip, the last strip's missing columns zero. A product split into
//!   blocks of columns packs each block's strips in the task that computes the block (in
//!   parallel, and while they are in cache); one split into blocks of rows packs all strips
//!   first (on the pool), as every block reads all of them;
//! - `op(a)` is read in place when it is stored `[m, k]` with `k` even (a row's pairs are
//!   adjacent); with `k` odd its rows are copied with the zero after them; stored transposed
//!   (`[k, m]`), it is packed into strips of 16 rows as `op(b)` is into strips of columns.
//!
//! The micro-kernel keeps a `6 × 64` tile of the result in 24 zmm accumulators (fewer at the
//! edges), and for each pair loads four vectors of `op(b)` and broadcasts one pair of each of
//! the 6 rows of `op(a)`: 24 `vdpbf16ps` for 10 loads. 64 columns are also the narrowest block
//! of a split by columns, so blocks are mostly whole tiles. The depth is cut into blocks of
//! equal size, at most [`KC`] pairs (a `KC × 64` panel of `op(b)`, 32 KiB, stays in L1 or L2
//! while the rows of `op(a)` stream past it); the first block writes the tile (`α·acc`, or
//! `β·out + α·acc`), the next ones add theirs (`out + α·acc`). On the project's 2-core AMD
//! EPYC (Zen 4) one core ran 100–105 G multiply-adds/s in large products, about twice what the
//! widening path (gemm's f32 kernel) gets.
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
//! `vdpbf16ps` does not compute exactly what the widening path does: it treats denormal
//! (subnormal) inputs as zero and flushes denormal results to zero, whatever MXCSR says, and it
//! adds each pair's two products into the f32 accumulator with its own rounding to f32 (round
//! to nearest even), not in the order nor with the roundings of the widening path's f32 FMA
//! chain. Products of bf16 are exact in f32, so results agree with the widening path to the
//! last bits of f32 (far below bf16's precision), but they are not bit-identical to it: once
//! rounded to bf16, a result can differ from the widening path's by one unit in the last place,
//! and subnormal operands or results become zero. This is accepted. Infinities and NaN
//! propagate as in f32 arithmetic. Results do not depend on the thread count (see above).

use half::bf16;

/// The most pairs of depth per block of the depth (256 values of `k`): a `KC × 64` panel of
/// packed `op(b)` is 32 KiB, which stays in cache while the micro-kernel runs down the rows of
/// `op(a)`. (96 and 192 ran as fast, within the noise, on the project's machine.)
const KC: usize = 128;

/// Rows of the micro-kernel's tile.
const MR: usize = 6;

/// Strips of 16 columns in the micro-kernel's tile (64 columns).
const NS: usize = 4;

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
    dims: (usize, usize, usize),
    a: (&[bf16], bool),
    (b, tb): (&[bf16], bool),
    out: &mut [f32],
    accumulate: Option<(f32, f32)>,
) -> bool {
    gemm_with(dims, a, (Right::Bf16(b), tb), out, accumulate)
}

/// [`gemm_bf16`] with `b` in f32, each value rounded to bf16 (to nearest even, as `to_dtype`
/// rounds it) as it is packed: the same result as a bf16 copy of `b` would give, with no copy
/// made (an autocast product reading an f32 weight).
pub(crate) fn gemm_bf16_rounded_b(
    dims: (usize, usize, usize),
    a: (&[bf16], bool),
    (b, tb): (&[f32], bool),
    out: &mut [f32],
    accumulate: Option<(f32, f32)>,
) -> bool {
    gemm_with(dims, a, (Right::F32(b), tb), out, accumulate)
}

/// The right operand of a product as stored: bf16, or f32 read rounded to bf16.
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Right<'a> {
    Bf16(&'a [bf16]),
    F32(&'a [f32]),
}

impl Right<'_> {
    fn len(&self) -> usize {
        match self {
            Right::Bf16(b) => b.len(),
            Right::F32(b) => b.len(),
        }
    }
}

fn gemm_with(
    (m, k, n): (usize, usize, usize),
    (a, ta): (&[bf16], bool),
    (b, tb): (Right<'_>, bool),
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
        Some((0.0, q)) => (None, q),
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
    use super::{Right, KC, MR, NS, STRIP};

    /// See [`gemm_bf16`], whose checks this assumes (`k ≥ 1`, `m, n ≥ 1`, lengths).
    /// `(beta, alpha)`: `out = beta·out + alpha·product` with `beta = Some`, else
    /// `out = alpha·product`.
    pub(super) fn product(
        (m, k, n): (usize, usize, usize),
        (a, ta): (&[bf16], bool),
        (b, tb): (Right<'_>, bool),
        out: &mut [f32],
        (beta, alpha): (Option<f32>, f32),
    ) {
        let kp = k.div_ceil(2);
        let strips = n.div_ceil(STRIP);
        // Written entirely by the packing (`pack_b`) before it is read.
        let mut packed_b = Packed::scratch(strips * kp * STRIP);
        let mut packed_a = None;
        let left = if ta {
            let buf = packed_a.insert(Packed::scratch(m.div_ceil(STRIP) * kp * STRIP));
            let dst = buf.as_mut_slice();
            // SAFETY: `available` said the CPU has AVX-512 F and BW (`gemm_bf16` checked it);
            // `a` is `[k, m]` and `dst` holds the strips of its `m` columns (op(a)'s rows).
            unsafe { interleave(a, k, m, 0..m, dst.as_mut_ptr(), dst.len()) };
            Left::Strips(buf.as_ptr())
        } else if k.is_multiple_of(2) {
            Left::Rows(a.as_ptr().cast::<u32>(), kp)
        } else {
            let buf = packed_a.insert(Packed::scratch(m * kp));
            let rows = buf.as_mut_slice();
            for (dst, src) in rows.chunks_exact_mut(kp).zip(a.chunks_exact(k)) {
                for (d, s) in dst.iter_mut().zip(src.chunks(2)) {
                    let hi = s.get(1).map_or(0, |h| u32::from(h.to_bits()));
                    *d = u32::from(s[0].to_bits()) | (hi << 16);
                }
            }
            Left::Rows(buf.as_ptr(), kp)
        };
        let Split {
            by_cols,
            block: size,
            tasks,
        } = split(m, n, k);
        let dst = packed_b.as_mut_slice();
        let job = Job {
            n,
            k,
            kp,
            left,
            src_b: (b, tb),
            b: SendPtr(dst.as_mut_ptr()),
            b_len: dst.len(),
            // A block of whole columns packs the strips of op(b) it reads (they are its own);
            // blocks of rows share all of them, packed first.
            pack_in_blocks: by_cols || tasks < 2,
            out: SendPtr(out.as_mut_ptr()),
            beta,
            alpha,
        };
        let work = super::super::Work::product(m, k, n);
        if !job.pack_in_blocks {
            let chunk = (STRIP * 16).max(n.div_ceil(STRIP * super::super::MAX_TASKS) * STRIP);
            let work = super::super::Work::pass::<bf16>(k * n, 3);
            // SAFETY: the CPU has the features (checked by `gemm_bf16`); the tasks pack disjoint
            // strips (chunks of whole strips) of `packed_b`, which nothing else touches yet.
            pool::run(n.div_ceil(chunk), work, &|t| unsafe {
                job.pack_b(t * chunk..((t + 1) * chunk).min(n))
            });
        }
        // For each `run` below: the CPU has the features (checked by `gemm_bf16`); the blocks'
        // ranges lie inside `0..m` × `0..n`, columns start at multiples of 16 (`split` aligns
        // its blocks so), and are disjoint, so concurrent blocks write disjoint parts of `out`
        // (and of `packed_b` when they pack), which outlive the pool's run; op(b) is packed
        // before it is read (by the block that reads it, or above), op(a) only read.
        if tasks < 2 {
            // SAFETY: see above; one block, the whole result.
            return unsafe { job.run(0..m, 0..n) };
        }
        let part = |t: usize| t * size..((t + 1) * size).min(if by_cols { n } else { m });
        if by_cols {
            // SAFETY: see above; task t computes block t of whole columns.
            pool::run(tasks, work, &|t| unsafe { job.run(0..m, part(t)) });
        } else {
            // SAFETY: see above; task t computes block t of whole rows.
            pool::run(tasks, work, &|t| unsafe { job.run(part(t), 0..n) });
        }
    }

    /// The pairs of depth (`k.div_ceil(2)`) of an operand packed into strips, after checking,
    /// in release builds too (the packers write through raw pointers), that `src_len` values
    /// are `width` columns of depth `k`, that `dst_len` u32 hold all their strips, and that
    /// `cols` starts a strip and lies within the width.
    fn checked_pairs(
        src_len: usize,
        k: usize,
        width: usize,
        cols: &std::ops::Range<usize>,
        dst_len: usize,
    ) -> usize {
        let kp = k.div_ceil(2);
        assert!(src_len == k * width && dst_len == width.div_ceil(STRIP) * kp * STRIP);
        assert!(cols.start.is_multiple_of(STRIP) && cols.end <= width);
        kp
    }

    /// Packs the columns `cols` of `src`, `k` rows of `width` bf16 (row-major), into strips of
    /// 16 columns of pairs: `dst[((j / 16)·kp + p)·16 + j % 16] = src[2p][j] | src[2p + 1][j]
    /// << 16`, a missing row `k` (odd `k`) and the columns past `width` zero. Writes every
    /// element of the strips `cols` covers, and nothing else.
    ///
    /// # Safety
    ///
    /// The CPU must have AVX-512 F and BW. `dst` points to `dst_len =
    /// width.div_ceil(16)·kp·16` u32 writable; `cols` ⊂ `0..width` starts at a multiple of 16,
    /// and ends at one or at `width`.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn interleave(
        src: &[bf16],
        k: usize,
        width: usize,
        cols: std::ops::Range<usize>,
        dst: *mut u32,
        dst_len: usize,
    ) {
        let kp = checked_pairs(src.len(), k, width, &cols, dst_len);
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
        for p in 0..kp {
            for c in cols.clone().step_by(2 * STRIP) {
                let left = cols.end - c;
                let mask: u32 = if left >= 32 { !0 } else { (1 << left) - 1 };
                // SAFETY: rows 2p (< k) and 2p + 1 (when < k) exist; the mask limits the loads
                // to columns c.. < cols.end ≤ width of the row (masked lanes are not read).
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
                // s + 1 only when `cols` covers it.
                unsafe {
                    _mm512_storeu_si512(
                        dst.add((s * kp + p) * STRIP).cast(),
                        _mm512_permutex2var_epi16(x, lo, y),
                    );
                    if c + STRIP < cols.end {
                        _mm512_storeu_si512(
                            dst.add(((s + 1) * kp + p) * STRIP).cast(),
                            _mm512_permutex2var_epi16(x, hi, y),
                        );
                    }
                }
            }
        }
    }

    /// The blocks' shared description of a product.
    struct Job<'a> {
        n: usize,
        k: usize,
        kp: usize,
        left: Left,
        /// `b` as stored, and whether transposed (`[n, k]`).
        src_b: (Right<'a>, bool),
        /// Packed `op(b)` (see `interleave`), `b_len = n.div_ceil(16)·kp·16` u32.
        b: SendPtr<u32>,
        b_len: usize,
        /// Whether each block packs its own columns of `op(b)` (else they are packed first).
        pack_in_blocks: bool,
        out: SendPtr<f32>,
        beta: Option<f32>,
        alpha: f32,
    }

    // SAFETY: the pointers are read only (`left`) or written in disjoint blocks (`b`, `out`, see
    // `product`), and the buffers they point to outlive the pool's run.
    unsafe impl Sync for Job<'_> {}

    impl Job<'_> {
        /// Packs the strips of `op(b)` that cover the columns `cols`.
        ///
        /// # Safety
        ///
        /// The CPU has AVX-512 F and BW; `cols` ⊂ `0..n` starts at a multiple of 16 and ends at
        /// one or at `n`; no other thread touches those strips meanwhile.
        unsafe fn pack_b(&self, cols: std::ops::Range<usize>) {
            let (dst, len) = (self.b.get(), self.b_len);
            let (n, k) = (self.n, self.k);
            match self.src_b {
                // SAFETY: the caller's promises.
                (Right::Bf16(b), true) => unsafe {
                    pack_pairs(b, bf16::to_bits, n, k, cols, dst, len)
                },
                // SAFETY: the caller's promises.
                (Right::Bf16(b), false) => unsafe { interleave(b, k, n, cols, dst, len) },
                // SAFETY: the caller's promises.
                (Right::F32(b), true) => unsafe { pack_pairs_rounded(b, n, k, cols, dst, len) },
                // SAFETY: the caller's promises.
                (Right::F32(b), false) => unsafe { interleave_rounded(b, k, n, cols, dst, len) },
            }
        }

        /// Computes `out[rows, cols]`.
        ///
        /// # Safety
        ///
        /// The CPU has AVX512-BF16, F and BW; `rows` ⊂ `0..m`, `cols` ⊂ `0..n` starts at a
        /// multiple of 16; no other thread touches `out[rows, cols]` meanwhile.
        unsafe fn run(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
            assert!(cols.start.is_multiple_of(STRIP));
            if self.pack_in_blocks {
                // SAFETY: the block's columns are its own (the caller's promise).
                unsafe { self.pack_b(cols.clone()) };
            }
            let (n, kp) = (self.n, self.kp);
            // Depth blocks of at most KC pairs, of equal size (the last may be shorter by less
            // than one per block): they depend on `k` only.
            let blocks = kp.div_ceil(KC);
            let kc_max = kp.div_ceil(blocks);
            // Pair `p` of row `i` of op(a): `a + i·row_step + p·pair_step`, where strips of 16
            // rows are `kp·16 − 16` further apart (`Strips`).
            let (a, row_step, pair_step, strip_gap) = match self.left {
                Left::Rows(p, stride) => (p, stride, 1, 0),
                Left::Strips(p) => (p, 1, STRIP, kp * STRIP - STRIP),
            };
            for pc in (0..kp).step_by(kc_max) {
                let kc = kc_max.min(kp - pc);
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
                    let b = unsafe { self.b.get().add((c / STRIP * kp + pc) * STRIP).cast_const() };
                    let mut i = rows.start;
                    while i < rows.end {
                        let r = (rows.end - i).min(MR);
                        let mut rows_a = [a; MR];
                        for (t, row) in rows_a.iter_mut().enumerate().take(r) {
                            let i = i + t;
                            // SAFETY: row i < m and pair pc < kp exist in the operand's layout.
                            *row = unsafe {
                                a.add(i * row_step + (i / STRIP) * strip_gap + pc * pair_step)
                            };
                        }
                        let tile = Tile {
                            kc,
                            a: rows_a,
                            pair_step,
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
        /// Each row's first pair; a row's next pairs `pair_step` u32 apart.
        a: [*const u32; MR],
        pair_step: usize,
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
        /// Runs the kernel for `r` rows (1..=MR) and `s` strips (1..=NS).
        ///
        /// # Safety
        ///
        /// As [`kernel`].
        unsafe fn dispatch(&self, r: usize, s: usize) {
            macro_rules! go {
                ($($r:literal)*) => {
                    match (r, s) {
                        $(
                            ($r, 1) => kernel::<$r, 1>(self),
                            ($r, 2) => kernel::<$r, 2>(self),
                            ($r, 3) => kernel::<$r, 3>(self),
                            ($r, 4) => kernel::<$r, 4>(self),
                        )*
                        _ => unreachable!("bf16 tile of {r} rows and {s} strips"),
                    }
                };
            }
            const _: () = assert!(MR <= 8 && NS <= 4);
            // SAFETY: the caller's promises are the kernel's.
            unsafe { go!(1 2 3 4 5 6 7 8) }
        }
    }

    /// The micro-kernel: `R` rows × `S` strips of 16 columns of the result from `t.kc` pairs.
    ///
    /// # Safety
    ///
    /// The CPU has AVX512-BF16, F and BW. For `p < kc`, `r < R`, `s < S`: the pairs
    /// `t.a[r] + p·pair_step` and `t.b[s·b_stride + p·16 .. +16]` are readable; the tile's
    /// elements `c[r·ldc + s·16 + j]` for the columns `j` set in `masks[s]` are writable (and
    /// readable with `Store::Scale`), touched by no other thread.
    #[target_feature(enable = "avx512f,avx512bf16,avx512bw")]
    unsafe fn kernel<const R: usize, const S: usize>(t: &Tile) {
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
                let pair = unsafe { t.a[r].add(p * t.pair_step).read_unaligned() };
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

    /// A buffer of `u32` (the thread's reusable f32 buffers of `wide.rs`, reinterpreted).
    struct Packed(Wide);

    impl Packed {
        /// `len` u32 of unspecified value, to be written before they are read.
        fn scratch(len: usize) -> Packed {
            Packed(Wide::scratch(len))
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

    /// Packs the rows `cols` of `src`, `width` rows of `k` values (row-major: `op(b)` stored
    /// transposed, `[n, k]`), each value's bf16 bits given by `bits`, into the strips of
    /// `interleave`: `dst[((j / 16)·kp + p)·16 + j % 16] = src[j][2p] | src[j][2p+1] << 16`, the
    /// missing value past an odd `k` and the columns past `width` zero. Writes every element of
    /// the strips `cols` covers, and nothing else.
    ///
    /// # Safety
    ///
    /// As `interleave`, but for the CPU features (none needed).
    unsafe fn pack_pairs<T: Copy>(
        src: &[T],
        bits: impl Fn(T) -> u16,
        width: usize,
        k: usize,
        cols: std::ops::Range<usize>,
        dst: *mut u32,
        dst_len: usize,
    ) {
        let kp = checked_pairs(src.len(), k, width, &cols, dst_len);
        for s in cols.start / STRIP..cols.end.div_ceil(STRIP) {
            // SAFETY: strip s < width.div_ceil(16) lies inside `dst`, and is the caller's to
            // write (it covers columns of `cols`).
            let strip =
                unsafe { std::slice::from_raw_parts_mut(dst.add(s * kp * STRIP), kp * STRIP) };
            for lane in 0..STRIP {
                let j = s * STRIP + lane;
                if j >= width {
                    (0..kp).for_each(|p| strip[p * STRIP + lane] = 0);
                    continue;
                }
                for (p, pair) in src[j * k..(j + 1) * k].chunks(2).enumerate() {
                    let hi = pair.get(1).map_or(0, |&h| u32::from(bits(h)));
                    strip[p * STRIP + lane] = u32::from(bits(pair[0])) | (hi << 16);
                }
            }
        }
    }

    /// f32 bits → bf16 bits in the low half of each lane: `(b + 0x7fff + ((b >> 16) & 1))
    /// >> 16`, and for a NaN (`|b| > 0x7f800000`) `(b >> 16) | 0x40` (made quiet).
    #[target_feature(enable = "avx512f")]
    fn round(b: __m512i) -> __m512i {
        let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
        let near = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            b,
            _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd),
        ));
        let magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff));
        let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7f80_0000));
        let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
        _mm512_mask_blend_epi32(nan, near, quiet)
    }

    /// `pack_pairs` for f32 values, each rounded to bf16 as `interleave_rounded` rounds it:
    /// `src` holds `width` rows of `k` f32 (`op(b)` stored transposed). Blocks of 16 rows × 16
    /// pairs: each row's 32 values are rounded and paired in two zmm (a word shuffle keeps the
    /// bf16 halves), written to a small buffer, and the buffer's columns gathered into the
    /// strip's 16 lanes.
    ///
    /// # Safety
    ///
    /// As `interleave`.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn pack_pairs_rounded(
        src: &[f32],
        width: usize,
        k: usize,
        cols: std::ops::Range<usize>,
        dst: *mut u32,
        dst_len: usize,
    ) {
        let kp = checked_pairs(src.len(), k, width, &cols, dst_len);
        // Word 2i of the rounded values of elements 0..32 (two zmm, as 32-bit lanes) is element
        // i's bf16: pair q takes words 4q and 4q + 2.
        let words: [i16; 32] = std::array::from_fn(|i| (2 * i) as i16);
        // SAFETY: reads 64 bytes from an array of 64 bytes.
        let words = unsafe { _mm512_loadu_si512(words.as_ptr().cast()) };
        let rows: [i32; 16] = std::array::from_fn(|i| (i * STRIP) as i32);
        // SAFETY: reads 64 bytes from an array of 64 bytes.
        let rows = unsafe { _mm512_loadu_si512(rows.as_ptr().cast()) };
        let mut buf = [0u32; STRIP * STRIP];
        let src = src.as_ptr().cast::<i32>();
        for s in cols.start / STRIP..cols.end.div_ceil(STRIP) {
            let lanes = STRIP.min(width - s * STRIP);
            for p0 in (0..kp).step_by(STRIP) {
                let (first, count) = (2 * p0, (k - 2 * p0).min(2 * STRIP));
                let lo: u16 = if count >= STRIP { !0 } else { (1 << count) - 1 };
                let hi: u16 = match count.saturating_sub(STRIP) {
                    STRIP => !0,
                    c => (1 << c) - 1,
                };
                for lane in 0..STRIP {
                    let pairs = if lane < lanes {
                        let row = (s * STRIP + lane) * k + first;
                        // SAFETY: row s·16 + lane < width has k values; the masks limit the
                        // loads to its values first.. < k (masked lanes are zero).
                        let (x, y) = unsafe {
                            (
                                _mm512_maskz_loadu_epi32(lo, src.add(row)),
                                _mm512_maskz_loadu_epi32(hi, src.add(row + STRIP)),
                            )
                        };
                        _mm512_permutex2var_epi16(round(x), words, round(y))
                    } else {
                        _mm512_setzero_si512()
                    };
                    // SAFETY: row `lane` of the 16 × 16 buffer.
                    unsafe {
                        _mm512_storeu_si512(buf.as_mut_ptr().add(lane * STRIP).cast(), pairs)
                    };
                }
                for p in p0..(p0 + STRIP).min(kp) {
                    // SAFETY: the gather reads buf[lane·16 + p − p0], inside the buffer; strip
                    // s and pair p < kp lie inside `dst`, the caller's to write.
                    unsafe {
                        let column = buf.as_ptr().add(p - p0).cast::<i32>();
                        let v = _mm512_i32gather_epi32::<4>(rows, column);
                        _mm512_storeu_si512(dst.add((s * kp + p) * STRIP).cast(), v);
                    }
                }
            }
        }
    }

    /// `interleave` for f32 values, each rounded to bf16 (to nearest even, NaN kept quiet, as
    /// `to_dtype` rounds) as it is packed: `src` holds `k` rows of `width` f32. A pair of one
    /// column is one u32 lane, so 16 columns are rounded and packed with integer ops on one zmm
    /// per row, no shuffles.
    ///
    /// # Safety
    ///
    /// As `interleave`.
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn interleave_rounded(
        src: &[f32],
        k: usize,
        width: usize,
        cols: std::ops::Range<usize>,
        dst: *mut u32,
        dst_len: usize,
    ) {
        let kp = checked_pairs(src.len(), k, width, &cols, dst_len);
        let src = src.as_ptr().cast::<i32>();
        for s in cols.start / STRIP..cols.end.div_ceil(STRIP) {
            let c = s * STRIP;
            let lanes = STRIP.min(width - c);
            let mask: u16 = if lanes == STRIP { !0 } else { (1 << lanes) - 1 };
            for p in 0..kp {
                // SAFETY: rows 2p (< k) and 2p + 1 (when < k) exist; the mask limits the loads
                // to columns c.. < width of the row (masked lanes are not read, and are zero).
                let (x, y) = unsafe {
                    let x = _mm512_maskz_loadu_epi32(mask, src.add(2 * p * width + c));
                    let y = if 2 * p + 1 < k {
                        _mm512_maskz_loadu_epi32(mask, src.add((2 * p + 1) * width + c))
                    } else {
                        _mm512_setzero_si512()
                    };
                    (x, y)
                };
                // Columns past `width` are zero: 0 rounds to 0.
                let pair = _mm512_or_si512(round(x), _mm512_slli_epi32::<16>(round(y)));
                // SAFETY: strip s < strips and p < kp: 16 u32 inside `dst`, the caller's to
                // write (the strip covers columns of `cols`).
                unsafe { _mm512_storeu_si512(dst.add((s * kp + p) * STRIP).cast(), pair) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::matmul::split;
    use crate::backend::cpu::num::ROUNDING_CASES;
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
    fn transpose<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
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

    /// f32 values that exercise the rounding to bf16 ([`ROUNDING_CASES`] every third value)
    /// among ordinary ones.
    fn rounding_cases(len: usize, seed: u64) -> Vec<f32> {
        let special = ROUNDING_CASES;
        let ordinary = values(len, seed);
        (0..len)
            .map(|i| match i % 3 {
                0 => special[(i / 3) % special.len()],
                _ => ordinary[i].to_f32() * (1.0 + 2f32.powi(-12) * (i % 5) as f32),
            })
            .collect()
    }

    #[test]
    fn an_f32_operand_read_rounded_gives_the_product_of_its_bf16_copy_bit_for_bit() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        let shapes = [
            (1, 1, 1),
            (3, 7, 33),
            (9, 17, 49),
            (16, 33, 97),
            (33, 130, 47),
            (67, 257, 129),
        ];
        for (si, &(m, k, n)) in shapes.iter().enumerate() {
            let a = values(m * k, 7 * si as u64 + 3);
            let b = rounding_cases(k * n, 7 * si as u64 + 4);
            // The copy `to_dtype` would make (half's conversion: round to nearest even).
            let copy: Vec<bf16> = b.iter().map(|&v| bf16::from_f32(v)).collect();
            let bt = transpose(&b, k, n);
            let copy_t = transpose(&copy, k, n);
            for tb in [false, true] {
                let (rounded, copied) = if tb { (&bt, &copy_t) } else { (&b, &copy) };
                for acc in [None, Some((0.5f32, 2.0f32))] {
                    let init: Vec<f32> = (0..m * n).map(|i| (i % 7) as f32 - 3.0).collect();
                    let (mut got, mut want) = (init.clone(), init);
                    let left = (a.as_slice(), false);
                    assert!(gemm_bf16_rounded_b(
                        (m, k, n),
                        left,
                        (rounded, tb),
                        &mut got,
                        acc
                    ));
                    assert!(gemm_bf16((m, k, n), left, (copied, tb), &mut want, acc));
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "[{m}, {k}]·[{k}, {n}] tb {tb} {acc:?}"
                    );
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
