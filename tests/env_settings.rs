//! Every environment variable ndscope reads, given bad values: each says what is wrong (on
//! stderr, once, naming the variable and the value) and nothing is silently taken as something
//! else. The environment is process-wide and read once, so each case runs in a child process:
//! this same binary running `child_env_case` with `NDSCOPE_TEST_CASE` naming the checks.
//!
//! The variables: `NDSCOPE_MAX_HOST_BYTES`, `NDSCOPE_MAX_CUDA_BYTES` (a bad value refuses every
//! allocation it limits with `InvalidConfig`), `NDSCOPE_RECORD` (a path that cannot be written
//! is said at start; the program runs on), `NDSCOPE_RECORD_MAX_ENTRIES`,
//! `NDSCOPE_WORKSPACE_DEBUG` (said, then ignored). `NDSCOPE_NUM_THREADS` is tested in
//! `tests/pool.rs`, `NDSCOPE_KERNEL_CACHE` with the CUDA backend.

use std::path::PathBuf;
use std::process::{Command, Output};

use ndscope::workspace::debug_mode;
use ndscope::{
    memory_limit, memory_usage, set_memory_limit, DType, Device, Error, LimitSource, Manager,
};

const CASE: &str = "NDSCOPE_TEST_CASE";
const DONE: &str = "env-case: checked";

/// Runs the child with `case` and the variables `vars`; checks it passed, and returns its
/// output.
fn run(case: &str, vars: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args([
        "--exact",
        "child_env_case",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CASE, case);
    for var in [
        "NDSCOPE_MAX_HOST_BYTES",
        "NDSCOPE_MAX_CUDA_BYTES",
        "NDSCOPE_RECORD",
        "NDSCOPE_RECORD_MAX_ENTRIES",
        "NDSCOPE_WORKSPACE_DEBUG",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in vars {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains(DONE),
        "case {case} with {vars:?} failed:\n{stdout}\n{stderr}"
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The child: the checks of `NDSCOPE_TEST_CASE` (`NDSCOPE_TEST_VALUE` is the variable's value).
#[test]
#[ignore = "run by the tests of this file in a child process"]
fn child_env_case() {
    let case = std::env::var(CASE).expect("run by a parent test");
    let value = std::env::var("NDSCOPE_TEST_VALUE").unwrap_or_default();
    match case.as_str() {
        "bad-host-limit" => {
            let m = Manager::new_base();
            assert_eq!(memory_limit(Device::Cpu), None, "no limit is made up");
            for _ in 0..2 {
                let err = m.zeros([16], DType::F32).unwrap_err();
                assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
                let text = err.to_string();
                assert!(
                    text.contains(&format!(
                        "NDSCOPE_MAX_HOST_BYTES={value:?} is not a byte count"
                    )),
                    "{text}"
                );
                assert!(text.contains("8G"), "the grammar is shown: {text}");
            }
            assert_eq!(m.report().total_arrays(), 0, "nothing was created");
            assert_eq!(memory_usage(Device::Cpu).in_use, 0);
            // The API replaces the bad value.
            set_memory_limit(Device::Cpu, Some(1 << 20));
            m.zeros([16], DType::F32).unwrap();
            m.close().unwrap();
        }
        "host-limit" => {
            let expect: usize = std::env::var("NDSCOPE_TEST_EXPECT")
                .unwrap()
                .parse()
                .unwrap();
            assert_eq!(memory_limit(Device::Cpu), Some(expect));
            let m = Manager::new_base();
            if expect == 0 {
                let err = m.zeros([1], DType::U8).unwrap_err();
                assert!(
                    matches!(
                        err,
                        Error::OutOfMemory {
                            limit_source: LimitSource::Env("NDSCOPE_MAX_HOST_BYTES"),
                            ..
                        }
                    ),
                    "{err}"
                );
            } else {
                m.zeros([16], DType::U8).unwrap();
            }
            m.close().unwrap();
        }
        "bad-cuda-limit" => {
            // Read when the CUDA counters are first used; no limit is made up.
            assert_eq!(memory_usage(Device::Cuda(0)).limit, None);
            assert_eq!(memory_limit(Device::Cuda(1)), None);
            // The host is not limited by it.
            let m = Manager::new_base();
            m.zeros([16], DType::F32).unwrap();
            m.close().unwrap();
        }
        "workload" => {
            let m = Manager::new_base();
            let ws = m.workspace("steps", Default::default()).unwrap();
            for _ in 0..3 {
                ws.cycle(|s| s.ones([64], DType::F32).map(|_| ())).unwrap();
            }
            println!("debug mode {:?}", debug_mode());
            m.close().unwrap();
        }
        other => panic!("unknown case {other}"),
    }
    println!("{DONE}");
}

#[test]
fn a_host_limit_that_is_not_a_byte_count_refuses_allocations_naming_it() {
    for value in [
        "-0", "0.5", "1e-9", "lots", "8 G", "1.5", "-1G", "0x100", "12P",
    ] {
        let out = run(
            "bad-host-limit",
            &[
                ("NDSCOPE_MAX_HOST_BYTES", value),
                ("NDSCOPE_TEST_VALUE", value),
            ],
        );
        let err = stderr(&out);
        let said = format!("ndscope: NDSCOPE_MAX_HOST_BYTES={value:?} is not a byte count");
        assert_eq!(err.matches(&said).count(), 1, "said once at start: {err}");
    }
}

#[test]
fn host_limits_in_the_documented_grammar_are_taken() {
    for (value, expect) in [
        ("0", 0usize),
        ("1073741824", 1 << 30),
        ("8G", 8 << 30),
        ("512M", 512 << 20),
        ("64k", 64 << 10),
        ("1.5GiB", 3 << 29),
        (" 2MB ", 2 << 20),
    ] {
        let out = run(
            "host-limit",
            &[
                ("NDSCOPE_MAX_HOST_BYTES", value),
                ("NDSCOPE_TEST_EXPECT", &expect.to_string()),
            ],
        );
        assert!(!stderr(&out).contains("ndscope:"), "{}", stderr(&out));
    }
}

#[test]
fn a_cuda_limit_that_is_not_a_byte_count_is_said_and_not_made_up() {
    let out = run(
        "bad-cuda-limit",
        &[
            ("NDSCOPE_MAX_CUDA_BYTES", "0.5"),
            ("NDSCOPE_TEST_VALUE", "0.5"),
        ],
    );
    let err = stderr(&out);
    assert_eq!(
        err.matches("ndscope: NDSCOPE_MAX_CUDA_BYTES=\"0.5\" is not a byte count")
            .count(),
        1,
        "{err}"
    );
}

/// A path under a regular file: no process can create it.
fn unwritable(test: &str) -> (PathBuf, PathBuf) {
    let file = std::env::temp_dir().join(format!("ndscope-env-{}-{test}", std::process::id()));
    std::fs::write(&file, b"a file, not a directory").unwrap();
    let path = file.join("trace.json");
    (file, path)
}

#[test]
fn an_unwritable_record_path_is_said_at_start_once() {
    let (file, path) = unwritable("record");
    let out = run("workload", &[("NDSCOPE_RECORD", path.to_str().unwrap())]);
    let err = stderr(&out);
    let said = format!("ndscope: NDSCOPE_RECORD: cannot write {}", path.display());
    assert_eq!(err.matches(&said).count(), 1, "said once: {err}");
    // Said before the program's own output (at start), not at exit.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("debug mode None"),
        "the program ran: {stdout}"
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn a_bad_record_cap_is_said_and_the_default_used() {
    let base = std::env::temp_dir().join(format!("ndscope-env-{}-cap", std::process::id()));
    let trace = PathBuf::from(format!("{}.json", base.display()));
    for value in ["0", "-5", "lots", "1e3"] {
        let out = run(
            "workload",
            &[
                ("NDSCOPE_RECORD", &format!("{}.json", base.display())),
                ("NDSCOPE_RECORD_MAX_ENTRIES", value),
            ],
        );
        let err = stderr(&out);
        assert_eq!(
            err.matches(&format!("ignoring NDSCOPE_RECORD_MAX_ENTRIES={value:?}"))
                .count(),
            1,
            "{err}"
        );
        let written = std::fs::read(&trace).expect("the recording was still written");
        assert!(!written.is_empty());
        std::fs::remove_file(&trace).unwrap();
    }
}

#[test]
fn a_bad_workspace_debug_mode_is_said_and_stays_off() {
    let out = run(
        "workload",
        &[("NDSCOPE_WORKSPACE_DEBUG", "spill-everything")],
    );
    let err = stderr(&out);
    assert_eq!(
        err.matches("ignoring NDSCOPE_WORKSPACE_DEBUG=\"spill-everything\"")
            .count(),
        1,
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("debug mode None"));
}
