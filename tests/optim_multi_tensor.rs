//! `Optimizer::step` runs one multi-tensor step per device and dtype: SGD (momentum, Nesterov,
//! weight decay) and Adam and AdamW over many parameters (single elements, ones larger than a
//! block's share of a launch, more parameters than one launch takes, f32 and f64 in one
//! optimizer) give parameters, state and gradients bit for bit equal to stepping each parameter
//! alone with the single-tensor steps (`sgd_update_`, `adam_update_`). On the simulated GPU a
//! step is one launch per dtype and per 64 parameters, with one cuBLAS product more per weight
//! gradient backward left pending, and no copy or wait.

use std::sync::Mutex;

use ndscope::{
    Adam, AdamUpdate, AdamW, DType, Device, Manager, NDArray, Optimizer, OptimizerKind, Sgd,
    SgdUpdate,
};

mod common;
use common::{device_tests, sim};

/// The tests take turns: the simulator's counters are the process's, and the large steps are
/// better not run side by side on a small machine.
static TURN: Mutex<()> = Mutex::new(());

/// The sizes of the parameters: single elements, a block's share of a launch (4096 elements)
/// and one more, several blocks' worth, odd sizes.
const SIZES: [usize; 7] = [1, 8197, 4096, 4097, 33, 1000, 3];

/// `count` parameters of `dtypes` (taken in turn) on `model`, sizes from [`SIZES`], and the
/// same again in `copy`, requiring gradients; with deterministic values varied by `seed`.
fn twins(
    model: &Manager,
    copy: &Manager,
    count: usize,
    dtypes: &[DType],
) -> (Vec<NDArray>, Vec<NDArray>) {
    let mut ours = Vec::new();
    let mut theirs = Vec::new();
    for i in 0..count {
        let n = SIZES[i % SIZES.len()];
        let dtype = dtypes[i % dtypes.len()];
        let vals = common::values(n, i as u64, 1000);
        for (m, list) in [(model, &mut ours), (copy, &mut theirs)] {
            let p = common::array(m, dtype, &[n], &vals, 1.0 / 512.0);
            p.set_requires_gradient(true).unwrap();
            list.push(p);
        }
    }
    (ours, theirs)
}

/// Gives every parameter of `params` the gradient `c` (values varied by `round`): the gradient
/// of `Σ p·c`, from a collector's backward on `model`.
fn backward(model: &Manager, params: &[NDArray], round: u64) {
    let scope = model.sub_scope().unwrap();
    {
        let _active = scope.activate();
        let collector = scope.gradient_collector().unwrap();
        let mut loss: Option<NDArray> = None;
        for (i, p) in params.iter().enumerate() {
            let vals = common::values(p.size(), 1000 * round + i as u64, 700);
            let c = common::array(&scope, p.dtype(), &[p.size()], &vals, 1.0 / 256.0);
            let term = p.mul(&c).unwrap().sum_all().unwrap();
            let term = term.to_dtype(DType::F64).unwrap();
            loss = Some(match loss {
                None => term,
                Some(l) => l.add(&term).unwrap(),
            });
        }
        collector.backward(&loss.unwrap()).unwrap();
    }
    scope.close().unwrap();
}

/// The bits of every element of `a` (f32 widened to f64 exactly).
fn bits(a: &NDArray) -> Vec<u64> {
    common::as_f64(a).into_iter().map(f64::to_bits).collect()
}

/// Steps `count` parameters (of `dtypes` in turn) three times with one optimizer running
/// `kind`, and their twins with the single-tensor step of each parameter alone (`sgd_update_`,
/// `adam_update_`, the state made here), and compares parameters, state and gradients bit for
/// bit.
fn multi_equals_single(dev: Device, kind: OptimizerKind, count: usize, dtypes: &[DType]) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let model = Manager::new_base_on(dev).unwrap();
    let copy = Manager::new_base_on(dev).unwrap();
    let (ours, theirs) = twins(&model, &copy, count, dtypes);
    let mut optimizer = Optimizer::new(&ours, kind).unwrap();
    let states: Vec<Vec<NDArray>> = theirs
        .iter()
        .map(|p| {
            let n = match kind {
                OptimizerKind::Sgd(s) if s.momentum == 0.0 => 0,
                OptimizerKind::Sgd(_) => 1,
                _ => 2,
            };
            (0..n)
                .map(|_| copy.zeros([p.size()], p.dtype()).unwrap())
                .collect()
        })
        .collect();
    for round in 1..=3u64 {
        backward(&model, &ours, round);
        backward(&copy, &theirs, round);
        let before = sim::stats();
        optimizer.step().unwrap();
        if let (Device::Cuda(_), Some(before), Some(after)) = (dev, before, sim::stats()) {
            // One launch per dtype and per 64 parameters of it, nothing else.
            let launches: u64 = dtypes
                .iter()
                .map(|&d| {
                    let of_dtype = ours.iter().filter(|p| p.dtype() == d).count();
                    of_dtype.div_ceil(64) as u64
                })
                .sum();
            let calls = sim::calls(&sim::diff(&before, &after));
            assert_eq!(calls, [("launches".to_string(), launches)], "{kind:?}");
        }
        for (p, state) in theirs.iter().zip(&states) {
            let grad = p.gradient().unwrap();
            match kind {
                OptimizerKind::Sgd(s) => {
                    let update = SgdUpdate {
                        lr: s.lr,
                        momentum: s.momentum,
                        weight_decay: s.weight_decay,
                        nesterov: s.nesterov,
                    };
                    p.sgd_update_(&grad, state.first(), update).unwrap();
                }
                OptimizerKind::Adam(a) => {
                    let update = AdamUpdate {
                        beta1: a.betas.0,
                        beta2: a.betas.1,
                        eps: a.eps,
                        weight_decay: a.weight_decay,
                        ..AdamUpdate::new(a.lr, round)
                    };
                    p.adam_update_(&grad, &state[0], &state[1], update).unwrap();
                }
                OptimizerKind::AdamW(a) => {
                    let update = AdamUpdate {
                        beta1: a.betas.0,
                        beta2: a.betas.1,
                        eps: a.eps,
                        weight_decay: a.weight_decay,
                        decoupled: true,
                        ..AdamUpdate::new(a.lr, round)
                    };
                    p.adam_update_(&grad, &state[0], &state[1], update).unwrap();
                }
            }
            grad.fill_(0.0).unwrap();
        }
        for (i, (p, twin)) in ours.iter().zip(&theirs).enumerate() {
            let what = format!(
                "{kind:?}, round {round}, parameter {i} ({} elements)",
                p.size()
            );
            assert_eq!(bits(p), bits(twin), "{what}: the parameter");
            let state = optimizer.state(p).unwrap();
            assert_eq!(state.len(), states[i].len(), "{what}: the state");
            for (s, t) in state.iter().zip(&states[i]) {
                assert_eq!(bits(s), bits(t), "{what}: the state");
            }
            assert!(
                common::as_f64(&p.gradient().unwrap())
                    .iter()
                    .all(|&g| g.to_bits() == 0),
                "{what}: the gradient is not zero after the step"
            );
        }
    }
    model.close().unwrap();
    copy.close().unwrap();
}

const F32: &[DType] = &[DType::F32];
const F64: &[DType] = &[DType::F64];
/// Every float dtype, the half types too (their steps compute in f32, one launch or many).
const FLOATS: &[DType] = &[DType::F32, DType::F64, DType::F16, DType::BF16];

fn sgd_kinds() -> [OptimizerKind; 4] {
    [
        Sgd::new(0.1).into(),
        Sgd {
            momentum: 0.9,
            ..Sgd::new(0.05)
        }
        .into(),
        Sgd {
            momentum: 0.9,
            nesterov: true,
            ..Sgd::new(0.05)
        }
        .into(),
        Sgd {
            momentum: 0.8,
            weight_decay: 0.01,
            ..Sgd::new(0.05)
        }
        .into(),
    ]
}

device_tests!(sgd_steps_many_parameters_as_each_alone);
fn sgd_steps_many_parameters_as_each_alone(dev: Device) {
    for kind in sgd_kinds() {
        multi_equals_single(dev, kind, 9, FLOATS);
    }
}

device_tests!(adam_steps_many_parameters_as_each_alone);
fn adam_steps_many_parameters_as_each_alone(dev: Device) {
    let adam = Adam {
        weight_decay: 0.01,
        ..Adam::new(1e-2)
    };
    multi_equals_single(dev, adam.into(), 9, FLOATS);
    multi_equals_single(dev, Adam::new(1e-3).into(), 5, F64);
}

device_tests!(adamw_steps_many_parameters_as_each_alone);
fn adamw_steps_many_parameters_as_each_alone(dev: Device) {
    multi_equals_single(dev, AdamW::new(1e-2).into(), 9, FLOATS);
}

device_tests!(more_parameters_than_one_launch_takes);
/// More parameters of one dtype than one launch takes (64): two launches on a GPU, the same
/// results.
fn more_parameters_than_one_launch_takes(dev: Device) {
    let momentum = Sgd {
        momentum: 0.9,
        nesterov: true,
        weight_decay: 0.01,
        ..Sgd::new(0.05)
    };
    multi_equals_single(dev, momentum.into(), 70, F32);
    multi_equals_single(dev, AdamW::new(1e-2).into(), 70, F64);
}

/// `Optimizer::step`'s calls to the simulated GPU: six parameters of one dtype without pending
/// gradients are one launch and nothing else; with three weight gradients backward left
/// pending, three cuBLAS products more. Skipped where the GPU is real (no counters).
#[test]
fn a_step_is_one_launch_on_the_simulator() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let Some(dev) = common::cuda_device() else {
        return;
    };
    if sim::stats().is_none() {
        eprintln!("skipped: the counters exist on the simulated GPU only");
        return;
    }
    let model = Manager::new_base_on(dev).unwrap();
    // An MLP 8 → 6 → 6 → 3: three weights and three biases.
    let dims = [8usize, 6, 6, 3];
    let mut params = Vec::new();
    for (l, pair) in dims.windows(2).enumerate() {
        let (fan_in, fan_out) = (pair[0], pair[1]);
        let w = common::array(
            &model,
            DType::F32,
            &[fan_in, fan_out],
            &common::values(fan_in * fan_out, l as u64, 100),
            1.0 / 256.0,
        );
        let b = common::array(
            &model,
            DType::F32,
            &[fan_out],
            &common::values(fan_out, 10 + l as u64, 100),
            1.0 / 256.0,
        );
        w.set_requires_gradient(true).unwrap();
        b.set_requires_gradient(true).unwrap();
        params.push(w);
        params.push(b);
    }
    let x = common::array(
        &model,
        DType::F32,
        &[5, dims[0]],
        &common::values(5 * dims[0], 99, 100),
        1.0 / 64.0,
    );
    let sgd = Sgd {
        momentum: 0.9,
        ..Sgd::new(0.01)
    };
    let mut optimizer = Optimizer::new(&params, sgd).unwrap();
    let forward_backward = || {
        let scope = model.sub_scope().unwrap();
        {
            let _active = scope.activate();
            let collector = scope.gradient_collector().unwrap();
            let mut h = x.clone();
            for (l, layer) in params.chunks(2).enumerate() {
                h = h.matmul(&layer[0]).unwrap().add(&layer[1]).unwrap();
                if l + 1 < params.len() / 2 {
                    h = h.relu().unwrap();
                }
            }
            collector.backward(&h.sum_all().unwrap()).unwrap();
        }
        // The step runs while the scope is open: the pending products read its arrays.
        scope
    };
    // A first round loads what the step needs.
    let scope = forward_backward();
    optimizer.step().unwrap();
    scope.close().unwrap();
    // No pending gradient: gradients given by hand (an in-place write settles nothing).
    for p in &params {
        p.gradient().unwrap().fill_(0.5).unwrap();
    }
    let before = sim::stats().unwrap();
    optimizer.step().unwrap();
    let after = sim::stats().unwrap();
    let d = sim::diff(&before, &after);
    let calls = sim::calls(&d);
    eprintln!("a step without pending gradients: {calls:?}");
    assert_eq!(
        (d["launches"], d["cublas"], d["blocking_syncs"]),
        (1, 0, 0),
        "{calls:?}"
    );
    assert_eq!((d["h2d"], d["d2h"], d["d2d"]), (0, 0, 0), "{calls:?}");
    // Three weight gradients left pending by backward.
    let scope = forward_backward();
    let before = sim::stats().unwrap();
    optimizer.step().unwrap();
    let after = sim::stats().unwrap();
    scope.close().unwrap();
    let d = sim::diff(&before, &after);
    let calls = sim::calls(&d);
    eprintln!("a step with three pending weight gradients: {calls:?}");
    assert_eq!(
        (d["launches"], d["cublas"], d["blocking_syncs"]),
        (1, 3, 0),
        "{calls:?}"
    );
    assert_eq!((d["h2d"], d["d2h"], d["d2d"]), (0, 0, 0), "{calls:?}");
    model.close().unwrap();
}

device_tests!(a_stale_pending_gradient_is_refused_before_anything_changes);
/// A weight gradient backward left to compute whose operand changed in place since is refused
/// by `step` before any parameter is written, also those earlier in the list.
fn a_stale_pending_gradient_is_refused_before_anything_changes(dev: Device) {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let model = Manager::new_base_on(dev).unwrap();
    let make = |seed: u64, shape: &[usize]| {
        let n = shape.iter().product();
        common::array(
            &model,
            DType::F32,
            shape,
            &common::values(n, seed, 50),
            1.0 / 64.0,
        )
    };
    let (w1, w2) = (make(1, &[4, 3]), make(2, &[4, 3]));
    for w in [&w1, &w2] {
        w.set_requires_gradient(true).unwrap();
    }
    let (x1, x2) = (make(3, &[2, 4]), make(4, &[2, 4]));
    let mut optimizer = Optimizer::new([&w1, &w2], Sgd::new(0.5)).unwrap();
    {
        let collector = model.gradient_collector().unwrap();
        let loss = x1
            .matmul(&w1)
            .unwrap()
            .sum_all()
            .unwrap()
            .add(&x2.matmul(&w2).unwrap().sum_all().unwrap())
            .unwrap();
        collector.backward(&loss).unwrap();
    }
    let before = [bits(&w1), bits(&w2)];
    // x2, an operand of w2's gradient, changes after backward used it.
    x2.fill_(1.0).unwrap();
    let err = optimizer.step().expect_err("a stale gradient");
    assert!(err.to_string().contains("modified"), "{err}");
    assert_eq!([bits(&w1), bits(&w2)], before, "a parameter changed");
    assert_eq!(optimizer.steps(), 0);
    model.close().unwrap();
}

/// The optimizer (with the memory its steps reuse) still moves to and is shared with other
/// threads.
#[test]
fn the_optimizer_is_send_and_sync() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Optimizer>();
}
