//! Matrix products: `gemm` for floats (AVX-512 kernels with the `x86-v4` feature), a blocked
//! loop for integers.

use gemm::Parallelism;
use rayon::prelude::*;

use super::num::Num;
use crate::Element;

/// `out[m×n] = a[m×k] · b[k×n]`, all row-major and contiguous.
pub(crate) fn matmul<T: Num>(m: usize, k: usize, n: usize, a: &[T], b: &[T], out: &mut [T]) {
    debug_assert!(a.len() == m * k && b.len() == k * n && out.len() == m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out.iter_mut().for_each(|o| *o = T::ZERO);
        return;
    }
    if T::DTYPE.is_float() {
        float_gemm(m, k, n, a, b, out);
    } else {
        int_matmul(k, n, a, b, out);
    }
}

/// Which operands of a batched product carry the batch axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Batched {
    /// `[b, m, k] · [b, k, n]`.
    Both,
    /// `[b, m, k] · [k, n]`: the right operand is shared.
    Left,
    /// `[m, k] · [b, k, n]`: the left operand is shared.
    Right,
}

/// `out[i] = a[i] · b[i]` for `batch` products of `m×k` by `k×n`, with a shared operand as
/// `which` says. A shared right operand is one product of `(batch·m)×k` by `k×n`. Small
/// products run in parallel across the batch; large ones one after the other, each using the
/// pool inside `gemm`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_batched<T: Num>(
    which: Batched,
    batch: usize,
    m: usize,
    k: usize,
    n: usize,
    a: &[T],
    b: &[T],
    out: &mut [T],
) {
    if which == Batched::Left {
        return matmul(batch * m, k, n, a, b, out);
    }
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    let a_step = if which == Batched::Both { m * k } else { 0 };
    let b_step = k * n;
    let one = |i: usize, out: &mut [T]| {
        let a = &a[i * a_step..i * a_step + m * k];
        let b = &b[i * b_step..(i + 1) * b_step];
        matmul(m, k, n, a, b, out);
    };
    let small = m * n * k < 48 * 48 * 48;
    if small && batch > 1 && batch * m * n * k >= 1 << 18 {
        out.par_chunks_mut(m * n)
            .enumerate()
            .for_each(|(i, o)| one(i, o));
    } else {
        for (i, o) in out.chunks_exact_mut(m * n).enumerate() {
            one(i, o);
        }
    }
}

fn float_gemm<T: Element>(m: usize, k: usize, n: usize, a: &[T], b: &[T], out: &mut [T]) {
    // Tiny products are faster on the calling thread; gemm has its own threshold too.
    let parallelism = if m * n * k >= 48 * 48 * 48 {
        Parallelism::Rayon(0)
    } else {
        Parallelism::None
    };
    // SAFETY: the three slices hold m·k, k·n and m·n elements (checked by the caller's shapes
    // and the debug assertion above); the strides describe row-major contiguous matrices inside
    // them; `out` does not alias `a` or `b` (it is a distinct `&mut`); with `read_dst = false`
    // gemm writes `out = beta · a · b` without reading it; T is f32 or f64, which gemm supports.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            T::ZERO,
            T::ONE,
            false,
            false,
            false,
            parallelism,
        );
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
}
