//! The manager tree (DESIGN §2, first table): the system manager, base managers, sub-managers,
//! names and ids, tree navigation, closing and capping.

use ndscope::{DType, Device, Error, Manager, Result};

fn is_closed_error(result: Result<Vec<f32>>) -> bool {
    matches!(result, Err(Error::ArrayClosed { .. }))
}

// ---------------------------------------------------------------------------------------------
// The system manager
// ---------------------------------------------------------------------------------------------

#[test]
fn system_manager_is_the_root_and_always_open() {
    let system = Manager::system();
    assert!(system.parent().is_none());
    assert!(system.is_open());
    assert_eq!(system.device(), Device::Cpu);
    assert_eq!(
        system,
        Manager::system(),
        "every call returns the same root"
    );
}

#[test]
fn closing_the_system_manager_is_refused() {
    let system = Manager::system();
    assert!(matches!(system.close(), Err(Error::SystemManager { .. })));
    assert!(system.is_open());
    // Still usable afterwards.
    let base = Manager::new_base();
    assert_eq!(base.parent(), Some(Manager::system()));
    base.close().unwrap();
}

#[test]
fn temp_attaching_into_the_system_manager_is_refused() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    assert!(matches!(
        a.temp_attach(&Manager::system()),
        Err(Error::SystemManager { .. })
    ));
    assert!(matches!(
        Manager::system().temp_attach_all(std::slice::from_ref(&a)),
        Err(Error::SystemManager { .. })
    ));
    // Nothing moved.
    assert_eq!(a.manager()?, m);
    m.close()?;
    assert!(!a.is_open());
    Ok(())
}

#[test]
fn ret_on_the_system_manager_is_refused() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([2], DType::F32)?;
    assert!(matches!(
        Manager::system().ret(&a),
        Err(Error::SystemManager { .. })
    ));
    assert_eq!(a.manager()?, m);
    m.close()
}

// ---------------------------------------------------------------------------------------------
// Base managers
// ---------------------------------------------------------------------------------------------

#[test]
fn new_base_is_an_open_cpu_child_of_the_system_manager() {
    let base = Manager::new_base();
    assert_eq!(base.parent(), Some(Manager::system()));
    assert_eq!(base.device(), Device::Cpu);
    assert!(base.is_open());
    assert!(!base.is_capped());
    assert!(base.children().is_empty());
    assert!(Manager::system().children().contains(&base));
    base.close().unwrap();
    assert!(!Manager::system().children().contains(&base));
}

#[test]
fn new_base_on_cpu_is_a_child_of_the_system_manager() -> Result<()> {
    let base = Manager::new_base_on(Device::Cpu)?;
    assert_eq!(base.parent(), Some(Manager::system()));
    assert_eq!(base.device(), Device::Cpu);
    base.close()
}

#[test]
fn new_base_on_an_absent_gpu_is_device_unavailable() {
    if !cfg!(feature = "cuda") {
        assert_eq!(Device::cuda_count(), 0, "this build has no GPU backend");
    }
    // The first ordinal past this machine's GPUs: cuda:0 where there are none.
    let absent = Device::Cuda(Device::cuda_count());
    match Manager::new_base_on(absent) {
        Err(Error::DeviceUnavailable { device, .. }) => assert_eq!(device, absent),
        other => panic!("expected DeviceUnavailable, got {other:?}"),
    }
}

#[test]
fn new_sub_manager_on_an_absent_gpu_is_device_unavailable() {
    let base = Manager::new_base();
    assert!(matches!(
        base.new_sub_manager_on(Device::Cuda(Device::cuda_count())),
        Err(Error::DeviceUnavailable { .. })
    ));
    assert!(base.children().is_empty(), "nothing was created");
    base.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Sub-managers
// ---------------------------------------------------------------------------------------------

#[test]
fn sub_manager_is_an_open_child_on_the_parent_device() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    assert_eq!(child.parent(), Some(parent.clone()));
    assert_eq!(child.device(), parent.device());
    assert!(child.is_open());
    assert_eq!(parent.children(), vec![child.clone()]);
    let on_cpu = parent.new_sub_manager_on(Device::Cpu)?;
    assert_eq!(on_cpu.device(), Device::Cpu);
    assert_eq!(on_cpu.parent(), Some(parent.clone()));
    parent.close()
}

#[test]
fn children_are_listed_newest_first_and_only_while_open() -> Result<()> {
    let parent = Manager::new_base();
    let a = parent.new_sub_manager()?;
    let b = parent.new_sub_manager()?;
    let c = parent.new_sub_manager()?;
    assert_eq!(parent.children(), vec![c.clone(), b.clone(), a.clone()]);
    b.close()?;
    assert_eq!(parent.children(), vec![c.clone(), a.clone()]);
    // Grandchildren are not children.
    let grandchild = a.new_sub_manager()?;
    assert_eq!(parent.children(), vec![c, a.clone()]);
    assert_eq!(a.children(), vec![grandchild]);
    parent.close()?;
    assert!(parent.children().is_empty());
    assert!(a.children().is_empty());
    Ok(())
}

#[test]
fn new_sub_manager_on_a_closed_manager_is_manager_closed() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    parent.close()?;
    assert!(matches!(
        parent.new_sub_manager(),
        Err(Error::ManagerClosed { .. })
    ));
    assert!(matches!(
        parent.new_sub_manager_on(Device::Cpu),
        Err(Error::ManagerClosed { .. })
    ));
    assert!(matches!(
        parent.sub_scope(),
        Err(Error::ManagerClosed { .. })
    ));
    // The child was closed with its parent, so the same holds for it.
    assert!(matches!(
        child.new_sub_manager(),
        Err(Error::ManagerClosed { .. })
    ));
    Ok(())
}

#[test]
fn factories_on_a_closed_manager_are_manager_closed() -> Result<()> {
    let m = Manager::new_base();
    m.close()?;
    assert!(matches!(
        m.zeros([2], DType::F32),
        Err(Error::ManagerClosed { .. })
    ));
    assert!(matches!(
        m.from_slice(&[1.0f32], [1]),
        Err(Error::ManagerClosed { .. })
    ));
    assert!(matches!(
        m.from_vec(vec![1i64, 2], [2]),
        Err(Error::ManagerClosed { .. })
    ));
    assert!(matches!(m.scalar(1u8), Err(Error::ManagerClosed { .. })));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Names and ids
// ---------------------------------------------------------------------------------------------

#[test]
fn unnamed_manager_is_named_by_its_id() {
    let m = Manager::new_base();
    let id = m.id().to_string();
    assert!(id.starts_with('m'), "{id}");
    assert!(id[1..].parse::<u64>().is_ok(), "id is m<number>: {id}");
    assert_eq!(m.name(), id);
    m.close().unwrap();
}

#[test]
fn ids_are_unique() -> Result<()> {
    let base = Manager::new_base();
    let mut ids = vec![base.id()];
    for _ in 0..20 {
        ids.push(base.new_sub_manager()?.id());
    }
    let mut unique = ids.clone();
    unique.sort();
    unique.dedup();
    assert_eq!(unique.len(), ids.len());
    base.close()
}

#[test]
fn set_name_and_with_name_name_the_manager() -> Result<()> {
    let model = Manager::new_base().with_name("model");
    assert_eq!(model.name(), "model");
    let trainer = model.new_sub_manager()?.with_name("trainer");
    assert_eq!(trainer.name(), "trainer");
    trainer.set_name("trainer-2");
    assert_eq!(trainer.name(), "trainer-2");
    // Every handle sees the name.
    assert_eq!(model.children()[0].name(), "trainer-2");
    // The id is unchanged by naming.
    assert_ne!(trainer.id().to_string(), trainer.name());
    model.close()?;
    // Names are still answered after closing.
    assert_eq!(trainer.name(), "trainer-2");
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Closing
// ---------------------------------------------------------------------------------------------

#[test]
fn close_is_idempotent() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([3], DType::F32)?;
    m.close()?;
    m.close()?;
    m.close()?;
    assert!(!m.is_open());
    assert!(!a.is_open());
    Ok(())
}

#[test]
fn closing_a_manager_frees_its_arrays() -> Result<()> {
    let m = Manager::new_base();
    let a = m.ones([3], DType::F32)?;
    let b = a.add(&a)?;
    assert_eq!(b.manager()?, m);
    m.close()?;
    assert!(!a.is_open());
    assert!(!b.is_open());
    assert!(is_closed_error(a.to_vec::<f32>()));
    assert!(is_closed_error(b.to_vec::<f32>()));
    Ok(())
}

#[test]
fn closing_parent_closes_subtree() -> Result<()> {
    let root = Manager::new_base();
    let child = root.new_sub_manager()?;
    let sibling = root.new_sub_manager()?;
    let grandchild = child.new_sub_manager()?;
    let in_root = root.ones([2], DType::F32)?;
    let in_child = child.ones([2], DType::F32)?;
    let in_sibling = sibling.ones([2], DType::F32)?;
    let in_grandchild = grandchild.ones([2], DType::F32)?;

    root.close()?;

    for m in [&root, &child, &sibling, &grandchild] {
        assert!(!m.is_open(), "{m:?} should be closed");
        assert!(m.children().is_empty());
    }
    for a in [&in_root, &in_child, &in_sibling, &in_grandchild] {
        assert!(!a.is_open());
        assert!(is_closed_error(a.to_vec::<f32>()));
    }
    assert!(!Manager::system().children().contains(&root));
    Ok(())
}

#[test]
fn closing_a_child_leaves_parent_and_siblings_open() -> Result<()> {
    let root = Manager::new_base();
    let child = root.new_sub_manager()?;
    let sibling = root.new_sub_manager()?;
    let in_root = root.ones([2], DType::F32)?;
    let in_sibling = sibling.ones([2], DType::F32)?;
    let in_child = child.ones([2], DType::F32)?;
    child.close()?;
    assert!(root.is_open() && sibling.is_open());
    assert!(in_root.is_open() && in_sibling.is_open());
    assert!(!in_child.is_open());
    assert_eq!(root.children(), vec![sibling]);
    root.close()
}

/// Children close before their parent: an array the parent lent to a grandchild goes back up the
/// chain (grandchild → child → parent) and is then freed by the parent as one of its own, so its
/// close reason names the parent. Closing the parent first would have found the lender closed.
#[test]
fn closing_parent_closes_children_first() -> Result<()> {
    let parent = Manager::new_base().with_name("parent");
    let child = parent.new_sub_manager()?.with_name("child");
    let grandchild = child.new_sub_manager()?.with_name("grandchild");
    let a = parent.ones([4], DType::F32)?;
    a.temp_attach(&child)?;
    a.temp_attach(&grandchild)?;
    assert_eq!(a.manager()?, grandchild);

    parent.close()?;

    let text = a.to_vec::<f32>().unwrap_err().to_string();
    assert!(
        text.contains("its manager 'parent'") && text.contains("was closed"),
        "the parent freed it as its own array: {text}"
    );
    assert!(!text.contains("borrower"), "{text}");
    Ok(())
}

#[test]
fn parent_is_answered_after_closing() -> Result<()> {
    let parent = Manager::new_base();
    let child = parent.new_sub_manager()?;
    parent.close()?;
    assert_eq!(child.parent(), Some(parent.clone()));
    assert_eq!(parent.parent(), Some(Manager::system()));
    Ok(())
}

#[test]
fn dropping_handles_frees_nothing() -> Result<()> {
    let m = Manager::new_base();
    let child = m.new_sub_manager()?;
    let a = child.ones([2], DType::F32)?;
    let id = child.id();
    drop(child);
    assert_eq!(m.children().len(), 1);
    assert_eq!(m.children()[0].id(), id);
    assert!(a.is_open());
    m.close()?;
    assert!(!a.is_open());
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Capping in the tree
// ---------------------------------------------------------------------------------------------

#[test]
fn cap_is_reported_by_is_capped() {
    let m = Manager::new_base();
    assert!(!m.is_capped());
    m.cap();
    assert!(m.is_capped());
    m.cap();
    assert!(m.is_capped(), "capping twice keeps it capped");
    m.close().unwrap();
    assert!(!m.is_capped(), "a closed manager is not reported capped");
}

#[test]
fn cap_is_not_inherited() -> Result<()> {
    let parent = Manager::new_base();
    parent.cap();
    let child = parent.new_sub_manager()?;
    assert!(!child.is_capped());
    let a = child.ones([2], DType::F32)?;
    assert_eq!(a.manager()?, child);
    // Capping a child does not cap its parent either.
    let other = Manager::new_base();
    let other_child = other.new_sub_manager()?;
    other_child.cap();
    assert!(!other.is_capped());
    other.ones([1], DType::F32)?;
    // A sub-manager created after the parent was capped is uncapped, one created before too.
    let early = other.new_sub_manager()?;
    other.cap();
    assert!(!early.is_capped());
    parent.close()?;
    other.close()
}

#[test]
fn capping_a_closed_manager_does_nothing() {
    let m = Manager::new_base();
    m.close().unwrap();
    m.cap();
    assert!(!m.is_capped());
    assert!(!m.is_open());
}
