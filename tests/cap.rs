//! `Manager::cap` (DESIGN §2): what a capped manager refuses — factories, `attach`, `ret` into it
//! and op results landing in it, all with `Capped` and nothing allocated — and what it still
//! allows.
//!
//! "Nothing allocated" is checked on the manager's own report: the process-wide counters of
//! `memory_usage` are shared with the other tests of this binary, which run in parallel.

use ndscope::{manual_seed, DType, Error, Manager, Result};

fn capped<T: std::fmt::Debug>(result: Result<T>) -> bool {
    matches!(result, Err(Error::Capped { .. }))
}

fn owned(m: &Manager) -> usize {
    m.report().arrays.len()
}

// ---------------------------------------------------------------------------------------------
// Refused
// ---------------------------------------------------------------------------------------------

#[test]
fn capped_manager_rejects_every_factory() -> Result<()> {
    let m = Manager::new_base();
    m.ones([1], DType::F32)?;
    m.cap();
    assert!(capped(m.zeros([2, 2], DType::F32)));
    assert!(capped(m.ones([2, 2], DType::F64)));
    assert!(capped(m.full([2], 3.0, DType::I32)));
    assert!(capped(m.from_slice(&[1.0f32, 2.0], [2])));
    assert!(capped(m.from_vec(vec![1i64, 2, 3], [3])));
    assert!(capped(m.scalar(1u8)));
    assert!(capped(m.arange(0.0, 4.0, 1.0, DType::F32)));
    assert!(capped(m.eye(3, DType::F32)));
    assert!(capped(m.randn([4], DType::F32)));
    assert!(capped(m.rand([4], 0.0, 1.0, DType::F32)));
    // Zero-sized arrays are new arrays too.
    assert!(capped(m.zeros([0], DType::F32)));
    assert_eq!(owned(&m), 1, "nothing was created");
    assert_eq!(m.report().total_bytes(), 4);
    m.close()
}

#[test]
fn capped_manager_rejects_attach() -> Result<()> {
    let m = Manager::new_base();
    let other = Manager::new_base();
    let x = other.ones([3], DType::F32)?;
    m.cap();
    assert!(capped(x.attach(&m)));
    assert_eq!(x.manager()?, other);
    assert_eq!(owned(&m), 0);
    m.close()?;
    other.close()
}

#[test]
fn capped_manager_rejects_ret_into_it() -> Result<()> {
    let model = Manager::new_base().with_name("model");
    let batch = model.new_sub_manager()?;
    let y = batch.ones([2], DType::F32)?;
    model.cap();
    assert!(capped(batch.ret(&y)));
    assert_eq!(y.manager()?, batch, "ret refused: y stays in the batch");
    assert_eq!(owned(&model), 0);
    // The same through `scope`: the closure's error comes out and the scope still closes.
    let result = model.scope(|s| {
        let z = s.ones([2], DType::F32)?;
        s.ret(&z)
    });
    assert!(capped(result));
    assert!(model.children().iter().all(|c| c == &batch));
    model.close()
}

#[test]
fn capped_manager_rejects_op_result() -> Result<()> {
    let model = Manager::new_base().with_name("model");
    let w = model.ones([4, 4], DType::F32)?;
    model.cap();
    assert!(capped(w.add(&w)));
    assert!(capped(w.relu()));
    assert!(capped(w.mul_scalar(2.0)));
    assert!(capped(w.matmul(&w)));
    assert!(capped(w.sum_all()));
    assert!(capped(w.duplicate()));
    assert!(capped(w.to_dtype(DType::F64)));
    assert_eq!(owned(&model), 1, "only w: no result was allocated");
    model.close()
}

#[test]
fn capped_manager_rejects_op_result_when_it_owns_the_first_input_only() -> Result<()> {
    let model = Manager::new_base();
    let data = Manager::new_base();
    let w = model.ones([4], DType::F32)?;
    let x = data.ones([4], DType::F32)?;
    model.cap();
    assert!(capped(w.add(&x)), "first input in the capped manager");
    let y = x.add(&w)?;
    assert_eq!(y.manager()?, data, "first input elsewhere: fine");
    assert_eq!(owned(&model), 1);
    model.close()?;
    data.close()
}

#[test]
fn capped_borrower_rejects_op_results_of_borrowed_arrays() -> Result<()> {
    let lender = Manager::new_base();
    let borrower = Manager::new_base();
    let x = lender.ones([4], DType::F32)?;
    x.temp_attach(&borrower)?;
    borrower.cap();
    assert!(capped(x.add(&x)), "the result would land in the borrower");
    assert!(borrower.report().arrays.is_empty());
    assert_eq!(borrower.report().borrowed.len(), 1);
    lender.close()?;
    borrower.close()
}

#[test]
fn capped_active_scope_rejects_op_result() -> Result<()> {
    let scope = Manager::new_base();
    let data = Manager::new_base();
    let x = data.ones([4], DType::F32)?;
    scope.cap();
    {
        let _active = scope.activate();
        assert!(capped(x.add(&x)));
    }
    assert_eq!(owned(&scope), 0);
    assert_eq!(owned(&data), 1);
    scope.close()?;
    data.close()
}

/// A refused factory changes nothing, not even the random stream: after `manual_seed`, the draws
/// are the same whether or not a capped manager refused a `randn` in between. This is the only
/// test of this binary that draws random numbers.
#[test]
fn refused_random_factory_does_not_consume_the_random_stream() -> Result<()> {
    let open = Manager::new_base();
    let closed_cap = Manager::new_base();
    closed_cap.cap();
    manual_seed(7);
    let first = open.randn([8], DType::F32)?.to_vec::<f32>()?;
    let second = open.rand([8], 0.0, 1.0, DType::F32)?.to_vec::<f32>()?;

    manual_seed(7);
    assert!(capped(closed_cap.randn([1000], DType::F32)));
    let first_again = open.randn([8], DType::F32)?.to_vec::<f32>()?;
    assert!(capped(closed_cap.rand([1000], 0.0, 1.0, DType::F32)));
    let second_again = open.rand([8], 0.0, 1.0, DType::F32)?.to_vec::<f32>()?;

    assert_eq!(first, first_again);
    assert_eq!(second, second_again);
    open.close()?;
    closed_cap.close()
}

// ---------------------------------------------------------------------------------------------
// Still allowed
// ---------------------------------------------------------------------------------------------

#[test]
fn capped_manager_can_be_closed() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([2], DType::F32)?;
    m.cap();
    m.close()?;
    assert!(!m.is_open());
    assert!(!x.is_open());
    Ok(())
}

#[test]
fn capped_manager_can_create_sub_managers() -> Result<()> {
    let model = Manager::new_base();
    model.cap();
    let trainer = model.new_sub_manager()?;
    let scope = model.sub_scope()?;
    assert!(!trainer.is_capped());
    let t = trainer.ones([2], DType::F32)?;
    let s = scope.ones([2], DType::F32)?;
    assert_eq!(t.manager()?, trainer);
    assert_eq!(s.manager()?, *scope);
    drop(scope);
    model.close()
}

#[test]
fn capped_manager_can_borrow_arrays() -> Result<()> {
    let capped_mgr = Manager::new_base();
    let other = Manager::new_base();
    let x = other.from_slice(&[1.0f32, 2.0], [2])?;
    capped_mgr.cap();
    x.temp_attach(&capped_mgr)?;
    assert_eq!(x.manager()?, capped_mgr);
    capped_mgr.temp_attach_all(&[other.ones([1], DType::F32)?])?;
    assert_eq!(capped_mgr.report().borrowed.len(), 2);
    capped_mgr.close()?;
    assert_eq!(x.manager()?, other);
    assert_eq!(x.to_vec::<f32>()?, vec![1.0, 2.0]);
    other.close()
}

#[test]
fn capped_manager_can_lend_arrays() -> Result<()> {
    let model = Manager::new_base();
    let w = model.ones([2], DType::F32)?;
    model.cap();
    let batch = model.new_sub_manager()?;
    w.temp_attach(&batch)?;
    assert_eq!(w.manager()?, batch);
    let y = w.add(&w)?; // lands in the borrower, which is not capped
    assert_eq!(y.manager()?, batch);
    batch.close()?;
    assert_eq!(w.manager()?, model, "returned past the cap");
    assert!(!y.is_open());
    assert_eq!(owned(&model), 1);
    model.close()
}

#[test]
fn arrays_borrowed_from_a_capped_manager_return_to_it() -> Result<()> {
    let model = Manager::new_base();
    let params: Vec<_> = (0..3)
        .map(|_| model.ones([2], DType::F32).unwrap())
        .collect();
    model.cap();
    let other = Manager::new_base();
    other.temp_attach_all(&params)?;
    assert_eq!(owned(&model), 0);
    other.close()?;
    assert_eq!(owned(&model), 3);
    assert!(params.iter().all(|p| p.is_open()));
    model.close()
}

#[test]
fn capped_manager_lets_arrays_leave_for_good() -> Result<()> {
    let model = Manager::new_base();
    let other = Manager::new_base();
    let w = model.ones([2], DType::F32)?;
    model.cap();
    w.attach(&other)?;
    assert_eq!(w.manager()?, other);
    assert_eq!(owned(&model), 0);
    model.close()?;
    assert!(w.is_open());
    other.close()
}

#[test]
fn capped_manager_accepts_attach_of_an_array_it_already_holds() -> Result<()> {
    let m = Manager::new_base();
    let w = m.ones([2], DType::F32)?;
    m.cap();
    w.attach(&m)?;
    assert_eq!(owned(&m), 1);
    m.close()
}

#[test]
fn in_place_updates_of_capped_parameters_are_allowed() -> Result<()> {
    let model = Manager::new_base();
    let w = model.from_slice(&[1.0f32, 2.0], [2])?;
    model.cap();
    let grad = model.scope(|s| {
        let g = s.from_slice(&[0.5f32, 0.5], [2])?;
        w.sub_(&g)?; // allocates nothing
        w.mul_scalar_(2.0)?;
        Ok(())
    });
    grad?;
    assert_eq!(w.to_vec::<f32>()?, vec![1.0, 3.0]);
    assert_eq!(owned(&model), 1);
    model.close()
}

/// The DJL leak scenario: the model is capped, a training step uses a parameter as the first
/// input; inside a scope the result goes to the scope, so the step works and nothing leaks into
/// the model.
#[test]
fn active_scope_rescues_ops_on_capped_parameters() -> Result<()> {
    let model = Manager::new_base().with_name("model");
    let w = model.ones([3, 3], DType::F32)?;
    model.cap();
    let trainer = model.new_sub_manager()?;
    for _ in 0..5 {
        let loss = trainer.scope(|batch| {
            let x = batch.ones([3, 3], DType::F32)?;
            let y = w.matmul(&x)?.relu()?.sum_all()?;
            assert_eq!(y.manager()?, *batch);
            batch.ret(&y)
        })?;
        assert_eq!(loss.to_scalar::<f32>()?, 27.0);
        assert_eq!(loss.manager()?, trainer);
        loss.close()?;
    }
    assert_eq!(owned(&model), 1);
    assert_eq!(model.report().total_arrays(), 1);
    model.close()
}
