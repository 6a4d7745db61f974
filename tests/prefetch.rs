//! Async prefetch into a circular workspace: how long a batch lives, what keeps one, errors
//! and panics of the producer, stopping the thread, and overlap with the consumer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndscope::{
    DType, Error, LearningPolicy, Manager, NDList, Prefetcher, ResetPolicy, WorkspaceConfig,
};

/// A prefetcher of `n` batches `[4]` filled with the batch's index.
fn counting(owner: &Manager, depth: usize, n: usize) -> Prefetcher {
    Prefetcher::from_iter(owner, depth, 0..n, |scope, i| {
        Ok(vec![scope.full([4], i as f64, DType::F32)?].into())
    })
    .unwrap()
}

fn value(batch: &NDList) -> Result<f32, Error> {
    Ok(batch.get(0).unwrap().to_vec::<f32>()?[0])
}

#[test]
fn batches_come_in_order_and_the_iterator_ends() {
    let owner = Manager::new_base();
    let batches = counting(&owner, 3, 20);
    let seen: Vec<f32> = batches.map(|b| value(&b.unwrap()).unwrap()).collect();
    assert_eq!(seen, (0..20).map(|i| i as f32).collect::<Vec<_>>());
    assert!(
        owner.children().is_empty(),
        "dropping it closed its manager"
    );
    owner.close().unwrap();
}

#[test]
fn a_batch_is_valid_until_the_kth_next_then_overwritten() {
    let owner = Manager::new_base();
    for depth in [1, 2, 3] {
        let mut batches = counting(&owner, depth, 50);
        let first = batches.next().unwrap().unwrap();
        let x = first.get(0).unwrap().clone();
        for k in 1..depth {
            batches.next().unwrap().unwrap();
            assert_eq!(value(&first).unwrap(), 0.0, "depth {depth}, after {k} more");
        }
        // Asking for batch `depth` ends batch 0.
        let current = batches.next().unwrap().unwrap();
        assert_eq!(value(&current).unwrap(), depth as f32);
        let err = x.to_vec::<f32>().unwrap_err();
        assert!(matches!(err, Error::ArrayClosed { .. }), "{err}");
        assert!(err.to_string().contains("overwritten"), "{err}");
        assert_eq!(batches.stats().overwritten, 1);
        // Every batch held to the end reads its own data until then: never another's.
        let mut held: Vec<NDList> = Vec::new();
        for b in batches.by_ref().take(30) {
            let b = b.unwrap();
            for (age, old) in held.iter().rev().enumerate() {
                match value(old) {
                    Ok(v) => assert!(age + 1 < depth, "depth {depth}: batch {v} lived too long"),
                    Err(Error::ArrayClosed { .. }) => assert!(age + 1 >= depth),
                    Err(e) => panic!("{e}"),
                }
            }
            held.push(b);
        }
    }
    owner.close().unwrap();
}

#[test]
fn detach_or_attach_keeps_a_batch() {
    let owner = Manager::new_base();
    let keeper = Manager::new_base();
    let mut batches = counting(&owner, 2, 40);
    let kept_detached = batches.next().unwrap().unwrap();
    kept_detached.detach().unwrap();
    let kept_attached = batches.next().unwrap().unwrap();
    kept_attached.attach(&keeper).unwrap();
    for b in batches.by_ref().take(30) {
        b.unwrap();
    }
    assert_eq!(value(&kept_detached).unwrap(), 0.0);
    assert_eq!(value(&kept_attached).unwrap(), 1.0);
    assert!(
        !keeper.report().arrays[0].in_workspace,
        "copied out of the ring"
    );
    kept_detached.close().unwrap();
    keeper.close().unwrap();
    owner.close().unwrap();
}

#[test]
fn a_circular_survivor_moved_out_is_copied_and_outlives_the_wrap() {
    let t = Manager::new_base();
    let conf = WorkspaceConfig::builder()
        .initial_size(1024)
        .learning(LearningPolicy::None)
        .reset(ResetPolicy::EndOfBuffer)
        .build()
        .unwrap();
    let ws = t.workspace("ring", conf).unwrap();
    let x = ws
        .cycle(|c| c.ret(&c.full([64], 7.0, DType::F32)?))
        .unwrap();
    assert!(t.report().arrays[0].in_workspace, "a zero-copy survivor");
    x.detach().unwrap(); // copied out now
    for _ in 0..8 {
        ws.cycle(|c| c.full([64], 1.0, DType::F32).map(drop))
            .unwrap();
    }
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![7.0; 64], "not overwritten");
    x.close().unwrap();
    t.close().unwrap();
}

#[test]
fn producer_errors_and_panics_reach_the_consumer() {
    let owner = Manager::new_base();
    let mut failing = Prefetcher::from_iter(&owner, 2, 0..10, |scope, i| {
        if i == 3 {
            return Err(Error::InvalidArgument {
                op: "read batch",
                at: std::panic::Location::caller(),
                reason: "corrupt record 3".into(),
            });
        }
        Ok(vec![scope.full([2], i as f64, DType::F32)?].into())
    })
    .unwrap();
    for i in 0..3 {
        assert_eq!(value(&failing.next().unwrap().unwrap()).unwrap(), i as f32);
    }
    match failing.next() {
        Some(Err(Error::InvalidArgument { reason, .. })) => assert_eq!(reason, "corrupt record 3"),
        other => panic!("expected the producer's error, got {other:?}"),
    }
    assert!(failing.next().is_none(), "the stream ends after an error");

    let mut panicking = Prefetcher::new(&owner, 2, |scope| {
        let _tmp = scope.zeros([8], DType::F32)?;
        panic!("producer bug")
    })
    .unwrap();
    match panicking.next() {
        Some(Err(Error::Panicked {
            message, during, ..
        })) => {
            assert_eq!(message, "producer bug");
            assert!(during.contains("producer"), "{during}");
        }
        other => panic!("expected Panicked, got {other:?}"),
    }
    assert!(panicking.next().is_none());
    assert_eq!(
        panicking.manager().report().total_arrays(),
        0,
        "its scope was closed"
    );
    drop(failing);
    drop(panicking);
    owner.close().unwrap();
}

#[test]
fn dropping_the_iterator_stops_the_producer_thread() {
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let owner = Manager::new_base();
    let stopped = Arc::new(AtomicBool::new(false));
    let flag = Flag(Arc::clone(&stopped));
    let mut endless = Prefetcher::new(&owner, 3, move |scope| {
        let _keep = &flag; // dropped with the closure, when the thread ends
        Ok(Some(vec![scope.ones([16], DType::F32)?].into()))
    })
    .unwrap();
    let manager = endless.manager().clone();
    for _ in 0..5 {
        endless.next().unwrap().unwrap();
    }
    drop(endless);
    assert!(stopped.load(Ordering::SeqCst), "the producer thread ended");
    assert!(!manager.is_open(), "the ring and every batch are freed");
    owner.close().unwrap();
}

#[test]
fn batches_live_in_the_ring_which_stops_growing() {
    let owner = Manager::new_base();
    let mut batches = counting(&owner, 2, 60);
    for b in batches.by_ref().take(10) {
        b.unwrap();
    }
    let learned = batches.workspace().stats();
    assert!(learned.initialized);
    for b in batches.by_ref() {
        b.unwrap();
    }
    let after = batches.workspace().stats();
    assert_eq!(
        after.capacity, learned.capacity,
        "no growth with batches of one size"
    );
    assert_eq!(after.reallocations, 0);
    assert_eq!(
        after.spilled_count, learned.spilled_count,
        "no spill after learning"
    );
    // The ring holds 2·depth + 1 batches of one 64-byte array each.
    assert!(after.capacity >= 5 * 64, "{after:?}");
    owner.close().unwrap();
}

#[test]
fn a_stray_op_on_a_batch_without_a_scope_is_capped() {
    let owner = Manager::new_base();
    let mut batches = counting(&owner, 2, 5);
    let b = batches.next().unwrap().unwrap();
    let x = b.get(0).unwrap();
    let err = x.add_scalar(1.0).unwrap_err();
    assert!(matches!(err, Error::Capped { .. }), "{err}");
    // In a scope it is fine.
    let y = owner.scope(|s| s.ret(&x.add_scalar(1.0)?)).unwrap();
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![1.0; 4]);
    drop(batches);
    owner.close().unwrap();
}

#[test]
fn bad_arguments_and_foreign_arrays_are_refused() {
    let owner = Manager::new_base();
    let err = Prefetcher::new(&owner, 0, |_| Ok(None)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let elsewhere = Manager::new_base();
    let foreign = elsewhere.ones([3], DType::F32).unwrap();
    let mut batches =
        Prefetcher::new(&owner, 1, move |_| Ok(Some(vec![foreign.clone()].into()))).unwrap();
    let err = batches.next().unwrap().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("producer's scope"), "{err}");
    assert_eq!(
        elsewhere.report().total_arrays(),
        1,
        "the foreign array stayed where it was"
    );
    drop(batches);
    let closed = Manager::new_base();
    closed.close().unwrap();
    assert!(matches!(
        Prefetcher::new(&closed, 1, |_| Ok(None)),
        Err(Error::ManagerClosed { .. })
    ));
    elsewhere.close().unwrap();
    owner.close().unwrap();
}

#[test]
fn a_producer_as_slow_as_the_step_is_hidden() {
    // Sleeps, not computation: the overlap holds on a loaded machine too.
    let t = Duration::from_millis(15);
    let owner = Manager::new_base();
    let batches = Prefetcher::from_iter(&owner, 2, 0..12, move |scope, i| {
        std::thread::sleep(t);
        Ok(vec![scope.full([4], i as f64, DType::F32)?].into())
    })
    .unwrap();
    let start = Instant::now();
    let mut n = 0;
    for b in batches {
        b.unwrap();
        std::thread::sleep(t); // the step
        n += 1;
    }
    let per_step = start.elapsed() / n;
    assert_eq!(n, 12);
    assert!(
        per_step < t * 16 / 10,
        "{per_step:?} per step: the producer was not hidden"
    );
    owner.close().unwrap();
}

/// `n` batches of `sizes(i)` f32 values each, batch `i` holding `i * 1000 + k` at `k`, in two
/// arrays (the second the first plus one) and a temporary.
fn sized(owner: &Manager, depth: usize, sizes: Vec<usize>) -> Prefetcher {
    Prefetcher::from_iter(
        owner,
        depth,
        sizes.into_iter().enumerate(),
        |scope, (i, n)| {
            let values: Vec<f32> = (0..n).map(|k| (i * 1000 + k) as f32).collect();
            let a = scope.from_vec(values, [n])?;
            let tmp = scope.full([n], 1.0, DType::F32)?;
            let b = a.add(&tmp)?;
            Ok(vec![a, b].into())
        },
    )
    .unwrap()
}

/// Checks that `batch` is batch `i` of `n` values, in full.
fn check_sized(batch: &NDList, i: usize, n: usize) -> Result<(), Error> {
    let a = batch.get(0).unwrap().to_vec::<f32>()?;
    let b = batch.get(1).unwrap().to_vec::<f32>()?;
    let want: Vec<f32> = (0..n).map(|k| (i * 1000 + k) as f32).collect();
    assert_eq!(a, want, "batch {i}");
    let plus: Vec<f32> = want.iter().map(|v| v + 1.0).collect();
    assert_eq!(b, plus, "batch {i}");
    Ok(())
}

/// Reads every batch in full when it comes, and again every batch still within its lifetime
/// (the `depth - 1` before it), letting the producer run ahead first.
fn read_all(owner: &Manager, depth: usize, sizes: Vec<usize>) -> ndscope::PrefetchStats {
    let mut batches = sized(owner, depth, sizes.clone());
    let mut held: std::collections::VecDeque<(usize, NDList)> = Default::default();
    for i in 0..sizes.len() {
        if i % 3 == 0 {
            // The producer fills its `depth` batches ahead meanwhile.
            std::thread::sleep(Duration::from_millis(2));
        }
        let batch = batches.next().unwrap().unwrap();
        if held.len() == depth {
            held.pop_front();
        }
        held.push_back((i, batch));
        for (j, b) in &held {
            if let Err(e) = check_sized(b, *j, sizes[*j]) {
                panic!("depth {depth}: batch {j} unreadable when batch {i} came: {e}");
            }
        }
    }
    assert!(batches.next().is_none());
    let stats = batches.stats();
    assert_eq!(stats.consumed, sizes.len() as u64);
    drop(batches);
    stats
}

#[test]
fn growing_batches_are_never_evicted_while_handed_out() {
    let owner = Manager::new_base();
    for depth in [1, 2, 3] {
        let sizes: Vec<usize> = (0..60).map(|i| 16 * (i + 1)).collect();
        let stats = read_all(&owner, depth, sizes);
        assert!(stats.ring_growths >= 1, "depth {depth}: {stats:?}");
    }
    assert!(owner.children().is_empty());
    owner.close().unwrap();
}

#[test]
fn batches_of_random_sizes_are_never_evicted_while_handed_out() {
    let owner = Manager::new_base();
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for depth in [1, 2, 4] {
        let sizes: Vec<usize> = (0..300)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                1 + (seed % 2000) as usize
            })
            .collect();
        read_all(&owner, depth, sizes);
    }
    owner.close().unwrap();
}

/// The documented lifetime, exactly: with depth `d`, batch `i` reads until `next` is called
/// for batch `i + d`, which closes it.
#[test]
fn the_documented_lifetime_holds_for_depth_two() {
    let owner = Manager::new_base();
    let mut batches = counting(&owner, 2, 20);
    let b: Vec<NDList> = (0..8).map(|_| batches.next().unwrap().unwrap()).collect();
    // Batch 5 was read while `next` returned batch 6, and closed when it returned batch 7.
    assert!(value(&b[6]).is_ok() && value(&b[7]).is_ok());
    assert!(matches!(value(&b[5]), Err(Error::ArrayClosed { .. })));
    let mut batches = counting(&owner, 2, 20);
    let b5: Vec<NDList> = (0..7).map(|_| batches.next().unwrap().unwrap()).collect();
    assert_eq!(
        value(&b5[5]).unwrap(),
        5.0,
        "valid while next returned batch 6"
    );
    drop(batches);
    owner.close().unwrap();
}

/// A panic payload whose own `Drop` panics (see `tests/predictor.rs`).
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panics too");
    }
}

#[test]
fn a_producer_panic_whose_payload_drop_panics_reaches_the_consumer() {
    let owner = Manager::new_base();
    let mut batches = Prefetcher::from_iter(&owner, 2, 0..10, |scope, i| {
        if i == 2 {
            std::panic::panic_any(Bomb);
        }
        Ok(vec![scope.full([4], i as f64, DType::F32)?].into())
    })
    .unwrap();
    // The consumer on its own thread: were the producer lost, it would wait forever.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let items: Vec<Result<f32, Error>> = batches
            .by_ref()
            .map(|b| b.and_then(|b| value(&b)))
            .collect();
        let _ = tx.send(items);
    });
    let items = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the consumer got an answer for every batch");
    assert_eq!(items.len(), 3, "{items:?}");
    assert_eq!(items[0].as_ref().unwrap(), &0.0);
    assert_eq!(items[1].as_ref().unwrap(), &1.0);
    assert!(matches!(items[2], Err(Error::Panicked { .. })), "{items:?}");
    owner.close().unwrap();
}
