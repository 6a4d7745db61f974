//! Parallel inference: workers over shared parameters, batching, panics in the step, shutdown
//! with requests in flight, and memory that stays flat.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ndscope::{
    DType, Error, HostArray, InferenceMode, Manager, NDArray, ParallelInference, Predictor,
    ShutdownMode,
};

/// A model `y = relu(x · w) · v` with w `[8, 16]` and v `[16, 3]` of deterministic values.
fn model() -> (Manager, NDArray, NDArray) {
    let m = Manager::new_base().with_name("model");
    let wv: Vec<f32> = (0..8 * 16)
        .map(|i| ((i % 7) as f32 - 3.0) * 0.125)
        .collect();
    let vv: Vec<f32> = (0..16 * 3).map(|i| ((i % 5) as f32 - 2.0) * 0.25).collect();
    let w = m.from_vec(wv, [8, 16]).unwrap().with_name("w");
    let v = m.from_vec(vv, [16, 3]).unwrap().with_name("v");
    (m, w, v)
}

fn forward(w: &NDArray, v: &NDArray, x: &NDArray) -> ndscope::Result<NDArray> {
    x.matmul(w)?.relu()?.matmul(v)
}

fn request(seed: usize, rows: usize) -> HostArray {
    let data: Vec<f32> = (0..rows * 8)
        .map(|i| (((seed * 31 + i * 7) % 17) as f32 - 8.0) * 0.5)
        .collect();
    HostArray::from_vec(data, [rows, 8]).unwrap()
}

fn batched(max_requests: usize, wait_us: u64) -> InferenceMode {
    InferenceMode::Batched {
        max_requests,
        max_wait: Duration::from_micros(wait_us),
    }
}

#[test]
fn answers_from_many_client_threads_match_a_single_threaded_reference() {
    for mode in [InferenceMode::Sequential, batched(8, 300)] {
        let (model, w, v) = model();
        let reference = {
            let (w, v) = (w.clone(), v.clone());
            Predictor::new(&model, move |c: &Manager, x: &HostArray| {
                forward(&w, &v, &c.from_host(x)?)?.to_host()
            })
            .unwrap()
        };
        let service = ParallelInference::builder(&model)
            .workers(3)
            .mode(mode)
            .build(move |_c, x| forward(&w, &v, x))
            .unwrap();
        assert_eq!(service.workers(), 3);
        std::thread::scope(|s| {
            for c in 0..6 {
                let (service, reference) = (&service, &reference);
                s.spawn(move || {
                    for i in 0..60 {
                        let x = request(c * 1000 + i, 1 + i % 3);
                        let want = reference.predict(&x).unwrap();
                        let got = service.predict(x).unwrap();
                        // Small multiples of 1/8: exact in f32 whatever the batch.
                        assert_eq!(got, want, "mode {mode:?}, client {c}, request {i}");
                    }
                });
            }
        });
        let stats = service.stats();
        assert_eq!(stats.submitted, 360);
        assert_eq!(stats.completed, 360);
        assert_eq!(stats.failed + stats.refused + stats.panics, 0);
        if mode == InferenceMode::Sequential {
            assert_eq!(stats.batches, 360);
            assert_eq!(stats.largest_batch, 1);
        } else {
            assert!(stats.largest_batch <= 8);
        }
        let report = service.shutdown(ShutdownMode::Drain).unwrap();
        assert_eq!(report.refused, 0);
        drop(reference);
        model.close().unwrap();
    }
}

#[test]
fn batching_joins_up_to_the_limit_of_compatible_requests() {
    let (model, w, v) = model();
    let service = ParallelInference::builder(&model)
        .workers(1)
        .mode(batched(4, 200_000))
        .build(move |_c, x| forward(&w, &v, x))
        .unwrap();
    // Ten one-row requests queued at once: one worker joins them four at a time.
    let pending: Vec<_> = (0..10)
        .map(|i| service.submit(request(i, 1)).unwrap())
        .collect();
    let answers: Vec<HostArray> = pending.into_iter().map(|p| p.wait().unwrap()).collect();
    assert!(answers.iter().all(|a| a.dims() == [1, 3]));
    let stats = service.stats();
    assert_eq!(stats.largest_batch, 4);
    assert!(stats.batches <= 4, "{stats:?}");
    // Requests with other trailing dimensions are not joined with these.
    let odd = service
        .submit(HostArray::from_vec(vec![1.0f32; 9], [1, 9]).unwrap())
        .unwrap();
    let fine = service.submit(request(3, 2)).unwrap();
    assert!(matches!(odd.wait(), Err(Error::ShapeMismatch { .. })));
    assert_eq!(fine.wait().unwrap().dims(), &[2, 3]);
    drop(service);
    model.close().unwrap();
}

#[test]
fn a_lone_request_waits_at_most_the_batching_window() {
    let (model, w, v) = model();
    let service = ParallelInference::builder(&model)
        .workers(1)
        .mode(batched(64, 30_000))
        .build(move |_c, x| forward(&w, &v, x))
        .unwrap();
    let start = Instant::now();
    service.predict(request(1, 1)).unwrap();
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(30),
        "answered before the window closed: {took:?}"
    );
    assert_eq!(service.stats().largest_batch, 1);
    drop(service);
    model.close().unwrap();
}

#[test]
fn a_panicking_worker_answers_an_error_frees_its_memory_and_the_service_keeps_serving() {
    for mode in [InferenceMode::Sequential, batched(8, 2_000)] {
        let (model, w, v) = model();
        let service = ParallelInference::builder(&model)
            .workers(2)
            .mode(mode)
            .build(move |_c, x| {
                if x.to_vec::<f32>()?.contains(&999.0) {
                    panic!("poisoned request");
                }
                forward(&w, &v, x)
            })
            .unwrap();
        let workers_before: Vec<_> = service.manager().children();
        let mut poisoned = request(5, 1).into_vec::<f32>().unwrap();
        poisoned[3] = 999.0;
        let poisoned = HostArray::from_vec(poisoned, [1, 8]).unwrap();
        // The poisoned request among good ones, queued together so a batch may join them.
        let mut pending = Vec::new();
        for i in 0..12 {
            let x = if i == 6 {
                poisoned.clone()
            } else {
                request(i, 1)
            };
            pending.push((i, service.submit(x).unwrap()));
        }
        for (i, p) in pending {
            let answer = p.wait();
            if i == 6 {
                match answer {
                    Err(Error::Panicked { message, .. }) => assert_eq!(message, "poisoned request"),
                    other => panic!("expected Panicked, got {other:?}"),
                }
            } else {
                assert_eq!(answer.unwrap().dims(), &[1, 3], "request {i} in {mode:?}");
            }
        }
        let stats = service.stats();
        assert!(stats.panics >= 1, "{stats:?}");
        assert_eq!(
            stats.failed, 1,
            "only the poisoned request failed: {stats:?}"
        );
        // The panicking worker's predictor was closed and replaced.
        let workers_after = service.manager().children();
        assert_eq!(workers_after.len(), 2);
        let replaced: Vec<_> = workers_before.iter().filter(|m| !m.is_open()).collect();
        assert_eq!(replaced.len(), 1, "one worker's manager was closed");
        assert_eq!(service.manager().report().total_arrays(), 0);
        // And it goes on serving.
        for i in 0..20 {
            service.predict(request(100 + i, 2)).unwrap();
        }
        service.shutdown(ShutdownMode::Drain).unwrap();
        model.close().unwrap();
    }
}

#[test]
fn a_failing_request_in_a_batch_does_not_fail_its_neighbours() {
    let (model, w, v) = model();
    let service = ParallelInference::builder(&model)
        .workers(1)
        .mode(batched(8, 50_000))
        .build(move |_c, x| {
            if x.to_vec::<f32>()?.contains(&-999.0) {
                return Err(Error::InvalidArgument {
                    op: "forward",
                    at: std::panic::Location::caller(),
                    reason: "bad row".into(),
                });
            }
            forward(&w, &v, x)
        })
        .unwrap();
    let bad = HostArray::from_vec(vec![-999.0f32; 8], [1, 8]).unwrap();
    let pending: Vec<_> = (0..6)
        .map(|i| {
            service
                .submit(if i == 2 { bad.clone() } else { request(i, 1) })
                .unwrap()
        })
        .collect();
    for (i, p) in pending.into_iter().enumerate() {
        match (i, p.wait()) {
            (2, Err(Error::InvalidArgument { reason, .. })) => assert_eq!(reason, "bad row"),
            (2, other) => panic!("expected the forward's error, got {other:?}"),
            (_, answer) => assert!(answer.is_ok(), "request {i}: {answer:?}"),
        }
    }
    drop(service);
    model.close().unwrap();
}

/// A service whose forward blocks until the test lets it go, telling the test when it starts.
fn gated(model: &Manager) -> (ParallelInference, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let entered_tx = Mutex::new(entered_tx);
    let release_rx = Mutex::new(release_rx);
    let service = ParallelInference::builder(model)
        .workers(1)
        .build(move |_c, x| {
            let _ = entered_tx.lock().unwrap().send(());
            let _ = release_rx.lock().unwrap().recv();
            x.mul_scalar(2.0)
        })
        .unwrap();
    (service, entered, release)
}

#[test]
fn shutdown_refusing_finishes_the_request_in_flight_and_refuses_the_queued_ones() {
    let model = Manager::new_base();
    let (service, entered, release) = gated(&model);
    let first = service.submit(request(1, 1)).unwrap();
    entered.recv().unwrap(); // the worker is inside the forward pass with it
    let queued: Vec<_> = (0..4)
        .map(|i| service.submit(request(i, 1)).unwrap())
        .collect();
    let report = std::thread::scope(|s| {
        let stopping = s.spawn(|| service.shutdown(ShutdownMode::Refuse));
        // The queued requests are refused at once, while the first is still running.
        for p in queued {
            match p.wait() {
                Err(Error::ShutDown { service: name, .. }) => {
                    assert!(name.contains("parallel-inference"))
                }
                other => panic!("expected ShutDown, got {other:?}"),
            }
        }
        assert!(first.try_wait().is_none(), "still in flight");
        release.send(()).unwrap();
        stopping.join().unwrap().unwrap()
    });
    let answer = first.wait().unwrap();
    assert_eq!(
        answer.as_slice::<f32>().unwrap()[0],
        request(1, 1).as_slice::<f32>().unwrap()[0] * 2.0
    );
    assert_eq!(report.refused, 4);
    assert_eq!(report.finished, 1);
    assert!(!service.manager().is_open(), "the workers' memory is freed");
    assert!(model.children().is_empty());
    // Later requests are refused.
    let err = service.predict(request(9, 1)).unwrap_err();
    assert!(matches!(err, Error::ShutDown { .. }), "{err}");
    assert_eq!(
        service.shutdown(ShutdownMode::Drain).unwrap().refused,
        0,
        "idempotent"
    );
    model.close().unwrap();
}

#[test]
fn shutdown_draining_answers_every_queued_request() {
    let model = Manager::new_base();
    let (service, entered, release) = gated(&model);
    let first = service.submit(request(1, 1)).unwrap();
    entered.recv().unwrap();
    let queued: Vec<_> = (0..5)
        .map(|i| service.submit(request(i, 1)).unwrap())
        .collect();
    let report = std::thread::scope(|s| {
        let stopping = s.spawn(|| service.shutdown(ShutdownMode::Drain));
        for _ in 0..6 {
            release.send(()).unwrap();
        }
        stopping.join().unwrap().unwrap()
    });
    assert!(first.wait().is_ok());
    for p in queued {
        assert!(p.wait().is_ok());
    }
    assert_eq!(report.refused, 0);
    // Those answered after the shutdown began (the worker may finish some before it does).
    assert!(report.finished <= 6, "{report:?}");
    assert!(!service.manager().is_open());
    model.close().unwrap();
}

#[test]
fn dropping_the_service_refuses_what_is_queued() {
    let model = Manager::new_base();
    let (service, entered, release) = gated(&model);
    let first = service.submit(request(1, 1)).unwrap();
    entered.recv().unwrap();
    let queued = service.submit(request(2, 1)).unwrap();
    let dropper = std::thread::spawn(move || drop(service));
    assert!(matches!(queued.wait(), Err(Error::ShutDown { .. })));
    release.send(()).unwrap();
    dropper.join().unwrap();
    assert!(first.wait().is_ok());
    assert!(model.children().is_empty());
    model.close().unwrap();
}

#[test]
fn a_full_queue_makes_submitters_wait() {
    let model = Manager::new_base();
    let (entered_tx, entered) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let (entered_tx, release_rx) = (Mutex::new(entered_tx), Mutex::new(release_rx));
    let service = ParallelInference::builder(&model)
        .workers(1)
        .queue_limit(1)
        .build(move |_c, x| {
            let _ = entered_tx.lock().unwrap().send(());
            let _ = release_rx.lock().unwrap().recv();
            x.duplicate()
        })
        .unwrap();
    let a = service.submit(request(1, 1)).unwrap();
    entered.recv().unwrap(); // taken: the queue is empty again
    let b = service.submit(request(2, 1)).unwrap(); // the queue is full now
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    std::thread::scope(|s| {
        let waiting = s.spawn(|| {
            let c = service.submit(request(3, 1));
            done.store(true, std::sync::atomic::Ordering::SeqCst);
            c
        });
        std::thread::sleep(Duration::from_millis(50));
        assert!(
            !done.load(std::sync::atomic::Ordering::SeqCst),
            "waits for room"
        );
        assert_eq!(service.stats().queued, 1);
        for _ in 0..3 {
            release.send(()).unwrap();
        }
        let c = waiting.join().unwrap().unwrap();
        assert!(a.wait().is_ok() && b.wait().is_ok() && c.wait().is_ok());
    });
    drop(service);
    model.close().unwrap();
}

#[test]
fn workers_share_the_parameters_and_memory_stays_flat_under_load() {
    let m = Manager::new_base().with_name("big-model");
    let w = m.full([256, 1024], 0.001, DType::F32).unwrap(); // 1 MiB, shared
    let service = ParallelInference::builder(&m)
        .workers(4)
        .mode(batched(4, 100))
        .workspace(
            // A block that holds the largest batch (8 rows: about 45 KiB) from the start: with
            // a learned block, a worker that had not yet served a full batch would grow its
            // block later, which is learning, not a leak.
            ndscope::WorkspaceConfig::builder()
                .learning(ndscope::LearningPolicy::None)
                .initial_size(256 << 10)
                .spill(ndscope::SpillPolicy::Reallocate)
                .build()
                .unwrap(),
        )
        .build(move |_c, x| x.matmul(&w)?.sum(&[1], true))
        .unwrap();
    let load = |rounds: usize| {
        std::thread::scope(|s| {
            for c in 0..4 {
                let service = &service;
                s.spawn(move || {
                    for i in 0..rounds {
                        let x = HostArray::from_vec(vec![1.0f32; 256 * 2], [2, 256]).unwrap();
                        let y = service.predict(x).unwrap();
                        assert_eq!(y.dims(), &[2, 1], "client {c} request {i}");
                    }
                });
            }
        });
    };
    // (arrays, bytes, workers), and the capacity of each worker's context workspace. A worker
    // makes its context at its first request, which may come late under this load: a new context
    // is not growth, a context whose block grows or an array left behind would be.
    let footprint = || {
        let report = service.manager().report();
        let blocks: Vec<usize> = report
            .children
            .iter()
            .flat_map(|w| &w.workspaces)
            .map(|ws| ws.stats.capacity)
            .collect();
        (
            (
                report.total_arrays(),
                report.total_bytes(),
                report.children.len(),
            ),
            blocks,
        )
    };
    load(20);
    let (before, first_blocks) = footprint();
    load(200);
    let (after, blocks) = footprint();
    assert_eq!(before, after, "(arrays, bytes, workers) must not grow");
    let (arrays, _, workers) = after;
    assert_eq!(arrays, 0, "no worker holds an array between requests");
    assert_eq!(workers, 4);
    assert!(
        !first_blocks.is_empty() && blocks.len() <= workers,
        "one context per worker at most: {blocks:?}"
    );
    assert!(
        blocks.iter().all(|&b| b == first_blocks[0]),
        "no context's block grew (each holds the largest batch from the start): {first_blocks:?} then {blocks:?}"
    );
    assert!(
        blocks.iter().sum::<usize>() < 4 * (1 << 20),
        "no copy of the 1 MiB parameters per worker: {blocks:?}"
    );
    assert_eq!(m.report().total_arrays(), 1);
    service.shutdown(ShutdownMode::Drain).unwrap();
    m.close().unwrap();
}

#[test]
fn bad_configurations_and_inputs_are_refused() {
    let (model, w, v) = model();
    let err = ParallelInference::builder(&model)
        .workers(0)
        .build(|_c, x| x.duplicate())
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    let err = ParallelInference::builder(&model)
        .mode(batched(0, 10))
        .build(|_c, x| x.duplicate())
        .unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
    // A batched forward must keep one row per input row.
    let service = ParallelInference::builder(&model)
        .workers(1)
        .mode(batched(4, 100))
        .build(move |_c, x| forward(&w, &v, x)?.sum_all())
        .unwrap();
    let err = service.predict(request(1, 2)).unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("one row per input row"), "{err}");
    let scalar = HostArray::from_vec(vec![1.0f32], ()).unwrap();
    let err = service.predict(scalar).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    drop(service);
    model.close().unwrap();
    let err = ParallelInference::builder(&model)
        .build(|_c, x| x.duplicate())
        .unwrap_err();
    assert!(matches!(err, Error::ManagerClosed { .. }), "{err}");
}

/// A panic payload whose own `Drop` panics (see `tests/predictor.rs`).
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panics too");
    }
}

/// The answer of `pending`, or `None` if none came within 20 seconds (a lost worker).
fn answer_within(pending: ndscope::Pending) -> Option<ndscope::Result<HostArray>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if let Some(answer) = pending.try_wait() {
            return Some(answer);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn a_panic_payload_whose_drop_panics_loses_no_worker_and_no_request() {
    for mode in [InferenceMode::Sequential, batched(4, 500)] {
        let (model, w, v) = model();
        // One worker: were it lost, nothing would answer the requests after the bomb.
        let service = ParallelInference::builder(&model)
            .workers(1)
            .mode(mode)
            .build(move |_c, x| {
                if x.to_vec::<f32>()?.contains(&999.0) {
                    std::panic::panic_any(Bomb);
                }
                forward(&w, &v, x)
            })
            .unwrap();
        let mut poisoned = request(5, 1).into_vec::<f32>().unwrap();
        poisoned[0] = 999.0;
        let poisoned = HostArray::from_vec(poisoned, [1, 8]).unwrap();
        match answer_within(service.submit(poisoned).unwrap()) {
            Some(Err(Error::Panicked { .. })) => {}
            other => panic!("expected Panicked in {mode:?}, got {other:?}"),
        }
        let pending: Vec<_> = (0..100)
            .map(|i| service.submit(request(i, 1)).unwrap())
            .collect();
        for (i, p) in pending.into_iter().enumerate() {
            match answer_within(p) {
                Some(Ok(y)) => assert_eq!(y.dims(), &[1, 3], "request {i} in {mode:?}"),
                other => panic!("request {i} in {mode:?}: {other:?}"),
            }
        }
        let stats = service.stats();
        assert_eq!(stats.panics, 1, "{stats:?}");
        assert_eq!(
            service.manager().children().len(),
            1,
            "the worker was replaced"
        );
        service.shutdown(ShutdownMode::Drain).unwrap();
        model.close().unwrap();
    }
}
