//! The optimizers (`Optimizer` with `Sgd`, `Adam`, `AdamW`): several steps of real training
//! (gradients from a collector's `backward`) against the rules computed here in f64 (SGD with and
//! without momentum, Nesterov, weight decay; Adam with its L2 penalty; AdamW decoupled), on the
//! CPU and, where a GPU is usable, on CUDA; gradients zeroed by each step; the state made once,
//! in the parameters' own manager, also on a capped model; every refusal, after which nothing
//! changed; and a step under an open collector, which is not recorded.

use ndscope::{
    Adam, AdamW, DType, Device, Error, Manager, NDArray, NDList, Optimizer, OptimizerKind, Sgd,
};

mod common;
use common::device_tests;

/// Deterministic values in about `[-scale, scale]`, varied by `seed`.
fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    (0..n as u64)
        .map(|i| {
            let z = (i.wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (seed + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9))
                >> 11;
            (z as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// `data` rounded to `dtype` (what an array of it holds).
fn rounded(data: &[f64], dtype: DType) -> Vec<f64> {
    match dtype {
        DType::F32 => data.iter().map(|&x| f64::from(x as f32)).collect(),
        _ => data.to_vec(),
    }
}

/// `data` as an array of `dtype` and `shape` in `m` (on `m`'s device).
fn array(m: &Manager, data: &[f64], shape: &[usize], dtype: DType) -> NDArray {
    match dtype {
        DType::F32 => m.from_vec(data.iter().map(|&x| x as f32).collect(), shape),
        _ => m.from_vec(data.to_vec(), shape),
    }
    .unwrap()
}

fn read(a: &NDArray) -> Vec<f64> {
    common::as_f64(a)
}

fn assert_close(got: &[f64], want: &[f64], dtype: DType, what: &str) {
    let tol = if dtype == DType::F32 { 2e-5 } else { 1e-12 };
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "{what} [{i}]: got {g}, want {w}"
        );
    }
}

/// One parameter of the reference: its values, gradient and state in f64.
struct Reference {
    p: Vec<f64>,
    /// Velocity (SGD) or first moment (Adam).
    a: Vec<f64>,
    /// Second moment (Adam).
    b: Vec<f64>,
}

/// One step of `kind` at step number `t` (from 1) on the reference, PyTorch's rules.
#[allow(clippy::needless_range_loop)] // the formulas index several vectors alike
fn reference_step(kind: OptimizerKind, r: &mut Reference, grad: &[f64], t: u64) {
    match kind {
        OptimizerKind::Sgd(s) => {
            for i in 0..r.p.len() {
                let g = grad[i] + s.weight_decay * r.p[i];
                let d = if s.momentum != 0.0 {
                    r.a[i] = s.momentum * r.a[i] + g;
                    if s.nesterov {
                        g + s.momentum * r.a[i]
                    } else {
                        r.a[i]
                    }
                } else {
                    g
                };
                r.p[i] -= s.lr * d;
            }
        }
        OptimizerKind::Adam(Adam {
            lr,
            betas,
            eps,
            weight_decay,
        })
        | OptimizerKind::AdamW(AdamW {
            lr,
            betas,
            eps,
            weight_decay,
        }) => {
            let decoupled = matches!(kind, OptimizerKind::AdamW(_));
            let (b1, b2) = betas;
            for i in 0..r.p.len() {
                let mut g = grad[i];
                if decoupled {
                    r.p[i] *= 1.0 - lr * weight_decay;
                } else {
                    g += weight_decay * r.p[i];
                }
                r.a[i] = b1 * r.a[i] + (1.0 - b1) * g;
                r.b[i] = b2 * r.b[i] + (1.0 - b2) * g * g;
                let m_hat = r.a[i] / (1.0 - b1.powi(t as i32));
                let v_hat = r.b[i] / (1.0 - b2.powi(t as i32));
                r.p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
            }
        }
    }
}

/// The optimizers the reference test runs.
fn kinds() -> Vec<(&'static str, OptimizerKind)> {
    vec![
        ("sgd", Sgd::new(0.1).into()),
        (
            "sgd+momentum",
            Sgd {
                momentum: 0.9,
                ..Sgd::new(0.05)
            }
            .into(),
        ),
        (
            "sgd+nesterov+decay",
            Sgd {
                momentum: 0.8,
                nesterov: true,
                weight_decay: 0.1,
                ..Sgd::new(0.05)
            }
            .into(),
        ),
        (
            "sgd+decay",
            Sgd {
                weight_decay: 0.3,
                ..Sgd::new(0.2)
            }
            .into(),
        ),
        (
            "adam+l2",
            Adam {
                weight_decay: 0.1,
                betas: (0.8, 0.99),
                ..Adam::new(0.01)
            }
            .into(),
        ),
        ("adam", Adam::new(0.02).into()),
        ("adamw", AdamW::new(0.01).into()),
        (
            "adamw+strong",
            AdamW {
                weight_decay: 0.5,
                eps: 1e-6,
                ..AdamW::new(0.05)
            }
            .into(),
        ),
    ]
}

device_tests!(optimizers_follow_the_reference_rules);
/// Four training steps of each optimizer over three parameters (matrices and a vector), the
/// gradients coming from `backward` of `Σ p·c_t` (so `c_t`), against the f64 reference; after
/// each step every gradient is zero again (else the next `backward` would add to the old one
/// and the reference would not match).
fn optimizers_follow_the_reference_rules(dev: Device) {
    for dtype in [DType::F32, DType::F64] {
        for (what, kind) in kinds() {
            let model = Manager::new_base_on(dev).unwrap();
            // The last is large enough to be split over the CPU's worker pool.
            let shapes: [&[usize]; 3] = [&[3, 4], &[5], &[200, 250]];
            let mut params = Vec::new();
            let mut refs = Vec::new();
            for (k, shape) in shapes.iter().enumerate() {
                let n = common::size(shape);
                let init = rounded(&values(n, 10 + k as u64, 1.0), dtype);
                let p = array(&model, &init, shape, dtype).with_name(&format!("p{k}"));
                p.set_requires_gradient(true).unwrap();
                params.push(p);
                refs.push(Reference {
                    p: init,
                    a: vec![0.0; n],
                    b: vec![0.0; n],
                });
            }
            let mut opt = Optimizer::new(&params, kind).unwrap();
            for t in 1..=4u64 {
                let step = model.sub_scope().unwrap();
                let mut grads = Vec::new();
                {
                    let _active = step.activate();
                    let collector = step.gradient_collector().unwrap();
                    let mut loss: Option<NDArray> = None;
                    for (k, p) in params.iter().enumerate() {
                        let c = rounded(&values(p.size(), 100 * t + k as u64, 2.0), dtype);
                        let term = p
                            .mul(&array(&step, &c, p.dims(), dtype))
                            .unwrap()
                            .sum_all()
                            .unwrap();
                        loss = Some(match loss {
                            Some(l) => l.add(&term).unwrap(),
                            None => term,
                        });
                        grads.push(c);
                    }
                    collector.backward(&loss.unwrap()).unwrap();
                }
                for (p, c) in params.iter().zip(&grads) {
                    assert_close(&read(&p.gradient().unwrap()), c, dtype, "gradient");
                }
                opt.step().unwrap();
                step.close().unwrap();
                assert_eq!(opt.steps(), t);
                for (k, (p, r)) in params.iter().zip(&mut refs).enumerate() {
                    reference_step(kind, r, &grads[k], t);
                    let at = format!("{what} {dtype} on {dev}, step {t}, parameter {k}");
                    assert_close(&read(p), &r.p, dtype, &at);
                    assert!(
                        read(&p.gradient().unwrap()).iter().all(|&g| g == 0.0),
                        "{at}: the gradient is zeroed by step"
                    );
                }
            }
            model.close().unwrap();
        }
    }
}

/// The names of the arrays `m` owns, sorted.
fn names(m: &Manager) -> Vec<String> {
    let mut names: Vec<String> = m
        .report()
        .arrays
        .iter()
        .map(|a| a.name.clone().unwrap_or_else(|| a.id.to_string()))
        .collect();
    names.sort();
    names
}

device_tests!(state_is_made_once_in_the_parameters_manager);
/// The state is made at construction, zeroed, in the manager of each parameter (two models
/// here), named after it, also on a capped model; steps add nothing anywhere.
fn state_is_made_once_in_the_parameters_manager(dev: Device) {
    for (kind, state) in [
        (OptimizerKind::from(Sgd::new(0.1)), &[][..]),
        (
            Sgd {
                momentum: 0.5,
                ..Sgd::new(0.1)
            }
            .into(),
            &["velocity"][..],
        ),
        (Adam::new(0.1).into(), &["m", "v"][..]),
        (AdamW::new(0.1).into(), &["m", "v"][..]),
    ] {
        let encoder = Manager::new_base_on(dev).unwrap();
        let decoder = Manager::new_base_on(dev).unwrap();
        let w = encoder.ones([4, 3], DType::F32).unwrap().with_name("enc.w");
        let v = decoder.ones([3], DType::F64).unwrap().with_name("dec.v");
        let unnamed = decoder.ones([2], DType::F32).unwrap();
        for p in [&w, &v, &unnamed] {
            p.set_requires_gradient(true).unwrap();
        }
        encoder.cap();
        decoder.cap();
        let before = (names(&encoder), names(&decoder));
        let mut opt = Optimizer::new(vec![w.clone(), v.clone(), unnamed.clone()], kind).unwrap();
        let mut want_enc = before.0.clone();
        let mut want_dec = before.1.clone();
        for s in state {
            want_enc.push(format!("enc.w.{s}"));
            want_dec.push(format!("dec.v.{s}"));
            want_dec.push(format!("{}.{s}", unnamed.id()));
        }
        if dev != Device::Cpu && !state.is_empty() && state[0] == "m" {
            // Adam on a GPU: one count of the steps taken per device and dtype (used under a
            // loss scaler), beside the group's first parameter: w (f32 with `unnamed`), v (f64).
            want_enc.push("enc.w.steps".to_string());
            want_dec.push("dec.v.steps".to_string());
        }
        want_enc.sort();
        want_dec.sort();
        assert_eq!(names(&encoder), want_enc, "{kind:?}: the encoder's arrays");
        assert_eq!(names(&decoder), want_dec, "{kind:?}: the decoder's arrays");
        for p in [&w, &v, &unnamed] {
            let st = opt.state(p).unwrap();
            assert_eq!(st.len(), state.len());
            for a in st {
                assert_eq!(
                    (a.shape(), a.dtype(), a.device()),
                    (p.shape(), p.dtype(), p.device())
                );
                assert!(
                    read(a).iter().all(|&x| x == 0.0),
                    "the state starts at zero"
                );
                assert_eq!(a.manager().unwrap().id(), p.manager().unwrap().id());
            }
        }
        let after_new = (names(&encoder), names(&decoder));
        for _ in 0..3 {
            for p in [&w, &v, &unnamed] {
                p.gradient().unwrap().fill_(0.5).unwrap();
            }
            opt.step().unwrap();
        }
        opt.zero_gradients().unwrap();
        assert_eq!((names(&encoder), names(&decoder)), after_new, "{kind:?}");
        assert!(read(&w)[0] < 1.0, "the capped model's parameters moved");
        let stranger = Manager::new_base().ones([1], DType::F32).unwrap();
        assert!(opt.state(&stranger).is_none(), "not a parameter");
        opt.close();
        assert_eq!(
            (names(&encoder), names(&decoder)),
            before,
            "close frees the state"
        );
        encoder.close().unwrap();
        decoder.close().unwrap();
    }
}

/// A model of two parameters requiring gradients, with gradients set to `0.5`.
fn model() -> (Manager, NDArray, NDArray) {
    let m = Manager::new_base();
    let w = m
        .from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2])
        .unwrap()
        .with_name("w");
    let b = m.from_slice(&[0.5f32, -0.5], [2]).unwrap().with_name("b");
    for p in [&w, &b] {
        p.set_requires_gradient(true).unwrap();
        p.gradient().unwrap().fill_(0.5).unwrap();
    }
    (m, w, b)
}

/// The names of the arrays the model holds (parameters, gradients, state).
fn snapshot(m: &Manager) -> Vec<String> {
    names(m)
}

fn values_of(arrays: &[&NDArray]) -> Vec<Vec<f64>> {
    arrays.iter().map(|a| read(a)).collect()
}

fn invalid(e: &Error) -> &str {
    match e {
        Error::InvalidArgument { op, reason, .. } => {
            assert_eq!(*op, "Optimizer::new", "{e}");
            reason
        }
        other => panic!("expected InvalidArgument, got {other}"),
    }
}

#[test]
fn bad_hyper_parameters_are_refused_naming_them() {
    let (m, w, b) = model();
    let before = snapshot(&m);
    let cases: Vec<(OptimizerKind, &str)> = vec![
        (Sgd::new(-0.1).into(), "lr"),
        (Sgd::new(f64::NAN).into(), "lr"),
        (Sgd::new(f64::INFINITY).into(), "lr"),
        (
            Sgd {
                momentum: -0.5,
                ..Sgd::new(0.1)
            }
            .into(),
            "momentum",
        ),
        (
            Sgd {
                weight_decay: f64::NAN,
                ..Sgd::new(0.1)
            }
            .into(),
            "weight_decay",
        ),
        (
            Sgd {
                nesterov: true,
                ..Sgd::new(0.1)
            }
            .into(),
            "nesterov",
        ),
        (Adam::new(-1.0).into(), "lr"),
        (
            Adam {
                betas: (1.0, 0.999),
                ..Adam::new(0.1)
            }
            .into(),
            "beta1",
        ),
        (
            Adam {
                betas: (0.9, -0.1),
                ..Adam::new(0.1)
            }
            .into(),
            "beta2",
        ),
        (
            AdamW {
                betas: (0.9, f64::NAN),
                ..AdamW::new(0.1)
            }
            .into(),
            "beta2",
        ),
        (
            Adam {
                eps: 0.0,
                ..Adam::new(0.1)
            }
            .into(),
            "eps",
        ),
        (
            AdamW {
                eps: f64::NAN,
                ..AdamW::new(0.1)
            }
            .into(),
            "eps",
        ),
        (
            AdamW {
                weight_decay: -0.01,
                ..AdamW::new(0.1)
            }
            .into(),
            "weight_decay",
        ),
    ];
    for (kind, name) in cases {
        let e = Optimizer::new([&w, &b], kind).unwrap_err();
        assert!(invalid(&e).contains(name), "{kind:?}: {e}");
        assert!(e.to_string().contains("tests/optimizers.rs"), "where: {e}");
        assert_eq!(snapshot(&m), before, "{kind:?}: nothing was made");
    }
}

#[test]
fn bad_parameters_are_refused_and_nothing_is_made() {
    let (m, w, b) = model();
    let before = snapshot(&m);
    let kind = Adam::new(0.1);

    let e = Optimizer::new(Vec::<NDArray>::new(), kind).unwrap_err();
    assert!(invalid(&e).contains("at least one parameter"), "{e}");

    let e = Optimizer::new([&w, &b, &w], kind).unwrap_err();
    assert!(
        invalid(&e).contains("'w'") && invalid(&e).contains("twice"),
        "{e}"
    );
    assert!(invalid(&e).contains("at 0 and 2"), "{e}");

    let frozen = m.ones([2], DType::F32).unwrap().with_name("frozen");
    let e = Optimizer::new([&w, &frozen], kind).unwrap_err();
    let reason = invalid(&e);
    assert!(
        reason.contains("'frozen'") && reason.contains("does not require gradients"),
        "{e}"
    );
    assert!(reason.contains("at 1"), "{e}");
    w.set_requires_gradient(false).unwrap();
    let e = Optimizer::new([&b, &w], kind).unwrap_err();
    assert!(invalid(&e).contains("'w'"), "{e}");
    w.set_requires_gradient(true).unwrap();

    let ints = m.zeros([2], DType::I32).unwrap().with_name("ints");
    let e = Optimizer::new([&w, &ints], kind).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                found: DType::I32,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("'ints'"), "{e}");

    let gone = m.ones([2], DType::F32).unwrap().with_name("gone");
    gone.set_requires_gradient(true).unwrap();
    let gone_grad = gone.gradient().unwrap();
    gone.close().unwrap();
    let e = Optimizer::new([&w, &gone], kind).unwrap_err();
    assert!(
        matches!(e, Error::ArrayClosed { ref array, .. } if array.contains("'gone'")),
        "{e}"
    );

    let lost = m.ones([2], DType::F32).unwrap().with_name("lost");
    lost.set_requires_gradient(true).unwrap();
    lost.gradient().unwrap().close().unwrap();
    let e = Optimizer::new([&w, &lost], kind).unwrap_err();
    assert!(
        matches!(e, Error::ArrayClosed { ref array, .. } if array.contains("'lost.grad'")),
        "{e}"
    );
    for extra in [&frozen, &ints, &lost, &gone_grad] {
        extra.close().unwrap();
    }
    assert_eq!(snapshot(&m), before, "no state was made");
    assert_eq!(
        values_of(&[&w, &b]),
        [vec![1.0, 2.0, 3.0, 4.0], vec![0.5, -0.5]]
    );
}

/// A step that finds a closed state array, or a parameter that stopped requiring gradients,
/// is refused before any parameter, state or gradient changed (the bad one is the last
/// parameter, so a step that checked as it went would already have changed the first).
#[test]
fn a_step_checks_everything_before_changing_anything() {
    let (m, w, b) = model();
    let mut opt = Optimizer::new(
        [&w, &b],
        Sgd {
            momentum: 0.9,
            ..Sgd::new(0.1)
        },
    )
    .unwrap();
    opt.step().unwrap();
    for p in [&w, &b] {
        p.gradient().unwrap().fill_(0.5).unwrap();
    }
    let arrays = |opt: &Optimizer| {
        let mut all = vec![
            w.clone(),
            b.clone(),
            w.gradient().unwrap(),
            b.gradient().unwrap(),
        ];
        all.extend(opt.state(&w).unwrap().iter().cloned());
        all
    };
    let tracked = arrays(&opt);
    let before = values_of(&tracked.iter().collect::<Vec<_>>());

    b.set_requires_gradient(false).unwrap();
    let e = opt.step().unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "Optimizer::step", ref reason, .. }
            if reason.contains("'b'")),
        "{e}"
    );
    assert_eq!(values_of(&tracked.iter().collect::<Vec<_>>()), before);
    let e = opt.zero_gradients().unwrap_err();
    assert!(e.to_string().contains("'b'"), "{e}");
    assert_eq!(values_of(&tracked.iter().collect::<Vec<_>>()), before);
    b.set_requires_gradient(true).unwrap();

    opt.state(&b).unwrap()[0].close().unwrap();
    let e = opt.step().unwrap_err();
    assert!(
        matches!(e, Error::ArrayClosed { op: "Optimizer::step", ref array, .. }
            if array.contains("'b.velocity'")),
        "{e}"
    );
    assert_eq!(values_of(&tracked.iter().collect::<Vec<_>>()), before);
    assert_eq!(opt.steps(), 1, "a refused step is not counted");
    m.close().unwrap();
    let e = opt.step().unwrap_err();
    assert!(matches!(e, Error::ArrayClosed { .. }), "{e}");
}

/// A gradient closed and made anew (`set_requires_gradient(true)` again) is the one later
/// steps read and zero.
#[test]
fn a_gradient_made_anew_is_followed() {
    let (_m, w, b) = model();
    let mut opt = Optimizer::new([&w, &b], Sgd::new(1.0)).unwrap();
    w.gradient().unwrap().close().unwrap();
    let e = opt.step().unwrap_err();
    assert!(
        matches!(e, Error::ArrayClosed { ref array, .. } if array.contains("'w.grad'")),
        "{e}"
    );
    assert_eq!(read(&b), [0.5, -0.5], "nothing changed");
    w.set_requires_gradient(true).unwrap();
    let grad = w.gradient().unwrap();
    grad.fill_(1.0).unwrap();
    opt.step().unwrap();
    assert_eq!(read(&w), [0.0, 1.0, 2.0, 3.0]);
    assert_eq!(read(&grad), [0.0; 4], "the new gradient is zeroed");
    assert_eq!(read(&b), [0.0, -1.0]);
}

#[test]
fn lr_is_settable_and_checked() {
    let (_m, w, b) = model();
    let mut opt = Optimizer::new(NDList::from(vec![w.clone(), b.clone()]), Sgd::new(0.1)).unwrap();
    assert_eq!(opt.lr(), 0.1);
    assert_eq!(opt.parameters(), [w.clone(), b.clone()]);
    let e = opt.set_lr(-1.0).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { op: "Optimizer::set_lr", ref reason, .. }
            if reason.contains("lr")),
        "{e}"
    );
    assert_eq!(opt.lr(), 0.1, "unchanged");
    opt.set_lr(1.0).unwrap();
    assert_eq!(*opt.kind(), OptimizerKind::Sgd(Sgd::new(1.0)));
    opt.step().unwrap();
    assert_eq!(read(&w), [0.5, 1.5, 2.5, 3.5], "the new lr is used");
    assert_eq!(read(&b), [0.0, -1.0]);

    let mut adam = Optimizer::new([&w], AdamW::new(0.1)).unwrap();
    adam.set_lr(0.0).unwrap();
    assert_eq!(adam.lr(), 0.0);
    let e = adam.set_lr(f64::NAN).unwrap_err();
    assert!(e.to_string().contains("lr"), "{e}");
    assert_eq!(adam.lr(), 0.0);
}

/// `zero_gradients` alone zeroes every gradient and leaves the parameters and the step count.
#[test]
fn zero_gradients_alone() {
    let (_m, w, b) = model();
    let opt = Optimizer::new([&w, &b], Adam::new(0.1)).unwrap();
    opt.zero_gradients().unwrap();
    assert_eq!(read(&w.gradient().unwrap()), [0.0; 4]);
    assert_eq!(read(&b.gradient().unwrap()), [0.0; 2]);
    assert_eq!(read(&w), [1.0, 2.0, 3.0, 4.0]);
    assert_eq!(opt.steps(), 0);
}

device_tests!(a_step_under_an_open_collector_is_not_recorded);
/// `step` inside an open collector (DJL users call `trainer.step()` in the collector's block):
/// it is refused by nothing, records nothing, and the collector still records afterwards, so a
/// second forward and backward in the same collector give the right gradient for the updated
/// parameters.
fn a_step_under_an_open_collector_is_not_recorded(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model
        .from_slice(&[1.0f64, -2.0, 3.0], [3])
        .unwrap()
        .with_name("w");
    w.set_requires_gradient(true).unwrap();
    let mut opt = Optimizer::new(
        [&w],
        Sgd {
            momentum: 0.5,
            ..Sgd::new(0.25)
        },
    )
    .unwrap();
    let step = model.sub_scope().unwrap();
    {
        let _active = step.activate();
        let collector = step.gradient_collector().unwrap();
        let loss = w.square().unwrap().sum_all().unwrap();
        collector.backward(&loss).unwrap();
        assert_eq!(read(&w.gradient().unwrap()), [2.0, -4.0, 6.0]);
        opt.step().unwrap();
        assert!(
            ndscope::is_grad_enabled(),
            "recording is back on after step"
        );
        assert_eq!(read(&w), [0.5, -1.0, 1.5]);
        assert_eq!(read(&w.gradient().unwrap()), [0.0; 3]);
        let loss = w.square().unwrap().sum_all().unwrap();
        collector.backward(&loss).unwrap();
        assert_eq!(read(&w.gradient().unwrap()), [1.0, -2.0, 3.0]);
        opt.zero_gradients().unwrap();
        assert!(ndscope::is_grad_enabled());
    }
    step.close().unwrap();
    model.close().unwrap();
}
