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
pub(crate) mod process;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod sgd;
pub(crate) mod shape;

/// Below this many elements a kernel runs on the calling thread: splitting costs more than it
/// saves (a task hand-off is a few microseconds; 32 Ki f32 adds take about as long).
pub(crate) const PAR_MIN: usize = 1 << 15;

/// The least elements one task of an elementwise loop or a reduction gets.
pub(crate) const MIN_CHUNK: usize = PAR_MIN / 4;

/// The most tasks one kernel is cut into. A fixed number, not one per thread: a kernel's tasks,
/// and so its chunk boundaries and the order its partial results are combined in, depend only
/// on the problem's size, which makes every result bit-identical for any thread count. 64
/// tasks keep 16 threads balanced (4 each) and cost a few atomic increments on 2.
pub(crate) const MAX_TASKS: usize = 64;

/// Elements per task for parallel loops of `len` elements: `len` cut into as many tasks as
/// have [`MIN_CHUNK`] elements each, at most [`MAX_TASKS`]. Depends on `len` only (never on the
/// thread count).
pub(crate) fn chunk_len(len: usize) -> usize {
    let tasks = (len / MIN_CHUNK).clamp(1, MAX_TASKS);
    len.div_ceil(tasks).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_depend_on_the_size_only_and_every_task_has_its_minimum_of_work() {
        for len in [PAR_MIN, PAR_MIN + 1, 100_000, 1 << 20, 12_345_678, 1 << 30] {
            let chunk = chunk_len(len);
            let tasks = len.div_ceil(chunk);
            assert!(tasks <= MAX_TASKS, "{len}: {tasks} tasks");
            // Every task but the last has at least MIN_CHUNK elements: no thread is woken
            // for less work than that.
            assert!(chunk >= MIN_CHUNK, "{len}: chunk {chunk}");
            assert!(tasks <= len / MIN_CHUNK, "{len}: {tasks} tasks");
        }
    }
}
