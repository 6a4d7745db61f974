//! Learned workspace cycles replayed as CUDA graphs (`WorkspaceConfig::graph_replay`):
//! - a replayed MLP training step is one graph launch and no kernel launch, cuBLAS product,
//!   copy, synchronisation or allocation from the host (counted on the simulated GPU);
//! - replayed steps give the bits of eager steps, Adam's changing step count included;
//! - every kind of divergence (another op, another shape, another scalar, another address, a
//!   host read in a new place, an op that fails, another thread using the device, a cycle that
//!   ends early) leaves results bit for bit those of an eager run, falls back, and relearns;
//! - the memory rules hold: nothing allocated per replayed cycle, closing the workspace
//!   destroys the graph, the timeline and the workspace's figures say what happened.
//!
//! On a real GPU the counters do not exist; everything else runs the same.

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use ndscope::{
    manual_seed, Adam, DType, Device, GraphState, Manager, NDArray, Optimizer, Sgd, Workspace,
    WorkspaceConfig,
};

use common::sim;

/// The tests of this file one at a time: the counters are the process's, and a test's cycle
/// falls back when another thread uses the device in the middle of it.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn replaying() -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .unwrap()
}

/// Every parameter's bits.
fn bits(params: &[NDArray]) -> Vec<Vec<u32>> {
    params
        .iter()
        .map(|p| {
            p.to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect()
}

/// A small MLP trained `steps` steps (one cycle each) in a workspace of `config`, with SGD
/// momentum or Adam; returns the parameters' bits and the workspace's figures.
fn train(
    dev: Device,
    config: WorkspaceConfig,
    adam: bool,
    steps: usize,
) -> (Vec<Vec<u32>>, ndscope::WorkspaceStats) {
    train_in(dev, config, adam, steps, DType::F32)
}

/// [`train`] in `dtype`'s precision: f32, or mixed precision in a half type (autocast, and a
/// loss scaler for f16).
fn train_in(
    dev: Device,
    config: WorkspaceConfig,
    adam: bool,
    steps: usize,
    dtype: DType,
) -> (Vec<Vec<u32>>, ndscope::WorkspaceStats) {
    let trainer = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let ws = trainer.workspace("batch", config).unwrap();
    manual_seed(7);
    let model = Manager::new_base_on(dev).unwrap().with_name("model");
    let net = mlp::Mlp::with_gradients(&model, &[32, 64, 64, 10]).unwrap();
    let precision = mlp::Precision::new(&model, dtype).unwrap();
    let mut optimizer = if adam {
        Optimizer::new(net.parameters(), Adam::new(1e-3)).unwrap()
    } else {
        let sgd = Sgd {
            momentum: 0.9,
            ..Sgd::new(0.05)
        };
        Optimizer::new(net.parameters(), sgd).unwrap()
    };
    let x = trainer.randn([16, 32], DType::F32).unwrap();
    let labels: Vec<i64> = (0..16).map(|i| i % 10).collect();
    let y = trainer.from_vec(labels, [16]).unwrap();
    for _ in 0..steps {
        ws.cycle(|_| {
            net.autograd_step_in(&precision, &mut optimizer, &x, &y)
                .map(|_| ())
        })
        .unwrap();
    }
    let params: Vec<NDArray> = net.parameters().iter().cloned().collect();
    let out = (bits(&params), ws.stats());
    model.close().unwrap();
    trainer.close().unwrap();
    out
}

#[test]
fn replayed_training_gives_the_bits_of_eager_training() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    for adam in [false, true] {
        let (eager, stats) = train(dev, WorkspaceConfig::default(), adam, 8);
        assert_eq!(stats.graph.state, GraphState::Off);
        let (replayed, stats) = train(dev, replaying(), adam, 8);
        let g = &stats.graph;
        assert_eq!(g.state, GraphState::Captured, "{g:?}");
        assert_eq!((g.captures, g.fallbacks), (1, 0), "{g:?}");
        // Cycle 1 learns the block, cycle 2 is recorded, 3..=8 replay.
        assert_eq!(g.replays, 6, "{g:?}");
        assert_eq!(g.graphs, 1, "{g:?}");
        if adam {
            assert!(g.updated_arguments > 0, "Adam's step count changes: {g:?}");
        }
        assert!(
            eager == replayed,
            "replayed training (adam: {adam}) differs from eager training"
        );
    }
}

/// A mixed-precision step (bf16 autocast; f16 autocast with a loss scaler, whose skip flag and
/// scale live on the device) replays too, with the bits of eager steps.
#[test]
fn replayed_mixed_precision_training_gives_the_bits_of_eager_training() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    for dtype in [DType::BF16, DType::F16] {
        for adam in [false, true] {
            let (eager, _) = train_in(dev, WorkspaceConfig::default(), adam, 8, dtype);
            let (replayed, stats) = train_in(dev, replaying(), adam, 8, dtype);
            let g = &stats.graph;
            assert_eq!(g.state, GraphState::Captured, "{dtype} adam {adam}: {g:?}");
            assert_eq!((g.captures, g.fallbacks, g.replays), (1, 0, 6), "{g:?}");
            assert!(
                eager == replayed,
                "replayed {dtype} training (adam: {adam}) differs from eager training"
            );
        }
    }
}

/// f16 training with a loss scaler, where step `bad` sees an input of infinities: its
/// gradients are non-finite and the step is skipped. Returns the parameters' bits after every
/// step, the scale at the end and the workspace's figures.
fn f16_with_a_bad_step(
    dev: Device,
    config: WorkspaceConfig,
    bad: usize,
) -> (Vec<Vec<Vec<u32>>>, f32, ndscope::WorkspaceStats) {
    let trainer = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let ws = trainer.workspace("batch", config).unwrap();
    manual_seed(7);
    let model = Manager::new_base_on(dev).unwrap().with_name("model");
    let net = mlp::Mlp::with_gradients(&model, &[32, 64, 64, 10]).unwrap();
    let precision = mlp::Precision::new(&model, DType::F16).unwrap();
    let sgd = Sgd {
        momentum: 0.9,
        ..Sgd::new(0.05)
    };
    let mut optimizer = Optimizer::new(net.parameters(), sgd).unwrap();
    let good = trainer.randn([16, 32], DType::F32).unwrap();
    let poison = trainer.full([16, 32], f64::INFINITY, DType::F32).unwrap();
    let x = good.duplicate().unwrap();
    let labels: Vec<i64> = (0..16).map(|i| i % 10).collect();
    let y = trainer.from_vec(labels, [16]).unwrap();
    let params: Vec<NDArray> = net.parameters().iter().cloned().collect();
    let mut after = Vec::new();
    for step in 0..8 {
        // The same input array every step (a replayed product reads it where it is), its
        // values changed in place for the bad step.
        x.assign_(if step == bad { &poison } else { &good })
            .unwrap();
        ws.cycle(|_| {
            net.autograd_step_in(&precision, &mut optimizer, &x, &y)
                .map(|_| ())
        })
        .unwrap();
        after.push(bits(&params));
    }
    let scale = precision
        .scaler
        .as_ref()
        .map(|s| s.borrow().scale_value().unwrap())
        .unwrap_or(0.0);
    let out = (after, scale, ws.stats());
    model.close().unwrap();
    trainer.close().unwrap();
    out
}

/// A replayed f16 step whose gradients are non-finite is skipped on the device (the scaler's
/// flag read by the optimizer's kernels inside the graph): the parameters stay as they were,
/// the scale backs off, and the run keeps the bits of an eager one, without falling back.
#[test]
fn a_replayed_step_the_loss_scaler_skips_changes_nothing() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    let bad = 5;
    let (eager, eager_scale, _) = f16_with_a_bad_step(dev, WorkspaceConfig::default(), bad);
    let (replayed, scale, stats) = f16_with_a_bad_step(dev, replaying(), bad);
    let g = &stats.graph;
    assert_eq!((g.captures, g.fallbacks, g.replays), (1, 0, 6), "{g:?}");
    assert_eq!(
        replayed[bad],
        replayed[bad - 1],
        "the skipped step changed a parameter"
    );
    assert_ne!(replayed[bad + 1], replayed[bad], "the next step is taken");
    assert_eq!((scale, eager_scale), (32768.0, 32768.0));
    assert!(eager == replayed, "replayed steps differ from eager ones");
}

/// The MLP step of `examples/mlp_step.rs` (784→1024→1024→10, batch 16), replayed.
#[test]
fn a_replayed_mlp_step_is_one_graph_launch_from_the_host() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    let mut fixture = mlp::AutogradStep::new(dev, 16, replaying()).unwrap();
    let mut step = || fixture.run().unwrap();
    for _ in 0..3 {
        step();
    }
    dev.synchronize().unwrap();
    let Some(before) = sim::stats() else {
        println!("not the simulator: nothing to count");
        step();
        return;
    };
    let steps = 10;
    for _ in 0..steps {
        step();
    }
    let d = sim::diff(&before, &sim::stats().unwrap());
    println!("{steps} replayed steps: {:?}", sim::calls(&d));
    assert_eq!(d["graph_launches"], steps, "{:?}", sim::calls(&d));
    for name in [
        "launches",
        "cublas",
        "blocking_syncs",
        "d2d",
        "h2d",
        "d2h",
        "memsets",
        "allocs",
        "async_allocs",
        "host_allocs",
        "captures",
    ] {
        assert_eq!(
            d[name],
            0,
            "{name} in {steps} replayed steps: {:?}",
            sim::calls(&d)
        );
    }
    let g = fixture.ws.stats().graph;
    assert_eq!((g.replays, g.fallbacks), (11, 0), "{g:?}");
    assert!(g.calls >= 8, "{g:?}");
    fixture.close().unwrap();
}

/// How a cycle departs from the recorded one (in cycle [`AT`] only).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Divergence {
    /// Another elementwise kernel.
    Op,
    /// The product on a narrower input.
    Shape,
    /// Another scalar argument of a kernel: written into the graph, no fallback.
    Scalar,
    /// A kernel reading another array: written into the graph, no fallback.
    KernelAddress,
    /// The product reading another array.
    ProductAddress,
    /// A value read on the host in the middle of the cycle.
    Read,
    /// An op that fails ends the cycle's work early.
    Error,
    /// Another thread writes, in the middle of the cycle, an array the held calls read.
    Thread,
    /// Another thread uses the device in the middle of the cycle on arrays the held calls do
    /// not touch: no fallback.
    OtherArrays,
    /// The cycle's last op is left out.
    Shorter,
    /// One op more at the end.
    Longer,
}

impl Divergence {
    const ALL: [Divergence; 11] = [
        Divergence::Op,
        Divergence::Shape,
        Divergence::Scalar,
        Divergence::KernelAddress,
        Divergence::ProductAddress,
        Divergence::Read,
        Divergence::Error,
        Divergence::Thread,
        Divergence::OtherArrays,
        Divergence::Shorter,
        Divergence::Longer,
    ];
}

/// The cycle in which the divergence happens: cycle 0 learns the block, 1 is recorded, 2
/// replays.
const AT: usize = 3;
const CYCLES: usize = 8;

/// The persistent arrays of one run.
struct Run {
    m: Manager,
    ws: Workspace,
    x: NDArray,
    x_alt: NDArray,
    w: NDArray,
    alt: NDArray,
    acc: NDArray,
    out: NDArray,
}

impl Run {
    fn new(dev: Device, config: WorkspaceConfig) -> Run {
        let m = Manager::new_base_on(dev).unwrap();
        let ws = m.workspace("ws", config).unwrap();
        manual_seed(3);
        let x = m.randn([64, 48], DType::F32).unwrap();
        let x_alt = m.randn([64, 48], DType::F32).unwrap();
        let w = m.randn([48, 32], DType::F32).unwrap();
        let alt = m.randn([64, 32], DType::F32).unwrap();
        let acc = m.zeros([64, 32], DType::F32).unwrap();
        let out = m.zeros([64, 32], DType::F32).unwrap();
        Run {
            m,
            ws,
            x,
            x_alt,
            w,
            alt,
            acc,
            out,
        }
    }

    /// One cycle `i`, departing as `kind` says when `i == AT`.
    fn cycle(&self, i: usize, kind: Divergence) -> ndscope::Result<()> {
        let now = |k: Divergence| i == AT && kind == k;
        self.ws.cycle(|_| {
            let x = if now(Divergence::ProductAddress) {
                &self.x_alt
            } else {
                &self.x
            };
            let h = if now(Divergence::Shape) {
                x.narrow(1, 0, 40)?.matmul(&self.w.narrow(0, 0, 40)?)?
            } else {
                x.matmul(&self.w)?
            };
            let a = if now(Divergence::Op) {
                h.exp()?
            } else {
                h.relu()?
            };
            if now(Divergence::Read) {
                let _ = a.to_vec::<f32>()?;
            }
            if now(Divergence::Thread) {
                // The held product read `w`: multiplying it by 1 in place changes no bit, but
                // must run after the product.
                let w = self.w.clone();
                std::thread::spawn(move || w.mul_scalar_(1.0))
                    .join()
                    .unwrap()?;
            }
            if now(Divergence::OtherArrays) {
                let alt = self.alt.clone();
                std::thread::spawn(move || alt.mul_scalar(2.0)?.sum_all()?.to_scalar::<f32>())
                    .join()
                    .unwrap()?;
            }
            let factor = if now(Divergence::Scalar) { 0.25 } else { 0.5 };
            let b = a.mul_scalar(factor)?;
            self.acc.add_(&b)?;
            if now(Divergence::Error) {
                // The shapes do not match: refused before anything runs; the cycle ends here.
                let _ = self.x.matmul(&self.x)?;
            }
            let other = if now(Divergence::KernelAddress) {
                &self.alt
            } else {
                &a
            };
            if now(Divergence::Shorter) {
                return Ok(());
            }
            let y = b.add(other)?;
            self.out.assign_(&y)?;
            if now(Divergence::Longer) {
                self.acc.add_(&y)?;
            }
            Ok(())
        })
    }

    fn bits(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self
            .out
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect();
        v.extend(
            self.acc
                .to_vec::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits),
        );
        v
    }
}

#[test]
fn every_divergence_falls_back_with_the_bits_of_an_eager_run() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    use Divergence::*;
    for kind in Divergence::ALL {
        let eager = Run::new(dev, WorkspaceConfig::default());
        let replayed = Run::new(dev, replaying());
        for i in 0..CYCLES {
            let e = eager.cycle(i, kind);
            let r = replayed.cycle(i, kind);
            assert_eq!(e.is_ok(), r.is_ok(), "{kind:?}, cycle {i}: {e:?} / {r:?}");
            assert!(
                eager.bits() == replayed.bits(),
                "{kind:?}: cycle {i} of the replayed run differs from the eager run"
            );
        }
        let g = replayed.ws.stats().graph;
        println!("{kind:?}: {g:?}");
        match kind {
            OtherArrays => {
                assert_eq!(g.fallbacks, 0, "{kind:?}: {g:?}");
                assert_eq!(g.replays, (CYCLES - 2) as u64, "{kind:?}: {g:?}");
            }
            Scalar | KernelAddress => {
                assert_eq!(g.fallbacks, 0, "{kind:?}: {g:?}");
                // Changed in cycle AT, changed back in AT + 1.
                assert_eq!(g.updated_arguments, 2, "{kind:?}: {g:?}");
                assert_eq!(g.replays, (CYCLES - 2) as u64, "{kind:?}: {g:?}");
            }
            _ => {
                assert_eq!(g.fallbacks, 1, "{kind:?}: {g:?}");
                // Cycle AT fell back, AT + 1 recorded again, the rest replayed.
                assert_eq!(g.captures, 2, "{kind:?}: {g:?}");
                assert_eq!(g.replays, (CYCLES - 4) as u64, "{kind:?}: {g:?}");
                assert_eq!(g.updated_arguments, 0, "{kind:?}: {g:?}");
                let why = g.last_fallback.clone().unwrap_or_default();
                let expected = match kind {
                    Op => "`exp` was called where `relu` was recorded",
                    Shape => "`narrow` was called where `matmul` was recorded",
                    ProductAddress => "a matrix product with other arguments",
                    Read => "reads or waits after",
                    Error | Shorter => "the cycle ended after 4 of the 6 recorded calls",
                    Thread => "another thread's `mul_scalar_` on cuda:0 touched what this cycle's held calls use",
                    _ => "was called after the last recorded call",
                };
                assert!(
                    why.contains(expected),
                    "{kind:?}: {why:?} lacks {expected:?}"
                );
            }
        }
        assert_eq!(g.state, GraphState::Captured, "{kind:?}: {g:?}");
        eager.m.close().unwrap();
        replayed.m.close().unwrap();
    }
}

#[test]
fn a_replayed_cycle_keeps_the_memory_rules_and_says_what_it_stood_for() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _one = serial();
    let m = Manager::new_base_on(dev).unwrap().with_name("owner");
    let ws = m.workspace("steps", replaying()).unwrap();
    let x = m.randn([128, 64], DType::F32).unwrap();
    ndscope::start_recording(ndscope::RecordOptions::default()).unwrap();
    let mut kept = None;
    for _ in 0..5 {
        ws.cycle(|_| {
            let y = x.relu()?.mul_scalar(2.0)?;
            kept = Some(y);
            Ok(())
        })
        .unwrap();
    }
    let recording = ndscope::stop_recording().unwrap();
    // An array of a replayed cycle is closed with it, as in an eager cycle.
    let err = kept.unwrap().to_vec::<f32>().unwrap_err();
    assert!(matches!(err, ndscope::Error::ArrayClosed { .. }), "{err}");
    // The timeline names what each replayed cycle stood for: cycles 3 to 5.
    let replayed: Vec<&str> = recording
        .events()
        .iter()
        .filter_map(|e| e.replayed())
        .collect();
    assert_eq!(
        replayed,
        vec!["1 graph launch for 2 calls: relu, mul_scalar"; 3],
        "{replayed:?}"
    );
    let dump = m.debug_dump(0);
    assert!(
        dump.contains(
            "graph replay [captured, 2 calls in 1 graph(s), 1 captures, 3 replays, 0 fallbacks"
        ),
        "{dump}"
    );
    // Nothing but the block: no allocation per replayed cycle.
    let before = ndscope::memory_usage(dev);
    ws.cycle(|_| x.relu()?.mul_scalar(2.0).map(|_| ())).unwrap();
    let after = ndscope::memory_usage(dev);
    assert_eq!(before.in_use, after.in_use);
    // Destroying the workspace destroys its graph; the figures stay readable.
    ws.destroy().unwrap();
    assert_eq!(ws.stats().graph.replays, 4);
    m.close().unwrap();
}

#[test]
fn replay_is_off_on_the_cpu_and_by_default() {
    let m = Manager::new_base();
    let ws = m.workspace("cpu", replaying()).unwrap();
    let x = m.ones([4, 4], DType::F32).unwrap();
    for _ in 0..4 {
        ws.cycle(|_| x.add(&x).map(|_| ())).unwrap();
    }
    assert_eq!(ws.stats().graph, ndscope::GraphReplayStats::default());
    assert!(!WorkspaceConfig::default().graph_replay());
    assert!(!m.debug_dump(0).contains("graph replay"));
    m.close().unwrap();
}
