//! CPU kernels over slices. Large inputs are split across the worker pool (`pool`); `ops`
//! runs the op families on host buffers.

pub(crate) mod buffer;
pub(crate) mod elementwise;
pub(crate) mod gemv;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod num;
pub(crate) mod ops;
pub(crate) mod packed;
pub(crate) mod pool;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod sgd;
pub(crate) mod shape;

/// Below this many elements a kernel runs on the calling thread: splitting costs more than it
/// saves (a task hand-off is a few microseconds; 32 Ki f32 adds take about as long).
pub(crate) const PAR_MIN: usize = 1 << 15;

/// Elements per task for parallel loops of `len` elements.
pub(crate) fn chunk_len(len: usize) -> usize {
    let threads = pool::threads().max(1);
    // A few tasks per thread balances uneven cores without drowning in overhead.
    len.div_ceil(threads * 4).max(PAR_MIN / 4)
}
