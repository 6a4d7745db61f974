//! Matrix products (2-D and batched 3-D), softmax / log-softmax, one-hot and pick against plain
//! reference loops, with odd and large sizes, empty arrays and every error path.

use ndscope::{DType, Device, Error, Manager, NDArray, Transpose};

mod common;
use common::{as_f64, device_tests, size};

/// Test data in -8..=8.
fn values(n: usize, seed: u64) -> Vec<i64> {
    common::values(n, seed, 8)
}

/// An array of `vals` (floats scaled by 1.0).
fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64]) -> NDArray {
    common::array(m, dtype, shape, vals, 1.0)
}

/// `a[m×k] · b[k×n]` by the definition.
fn reference_matmul(m: usize, k: usize, n: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
        }
    }
    out
}

device_tests!(matmul_of_matrices_matches_the_reference);
fn matmul_of_matrices_matches_the_reference(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64] {
        for &(m, k, n) in &[
            (1, 1, 1),
            (1, 7, 1),
            (7, 1, 33),
            (33, 17, 7),
            (64, 64, 64),
            (0, 3, 4),
            (3, 0, 4),
        ] {
            let a = array(&mg, dtype, &[m, k], &values(m * k, 1));
            let b = array(&mg, dtype, &[k, n], &values(k * n, 2));
            let c = a.matmul(&b).unwrap();
            assert_eq!(c.dims(), &[m, n]);
            assert_eq!(c.dtype(), dtype);
            assert_eq!(
                as_f64(&c),
                reference_matmul(m, k, n, &as_f64(&a), &as_f64(&b)),
                "{dtype} {m}x{k}x{n}"
            );
        }
    }
}

device_tests!(batched_matmul_multiplies_each_batch_entry);
fn batched_matmul_multiplies_each_batch_entry(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64, DType::I64] {
        for &(b, m, k, n) in &[
            (1, 1, 1, 1),
            (3, 2, 5, 7),
            (7, 33, 17, 9),
            (40, 16, 16, 16),
            (2, 70, 60, 50),
            (0, 2, 3, 4),
        ] {
            let x = array(&mg, dtype, &[b, m, k], &values(b * m * k, 3));
            let y = array(&mg, dtype, &[b, k, n], &values(b * k * n, 4));
            let z = x.matmul(&y).unwrap();
            assert_eq!(z.dims(), &[b, m, n]);
            let (xv, yv) = (as_f64(&x), as_f64(&y));
            let want: Vec<f64> = (0..b)
                .flat_map(|i| {
                    reference_matmul(
                        m,
                        k,
                        n,
                        &xv[i * m * k..(i + 1) * m * k],
                        &yv[i * k * n..(i + 1) * k * n],
                    )
                })
                .collect();
            assert_eq!(as_f64(&z), want, "{dtype} {b}x{m}x{k}x{n}");
        }
    }
}

device_tests!(batched_matmul_with_a_shared_right_operand);
fn batched_matmul_with_a_shared_right_operand(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    for &(b, m, k, n) in &[(1, 1, 1, 1), (5, 3, 7, 2), (9, 33, 17, 40), (0, 2, 3, 4)] {
        let x = array(&mg, DType::F32, &[b, m, k], &values(b * m * k, 5));
        let w = array(&mg, DType::F32, &[k, n], &values(k * n, 6));
        let z = x.matmul(&w).unwrap();
        assert_eq!(z.dims(), &[b, m, n]);
        let (xv, wv) = (as_f64(&x), as_f64(&w));
        let want: Vec<f64> = (0..b)
            .flat_map(|i| reference_matmul(m, k, n, &xv[i * m * k..(i + 1) * m * k], &wv))
            .collect();
        assert_eq!(as_f64(&z), want, "{b}x{m}x{k}x{n}");
    }
}

device_tests!(batched_matmul_with_a_shared_left_operand);
fn batched_matmul_with_a_shared_left_operand(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let (b, m, k, n) = (4, 3, 5, 6);
    let x = array(&mg, DType::F64, &[m, k], &values(m * k, 7));
    let y = array(&mg, DType::F64, &[b, k, n], &values(b * k * n, 8));
    let z = x.matmul(&y).unwrap();
    assert_eq!(z.dims(), &[b, m, n]);
    let (xv, yv) = (as_f64(&x), as_f64(&y));
    let want: Vec<f64> = (0..b)
        .flat_map(|i| reference_matmul(m, k, n, &xv, &yv[i * k * n..(i + 1) * k * n]))
        .collect();
    assert_eq!(as_f64(&z), want);
}

device_tests!(matmul_shape_errors_are_shape_mismatches);
fn matmul_shape_errors_are_shape_mismatches(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let z = |shape: &[usize]| mg.zeros(shape, DType::F32).unwrap();
    let cases: &[(&[usize], &[usize])] = &[
        (&[2, 3], &[4, 5]),
        (&[2, 2, 3], &[3, 3, 4]),
        (&[2, 2, 3], &[2, 4, 4]),
        (&[2, 3], &[3]),
        (&[3], &[3, 2]),
        (&[1, 2, 2, 3], &[3, 2]),
        (&[], &[]),
    ];
    for &(a, b) in cases {
        let err = z(a).matmul(&z(b)).unwrap_err();
        assert!(
            matches!(err, Error::ShapeMismatch { .. }),
            "{a:?} {b:?}: {err}"
        );
        assert!(err.to_string().contains("matmul"));
    }
    let f64s = mg.zeros([3, 2], DType::F64).unwrap();
    assert!(matches!(
        z(&[2, 3]).matmul(&f64s),
        Err(Error::DTypeMismatch { .. })
    ));
}

/// Softmax along axis `ax` of `x` (shape `dims`) in f64, by the definition with the maximum
/// subtracted; `log` gives log-softmax.
fn reference_softmax(x: &[f64], dims: &[usize], ax: usize, log: bool) -> Vec<f64> {
    let outer: usize = dims[..ax].iter().product();
    let n = dims[ax];
    let inner: usize = dims[ax + 1..].iter().product();
    let mut out = vec![0.0; x.len()];
    for o in 0..outer {
        for j in 0..inner {
            let at = |i: usize| (o * n + i) * inner + j;
            let max = (0..n).map(|i| x[at(i)]).fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = (0..n).map(|i| (x[at(i)] - max).exp()).sum();
            for i in 0..n {
                out[at(i)] = if log {
                    x[at(i)] - max - sum.ln()
                } else {
                    (x[at(i)] - max).exp() / sum
                };
            }
        }
    }
    out
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what} [{i}]: {g} vs {w}"
        );
    }
}

device_tests!(softmax_and_log_softmax_match_the_reference_along_every_axis);
fn softmax_and_log_softmax_match_the_reference_along_every_axis(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[3, 5],
        &[2, 3, 4],
        &[1, 33, 1],
        &[200, 300],
        &[3, 40_000],
        &[6, 2000, 3],
    ];
    for dtype in [DType::F32, DType::F64] {
        for (s, &dims) in shapes.iter().enumerate() {
            let a = array(&mg, dtype, dims, &values(size(dims), 10 + s as u64))
                .mul_scalar(0.75)
                .unwrap();
            let x = as_f64(&a);
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
            for axis in -(dims.len() as isize)..dims.len() as isize {
                let ax = (axis + dims.len() as isize) as usize % dims.len();
                let p = a.softmax(axis).unwrap();
                assert_eq!(p.dims(), dims);
                assert_eq!(p.dtype(), dtype);
                assert_close(
                    &as_f64(&p),
                    &reference_softmax(&x, dims, ax, false),
                    tol,
                    &format!("softmax {dtype} {dims:?} {axis}"),
                );
                let lp = a.log_softmax(axis).unwrap();
                assert_close(
                    &as_f64(&lp),
                    &reference_softmax(&x, dims, ax, true),
                    tol,
                    &format!("log_softmax {dtype} {dims:?} {axis}"),
                );
            }
        }
    }
}

device_tests!(softmax_does_not_overflow_on_large_inputs);
fn softmax_does_not_overflow_on_large_inputs(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let a = mg
        .from_slice(&[1000.0f32, 1001.0, -1000.0, 89.0, 90.0, 91.0], [2, 3])
        .unwrap();
    let p = a.softmax(1).unwrap().to_vec::<f32>().unwrap();
    assert!(p.iter().all(|v| v.is_finite()), "{p:?}");
    assert!((p[0] + p[1] + p[2] - 1.0).abs() < 1e-6);
    let lp = a.log_softmax(1).unwrap().to_vec::<f32>().unwrap();
    assert!(lp.iter().all(|v| v.is_finite()), "{lp:?}");
    assert!(
        (lp[2] - (-2001.0 - (1.0f32 + (-1.0f32).exp()).ln())).abs() < 1e-2,
        "{lp:?}"
    );
    let cols = a.softmax(0).unwrap().to_vec::<f32>().unwrap();
    assert!(cols.iter().all(|v| v.is_finite()));
}

device_tests!(softmax_of_empty_arrays_is_empty);
fn softmax_of_empty_arrays_is_empty(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let a = mg.zeros([0, 4], DType::F32).unwrap();
    assert_eq!(a.softmax(-1).unwrap().dims(), &[0, 4]);
    let b = mg.zeros([3, 0], DType::F64).unwrap();
    assert_eq!(b.log_softmax(1).unwrap().dims(), &[3, 0]);
}

device_tests!(softmax_needs_floats_and_a_valid_axis);
fn softmax_needs_floats_and_a_valid_axis(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let ints = mg.zeros([2, 3], DType::I32).unwrap();
    assert!(matches!(ints.softmax(1), Err(Error::DTypeMismatch { .. })));
    assert!(matches!(
        ints.log_softmax(1),
        Err(Error::DTypeMismatch { .. })
    ));
    let f = mg.zeros([2, 3], DType::F32).unwrap();
    assert!(matches!(f.softmax(2), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        f.log_softmax(-3),
        Err(Error::InvalidArgument { .. })
    ));
}

device_tests!(one_hot_matches_the_reference_for_every_index_dtype);
fn one_hot_matches_the_reference_for_every_index_dtype(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    for from in [DType::I32, DType::I64, DType::U8] {
        for to in DType::ALL {
            for dims in [&[][..], &[1], &[7], &[3, 5], &[0], &[2, 0, 3], &[5000]] {
                let depth = 9;
                let idx: Vec<i64> = (0..size(dims)).map(|i| (i * 7 % depth) as i64).collect();
                let a = array(&mg, from, dims, &idx);
                let y = a.one_hot(depth, to).unwrap();
                let mut out = dims.to_vec();
                out.push(depth);
                assert_eq!(y.dims(), out.as_slice());
                assert_eq!(y.dtype(), to);
                let want: Vec<f64> = (0..size(&out))
                    .map(|p| f64::from(u8::from(idx[p / depth] == (p % depth) as i64)))
                    .collect();
                assert_eq!(as_f64(&y), want, "{from} -> {to} {dims:?}");
            }
        }
    }
    let empty_depth = mg
        .zeros([0], DType::I64)
        .unwrap()
        .one_hot(0, DType::F32)
        .unwrap();
    assert_eq!(empty_depth.dims(), &[0, 0]);
}

device_tests!(one_hot_index_out_of_range_or_negative_is_invalid);
fn one_hot_index_out_of_range_or_negative_is_invalid(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let a = mg.from_slice(&[0i64, 3, 1], [3]).unwrap();
    let err = common::refused(dev, a.one_hot(3, DType::F32));
    assert!(
        matches!(err, Error::InvalidArgument { op: "one_hot", .. }),
        "{err}"
    );
    assert!(err.to_string().contains("position 1"), "{err}");
    let b = mg.from_slice(&[0i32, -1], [2]).unwrap();
    assert!(matches!(
        common::refused(dev, b.one_hot(5, DType::F32)),
        Error::InvalidArgument { .. }
    ));
    let c = mg.from_slice(&[0u8], [1]).unwrap();
    assert!(matches!(
        c.one_hot(0, DType::U8),
        Err(Error::InvalidArgument { .. })
    ));
    let f = mg.zeros([3], DType::F32).unwrap();
    assert!(matches!(
        f.one_hot(3, DType::F32),
        Err(Error::DTypeMismatch { .. })
    ));
    // The input is untouched.
    assert_eq!(a.to_vec::<i64>().unwrap(), vec![0, 3, 1]);
}

/// `pick` by the definition: result[idx without axis] = x[idx with indices[..] at axis].
fn reference_pick(x: &[f64], dims: &[usize], ax: usize, idx: &[i64]) -> Vec<f64> {
    let outer: usize = dims[..ax].iter().product();
    let n = dims[ax];
    let inner: usize = dims[ax + 1..].iter().product();
    (0..outer * inner)
        .map(|p| {
            let (o, j) = (p / inner, p % inner);
            x[(o * n + idx[p] as usize) * inner + j]
        })
        .collect()
}

device_tests!(pick_gathers_one_element_per_row_along_any_axis);
fn pick_gathers_one_element_per_row_along_any_axis(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[4, 3],
        &[1, 33],
        &[2, 3, 4],
        &[1000, 10],
        &[0, 5],
    ];
    for dtype in DType::ALL {
        for from in [DType::I32, DType::I64, DType::U8] {
            for (s, &dims) in shapes.iter().enumerate() {
                let a = array(&mg, dtype, dims, &values(size(dims), 20 + s as u64));
                let x = as_f64(&a);
                for ax in 0..dims.len() {
                    let mut rest = dims.to_vec();
                    let n = rest.remove(ax);
                    if n == 0 {
                        // Every index is out of range of an empty axis.
                        let indices = mg.zeros(&rest[..], from).unwrap();
                        assert!(matches!(
                            a.pick(&indices, ax as isize),
                            Err(Error::InvalidArgument { .. })
                        ));
                        continue;
                    }
                    // Indices below 200 so they fit u8 too.
                    let idx: Vec<i64> = (0..size(&rest))
                        .map(|p| ((p * 5 + 3) % n.min(200)) as i64)
                        .collect();
                    let indices = array(&mg, from, &rest, &idx);
                    for axis in [ax as isize, ax as isize - dims.len() as isize] {
                        let got = a.pick(&indices, axis).unwrap();
                        assert_eq!(got.dims(), rest.as_slice());
                        assert_eq!(got.dtype(), dtype);
                        assert_eq!(
                            as_f64(&got),
                            reference_pick(&x, dims, ax, &idx),
                            "{dtype} {from} {dims:?} axis {axis}"
                        );
                    }
                }
            }
        }
    }
}

device_tests!(pick_takes_each_rows_label);
fn pick_takes_each_rows_label(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let probs = mg
        .from_slice(&[0.1f32, 0.7, 0.2, 0.3, 0.3, 0.4], [2, 3])
        .unwrap();
    let labels = mg.from_slice(&[1i64, 2], [2]).unwrap();
    assert_eq!(
        probs.pick(&labels, 1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.7, 0.4]
    );
    assert_eq!(
        probs.pick(&labels, -1).unwrap().to_vec::<f32>().unwrap(),
        vec![0.7, 0.4]
    );
}

device_tests!(pick_errors_name_the_problem);
fn pick_errors_name_the_problem(dev: Device) {
    let mg = Manager::new_base_on(dev).unwrap();
    let x = mg.zeros([2, 3], DType::F32).unwrap();
    let out_of_range = mg.from_slice(&[0i64, 3], [2]).unwrap();
    let err = common::refused(dev, x.pick(&out_of_range, 1));
    assert!(
        matches!(err, Error::InvalidArgument { op: "pick", .. }),
        "{err}"
    );
    let negative = mg.from_slice(&[-1i32, 0], [2]).unwrap();
    assert!(matches!(
        common::refused(dev, x.pick(&negative, 1)),
        Error::InvalidArgument { .. }
    ));
    let wrong_shape = mg.from_slice(&[0i64, 1, 1], [3]).unwrap();
    assert!(matches!(
        x.pick(&wrong_shape, 1),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(x.pick(&wrong_shape, 0).is_ok());
    let matrix = mg.zeros([2, 1], DType::I64).unwrap();
    assert!(matches!(
        x.pick(&matrix, 1),
        Err(Error::ShapeMismatch { .. })
    ));
    let floats = mg.zeros([2], DType::F32).unwrap();
    assert!(matches!(
        x.pick(&floats, 1),
        Err(Error::DTypeMismatch { .. })
    ));
    let ok = mg.zeros([2], DType::I64).unwrap();
    assert!(matches!(x.pick(&ok, 2), Err(Error::InvalidArgument { .. })));
    let s = mg.scalar(1.0f32).unwrap();
    assert!(matches!(s.pick(&ok, 0), Err(Error::InvalidArgument { .. })));
    ok.close().unwrap();
    assert!(matches!(x.pick(&ok, 1), Err(Error::ArrayClosed { .. })));
}

device_tests!(nn_results_land_with_the_first_inputs_owner);
fn nn_results_land_with_the_first_inputs_owner(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let batch = Manager::new_base_on(dev).unwrap();
    let x = batch.zeros([4, 3], DType::F32).unwrap();
    let w = model.zeros([3, 2], DType::F32).unwrap();
    let y = x.matmul(&w).unwrap();
    assert_eq!(y.manager().unwrap(), batch);
    let labels = batch.zeros([4], DType::I64).unwrap();
    assert_eq!(y.pick(&labels, 1).unwrap().manager().unwrap(), batch);
    model.cap();
    assert!(matches!(w.softmax(1), Err(Error::Capped { .. })));
}

device_tests!(op_results_in_a_reused_workspace_never_show_stale_bytes);
fn op_results_in_a_reused_workspace_never_show_stale_bytes(dev: Device) {
    use ndscope::{concat, LearningPolicy, WorkspaceConfig};
    // A fixed block: the second cycle's results land exactly where the first cycle left
    // garbage (same sizes, same order), so any element an op forgot to write would show it.
    let trainer = Manager::new_base_on(dev).unwrap();
    let conf = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(1 << 20)
        .build()
        .unwrap();
    let ws = trainer.workspace("ops", conf).unwrap();
    type Step = fn(&Manager, &[NDArray]) -> Vec<NDArray>;
    let inputs = |m: &Manager| -> Vec<NDArray> {
        vec![
            m.from_slice(&[1.0f32, 5.0, 3.0, 2.0, 0.0, 4.0], [2, 3])
                .unwrap(),
            m.from_slice(&[2i64, 0], [2]).unwrap(),
            m.zeros([3, 0], DType::F32).unwrap(),
            m.zeros([0, 2], DType::F32).unwrap(),
        ]
    };
    let garbage: Step = |m, _| {
        let g = |shape: &[usize], dtype| m.full(shape, 7.0, dtype).unwrap();
        vec![
            g(&[2], DType::F32),
            g(&[3], DType::F32),
            g(&[2], DType::F32),
            g(&[3], DType::I64),
            g(&[2, 3], DType::F32),
            g(&[2, 4], DType::F64),
            g(&[2], DType::F32),
            g(&[3, 2], DType::F32),
            g(&[4, 3], DType::F32),
            g(&[2, 3], DType::U8),
            g(&[3, 2], DType::F32),
        ]
    };
    let real: Step = |_, x| {
        vec![
            x[0].sum(&[1], false).unwrap(),
            x[0].mean(&[0], false).unwrap(),
            x[0].max(1, false).unwrap(),
            x[0].argmax(0).unwrap(),
            x[0].softmax(1).unwrap(),
            x[1].one_hot(4, DType::F64).unwrap(),
            x[0].pick(&x[1], 1).unwrap(),
            x[0].transpose().unwrap(),
            concat(&[x[0].clone(), x[0].clone()], 0).unwrap(),
            x[0].gt_scalar(2.0).unwrap(),
            x[2].matmul(&x[3]).unwrap(),
        ]
    };
    for (cycle, step) in [garbage, real].into_iter().enumerate() {
        let got = ws
            .cycle(|m| {
                let x = inputs(m);
                let out = step(m, &x);
                Ok(out.iter().map(as_f64).collect::<Vec<_>>())
            })
            .unwrap();
        if cycle == 1 {
            let e = |v: f64| v.exp();
            let (s0, s1) = (e(1.0) + e(5.0) + e(3.0), e(2.0) + e(0.0) + e(4.0));
            let softmax: Vec<f64> = [
                e(1.0) / s0,
                e(5.0) / s0,
                e(3.0) / s0,
                e(2.0) / s1,
                e(0.0) / s1,
                e(4.0) / s1,
            ]
            .to_vec();
            assert_eq!(got[0], vec![9.0, 6.0]);
            assert_eq!(got[1], vec![1.5, 2.5, 3.5]);
            assert_eq!(got[2], vec![5.0, 4.0]);
            assert_eq!(got[3], vec![1.0, 0.0, 1.0]);
            assert_close(&got[4], &softmax, 1e-6, "softmax");
            assert_eq!(got[5], vec![0.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
            assert_eq!(got[6], vec![3.0, 2.0]);
            assert_eq!(got[7], vec![1.0, 2.0, 5.0, 0.0, 3.0, 4.0]);
            assert_eq!(got[8], [[1.0, 5.0, 3.0, 2.0, 0.0, 4.0]; 2].concat());
            assert_eq!(got[9], vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0]);
            assert_eq!(got[10], vec![0.0; 6]);
        }
    }
    let stats = ws.stats();
    assert_eq!(stats.spilled_count, 0, "{stats:?}");
    assert_eq!(stats.cycles, 2);
    trainer.close().unwrap();
}

/// `x` (`[rows, cols]`, row-major) transposed.
fn transposed(x: &[f64], rows: usize, cols: usize) -> Vec<f64> {
    (0..rows * cols)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

device_tests!(matmul_t_reads_transposed_operands_without_copies_and_matches_the_reference);
fn matmul_t_reads_transposed_operands_without_copies_and_matches_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    // Short results (m ≤ n/8) and tall ones take different routes inside: cover both.
    for &(rows, k, n) in &[
        (3, 5, 7),
        (16, 64, 200),
        (40, 33, 48),
        (1, 9, 1024),
        (70, 1, 8),
    ] {
        for dtype in [DType::F32, DType::F64, DType::I64] {
            let (av, bv) = (values(rows * k, 1), values(k * n, 2));
            let (af, bf): (Vec<f64>, Vec<f64>) = (
                av.iter().map(|&v| v as f64).collect(),
                bv.iter().map(|&v| v as f64).collect(),
            );
            let expect = reference_matmul(rows, k, n, &af, &bf);
            for t in [
                Transpose::None,
                Transpose::Left,
                Transpose::Right,
                Transpose::Both,
            ] {
                // Store each operand the way `t` says it is read.
                let (a_store, a_shape) = match t {
                    Transpose::Left | Transpose::Both => (transposed(&af, rows, k), [k, rows]),
                    _ => (af.clone(), [rows, k]),
                };
                let (b_store, b_shape) = match t {
                    Transpose::Right | Transpose::Both => (transposed(&bf, k, n), [n, k]),
                    _ => (bf.clone(), [k, n]),
                };
                let to_i = |v: &[f64]| -> Vec<i64> { v.iter().map(|&x| x as i64).collect() };
                let a = array(&m, dtype, &a_shape, &to_i(&a_store));
                let b = array(&m, dtype, &b_shape, &to_i(&b_store));
                let c = a.matmul_t(&b, t).unwrap();
                assert_eq!(c.dims(), &[rows, n], "{t:?} {rows}×{k}×{n} {dtype}");
                assert_eq!(as_f64(&c), expect, "{t:?} {rows}×{k}×{n} {dtype}");
            }
        }
    }
    m.close().unwrap();
}

device_tests!(matmul_t_temporaries_are_placed_like_the_result_and_closed);
fn matmul_t_temporaries_are_placed_like_the_result_and_closed(dev: Device) {
    // A capped model owns w; the batch owns g. Without an active scope the result goes to g's
    // owner, and so must every temporary the product makes internally (never the model).
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.ones([1024, 64], DType::F32).unwrap(); // read as wᵀ: [64, 1024]
    model.cap();
    let batch = Manager::new_base_on(dev).unwrap();
    for rows in [4, 512] {
        let g = batch.ones([rows, 64], DType::F32).unwrap();
        let y = g.matmul_t(&w, Transpose::Right).unwrap();
        assert_eq!(y.dims(), &[rows, 1024]);
        assert_eq!(y.manager().unwrap(), batch);
        assert!(y.to_vec::<f32>().unwrap().iter().all(|&v| v == 64.0));
        let report = batch.report();
        assert_eq!(
            report.arrays.len(),
            2,
            "g and y only: no temporary left behind"
        );
        y.close().unwrap();
        g.close().unwrap();
    }
    assert_eq!(model.report().arrays.len(), 1);
    model.close().unwrap();
    batch.close().unwrap();
}

device_tests!(matmul_t_errors_name_the_transposed_shapes);
fn matmul_t_errors_name_the_transposed_shapes(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.ones([2, 3], DType::F32).unwrap();
    let b = m.ones([2, 3], DType::F32).unwrap();
    assert!(a.matmul_t(&b, Transpose::Right).is_ok(), "[2,3]·[3,2]");
    assert!(a.matmul_t(&b, Transpose::Left).is_ok(), "[3,2]·[2,3]");
    let err = a.matmul_t(&b, Transpose::None).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("inner dimensions 3 and 2"),
        "{err}"
    );
    let v = m.ones([4], DType::F32).unwrap();
    assert!(matches!(
        a.matmul_t(&v, Transpose::Right),
        Err(Error::ShapeMismatch { .. })
    ));
    let i = m.ones([2, 3], DType::I32).unwrap();
    assert!(matches!(
        a.matmul_t(&i, Transpose::Right),
        Err(Error::DTypeMismatch { .. })
    ));
    m.close().unwrap();
}

device_tests!(addmm_accumulates_the_product_in_place);
fn addmm_accumulates_the_product_in_place(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for &(rows, k, n) in &[(7, 3, 5), (64, 16, 96), (1, 1, 1)] {
        for dtype in [DType::F32, DType::F64, DType::I32] {
            let (av, bv, cv) = (values(k * rows, 3), values(k * n, 4), values(rows * n, 5));
            let af: Vec<f64> = av.iter().map(|&v| v as f64).collect();
            let bf: Vec<f64> = bv.iter().map(|&v| v as f64).collect();
            // a is stored [k, rows] and read transposed: the weight-gradient shape xᵀ·g.
            let product = reference_matmul(rows, k, n, &transposed(&af, k, rows), &bf);
            let a = array(&m, dtype, &[k, rows], &av);
            let b = array(&m, dtype, &[k, n], &bv);
            let c = array(&m, dtype, &[rows, n], &cv);
            c.addmm_(&a, &b, Transpose::Left, 2.0, 3.0).unwrap();
            let want: Vec<f64> = cv
                .iter()
                .zip(&product)
                .map(|(&c, &p)| 2.0 * c as f64 + 3.0 * p)
                .collect();
            assert_eq!(as_f64(&c), want, "{rows}×{k}×{n} {dtype}");
        }
    }
    m.close().unwrap();
}

device_tests!(failed_addmm_changes_nothing_and_allocates_nothing);
fn failed_addmm_changes_nothing_and_allocates_nothing(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.ones([4, 3], DType::F32).unwrap();
    let g = m.ones([4, 5], DType::F32).unwrap();
    let v = m.full([3, 5], 7.0, DType::F32).unwrap();
    m.cap(); // in-place ops must not need a new array
    let cases = [
        v.addmm_(&x, &g, Transpose::None, 1.0, 1.0).unwrap_err(), // [4,3]·[4,5]: inner 3 ≠ 4
        v.addmm_(&g, &x, Transpose::Left, 1.0, 1.0).unwrap_err(), // product [5,3] ≠ [3,5]
        v.addmm_(&v, &g, Transpose::None, 1.0, 1.0).unwrap_err(), // target is an operand
    ];
    assert!(
        matches!(cases[0], Error::ShapeMismatch { .. }),
        "{}",
        cases[0]
    );
    assert!(
        matches!(cases[1], Error::ShapeMismatch { .. }),
        "{}",
        cases[1]
    );
    assert!(
        matches!(cases[2], Error::InvalidArgument { .. }),
        "{}",
        cases[2]
    );
    let i = m.ones([3, 5], DType::I32);
    assert!(matches!(i, Err(Error::Capped { .. })));
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![7.0; 15]);
    v.addmm_(&x, &g, Transpose::Left, 0.5, 1.0).unwrap();
    assert_eq!(
        v.to_vec::<f32>().unwrap(),
        vec![7.5; 15],
        "0.5·7 + (xᵀ·g = 4)"
    );
    m.close().unwrap();
}

device_tests!(integer_addmm_refuses_fractional_scales);
fn integer_addmm_refuses_fractional_scales(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.ones([2, 2], DType::I64).unwrap();
    let c = m.ones([2, 2], DType::I64).unwrap();
    let err = c.addmm_(&a, &a, Transpose::None, 0.5, 1.0).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert_eq!(c.to_vec::<i64>().unwrap(), vec![1; 4]);
    c.addmm_(&a, &a, Transpose::None, 1.0, 2.0).unwrap();
    assert_eq!(c.to_vec::<i64>().unwrap(), vec![5; 4]);
    m.close().unwrap();
}

/// `v ← μ·v + xᵀ·g; w ← w − lr·v` by the definition, in f64.
fn reference_sgd(
    (fan_in, batch, fan_out): (usize, usize, usize),
    x: &[f64],
    g: &[f64],
    v: &[f64],
    w: &[f64],
    lr: f64,
    momentum: f64,
) -> (Vec<f64>, Vec<f64>) {
    let grad = reference_matmul(fan_in, batch, fan_out, &transposed(x, batch, fan_in), g);
    let v: Vec<f64> = v
        .iter()
        .zip(&grad)
        .map(|(&v, &d)| if momentum == 0.0 { d } else { momentum * v + d })
        .collect();
    let w = w.iter().zip(&v).map(|(&w, &v)| w - lr * v).collect();
    (v, w)
}

device_tests!(sgd_dense_update_is_addmm_then_axpy_in_one_pass);
fn sgd_dense_update_is_addmm_then_axpy_in_one_pass(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    // Batches inside the fused kernel's range (f32) and past it, ragged and vector-sized widths.
    for &(fan_in, batch, fan_out) in &[
        (7, 3, 5),
        (64, 16, 96),
        (33, 64, 130),
        (5, 100, 3),
        (1, 1, 1),
    ] {
        for dtype in [DType::F32, DType::F64] {
            for momentum in [0.5, 0.0] {
                let (xv, gv) = (values(batch * fan_in, 6), values(batch * fan_out, 7));
                let (vv, wv) = (values(fan_in * fan_out, 8), values(fan_in * fan_out, 9));
                let f = |v: &[i64]| -> Vec<f64> { v.iter().map(|&v| v as f64).collect() };
                let x = array(&m, dtype, &[batch, fan_in], &xv);
                let g = array(&m, dtype, &[batch, fan_out], &gv);
                let v = array(&m, dtype, &[fan_in, fan_out], &vv);
                let w = array(&m, dtype, &[fan_in, fan_out], &wv);
                if momentum == 0.0 {
                    v.fill_(f64::NAN).unwrap(); // without momentum the old velocity is not read
                }
                w.sgd_dense_update_(&v, &x, &g, 0.25, momentum).unwrap();
                let (want_v, want_w) = reference_sgd(
                    (fan_in, batch, fan_out),
                    &f(&xv),
                    &f(&gv),
                    &f(&vv),
                    &f(&wv),
                    0.25,
                    momentum,
                );
                // Inputs in -8..=8, batches ≤ 100 and power-of-two factors keep every value
                // exact in f32 and f64, whatever the order of summation.
                let case = format!("{fan_in}×{batch}×{fan_out} {dtype} μ {momentum}");
                assert_eq!(as_f64(&v), want_v, "velocity, {case}");
                assert_eq!(as_f64(&w), want_w, "weights, {case}");
            }
        }
    }
    m.close().unwrap();
}

device_tests!(failed_sgd_dense_update_changes_nothing);
fn failed_sgd_dense_update_changes_nothing(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.ones([4, 3], DType::F32).unwrap();
    let g = m.ones([4, 5], DType::F32).unwrap();
    let v = m.full([3, 5], 7.0, DType::F32).unwrap();
    let w = m.full([3, 5], 1.0, DType::F32).unwrap();
    let x64 = m.ones([4, 3], DType::F64).unwrap();
    let wi = m.ones([3, 5], DType::I32).unwrap();
    let vi = m.ones([3, 5], DType::I32).unwrap();
    let (xi, gi) = (
        m.ones([4, 3], DType::I32).unwrap(),
        m.ones([4, 5], DType::I32).unwrap(),
    );
    let short_g = m.ones([2, 5], DType::F32).unwrap();
    let closed = m.ones([4, 3], DType::F32).unwrap();
    closed.close().unwrap();
    m.cap(); // in-place: must not need a new array
    type Kind = fn(&Error) -> bool;
    let shape: Kind = |e| matches!(e, Error::ShapeMismatch { .. });
    let invalid: Kind = |e| matches!(e, Error::InvalidArgument { .. });
    let dtype: Kind = |e| matches!(e, Error::DTypeMismatch { .. });
    let closed_err: Kind = |e| matches!(e, Error::ArrayClosed { .. });
    let cases: Vec<(Error, Kind)> = vec![
        (
            w.sgd_dense_update_(&v, &g, &x, 0.1, 0.9).unwrap_err(),
            shape,
        ), // x and g swapped
        (
            w.sgd_dense_update_(&v, &x, &short_g, 0.1, 0.9).unwrap_err(),
            shape,
        ), // batch 4 ≠ 2
        (
            w.sgd_dense_update_(&x, &x, &g, 0.1, 0.9).unwrap_err(),
            invalid,
        ), // velocity is x
        (
            w.sgd_dense_update_(&w, &x, &g, 0.1, 0.9).unwrap_err(),
            invalid,
        ), // velocity is w
        (
            w.sgd_dense_update_(&v, &x, &g, f64::NAN, 0.9).unwrap_err(),
            invalid,
        ),
        (
            w.sgd_dense_update_(&v, &x, &g, 0.1, f64::INFINITY)
                .unwrap_err(),
            invalid,
        ),
        (
            w.sgd_dense_update_(&v, &x64, &g, 0.1, 0.9).unwrap_err(),
            dtype,
        ),
        (
            wi.sgd_dense_update_(&vi, &xi, &gi, 0.1, 0.9).unwrap_err(),
            dtype,
        ), // floats only
        (
            w.sgd_dense_update_(&v, &closed, &g, 0.1, 0.9).unwrap_err(),
            closed_err,
        ),
    ];
    for (i, (err, kind)) in cases.iter().enumerate() {
        assert!(kind(err), "case {i}: {err}");
        assert!(
            err.to_string().contains("sgd_dense_update_"),
            "case {i} names the op: {err}"
        );
    }
    assert_eq!(v.to_vec::<f32>().unwrap(), vec![7.0; 15]);
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0; 15]);
    w.sgd_dense_update_(&v, &x, &g, 0.5, 0.5).unwrap();
    assert_eq!(
        v.to_vec::<f32>().unwrap(),
        vec![7.5; 15],
        "0.5·7 + (xᵀ·g = 4)"
    );
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![1.0 - 0.5 * 7.5; 15]);
    m.close().unwrap();
}
