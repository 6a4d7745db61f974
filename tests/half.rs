//! Half precision on the CPU: `f16` and `bf16` arrays, their conversions (round to nearest
//! even, once), every float op computing in f32 and rounding each result once, reports and
//! workspaces counting 2 bytes an element, `HostArray`, and safetensors files as the reference
//! implementation writes them.

use std::collections::HashMap;

use ndscope::{bf16, f16, manual_seed, Activation, DType, Error, HostArray, Manager, NDArray};

const HALVES: [DType; 2] = [DType::F16, DType::BF16];

/// The random stream is one per process and the tests of this file run at once: a test that
/// seeds it or draws from it takes its turn, so no other test's seed or draws come between its
/// own (two seedings of one test would otherwise give different numbers).
fn seeded() -> std::sync::MutexGuard<'static, ()> {
    static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SEEDED.lock().unwrap_or_else(|e| e.into_inner())
}

fn values(a: &NDArray) -> Vec<f64> {
    match a.dtype() {
        DType::F16 => a
            .to_vec::<f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_f64())
            .collect(),
        DType::BF16 => a
            .to_vec::<bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_f64())
            .collect(),
        DType::F32 => a
            .to_vec::<f32>()
            .unwrap()
            .iter()
            .map(|&v| v as f64)
            .collect(),
        DType::F64 => a.to_vec::<f64>().unwrap(),
        other => panic!("not a float: {other}"),
    }
}

/// `v` rounded once to `dtype`, to nearest even: an independent reference that compares `v`
/// with the neighbouring half values in f64 (exact for values this close), rather than trust
/// any conversion routine.
fn round(dtype: DType, v: f64) -> f64 {
    fn nearest(v: f64, from_bits: fn(u16) -> f64, to_bits: fn(f32) -> u16) -> f64 {
        if v.is_nan() {
            return v;
        }
        let guess = to_bits(v as f32);
        let mut best: Option<(f64, u16)> = None;
        for delta in [-2i32, -1, 0, 1, 2] {
            let bits = (guess as i32 + delta) as u16;
            let h = from_bits(bits);
            if h.is_nan() || (h.signum() != v.signum() && h != 0.0) {
                continue;
            }
            let d = (h - v).abs();
            best = match best {
                Some((b, bb)) if d > (from_bits(bb) - v).abs() => Some((b, bb)),
                Some((b, bb)) if d == (from_bits(bb) - v).abs() && bb % 2 == 0 => Some((b, bb)),
                _ => Some((h, bits)),
            };
        }
        best.map(|(h, _)| h).unwrap_or(v)
    }
    match dtype {
        DType::F16 => {
            // Beyond the largest finite f16 (65504) by half an ulp or more: infinity.
            if v.abs() >= 65520.0 {
                return f64::INFINITY.copysign(v);
            }
            nearest(
                v,
                |b| f16::from_bits(b).to_f64(),
                |f| f16::from_f32(f).to_bits(),
            )
        }
        DType::BF16 => {
            if v.abs() >= 3.3961776e38 {
                return f64::INFINITY.copysign(v);
            }
            nearest(
                v,
                |b| bf16::from_bits(b).to_f64(),
                |f| bf16::from_f32(f).to_bits(),
            )
        }
        DType::F32 => v as f32 as f64,
        _ => v,
    }
}

fn same(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()) || (*x == 0.0 && *y == 0.0),
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

/// `a` and `b` (values of bf16) are equal, or neighbours: one unit in the last place of bf16
/// apart.
fn within_one_bf16_ulp(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (bx, by) = ((*x as f32).to_bits() >> 16, (*y as f32).to_bits() >> 16);
        assert!(
            bx.abs_diff(by) <= 1 || (x.is_nan() && y.is_nan()) || (*x == 0.0 && *y == 0.0),
            "{what}: element {i}: {x} vs {y}"
        );
    }
}

/// Values that exercise the conversions: ordinary numbers, the halves' extremes, subnormals,
/// infinities, NaN, and a spread of magnitudes.
fn probe() -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        0.1,
        1.0 / 3.0,
        65504.0,
        65520.0,
        1e5,
        -7e4,
        6e-8,
        3e-8,
        1e-40,
        3.4e38,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        1.0 + 2f32.powi(-8),
        1.0 + 2f32.powi(-11),
        255.5,
        -0.007_812_5,
    ];
    let mut s = 0x9e37_79b9u32;
    for _ in 0..200 {
        s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        let mant = (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
        v.push(mant * 2f32.powi((s % 40) as i32 - 20));
    }
    v
}

#[test]
fn to_dtype_rounds_to_nearest_even_once_and_keeps_nan_and_infinities() {
    let m = Manager::new_base();
    let x = m.from_vec(probe(), [probe().len()]).unwrap();
    for dtype in HALVES {
        let h = x.to_dtype(dtype).unwrap();
        let want: Vec<f64> = probe().iter().map(|&v| round(dtype, v as f64)).collect();
        same(&values(&h), &want, &format!("f32 -> {dtype}"));
        // Back to f32 is exact, and so is a round trip through the other float types.
        same(&values(&h.to_dtype(DType::F32).unwrap()), &want, "back");
        same(
            &values(&h.to_dtype(DType::F64).unwrap().to_dtype(dtype).unwrap()),
            &want,
            "f64",
        );
    }
    // Every f16 bit pattern survives f16 -> f32 -> f16 and f16 -> bf16 -> f32 rounds once.
    let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let h = m.from_vec(all.clone(), [all.len()]).unwrap();
    let back = h
        .to_dtype(DType::F32)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let back = back.to_vec::<f16>().unwrap();
    for (a, b) in all.iter().zip(&back) {
        assert!(
            a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
            "{a} {b}"
        );
    }
    // From f64, once: 1 + 2^-11 + 2^-40 is above the midpoint of f16 1 and 1 + 2^-10, so it
    // rounds up; through f32 it would first become the midpoint and then round to even (1).
    let x = m
        .from_vec(vec![1.0 + 2f64.powi(-11) + 2f64.powi(-40)], [1])
        .unwrap();
    assert_eq!(
        values(&x.to_dtype(DType::F16).unwrap()),
        vec![1.0 + 2f64.powi(-10)]
    );
    // An i64 just above a bf16 midpoint whose nearest f64 is the midpoint: rounded once, up
    // (through f64 to nearest, then to even, it would go down to 2^62).
    let big = m.from_vec(vec![(1i64 << 62) + (1 << 54) + 1], [1]).unwrap();
    let got = big.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap()[0].to_f64();
    assert_eq!(got, 2f64.powi(62) + 2f64.powi(55));
    // Integers: into halves by rounding, out of them truncating toward zero and saturating.
    let i = m.from_vec(vec![3i64, -70000, 1 << 40, 257], [4]).unwrap();
    assert_eq!(
        values(&i.to_dtype(DType::F16).unwrap()),
        vec![3.0, f64::NEG_INFINITY, f64::INFINITY, 257.0]
    );
    assert_eq!(
        values(&i.to_dtype(DType::BF16).unwrap()),
        vec![3.0, -70144.0, 2f64.powi(40), 256.0]
    );
    let h = m
        .from_vec(
            vec![bf16::from_f32(-2.75), bf16::from_f32(300.0), bf16::NAN],
            [3],
        )
        .unwrap();
    assert_eq!(
        h.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap(),
        vec![-2, 300, 0]
    );
    assert_eq!(
        h.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 255, 0]
    );
    m.close().unwrap();
}

#[test]
fn random_draws_are_the_f64_draws_rounded_once_and_rand_stays_below_high() {
    let _turn = seeded();
    let m = Manager::new_base();
    for dtype in HALVES {
        manual_seed(11);
        let wide = values(&m.randn([4096], DType::F64).unwrap());
        manual_seed(11);
        let h = values(&m.randn([4096], dtype).unwrap());
        let want: Vec<f64> = wide.iter().map(|&v| round(dtype, v)).collect();
        same(&h, &want, &format!("randn {dtype}"));
        // Uniform draws in [0, 1): in bf16 one in ~500 lies within half an ulp of 1 and would
        // round up to it.
        let u = values(&m.rand([200_000], 0.0, 1.0, dtype).unwrap());
        assert!(
            u.iter().all(|&v| (0.0..1.0).contains(&v)),
            "rand {dtype} reached 1"
        );
        let top = u.iter().cloned().fold(0.0, f64::max);
        assert!(top > 0.99, "rand {dtype}: largest draw {top}");
    }
    m.close().unwrap();
}

/// A float op on halves computes in f32 and rounds once: the same bits as the f32 op on the
/// widened inputs, rounded.
#[test]
fn elementwise_ops_compute_in_f32_and_round_once() {
    let m = Manager::new_base();
    let a32: Vec<f32> = probe();
    let b32: Vec<f32> = probe().iter().rev().map(|v| v * 0.75 + 0.5).collect();
    let n = a32.len();
    type Unary = fn(&NDArray) -> ndscope::Result<NDArray>;
    let unary: [(&str, Unary); 12] = [
        ("exp", NDArray::exp),
        ("log", NDArray::log),
        ("sqrt", NDArray::sqrt),
        ("tanh", NDArray::tanh),
        ("sigmoid", NDArray::sigmoid),
        ("gelu", NDArray::gelu),
        ("relu", NDArray::relu),
        ("neg", NDArray::neg),
        ("abs", NDArray::abs),
        ("square", NDArray::square),
        ("pow 1.5", |x| x.pow_scalar(1.5)),
        ("mul_scalar 0.1", |x| x.mul_scalar(0.1)),
    ];
    type Binary = fn(&NDArray, &NDArray) -> ndscope::Result<NDArray>;
    let binary: [(&str, Binary); 6] = [
        ("add", NDArray::add),
        ("sub", NDArray::sub),
        ("mul", NDArray::mul),
        ("div", NDArray::div),
        ("maximum", NDArray::maximum),
        ("minimum", NDArray::minimum),
    ];
    for dtype in HALVES {
        let a = m
            .from_vec(a32.clone(), [n])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let b = m
            .from_vec(b32.clone(), [n])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // The f32 reference on exactly the half values.
        let (wa, wb) = (
            a.to_dtype(DType::F32).unwrap(),
            b.to_dtype(DType::F32).unwrap(),
        );
        for (name, f) in unary {
            let want: Vec<f64> = values(&f(&wa).unwrap())
                .iter()
                .map(|&v| round(dtype, v))
                .collect();
            let got = f(&a).unwrap();
            assert_eq!(got.dtype(), dtype);
            same(&values(&got), &want, &format!("{name} {dtype}"));
        }
        for (name, f) in binary {
            let want: Vec<f64> = values(&f(&wa, &wb).unwrap())
                .iter()
                .map(|&v| round(dtype, v))
                .collect();
            same(
                &values(&f(&a, &b).unwrap()),
                &want,
                &format!("{name} {dtype}"),
            );
        }
        // Comparisons are exact.
        assert_eq!(
            a.gt(&b).unwrap().to_vec::<u8>().unwrap(),
            wa.gt(&wb).unwrap().to_vec::<u8>().unwrap()
        );
    }
    m.close().unwrap();
}

#[test]
fn reductions_softmax_products_and_losses_accumulate_in_f32() {
    let _turn = seeded();
    let m = Manager::new_base();
    manual_seed(3);
    for dtype in HALVES {
        let x = m
            .randn([64, 300], DType::F32)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let w = m
            .randn([300, 40], DType::F32)
            .unwrap()
            .mul_scalar(0.05)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (wx, ww) = (
            x.to_dtype(DType::F32).unwrap(),
            w.to_dtype(DType::F32).unwrap(),
        );
        let rounded =
            |a: &NDArray| -> Vec<f64> { values(a).iter().map(|&v| round(dtype, v)).collect() };
        // Products: f32 products of the half values, rounded once. f16 runs the same f32
        // kernel, bit for bit; bf16 runs `vdpbf16ps` where the CPU has AVX512-BF16, whose f32
        // sums round differently (pairs of products at a time) in the last bits of f32, which
        // can move a result rounded to bf16 by one unit in the last place.
        let products = if dtype == DType::BF16 {
            within_one_bf16_ulp
        } else {
            same
        };
        products(
            &values(&x.matmul(&w).unwrap()),
            &rounded(&wx.matmul(&ww).unwrap()),
            "matmul",
        );
        let b = m.randn([40], DType::F32).unwrap().to_dtype(dtype).unwrap();
        let wb = b.to_dtype(DType::F32).unwrap();
        let y = x.linear(&w, Some(&b), Activation::Relu).unwrap();
        products(
            &values(&y),
            &rounded(&wx.linear(&ww, Some(&wb), Activation::Relu).unwrap()),
            "linear",
        );
        // Softmax and its log in f32, rounded once.
        same(
            &values(&x.softmax(-1).unwrap()),
            &rounded(&wx.softmax(-1).unwrap()),
            "softmax",
        );
        same(
            &values(&x.log_softmax(0).unwrap()),
            &rounded(&wx.log_softmax(0).unwrap()),
            "log_softmax",
        );
        // A sum of 19200 values is not representable in 8 or 11 bits as it goes: it is
        // accumulated wide and rounded once.
        let s = values(&x.sum_all().unwrap())[0];
        let exact: f64 = values(&x).iter().sum();
        assert_eq!(s, round(dtype, exact), "sum_all {dtype}");
        let rows = values(&x.sum(&[1], false).unwrap());
        let want = values(&wx.to_dtype(DType::F64).unwrap().sum(&[1], false).unwrap());
        same(
            &rows,
            &want.iter().map(|&v| round(dtype, v)).collect::<Vec<_>>(),
            "sum rows",
        );
        // Cross-entropy: the loss and its gradient in f32.
        let labels = m
            .from_vec((0..64).map(|i| (i * 7 % 40) as i64).collect(), [64])
            .unwrap();
        let logits = y.sub_scalar(1.0).unwrap();
        let loss = values(&logits.softmax_cross_entropy(&labels).unwrap())[0];
        let wl = values(
            &logits
                .to_dtype(DType::F32)
                .unwrap()
                .softmax_cross_entropy(&labels)
                .unwrap(),
        )[0];
        assert_eq!(loss, round(dtype, wl), "cross-entropy {dtype}");
        let top = x.max(1, false).unwrap();
        same(&values(&top), &values(&wx.max(1, false).unwrap()), "max");
        assert_eq!(
            x.argmax(1).unwrap().to_vec::<i64>().unwrap(),
            wx.argmax(1).unwrap().to_vec::<i64>().unwrap()
        );
    }
    m.close().unwrap();
}

#[test]
fn shape_ops_move_half_values_unchanged() {
    let m = Manager::new_base();
    for dtype in HALVES {
        let x = m
            .arange(0.0, 24.0, 1.0, dtype)
            .unwrap()
            .reshape([2, 3, 4])
            .unwrap();
        let t = x.permute(&[2, 0, 1]).unwrap();
        let wt = x.to_dtype(DType::F32).unwrap().permute(&[2, 0, 1]).unwrap();
        same(&values(&t), &values(&wt), "permute");
        let n = x.narrow(2, 1, 2).unwrap();
        assert_eq!(values(&n)[..4], [1.0, 2.0, 5.0, 6.0]);
        let c = ndscope::concat(&[x.clone(), x.clone()], 0).unwrap();
        assert_eq!(c.dims(), &[4, 3, 4]);
        assert_eq!(values(&c)[24..], values(&x)[..]);
    }
    m.close().unwrap();
}

#[test]
fn optimizer_steps_on_half_parameters_compute_in_f32() {
    use ndscope::{Adam, Optimizer, Sgd};
    let m = Manager::new_base();
    let kind = |adam: bool| -> ndscope::OptimizerKind {
        if adam {
            Adam::new(0.01).into()
        } else {
            Sgd {
                momentum: 0.9,
                ..Sgd::new(0.1)
            }
            .into()
        }
    };
    let start = [0.5f32, -1.25, 2.0, 3.0e-3, 1e-4, -7.0];
    let grad = |step: usize| {
        let g: Vec<f32> = vec![0.3, -0.7, 1.5 + step as f32, 0.01, 2e-3, 0.123];
        m.from_vec(g, [6]).unwrap()
    };
    for dtype in HALVES {
        for adam in [false, true] {
            // The half step: its parameter and state stored as halves.
            let p = m
                .from_vec(start.to_vec(), [6])
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            p.set_requires_gradient(true).unwrap();
            let mut opt = Optimizer::new([&p], kind(adam)).unwrap();
            // The same step in f32, with the parameter and state rounded to the half type
            // after each step: what computing in f32 and rounding each stored value once means.
            let q = p.to_dtype(DType::F32).unwrap();
            q.set_requires_gradient(true).unwrap();
            let mut wide = Optimizer::new([&q], kind(adam)).unwrap();
            for step in 0..4 {
                p.gradient()
                    .unwrap()
                    .assign_(&grad(step).to_dtype(dtype).unwrap())
                    .unwrap();
                q.gradient()
                    .unwrap()
                    .assign_(
                        &grad(step)
                            .to_dtype(dtype)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap(),
                    )
                    .unwrap();
                opt.step().unwrap();
                wide.step().unwrap();
                for a in std::iter::once(&q).chain(wide.state(&q).unwrap()) {
                    a.assign_(&a.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap())
                        .unwrap();
                }
                same(
                    &values(&p),
                    &values(&q),
                    &format!("{dtype} adam={adam} step {step}"),
                );
                for (s, w) in opt.state(&p).unwrap().iter().zip(wide.state(&q).unwrap()) {
                    same(
                        &values(s),
                        &values(w),
                        &format!("{dtype} adam={adam} state, step {step}"),
                    );
                }
            }
        }
    }
    m.close().unwrap();
}

#[test]
fn softmax_of_halves_is_the_f32_softmax_rounded() {
    let _turn = seeded();
    let m = Manager::new_base();
    manual_seed(3);
    let x = m
        .randn([64, 300], DType::F32)
        .unwrap()
        .to_dtype(DType::F16)
        .unwrap();
    let wx = x.to_dtype(DType::F32).unwrap();
    let a = values(&x.softmax(-1).unwrap());
    let b = values(&wx.softmax(-1).unwrap());
    for (i, (p, q)) in a.iter().zip(&b).enumerate() {
        assert_eq!(*p, round(DType::F16, *q), "element {i}");
    }
    m.close().unwrap();
}

#[test]
fn printing_reports_and_workspaces_count_two_bytes_an_element() {
    let m = Manager::new_base().with_name("halves");
    let a = m
        .from_vec(vec![bf16::from_f32(1.5), bf16::from_f32(-0.25)], [2])
        .unwrap();
    assert!(a.to_string().contains("1.5"), "{a}");
    let f = m.zeros([1000], DType::F16).unwrap();
    let b = m.zeros([1000], DType::BF16).unwrap();
    let f32s = m.zeros([1000], DType::F32).unwrap();
    let report = m.report();
    assert_eq!(report.total_bytes(), 4 + 2000 + 2000 + 4000, "{report:?}");
    assert!(format!("{f:?}").contains("f16"));
    assert!(format!("{b:?}").contains("bf16"));
    f32s.close().unwrap();
    // A workspace cycle of bf16 temporaries learns a block half the size of the f32 one.
    let block = |dtype: DType| {
        let trainer = Manager::new_base();
        let ws = trainer
            .workspace("step", ndscope::WorkspaceConfig::default())
            .unwrap();
        for _ in 0..3 {
            ws.cycle(|m| {
                let x = m.ones([256, 256], dtype)?;
                x.add(&x)?.mul(&x)?;
                Ok(())
            })
            .unwrap();
        }
        let stats = ws.stats();
        trainer.close().unwrap();
        stats.capacity
    };
    let (half, full) = (block(DType::BF16), block(DType::F32));
    assert!(
        half * 2 <= full + 4096 && half > 0,
        "bf16 block {half}, f32 block {full}"
    );
    m.close().unwrap();
}

#[test]
fn host_arrays_hold_halves() {
    let v: Vec<f16> = [1.0f32, -2.5, 65504.0]
        .iter()
        .map(|&x| f16::from_f32(x))
        .collect();
    let h = HostArray::from_vec(v.clone(), [3]).unwrap();
    assert_eq!(h.dtype(), DType::F16);
    let m = Manager::new_base();
    let a = m.from_host(&h).unwrap();
    assert_eq!(a.to_vec::<f16>().unwrap(), v);
    let back = a.to_host().unwrap();
    assert_eq!(back, h);
    let two = HostArray::concat_rows(&[h.clone(), h.clone()]).unwrap();
    assert_eq!(
        two.split_rows(&[3, 3]).unwrap()[1]
            .as_slice::<f16>()
            .unwrap(),
        &v[..]
    );
    assert!(matches!(
        h.as_slice::<bf16>(),
        Err(Error::DTypeMismatch { .. })
    ));
    m.close().unwrap();
}

/// The layout the reference implementation (`safetensors.torch.save_file`) writes: the header
/// (tensors sorted by name, `__metadata__` first), padded with spaces to 8 bytes, then the data
/// in the same order, little-endian.
fn reference_file(
    path: &std::path::Path,
    tensors: &[(&str, safetensors::Dtype, Vec<usize>, Vec<u8>)],
) {
    use safetensors::tensor::TensorView;
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.to_string(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    safetensors::serialize_to_file(views, Some(meta), path).unwrap();
}

fn le<T: Copy>(v: &[T], bytes: fn(T) -> [u8; 2]) -> Vec<u8> {
    v.iter().flat_map(|&x| bytes(x)).collect()
}

#[test]
fn a_half_checkpoint_in_the_reference_layout_loads_and_runs_as_its_f32_twin() {
    let _turn = seeded();
    let dir = std::env::temp_dir().join(format!("ndscope-half-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    manual_seed(5);
    let src = Manager::new_base();
    let w1: Vec<bf16> = src.randn([8, 16], DType::BF16).unwrap().to_vec().unwrap();
    let b1: Vec<bf16> = src.randn([16], DType::BF16).unwrap().to_vec().unwrap();
    let w2: Vec<f16> = src.randn([16, 4], DType::F16).unwrap().to_vec().unwrap();
    let b2: Vec<f16> = src.randn([4], DType::F16).unwrap().to_vec().unwrap();
    reference_file(
        &path,
        &[
            (
                "b1",
                safetensors::Dtype::BF16,
                vec![16],
                le(&b1, bf16::to_le_bytes),
            ),
            (
                "b2",
                safetensors::Dtype::F16,
                vec![4],
                le(&b2, f16::to_le_bytes),
            ),
            (
                "w1",
                safetensors::Dtype::BF16,
                vec![8, 16],
                le(&w1, bf16::to_le_bytes),
            ),
            (
                "w2",
                safetensors::Dtype::F16,
                vec![16, 4],
                le(&w2, f16::to_le_bytes),
            ),
        ],
    );
    // Loaded as stored: bit for bit, the dtypes of the file.
    let m = Manager::new_base();
    let loaded = m.load_safetensors(&path).unwrap();
    let by_name = |l: &ndscope::NDList, n: &str| -> NDArray {
        l.iter()
            .find(|a| a.name().as_deref() == Some(n))
            .unwrap()
            .clone()
    };
    assert_eq!(by_name(&loaded, "w1").dtype(), DType::BF16);
    assert_eq!(by_name(&loaded, "w1").to_vec::<bf16>().unwrap(), w1);
    assert_eq!(by_name(&loaded, "b2").to_vec::<f16>().unwrap(), b2);
    // Saved again by ndscope, the file is byte for byte the reference one.
    let again = dir.join("again.safetensors");
    let order: Vec<NDArray> = ["b1", "b2", "w1", "w2"]
        .iter()
        .map(|n| by_name(&loaded, n))
        .collect();
    let keep = Manager::new_base();
    for a in &order {
        let c = keep.from_host(&a.to_host().unwrap()).unwrap();
        c.set_name(&a.name().unwrap());
    }
    keep.save_safetensors(&again).unwrap();
    let (ours, theirs) = (
        std::fs::read(&again).unwrap(),
        std::fs::read(&path).unwrap(),
    );
    let data = |f: &[u8]| {
        let n = u64::from_le_bytes(f[..8].try_into().unwrap()) as usize;
        f[8 + n..].to_vec()
    };
    assert_eq!(
        data(&ours),
        data(&theirs),
        "tensor data differs from the reference layout"
    );
    let st = safetensors::SafeTensors::deserialize(&ours).unwrap();
    assert_eq!(st.tensor("w1").unwrap().dtype(), safetensors::Dtype::BF16);

    // A forward pass of the half model matches f32 computed from the same bits, within the
    // rounding of the halves.
    let x = m.randn([5, 8], DType::F32).unwrap();
    let forward = |w1: &NDArray, b1: &NDArray, w2: &NDArray, b2: &NDArray, x: &NDArray| {
        x.linear(w1, Some(b1), Activation::Relu)
            .unwrap()
            .linear(w2, Some(b2), Activation::Identity)
            .unwrap()
    };
    let wide = m.load_safetensors_as(&path, DType::F32).unwrap();
    assert!(wide.iter().all(|a| a.dtype() == DType::F32));
    let (fw1, fb1, fw2, fb2) = (
        by_name(&wide, "w1"),
        by_name(&wide, "b1"),
        by_name(&wide, "w2"),
        by_name(&wide, "b2"),
    );
    assert_eq!(
        values(&fw1),
        w1.iter().map(|v| v.to_f64()).collect::<Vec<_>>()
    );
    let want = values(&forward(&fw1, &fb1, &fw2, &fb2, &x));
    let h1 = by_name(&loaded, "w1");
    let hx = x.to_dtype(DType::BF16).unwrap();
    let layer1 = hx
        .linear(&h1, Some(&by_name(&loaded, "b1")), Activation::Relu)
        .unwrap();
    let got = values(
        &layer1
            .to_dtype(DType::F16)
            .unwrap()
            .linear(
                &by_name(&loaded, "w2"),
                Some(&by_name(&loaded, "b2")),
                Activation::Identity,
            )
            .unwrap(),
    );
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 0.05 * w.abs().max(1.0), "{g} vs {w}");
    }
    // Restored into an f32 model: converted as read, the same values.
    let model = Manager::new_base();
    let mut made = Vec::new();
    for (n, shape) in [
        ("w1", vec![8, 16]),
        ("b1", vec![16]),
        ("w2", vec![16, 4]),
        ("b2", vec![4]),
    ] {
        let a = model.zeros(shape, DType::F32).unwrap();
        a.set_name(n);
        made.push(a);
    }
    model.restore_safetensors(&path).unwrap();
    assert_eq!(values(&made[0]), values(&fw1));
    assert_eq!(values(&made[3]), values(&fb2));
    // Only floats convert.
    assert!(matches!(
        m.load_safetensors_as(&path, DType::I32),
        Err(Error::InvalidArgument { .. })
    ));
    for c in [m, src, keep, model] {
        c.close().unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
