//! Managers and arrays shared between threads (handles are `Send + Sync`): concurrent work under
//! one parent, and closing an array or a manager while another thread computes on it, which must
//! give either a correct result or `ArrayClosed`, never a crash or stale data.

use std::sync::Barrier;
use std::thread;
use std::time::{Duration, Instant};

use ndscope::{DType, Error, Manager, NDArray, Result};

const THREADS: usize = 4;
/// Under Miri (which interprets every thread on one core) the races are run smaller and fewer
/// times.
const STEPS: usize = if cfg!(miri) { 5 } else { 50 };

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn handles_are_send_and_sync() {
    assert_send_sync::<Manager>();
    assert_send_sync::<NDArray>();
    assert_send_sync::<ndscope::NDList>();
}

#[test]
fn four_threads_share_one_parent() -> Result<()> {
    let parent = Manager::new_base().with_name("parent");
    let w = parent.full([16, 16], 0.5, DType::F32)?; // shared, read by every thread
    let kept: Vec<Vec<(usize, NDArray)>> = thread::scope(|t| {
        let handles: Vec<_> = (0..THREADS)
            .map(|tid| {
                let parent = parent.clone();
                let w = w.clone();
                t.spawn(move || -> Result<Vec<(usize, NDArray)>> {
                    let mut kept = Vec::new();
                    for step in 0..STEPS {
                        let value = (tid * 100 + step) as f64;
                        // A scope: temporaries, a nested sub-manager, one result kept.
                        let total = parent.scope(|s| {
                            let x = s.full([16, 16], value, DType::F32)?;
                            let y = x.matmul(&w)?; // every entry: 16 · value · 0.5
                            assert_eq!(y.manager()?, *s);
                            let inner = s.new_sub_manager()?;
                            let tmp = inner.ones([8], DType::F32)?;
                            tmp.temp_attach(s)?;
                            inner.close()?;
                            let sum = y.sum_all()?;
                            s.ret(&sum)
                        })?;
                        kept.push((step, total));
                        // A sub-manager closed by hand, with arrays moved in and out.
                        let sub = parent.new_sub_manager()?;
                        let a = sub.full([32], value, DType::F64)?;
                        let b = a.add_scalar(1.0)?;
                        b.add_(&a)?;
                        let other = parent.new_sub_manager()?;
                        b.attach(&other)?;
                        a.temp_attach(&other)?;
                        other.close()?; // a goes back to sub, b is freed
                        assert!(a.is_open() && !b.is_open());
                        assert_eq!(a.manager()?, sub);
                        sub.close()?;
                        assert!(!a.is_open());
                        // Every fifth kept result is closed again.
                        if step % 5 == 4 {
                            kept.pop().unwrap().1.close()?;
                        }
                    }
                    Ok(kept)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("worker panicked"))
            .collect::<Result<Vec<_>>>()
    })?;

    let report = parent.report();
    assert!(report.children.is_empty(), "every sub-manager closed");
    assert!(parent.children().is_empty());
    let per_thread = STEPS - STEPS / 5;
    assert_eq!(report.arrays.len(), 1 + THREADS * per_thread);
    assert_eq!(report.total_arrays(), 1 + THREADS * per_thread);
    for (tid, results) in kept.iter().enumerate() {
        assert_eq!(results.len(), per_thread);
        for (step, total) in results {
            let value = (tid * 100 + step) as f32;
            let expected = 256.0 * 16.0 * value * 0.5;
            assert_eq!(total.to_scalar::<f32>()?, expected);
            assert_eq!(total.manager()?, parent);
        }
    }
    parent.close()?;
    assert!(kept.iter().flatten().all(|(_, a)| !a.is_open()));
    assert!(!w.is_open());
    Ok(())
}

#[test]
fn reports_and_dumps_while_other_threads_work() -> Result<()> {
    let parent = Manager::new_base();
    let stop = std::sync::atomic::AtomicBool::new(false);
    thread::scope(|t| {
        for _ in 0..2 {
            let parent = parent.clone();
            let stop = &stop;
            t.spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    parent
                        .scope(|s| {
                            let x = s.ones([64], DType::F32)?;
                            x.add(&x)?.sum_all()?;
                            Ok(())
                        })
                        .unwrap();
                }
            });
        }
        let deadline = Instant::now() + Duration::from_millis(200);
        let mut reports = 0;
        // Miri's clock is virtual: count reports there instead.
        let more = |reports: usize| {
            if cfg!(miri) {
                reports < 3
            } else {
                Instant::now() < deadline
            }
        };
        while more(reports) {
            let report = parent.report();
            assert!(report.total_arrays() <= 2 * 3);
            let dump = parent.debug_dump(1);
            assert!(!dump.is_empty());
            reports += 1;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(reports > 0);
    });
    assert!(parent.children().is_empty());
    assert_eq!(parent.report().total_arrays(), 0);
    parent.close()
}

/// Outcome counts of a race, printed for information (the test asserts only that every outcome
/// is one of the allowed ones).
#[derive(Default, Debug)]
struct Outcomes {
    correct: usize,
    refused: usize,
    result_closed: usize,
}

/// Checks one op result raced against a close: a correct result, or `ArrayClosed` from the op
/// or from reading its (closed) result.
fn check_raced(result: Result<NDArray>, expected: f32, outcomes: &mut Outcomes) {
    match result {
        Ok(r) => match r.to_vec::<f32>() {
            Ok(values) => {
                assert!(
                    values.iter().all(|&v| v == expected),
                    "stale or torn data: expected all {expected}, got e.g. {:?}",
                    &values[..4.min(values.len())]
                );
                outcomes.correct += 1;
            }
            Err(Error::ArrayClosed { .. }) => outcomes.result_closed += 1,
            Err(e) => panic!("reading the result failed with {e}"),
        },
        Err(Error::ArrayClosed { .. }) => outcomes.refused += 1,
        Err(e) => panic!("the op failed with {e}, not ArrayClosed"),
    }
}

/// Spins for about `micros` microseconds (sleeping would be far too coarse).
fn spin(micros: u64) {
    let until = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

const RACES: usize = if cfg!(miri) { 4 } else { 300 };
const N: usize = if cfg!(miri) { 8 } else { 160 };
/// Elements of the arrays of the elementwise races.
const LEN: usize = if cfg!(miri) { 64 } else { 1 << 18 };

#[test]
fn closing_an_array_while_another_thread_computes_on_it() -> Result<()> {
    let mut outcomes = Outcomes::default();
    for i in 0..RACES {
        let m = Manager::new_base();
        let a = m.ones([N, N], DType::F32)?;
        let b = m.ones([N, N], DType::F32)?;
        let barrier = Barrier::new(2);
        let result = thread::scope(|t| {
            t.spawn(|| {
                barrier.wait();
                spin((i % 10) as u64 * 40);
                a.close().unwrap();
            });
            barrier.wait();
            if i % 2 == 0 {
                a.matmul(&b)
            } else {
                b.matmul(&a)
            }
        });
        check_raced(result, N as f32, &mut outcomes);
        m.close()?;
    }
    eprintln!("array closed during matmul: {outcomes:?}");
    Ok(())
}

#[test]
fn closing_an_array_during_an_elementwise_op() -> Result<()> {
    let mut outcomes = Outcomes::default();
    for i in 0..RACES {
        let m = Manager::new_base();
        let a = m.full([LEN], 2.0, DType::F32)?;
        let b = m.full([LEN], 3.0, DType::F32)?;
        let barrier = Barrier::new(2);
        let result = thread::scope(|t| {
            t.spawn(|| {
                barrier.wait();
                spin((i % 10) as u64 * 30);
                b.close().unwrap();
            });
            barrier.wait();
            a.mul(&b)
        });
        check_raced(result, 6.0, &mut outcomes);
        m.close()?;
    }
    eprintln!("array closed during mul: {outcomes:?}");
    Ok(())
}

#[test]
fn closing_a_manager_while_another_thread_computes_on_its_arrays() -> Result<()> {
    let mut outcomes = Outcomes::default();
    for i in 0..RACES {
        let m = Manager::new_base();
        let a = m.ones([N, N], DType::F32)?;
        let barrier = Barrier::new(2);
        let result = thread::scope(|t| {
            t.spawn(|| {
                barrier.wait();
                spin((i % 10) as u64 * 40);
                m.close().unwrap();
            });
            barrier.wait();
            a.matmul(&a)
        });
        assert!(!a.is_open());
        if let Ok(r) = &result {
            // It landed in `m` (the first input's owner), so it was closed with it.
            assert!(!r.is_open());
        }
        check_raced(result, N as f32, &mut outcomes);
    }
    eprintln!("manager closed during matmul: {outcomes:?}");
    assert_eq!(outcomes.correct, 0);
    Ok(())
}

#[test]
fn in_place_ops_racing_a_close_are_refused_or_complete() -> Result<()> {
    for i in 0..RACES {
        let m = Manager::new_base();
        let a = m.full([LEN], 1.0, DType::F32)?;
        let g = m.full([LEN], 1.0, DType::F32)?;
        let barrier = Barrier::new(2);
        let result = thread::scope(|t| {
            t.spawn(|| {
                barrier.wait();
                spin((i % 10) as u64 * 30);
                g.close().unwrap();
            });
            barrier.wait();
            a.add_(&g)
        });
        match result {
            Ok(()) => assert!(a.to_vec::<f32>()?.iter().all(|&v| v == 2.0)),
            Err(Error::ArrayClosed { .. }) => {
                assert!(
                    a.to_vec::<f32>()?.iter().all(|&v| v == 1.0),
                    "a refused in-place op changes nothing"
                )
            }
            Err(e) => panic!("add_ failed with {e}"),
        }
        m.close()?;
    }
    Ok(())
}

#[test]
fn moving_arrays_between_managers_while_computing_keeps_data_intact() -> Result<()> {
    let base = Manager::new_base();
    let m1 = base.new_sub_manager()?;
    let m2 = base.new_sub_manager()?;
    let rows = if cfg!(miri) { 16 } else { 256 };
    let a = m1.full([rows, 64], 1.5, DType::F32)?;
    let b = m1.full([64, 32], 2.0, DType::F32)?;
    thread::scope(|t| {
        let mover = t.spawn(|| -> Result<()> {
            for i in 0..RACES {
                if i % 2 == 0 {
                    a.attach(&m2)?;
                    b.temp_attach(&m2)?;
                } else {
                    a.attach(&m1)?;
                    b.attach(&m1)?;
                }
            }
            Ok(())
        });
        for _ in 0..if cfg!(miri) { 3 } else { 100 } {
            let y = base.scope(|s| {
                let y = a.matmul(&b)?;
                assert_eq!(y.manager()?, *s);
                s.ret(&y.sum_all()?)
            })?;
            assert_eq!(y.to_scalar::<f32>()?, rows as f32 * 32.0 * 64.0 * 3.0);
            y.close()?;
        }
        mover.join().unwrap()
    })?;
    assert!(a.is_open() && b.is_open());
    base.close()
}
