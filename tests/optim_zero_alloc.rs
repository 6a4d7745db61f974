//! The fused optimizer steps allocate nothing: after a first step (which may start the worker
//! pool), further SGD and Adam steps on small and pool-sized arrays make no heap allocation at
//! all, and neither do `Optimizer::step` and `Optimizer::zero_gradients` over several such
//! parameters (SGD with momentum, Adam, AdamW), also inside an open gradient collector. A counting global allocator sees every allocation of the process but the test
//! harness's own thread (see `harness_thread`), so this file holds one test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ndscope::{Adam, AdamUpdate, AdamW, DType, Manager, Optimizer, OptimizerKind, Sgd, SgdUpdate};

struct Counting;

static WATCHING: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);
/// Whether the steps run on the process's main thread (then nothing is left out).
static MEASURING_ON_MAIN: AtomicBool = AtomicBool::new(false);

/// Whether this is the process's main thread (Linux: its thread id is the process id).
fn on_main_thread() -> bool {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and getpid take no arguments, cannot fail and allocate nothing.
        unsafe { libc::gettid() == libc::getpid() }
    }
    #[cfg(not(target_os = "linux"))]
    {
        false
    }
}

/// Whether the calling thread is the test harness's main thread while the test runs on another
/// one: its allocations (timed wake-ups while it waits for the test) are not the library's.
fn harness_thread() -> bool {
    on_main_thread() && !MEASURING_ON_MAIN.load(Ordering::Relaxed)
}

// SAFETY: every call is forwarded unchanged to the system allocator; we only count on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) && !harness_thread() {
            COUNT.fetch_add(1, Ordering::Relaxed);
        }
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (all our allocations do).
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn optimizer_steps_allocate_nothing() {
    fused_steps_allocate_nothing();
    optimizers_allocate_nothing();
}

fn fused_steps_allocate_nothing() {
    let mg = Manager::new_base();
    for (len, dtype) in [
        (100, DType::F32),
        (200_000, DType::F32),
        (200_000, DType::F64),
    ] {
        let p = mg.ones([len], dtype).unwrap();
        let g = mg.ones([len], dtype).unwrap();
        let (a, b) = (
            mg.zeros([len], dtype).unwrap(),
            mg.zeros([len], dtype).unwrap(),
        );
        let sgd = SgdUpdate {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..SgdUpdate::new(0.1)
        };
        let adam = AdamUpdate {
            weight_decay: 0.01,
            decoupled: true,
            ..AdamUpdate::new(0.01, 1)
        };
        let run = |t: u64| {
            p.sgd_update_(&g, Some(&a), sgd).unwrap();
            p.sgd_update_(&g, None, SgdUpdate::new(0.1)).unwrap();
            p.adam_update_(&g, &a, &b, AdamUpdate { step: t, ..adam })
                .unwrap();
        };
        run(1);
        COUNT.store(0, Ordering::Relaxed);
        MEASURING_ON_MAIN.store(on_main_thread(), Ordering::Relaxed);
        WATCHING.store(true, Ordering::Relaxed);
        for t in 2..6 {
            run(t);
        }
        WATCHING.store(false, Ordering::Relaxed);
        let count = COUNT.load(Ordering::Relaxed);
        assert_eq!(
            count, 0,
            "{len} elements of {dtype}: {count} allocations in 4 steps"
        );
    }
}

/// `Optimizer::step` and `zero_gradients` over three parameters (small and pool-sized, f32 and
/// f64) allocate nothing after the first step, with and without an open collector.
fn optimizers_allocate_nothing() {
    let model = Manager::new_base();
    let params: Vec<_> = [
        (100, DType::F32),
        (200_000, DType::F32),
        (200_000, DType::F64),
    ]
    .into_iter()
    .map(|(len, dtype)| {
        let p = model.ones([len], dtype).unwrap();
        p.set_requires_gradient(true).unwrap();
        p
    })
    .collect();
    let kinds: [OptimizerKind; 3] = [
        Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..Sgd::new(0.1)
        }
        .into(),
        Adam {
            weight_decay: 0.01,
            ..Adam::new(0.01)
        }
        .into(),
        AdamW::new(0.01).into(),
    ];
    for kind in kinds {
        let mut opt = Optimizer::new(&params, kind).unwrap();
        opt.step().unwrap();
        let scope = model.sub_scope().unwrap();
        let collector = scope.gradient_collector().unwrap();
        COUNT.store(0, Ordering::Relaxed);
        MEASURING_ON_MAIN.store(on_main_thread(), Ordering::Relaxed);
        WATCHING.store(true, Ordering::Relaxed);
        for _ in 0..4 {
            opt.step().unwrap();
            opt.zero_gradients().unwrap();
        }
        WATCHING.store(false, Ordering::Relaxed);
        drop(collector);
        scope.close().unwrap();
        let count = COUNT.load(Ordering::Relaxed);
        assert_eq!(count, 0, "{kind:?}: {count} allocations in 4 steps");
        assert_eq!(opt.steps(), 5);
        opt.close();
    }
}
