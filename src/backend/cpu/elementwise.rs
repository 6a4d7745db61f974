//! Elementwise loops: maps, zips and NumPy broadcasting, parallel above `PAR_MIN` elements.
//!
//! The closures are generic parameters, so each loop is compiled per op and dtype and the
//! compiler vectorises the contiguous cases.

use super::{chunk_len, pool, Work, PAR_MIN};
use crate::backend::layout::{broadcast_strides, merge_dims};

/// `out[i] = f(a[i])`.
pub(crate) fn map<T, U>(a: &[T], out: &mut [U], f: impl Fn(T) -> U + Sync)
where
    T: Copy + Send + Sync,
    U: Send,
{
    map_chunks(a, out, |a, o| {
        for (o, &x) in o.iter_mut().zip(a) {
            *o = f(x);
        }
    });
}

/// `f(a[r], out[r])` over ranges `r` that together cover both slices (of one length): one range
/// below `PAR_MIN` elements, else chunks split across the pool. For loops that convert a whole
/// slice at once (`cpu/wide.rs`).
pub(crate) fn map_chunks<T, U>(a: &[T], out: &mut [U], f: impl Fn(&[T], &mut [U]) + Sync)
where
    T: Sync,
    U: Send,
{
    debug_assert_eq!(a.len(), out.len());
    if out.len() < PAR_MIN {
        return f(a, out);
    }
    let chunk = chunk_len(out.len());
    let work = Work::Bytes(out.len() * (size_of::<T>() + size_of::<U>()));
    pool::for_each_chunk_zip(out, chunk, a, chunk, work, |o, a| f(a, o));
}

/// `out.copy_from_slice(a)` (slices of one length), split across the pool like any pass over
/// memory: one core copies at a fraction of what a server's memory delivers (about 10 GB/s of
/// a socket's 100 or more), so a large copy (an array's bytes, a chunk staged for the GPU) runs
/// on the threads its bytes are worth. A copy below `PAR_MIN` elements, or of less than twice
/// the thread policy's `BYTES_PER_THREAD` read and written (512 KiB copied), stays on the calling
/// thread.
pub(crate) fn copy<T: Copy + Send + Sync>(a: &[T], out: &mut [T]) {
    map_chunks(a, out, |a, o| o.copy_from_slice(a));
}

/// `out[i] = f(a[i], b[i])`.
pub(crate) fn zip<T, U>(a: &[T], b: &[T], out: &mut [U], f: impl Fn(T, T) -> U + Sync)
where
    T: Copy + Send + Sync,
    U: Send,
{
    debug_assert!(a.len() == out.len() && b.len() == out.len());
    if out.len() < PAR_MIN {
        for ((o, &x), &y) in out.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
        return;
    }
    let chunk = chunk_len(out.len());
    let work = Work::Bytes(out.len() * (2 * size_of::<T>() + size_of::<U>()));
    pool::for_each_chunk_mut(out, chunk, work, |t, o| {
        let (a, b) = (pool::chunk_at(a, chunk, t), pool::chunk_at(b, chunk, t));
        for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
            *o = f(x, y);
        }
    });
}

/// `x[i] = f(x[i])`.
pub(crate) fn map_inplace<T>(x: &mut [T], f: impl Fn(T) -> T + Sync)
where
    T: Copy + Send + Sync,
{
    if x.len() < PAR_MIN {
        for v in x.iter_mut() {
            *v = f(*v);
        }
        return;
    }
    let chunk = chunk_len(x.len());
    pool::for_each_chunk_mut(x, chunk, Work::pass::<T>(x.len(), 2), |_, x| {
        for v in x.iter_mut() {
            *v = f(*v);
        }
    });
}

/// `x[i] = f(x[i], b[i])`.
pub(crate) fn zip_inplace<T>(x: &mut [T], b: &[T], f: impl Fn(T, T) -> T + Sync)
where
    T: Copy + Send + Sync,
{
    debug_assert_eq!(x.len(), b.len());
    if x.len() < PAR_MIN {
        for (v, &y) in x.iter_mut().zip(b) {
            *v = f(*v, y);
        }
        return;
    }
    let chunk = chunk_len(x.len());
    pool::for_each_chunk_zip(x, chunk, b, chunk, Work::pass::<T>(x.len(), 3), |x, b| {
        for (v, &y) in x.iter_mut().zip(b) {
            *v = f(*v, y);
        }
    });
}

/// An iteration over the rows (last dimension) of a broadcast, with adjacent dimensions merged
/// where every operand allows it, so the inner loop is as long as possible.
struct Rows {
    /// Outer dimensions (all but the merged last one).
    dims: Vec<usize>,
    /// Per operand: strides of the outer dimensions.
    strides: Vec<Vec<usize>>,
    /// Per operand: stride of the inner dimension (0 or 1).
    inner_stride: Vec<usize>,
    inner: usize,
    rows: usize,
}

impl Rows {
    fn new(out: &[usize], operand_strides: Vec<Vec<usize>>) -> Rows {
        let (mut dims, mut strides) = merge_dims(out, &operand_strides);
        let inner = dims.pop().unwrap_or(1);
        let inner_stride = strides.iter_mut().map(|s| s.pop().unwrap_or(0)).collect();
        let rows = dims.iter().product();
        Rows {
            dims,
            strides,
            inner_stride,
            inner,
            rows,
        }
    }

    /// Offsets of every operand at the start of `row`.
    fn offsets(&self, mut row: usize, out: &mut [usize]) {
        out.iter_mut().for_each(|o| *o = 0);
        for d in (0..self.dims.len()).rev() {
            let i = row % self.dims[d];
            row /= self.dims[d];
            for (o, s) in out.iter_mut().zip(&self.strides) {
                *o += i * s[d];
            }
        }
    }

    /// Advances `offsets` from `row` to `row + 1` (odometer), without division.
    fn step(&self, index: &mut [usize], offsets: &mut [usize]) {
        for d in (0..self.dims.len()).rev() {
            index[d] += 1;
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o += s[d];
            }
            if index[d] < self.dims[d] {
                return;
            }
            for (o, s) in offsets.iter_mut().zip(&self.strides) {
                *o -= s[d] * self.dims[d];
            }
            index[d] = 0;
        }
    }

    /// Calls `body(row_range_first_offsets...)` for rows `[start, end)`.
    fn walk(&self, start: usize, end: usize, mut body: impl FnMut(&[usize])) {
        let mut offsets = vec![0; self.strides.len()];
        self.offsets(start, &mut offsets);
        let mut index = vec![0; self.dims.len()];
        let mut row = start;
        for d in (0..self.dims.len()).rev() {
            index[d] = row % self.dims[d];
            row /= self.dims[d];
        }
        for _ in start..end {
            body(&offsets);
            self.step(&mut index, &mut offsets);
        }
    }
}

/// `out = f(a, b)` with NumPy broadcasting of `a` (`a_shape`) and `b` (`b_shape`) to
/// `out_shape`.
pub(crate) fn broadcast_zip<T, U>(
    a: &[T],
    a_shape: &[usize],
    b: &[T],
    b_shape: &[usize],
    out: &mut [U],
    out_shape: &[usize],
    f: impl Fn(T, T) -> U + Sync,
) where
    T: Copy + Send + Sync,
    U: Send,
{
    if out.is_empty() {
        return;
    }
    if a.len() == out.len() && b.len() == out.len() {
        return zip(a, b, out, f);
    }
    if b.len() == 1 && a.len() == out.len() {
        let y = b[0];
        return map(a, out, |x| f(x, y));
    }
    if a.len() == 1 && b.len() == out.len() {
        let x = a[0];
        return map(b, out, |y| f(x, y));
    }
    let rows = Rows::new(
        out_shape,
        vec![
            broadcast_strides(a_shape, out_shape),
            broadcast_strides(b_shape, out_shape),
        ],
    );
    let inner = rows.inner;
    let (sa, sb) = (rows.inner_stride[0], rows.inner_stride[1]);
    let run = |first_row: usize, out: &mut [U]| {
        let count = out.len() / inner;
        let mut chunks = out.chunks_exact_mut(inner);
        rows.walk(first_row, first_row + count, |off| {
            let Some(o) = chunks.next() else { return };
            let (oa, ob) = (off[0], off[1]);
            match (sa, sb) {
                (1, 1) => {
                    for ((o, &x), &y) in
                        o.iter_mut().zip(&a[oa..oa + inner]).zip(&b[ob..ob + inner])
                    {
                        *o = f(x, y);
                    }
                }
                (1, _) => {
                    let y = b[ob];
                    for (o, &x) in o.iter_mut().zip(&a[oa..oa + inner]) {
                        *o = f(x, y);
                    }
                }
                (_, 1) => {
                    let x = a[oa];
                    for (o, &y) in o.iter_mut().zip(&b[ob..ob + inner]) {
                        *o = f(x, y);
                    }
                }
                _ => {
                    let (x, y) = (a[oa], b[ob]);
                    for o in o.iter_mut() {
                        *o = f(x, y);
                    }
                }
            }
        });
    };
    if out.len() < PAR_MIN || rows.rows < 2 {
        return run(0, out);
    }
    let rows_per_task = chunk_len(out.len()).div_ceil(inner).max(1);
    let work = Work::Bytes(out.len() * (2 * size_of::<T>() + size_of::<U>()));
    pool::for_each_chunk_mut(out, rows_per_task * inner, work, |task, chunk| {
        run(task * rows_per_task, chunk)
    });
}

/// `x = f(x, b)` with `b` (`b_shape`) broadcast to `x`'s shape `x_shape`.
pub(crate) fn broadcast_zip_inplace<T>(
    x: &mut [T],
    x_shape: &[usize],
    b: &[T],
    b_shape: &[usize],
    f: impl Fn(T, T) -> T + Sync,
) where
    T: Copy + Send + Sync,
{
    if x.is_empty() {
        return;
    }
    if b.len() == x.len() {
        return zip_inplace(x, b, f);
    }
    if b.len() == 1 {
        let y = b[0];
        return map_inplace(x, |v| f(v, y));
    }
    let rows = Rows::new(x_shape, vec![broadcast_strides(b_shape, x_shape)]);
    let inner = rows.inner;
    let sb = rows.inner_stride[0];
    let run = |first_row: usize, x: &mut [T]| {
        let count = x.len() / inner;
        let mut chunks = x.chunks_exact_mut(inner);
        rows.walk(first_row, first_row + count, |off| {
            let Some(v) = chunks.next() else { return };
            let ob = off[0];
            if sb == 1 {
                for (v, &y) in v.iter_mut().zip(&b[ob..ob + inner]) {
                    *v = f(*v, y);
                }
            } else {
                let y = b[ob];
                for v in v.iter_mut() {
                    *v = f(*v, y);
                }
            }
        });
    };
    if x.len() < PAR_MIN || rows.rows < 2 {
        return run(0, x);
    }
    let rows_per_task = chunk_len(x.len()).div_ceil(inner).max(1);
    let work = Work::pass::<T>(x.len(), 3);
    pool::for_each_chunk_mut(x, rows_per_task * inner, work, |task, chunk| {
        run(task * rows_per_task, chunk)
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[i64], ash: &[usize], b: &[i64], bsh: &[usize], out: &[usize]) -> Vec<i64> {
        let n: usize = out.iter().product();
        let sa = broadcast_strides(ash, out);
        let sb = broadcast_strides(bsh, out);
        (0..n)
            .map(|flat| {
                let mut rem = flat;
                let (mut oa, mut ob) = (0, 0);
                for d in (0..out.len()).rev() {
                    let i = rem % out[d];
                    rem /= out[d];
                    oa += i * sa[d];
                    ob += i * sb[d];
                }
                a[oa] * 1000 + b[ob]
            })
            .collect()
    }

    #[test]
    fn a_copy_is_exact_and_only_a_large_one_runs_on_the_pool() {
        // A pattern no chunk length repeats, so a chunk copied to the wrong place shows.
        let pattern =
            |len: usize| -> Vec<u8> { (0..len).map(|i| (i * 7 + i / 251) as u8).collect() };
        for len in [
            0,
            1,
            1000,
            PAR_MIN - 1,
            PAR_MIN,
            (512 << 10) + 3,
            (4 << 20) + 13,
        ] {
            let a = pattern(len);
            let mut out = vec![0u8; len];
            copy(&a, &mut out);
            assert!(a == out, "{len} bytes");
            let words: Vec<u32> = a.iter().map(|&x| u32::from(x) * 65_537).collect();
            let mut out = vec![0u32; len];
            copy(&words, &mut out);
            assert!(words == out, "{len} words");
        }
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        if pool::threads().min(cores) < 2 {
            return; // NDSCOPE_NUM_THREADS=1, or one core: every copy runs on the caller
        }
        let last_joined = || pool::LAST_JOINED.with(std::cell::Cell::get);
        let unset = || pool::LAST_JOINED.with(|j| j.set(usize::MAX));
        let a = pattern(4 << 20);
        let mut out = vec![0u8; a.len()];
        // Another test's job may hold the pool for a while (then the copy runs inline).
        let on_pool = (0..1000).any(|_| {
            unset();
            copy(&a, &mut out);
            last_joined() != usize::MAX
        });
        assert!(on_pool, "a 4 MiB copy never ran as a job on the pool");
        // 256 KiB copied (512 KiB read and written) is one thread's share: never a job.
        let small = 256 << 10;
        for _ in 0..100 {
            unset();
            copy(&a[..small], &mut out[..small]);
            assert_eq!(last_joined(), usize::MAX, "a 256 KiB copy ran as a job");
        }
    }

    #[test]
    fn broadcasting_matches_the_index_formula() {
        let cases: &[(&[usize], &[usize], &[usize])] = &[
            (&[2, 3], &[3], &[2, 3]),
            (&[2, 1], &[1, 3], &[2, 3]),
            (&[4, 1, 5], &[3, 1], &[4, 3, 5]),
            (&[1], &[2, 2], &[2, 2]),
            (&[3, 1, 1, 2], &[1, 4, 5, 1], &[3, 4, 5, 2]),
            (&[256, 300], &[300], &[256, 300]),
            (&[300, 1], &[300, 256], &[300, 256]),
        ];
        for &(ash, bsh, out) in cases {
            let a: Vec<i64> = (0..ash.iter().product::<usize>() as i64).collect();
            let b: Vec<i64> = (0..bsh.iter().product::<usize>() as i64).collect();
            let n: usize = out.iter().product();
            let mut got = vec![0; n];
            broadcast_zip(&a, ash, &b, bsh, &mut got, out, |x, y| x * 1000 + y);
            assert_eq!(got, reference(&a, ash, &b, bsh, out), "{ash:?} {bsh:?}");
            if ash == out {
                let mut x = a.clone();
                broadcast_zip_inplace(&mut x, out, &b, bsh, |x, y| x * 1000 + y);
                assert_eq!(x, got, "inplace {ash:?} {bsh:?}");
            }
        }
    }
}
