//! The fused optimizer steps allocate nothing: after a first step (which may start the worker
//! pool), further SGD and Adam steps on small and pool-sized arrays make no heap allocation at
//! all. A counting global allocator sees every allocation of the process, so this file holds
//! one test.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use ndscope::{AdamUpdate, DType, Manager, SgdUpdate};

struct Counting;

static WATCHING: AtomicBool = AtomicBool::new(false);
static COUNT: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; we only count on the side.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if WATCHING.load(Ordering::Relaxed) {
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
