//! CPU kernels over slices. Large inputs are split across the worker pool (`pool`); `ops`
//! runs the op families on host buffers.

pub(crate) mod bf16;
pub(crate) mod buffer;
pub(crate) mod elementwise;
pub(crate) mod gemv;
pub(crate) mod matmul;
pub(crate) mod nn;
pub(crate) mod num;
pub(crate) mod ops;
pub(crate) mod optim;
pub(crate) mod packed;
pub(crate) mod peak;
pub(crate) mod pool;
pub(crate) mod random;
pub(crate) mod reduce;
pub(crate) mod sgd;
pub(crate) mod shape;
pub(crate) mod warm;
pub(crate) mod wide;

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

/// A kernel's work, as the thread policy measures it: floating-point operations for products
/// (two per multiply-add, whatever the element type) with the bytes of their operands, bytes
/// read and written for the passes over memory (elementwise loops, reductions, copies,
/// optimizer updates).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Work {
    /// A product: its floating-point operations and the bytes of its operands and result (a
    /// short product, e.g. at batch 1, is bound by reading the weights, not by arithmetic).
    Flops(usize, usize),
    /// Bytes read and written.
    Bytes(usize),
}

impl Work {
    /// The work of a product `[m, k] · [k, n]` of f32: `2·m·k·n` operations over
    /// `4·(m·k + k·n + m·n)` bytes.
    pub(crate) fn product(m: usize, k: usize, n: usize) -> Work {
        let flops = m.saturating_mul(k).saturating_mul(n).saturating_mul(2);
        let elements = m
            .saturating_mul(k)
            .saturating_add(k.saturating_mul(n))
            .saturating_add(m.saturating_mul(n));
        Work::Flops(flops, elements.saturating_mul(4))
    }

    /// The work of a pass over `streams` arrays of `len` elements of `T` (e.g. 3 for
    /// `out = a + b`: two read, one written).
    pub(crate) fn pass<T>(len: usize, streams: usize) -> Work {
        Work::Bytes(
            len.saturating_mul(std::mem::size_of::<T>().max(1))
                .saturating_mul(streams),
        )
    }
}

/// The least floating-point operations a product gives each thread it runs on: 2 Mi (1 Mi
/// multiply-adds), about 20 µs of one core's time in the products of an MLP layer (about
/// 100 GFLOP/s). Waking a sleeping helper costs tens of microseconds and a spinning one a few;
/// a thread given less would cost about as much to start as it saves.
pub(crate) const FLOPS_PER_THREAD: usize = 2 << 20;

/// The least operand bytes a product gives each thread it runs on: 1.25 MiB, about 20 µs of one
/// core reading packed weights (a batch-1 `[1,784]·[784,1024]` product, 3.2 MB, takes 50 µs on
/// one core). A batch-1 layer is bound by this, not by its FLOPs: 784→1024 takes 2 threads,
/// 1024→1024 3, the 10-wide output layer 1.
pub(crate) const PRODUCT_BYTES_PER_THREAD: usize = 5 << 18;

/// The least bytes a pass over memory gives each thread it runs on: 512 KiB (read and written),
/// about 20 µs of one core's bandwidth. A bias add or ReLU over `[16, 1024]` f32 (128 KiB) stays
/// on the calling thread; over `[256, 1024]` (2 MiB) it takes 4 threads.
pub(crate) const BYTES_PER_THREAD: usize = 512 << 10;

/// The thread policy: the threads a kernel of `tasks` tasks and `work` runs on, on a pool of
/// `pool` threads — one per [`FLOPS_PER_THREAD`] or [`PRODUCT_BYTES_PER_THREAD`] of a product
/// (whichever gives more), one per [`BYTES_PER_THREAD`] of a pass; at least one, at most one per
/// task and at most the pool. Every parallel kernel asks this, through
/// `pool::run`. It decides only *how many threads share the tasks*: the tasks themselves are
/// cut by the problem's size alone (so results stay bit-identical whatever this says).
pub(crate) fn threads_for(work: Work, tasks: usize, pool: usize) -> usize {
    let wanted = match work {
        Work::Flops(f, b) => (f / FLOPS_PER_THREAD).max(b / PRODUCT_BYTES_PER_THREAD),
        Work::Bytes(b) => b / BYTES_PER_THREAD,
    };
    wanted.clamp(1, tasks.clamp(1, pool.max(1)))
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

    /// The kernels of an MLP 784→1024→1024→10 (forward products at batch 1, 16, 64 and 256,
    /// backward products at 16 and 256, the bias add, ReLU and softmax passes) and a 1024²
    /// product, each with its tasks (from its size alone) and its work.
    fn mlp_kernels() -> Vec<(String, usize, Work)> {
        let product = |m: usize, k: usize, n: usize| {
            let tasks = if m <= gemv::MAX_M {
                gemv::tasks(m, k, n)
            } else {
                matmul::split(m, n, k).tasks
            };
            (tasks, Work::product(m, k, n))
        };
        // An elementwise pass over `len` f32 touching `streams` arrays.
        let pass = |len: usize, streams: usize| {
            let tasks = if len < PAR_MIN {
                1
            } else {
                len.div_ceil(chunk_len(len))
            };
            (tasks, Work::pass::<f32>(len, streams))
        };
        let mut rows: Vec<(String, (usize, Work))> = Vec::new();
        for b in [1, 16, 64, 256] {
            for (k, n) in [(784, 1024), (1024, 1024), (1024, 10)] {
                rows.push((
                    format!("b{b} fwd matmul [{b},{k}]·[{k},{n}]"),
                    product(b, k, n),
                ));
            }
            if b <= 64 {
                for (k, n) in [(784, 1024), (1024, 1024)] {
                    let tasks = packed::tasks(b, k, n);
                    rows.push((
                        format!("b{b} fwd Dense packed {k}→{n}"),
                        (tasks, Work::product(b, k, n)),
                    ));
                }
            }
            rows.push((
                format!("b{b} bias add [{b},1024]+[1024]"),
                pass(b * 1024, 3),
            ));
            rows.push((format!("b{b} relu [{b},1024]"), pass(b * 1024, 2)));
            rows.push((format!("b{b} softmax [{b},10]"), pass(b * 10, 2)));
            if b == 16 || b == 256 {
                rows.push((
                    format!("b{b} bwd dh [{b},10]·[10,1024]"),
                    product(b, 10, 1024),
                ));
                rows.push((
                    format!("b{b} bwd dh [{b},1024]·[1024,1024]ᵀ"),
                    product(b, 1024, 1024),
                ));
                if b > 64 {
                    rows.push((
                        format!("b{b} bwd dW [784,{b}]·[{b},1024]"),
                        product(784, b, 1024),
                    ));
                    rows.push((
                        format!("b{b} bwd dW [1024,{b}]·[{b},1024]"),
                        product(1024, b, 1024),
                    ));
                    rows.push((format!("b{b} update 784×1024"), pass(784 * 1024, 3)));
                } else {
                    for (m, n) in [(784usize, 1024), (1024, 1024)] {
                        let tasks = m.div_ceil(4).div_ceil(sgd::tiles_per_task(m, b, n));
                        rows.push((
                            format!("b{b} bwd fused sgd {m}×{n}"),
                            (tasks, Work::product(m, b, n)),
                        ));
                    }
                }
            }
        }
        rows.push(("1024² matmul".into(), product(1024, 1024, 1024)));
        rows.into_iter().map(|(n, (t, w))| (n, t, w)).collect()
    }

    /// The policy's table: the threads each kernel takes on pools of 1, 2, 16 and 64 threads
    /// (`cargo test --lib threads_per_kernel -- --nocapture` prints it; README.md's "Threads"
    /// section shows it). Kept here so that a change to the policy is a visible change to this
    /// test.
    #[test]
    fn threads_per_kernel_at_1_2_16_and_64_threads() {
        let pools = [1, 2, 16, 64];
        println!("| Kernel | Tasks | Work | 1 | 2 | 16 | 64 |\n|---|---|---|---|---|---|---|");
        let mut table = Vec::new();
        for (name, tasks, work) in mlp_kernels() {
            let threads: Vec<usize> = pools.iter().map(|&p| threads_for(work, tasks, p)).collect();
            let work_text = match work {
                Work::Flops(f, b) => {
                    format!("{:.2} MFLOP, {:.2} MB", f as f64 / 1e6, b as f64 / 1e6)
                }
                Work::Bytes(b) => format!("{} KiB", b / 1024),
            };
            println!(
                "| {name} | {tasks} | {work_text} | {} | {} | {} | {} |",
                threads[0], threads[1], threads[2], threads[3]
            );
            table.push((name, threads[2], threads[3]));
        }
        let find = |name: &str| {
            table
                .iter()
                .find(|(n, _, _)| n == name)
                .map(|&(_, t16, t64)| (t16, t64))
                .unwrap_or_else(|| panic!("no row {name}"))
        };
        // Batch 1: the passes and the small products on the calling thread, a layer's
        // product on the 2 or 3 threads its weights are worth, whatever the pool.
        for (name, t16, t64) in &table {
            if name.starts_with("b1 ") {
                assert!(*t16 <= 3 && t16 == t64, "{name}: {t16}, {t64}");
            }
        }
        assert_eq!(find("b1 fwd Dense packed 784→1024"), (2, 2));
        assert_eq!(find("b1 fwd Dense packed 1024→1024"), (3, 3));
        assert_eq!(find("b1 relu [1,1024]"), (1, 1));
        // Batch 16 training: the passes and the 10-wide products stay on the calling thread;
        // only products of at least 16 × `FLOPS_PER_THREAD` take 16 threads.
        for (name, t16, _) in &table {
            if name.starts_with("b16 ")
                && !name.contains("1024,1024")
                && !name.contains("1024→1024")
                && !name.contains("1024×1024")
            {
                assert!(*t16 < 16, "{name}: {t16}");
            }
        }
        assert_eq!(find("b16 bias add [16,1024]+[1024]"), (1, 1));
        assert_eq!(find("b16 relu [16,1024]"), (1, 1));
        assert_eq!(find("b16 fwd matmul [16,1024]·[1024,10]"), (1, 1));
        assert_eq!(find("b16 fwd matmul [16,784]·[784,1024]"), (12, 12));
        // Large products use every thread their blocks allow (16: whole blocks of 64 columns).
        assert_eq!(find("b256 fwd matmul [256,1024]·[1024,1024]"), (16, 16));
        assert_eq!(find("1024² matmul"), (16, 16));
    }
}
