//! Devices (DESIGN §5) on every machine, with or without a GPU: counting GPUs never panics, an
//! absent device is `DeviceUnavailable` saying why, `to_device` keeps the owner, `empty` gives
//! the shape and dtype asked for, `synchronize` and the TF32 switch. What needs a GPU to run is
//! in `tests/cuda.rs`.

use ndscope::{DType, Device, Error, LearningPolicy, Manager, WorkspaceConfig};

mod common;
use common::device_tests;

/// The first ordinal past this machine's GPUs: `cuda:0` where there are none.
fn absent() -> Device {
    Device::Cuda(Device::cuda_count())
}

#[test]
fn cuda_count_never_panics_and_agrees_with_is_available() {
    // The first call probes the driver and libraries; make several threads race for it.
    let counts: Vec<usize> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(Device::cuda_count)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let n = Device::cuda_count();
    assert!(counts.iter().all(|&c| c == n), "{counts:?} vs {n}");
    if !cfg!(feature = "cuda") {
        assert_eq!(n, 0, "a build without the `cuda` feature has no GPUs");
    }
    assert!(Device::Cpu.is_available());
    for i in 0..n {
        assert!(Device::Cuda(i).is_available(), "cuda:{i} of {n}");
    }
    for ordinal in [n, n + 1, 64, usize::MAX] {
        assert!(!Device::Cuda(ordinal).is_available(), "cuda:{ordinal}");
    }
}

#[test]
fn an_absent_gpu_is_device_unavailable_saying_why() {
    let n = Device::cuda_count();
    let dev = absent();
    let err = Manager::new_base_on(dev).unwrap_err();
    let Error::DeviceUnavailable { device, reason, .. } = &err else {
        panic!("expected DeviceUnavailable, got {err:?}");
    };
    assert_eq!(*device, dev);
    let text = err.to_string();
    assert!(text.contains(&dev.to_string()), "{text}");
    assert!(text.contains(reason.as_str()), "{text}");
    if !cfg!(feature = "cuda") {
        assert!(
            reason.contains("built without the `cuda` feature"),
            "the reason names the missing feature: {text}"
        );
    } else if n == 0 {
        // The driver, a GPU or one of the libraries is missing: the reason says which.
        assert!(
            ["driver", "GPU", "cuBLAS", "NVRTC"]
                .iter()
                .any(|what| reason.contains(what)),
            "the reason names what is missing: {text}"
        );
    } else {
        assert!(
            reason.contains(&format!("this machine has {n} CUDA device(s)")),
            "{text}"
        );
    }
    // Every way of making something on it says the same, and creates nothing.
    let base = Manager::new_base();
    for result in [
        base.new_sub_manager_on(dev).map(|_| ()),
        base.ones([2], DType::F32)
            .unwrap()
            .to_device(dev)
            .map(|_| ()),
        dev.synchronize(),
    ] {
        match result {
            Err(Error::DeviceUnavailable {
                device, reason: r, ..
            }) => {
                assert_eq!(device, dev);
                assert_eq!(&r, reason);
            }
            other => panic!("expected DeviceUnavailable, got {other:?}"),
        }
    }
    assert!(base.children().is_empty());
    assert_eq!(base.report().arrays.len(), 1, "only the source array");
    base.close().unwrap();
}

#[test]
fn to_device_of_an_ordinal_past_the_limit_is_device_unavailable() {
    let m = Manager::new_base();
    let a = m.from_slice(&[1i64, 2, 3], [3]).unwrap();
    for ordinal in [64, 1000, usize::MAX] {
        let err = a.to_device(Device::Cuda(ordinal)).unwrap_err();
        assert!(
            matches!(err, Error::DeviceUnavailable { device, .. } if device == Device::Cuda(ordinal)),
            "{err}"
        );
        assert!(
            err.to_string().contains(&format!("cuda:{ordinal}")),
            "{err}"
        );
    }
    assert_eq!(m.report().arrays.len(), 1, "no copy was made");
    assert_eq!(a.to_vec::<i64>().unwrap(), vec![1, 2, 3]);
    m.close().unwrap();
}

#[test]
fn to_device_keeps_the_owner_under_another_active_scope() {
    let owner = Manager::new_base().with_name("owner");
    let other = Manager::new_base().with_name("other");
    let a = owner.from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    let (copy, result) = {
        let _active = other.activate();
        // An op result goes to the active scope; a device copy stays with the source's owner.
        (a.to_device(Device::Cpu).unwrap(), a.neg().unwrap())
    };
    assert_eq!(copy.manager().unwrap(), owner);
    assert_eq!(result.manager().unwrap(), other);
    assert_eq!(copy.device(), Device::Cpu);
    assert_ne!(copy.id(), a.id(), "a copy, not the same array");
    assert_eq!(copy.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    a.fill_(0.0).unwrap();
    assert_eq!(
        copy.to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0],
        "the copy has its own data"
    );
    assert_eq!(owner.report().arrays.len(), 2);
    assert_eq!(other.report().arrays.len(), 1);

    // While borrowed, the source is held by its borrower: the copy goes there.
    let borrower = Manager::new_base().with_name("borrower");
    a.temp_attach(&borrower).unwrap();
    let borrowed_copy = {
        let _active = other.activate();
        a.to_device(Device::Cpu).unwrap()
    };
    assert_eq!(borrowed_copy.manager().unwrap(), borrower);

    // A capped owner refuses the copy, whatever scope is active, and nothing is allocated.
    let capped = Manager::new_base();
    let c = capped.ones([4], DType::I32).unwrap();
    capped.cap();
    {
        let _active = other.activate();
        assert!(matches!(
            c.to_device(Device::Cpu),
            Err(Error::Capped { .. })
        ));
    }
    assert_eq!(capped.report().arrays.len(), 1);
    assert_eq!(other.report().arrays.len(), 1);
    for m in [borrower, owner, other, capped] {
        m.close().unwrap();
    }
}

#[test]
fn to_device_inside_a_workspace_cycle_keeps_the_owner() {
    let t = Manager::new_base();
    let other = Manager::new_base();
    let ws = t.workspace("batch", WorkspaceConfig::default()).unwrap();
    ws.cycle(|c| {
        let a = c.arange(0.0, 5.0, 1.0, DType::F64)?;
        let copy = {
            let _active = other.activate();
            a.to_device(Device::Cpu)?
        };
        assert_eq!(copy.manager()?, *c);
        assert_eq!(copy.to_vec::<f64>()?, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        Ok(())
    })
    .unwrap();
    assert!(other.report().arrays.is_empty());
    other.close().unwrap();
    t.close().unwrap();
}

device_tests!(empty_has_the_shape_and_dtype_asked_for);
/// `empty` leaves the contents unspecified, so only its shape, dtype, device and owner are
/// checked, and that what is written reads back, outside and inside a workspace (where its
/// bytes are those an earlier cycle left).
fn empty_has_the_shape_and_dtype_asked_for(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let shapes: [&[usize]; 5] = [&[], &[0], &[3, 0], &[2, 3], &[1000, 7]];
    let check = |owner: &Manager| -> ndscope::Result<()> {
        for dtype in DType::ALL {
            for shape in shapes {
                let e = owner.empty(shape, dtype)?;
                assert_eq!(e.dims(), shape, "{dtype} {shape:?}");
                assert_eq!(e.dtype(), dtype);
                assert_eq!(e.device(), owner.device());
                assert_eq!(e.size(), shape.iter().product::<usize>());
                assert_eq!(e.nbytes(), e.size() * dtype.size_in_bytes());
                assert_eq!(e.manager()?, *owner);
                e.fill_(3.0)?;
                assert!(common::as_f64(&e).iter().all(|&v| v == 3.0), "{dtype}");
                let src = owner.arange(0.0, e.size() as f64, 1.0, dtype)?;
                e.assign_(&src.reshape(shape)?)?;
                assert_eq!(common::as_f64(&e), common::as_f64(&src), "{dtype}");
            }
        }
        Ok(())
    };
    check(&m).unwrap();

    let conf = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 20)
        .build()
        .unwrap();
    let ws = m.workspace("ws", conf).unwrap();
    for _ in 0..2 {
        // The first cycle leaves its bytes in the block; the second's `empty` gets them.
        ws.cycle(|c| {
            let used = ws.stats().used;
            let e = c.empty([4, 5], DType::F64)?;
            assert_eq!(ws.stats().used, used + 192, "160 B in the block, aligned");
            assert!(c.report().arrays[0].in_workspace);
            assert_eq!((e.dims(), e.dtype()), (&[4usize, 5][..], DType::F64));
            e.fill_(-1.0)?;
            assert_eq!(e.to_vec::<f64>()?, vec![-1.0; 20]);
            check(c)
        })
        .unwrap();
    }
    assert_eq!(ws.stats().spilled_count, 0);

    // Like every factory: refused by a capped or closed manager.
    let capped = m.new_sub_manager().unwrap();
    capped.cap();
    assert!(matches!(
        capped.empty([2], DType::F32),
        Err(Error::Capped { .. })
    ));
    m.close().unwrap();
    assert!(matches!(
        m.empty([2], DType::F32),
        Err(Error::ManagerClosed { .. })
    ));
}

#[test]
fn synchronizing_the_cpu_is_a_no_op_and_an_absent_gpu_is_unavailable() {
    Device::Cpu.synchronize().unwrap();
    let m = Manager::new_base();
    let a = m.ones([256, 256], DType::F32).unwrap();
    let b = a.matmul(&a).unwrap();
    Device::Cpu.synchronize().unwrap();
    assert_eq!(
        b.sum_all().unwrap().to_scalar::<f32>().unwrap(),
        256.0 * 65536.0
    );
    let err = absent().synchronize().unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
    assert!(err.to_string().contains(&absent().to_string()), "{err}");
    m.close().unwrap();
}

#[test]
fn allow_tf32_round_trips_and_is_off_by_default() {
    // The only test of this binary that touches the switch.
    assert!(!ndscope::allow_tf32(), "strict FP32 by default");
    ndscope::set_allow_tf32(true);
    assert!(ndscope::allow_tf32());
    ndscope::set_allow_tf32(true);
    assert!(ndscope::allow_tf32(), "setting it twice");
    ndscope::set_allow_tf32(false);
    assert!(!ndscope::allow_tf32());
    // CPU products stay strict either way.
    let m = Manager::new_base();
    let a = m.full([64, 64], 1.0 + 1.0 / 1024.0, DType::F32).unwrap();
    let strict = a.matmul(&a).unwrap().to_vec::<f32>().unwrap();
    ndscope::set_allow_tf32(true);
    let with_tf32 = a.matmul(&a).unwrap().to_vec::<f32>().unwrap();
    ndscope::set_allow_tf32(false);
    assert_eq!(strict, with_tf32);
    m.close().unwrap();
}
