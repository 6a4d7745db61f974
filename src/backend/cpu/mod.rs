//! CPU kernels over slices. Large inputs are split across the worker pool (`pool`); `ops`
//! runs the op families on host buffers.

pub(crate) mod buffer;
pub(crate) mod elementwise;
pub(crate) mod gemv;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod num;
pub(crate) mod ops;
pub(crate) mod optim;
pub(crate) mod packed;
pub(crate) mod pool;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod sgd;
pub(crate) mod shape;
pub(crate) mod warm;

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

    /// The threads each kernel of the workloads takes on a 16-thread pool (an MLP
    /// 784→1024→1024→10 training step at batch 256 and 16, inference at batch 1 and 64): the
    /// policy's table, kept here so that a change to it is a visible change to this test. A
    /// kernel takes `min(16, tasks)` threads, and `run` lets no more helpers in than that.
    #[test]
    fn threads_per_kernel_on_a_16_thread_pool() {
        const THREADS: usize = 16;
        let product = |m: usize, k: usize, n: usize| {
            if m <= gemv::MAX_M {
                gemv::tasks(m, k, n)
            } else {
                matmul::split(m, n, k).tasks
            }
        };
        let elementwise = |len: usize| {
            if len < PAR_MIN {
                1
            } else {
                len.div_ceil(chunk_len(len))
            }
        };
        let sgd =
            |m: usize, k: usize, n: usize| m.div_ceil(4).div_ceil(sgd::tiles_per_task(m, k, n));
        let mut rows = Vec::new();
        for b in [256, 16] {
            rows.push((
                format!("b{b} fwd [{b},784]·[784,1024]"),
                product(b, 784, 1024),
            ));
            rows.push((
                format!("b{b} fwd [{b},1024]·[1024,1024]"),
                product(b, 1024, 1024),
            ));
            rows.push((
                format!("b{b} fwd [{b},1024]·[1024,10]"),
                product(b, 1024, 10),
            ));
            rows.push((
                format!("b{b} bias add / relu [{b},1024]"),
                elementwise(b * 1024),
            ));
            rows.push((
                format!("b{b} bwd dh [{b},10]·[10,1024]"),
                product(b, 10, 1024),
            ));
            rows.push((
                format!("b{b} bwd dh [{b},1024]·[1024,1024]ᵀ"),
                product(b, 1024, 1024),
            ));
            if b > 64 {
                // Weight gradients through gemm (xᵀ·g), then the update pass over the weights.
                rows.push((
                    format!("b{b} dW [784,{b}]·[{b},1024]"),
                    product(784, b, 1024),
                ));
                rows.push((
                    format!("b{b} dW [1024,{b}]·[{b},1024]"),
                    product(1024, b, 1024),
                ));
                rows.push((format!("b{b} dW [1024,{b}]·[{b},10]"), product(1024, b, 10)));
                rows.push((format!("b{b} update 784×1024"), elementwise(784 * 1024)));
            } else {
                rows.push((format!("b{b} fused sgd 784×1024"), sgd(784, b, 1024)));
                rows.push((format!("b{b} fused sgd 1024×1024"), sgd(1024, b, 1024)));
                rows.push((format!("b{b} fused sgd 1024×10"), sgd(1024, b, 10)));
            }
        }
        for b in [1, 64] {
            rows.push((
                format!("infer b{b} matmul [{b},784]·[784,1024]"),
                product(b, 784, 1024),
            ));
            rows.push((
                format!("infer b{b} matmul [{b},1024]·[1024,1024]"),
                product(b, 1024, 1024),
            ));
            rows.push((
                format!("infer b{b} Dense packed 784→1024"),
                packed::tasks(b, 784, 1024),
            ));
            rows.push((
                format!("infer b{b} Dense packed 1024→1024"),
                packed::tasks(b, 1024, 1024),
            ));
            rows.push((
                format!("infer b{b} Dense packed 1024→10"),
                packed::tasks(b, 1024, 10),
            ));
        }
        for (name, tasks) in &rows {
            println!("| {name} | {tasks} | {} |", (*tasks).min(THREADS));
        }
        let threads: Vec<usize> = rows.iter().map(|(_, t)| (*t).min(THREADS)).collect();
        assert_eq!(
            threads,
            [
                16, 16, 8, 16, 16, 16, 16, 16, 16, 16, // b256
                16, 16, 1, 1, 1, 16, 16, 16, 2, // b16
                1, 1, 8, 10, 1, // inference b1
                16, 16, 16, 16, 1, // inference b64
            ],
            "the policy's table changed: {rows:#?}"
        );
    }
}
