//! Shape ops (`reshape`, `transpose`, `permute`, `broadcast_to`, `narrow`, `squeeze`,
//! `unsqueeze`, `concat`, `stack`) against plain reference loops, with odd and large sizes,
//! empty arrays, every dtype, and the error paths. Results are values: copies of the input.

use ndscope::{concat, stack, DType, Device, Error, Manager, NDArray};
use proptest::prelude::*;

mod common;
use common::device_tests;

fn size(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// An `i64` array holding 0, 1, 2, … so every element says where it came from.
fn iota(m: &Manager, shape: &[usize]) -> NDArray {
    m.from_vec((0..size(shape) as i64).collect(), shape)
        .unwrap()
}

fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = flat % shape[d];
        flat /= shape[d];
    }
    idx
}

fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Row-major flat values of `shape`, each computed from its multi-index.
fn build(shape: &[usize], f: impl Fn(&[usize]) -> i64) -> Vec<i64> {
    (0..size(shape))
        .map(|flat| f(&unravel(flat, shape)))
        .collect()
}

fn reference_permute(x: &[i64], dims: &[usize], perm: &[usize]) -> Vec<i64> {
    let out: Vec<usize> = perm.iter().map(|&p| dims[p]).collect();
    build(&out, |idx| {
        let mut src = vec![0; dims.len()];
        for (k, &p) in perm.iter().enumerate() {
            src[p] = idx[k];
        }
        x[ravel(&src, dims)]
    })
}

device_tests!(reshape_keeps_the_elements_in_row_major_order);
fn reshape_keeps_the_elements_in_row_major_order(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = iota(&m, &[2, 3, 4]);
    let shapes: [&[usize]; 4] = [&[24], &[4, 6], &[1, 24, 1], &[2, 2, 2, 3]];
    for shape in shapes {
        let r = a.reshape(shape).unwrap();
        assert_eq!(r.dims(), shape);
        assert_eq!(r.to_vec::<i64>().unwrap(), (0..24).collect::<Vec<_>>());
    }
    let one = m.from_slice(&[5.0f32], [1, 1]).unwrap();
    assert_eq!(one.reshape(()).unwrap().to_scalar::<f32>().unwrap(), 5.0);
    let empty = m.zeros([0, 3], DType::U8).unwrap();
    assert_eq!(empty.reshape([3, 0, 7]).unwrap().dims(), &[3, 0, 7]);
}

device_tests!(reshape_to_a_different_size_is_a_shape_mismatch);
fn reshape_to_a_different_size_is_a_shape_mismatch(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = iota(&m, &[2, 3]);
    let err = a.reshape([4]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }));
    assert!(
        err.to_string().contains("[2, 3]") && err.to_string().contains("[4]"),
        "{err}"
    );
    assert!(matches!(
        a.reshape([usize::MAX, 2]),
        Err(Error::ShapeMismatch { .. })
    ));
}

device_tests!(transpose_matches_the_reference_for_odd_and_large_sizes);
fn transpose_matches_the_reference_for_odd_and_large_sizes(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    for &(r, c) in &[
        (1, 1),
        (1, 7),
        (7, 1),
        (33, 17),
        (64, 64),
        (0, 5),
        (1025, 999),
        (1024, 1024),
    ] {
        let a = iota(&m, &[r, c]);
        let t = a.transpose().unwrap();
        assert_eq!(t.dims(), &[c, r]);
        let want = build(&[c, r], |idx| (idx[1] * c + idx[0]) as i64);
        assert_eq!(t.to_vec::<i64>().unwrap(), want, "{r}x{c}");
    }
    for dtype in DType::ALL {
        let a = iota(&m, &[37, 41]).to_dtype(dtype).unwrap();
        let t = a.transpose().unwrap();
        assert_eq!(t.dtype(), dtype);
        let back = t.transpose().unwrap();
        let as_i64 = |x: &NDArray| x.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap();
        assert_eq!(as_i64(&back), as_i64(&a), "{dtype}");
        assert_ne!(as_i64(&t), as_i64(&a), "{dtype}");
    }
    let f = m.randn([1024, 1024], DType::F32).unwrap();
    let x = f.to_vec::<f32>().unwrap();
    let t = f.transpose().unwrap().to_vec::<f32>().unwrap();
    for (i, j) in [(0, 0), (1, 1023), (1023, 1), (517, 300), (1000, 999)] {
        assert_eq!(t[j * 1024 + i], x[i * 1024 + j]);
    }
}

device_tests!(transpose_of_a_non_matrix_is_a_shape_mismatch);
fn transpose_of_a_non_matrix_is_a_shape_mismatch(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let shapes: [&[usize]; 3] = [&[], &[3], &[2, 3, 4]];
    for shape in shapes {
        let a = m.zeros(shape, DType::F32).unwrap();
        assert!(
            matches!(a.transpose(), Err(Error::ShapeMismatch { .. })),
            "{shape:?}"
        );
    }
}

device_tests!(permute_matches_the_reference);
fn permute_matches_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let cases: &[(&[usize], &[usize])] = &[
        (&[], &[]),
        (&[5], &[0]),
        (&[3, 5], &[1, 0]),
        (&[2, 3, 4], &[0, 1, 2]),
        (&[2, 3, 4], &[0, 2, 1]),
        (&[2, 3, 4], &[2, 0, 1]),
        (&[2, 3, 4], &[1, 2, 0]),
        (&[2, 3, 4], &[2, 1, 0]),
        (&[3, 1, 4, 2], &[3, 1, 0, 2]),
        (&[2, 0, 3], &[2, 0, 1]),
        (&[8, 70, 90], &[0, 2, 1]),
        (&[40, 30, 50], &[2, 1, 0]),
        (&[40, 30, 50], &[1, 0, 2]),
        (&[5, 6, 7, 8, 9], &[4, 2, 0, 3, 1]),
    ];
    for &(dims, perm) in cases {
        let a = iota(&m, dims);
        let p = a.permute(perm).unwrap();
        let out: Vec<usize> = perm.iter().map(|&k| dims[k]).collect();
        assert_eq!(p.dims(), out.as_slice());
        let x: Vec<i64> = (0..size(dims) as i64).collect();
        assert_eq!(
            p.to_vec::<i64>().unwrap(),
            reference_permute(&x, dims, perm),
            "{dims:?} {perm:?}"
        );
    }
}

device_tests!(permute_needs_each_axis_exactly_once);
fn permute_needs_each_axis_exactly_once(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([2, 3, 4], DType::F64).unwrap();
    for perm in [&[0, 1][..], &[0, 1, 1], &[0, 1, 3], &[0, 1, 2, 3]] {
        assert!(
            matches!(a.permute(perm), Err(Error::InvalidArgument { .. })),
            "{perm:?}"
        );
    }
}

device_tests!(broadcast_to_matches_the_reference);
fn broadcast_to_matches_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let cases: &[(&[usize], &[usize])] = &[
        (&[], &[]),
        (&[], &[3, 2]),
        (&[1], &[7]),
        (&[3], &[2, 3]),
        (&[2, 1], &[2, 5]),
        (&[4, 1, 3], &[2, 4, 6, 3]),
        (&[1, 3], &[0, 3]),
        (&[300, 1], &[300, 257]),
    ];
    for &(from, to) in cases {
        let a = iota(&m, from);
        let b = a.broadcast_to(to).unwrap();
        assert_eq!(b.dims(), to);
        let offset = to.len() - from.len();
        let want = build(to, |idx| {
            let src: Vec<usize> = from
                .iter()
                .enumerate()
                .map(|(i, &d)| if d == 1 { 0 } else { idx[offset + i] })
                .collect();
            ravel(&src, from) as i64
        });
        assert_eq!(b.to_vec::<i64>().unwrap(), want, "{from:?} -> {to:?}");
    }
}

device_tests!(broadcast_to_an_incompatible_shape_is_a_shape_mismatch);
fn broadcast_to_an_incompatible_shape_is_a_shape_mismatch(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([2, 3], DType::F32).unwrap();
    let targets: [&[usize]; 4] = [&[3], &[3, 3], &[2, 1], &[4, 2, 2]];
    for to in targets {
        assert!(
            matches!(a.broadcast_to(to), Err(Error::ShapeMismatch { .. })),
            "{to:?}"
        );
    }
}

device_tests!(narrow_matches_the_reference);
fn narrow_matches_the_reference(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let cases: &[(&[usize], isize, usize, usize)] = &[
        (&[7], 0, 2, 3),
        (&[7], -1, 0, 7),
        (&[7], 0, 7, 0),
        (&[4, 5], 1, 1, 3),
        (&[4, 5], 0, 3, 1),
        (&[2, 3, 4], -2, 1, 2),
        (&[2, 0, 4], 2, 1, 2),
        (&[100, 1000], 1, 17, 900),
    ];
    for &(dims, axis, start, len) in cases {
        let a = iota(&m, dims);
        let n = a.narrow(axis, start, len).unwrap();
        let ax = if axis < 0 {
            (axis + dims.len() as isize) as usize
        } else {
            axis as usize
        };
        let mut out = dims.to_vec();
        out[ax] = len;
        assert_eq!(n.dims(), out.as_slice());
        let want = build(&out, |idx| {
            let mut src = idx.to_vec();
            src[ax] += start;
            ravel(&src, dims) as i64
        });
        assert_eq!(
            n.to_vec::<i64>().unwrap(),
            want,
            "{dims:?} {axis} {start} {len}"
        );
    }
}

device_tests!(narrow_past_the_end_or_of_a_bad_axis_is_invalid);
fn narrow_past_the_end_or_of_a_bad_axis_is_invalid(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([4, 5], DType::I32).unwrap();
    assert!(matches!(
        a.narrow(1, 3, 3),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.narrow(0, 5, 0),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.narrow(0, usize::MAX, 2),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.narrow(2, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.narrow(-3, 0, 1),
        Err(Error::InvalidArgument { .. })
    ));
}

device_tests!(squeeze_removes_size_one_axes);
fn squeeze_removes_size_one_axes(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = iota(&m, &[1, 3, 1, 2]);
    let all = a.squeeze(&[]).unwrap();
    assert_eq!(all.dims(), &[3, 2]);
    assert_eq!(all.to_vec::<i64>().unwrap(), (0..6).collect::<Vec<_>>());
    assert_eq!(a.squeeze(&[0]).unwrap().dims(), &[3, 1, 2]);
    assert_eq!(a.squeeze(&[-2]).unwrap().dims(), &[1, 3, 2]);
    assert_eq!(a.squeeze(&[2, 0]).unwrap().dims(), &[3, 2]);
    let s = m.ones([1, 1], DType::F32).unwrap().squeeze(&[]).unwrap();
    assert_eq!(s.dims(), &[] as &[usize]);
    assert_eq!(
        m.zeros([0, 1], DType::F32)
            .unwrap()
            .squeeze(&[])
            .unwrap()
            .dims(),
        &[0]
    );
}

device_tests!(squeezing_an_axis_whose_size_is_not_one_is_invalid);
fn squeezing_an_axis_whose_size_is_not_one_is_invalid(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.zeros([1, 3], DType::F32).unwrap();
    assert!(matches!(
        a.squeeze(&[1]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.squeeze(&[0, 0]),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        a.squeeze(&[2]),
        Err(Error::InvalidArgument { .. })
    ));
}

device_tests!(unsqueeze_inserts_a_size_one_axis_anywhere);
fn unsqueeze_inserts_a_size_one_axis_anywhere(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = iota(&m, &[2, 3]);
    let cases: &[(isize, &[usize])] = &[
        (0, &[1, 2, 3]),
        (1, &[2, 1, 3]),
        (2, &[2, 3, 1]),
        (-1, &[2, 3, 1]),
        (-2, &[2, 1, 3]),
        (-3, &[1, 2, 3]),
    ];
    for &(axis, want) in cases {
        let u = a.unsqueeze(axis).unwrap();
        assert_eq!(u.dims(), want, "{axis}");
        assert_eq!(u.to_vec::<i64>().unwrap(), (0..6).collect::<Vec<_>>());
    }
    assert!(matches!(a.unsqueeze(3), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        a.unsqueeze(-4),
        Err(Error::InvalidArgument { .. })
    ));
    let s = m.scalar(2i32).unwrap();
    assert_eq!(s.unsqueeze(0).unwrap().dims(), &[1]);
    assert_eq!(s.unsqueeze(-1).unwrap().dims(), &[1]);
}

device_tests!(concat_matches_the_reference_along_every_axis);
fn concat_matches_the_reference_along_every_axis(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let base = [3usize, 4, 5];
    for axis in 0..3usize {
        let sizes = [2usize, 0, 1, 5];
        let arrays: Vec<NDArray> = sizes
            .iter()
            .enumerate()
            .map(|(k, &s)| {
                let mut dims = base.to_vec();
                dims[axis] = s;
                m.from_vec(
                    build(&dims, |idx| (k as i64) * 1000 + ravel(idx, &dims) as i64),
                    &dims[..],
                )
                .unwrap()
            })
            .collect();
        for signed in [axis as isize, axis as isize - 3] {
            let c = concat(&arrays, signed).unwrap();
            let mut out = base.to_vec();
            out[axis] = sizes.iter().sum();
            assert_eq!(c.dims(), out.as_slice());
            let want = build(&out, |idx| {
                let mut pos = idx[axis];
                let mut k = 0;
                while pos >= sizes[k] {
                    pos -= sizes[k];
                    k += 1;
                }
                let mut dims = base.to_vec();
                dims[axis] = sizes[k];
                let mut src = idx.to_vec();
                src[axis] = pos;
                k as i64 * 1000 + ravel(&src, &dims) as i64
            });
            assert_eq!(c.to_vec::<i64>().unwrap(), want, "axis {signed}");
        }
    }
}

device_tests!(concat_of_one_array_with_itself_and_large_inputs);
fn concat_of_one_array_with_itself_and_large_inputs(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[1.0f32, 2.0], [2]).unwrap();
    assert_eq!(
        concat(&[a.clone(), a.clone(), a], 0)
            .unwrap()
            .to_vec::<f32>()
            .unwrap(),
        vec![1.0, 2.0, 1.0, 2.0, 1.0, 2.0]
    );
    let x = iota(&m, &[300, 200]);
    let y = iota(&m, &[300, 57]);
    let c = concat(&[x, y], 1).unwrap();
    assert_eq!(c.dims(), &[300, 257]);
    let want = build(&[300, 257], |i| {
        if i[1] < 200 {
            (i[0] * 200 + i[1]) as i64
        } else {
            (i[0] * 57 + i[1] - 200) as i64
        }
    });
    assert_eq!(c.to_vec::<i64>().unwrap(), want);
}

device_tests!(concat_errors_name_the_problem);
fn concat_errors_name_the_problem(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    assert!(matches!(concat(&[], 0), Err(Error::InvalidArgument { .. })));
    let a = m.zeros([2, 3], DType::F32).unwrap();
    let b = m.zeros([2, 4], DType::F32).unwrap();
    let err = concat(&[a.clone(), b.clone()], 0).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("[2, 3]") && err.to_string().contains("[2, 4]"));
    assert_eq!(concat(&[a.clone(), b], 1).unwrap().dims(), &[2, 7]);
    let c = m.zeros([2, 3], DType::F64).unwrap();
    assert!(matches!(
        concat(&[a.clone(), c], 0),
        Err(Error::DTypeMismatch { .. })
    ));
    let d = m.zeros([2, 3, 1], DType::F32).unwrap();
    assert!(matches!(
        concat(&[a.clone(), d], 0),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        concat(std::slice::from_ref(&a), 2),
        Err(Error::InvalidArgument { .. })
    ));
    let s = m.scalar(1.0f32).unwrap();
    assert!(matches!(
        concat(&[s.clone(), s], 0),
        Err(Error::InvalidArgument { .. })
    ));
    let closed = m.zeros([2, 3], DType::F32).unwrap();
    closed.close().unwrap();
    assert!(matches!(
        concat(&[a, closed], 0),
        Err(Error::ArrayClosed { .. })
    ));
}

device_tests!(stack_matches_the_reference_along_every_axis);
fn stack_matches_the_reference_along_every_axis(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let dims = [2usize, 3];
    let arrays: Vec<NDArray> = (0..4)
        .map(|k| {
            m.from_vec(
                build(&dims, |idx| k * 100 + ravel(idx, &dims) as i64),
                &dims[..],
            )
            .unwrap()
        })
        .collect();
    for axis in 0..=2usize {
        let mut out = dims.to_vec();
        out.insert(axis, 4);
        let want = build(&out, |idx| {
            let mut src = idx.to_vec();
            let k = src.remove(axis);
            k as i64 * 100 + ravel(&src, &dims) as i64
        });
        for signed in [axis as isize, axis as isize - 3] {
            let s = stack(&arrays, signed).unwrap();
            assert_eq!(s.dims(), out.as_slice());
            assert_eq!(s.to_vec::<i64>().unwrap(), want, "axis {signed}");
        }
    }
    let scalars: Vec<NDArray> = (0..3).map(|v| m.scalar(v as u8).unwrap()).collect();
    assert_eq!(
        stack(&scalars, 0).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 1, 2]
    );
    let empties = vec![m.zeros([0, 2], DType::F32).unwrap(); 2];
    assert_eq!(stack(&empties, 1).unwrap().dims(), &[0, 2, 2]);
}

device_tests!(stack_errors_name_the_problem);
fn stack_errors_name_the_problem(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    assert!(matches!(stack(&[], 0), Err(Error::InvalidArgument { .. })));
    let a = m.zeros([2, 3], DType::I64).unwrap();
    let b = m.zeros([3, 2], DType::I64).unwrap();
    assert!(matches!(
        stack(&[a.clone(), b], 0),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        stack(std::slice::from_ref(&a), 3),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        stack(std::slice::from_ref(&a), -4),
        Err(Error::InvalidArgument { .. })
    ));
    let c = m.zeros([2, 3], DType::I32).unwrap();
    assert!(matches!(
        stack(&[a, c], 0),
        Err(Error::DTypeMismatch { .. })
    ));
}

device_tests!(shape_op_results_are_values_independent_of_the_input);
fn shape_op_results_are_values_independent_of_the_input(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.from_slice(&[1.0f32, 2.0, 3.0, 4.0], [2, 2]).unwrap();
    let results = [
        a.reshape([4]).unwrap(),
        a.transpose().unwrap(),
        a.permute(&[0, 1]).unwrap(),
        a.broadcast_to([2, 2]).unwrap(),
        a.narrow(0, 0, 2).unwrap(),
        a.squeeze(&[]).unwrap(),
        a.unsqueeze(0).unwrap(),
        concat(std::slice::from_ref(&a), 0).unwrap(),
        stack(std::slice::from_ref(&a), 0).unwrap(),
    ];
    for r in &results {
        r.fill_(0.0).unwrap();
        assert_eq!(r.manager().unwrap(), a.manager().unwrap());
    }
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    a.fill_(9.0).unwrap();
    for r in &results {
        assert!(r.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    }
}

device_tests!(permute_matches_the_reference_for_random_shapes);
fn permute_matches_the_reference_for_random_shapes(dev: Device) {
    proptest!(ProptestConfig::with_cases(64), |(
        (dims, perm) in prop::collection::vec(0usize..5, 0..=5).prop_flat_map(|dims| {
            let n = dims.len();
            (Just(dims), Just((0..n).collect::<Vec<usize>>()).prop_shuffle())
        }),
    )| {
        let m = Manager::new_base_on(dev).unwrap();
        let a = iota(&m, &dims);
        let x: Vec<i64> = (0..size(&dims) as i64).collect();
        prop_assert_eq!(a.permute(&perm).unwrap().to_vec::<i64>().unwrap(), reference_permute(&x, &dims, &perm));
        m.close().unwrap();
    });
}
