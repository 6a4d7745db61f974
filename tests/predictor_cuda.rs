//! Inference on a GPU served from host data: a `Predictor` and a `ParallelInference` over a
//! model whose parameters live on a CUDA device, request and answer in host memory. Their answers
//! match the same model on the CPU; after the first calls a call copies once each way, waits
//! once, and allocates nothing (counted by the simulated GPU, `tests/common/sim.rs`; on a real
//! GPU that part is skipped); closing frees every byte. Without a GPU each test says why it
//! skipped (`common::cuda_device`).

mod common;

use std::sync::Mutex;

use common::sim;
use ndscope::{
    memory_usage, Device, Error, HostArray, InferenceMode, Manager, NDArray, ParallelInference,
    Predictor, Result, ShutdownMode,
};

/// The simulator's counters and the device's memory figures are process-wide: the tests take
/// turns, so that no other test's work lands between two readings.
static TURN: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

const SIZES: [usize; 3] = [8, 16, 4];

/// The parameters of a two-layer MLP, `[w1, b1, w2, b2]`, as host data (the same on every
/// device).
fn parameters() -> Vec<HostArray> {
    let mut out = Vec::new();
    for (i, pair) in SIZES.windows(2).enumerate() {
        let (k, n) = (pair[0], pair[1]);
        let w = common::values(k * n, 11 + i as u64, 9)
            .into_iter()
            .map(|v| v as f32 * 0.1)
            .collect();
        let b = common::values(n, 21 + i as u64, 5)
            .into_iter()
            .map(|v| v as f32 * 0.05)
            .collect();
        out.push(HostArray::from_vec(w, [k, n]).unwrap());
        out.push(HostArray::from_vec(b, [n]).unwrap());
    }
    out
}

/// A model manager on `dev` holding the parameters.
fn model_on(dev: Device) -> (Manager, Vec<NDArray>) {
    let m = Manager::new_base_on(dev).unwrap().with_name("model");
    let params = parameters()
        .iter()
        .map(|p| m.from_host(p).unwrap())
        .collect();
    (m, params)
}

/// `relu(x · w1 + b1) · w2 + b2`, every temporary in the active scope.
fn forward(p: &[NDArray], x: &NDArray) -> Result<NDArray> {
    x.matmul(&p[0])?
        .add(&p[1])?
        .relu()?
        .matmul(&p[2])?
        .add(&p[3])
}

fn predictor(model: &Manager, p: Vec<NDArray>) -> Predictor<HostArray, HostArray> {
    Predictor::new(model, move |ctx: &Manager, x: &HostArray| {
        forward(&p, &ctx.from_host(x)?)?.to_host()
    })
    .unwrap()
}

fn request(seed: u64, rows: usize) -> HostArray {
    let v = common::values(rows * SIZES[0], seed, 20)
        .into_iter()
        .map(|v| v as f32 * 0.1)
        .collect();
    HostArray::from_vec(v, [rows, SIZES[0]]).unwrap()
}

fn assert_close(got: &HostArray, want: &HostArray, what: &str) {
    assert_eq!(got.dims(), want.dims(), "{what}");
    let (g, w) = (
        got.as_slice::<f32>().unwrap(),
        want.as_slice::<f32>().unwrap(),
    );
    for (i, (a, b)) in g.iter().zip(w).enumerate() {
        assert!(
            (a - b).abs() <= 1e-4 * (1.0 + b.abs()),
            "{what}: element {i} is {a} on the GPU, {b} on the CPU"
        );
    }
}

/// The counters that say what `calls` calls cost: each must be a copy in, a copy out and the
/// one wait for the answer, with no allocation.
fn assert_one_copy_each_way(d: &std::collections::HashMap<String, u64>, calls: u64) {
    let all = sim::calls(d);
    for name in ["allocs", "async_allocs", "host_allocs"] {
        assert_eq!(d[name], 0, "{name} in {calls} learned calls: {all:?}");
    }
    assert_eq!(d["h2d"], calls, "one copy in per call: {all:?}");
    assert_eq!(d["d2h"], calls, "one copy out per call: {all:?}");
    assert_eq!(
        d["blocking_syncs"], calls,
        "one wait per call, for the answer: {all:?}"
    );
}

#[test]
fn a_cuda_predictor_matches_the_cpu_model_and_a_learned_call_copies_once_each_way() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _turn = turn();
    let (cpu_model, cpu_params) = model_on(Device::Cpu);
    let cpu = predictor(&cpu_model, cpu_params);
    let (model, params) = model_on(dev);
    let held = memory_usage(dev).in_use;
    let gpu = predictor(&model, params);
    assert_eq!(gpu.device(), dev, "the contexts are on the model's device");
    for (seed, rows) in [(1, 1), (2, 3), (3, 1), (4, 64), (5, 1)] {
        let x = request(seed, rows);
        let want = cpu.predict(&x).unwrap();
        assert_close(&gpu.predict(&x).unwrap(), &want, &format!("{rows} rows"));
    }
    assert_eq!(gpu.contexts(), 1);

    // Learned from the first call (one row): calls of that size run in its block.
    let x = request(6, 1);
    let want = cpu.predict(&x).unwrap();
    let before = sim::stats();
    for _ in 0..10 {
        assert_close(&gpu.predict(&x).unwrap(), &want, "a learned call");
    }
    if let (Some(before), Some(after)) = (before, sim::stats()) {
        assert_one_copy_each_way(&sim::diff(&before, &after), 10);
    }
    let report = gpu.manager().report();
    assert_eq!(report.total_arrays(), 0, "nothing of a call survives it");
    assert_eq!(report.workspaces[0].stats.cycles, 15);

    assert!(
        memory_usage(dev).in_use > held,
        "the context's block is counted while the predictor is open"
    );
    gpu.close().unwrap();
    assert!(!gpu.manager().is_open());
    assert_eq!(
        memory_usage(dev).in_use,
        held,
        "closing the predictor frees its contexts: only the parameters stay"
    );
    assert!(gpu.predict(&x).is_err(), "a closed predictor refuses calls");
    drop(gpu);
    model.close().unwrap();
    assert_eq!(model.report().total_arrays(), 0);
    drop(cpu);
    cpu_model.close().unwrap();
}

#[test]
fn parameters_moved_to_the_gpu_are_served_with_the_device_option() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _turn = turn();
    // A CPU manager holding CUDA arrays: the contexts must be told the device.
    let model = Manager::new_base().with_name("model");
    let params: Vec<NDArray> = parameters()
        .iter()
        .map(|p| model.from_host(p).unwrap().to_device(dev).unwrap())
        .collect();
    let host = parameters();
    let x = request(7, 2);
    let reference = {
        let cpu = Manager::new_base();
        let p: Vec<NDArray> = host.iter().map(|h| cpu.from_host(h).unwrap()).collect();
        let y = forward(&p, &cpu.from_host(&x).unwrap())
            .unwrap()
            .to_host()
            .unwrap();
        cpu.close().unwrap();
        y
    };

    let on_cpu = predictor(&model, params.clone());
    assert_eq!(on_cpu.device(), Device::Cpu);
    let err = on_cpu.predict(&x).unwrap_err();
    assert!(matches!(err, Error::DeviceMismatch { .. }), "{err}");
    drop(on_cpu);

    let p = params.clone();
    let gpu = Predictor::builder(&model)
        .device(dev)
        .build(move |ctx: &Manager, x: &HostArray| forward(&p, &ctx.from_host(x)?)?.to_host())
        .unwrap();
    assert_eq!(gpu.device(), dev);
    assert_close(&gpu.predict(&x).unwrap(), &reference, "predictor");
    drop(gpu);

    let p = params;
    let service = ParallelInference::builder(&model)
        .workers(2)
        .device(dev)
        .build(move |_ctx, x| forward(&p, x))
        .unwrap();
    assert_eq!(service.device(), dev);
    assert_close(&service.predict(x).unwrap(), &reference, "service");
    service.shutdown(ShutdownMode::Drain).unwrap();
    model.close().unwrap();
}

#[test]
fn a_cuda_parallel_inference_matches_the_cpu_model_and_a_learned_request_copies_once_each_way() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _turn = turn();
    let (cpu_model, cpu_params) = model_on(Device::Cpu);
    let cpu = predictor(&cpu_model, cpu_params);
    let (model, params) = model_on(dev);
    let held = memory_usage(dev).in_use;

    // Several workers and clients, batched: every answer is the CPU's.
    let shared = params.clone();
    let service = ParallelInference::builder(&model)
        .workers(3)
        .mode(InferenceMode::Batched {
            max_requests: 4,
            max_wait: std::time::Duration::from_micros(200),
        })
        .build(move |_ctx, x| forward(&shared, x))
        .unwrap();
    assert_eq!(service.device(), dev);
    std::thread::scope(|s| {
        for c in 0..4u64 {
            let (service, cpu) = (&service, &cpu);
            s.spawn(move || {
                for i in 0..25 {
                    let x = request(100 * c + i, 1 + (i as usize % 3));
                    let want = cpu.predict(&x).unwrap();
                    let got = service.predict(x).unwrap();
                    assert_close(&got, &want, &format!("client {c} request {i}"));
                }
            });
        }
    });
    let stats = service.stats();
    assert_eq!((stats.completed, stats.failed), (100, 0));
    service.shutdown(ShutdownMode::Drain).unwrap();
    assert!(!service.manager().is_open());
    assert_eq!(
        memory_usage(dev).in_use,
        held,
        "the shutdown frees every worker"
    );
    drop(service);

    // One worker, so that the counted requests all go to the learned context.
    let service = ParallelInference::builder(&model)
        .workers(1)
        .build(move |_ctx, x| forward(&params, x))
        .unwrap();
    let x = request(9, 1);
    let want = cpu.predict(&x).unwrap();
    for _ in 0..3 {
        assert_close(&service.predict(x.clone()).unwrap(), &want, "warm-up");
    }
    let before = sim::stats();
    for _ in 0..10 {
        assert_close(
            &service.predict(x.clone()).unwrap(),
            &want,
            "a learned request",
        );
    }
    if let (Some(before), Some(after)) = (before, sim::stats()) {
        assert_one_copy_each_way(&sim::diff(&before, &after), 10);
    }
    service.shutdown(ShutdownMode::Drain).unwrap();
    assert_eq!(
        memory_usage(dev).in_use,
        held,
        "the shutdown frees the worker"
    );
    drop(service);
    model.close().unwrap();
    drop(cpu);
    cpu_model.close().unwrap();
}

#[test]
fn a_predictor_on_an_absent_device_is_refused_and_caps_nothing() {
    let model = Manager::new_base().with_name("model");
    let err = Predictor::builder(&model)
        .device(Device::Cuda(64))
        .build(|_ctx: &Manager, x: &u32| Ok(*x))
        .unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
    let err = ParallelInference::builder(&model)
        .device(Device::Cuda(64))
        .build(|_ctx, x| Ok(x.clone()))
        .unwrap_err();
    assert!(matches!(err, Error::DeviceUnavailable { .. }), "{err}");
    assert!(!model.is_capped(), "nothing changed");
    assert!(model.children().is_empty());
    model.close().unwrap();
}

/// A predictor whose context workspace replays its learned cycle as a CUDA graph
/// (`WorkspaceConfig::graph_replay`): the same answers as the eager GPU predictor, bit for bit,
/// and a learned call is one copy in, one graph launch, one copy out and one wait, with no
/// kernel launch or product from the host. A request of another size falls back (its answer
/// still right) and the next ones relearn.
#[test]
fn a_replayed_cuda_predictor_answers_as_the_eager_one_with_one_graph_launch_per_call() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _turn = turn();
    let (model, params) = model_on(dev);
    let eager = predictor(&model, params.clone());
    let p = params.clone();
    let replay = ndscope::WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .unwrap();
    let replayed = Predictor::builder(&model)
        .workspace(replay)
        .build(move |ctx: &Manager, x: &HostArray| forward(&p, &ctx.from_host(x)?)?.to_host())
        .unwrap();
    let same = |x: &HostArray, what: &str| {
        let (a, b) = (eager.predict(x).unwrap(), replayed.predict(x).unwrap());
        assert_eq!(
            a.as_slice::<f32>().unwrap(),
            b.as_slice::<f32>().unwrap(),
            "{what}"
        );
    };
    // Learn (1), record (2), replay.
    for seed in 0..4 {
        same(&request(30 + seed, 2), "a call of 2 rows");
    }
    let x = request(40, 2);
    let want = eager.predict(&x).unwrap();
    let before = sim::stats();
    for _ in 0..10 {
        let got = replayed.predict(&x).unwrap();
        assert_eq!(
            got.as_slice::<f32>().unwrap(),
            want.as_slice::<f32>().unwrap()
        );
    }
    if let (Some(before), Some(after)) = (before, sim::stats()) {
        let d = sim::diff(&before, &after);
        assert_one_copy_each_way(&d, 10);
        assert_eq!(d["graph_launches"], 10, "{:?}", sim::calls(&d));
        assert_eq!(d["launches"] + d["cublas"], 0, "{:?}", sim::calls(&d));
    }
    // Another size: that call falls back, the later ones of that size relearn and replay.
    for seed in 0..4 {
        same(&request(50 + seed, 5), "a call of 5 rows");
    }
    let stats = &replayed.manager().report().workspaces[0].stats.graph;
    assert_eq!(stats.fallbacks, 1, "{stats:?}");
    assert_eq!(stats.replays, 12 + 2, "{stats:?}");
    assert!(
        replayed.debug_dump(0).contains("graph replay [captured"),
        "{}",
        replayed.debug_dump(0)
    );
    drop((eager, replayed));
    model.close().unwrap();
}

/// Two workers of a service replaying their context cycles on one GPU at once: they read the
/// same parameters and write only their own workspaces, so neither makes the other fall back
/// (each op's locked arrays are checked against what the other's held calls use), and every
/// answer is the eager one.
#[test]
fn two_replaying_workers_on_one_gpu_do_not_make_each_other_fall_back() {
    let Some(dev) = common::cuda_device() else {
        return;
    };
    let _turn = turn();
    let (model, params) = model_on(dev);
    let eager = predictor(&model, params.clone());
    let shared = params.clone();
    let replay = ndscope::WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .unwrap();
    let service = ParallelInference::builder(&model)
        .workers(2)
        .workspace(replay)
        .build(move |_ctx, x| forward(&shared, x))
        .unwrap();
    let x = request(60, 3);
    let want = eager.predict(&x).unwrap();
    std::thread::scope(|s| {
        for _ in 0..4 {
            let (service, x, want) = (&service, &x, &want);
            s.spawn(move || {
                for _ in 0..40 {
                    let got = service.predict(x.clone()).unwrap();
                    assert_eq!(
                        got.as_slice::<f32>().unwrap(),
                        want.as_slice::<f32>().unwrap()
                    );
                }
            });
        }
    });
    let report = service.debug_dump(0);
    println!("{report}");
    let workers = model.report();
    let mut replays = 0;
    let mut fallbacks = 0;
    fn walk(r: &ndscope::ManagerReport, replays: &mut u64, fallbacks: &mut u64) {
        for ws in &r.workspaces {
            *replays += ws.stats.graph.replays;
            *fallbacks += ws.stats.graph.fallbacks;
        }
        for c in &r.children {
            walk(c, replays, fallbacks);
        }
    }
    walk(&workers, &mut replays, &mut fallbacks);
    assert_eq!(fallbacks, 0, "{report}");
    assert!(replays >= 150, "{replays} replays: {report}");
    service.shutdown(ShutdownMode::Drain).unwrap();
    drop(eager);
    model.close().unwrap();
}
