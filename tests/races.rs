//! Races between threads around workspaces, and the "no global stalls" rule.
//!
//! Each race checks the values every read gives: an array's own values, or `ArrayClosed` /
//! `ManagerClosed` — never stale data, never another array's data (a workspace reuses the same
//! bytes cycle after cycle, so a read that reached freed or reused bytes would see another
//! cycle's values):
//! - a workspace cycle closed (and the next cycle writing into the same bytes) while another
//!   thread reads the cycle's arrays;
//! - a circular workspace overwriting arrays kept from earlier cycles while another thread reads
//!   them (an array in use is never overwritten: the allocation spills instead);
//! - arrays moved out of a workspace cycle (`ret`, `attach`, `detach`, `NDList::attach`, which
//!   copy them out) while another thread reads them: the same handles stay valid, with their
//!   values, after the cycle's bytes are reused.
//!
//! And the stall tests: a long `matmul` on thread A reads an array that thread B closes (or
//! moves out of a workspace); B waits for A's kernel, but thread C, doing unrelated ops and
//! `report()` calls, must keep completing them meanwhile. They assert on C's progress count
//! while A's kernel still runs; time is only used to size the kernel and to recognise a trial
//! in which B's call did not overlap the kernel (which is then run again).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use ndscope::{
    AllocationPolicy, DType, Error, LearningPolicy, Manager, NDArray, NDList, ResetPolicy, Result,
    WorkspaceConfig,
};

/// Elements per array: large enough that a read takes a while, small enough for Miri.
const N: usize = if cfg!(miri) { 16 } else { 1 << 14 };
/// Rounds of each race.
const ROUNDS: usize = if cfg!(miri) { 3 } else { 150 };

/// Counts of what the reads of a race gave, printed for information.
#[derive(Default, Debug)]
struct Reads {
    right: usize,
    closed: usize,
}

impl Reads {
    fn add(&mut self, other: &Reads) {
        self.right += other.right;
        self.closed += other.closed;
    }
}

/// Checks one read raced against a close or a move: every value `expected`, or the array (or
/// the manager an op result would land in) closed.
fn check(result: Result<Vec<f32>>, expected: f32, what: &str, reads: &mut Reads) {
    match result {
        Ok(values) => {
            assert!(
                values.iter().all(|&v| v == expected),
                "{what}: stale or foreign data: expected all {expected}, got e.g. {:?}",
                values.iter().find(|&&v| v != expected)
            );
            reads.right += 1;
        }
        Err(Error::ArrayClosed { .. } | Error::ManagerClosed { .. }) => reads.closed += 1,
        Err(e) => panic!("{what}: failed with {e}, not ArrayClosed or ManagerClosed"),
    }
}

/// Reads `a` (which holds `value` everywhere) in one of three ways: directly, through a kernel
/// whose result lands in `a`'s manager, or through a reduction (results are closed again).
fn read(a: &NDArray, value: f32, how: usize, reads: &mut Reads) {
    match how % 3 {
        0 => check(a.to_vec::<f32>(), value, "to_vec", reads),
        1 => check(
            a.mul_scalar(2.0).and_then(|r| {
                let values = r.to_vec::<f32>();
                r.close()?;
                values
            }),
            2.0 * value,
            "mul_scalar",
            reads,
        ),
        _ => check(
            a.sum_all().and_then(|r| {
                let sum = r.to_scalar::<f32>();
                r.close()?;
                sum.map(|s| vec![s])
            }),
            N as f32 * value,
            "sum_all",
            reads,
        ),
    }
}

/// Spins for about `micros` microseconds (sleeping would be far too coarse).
fn spin(micros: u64) {
    let until = Instant::now() + Duration::from_micros(micros);
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}

/// Bytes of one array, as a workspace rounds them.
fn slot() -> usize {
    (N * 4).div_ceil(64) * 64
}

/// A workspace whose block holds `slots` arrays from the start and never changes.
fn fixed(slots: usize, reset: ResetPolicy) -> WorkspaceConfig {
    WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .allocation(AllocationPolicy::Strict)
        .initial_size(slots * slot())
        .reset(reset)
        .build()
        .unwrap()
}

#[test]
fn closing_a_workspace_cycle_while_another_thread_reads_its_arrays() -> Result<()> {
    let trainer = Manager::new_base().with_name("trainer");
    let ws = trainer.workspace("batch", fixed(12, ResetPolicy::BlockLeft))?;
    let mut total = Reads::default();
    for round in 0..ROUNDS {
        let cycle = ws.open()?;
        let arrays = (0..4)
            .map(|i| {
                let value = (round * 10 + i + 1) as f32;
                Ok((cycle.full([N], f64::from(value), DType::F32)?, value))
            })
            .collect::<Result<Vec<_>>>()?;
        let barrier = Barrier::new(2);
        let reads = thread::scope(|t| -> Result<Reads> {
            let reader = t.spawn(|| {
                let mut reads = Reads::default();
                barrier.wait();
                for k in 0..6 {
                    for (a, value) in &arrays {
                        read(a, *value, k, &mut reads);
                    }
                }
                reads
            });
            barrier.wait();
            spin((round % 8) as u64 * 25);
            cycle.close()?;
            // The next cycle writes other values into the same bytes (unless a closed array's
            // bytes are still being read: then it spills). The reader must never see them.
            let next = ws.open()?;
            let filler = next.full([4 * N], -1.0, DType::F32)?;
            let reads = reader.join().expect("reader panicked");
            assert_eq!(filler.to_vec::<f32>()?, vec![-1.0; 4 * N]);
            next.close()?;
            Ok(reads)
        })?;
        for (a, _) in &arrays {
            assert!(!a.is_open(), "every array of the cycle is closed with it");
        }
        total.add(&reads);
    }
    eprintln!("reads raced against a cycle closing: {total:?}");
    trainer.close()
}

#[test]
fn circular_eviction_while_another_thread_reads_the_evicted_arrays() -> Result<()> {
    let trainer = Manager::new_base().with_name("trainer");
    // Four slots; each cycle keeps two arrays (`ret`, zero-copy), so the next-but-one cycle
    // comes round over them.
    let ws = trainer.workspace("ring", fixed(4, ResetPolicy::EndOfBuffer))?;
    let kept: Mutex<Vec<(NDArray, f32)>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    // Passes the reader has made over the newest kept arrays: each round waits for one, so
    // the reads go on while the rounds overwrite.
    let passes = AtomicUsize::new(0);
    let reads = thread::scope(|t| -> Result<Reads> {
        let reader = t.spawn(|| {
            let mut reads = Reads::default();
            let mut k = 0;
            while !stop.load(Ordering::Acquire) {
                let snapshot: Vec<(NDArray, f32)> = kept.lock().unwrap().clone();
                for (a, value) in snapshot.iter().rev().take(6) {
                    read(a, *value, k, &mut reads);
                    k += 1;
                }
                passes.fetch_add(1, Ordering::AcqRel);
            }
            reads
        });
        for round in 0..ROUNDS * 2 {
            let cycle = ws.open()?;
            for i in 0..2 {
                let value = (round * 10 + i + 1) as f32;
                let a = cycle.full([N], f64::from(value), DType::F32)?;
                cycle.ret(&a)?;
                kept.lock().unwrap().push((a, value));
            }
            cycle.close()?;
            let seen = passes.load(Ordering::Acquire);
            while passes.load(Ordering::Acquire) < seen + 1 {
                std::hint::spin_loop();
            }
        }
        stop.store(true, Ordering::Release);
        Ok(reader.join().expect("reader panicked"))
    })?;
    // Afterwards every kept array holds its own values or was overwritten, and says so.
    let mut overwritten = 0;
    for (a, value) in kept.lock().unwrap().iter() {
        match a.to_vec::<f32>() {
            Ok(values) => assert!(values.iter().all(|v| v == value), "kept array changed"),
            Err(e @ Error::ArrayClosed { .. }) => {
                assert!(e.to_string().contains("overwritten"), "{e}");
                overwritten += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(overwritten > 0, "the ring came round over kept arrays");
    eprintln!("reads raced against circular eviction: {reads:?}, {overwritten} overwritten");
    trainer.close()
}

#[test]
fn moving_arrays_out_of_a_workspace_while_another_thread_reads_them() -> Result<()> {
    let trainer = Manager::new_base().with_name("trainer");
    let other = trainer.new_sub_manager()?.with_name("other");
    let ws = trainer.workspace("batch", fixed(8, ResetPolicy::BlockLeft))?;
    let mut total = Reads::default();
    let mut moved_all = Vec::new();
    for round in 0..ROUNDS {
        let cycle = ws.open()?;
        let arrays = (0..4)
            .map(|i| {
                let value = (round * 10 + i + 1) as f32;
                Ok((cycle.full([N], f64::from(value), DType::F32)?, value))
            })
            .collect::<Result<Vec<_>>>()?;
        let barrier = Barrier::new(2);
        let reads = thread::scope(|t| -> Result<Reads> {
            let reader = t.spawn(|| {
                let mut reads = Reads::default();
                barrier.wait();
                for k in 0..6 {
                    for (a, value) in &arrays {
                        // Moved arrays stay valid, so reading the values never fails.
                        let values = a.to_vec::<f32>().expect("a moved array stays valid");
                        check(Ok(values), *value, "to_vec", &mut reads);
                        read(a, *value, k, &mut reads);
                    }
                }
                reads
            });
            barrier.wait();
            spin((round % 8) as u64 * 25);
            // Each of the four ways out of the cycle copies the bytes out.
            let [(a, _), (b, _), (c, _), (d, _)] = &arrays[..] else {
                unreachable!()
            };
            match round % 4 {
                0 => {
                    cycle.ret(a)?;
                    b.attach(&trainer)?;
                    c.detach()?;
                    NDList::from(vec![d.clone()]).attach(&other)?;
                }
                1 => {
                    NDList::from(vec![a.clone(), b.clone()]).detach()?;
                    other.attach_all(&[c.clone(), d.clone()])?;
                }
                2 => {
                    cycle.ret_list(&NDList::from(vec![a.clone(), b.clone(), c.clone()]))?;
                    d.attach(&other)?;
                }
                _ => {
                    trainer.attach_all(&[a.clone(), b.clone(), c.clone(), d.clone()])?;
                }
            }
            cycle.close()?;
            // The next cycle writes other values into the bytes the arrays were copied from.
            let next = ws.open()?;
            let filler = next.full([8 * N], -1.0, DType::F32)?;
            let reads = reader.join().expect("reader panicked");
            assert_eq!(filler.to_vec::<f32>()?, vec![-1.0; 8 * N]);
            next.close()?;
            Ok(reads)
        })?;
        total.add(&reads);
        moved_all.extend(arrays);
    }
    for (a, value) in &moved_all {
        assert_eq!(
            a.to_vec::<f32>()?,
            vec![*value; N],
            "moved array kept its values"
        );
        if a.is_detached() {
            a.close()?;
        }
    }
    eprintln!("reads raced against moves out of a workspace: {total:?}");
    trainer.close()
}

// ------------------------------------------------------------------------------------------------
// No global stalls (not under Miri: they need real time and large kernels).

#[cfg(not(miri))]
mod stall {
    use super::*;
    use ndscope::Scope;

    /// What one stall trial saw.
    #[derive(Debug)]
    struct Trial {
        /// Whether B's call was through the arena (C saw the move) while A's kernel had the
        /// array, and the kernel ran on for 40 ms after: only then does the trial say anything.
        overlapped: bool,
        /// Unrelated ops and reports thread C completed after B's call had taken the array out of
        /// (or moved it within) the arena, while A's kernel still ran.
        progress: usize,
    }

    /// Largest side of A's matrices: three of them (x, w, the product) take 805 MB at 8192,
    /// and a 16- or 64-core server needs that much work for a product of a few hundred
    /// milliseconds (3072, the old bound, takes under 40 ms on 16 AVX-512 cores).
    const MAX_SIDE: usize = 8192;

    /// Side of the square matrices of A's kernel, sized so that one product takes about
    /// `target` in this build on this machine, with the pool as wide as it is: timed at a
    /// small side first, then once more at the side that gives (a small product does not keep
    /// a wide pool busy, so the first guess is too small where there are many cores).
    fn matmul_side(m: &Manager, target: Duration) -> Result<usize> {
        let n0 = 192;
        let time = |n: usize, budget: Duration| -> Result<f64> {
            let a = m.ones([n, n], DType::F32)?;
            let start = Instant::now();
            let mut runs = 0;
            while runs == 0 || start.elapsed() < budget {
                a.matmul(&a)?.close()?;
                runs += 1;
            }
            a.close()?;
            Ok(start.elapsed().as_secs_f64() / f64::from(runs))
        };
        let side_for = |n: usize, per_run: f64| {
            let scale = (target.as_secs_f64() / per_run).cbrt();
            ((n as f64 * scale) as usize).clamp(n0, MAX_SIDE)
        };
        let guess = side_for(n0, time(n0, Duration::from_millis(20))?);
        Ok(side_for(guess, time(guess, Duration::ZERO)?))
    }

    /// One trial: A computes `x · w`; B, once A has started, runs `action(x)`; C waits until
    /// `moved(x)` says B's call is through the arena, then counts its own unrelated work until A's
    /// kernel returns. The trial counts (`overlapped`) only if C saw the move at least 40 ms
    /// before A's kernel returned: C's progress is counted from then, so that is the window to
    /// judge it by. (Measured from B's start, as this test once did, a trial in which B merely
    /// took long to get through the arena, with more runnable threads than cores, left C no
    /// window at all, and "0 ops" was then read as a stall.)
    fn stall_trial(
        base: &Manager,
        x: &NDArray,
        w: &NDArray,
        expected: f32,
        action: &(dyn Fn(&NDArray) -> Result<()> + Sync),
        moved: &(dyn Fn(&NDArray) -> bool + Sync),
    ) -> Trial {
        let started = AtomicBool::new(false);
        let acting = AtomicBool::new(false);
        let done = AtomicBool::new(false);
        let progress = AtomicUsize::new(0);
        // When C saw the move, when A's kernel returned.
        let timings: Mutex<(Option<Instant>, Option<Instant>)> = Mutex::new((None, None));
        let kernel_ok = thread::scope(|t| {
            let a = t.spawn(|| {
                started.store(true, Ordering::Release);
                let result = x.matmul(w);
                done.store(true, Ordering::Release);
                timings.lock().unwrap().1 = Some(Instant::now());
                match result {
                    Ok(r) => {
                        let values = r.to_vec::<f32>().expect("the product is readable");
                        assert!(values.iter().all(|&v| v == expected), "wrong product");
                        true
                    }
                    Err(Error::ArrayClosed { .. }) => false,
                    Err(e) => panic!("matmul failed with {e}"),
                }
            });
            let b = t.spawn(|| {
                while !started.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                // Let the kernel take the array's data lock first.
                spin(3_000);
                acting.store(true, Ordering::Release);
                action(x).expect("B's call succeeds");
            });
            let c = t.spawn(|| {
                while !acting.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                // Blocks for as long as B holds the arena lock. Polls with a pause: `moved` takes
                // the arena lock, and a tight loop of it would keep B from taking that lock
                // whenever C is descheduled while holding it.
                while !moved(x) {
                    thread::sleep(Duration::from_micros(50));
                }
                timings.lock().unwrap().0 = Some(Instant::now());
                while !done.load(Ordering::Acquire) {
                    let m = base.new_sub_manager().expect("unrelated manager");
                    let y = m.full([16], 1.0, DType::F32).expect("unrelated array");
                    let z = y.add(&y).expect("unrelated op");
                    assert_eq!(z.sum_all().unwrap().to_scalar::<f32>().unwrap(), 32.0);
                    assert!(base.report().total_arrays() >= 2);
                    m.close().expect("unrelated close");
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            });
            b.join().expect("B panicked");
            c.join().expect("C panicked");
            a.join().expect("A panicked")
        });
        let (seen, finished) = *timings.lock().unwrap();
        let overlap = match (seen, finished) {
            (Some(seen), Some(finished)) => finished.saturating_duration_since(seen),
            _ => Duration::ZERO,
        };
        Trial {
            overlapped: kernel_ok && overlap >= Duration::from_millis(40),
            progress: progress.load(Ordering::Relaxed),
        }
    }

    /// What a stall trial works on: A computes `x · w`; `keep` is closed after the trial.
    struct Setup {
        keep: Vec<Manager>,
        cycle: Option<Scope>,
        x: NDArray,
        w: NDArray,
    }

    /// Overlapping trials in which C made little progress that it takes to fail. One is not
    /// enough: a lock held across A's kernel stops C in *every* trial, but C can also be slow
    /// for a while without any lock. With more busy threads than cores (a 16-thread pool, as on
    /// a 16-core server, while the other tests of this file run their own kernels, or 16 pool
    /// threads on CI's two cores), every thread waits its turn on a core for tens of
    /// milliseconds at a time, and so does any thread waiting for the arena lock while its
    /// holder waits for a core; measured: single unrelated ops of C taking 5 to 77 ms and then
    /// completing *while A's kernel still ran*, so no lock was held across it, yet in about one
    /// overlapping trial in ten that stall covered the whole 40 ms window. Three such trials in a
    /// row (about 1 in 1000 by that rate) do not happen by chance; a lock held across the kernel
    /// gives them every time.
    const STALLED_TRIALS_TO_FAIL: usize = 3;

    /// Runs stall trials (a new `setup` each, larger each time) until one overlaps B's call with
    /// A's kernel and shows C making progress meanwhile; fails when
    /// [`STALLED_TRIALS_TO_FAIL`] overlapping trials show none.
    fn assert_no_stall(
        what: &str,
        setup: impl Fn(&Manager, usize) -> Result<Setup>,
        action: &(dyn Fn(&NDArray) -> Result<()> + Sync),
        moved: &(dyn Fn(&NDArray) -> bool + Sync),
    ) -> Result<()> {
        let base = Manager::new_base().with_name("base");
        let mut side = matmul_side(&base, Duration::from_millis(200))?;
        let mut trials = Vec::new();
        let mut stalled = 0;
        for _ in 0..10 {
            let Setup { keep, cycle, x, w } = setup(&base, side)?;
            let trial = stall_trial(&base, &x, &w, side as f32 * 0.5, action, moved);
            drop(cycle);
            for m in keep {
                m.close()?;
            }
            let (overlapped, progress) = (trial.overlapped, trial.progress);
            trials.push(trial);
            if overlapped && progress >= 10 {
                eprintln!("{what}: side {side}, trials {trials:?}");
                return base.close();
            }
            if overlapped {
                stalled += 1;
                assert!(
                    stalled < STALLED_TRIALS_TO_FAIL,
                    "{what}: in {stalled} trials, thread C completed fewer than 10 unrelated ops \
                     while thread B waited for A's kernel (side {side}; trials {trials:?}): B \
                     holds a lock every thread needs"
                );
            }
            side = (side * 5 / 4).min(MAX_SIDE);
        }
        panic!(
            "{what}: in no trial did thread C see B's call through the arena 40 ms before A's \
             kernel returned ({trials:?}): B's call waits for the kernel while it holds the \
             arena lock, or the kernel is too short"
        );
    }

    #[test]
    fn closing_an_array_a_kernel_reads_stalls_no_other_thread() -> Result<()> {
        assert_no_stall(
            "close",
            |base, side| {
                let m = base.new_sub_manager()?;
                let x = m.ones([side, side], DType::F32)?;
                let w = m.full([side, side], 0.5, DType::F32)?;
                Ok(Setup {
                    keep: vec![m],
                    cycle: None,
                    x,
                    w,
                })
            },
            &|x| x.close(),
            &|x| !x.is_open(),
        )
    }

    #[test]
    fn moving_an_array_out_of_a_workspace_while_a_kernel_reads_it_stalls_no_other_thread(
    ) -> Result<()> {
        let out = Manager::new_base().with_name("out");
        let result = assert_no_stall(
            "copy out of a workspace",
            |base, side| {
                let trainer = base.new_sub_manager()?;
                let block = WorkspaceConfig::builder()
                    .learning(LearningPolicy::None)
                    .initial_size(side * side * 4)
                    .build()?;
                let cycle = trainer.workspace("batch", block)?.open()?;
                // In the block, so that attaching it elsewhere copies it out.
                let x = cycle.ones([side, side], DType::F32)?;
                assert!(cycle.report().arrays[0].in_workspace);
                let w = trainer.full([side, side], 0.5, DType::F32)?;
                Ok(Setup {
                    keep: vec![trainer],
                    cycle: Some(cycle),
                    x,
                    w,
                })
            },
            &|x| {
                x.attach(&out)?;
                // The handle stays valid and the copy holds the values.
                assert!(x.to_vec::<f32>()?.iter().all(|&v| v == 1.0));
                Ok(())
            },
            &|x| x.manager().is_ok_and(|m| m == out),
        );
        out.close()?;
        result
    }
}
