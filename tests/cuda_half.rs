//! F16 and BF16 on a CUDA device against the CPU, where `tests/cuda.rs` (every op family over
//! `DType::ALL`, on values half types hold exactly) does not reach: products of values of
//! moderate size (f32 accumulation in another order), the fused dense layer and its gradient,
//! the softmax cross-entropy, the optimizer steps, and what happens without the toolkit's
//! half-precision headers (half ops refused with `DeviceUnavailable`, everything else working).
//!
//! Tolerances (the README's "Half precision" section): results computed the same way on both
//! devices are compared exactly (the elementwise ops, the optimizer steps, in f32 on both and
//! rounded once); products and sums, whose f32 accumulation order differs, within 2e-3 (f16) or
//! 1e-2 (bf16) of the largest magnitude of the CPU's result: one or two units in the last place
//! of the half type.
//!
//! Without a usable GPU each test prints why it skipped.

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{
    manual_seed, Activation, AdamUpdate, DType, Device, Error, Manager, NDArray, SgdUpdate,
    Transpose,
};

mod common;

static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU with this file's lock held, or `None` after printing why the test skips.
fn gpu() -> Option<(MutexGuard<'static, ()>, Device)> {
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    common::cuda_device().map(|dev| (serial, dev))
}

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

/// The tolerance of products and sums of `dtype`, relative to the largest magnitude of the
/// CPU's result (at least 1).
fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2e-3,
        _ => 1e-2,
    }
}

/// Asserts that `got` (the GPU's) is within `tol` of `want` (the CPU's), relative to the
/// largest finite magnitude of `want` (at least 1); `tol` 0: the same values, NaN matching NaN.
fn assert_close(what: &str, want: &NDArray, got: &NDArray, tol: f64) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (w, g) = (common::as_f64(want), common::as_f64(got));
    let scale = w
        .iter()
        .filter(|v| v.is_finite())
        .fold(1.0f64, |m, v| m.max(v.abs()));
    let bad: Vec<usize> = (0..w.len())
        .filter(|&i| {
            let (x, y) = (w[i], g[i]);
            !(x == y || (x.is_nan() && y.is_nan()) || (x - y).abs() <= tol * scale)
        })
        .collect();
    if let Some(&i) = bad.first() {
        panic!(
            "{what}: {} of {} elements differ (tolerance {tol}); first at [{i}]: cpu {} vs cuda {}",
            bad.len(),
            w.len(),
            w[i],
            g[i]
        );
    }
}

/// Normal draws of `dtype` on the CPU manager `m` and a copy on `dev`.
fn normal(m: &Manager, dev: Device, dtype: DType, shape: &[usize]) -> (NDArray, NDArray) {
    let cpu = m.randn(shape, dtype).unwrap();
    let gpu = cpu.to_device(dev).unwrap();
    (cpu, gpu)
}

#[test]
fn products_of_halves_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    manual_seed(11);
    for dtype in HALVES {
        let tol = tolerance(dtype);
        for (rows, k, n) in [
            (1, 1, 1),
            (7, 33, 5),
            (64, 64, 64),
            (129, 257, 65),
            (3, 0, 4),
        ] {
            let (a, ga) = normal(&m, dev, dtype, &[rows, k]);
            let (b, gb) = normal(&m, dev, dtype, &[k, n]);
            let what = format!("matmul {dtype} {rows}x{k}x{n}");
            assert_close(&what, &a.matmul(&b).unwrap(), &ga.matmul(&gb).unwrap(), tol);
            let (c, gc) = normal(&m, dev, dtype, &[rows, n]);
            c.addmm_(&a, &b, Transpose::None, 0.5, 2.0).unwrap();
            gc.addmm_(&ga, &gb, Transpose::None, 0.5, 2.0).unwrap();
            assert_close(&format!("addmm_ {what}"), &c, &gc, tol);
            // Transposed operands.
            let (at, gat) = normal(&m, dev, dtype, &[k, rows]);
            let (bt, gbt) = normal(&m, dev, dtype, &[n, k]);
            assert_close(
                &format!("matmul_t both {what}"),
                &at.matmul_t(&bt, Transpose::Both).unwrap(),
                &gat.matmul_t(&gbt, Transpose::Both).unwrap(),
                tol,
            );
        }
        // Batched (one strided batched call) and a shared right operand.
        let (x, gx) = normal(&m, dev, dtype, &[5, 17, 33]);
        let (y, gy) = normal(&m, dev, dtype, &[5, 33, 9]);
        let (y2, gy2) = normal(&m, dev, dtype, &[33, 9]);
        assert_close(
            &format!("batched matmul {dtype}"),
            &x.matmul(&y).unwrap(),
            &gx.matmul(&gy).unwrap(),
            tol,
        );
        assert_close(
            &format!("batched matmul, shared right {dtype}"),
            &x.matmul(&y2).unwrap(),
            &gx.matmul(&gy2).unwrap(),
            tol,
        );
    }
    m.close().unwrap();
}

/// The dense layer `relu(x·w + b)` (cuBLASLt's bias and ReLU epilogues on the device) and its
/// gradients (the product's and the bias gradient's kernels).
#[test]
fn the_dense_layer_and_its_gradient_in_half_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let cpu = Manager::new_base();
    let gm = Manager::new_base_on(dev).unwrap();
    manual_seed(12);
    for dtype in HALVES {
        let tol = tolerance(dtype);
        for act in [Activation::Identity, Activation::Relu] {
            for bias in [false, true] {
                let (x, w, b, r) = (
                    cpu.randn([16, 24], dtype).unwrap(),
                    cpu.randn([24, 10], dtype).unwrap(),
                    cpu.randn([10], dtype).unwrap(),
                    cpu.randn([16, 10], dtype).unwrap(),
                );
                let run = |m: &Manager| -> Vec<NDArray> {
                    let [x, w, b, r] = [&x, &w, &b, &r].map(|a| a.to_device(m.device()).unwrap());
                    for a in [&x, &w, &b] {
                        a.set_requires_gradient(true).unwrap();
                    }
                    let c = m.gradient_collector().unwrap();
                    let y = x.linear(&w, bias.then_some(&b), act).unwrap();
                    let loss = y.mul(&r).unwrap().sum_all().unwrap();
                    c.backward(&loss).unwrap();
                    let mut out = vec![y, x.gradient().unwrap(), w.gradient().unwrap()];
                    if bias {
                        out.push(b.gradient().unwrap());
                    }
                    out
                };
                let (want, got) = (run(&cpu), run(&gm));
                for (i, (c, g)) in want.iter().zip(&got).enumerate() {
                    let what = format!("linear {dtype} {act:?} bias {bias}: output {i}");
                    assert_eq!(g.device(), dev, "{what}");
                    assert_close(&what, c, g, tol);
                }
            }
        }
    }
    gm.close().unwrap();
    cpu.close().unwrap();
}

#[test]
fn softmax_cross_entropy_in_half_matches_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    manual_seed(13);
    for dtype in HALVES {
        for (rows, classes) in [(1, 2), (8, 10), (33, 257), (300, 7)] {
            let logits = m.randn([rows, classes], dtype).unwrap();
            let labels: Vec<i64> = (0..rows).map(|r| ((r * 7) % classes) as i64).collect();
            let labels = m.from_vec(labels, [rows]).unwrap();
            let run = |dev: Device| -> Vec<NDArray> {
                let mg = Manager::new_base_on(dev).unwrap();
                let x = logits.to_device(dev).unwrap();
                let l = labels.to_device(dev).unwrap();
                x.set_requires_gradient(true).unwrap();
                let c = mg.gradient_collector().unwrap();
                let loss = x.softmax_cross_entropy(&l).unwrap();
                c.backward(&loss).unwrap();
                vec![loss, x.gradient().unwrap()]
            };
            let (want, got) = (run(Device::Cpu), run(dev));
            for (i, (c, g)) in want.iter().zip(&got).enumerate() {
                let what = format!("softmax_cross_entropy {dtype} {rows}x{classes}: output {i}");
                // Sums of exponentials in f64, everything else in f32 on both: at most the last
                // place of the half type (the device's expf may differ from the CPU's by an
                // ulp of f32).
                assert_close(&what, c, g, tolerance(dtype));
            }
        }
    }
    m.close().unwrap();
}

/// SGD (momentum, Nesterov, weight decay) and Adam/AdamW steps on half parameters: in f32 on
/// both devices, each stored value rounded once, so the same values.
#[test]
fn optimizer_steps_in_half_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    manual_seed(14);
    let sgds = [
        SgdUpdate::new(0.1),
        SgdUpdate {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
            ..SgdUpdate::new(0.05)
        },
    ];
    for dtype in HALVES {
        for n in [1usize, 1000, 70_001] {
            let p0 = m.randn([n], dtype).unwrap();
            let g0 = m.randn([n], dtype).unwrap();
            for (i, step) in sgds.iter().enumerate() {
                let (p, g) = (p0.duplicate().unwrap(), g0.duplicate().unwrap());
                let v = m.zeros([n], dtype).unwrap();
                let [gp, gg, gv] = [&p, &g, &v].map(|a| a.to_device(dev).unwrap());
                for _ in 0..3 {
                    p.sgd_update_(&g, Some(&v), *step).unwrap();
                    gp.sgd_update_(&gg, Some(&gv), *step).unwrap();
                }
                assert_close(&format!("sgd {i} {dtype} [{n}]: p"), &p, &gp, 0.0);
                assert_close(&format!("sgd {i} {dtype} [{n}]: velocity"), &v, &gv, 0.0);
            }
            for decoupled in [false, true] {
                let (p, g) = (p0.duplicate().unwrap(), g0.duplicate().unwrap());
                let (m1, m2) = (m.zeros([n], dtype).unwrap(), m.zeros([n], dtype).unwrap());
                let [gp, gg, gm1, gm2] = [&p, &g, &m1, &m2].map(|a| a.to_device(dev).unwrap());
                for t in 1..=3 {
                    let step = AdamUpdate {
                        weight_decay: 0.01,
                        decoupled,
                        ..AdamUpdate::new(1e-2, t)
                    };
                    p.adam_update_(&g, &m1, &m2, step).unwrap();
                    gp.adam_update_(&gg, &gm1, &gm2, step).unwrap();
                }
                let what = format!("adam decoupled {decoupled} {dtype} [{n}]");
                assert_close(&format!("{what}: p"), &p, &gp, 0.0);
                assert_close(&format!("{what}: m"), &m1, &gm1, 0.0);
                assert_close(&format!("{what}: v"), &m2, &gm2, 0.0);
            }
        }
    }
    m.close().unwrap();
}

/// Sums and means of halves: accumulated in f64 on both devices and rounded once, over long
/// rows split across the device too.
#[test]
fn sums_of_halves_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    manual_seed(15);
    for dtype in HALVES {
        for shape in [&[1000usize][..], &[3, 70_001], &[70_001, 3], &[4, 300, 5]] {
            let (a, ga) = normal(&m, dev, dtype, shape);
            let what = |op: &str| format!("{op} {dtype} {shape:?}");
            let tol = tolerance(dtype);
            assert_close(
                &what("sum_all"),
                &a.sum_all().unwrap(),
                &ga.sum_all().unwrap(),
                tol,
            );
            assert_close(
                &what("mean_all"),
                &a.mean_all().unwrap(),
                &ga.mean_all().unwrap(),
                tol,
            );
            for axis in 0..shape.len() as isize {
                let w = what(&format!("sum {axis}"));
                assert_close(
                    &w,
                    &a.sum(&[axis], false).unwrap(),
                    &ga.sum(&[axis], false).unwrap(),
                    tol,
                );
                let w = what(&format!("mean {axis}"));
                assert_close(
                    &w,
                    &a.mean(&[axis], true).unwrap(),
                    &ga.mean(&[axis], true).unwrap(),
                    tol,
                );
            }
        }
    }
    m.close().unwrap();
}

/// Without the toolkit's `cuda_fp16.h` (here `NDSCOPE_CUDA_INCLUDE` names an empty directory),
/// half-precision ops on the device fail with `DeviceUnavailable` saying what to set, while
/// every other dtype works, and half arrays still move (uploads, downloads, copies, transposes
/// only move bits). Runs in a child process: the half program is loaded once per process.
#[test]
fn without_the_half_headers_only_half_ops_fail() {
    const NAME: &str = "without_the_half_headers_only_half_ops_fail";
    let Some((_serial, dev)) = gpu() else { return };
    if std::env::var_os("NDSCOPE_HALF_HEADERS_CHILD").is_none() {
        let empty = std::env::temp_dir().join(format!("ndscope-no-headers-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env("NDSCOPE_HALF_HEADERS_CHILD", "1")
            .env("NDSCOPE_CUDA_INCLUDE", &empty)
            .output()
            .unwrap();
        let _ = std::fs::remove_dir(&empty);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "the child run failed:\n{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        return;
    }
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap();
    assert_eq!(
        a.add(&a).unwrap().to_vec::<f32>().unwrap(),
        vec![2.0, 4.0, 6.0, 8.0]
    );
    let h = m
        .from_vec(
            [1.0f32, 2.0, 3.0, 4.0].map(ndscope::f16::from_f32).to_vec(),
            [2, 2],
        )
        .unwrap();
    for err in [
        h.add(&h).unwrap_err(),
        h.to_dtype(DType::F32).unwrap_err(),
        a.to_dtype(DType::BF16).unwrap_err(),
    ] {
        match &err {
            Error::DeviceUnavailable { device, reason, .. } => {
                assert_eq!(*device, dev, "{err}");
                assert!(
                    reason.contains("holds no cuda_fp16.h")
                        && reason.contains("NDSCOPE_CUDA_INCLUDE"),
                    "{err}"
                );
            }
            other => panic!("expected DeviceUnavailable, got {other}"),
        }
    }
    // Moving bits needs no kernel of the half program.
    let t = h.transpose().unwrap();
    let back: Vec<f32> = t
        .to_vec::<ndscope::f16>()
        .unwrap()
        .iter()
        .map(|v| v.to_f32())
        .collect();
    assert_eq!(back, vec![1.0, 3.0, 2.0, 4.0]);
    // The other dtypes keep working after the refusal.
    let i = m.from_slice(&[1i64, 2], [2]).unwrap();
    assert_eq!(i.mul(&i).unwrap().to_vec::<i64>().unwrap(), vec![1, 4]);
    assert_eq!(
        a.matmul(&a).unwrap().to_vec::<f32>().unwrap(),
        vec![7.0, 10.0, 15.0, 22.0]
    );
    m.close().unwrap();
}

/// Casts into a half type round once from the exact value on both devices, also for i64
/// values that f64 cannot hold (rounding through f64 first would round twice) and for f64
/// values just off a half midpoint.
#[test]
fn casts_into_halves_round_once_as_on_the_cpu() {
    let Some((_serial, dev)) = gpu() else {
        return;
    };
    let cpu = Manager::new_base();
    let gpu_m = Manager::new_base_on(dev).unwrap();
    let big = (1i64 << 62) + (1 << 54) + 1;
    let ints = vec![
        big,
        -big,
        (1 << 53) + 1,
        i64::MAX,
        i64::MIN,
        65_519,
        65_520,
        257,
    ];
    let floats = vec![
        1.0 + 2f64.powi(-11) + 2f64.powi(-40),
        1.0 + 2f64.powi(-8) + 2f64.powi(-40),
        -(1.0 + 2f64.powi(-11) - 2f64.powi(-40)),
        65_519.99,
        1e-8,
        f64::NAN,
    ];
    for dtype in HALVES {
        for (name, host) in [
            ("i64", cpu.from_vec(ints.clone(), [ints.len()]).unwrap()),
            ("f64", cpu.from_vec(floats.clone(), [floats.len()]).unwrap()),
        ] {
            let want = host.to_dtype(dtype).unwrap().to_dtype(DType::F64).unwrap();
            let got = host
                .to_device(dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let (w, g) = (want.to_vec::<f64>().unwrap(), got.to_vec::<f64>().unwrap());
            for (i, (a, b)) in w.iter().zip(&g).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "{name} -> {dtype}, element {i}: CPU {a}, GPU {b}"
                );
            }
        }
    }
    cpu.close().unwrap();
    gpu_m.close().unwrap();
}
