//! Products with a right operand packed once: `out[m×n] = a[m×k] · b[k×n] (+ bias) (then ReLU)`
//! for f32, where `b` — a layer's weights — was rearranged by [`pack`] ahead of time.
//!
//! Why: the `gemm` crate packs `b` into column panels on every call before it multiplies. For
//! inference the weights do not change between calls, and at batch 64 on the MLP
//! 784→1024→1024→10 that packing was 16% of the time (profiled on the project's machine). Packed
//! once, each call reads the panels straight from memory in the order the kernel needs them.
//!
//! Layout: `b`'s columns are cut into panels of [`NR`] (the last one padded with zeros); panel
//! `j` holds rows `0..k` of columns `j·NR..(j+1)·NR`, row after row, so the kernel reads one
//! panel as one run of `k·NR` floats.
//!
//! Kernel: a block of up to [`MR`] rows of `a` times `KC` rows of a panel, into `MR×NR`
//! accumulators held in registers (12 AVX registers at `MR` 6), for every row block while the
//! panel's slice stays in L1. The bias and ReLU are applied when the last slice is stored, so
//! a dense layer writes its output once.
//!
//! Each output element is summed in the order p = 0, 1, …, k − 1 with fused multiply-adds,
//! whatever `m`, the thread count or the panel split, then the bias is added: a row's result
//! does not depend on the batch it came in.

use super::pool::{self, SendPtr};
use crate::backend::contract::Mnk;

/// Columns per panel (two AVX vectors).
pub(crate) const NR: usize = 16;

/// Rows of `a` per kernel call.
const MR: usize = 6;

/// Rows of a panel per pass over the row blocks: 256 × 16 f32 (16 KiB) stay in L1 while every
/// row block reads them.
const KC: usize = 256;

/// Panels per pool task: enough tasks for the threads to even out, each a long run of memory.
const PANELS_PER_TASK: usize = 4;

/// Multiply-adds below which a product runs on the calling thread.
const PAR_MIN: usize = 48 * 48 * 48;

/// Floats a packed `[k, n]` operand takes.
pub(crate) fn packed_len(k: usize, n: usize) -> usize {
    n.div_ceil(NR) * k * NR
}

/// Packs `b` (`[k, n]`, row-major, contiguous) into `out` (`packed_len(k, n)` floats).
pub(crate) fn pack(k: usize, n: usize, b: &[f32], out: &mut [f32]) {
    // Checked in release builds too: `packed_matmul` trusts this layout.
    assert!(
        b.len() == k * n && out.len() == packed_len(k, n),
        "pack: lengths {} and {} do not fit [{k}, {n}]",
        b.len(),
        out.len()
    );
    if k == 0 {
        return; // nothing to pack: `out` is empty
    }
    for (j, panel) in out.chunks_exact_mut(k * NR).enumerate() {
        let cols = j * NR..((j + 1) * NR).min(n);
        for (p, dst) in panel.chunks_exact_mut(NR).enumerate() {
            let src = &b[p * n + cols.start..p * n + cols.end];
            dst[..src.len()].copy_from_slice(src);
            dst[src.len()..].iter_mut().for_each(|x| *x = 0.0);
        }
    }
}

/// What a packed product does to its sums before it stores them: add a bias of `n` floats,
/// then apply ReLU (a dense layer's epilogue).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Epilogue<'a> {
    /// Added to every row.
    pub bias: Option<&'a [f32]>,
    /// ReLU after the bias.
    pub relu: bool,
}

/// `out = a · b (+ bias) (then ReLU)`, with `a` `[m, k]` and `out` `[m, n]` row-major and
/// contiguous, `packed` the `[k, n]` operand as [`pack`] wrote it.
pub(crate) fn packed_matmul(
    dims: Mnk,
    a: &[f32],
    packed: &[f32],
    epilogue: Epilogue<'_>,
    out: &mut [f32],
) {
    product(dims, (a, packed), epilogue, out, true);
}

/// [`packed_matmul`] with the AVX2 kernel when `avx2` is asked for and the CPU has AVX2 and FMA,
/// else the portable one.
fn product(
    Mnk { m, k, n }: Mnk,
    (a, packed): (&[f32], &[f32]),
    Epilogue { bias, relu }: Epilogue<'_>,
    out: &mut [f32],
    avx2: bool,
) {
    // Checked in release builds too: the kernels read through raw pointers.
    assert!(
        a.len() == m * k
            && packed.len() == packed_len(k, n)
            && out.len() == m * n
            && bias.is_none_or(|b| b.len() == n),
        "packed_matmul: lengths {}, {}, {}, {:?} do not fit [{m}, {k}] · packed [{k}, {n}]",
        a.len(),
        packed.len(),
        out.len(),
        bias.map(<[f32]>::len)
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // An empty sum: the bias alone, through the activation.
        for row in out.chunks_exact_mut(n) {
            for (j, o) in row.iter_mut().enumerate() {
                let v = bias.map_or(0.0, |b| b[j]);
                *o = if relu { v.max(0.0) } else { v };
            }
        }
        return;
    }
    let panels = n.div_ceil(NR);
    let job = Operands {
        m,
        k,
        n,
        a: a.as_ptr(),
        packed: packed.as_ptr(),
        bias: bias.map(<[f32]>::as_ptr),
        relu,
        out: SendPtr(out.as_mut_ptr()),
        avx2: avx2 && super::gemv::available(),
    };
    let per_task = panels_per_task(m, k);
    let tasks = panels.div_ceil(per_task);
    let task = |t: usize| {
        let first = t * per_task;
        // SAFETY: `job` describes the operands checked above, which stay borrowed until this
        // function returns; `run` gives each task index to one call, and task t writes only the
        // columns of panels first..first + per_task, so the tasks' writes are disjoint.
        unsafe { job.panels(first..(first + per_task).min(panels)) };
    };
    if self::tasks(m, k, n) < 2 || pool::threads() < 2 {
        (0..tasks).for_each(task);
    } else {
        pool::run(tasks, super::Work::product(m, k, n), &task);
    }
}

/// Panels per task of a packed product with `m` rows and depth `k`: at least
/// `PANELS_PER_TASK`, and enough that a task has `PAR_MIN` multiply-adds, so a short batch does
/// not wake a thread per four panels. From the sizes alone; each panel is computed the same way
/// whichever task has it.
pub(crate) fn panels_per_task(m: usize, k: usize) -> usize {
    PANELS_PER_TASK.max(PAR_MIN.div_ceil((m * k * NR).max(1)))
}

/// Tasks of a packed product `[m, k] · [k, n]` (1: it runs on the calling thread).
pub(crate) fn tasks(m: usize, k: usize, n: usize) -> usize {
    let tasks = n.div_ceil(NR).div_ceil(panels_per_task(m, k));
    if m * k * n < PAR_MIN {
        1
    } else {
        tasks
    }
}

/// One product's operands, as raw pointers so that pool tasks can share them.
struct Operands {
    m: usize,
    k: usize,
    n: usize,
    a: *const f32,
    packed: *const f32,
    bias: Option<*const f32>,
    relu: bool,
    out: SendPtr<f32>,
    avx2: bool,
}

// SAFETY: the pointers are only read (a, packed, bias) or written in disjoint column ranges
// (out), as `packed_matmul` states for each task.
unsafe impl Sync for Operands {}

impl Operands {
    /// Computes the output columns of `panels`.
    ///
    /// # Safety
    ///
    /// The pointers hold what `packed_matmul` checked, and no other thread writes these
    /// panels' columns of `out` meanwhile.
    unsafe fn panels(&self, panels: std::ops::Range<usize>) {
        let (m, k, n) = (self.m, self.k, self.n);
        let mut j = panels.start;
        while j < panels.end {
            // A single row reads 4 full panels at once: one panel gives its two FMA chains
            // too little to do between loads.
            let group = if m == 1 && j + WIDE <= panels.end && (j + WIDE) * NR <= n {
                WIDE
            } else {
                1
            };
            let width = NR.min(n - j * NR);
            let mut k0 = 0;
            while k0 < k {
                let kc = KC.min(k - k0);
                let last = k0 + kc == k;
                let tile = Tile {
                    kc,
                    lda: k,
                    // Panel j starts at j·k·NR and row k0 of it k0·NR further, inside
                    // `packed_len(k, n)`.
                    b: self.packed.wrapping_add((j * k + k0) * NR),
                    panel_stride: k * NR,
                    ldc: n,
                    width,
                    first: k0 == 0,
                    bias: if last {
                        self.bias.map(|b| b.wrapping_add(j * NR))
                    } else {
                        None
                    },
                    relu: last && self.relu,
                };
                let mut i = 0;
                while i < m {
                    let rows = MR.min(m - i);
                    let a = self.a.wrapping_add(i * k + k0);
                    let c = self.out.get().wrapping_add(i * n + j * NR);
                    // SAFETY: rows i..i + rows ≤ m of a and out, columns
                    // j·NR..j·NR + (group − 1)·NR + width ≤ n of out, rows k0..k0 + kc ≤ k of
                    // panels j..j + group and their bias are inside the operands this
                    // function's contract describes; only this call writes those columns now.
                    // The AVX2 kernel runs only where `avx2` says the CPU has AVX2 and FMA.
                    unsafe {
                        if !self.avx2 {
                            tile.portable(rows, group, a, c);
                        } else {
                            #[cfg(target_arch = "x86_64")]
                            match (rows, group) {
                                (1, WIDE) => tile.avx2::<1, WIDE>(a, c),
                                (6, _) => tile.avx2::<6, 1>(a, c),
                                (5, _) => tile.avx2::<5, 1>(a, c),
                                (4, _) => tile.avx2::<4, 1>(a, c),
                                (3, _) => tile.avx2::<3, 1>(a, c),
                                (2, _) => tile.avx2::<2, 1>(a, c),
                                _ => tile.avx2::<1, 1>(a, c),
                            }
                        }
                    }
                    i += rows;
                }
                k0 += kc;
            }
            j += group;
        }
    }
}

/// Panels a one-row product reads at once.
const WIDE: usize = 4;

/// One kernel call's shape: `kc` rows of one panel into a block of rows.
struct Tile {
    kc: usize,
    /// Distance between rows of `a`.
    lda: usize,
    /// Row k0 of the (first) panel.
    b: *const f32,
    /// Distance between panels (`k·NR`), for kernels that take several.
    panel_stride: usize,
    /// Distance between rows of the output.
    ldc: usize,
    /// Valid columns of this panel (16, or fewer in the last one).
    width: usize,
    /// Whether the accumulators start at zero (the first slice) or at what `out` holds.
    first: bool,
    /// The panel's bias, added on the last slice.
    bias: Option<*const f32>,
    /// Whether to clamp at zero on the last slice.
    relu: bool,
}

impl Tile {
    /// The portable kernel, for CPUs without AVX2 and FMA: the same sums in the same order.
    ///
    /// # Safety
    ///
    /// `a` points to `rows` rows of `kc` floats `lda` apart, `c` to `rows` rows of
    /// `(panels − 1)·NR + width` floats `ldc` apart, and `b` / `bias` as the fields say.
    unsafe fn portable(&self, rows: usize, panels: usize, a: *const f32, c: *mut f32) {
        // SAFETY: every pointer read or written is inside what the caller's contract gives.
        unsafe {
            for r in 0..rows {
                for col in 0..(panels - 1) * NR + self.width {
                    let (panel, lane) = (col / NR, col % NR);
                    let b = self.b.add(panel * self.panel_stride + lane);
                    let o = c.add(r * self.ldc + col);
                    let mut acc = if self.first { 0.0 } else { *o };
                    for p in 0..self.kc {
                        acc = (*a.add(r * self.lda + p)).mul_add(*b.add(p * NR), acc);
                    }
                    if let Some(b) = self.bias {
                        acc += *b.add(col);
                    }
                    if self.relu {
                        acc = acc.max(0.0);
                    }
                    *o = acc;
                }
            }
        }
    }

    /// The AVX2 kernel: `R` rows × `P` panels of 16 columns in 2·R·P registers. With `P > 1`
    /// every panel is full.
    ///
    /// # Safety
    ///
    /// As [`Tile::portable`] with `rows = R` and `panels = P`, and the CPU has AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const R: usize, const P: usize>(&self, a: *const f32, c: *mut f32) {
        // SAFETY: every pointer read or written is inside what the caller's contract gives,
        // and the CPU has AVX2 and FMA (the contract too).
        unsafe {
            use std::arch::x86_64::*;
            let full = self.width == NR;
            // Lanes of a panel's two vectors that hold valid columns (all of them when full).
            let lane = |v: usize| {
                let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let valid = _mm256_set1_epi32(self.width as i32 - (v * 8) as i32);
                _mm256_cmpgt_epi32(valid, idx)
            };
            let masks = [lane(0), lane(1)];
            // Vector v (0..2·P) of a row of 16·P floats.
            let load = |p: *const f32, v: usize| {
                if full {
                    _mm256_loadu_ps(p.add(v * 8))
                } else {
                    _mm256_maskload_ps(p.add(v * 8), masks[v])
                }
            };
            let mut acc = [[[_mm256_setzero_ps(); 2]; P]; R];
            if !self.first {
                for (r, row) in acc.iter_mut().enumerate() {
                    for (q, pair) in row.iter_mut().enumerate() {
                        let o = c.add(r * self.ldc + q * NR);
                        *pair = [load(o, 0), load(o, 1)];
                    }
                }
            }
            let mut acc = dot::<R, P>(acc, self.kc, (a, self.lda), (self.b, self.panel_stride));
            if let Some(bias) = self.bias {
                for q in 0..P {
                    let bias = [load(bias.add(q * NR), 0), load(bias.add(q * NR), 1)];
                    for row in acc.iter_mut() {
                        row[q][0] = _mm256_add_ps(row[q][0], bias[0]);
                        row[q][1] = _mm256_add_ps(row[q][1], bias[1]);
                    }
                }
            }
            if self.relu {
                let zero = _mm256_setzero_ps();
                for pair in acc.iter_mut().flatten() {
                    pair[0] = _mm256_max_ps(pair[0], zero);
                    pair[1] = _mm256_max_ps(pair[1], zero);
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (q, pair) in row.iter().enumerate() {
                    let o = c.add(r * self.ldc + q * NR);
                    if full {
                        _mm256_storeu_ps(o, pair[0]);
                        _mm256_storeu_ps(o.add(8), pair[1]);
                    } else {
                        _mm256_maskstore_ps(o, masks[0], pair[0]);
                        _mm256_maskstore_ps(o.add(8), masks[1], pair[1]);
                    }
                }
            }
        }
    }
}

/// The kernel's inner loop: `acc[r][q] += a[r, p] · panel q row p` for p in 0..kc, the
/// accumulators passed by value so that they stay in registers.
///
/// # Safety
///
/// `a` holds `R` rows of `kc` floats `lda` apart, each of the `P` panels (`stride` apart) `kc`
/// rows of 16 floats from `b`, and the CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
// Indexed loops over constant bounds on accumulators passed by value: with this loop written
// inside `Tile::avx2`, LLVM kept the accumulators on the stack and the kernel ran at half speed.
#[allow(clippy::needless_range_loop)]
unsafe fn dot<const R: usize, const P: usize>(
    mut acc: [[[std::arch::x86_64::__m256; 2]; P]; R],
    kc: usize,
    (mut a, lda): (*const f32, usize),
    (mut b, stride): (*const f32, usize),
) -> [[[std::arch::x86_64::__m256; 2]; P]; R] {
    use std::arch::x86_64::*;
    // SAFETY: the reads stay inside what the contract gives; the intrinsics need AVX2 and FMA,
    // which the contract promises.
    unsafe {
        for _ in 0..kc {
            let mut bv = [[_mm256_setzero_ps(); 2]; P];
            for q in 0..P {
                let panel = b.add(q * stride);
                bv[q] = [_mm256_loadu_ps(panel), _mm256_loadu_ps(panel.add(8))];
            }
            for r in 0..R {
                let x = _mm256_broadcast_ss(&*a.add(r * lda));
                for q in 0..P {
                    acc[r][q][0] = _mm256_fmadd_ps(x, bv[q][0], acc[r][q][0]);
                    acc[r][q][1] = _mm256_fmadd_ps(x, bv[q][1], acc[r][q][1]);
                }
            }
            a = a.add(1);
            b = b.add(NR);
        }
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;

    /// out = a·b + bias, then ReLU, summed p = 0..k in f32 with fused multiply-adds.
    fn reference(
        m: usize,
        k: usize,
        n: usize,
        a: &[f32],
        b: &[f32],
        bias: Option<&[f32]>,
        relu: bool,
    ) -> Vec<f32> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0.0f32;
                for p in 0..k {
                    acc = a[i * k + p].mul_add(b[p * n + j], acc);
                }
                acc += bias.map_or(0.0, |b| b[j]);
                out[i * n + j] = if relu { acc.max(0.0) } else { acc };
            }
        }
        out
    }

    #[test]
    fn agrees_with_the_definition_for_every_edge_of_the_blocking() {
        // Row counts around MR, column counts around NR and the task split, depths around KC.
        for &(m, k, n) in &[
            (1, 1, 1),
            (3, 0, 5),
            (5, 3, 17),
            (6, 257, 16),
            (7, 256, 15),
            (13, 600, 70),
            (64, 784, 130),
            (2, 1030, 10),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| ((i % 13) as f32 - 6.0) * 0.3).collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.7).collect();
            let bias: Vec<f32> = (0..n).map(|j| j as f32 - 4.5).collect();
            let mut packed = vec![f32::NAN; packed_len(k, n)];
            pack(k, n, &b, &mut packed);
            for (bias, relu) in [(None, false), (Some(&bias[..]), false), (Some(&bias), true)] {
                let want = reference(m, k, n, &a, &b, bias, relu);
                let mut out = vec![f32::NAN; m * n];
                packed_matmul(
                    Mnk { m, k, n },
                    &a,
                    &packed,
                    Epilogue { bias, relu },
                    &mut out,
                );
                assert_eq!(
                    out,
                    want,
                    "m {m} k {k} n {n} bias {} relu {relu}",
                    bias.is_some()
                );
                // The portable kernel gives the same sums.
                out.iter_mut().for_each(|o| *o = f32::NAN);
                product(
                    Mnk { m, k, n },
                    (&a, &packed),
                    Epilogue { bias, relu },
                    &mut out,
                    false,
                );
                assert_eq!(out, want, "portable, m {m} k {k} n {n}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "packed_matmul: lengths")]
    fn checks_lengths_in_release_builds() {
        let (a, packed, mut out) = (vec![1.0f32; 6], vec![1.0f32; 16], vec![0.0f32; 4]);
        packed_matmul(
            Mnk { m: 2, k: 3, n: 2 },
            &a,
            &packed,
            Epilogue::default(),
            &mut out,
        );
    }
}
