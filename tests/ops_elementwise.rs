//! Elementwise ops and comparisons against plain reference loops: NumPy broadcasting (size-1
//! dims, rank mismatch, scalars, empty arrays), every dtype, sizes on both sides of the
//! parallel threshold, and the error paths.

use ndscope::{DType, Device, Error, Manager, NDArray};
use proptest::prelude::*;

mod common;
use common::{as_f64, device_tests, size};

/// Test data in -9..=9.
fn values(n: usize, seed: u64) -> Vec<i64> {
    common::values(n, seed, 9)
}

/// An array of `vals` (floats scaled by 0.5).
fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64]) -> NDArray {
    common::array(m, dtype, shape, vals, 0.5)
}

/// The NumPy broadcast of two shapes, by the textbook rule.
fn broadcast(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let db = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            match (da, db) {
                _ if da == db => Some(da),
                (1, _) => Some(db),
                (_, 1) => Some(da),
                _ => None,
            }
        })
        .collect()
}

/// The flat index into an array of `shape` of the element that broadcasts to multi-index `idx`
/// of `out`.
fn source_index(shape: &[usize], out: &[usize], idx: &[usize]) -> usize {
    let offset = out.len() - shape.len();
    shape.iter().enumerate().fold(0, |acc, (i, &d)| {
        acc * d + if d == 1 { 0 } else { idx[offset + i] }
    })
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

/// `f` applied with broadcasting, by the index formula.
fn reference_zip(
    a: &[f64],
    ash: &[usize],
    b: &[f64],
    bsh: &[usize],
    f: impl Fn(f64, f64) -> f64,
) -> (Vec<usize>, Vec<f64>) {
    let out = broadcast(ash, bsh).expect("shapes broadcast");
    let data = (0..size(&out))
        .map(|flat| {
            let idx = unravel(flat, &out);
            f(
                a[source_index(ash, &out, &idx)],
                b[source_index(bsh, &out, &idx)],
            )
        })
        .collect();
    (out, data)
}

const SHAPE_PAIRS: &[(&[usize], &[usize])] = &[
    (&[], &[]),
    (&[7], &[]),
    (&[], &[7]),
    (&[1], &[33]),
    (&[33], &[33]),
    (&[2, 1, 3], &[4, 1]),
    (&[5, 1], &[1, 7]),
    (&[3, 1, 1, 2], &[1, 4, 5, 1]),
    (&[0, 3], &[3]),
    (&[2, 0], &[1, 1]),
    (&[300, 257], &[257]),
    (&[300, 1], &[300, 128]),
    (&[1200, 40], &[1200, 40]),
];

fn compare_all(dev: Device, op: &str) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in DType::ALL {
        for (i, &(ash, bsh)) in SHAPE_PAIRS.iter().enumerate() {
            let (av, bv) = (
                values(size(ash), i as u64),
                values(size(bsh), 100 + i as u64),
            );
            let (a, b) = (array(&m, dtype, ash, &av), array(&m, dtype, bsh, &bv));
            let got = match op {
                "gt" => a.gt(&b),
                "lt" => a.lt(&b),
                _ => a.eq(&b),
            }
            .unwrap();
            let (shape, want) = reference_zip(&as_f64(&a), ash, &as_f64(&b), bsh, |x, y| {
                let r = match op {
                    "gt" => x > y,
                    "lt" => x < y,
                    _ => x == y,
                };
                f64::from(u8::from(r))
            });
            assert_eq!(got.dtype(), DType::U8);
            assert_eq!(got.dims(), shape.as_slice(), "{op} {dtype} {ash:?} {bsh:?}");
            assert_eq!(as_f64(&got), want, "{op} {dtype} {ash:?} {bsh:?}");
        }
    }
    m.close().unwrap();
}

device_tests!(gt_broadcasts_and_gives_u8_zero_or_one);
fn gt_broadcasts_and_gives_u8_zero_or_one(dev: Device) {
    compare_all(dev, "gt");
}

device_tests!(lt_broadcasts_and_gives_u8_zero_or_one);
fn lt_broadcasts_and_gives_u8_zero_or_one(dev: Device) {
    compare_all(dev, "lt");
}

device_tests!(eq_broadcasts_and_gives_u8_zero_or_one);
fn eq_broadcasts_and_gives_u8_zero_or_one(dev: Device) {
    compare_all(dev, "eq");
}

device_tests!(comparisons_with_nan_are_false);
fn comparisons_with_nan_are_false(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[f32::NAN, 1.0, f32::NAN], [3]).unwrap();
    let b = m.from_slice(&[f32::NAN, f32::NAN, 0.0], [3]).unwrap();
    assert_eq!(a.gt(&b).unwrap().to_vec::<u8>().unwrap(), vec![0, 0, 0]);
    assert_eq!(a.lt(&b).unwrap().to_vec::<u8>().unwrap(), vec![0, 0, 0]);
    assert_eq!(a.eq(&a).unwrap().to_vec::<u8>().unwrap(), vec![0, 1, 0]);
    assert_eq!(
        a.eq_scalar(f64::NAN).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 0, 0]
    );
}

device_tests!(scalar_comparisons_match_reference_for_every_dtype);
fn scalar_comparisons_match_reference_for_every_dtype(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in DType::ALL {
        for n in [0, 1, 7, 33, 40_000] {
            let a = array(&m, dtype, &[n], &values(n, n as u64));
            let x = as_f64(&a);
            for value in [-2.0, 0.0, 1.5, 3.0] {
                let check = |got: NDArray, f: fn(f64, f64) -> bool| {
                    assert_eq!(got.dtype(), DType::U8);
                    let want: Vec<f64> = x
                        .iter()
                        .map(|&v| f64::from(u8::from(f(v, value))))
                        .collect();
                    assert_eq!(as_f64(&got), want, "{dtype} n={n} value={value}");
                };
                check(a.gt_scalar(value).unwrap(), |v, s| v > s);
                check(a.lt_scalar(value).unwrap(), |v, s| v < s);
                check(a.eq_scalar(value).unwrap(), |v, s| v == s);
            }
        }
    }
}

device_tests!(integer_scalar_comparison_does_not_truncate_the_scalar);
fn integer_scalar_comparison_does_not_truncate_the_scalar(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[2i32, 3], [2]).unwrap();
    assert_eq!(
        a.gt_scalar(2.5).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 1]
    );
    assert_eq!(
        a.eq_scalar(2.5).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 0]
    );
    assert_eq!(
        a.lt_scalar(2.5).unwrap().to_vec::<u8>().unwrap(),
        vec![1, 0]
    );
}

device_tests!(float_scalar_comparison_uses_the_array_precision);
fn float_scalar_comparison_uses_the_array_precision(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[0.1f32, 0.2], [2]).unwrap();
    assert_eq!(
        a.eq_scalar(0.1).unwrap().to_vec::<u8>().unwrap(),
        vec![1, 0]
    );
}

device_tests!(comparison_of_different_dtypes_is_a_dtype_mismatch);
fn comparison_of_different_dtypes_is_a_dtype_mismatch(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([3], DType::F32).unwrap();
    let b = m.zeros([3], DType::F64).unwrap();
    assert!(matches!(a.gt(&b), Err(Error::DTypeMismatch { .. })));
    assert!(matches!(a.eq(&b), Err(Error::DTypeMismatch { .. })));
}

device_tests!(comparison_of_shapes_that_do_not_broadcast_is_a_shape_mismatch);
fn comparison_of_shapes_that_do_not_broadcast_is_a_shape_mismatch(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([2, 3], DType::I32).unwrap();
    let b = m.zeros([4], DType::I32).unwrap();
    let err = a.lt(&b).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("lt") && text.contains("[2, 3]") && text.contains("[4]"),
        "{text}"
    );
}

device_tests!(comparison_of_a_closed_array_is_array_closed);
fn comparison_of_a_closed_array_is_array_closed(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([3], DType::F32).unwrap();
    let b = m.zeros([3], DType::F32).unwrap();
    b.close().unwrap();
    assert!(matches!(a.gt(&b), Err(Error::ArrayClosed { .. })));
    assert!(matches!(b.gt_scalar(1.0), Err(Error::ArrayClosed { .. })));
}

device_tests!(binary_arithmetic_broadcasts_like_numpy_for_every_dtype);
fn binary_arithmetic_broadcasts_like_numpy_for_every_dtype(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    type Op = (
        &'static str,
        fn(&NDArray, &NDArray) -> ndscope::Result<NDArray>,
        fn(f64, f64) -> f64,
    );
    let ops: [Op; 5] = [
        ("add", |a, b| a.add(b), |x, y| x + y),
        ("sub", |a, b| a.sub(b), |x, y| x - y),
        ("mul", |a, b| a.mul(b), |x, y| x * y),
        ("maximum", |a, b| a.maximum(b), f64::max),
        ("minimum", |a, b| a.minimum(b), f64::min),
    ];
    for dtype in [DType::F32, DType::F64, DType::I32, DType::I64] {
        for (i, &(ash, bsh)) in SHAPE_PAIRS.iter().enumerate() {
            let a = array(&m, dtype, ash, &values(size(ash), i as u64));
            let b = array(&m, dtype, bsh, &values(size(bsh), 50 + i as u64));
            for (name, op, f) in ops {
                let got = op(&a, &b).unwrap();
                let (shape, want) = reference_zip(&as_f64(&a), ash, &as_f64(&b), bsh, f);
                assert_eq!(got.dtype(), dtype);
                assert_eq!(
                    got.dims(),
                    shape.as_slice(),
                    "{name} {dtype} {ash:?} {bsh:?}"
                );
                assert_eq!(as_f64(&got), want, "{name} {dtype} {ash:?} {bsh:?}");
            }
        }
    }
}

device_tests!(integer_division_by_zero_is_invalid_and_float_division_is_ieee);
fn integer_division_by_zero_is_invalid_and_float_division_is_ieee(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[4i32, 9], [2]).unwrap();
    let z = m.from_slice(&[2i32, 0], [2]).unwrap();
    let e = common::refused(dev, a.div(&z));
    assert!(matches!(e, Error::InvalidArgument { op: "div", .. }), "{e}");
    assert!(matches!(
        a.div_scalar(0.0),
        Err(Error::InvalidArgument { .. })
    ));
    let f = m.from_slice(&[1.0f64, -1.0], [2]).unwrap();
    let zf = m.zeros([1], DType::F64).unwrap();
    assert_eq!(
        f.div(&zf).unwrap().to_vec::<f64>().unwrap(),
        vec![f64::INFINITY, f64::NEG_INFINITY]
    );
    assert_eq!(
        a.div_scalar(2.0).unwrap().to_vec::<i32>().unwrap(),
        vec![2, 4]
    );
}

device_tests!(unary_ops_match_reference_on_both_sides_of_the_parallel_threshold);
fn unary_ops_match_reference_on_both_sides_of_the_parallel_threshold(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for n in [0usize, 1, 7, 33, 40_001] {
        let x: Vec<f64> = values(n, 7).iter().map(|&v| v as f64 * 0.25).collect();
        let a = m.from_slice(&x, [n]).unwrap();
        let check = |got: NDArray, f: fn(f64) -> f64, name: &str| {
            let want: Vec<f64> = x.iter().map(|&v| f(v)).collect();
            let got = got.to_vec::<f64>().unwrap();
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() < 1e-12,
                    "{name} n={n}"
                );
            }
        };
        check(a.neg().unwrap(), |v| -v, "neg");
        check(a.abs().unwrap(), f64::abs, "abs");
        check(a.square().unwrap(), |v| v * v, "square");
        check(a.relu().unwrap(), |v| v.max(0.0), "relu");
        check(a.exp().unwrap(), f64::exp, "exp");
        check(a.tanh().unwrap(), f64::tanh, "tanh");
        check(
            a.sigmoid().unwrap(),
            |v| 1.0 / (1.0 + (-v).exp()),
            "sigmoid",
        );
        check(a.mul_scalar(3.0).unwrap(), |v| v * 3.0, "mul_scalar");
        check(a.add_scalar(-1.5).unwrap(), |v| v - 1.5, "add_scalar");
    }
    let ints = m.from_slice(&[1i32, 2], [2]).unwrap();
    assert!(matches!(ints.exp(), Err(Error::DTypeMismatch { .. })));
}

device_tests!(gelu_matches_reference_values);
/// The exact GELU, `0.5·x·(1 + erf(x/√2))` (PyTorch's default), against reference values
/// (`x·Φ(x)` computed in high precision), in both float dtypes, on both sides of the parallel
/// threshold.
fn gelu_matches_reference_values(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let cases: [(f64, f64); 9] = [
        (0.0, 0.0),
        (1.0, 0.8413447460685429),
        (-1.0, -0.15865525393145707),
        (2.0, 1.9544997361036416),
        (-2.0, -0.04550026389635844),
        (0.5, 0.34573123063700656),
        (-3.0, -0.004049694094890287),
        (10.0, 10.0),
        (-10.0, 0.0),
    ];
    let (x, want): (Vec<f64>, Vec<f64>) = cases.iter().copied().unzip();
    let got = m.from_slice(&x, [x.len()]).unwrap().gelu().unwrap();
    for (i, (g, w)) in got.to_vec::<f64>().unwrap().iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-15 * w.abs().max(1.0),
            "f64 gelu({}) = {g}, want {w}",
            x[i]
        );
    }
    let x32: Vec<f32> = x.iter().map(|&v| v as f32).collect();
    let got = m.from_slice(&x32, [x.len()]).unwrap().gelu().unwrap();
    assert_eq!(got.dtype(), DType::F32);
    for (i, (g, w)) in got.to_vec::<f32>().unwrap().iter().zip(&want).enumerate() {
        let g = f64::from(*g);
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "f32 gelu({}) = {g}, want {w}",
            x[i]
        );
    }
    // The tails: the identity far right, zero (not NaN) far left, NaN stays NaN, infinities.
    let tails = m
        .from_slice(
            &[40.0f64, -40.0, f64::INFINITY, f64::NEG_INFINITY, f64::NAN],
            [5],
        )
        .unwrap();
    let got = tails.gelu().unwrap().to_vec::<f64>().unwrap();
    assert_eq!(got[0], 40.0);
    assert_eq!(got[1], 0.0);
    assert_eq!(got[2], f64::INFINITY);
    assert!(got[3].is_nan() || got[3] == 0.0, "gelu(-inf) = {}", got[3]);
    assert!(got[4].is_nan());
    // Past the parallel threshold, every element as the one-element result.
    let n = 40_001;
    let big: Vec<f64> = values(n, 11).iter().map(|&v| v as f64 / 64.0).collect();
    let all = m
        .from_slice(&big, [n])
        .unwrap()
        .gelu()
        .unwrap()
        .to_vec::<f64>()
        .unwrap();
    for i in [0, 1, n / 2, n - 1] {
        let one = m.from_slice(&big[i..=i], [1]).unwrap().gelu().unwrap();
        assert_eq!(all[i], one.to_vec::<f64>().unwrap()[0], "element {i}");
    }
    m.close().unwrap();
}

device_tests!(gelu_refuses_integer_dtypes_as_tanh_does);
/// `gelu` is float-only, like `tanh` and `sigmoid`: integer arrays give the same
/// `DTypeMismatch` as they do, naming `gelu`.
fn gelu_refuses_integer_dtypes_as_tanh_does(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::I32, DType::I64, DType::U8] {
        let a = m.zeros([3], dtype).unwrap();
        let gelu = a.gelu().unwrap_err();
        let tanh = a.tanh().unwrap_err();
        assert!(matches!(gelu, Error::DTypeMismatch { .. }), "{gelu}");
        let text = gelu.to_string();
        assert!(text.contains("gelu"), "{text}");
        assert_eq!(
            strip_site(&text.replace("gelu", "tanh")),
            strip_site(&tanh.to_string()),
            "gelu's error is tanh's, named gelu"
        );
    }
    m.close().unwrap();
}

/// An error message without its ` at file:line:column` call sites.
fn strip_site(text: &str) -> String {
    text.split_whitespace()
        .filter(|w| !w.contains(".rs:"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Two shapes that broadcast: a result shape, and each operand a suffix of it with some
/// dimensions set to 1.
fn broadcastable_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    prop::collection::vec(0usize..5, 0..5).prop_flat_map(|out| {
        let n = out.len();
        (
            Just(out),
            0..=n,
            0..=n,
            prop::collection::vec(any::<bool>(), n),
            prop::collection::vec(any::<bool>(), n),
        )
            .prop_map(|(out, la, lb, ones_a, ones_b)| {
                let pick = |len: usize, ones: &[bool]| -> Vec<usize> {
                    (out.len() - len..out.len())
                        .map(|i| if ones[i] { 1 } else { out[i] })
                        .collect()
                };
                (pick(la, &ones_a), pick(lb, &ones_b))
            })
    })
}

device_tests!(broadcasting_matches_the_reference_for_random_shapes);
fn broadcasting_matches_the_reference_for_random_shapes(dev: Device) {
    proptest!(ProptestConfig::with_cases(64), |(
        (ash, bsh) in broadcastable_pair(),
        seed in any::<u64>(),
        dtype in prop::sample::select(DType::ALL.to_vec()),
    )| {
        let m = Manager::new_base_on(dev).unwrap();
        let a = array(&m, dtype, &ash, &values(size(&ash), seed));
        let b = array(&m, dtype, &bsh, &values(size(&bsh), seed ^ 0xABCD));
        let (shape, want) = reference_zip(&as_f64(&a), &ash, &as_f64(&b), &bsh, f64::max);
        let got = a.maximum(&b).unwrap();
        prop_assert_eq!(got.dims(), shape.as_slice());
        prop_assert_eq!(as_f64(&got), want);
        let (_, want) = reference_zip(&as_f64(&a), &ash, &as_f64(&b), &bsh, |x, y| f64::from(u8::from(x > y)));
        prop_assert_eq!(as_f64(&a.gt(&b).unwrap()), want);
        m.close().unwrap();
    });
}

device_tests!(integer_scalar_ops_refuse_fractional_or_out_of_range_scalars);
fn integer_scalar_ops_refuse_fractional_or_out_of_range_scalars(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[2i32, 4, 6], [3]).unwrap();
    for (name, result) in [
        ("add_scalar", a.add_scalar(0.5)),
        ("sub_scalar", a.sub_scalar(1e12)),
        ("mul_scalar", a.mul_scalar(0.5)),
        ("div_scalar", a.div_scalar(2.5)),
    ] {
        let err = result.unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{name}: {err}"
        );
        assert!(err.to_string().contains("whole number"), "{name}: {err}");
    }
    let err = a.mul_scalar_(0.5).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }));
    assert_eq!(
        a.to_vec::<i32>().unwrap(),
        vec![2, 4, 6],
        "a refused in-place op changes nothing"
    );
    assert_eq!(
        a.mul_scalar(3.0).unwrap().to_vec::<i32>().unwrap(),
        vec![6, 12, 18]
    );
    assert_eq!(
        a.div_scalar(-2.0).unwrap().to_vec::<i32>().unwrap(),
        vec![-1, -2, -3]
    );
    let u = m.from_slice(&[250u8], [1]).unwrap();
    assert!(u.add_scalar(-1.0).is_err(), "-1 does not fit u8");
    assert!(u.add_scalar(256.0).is_err(), "256 does not fit u8");
    m.close().unwrap();
}
