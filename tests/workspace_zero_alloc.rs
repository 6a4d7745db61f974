//! After learning, a training-like workspace cycle (create, matmul, relu, mean, close) makes zero
//! heap allocations for array storage. A counting global allocator sees every allocation of the
//! process but the test harness's own thread (see `harness_thread`). ndscope allocates array
//! buffers and workspace blocks with exactly 64-byte alignment (`workspace::ALIGNMENT`), so
//! those are "storage"; the matrix kernels' packing scratch
//! (`gemm`, 128-byte aligned) and small metadata (array handles, names; 8-byte aligned) are
//! counted separately.
//!
//! The same holds for a training step with autograd: forward under a gradient collector,
//! `backward` (its tape holds handles, its temporaries land in the cycle) and an SGD update of
//! each parameter from its gradient, which is then zeroed.
//!
//! The counts per cycle must not depend on the thread count either (the pool's bookkeeping is
//! allocated once, and a product is cut into the same gemm calls on 1 thread or 16): the test
//! runs itself again in child processes with `NDSCOPE_NUM_THREADS` set to 1, 2, 3, 7 and 16 and
//! compares their counts.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, AtomicUsize, Ordering};

use ndscope::{gradient_collector, DType, Manager, NDArray, Result, SgdUpdate, WorkspaceConfig};

struct Counting;

static WATCHING: AtomicBool = AtomicBool::new(false);
static STORAGE: AtomicUsize = AtomicUsize::new(0);
static STORAGE_BYTES: AtomicUsize = AtomicUsize::new(0);
static SCRATCH: AtomicUsize = AtomicUsize::new(0);
static OTHER: AtomicUsize = AtomicUsize::new(0);
/// Bytes allocated minus bytes freed while watching.
static NET: AtomicIsize = AtomicIsize::new(0);

/// Whether the calling thread is the test harness's main thread while the test body runs on
/// another one: its allocations (the harness waiting for the test, timed wake-ups that shift
/// into a cycle under load) are not the library's and are not counted. ndscope's pool threads
/// and the test's own thread are.
fn harness_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and getpid take no arguments, cannot fail and allocate nothing; a
        // process's main thread has the process id as its thread id.
        let main = unsafe { libc::gettid() == libc::getpid() };
        main && !MEASURING_ON_MAIN.load(Ordering::Relaxed)
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Whether [`count`] runs on the process's main thread (then nothing is left out).
static MEASURING_ON_MAIN: AtomicBool = AtomicBool::new(false);

fn watching() -> bool {
    WATCHING.load(Ordering::Relaxed) && !harness_thread()
}

fn note(layout: Layout) {
    if watching() {
        NET.fetch_add(layout.size() as isize, Ordering::Relaxed);
        if layout.align() == ndscope::workspace::ALIGNMENT {
            STORAGE.fetch_add(1, Ordering::Relaxed);
            STORAGE_BYTES.fetch_add(layout.size(), Ordering::Relaxed);
        } else if layout.align() > ndscope::workspace::ALIGNMENT {
            SCRATCH.fetch_add(1, Ordering::Relaxed);
        } else {
            OTHER.fetch_add(1, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; we only count on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if watching() {
            NET.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        // SAFETY: `ptr` came from `System` with this layout (all our allocations do).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(Layout::from_size_align(new_size, layout.align()).unwrap_or(layout));
        if watching() {
            NET.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        }
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// One training-like step: a batch, two dense layers with ReLU, a mean loss read back.
fn step(batch: &Manager, w1: &NDArray, w2: &NDArray) -> Result<f32> {
    let x = batch.randn([128, 64], DType::F32)?;
    let h = x.matmul(w1)?.relu()?;
    let logits = h.matmul(w2)?;
    let loss = logits.mean_all()?;
    loss.to_scalar::<f32>()
}

/// The labels of the autograd step's batch.
const LABELS: [i64; 128] = {
    let mut labels = [0i64; 128];
    let mut i = 0;
    while i < 128 {
        labels[i] = ((i * 7) % 10) as i64;
        i += 1;
    }
    labels
};

/// One training step with autograd: a batch, a two-layer classifier with biases and ReLU, the
/// mean negative log-likelihood, `backward`, then an SGD update of each parameter and its
/// gradient zeroed.
fn autograd_step(batch: &Manager, params: &[NDArray; 4]) -> Result<()> {
    let [w1, b1, w2, b2] = params;
    let collector = gradient_collector()?;
    let x = batch.randn([128, 64], DType::F32)?;
    let labels = batch.from_slice(&LABELS, [128])?;
    let h = x.matmul(w1)?.add(b1)?.relu()?;
    let logp = h.matmul(w2)?.add(b2)?.log_softmax(1)?;
    let loss = logp.pick(&labels, 1)?.mean_all()?.neg()?;
    collector.backward(&loss)?;
    drop(collector);
    for p in params {
        let g = p.gradient()?;
        p.sgd_update_(&g, None, SgdUpdate::new(0.01))?;
        g.fill_(0.0)?;
    }
    Ok(())
}

/// Allocations made by `f`: storage buffers, their bytes, kernel scratch, metadata.
fn count(f: impl FnOnce()) -> (usize, usize, usize, usize) {
    for c in [&STORAGE, &STORAGE_BYTES, &SCRATCH, &OTHER] {
        c.store(0, Ordering::Relaxed);
    }
    NET.store(0, Ordering::Relaxed);
    #[cfg(target_os = "linux")]
    {
        // SAFETY: as in `harness_thread`.
        let on_main = unsafe { libc::gettid() == libc::getpid() };
        MEASURING_ON_MAIN.store(on_main, Ordering::Relaxed);
    }
    WATCHING.store(true, Ordering::Relaxed);
    f();
    WATCHING.store(false, Ordering::Relaxed);
    (
        STORAGE.load(Ordering::Relaxed),
        STORAGE_BYTES.load(Ordering::Relaxed),
        SCRATCH.load(Ordering::Relaxed),
        OTHER.load(Ordering::Relaxed),
    )
}

const CHILD_VAR: &str = "NDSCOPE_TEST_ZERO_ALLOC_CHILD";
const COUNTS_PREFIX: &str = "per cycle after learning: ";

/// The per-cycle line of this test run in a child process with `threads` pool threads.
fn counts_with(threads: usize) -> String {
    let child = std::process::Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "learned_workspace_cycle_allocates_no_array_storage",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("NDSCOPE_NUM_THREADS", threads.to_string())
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let head: String = stdout.chars().take(3000).collect();
    let stderr = String::from_utf8_lossy(&child.stderr);
    assert!(
        child.status.success(),
        "with {threads} threads: {head}\n{stderr}"
    );
    stdout
        .lines()
        .find_map(|l| l.find(COUNTS_PREFIX).map(|at| l[at..].to_string()))
        .unwrap_or_else(|| panic!("no counts from the child ({threads} threads): {head}"))
}

// One test in this binary: the counters are process-wide.
#[test]
fn learned_workspace_cycle_allocates_no_array_storage() {
    let here = cycle_counts();
    if std::env::var_os(CHILD_VAR).is_some() {
        return;
    }
    let one = counts_with(1);
    assert_eq!(
        here,
        one,
        "with {} threads and with one",
        ndscope::num_threads()
    );
    for threads in [2, 3, 7, 16] {
        assert_eq!(
            counts_with(threads),
            one,
            "allocations per cycle with {threads} threads and with one"
        );
    }
}

/// Runs the checks in this process and returns its per-cycle line.
fn cycle_counts() -> String {
    let mut line = String::new();
    let model = Manager::new_base().with_name("model");
    let w1 = model.randn([64, 256], DType::F32).unwrap();
    let w2 = model.randn([256, 10], DType::F32).unwrap();
    model.cap();
    let trainer = model.new_sub_manager().unwrap().with_name("trainer");

    // Control: the same step without a workspace allocates storage for each of its arrays,
    // so the counter can see what it is meant to see.
    let (storage, bytes, _, _) = count(|| {
        trainer.scope(|batch| step(batch, &w1, &w2)).unwrap();
    });
    assert!(
        storage >= 5,
        "without a workspace a step allocates storage for its 5 arrays, saw {storage}"
    );
    assert!(bytes >= (128 * 64 + 128 * 256 * 2 + 128 * 10) * 4);

    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    // The first cycle is measured (its arrays spill), then the block is allocated.
    for _ in 0..3 {
        ws.cycle(|batch| step(batch, &w1, &w2)).unwrap();
    }
    let stats = ws.stats();
    assert!(stats.initialized);
    assert_eq!(
        stats.spilled_count, 5,
        "only the learning cycle spills: {stats:?}"
    );

    for i in 0..20 {
        let (storage, bytes, scratch, other) = count(|| {
            ws.cycle(|batch| step(batch, &w1, &w2)).unwrap();
        });
        if i == 0 {
            line = format!("{COUNTS_PREFIX}{storage} storage, {scratch} gemm scratch, {other} metadata allocations");
        }
        assert_eq!(
            storage, 0,
            "cycle {i} after learning allocated {storage} storage buffers ({bytes} bytes)"
        );
        // Metadata only: five array handles, the cycle's manager and its name.
        assert!(other <= 24, "cycle {i}: {other} small allocations");
        let net = NET.load(Ordering::Relaxed);
        assert_eq!(net, 0, "cycle {i} left {net} heap bytes behind (a leak)");
    }
    let after = ws.stats();
    assert_eq!(after.spilled_count, 5, "no spill after learning");
    assert_eq!(after.cycles, 23);
    model.close().unwrap();
    line.push_str("; with autograd: ");
    line.push_str(&autograd_counts());
    line.push_str("; carved arrays: ");
    line.push_str(&carved_counts());
    println!("{line}");
    line
}

/// Creating and closing an array carved from a learned block allocates nothing at all, not
/// even its handle's metadata (the arena reuses a closed array's): a cycle of 128 arrays makes
/// the same allocations as a cycle of 64 (those of the cycle's scope). Returns the counts.
fn carved_counts() -> String {
    let owner = Manager::new_base().with_name("carved");
    let ws = owner
        .workspace("carved", WorkspaceConfig::default())
        .unwrap();
    let cycle = |n: usize| {
        ws.cycle(|s| {
            for _ in 0..n {
                s.empty([256], DType::F32)?.close()?;
            }
            Ok(())
        })
        .unwrap()
    };
    for _ in 0..3 {
        cycle(128);
    }
    let mut counts = Vec::new();
    for n in [64, 128, 64, 128] {
        let (storage, _, scratch, other) = count(|| cycle(n));
        let net = NET.load(Ordering::Relaxed);
        assert_eq!(
            (storage, scratch, net),
            (0, 0, 0),
            "a cycle of {n} carved arrays: storage allocations, scratch, net heap bytes"
        );
        counts.push(other);
    }
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "allocations of cycles of 64, 128, 64 and 128 carved arrays: {counts:?} (one per array: \
         a closed array's metadata is not reused)"
    );
    owner.close().unwrap();
    format!("{} allocations per cycle whatever its arrays", counts[0])
}

/// The autograd step's checks; returns its per-cycle counts.
fn autograd_counts() -> String {
    let model = Manager::new_base().with_name("model");
    let params = [
        model.randn([64, 256], DType::F32).unwrap().with_name("w1"),
        model.zeros([256], DType::F32).unwrap().with_name("b1"),
        model.randn([256, 10], DType::F32).unwrap().with_name("w2"),
        model.zeros([10], DType::F32).unwrap().with_name("b2"),
    ];
    for p in &params {
        p.set_requires_gradient(true).unwrap();
    }
    model.cap();
    let trainer = model.new_sub_manager().unwrap().with_name("trainer");

    // Control: without a workspace the step allocates storage for the forward's arrays and
    // backward's temporaries.
    let (storage, _, _, _) = count(|| {
        trainer
            .scope(|batch| autograd_step(batch, &params))
            .unwrap();
    });
    assert!(
        storage >= 20,
        "without a workspace an autograd step allocates storage for its arrays, saw {storage}"
    );

    let ws = trainer
        .workspace("step", WorkspaceConfig::default())
        .unwrap();
    for _ in 0..3 {
        ws.cycle(|batch| autograd_step(batch, &params)).unwrap();
    }
    let learned = ws.stats();
    assert!(learned.initialized);
    let mut line = String::new();
    for i in 0..20 {
        let (storage, bytes, scratch, other) = count(|| {
            ws.cycle(|batch| autograd_step(batch, &params)).unwrap();
        });
        if i == 0 {
            line =
                format!("{storage} storage, {scratch} gemm scratch, {other} metadata allocations");
        }
        assert_eq!(
            storage, 0,
            "autograd cycle {i} after learning allocated {storage} storage buffers ({bytes} bytes)"
        );
        let net = NET.load(Ordering::Relaxed);
        assert_eq!(
            net, 0,
            "autograd cycle {i} left {net} heap bytes behind (a leak: the tape kept handles?)"
        );
    }
    let after = ws.stats();
    assert_eq!(
        after.spilled_count, learned.spilled_count,
        "no spill after learning"
    );
    assert_eq!(after.cycles, 23);
    // The model holds its parameters and their gradients, nothing else.
    assert_eq!(model.report().arrays.len(), 8);
    model.close().unwrap();
    line
}
