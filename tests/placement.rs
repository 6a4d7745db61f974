//! Where op results go (DESIGN §2): the thread's active scope, else the owner of the first input
//! (the borrower while borrowed), else — first input detached — the system manager's detached
//! list. A capped destination refuses with `Capped` before allocating.

use ndscope::{DType, Error, Manager, NDArray, Result};

fn owner(a: &NDArray) -> Manager {
    a.manager().expect("array has an owner")
}

fn detached_ids() -> Vec<ndscope::ArrayId> {
    Manager::system()
        .report()
        .detached
        .iter()
        .map(|r| r.id)
        .collect()
}

#[test]
fn op_result_goes_to_the_active_scope() -> Result<()> {
    let data = Manager::new_base();
    let other = Manager::new_base();
    let scope = Manager::new_base();
    let a = data.ones([2], DType::F32)?;
    let b = other.ones([2], DType::F32)?;
    let _active = scope.activate();
    for result in [
        a.add(&b)?,
        b.add(&a)?,
        a.relu()?,
        a.sum_all()?,
        a.duplicate()?,
        a.to_dtype(DType::F64)?,
        a.mul_scalar(2.0)?,
    ] {
        assert_eq!(owner(&result), scope);
    }
    assert_eq!(data.report().arrays.len(), 1);
    assert_eq!(other.report().arrays.len(), 1);
    data.close()?;
    other.close()?;
    scope.close()
}

#[test]
fn op_result_goes_to_the_first_inputs_manager() -> Result<()> {
    let m1 = Manager::new_base();
    let m2 = Manager::new_base();
    let a = m1.ones([2, 2], DType::F32)?;
    let b = m2.ones([2, 2], DType::F32)?;
    assert_eq!(owner(&a.add(&b)?), m1);
    assert_eq!(owner(&b.add(&a)?), m2);
    assert_eq!(owner(&a.matmul(&b)?), m1);
    assert_eq!(owner(&b.matmul(&a)?), m2);
    assert_eq!(owner(&a.exp()?), m1);
    assert_eq!(m1.report().arrays.len(), 4);
    assert_eq!(m2.report().arrays.len(), 3);
    m1.close()?;
    m2.close()
}

#[test]
fn op_result_goes_to_the_borrower_of_a_borrowed_first_input() -> Result<()> {
    let lender = Manager::new_base();
    let borrower = Manager::new_base();
    let a = lender.ones([2], DType::F32)?;
    a.temp_attach(&borrower)?;
    let y = a.add(&a)?;
    assert_eq!(owner(&y), borrower);
    assert!(
        borrower.report().borrowed.iter().all(|r| r.id == a.id()),
        "the result is owned, not borrowed"
    );
    assert_eq!(borrower.report().arrays.len(), 1);
    borrower.close()?;
    assert!(!y.is_open(), "the result dies with the borrower");
    assert!(a.is_open(), "the input went back");
    lender.close()
}

#[test]
fn op_result_of_a_detached_first_input_is_listed_as_detached_under_the_system_manager() -> Result<()>
{
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    let b = m.ones([2], DType::F32)?;
    a.detach()?;
    let y = a.add(&b)?;
    assert!(y.is_detached());
    assert!(matches!(y.manager(), Err(Error::InvalidArgument { .. })));
    let listed = detached_ids();
    assert!(listed.contains(&y.id()), "the result cannot hide");
    assert!(listed.contains(&a.id()));
    assert!(!m.report().arrays.iter().any(|r| r.id == y.id()));
    // The second input's manager does not matter.
    let z = b.add(&a)?;
    assert_eq!(owner(&z), m);
    y.close()?;
    a.close()?;
    assert!(!detached_ids().contains(&y.id()));
    m.close()
}

#[test]
fn active_scope_wins_over_a_detached_first_input() -> Result<()> {
    let m = Manager::new_base();
    let scope = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    a.detach()?;
    let y = {
        let _active = scope.activate();
        a.neg()?
    };
    assert_eq!(owner(&y), scope);
    a.close()?;
    m.close()?;
    scope.close()
}

#[test]
fn to_device_keeps_the_owner_rule() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    let b = a.to_device(ndscope::Device::Cpu)?;
    assert_eq!(owner(&b), m);
    assert_eq!(b.device(), ndscope::Device::Cpu);
    assert!(matches!(
        a.to_device(ndscope::Device::Cuda(ndscope::Device::cuda_count())),
        Err(Error::DeviceUnavailable { .. })
    ));
    assert_eq!(m.report().arrays.len(), 2);
    m.close()
}

#[test]
fn ops_create_no_implicit_sub_managers() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([3, 3], DType::F32)?;
    for _ in 0..10 {
        a.matmul(&a)?.relu()?.sum_all()?;
    }
    assert!(m.children().is_empty());
    assert_eq!(m.report().arrays.len(), 31);
    m.close()
}

#[test]
fn capped_destination_refuses_before_allocating() -> Result<()> {
    // First input's manager capped.
    let model = Manager::new_base().with_name("model");
    let w = model.ones([8, 8], DType::F32)?;
    model.cap();
    assert!(matches!(w.matmul(&w), Err(Error::Capped { .. })));
    assert_eq!(model.report().arrays.len(), 1);
    assert!(model.children().is_empty());

    // Active scope capped, even when the input's own manager is open.
    let data = Manager::new_base();
    let x = data.ones([8], DType::F32)?;
    let sink = Manager::new_base();
    sink.cap();
    {
        let _active = sink.activate();
        assert!(matches!(x.sqrt(), Err(Error::Capped { .. })));
    }
    assert!(sink.report().arrays.is_empty());
    assert_eq!(data.report().arrays.len(), 1);

    // Borrower capped.
    x.temp_attach(&sink)?;
    assert!(matches!(x.add(&x), Err(Error::Capped { .. })));
    assert!(sink.report().arrays.is_empty());
    model.close()?;
    sink.close()?;
    data.close()
}

#[test]
fn failed_op_leaves_no_result_behind() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2, 3], DType::F32)?;
    let b = m.ones([4], DType::F32)?;
    let c = m.ones([2], DType::F64)?;
    assert!(matches!(a.add(&b), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(a.matmul(&a), Err(Error::ShapeMismatch { .. })));
    assert!(matches!(b.add(&c), Err(Error::DTypeMismatch { .. })));
    let ints = m.from_slice(&[1i32, 2], [2])?;
    let zeros = m.zeros([2], DType::I32)?;
    assert!(matches!(
        ints.div(&zeros),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(m.report().arrays.len(), 5, "only the inputs");
    m.close()
}
