//! Per-array ownership calls (DESIGN §2, second table): `manager`, `attach`, `temp_attach`,
//! `detach`, `close`, `ret`, the `_all` forms and `NDList`. Every call checks everything before
//! it moves anything.

use ndscope::{DType, Error, Manager, NDArray, NDList, Result};

fn owner(a: &NDArray) -> Manager {
    a.manager().expect("array has an owner")
}

fn closed<T: std::fmt::Debug>(result: Result<T>) -> bool {
    matches!(result, Err(Error::ArrayClosed { .. }))
}

/// Three sibling managers under one base.
fn three() -> (Manager, Manager, Manager, Manager) {
    let base = Manager::new_base();
    let a = base.new_sub_manager().unwrap().with_name("A");
    let b = base.new_sub_manager().unwrap().with_name("B");
    let c = base.new_sub_manager().unwrap().with_name("C");
    (base, a, b, c)
}

// ---------------------------------------------------------------------------------------------
// manager()
// ---------------------------------------------------------------------------------------------

#[test]
fn manager_is_the_creating_manager() -> Result<()> {
    let m = Manager::new_base();
    let a = m.zeros([2], DType::F32)?;
    assert_eq!(a.manager()?, m);
    assert!(!a.is_detached());
    m.close()
}

#[test]
fn manager_of_a_borrowed_array_is_the_borrower() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    assert_eq!(x.manager()?, b_mgr);
    base.close()
}

#[test]
fn manager_of_a_detached_array_is_invalid_argument() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    a.detach()?;
    assert!(a.is_detached());
    assert!(matches!(a.manager(), Err(Error::InvalidArgument { .. })));
    a.close()?;
    m.close()
}

#[test]
fn manager_of_a_closed_array_is_array_closed() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    a.close()?;
    assert!(closed(a.manager()));
    assert!(!a.is_detached());
    m.close()
}

// ---------------------------------------------------------------------------------------------
// attach
// ---------------------------------------------------------------------------------------------

#[test]
fn attach_moves_for_good() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.from_slice(&[1.0f32, 2.0], [2])?;
    x.attach(&b_mgr)?;
    assert_eq!(owner(&x), b_mgr);
    a_mgr.close()?;
    assert_eq!(
        x.to_vec::<f32>()?,
        vec![1.0, 2.0],
        "survives its old manager"
    );
    b_mgr.close()?;
    assert!(!x.is_open());
    base.close()
}

#[test]
fn attach_to_the_current_owner_changes_nothing() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([2], DType::F32)?;
    x.attach(&m)?;
    assert_eq!(owner(&x), m);
    assert_eq!(m.report().arrays.len(), 1);
    m.close()
}

#[test]
fn attach_to_a_closed_manager_is_manager_closed_and_moves_nothing() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    b_mgr.close()?;
    assert!(matches!(x.attach(&b_mgr), Err(Error::ManagerClosed { .. })));
    assert_eq!(owner(&x), a_mgr);
    assert!(x.is_open());
    base.close()
}

#[test]
fn failed_attach_to_capped_manager_moves_nothing() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    b_mgr.cap();
    assert!(matches!(x.attach(&b_mgr), Err(Error::Capped { .. })));
    assert_eq!(owner(&x), a_mgr, "DJL would have orphaned it here");
    assert_eq!(a_mgr.report().arrays.len(), 1);
    assert_eq!(b_mgr.report().arrays.len(), 0);
    base.close()
}

#[test]
fn attach_of_a_closed_array_is_array_closed() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.close()?;
    assert!(closed(x.attach(&b_mgr)));
    assert_eq!(b_mgr.report().arrays.len(), 0);
    base.close()
}

#[test]
fn attaching_to_the_current_borrower_keeps_it_borrowed() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.attach(&b_mgr)?;
    assert_eq!(owner(&x), b_mgr);
    assert_eq!(b_mgr.report().borrowed.len(), 1, "still borrowed");
    b_mgr.close()?;
    assert!(x.is_open(), "it went back");
    assert_eq!(owner(&x), a_mgr);
    base.close()
}

#[test]
fn attach_cancels_a_pending_return() -> Result<()> {
    let (base, a_mgr, b_mgr, c_mgr) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.attach(&c_mgr)?;
    assert_eq!(owner(&x), c_mgr);
    assert!(c_mgr.report().borrowed.is_empty(), "owned, not borrowed");
    b_mgr.close()?;
    assert_eq!(owner(&x), c_mgr, "B's close does not touch it");
    a_mgr.close()?;
    assert!(x.is_open(), "A no longer has a claim on it");
    c_mgr.close()?;
    assert!(!x.is_open());
    base.close()
}

#[test]
fn attach_back_to_the_lender_ends_the_borrow() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.attach(&a_mgr)?;
    assert_eq!(owner(&x), a_mgr);
    assert!(a_mgr.report().borrowed.is_empty());
    assert_eq!(a_mgr.report().arrays.len(), 1);
    b_mgr.close()?;
    assert!(x.is_open());
    assert_eq!(owner(&x), a_mgr);
    base.close()
}

#[test]
fn attach_of_a_detached_array_adopts_it() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.detach()?;
    x.attach(&b_mgr)?;
    assert!(!x.is_detached());
    assert_eq!(owner(&x), b_mgr);
    b_mgr.close()?;
    assert!(!x.is_open());
    base.close()
}

// ---------------------------------------------------------------------------------------------
// temp_attach (borrowing)
// ---------------------------------------------------------------------------------------------

#[test]
fn borrowed_array_returns_when_the_borrower_closes() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.from_slice(&[1.0f32, 2.0, 3.0], [3])?;
    x.temp_attach(&b_mgr)?;
    assert_eq!(owner(&x), b_mgr);
    assert_eq!(a_mgr.report().arrays.len(), 0);
    let borrowed = b_mgr.report().borrowed;
    assert_eq!(borrowed.len(), 1);
    assert_eq!(borrowed[0].lent_by, Some(a_mgr.id()));
    b_mgr.close()?;
    assert_eq!(owner(&x), a_mgr);
    assert_eq!(x.to_vec::<f32>()?, vec![1.0, 2.0, 3.0], "data intact");
    assert_eq!(a_mgr.report().arrays.len(), 1);
    assert!(a_mgr.report().borrowed.is_empty());
    base.close()
}

#[test]
fn borrow_chain_unwinds_in_reverse() -> Result<()> {
    let (base, a_mgr, b_mgr, c_mgr) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.temp_attach(&c_mgr)?;
    assert_eq!(owner(&x), c_mgr);
    assert_eq!(c_mgr.report().borrowed[0].lent_by, Some(b_mgr.id()));
    c_mgr.close()?;
    assert_eq!(owner(&x), b_mgr, "C gives it back to B");
    assert_eq!(b_mgr.report().borrowed.len(), 1, "B still only borrows it");
    assert_eq!(b_mgr.report().borrowed[0].lent_by, Some(a_mgr.id()));
    b_mgr.close()?;
    assert_eq!(owner(&x), a_mgr, "B gives it back to A");
    assert_eq!(a_mgr.report().arrays.len(), 1);
    a_mgr.close()?;
    assert!(!x.is_open());
    base.close()
}

#[test]
fn borrow_chain_with_middle_closed_first_closes_the_array_when_the_last_borrower_closes(
) -> Result<()> {
    let (base, a_mgr, b_mgr, c_mgr) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.temp_attach(&c_mgr)?;
    b_mgr.close()?;
    assert!(x.is_open(), "C still holds it");
    assert_eq!(owner(&x), c_mgr);
    c_mgr.close()?;
    assert!(!x.is_open(), "B, the manager to return it to, is closed");
    assert_eq!(a_mgr.report().arrays.len(), 0, "it does not skip back to A");
    let text = x.to_vec::<f32>().unwrap_err().to_string();
    assert!(text.contains("'B'") && text.contains("'C'"), "{text}");
    base.close()
}

#[test]
fn borrowed_array_is_closed_when_its_lender_closed_first() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    a_mgr.close()?;
    assert!(x.is_open(), "B holds it until B closes");
    assert_eq!(x.to_vec::<f32>()?, vec![1.0, 1.0]);
    b_mgr.close()?;
    assert!(!x.is_open());
    base.close()
}

#[test]
fn borrowing_into_a_child_returns_before_the_parent_frees() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    let x = parent.ones([2], DType::F32)?;
    x.temp_attach(&child)?;
    child.close()?;
    assert_eq!(owner(&x), parent);
    assert!(x.is_open());
    parent.close()?;
    assert!(!x.is_open());
    Ok(())
}

#[test]
fn temp_attach_to_the_manager_that_holds_it_is_a_no_op() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&a_mgr)?;
    assert_eq!(owner(&x), a_mgr);
    assert!(
        a_mgr.report().borrowed.is_empty(),
        "not borrowed from itself"
    );
    // Same while borrowed: B borrowing again does not stack a second return to B.
    x.temp_attach(&b_mgr)?;
    x.temp_attach(&b_mgr)?;
    b_mgr.close()?;
    assert_eq!(owner(&x), a_mgr);
    assert!(a_mgr.report().borrowed.is_empty());
    base.close()
}

#[test]
fn temp_attach_into_a_closed_manager_is_manager_closed() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    b_mgr.close()?;
    assert!(matches!(
        x.temp_attach(&b_mgr),
        Err(Error::ManagerClosed { .. })
    ));
    assert_eq!(owner(&x), a_mgr);
    base.close()
}

#[test]
fn temp_attach_of_a_closed_array_is_array_closed() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.close()?;
    assert!(closed(x.temp_attach(&b_mgr)));
    assert!(b_mgr.report().borrowed.is_empty());
    base.close()
}

#[test]
fn detach_cancels_a_pending_return() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.detach()?;
    assert!(x.is_detached());
    b_mgr.close()?;
    assert!(x.is_open());
    assert!(x.is_detached(), "not given back to A");
    a_mgr.close()?;
    assert!(x.is_open(), "A no longer has a claim on it");
    x.close()?;
    base.close()
}

#[test]
fn close_cancels_a_pending_return() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&b_mgr)?;
    x.close()?;
    assert!(b_mgr.report().borrowed.is_empty());
    b_mgr.close()?;
    assert!(!x.is_open());
    assert_eq!(a_mgr.report().arrays.len(), 0, "nothing came back to A");
    base.close()
}

#[test]
fn borrowed_detached_array_goes_back_to_being_detached() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2], DType::F32)?;
    x.detach()?;
    x.temp_attach(&b_mgr)?;
    assert_eq!(owner(&x), b_mgr);
    assert!(!x.is_detached());
    assert_eq!(b_mgr.report().borrowed[0].lent_by, None);
    b_mgr.close()?;
    assert!(x.is_open());
    assert!(x.is_detached());
    x.close()?;
    base.close()
}

// ---------------------------------------------------------------------------------------------
// detach and close
// ---------------------------------------------------------------------------------------------

#[test]
fn detached_array_survives_its_manager_and_is_closed_by_the_caller() -> Result<()> {
    let m = Manager::new_base();
    let x = m.from_slice(&[4i32, 5], [2])?;
    x.detach()?;
    assert!(m.report().arrays.is_empty());
    m.close()?;
    assert!(x.is_open());
    assert_eq!(x.to_vec::<i32>()?, vec![4, 5]);
    x.close()?;
    assert!(!x.is_open());
    assert!(!x.is_detached());
    Ok(())
}

#[test]
fn detach_twice_is_harmless() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([1], DType::F32)?;
    x.detach()?;
    x.detach()?;
    assert!(x.is_detached());
    x.close()?;
    m.close()
}

#[test]
fn detach_of_a_closed_array_is_array_closed() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([1], DType::F32)?;
    x.close()?;
    assert!(closed(x.detach()));
    m.close()
}

#[test]
fn close_frees_now_and_is_idempotent() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([4], DType::F32)?;
    let y = m.ones([4], DType::F32)?;
    x.close()?;
    assert!(!x.is_open());
    assert_eq!(m.report().arrays.len(), 1, "only y is left");
    x.close()?;
    x.close()?;
    assert!(y.is_open());
    m.close()
}

#[test]
fn stale_handles_give_array_closed() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([2, 2], DType::F32)?;
    let other = a_mgr.ones([2, 2], DType::F32)?;
    let copy = x.clone();
    x.close()?;
    // Every handle, every use.
    assert!(closed(copy.to_vec::<f32>()));
    assert!(closed(copy.add(&other)));
    assert!(closed(other.add(&copy)));
    assert!(closed(copy.sum_all()));
    assert!(closed(copy.duplicate()));
    assert!(closed(copy.add_(&other)));
    assert!(closed(other.add_(&copy)));
    assert!(closed(copy.manager()));
    assert!(closed(copy.attach(&b_mgr)));
    assert!(closed(copy.temp_attach(&b_mgr)));
    assert!(closed(copy.detach()));
    assert!(closed(a_mgr.ret(&copy)));
    let one = a_mgr.scalar(1.0f32)?;
    one.close()?;
    assert!(closed(one.to_scalar::<f32>()));
    // Metadata is cached in the handle and still answers.
    assert_eq!(copy.dims(), &[2, 2]);
    assert_eq!(copy.dtype(), DType::F32);
    assert_eq!(copy.nbytes(), 16);
    // No op result leaked into the manager from the refused calls.
    assert_eq!(a_mgr.report().arrays.len(), 1);
    base.close()
}

#[test]
fn arrays_of_a_closed_manager_give_array_closed() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([2], DType::F32)?;
    let other = Manager::new_base();
    let y = other.ones([2], DType::F32)?;
    m.close()?;
    assert!(closed(x.to_vec::<f32>()));
    assert!(closed(y.add(&x)));
    assert!(closed(x.attach(&other)));
    assert_eq!(other.report().arrays.len(), 1);
    other.close()
}

// ---------------------------------------------------------------------------------------------
// ret
// ---------------------------------------------------------------------------------------------

#[test]
fn ret_attaches_to_the_parent_and_returns_the_same_handle() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    let x = child.from_slice(&[1.0f64, 2.0], [2])?;
    let kept = child.ret(&x)?;
    assert_eq!(kept, x);
    assert_eq!(owner(&x), parent);
    child.close()?;
    assert_eq!(x.to_vec::<f64>()?, vec![1.0, 2.0]);
    parent.close()?;
    assert!(!x.is_open());
    Ok(())
}

#[test]
fn ret_goes_to_the_managers_parent_not_the_arrays_origin() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let child = b_mgr.new_sub_manager()?;
    let x = a_mgr.ones([2], DType::F32)?;
    child.ret(&x)?;
    assert_eq!(owner(&x), b_mgr);
    base.close()
}

#[test]
fn ret_on_a_base_manager_goes_to_the_system_manager() -> Result<()> {
    let base = Manager::new_base();
    let x = base.ones([2], DType::F32)?;
    base.ret(&x)?;
    assert_eq!(owner(&x), Manager::system());
    assert!(Manager::system()
        .report()
        .arrays
        .iter()
        .any(|r| r.id == x.id()));
    base.close()?;
    assert!(x.is_open(), "survives its base manager");
    x.close()?;
    Ok(())
}

#[test]
fn ret_cancels_a_pending_return() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let scope = b_mgr.new_sub_manager()?;
    let x = a_mgr.ones([2], DType::F32)?;
    x.temp_attach(&scope)?;
    scope.ret(&x)?;
    assert_eq!(owner(&x), b_mgr);
    assert!(b_mgr.report().borrowed.is_empty());
    scope.close()?;
    a_mgr.close()?;
    assert!(x.is_open());
    assert_eq!(owner(&x), b_mgr);
    base.close()
}

#[test]
fn ret_from_a_closed_manager_is_manager_closed() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    let x = parent.ones([1], DType::F32)?;
    child.close()?;
    assert!(matches!(child.ret(&x), Err(Error::ManagerClosed { .. })));
    parent.close()
}

#[test]
fn returns_bypass_the_lenders_cap() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.from_slice(&[7.0f32], [1])?;
    a_mgr.cap();
    x.temp_attach(&b_mgr)?;
    b_mgr.close()?;
    assert_eq!(owner(&x), a_mgr);
    assert_eq!(x.to_vec::<f32>()?, vec![7.0]);
    base.close()
}

// ---------------------------------------------------------------------------------------------
// attach_all / temp_attach_all / NDList: all or nothing
// ---------------------------------------------------------------------------------------------

#[test]
fn attach_all_moves_every_array() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let xs = vec![a_mgr.ones([1], DType::F32)?, a_mgr.ones([2], DType::F64)?];
    b_mgr.attach_all(&xs)?;
    assert!(xs.iter().all(|x| owner(x) == b_mgr));
    assert_eq!(b_mgr.report().arrays.len(), 2);
    base.close()
}

#[test]
fn attach_all_with_one_closed_array_moves_none() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let xs = vec![
        a_mgr.ones([1], DType::F32)?,
        a_mgr.ones([1], DType::F32)?,
        a_mgr.ones([1], DType::F32)?,
    ];
    xs[2].close()?;
    assert!(closed(b_mgr.attach_all(&xs)));
    assert_eq!(owner(&xs[0]), a_mgr);
    assert_eq!(owner(&xs[1]), a_mgr);
    assert!(b_mgr.report().arrays.is_empty());
    base.close()
}

#[test]
fn attach_all_to_a_capped_manager_moves_none() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let already = b_mgr.ones([1], DType::F32)?;
    let x = a_mgr.ones([1], DType::F32)?;
    b_mgr.cap();
    // The first is already there (no-op), the second is refused: nothing moves.
    assert!(matches!(
        b_mgr.attach_all(&[already.clone(), x.clone()]),
        Err(Error::Capped { .. })
    ));
    assert_eq!(owner(&x), a_mgr);
    assert_eq!(owner(&already), b_mgr);
    base.close()
}

#[test]
fn attach_all_with_a_repeated_array_moves_it_once() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([1], DType::F32)?;
    b_mgr.attach_all(&[x.clone(), x.clone()])?;
    assert_eq!(b_mgr.report().arrays.len(), 1);
    base.close()
}

#[test]
fn temp_attach_all_borrows_every_array_and_returns_them() -> Result<()> {
    let (base, a_mgr, b_mgr, c_mgr) = three();
    let x = a_mgr.ones([1], DType::F32)?;
    let y = c_mgr.ones([1], DType::F32)?;
    b_mgr.temp_attach_all(&[x.clone(), y.clone()])?;
    assert_eq!(b_mgr.report().borrowed.len(), 2);
    b_mgr.close()?;
    assert_eq!(owner(&x), a_mgr);
    assert_eq!(owner(&y), c_mgr);
    base.close()
}

#[test]
fn temp_attach_all_with_one_closed_array_moves_none() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let x = a_mgr.ones([1], DType::F32)?;
    let y = a_mgr.ones([1], DType::F32)?;
    y.close()?;
    assert!(closed(b_mgr.temp_attach_all(&[x.clone(), y])));
    assert_eq!(owner(&x), a_mgr);
    assert!(b_mgr.report().borrowed.is_empty());
    base.close()
}

#[test]
fn ndlist_attach_moves_every_array() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let list: NDList = vec![a_mgr.zeros([2], DType::F32)?, a_mgr.ones([3], DType::I32)?].into();
    list.attach(&b_mgr)?;
    a_mgr.close()?;
    assert!(list.iter().all(|a| a.is_open() && owner(a) == b_mgr));
    base.close()
}

#[test]
fn ndlist_attach_with_one_closed_array_moves_none() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let list: NDList = (0..3)
        .map(|_| a_mgr.zeros([2], DType::F32).unwrap())
        .collect();
    list.get(1).unwrap().close()?;
    assert!(closed(list.attach(&b_mgr)));
    assert_eq!(owner(list.get(0).unwrap()), a_mgr);
    assert_eq!(owner(list.get(2).unwrap()), a_mgr);
    base.close()
}

#[test]
fn ndlist_temp_attach_returns_every_array() -> Result<()> {
    let (base, a_mgr, b_mgr, _) = three();
    let list: NDList = vec![a_mgr.zeros([2], DType::F32)?, a_mgr.ones([3], DType::F32)?].into();
    list.temp_attach(&b_mgr)?;
    assert!(list.iter().all(|a| owner(a) == b_mgr));
    b_mgr.close()?;
    assert!(list.iter().all(|a| owner(a) == a_mgr));
    base.close()
}

#[test]
fn ndlist_detach_and_close() -> Result<()> {
    let m = Manager::new_base();
    let list: NDList = vec![m.zeros([2], DType::F32)?, m.ones([3], DType::F32)?].into();
    list.detach()?;
    assert!(list.iter().all(NDArray::is_detached));
    m.close()?;
    assert!(list.iter().all(NDArray::is_open));
    list.close()?;
    assert!(list.iter().all(|a| !a.is_open()));
    list.close()?; // idempotent
    Ok(())
}

#[test]
fn ndlist_detach_with_one_closed_array_detaches_none() -> Result<()> {
    let m = Manager::new_base();
    let list: NDList = vec![m.zeros([2], DType::F32)?, m.ones([3], DType::F32)?].into();
    list.get(1).unwrap().close()?;
    assert!(closed(list.detach()));
    assert!(!list.get(0).unwrap().is_detached());
    assert_eq!(owner(list.get(0).unwrap()), m);
    m.close()
}

#[test]
fn ret_list_returns_every_array_or_none() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    let list: NDList = vec![child.zeros([2], DType::F32)?, child.ones([3], DType::F32)?].into();
    let kept = child.ret_list(&list)?;
    assert_eq!(kept, list);
    assert!(list.iter().all(|a| owner(a) == parent));

    let bad: NDList = vec![child.zeros([1], DType::F32)?, child.ones([1], DType::F32)?].into();
    bad.get(0).unwrap().close()?;
    assert!(closed(child.ret_list(&bad)));
    assert_eq!(owner(bad.get(1).unwrap()), child);

    let good: NDList = vec![child.zeros([1], DType::F32)?].into();
    parent.cap();
    assert!(matches!(child.ret_list(&good), Err(Error::Capped { .. })));
    assert_eq!(owner(good.get(0).unwrap()), child);
    parent.close()
}

#[test]
fn closing_a_subtree_returns_borrowed_arrays_to_the_nearest_lender_outside_it() {
    // A lends to S1, S1 lends on to S2; S1 and S2 are children of P. Closing P closes both
    // borrowers in one call: the array goes back to A whichever sibling was created first.
    for s1_first in [true, false] {
        let a = Manager::new_base().with_name("A");
        let p = Manager::new_base().with_name("P");
        let (s1, s2) = if s1_first {
            let s1 = p.new_sub_manager().unwrap();
            (s1, p.new_sub_manager().unwrap())
        } else {
            let s2 = p.new_sub_manager().unwrap();
            (p.new_sub_manager().unwrap(), s2)
        };
        let x = a.ones([3], DType::F32).unwrap();
        x.temp_attach(&s1).unwrap();
        x.temp_attach(&s2).unwrap();
        p.close().unwrap();
        assert!(x.is_open(), "s1 created first: {s1_first}");
        assert_eq!(x.manager().unwrap(), a, "s1 created first: {s1_first}");
        assert_eq!(a.report().arrays.len(), 1);
        a.close().unwrap();
    }
}

#[test]
fn closing_a_subtree_closes_arrays_borrowed_within_it() {
    // Owned by S1, borrowed by its sibling S2: no lender outside P, so closing P frees it.
    for s1_first in [true, false] {
        let p = Manager::new_base();
        let (s1, s2) = if s1_first {
            let s1 = p.new_sub_manager().unwrap();
            (s1, p.new_sub_manager().unwrap())
        } else {
            let s2 = p.new_sub_manager().unwrap();
            (p.new_sub_manager().unwrap(), s2)
        };
        let x = s1.ones([3], DType::F32).unwrap();
        x.temp_attach(&s2).unwrap();
        p.close().unwrap();
        assert!(!x.is_open(), "s1 created first: {s1_first}");
    }
}
