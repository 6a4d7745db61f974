//! In-place ops (`add_`, `sub_`, `mul_`, `mul_scalar_`, `axpy_`, `assign_`, `fill_`) against
//! plain reference loops: broadcasting of the source, the source being the target, sizes on
//! both sides of the parallel threshold, and every error path leaving the target unchanged.

use ndscope::{DType, Device, Error, Manager, NDArray};
use proptest::prelude::*;

mod common;
use common::{as_f64, device_tests, size};

/// Test data in -10..=10.
fn values(n: usize, seed: u64) -> Vec<i64> {
    common::values(n, seed, 10)
}

/// An array of `vals` (floats scaled by 0.5).
fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64]) -> NDArray {
    common::array(m, dtype, shape, vals, 0.5)
}

/// `target[i] = f(target[i], src[broadcast i])` by the index formula.
fn reference_update(
    target: &[f64],
    tsh: &[usize],
    src: &[f64],
    ssh: &[usize],
    f: impl Fn(f64, f64) -> f64,
) -> Vec<f64> {
    let offset = tsh.len() - ssh.len();
    (0..target.len())
        .map(|flat| {
            let mut rest = flat;
            let mut idx = vec![0; tsh.len()];
            for d in (0..tsh.len()).rev() {
                idx[d] = rest % tsh[d];
                rest /= tsh[d];
            }
            let s = ssh.iter().enumerate().fold(0, |acc, (i, &d)| {
                acc * d + if d == 1 { 0 } else { idx[offset + i] }
            });
            f(target[flat], src[s])
        })
        .collect()
}

const PAIRS: &[(&[usize], &[usize])] = &[
    (&[], &[]),
    (&[7], &[]),
    (&[7], &[1]),
    (&[33], &[33]),
    (&[3, 5], &[5]),
    (&[3, 5], &[3, 1]),
    (&[2, 3, 4], &[1, 3, 1]),
    (&[0, 4], &[4]),
    (&[300, 257], &[257]),
    (&[300, 130], &[300, 1]),
    (&[40_000], &[40_000]),
];

device_tests!(axpy_adds_alpha_times_a_broadcast_source);
fn axpy_adds_alpha_times_a_broadcast_source(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64] {
        for (i, &(tsh, ssh)) in PAIRS.iter().enumerate() {
            for alpha in [1.0, -2.0, 0.5] {
                if !dtype.is_float() && alpha == 0.5 {
                    continue;
                }
                let t = array(&m, dtype, tsh, &values(size(tsh), i as u64));
                let s = array(&m, dtype, ssh, &values(size(ssh), 99 + i as u64));
                let want =
                    reference_update(&as_f64(&t), tsh, &as_f64(&s), ssh, |x, y| x + alpha * y);
                t.axpy_(alpha, &s).unwrap();
                assert_eq!(t.dims(), tsh);
                assert_eq!(as_f64(&t), want, "{dtype} {tsh:?} {ssh:?} alpha {alpha}");
            }
        }
    }
}

device_tests!(axpy_with_the_target_as_source_scales_it);
fn axpy_with_the_target_as_source_scales_it(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for n in [1, 7, 40_000] {
        let vals = values(n, 3);
        let a = array(&m, DType::F32, &[n], &vals);
        a.axpy_(2.0, &a).unwrap();
        let want: Vec<f64> = vals.iter().map(|&v| v as f64 * 0.5 * 3.0).collect();
        assert_eq!(as_f64(&a), want);
    }
    let i = m.from_slice(&[1i64, -4], [2]).unwrap();
    i.axpy_(-1.0, &i).unwrap();
    assert_eq!(i.to_vec::<i64>().unwrap(), vec![0, 0]);
}

device_tests!(
    integer_axpy_with_a_fractional_or_unrepresentable_alpha_is_invalid_and_changes_nothing
);
fn integer_axpy_with_a_fractional_or_unrepresentable_alpha_is_invalid_and_changes_nothing(
    dev: Device,
) {
    let m = Manager::new_base_on(dev).unwrap();
    let t = m.from_slice(&[1i32, 2, 3], [3]).unwrap();
    let s = m.from_slice(&[1i32, 1, 1], [3]).unwrap();
    assert!(matches!(
        t.axpy_(0.5, &s),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        t.axpy_(f64::NAN, &s),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(t.to_vec::<i32>().unwrap(), vec![1, 2, 3]);
    let b = m.from_slice(&[1u8, 2], [2]).unwrap();
    assert!(matches!(
        b.axpy_(-1.0, &b),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        b.axpy_(256.0, &b),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(b.to_vec::<u8>().unwrap(), vec![1, 2]);
    b.axpy_(3.0, &m.from_slice(&[1u8], [1]).unwrap()).unwrap();
    assert_eq!(b.to_vec::<u8>().unwrap(), vec![4, 5]);
}

device_tests!(binary_inplace_ops_broadcast_the_source);
fn binary_inplace_ops_broadcast_the_source(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    type Op = (
        &'static str,
        fn(&NDArray, &NDArray) -> ndscope::Result<()>,
        fn(f64, f64) -> f64,
    );
    let ops: [Op; 3] = [
        ("add_", |a, b| a.add_(b), |x, y| x + y),
        ("sub_", |a, b| a.sub_(b), |x, y| x - y),
        ("mul_", |a, b| a.mul_(b), |x, y| x * y),
    ];
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64] {
        for (i, &(tsh, ssh)) in PAIRS.iter().enumerate() {
            for (name, op, f) in ops {
                let t = array(&m, dtype, tsh, &values(size(tsh), i as u64));
                let s = array(&m, dtype, ssh, &values(size(ssh), 7 + i as u64));
                let want = reference_update(&as_f64(&t), tsh, &as_f64(&s), ssh, f);
                op(&t, &s).unwrap();
                assert_eq!(as_f64(&t), want, "{name} {dtype} {tsh:?} {ssh:?}");
            }
        }
    }
    let a = m.from_slice(&[1.0f64, -2.0], [2]).unwrap();
    a.add_(&a).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), vec![2.0, -4.0]);
    a.mul_(&a).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), vec![4.0, 16.0]);
    a.sub_(&a).unwrap();
    assert_eq!(a.to_vec::<f64>().unwrap(), vec![0.0, 0.0]);
}

device_tests!(mul_scalar_inplace_scales_every_element);
fn mul_scalar_inplace_scales_every_element(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for n in [0, 1, 33, 40_000] {
        let vals = values(n, 5);
        let a = array(&m, DType::F64, &[n], &vals);
        a.mul_scalar_(-1.5).unwrap();
        let want: Vec<f64> = vals.iter().map(|&v| v as f64 * 0.5 * -1.5).collect();
        assert_eq!(a.to_vec::<f64>().unwrap(), want);
    }
}

device_tests!(assign_copies_a_broadcast_source);
fn assign_copies_a_broadcast_source(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in DType::ALL {
        for (i, &(tsh, ssh)) in PAIRS.iter().enumerate() {
            let t = array(&m, dtype, tsh, &values(size(tsh), i as u64));
            let s = array(&m, dtype, ssh, &values(size(ssh), 50 + i as u64));
            let want = reference_update(&as_f64(&t), tsh, &as_f64(&s), ssh, |_, y| y);
            t.assign_(&s).unwrap();
            assert_eq!(as_f64(&t), want, "{dtype} {tsh:?} {ssh:?}");
        }
    }
    let a = m.from_slice(&[1i32, 2], [2]).unwrap();
    a.assign_(&a).unwrap();
    assert_eq!(a.to_vec::<i32>().unwrap(), vec![1, 2]);
}

device_tests!(fill_sets_every_element);
fn fill_sets_every_element(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in DType::ALL {
        for n in [0, 1, 7, 40_000] {
            let a = array(&m, dtype, &[n], &values(n, 1));
            a.fill_(3.0).unwrap();
            assert!(as_f64(&a).iter().all(|&v| v == 3.0), "{dtype} {n}");
        }
    }
    let i = m.zeros([2], DType::I32).unwrap();
    i.fill_(-2.7).unwrap();
    assert_eq!(i.to_vec::<i32>().unwrap(), vec![-2, -2]);
}

device_tests!(failed_inplace_op_changes_nothing);
fn failed_inplace_op_changes_nothing(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let t = m
        .from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])
        .unwrap();
    let before = t.to_vec::<f32>().unwrap();
    let wrong_dtype = m.ones([2, 3], DType::F64).unwrap();
    let grows_target = m.ones([4, 2, 3], DType::F32).unwrap();
    let no_broadcast = m.ones([2], DType::F32).unwrap();
    let closed = m.ones([2, 3], DType::F32).unwrap();
    closed.close().unwrap();
    type Op = fn(&NDArray, &NDArray) -> ndscope::Result<()>;
    let ops: [(&str, Op); 5] = [
        ("add_", |a, b| a.add_(b)),
        ("sub_", |a, b| a.sub_(b)),
        ("mul_", |a, b| a.mul_(b)),
        ("axpy_", |a, b| a.axpy_(2.0, b)),
        ("assign_", |a, b| a.assign_(b)),
    ];
    for (name, op) in ops {
        let err = op(&t, &wrong_dtype).unwrap_err();
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{name}: {err}");
        assert!(err.to_string().contains(name), "{err}");
        let err = op(&t, &grows_target).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{name}: {err}");
        assert!(
            matches!(op(&t, &no_broadcast), Err(Error::ShapeMismatch { .. })),
            "{name}"
        );
        assert!(
            matches!(op(&t, &closed), Err(Error::ArrayClosed { .. })),
            "{name}"
        );
        assert_eq!(
            t.to_vec::<f32>().unwrap(),
            before,
            "{name} changed its target"
        );
    }
    let ints = m.from_slice(&[4i32, 8], [2]).unwrap();
    let zero = m.from_slice(&[0i32], [1]).unwrap();
    common::refused(dev, ints.div(&zero));
    assert_eq!(ints.to_vec::<i32>().unwrap(), vec![4, 8]);
}

device_tests!(inplace_ops_on_a_closed_target_are_array_closed);
fn inplace_ops_on_a_closed_target_are_array_closed(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let t = m.zeros([3], DType::F32).unwrap();
    let s = m.ones([3], DType::F32).unwrap();
    t.close().unwrap();
    assert!(matches!(t.axpy_(1.0, &s), Err(Error::ArrayClosed { .. })));
    assert!(matches!(t.assign_(&s), Err(Error::ArrayClosed { .. })));
    assert!(matches!(t.fill_(1.0), Err(Error::ArrayClosed { .. })));
    assert!(matches!(t.mul_scalar_(2.0), Err(Error::ArrayClosed { .. })));
    assert!(matches!(t.axpy_(1.0, &t), Err(Error::ArrayClosed { .. })));
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![1.0; 3]);
}

device_tests!(inplace_ops_allocate_nothing_so_they_work_in_a_capped_manager);
fn inplace_ops_allocate_nothing_so_they_work_in_a_capped_manager(dev: Device) {
    // A capped manager refuses every new array, so an op that allocated would fail here.
    let m = Manager::new_base_on(dev).unwrap();
    let w = m.from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    let g = m.from_slice(&[1.0f32, 1.0, 1.0], [3]).unwrap();
    m.cap();
    assert!(matches!(w.add(&g), Err(Error::Capped { .. })));
    w.axpy_(-0.5, &g).unwrap();
    w.add_(&g).unwrap();
    w.sub_(&g).unwrap();
    w.mul_(&g).unwrap();
    w.mul_scalar_(2.0).unwrap();
    w.assign_(&g).unwrap();
    w.fill_(0.25).unwrap();
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.25; 3]);
}

device_tests!(sgd_step_with_axpy_matches_the_formula);
fn sgd_step_with_axpy_matches_the_formula(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let n = 50_000;
    let w0: Vec<f32> = (0..n).map(|i| (i % 17) as f32 * 0.125).collect();
    let g0: Vec<f32> = (0..n).map(|i| (i % 5) as f32 - 2.0).collect();
    let w = m.from_slice(&w0, [n]).unwrap();
    let g = m.from_slice(&g0, [n]).unwrap();
    w.axpy_(-0.25, &g).unwrap();
    let want: Vec<f32> = w0.iter().zip(&g0).map(|(w, g)| w + -0.25 * g).collect();
    assert_eq!(w.to_vec::<f32>().unwrap(), want);
}

/// A target shape and a source shape that broadcasts to it.
fn target_and_source() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(0usize..5, 0..5).prop_flat_map(|t| {
        let n = t.len();
        (Just(t), 0..=n, prop::collection::vec(any::<bool>(), n)).prop_map(|(t, len, ones)| {
            let s = (t.len() - len..t.len())
                .map(|i| if ones[i] { 1 } else { t[i] })
                .collect();
            (t, s)
        })
    })
}

device_tests!(inplace_broadcasting_matches_the_reference_for_random_shapes);
fn inplace_broadcasting_matches_the_reference_for_random_shapes(dev: Device) {
    proptest!(ProptestConfig::with_cases(64), |(
        (tsh, ssh) in target_and_source(),
        seed in any::<u64>(),
        dtype in prop::sample::select(vec![DType::F32, DType::F64, DType::I32, DType::I64]),
    )| {
        let m = Manager::new_base_on(dev).unwrap();
        let t = array(&m, dtype, &tsh, &values(size(&tsh), seed));
        let s = array(&m, dtype, &ssh, &values(size(&ssh), !seed));
        let want = reference_update(&as_f64(&t), &tsh, &as_f64(&s), &ssh, |x, y| x - 3.0 * y);
        t.axpy_(-3.0, &s).unwrap();
        prop_assert_eq!(as_f64(&t), want);
        let want = reference_update(&as_f64(&t), &tsh, &as_f64(&s), &ssh, |_, y| y);
        t.assign_(&s).unwrap();
        prop_assert_eq!(as_f64(&t), want);
        m.close().unwrap();
    });
}
