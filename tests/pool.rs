//! The CPU worker pool: `NDSCOPE_NUM_THREADS` sets its size, and kernels split across threads
//! give the results of the same kernels on one thread.
//!
//! The pool's size is fixed at its first use, process-wide, so the one-thread run happens in a
//! child process: this same binary, running `one_thread_child` with `NDSCOPE_NUM_THREADS=1`.
//! On its own, the child test does nothing.

use std::process::Command;

use ndscope::{manual_seed, DType, Manager, Result, Transpose};

const CHILD_VAR: &str = "NDSCOPE_TEST_POOL_CHILD";
const RESULT_PREFIX: &str = "pool-results:";

/// Runs kernels that take their parallel paths (each input is past the split threshold) and
/// returns, for each, its sum and about 3,000 of its elements spread evenly (a split that went
/// wrong spoils whole chunks), in f64.
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
        ])
    });
    m.close()?;
    out
}

#[test]
fn kernels_agree_with_one_thread_and_the_variable_sets_the_size() {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    if std::env::var_os("NDSCOPE_NUM_THREADS").is_none() {
        assert_eq!(ndscope::num_threads(), threads);
    }
    let here = large_kernels().expect("kernels run");
    let child = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "one_thread_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_VAR, "1")
        .env("NDSCOPE_NUM_THREADS", "1")
        .output()
        .expect("child runs");
    let stdout = String::from_utf8_lossy(&child.stdout);
    let head: String = stdout.chars().take(2000).collect();
    assert!(child.status.success(), "child failed: {head}");
    let line = stdout
        .lines()
        .find_map(|l| l.split_once(RESULT_PREFIX).map(|(_, rest)| rest))
        .unwrap_or_else(|| panic!("no results from the child: {head}"));
    let there: Vec<Vec<f64>> = line
        .split(';')
        .map(|part| {
            part.split(',')
                .map(|x| x.parse().expect("a number"))
                .collect()
        })
        .collect();
    assert_eq!(here.len(), there.len());
    for (i, (a, b)) in here.iter().zip(&there).enumerate() {
        assert_eq!(a.len(), b.len(), "kernel {i}");
        for (j, (x, y)) in a.iter().zip(b).enumerate() {
            // Sums may associate differently; everything else is the same arithmetic.
            assert!(
                (x - y).abs() <= 1e-5 * x.abs().max(1.0),
                "kernel {i} element {j}: {x} with the pool, {y} on one thread"
            );
        }
    }
}

/// Child of the test above: reports the pool size and the kernels' results on stdout.
#[test]
fn one_thread_child() {
    if std::env::var_os(CHILD_VAR).is_none() {
        return;
    }
    assert_eq!(
        ndscope::num_threads(),
        1,
        "NDSCOPE_NUM_THREADS=1 sets one thread"
    );
    let results = large_kernels().expect("kernels run");
    let parts: Vec<String> = results
        .iter()
        .map(|r| {
            r.iter()
                .map(|x| format!("{x:e}"))
                .collect::<Vec<_>>()
                .join(",")
        })
        .collect();
    println!("{RESULT_PREFIX}{}", parts.join(";"));
}
