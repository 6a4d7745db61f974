//! The example MLP's gradients from autograd equal those of its hand-written backward pass on
//! the same batch, and an autograd training step (collector, backward, `Sgd` with momentum)
//! moves the parameters exactly as the hand-written step does, on the CPU and on a CUDA device.
//!
//! The hand-written step fuses its gradients into the update, so they are read back from it:
//! with momentum 0 and learning rate 1 it sets each parameter to `p − ∂loss/∂p`.

#[path = "../examples/mlp/mod.rs"]
mod mlp;

mod common;

use common::device_tests;
use ndscope::{
    gradient_collector, manual_seed, DType, Device, LayerWorkspaceMgr, Manager, NDArray, Optimizer,
    Sgd, WorkspaceConfig,
};

/// The random stream is one per process: tests that seed it take turns.
static SEEDED: std::sync::Mutex<()> = std::sync::Mutex::new(());

const SIZES: [usize; 4] = [12, 16, 8, 3];

/// Two copies of the same MLP (same seed) in `model`: one for the hand-written step, one whose
/// parameters require gradients; and a batch on `dev`.
fn nets(model: &Manager, trainer: &Manager) -> (mlp::Mlp, mlp::Mlp, NDArray, NDArray) {
    manual_seed(11);
    let manual = mlp::Mlp::new(model, &SIZES).unwrap();
    manual_seed(11);
    let auto = mlp::Mlp::with_gradients(model, &SIZES).unwrap();
    let x = trainer.randn([7, SIZES[0]], DType::F32).unwrap();
    let y = trainer.from_slice(&[0i64, 1, 2, 1, 0, 2, 2], [7]).unwrap();
    (manual, auto, x, y)
}

fn values(a: &NDArray) -> Vec<f32> {
    a.to_vec::<f32>().unwrap()
}

fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}[{i}]: autograd {g} vs hand-written {w} (scale {scale})"
        );
    }
}

device_tests!(autograd_gradients_equal_the_hand_written_ones);
fn autograd_gradients_equal_the_hand_written_ones(dev: Device) {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    let model = Manager::new_base_on(dev).unwrap();
    let trainer = model.new_sub_manager().unwrap();
    let (manual, auto, x, y) = nets(&model, &trainer);
    model.cap();
    let before: Vec<Vec<f32>> = manual.parameters().iter().map(values).collect();
    let layers = LayerWorkspaceMgr::training(&trainer).unwrap();
    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    // Momentum 0, learning rate 1: each parameter becomes p − ∂loss/∂p.
    ws.cycle(|_| manual.train_step(&layers, &x, &y, 1.0, 0.0).map(drop))
        .unwrap();
    ws.cycle(|_| {
        let collector = gradient_collector()?;
        let loss = mlp::Mlp::loss(&auto.logits(&x)?, &y)?;
        collector.backward(&loss)
    })
    .unwrap();
    let params = manual.parameters();
    for ((p, b), a) in params.iter().zip(&before).zip(auto.parameters().iter()) {
        let hand: Vec<f32> = b.iter().zip(values(p)).map(|(b, a)| b - a).collect();
        let name = p.name().unwrap_or_default();
        assert_close(&name, &values(&a.gradient().unwrap()), &hand, 1e-4);
    }
    model.close().unwrap();
}

device_tests!(an_autograd_sgd_step_moves_the_parameters_as_the_hand_written_step);
fn an_autograd_sgd_step_moves_the_parameters_as_the_hand_written_step(dev: Device) {
    let _turn = SEEDED.lock().unwrap_or_else(|e| e.into_inner());
    let model = Manager::new_base_on(dev).unwrap();
    let trainer = model.new_sub_manager().unwrap();
    let (manual, auto, x, y) = nets(&model, &trainer);
    let sgd = Sgd {
        momentum: 0.9,
        ..Sgd::new(0.05)
    };
    let mut optimizer = Optimizer::new(auto.parameters(), sgd).unwrap();
    model.cap();
    let layers = LayerWorkspaceMgr::training(&trainer).unwrap();
    let ws = trainer
        .workspace("batch", WorkspaceConfig::default())
        .unwrap();
    for step in 0..4 {
        let hand = ws
            .cycle(|_| {
                manual
                    .train_step(&layers, &x, &y, 0.05, 0.9)?
                    .loss
                    .to_scalar::<f32>()
            })
            .unwrap();
        let out = ws
            .cycle(|_| {
                auto.autograd_step(&mut optimizer, &x, &y)?
                    .loss
                    .to_scalar::<f32>()
            })
            .unwrap();
        assert!(
            (hand - out).abs() <= 1e-4 * hand.abs().max(1.0),
            "step {step}: loss {out} with autograd, {hand} hand-written"
        );
        for (p, q) in manual.parameters().iter().zip(auto.parameters().iter()) {
            let name = format!("step {step}: {}", p.name().unwrap_or_default());
            assert_close(&name, &values(q), &values(p), 1e-4);
            // The step zeroed the gradient.
            assert!(values(&q.gradient().unwrap()).iter().all(|&v| v == 0.0));
        }
    }
    model.close().unwrap();
}
