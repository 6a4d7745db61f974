//! `NDArray::linear`: a dense layer in one op. Its values against `matmul`, `add` and `relu`,
//! its errors, its gradient (the bias gradient written into the bias's own `gradient()`), and,
//! on the simulated GPU, what it asks of the device: one cuBLASLt product forward, one kernel
//! for the mask and the bias gradient backward, no copy.

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{gradient_collector, Activation, DType, Device, Error, Manager, NDArray};

mod common;
use common::{device_tests, sim};

static SERIAL: Mutex<()> = Mutex::new(());

/// The tests take turns: the counting ones read process-wide counters.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Deterministic values in about [-1, 1], some exactly 0 (for the ReLU's kink at 0).
fn values(n: usize, seed: u64) -> Vec<f64> {
    (0..n)
        .map(|i| {
            let v = ((i as u64 * 2654435761 + seed * 97) % 1001) as f64;
            if i % 7 == 3 {
                0.0
            } else {
                v / 500.0 - 1.0
            }
        })
        .collect()
}

fn array(m: &Manager, dtype: DType, shape: &[usize], seed: u64) -> NDArray {
    let n = shape.iter().product();
    let v = values(n, seed);
    match dtype {
        DType::F32 => m.from_vec(v.iter().map(|&x| x as f32).collect(), shape),
        _ => m.from_vec(v, shape),
    }
    .unwrap()
}

/// The three ops `linear` fuses.
fn composed(x: &NDArray, w: &NDArray, b: Option<&NDArray>, act: Activation) -> NDArray {
    let rows = x.dims()[..x.ndim() - 1].iter().product::<usize>();
    let flat = x.reshape([rows, w.dims()[0]]).unwrap();
    let mut y = flat.matmul(w).unwrap();
    if let Some(b) = b {
        y = y.add(b).unwrap();
    }
    if act == Activation::Relu {
        y = y.relu().unwrap();
    }
    let mut dims = x.dims().to_vec();
    *dims.last_mut().unwrap() = w.dims()[1];
    y.reshape(dims).unwrap()
}

fn assert_close(what: &str, got: &NDArray, want: &NDArray, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}");
    let (g, w) = (common::as_f64(got), common::as_f64(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i}: {a} vs {b}"
        );
    }
}

device_tests!(equals_matmul_add_relu);
fn equals_matmul_add_relu(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        for (xs, k, n) in [
            (vec![5, 7], 7, 3),
            (vec![1, 784], 784, 33),
            (vec![2, 3, 4], 4, 6),
            (vec![4], 4, 2),
            (vec![0, 3], 3, 2),
            (vec![3, 0], 0, 2),
        ] {
            let x = array(&m, dtype, &xs, 1);
            let w = array(&m, dtype, &[k, n], 2);
            let b = array(&m, dtype, &[n], 3);
            for bias in [None, Some(&b)] {
                for act in [Activation::Identity, Activation::Relu] {
                    let got = x.linear(&w, bias, act).unwrap();
                    let want = composed(&x, &w, bias, act);
                    let what = format!(
                        "{dtype} x {xs:?} w [{k}, {n}] bias {} {act:?}",
                        bias.is_some()
                    );
                    // The CPU runs the same arithmetic in the same order; a GPU's product may
                    // sum in another order.
                    let tol = match (dev, dtype) {
                        (Device::Cpu, _) => 0.0,
                        (_, DType::F32) => 1e-5,
                        _ => 1e-12,
                    };
                    assert_close(&what, &got, &want, tol);
                }
            }
        }
    }
    m.close().unwrap();
}

device_tests!(bad_input_is_an_error_and_creates_nothing);
fn bad_input_is_an_error_and_creates_nothing(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = array(&m, DType::F32, &[2, 3], 1);
    let w = array(&m, DType::F32, &[3, 4], 2);
    let b = array(&m, DType::F32, &[4], 3);
    let b5 = array(&m, DType::F32, &[5], 3);
    let w64 = array(&m, DType::F64, &[3, 4], 2);
    let w3d = array(&m, DType::F32, &[3, 4, 1], 2);
    let wi = m.zeros([3, 4], DType::I32).unwrap();
    let x4 = array(&m, DType::F32, &[2, 4], 1);
    let scalar = m.scalar(1.0f32).unwrap();
    let closed = array(&m, DType::F32, &[3, 4], 9);
    closed.close().unwrap();
    let host = Manager::new_base();
    let wc = host.zeros([3, 4], DType::F32).unwrap();
    let before = m.report().total_arrays();
    let relu = Activation::Relu;
    let shape = |r: ndscope::Result<NDArray>| matches!(r, Err(Error::ShapeMismatch { .. }));
    let dtype = |r: ndscope::Result<NDArray>| matches!(r, Err(Error::DTypeMismatch { .. }));
    assert!(shape(x4.linear(&w, Some(&b), relu)));
    assert!(shape(x.linear(&w3d, None, relu)));
    assert!(shape(x.linear(&w, Some(&b5), relu)));
    assert!(shape(scalar.linear(&w, None, relu)));
    assert!(dtype(x.linear(&w64, None, relu)));
    assert!(dtype(x.linear(&wi, None, relu)));
    assert!(matches!(
        x.linear(&closed, None, relu),
        Err(Error::ArrayClosed { .. })
    ));
    if dev != Device::Cpu {
        let err = x.linear(&wc, None, relu).unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    }
    assert_eq!(
        m.report().total_arrays(),
        before,
        "an error created an array"
    );
    host.close().unwrap();
    m.close().unwrap();
}

// The gradients of x, w and b through `linear` against those through the three ops.
device_tests!(gradient_equals_the_composed_ops);
fn gradient_equals_the_composed_ops(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::F32, DType::F64] {
        for act in [Activation::Identity, Activation::Relu] {
            for bias in [false, true] {
                let grads = |fused: bool| -> Vec<NDArray> {
                    let x = array(&m, dtype, &[6, 5], 1);
                    let w = array(&m, dtype, &[5, 4], 2);
                    let b = array(&m, dtype, &[4], 3);
                    let r = array(&m, dtype, &[6, 4], 4);
                    for a in [&x, &w, &b] {
                        a.set_requires_gradient(true).unwrap();
                    }
                    let bias = bias.then_some(&b);
                    // Twice: the second backward adds into the gradients the first wrote.
                    for _ in 0..2 {
                        let c = gradient_collector_on(&m);
                        let y = if fused {
                            x.linear(&w, bias, act).unwrap()
                        } else {
                            composed(&x, &w, bias, act)
                        };
                        let loss = y.mul(&r).unwrap().sum_all().unwrap();
                        c.backward(&loss).unwrap();
                    }
                    let mut out = vec![x.gradient().unwrap(), w.gradient().unwrap()];
                    if bias.is_some() {
                        out.push(b.gradient().unwrap());
                    } else {
                        assert_eq!(common::as_f64(&b.gradient().unwrap()), vec![0.0; 4]);
                    }
                    out
                };
                let (got, want) = (grads(true), grads(false));
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_close(
                        &format!("{dtype} {act:?} bias {bias}: input {i}"),
                        g,
                        w,
                        tol,
                    );
                }
            }
        }
    }
    m.close().unwrap();
}

fn gradient_collector_on(m: &Manager) -> ndscope::GradientCollector {
    m.gradient_collector().unwrap()
}

// A bias that is not a leaf (computed from one) gets its gradient as an array handed on.
device_tests!(bias_computed_from_a_leaf);
fn bias_computed_from_a_leaf(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = array(&m, DType::F64, &[3, 2], 1);
    let w = array(&m, DType::F64, &[2, 2], 2);
    let b0 = array(&m, DType::F64, &[2], 3);
    b0.set_requires_gradient(true).unwrap();
    w.set_requires_gradient(true).unwrap();
    {
        let scope = m.sub_scope().unwrap();
        let _active = scope.activate();
        let c = gradient_collector().unwrap();
        let b = b0.mul_scalar(3.0).unwrap();
        let y = x.linear(&w, Some(&b), Activation::Relu).unwrap();
        let loss = y.sum_all().unwrap();
        c.backward(&loss).unwrap();
    }
    // d loss / d b0 = 3 · Σ_rows [x·w + b > 0]
    let z = composed(
        &x,
        &w,
        Some(&b0.mul_scalar(3.0).unwrap()),
        Activation::Identity,
    );
    let z = common::as_f64(&z);
    let want: Vec<f64> = (0..2)
        .map(|j| 3.0 * (0..3).filter(|r| z[r * 2 + j] > 0.0).count() as f64)
        .collect();
    assert_eq!(common::as_f64(&b0.gradient().unwrap()), want);
    m.close().unwrap();
}

/// On the simulated GPU: the forward pass is one cuBLAS(Lt) product and no kernel; backward
/// through a ReLU layer whose bias is a leaf is one kernel (mask and bias gradient, into the
/// bias's gradient) and the products, with no copy; a second backward adds into the bias
/// gradient, again with no copy or memset.
#[test]
fn one_product_forward_one_kernel_backward_no_copy() {
    let _serial = serial();
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let m = Manager::new_base_on(dev).unwrap();
    let x = array(&m, DType::F32, &[16, 32], 1);
    let w = array(&m, DType::F32, &[32, 8], 2);
    let b = array(&m, DType::F32, &[8], 3);
    w.set_requires_gradient(true).unwrap();
    b.set_requires_gradient(true).unwrap();
    // The gradients exist (made, zeroed) before counting.
    w.gradient().unwrap();
    b.gradient().unwrap();
    dev.synchronize().unwrap();
    let Some(start) = sim::stats() else {
        println!("not the simulator: nothing to count");
        return;
    };
    let scope = m.sub_scope().unwrap();
    let active = scope.activate();
    let y = x.linear(&w, Some(&b), Activation::Relu).unwrap();
    let after_forward = sim::stats().unwrap();
    let d = sim::diff(&start, &after_forward);
    assert_eq!(
        (d["cublas"], d["launches"]),
        (1, 0),
        "forward: {:?}",
        sim::calls(&d)
    );
    for round in 0..2 {
        let before = sim::stats().unwrap();
        let c = gradient_collector().unwrap();
        let y = x.linear(&w, Some(&b), Activation::Relu).unwrap();
        c.backward_with(&y, &y).unwrap();
        let d = sim::diff(&before, &sim::stats().unwrap());
        // forward: 1 product; backward: 1 kernel (mask + bias gradient); x needs no gradient.
        // The weight gradient: the first time a pending product (no work yet); the second
        // time the pending one is computed and the new one added (2 products).
        let products = if round == 0 { 1 } else { 3 };
        assert_eq!(
            (
                d["cublas"],
                d["launches"],
                d["d2d"],
                d["memsets"],
                d["blocking_syncs"]
            ),
            (products, 1, 0, 0, 0),
            "round {round}: {:?}",
            sim::calls(&d)
        );
    }
    drop(y);
    drop(active);
    scope.close().unwrap();
    m.close().unwrap();
}
