//! Mixed precision as PyTorch users know it: `autocast` (products in f16/bf16, softmax, losses
//! and sums in f32, each parameter converted once per guard) and `GradScaler` (dynamic loss
//! scaling, a step with a non-finite gradient skipped, decided on the device).

use ndscope::{
    autocast, autocast_dtype, Activation, Adam, DType, Device, Error, GradScaler,
    GradScalerOptions, Manager, NDArray, Optimizer, Sgd,
};

#[path = "../examples/mlp/mod.rs"]
mod mlp;

mod common;
use common::device_tests;

fn values(a: &NDArray) -> Vec<f64> {
    a.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
}

device_tests!(products_run_low_and_precision_sensitive_ops_in_f32);
fn products_run_low_and_precision_sensitive_ops_in_f32(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.randn([4, 8], DType::F32).unwrap();
    let w = m.randn([8, 3], DType::F32).unwrap();
    let b = m.randn([3], DType::F32).unwrap();
    let labels = m.from_slice(&[0i64, 2, 1, 1], [4]).unwrap();
    assert_eq!(autocast_dtype(), None);
    for low in [DType::F16, DType::BF16] {
        let _guard = autocast(low).unwrap();
        assert_eq!(autocast_dtype(), Some(low));
        let y = x.matmul(&w).unwrap();
        assert_eq!(y.dtype(), low);
        assert_eq!(
            x.linear(&w, Some(&b), Activation::Relu).unwrap().dtype(),
            low
        );
        let dense = ndscope::Dense::new(&w, Some(&b), Activation::Identity).unwrap();
        assert_eq!(dense.forward(&x).unwrap().dtype(), low);
        assert_eq!(
            x.matmul_t(&x, ndscope::Transpose::Right).unwrap().dtype(),
            low
        );
        // The precision-sensitive ones in f32, whatever their input.
        assert_eq!(y.softmax(-1).unwrap().dtype(), DType::F32);
        assert_eq!(y.log_softmax(-1).unwrap().dtype(), DType::F32);
        assert_eq!(
            y.softmax_cross_entropy(&labels).unwrap().dtype(),
            DType::F32
        );
        assert_eq!(y.sum_all().unwrap().dtype(), DType::F32);
        assert_eq!(y.mean(&[0], false).unwrap().dtype(), DType::F32);
        // Others in their input's dtype; two float dtypes meet in the wider.
        assert_eq!(y.relu().unwrap().dtype(), low);
        assert_eq!(y.add(&b).unwrap().dtype(), DType::F32);
        // The product is the low-precision product of the rounded inputs.
        let want = x
            .to_dtype(low)
            .unwrap()
            .matmul(&w.to_dtype(low).unwrap())
            .unwrap();
        assert_eq!(values(&y), values(&want));
        dense.close().unwrap();
    }
    // Nested guards: the innermost applies, and the outer one is back after it.
    {
        let _outer = autocast(DType::BF16).unwrap();
        {
            let _inner = autocast(DType::F16).unwrap();
            assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F16);
        }
        assert_eq!(x.matmul(&w).unwrap().dtype(), DType::BF16);
    }
    assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F32);
    for bad in [DType::F32, DType::F64, DType::I32] {
        assert!(matches!(autocast(bad), Err(Error::InvalidArgument { .. })));
    }
    m.close().unwrap();
}

device_tests!(a_parameter_is_converted_once_per_guard_while_unchanged);
fn a_parameter_is_converted_once_per_guard_while_unchanged(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.randn([8, 8], DType::F32).unwrap();
    w.set_requires_gradient(true).unwrap();
    let x = model
        .randn([2, 8], DType::F32)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let arrays_made = |uses: usize, change_between: bool| {
        let step = model.sub_scope().unwrap();
        {
            let _active = step.activate();
            let _bf16 = autocast(DType::BF16).unwrap();
            for i in 0..uses {
                if change_between && i == 1 {
                    w.mul_scalar_(1.0).unwrap();
                }
                x.matmul(&w).unwrap();
            }
        }
        let n = step.report().total_arrays();
        step.close().unwrap();
        n
    };
    // Three products: three results and one bf16 copy of `w`.
    assert_eq!(arrays_made(3, false), 4);
    // Written in place between uses: copied again.
    assert_eq!(arrays_made(3, true), 5);
    // A new guard converts anew (its step's copy is gone with the step).
    assert_eq!(arrays_made(1, false), 2);
    model.close().unwrap();
}

device_tests!(gradients_flow_through_autocast_to_f32_parameters);
fn gradients_flow_through_autocast_to_f32_parameters(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model
        .randn([16, 10], DType::F32)
        .unwrap()
        .mul_scalar(0.3)
        .unwrap();
    let b = model.zeros([10], DType::F32).unwrap();
    for p in [&w, &b] {
        p.set_requires_gradient(true).unwrap();
    }
    let x = model.randn([32, 16], DType::F32).unwrap();
    let labels = model
        .from_vec((0..32).map(|i| (i % 10) as i64).collect(), [32])
        .unwrap();
    let grads = |low: Option<DType>| -> Vec<Vec<f64>> {
        let step = model.sub_scope().unwrap();
        {
            let _active = step.activate();
            let collector = step.gradient_collector().unwrap();
            let loss = {
                let _guard = low.map(|d| autocast(d).unwrap());
                x.linear(&w, Some(&b), Activation::Relu)
                    .unwrap()
                    .softmax_cross_entropy(&labels)
                    .unwrap()
            };
            assert_eq!(loss.dtype(), DType::F32);
            collector.backward(&loss).unwrap();
        }
        step.close().unwrap();
        let out = [&w, &b]
            .iter()
            .map(|p| {
                let g = p.gradient().unwrap();
                assert_eq!(
                    g.dtype(),
                    DType::F32,
                    "the gradient of an f32 parameter is f32"
                );
                let v = values(&g);
                g.fill_(0.0).unwrap();
                v
            })
            .collect();
        out
    };
    let reference = grads(None);
    for (low, tol) in [(DType::F16, 5e-3), (DType::BF16, 3e-2)] {
        let got = grads(Some(low));
        for (g, r) in got.iter().zip(&reference) {
            let scale = 1.0 + r.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            for (a, e) in g.iter().zip(r) {
                assert!((a - e).abs() <= tol * scale, "{low}: {a} vs {e}");
            }
        }
    }
    model.close().unwrap();
}

/// One training step of `w` on `loss_of(w)`, with or without a scaler.
fn step(
    model: &Manager,
    opt: &mut Optimizer,
    scaler: Option<&mut GradScaler>,
    loss_of: &dyn Fn() -> NDArray,
) {
    let scope = model.sub_scope().unwrap();
    {
        let _active = scope.activate();
        let collector = scope.gradient_collector().unwrap();
        let loss = loss_of();
        match scaler {
            Some(s) => {
                collector.backward(&s.scale(&loss).unwrap()).unwrap();
                s.step(opt).unwrap();
                s.update().unwrap();
            }
            None => {
                collector.backward(&loss).unwrap();
                opt.step().unwrap();
            }
        }
    }
    scope.close().unwrap();
}

device_tests!(a_scaled_f32_step_is_the_plain_step_and_a_non_finite_one_is_skipped);
fn a_scaled_f32_step_is_the_plain_step_and_a_non_finite_one_is_skipped(dev: Device) {
    for adam in [false, true] {
        let kind = |lr| -> ndscope::OptimizerKind {
            if adam {
                Adam::new(lr).into()
            } else {
                Sgd {
                    momentum: 0.9,
                    ..Sgd::new(lr)
                }
                .into()
            }
        };
        let model = Manager::new_base_on(dev).unwrap();
        let init = model.randn([6, 3], DType::F32).unwrap();
        let x = model.randn([5, 6], DType::F32).unwrap();
        let bad = x.mul_scalar(f64::INFINITY).unwrap();
        let labels = model.from_slice(&[0i64, 1, 2, 1, 0], [5]).unwrap();
        let make = || {
            let w = init.duplicate().unwrap();
            w.set_requires_gradient(true).unwrap();
            let opt = Optimizer::new([&w], kind(0.05)).unwrap();
            (w, opt)
        };
        let loss =
            |w: &NDArray, x: &NDArray| x.matmul(w).unwrap().softmax_cross_entropy(&labels).unwrap();
        // Plain: two good steps.
        let (w0, mut plain) = make();
        for _ in 0..2 {
            step(&model, &mut plain, None, &|| loss(&w0, &x));
        }
        // Scaled (a power of two: exact in f32), with a non-finite step between the two.
        let (w1, mut scaled) = make();
        let mut scaler = GradScaler::new(&model).unwrap();
        step(&model, &mut scaled, Some(&mut scaler), &|| loss(&w1, &x));
        assert!(!scaler.found_non_finite().unwrap());
        let before = values(&w1);
        let state_before: Vec<Vec<f64>> = scaled.state(&w1).unwrap().iter().map(values).collect();
        step(&model, &mut scaled, Some(&mut scaler), &|| loss(&w1, &bad));
        assert!(scaler.found_non_finite().unwrap(), "adam={adam}");
        assert_eq!(values(&w1), before, "a skipped step changes no parameter");
        let state_after: Vec<Vec<f64>> = scaled.state(&w1).unwrap().iter().map(values).collect();
        assert_eq!(state_after, state_before, "nor any state");
        assert!(
            values(&w1.gradient().unwrap()).iter().all(|&g| g == 0.0),
            "the gradient is zeroed"
        );
        assert_eq!(scaler.scale_value().unwrap(), 32768.0, "backed off");
        // On the CPU the flag is read for free and a skipped step is not counted; a GPU's host
        // does not wait to learn it, and counts it.
        assert_eq!(scaled.steps(), if dev == Device::Cpu { 1 } else { 2 });
        step(&model, &mut scaled, Some(&mut scaler), &|| loss(&w1, &x));
        // The same steps up to rounding: the plain SGD step may fuse the weight gradient's
        // product into the update (another rounding order), the scaled one reads the unscaled
        // gradient. Adam's bias corrections count the steps taken: on a GPU the device keeps
        // that count, so the skipped step is not in it there either.
        for (a, e) in values(&w1).iter().zip(values(&w0)) {
            assert!(
                (a - e).abs() <= 1e-6 * e.abs().max(1.0),
                "adam={adam}: {a} vs {e}"
            );
        }
        assert_eq!(scaler.good_steps().unwrap(), 1);
        model.close().unwrap();
    }
}

device_tests!(the_scale_grows_after_the_interval_and_the_options_are_checked);
fn the_scale_grows_after_the_interval_and_the_options_are_checked(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.randn([4, 2], DType::F32).unwrap();
    w.set_requires_gradient(true).unwrap();
    let x = model.randn([3, 4], DType::F32).unwrap();
    let labels = model.from_slice(&[0i64, 1, 1], [3]).unwrap();
    let mut opt = Optimizer::new([&w], Sgd::new(0.01)).unwrap();
    let options = GradScalerOptions {
        init_scale: 8.0,
        growth_interval: 3,
        ..GradScalerOptions::default()
    };
    let mut scaler = GradScaler::with_options(&model, options).unwrap();
    let mut seen = Vec::new();
    for _ in 0..7 {
        step(&model, &mut opt, Some(&mut scaler), &|| {
            x.matmul(&w)
                .unwrap()
                .softmax_cross_entropy(&labels)
                .unwrap()
        });
        seen.push(scaler.scale_value().unwrap());
    }
    assert_eq!(seen, vec![8.0, 8.0, 16.0, 16.0, 16.0, 32.0, 32.0]);
    // unscale_ twice before update is refused, as PyTorch's.
    {
        let scope = model.sub_scope().unwrap();
        let _active = scope.activate();
        let c = scope.gradient_collector().unwrap();
        c.backward(
            &scaler
                .scale(&x.matmul(&w).unwrap().sum_all().unwrap())
                .unwrap(),
        )
        .unwrap();
        scaler.unscale_(&opt).unwrap();
        assert!(matches!(
            scaler.unscale_(&opt),
            Err(Error::InvalidArgument { .. })
        ));
        scaler.step(&mut opt).unwrap();
        scaler.update().unwrap();
        drop(c);
        drop(_active);
        scope.close().unwrap();
    }
    for bad in [
        GradScalerOptions {
            init_scale: 0.0,
            ..Default::default()
        },
        GradScalerOptions {
            init_scale: f64::INFINITY,
            ..Default::default()
        },
        GradScalerOptions {
            growth_factor: 1.0,
            ..Default::default()
        },
        GradScalerOptions {
            backoff_factor: 1.0,
            ..Default::default()
        },
        GradScalerOptions {
            growth_interval: 0,
            ..Default::default()
        },
    ] {
        assert!(matches!(
            GradScaler::with_options(&model, bad),
            Err(Error::InvalidArgument { .. })
        ));
    }
    model.close().unwrap();
}

device_tests!(without_a_scaler_small_f16_gradients_vanish_and_with_one_they_survive);
fn without_a_scaler_small_f16_gradients_vanish_and_with_one_they_survive(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.full([8, 4], 0.5, DType::F32).unwrap();
    w.set_requires_gradient(true).unwrap();
    let x = model.full([2, 8], 0.25, DType::F32).unwrap();
    let grad = |scaler: Option<&mut GradScaler>| -> Vec<f64> {
        let mut opt = Optimizer::new([&w], Sgd::new(0.0)).unwrap();
        let scope = model.sub_scope().unwrap();
        let g;
        {
            let _active = scope.activate();
            let collector = scope.gradient_collector().unwrap();
            // d loss / d y = 1e-8 per element: below f16's smallest subnormal (6e-8).
            let loss = {
                let _f16 = autocast(DType::F16).unwrap();
                x.matmul(&w)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .mul_scalar(1e-8)
                    .unwrap()
            };
            match scaler {
                Some(s) => {
                    collector.backward(&s.scale(&loss).unwrap()).unwrap();
                    s.unscale_(&opt).unwrap();
                    g = values(&w.gradient().unwrap());
                    s.step(&mut opt).unwrap();
                    s.update().unwrap();
                }
                None => {
                    collector.backward(&loss).unwrap();
                    g = values(&w.gradient().unwrap());
                    opt.step().unwrap();
                }
            }
        }
        scope.close().unwrap();
        g
    };
    assert!(
        grad(None).iter().all(|&v| v == 0.0),
        "f16 flushes 1e-8 to zero"
    );
    let mut scaler = GradScaler::new(&model).unwrap();
    let scaled = grad(Some(&mut scaler));
    // x · 1e-8 = 2.5e-9 · 2 rows = 5e-9 per weight, recovered to within f16's precision.
    for v in scaled {
        assert!((v - 5e-9).abs() < 5e-9 * 2e-2, "{v}");
    }
    model.close().unwrap();
}

#[test]
fn a_scaler_on_another_device_than_the_parameters_is_refused_before_anything_changes() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.ones([3], DType::F32).unwrap();
    w.set_requires_gradient(true).unwrap();
    w.gradient().unwrap().fill_(2.0).unwrap();
    let mut opt = Optimizer::new([&w], Sgd::new(0.1)).unwrap();
    let host = Manager::new_base();
    let mut scaler = GradScaler::new(&host).unwrap();
    let err = scaler.step(&mut opt).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    assert_eq!(
        values(&w.gradient().unwrap()),
        vec![2.0; 3],
        "the gradient is unchanged"
    );
    assert_eq!(values(&w), vec![1.0; 3], "and the parameter");
    model.close().unwrap();
    host.close().unwrap();
}

device_tests!(addmm_multiplies_halves_into_f32);
/// An f32 target takes a product of halves (`addmm_`): accumulated and kept in f32, never
/// rounded to the half type; other dtype mixes are refused and change nothing.
fn addmm_multiplies_halves_into_f32(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    // 256 + 1 = 257 needs 9 significant bits: bf16 has 8, f16 11.
    let a = m.from_slice(&[256.0f32, 1.0], [2, 1]).unwrap();
    let b = m.from_slice(&[1.0f32, 1.0], [2, 1]).unwrap();
    for low in [DType::BF16, DType::F16] {
        let (a, b) = (a.to_dtype(low).unwrap(), b.to_dtype(low).unwrap());
        let target = m.full([1, 1], 5.0, DType::F32).unwrap();
        target
            .addmm_(&a, &b, ndscope::Transpose::Left, 1.0, 1.0)
            .unwrap();
        assert_eq!(target.to_vec::<f32>().unwrap(), vec![262.0], "{low}");
        target
            .addmm_(&a, &b, ndscope::Transpose::Left, 0.0, 2.0)
            .unwrap();
        assert_eq!(target.to_vec::<f32>().unwrap(), vec![514.0], "{low}");
        // The same product rounded to the half type, for contrast: bf16 loses the 1.
        let rounded = a.matmul_t(&b, ndscope::Transpose::Left).unwrap();
        let want = if low == DType::BF16 { 256.0 } else { 257.0 };
        assert_eq!(values(&rounded), vec![want], "{low}");
    }
    // Refused: a half target with f32 operands, operands of two half types, an f64 target.
    let (a16, bbf) = (
        a.to_dtype(DType::F16).unwrap(),
        b.to_dtype(DType::BF16).unwrap(),
    );
    let half_target = m.zeros([1, 1], DType::BF16).unwrap();
    let f32_target = m.zeros([1, 1], DType::F32).unwrap();
    let f64_target = m.zeros([1, 1], DType::F64).unwrap();
    let t = ndscope::Transpose::Left;
    for err in [
        half_target.addmm_(&a, &b, t, 1.0, 1.0).unwrap_err(),
        f32_target.addmm_(&a16, &bbf, t, 1.0, 1.0).unwrap_err(),
        f32_target.addmm_(&a16, &b, t, 1.0, 1.0).unwrap_err(),
        f64_target.addmm_(&a16, &a16, t, 1.0, 1.0).unwrap_err(),
    ] {
        assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    }
    assert_eq!(values(&f32_target), vec![0.0]);
    assert_eq!(values(&half_target), vec![0.0]);
    m.close().unwrap();
}

device_tests!(a_weight_gradient_under_autocast_is_not_rounded_to_the_half_type);
/// The weight gradient of an autocast product goes into the f32 parameter's gradient straight
/// from the halves: not rounded to the half type on the way (so no half copy of it is made).
fn a_weight_gradient_under_autocast_is_not_rounded_to_the_half_type(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.ones([1, 1], DType::F32).unwrap();
    w.set_requires_gradient(true).unwrap();
    // d(sum(x · w))/dw = 256 + 1 = 257: a bf16 product would give 256.
    let x = model.from_slice(&[256.0f32, 1.0], [2, 1]).unwrap();
    for (dense, stepped) in [(false, false), (true, false), (true, true)] {
        let step = model.sub_scope().unwrap();
        {
            let _active = step.activate();
            let collector = step.gradient_collector().unwrap();
            let loss = {
                let _guard = autocast(DType::BF16).unwrap();
                let y = if dense {
                    x.linear(&w, None, Activation::Identity).unwrap()
                } else {
                    x.matmul(&w).unwrap()
                };
                assert_eq!(y.dtype(), DType::BF16);
                y.sum_all().unwrap()
            };
            collector.backward(&loss).unwrap();
            if stepped {
                // The optimizer takes the product (and leaves the gradient zeroed): w ← 1 −
                // 257/1024, exact in f32 (a bf16 gradient would give 0.75).
                let mut opt = Optimizer::new([w.clone()], Sgd::new(1.0 / 1024.0)).unwrap();
                opt.step().unwrap();
            }
        }
        step.close().unwrap();
        let g = w.gradient().unwrap();
        assert_eq!(g.dtype(), DType::F32);
        if stepped {
            assert_eq!(values(&w), vec![1.0 - 257.0 / 1024.0], "dense {dense}");
            assert_eq!(values(&g), vec![0.0], "the step zeroes the gradient");
        } else {
            assert_eq!(values(&g), vec![257.0], "dense {dense}");
        }
        g.fill_(0.0).unwrap();
    }
    model.close().unwrap();
}

/// The bits of every element (NaN payloads included), for comparisons that must be exact.
fn bits(a: &NDArray) -> Vec<u64> {
    values(a).iter().map(|v| v.to_bits()).collect()
}

device_tests!(an_autocast_layer_computes_what_it_computes_on_half_copies_bit_for_bit);
/// Two dense layers under autocast (f32 parameters, which the products read rounded, with no
/// half copy) against the same layers run by hand on half copies made with `to_dtype`: the
/// loss, the outputs and every parameter's gradient agree bit for bit on the CPU, in both half
/// types (the rounded packing feeds the same kernels). On CUDA the rounded layers run our own
/// product kernel and the copies cuBLAS, whose order of summation is its own, so they agree
/// within float tolerance there (the rounding itself is checked exactly by
/// `a_layer_reading_f32_weights_rounded_reads_each_as_to_dtype_rounds_it`). The shapes are odd
/// (k = 37, n = 40 and 12: an odd depth, strips not filled), and the weights hold values that
/// round up, ties, infinities and NaN-free extremes of the half types.
fn an_autocast_layer_computes_what_it_computes_on_half_copies_bit_for_bit(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let special = |n: usize, seed: f32| -> Vec<f32> {
        (0..n)
            .map(|i| match i % 7 {
                // 1 + 2^-8 is a bf16 tie (to 1), 1 + 2^-11 an f16 one.
                0 => 1.0 + 2f32.powi(-8),
                1 => -(1.0 + 2f32.powi(-11)),
                2 => 1.0 + 3.0 * 2f32.powi(-9),
                _ => ((i as f32 * 0.37 + seed).sin()) * 0.5,
            })
            .collect()
    };
    let (m, k, h, n) = (16, 37, 40, 12);
    let w1 = model.from_vec(special(k * h, 0.1), [k, h]).unwrap();
    let b1 = model.from_vec(special(h, 0.2), [h]).unwrap();
    let w2 = model.from_vec(special(h * n, 0.3), [h, n]).unwrap();
    let b2 = model.from_vec(special(n, 0.4), [n]).unwrap();
    let params = [&w1, &b1, &w2, &b2];
    for p in params {
        p.set_requires_gradient(true).unwrap();
    }
    let x = model.from_vec(special(m * k, 0.5), [m, k]).unwrap();
    let labels = model
        .from_vec((0..m).map(|i| (i % n) as i64).collect(), [m])
        .unwrap();
    // Loss, logits and the gradients, by autocast or by hand on half copies.
    let run = |low: DType, by_hand: bool| -> Vec<Vec<u64>> {
        let step = model.sub_scope().unwrap();
        let mut out = {
            let _active = step.activate();
            let collector = step.gradient_collector().unwrap();
            let (logits, loss) = if by_hand {
                let c = |a: &NDArray| a.to_dtype(low).unwrap();
                let hidden = c(&x)
                    .linear(&c(&w1), Some(&c(&b1)), Activation::Relu)
                    .unwrap();
                let logits = hidden
                    .linear(&c(&w2), Some(&c(&b2)), Activation::Identity)
                    .unwrap();
                let loss = logits
                    .to_dtype(DType::F32)
                    .unwrap()
                    .softmax_cross_entropy(&labels)
                    .unwrap();
                (logits, loss)
            } else {
                let _guard = autocast(low).unwrap();
                let hidden = x.linear(&w1, Some(&b1), Activation::Relu).unwrap();
                let logits = hidden.linear(&w2, Some(&b2), Activation::Identity).unwrap();
                let loss = logits.softmax_cross_entropy(&labels).unwrap();
                (logits, loss)
            };
            assert_eq!(logits.dtype(), low);
            collector.backward(&loss).unwrap();
            vec![bits(&loss), bits(&logits)]
        };
        step.close().unwrap();
        for p in params {
            let g = p.gradient().unwrap();
            assert_eq!(g.dtype(), DType::F32);
            out.push(bits(&g));
            g.fill_(0.0).unwrap();
        }
        out
    };
    for low in [DType::BF16, DType::F16] {
        let (auto, hand) = (run(low, false), run(low, true));
        let what = ["loss", "logits", "w1.grad", "b1.grad", "w2.grad", "b2.grad"];
        for ((a, b), what) in auto.iter().zip(&hand).zip(what) {
            if dev.is_cpu() {
                assert_eq!(
                    a, b,
                    "{low}: {what} differs between autocast and half copies"
                );
                continue;
            }
            let (a, b): (Vec<f64>, Vec<f64>) = (
                a.iter().map(|&x| f64::from_bits(x)).collect(),
                b.iter().map(|&x| f64::from_bits(x)).collect(),
            );
            let scale = b.iter().fold(1f64, |m, v| m.max(v.abs()));
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    (x - y).abs() <= 2e-2 * scale,
                    "{low}: {what}[{i}] is {x} under autocast, {y} on half copies"
                );
            }
        }
    }
    model.close().unwrap();
}

device_tests!(a_layer_reading_f32_weights_rounded_reads_each_as_to_dtype_rounds_it);
/// Under autocast a layer reads its f32 weights rounded to the half type, forward (`w` as
/// stored) and backward (`w` transposed, for the input's gradient), and gives the bits of the
/// same products run on a `to_dtype` copy of `w`, on every device. Each row of the input holds
/// two ones (columns i and i + 1), and so does each row of the output's gradient: every sum
/// has two terms and zeros, which any order of summation adds alike (cuBLAS's, our CUDA
/// kernel's, the CPU's), so the comparison is exact on a GPU too. The weights hold ties (to even
/// both ways, in bf16 and in f16), f16's largest finite value and a subnormal: a sum of two
/// values read unrounded differs, after the result's rounding, from the sum of the rounded ones.
fn a_layer_reading_f32_weights_rounded_reads_each_as_to_dtype_rounds_it(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let (k, n) = (37, 40);
    let stored: Vec<f32> = (0..k * n)
        .map(|i| match i % 9 {
            // Ties: to 1 and up to 1 + 2^-6 in bf16; to 1 and up to 1 + 2^-9 in f16.
            0 => 1.0 + 2f32.powi(-8),
            1 => -(1.0 + 3.0 * 2f32.powi(-8)),
            2 => 1.0 + 2f32.powi(-11),
            3 => 1.0 + 3.0 * 2f32.powi(-11),
            // f16: down to 65504 (65520 would overflow); a subnormal; 257 is a bf16 tie.
            4 => -65519.0,
            5 => 6.0e-5,
            6 => 257.0,
            _ => (i as f32 * 0.37).sin() * 3.0,
        })
        .collect();
    let w = model.from_vec(stored, [k, n]).unwrap();
    // Ones at [i][i] and [i][i + 1] (wrapping at `cols`).
    let pairs = |rows: usize, cols: usize| -> Vec<f32> {
        (0..rows * cols)
            .map(|q| {
                let (i, j) = (q / cols, q % cols);
                f32::from(u8::from(j == i || j == (i + 1) % cols))
            })
            .collect()
    };
    for low in [DType::BF16, DType::F16] {
        let step = model.sub_scope().unwrap();
        {
            let _active = step.activate();
            let w_low = w.to_dtype(low).unwrap();
            let x = step.from_vec(pairs(k, k), [k, k]).unwrap();
            let x = x.to_dtype(low).unwrap();
            x.set_requires_gradient(true).unwrap();
            let g = step.from_vec(pairs(k, n), [k, n]).unwrap();
            let g = g.to_dtype(low).unwrap();
            let collector = step.gradient_collector().unwrap();
            let y = {
                let _low = autocast(low).unwrap();
                x.linear(&w, None, Activation::Identity).unwrap()
            };
            assert_eq!(y.dtype(), low);
            let by_copy = x.linear(&w_low, None, Activation::Identity).unwrap();
            assert_eq!(bits(&y), bits(&by_copy), "{low}: the forward read");
            // d(sum(y ⊙ g))/dx = g · wᵀ.
            collector
                .backward(&y.mul(&g).unwrap().sum_all().unwrap())
                .unwrap();
            let gx = x.gradient().unwrap();
            assert_eq!(gx.dtype(), low);
            let by_copy = g.matmul(&w_low.transpose().unwrap()).unwrap();
            assert_eq!(
                bits(&gx),
                bits(&by_copy),
                "{low}: backward's transposed read"
            );
        }
        step.close().unwrap();
    }
    model.close().unwrap();
}

device_tests!(an_autocast_layer_makes_no_half_copy_of_its_weights);
/// A layer under autocast reads its f32 weights rounded as its product reads them: the step
/// makes its result and nothing else, and its backward pass makes no copy either. On CUDA that
/// holds for products up to 2^25 multiply-adds (our own kernel); a larger one converts the
/// weights once per guard and runs on cuBLAS's tensor cores, while the CPU never copies.
fn an_autocast_layer_makes_no_half_copy_of_its_weights(dev: Device) {
    let model = Manager::new_base_on(dev).unwrap();
    let w = model.randn([64, 32], DType::F32).unwrap();
    let w2 = model.randn([32, 8], DType::F32).unwrap();
    for p in [&w, &w2] {
        p.set_requires_gradient(true).unwrap();
    }
    let x = model
        .randn([4, 64], DType::F32)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let step = model.sub_scope().unwrap();
    {
        let _active = step.activate();
        let _bf16 = autocast(DType::BF16).unwrap();
        let y = x.linear(&w, None, Activation::Identity).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        assert_eq!(step.report().total_arrays(), 1);
        x.linear(&w, None, Activation::Relu).unwrap();
        assert_eq!(step.report().total_arrays(), 2);
    }
    step.close().unwrap();
    // 1024·256·256 multiply-adds, above CUDA's bound: a half copy there, once per guard.
    let big_w = model.randn([256, 256], DType::F32).unwrap();
    big_w.set_requires_gradient(true).unwrap();
    let big_x = model
        .randn([1024, 256], DType::F32)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let copies = usize::from(!dev.is_cpu());
    let step = model.sub_scope().unwrap();
    {
        let _active = step.activate();
        let _bf16 = autocast(DType::BF16).unwrap();
        big_x.linear(&big_w, None, Activation::Identity).unwrap();
        assert_eq!(step.report().total_arrays(), 1 + copies);
        big_x.linear(&big_w, None, Activation::Relu).unwrap();
        assert_eq!(step.report().total_arrays(), 2 + copies);
    }
    step.close().unwrap();
    // Backward through a second layer reads `w2` for the first layer's output gradient: the
    // bytes backward leaves in the step are the same whether `w2` is f32 or a bf16 copy of
    // it made outside the step, so no copy of `w2` is made in it.
    let w2_low = w2.to_dtype(DType::BF16).unwrap();
    w2_low.set_requires_gradient(true).unwrap();
    let step_bytes = |second: &NDArray| {
        let step = model.sub_scope().unwrap();
        let bytes = {
            let _active = step.activate();
            let collector = step.gradient_collector().unwrap();
            let loss = {
                let _bf16 = autocast(DType::BF16).unwrap();
                x.linear(&w, None, Activation::Relu)
                    .unwrap()
                    .linear(second, None, Activation::Identity)
                    .unwrap()
                    .sum_all()
                    .unwrap()
            };
            collector.backward(&loss).unwrap();
            step.report().total_bytes()
        };
        step.close().unwrap();
        for p in [&w, &w2, &w2_low] {
            p.gradient().unwrap().fill_(0.0).unwrap();
        }
        bytes
    };
    assert_eq!(step_bytes(&w2), step_bytes(&w2_low));
    model.close().unwrap();
}

/// The random stream is one per process: tests that seed it take turns.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

device_tests!(the_learned_mixed_precision_step_of_train_mlp_needs_about_half_the_f32_block);
/// `train_mlp`'s learned step (784→256→128→10, batch 128, autograd, SGD with momentum, the
/// batch in the step's dtype as its prefetcher delivers it) learns a workspace block about half
/// the f32 one in bf16 and in f16 (with its loss scaler), on the CPU and on CUDA. Before the
/// products read f32 weights rounded, the half copies of the weights made the bf16 block 1.15×
/// the f32 one at this batch on the CPU, 0.98× on CUDA.
fn the_learned_mixed_precision_step_of_train_mlp_needs_about_half_the_f32_block(dev: Device) {
    let _seeded = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    let block = |dtype: DType| -> usize {
        let trainer = Manager::new_base_on(dev).unwrap().with_name("trainer");
        let ws = trainer
            .workspace("batch", ndscope::WorkspaceConfig::default())
            .unwrap();
        let model = Manager::new_base_on(dev).unwrap().with_name("model");
        ndscope::manual_seed(3);
        let net = mlp::Mlp::with_gradients(&model, &[784, 256, 128, 10]).unwrap();
        let sgd = Sgd {
            momentum: 0.9,
            ..Sgd::new(0.02)
        };
        let mut optimizer = Optimizer::new(net.parameters(), sgd).unwrap();
        let precision = mlp::Precision::new(&model, dtype).unwrap();
        let x = trainer
            .randn([128, 784], DType::F32)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let y = trainer
            .from_vec((0..128).map(|i| i % 10).collect::<Vec<i64>>(), [128])
            .unwrap();
        for _ in 0..3 {
            ws.cycle(|_| {
                net.autograd_step_in(&precision, &mut optimizer, &x, &y)
                    .map(|_| ())
            })
            .unwrap();
        }
        let stats = ws.stats();
        assert_eq!(stats.cycles, 3);
        drop(precision);
        model.close().unwrap();
        trainer.close().unwrap();
        stats.capacity
    };
    let full = block(DType::F32);
    for low in [DType::BF16, DType::F16] {
        let half = block(low);
        eprintln!(
            "{dev}: {low} block {half} B, f32 block {full} B: {:.2}×",
            half as f64 / full as f64
        );
        assert!(
            half > 0 && half * 100 <= full * 55,
            "{low} block {half} B against the f32 block {full} B: more than 0.55×"
        );
    }
}
