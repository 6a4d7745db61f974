//! `NDArray::softmax_cross_entropy`, the fused loss: its value against the composed ops
//! (`log_softmax(1).pick(labels, 1).mean_all().neg()`) for f32 and f64, many shapes, every label
//! dtype and extreme logits; its gradient through `backward` (with and without a seed, at the
//! root and inside a graph) against the composed path's; CPU and CUDA agreeing; the errors
//! (labels out of range, shapes, dtypes, devices), after which nothing was created; where its
//! arrays go, and the check of the gradient it saves; and, on the simulated GPU, what it costs:
//! one launch forward, no launch and no copy for the seed and its own backward. The tests take
//! turns (`turn`).

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{DType, Device, Error, Manager, NDArray};

mod common;
use common::{as_f64, device_tests, sim};

/// The tests take turns: the simulated GPU's counters are process-wide, so the test that reads
/// them must not see another test's launches (and the others are short).
static SERIAL: Mutex<()> = Mutex::new(());

fn turn() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Logits `[rows, classes]` of `dtype` from deterministic values in [-4, 4] (exact in f32).
fn logits(m: &Manager, dtype: DType, rows: usize, classes: usize, seed: u64) -> NDArray {
    let vals = common::values(rows * classes, seed, 1024);
    common::array(m, dtype, &[rows, classes], &vals, 1.0 / 256.0)
}

/// Labels `[rows]` of `dtype` in `0..classes`.
fn labels(m: &Manager, dtype: DType, rows: usize, classes: usize, seed: u64) -> NDArray {
    let vals: Vec<i64> = common::values(rows, seed ^ 0x1abe1, 1 << 20)
        .into_iter()
        .map(|v| v.rem_euclid(classes.max(1) as i64))
        .collect();
    common::array(m, dtype, &[rows], &vals, 1.0)
}

/// The loss composed from the public ops.
fn composed(x: &NDArray, labels: &NDArray) -> ndscope::Result<NDArray> {
    x.log_softmax(1)?.pick(labels, 1)?.mean_all()?.neg()
}

/// Machine epsilon of a float dtype.
fn eps(dtype: DType) -> f64 {
    if dtype == DType::F32 {
        f64::from(f32::EPSILON)
    } else {
        f64::EPSILON
    }
}

/// `a` and `b` within `ulps` units of the last place of the larger (or of 1), NaNs equal.
fn assert_close(a: &[f64], b: &[f64], dtype: DType, ulps: f64, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (&x, &y)) in a.iter().zip(b).enumerate() {
        if x.is_nan() && y.is_nan() {
            continue;
        }
        let tol = ulps * eps(dtype) * x.abs().max(y.abs()).max(1.0);
        assert!(
            (x - y).abs() <= tol,
            "{what}: element {i}: {x} vs {y} (tolerance {tol})"
        );
    }
}

const SHAPES: &[(usize, usize)] = &[
    (1, 1),
    (1, 7),
    (5, 1),
    (16, 10),
    (3, 1000),
    (300, 7),
    (2, 300),
];

// ---------------------------------------------------------------------------------------------
// Values

device_tests!(loss_equals_the_composed_ops);
fn loss_equals_the_composed_ops(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        for &(rows, classes) in SHAPES {
            for label_dtype in [DType::I32, DType::I64, DType::U8] {
                if label_dtype == DType::U8 && classes > 256 {
                    continue;
                }
                let seed = (rows * 31 + classes) as u64;
                let x = logits(&m, dtype, rows, classes, seed);
                let l = labels(&m, label_dtype, rows, classes, seed);
                let loss = x.softmax_cross_entropy(&l).unwrap();
                assert_eq!(loss.dims(), &[] as &[usize]);
                assert_eq!(loss.dtype(), dtype);
                assert_eq!(loss.device(), dev);
                let what = format!("{dtype} [{rows}, {classes}] labels {label_dtype} on {dev}");
                let expected = as_f64(&composed(&x, &l).unwrap());
                assert_close(&as_f64(&loss), &expected, dtype, 4.0, &what);
                assert!(
                    as_f64(&loss)[0] >= 0.0,
                    "{what}: a cross-entropy is not negative"
                );
            }
        }
    }
    m.close().unwrap();
}

device_tests!(extreme_logits_stay_finite);
fn extreme_logits_stay_finite(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        // Rows of ±1e30 (the label on the large or the small side), one NaN-free tie row.
        let vals = [
            1e30, -1e30, 0.0, //
            -1e30, 1e30, -1e30, //
            1e30, 1e30, -1e30, //
        ];
        let x = match dtype {
            DType::F32 => m.from_vec(vals.iter().map(|&v| v as f32).collect(), [3, 3]),
            _ => m.from_vec(vals.to_vec(), [3, 3]),
        }
        .unwrap();
        let l = m.from_slice(&[0i64, 0, 1], [3]).unwrap();
        let loss = x.softmax_cross_entropy(&l).unwrap();
        let value = as_f64(&loss)[0];
        // Row 0: 0; row 1: 2e30; row 2: ln 2 (negligible next to 2e30).
        assert!(value.is_finite(), "{dtype} on {dev}: {value}");
        assert_close(&[value], &[2e30 / 3.0], dtype, 4.0, "extreme logits");
        assert_close(
            &[value],
            &as_f64(&composed(&x, &l).unwrap()),
            dtype,
            4.0,
            "extreme logits against the composed ops",
        );
        // The gradient is finite too.
        let p = m.sub_scope().unwrap();
        let leaf = x.duplicate().unwrap();
        leaf.attach(&p).unwrap();
        leaf.set_requires_gradient(true).unwrap();
        let c = p.gradient_collector().unwrap();
        let loss = leaf.softmax_cross_entropy(&l).unwrap();
        c.backward(&loss).unwrap();
        drop(c);
        let g = as_f64(&leaf.gradient().unwrap());
        assert!(g.iter().all(|v| v.is_finite()), "{dtype} on {dev}: {g:?}");
        let third = 1.0 / 3.0;
        let expected = [
            0.0,
            0.0,
            0.0, //
            -third,
            third,
            0.0, //
            third / 2.0,
            -third / 2.0,
            0.0, //
        ];
        assert_close(&g, &expected, dtype, 4.0, "gradient of extreme logits");
        drop(p);
    }
    m.close().unwrap();
}

device_tests!(no_rows_give_nan_as_the_mean_of_nothing);
fn no_rows_give_nan_as_the_mean_of_nothing(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.zeros([0, 4], DType::F32).unwrap();
    let l = m.from_vec(Vec::<i64>::new(), [0]).unwrap();
    let loss = x.softmax_cross_entropy(&l).unwrap();
    assert!(as_f64(&loss)[0].is_nan());
    assert!(as_f64(&composed(&x, &l).unwrap())[0].is_nan());
    m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Gradients

/// The gradient of `loss_of(leaf)` with respect to a leaf holding `x`'s values, with
/// `backward(&loss)`, or `backward_with(&loss, seed)` when `seed` is given.
fn gradient_of(
    x: &NDArray,
    seed: Option<f64>,
    loss_of: impl Fn(&NDArray) -> ndscope::Result<NDArray>,
) -> Vec<f64> {
    let m = x.manager().unwrap();
    let step = m.sub_scope().unwrap();
    let leaf = x.duplicate().unwrap();
    leaf.attach(&step).unwrap();
    leaf.set_requires_gradient(true).unwrap();
    {
        let _active = step.activate();
        let c = step.gradient_collector().unwrap();
        let loss = loss_of(&leaf).unwrap();
        match seed {
            None => c.backward(&loss).unwrap(),
            Some(s) => {
                let seed = step.full(loss.shape().clone(), s, loss.dtype()).unwrap();
                c.backward_with(&loss, &seed).unwrap();
            }
        }
    }
    let g = as_f64(&leaf.gradient().unwrap());
    step.close().unwrap();
    g
}

device_tests!(gradient_equals_the_composed_path);
fn gradient_equals_the_composed_path(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        for &(rows, classes) in SHAPES {
            let seed = (rows * 7 + classes) as u64;
            let x = logits(&m, dtype, rows, classes, seed);
            let l = labels(&m, DType::I64, rows, classes, seed);
            let what = format!("{dtype} [{rows}, {classes}] on {dev}");
            // At the root, the implicit seed of ones.
            let fused = gradient_of(&x, None, |x| x.softmax_cross_entropy(&l));
            let expected = gradient_of(&x, None, |x| composed(x, &l));
            assert_close(&fused, &expected, dtype, 4.0, &what);
            // An explicit seed multiplies.
            let seeded = gradient_of(&x, Some(2.5), |x| x.softmax_cross_entropy(&l));
            let expected = gradient_of(&x, Some(2.5), |x| composed(x, &l));
            assert_close(&seeded, &expected, dtype, 4.0, &format!("{what}, seeded"));
            // Inside a graph: the loss scaled and added to another term, the logits computed.
            let inner = |ce: &dyn Fn(&NDArray) -> ndscope::Result<NDArray>, x: &NDArray| {
                let z = x.tanh()?;
                ce(&z)?.mul_scalar(3.0)?.add(&x.square()?.mean_all()?)
            };
            let fused = gradient_of(&x, None, |x| inner(&|z| z.softmax_cross_entropy(&l), x));
            let expected = gradient_of(&x, None, |x| inner(&|z| composed(z, &l), x));
            assert_close(
                &fused,
                &expected,
                dtype,
                16.0,
                &format!("{what}, in a graph"),
            );
        }
    }
    m.close().unwrap();
}

#[test]
fn gradient_is_finite_differences_of_the_loss() {
    let _turn = turn();
    let m = Manager::new_base();
    let (rows, classes) = (3, 5);
    let x = logits(&m, DType::F64, rows, classes, 11);
    let l = labels(&m, DType::U8, rows, classes, 11);
    let g = gradient_of(&x, None, |x| x.softmax_cross_entropy(&l));
    let base: Vec<f64> = x.to_vec().unwrap();
    let h = 1e-6;
    for (i, &gi) in g.iter().enumerate() {
        let at = |d: f64| {
            let mut v = base.clone();
            v[i] += d;
            let x = m.from_vec(v, [rows, classes]).unwrap();
            x.softmax_cross_entropy(&l)
                .unwrap()
                .to_vec::<f64>()
                .unwrap()[0]
        };
        let fd = (at(h) - at(-h)) / (2.0 * h);
        assert!((fd - gi).abs() < 1e-8, "element {i}: {gi} vs {fd}");
    }
    m.close().unwrap();
}

#[test]
fn cpu_and_cuda_agree() {
    let _turn = turn();
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let cpu = Manager::new_base();
    let gpu = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        for &(rows, classes) in SHAPES {
            let seed = (rows * 13 + classes) as u64;
            let x = logits(&cpu, dtype, rows, classes, seed);
            let l = labels(&cpu, DType::I32, rows, classes, seed);
            let (xd, ld) = (x.to_device(dev).unwrap(), l.to_device(dev).unwrap());
            let what = format!("{dtype} [{rows}, {classes}]");
            let host = as_f64(&x.softmax_cross_entropy(&l).unwrap());
            let device = as_f64(&xd.softmax_cross_entropy(&ld).unwrap());
            assert_close(&device, &host, dtype, 4.0, &what);
            let host = gradient_of(&x, None, |x| x.softmax_cross_entropy(&l));
            let device = gradient_of(&xd, None, |x| x.softmax_cross_entropy(&ld));
            assert_close(&device, &host, dtype, 4.0, &format!("{what}, gradient"));
        }
    }
    gpu.close().unwrap();
    cpu.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Where the arrays go, and the saved gradient's check

device_tests!(saved_gradient_is_an_op_result_made_only_when_recorded);
fn saved_gradient_is_an_op_result_made_only_when_recorded(dev: Device) {
    let _turn = turn();
    let model = Manager::new_base_on(dev).unwrap();
    let x = logits(&model, DType::F32, 4, 6, 3);
    let l = labels(&model, DType::I64, 4, 6, 3);
    x.set_requires_gradient(true).unwrap();
    // Not recording: the loss alone, in the active scope.
    let step = model.sub_scope().unwrap();
    {
        let _active = step.activate();
        let _loss = x.softmax_cross_entropy(&l).unwrap();
    }
    let report = step.report();
    assert_eq!(report.arrays.len(), 1, "{report:?}");
    assert_eq!(report.arrays[0].shape.dims(), &[] as &[usize]);
    drop(step);
    // Recording: the loss and the saved gradient, both in the active scope; nothing else.
    let step = model.sub_scope().unwrap();
    {
        let _active = step.activate();
        let c = step.gradient_collector().unwrap();
        let loss = x.softmax_cross_entropy(&l).unwrap();
        let report = step.report();
        let mut shapes: Vec<Vec<usize>> = report
            .arrays
            .iter()
            .map(|a| a.shape.dims().to_vec())
            .collect();
        shapes.sort();
        assert_eq!(shapes, vec![vec![], vec![4, 6]], "{report:?}");
        let before = model.report().arrays.len();
        c.backward(&loss).unwrap();
        // backward at the root made no temporary: only the model's gradient was written.
        assert_eq!(step.report().arrays.len(), 2);
        assert_eq!(model.report().arrays.len(), before);
    }
    drop(step);
    model.close().unwrap();
}

device_tests!(a_closed_saved_gradient_fails_backward_naming_the_op);
fn a_closed_saved_gradient_fails_backward_naming_the_op(dev: Device) {
    let _turn = turn();
    let model = Manager::new_base_on(dev).unwrap();
    let x = logits(&model, DType::F32, 4, 6, 5);
    let l = labels(&model, DType::I64, 4, 6, 5);
    x.set_requires_gradient(true).unwrap();
    let outer = model.sub_scope().unwrap();
    let c = outer.gradient_collector().unwrap();
    // The loss is kept in `outer`; the saved gradient stays in `inner`, which closes.
    let inner = outer.sub_scope().unwrap();
    let loss = {
        let _active = inner.activate();
        x.softmax_cross_entropy(&l).unwrap()
    };
    loss.attach(&outer).unwrap();
    drop(inner);
    let e = c.backward(&loss).unwrap_err();
    match &e {
        Error::ArrayClosed { reason, .. } => {
            assert!(
                reason.contains("`softmax_cross_entropy`") && reason.contains("saved it"),
                "{e}"
            );
        }
        other => panic!("expected ArrayClosed for the saved gradient, got {other}"),
    }
    // Nothing was accumulated.
    assert!(as_f64(&x.gradient().unwrap()).iter().all(|&v| v == 0.0));
    drop(c);
    drop(outer);
    model.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Errors

/// The op and reason of an `InvalidArgument`.
fn invalid(e: &Error) -> (&'static str, String) {
    match e {
        Error::InvalidArgument { op, reason, .. } => (op, reason.clone()),
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

device_tests!(labels_out_of_range_are_invalid_argument);
fn labels_out_of_range_are_invalid_argument(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    let x = logits(&m, DType::F32, 4, 5, 1);
    let bad: [(NDArray, i64); 3] = [
        (m.from_slice(&[0i64, 4, -1, 2], [4]).unwrap(), -1),
        (m.from_slice(&[0i32, 4, 5, 2], [4]).unwrap(), 5),
        (m.from_slice(&[1u8, 0, 200, 9], [4]).unwrap(), 200),
    ];
    for (l, value) in &bad {
        let before = m.report().arrays.len();
        let e = common::refused(dev, x.softmax_cross_entropy(l));
        let (op, reason) = invalid(&e);
        assert_eq!(op, "softmax_cross_entropy");
        assert!(reason.contains("flat position 2"), "{reason}");
        assert!(reason.contains("the number of classes, 5"), "{reason}");
        if dev == Device::Cpu {
            // The host names the value too (as `pick` does there), and creates nothing.
            assert!(reason.contains(&format!("index {value} ")), "{reason}");
        }
        assert_eq!(m.report().arrays.len(), before, "{e}");
    }
    // No classes: every label is out of range.
    let empty = m.zeros([2, 0], DType::F32).unwrap();
    let l = m.from_slice(&[0i64, 0], [2]).unwrap();
    let e = empty.softmax_cross_entropy(&l).unwrap_err();
    assert!(invalid(&e).1.contains("flat position 0"), "{e}");
    m.close().unwrap();
}

device_tests!(bad_shapes_dtypes_and_devices_create_nothing);
fn bad_shapes_dtypes_and_devices_create_nothing(dev: Device) {
    let _turn = turn();
    let m = Manager::new_base_on(dev).unwrap();
    let x = logits(&m, DType::F32, 4, 5, 2);
    let l = labels(&m, DType::I64, 4, 5, 2);
    let before = m.report().arrays.len();
    let cases: Vec<(&str, ndscope::Result<NDArray>)> = vec![
        (
            "1-D logits",
            m.zeros([5], DType::F32).and_then(|v| {
                let before = m.report().arrays.len();
                let r = v.softmax_cross_entropy(&l);
                assert_eq!(m.report().arrays.len(), before);
                v.close()?;
                r
            }),
        ),
        ("3-D logits", {
            let v = x.reshape([4, 5, 1]).unwrap();
            let r = v.softmax_cross_entropy(&l);
            v.close().unwrap();
            r
        }),
        ("labels of 3 rows", {
            let l3 = labels(&m, DType::I64, 3, 5, 2);
            let r = x.softmax_cross_entropy(&l3);
            l3.close().unwrap();
            r
        }),
        ("2-D labels", {
            let l2 = l.reshape([4, 1]).unwrap();
            let r = x.softmax_cross_entropy(&l2);
            l2.close().unwrap();
            r
        }),
        ("integer logits", {
            let xi = x.to_dtype(DType::I32).unwrap();
            let r = xi.softmax_cross_entropy(&l);
            xi.close().unwrap();
            r
        }),
        ("float labels", {
            let lf = l.to_dtype(DType::F32).unwrap();
            let r = x.softmax_cross_entropy(&lf);
            lf.close().unwrap();
            r
        }),
    ];
    for (what, result) in cases {
        let e = result.expect_err(what);
        let ok = match what {
            "integer logits" | "float labels" => matches!(e, Error::DTypeMismatch { .. }),
            _ => matches!(e, Error::ShapeMismatch { .. }),
        };
        assert!(ok, "{what}: {e}");
        assert!(
            e.to_string().contains("softmax_cross_entropy"),
            "{what}: {e}"
        );
    }
    assert_eq!(m.report().arrays.len(), before);
    if dev != Device::Cpu {
        let host = Manager::new_base();
        let lh = labels(&host, DType::I64, 4, 5, 2);
        let e = x.softmax_cross_entropy(&lh).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
        assert_eq!(m.report().arrays.len(), before);
        assert_eq!(host.report().arrays.len(), 1);
        host.close().unwrap();
    }
    m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// What it costs on the simulated GPU

#[test]
fn one_launch_forward_and_none_for_its_backward_on_the_simulator() {
    let _turn = turn();
    let Some(dev) = common::cuda_device() else {
        return;
    };
    if sim::stats().is_none() {
        println!("skipped: the launch counts need the simulated GPU");
        return;
    }
    let model = Manager::new_base_on(dev).unwrap();
    let (rows, classes) = (16, 10);
    let x = logits(&model, DType::F32, rows, classes, 9);
    let l = labels(&model, DType::I64, rows, classes, 9);
    x.set_requires_gradient(true).unwrap();
    let count = |f: &dyn Fn()| {
        dev.synchronize().unwrap();
        let before = sim::stats().unwrap();
        f();
        let after = sim::stats().unwrap();
        dev.synchronize().unwrap();
        sim::diff(&before, &after)
    };
    let step = model.sub_scope().unwrap();
    let _active = step.activate();
    // Warm: kernels loaded, check flag made, memory cached.
    for _ in 0..2 {
        let c = step.gradient_collector().unwrap();
        let loss = x.softmax_cross_entropy(&l).unwrap();
        c.backward(&loss).unwrap();
        let loss = composed(&x, &l).unwrap();
        c.backward(&loss).unwrap();
    }
    // A fresh leaf: its gradient is known to hold zeros.
    let x = x.duplicate().unwrap();
    x.set_requires_gradient(true).unwrap();

    // Forward, not recorded and recorded: one launch, no product, no wait.
    for recorded in [false, true] {
        let c = recorded.then(|| step.gradient_collector().unwrap());
        let d = count(&|| {
            x.softmax_cross_entropy(&l).unwrap();
        });
        let line = format!("forward (recorded: {recorded}): {:?}", sim::calls(&d));
        println!("{line}");
        assert_eq!(d["launches"], 1, "{line}");
        assert_eq!(d["cublas"], 0, "{line}");
        assert_eq!(d["blocking_syncs"], 0, "{line}");
        drop(c);
    }

    // backward(&loss) with the loss at the root and the logits a leaf whose gradient holds
    // zeros: no seed, nothing for the op; the saved gradient is copied into the leaf's.
    let c = step.gradient_collector().unwrap();
    let loss = x.softmax_cross_entropy(&l).unwrap();
    let d = count(&|| c.backward(&loss).unwrap());
    let line = format!("backward, first: {:?}", sim::calls(&d));
    println!("{line}");
    assert_eq!(
        (d["launches"], d["cublas"], d["blocking_syncs"]),
        (0, 0, 0),
        "{line}"
    );
    assert_eq!((d["d2d"], d["memsets"]), (1, 0), "{line}");
    // Again: the leaf's gradient is no longer known to be zero, so it is added to (one launch).
    let loss = x.softmax_cross_entropy(&l).unwrap();
    let d = count(&|| c.backward(&loss).unwrap());
    let line = format!("backward, adding: {:?}", sim::calls(&d));
    println!("{line}");
    assert_eq!(
        (d["launches"], d["cublas"], d["d2d"], d["blocking_syncs"]),
        (1, 0, 0, 0),
        "{line}"
    );
    // The composed loss, for comparison.
    let d = count(&|| {
        let loss = composed(&x, &l).unwrap();
        c.backward(&loss).unwrap();
    });
    println!("composed forward + backward (adding): {:?}", sim::calls(&d));
    drop(c);
    drop(_active);
    drop(step);
    model.close().unwrap();
}
