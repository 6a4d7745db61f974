//! `Dense`: dense layers with packed weights. Results against `matmul` + `add` + activation,
//! where the packed copy lives and when it is freed, bad input refused with nothing changed,
//! snapshots and `repack`, and the unpacked path (f64, or a GPU).

mod common;

use common::device_tests;
use ndscope::{Activation, DType, Dense, Device, Error, Manager, NDArray, WorkspaceConfig};

/// A `[rows, cols]` array of small multiples of 1/8, so every sum below is exact in f32 and the
/// packed kernel and `matmul` must agree bit for bit whatever order they add in.
fn exact(m: &Manager, rows: usize, cols: usize, seed: usize, dtype: DType) -> NDArray {
    let v: Vec<f64> = (0..rows * cols)
        .map(|i| ((i * 7 + seed) % 17) as f64 / 8.0 - 1.0)
        .collect();
    m.from_slice(&v, [rows, cols])
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// `x · w + b`, then the activation, with the plain ops.
fn plain(x: &NDArray, w: &NDArray, b: Option<&NDArray>, act: Activation) -> NDArray {
    let mut y = x.matmul(w).unwrap();
    if let Some(b) = b {
        y = y.add(b).unwrap();
    }
    if act == Activation::Relu {
        y = y.relu().unwrap();
    }
    y
}

fn agrees_with_matmul_add_and_activation(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    // Row counts around the kernel's 6-row blocks and column counts around its 16-column
    // panels, depths around its 256-row slices; 1 row uses the wide one-row kernel.
    for &(rows, k, n) in &[
        (1, 3, 5),
        (1, 70, 64),
        (6, 257, 16),
        (7, 300, 17),
        (64, 40, 130),
    ] {
        for dtype in [DType::F32, DType::F64] {
            let x = exact(&m, rows, k, 1, dtype);
            let w = exact(&m, k, n, 2, dtype);
            let b = exact(&m, 1, n, 3, dtype).reshape([n]).unwrap();
            for (bias, act) in [
                (None, Activation::Identity),
                (Some(&b), Activation::Identity),
                (Some(&b), Activation::Relu),
                (None, Activation::Relu),
            ] {
                let layer = Dense::new(&w, bias, act).unwrap();
                assert_eq!(layer.is_packed(), dtype == DType::F32 && dev == Device::Cpu);
                let y = layer.forward(&x).unwrap();
                let want = plain(&x, &w, bias, act);
                assert_eq!(y.dims(), &[rows, n]);
                let values = |a: &NDArray| a.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
                assert_eq!(
                    values(&y),
                    values(&want),
                    "{rows}×{k}×{n} {dtype} bias {} {act:?}",
                    bias.is_some()
                );
            }
        }
    }
    m.close().unwrap();
}

fn leading_axes_are_batch_axes(dev: Device) {
    let m = Manager::new_base_on(dev).unwrap();
    let values = |a: &NDArray| a.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
    for dtype in [DType::F32, DType::F64] {
        let w = exact(&m, 4, 3, 0, dtype);
        let layer = Dense::new(&w, None, Activation::Identity).unwrap();
        let x = exact(&m, 6, 4, 5, dtype);
        let flat = values(&layer.forward(&x).unwrap());
        let y = layer.forward(&x.reshape([2, 3, 4]).unwrap()).unwrap();
        assert_eq!(y.dims(), &[2, 3, 3]);
        assert_eq!(values(&y), flat);
        let one = layer
            .forward(&x.reshape([24]).unwrap().narrow(0, 0, 4).unwrap())
            .unwrap();
        assert_eq!(one.dims(), &[3]);
        assert_eq!(values(&one), flat[..3]);
        let none = layer.forward(&m.zeros([0, 4], dtype).unwrap()).unwrap();
        assert_eq!(none.dims(), &[0, 3]);
        drop(layer);
    }
    // No input features: the output is the bias alone, through the activation, even in a
    // workspace whose memory holds an earlier cycle's values.
    let w = m.zeros([0, 3], DType::F32).unwrap();
    let b = m.from_slice(&[1.0f32, -2.0, 3.0], [3]).unwrap();
    let layer = Dense::new(&w, Some(&b), Activation::Relu).unwrap();
    let ws = m.workspace("ctx", WorkspaceConfig::default()).unwrap();
    for _ in 0..3 {
        let y = ws
            .cycle(|ctx| {
                ctx.full([2, 3], 7.0, DType::F32)?.close()?;
                layer
                    .forward(&ctx.zeros([2, 0], DType::F32)?)?
                    .to_vec::<f32>()
            })
            .unwrap();
        assert_eq!(y, vec![1.0, 0.0, 3.0, 1.0, 0.0, 3.0]);
    }
    drop(layer);
    m.close().unwrap();
}

device_tests!(
    agrees_with_matmul_add_and_activation,
    leading_axes_are_batch_axes
);

#[test]
fn the_packed_copy_is_an_array_of_the_weights_manager_freed_with_the_layer() {
    let model = Manager::new_base().with_name("model");
    let w = exact(&model, 20, 40, 0, DType::F32).with_name("fc1.w");
    let before = model.report().arrays.len();
    let layer = Dense::new(&w, None, Activation::Relu).unwrap();
    let report = model.report();
    assert_eq!(report.arrays.len(), before + 1);
    let packed = report
        .arrays
        .iter()
        .find(|a| a.name.as_deref() == Some("fc1.w (packed)"))
        .expect("the packed copy is listed in the model, named after the weights");
    // 40 columns round up to 3 panels of 16.
    assert_eq!(packed.shape.dims(), &[3, 20, 16]);
    assert_eq!(packed.bytes, 3 * 20 * 16 * 4);
    assert_eq!(layer.packed().unwrap().dims(), &[3, 20, 16]);
    drop(layer);
    assert_eq!(
        model.report().arrays.len(),
        before,
        "dropping the layer frees it"
    );

    let layer = Dense::new(&w, None, Activation::Relu).unwrap();
    let packed = layer.packed().unwrap().clone();
    layer.close().unwrap();
    assert!(!packed.is_open(), "close frees it now");
    assert!(w.is_open(), "the weights belong to the model and stay");

    // A layer outliving its model: the copy closed with the model; dropping it is quiet, and
    // using it says what was closed.
    let layer = Dense::new(&w, None, Activation::Identity).unwrap();
    let x = exact(&model, 2, 20, 1, DType::F32);
    model.close().unwrap();
    let other = Manager::new_base();
    let x2 = exact(&other, 2, 20, 1, DType::F32);
    assert!(matches!(
        layer.forward(&x2),
        Err(Error::ArrayClosed { .. } | Error::ManagerClosed { .. })
    ));
    assert!(!x.is_open());
    drop(layer);
    other.close().unwrap();
}

#[test]
fn forward_places_its_result_like_any_op_and_allocates_nothing_in_a_learned_cycle() {
    let model = Manager::new_base().with_name("model");
    let w1 = exact(&model, 30, 50, 1, DType::F32);
    let b1 = exact(&model, 1, 50, 2, DType::F32).reshape([50]).unwrap();
    let w2 = exact(&model, 50, 7, 3, DType::F32);
    let l1 = Dense::new(&w1, Some(&b1), Activation::Relu).unwrap();
    let l2 = Dense::new(&w2, None, Activation::Identity).unwrap();
    let arrays = model.report().arrays.len();
    let service = Manager::new_base();
    let ws = service
        .workspace("ctx", WorkspaceConfig::default())
        .unwrap();
    let x = service.ones([8, 30], DType::F32).unwrap();
    let (mut first, mut learned) = (None, None);
    for i in 0..4 {
        let out = ws
            .cycle(|ctx| {
                let h = l2.forward(&l1.forward(&x)?)?;
                let report = ctx.report();
                // The first cycle learns the workspace's size; later ones use its block.
                assert_eq!(
                    report.arrays.iter().all(|a| a.in_workspace),
                    i > 0,
                    "cycle {i}"
                );
                assert_eq!(report.arrays.len(), 2, "one array per layer");
                h.to_vec::<f32>()
            })
            .unwrap();
        assert_eq!(*first.get_or_insert_with(|| out.clone()), out);
        if i == 0 {
            learned = Some(ws.stats());
        }
    }
    // After the learning cycle: no spill out of the block, no new block.
    let (after, learned) = (ws.stats(), learned.unwrap());
    assert_eq!(after.spilled_count, learned.spilled_count);
    assert_eq!(after.reallocations, learned.reallocations);
    assert_eq!(after.cycles, learned.cycles + 3);
    assert_eq!(
        model.report().arrays.len(),
        arrays,
        "nothing new in the model"
    );
    drop((l1, l2));
    service.close().unwrap();
    model.close().unwrap();
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let model = Manager::new_base();
    let w = exact(&model, 4, 3, 0, DType::F32);
    let arrays = || model.report().arrays.len();
    let start = arrays();
    // Weights.
    let flat = w.reshape([12]).unwrap();
    let start = start + 1;
    assert!(matches!(
        Dense::new(&flat, None, Activation::Identity),
        Err(Error::ShapeMismatch { .. })
    ));
    let ints = model.zeros([4, 3], DType::I32).unwrap();
    let start = start + 1;
    assert!(matches!(
        Dense::new(&ints, None, Activation::Identity),
        Err(Error::DTypeMismatch { .. })
    ));
    // Bias: wrong length, wrong rank, wrong dtype.
    for (bias, is_shape) in [
        (model.zeros([4], DType::F32).unwrap(), true),
        (model.zeros([1, 3], DType::F32).unwrap(), true),
        (model.zeros([3], DType::F64).unwrap(), false),
    ] {
        let err = Dense::new(&w, Some(&bias), Activation::Identity).unwrap_err();
        if is_shape {
            assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
            assert!(err.to_string().contains("the bias must be [3]"), "{err}");
        } else {
            assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
        }
    }
    let start = start + 3;
    assert_eq!(arrays(), start, "no packed copy left behind");
    // Inputs.
    let layer = Dense::new(&w, None, Activation::Identity).unwrap();
    let with_layer = arrays();
    for x in [
        model.zeros([2, 5], DType::F32).unwrap(),
        model.zeros([3], DType::F32).unwrap(),
        model.zeros((), DType::F32).unwrap(),
    ] {
        let err = layer.forward(&x).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
        assert!(
            err.to_string().contains("the input must be [..., 4]"),
            "{err}"
        );
        x.close().unwrap();
    }
    let x = model.zeros([2, 4], DType::F64).unwrap();
    assert!(matches!(
        layer.forward(&x),
        Err(Error::DTypeMismatch { .. })
    ));
    x.close().unwrap();
    assert_eq!(arrays(), with_layer, "no result made on an error");
    // A capped manager takes no packed copy.
    model.cap();
    let err = Dense::new(&w, None, Activation::Identity).unwrap_err();
    assert!(matches!(err, Error::Capped { .. }), "{err}");
    assert_eq!(arrays(), with_layer);
    drop(layer);
    model.close().unwrap();
}

#[test]
fn the_packed_copy_is_a_snapshot_until_repacked() {
    let model = Manager::new_base();
    let w = exact(&model, 5, 20, 0, DType::F32);
    let b = exact(&model, 1, 20, 1, DType::F32).reshape([20]).unwrap();
    let layer = Dense::new(&w, Some(&b), Activation::Relu).unwrap();
    let x = exact(&model, 3, 5, 2, DType::F32);
    let before = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
    w.mul_scalar_(2.0).unwrap();
    b.add_(&model.ones([20], DType::F32).unwrap()).unwrap();
    // The weights changed, the packed copy did not; the bias is read at each call.
    let stale = layer.forward(&x).unwrap();
    let bias_only = plain(
        &x,
        &exact(&model, 5, 20, 0, DType::F32),
        Some(&b),
        Activation::Relu,
    );
    assert_eq!(
        stale.to_vec::<f32>().unwrap(),
        bias_only.to_vec::<f32>().unwrap()
    );
    assert_ne!(stale.to_vec::<f32>().unwrap(), before);
    layer.repack().unwrap();
    let fresh = layer.forward(&x).unwrap();
    let want = plain(&x, &w, Some(&b), Activation::Relu);
    assert_eq!(
        fresh.to_vec::<f32>().unwrap(),
        want.to_vec::<f32>().unwrap()
    );
    w.close().unwrap();
    assert!(matches!(layer.repack(), Err(Error::ArrayClosed { .. })));
    drop(layer);
    model.close().unwrap();
}

#[test]
fn layers_serve_many_threads_at_once() {
    let model = Manager::new_base();
    let w = exact(&model, 64, 96, 0, DType::F32);
    let layer = Dense::new(&w, None, Activation::Relu).unwrap();
    let x = exact(&model, 9, 64, 4, DType::F32);
    let want = layer.forward(&x).unwrap().to_vec::<f32>().unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let scope = Manager::new_base();
                for _ in 0..50 {
                    let y = scope.scope(|_| layer.forward(&x)?.to_vec::<f32>()).unwrap();
                    assert_eq!(y, want);
                }
                scope.close().unwrap();
            });
        }
    });
    drop(layer);
    model.close().unwrap();
}
