//! Scopes (DESIGN §2): `Manager::scope` closes its sub-scope on success, on error and on panic,
//! and makes it the active scope while the closure runs; `sub_scope` closes on drop (not active);
//! `activate` guards nest and restore the previous active scope.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};

use ndscope::{DType, Error, Manager, Result};

// ---------------------------------------------------------------------------------------------
// A global allocator counting, per thread, allocations made minus allocations freed, so a test
// can see objects that are never freed without being disturbed by the tests running beside it.
// ---------------------------------------------------------------------------------------------

struct CountingAllocator;

thread_local! {
    static LIVE_ALLOCATIONS: Cell<isize> = const { Cell::new(0) };
}

fn count(delta: isize) {
    let _ = LIVE_ALLOCATIONS.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: every call is forwarded unchanged to the system allocator; the counting touches only a
// const-initialised thread-local `Cell`, which never allocates.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(1);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count(1);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-1);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn live_allocations() -> isize {
    LIVE_ALLOCATIONS.with(Cell::get)
}

fn closed<T: std::fmt::Debug>(result: Result<T>) -> bool {
    matches!(result, Err(Error::ArrayClosed { .. }))
}

// ---------------------------------------------------------------------------------------------
// Manager::scope
// ---------------------------------------------------------------------------------------------

#[test]
fn scope_returns_the_closures_value() -> Result<()> {
    let m = Manager::new_base();
    let value = m.scope(|s| {
        let x = s.from_slice(&[1.0f32, 2.0, 3.0], [3])?;
        x.sum_all()?.to_scalar::<f32>()
    })?;
    assert_eq!(value, 6.0);
    m.close()
}

#[test]
fn scope_is_a_child_of_its_manager_and_closes_on_ok() -> Result<()> {
    let m = Manager::new_base();
    let (scope, tmp, grandchild) = m.scope(|s| {
        assert_eq!(s.parent(), Some(m.clone()));
        assert_eq!(m.children(), vec![s.clone()]);
        let g = s.new_sub_manager()?;
        Ok((s.clone(), s.ones([4], DType::F32)?, g))
    })?;
    assert!(!scope.is_open());
    assert!(
        !grandchild.is_open(),
        "managers made in the scope close with it"
    );
    assert!(!tmp.is_open());
    assert!(m.children().is_empty());
    assert!(m.is_open());
    m.close()
}

#[test]
fn scope_closes_on_err_and_returns_the_error() -> Result<()> {
    let m = Manager::new_base();
    let mut seen = None;
    let result: Result<()> = m.scope(|s| {
        let tmp = s.ones([4], DType::F32)?;
        seen = Some((s.clone(), tmp.clone()));
        tmp.to_scalar::<f32>()?; // four elements: ShapeMismatch
        Ok(())
    });
    assert!(
        matches!(result, Err(Error::ShapeMismatch { .. })),
        "{result:?}"
    );
    let (scope, tmp) = seen.unwrap();
    assert!(!scope.is_open());
    assert!(!tmp.is_open());
    assert!(m.children().is_empty());
    m.close()
}

#[test]
fn scope_closes_on_panic() -> Result<()> {
    let m = Manager::new_base();
    let outer = Manager::new_base();
    let _active = outer.activate();
    let mut seen = None;
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let _: Result<()> = m.scope(|s| {
            let tmp = s.ones([4], DType::F32)?;
            seen = Some((s.clone(), tmp));
            panic!("step failed");
        });
    }));
    assert!(caught.is_err());
    let (scope, tmp) = seen.unwrap();
    assert!(!scope.is_open());
    assert!(!tmp.is_open());
    assert!(m.children().is_empty());
    assert_eq!(
        Manager::active(),
        Some(outer.clone()),
        "the panicking scope's activation was unwound"
    );
    m.close()?;
    outer.close()
}

#[test]
fn ret_from_scope_keeps_data() -> Result<()> {
    let m = Manager::new_base();
    let kept = m.scope(|s| {
        let x = s.from_slice(&[1.0f64, 2.0], [2])?;
        let y = x.mul_scalar(10.0)?;
        s.ret(&y)
    })?;
    assert!(kept.is_open());
    assert_eq!(kept.manager()?, m);
    assert_eq!(kept.to_vec::<f64>()?, vec![10.0, 20.0]);
    m.close()?;
    assert!(!kept.is_open());
    Ok(())
}

#[test]
fn scope_is_active_while_the_closure_runs() -> Result<()> {
    let m = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([2], DType::F32)?;
    assert_eq!(Manager::active(), None);
    let result_owner = m.scope(|s| {
        assert_eq!(Manager::active(), Some(s.clone()));
        let y = x.add(&x)?; // x is owned elsewhere; the result lands in the active scope
        y.manager()
    })?;
    assert!(!result_owner.is_open());
    assert_eq!(Manager::active(), None, "deactivated afterwards");
    assert_eq!(
        data.report().arrays.len(),
        1,
        "nothing landed with the input"
    );
    m.close()?;
    data.close()
}

#[test]
fn scope_restores_the_previous_active_scope_after_an_error() -> Result<()> {
    let outer = Manager::new_base();
    let _active = outer.activate();
    let _ = outer.scope(|s| -> Result<()> {
        assert_eq!(Manager::active(), Some(s.clone()));
        Err(s.ones([2], DType::F32)?.to_scalar::<f32>().unwrap_err())
    });
    assert_eq!(Manager::active(), Some(outer.clone()));
    outer.close()
}

#[test]
fn nested_scopes_return_to_the_enclosing_scope() -> Result<()> {
    let m = Manager::new_base();
    let total = m.scope(|outer| {
        let inner_result = outer.scope(|inner| {
            assert_eq!(inner.parent(), Some(outer.clone()));
            assert_eq!(Manager::active(), Some(inner.clone()));
            let v = inner.full([3], 2.0, DType::F32)?;
            inner.ret(&v)
        })?;
        assert_eq!(inner_result.manager()?, *outer);
        assert_eq!(Manager::active(), Some(outer.clone()));
        let sum = inner_result.sum_all()?;
        outer.ret(&sum)
    })?;
    assert_eq!(total.to_scalar::<f32>()?, 6.0);
    assert_eq!(total.manager()?, m);
    assert_eq!(m.report().total_arrays(), 1);
    m.close()
}

#[test]
fn scope_on_a_closed_manager_is_manager_closed_and_does_not_run() {
    let m = Manager::new_base();
    m.close().unwrap();
    let mut ran = false;
    let result = m.scope(|_| {
        ran = true;
        Ok(())
    });
    assert!(matches!(result, Err(Error::ManagerClosed { .. })));
    assert!(!ran);
}

#[test]
fn arrays_made_in_a_scope_are_closed_with_it() -> Result<()> {
    let m = Manager::new_base();
    let leaked = m.scope(|s| {
        let a = s.ones([2], DType::F32)?;
        let b = a.add(&a)?;
        Ok(vec![a, b])
    })?;
    for a in &leaked {
        assert!(closed(a.to_vec::<f32>()));
    }
    assert_eq!(m.report().total_arrays(), 0);
    m.close()
}

// ---------------------------------------------------------------------------------------------
// sub_scope / Scope
// ---------------------------------------------------------------------------------------------

#[test]
fn sub_scope_closes_on_drop() -> Result<()> {
    let m = Manager::new_base();
    let (handle, tmp) = {
        let scope = m.sub_scope()?;
        assert_eq!(scope.parent(), Some(m.clone()));
        assert_eq!(scope.manager(), &*scope);
        (scope.manager().clone(), scope.ones([2], DType::F32)?)
    };
    assert!(!handle.is_open());
    assert!(!tmp.is_open());
    assert!(m.children().is_empty());
    m.close()
}

#[test]
fn sub_scope_close_closes_now() -> Result<()> {
    let m = Manager::new_base();
    let scope = m.sub_scope()?;
    let handle = scope.manager().clone();
    let tmp = scope.ones([2], DType::F32)?;
    let kept = scope.ret(&scope.ones([2], DType::F32)?)?;
    scope.close()?;
    assert!(!handle.is_open());
    assert!(!tmp.is_open());
    assert!(kept.is_open());
    m.close()
}

#[test]
fn sub_scope_closes_on_panic() {
    let m = Manager::new_base();
    let mut seen = None;
    let caught = catch_unwind(AssertUnwindSafe(|| {
        let scope = m.sub_scope().unwrap();
        seen = Some(scope.manager().clone());
        let _tmp = scope.ones([2], DType::F32).unwrap();
        panic!("boom");
    }));
    assert!(caught.is_err());
    assert!(!seen.unwrap().is_open());
    assert!(m.children().is_empty());
    m.close().unwrap();
}

#[test]
fn sub_scope_is_not_activated() -> Result<()> {
    let m = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([2], DType::F32)?;
    let scope = m.sub_scope()?;
    assert_eq!(Manager::active(), None);
    let y = x.add(&x)?;
    assert_eq!(y.manager()?, data, "result goes with the first input");
    {
        let _active = scope.activate();
        let z = x.add(&x)?;
        assert_eq!(z.manager()?, *scope);
    }
    drop(scope);
    assert!(y.is_open());
    m.close()?;
    data.close()
}

#[test]
fn dropping_a_scope_of_an_already_closed_manager_is_harmless() -> Result<()> {
    let m = Manager::new_base();
    let scope = m.sub_scope()?;
    m.close()?; // closes the scope's manager too
    assert!(!scope.is_open());
    drop(scope);
    let scope = Manager::new_base().sub_scope()?;
    let parent = scope.parent().unwrap();
    scope.close()?;
    parent.close()
}

/// A finished scope leaves nothing behind: after warm-up, a thousand `scope` calls (and explicit
/// `Scope::close` calls) must not leave a thousand allocations alive.
#[test]
fn finished_scopes_leave_no_allocations_behind() -> Result<()> {
    let m = Manager::new_base();
    let step = |m: &Manager| -> Result<()> {
        m.scope(|s| {
            s.ones([4], DType::F32)?;
            Ok(())
        })?;
        let scope = m.sub_scope()?;
        scope.ones([4], DType::F32)?;
        scope.close()?;
        drop(m.sub_scope()?);
        Ok(())
    };
    for _ in 0..200 {
        step(&m)?;
    }
    let before = live_allocations();
    for _ in 0..1000 {
        step(&m)?;
    }
    let grown = live_allocations() - before;
    assert!(
        grown < 100,
        "1000 steps left {grown} allocations alive on this thread"
    );
    m.close()
}

// ---------------------------------------------------------------------------------------------
// activate / Manager::active
// ---------------------------------------------------------------------------------------------

#[test]
fn no_scope_is_active_by_default() {
    assert_eq!(Manager::active(), None);
}

#[test]
fn activate_nests_and_guards_restore_the_previous_scope() -> Result<()> {
    let a = Manager::new_base();
    let b = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([1], DType::F32)?;
    {
        let _ga = a.activate();
        assert_eq!(Manager::active(), Some(a.clone()));
        assert_eq!(x.neg()?.manager()?, a);
        {
            let _gb = b.activate();
            assert_eq!(Manager::active(), Some(b.clone()));
            assert_eq!(x.neg()?.manager()?, b);
            {
                let _ga2 = a.activate();
                assert_eq!(Manager::active(), Some(a.clone()));
            }
            assert_eq!(Manager::active(), Some(b.clone()));
        }
        assert_eq!(Manager::active(), Some(a.clone()));
        assert_eq!(x.neg()?.manager()?, a);
    }
    assert_eq!(Manager::active(), None);
    assert_eq!(x.neg()?.manager()?, data);
    assert_eq!(a.report().arrays.len(), 2);
    assert_eq!(b.report().arrays.len(), 1);
    a.close()?;
    b.close()?;
    data.close()
}

#[test]
fn guards_dropped_out_of_order_remove_only_their_own_activation() -> Result<()> {
    let a = Manager::new_base();
    let b = Manager::new_base();
    let ga = a.activate();
    let gb = b.activate();
    drop(ga);
    assert_eq!(Manager::active(), Some(b.clone()));
    drop(gb);
    assert_eq!(Manager::active(), None);
    a.close()?;
    b.close()
}

#[test]
fn activation_belongs_to_its_thread() -> Result<()> {
    let a = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([1], DType::F32)?;
    let _guard = a.activate();
    let (active_there, owner_there) = std::thread::scope(|t| {
        t.spawn(|| (Manager::active(), x.neg().unwrap().manager().unwrap()))
            .join()
            .unwrap()
    });
    assert_eq!(active_there, None);
    assert_eq!(owner_there, data);
    assert_eq!(Manager::active(), Some(a.clone()));
    a.close()?;
    data.close()
}

#[test]
fn factories_ignore_the_active_scope() -> Result<()> {
    let a = Manager::new_base();
    let m = Manager::new_base();
    let _guard = a.activate();
    let x = m.zeros([2], DType::F32)?;
    assert_eq!(x.manager()?, m, "a factory creates in its own manager");
    assert!(a.report().arrays.is_empty());
    a.close()?;
    m.close()
}

#[test]
fn ops_with_a_closed_active_scope_are_manager_closed() -> Result<()> {
    let a = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([1], DType::F32)?;
    let _guard = a.activate();
    a.close()?;
    assert!(matches!(x.neg(), Err(Error::ManagerClosed { .. })));
    assert_eq!(data.report().arrays.len(), 1);
    data.close()
}
