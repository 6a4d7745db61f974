//! Error values and messages (DESIGN §1, §3): every error says what failed, where (the caller's
//! file:line) and why; `ArrayClosed` names the array, where it was created and why it is closed;
//! `Capped` and `ManagerClosed` name the manager.

use ndscope::{DType, Device, Error, Manager, Result};

/// `tests/errors.rs:LINE:` — a location in this file, as error messages print it.
fn here(line: u32) -> String {
    format!("{}:{line}:", file!())
}

fn assert_error_is_std_error<E: std::error::Error + Send + Sync + 'static>() {}

#[test]
fn error_is_a_thread_safe_std_error() {
    assert_error_is_std_error::<Error>();
}

#[test]
fn array_closed_by_the_user_names_array_creation_site_and_closer() -> Result<()> {
    let m = Manager::new_base();
    let (a, created) = (m.ones([2], DType::F32)?, line!());
    a.set_name("logits");
    let ((), closed_at) = (a.close()?, line!());
    let (err, used) = (a.to_vec::<f32>().unwrap_err(), line!());
    match &err {
        Error::ArrayClosed {
            op,
            at,
            array,
            created_at,
            reason,
        } => {
            assert_eq!(*op, "NDArray::to_vec");
            assert_eq!((at.file(), at.line()), (file!(), used));
            assert_eq!(array, &format!("'logits' ({})", a.id()));
            assert_eq!((created_at.file(), created_at.line()), (file!(), created));
            assert!(reason.contains("closed by the user"), "{reason}");
            assert!(reason.contains(&here(closed_at)), "{reason}");
        }
        other => panic!("expected ArrayClosed, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("'logits'"), "{text}");
    assert!(text.contains(&here(created)), "{text}");
    assert!(text.contains(&here(used)), "{text}");
    assert!(text.contains("closed by the user"), "{text}");
    m.close()
}

#[test]
fn array_closed_names_an_unnamed_array_by_its_id() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    a.close()?;
    let text = a.add(&a).unwrap_err().to_string();
    let id = a.id().to_string();
    assert!(id.starts_with('a'), "{id}");
    assert!(text.contains(&format!("array {id} ")), "{text}");
    m.close()
}

#[test]
fn array_closed_by_its_manager_names_the_manager() -> Result<()> {
    let m = Manager::new_base().with_name("batch");
    let (a, created) = (m.zeros([3], DType::F64)?, line!());
    m.close()?;
    let err = a.sum_all().unwrap_err();
    assert!(matches!(err, Error::ArrayClosed { .. }));
    let text = err.to_string();
    assert!(text.contains(&here(created)), "{text}");
    assert!(
        text.contains(&format!("its manager 'batch' ({}) was closed", m.id())),
        "{text}"
    );
    assert!(!text.contains("closed by the user"), "{text}");
    Ok(())
}

#[test]
fn array_closed_of_an_op_result_points_at_the_op() -> Result<()> {
    let m = Manager::new_base();
    let x = m.ones([2], DType::F32)?;
    let (y, line) = (x.add(&x)?, line!());
    assert_eq!(
        (y.created_at().file(), y.created_at().line()),
        (file!(), line)
    );
    let (z, scope_line) = m.scope(|s| Ok((s.ones([1], DType::F32)?, line!())))?;
    assert_eq!(z.created_at().line(), scope_line);
    let text = z.to_vec::<f32>().unwrap_err().to_string();
    assert!(text.contains(&here(scope_line)), "{text}");
    assert!(text.contains("was closed"), "{text}");
    m.close()
}

#[test]
fn array_closed_after_a_broken_borrow_chain_says_so() -> Result<()> {
    let base = Manager::new_base();
    let lender = base.new_sub_manager()?.with_name("lender");
    let borrower = base.new_sub_manager()?.with_name("borrower");
    let a = lender.ones([2], DType::F32)?;
    a.temp_attach(&borrower)?;
    lender.close()?;
    borrower.close()?;
    let text = a.to_vec::<f32>().unwrap_err().to_string();
    assert!(text.contains("'borrower'"), "{text}");
    assert!(text.contains("'lender'"), "{text}");
    base.close()
}

#[test]
fn ownership_errors_point_at_the_call_site() -> Result<()> {
    let m = Manager::new_base();
    let other = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    a.close()?;
    let (err, line) = (a.attach(&other).unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    let one = std::slice::from_ref(&a);
    let (err, line) = (other.attach_all(one).unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    let (err, line) = (a.temp_attach(&other).unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    let (err, line) = (a.detach().unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    let (err, line) = (m.ret(&a).unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    let (err, line) = (a.manager().unwrap_err(), line!());
    assert!(err.to_string().contains(&here(line)), "{err}");
    m.close()?;
    other.close()
}

#[test]
fn manager_closed_names_the_manager() -> Result<()> {
    let m = Manager::new_base().with_name("trainer");
    m.close()?;
    let (err, line) = (m.new_sub_manager().unwrap_err(), line!());
    match &err {
        Error::ManagerClosed { manager, at, .. } => {
            assert_eq!(manager, &format!("'trainer' ({})", m.id()));
            assert_eq!(at.line(), line);
        }
        other => panic!("expected ManagerClosed, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("'trainer'"), "{text}");
    assert!(text.contains(&m.id().to_string()), "{text}");
    assert!(text.contains("is closed"), "{text}");
    assert!(text.contains(&here(line)), "{text}");

    // Unnamed: the id.
    let n = Manager::new_base();
    n.close()?;
    let text = n.zeros([1], DType::F32).unwrap_err().to_string();
    assert!(
        text.contains(&format!("manager {} is closed", n.id())),
        "{text}"
    );
    Ok(())
}

#[test]
fn capped_names_the_manager_and_what_would_have_landed() -> Result<()> {
    let model = Manager::new_base().with_name("model");
    let w = model.ones([2], DType::F32)?;
    w.set_name("weight");
    model.cap();

    let (err, line) = (model.zeros([3], DType::F32).unwrap_err(), line!());
    match &err {
        Error::Capped { manager, at, .. } => {
            assert_eq!(manager, &format!("'model' ({})", model.id()));
            assert_eq!(at.line(), line);
        }
        other => panic!("expected Capped, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("'model'") && text.contains("capped"),
        "{text}"
    );
    assert!(text.contains(&here(line)), "{text}");

    // An op result: the message says which input sent it there.
    let text = w.add(&w).unwrap_err().to_string();
    assert!(text.contains("'model'"), "{text}");
    assert!(text.contains("'weight'"), "{text}");

    // attach: names the array.
    let other = Manager::new_base();
    let x = other.ones([1], DType::F32)?.with_name("stray");
    let text = x.attach(&model).unwrap_err().to_string();
    assert!(
        text.contains("'model'") && text.contains("'stray'"),
        "{text}"
    );
    other.close()?;
    model.close()
}

#[test]
fn system_manager_errors_say_so() {
    let err = Manager::system().close().unwrap_err();
    assert!(matches!(err, Error::SystemManager { .. }));
    assert!(err.to_string().contains("system manager"), "{err}");
}

#[test]
fn device_unavailable_names_the_device() {
    // The first ordinal past this machine's GPUs: cuda:0 where there are none.
    let absent = Device::Cuda(Device::cuda_count());
    let (err, line) = (Manager::new_base_on(absent).unwrap_err(), line!());
    let text = err.to_string();
    assert!(text.contains(&absent.to_string()), "{text}");
    assert!(text.contains(&here(line)), "{text}");
}

#[test]
fn detached_manager_query_is_invalid_argument_naming_the_array() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([1], DType::F32)?.with_name("loose");
    a.detach()?;
    let err = a.manager().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }));
    assert!(err.to_string().contains("'loose'"), "{err}");
    assert!(err.to_string().contains("detached"), "{err}");
    a.close()?;
    m.close()
}
