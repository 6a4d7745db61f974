//! Memory accounting and limits (DESIGN §5), CPU only.
//!
//! The counters and limits are process-wide and the tests of one binary run in parallel, so this
//! file holds a single test. `env_limit_child` is a helper it runs in a child process (this same
//! binary, with `NDSCOPE_MAX_HOST_BYTES` set); on its own it does nothing.

#[cfg(not(miri))]
use std::process::Command;

use ndscope::{
    memory_limit, memory_usage, reset_peak, set_memory_limit, DType, Device, Error, LimitSource,
    Manager, Result,
};

const MIB: usize = 1 << 20;
/// Elements of a 4 MiB `f32` array.
const FOUR_MIB_F32: usize = MIB;

/// Set in the child process: the expected limit in bytes, or `none`.
const CHILD_VAR: &str = "NDSCOPE_TEST_ENV_LIMIT_CHILD";
const CHILD_MARKER: &str = "env-limit-child: checked";

fn out_of_memory<T: std::fmt::Debug>(result: Result<T>) -> Error {
    match result {
        Err(e @ Error::OutOfMemory { .. }) => e,
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
}

#[test]
fn memory_usage_and_limits_on_cpu() -> Result<()> {
    // --- A clean start: nothing allocated, no limit. ---
    set_memory_limit(Device::Cpu, None);
    assert_eq!(memory_limit(Device::Cpu), None);
    let start = memory_usage(Device::Cpu);
    assert_eq!((start.in_use, start.arrays, start.limit), (0, 0, None));

    // --- Usage follows allocations. ---
    let m = Manager::new_base().with_name("mem");
    let a = m.zeros([FOUR_MIB_F32], DType::F32)?;
    let usage = memory_usage(Device::Cpu);
    assert_eq!(usage.in_use, 4 * MIB);
    assert_eq!(usage.arrays, 1);
    assert!(usage.peak >= 4 * MIB);
    let small = m.ones([16], DType::F64)?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 4 * MIB + 128);
    assert_eq!(memory_usage(Device::Cpu).arrays, 2);
    small.close()?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 4 * MIB);
    assert_eq!(memory_usage(Device::Cpu).arrays, 1);
    // Zero-sized arrays are arrays but take no bytes.
    let empty = m.zeros([0], DType::F32)?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 4 * MIB);
    assert_eq!(memory_usage(Device::Cpu).arrays, 2);
    empty.close()?;

    // --- A limit: over it, OutOfMemory and nothing changes. ---
    set_memory_limit(Device::Cpu, Some(6 * MIB));
    assert_eq!(memory_limit(Device::Cpu), Some(6 * MIB));
    assert_eq!(memory_usage(Device::Cpu).limit, Some(6 * MIB));
    let before = memory_usage(Device::Cpu);

    let err = out_of_memory(m.zeros([FOUR_MIB_F32], DType::F32));
    match &err {
        Error::OutOfMemory {
            device,
            requested,
            in_use,
            limit,
            limit_source,
            ..
        } => {
            assert_eq!(*device, Device::Cpu);
            assert_eq!(*requested, 4 * MIB);
            assert_eq!(*in_use, 4 * MIB);
            assert_eq!(*limit, Some(6 * MIB));
            assert_eq!(*limit_source, LimitSource::Api);
        }
        _ => unreachable!(),
    }
    let text = err.to_string();
    assert!(
        text.contains("cannot allocate 4.00 MiB on cpu: 4.00 MiB of 6.00 MiB in use (limit"),
        "{text}"
    );
    assert!(
        text.contains(&format!("{}:", file!())),
        "names the call site: {text}"
    );

    // Op results, from_vec and duplicate are refused the same way.
    out_of_memory(a.add(&a));
    out_of_memory(a.duplicate());
    out_of_memory(m.from_vec(vec![0.0f32; FOUR_MIB_F32], [FOUR_MIB_F32]));
    out_of_memory(m.full([FOUR_MIB_F32], 1.0, DType::F32));
    let after = memory_usage(Device::Cpu);
    assert_eq!((after.in_use, after.arrays), (before.in_use, before.arrays));
    assert_eq!(m.report().arrays.len(), 1, "nothing was created");
    assert!(m.children().is_empty());

    // What fits still works.
    let fits = m.zeros([MIB / 4], DType::F32)?; // 1 MiB
    assert_eq!(memory_usage(Device::Cpu).in_use, 5 * MIB);

    // A capped manager says Capped, not OutOfMemory: the cap is checked before any memory is
    // reserved, for every factory.
    let capped = Manager::new_base();
    capped.cap();
    assert!(matches!(
        capped.zeros([FOUR_MIB_F32], DType::F32),
        Err(Error::Capped { .. })
    ));
    assert!(matches!(
        capped.from_vec(vec![0.0f32; FOUR_MIB_F32], [FOUR_MIB_F32]),
        Err(Error::Capped { .. })
    ));
    // Even when it would fit, refusing it reserves nothing, not even for a moment.
    reset_peak(Device::Cpu);
    assert!(matches!(
        capped.from_vec(vec![0u8; 1024], [1024]),
        Err(Error::Capped { .. })
    ));
    assert_eq!(memory_usage(Device::Cpu).peak, 5 * MIB);
    capped.close()?;

    // A limit below what is in use refuses everything new and touches nothing already there.
    set_memory_limit(Device::Cpu, Some(MIB));
    out_of_memory(m.zeros([1], DType::U8));
    assert_eq!(a.to_vec::<f32>()?.len(), FOUR_MIB_F32);
    assert_eq!(memory_usage(Device::Cpu).in_use, 5 * MIB);
    fits.close()?;
    a.close()?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 0);
    let tiny = m.zeros([256], DType::F32)?; // fits under 1 MiB now
    tiny.close()?;

    // --- Removing the limit. ---
    set_memory_limit(Device::Cpu, None);
    assert_eq!(memory_limit(Device::Cpu), None);
    assert_eq!(memory_usage(Device::Cpu).limit, None);

    // --- Peak. ---
    reset_peak(Device::Cpu);
    assert_eq!(memory_usage(Device::Cpu).peak, 0);
    let big = m.zeros([2 * FOUR_MIB_F32], DType::F32)?; // 8 MiB
    let from_vec = m.from_vec(vec![1.0f64; 1024], [1024])?; // 8 KiB
    assert_eq!(memory_usage(Device::Cpu).in_use, 8 * MIB + 8192);
    assert_eq!(memory_usage(Device::Cpu).arrays, 2);

    // --- Everything closed: back to zero. ---
    m.close()?;
    assert!(!big.is_open() && !from_vec.is_open());
    let end = memory_usage(Device::Cpu);
    assert_eq!(end.in_use, 0);
    assert_eq!(end.arrays, 0);
    assert_eq!(end.peak, 8 * MIB + 8192);

    // --- Detached arrays count until their owner closes them. ---
    let m = Manager::new_base();
    let loose = m.zeros([256], DType::F32)?;
    loose.detach()?;
    m.close()?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 1024);
    loose.close()?;
    assert_eq!(memory_usage(Device::Cpu).in_use, 0);

    // --- The environment variable, read at start-up: a child process (Miri cannot start one). ---
    #[cfg(not(miri))]
    {
        run_child("8M", "8388608");
        run_child("1048576", "1048576");
        run_child("lots", "bad");
    }
    Ok(())
}

#[cfg(not(miri))]
fn run_child(value: &str, expect: &str) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "env_limit_child",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("NDSCOPE_MAX_HOST_BYTES", value)
        .env(CHILD_VAR, expect)
        .output()
        .expect("the test binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "child with NDSCOPE_MAX_HOST_BYTES={value} failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains(CHILD_MARKER),
        "the child did not run its checks (filter matched nothing?):\n{stdout}\n{stderr}"
    );
}

/// Run by `memory_usage_and_limits_on_cpu` in a child process with `NDSCOPE_MAX_HOST_BYTES` set;
/// a no-op otherwise.
#[test]
fn env_limit_child() {
    let Ok(expect) = std::env::var(CHILD_VAR) else {
        return;
    };
    let m = Manager::new_base();
    if expect == "bad" {
        // A value that is not a byte count refuses every allocation, naming the variable and
        // the value, until the API replaces it.
        assert_eq!(memory_limit(Device::Cpu), None);
        let err = m.zeros([FOUR_MIB_F32], DType::F32).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("NDSCOPE_MAX_HOST_BYTES=\"lots\" is not a byte count"),
            "{err}"
        );
        set_memory_limit(Device::Cpu, None);
        m.zeros([FOUR_MIB_F32], DType::F32).unwrap();
    } else {
        let limit: usize = expect.parse().unwrap();
        assert_eq!(memory_limit(Device::Cpu), Some(limit));
        assert_eq!(memory_usage(Device::Cpu).limit, Some(limit));
        let half = limit / 2 / 4; // f32 elements in half the limit
        m.zeros([half], DType::F32).unwrap();
        m.zeros([half], DType::F32).unwrap();
        let err = out_of_memory(m.zeros([half], DType::F32));
        assert!(matches!(
            err,
            Error::OutOfMemory {
                limit_source: LimitSource::Env("NDSCOPE_MAX_HOST_BYTES"),
                ..
            }
        ));
        if limit == 8 * MIB {
            let text = err.to_string();
            assert!(
                text.ends_with(
                    "cannot allocate 4.00 MiB on cpu: 8.00 MiB of 8.00 MiB in use (limit NDSCOPE_MAX_HOST_BYTES)"
                ),
                "{text}"
            );
        }
        assert_eq!(m.report().arrays.len(), 2);
        // The API overrides the environment.
        set_memory_limit(Device::Cpu, None);
        m.zeros([half], DType::F32).unwrap();
    }
    m.close().unwrap();
    assert_eq!(memory_usage(Device::Cpu).in_use, 0);
    println!("{CHILD_MARKER}");
}
