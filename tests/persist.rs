//! Saved parameters: the safetensors format through the `safetensors` crate, into a given
//! manager, checked (names, shapes, dtypes, the file itself), all or nothing.

use std::io::ErrorKind;
use std::path::PathBuf;

use ndscope::{DType, Error, Manager, NDList};

/// A fresh directory for one test's files.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ndscope-persist-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A model with one named array of every dtype.
fn model() -> Manager {
    let m = Manager::new_base().with_name("model");
    m.from_slice(&[1.5f32, -2.0, 3.25, 0.0, 7.0, -1e-3], [2, 3])
        .unwrap()
        .set_name("w");
    m.from_slice(&[0.25f64, -8.0], [2]).unwrap().set_name("b");
    m.from_slice(&[i32::MIN, 0, i32::MAX], [3])
        .unwrap()
        .set_name("counts");
    m.from_slice(&[i64::MAX, -5], [1, 2])
        .unwrap()
        .set_name("steps");
    m.from_slice(&[0u8, 1, 255], [3]).unwrap().set_name("mask");
    m.scalar(42.0f32).unwrap().set_name("scale");
    m
}

fn by_name(list: &NDList, name: &str) -> ndscope::NDArray {
    list.iter()
        .find(|a| a.name().as_deref() == Some(name))
        .unwrap_or_else(|| panic!("no array named {name}"))
        .clone()
}

#[test]
fn every_dtype_round_trips_with_names_and_shapes() {
    let d = dir("roundtrip");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let other = Manager::new_base();
    let loaded = other.load_safetensors(&path).unwrap();
    assert_eq!(loaded.len(), 6);
    let names: Vec<String> = loaded.iter().map(|a| a.name().unwrap()).collect();
    assert_eq!(
        names,
        ["b", "counts", "mask", "scale", "steps", "w"],
        "sorted by name"
    );
    for a in &loaded {
        assert_eq!(a.manager().unwrap(), other);
    }
    let w = by_name(&loaded, "w");
    assert_eq!(w.dims(), &[2, 3]);
    assert_eq!(
        w.to_vec::<f32>().unwrap(),
        vec![1.5, -2.0, 3.25, 0.0, 7.0, -1e-3]
    );
    assert_eq!(
        by_name(&loaded, "b").to_vec::<f64>().unwrap(),
        vec![0.25, -8.0]
    );
    assert_eq!(
        by_name(&loaded, "counts").to_vec::<i32>().unwrap(),
        vec![i32::MIN, 0, i32::MAX]
    );
    let steps = by_name(&loaded, "steps");
    assert_eq!(steps.dims(), &[1, 2]);
    assert_eq!(steps.to_vec::<i64>().unwrap(), vec![i64::MAX, -5]);
    assert_eq!(
        by_name(&loaded, "mask").to_vec::<u8>().unwrap(),
        vec![0, 1, 255]
    );
    let scale = by_name(&loaded, "scale");
    assert_eq!(scale.dims(), &[] as &[usize]);
    assert_eq!(scale.to_scalar::<f32>().unwrap(), 42.0);
    m.close().unwrap();
    other.close().unwrap();
}

#[test]
fn the_file_is_plain_safetensors() {
    let d = dir("interop");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = file.tensor("w").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), &[2, 3]);
    assert_eq!(&w.data()[..4], &1.5f32.to_le_bytes());
    assert_eq!(
        file.tensor("steps").unwrap().dtype(),
        safetensors::Dtype::I64
    );
    assert_eq!(file.len(), 6);
    m.close().unwrap();
}

#[test]
fn a_list_is_saved_by_name_or_position() {
    let d = dir("list");
    let path = d.join("list.safetensors");
    let m = Manager::new_base();
    let list: NDList = vec![
        m.ones([2], DType::F32).unwrap(),
        m.zeros([3], DType::I64).unwrap().with_name("named"),
        m.full([1], 2.0, DType::F64).unwrap(),
    ]
    .into();
    list.save_safetensors(&path).unwrap();
    let back = m.load_safetensors(&path).unwrap();
    let names: Vec<String> = back.iter().map(|a| a.name().unwrap()).collect();
    assert_eq!(names, ["0", "2", "named"]);
    // Restore into the same list, in place.
    list.get(0).unwrap().fill_(9.0).unwrap();
    list.restore_safetensors(&path).unwrap();
    assert_eq!(
        list.get(0).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 1.0]
    );
    m.close().unwrap();
}

#[test]
fn unnamed_or_duplicate_names_are_refused_and_nothing_is_written() {
    let d = dir("names");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let before = std::fs::read(&path).unwrap();

    let stray = m.zeros([4], DType::F32).unwrap(); // no name
    let err = m.save_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains(&stray.id().to_string()), "{msg}");
    assert!(msg.contains("has no name"), "{msg}");
    assert_eq!(
        std::fs::read(&path).unwrap(),
        before,
        "the old file is intact"
    );

    stray.set_name("w");
    let err = m.save_safetensors(&path).unwrap_err();
    assert!(
        err.to_string().contains("two arrays are named 'w'"),
        "{err}"
    );
    assert_eq!(std::fs::read(&path).unwrap(), before);
    m.close().unwrap();
}

fn assert_invalid_data(err: &Error) {
    match err {
        Error::Io { source, path, .. } => {
            assert_eq!(source.kind(), ErrorKind::InvalidData, "{err}");
            assert!(path.ends_with("model.safetensors"), "{err}");
            assert!(
                err.to_string().contains("not a valid safetensors file"),
                "{err}"
            );
        }
        other => panic!("expected Io/InvalidData, got {other}"),
    }
}

#[test]
fn a_truncated_or_corrupt_file_is_an_error_and_loads_nothing() {
    let d = dir("corrupt");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let target = Manager::new_base().with_name("target");

    // Truncated: every cut, from the header length to the last data byte.
    for cut in [0, 4, 8, 20, good.len() / 2, good.len() - 1] {
        std::fs::write(&path, &good[..cut]).unwrap();
        let err = target.load_safetensors(&path).unwrap_err();
        assert_invalid_data(&err);
        assert_eq!(target.report().total_arrays(), 0, "cut at {cut}");
    }
    // A corrupt header: not JSON.
    let mut bad = good.clone();
    for b in &mut bad[8..24] {
        *b = b'#';
    }
    std::fs::write(&path, &bad).unwrap();
    assert_invalid_data(&target.load_safetensors(&path).unwrap_err());
    // A header length past the end of the file.
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&(good.len() as u64 * 2).to_le_bytes());
    std::fs::write(&path, &bad).unwrap();
    assert_invalid_data(&target.load_safetensors(&path).unwrap_err());
    // Restoring from a corrupt file changes nothing either.
    let before = m.report();
    assert_invalid_data(&m.restore_safetensors(&path).unwrap_err());
    assert_eq!(m.report().total_bytes(), before.total_bytes());
    assert_eq!(target.report().total_arrays(), 0);
    // A missing file.
    let err = target.load_safetensors(d.join("absent")).unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.kind() == ErrorKind::NotFound),
        "{err}"
    );
    m.close().unwrap();
    target.close().unwrap();
}

#[test]
fn wrong_shapes_into_an_existing_model_are_refused_and_the_model_is_unchanged() {
    let d = dir("shapes");
    let path = d.join("model.safetensors");
    // The file: w is [3, 2].
    let saved = Manager::new_base();
    saved
        .from_slice(&[1.0f32; 6], [3, 2])
        .unwrap()
        .set_name("w");
    saved.from_slice(&[2.0f32; 2], [2]).unwrap().set_name("b");
    saved.save_safetensors(&path).unwrap();
    // The model: w is [2, 3]; b matches and would be written first in name order.
    let model = Manager::new_base().with_name("model");
    let w = model.zeros([2, 3], DType::F32).unwrap().with_name("w");
    let b = model.zeros([2], DType::F32).unwrap().with_name("b");
    model.cap();
    let err = model.restore_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("'w'") && msg.contains("[3, 2]") && msg.contains("[2, 3]"),
        "{msg}"
    );
    assert_eq!(w.to_vec::<f32>().unwrap(), vec![0.0; 6], "w unchanged");
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![0.0; 2], "b unchanged too");

    // Right shape, wrong dtype: a float tensor does not restore into integers (into another
    // float dtype it is converted, see tests/half.rs).
    w.close().unwrap();
    let model2 = Manager::new_base();
    let w2 = model2.zeros([3, 2], DType::I32).unwrap().with_name("w");
    model2.zeros([2], DType::F32).unwrap().set_name("b");
    let err = model2.restore_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    assert_eq!(w2.to_vec::<i32>().unwrap(), vec![0; 6]);

    // Names that differ: both directions are named.
    let model3 = Manager::new_base();
    model3.zeros([3, 2], DType::F32).unwrap().set_name("w");
    model3.zeros([2], DType::F32).unwrap().set_name("bias");
    let err = model3.restore_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("\"bias\"") && msg.contains("\"b\""), "{msg}");

    // The right model restores, in place, although it is capped.
    let model4 = Manager::new_base();
    let w4 = model4.zeros([3, 2], DType::F32).unwrap().with_name("w");
    let b4 = model4.zeros([2], DType::F32).unwrap().with_name("b");
    model4.cap();
    model4.restore_safetensors(&path).unwrap();
    assert_eq!(w4.to_vec::<f32>().unwrap(), vec![1.0; 6]);
    assert_eq!(b4.to_vec::<f32>().unwrap(), vec![2.0; 2]);
    assert_eq!(
        model4.report().total_arrays(),
        2,
        "nothing new in the model"
    );
    for m in [saved, model, model2, model3, model4] {
        m.close().unwrap();
    }
}

#[test]
fn loading_into_a_capped_or_closed_manager_is_refused() {
    let d = dir("capped");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let capped = Manager::new_base();
    capped.cap();
    let err = capped.load_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::Capped { .. }), "{err}");
    assert_eq!(capped.report().total_arrays(), 0);
    let closed = Manager::new_base();
    closed.close().unwrap();
    let err = closed.load_safetensors(&path).unwrap_err();
    assert!(matches!(err, Error::ManagerClosed { .. }), "{err}");
    m.close().unwrap();
    capped.close().unwrap();
}

#[test]
fn dtypes_without_an_equivalent_are_unsupported_and_bool_loads_as_u8() {
    use safetensors::tensor::TensorView;
    let d = dir("dtypes");
    let short = d.join("i16.safetensors");
    let data = [0u8; 8];
    let view = TensorView::new(safetensors::Dtype::I16, vec![4], &data).unwrap();
    safetensors::serialize_to_file([("h", view)], None, &short).unwrap();
    let m = Manager::new_base();
    let err = m.load_safetensors(&short).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains("'h'"), "{err}");

    let flags = d.join("bool.safetensors");
    let data = [1u8, 0, 1];
    let view = TensorView::new(safetensors::Dtype::BOOL, vec![3], &data).unwrap();
    safetensors::serialize_to_file([("f", view)], None, &flags).unwrap();
    let loaded = m.load_safetensors(&flags).unwrap();
    let f = loaded.get(0).unwrap();
    assert_eq!(f.dtype(), DType::U8);
    assert_eq!(f.to_vec::<u8>().unwrap(), vec![1, 0, 1]);
    m.close().unwrap();
}

#[test]
fn loading_inside_a_workspace_cycle_puts_the_arrays_in_the_block() {
    let d = dir("cycle");
    let path = d.join("model.safetensors");
    let m = model();
    m.save_safetensors(&path).unwrap();
    let t = Manager::new_base();
    let ws = t
        .workspace(
            "load",
            ndscope::WorkspaceConfig::builder()
                .initial_size(1 << 16)
                .learning(ndscope::LearningPolicy::None)
                .build()
                .unwrap(),
        )
        .unwrap();
    let total = ws
        .cycle(|c| {
            let loaded = c.load_safetensors(&path)?;
            assert!(c.report().arrays.iter().all(|a| a.in_workspace));
            by_name(&loaded, "w").sum_all()?.to_scalar::<f32>()
        })
        .unwrap();
    assert!((total - 9.749).abs() < 1e-4);
    m.close().unwrap();
    t.close().unwrap();
}
