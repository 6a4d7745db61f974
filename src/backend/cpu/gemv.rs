//! Products with a short left operand, `out[m×n] = a[m×k] · b[k×n]` for `m ≤ MAX_M` (f32):
//! inference at batch 1 to 4, where a product is a matrix-vector product bound by reading `b`.
//!
//! Why not gemm: for one row gemm packs `b` into panels before it multiplies, so every weight is
//! read, written and read again, and at batch 1 a 784→1024→1024→10 forward pass took 1 ms where
//! streaming the 7.4 MB of weights once takes a fraction of that. Here each row of `b` is read
//! once, in order, and added into the output rows (which stay in L1) with the matching
//! coefficients of `a`: out[i, :] += a[i, p] · b[p, :], eight rows of `b` at a time, each read
//! as one long run (see `COLS`).
//!
//! Each output element is summed in the order p = 0, 1, …, k − 1 whatever `m`, the thread count
//! or the column split, so a row's result does not depend on the batch it came in (up to
//! `MAX_M` rows).

use super::pool::{self, SendPtr};

/// The longest left operand taken here; longer ones go to gemm, which then wins.
pub(crate) const MAX_M: usize = 4;

/// Columns per task. Each row of `b` is read as one run of `COLS` elements, and the hardware
/// prefetcher needs long runs: on the project's machines a 784→1024→1024 pass took 290 µs
/// reading whole 1024-column rows, 370 µs in runs of 512 and 430–550 µs in runs of 256, on one
/// thread. Two threads splitting the rows or the columns were no faster than one (the pass is
/// bound by memory, and shorter runs cost more than the second core gives), so a product only
/// runs on several threads when it has more than `COLS` columns. `m` output rows of `COLS`
/// f32 (16 KiB at most) stay in L1.
const COLS: usize = 1024;

/// Multiply-adds below which the product runs on the calling thread.
const PAR_MIN: usize = 1 << 16;

/// Tasks of a [`small_m`] product `[m, k] · [k, n]` (1: it runs on the calling thread).
pub(crate) fn tasks(m: usize, k: usize, n: usize) -> usize {
    if m * k * n < PAR_MIN {
        1
    } else {
        n.div_ceil(COLS)
    }
}

/// Whether [`small_m`] runs on this machine (f32 with AVX2 and FMA).
pub(crate) fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out = a · b` with `a` `[m, k]`, `b` `[k, n]`, `out` `[m, n]`, all row-major and contiguous,
/// `1 ≤ m ≤ MAX_M`. Call only when [`available`] says so.
pub(crate) fn small_m(m: usize, k: usize, n: usize, a: &[f32], b: &[f32], out: &mut [f32]) {
    // Checked in release builds too: the kernel's bounds are derived from these lengths.
    assert!(
        (1..=MAX_M).contains(&m) && a.len() == m * k && b.len() == k * n && out.len() == m * n,
        "small_m: operand lengths {}, {}, {} do not fit [{m}, {k}] · [{k}, {n}]",
        a.len(),
        b.len(),
        out.len()
    );
    out.iter_mut().for_each(|o| *o = 0.0);
    let tasks = n.div_ceil(COLS);
    let out_ptr = SendPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let cols = t * COLS..((t + 1) * COLS).min(n);
        let rows: [&mut [f32]; MAX_M] = std::array::from_fn(|i| {
            if i < m {
                // SAFETY: each task writes only columns `cols` of the m output rows, and `run`
                // gives each task index to one call: the tasks' writes are disjoint, and inside
                // `out` (row i < m starts at i·n), which stays borrowed until `run` returns.
                unsafe {
                    std::slice::from_raw_parts_mut(
                        out_ptr.get().add(i * n + cols.start),
                        cols.len(),
                    )
                }
            } else {
                &mut []
            }
        });
        columns(m, k, n, a, b, cols.start, rows);
    };
    if self::tasks(m, k, n) < 2 || pool::threads() < 2 {
        (0..tasks).for_each(task);
    } else {
        pool::run(tasks, super::Work::product(m, k, n), &task);
    }
}

/// Columns `start..start + rows[0].len()` of the product, into `rows` (one slice per row of
/// `a`; unused ones empty).
fn columns(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    b: &[f32],
    start: usize,
    mut rows: [&mut [f32]; MAX_M],
) {
    let width = rows[0].len();
    let b_row = |p: usize| &b[p * n + start..p * n + start + width];
    let mut p = 0;
    while p + UNROLL <= k {
        let bs: [&[f32]; UNROLL] = std::array::from_fn(|q| b_row(p + q));
        for (i, row) in rows.iter_mut().enumerate().take(m) {
            let c: [f32; UNROLL] = std::array::from_fn(|q| a[i * k + p + q]);
            // SAFETY: `available()` was checked by the caller (`small_m`'s contract): the CPU
            // has AVX2 and FMA.
            unsafe { axpy_rows(row, bs, c) };
        }
        p += UNROLL;
    }
    while p < k {
        let bp = b_row(p);
        for (i, row) in rows.iter_mut().enumerate().take(m) {
            let c = a[i * k + p];
            // SAFETY: as above.
            unsafe { axpy1(row, bp, c) };
        }
        p += 1;
    }
}

/// Rows of `b` added per pass over the output: each output element is loaded and stored once
/// per `UNROLL` rows (8 was 5–15% faster than 4 at batch 1).
const UNROLL: usize = 8;

/// `out += c[0]·b[0] + c[1]·b[1] + …`, summed left to right with fused multiply-adds. All the
/// slices have one length.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA ([`available`]); the body itself only indexes slices.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn axpy_rows(out: &mut [f32], b: [&[f32]; UNROLL], c: [f32; UNROLL]) {
    let len = out.len();
    let b: [&[f32]; UNROLL] = std::array::from_fn(|q| &b[q][..len]);
    for j in 0..len {
        let mut o = out[j];
        for q in 0..UNROLL {
            o = b[q][j].mul_add(c[q], o);
        }
        out[j] = o;
    }
}

/// `out += c·b` with a fused multiply-add; both slices have one length.
///
/// # Safety
///
/// The CPU must have AVX2 and FMA ([`available`]); the body itself only indexes slices.
#[cfg_attr(target_arch = "x86_64", target_feature(enable = "avx2,fma"))]
unsafe fn axpy1(out: &mut [f32], b: &[f32], c: f32) {
    let b = &b[..out.len()];
    for (o, &x) in out.iter_mut().zip(b) {
        *o = x.mul_add(c, *o);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agrees_with_the_definition_and_rows_do_not_depend_on_the_batch() {
        if !available() {
            return;
        }
        for &(k, n) in &[(1, 1), (3, 5), (7, 300), (784, 1024), (1024, 10)] {
            let a: Vec<f32> = (0..MAX_M * k)
                .map(|i| ((i % 13) as f32 - 6.0) * 0.25)
                .collect();
            let b: Vec<f32> = (0..k * n).map(|i| ((i % 7) as f32 - 3.0) * 0.5).collect();
            let mut first: Option<Vec<f32>> = None;
            for m in 1..=MAX_M {
                let mut out = vec![f32::NAN; m * n];
                small_m(m, k, n, &a[..m * k], &b, &mut out);
                for i in 0..m {
                    for j in 0..n {
                        let want: f64 = (0..k)
                            .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                            .sum();
                        // Small multiples of 1/8: every partial sum is exact in f32.
                        assert_eq!(out[i * n + j] as f64, want, "m {m} k {k} n {n} ({i}, {j})");
                    }
                }
                match &first {
                    None => first = Some(out[..n].to_vec()),
                    Some(row) => assert_eq!(&out[..n], &row[..], "row 0 at m {m}"),
                }
            }
        }
    }
}
