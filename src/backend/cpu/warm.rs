//! Warming a thread for float products: gemm keeps a per-thread packing buffer (about the size
//! of the L2 cache, kept for the thread's life) that it allocates at the first product that
//! needs it. A leaf, so that the worker pool (whose helpers warm as they start) and the products
//! (which warm any other thread at its first float product) both use it without importing each
//! other.

use std::cell::Cell;

use gemm::Parallelism;

use super::num::Num;

thread_local! {
    static WARMED: Cell<bool> = const { Cell::new(false) };
}

/// [`warm_thread`] on this thread's first float product.
#[inline]
pub(crate) fn warm_once() {
    if !WARMED.with(|w| w.replace(true)) {
        warm_thread();
    }
}

/// Runs small f32 and f64 products on this thread, so that gemm's per-thread packing buffer is
/// allocated now. gemm takes it only for some shapes, and which blocks of a product a pool
/// thread runs depends on timing: without this, a thread's first such block — at any step of a
/// user's steady loop — would allocate a megabyte there. Pool helpers call it when they start;
/// other threads at their first float product.
///
/// The products are the gemm calls `matmul::gemm_general` makes for a 32×32×32 product (one
/// block, on the calling thread) in two forms: plain `a · b`, and `out + aᵀ · b`. Nothing here
/// asks for the pool, so a helper warms without waiting for the pool it is starting in.
pub(crate) fn warm_thread() {
    WARMED.with(|w| w.set(true));
    warm::<f32>();
    warm::<f64>();
}

const N: usize = 32;

fn warm<T: Num>() {
    let ones = [T::ONE; N * N];
    let mut out = [T::ZERO; N * N];
    // out = a · b (row-major: a row stride N, column stride 1).
    product(&ones, (N, 1), &mut out, None);
    // out = 1·out + 1·aᵀ · b (a stored transposed: row stride 1, column stride N).
    product(&ones, (1, N), &mut out, Some((T::ONE, T::ONE)));
}

/// `out = op(a) · b`, or `out = s·out + p·op(a) · b` with `accumulate = Some((s, p))`, for
/// `N×N` operands, `op(a)`'s element (i, p) at `a[i·rs + p·cs]` for `(rs, cs) = a_strides`.
fn product<T: Num>(
    a: &[T; N * N],
    a_strides: (usize, usize),
    out: &mut [T; N * N],
    accumulate: Option<(T, T)>,
) {
    let (a_rs, a_cs) = a_strides;
    let (read_dst, dst_scale, product_scale) = match accumulate {
        Some((s, p)) => (true, s, p),
        None => (false, T::ZERO, T::ONE),
    };
    let b = a;
    // SAFETY: `a`, `b` and `out` each hold N·N elements; with strides (N, 1) or (1, N) every
    // element (i, p) read for i, p < N is inside them, and `out` (written row-major, row stride
    // N) is a separate array that aliases neither input. With `read_dst` gemm reads `out`, which
    // is initialised. T is f32 or f64, which gemm supports.
    unsafe {
        gemm::gemm(
            N,
            N,
            N,
            out.as_mut_ptr(),
            1,
            N as isize,
            read_dst,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            1,
            N as isize,
            dst_scale,
            product_scale,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}
