//! The CPU's f32 floating-point peak, measured: a loop of fused multiply-adds on independent
//! registers, run on a given number of threads at once ([`measure_cpu_peak`]).
//!
//! Measured rather than computed from a formula (lanes × FMA units × clock), because the
//! formula's terms are not known reliably at run time: AMD's Zen 4 runs AVX-512 on 256-bit units
//! (double pumping, so 16 lanes give the throughput of 8 × 2), Intel parts have one or two
//! 512-bit FMA units depending on the model, and the clock under a full FMA load is neither the
//! base nor the turbo frequency the CPU reports.

use std::hint::black_box;
use std::sync::{Barrier, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use super::pool;
use crate::error::{Ctx, Result};

/// The f32 floating-point peak of this CPU on some threads, measured by
/// [`measure_cpu_peak`]. Its [`Display`](std::fmt::Display) reads e.g.
/// `226.1 GFLOP/s f32 (2 threads × 113.0, avx512f FMA, measured)`.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct CpuPeak {
    /// f32 GFLOP/s of all the threads together (a fused multiply-add counts as two operations
    /// per lane).
    pub gflops: f64,
    /// `gflops / threads`: what one thread did while all of them ran.
    pub per_thread: f64,
    /// The threads the loop ran on at once.
    pub threads: usize,
    /// f32 lanes per vector of the instructions used: 16 for AVX-512F, 8 for AVX2, 4 for NEON,
    /// 1 for the portable loop.
    pub lanes: usize,
    /// The instructions used: `"avx512f"`, `"avx2+fma"`, `"neon"` or `"scalar"` (the portable
    /// loop of [`f32::mul_add`]).
    pub isa: &'static str,
}

impl std::fmt::Display for CpuPeak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = if self.threads == 1 { "" } else { "s" };
        write!(
            f,
            "{:.1} GFLOP/s f32 ({} thread{plural} × {:.1}, {} FMA, measured)",
            self.gflops, self.threads, self.per_thread, self.isa
        )
    }
}

/// Measures the CPU's f32 floating-point peak on `threads` threads at once: the figure to
/// compare a kernel's or a training step's GFLOP/s with.
///
/// # Method
///
/// `threads` new OS threads (not ndscope's pool, which shares a small job among few threads)
/// run a loop of fused multiply-adds on independent vector accumulators (enough of them to hide
/// the instruction's latency, so the loop is bound by the FMA units' throughput alone), with
/// the widest f32 FMA this CPU has, detected at run time: AVX-512F (16 lanes), else AVX2 with
/// FMA (8 lanes) on x86-64, NEON (4 lanes) on AArch64, else a portable loop of
/// [`f32::mul_add`] (1 lane; `isa` says `"scalar"`). The threads start together (a barrier)
/// and each runs for about 20 ms; this is done 3 times and the best repetition kept. The peak
/// is the operations of all the threads (2 per lane per FMA) over the wall time from the first
/// thread's start to the last one's end. The call takes about 60 ms.
///
/// # Why measured
///
/// A formula (lanes × FMA units × clock) needs figures the CPU does not report reliably: AMD's
/// Zen 4 runs 512-bit FMAs on two 256-bit units (16 lanes, the throughput of 8 × 2); Intel
/// parts have one or two 512-bit FMA units depending on the model; the clock under a full FMA
/// load on every core is neither the base nor the turbo frequency. Measuring gives what the
/// machine delivers now, under the same conditions as the work it is compared with. Since it is
/// measured, the figure varies a little from run to run (and drops when other work shares the
/// cores).
///
/// # Errors
///
/// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when `threads` is 0 or more than
/// the larger of 4 × the cores the process may use and 64 (at most 1024), the limit of
/// `NDSCOPE_NUM_THREADS`, or when a thread cannot be started.
///
/// ```
/// let peak = ndscope::measure_cpu_peak(1)?;
/// assert!(peak.gflops > 0.0 && peak.threads == 1);
/// println!("{peak}");
/// assert!(ndscope::measure_cpu_peak(0).is_err());
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn measure_cpu_peak(threads: usize) -> Result<CpuPeak> {
    let ctx = Ctx::new("measure_cpu_peak");
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    let max = pool::max_threads(cores);
    if threads == 0 {
        return Err(ctx.invalid("needs at least one thread"));
    }
    if threads > max {
        return Err(ctx.invalid(format!(
            "{threads} threads is more than the {max} allowed with {cores} cores (the larger \
             of 4 × the cores and 64, as for NDSCOPE_NUM_THREADS)"
        )));
    }
    let isa = Isa::detect();
    let runs = run_threads(isa, threads).map_err(|e| ctx.invalid(e))?;
    let gflops = runs
        .iter()
        .map(|run| run.gflops(isa))
        .fold(0.0f64, f64::max);
    Ok(CpuPeak {
        gflops,
        per_thread: gflops / threads as f64,
        threads,
        lanes: isa.lanes(),
        isa: isa.name(),
    })
}

/// How long each thread runs in one repetition.
const RUN: Duration = Duration::from_millis(20);

/// Repetitions; the best is kept.
const REPEAT: usize = if cfg!(miri) { 1 } else { 3 };

/// Loop iterations per kernel call; a thread checks the clock between calls (a call is about
/// 10–20 µs of FMAs on a current core, so reading the clock costs well under 1%).
const BLOCK: usize = if cfg!(miri) { 4 } else { 4096 };

/// The instructions the loop runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Under Miri `detect` returns `Scalar` only.
#[cfg_attr(miri, allow(dead_code))]
enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
    #[cfg(target_arch = "aarch64")]
    Neon,
    Scalar,
}

impl Isa {
    /// The widest f32 FMA of this CPU (the portable loop under Miri, which runs no intrinsics
    /// of these).
    fn detect() -> Isa {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                return Isa::Avx2Fma;
            }
        }
        #[cfg(all(target_arch = "aarch64", not(miri)))]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Isa::Neon;
            }
        }
        Isa::Scalar
    }

    fn name(self) -> &'static str {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => "avx512f",
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => "avx2+fma",
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => "neon",
            Isa::Scalar => "scalar",
        }
    }

    fn lanes(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => 16,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => 8,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => 4,
            Isa::Scalar => 1,
        }
    }

    /// Vector accumulators the kernel keeps (each FMA of an iteration updates one).
    fn accumulators(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => ACC_AVX512,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => ACC_AVX2,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => ACC_NEON,
            Isa::Scalar => ACC_SCALAR,
        }
    }

    /// f32 operations of one kernel call of [`BLOCK`] iterations.
    fn flops_per_block(self) -> f64 {
        (2 * BLOCK * self.accumulators() * self.lanes()) as f64
    }

    /// [`BLOCK`] iterations of the kernel: `acc ← acc · a + b` on every accumulator, which
    /// converges to `b / (1 − a)` for `0 < a < 1` (no overflow, no subnormals). Returns the sum
    /// of the accumulators, for the caller to pass to `black_box`.
    fn block(self, a: f32, b: f32) -> f32 {
        match self {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` returns `Avx512` only when the CPU has AVX-512F.
            Isa::Avx512 => unsafe { fma_avx512(BLOCK, a, b) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `detect` returns `Avx2Fma` only when the CPU has AVX2 and FMA.
            Isa::Avx2Fma => unsafe { fma_avx2(BLOCK, a, b) },
            #[cfg(target_arch = "aarch64")]
            // SAFETY: `detect` returns `Neon` only when the CPU has NEON.
            Isa::Neon => unsafe { fma_neon(BLOCK, a, b) },
            Isa::Scalar => fma_scalar(BLOCK, a, b),
        }
    }
}

/// One repetition: when each thread started and ended, and the kernel calls it made.
struct Run {
    spans: Vec<(Instant, Instant, u64)>,
}

impl Run {
    /// The repetition's GFLOP/s: all the threads' operations over the time from the first
    /// start to the last end.
    fn gflops(&self, isa: Isa) -> f64 {
        let (Some(start), Some(end)) = (
            self.spans.iter().map(|s| s.0).min(),
            self.spans.iter().map(|s| s.1).max(),
        ) else {
            return 0.0;
        };
        let blocks: u64 = self.spans.iter().map(|s| s.2).sum();
        // At least a nanosecond: Miri's clock may not move during one short call.
        let seconds = end.duration_since(start).as_secs_f64().max(1e-9);
        blocks as f64 * isa.flops_per_block() / seconds / 1e9
    }
}

/// Runs the kernel on `threads` new threads, [`REPEAT`] times, all starting each repetition
/// together. The threads wait until every one has been started, so a thread that cannot be
/// started leaves none waiting: the others are told to stop, and the error is returned.
fn run_threads(isa: Isa, threads: usize) -> std::result::Result<Vec<Run>, String> {
    // `None` while threads are being started, then whether to go.
    let gate = (Mutex::new(None::<bool>), Condvar::new());
    let barrier = Barrier::new(threads);
    let open = |go: bool| {
        *gate.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(go);
        gate.1.notify_all();
    };
    thread::scope(|s| {
        let mut handles = Vec::with_capacity(threads);
        for i in 0..threads {
            let (gate, barrier) = (&gate, &barrier);
            let spawned = thread::Builder::new()
                .name(format!("ndscope-peak-{i}"))
                .spawn_scoped(s, move || {
                    let mut go = gate.0.lock().unwrap_or_else(PoisonError::into_inner);
                    while go.is_none() {
                        go = gate.1.wait(go).unwrap_or_else(PoisonError::into_inner);
                    }
                    if *go != Some(true) {
                        return Vec::new();
                    }
                    drop(go);
                    (0..REPEAT).map(|_| one_thread(isa, barrier)).collect()
                });
            match spawned {
                Ok(handle) => handles.push(handle),
                Err(e) => {
                    open(false);
                    return Err(format!("cannot start thread {i} of {threads}: {e}"));
                }
            }
        }
        open(true);
        let mut runs: Vec<Run> = (0..REPEAT)
            .map(|_| Run {
                spans: Vec::with_capacity(threads),
            })
            .collect();
        for handle in handles {
            let spans = handle
                .join()
                .map_err(|_| "a measuring thread panicked".to_string())?;
            for (run, span) in runs.iter_mut().zip(spans) {
                run.spans.push(span);
            }
        }
        Ok(runs)
    })
}

/// One thread's part of one repetition: waits for the others, then calls the kernel until
/// [`RUN`] has passed (once under Miri). Returns its start, its end and the calls it made.
fn one_thread(isa: Isa, barrier: &Barrier) -> (Instant, Instant, u64) {
    let (a, b) = (0.999_9_f32, 1e-4_f32);
    barrier.wait();
    let start = Instant::now();
    let mut blocks = 0u64;
    let mut sink = 0.0f32;
    loop {
        // The operands through `black_box` at every call: the kernel is a pure function, and
        // with operands it could see it would be called once, outside the loop (or folded).
        sink += isa.block(black_box(a), black_box(b));
        blocks += 1;
        if cfg!(miri) || start.elapsed() >= RUN {
            break;
        }
    }
    let end = Instant::now();
    // The results are used, so no call can be removed.
    black_box(sink);
    (start, end, blocks)
}

#[cfg(target_arch = "x86_64")]
const ACC_AVX512: usize = 16;
#[cfg(target_arch = "x86_64")]
const ACC_AVX2: usize = 12;
#[cfg(target_arch = "aarch64")]
const ACC_NEON: usize = 16;
const ACC_SCALAR: usize = 8;

// Accumulators per kernel: an FMA's latency (4–5 cycles) times the FMA instructions a core
// issues per cycle (up to 2 for 512-bit vectors, 4 for NEON on some cores) must not exceed
// them, or the loop measures latency; and they must fit in the registers (32 for AVX-512 and
// NEON, 16 for AVX2, with two more for the operands) or it measures spills.

/// `iters` iterations of `acc ← acc · a + b` on [`ACC_AVX512`] vectors of 16 lanes; returns
/// their sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_avx512(iters: usize, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::*;
    let (va, vb) = (_mm512_set1_ps(a), _mm512_set1_ps(b));
    let mut acc = [_mm512_setzero_ps(); ACC_AVX512];
    for (i, v) in acc.iter_mut().enumerate() {
        *v = _mm512_set1_ps(i as f32);
    }
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm512_fmadd_ps(*v, va, vb);
        }
    }
    let mut sum = _mm512_setzero_ps();
    for v in acc {
        sum = _mm512_add_ps(sum, v);
    }
    _mm512_reduce_add_ps(sum)
}

/// `iters` iterations of `acc ← acc · a + b` on [`ACC_AVX2`] vectors of 8 lanes; returns their
/// sum.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn fma_avx2(iters: usize, a: f32, b: f32) -> f32 {
    use std::arch::x86_64::*;
    let (va, vb) = (_mm256_set1_ps(a), _mm256_set1_ps(b));
    let mut acc = [_mm256_setzero_ps(); ACC_AVX2];
    for (i, v) in acc.iter_mut().enumerate() {
        *v = _mm256_set1_ps(i as f32);
    }
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, va, vb);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for v in acc {
        sum = _mm256_add_ps(sum, v);
    }
    let half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps::<1>(sum));
    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)))
}

/// `iters` iterations of `acc ← acc · a + b` (`vfmaq_f32(b, acc, a)`) on [`ACC_NEON`] vectors
/// of 4 lanes; returns their sum.
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
fn fma_neon(iters: usize, a: f32, b: f32) -> f32 {
    use std::arch::aarch64::*;
    // SAFETY: this function runs with NEON enabled, and these intrinsics only take and return
    // registers. (Rust versions differ on whether they need `unsafe` in such a function.)
    #[allow(unused_unsafe)]
    let sum = unsafe {
        let (va, vb) = (vdupq_n_f32(a), vdupq_n_f32(b));
        let mut acc = [vdupq_n_f32(0.0); ACC_NEON];
        for (i, v) in acc.iter_mut().enumerate() {
            *v = vdupq_n_f32(i as f32);
        }
        for _ in 0..iters {
            for v in acc.iter_mut() {
                *v = vfmaq_f32(vb, *v, va);
            }
        }
        let mut sum = vdupq_n_f32(0.0);
        for v in acc {
            sum = vaddq_f32(sum, v);
        }
        vaddvq_f32(sum)
    };
    sum
}

/// `iters` iterations of `acc ← acc · a + b` ([`f32::mul_add`], one rounding) on
/// [`ACC_SCALAR`] independent f32s; returns their sum.
fn fma_scalar(iters: usize, a: f32, b: f32) -> f32 {
    let mut acc = [0.0f32; ACC_SCALAR];
    for (i, v) in acc.iter_mut().enumerate() {
        *v = i as f32;
    }
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = v.mul_add(a, b);
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(peak: CpuPeak, threads: usize) {
        // No figure is asserted: it depends on the machine and on what else runs on it.
        eprintln!("{peak}");
        assert_eq!(peak.threads, threads);
        assert!(peak.gflops.is_finite() && peak.gflops > 0.0, "{peak:?}");
        assert!(
            peak.per_thread.is_finite() && peak.per_thread > 0.0,
            "{peak:?}"
        );
        let total = peak.per_thread * threads as f64;
        assert!(
            (total - peak.gflops).abs() <= 1e-9 * peak.gflops,
            "{peak:?}"
        );
        assert!(!peak.isa.is_empty());
        let lanes = match peak.isa {
            "avx512f" => 16,
            "avx2+fma" => 8,
            "neon" => 4,
            "scalar" => 1,
            other => panic!("unknown isa {other:?}"),
        };
        assert_eq!(peak.lanes, lanes, "{peak:?}");
        let text = peak.to_string();
        assert!(
            text.contains("GFLOP/s f32") && text.contains(peak.isa),
            "{text}"
        );
    }

    #[test]
    fn peak_on_one_and_two_threads_is_a_positive_figure() {
        check(measure_cpu_peak(1).expect("one thread"), 1);
        check(measure_cpu_peak(2).expect("two threads"), 2);
    }

    #[test]
    fn no_thread_or_too_many_is_an_invalid_argument() {
        let e = measure_cpu_peak(0).expect_err("zero threads");
        assert!(matches!(e, crate::Error::InvalidArgument { .. }), "{e}");
        let e = measure_cpu_peak(usize::MAX).expect_err("too many threads");
        assert!(matches!(e, crate::Error::InvalidArgument { .. }), "{e}");
    }

    #[test]
    #[cfg_attr(miri, ignore = "a whole block is long under Miri")]
    fn the_kernel_this_cpu_runs_computes_its_recurrence() {
        // `acc ← acc · 0.5 + 1` reaches its fixed point 2 exactly (from 0..16, in well under
        // a block's iterations) on every lane of every accumulator, whatever the instructions.
        for isa in [Isa::detect(), Isa::Scalar] {
            let want = 2.0 * (isa.accumulators() * isa.lanes()) as f32;
            assert_eq!(isa.block(0.5, 1.0), want, "{isa:?}");
        }
    }
}
