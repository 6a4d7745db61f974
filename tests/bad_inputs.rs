//! Public functions that take a path or a number from outside, given bad ones: each is a clear
//! `Error` (what, where, why) and changes nothing — no file left, no array, no memory held.
//! (The safetensors paths are in `tests/persist_files.rs`, the environment variables in
//! `tests/env_settings.rs`, the prefetch depth and the inference settings in their own files.)

use std::path::PathBuf;

use ndscope::{
    memory_usage, start_recording, stop_recording, DType, Device, Error, LearningPolicy,
    LocationPolicy, Manager, Prefetcher, RecordOptions, WorkspaceConfig,
};

/// Two tests check that the process's memory in use is unchanged; the others create arrays.
/// The tests of this file take turns, so no array of one lands between another's two readings.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// This test's turn (a test that failed before releasing it does not block the others).
fn turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A path under a regular file (no process can create it), and that file.
fn under_a_file(test: &str) -> (PathBuf, PathBuf) {
    let file = std::env::temp_dir().join(format!("ndscope-bad-{}-{test}", std::process::id()));
    std::fs::write(&file, b"a file, not a directory").unwrap();
    (file.join("out.bin"), file)
}

#[test]
fn recordings_written_to_bad_paths_are_io_errors_and_write_nothing() {
    let _turn = turn();
    let (path, file) = under_a_file("trace");
    let dir = std::env::temp_dir();
    // A recording of its own: the recorder is process-wide, so none may run meanwhile in this
    // binary (this is its only test that records).
    start_recording(RecordOptions::default()).unwrap();
    Manager::new_base().close().unwrap();
    let recording = stop_recording().expect("a recording");
    for bad in [path.clone(), dir.clone(), PathBuf::new()] {
        for err in [
            recording.write_chrome_trace(&bad).unwrap_err(),
            recording.write_memory_snapshot(&bad).unwrap_err(),
        ] {
            match &err {
                Error::Io { path, .. } => assert_eq!(path, &bad, "{err}"),
                other => panic!("expected Io for {}, got {other}", bad.display()),
            }
        }
    }
    assert!(!path.exists());
    assert_eq!(
        std::fs::read(&file).unwrap(),
        b"a file, not a directory",
        "the file in the way is untouched"
    );
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn a_memory_mapped_workspace_at_a_bad_path_is_refused_and_holds_nothing() {
    let _turn = turn();
    let (path, file) = under_a_file("mmap");
    let owner = Manager::new_base();
    let before = memory_usage(Device::Cpu).in_use;
    let config = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        .mmap_path(&path)
        .build()
        .unwrap();
    let err = owner.workspace("mapped", config).unwrap_err();
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    assert!(
        owner.report().workspaces.is_empty(),
        "no workspace was made"
    );
    assert_eq!(memory_usage(Device::Cpu).in_use, before);
    assert!(!path.exists());
    owner.close().unwrap();
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn bad_workspace_numbers_are_invalid_config() {
    let _turn = turn();
    for (what, built) in [
        (
            "overallocation NaN",
            WorkspaceConfig::builder()
                .overallocation_limit(f64::NAN)
                .build(),
        ),
        (
            "overallocation negative",
            WorkspaceConfig::builder()
                .overallocation_limit(-1.0)
                .build(),
        ),
        (
            "overallocation infinite",
            WorkspaceConfig::builder()
                .overallocation_limit(f64::INFINITY)
                .build(),
        ),
        (
            "min above max",
            WorkspaceConfig::builder()
                .min_size(1 << 20)
                .max_size(1 << 10)
                .build(),
        ),
    ] {
        match built {
            Err(Error::InvalidConfig { .. }) => {}
            other => panic!("{what}: expected InvalidConfig, got {other:?}"),
        }
    }
}

#[test]
fn bad_shapes_and_ranges_are_errors_and_create_nothing() {
    let _turn = turn();
    let m = Manager::new_base();
    let before = memory_usage(Device::Cpu).in_use;
    let results = [
        (
            "zeros of usize::MAX elements",
            m.zeros([usize::MAX, 2], DType::F32).map(drop),
        ),
        (
            "empty of 2^62 f64",
            m.empty([1 << 62], DType::F64).map(drop),
        ),
        (
            "arange with step 0",
            m.arange(0.0, 1.0, 0.0, DType::F32).map(drop),
        ),
        (
            "arange with NaN",
            m.arange(0.0, f64::NAN, 1.0, DType::F32).map(drop),
        ),
        (
            "arange to infinity",
            m.arange(0.0, f64::INFINITY, 1.0, DType::F32).map(drop),
        ),
        (
            "from_vec of the wrong length",
            m.from_vec(vec![1.0f32; 3], [2, 2]).map(drop),
        ),
    ];
    for (what, result) in results {
        assert!(result.is_err(), "{what} was accepted");
    }
    let x = m.zeros([4, 4], DType::F32).unwrap();
    assert!(x.narrow(0, 3, 2).is_err(), "narrow past the end");
    assert!(
        x.narrow(5, 0, 1).is_err(),
        "narrow on an axis that does not exist"
    );
    assert!(x.reshape([3, 5]).is_err(), "reshape to another size");
    assert_eq!(m.report().total_arrays(), 1, "only x");
    x.close().unwrap();
    assert_eq!(memory_usage(Device::Cpu).in_use, before);
    m.close().unwrap();
}

#[test]
fn a_prefetch_depth_of_zero_is_refused_and_starts_nothing() {
    let _turn = turn();
    let owner = Manager::new_base();
    let err = Prefetcher::from_iter(&owner, 0, 0..3, |s, _| {
        Ok(vec![s.zeros([1], DType::F32)?].into())
    })
    .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(owner.children().is_empty(), "no prefetch manager left");
    owner.close().unwrap();
}
