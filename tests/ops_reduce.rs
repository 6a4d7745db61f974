//! Reductions (`sum`, `mean`, `max`, `argmax`, `sum_all`, `mean_all`) against plain reference
//! loops: every axis combination, negative axes, `keep_dims`, empty axes lists and empty arrays,
//! the contiguous fast paths and the parallel paths, dtypes, NaN, and the error paths.

use ndscope::{DType, Device, Error, Manager, NDArray};
use proptest::prelude::*;

mod common;
use common::{as_f64, device_tests, round_to, size};

/// Test data in -16..=16.
fn values(n: usize, seed: u64) -> Vec<i64> {
    common::values(n, seed, 16)
}

/// An array of `vals` (floats scaled by 0.25).
fn array(m: &Manager, dtype: DType, shape: &[usize], vals: &[i64]) -> NDArray {
    common::array(m, dtype, shape, vals, 0.25)
}

/// Which axes `axes` names (negative from the end; empty = all).
fn mask(axes: &[isize], ndim: usize) -> Vec<bool> {
    let mut mask = vec![axes.is_empty(); ndim];
    for &a in axes {
        mask[if a < 0 {
            (a + ndim as isize) as usize
        } else {
            a as usize
        }] = true;
    }
    mask
}

/// The reduction of `x` (shape `dims`) over the axes in `mask` by `f` starting from `init`:
/// the output shape (with `keep_dims`) and data.
fn reference_fold(
    x: &[f64],
    dims: &[usize],
    mask: &[bool],
    keep_dims: bool,
    init: f64,
    f: impl Fn(f64, f64) -> f64,
) -> (Vec<usize>, Vec<f64>) {
    let kept: Vec<usize> = (0..dims.len()).filter(|&i| !mask[i]).collect();
    let out_len: usize = kept.iter().map(|&i| dims[i]).product();
    let mut out = vec![init; out_len];
    for (flat, &v) in x.iter().enumerate() {
        let mut rest = flat;
        let mut idx = vec![0; dims.len()];
        for d in (0..dims.len()).rev() {
            idx[d] = rest % dims[d];
            rest /= dims[d];
        }
        let o = kept.iter().fold(0, |acc, &i| acc * dims[i] + idx[i]);
        out[o] = f(out[o], v);
    }
    let shape = (0..dims.len())
        .filter_map(|i| match (mask[i], keep_dims) {
            (false, _) => Some(dims[i]),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect();
    (shape, out)
}

fn count(dims: &[usize], mask: &[bool]) -> f64 {
    dims.iter()
        .zip(mask)
        .filter(|(_, &m)| m)
        .map(|(&d, _)| d as f64)
        .product()
}

/// Checks `sum` and `mean` of `a` over `axes` against the reference.
fn check_sum_mean(a: &NDArray, axes: &[isize], keep_dims: bool) {
    let dims = a.dims().to_vec();
    let mk = mask(axes, dims.len());
    let x = as_f64(a);
    let (shape, want) = reference_fold(&x, &dims, &mk, keep_dims, 0.0, |p, q| p + q);
    let sum = a.sum(axes, keep_dims).unwrap();
    let sum_dtype = if a.dtype().is_float() {
        a.dtype()
    } else {
        DType::I64
    };
    assert_eq!(sum.dtype(), sum_dtype);
    assert_eq!(
        sum.dims(),
        shape.as_slice(),
        "sum {dims:?} {axes:?} {keep_dims}"
    );
    // Half sums accumulate exactly here (small integers) and round once.
    let rounded: Vec<f64> = want.iter().map(|&w| round_to(a.dtype(), w)).collect();
    assert_eq!(
        as_f64(&sum),
        rounded,
        "sum {:?} {dims:?} {axes:?}",
        a.dtype()
    );

    let mean = a.mean(axes, keep_dims).unwrap();
    let mean_dtype = if a.dtype().is_float() {
        a.dtype()
    } else {
        DType::F64
    };
    assert_eq!(mean.dtype(), mean_dtype);
    assert_eq!(mean.dims(), shape.as_slice());
    let n = count(&dims, &mk);
    for (g, s) in as_f64(&mean).iter().zip(&want) {
        let w = round_to(a.dtype(), s / n);
        assert!(
            (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "mean {:?} {dims:?} {axes:?}: {g} vs {w}",
            a.dtype()
        );
    }
}

/// Checks `max` and `argmax` of `a` along `axis` against the reference.
fn check_max_argmax(a: &NDArray, axis: isize, keep_dims: bool) {
    let dims = a.dims().to_vec();
    let mk = mask(&[axis], dims.len());
    let x = as_f64(a);
    let (shape, want) = reference_fold(&x, &dims, &mk, keep_dims, f64::NEG_INFINITY, |p, q| {
        if p.is_nan() || q.is_nan() {
            f64::NAN
        } else {
            p.max(q)
        }
    });
    let max = a.max(axis, keep_dims).unwrap();
    assert_eq!(max.dtype(), a.dtype());
    assert_eq!(max.dims(), shape.as_slice(), "max {dims:?} {axis}");
    let got = as_f64(&max);
    for (g, w) in got.iter().zip(&want) {
        assert!(
            g == w || (g.is_nan() && w.is_nan()),
            "max {dims:?} {axis}: {g} vs {w}"
        );
    }
    // argmax: the first index reaching the maximum (or the first NaN).
    let ax = mk.iter().position(|&m| m).unwrap();
    let (outer, n, inner) = (
        dims[..ax].iter().product::<usize>(),
        dims[ax],
        dims[ax + 1..].iter().product::<usize>(),
    );
    let mut want_idx = vec![0i64; outer * inner];
    for o in 0..outer {
        for j in 0..inner {
            let at = |i: usize| x[(o * n + i) * inner + j];
            let best = (0..n)
                .find(|&i| at(i).is_nan())
                .unwrap_or_else(|| (0..n).find(|&i| at(i) == want[o * inner + j]).unwrap());
            want_idx[o * inner + j] = best as i64;
        }
    }
    let arg = a.argmax(axis).unwrap();
    assert_eq!(arg.dtype(), DType::I64);
    let (arg_shape, _) = reference_fold(&x, &dims, &mk, false, 0.0, |p, _| p);
    assert_eq!(arg.dims(), arg_shape.as_slice());
    assert_eq!(
        arg.to_vec::<i64>().unwrap(),
        want_idx,
        "argmax {dims:?} {axis}"
    );
}

device_tests!(sum_and_mean_over_every_axis_combination_match_the_reference);
fn sum_and_mean_over_every_axis_combination_match_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let shapes: &[&[usize]] = &[&[], &[1], &[7], &[3, 5], &[1, 7], &[2, 3, 4], &[3, 1, 4, 2]];
    for dtype in DType::ALL {
        for (i, &shape) in shapes.iter().enumerate() {
            let a = array(&m, dtype, shape, &values(size(shape), i as u64));
            let nd = shape.len();
            for bits in 0..(1u32 << nd) {
                let axes: Vec<isize> = (0..nd)
                    .filter(|&d| bits >> d & 1 == 1)
                    .map(|d| d as isize)
                    .collect();
                for keep in [false, true] {
                    check_sum_mean(&a, &axes, keep);
                }
            }
        }
    }
}

device_tests!(sum_over_negative_axis_keeps_dims);
fn sum_over_negative_axis_keeps_dims(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m
        .from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])
        .unwrap();
    let s = a.sum(&[-1], true).unwrap();
    assert_eq!(s.dims(), &[2, 1]);
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![6.0, 15.0]);
    let s = a.sum(&[-2], false).unwrap();
    assert_eq!(s.dims(), &[3]);
    assert_eq!(s.to_vec::<f32>().unwrap(), vec![5.0, 7.0, 9.0]);
}

device_tests!(empty_axes_list_reduces_every_axis);
fn empty_axes_list_reduces_every_axis(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[1i32, 2, 3, 4, 5, 6], [2, 3]).unwrap();
    let s = a.sum(&[], false).unwrap();
    assert_eq!(s.dims(), &[] as &[usize]);
    assert_eq!(s.to_vec::<i64>().unwrap(), vec![21]);
    let s = a.sum(&[], true).unwrap();
    assert_eq!(s.dims(), &[1, 1]);
    let mean = a.mean(&[], false).unwrap();
    assert_eq!(mean.dtype(), DType::F64);
    assert_eq!(mean.to_vec::<f64>().unwrap(), vec![3.5]);
}

device_tests!(sum_over_an_empty_axis_is_zero_and_mean_is_nan);
fn sum_over_an_empty_axis_is_zero_and_mean_is_nan(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([3, 0], DType::F32).unwrap();
    assert_eq!(
        a.sum(&[1], false).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0; 3]
    );
    assert!(a
        .mean(&[1], false)
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|v| v.is_nan()));
    let s = a.sum(&[0], false).unwrap();
    assert_eq!(s.dims(), &[0]);
    assert_eq!(
        a.sum(&[], false).unwrap().to_vec::<f32>().unwrap(),
        vec![0.0]
    );
    let ints = m.zeros([0, 4], DType::I32).unwrap();
    assert_eq!(
        ints.sum(&[0], true).unwrap().to_vec::<i64>().unwrap(),
        vec![0; 4]
    );
}

device_tests!(integer_sums_are_exact_i64);
fn integer_sums_are_exact_i64(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let big = (1i64 << 53) + 1;
    let a = m.from_slice(&[big, 0, 2], [1, 3]).unwrap();
    assert_eq!(
        a.sum(&[1], false).unwrap().to_vec::<i64>().unwrap(),
        vec![big + 2]
    );
    assert_eq!(a.sum_all().unwrap().to_scalar::<i64>().unwrap(), big + 2);
    let bytes = m.full([1000], 200.0, DType::U8).unwrap();
    assert_eq!(
        bytes.sum(&[0], false).unwrap().to_vec::<i64>().unwrap(),
        vec![200_000]
    );
}

device_tests!(large_reductions_use_every_path_and_match_the_reference);
fn large_reductions_use_every_path_and_match_the_reference(dev: Device) {
    // Sizes cross the parallel threshold (32768 elements) in each layout: many rows, one long
    // row, wide columns, tall columns, the middle axis, and two separate reduced axes.
    let m = Manager::new_base_on(dev).unwrap();
    let cases: &[(&[usize], &[isize])] = &[
        (&[64, 1031], &[-1]),
        (&[1, 100_003], &[1]),
        (&[3, 40_000], &[1]),
        (&[2, 40_000], &[0]),
        (&[40_001, 3], &[0]),
        (&[1200, 40], &[0]),
        (&[8, 101, 50], &[1]),
        (&[20, 31, 40, 3], &[0, 2]),
        (&[6, 70, 7, 30], &[1, 3]),
    ];
    for dtype in [DType::F32, DType::F64, DType::I32] {
        for (i, &(shape, axes)) in cases.iter().enumerate() {
            let a = array(&m, dtype, shape, &values(size(shape), 1000 + i as u64));
            check_sum_mean(&a, axes, false);
            check_sum_mean(&a, axes, true);
            if axes.len() == 1 {
                check_max_argmax(&a, axes[0], false);
            }
        }
    }
}

device_tests!(max_and_argmax_along_every_axis_match_the_reference);
fn max_and_argmax_along_every_axis_match_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let shapes: &[&[usize]] = &[&[1], &[7], &[3, 5], &[5, 1], &[2, 3, 4], &[3, 1, 4, 2]];
    for dtype in DType::ALL {
        for (i, &shape) in shapes.iter().enumerate() {
            let a = array(&m, dtype, shape, &values(size(shape), 77 + i as u64));
            for axis in -(shape.len() as isize)..shape.len() as isize {
                check_max_argmax(&a, axis, false);
                check_max_argmax(&a, axis, true);
            }
        }
    }
}

device_tests!(max_propagates_nan_and_argmax_points_at_the_first_nan);
fn max_propagates_nan_and_argmax_points_at_the_first_nan(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m
        .from_slice(
            &[1.0f64, f64::NAN, 3.0, f64::NAN, 0.5, 9.0, -1.0, 2.0],
            [2, 4],
        )
        .unwrap();
    let max = a.max(1, false).unwrap().to_vec::<f64>().unwrap();
    assert!(max[0].is_nan());
    assert_eq!(max[1], 9.0);
    assert_eq!(a.argmax(1).unwrap().to_vec::<i64>().unwrap(), vec![1, 1]);
    let cols = a.max(0, false).unwrap().to_vec::<f64>().unwrap();
    assert!(cols[1].is_nan() && cols[3].is_nan());
    assert_eq!((cols[0], cols[2]), (1.0, 3.0));
    assert_eq!(
        a.argmax(0).unwrap().to_vec::<i64>().unwrap(),
        vec![0, 0, 0, 0]
    );
    let b = m.from_slice(&[0.0f32, 1.0, f32::NAN, 0.5], [2, 2]).unwrap();
    assert_eq!(b.argmax(0).unwrap().to_vec::<i64>().unwrap(), vec![1, 0]);
    let mut long = vec![0.0f32; 50_000];
    long[30_000] = f32::NAN;
    long[40_000] = 5.0;
    let long = m.from_vec(long, [1, 50_000]).unwrap();
    assert_eq!(
        long.argmax(-1).unwrap().to_vec::<i64>().unwrap(),
        vec![30_000]
    );
    assert!(long.max(-1, false).unwrap().to_vec::<f32>().unwrap()[0].is_nan());
}

device_tests!(argmax_returns_the_first_of_equal_maxima);
fn argmax_returns_the_first_of_equal_maxima(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[3i32, 7, 7, 1, 7], [5]).unwrap();
    assert_eq!(a.argmax(0).unwrap().to_vec::<i64>().unwrap(), vec![1]);
    let mut long = vec![1u8; 100_000];
    long[60_000] = 9;
    long[90_000] = 9;
    let long = m.from_vec(long, [100_000]).unwrap();
    assert_eq!(
        long.argmax(0).unwrap().to_vec::<i64>().unwrap(),
        vec![60_000]
    );
}

device_tests!(max_over_an_empty_axis_is_invalid);
fn max_over_an_empty_axis_is_invalid(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([0, 3], DType::F32).unwrap();
    assert!(matches!(
        a.max(0, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(a.argmax(0), Err(Error::InvalidArgument { .. })));
    // Reducing a non-empty axis of an empty array is fine: the result is empty.
    let b = m.zeros([3, 0], DType::F32).unwrap();
    assert_eq!(b.max(0, false).unwrap().dims(), &[0]);
    assert_eq!(b.argmax(0).unwrap().dims(), &[0]);
}

device_tests!(duplicate_or_out_of_range_axes_are_invalid);
fn duplicate_or_out_of_range_axes_are_invalid(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([2, 3], DType::F64).unwrap();
    for axes in [&[0, 0][..], &[1, -1], &[2], &[-3]] {
        let err = a.sum(axes, false).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { .. }),
            "{axes:?}: {err}"
        );
        assert!(err.to_string().contains("sum"), "{err}");
        assert!(matches!(
            a.mean(axes, true),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(
        a.max(2, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(a.argmax(-3), Err(Error::InvalidArgument { .. })));
    let s = m.scalar(1.0f32).unwrap();
    assert!(matches!(
        s.max(0, false),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(s.sum(&[], false).unwrap().to_scalar::<f32>().unwrap(), 1.0);
}

device_tests!(reducing_a_closed_array_is_array_closed);
fn reducing_a_closed_array_is_array_closed(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([2, 3], DType::F32).unwrap();
    a.close().unwrap();
    assert!(matches!(a.sum(&[0], false), Err(Error::ArrayClosed { .. })));
    assert!(matches!(a.argmax(0), Err(Error::ArrayClosed { .. })));
}

device_tests!(sum_all_and_mean_all_agree_with_sum_over_all_axes);
fn sum_all_and_mean_all_agree_with_sum_over_all_axes(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for n in [0usize, 1, 7, 33, 70_001] {
        let a = array(&m, DType::F32, &[n], &values(n, n as u64));
        let s1 = a.sum_all().unwrap().to_scalar::<f32>().unwrap();
        let s2 = a.sum(&[], false).unwrap().to_scalar::<f32>().unwrap();
        assert_eq!(s1, s2);
        let want: f64 = as_f64(&a).iter().sum();
        assert_eq!(s1 as f64, want);
        let mean = a.mean_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(mean.is_nan() == (n == 0));
    }
}

/// A random shape of rank 0..=4 with small dims (0 included), a random set of axes (each
/// written as positive or negative) and `keep_dims`.
fn shape_and_axes() -> impl Strategy<Value = (Vec<usize>, Vec<isize>, bool)> {
    prop::collection::vec(0usize..5, 0..=4).prop_flat_map(|dims| {
        let n = dims.len();
        (
            Just(dims),
            prop::collection::vec((any::<bool>(), any::<bool>()), n),
            any::<bool>(),
        )
            .prop_map(|(dims, picks, keep)| {
                let n = dims.len() as isize;
                let axes = picks
                    .iter()
                    .enumerate()
                    .filter(|(_, (on, _))| *on)
                    .map(|(i, (_, neg))| if *neg { i as isize - n } else { i as isize })
                    .collect();
                (dims, axes, keep)
            })
    })
}

device_tests!(reductions_match_the_reference_for_random_shapes_and_axes);
fn reductions_match_the_reference_for_random_shapes_and_axes(dev: Device) {
    proptest!(ProptestConfig::with_cases(64), |(
        (dims, axes, keep) in shape_and_axes(),
        seed in any::<u64>(),
        dtype in prop::sample::select(DType::ALL.to_vec()),
    )| {
        let m = Manager::new_base_on(dev).unwrap();
        let a = array(&m, dtype, &dims, &values(size(&dims), seed));
        check_sum_mean(&a, &axes, keep);
        if let Some(&axis) = axes.first() {
            let ax = if axis < 0 { (axis + dims.len() as isize) as usize } else { axis as usize };
            if dims[ax] > 0 {
                check_max_argmax(&a, axis, keep);
            } else {
                let is_invalid = matches!(a.max(axis, keep), Err(Error::InvalidArgument { .. }));
                prop_assert!(is_invalid);
            }
        }
        m.close().unwrap();
    });
}
