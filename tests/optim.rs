//! The fused optimizer steps `sgd_update_` and `adam_update_`: several steps against a plain
//! f64 implementation of PyTorch's rules (SGD with and without momentum, Nesterov and weight
//! decay; Adam and AdamW at several step numbers), on arrays small and large enough to be split
//! over the worker pool; edge cases; every refusal, after which nothing changed; and, where a
//! GPU is usable, the CUDA kernels against the CPU's (the same operations, so the same bits).

use ndscope::{AdamUpdate, DType, Device, Error, Manager, NDArray, SgdUpdate};

mod common;

/// Deterministic values in about `[-scale, scale]`, varied by `seed`.
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let z = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ seed.wrapping_mul(0xBF58_476D_1CE4_E5B9))
                >> 11;
            (z as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `data` as an array of `dtype` on `device`.
fn array(m: &Manager, data: &[f64], dtype: DType, device: Device) -> NDArray {
    let a = match dtype {
        DType::F32 => {
            let v: Vec<f32> = data.iter().map(|&x| x as f32).collect();
            m.from_slice(&v, [data.len()]).unwrap()
        }
        _ => m.from_slice(data, [data.len()]).unwrap(),
    };
    if device == Device::Cpu {
        a
    } else {
        a.to_device(device).unwrap()
    }
}

/// The array's values as f64.
fn read(a: &NDArray) -> Vec<f64> {
    match a.dtype() {
        DType::F32 => a
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect(),
        _ => a.to_vec::<f64>().unwrap(),
    }
}

/// The values rounded to `dtype` (the reference starts from what the arrays hold).
fn rounded(data: &[f64], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => data.iter().map(|&x| f64::from(x as f32)).collect(),
        _ => data.to_vec(),
    }
}

fn assert_close(got: &[f64], want: &[f64], dtype: DType, what: &str) {
    let tol = if dtype == DType::F32 { 2e-5 } else { 1e-12 };
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what} ({dtype}) at {i}: got {g}, want {w}"
        );
    }
}

/// PyTorch's SGD step in f64 (dampening 0).
fn sgd_reference(p: &mut [f64], grad: &[f64], vel: Option<&mut [f64]>, s: SgdUpdate) {
    match vel {
        None => {
            for (p, &g) in p.iter_mut().zip(grad) {
                let g = g + s.weight_decay * *p;
                *p -= s.lr * g;
            }
        }
        Some(vel) => {
            for ((p, v), &g) in p.iter_mut().zip(vel.iter_mut()).zip(grad) {
                let g = g + s.weight_decay * *p;
                *v = s.momentum * *v + g;
                let d = if s.nesterov { g + s.momentum * *v } else { *v };
                *p -= s.lr * d;
            }
        }
    }
}

/// PyTorch's Adam / AdamW step in f64 (amsgrad off), in the textbook form.
fn adam_reference(p: &mut [f64], grad: &[f64], m: &mut [f64], v: &mut [f64], s: AdamUpdate) {
    let t = s.step as f64;
    let (bc1, bc2) = (1.0 - s.beta1.powf(t), 1.0 - s.beta2.powf(t));
    for (((p, m), v), &g) in p.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(grad) {
        let g = if s.decoupled {
            *p *= 1.0 - s.lr * s.weight_decay;
            g
        } else {
            g + s.weight_decay * *p
        };
        *m = s.beta1 * *m + (1.0 - s.beta1) * g;
        *v = s.beta2 * *v + (1.0 - s.beta2) * g * g;
        let (mh, vh) = (*m / bc1, *v / bc2);
        *p -= s.lr * mh / (vh.sqrt() + s.eps);
    }
}

/// Small (one thread) and large (split over the pool) lengths.
const LENS: [usize; 2] = [37, 100_003];

fn sgd_configs() -> Vec<SgdUpdate> {
    let base = SgdUpdate::new(0.05);
    vec![
        base,
        SgdUpdate {
            weight_decay: 0.1,
            ..base
        },
        SgdUpdate {
            momentum: 0.9,
            ..base
        },
        SgdUpdate {
            momentum: 0.9,
            weight_decay: 0.1,
            ..base
        },
        SgdUpdate {
            momentum: 0.8,
            nesterov: true,
            ..base
        },
        SgdUpdate {
            momentum: 0.8,
            nesterov: true,
            weight_decay: 0.05,
            ..base
        },
    ]
}

#[test]
fn sgd_matches_the_reference_over_several_steps() {
    let m = Manager::new_base();
    for dtype in [DType::F32, DType::F64] {
        for len in LENS {
            for (c, step) in sgd_configs().into_iter().enumerate() {
                let with_velocity = step.momentum > 0.0;
                let mut want_p = rounded(&values(len, 1, 1.0), dtype);
                let mut want_v = vec![0.0; len];
                let p = array(&m, &want_p, dtype, Device::Cpu);
                let vel = m.zeros([len], dtype).unwrap();
                for s in 0..4u64 {
                    let grad = rounded(&values(len, 10 + s, 2.0), dtype);
                    let g = array(&m, &grad, dtype, Device::Cpu);
                    p.sgd_update_(&g, with_velocity.then_some(&vel), step)
                        .unwrap();
                    sgd_reference(
                        &mut want_p,
                        &grad,
                        with_velocity.then_some(&mut want_v[..]),
                        step,
                    );
                    let what = format!("sgd config {c} len {len} step {s}");
                    assert_close(&read(&p), &want_p, dtype, &format!("{what}: p"));
                    if with_velocity {
                        assert_close(&read(&vel), &want_v, dtype, &format!("{what}: velocity"));
                    }
                }
            }
        }
    }
}

/// Momentum 0 with a velocity: the velocity becomes the gradient, the step plain SGD.
#[test]
fn sgd_with_zero_momentum_and_a_velocity_is_plain_sgd() {
    let m = Manager::new_base();
    let p = m.from_slice(&[1.0f64, 2.0, 3.0], [3]).unwrap();
    let g = m.from_slice(&[0.5f64, -1.0, 2.0], [3]).unwrap();
    let v = m.from_slice(&[9.0f64, 9.0, 9.0], [3]).unwrap();
    p.sgd_update_(&g, Some(&v), SgdUpdate::new(0.5)).unwrap();
    assert_eq!(v.to_vec::<f64>().unwrap(), vec![0.5, -1.0, 2.0]);
    assert_eq!(p.to_vec::<f64>().unwrap(), vec![0.75, 2.5, 2.0]);
}

fn adam_configs() -> Vec<AdamUpdate> {
    let base = AdamUpdate::new(0.01, 1);
    vec![
        base,
        AdamUpdate {
            weight_decay: 0.1,
            ..base
        },
        AdamUpdate {
            weight_decay: 0.1,
            decoupled: true,
            ..base
        },
        AdamUpdate {
            beta1: 0.5,
            beta2: 0.9,
            eps: 1e-3,
            ..base
        },
        AdamUpdate {
            beta1: 0.0,
            beta2: 0.0,
            decoupled: true,
            weight_decay: 0.5,
            ..base
        },
    ]
}

#[test]
fn adam_and_adamw_match_the_reference_over_several_steps() {
    let mg = Manager::new_base();
    for dtype in [DType::F32, DType::F64] {
        for len in LENS {
            for (c, config) in adam_configs().into_iter().enumerate() {
                // From step 1 with zero moments, and later steps with moments already built up.
                for first in [1u64, 50] {
                    let mut want_p = rounded(&values(len, 2, 1.0), dtype);
                    let (mut want_m, mut want_v) = if first == 1 {
                        (vec![0.0; len], vec![0.0; len])
                    } else {
                        let m0 = rounded(&values(len, 3, 0.1), dtype);
                        let v0 = rounded(&values(len, 4, 0.1), dtype)
                            .iter()
                            .map(|x| x.abs())
                            .collect();
                        (m0, v0)
                    };
                    let p = array(&mg, &want_p, dtype, Device::Cpu);
                    let m = array(&mg, &want_m, dtype, Device::Cpu);
                    let v = array(&mg, &want_v, dtype, Device::Cpu);
                    for t in first..first + 4 {
                        let grad = rounded(&values(len, 20 + t, 1.0), dtype);
                        let g = array(&mg, &grad, dtype, Device::Cpu);
                        let step = AdamUpdate { step: t, ..config };
                        p.adam_update_(&g, &m, &v, step).unwrap();
                        adam_reference(&mut want_p, &grad, &mut want_m, &mut want_v, step);
                        let what = format!("adam config {c} len {len} step {t}");
                        assert_close(&read(&p), &want_p, dtype, &format!("{what}: p"));
                        assert_close(&read(&m), &want_m, dtype, &format!("{what}: m"));
                        assert_close(&read(&v), &want_v, dtype, &format!("{what}: v"));
                    }
                }
            }
        }
    }
}

/// lr 0 leaves the parameters (AdamW's decay included) and updates only the state; empty
/// arrays are fine; a huge step number makes the bias corrections 1.
#[test]
fn optimizer_edge_cases() {
    let mg = Manager::new_base();
    let p = mg.from_slice(&[1.0f32, -2.0], [2]).unwrap();
    let g = mg.from_slice(&[0.5f32, 0.25], [2]).unwrap();
    let (m, v) = (
        mg.zeros([2], DType::F32).unwrap(),
        mg.zeros([2], DType::F32).unwrap(),
    );
    let step = AdamUpdate {
        weight_decay: 0.5,
        decoupled: true,
        ..AdamUpdate::new(0.0, 1)
    };
    p.adam_update_(&g, &m, &v, step).unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, -2.0]);
    assert_eq!(
        m.to_vec::<f32>().unwrap(),
        vec![0.1f32 * 0.5, 0.1f32 * 0.25]
    );
    let vel = mg.zeros([2], DType::F32).unwrap();
    p.sgd_update_(
        &g,
        Some(&vel),
        SgdUpdate {
            momentum: 0.9,
            ..SgdUpdate::new(0.0)
        },
    )
    .unwrap();
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, -2.0]);
    assert_eq!(vel.to_vec::<f32>().unwrap(), vec![0.5, 0.25]);

    let e: Vec<NDArray> = (0..4)
        .map(|_| mg.zeros([0, 3], DType::F64).unwrap())
        .collect();
    e[0].sgd_update_(
        &e[1],
        Some(&e[2]),
        SgdUpdate {
            momentum: 0.5,
            ..SgdUpdate::new(1.0)
        },
    )
    .unwrap();
    e[0].adam_update_(&e[1], &e[2], &e[3], AdamUpdate::new(1.0, 3))
        .unwrap();

    // Step u64::MAX: β^t is 0, so m̂ = m and v̂ = v; the first moment's sign decides.
    let p = mg.from_slice(&[0.0f64], [1]).unwrap();
    let g = mg.from_slice(&[4.0f64], [1]).unwrap();
    let (m, v) = (
        mg.zeros([1], DType::F64).unwrap(),
        mg.zeros([1], DType::F64).unwrap(),
    );
    p.adam_update_(
        &g,
        &m,
        &v,
        AdamUpdate {
            eps: 1e-300,
            ..AdamUpdate::new(1.0, u64::MAX)
        },
    )
    .unwrap();
    let want = -(0.1 * 4.0) / (0.001f64 * 16.0).sqrt();
    assert!((p.to_vec::<f64>().unwrap()[0] - want).abs() < 1e-12);
}

/// A refused call: what it tries, its result, and which error it must be.
type Refusal<'a> = (&'a str, ndscope::Result<()>, &'a dyn Fn(&Error) -> bool);

fn is_invalid(e: &Error, needle: &str) -> bool {
    matches!(e, Error::InvalidArgument { reason, .. } if reason.contains(needle))
}

#[test]
fn every_refusal_is_an_error_and_changes_nothing() {
    let mg = Manager::new_base();
    let p = mg.from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    let g = mg.from_slice(&[0.5f32, 0.5, 0.5], [3]).unwrap();
    let a = mg.from_slice(&[0.1f32, 0.2, 0.3], [3]).unwrap();
    let b = mg.from_slice(&[0.4f32, 0.5, 0.6], [3]).unwrap();
    let g64 = mg.from_slice(&[0.5f64, 0.5, 0.5], [3]).unwrap();
    let g2 = mg.from_slice(&[0.5f32, 0.5], [2]).unwrap();
    let gm = mg.from_slice(&[0.5f32, 0.5, 0.5], [3, 1]).unwrap();
    let pi = mg.from_slice(&[1i32, 2, 3], [3]).unwrap();
    let gi = mg.from_slice(&[1i32, 1, 1], [3]).unwrap();
    let sgd = SgdUpdate {
        momentum: 0.9,
        ..SgdUpdate::new(0.1)
    };
    let adam = AdamUpdate::new(0.1, 1);
    let unchanged = || {
        assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
        assert_eq!(a.to_vec::<f32>().unwrap(), vec![0.1, 0.2, 0.3]);
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.4, 0.5, 0.6]);
    };
    let cases: Vec<Refusal<'_>> = vec![
        ("dtype", p.sgd_update_(&g64, Some(&a), sgd), &|e| {
            matches!(e, Error::DTypeMismatch { .. })
        }),
        (
            "int",
            pi.sgd_update_(&gi, None, SgdUpdate::new(1.0)),
            &|e| matches!(e, Error::DTypeMismatch { .. }),
        ),
        ("shape", p.sgd_update_(&g2, Some(&a), sgd), &|e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        ("rank", p.sgd_update_(&gm, Some(&a), sgd), &|e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        ("velocity is p", p.sgd_update_(&g, Some(&p), sgd), &|e| {
            is_invalid(e, "distinct")
        }),
        ("velocity is grad", p.sgd_update_(&a, Some(&a), sgd), &|e| {
            is_invalid(e, "distinct")
        }),
        ("grad is p", p.sgd_update_(&p, Some(&a), sgd), &|e| {
            is_invalid(e, "distinct")
        }),
        ("no velocity", p.sgd_update_(&g, None, sgd), &|e| {
            is_invalid(e, "velocity")
        }),
        (
            "nesterov",
            p.sgd_update_(
                &g,
                Some(&a),
                SgdUpdate {
                    nesterov: true,
                    ..SgdUpdate::new(0.1)
                },
            ),
            &|e| is_invalid(e, "nesterov"),
        ),
        (
            "lr nan",
            p.sgd_update_(
                &g,
                Some(&a),
                SgdUpdate {
                    lr: f64::NAN,
                    ..sgd
                },
            ),
            &|e| is_invalid(e, "lr"),
        ),
        (
            "lr < 0",
            p.sgd_update_(&g, Some(&a), SgdUpdate { lr: -0.1, ..sgd }),
            &|e| is_invalid(e, "lr"),
        ),
        (
            "momentum inf",
            p.sgd_update_(
                &g,
                Some(&a),
                SgdUpdate {
                    momentum: f64::INFINITY,
                    ..sgd
                },
            ),
            &|e| is_invalid(e, "momentum"),
        ),
        (
            "momentum < 0",
            p.sgd_update_(
                &g,
                Some(&a),
                SgdUpdate {
                    momentum: -0.5,
                    ..sgd
                },
            ),
            &|e| is_invalid(e, "momentum"),
        ),
        (
            "weight decay",
            p.sgd_update_(
                &g,
                Some(&a),
                SgdUpdate {
                    weight_decay: -1.0,
                    ..sgd
                },
            ),
            &|e| is_invalid(e, "weight_decay"),
        ),
        ("adam dtype", p.adam_update_(&g64, &a, &b, adam), &|e| {
            matches!(e, Error::DTypeMismatch { .. })
        }),
        ("adam int", pi.adam_update_(&gi, &a, &b, adam), &|e| {
            matches!(e, Error::DTypeMismatch { .. })
        }),
        ("adam shape", p.adam_update_(&g, &a, &g2, adam), &|e| {
            matches!(e, Error::ShapeMismatch { .. })
        }),
        ("m is v", p.adam_update_(&g, &a, &a, adam), &|e| {
            is_invalid(e, "distinct")
        }),
        ("m is p", p.adam_update_(&g, &p, &b, adam), &|e| {
            is_invalid(e, "distinct")
        }),
        ("v is grad", p.adam_update_(&g, &a, &g, adam), &|e| {
            is_invalid(e, "distinct")
        }),
        (
            "beta1 = 1",
            p.adam_update_(&g, &a, &b, AdamUpdate { beta1: 1.0, ..adam }),
            &|e| is_invalid(e, "beta1"),
        ),
        (
            "beta1 nan",
            p.adam_update_(
                &g,
                &a,
                &b,
                AdamUpdate {
                    beta1: f64::NAN,
                    ..adam
                },
            ),
            &|e| is_invalid(e, "beta1"),
        ),
        (
            "beta2 < 0",
            p.adam_update_(
                &g,
                &a,
                &b,
                AdamUpdate {
                    beta2: -0.1,
                    ..adam
                },
            ),
            &|e| is_invalid(e, "beta2"),
        ),
        (
            "eps 0",
            p.adam_update_(&g, &a, &b, AdamUpdate { eps: 0.0, ..adam }),
            &|e| is_invalid(e, "eps"),
        ),
        (
            "eps inf",
            p.adam_update_(
                &g,
                &a,
                &b,
                AdamUpdate {
                    eps: f64::INFINITY,
                    ..adam
                },
            ),
            &|e| is_invalid(e, "eps"),
        ),
        (
            "step 0",
            p.adam_update_(&g, &a, &b, AdamUpdate { step: 0, ..adam }),
            &|e| is_invalid(e, "step"),
        ),
        (
            "adam lr",
            p.adam_update_(
                &g,
                &a,
                &b,
                AdamUpdate {
                    lr: f64::INFINITY,
                    ..adam
                },
            ),
            &|e| is_invalid(e, "lr"),
        ),
        (
            "adam weight decay",
            p.adam_update_(
                &g,
                &a,
                &b,
                AdamUpdate {
                    weight_decay: f64::NAN,
                    ..adam
                },
            ),
            &|e| is_invalid(e, "weight_decay"),
        ),
    ];
    for (what, result, expected) in cases {
        match result {
            Ok(()) => panic!("{what}: accepted"),
            Err(e) => assert!(expected(&e), "{what}: unexpected error {e}"),
        }
        unchanged();
    }
    assert_eq!(pi.to_vec::<i32>().unwrap(), vec![1, 2, 3]);
}

/// On a GPU the kernels give the CPU's bits (the same operations, no fused multiply-adds), for
/// every configuration, on small and large arrays; operands on two devices are refused.
#[test]
fn cuda_steps_equal_the_cpu_steps() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let mg = Manager::new_base();
    for dtype in [DType::F32, DType::F64] {
        for len in LENS {
            for (c, step) in sgd_configs().into_iter().enumerate() {
                let vel = step.momentum > 0.0;
                let init = values(len, 5, 1.0);
                let (p_cpu, p_gpu) = (
                    array(&mg, &init, dtype, Device::Cpu),
                    array(&mg, &init, dtype, dev),
                );
                let (v_cpu, v_gpu) = (
                    mg.zeros([len], dtype).unwrap(),
                    mg.zeros([len], dtype).unwrap().to_device(dev).unwrap(),
                );
                for s in 0..3 {
                    let grad = values(len, 30 + s, 1.0);
                    let (g_cpu, g_gpu) = (
                        array(&mg, &grad, dtype, Device::Cpu),
                        array(&mg, &grad, dtype, dev),
                    );
                    p_cpu
                        .sgd_update_(&g_cpu, vel.then_some(&v_cpu), step)
                        .unwrap();
                    p_gpu
                        .sgd_update_(&g_gpu, vel.then_some(&v_gpu), step)
                        .unwrap();
                }
                assert_eq!(
                    read(&p_gpu),
                    read(&p_cpu),
                    "sgd config {c} {dtype} len {len}: p"
                );
                assert_eq!(
                    read(&v_gpu),
                    read(&v_cpu),
                    "sgd config {c} {dtype} len {len}: velocity"
                );
            }
            for (c, config) in adam_configs().into_iter().enumerate() {
                let init = values(len, 6, 1.0);
                let (p_cpu, p_gpu) = (
                    array(&mg, &init, dtype, Device::Cpu),
                    array(&mg, &init, dtype, dev),
                );
                let zeros = || mg.zeros([len], dtype).unwrap();
                let (m_cpu, v_cpu) = (zeros(), zeros());
                let (m_gpu, v_gpu) = (
                    zeros().to_device(dev).unwrap(),
                    zeros().to_device(dev).unwrap(),
                );
                for t in 1..4 {
                    let grad = values(len, 40 + t, 1.0);
                    let (g_cpu, g_gpu) = (
                        array(&mg, &grad, dtype, Device::Cpu),
                        array(&mg, &grad, dtype, dev),
                    );
                    let step = AdamUpdate { step: t, ..config };
                    p_cpu.adam_update_(&g_cpu, &m_cpu, &v_cpu, step).unwrap();
                    p_gpu.adam_update_(&g_gpu, &m_gpu, &v_gpu, step).unwrap();
                }
                assert_eq!(
                    read(&p_gpu),
                    read(&p_cpu),
                    "adam config {c} {dtype} len {len}: p"
                );
                assert_eq!(
                    read(&m_gpu),
                    read(&m_cpu),
                    "adam config {c} {dtype} len {len}: m"
                );
                assert_eq!(
                    read(&v_gpu),
                    read(&v_cpu),
                    "adam config {c} {dtype} len {len}: v"
                );
            }
        }
    }
    let p = array(&mg, &[1.0, 2.0], DType::F32, dev);
    let g = array(&mg, &[1.0, 2.0], DType::F32, Device::Cpu);
    let err = p.sgd_update_(&g, None, SgdUpdate::new(0.1)).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    let (m, v) = (
        array(&mg, &[0.0, 0.0], DType::F32, dev),
        array(&mg, &[0.0, 0.0], DType::F32, Device::Cpu),
    );
    let g = array(&mg, &[1.0, 2.0], DType::F32, dev);
    let err = p
        .adam_update_(&g, &m, &v, AdamUpdate::new(0.1, 1))
        .unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    assert_eq!(read(&p), vec![1.0, 2.0]);
}
