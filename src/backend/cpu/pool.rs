//! The CPU worker pool: the calling thread plus `threads() − 1` helper threads.
//!
//! Why not a general work-stealing pool: a training step at small batch is a chain of short
//! kernels (tens of microseconds each), issued from the user's thread. With a pool the caller
//! only hands work to, every kernel pays a sleep and a wake-up of the caller on top of the
//! helpers', and on a machine with as many busy threads as cores the spinning helpers compete
//! with the caller for them. Here, as in OpenMP runtimes:
//!
//! - the caller takes part: it claims tasks like any helper, so `threads()` threads run a job,
//!   not `threads() + 1`;
//! - helpers spin for a short while (`SPIN`) after a job before they sleep, so the next kernel
//!   of a step starts on them within a fraction of a microsecond;
//! - one job runs at a time. A caller that finds the pool busy (another thread's job, or a
//!   kernel called from inside a task) runs its tasks itself, in order: never a deadlock, and
//!   never more threads than cores.
//!
//! - a job runs on the threads the policy gives its work (`super::threads_for`: one per so many
//!   FLOPs or bytes, at most one per task), and lets at most that many helpers in, less the
//!   caller (and wakes at most that many sleeping ones): a kernel with little work never wakes
//!   the whole pool. How many tasks a kernel has is its own choice, made from the problem's
//!   size alone (see `super::chunk_len`), so that its results are bit-identical for any thread
//!   count, and for any cap set by [`set_limit`].
//!
//! The thread count is `NDSCOPE_NUM_THREADS` when set, else the number of cores the process may
//! use. The pool is created at the first parallel kernel, which cannot fail, so a bad value is
//! reported the way a bad `NDSCOPE_MAX_HOST_BYTES` is: a warning (on stderr and through
//! `tracing`) that names the variable and the value, and the default in its place. See
//! [`threads_from_env`].

use std::cell::UnsafeCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::Work;

/// How long a helper spins for the next job before it sleeps.
const SPIN: Duration = Duration::from_micros(300);

/// `ctl` layout: the number of helpers inside the current job in the low 16 bits, the number
/// that joined it in the next 16, the "open" flag (helpers may join) above them, and the job's
/// epoch in the high bits.
const COUNT_MASK: u64 = (1 << 16) - 1;
const JOINED_SHIFT: u32 = 16;
const JOINED_ONE: u64 = 1 << JOINED_SHIFT;
const OPEN: u64 = 1 << 32;
const EPOCH_SHIFT: u32 = 33;

/// The most threads the pool starts, whatever `NDSCOPE_NUM_THREADS` asks (the helper counts of
/// `ctl` must fit in 16 bits).
const MAX_THREADS: usize = 1024;

/// How many times the available parallelism `NDSCOPE_NUM_THREADS` may ask for...
const OVERSUBSCRIBE: usize = 4;
/// ...or this many threads, if more: a small machine (CI's two cores) can still run a 16- or
/// 64-core server's pool, to reproduce what happens there.
const MIN_MAX_THREADS: usize = 64;

/// One job: `tasks` calls of `f`, each index given to exactly one thread.
struct Job<'a> {
    f: &'a (dyn Fn(usize) + Sync),
    tasks: usize,
}

struct Pool {
    /// Threads a job runs on: 1 + the helpers that started.
    threads: AtomicUsize,
    /// The cores the process may use: no job runs on more threads than that.
    cores: AtomicUsize,
    /// Helpers spinning for the next job (not sleeping, not in a job).
    spinning: AtomicUsize,
    /// Whether a caller owns the pool (runs a job).
    busy: AtomicBool,
    ctl: AtomicU64,
    /// The open job, valid while a helper is counted in `ctl`.
    job: UnsafeCell<*const Job<'static>>,
    /// The next unclaimed task of the current job.
    next: AtomicUsize,
    /// How many helpers may join the current job (its tasks less the caller's one).
    helpers: AtomicUsize,
    /// Whether a helper's task panicked in the current job.
    panicked: AtomicBool,
    sleepers: AtomicUsize,
    /// Helpers that have started and warmed their thread-local kernel state.
    ready: AtomicUsize,
    /// Whether every helper was ready before the pool was published.
    warm_at_start: AtomicBool,
    sleep_lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written only by the caller owning the pool (`busy`) while the job is closed
// (no helper inside), and read only by helpers counted inside the open job; the `ctl` store
// (Release) and join CAS (Acquire) order the write before the reads. Everything else is atomic
// or locked.
unsafe impl Sync for Pool {}

static POOL: OnceLock<&'static Pool> = OnceLock::new();

/// The most threads a job may run on, set by [`set_limit`] (`usize::MAX`: the whole pool).
static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);

/// The pool size `NDSCOPE_NUM_THREADS` asks for, given its value (`None` when unset) and the
/// available parallelism, with the warning to give when the value is not used as it stands:
///
/// - unset, or only blanks: `available`, no warning;
/// - a whole number from 1 to `max(4 × available, 64)` (at most 1024): that number;
/// - a larger number: clamped to that maximum, with a warning (1000 threads on 8 cores would
///   only make every kernel slower, and each thread reserves its stack and kernel buffers);
/// - `0`, a negative, fractional or non-numeric value: `available`, with a warning.
pub(crate) fn threads_from_env(value: Option<&str>, available: usize) -> (usize, Option<String>) {
    const VAR: &str = "NDSCOPE_NUM_THREADS";
    let available = available.clamp(1, MAX_THREADS);
    let max = max_threads(available);
    let Some(text) = value.map(str::trim).filter(|t| !t.is_empty()) else {
        return (available, None);
    };
    // All digits but too large for a u64 is still "too many threads".
    let parsed = text
        .parse::<u64>()
        .or_else(|e| match text.bytes().all(|b| b.is_ascii_digit()) {
            true => Ok(u64::MAX),
            false => Err(e),
        });
    match parsed {
        Ok(0) => (
            available,
            Some(format!(
                "ndscope: ignoring {VAR}={text:?}: the pool needs at least one thread (the \
                 caller's); using the {available} cores available"
            )),
        ),
        Ok(n) if n > max as u64 => (
            max,
            Some(format!(
                "ndscope: {VAR}={text:?} is more than the {max} threads allowed with {available} \
                 cores available (the larger of {OVERSUBSCRIBE} × the cores and \
                 {MIN_MAX_THREADS}); using {max} threads"
            )),
        ),
        Ok(n) => (n as usize, None),
        Err(_) => (
            available,
            Some(format!(
                "ndscope: ignoring {VAR}={text:?}: expected a whole number of threads from 1 to \
                 {max}; using the {available} cores available"
            )),
        ),
    }
}

/// The most threads a pool may have on `available` cores: the larger of [`OVERSUBSCRIBE`] ×
/// `available` and [`MIN_MAX_THREADS`], at most [`MAX_THREADS`]. Also the most
/// [`measure_cpu_peak`](super::peak::measure_cpu_peak) runs on.
pub(crate) fn max_threads(available: usize) -> usize {
    available
        .saturating_mul(OVERSUBSCRIBE)
        .clamp(MIN_MAX_THREADS, MAX_THREADS)
}

fn pool() -> &'static Pool {
    POOL.get_or_init(|| {
        let available = thread::available_parallelism().map_or(1, |n| n.get());
        let value = std::env::var("NDSCOPE_NUM_THREADS").ok();
        let (wanted, warning) = threads_from_env(value.as_deref(), available);
        if let Some(warning) = warning {
            // Said on stderr too: a library's `tracing` events are often not collected, and a
            // setting that silently does something else is worse than a line on stderr.
            tracing::warn!(target: "ndscope::pool", "{warning}");
            eprintln!("{warning}");
        }
        let pool: &'static Pool = Box::leak(Box::new(Pool {
            threads: AtomicUsize::new(1),
            cores: AtomicUsize::new(available.max(1)),
            busy: AtomicBool::new(false),
            ctl: AtomicU64::new(0),
            job: UnsafeCell::new(std::ptr::null()),
            next: AtomicUsize::new(0),
            helpers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            spinning: AtomicUsize::new(0),
            ready: AtomicUsize::new(0),
            warm_at_start: AtomicBool::new(false),
            sleep_lock: Mutex::new(()),
            wake: Condvar::new(),
        }));
        let mut started = 0;
        for i in 1..wanted {
            let spawned = thread::Builder::new()
                .name(format!("ndscope-cpu-{i}"))
                .spawn(move || helper(pool));
            if spawned.is_ok() {
                started += 1;
            }
        }
        pool.threads.store(1 + started, Ordering::Relaxed);
        // Wait until the helpers have allocated their per-thread kernel buffers, so that this
        // happens now (at the first parallel kernel) and never later, in the middle of a
        // steady loop. A second at most: a helper that is not scheduled by then warms later.
        let start = Instant::now();
        while pool.ready.load(Ordering::Acquire) < started
            && start.elapsed() < Duration::from_secs(1)
        {
            thread::yield_now();
        }
        let warm = pool.ready.load(Ordering::Acquire) == started;
        pool.warm_at_start.store(warm, Ordering::Relaxed);
        pool
    })
}

/// Threads a parallel kernel may run on (the caller included): the pool's, or fewer if
/// [`set_limit`] said so.
pub(crate) fn threads() -> usize {
    pool()
        .threads
        .load(Ordering::Relaxed)
        .min(LIMIT.load(Ordering::Relaxed))
}

/// Caps the threads any job runs on at `n` (at least 1; more than the pool has means the whole
/// pool) and returns the threads kernels may now run on. The pool's threads stay (the ones
/// above the cap sleep); a kernel's tasks do not change, so neither do its results.
pub(crate) fn set_limit(n: usize) -> usize {
    LIMIT.store(n.max(1), Ordering::Relaxed);
    threads()
}

fn run_tasks(pool: &Pool, job: &Job<'_>) -> bool {
    let mut ok = true;
    loop {
        let i = pool.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.tasks {
            return ok;
        }
        // The payload is dropped here, on a pool thread: a `Drop` that panics must not escape
        // and end the helper (the caller re-panics with a message of its own).
        if let Err(payload) = panic::catch_unwind(AssertUnwindSafe(|| (job.f)(i))) {
            crate::error::drop_panic_payload(payload);
            ok = false;
        }
    }
}

fn helper(pool: &'static Pool) {
    super::warm::warm_thread();
    pool.ready.fetch_add(1, Ordering::Release);
    let mut seen = 0u64;
    // Since when this helper has run no task: it spins until `SPIN` past that, then sleeps. A
    // job it did not join (enough helpers were in) does not restart the count: on a pool larger
    // than the jobs (16 threads on 2 cores, or kernels that want 2 threads of 64), the helpers
    // no job wants would otherwise spin for ever, taking the cores from the ones working.
    let mut idle_since = Instant::now();
    loop {
        // Wait for an open job of a new epoch: spin first, then sleep.
        let mut spins = 0u32;
        pool.spinning.fetch_add(1, Ordering::SeqCst);
        let mut ctl = loop {
            let c = pool.ctl.load(Ordering::Acquire);
            if c & OPEN != 0 && c >> EPOCH_SHIFT != seen {
                pool.spinning.fetch_sub(1, Ordering::SeqCst);
                break c;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && idle_since.elapsed() > SPIN {
                let guard = pool
                    .sleep_lock
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                pool.spinning.fetch_sub(1, Ordering::SeqCst);
                pool.sleepers.fetch_add(1, Ordering::SeqCst);
                let c = pool.ctl.load(Ordering::SeqCst);
                if !(c & OPEN != 0 && c >> EPOCH_SHIFT != seen) {
                    drop(
                        pool.wake
                            .wait(guard)
                            .unwrap_or_else(PoisonError::into_inner),
                    );
                }
                pool.sleepers.fetch_sub(1, Ordering::SeqCst);
                pool.spinning.fetch_add(1, Ordering::SeqCst);
                continue;
            }
            std::hint::spin_loop();
        };
        seen = ctl >> EPOCH_SHIFT;
        // The caller wrote `helpers` before opening the job; our Acquire load of `ctl` saw the
        // open job, so it sees that write too.
        let limit = pool.helpers.load(Ordering::Relaxed) as u64;
        // Join (count ourselves in) only while this job is still open and wants more helpers.
        let joined = loop {
            if (ctl >> JOINED_SHIFT) & COUNT_MASK >= limit {
                break false;
            }
            match pool.ctl.compare_exchange_weak(
                ctl,
                ctl + 1 + JOINED_ONE,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => break true,
                Err(now) if now & OPEN != 0 && now >> EPOCH_SHIFT == seen => ctl = now,
                Err(_) => break false,
            }
        };
        if !joined {
            continue;
        }
        // SAFETY: we are counted inside the open job, so the caller has published `job` before
        // opening (ordered by our Acquire) and keeps it alive until we leave below.
        let job = unsafe { &**pool.job.get() };
        if !run_tasks(pool, job) {
            pool.panicked.store(true, Ordering::Relaxed);
        }
        pool.ctl.fetch_sub(1, Ordering::Release);
        idle_since = Instant::now();
    }
}

#[cfg(test)]
thread_local! {
    /// How many helpers joined the last job this thread ran on the pool.
    pub(crate) static LAST_JOINED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

thread_local! {
    /// Set on threads that run every kernel themselves ([`set_inline`]).
    static INLINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// From now on, kernels called on this thread run on it alone, without the pool (`true`), or
/// on the pool again (`false`). For threads that are themselves one of as many parallel workers
/// as there are cores (the workers of a `ParallelInference`, while others are busy too): a
/// kernel that also asked the pool's helpers for help would put more busy threads than cores on
/// the machine.
pub(crate) fn set_inline(inline: bool) {
    INLINE.with(|i| i.set(inline));
}

/// Runs `f(0)`, …, `f(tasks − 1)`, each once, on the pool (the calling thread included), and
/// returns when all have finished. At most `threads_for(work, tasks, threads())` threads take
/// part (the thread policy, `super::threads_for`): no helper joins (or is woken) that would find
/// no task, or too little work. Runs them in order on the calling thread when that is one
/// thread, or the pool is busy. A panic in a task is re-raised here
/// after every task has finished.
///
/// Which thread runs which task is left to timing, so a kernel's result must not depend on it:
/// each task writes its own part of the output, and partial results are combined in task order
/// (as [`fold_tasks`] does).
pub(crate) fn run(tasks: usize, work: Work, f: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 || INLINE.with(std::cell::Cell::get) {
        (0..tasks).for_each(f);
        return;
    }
    let pool = pool();
    // Never more threads at once than cores: on a pool larger than the machine (16 threads on
    // 2 cores), a third thread woken for a 1024² product waits for a core a scheduler tick
    // long (a batch-1 forward pass took 417 µs there instead of 61).
    let cores = pool.cores.load(Ordering::Relaxed);
    let threads = super::threads_for(work, tasks, threads().min(cores));
    if threads < 2
        || pool
            .busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
    {
        (0..tasks).for_each(f);
        return;
    }
    let job = Job { f, tasks };
    // SAFETY: we own the pool (`busy`) and the previous job is closed with no helper inside, so
    // nobody reads `job` now. The pointer is only dereferenced by helpers counted inside the job
    // opened below, and we close it and wait for them to leave before `job` goes out of scope.
    unsafe { *pool.job.get() = (&job as *const Job<'_>).cast::<Job<'static>>() };
    pool.next.store(0, Ordering::Relaxed);
    let helpers = threads - 1;
    pool.helpers.store(helpers, Ordering::Relaxed);
    pool.panicked.store(false, Ordering::Relaxed);
    let epoch = (pool.ctl.load(Ordering::Relaxed) >> EPOCH_SHIFT).wrapping_add(1);
    pool.ctl.store(
        (epoch << EPOCH_SHIFT) | OPEN,
        // SeqCst pairs with the sleepers' SeqCst increment and load: either a helper going to
        // sleep sees the open job, or we see it counted as a sleeper and wake it.
        Ordering::SeqCst,
    );
    let sleepers = pool.sleepers.load(Ordering::SeqCst);
    // The places spinning helpers will take need no sleeper woken (a wake-up is a system call,
    // and on a small machine a context switch the caller waits for). A spinner that goes to
    // sleep meanwhile leaves its place to the caller, which runs every task no helper takes.
    let wake = helpers
        .saturating_sub(pool.spinning.load(Ordering::SeqCst))
        .min(sleepers);
    if wake > 0 {
        let _guard = pool
            .sleep_lock
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        // A woken helper that finds no place left goes back to sleep.
        for _ in 0..wake {
            pool.wake.notify_one();
        }
    }
    let mine = panic::catch_unwind(AssertUnwindSafe(|| {
        let mut i = pool.next.fetch_add(1, Ordering::Relaxed);
        while i < tasks {
            f(i);
            i = pool.next.fetch_add(1, Ordering::Relaxed);
        }
    }));
    // Close the job, then wait for the helpers inside it to finish their last task.
    let closed = pool.ctl.fetch_and(!OPEN, Ordering::AcqRel);
    let joined = ((closed >> JOINED_SHIFT) & COUNT_MASK) as usize;
    debug_assert!(
        joined <= helpers,
        "{joined} helpers joined a job for {helpers}"
    );
    #[cfg(test)]
    LAST_JOINED.with(|j| j.set(joined));
    #[cfg(not(test))]
    let _ = joined;
    let mut spins = 0u32;
    while pool.ctl.load(Ordering::Acquire) & COUNT_MASK != 0 {
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(1024) {
            thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    let helper_panicked = pool.panicked.load(Ordering::Relaxed);
    pool.busy.store(false, Ordering::Release);
    if let Err(payload) = mine {
        panic::resume_unwind(payload);
    }
    if helper_panicked {
        panic!("a task on an ndscope pool thread panicked");
    }
}

/// A pointer that may cross threads; users guarantee disjoint access.
pub(crate) struct SendPtr<T>(pub(crate) *mut T);

// Copy for every `T` (a derive would ask `T: Copy`).
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer. (A method, so closures capture the whole `SendPtr`, not its field.)
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}
// SAFETY: a `SendPtr` is only a number in transit; every dereference states why it is exclusive.
unsafe impl<T: Send> Send for SendPtr<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// Calls `f(start..end)` for the consecutive ranges of `0..len` of `chunk` elements (the last
/// may be shorter), in parallel (on the threads `work` is worth): each range goes to one call
/// only.
pub(crate) fn for_each_range(
    len: usize,
    chunk: usize,
    work: Work,
    f: impl Fn(std::ops::Range<usize>) + Sync,
) {
    let chunk = chunk.max(1);
    run(len.div_ceil(chunk), work, &|i| {
        let start = i * chunk;
        f(start..(start + chunk).min(len));
    });
}

/// Calls `f(i, chunk_i)` for the consecutive chunks of `out` of `chunk` elements (the last may
/// be shorter), in parallel (on the threads `work` is worth).
pub(crate) fn for_each_chunk_mut<T: Send>(
    out: &mut [T],
    chunk: usize,
    work: Work,
    f: impl Fn(usize, &mut [T]) + Sync,
) {
    let chunk = chunk.max(1);
    let base = SendPtr(out.as_mut_ptr());
    for_each_range(out.len(), chunk, work, |range| {
        // SAFETY: `for_each_range` gives each range to one call only, so the ranges handed out
        // are disjoint and inside `out`, which stays mutably borrowed until it returns.
        let part =
            unsafe { std::slice::from_raw_parts_mut(base.get().add(range.start), range.len()) };
        f(range.start / chunk, part);
    });
}

/// Chunk `t` of `x` cut into chunks of `chunk` elements (the last may be shorter).
pub(crate) fn chunk_at<T>(x: &[T], chunk: usize, t: usize) -> &[T] {
    &x[t * chunk..((t + 1) * chunk).min(x.len())]
}

/// Calls `f(out_i, src_i)` for the i-th chunks of `out` (cut into chunks of `out_chunk`
/// elements) and of `src` (chunks of `src_chunk`), in parallel (on the threads `work` is
/// worth). Both must cut into the same number of chunks.
pub(crate) fn for_each_chunk_zip<T: Send, S: Sync>(
    out: &mut [T],
    out_chunk: usize,
    src: &[S],
    src_chunk: usize,
    work: Work,
    f: impl Fn(&mut [T], &[S]) + Sync,
) {
    debug_assert_eq!(
        out.len().div_ceil(out_chunk.max(1)),
        src.len().div_ceil(src_chunk.max(1))
    );
    for_each_chunk_mut(out, out_chunk, work, |t, o| {
        f(o, chunk_at(src, src_chunk, t))
    });
}

/// Results of this many tasks are kept on the stack: a parallel reduction then allocates
/// nothing (a training step's reductions stay off the heap, and off new pages).
const STACK_TASKS: usize = 64;

/// `f(0)`, …, `f(tasks − 1)` computed in parallel (on the threads `work` is worth), then
/// combined in index order: `combine(combine(f(0), f(1)), f(2))`, …; `None` for no tasks.
pub(crate) fn fold_tasks<R: Send>(
    tasks: usize,
    work: Work,
    f: impl Fn(usize) -> R + Sync,
    combine: impl FnMut(R, R) -> R,
) -> Option<R> {
    let fill = |slots: &mut [Option<R>]| {
        for_each_chunk_mut(slots, 1, work, |i, slot| slot[0] = Some(f(i)));
    };
    if tasks <= STACK_TASKS {
        let mut slots: [Option<R>; STACK_TASKS] = std::array::from_fn(|_| None);
        fill(&mut slots[..tasks]);
        slots.into_iter().flatten().reduce(combine)
    } else {
        let mut slots: Vec<Option<R>> = (0..tasks).map(|_| None).collect();
        fill(&mut slots);
        slots.into_iter().flatten().reduce(combine)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Work enough for every thread of the pool.
    const ALL: Work = Work::Flops(usize::MAX, usize::MAX);

    #[test]
    fn every_task_runs_once_and_nested_calls_run_inline() {
        for tasks in [0, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            run(tasks, ALL, &|i| {
                // A kernel called from inside a task finds the pool busy and runs inline.
                let inner = AtomicUsize::new(0);
                run(3, ALL, &|_| {
                    inner.fetch_add(1, Ordering::Relaxed);
                });
                assert_eq!(inner.load(Ordering::Relaxed), 3);
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn a_job_never_takes_more_threads_than_it_has_tasks() {
        // Tasks long enough (about 50 µs each) that every spinning helper would join if let.
        let work = |_: usize| {
            let start = Instant::now();
            while start.elapsed() < Duration::from_micros(50) {
                std::hint::spin_loop();
            }
        };
        for tasks in 2..=threads() + 3 {
            for _ in 0..20 {
                LAST_JOINED.with(|j| j.set(usize::MAX));
                run(tasks, ALL, &work);
                let joined = LAST_JOINED.with(std::cell::Cell::get);
                if joined == usize::MAX {
                    continue; // the pool was busy (another test's job): ran inline
                }
                assert!(
                    joined < tasks && joined < threads(),
                    "{joined} helpers joined a job of {tasks} tasks on {} threads",
                    threads()
                );
            }
        }
    }

    #[test]
    fn the_thread_count_variable_is_checked_and_clamped() {
        assert_eq!(threads_from_env(None, 8), (8, None));
        assert_eq!(threads_from_env(Some("  "), 8), (8, None));
        assert_eq!(threads_from_env(Some("3"), 8), (3, None));
        assert_eq!(threads_from_env(Some(" 32 "), 8), (32, None));
        assert_eq!(threads_from_env(Some("64"), 2), (64, None));
        assert_eq!(threads_from_env(Some("100"), 32), (100, None));
        let (n, warning) = threads_from_env(Some("1000"), 8);
        assert_eq!(n, 64);
        let warning = warning.expect("a clamped value warns");
        assert!(warning.contains("NDSCOPE_NUM_THREADS=\"1000\"") && warning.contains("64"));
        assert_eq!(threads_from_env(Some("1000"), 32).0, 128);
        for bad in ["0", "-2", "1.5", "four", "1e3", "99999999999999999999999"] {
            let (n, warning) = threads_from_env(Some(bad), 8);
            let warning = warning.unwrap_or_else(|| panic!("{bad:?} warns"));
            assert!(
                warning.contains(&format!("NDSCOPE_NUM_THREADS={bad:?}")),
                "{warning}"
            );
            if bad.starts_with("9999") {
                assert_eq!(n, 64, "a huge number is clamped");
            } else {
                assert_eq!(n, 8, "{bad:?} falls back to the cores available");
            }
        }
        // Never more than MAX_THREADS, however many cores.
        assert_eq!(threads_from_env(Some("100000"), 4096).0, MAX_THREADS);
        assert_eq!(threads_from_env(None, 0).0, 1);
    }

    #[test]
    fn helpers_are_warm_before_the_pool_is_used() {
        // A helper's warm-up must not wait for the pool it is starting in (it once did, and
        // every process stalled for the one-second timeout at its first parallel kernel).
        assert!(threads() >= 1);
        assert!(pool().warm_at_start.load(Ordering::Relaxed));
    }

    #[test]
    fn chunks_are_disjoint_and_cover_the_slice() {
        let mut v = vec![0usize; 1001];
        for_each_chunk_mut(&mut v, 64, ALL, |i, part| {
            for (j, x) in part.iter_mut().enumerate() {
                *x += i * 64 + j;
            }
        });
        assert!(v.iter().enumerate().all(|(i, &x)| x == i));
        let order = |n| {
            fold_tasks(
                n,
                ALL,
                |i| vec![i],
                |mut a, b| {
                    a.extend(b);
                    a
                },
            )
        };
        assert_eq!(order(5), Some(vec![0, 1, 2, 3, 4]));
        assert_eq!(order(100), Some((0..100).collect()));
        assert_eq!(order(0), None);
    }

    #[test]
    fn concurrent_callers_and_a_panicking_task() {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                thread::spawn(move || {
                    for round in 0..200 {
                        let sum = AtomicUsize::new(0);
                        run(8, ALL, &|i| {
                            sum.fetch_add(i + t + round, Ordering::Relaxed);
                        });
                        assert_eq!(sum.load(Ordering::Relaxed), 28 + 8 * (t + round));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().expect("no caller panics");
        }
        let caught = panic::catch_unwind(|| run(64, ALL, &|i| assert!(i != 40, "task 40 fails")));
        assert!(caught.is_err());
        // The pool still works afterwards.
        let count = AtomicUsize::new(0);
        run(10, ALL, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }

    /// A panic payload whose own `Drop` panics.
    struct PanicsOnDrop;
    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("the payload's drop panics too");
        }
    }

    #[test]
    fn a_payload_whose_drop_panics_ends_no_pool_thread() {
        for _ in 0..20 {
            let caught = panic::catch_unwind(|| {
                run(64, ALL, &|_| std::panic::panic_any(PanicsOnDrop));
            });
            // The caller's own payload is re-raised: leak it rather than run its `Drop`.
            match caught {
                Err(payload) => std::mem::forget(payload),
                Ok(()) => panic!("the job's panic reached the caller"),
            }
        }
        // Every helper is still there to take part (a dead one would leave this job waiting).
        let count = AtomicUsize::new(0);
        run(64, ALL, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 64);
    }
}
