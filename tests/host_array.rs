//! `HostArray`: data the caller owns, in and out of managers, joined and cut along axis 0.

use ndscope::{DType, Error, HostArray, Manager};

#[test]
fn every_dtype_goes_into_a_manager_and_back() {
    let m = Manager::new_base();
    let cases = [
        HostArray::from_vec(vec![1.5f32, -2.0], [2]).unwrap(),
        HostArray::from_vec(vec![1e300f64, -0.0], [1, 2]).unwrap(),
        HostArray::from_vec(vec![i32::MIN, 7], [2, 1]).unwrap(),
        HostArray::from_vec(vec![i64::MAX], ()).unwrap(),
        HostArray::from_slice(&[0u8, 255, 3], [3]).unwrap(),
    ];
    for (host, dtype) in cases.iter().zip(DType::ALL) {
        assert_eq!(host.dtype(), dtype);
        let a = m.from_host(host).unwrap();
        assert_eq!(a.dtype(), dtype);
        assert_eq!(a.shape(), host.shape());
        assert_eq!(&a.to_host().unwrap(), host);
        assert_eq!(host.nbytes(), host.size() * dtype.size_in_bytes());
    }
    m.close().unwrap();
    // Owned: it outlives the manager it came from.
    let kept = cases[0].clone();
    assert_eq!(kept.as_slice::<f32>().unwrap(), &[1.5, -2.0]);
    assert_eq!(kept.into_vec::<f32>().unwrap(), vec![1.5, -2.0]);
}

#[test]
fn wrong_lengths_and_types_are_refused() {
    let err = HostArray::from_vec(vec![1.0f32; 5], [2, 3]).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let h = HostArray::from_vec(vec![1i64, 2], [2]).unwrap();
    let err = h.as_slice::<f32>().unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    assert!(
        err.to_string().contains("holds i64, asked for f32"),
        "{err}"
    );
    assert!(matches!(
        h.clone().into_vec::<i32>(),
        Err(Error::DTypeMismatch { .. })
    ));
    assert_eq!(h.into_vec::<i64>().unwrap(), vec![1, 2]);
    let closed = Manager::new_base();
    let a = closed.ones([2], DType::F32).unwrap();
    closed.close().unwrap();
    assert!(matches!(a.to_host(), Err(Error::ArrayClosed { .. })));
    assert!(matches!(
        closed.from_host(&HostArray::from_vec(vec![1u8], [1]).unwrap()),
        Err(Error::ManagerClosed { .. })
    ));
}

#[test]
fn rows_are_joined_and_cut_along_the_first_axis() {
    let a = HostArray::from_vec(vec![1.0f32, 2.0, 3.0], [1, 3]).unwrap();
    let b = HostArray::from_vec(vec![4.0f32, 5.0, 6.0, 7.0, 8.0, 9.0], [2, 3]).unwrap();
    let ab = HostArray::concat_rows(&[a.clone(), b.clone()]).unwrap();
    assert_eq!(ab.dims(), &[3, 3]);
    assert_eq!(
        ab.as_slice::<f32>().unwrap()[3..],
        [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    );
    let parts = ab.split_rows(&[1, 2]).unwrap();
    assert_eq!(parts, vec![a.clone(), b.clone()]);
    assert!(matches!(
        ab.split_rows(&[1, 1]),
        Err(Error::ShapeMismatch { .. })
    ));
    let other = HostArray::from_vec(vec![1.0f32; 4], [1, 4]).unwrap();
    assert!(matches!(
        HostArray::concat_rows(&[a.clone(), other]),
        Err(Error::ShapeMismatch { .. })
    ));
    let ints = HostArray::from_vec(vec![1i32; 3], [1, 3]).unwrap();
    assert!(matches!(
        HostArray::concat_rows(&[a, ints]),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        HostArray::concat_rows(&[]),
        Err(Error::InvalidArgument { .. })
    ));
    let scalar = HostArray::from_vec(vec![1.0f32], ()).unwrap();
    assert!(matches!(
        scalar.split_rows(&[1]),
        Err(Error::InvalidArgument { .. })
    ));
}
