//! `ParallelTrainer`: data-parallel training over several CUDA devices with NCCL. Replicas stay
//! bit-identical; N devices give what 1 device gives on the whole batch; a failing replica gives
//! an error naming it and changes nothing; learned steps allocate nothing on any device; bad
//! input is refused. The GPU tests need at least 2 devices (the simulator: `CUDASIM_DEVICES=4`)
//! and skip with the reason otherwise (a failure under `NDSCOPE_REQUIRE_DEVICES=N` for a test
//! that needs N or fewer; no GPU at all fails under `NDSCOPE_REQUIRE_GPU=1`).

mod common;
#[path = "../examples/mlp/mod.rs"]
mod mlp;

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mlp::Mlp;
use ndscope::{
    gradient_collector, Adam, Device, Error, Manager, NDArray, Optimizer, OptimizerKind,
    ParallelTrainer, Sgd, WorkspaceConfig,
};

const SIZES: [usize; 4] = [32, 64, 64, 10];

/// The tests share the devices and read process-wide counters: one at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first `n` CUDA devices, or `None` after printing why the test skips. No GPU at all under
/// `NDSCOPE_REQUIRE_GPU=1` fails (`common::cuda_device`); fewer than `n` devices fails when
/// `NDSCOPE_REQUIRE_DEVICES` is `n` or more (the GPU suite runs with one device by default, where
/// these tests skip).
fn devices(n: usize) -> Option<Vec<Device>> {
    common::cuda_device()?;
    let count = Device::cuda_count();
    if count < n {
        let required: usize = std::env::var("NDSCOPE_REQUIRE_DEVICES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if required >= n {
            panic!(
                "NDSCOPE_REQUIRE_DEVICES={required}, but this test needs {n} CUDA devices and \
                 there are {count}"
            );
        }
        println!("skipped: needs {n} CUDA devices, this machine has {count}");
        return None;
    }
    Some((0..n).map(Device::Cuda).collect())
}

/// The source parameters of the MLP (seeded), on the CPU.
fn source(m: &Manager) -> Vec<NDArray> {
    ndscope::manual_seed(7);
    Mlp::with_gradients(m, &SIZES)
        .expect("mlp")
        .parameters()
        .into_vec()
}

fn model(params: &[NDArray]) -> ndscope::Result<Mlp> {
    Ok(Mlp::from_parameters(params, SIZES[3]))
}

/// 0: no failure; 1: the step closure fails on cuda:1; 2: it panics there; 3: it stops
/// answering there (until `RELEASE`); 4: it leaks an array into its replica's manager there.
static FAIL: AtomicU8 = AtomicU8::new(0);
/// Ends the hang of `FAIL` 3.
static RELEASE: AtomicBool = AtomicBool::new(false);
/// Set when a hung step closure has returned.
static RETURNED: AtomicBool = AtomicBool::new(false);

fn step(net: &Mlp, x: &NDArray, y: &NDArray) -> ndscope::Result<NDArray> {
    if x.device() == Device::Cuda(1) {
        match FAIL.load(Ordering::SeqCst) {
            // An injected failure: a reshape that cannot be.
            1 => return x.reshape([3, 1000]),
            2 => panic!("an injected panic"),
            3 => {
                let start = Instant::now();
                while !RELEASE.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(60) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                RETURNED.store(true, Ordering::SeqCst);
                return Mlp::loss(&net.logits(x)?, y);
            }
            4 => {
                // A leak: an array made in the (capped) replica manager a weight lives in.
                let replica = net.layers[0].w.manager()?;
                std::mem::forget(replica.zeros([4], ndscope::DType::F32)?);
            }
            _ => {}
        }
    }
    Mlp::loss(&net.logits(x)?, y)
}

/// `count` batches of `rows` rows, on the CPU.
fn batches(m: &Manager, count: usize, rows: usize) -> Vec<(NDArray, NDArray)> {
    ndscope::manual_seed(11);
    (0..count)
        .map(|_| mlp::make_data(m, rows, SIZES[0], SIZES[3], 2, 2.0).expect("data"))
        .collect()
}

fn trainer(devs: &[Device], src: &[NDArray], kind: OptimizerKind) -> ParallelTrainer {
    ParallelTrainer::builder()
        .name("dp")
        .devices(devs)
        .optimizer(kind)
        .build(src, model, step)
        .expect("a trainer")
}

fn bits(a: &NDArray) -> Vec<u32> {
    a.to_vec::<f32>()
        .expect("read")
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

fn snapshot(t: &ParallelTrainer, rank: usize) -> Vec<Vec<u32>> {
    t.parameters(rank).expect("rank").iter().map(bits).collect()
}

fn assert_identical(t: &ParallelTrainer) {
    let first = snapshot(t, 0);
    for rank in 1..t.replicas() {
        assert!(
            snapshot(t, rank) == first,
            "replica {rank} differs from replica 0"
        );
    }
}

fn in_use(devs: &[Device]) -> Vec<(usize, usize)> {
    devs.iter()
        .map(|&d| {
            let u = ndscope::memory_usage(d);
            (u.in_use, u.arrays)
        })
        .collect()
}

fn momentum() -> OptimizerKind {
    Sgd {
        momentum: 0.9,
        ..Sgd::new(0.05)
    }
    .into()
}

#[test]
fn replicas_stay_bit_identical() {
    let _serial = serial();
    let n = Device::cuda_count().clamp(2, 4);
    let Some(devs) = devices(n) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    // 17 rows: uneven shards on 2 and 4 devices.
    let data = batches(&host, 4, 17);
    let before = in_use(&devs);
    for kind in [momentum(), Adam::new(1e-3).into()] {
        let mut t = trainer(&devs, &src, kind);
        let mut first = None;
        let mut last = 0.0;
        for i in 0..20 {
            let (x, y) = &data[i % data.len()];
            let s = t.step(x, y).expect("step");
            assert!(s.loss.is_finite());
            assert_eq!(s.rows.iter().sum::<usize>(), 17);
            first.get_or_insert(s.loss);
            last = s.loss;
        }
        assert!(
            last < first.unwrap_or(f32::MAX),
            "{kind:?}: loss did not fall"
        );
        assert_identical(&t);
        assert_eq!(t.stats().steps, 20);
        let dump = t.debug_dump(0);
        assert!(
            dump.contains("replica-1") && dump.contains("steps-1"),
            "{dump}"
        );
        t.close().expect("close");
        assert_eq!(
            in_use(&devs),
            before,
            "memory left on the devices after close"
        );
    }
    host.close().expect("close");
}

/// Plain 1-device training on the whole batch with the same optimizer.
fn reference(
    dev: Device,
    src: &[NDArray],
    kind: OptimizerKind,
    data: &[(NDArray, NDArray)],
    steps: usize,
) -> Vec<Vec<f32>> {
    let m = Manager::new_base_on(dev).expect("manager");
    let params: Vec<NDArray> = src
        .iter()
        .map(|p| {
            let c = p.to_device(dev).expect("copy");
            c.attach(&m).expect("attach");
            c.set_requires_gradient(true).expect("grad");
            c
        })
        .collect();
    let net = model(&params).expect("model");
    let mut opt = Optimizer::new(&params, kind).expect("optimizer");
    let ws = m
        .workspace("step", WorkspaceConfig::default())
        .expect("workspace");
    for i in 0..steps {
        let (x, y) = &data[i % data.len()];
        ws.cycle(|_| {
            let x = x.to_device(dev)?;
            let y = y.to_device(dev)?;
            let collector = gradient_collector()?;
            let loss = step(&net, &x, &y)?;
            collector.backward(&loss)?;
            collector.close();
            opt.step()
        })
        .expect("reference step");
    }
    let out = params
        .iter()
        .map(|p| p.to_vec::<f32>().expect("read"))
        .collect();
    opt.close();
    m.close().expect("close");
    out
}

fn equivalence(n: usize) {
    let _serial = serial();
    let Some(devs) = devices(n) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    // 18 rows: 9 + 9 on 2 devices, 5 + 5 + 4 + 4 on 4.
    let data = batches(&host, 3, 18);
    for kind in [momentum(), Adam::new(1e-3).into()] {
        let mut t = trainer(&devs, &src, kind);
        for i in 0..6 {
            let (x, y) = &data[i % data.len()];
            t.step(x, y).expect("step");
        }
        let got: Vec<Vec<f32>> = t
            .parameters(0)
            .expect("rank 0")
            .iter()
            .map(|p| p.to_vec::<f32>().expect("read"))
            .collect();
        t.close().expect("close");
        let want = reference(devs[0], &src, kind, &data, 6);
        let mut worst = 0.0f32;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            let err = (g - w).abs() / w.abs().max(1e-2);
            worst = worst.max(err);
        }
        println!("{n} devices, {kind:?}: largest relative difference {worst:e}");
        assert!(worst < 1e-5, "{n} devices vs 1, {kind:?}: {worst:e}");
    }
    host.close().expect("close");
}

#[test]
fn one_device_trainer_matches_plain_training() {
    equivalence(1);
}

#[test]
fn two_devices_match_one() {
    equivalence(2);
}

#[test]
fn four_devices_match_one() {
    equivalence(4);
}

#[test]
fn a_failing_replica_is_named_and_changes_nothing() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 2, 16);
    let before = in_use(&devs);
    let mut t = trainer(&devs, &src, momentum());
    for i in 0..3 {
        let (x, y) = &data[i % 2];
        t.step(x, y).expect("step");
    }
    for (mode, panicked) in [(1, false), (2, true)] {
        let params = snapshot(&t, 0);
        FAIL.store(mode, Ordering::SeqCst);
        let result = t.step(&data[0].0, &data[0].1);
        FAIL.store(0, Ordering::SeqCst);
        match result {
            Err(Error::ReplicaFailed {
                device,
                rank,
                after_all_reduce,
                source,
                ..
            }) => {
                assert_eq!(
                    (device, rank, after_all_reduce),
                    (Device::Cuda(1), 1, false)
                );
                assert_eq!(
                    matches!(*source, Error::Panicked { .. }),
                    panicked,
                    "{source}"
                );
            }
            other => panic!("expected ReplicaFailed on cuda:1, got {other:?}"),
        }
        assert!(snapshot(&t, 0) == params, "a failed step changed replica 0");
        // Every replica dropped the failed step's gradients (the next step starts from zero).
        for rank in 0..t.replicas() {
            for p in t.parameters(rank).expect("rank") {
                let g = p
                    .gradient()
                    .expect("gradient")
                    .to_vec::<f32>()
                    .expect("read");
                assert!(g.iter().all(|&v| v == 0.0), "rank {rank} kept a gradient");
            }
        }
        assert_identical(&t);
        // The trainer goes on.
        t.step(&data[1].0, &data[1].1)
            .expect("a step after the failure");
        assert_identical(&t);
    }
    let stats = t.stats();
    assert_eq!((stats.steps, stats.failed, stats.broken), (5, 2, false));
    t.close().expect("close");
    assert!(t.step(&data[0].0, &data[0].1).is_err());
    assert_eq!(
        in_use(&devs),
        before,
        "memory left on the devices after close"
    );
    host.close().expect("close");
}

#[test]
fn learned_steps_allocate_nothing_on_any_device() {
    let _serial = serial();
    let n = Device::cuda_count().clamp(2, 4);
    let Some(devs) = devices(n) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 2, 16);
    let mut t = trainer(&devs, &src, Adam::new(1e-3).into());
    for i in 0..3 {
        t.step(&data[i % 2].0, &data[i % 2].1).expect("warm-up");
    }
    let count = |d: Device| {
        let u = ndscope::memory_usage(d);
        (u.driver_allocations, u.spills, u.reallocations)
    };
    let before: Vec<_> = devs.iter().map(|&d| count(d)).collect();
    let sim_before = common::sim::stats();
    let steps = 5u64;
    for i in 0..steps as usize {
        t.step(&data[i % 2].0, &data[i % 2].1).expect("step");
    }
    let after: Vec<_> = devs.iter().map(|&d| count(d)).collect();
    assert_eq!(before, after, "learned steps allocated on a device");
    let stats = t.stats();
    println!(
        "per step and device: {} bucket(s), {} all-reduces, {} bytes",
        stats.buckets, stats.collectives_per_step, stats.bytes_per_step
    );
    assert_eq!(stats.collectives_per_step, 6);
    assert_eq!(stats.bytes_per_step, 6922 * 4);
    if let (Some(b), Some(a)) = (sim_before, common::sim::stats()) {
        let d = |k: &str| a.get(k).copied().unwrap_or(0) - b.get(k).copied().unwrap_or(0);
        println!(
            "simulator, {steps} steps on {n} devices: nccl_collectives {} nccl_bytes {} \
             launches {} cublas {} blocking_syncs {}",
            d("nccl_collectives"),
            d("nccl_bytes"),
            d("launches"),
            d("cublas"),
            d("blocking_syncs")
        );
        assert_eq!(d("nccl_collectives"), steps * n as u64 * 6);
        assert_eq!(d("nccl_bytes"), steps * n as u64 * 6922 * 4);
    }
    t.close().expect("close");
    host.close().expect("close");
}

#[test]
fn bad_devices_are_refused() {
    let _serial = serial();
    let host = Manager::new_base();
    let src = source(&host);
    let build = |devs: &[Device]| {
        ParallelTrainer::builder()
            .devices(devs)
            .build(&src, model, step)
    };
    for devs in [
        vec![],
        vec![Device::Cpu],
        vec![Device::Cuda(0), Device::Cpu],
        vec![Device::Cuda(0), Device::Cuda(0)],
    ] {
        match build(&devs) {
            Err(Error::InvalidArgument { reason, .. }) => println!("{devs:?}: {reason}"),
            Err(Error::DeviceUnavailable { .. }) if devs.len() > 1 => {}
            other => panic!("{devs:?}: expected InvalidArgument, got {other:?}"),
        }
    }
    let replay = WorkspaceConfig::builder()
        .graph_replay(true)
        .build()
        .expect("config");
    let refused = ParallelTrainer::builder()
        .devices(&[Device::Cuda(0), Device::Cuda(1)])
        .workspace(replay)
        .build(&src, model, step);
    assert!(
        matches!(
            refused,
            Err(Error::InvalidConfig { .. } | Error::DeviceUnavailable { .. })
        ),
        "{refused:?}"
    );
    host.close().expect("close");
}

#[test]
fn bad_batches_are_refused_and_change_nothing() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 1, 16);
    let mut t = trainer(&devs, &src, momentum());
    t.step(&data[0].0, &data[0].1).expect("step");
    let params = snapshot(&t, 0);
    let (x, y) = &data[0];
    let one_row = (
        x.narrow(0, 0, 1).expect("narrow"),
        y.narrow(0, 0, 1).expect("narrow"),
    );
    let scalar = host.scalar(1.0f32).expect("scalar");
    let cases = [
        ("a batch of 1 row on 2 devices", &one_row.0, &one_row.1),
        ("16 inputs, 1 label", x, &one_row.1),
        ("a 0-d input", &scalar, y),
    ];
    for (what, x, y) in cases {
        match t.step(x, y) {
            Err(Error::InvalidArgument { reason, .. }) => println!("{what}: {reason}"),
            other => panic!("{what}: expected InvalidArgument, got {other:?}"),
        }
    }
    assert!(
        snapshot(&t, 0) == params,
        "a refused step changed the parameters"
    );
    assert_eq!(t.stats().steps, 1);
    t.step(x, y).expect("a good step after the refusals");
    assert!(t.parameters(2).is_err());
    t.close().expect("close");
    host.close().expect("close");
}

#[test]
fn a_failing_model_closure_is_named_and_frees_everything() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let before = in_use(&devs);
    for panics in [false, true] {
        let built = ParallelTrainer::builder().devices(&devs).build(
            &src,
            move |p: &[NDArray]| {
                if p[0].device() == Device::Cuda(1) {
                    if panics {
                        panic!("an injected panic in the model closure");
                    }
                    // An injected failure: a reshape that cannot be.
                    p[0].reshape([3, 1000])?;
                }
                model(p)
            },
            step,
        );
        match built {
            Err(Error::ReplicaFailed {
                device,
                rank,
                source,
                ..
            }) => {
                assert_eq!((device, rank), (Device::Cuda(1), 1));
                assert_eq!(
                    matches!(*source, Error::Panicked { .. }),
                    panics,
                    "{source}"
                );
            }
            other => panic!("expected ReplicaFailed on cuda:1, got {other:?}"),
        }
        assert_eq!(in_use(&devs), before, "memory left after a failed build");
    }
    // A model closure that does not return fails the build after the timeout.
    let timeout = Duration::from_millis(1500);
    let release = std::sync::Arc::new(AtomicBool::new(false));
    let released = std::sync::Arc::clone(&release);
    let start = Instant::now();
    let built = ParallelTrainer::builder()
        .devices(&devs)
        .timeout(timeout)
        .build(
            &src,
            move |p: &[NDArray]| {
                if p[0].device() == Device::Cuda(1) {
                    let start = Instant::now();
                    while !released.load(Ordering::SeqCst)
                        && start.elapsed() < Duration::from_secs(60)
                    {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                model(p)
            },
            step,
        );
    let took = start.elapsed();
    match built {
        Err(Error::ReplicaFailed {
            device,
            rank,
            source,
            ..
        }) => {
            assert_eq!((device, rank), (Device::Cuda(1), 1));
            assert!(matches!(*source, Error::TimedOut { .. }), "{source}");
        }
        other => panic!("expected ReplicaFailed on cuda:1, got {other:?}"),
    }
    assert!(took >= timeout && took < timeout * 4, "took {took:?}");
    assert_eq!(in_use(&devs), before, "memory left after a timed-out build");
    release.store(true, Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(in_use(&devs), before);
    assert!(matches!(
        ParallelTrainer::builder()
            .devices(&devs)
            .timeout(Duration::ZERO)
            .build(&src, model, step),
        Err(Error::InvalidConfig { .. })
    ));
    host.close().expect("close");
}

#[test]
fn small_buckets_give_the_same_bits() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 2, 16);
    let run = |bucket: Option<usize>| {
        let mut b = ParallelTrainer::builder()
            .devices(&devs)
            .optimizer(Adam::new(1e-3));
        if let Some(bytes) = bucket {
            b = b.bucket_bytes(bytes);
        }
        let mut t = b.build(&src, model, step).expect("trainer");
        for i in 0..4 {
            t.step(&data[i % 2].0, &data[i % 2].1).expect("step");
        }
        let out = (t.stats().buckets, snapshot(&t, 0));
        assert_identical(&t);
        t.close().expect("close");
        out
    };
    let (one, whole) = run(None);
    // From the last parameter back: [b3, w3, b2] (2,856 bytes), [w2] (16 KiB), [b1], [w1].
    let (several, split) = run(Some(4096));
    println!("buckets: {one} by default, {several} of at most 4 KiB");
    assert_eq!(one, 1);
    assert_eq!(several, 4);
    assert!(whole == split, "bucketing changed the result");
    host.close().expect("close");
}

#[test]
fn a_replica_that_stops_answering_is_named_after_the_timeout() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 2, 16);
    let before = in_use(&devs);
    let timeout = Duration::from_millis(1500);
    let mut t = ParallelTrainer::builder()
        .name("dp")
        .devices(&devs)
        .optimizer(momentum())
        .timeout(timeout)
        .build(&src, model, step)
        .expect("a trainer");
    t.step(&data[0].0, &data[0].1).expect("step");
    RELEASE.store(false, Ordering::SeqCst);
    RETURNED.store(false, Ordering::SeqCst);
    FAIL.store(3, Ordering::SeqCst);
    let start = Instant::now();
    let result = t.step(&data[1].0, &data[1].1);
    let took = start.elapsed();
    FAIL.store(0, Ordering::SeqCst);
    match result {
        Err(Error::ReplicaFailed {
            device,
            rank,
            step,
            after_all_reduce,
            source,
            ..
        }) => {
            assert_eq!(
                (device, rank, step, after_all_reduce),
                (Device::Cuda(1), 1, 1, false)
            );
            match *source {
                Error::TimedOut {
                    ref what, waited, ..
                } => {
                    assert_eq!(waited, timeout);
                    assert!(
                        what.contains("step closure") && what.contains("cuda:1"),
                        "{what}"
                    );
                }
                ref other => panic!("expected TimedOut, got {other}"),
            }
        }
        other => panic!("expected ReplicaFailed on cuda:1, got {other:?}"),
    }
    assert!(took >= timeout && took < timeout * 4, "took {took:?}");
    let stats = t.stats();
    assert_eq!((stats.steps, stats.failed, stats.broken), (1, 1, true));
    assert!(matches!(
        t.step(&data[0].0, &data[0].1),
        Err(Error::ShutDown { .. })
    ));
    // Closing does not wait for the thread still in the closure, and frees everything.
    let closing = Instant::now();
    t.close().expect("close");
    assert!(
        closing.elapsed() < timeout,
        "close waited for the hung thread"
    );
    assert!(!RETURNED.load(Ordering::SeqCst));
    assert_eq!(
        in_use(&devs),
        before,
        "memory left on the devices after close"
    );
    // The closure returns at last (its arrays closed meanwhile): its thread ends on its own.
    RELEASE.store(true, Ordering::SeqCst);
    let start = Instant::now();
    while !RETURNED.load(Ordering::SeqCst) && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(RETURNED.load(Ordering::SeqCst));
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(in_use(&devs), before);
    host.close().expect("close");
}

#[test]
fn caps_and_growth_checks_hold_on_every_device() {
    let _serial = serial();
    let Some(devs) = devices(2) else { return };
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 2, 16);
    let before = in_use(&devs);
    let mut t = trainer(&devs, &src, momentum());
    // The trainer's subtree (every replica on every device) does not grow over learned steps.
    let root = t.manager().clone();
    ndscope::testing::assert_no_growth(&root, 2, 5, |i| {
        t.step(&data[i % 2].0, &data[i % 2].1).map(|_| ())
    });
    // Every device's replica (capped) and step manager (with its workspace) is in the report.
    let report = t.report();
    for d in &devs {
        let on: Vec<_> = report.children.iter().filter(|c| c.device == *d).collect();
        assert_eq!(on.len(), 2, "{d}: {report:?}");
        assert_eq!(on.iter().filter(|c| c.capped).count(), 1, "{d}");
        assert_eq!(
            on.iter().map(|c| c.workspaces.len()).sum::<usize>(),
            1,
            "{d}"
        );
    }
    // A step that leaks into a replica's manager is refused there (`Capped`), on that device,
    // and changes nothing.
    let params = snapshot(&t, 0);
    FAIL.store(4, Ordering::SeqCst);
    let result = t.step(&data[0].0, &data[0].1);
    FAIL.store(0, Ordering::SeqCst);
    match result {
        Err(Error::ReplicaFailed { device, source, .. }) => {
            assert_eq!(device, Device::Cuda(1));
            assert!(matches!(*source, Error::Capped { .. }), "{source}");
        }
        other => panic!("expected ReplicaFailed(Capped) on cuda:1, got {other:?}"),
    }
    assert!(
        snapshot(&t, 0) == params,
        "a refused step changed replica 0"
    );
    assert_identical(&t);
    t.step(&data[1].0, &data[1].1)
        .expect("a step after the refusal");
    t.close().expect("close");
    assert_eq!(in_use(&devs), before, "memory left after close");
    host.close().expect("close");
}

/// Set in the child run of the test below, where NCCL seems to take device memory.
const PRETEND_CHILD: &str = "NDSCOPE_TEST_COMM_MEMORY_CHILD";
/// What each communicator seems to take there at its initialisation and at its first
/// collective (`NDSCOPE_CUDA_PRETEND=nccl_init=...,nccl_connect=...`).
const INIT_BYTES: usize = 48 << 20;
const CONNECT_BYTES: usize = 16 << 20;

/// The NCCL communicators' own device memory is in `memory_usage(dev).cached` while the trainer
/// lives (`release_cached` does not give it back) and goes back when it is closed. The
/// simulated NCCL takes no device memory (a GPU's takes some), so the test runs again in a
/// child process where each communicator seems to take `INIT_BYTES` at its initialisation and
/// `CONNECT_BYTES` at its first collective.
#[test]
fn communicators_memory_is_cached_while_they_live_and_given_back_on_close() {
    let _serial = serial();
    let n = Device::cuda_count().clamp(2, 4);
    let Some(devs) = devices(n) else { return };
    let pretended = std::env::var_os(PRETEND_CHILD).is_some();
    communicators_memory(&devs, pretended);
    if pretended {
        return;
    }
    let test = "communicators_memory_is_cached_while_they_live_and_given_back_on_close";
    let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(PRETEND_CHILD, "1")
        .env(
            "NDSCOPE_CUDA_PRETEND",
            format!("nccl_init={INIT_BYTES},nccl_connect={CONNECT_BYTES}"),
        )
        .output()
        .expect("the child run");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child run failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn communicators_memory(devs: &[Device], pretended: bool) {
    use ndscope::cuda::{communicator_bytes, release_cached};
    use ndscope::memory_usage;
    let exact = common::sim::stats().is_some();
    let host = Manager::new_base();
    let src = source(&host);
    let data = batches(&host, 1, 16);
    // Every device set up and its caches given back: what `cached` is without the trainer.
    let start: Vec<usize> = devs
        .iter()
        .map(|&d| {
            let m = Manager::new_base_on(d).expect("manager");
            m.zeros([64], ndscope::DType::F32).expect("zeros");
            m.close().expect("close");
            release_cached(d).expect("release");
            assert_eq!(communicator_bytes(d), 0, "{d}: no communicator yet");
            memory_usage(d).cached
        })
        .collect();
    let mut t = trainer(devs, &src, momentum());
    let at_init: Vec<usize> = devs.iter().map(|&d| communicator_bytes(d)).collect();
    t.step(&data[0].0, &data[0].1).expect("step");
    t.step(&data[0].0, &data[0].1).expect("step");
    for (i, &d) in devs.iter().enumerate() {
        let live = communicator_bytes(d);
        println!(
            "{d}: communicators {} bytes after init, {live} after 2 steps",
            at_init[i]
        );
        assert!(
            live >= at_init[i],
            "{d}: counted bytes never shrink while it lives"
        );
        if pretended {
            assert!(at_init[i] >= INIT_BYTES, "{d}: {} at init", at_init[i]);
            assert!(
                live >= INIT_BYTES + CONNECT_BYTES,
                "{d}: {live} once connected"
            );
            if exact {
                // The simulated NCCL takes nothing itself: exactly what it seemed to take.
                assert_eq!(at_init[i], INIT_BYTES, "{d}: at init");
                assert_eq!(live, INIT_BYTES + CONNECT_BYTES, "{d}: once connected");
            }
        }
        // Counted in `cached`, and not given back with the caches.
        release_cached(d).expect("release");
        let cached = memory_usage(d).cached;
        assert!(
            cached >= live,
            "{d}: cached {cached} < communicators' {live}"
        );
    }
    let live: Vec<usize> = devs.iter().map(|&d| communicator_bytes(d)).collect();
    t.close().expect("close");
    for (i, &d) in devs.iter().enumerate() {
        assert_eq!(communicator_bytes(d), 0, "{d}: given back on close");
        release_cached(d).expect("release");
        let end = memory_usage(d).cached;
        assert!(
            end.saturating_sub(start[i]) < live[i].max(1),
            "{d}: cached {end} after close, {} before the trainer: the communicators' {} \
             bytes stayed",
            start[i],
            live[i]
        );
    }
    host.close().expect("close");
}
