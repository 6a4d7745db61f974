//! Matrix products: `gemm` for floats (AVX-512 kernels with the `x86-v4` feature), a blocked
//! loop for integers.

use gemm::Parallelism;

use super::num::Num;
use super::pool::{self, SendPtr};
use super::warm;
use crate::backend::Batched;

/// Multiply-adds below which a product runs on one thread, and the least one task of a split
/// product gets (a few microseconds of work: less would cost more to hand over than it saves).
const PAR_PRODUCT: usize = 48 * 48 * 48;

/// The least columns (rows) a block of a product split by columns (rows) gets: narrower blocks
/// make gemm pack the other operand once per block for too little arithmetic.
const MIN_BLOCK_COLS: usize = 64;
const MIN_BLOCK_ROWS: usize = 32;

/// How a float product `[m, k] · [k, n]` is cut into blocks of the result, each computed by one
/// gemm call. Derived from `m`, `n` and `k` alone, never from the thread count: gemm's own
/// blocking (its depth blocks and its kernels for small shapes) depends on the shape of the
/// block it is given, so the same element could be summed in a different order if the blocks
/// changed with the threads. With the blocks fixed, each element is computed by the same
/// sequence of operations on 1 thread or 16, and the result is bit-identical.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    /// Blocks of whole columns (else of whole rows).
    pub(crate) by_cols: bool,
    /// Columns (rows) per block; the last block may be narrower.
    pub(crate) block: usize,
    /// Number of blocks: the tasks the product gives the pool.
    pub(crate) tasks: usize,
}

/// The split of a float product (see [`Split`]): at most `MAX_TASKS` blocks, each with at least
/// `PAR_PRODUCT` multiply-adds (a product with less than twice that is one block), cut along the
/// columns when the result is at least as wide as it is tall, else along the rows, in whole
/// vectors (16 columns or 8 rows).
pub(crate) fn split(m: usize, n: usize, k: usize) -> Split {
    let work = m.saturating_mul(n).saturating_mul(k);
    let wanted = (work / PAR_PRODUCT).clamp(1, super::MAX_TASKS);
    let (len, min, align) = if n >= m {
        (n, MIN_BLOCK_COLS, 16)
    } else {
        (m, MIN_BLOCK_ROWS, 8)
    };
    let block = if wanted < 2 {
        len
    } else {
        len.div_ceil(wanted)
            .max(min)
            .next_multiple_of(align)
            .min(len)
    };
    Split {
        by_cols: n >= m,
        block: block.max(1),
        tasks: len.div_ceil(block.max(1)),
    }
}

/// `out[m×n] = a[m×k] · b[k×n]`, all row-major and contiguous.
pub(crate) fn matmul<T: Num>(m: usize, k: usize, n: usize, a: &[T], b: &[T], out: &mut [T]) {
    // Checked in release builds too: the product reads through raw pointers and strides.
    assert!(
        a.len() == m * k && b.len() == k * n && out.len() == m * n,
        "matmul: operand lengths {}, {}, {} do not fit [{m}, {k}] · [{k}, {n}]",
        a.len(),
        b.len(),
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.iter_mut().for_each(|o| *o = T::ZERO);
        return;
    }
    if T::DTYPE.is_float() {
        gemm_general((m, k, n), (a, false), (b, false), out, None);
    } else {
        int_matmul(k, n, a, b, out);
    }
}

/// `out[i] = a[i] · b[i]` for `batch` products of `m×k` by `k×n`, with a shared operand as
/// `which` says. A shared right operand is one product of `(batch·m)×k` by `k×n`. Small
/// products run in parallel across the batch; large ones one after the other, each split across
/// the pool.
pub(crate) fn matmul_batched<T: Num>(
    batch: (Batched, usize),
    (m, k, n): (usize, usize, usize),
    a: &[T],
    b: &[T],
    out: &mut [T],
) {
    batched_with(batch, (m, k, n), a, b, out, &|(m, k, n), a, b, out| {
        matmul(m, k, n, a, b, out)
    });
}

/// The batching of [`matmul_batched`] around any product `product((m, k, n), a, b, out)` of
/// row-major operands (`out = a · b`, `a` `[m, k]`, `b` `[k, n]`), whatever the element types
/// of the operands (`A`) and of the result (`O`): the bf16 kernel (`bf16.rs`) batches its
/// products with it into an f32 result.
#[allow(clippy::type_complexity)]
pub(crate) fn batched_with<A: Sync, O: Send>(
    (which, batch): (Batched, usize),
    (m, k, n): (usize, usize, usize),
    a: &[A],
    b: &[A],
    out: &mut [O],
    product: &(dyn Fn((usize, usize, usize), &[A], &[A], &mut [O]) + Sync),
) {
    if which == Batched::Left {
        return product((batch * m, k, n), a, b, out);
    }
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    let a_step = if which == Batched::Both { m * k } else { 0 };
    let b_step = k * n;
    let one = |i: usize, out: &mut [O]| {
        let a = &a[i * a_step..i * a_step + m * k];
        let b = &b[i * b_step..(i + 1) * b_step];
        product((m, k, n), a, b, out);
    };
    let small = m * n * k < PAR_PRODUCT;
    if small && batch > 1 && batch * m * n * k >= 1 << 18 {
        let work = super::Work::product(batch * m, k, n);
        pool::for_each_chunk_mut(out, m * n, work, one);
    } else {
        for (i, o) in out.chunks_exact_mut(m * n).enumerate() {
            one(i, o);
        }
    }
}

/// `out[m×n] = op(a) · op(b)`, or with `accumulate = Some((s, p))`, `out = s·out + p·op(a)·op(b)`,
/// where `op` transposes an operand stored transposed: `a` is stored `[m, k]`, or `[k, m]` when
/// `ta`; `b` is stored `[k, n]`, or `[n, k]` when `tb`. Floats read the transposed operands
/// through strides (no copy); integers use a plain loop.
pub(crate) fn gemm_general<T: Num>(
    (m, k, n): (usize, usize, usize),
    (a, ta): (&[T], bool),
    (b, tb): (&[T], bool),
    out: &mut [T],
    accumulate: Option<(T, T)>,
) {
    // Checked in release builds too: gemm reads through raw pointers and strides.
    assert!(
        a.len() == m * k && b.len() == k * n && out.len() == m * n,
        "gemm_general: operand lengths {}, {}, {} do not fit [{m}, {k}] · [{k}, {n}]",
        a.len(),
        b.len(),
        out.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    // `beta = 0` does not read `out` (as BLAS does not): a NaN or ∞ there must not survive as
    // 0·NaN. The product is then only scaled by alpha.
    let (accumulate, alpha) = match accumulate {
        Some((s, q)) if s == T::ZERO => (None, q),
        other => (other, T::ONE),
    };
    if k == 0 {
        match accumulate {
            Some((s, _)) => out.iter_mut().for_each(|o| *o = o.mul(s)),
            None => out.iter_mut().for_each(|o| *o = T::ZERO),
        }
        return;
    }
    // Element (i, p) of op(a) is a[i·a_rs + p·a_cs]; (p, j) of op(b) is b[p·b_rs + j·b_cs].
    let (a_rs, a_cs) = if ta { (1, m) } else { (k, 1) };
    let (b_rs, b_cs) = if tb { (1, k) } else { (n, 1) };
    if !T::DTYPE.is_float() {
        for i in 0..m {
            for j in 0..n {
                let mut acc = T::ZERO;
                for p in 0..k {
                    acc = acc.add(a[i * a_rs + p * a_cs].mul(b[p * b_rs + j * b_cs]));
                }
                let o = &mut out[i * n + j];
                *o = match accumulate {
                    Some((s, q)) => o.mul(s).add(acc.mul(q)),
                    None if alpha == T::ONE => acc,
                    None => acc.mul(alpha),
                };
            }
        }
        return;
    }
    // Half operands are widened to f32 by the caller (`cpu/wide.rs`), or bf16 ones computed by
    // `cpu/bf16.rs` where the CPU has AVX512-BF16: gemm has no bf16 kernel.
    // Checked in release builds too, as the lengths are: gemm reads through raw pointers.
    assert!(
        !T::DTYPE.is_half(),
        "gemm_general: {} operands must be widened to f32 first",
        T::DTYPE
    );
    if m <= super::gemv::MAX_M && !ta && !tb && accumulate.is_none() && alpha == T::ONE {
        if let Some((a, b, out)) = as_f32(a, b, out).filter(|_| super::gemv::available()) {
            return super::gemv::small_m(m, k, n, a, b, out);
        }
    }
    warm::warm_once();
    let (read_dst, dst_scale, product_scale) = match accumulate {
        Some((s, q)) => (true, s, q),
        None => (false, T::ZERO, alpha),
    };
    let block = |rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, out: SendPtr<T>| {
        // SAFETY: `a` holds m·k elements and (i, p) ↦ i·a_rs + p·a_cs stays inside it for i < m,
        // p < k (whether stored [m, k] or [k, m]); likewise `b` for its k·n elements; `out`
        // points to m·n elements, row-major, that alias neither input. The block reads rows
        // `rows` of op(a) and columns `cols` of op(b) and writes only out[rows, cols], so blocks
        // with disjoint ranges may run at once. With `read_dst` gemm computes
        // out = dst_scale·out + product_scale·op(a)·op(b), otherwise it writes
        // product_scale·op(a)·op(b) without reading `out`. T is f32 or f64, which gemm supports.
        unsafe {
            gemm::gemm(
                rows.len(),
                cols.len(),
                k,
                out.get().add(rows.start * n + cols.start),
                1,
                n as isize,
                read_dst,
                a.as_ptr().add(rows.start * a_rs),
                a_cs as isize,
                a_rs as isize,
                b.as_ptr().add(cols.start * b_cs),
                b_cs as isize,
                b_rs as isize,
                dst_scale,
                product_scale,
                false,
                false,
                false,
                Parallelism::None,
            );
        }
    };
    let out = SendPtr(out.as_mut_ptr());
    // Small products (one block) never ask for the pool.
    let Split {
        by_cols,
        block: size,
        tasks,
    } = split(m, n, k);
    if tasks < 2 {
        return block(0..m, 0..n, out);
    }
    let part = |t: usize| t * size..((t + 1) * size).min(if by_cols { n } else { m });
    let work = super::Work::product(m, k, n);
    if by_cols {
        pool::run(tasks, work, &|t| block(0..m, part(t), out));
    } else {
        pool::run(tasks, work, &|t| block(part(t), 0..n, out));
    }
}

/// The operands as f32 slices when `T` is f32.
#[allow(clippy::type_complexity)]
fn as_f32<'a, T: Num>(
    a: &'a [T],
    b: &'a [T],
    out: &'a mut [T],
) -> Option<(&'a [f32], &'a [f32], &'a mut [f32])> {
    if T::DTYPE != crate::DType::F32 {
        return None;
    }
    // SAFETY: `T` is f32 (its dtype says so, and `Element` is sealed: only f32 has that dtype),
    // so each slice is a slice of f32 with the same length and lifetime; `out` is reborrowed
    // once, mutably, as the only use of the original.
    unsafe {
        Some((
            std::slice::from_raw_parts(a.as_ptr().cast::<f32>(), a.len()),
            std::slice::from_raw_parts(b.as_ptr().cast::<f32>(), b.len()),
            std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<f32>(), out.len()),
        ))
    }
}

fn int_matmul<T: Num>(k: usize, n: usize, a: &[T], b: &[T], out: &mut [T]) {
    for (i, row) in out.chunks_exact_mut(n).enumerate() {
        row.iter_mut().for_each(|o| *o = T::ZERO);
        for p in 0..k {
            let x = a[i * k + p];
            for (o, &y) in row.iter_mut().zip(&b[p * n..(p + 1) * n]) {
                *o = o.add(x.mul(y));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, k: usize, n: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut out = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        out
    }

    #[test]
    fn transposed_and_accumulating_products_agree_with_the_definition() {
        let (m, k, n) = (37, 19, 23);
        let a: Vec<f64> = (0..m * k).map(|i| (i % 11) as f64 - 5.0).collect();
        let b: Vec<f64> = (0..k * n).map(|i| (i % 5) as f64 * 0.25).collect();
        let expect = naive(m, k, n, &a, &b);
        let transpose = |x: &[f64], rows: usize, cols: usize| -> Vec<f64> {
            (0..cols * rows)
                .map(|i| x[(i % rows) * cols + i / rows])
                .collect()
        };
        let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let (a_in, b_in) = (if ta { &at } else { &a }, if tb { &bt } else { &b });
            let mut out = vec![f64::NAN; m * n];
            gemm_general((m, k, n), (a_in, ta), (b_in, tb), &mut out, None);
            assert_eq!(out, expect, "ta {ta} tb {tb}");
            let mut acc = vec![2.0; m * n];
            gemm_general(
                (m, k, n),
                (a_in, ta),
                (b_in, tb),
                &mut acc,
                Some((0.5, 3.0)),
            );
            let want: Vec<f64> = expect.iter().map(|e| 1.0 + 3.0 * e).collect();
            assert_eq!(acc, want, "accumulate ta {ta} tb {tb}");
            let ai: Vec<i64> = a_in.iter().map(|&x| x as i64).collect();
            let bi: Vec<i64> = b_in.iter().map(|&x| (x * 4.0) as i64).collect();
            let mut oi = vec![1i64; m * n];
            gemm_general((m, k, n), (&ai, ta), (&bi, tb), &mut oi, Some((2, 1)));
            let want: Vec<i64> = expect.iter().map(|e| 2 + (e * 4.0) as i64).collect();
            assert_eq!(oi, want, "integers ta {ta} tb {tb}");
        }
    }

    #[test]
    fn splits_depend_on_the_shape_only_and_give_every_block_its_minimum_of_work() {
        let shapes = [
            (1, 1, 1),
            (48, 48, 48),
            (96, 48, 48),
            (128, 256, 64),
            (128, 10, 256),
            (256, 1024, 784),
            (16, 1024, 1024),
            (784, 1024, 256),
            (1024, 10, 1024),
            (3000, 3000, 3000),
            (100_000, 16, 16),
        ];
        for (m, n, k) in shapes {
            let s = split(m, n, k);
            let len = if s.by_cols { n } else { m };
            assert!(
                s.tasks >= 1 && s.tasks <= super::super::MAX_TASKS,
                "{m}x{n}x{k}: {s:?}"
            );
            assert_eq!(s.tasks, len.div_ceil(s.block), "{m}x{n}x{k}: {s:?}");
            if s.tasks > 1 {
                // Every block but the last is whole, and even the narrowest one carries at
                // least PAR_PRODUCT multiply-adds of work... except a last, narrower block.
                let other = if s.by_cols { m } else { n };
                assert!(s.block * other * k >= PAR_PRODUCT, "{m}x{n}x{k}: {s:?}");
                // So a split never uses more threads than it has work for.
                assert!(s.tasks <= m * n * k / PAR_PRODUCT, "{m}x{n}x{k}: {s:?}");
            }
        }
        assert_eq!(split(48, 48, 48).tasks, 1);
    }

    /// Splitting a product into blocks the way `split` says gives the same bits whether the
    /// blocks run on one thread or on the pool (they are the same gemm calls).
    #[test]
    fn a_split_product_is_bit_identical_to_its_blocks_run_in_order() {
        let (m, k, n) = (200, 300, 700);
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 / 997.0 - 0.5)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729) % 1000) as f32 / 991.0 - 0.5)
            .collect();
        let mut pooled = vec![0f32; m * n];
        gemm_general((m, k, n), (&a, false), (&b, false), &mut pooled, None);
        let s = split(m, n, k);
        assert!(s.tasks > 1 && s.by_cols);
        let mut serial = vec![0f32; m * n];
        for t in 0..s.tasks {
            let cols = t * s.block..((t + 1) * s.block).min(n);
            let bb: Vec<f32> = (0..k)
                .flat_map(|p| b[p * n + cols.start..p * n + cols.end].to_vec())
                .collect();
            let mut o = vec![0f32; m * cols.len()];
            // One block, below the split threshold per block only if small: call gemm directly.
            // SAFETY: as in `gemm_general`: the pointers and strides describe the vectors above.
            unsafe {
                gemm::gemm(
                    m,
                    cols.len(),
                    k,
                    o.as_mut_ptr(),
                    1,
                    cols.len() as isize,
                    false,
                    a.as_ptr(),
                    1,
                    k as isize,
                    bb.as_ptr(),
                    1,
                    cols.len() as isize,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    Parallelism::None,
                );
            }
            for i in 0..m {
                serial[i * n + cols.start..i * n + cols.end]
                    .copy_from_slice(&o[i * cols.len()..(i + 1) * cols.len()]);
            }
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&pooled), bits(&serial));
    }

    #[test]
    fn gemm_agrees_with_the_definition() {
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 7), (64, 33, 17), (100, 200, 50)] {
            let a: Vec<f64> = (0..m * k).map(|i| (i % 13) as f64 - 6.0).collect();
            let b: Vec<f64> = (0..k * n).map(|i| (i % 7) as f64 * 0.5).collect();
            let mut out = vec![f64::NAN; m * n];
            matmul(m, k, n, &a, &b, &mut out);
            assert_eq!(out, naive(m, k, n, &a, &b));
            let ai: Vec<i64> = a.iter().map(|&x| x as i64).collect();
            let bi: Vec<i64> = (0..k * n).map(|i| (i % 7) as i64).collect();
            let mut oi = vec![0i64; m * n];
            matmul(m, k, n, &ai, &bi, &mut oi);
            let bf: Vec<f64> = bi.iter().map(|&x| x as f64).collect();
            let expect: Vec<i64> = naive(m, k, n, &a, &bf).iter().map(|&x| x as i64).collect();
            assert_eq!(oi, expect);
        }
    }

    /// The kernels read through raw pointers and strides: operands that do not fit the
    /// dimensions are refused in release builds too (every front-end checks shapes first, so
    /// only a wrong call inside the crate could pass them).
    #[test]
    #[should_panic(expected = "matmul: operand lengths")]
    fn matmul_checks_operand_lengths_in_release_builds() {
        let (a, b, mut out) = (vec![1.0f32; 7], vec![1.0f32; 6], vec![0.0f32; 4]);
        matmul(2, 3, 2, &a, &b, &mut out);
    }

    #[test]
    #[should_panic(expected = "gemm_general: operand lengths")]
    fn gemm_checks_operand_lengths_in_release_builds() {
        let (a, b, mut out) = (vec![1.0f64; 6], vec![1.0f64; 6], vec![0.0f64; 5]);
        gemm_general((2, 3, 2), (&a, true), (&b, false), &mut out, None);
    }
}
