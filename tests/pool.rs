//! The CPU worker pool: `NDSCOPE_NUM_THREADS` sets its size, and every kernel gives the same
//! bits whatever the size (chunk boundaries and reduction orders depend on the problem's size,
//! never on the thread count).
//!
//! The pool's size is fixed at its first use, process-wide, so each thread count runs in a
//! child process: this same binary, running `thread_count_child` with `NDSCOPE_NUM_THREADS`
//! set. On its own, the child test does nothing.

use std::process::Command;

use ndscope::{manual_seed, Activation, DType, Dense, Manager, Result, Transpose};

const CHILD_VAR: &str = "NDSCOPE_TEST_POOL_CHILD";
const RESULT_PREFIX: &str = "pool-results:";

/// The thread counts compared (the issue's: one, the two of a small machine, odd counts that
/// divide nothing evenly, and a 16-core server's).
const THREAD_COUNTS: [usize; 5] = [1, 2, 3, 7, 16];

/// Names of the kernels [`large_kernels`] runs, in order, for messages.
const KERNELS: [&str; 23] = [
    "add + relu (1M)",
    "sum_all f32 (1M)",
    "sum_all i64 (1M)",
    "argmax (1M)",
    "sum over axis 0 of [300, 700]",
    "softmax over axis 1 of [300, 700]",
    "transpose [300, 700]",
    "matmul [256, 300] · [300, 700]",
    "matmul_t [16, 700] · [300, 700]ᵀ",
    "sgd_dense_update_ weights",
    "sgd_dense_update_ velocities",
    "log_softmax over axis 1 of [300, 700]",
    "sum over axis 0 of [4096, 64] (tall)",
    "sum over axis 1 of [4, 100000] (few long rows)",
    "mean over axis 1 of [64, 8192]",
    "max over axis 1 of [300, 700]",
    "addmm_ with a transposed left operand, [300, 700]",
    "matmul [256, 784] · [784, 1024] (MLP layer, batch 256)",
    "matmul [16, 784] · [784, 1024] (MLP layer, batch 16)",
    "Dense (packed weights) 784→1024 with bias and ReLU, batch 1",
    "Dense (packed weights) 784→1024 with bias and ReLU, batch 64",
    "matmul bf16 [256, 784] · [784, 1024]",
    "addmm_ bf16 with a transposed left operand, [300, 700]",
];

/// Runs kernels that take their parallel paths (each input is past the split threshold) and
/// returns, for each, its sum and about 3,000 of its elements spread evenly (a split that went
/// wrong spoils whole chunks), in f64 (exact for f32 and i64 values of this size).
fn large_kernels() -> Result<Vec<Vec<f64>>> {
    manual_seed(7);
    let m = Manager::new_base();
    let out = m.scope(|s| {
        let as_f64 = |a: &ndscope::NDArray| -> Result<Vec<f64>> {
            let all = a.to_dtype(DType::F64)?.to_vec::<f64>()?;
            let stride = all.len().div_ceil(3000).max(1);
            let mut picked: Vec<f64> = all.iter().step_by(stride).copied().collect();
            picked.push(all.iter().sum());
            Ok(picked)
        };
        let big = s.randn([1 << 20], DType::F32)?; // 1M elements
        let wide = s.randn([300, 700], DType::F32)?;
        let a = s.randn([256, 300], DType::F32)?;
        let x = s.randn([16, 300], DType::F32)?;
        let g = s.randn([16, 700], DType::F32)?;
        let w = s.randn([300, 700], DType::F32)?;
        let v = s.randn([300, 700], DType::F32)?;
        w.sgd_dense_update_(&v, &x, &g, 0.01, 0.9)?;
        let ints = s.arange(0.0, (1 << 20) as f64, 1.0, DType::I64)?;
        let tall = s.randn([4096, 64], DType::F32)?;
        let long_rows = s.randn([4, 100_000], DType::F32)?;
        let rows = s.randn([64, 8192], DType::F32)?;
        let c = s.randn([300, 700], DType::F32)?;
        let at = s.randn([256, 300], DType::F32)?;
        let bt = s.randn([256, 700], DType::F32)?;
        c.addmm_(&at, &bt, Transpose::Left, 0.5, 2.0)?;
        let x256 = s.randn([256, 784], DType::F32)?;
        let x16 = s.randn([16, 784], DType::F32)?;
        let w1 = s.randn([784, 1024], DType::F32)?;
        let bias = s.randn([1024], DType::F32)?;
        let dense = Dense::new(&w1, Some(&bias), Activation::Relu)?;
        let x1 = s.randn([1, 784], DType::F32)?;
        let x64 = s.randn([64, 784], DType::F32)?;
        let (x256h, w1h) = (x256.to_dtype(DType::BF16)?, w1.to_dtype(DType::BF16)?);
        let ch = s.randn([300, 700], DType::F32)?.to_dtype(DType::BF16)?;
        ch.addmm_(
            &at.to_dtype(DType::BF16)?,
            &bt.to_dtype(DType::BF16)?,
            Transpose::Left,
            0.5,
            2.0,
        )?;
        Ok(vec![
            as_f64(&big.add(&big)?.relu()?)?,
            as_f64(&big.sum_all()?)?,
            as_f64(&ints.sum_all()?)?,
            as_f64(&big.argmax(0)?)?,
            as_f64(&wide.sum(&[0], false)?)?,
            as_f64(&wide.softmax(1)?)?,
            as_f64(&wide.transpose()?)?,
            as_f64(&a.matmul(&wide)?)?,
            as_f64(&g.matmul_t(&w, Transpose::Right)?)?,
            as_f64(&w)?,
            as_f64(&v)?,
            as_f64(&wide.log_softmax(1)?)?,
            as_f64(&tall.sum(&[0], false)?)?,
            as_f64(&long_rows.sum(&[1], false)?)?,
            as_f64(&rows.mean(&[1], false)?)?,
            as_f64(&wide.max(1, false)?)?,
            as_f64(&c)?,
            as_f64(&x256.matmul(&w1)?)?,
            as_f64(&x16.matmul(&w1)?)?,
            as_f64(&dense.forward(&x1)?)?,
            as_f64(&dense.forward(&x64)?)?,
            as_f64(&x256h.matmul(&w1h)?)?,
            as_f64(&ch)?,
        ])
    });
    m.close()?;
    out
}

/// The kernels' results in a child process with `threads` pool threads, as bit patterns.
fn results_with(threads: usize) -> Vec<Vec<u64>> {
    let child = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "thread_count_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, threads.to_string())
        .env("NDSCOPE_NUM_THREADS", threads.to_string())
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let head: String = stdout.chars().take(2000).collect();
    assert!(
        child.status.success(),
        "child ({threads} threads) failed: {head}"
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(RESULT_PREFIX).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no results from the child ({threads} threads): {head}"));
    line.split(';')
        .map(|part| {
            part.split(',')
                .map(|x| u64::from_str_radix(x, 16).expect("a bit pattern"))
                .collect()
        })
        .collect()
}

fn bits(results: &[Vec<f64>]) -> Vec<Vec<u64>> {
    results
        .iter()
        .map(|r| r.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// Asserts that `got` (with `threads` threads) has the bits of `want` (one thread).
fn assert_same_bits(threads: usize, got: &[Vec<u64>], want: &[Vec<u64>]) {
    assert_eq!(got.len(), KERNELS.len(), "{threads} threads: kernels");
    assert_eq!(want.len(), KERNELS.len());
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.len(), b.len(), "kernel {i} ({})", KERNELS[i]);
        if let Some(j) = (0..a.len()).find(|&j| a[j] != b[j]) {
            panic!(
                "kernel {i} ({}) element {j}: {:e} with {threads} threads, {:e} on one thread \
                 (results must be bit-identical for any thread count)",
                KERNELS[i],
                f64::from_bits(a[j]),
                f64::from_bits(b[j])
            );
        }
    }
}

#[test]
fn kernels_give_the_same_bits_for_any_thread_count() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if std::env::var_os("NDSCOPE_NUM_THREADS").is_none() {
        assert_eq!(ndscope::num_threads(), threads);
    }
    let one = results_with(1);
    // This process, whatever its pool size (CI runs this file with 1, the default and 16).
    assert_same_bits(
        ndscope::num_threads(),
        &bits(&large_kernels().expect("kernels run")),
        &one,
    );
    for n in THREAD_COUNTS.into_iter().skip(1) {
        assert_same_bits(n, &results_with(n), &one);
    }
}

/// Child of the test above: checks the pool size and reports the kernels' results on stdout.
#[test]
fn thread_count_child() {
    let Some(wanted) = std::env::var_os(CHILD_VAR) else {
        return;
    };
    let wanted: usize = wanted.to_string_lossy().parse().expect("a thread count");
    assert_eq!(
        ndscope::num_threads(),
        wanted,
        "NDSCOPE_NUM_THREADS={wanted} sets {wanted} threads"
    );
    let results = large_kernels().expect("kernels run");
    let parts: Vec<String> = bits(&results)
        .iter()
        .map(|r| {
            r.iter()
                .map(|x| format!("{x:x}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    println!("{RESULT_PREFIX}{}", parts.join(";"));
}

const ENV_CHILD_VAR: &str = "NDSCOPE_TEST_POOL_ENV_CHILD";
const THREADS_PREFIX: &str = "pool-threads:";

/// Runs `report_threads_child` with `NDSCOPE_NUM_THREADS=value`: the pool size it got and what
/// it said on stderr.
fn threads_for(value: &str) -> (usize, String) {
    let child = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "report_threads_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ENV_CHILD_VAR, "1")
        .env("NDSCOPE_NUM_THREADS", value)
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let stderr = String::from_utf8_lossy(&child.stderr).into_owned();
    assert!(child.status.success(), "child failed: {stdout}\n{stderr}");
    let threads = stdout
        .lines()
        .find_map(|l| l.split_once(THREADS_PREFIX).map(|(_, rest)| rest))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no thread count from the child: {stdout}"));
    (threads, stderr)
}

/// A bad `NDSCOPE_NUM_THREADS` is said on stderr (naming the variable and the value) when the
/// pool starts, and the default (or the maximum) is used instead: the pool starts lazily, inside
/// kernels that cannot fail for it, exactly as a bad `NDSCOPE_MAX_HOST_BYTES` is a warning and no
/// limit.
#[test]
fn a_bad_thread_count_is_reported_and_replaced() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let max = (4 * cores).clamp(64, 1024);
    assert_eq!(threads_for("3"), (3, String::new()));
    for bad in ["0", "-1", "2.5", "many", "1e2"] {
        let (threads, stderr) = threads_for(bad);
        assert_eq!(
            threads, cores,
            "NDSCOPE_NUM_THREADS={bad:?} uses the cores available"
        );
        assert!(
            stderr.contains(&format!("NDSCOPE_NUM_THREADS={bad:?}")),
            "{bad:?}: {stderr}"
        );
        assert_eq!(
            stderr.matches("NDSCOPE_NUM_THREADS").count(),
            1,
            "said once: {stderr}"
        );
    }
    for huge in ["100000", "99999999999999999999999999"] {
        let (threads, stderr) = threads_for(huge);
        assert_eq!(threads, max, "NDSCOPE_NUM_THREADS={huge} is clamped");
        assert!(
            stderr.contains(&format!("NDSCOPE_NUM_THREADS={huge:?}"))
                && stderr.contains(&format!("using {max} threads")),
            "{stderr}"
        );
    }
}

/// Child of the test above: starts the pool with a kernel and reports its size.
#[test]
fn report_threads_child() {
    if std::env::var_os(ENV_CHILD_VAR).is_none() {
        return;
    }
    // A parallel kernel starts the pool (twice: the warning comes once).
    for _ in 0..2 {
        let m = Manager::new_base();
        let x = m.ones([1 << 16], DType::F32).expect("ones");
        assert_eq!(
            x.sum_all().and_then(|s| s.to_scalar::<f32>()).ok(),
            Some(65536.0)
        );
        m.close().expect("close");
    }
    println!("{THREADS_PREFIX}{}", ndscope::num_threads());
}
