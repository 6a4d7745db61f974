//! Setting up a CUDA device (issue 17, part c): a failed setup is reported where the device is
//! first asked for, releases what it created and is tried again; a cold setup does not run under
//! the arena lock.
//!
//! A device is set up once per process, so each test re-runs this test binary as a child process
//! (with `NDSCOPE_SETUP_CHILD` set) in the environment it needs. Without a usable GPU each test
//! prints why it skipped (`NDSCOPE_REQUIRE_GPU=1` makes that a failure). Parts that count driver
//! calls read the simulator's counters and skip that part on a real driver.

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ndscope::{Device, Error, Manager};

/// Whether this process is the child of `test`.
fn is_child(test: &str) -> bool {
    std::env::var("NDSCOPE_SETUP_CHILD").is_ok_and(|v| v == test)
}

/// Runs `test` of this binary in a child process with `env` set, and asserts that it passed.
/// `false` (after printing why) when there is no GPU to run it on.
fn run_child(test: &str, env: &[(&str, &str)]) -> bool {
    if Device::cuda_count() == 0 {
        if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
            panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU");
        }
        println!("skipped on cuda: no CUDA device");
        return false;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("NDSCOPE_SETUP_CHILD", test);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("running the child test");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "the child run of {test} failed:\n{stdout}\n{stderr}"
    );
    true
}

/// A fresh empty directory under the system's temporary directory.
fn fresh_dir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "ndscope-{tag}-{}-{:?}",
        std::process::id(),
        Instant::now()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The simulator's counters, read in-process from the loaded driver, or `None` on a real driver.
fn sim_stats() -> Option<HashMap<String, u64>> {
    type Stats = unsafe extern "C" fn(*mut u64, usize) -> usize;
    type Name = unsafe extern "C" fn(usize) -> *const std::ffi::c_char;
    // SAFETY: RTLD_NOLOAD only looks up a library the process already loaded; the symbols, when
    // present, have the simulator's documented signatures.
    unsafe {
        let lib = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOLOAD | libc::RTLD_NOW);
        if lib.is_null() {
            return None;
        }
        let stats = libc::dlsym(lib, c"cudasim_stats".as_ptr());
        let name = libc::dlsym(lib, c"cudasim_stat_name".as_ptr());
        if stats.is_null() || name.is_null() {
            libc::dlclose(lib);
            return None;
        }
        let stats: Stats = std::mem::transmute(stats);
        let name: Name = std::mem::transmute(name);
        let mut out = [0u64; 64];
        let n = stats(out.as_mut_ptr(), out.len()).min(out.len());
        let map = (0..n)
            .map(|i| {
                let s = std::ffi::CStr::from_ptr(name(i))
                    .to_string_lossy()
                    .into_owned();
                (s, out[i])
            })
            .collect();
        libc::dlclose(lib);
        Some(map)
    }
}

/// A setup that fails (injected with `NDSCOPE_CUDA_FAIL_SETUP=1`) is reported by
/// `Manager::new_base_on` with its cause, releases the staging memory and cuBLAS workspace it had
/// allocated, and the next call sets the device up and works.
#[test]
fn failed_setup_is_reported_released_and_retried() {
    const NAME: &str = "failed_setup_is_reported_released_and_retried";
    if !is_child(NAME) {
        let cache = fresh_dir("setup-cache");
        run_child(
            NAME,
            &[
                ("NDSCOPE_CUDA_FAIL_SETUP", "1"),
                ("NDSCOPE_KERNEL_CACHE", cache.to_str().unwrap()),
            ],
        );
        let _ = std::fs::remove_dir_all(cache);
        return;
    }
    let dev = Device::Cuda(0);
    let err = Manager::new_base_on(dev).expect_err("the first setup fails (injected)");
    match &err {
        Error::DeviceUnavailable { device, reason, .. } => {
            assert_eq!(*device, dev);
            assert!(reason.contains("NDSCOPE_CUDA_FAIL_SETUP"), "{err}");
        }
        other => panic!("expected DeviceUnavailable, got {other}"),
    }
    assert!(err.to_string().contains("NDSCOPE_CUDA_FAIL_SETUP"), "{err}");
    if let Some(stats) = sim_stats() {
        // Two page-locked staging buffers and the cuBLAS workspace were allocated and freed.
        assert!(stats["host_allocs"] >= 2, "{stats:?}");
        assert!(
            stats["frees"] > stats["host_allocs"],
            "a failed setup freed what it allocated: {stats:?}"
        );
    }
    // Tried again: the device works now.
    let m = Manager::new_base_on(dev).expect("the second setup succeeds");
    let a = m.from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    let b = a.add(&a).unwrap();
    assert_eq!(b.to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    m.close().unwrap();
}

/// A cold setup (an NVRTC compile, no kernel cache) runs before the arena lock is taken: CPU
/// managers on another thread keep working while it runs.
#[test]
fn cold_setup_does_not_hold_the_arena_lock() {
    const NAME: &str = "cold_setup_does_not_hold_the_arena_lock";
    if !is_child(NAME) {
        let cache = fresh_dir("cold-cache");
        run_child(
            NAME,
            &[
                ("NDSCOPE_KERNEL_CACHE", cache.to_str().unwrap()),
                // The simulator's NVRTC caches its compiled objects: off, the compile is cold.
                ("CUDASIM_CACHE", "off"),
            ],
        );
        let _ = std::fs::remove_dir_all(cache);
        return;
    }
    let done = Arc::new(AtomicBool::new(false));
    let setup = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let start = Instant::now();
            // The first op on a new manager of the device: the device is set up here.
            let m = Manager::new_base_on(Device::Cuda(0)).unwrap();
            let a = m.zeros([4], ndscope::DType::F32).unwrap();
            a.close().unwrap();
            m.close().unwrap();
            done.store(true, Ordering::SeqCst);
            start.elapsed()
        })
    };
    // CPU work on this thread, each op needing the arena lock: record when each finishes.
    let start = Instant::now();
    let mut finished = Vec::new();
    while !done.load(Ordering::SeqCst) {
        let m = Manager::new_base();
        let a = m.from_slice(&[1.0f32, 2.0], [2]).unwrap();
        let b = a.mul(&a).unwrap();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.0, 4.0]);
        m.close().unwrap();
        finished.push(start.elapsed());
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = setup.join().unwrap();
    assert!(
        took > Duration::from_millis(200),
        "the setup was not cold ({took:?}): nothing to show"
    );
    // The middle half of the setup: CPU ops completed there, so it did not hold the lock.
    let (lo, hi) = (took / 4, took * 3 / 4);
    let during = finished.iter().filter(|t| **t > lo && **t < hi).count();
    assert!(
        during > 0,
        "no CPU op finished during the middle of a {took:?} device setup \
         ({} ops in all): the setup held the arena lock",
        finished.len()
    );
}

/// The kernel cache files (`kernels-*.bin`) in `dir`.
fn cache_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            name.starts_with("kernels-") && name.ends_with(".bin")
        })
        .collect();
    files.sort();
    files
}

/// A damaged kernel cache entry (its key intact, the compiled kernels after it overwritten) is
/// compiled again and replaced: the device still works.
#[test]
fn damaged_kernel_cache_entry_is_recompiled_and_replaced() {
    const NAME: &str = "damaged_kernel_cache_entry_is_recompiled_and_replaced";
    if is_child(NAME) {
        let m = Manager::new_base_on(Device::Cuda(0)).expect("the device sets up");
        let a = m.from_slice(&[1.0f32, 2.0, 3.0], [3]).unwrap();
        let b = a.mul(&a).unwrap();
        assert_eq!(b.to_vec::<f32>().unwrap(), vec![1.0, 4.0, 9.0]);
        m.close().unwrap();
        return;
    }
    let cache = fresh_dir("damaged-cache");
    let env = [("NDSCOPE_KERNEL_CACHE", cache.to_str().unwrap())];
    // A first process compiles the kernels and writes the entry.
    if !run_child(NAME, &env) {
        return;
    }
    let files = cache_files(&cache);
    assert_eq!(files.len(), 1, "one cache entry: {files:?}");
    let good = std::fs::read(&files[0]).unwrap();
    // The key is the entry's first five lines; the compiled kernels follow.
    let key_end = good
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .nth(4)
        .map(|(i, _)| i + 1)
        .expect("a five-line key");
    let mut damaged = good[..key_end].to_vec();
    damaged.extend(std::iter::repeat_n(0x5a_u8, 4096));
    std::fs::write(&files[0], &damaged).unwrap();
    // A second process finds the damaged entry: it compiles again, works, and replaces it.
    run_child(NAME, &env);
    let now = std::fs::read(&files[0]).unwrap();
    assert_ne!(now, damaged, "the damaged entry was replaced");
    assert_eq!(now, good, "by the same compiled kernels");
    assert_eq!(cache_files(&cache).len(), 1);
    let _ = std::fs::remove_dir_all(cache);
}
