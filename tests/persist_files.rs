//! Safetensors files that are not what they seem (a FIFO, `/dev/zero`, a sparse file larger
//! than the memory limit, `BOOL` bytes other than 0 and 1), names the format cannot hold, and
//! saves that keep the target's mode, honour the umask, clean up after a killed save and leave
//! the old file whole when killed midway. What needs its own process (the umask, a memory
//! limit, an address-space limit, a kill) runs in a child: this same binary running one of the
//! `#[ignore]`d `child_*` tests.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use ndscope::{DType, Error, Manager, NDList};

/// A fresh directory for one test's files.
fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ndscope-files-{}-{test}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The command running the ignored test `name` of this binary, with `NDSCOPE_TEST_DIR=dir`.
fn child(name: &str, dir: &Path) -> Command {
    let mut cmd = Command::new(std::env::current_exe().expect("the test binary"));
    cmd.args([
        "--exact",
        name,
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ])
    .env("NDSCOPE_TEST_DIR", dir)
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    cmd
}

/// Runs `cmd` for at most `limit`; `None` (and the child killed) if it takes longer.
fn run_for(mut cmd: Command, limit: Duration) -> Option<Output> {
    let mut running = cmd.spawn().expect("the child starts");
    let start = Instant::now();
    while start.elapsed() < limit {
        if running.try_wait().expect("the child's status").is_some() {
            return Some(running.wait_with_output().expect("the child's output"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = running.kill();
    let _ = running.wait();
    None
}

/// Runs the child test `name` and checks it passed (within a minute).
fn child_passes(name: &str, dir: &Path) {
    let out = run_for(child(name, dir), Duration::from_secs(60))
        .unwrap_or_else(|| panic!("{name} did not finish within a minute (a hang)"));
    assert!(
        out.status.success(),
        "{name} failed ({:?}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The directory a child works in.
fn child_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("NDSCOPE_TEST_DIR").expect("run by its parent test"))
}

/// Caps this (child) process's address space, so a loader that reads without bound fails
/// here instead of taking the machine's memory.
fn cap_address_space(bytes: u64) {
    let limit = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: bytes,
    };
    // SAFETY: `setrlimit` reads the struct passed by reference and changes only this process.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
    assert_eq!(rc, 0, "setrlimit");
}

fn assert_io(err: &Error, kind: ErrorKind, says: &str) {
    match err {
        Error::Io { source, .. } => {
            assert_eq!(source.kind(), kind, "{err}");
            assert!(err.to_string().contains(says), "{err}");
        }
        other => panic!("expected Io ({kind:?}), got {other}"),
    }
}

// ----------------------------------------------------------------------------------------------
// Loading
// ----------------------------------------------------------------------------------------------

#[test]
#[ignore = "run by a_fifo_and_dev_zero_are_refused_at_once, in a child process"]
fn child_special_files() {
    cap_address_space(2 << 30);
    let fifo = child_dir().join("fifo.safetensors");
    let target = Manager::new_base();
    for path in [fifo.as_path(), Path::new("/dev/zero")] {
        let err = target.load_safetensors(path).unwrap_err();
        assert_io(&err, ErrorKind::InvalidInput, "not a regular file");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        let err = NDList::new().restore_safetensors(path).unwrap_err();
        assert_io(&err, ErrorKind::InvalidInput, "not a regular file");
        assert_eq!(target.report().total_arrays(), 0);
    }
    // A directory, too.
    let err = target.load_safetensors(child_dir()).unwrap_err();
    assert_io(&err, ErrorKind::InvalidInput, "a directory");
    target.close().unwrap();
}

#[test]
fn a_fifo_and_dev_zero_are_refused_at_once() {
    let d = dir("special");
    let fifo = d.join("fifo.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo");
    child_passes("child_special_files", &d);
    std::fs::remove_dir_all(&d).unwrap();
}

/// The file header of one tensor of `dtype` and `shape`, whose data is `len` bytes.
fn one_tensor_header(name: &str, dtype: &str, shape: &[usize], len: usize) -> Vec<u8> {
    let json =
        format!(r#"{{"{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[0,{len}]}}}}"#);
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes
}

#[test]
#[ignore = "run by tensors_over_the_memory_limit_are_refused_before_they_are_read, in a child"]
fn child_sparse_over_the_limit() {
    use ndscope::{memory_usage, set_memory_limit, Device, LimitSource};
    // Less than the file: a loader that reads it whole, or builds its values before the
    // limit is checked, fails here.
    cap_address_space(1 << 30);
    // 2 GiB of f32 zeros, sparse on disk: a valid file far over the limit.
    let path = child_dir().join("huge.safetensors");
    let len = 2usize << 30;
    let header = one_tensor_header("huge", "F32", &[len / 4], len);
    std::fs::write(&path, &header).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    file.set_len((header.len() + len) as u64).unwrap();
    let target = Manager::new_base();
    let before = memory_usage(Device::Cpu).in_use;
    set_memory_limit(Device::Cpu, Some(before + (1 << 20)));
    let start = Instant::now();
    let err = target.load_safetensors(&path).unwrap_err();
    let took = start.elapsed();
    match &err {
        Error::OutOfMemory {
            requested,
            limit_source,
            ..
        } => {
            assert_eq!(*requested, len, "{err}");
            assert_eq!(*limit_source, LimitSource::Api, "{err}");
        }
        other => panic!("expected OutOfMemory, got {other}"),
    }
    println!("refused in {took:?}");
    assert_eq!(target.report().total_arrays(), 0);
    assert_eq!(memory_usage(Device::Cpu).in_use, before);
    set_memory_limit(Device::Cpu, None);
    target.close().unwrap();
}

#[test]
fn tensors_over_the_memory_limit_are_refused_before_they_are_read() {
    let d = dir("sparse");
    child_passes("child_sparse_over_the_limit", &d);
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bool_bytes_other_than_0_and_1_are_refused_naming_the_tensor_and_offset() {
    let d = dir("bool");
    let path = d.join("flags.safetensors");
    let mut bytes = one_tensor_header("flags", "BOOL", &[5], 5);
    let data_start = bytes.len();
    bytes.extend_from_slice(&[1, 0, 1, 2, 0]);
    std::fs::write(&path, &bytes).unwrap();
    let m = Manager::new_base();
    let err = m.load_safetensors(&path).unwrap_err();
    assert_io(
        &err,
        ErrorKind::InvalidData,
        "BOOL tensor 'flags' holds 2 at element 3",
    );
    assert!(
        err.to_string()
            .contains(&format!("byte {} of the file", data_start + 3)),
        "{err}"
    );
    assert_eq!(m.report().total_arrays(), 0);
    // Restoring into a u8 array is refused as well, and leaves it alone.
    let flags = m.from_slice(&[7u8; 5], [5]).unwrap().with_name("flags");
    assert_io(
        &m.restore_safetensors(&path).unwrap_err(),
        ErrorKind::InvalidData,
        "'flags'",
    );
    assert_eq!(flags.to_vec::<u8>().unwrap(), vec![7; 5]);
    // 0 and 1 load.
    bytes[data_start + 3] = 1;
    std::fs::write(&path, &bytes).unwrap();
    m.restore_safetensors(&path).unwrap();
    assert_eq!(flags.to_vec::<u8>().unwrap(), vec![1, 0, 1, 1, 0]);
    m.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn an_absurd_header_length_is_refused_without_reading_it() {
    let d = dir("header");
    let path = d.join("model.safetensors");
    let m = Manager::new_base();
    for n in [u64::MAX, 1 << 40, 100_000_001, 9] {
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        std::fs::write(&path, &bytes).unwrap();
        let err = m.load_safetensors(&path).unwrap_err();
        assert_io(&err, ErrorKind::InvalidData, "the header is said to take");
    }
    // Shorter than the header's length field.
    std::fs::write(&path, [1u8, 2, 3]).unwrap();
    assert_io(
        &m.load_safetensors(&path).unwrap_err(),
        ErrorKind::InvalidData,
        "less than the 8",
    );
    // An empty header and no data: a valid file of no tensors.
    let mut bytes = 2u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&path, &bytes).unwrap();
    assert!(m.load_safetensors(&path).unwrap().is_empty());
    // Data past what the header describes.
    bytes.push(0);
    std::fs::write(&path, &bytes).unwrap();
    assert_io(
        &m.load_safetensors(&path).unwrap_err(),
        ErrorKind::InvalidData,
        "describes 0 bytes of data, the file has 1",
    );
    assert_eq!(m.report().total_arrays(), 0);
    m.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

// ----------------------------------------------------------------------------------------------
// Saving
// ----------------------------------------------------------------------------------------------

#[test]
fn names_the_format_cannot_hold_are_refused_and_nothing_is_written() {
    let d = dir("names");
    let path = d.join("model.safetensors");
    for name in ["__metadata__", ""] {
        let m = Manager::new_base();
        m.zeros([2], DType::F32).unwrap().set_name("fine");
        let bad = m.ones([3], DType::F32).unwrap().with_name(name);
        let err = m.save_safetensors(&path).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert!(err.to_string().contains(&format!("{name:?}")), "{err}");
        assert!(err.to_string().contains(&bad.id().to_string()), "{err}");
        let list: NDList = vec![bad.clone()].into();
        let err = list.save_safetensors(&path).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        assert_eq!(
            std::fs::read_dir(&d).unwrap().count(),
            0,
            "no file, no temporary"
        );
        m.close().unwrap();
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn bad_paths_are_refused_and_leave_nothing_behind() {
    let d = dir("paths");
    let m = Manager::new_base();
    m.zeros([2], DType::F32).unwrap().set_name("w");
    // A directory where the file should go.
    let sub = d.join("model.safetensors");
    std::fs::create_dir(&sub).unwrap();
    let err = m.save_safetensors(&sub).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(sub.is_dir());
    // A directory that does not exist.
    let err = m
        .save_safetensors(d.join("absent").join("m.safetensors"))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Io { source, .. } if source.kind() == ErrorKind::NotFound),
        "{err}"
    );
    // No file name at all.
    let err = m.save_safetensors("/").unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let names: Vec<_> = std::fs::read_dir(&d)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("model.safetensors")],
        "no temporary left"
    );
    m.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

#[test]
fn saving_over_a_file_keeps_its_mode() {
    use std::os::unix::fs::PermissionsExt;
    let d = dir("mode");
    let path = d.join("model.safetensors");
    let m = Manager::new_base();
    m.zeros([2], DType::F32).unwrap().set_name("w");
    for wanted in [0o640, 0o604, 0o755] {
        m.save_safetensors(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(wanted)).unwrap();
        m.save_safetensors(&path).unwrap();
        assert_eq!(mode(&path), wanted, "{wanted:o} kept");
        std::fs::remove_file(&path).unwrap();
    }
    m.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "run by a_new_file_honours_the_umask, in a child process"]
fn child_save_with_umask() {
    // SAFETY: `umask` only sets this process's file creation mask.
    unsafe { libc::umask(0o027) };
    let m = Manager::new_base();
    m.zeros([2], DType::F32).unwrap().set_name("w");
    m.save_safetensors(child_dir().join("new.safetensors"))
        .unwrap();
    m.close().unwrap();
}

#[test]
fn a_new_file_honours_the_umask() {
    let d = dir("umask");
    child_passes("child_save_with_umask", &d);
    assert_eq!(mode(&d.join("new.safetensors")), 0o640, "0666 & !0027");
    std::fs::remove_dir_all(&d).unwrap();
}

/// The temporaries of saves to `model.safetensors` in `d`.
fn temporaries(d: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .filter(|n| n.starts_with(".model.safetensors.ndscope-tmp-"))
        .collect();
    names.sort();
    names
}

/// The id of a process that has exited.
fn dead_pid() -> u32 {
    let mut done = Command::new("true").spawn().expect("`true` runs");
    let pid = done.id();
    done.wait().unwrap();
    pid
}

#[test]
fn a_save_removes_the_stale_temporaries_of_killed_saves_only() {
    let d = dir("stale");
    let path = d.join("model.safetensors");
    let dead = format!(".model.safetensors.ndscope-tmp-{}-0", dead_pid());
    // Process 1 exists: its temporary may be a save in progress, and stays.
    let live = ".model.safetensors.ndscope-tmp-1-0".to_string();
    let other_target = format!(".other.safetensors.ndscope-tmp-{}-0", dead_pid());
    for name in [&dead, &live, &other_target] {
        std::fs::write(d.join(name), b"half a model").unwrap();
    }
    let m = Manager::new_base();
    m.zeros([2], DType::F32).unwrap().set_name("w");
    m.save_safetensors(&path).unwrap();
    assert_eq!(
        temporaries(&d),
        vec![live.clone()],
        "the dead process's one is gone"
    );
    assert!(
        d.join(&other_target).exists(),
        "another target's are left alone"
    );
    m.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
#[ignore = "run by a_save_killed_midway_leaves_the_old_file_whole, in a child process"]
fn child_big_save() {
    let m = Manager::new_base();
    for i in 0..8 {
        m.full([4 << 20], 2.0, DType::F32)
            .unwrap()
            .set_name(&format!("new{i}"));
    }
    println!("saving");
    m.save_safetensors(child_dir().join("model.safetensors"))
        .unwrap();
    m.close().unwrap();
}

#[test]
fn a_save_killed_midway_leaves_the_old_file_whole() {
    let d = dir("killed");
    let path = d.join("model.safetensors");
    let old = Manager::new_base();
    old.from_slice(&[1.0f32, 2.0, 3.0], [3])
        .unwrap()
        .set_name("old");
    old.save_safetensors(&path).unwrap();
    let good = std::fs::read(&path).unwrap();
    // The child writes 128 MiB; it is killed as soon as its temporary file appears. (Were it
    // ever to finish first, the run is repeated: the point is a kill in the middle.)
    let mut killed_midway = false;
    for _ in 0..5 {
        let mut running = child("child_big_save", &d).spawn().unwrap();
        let start = Instant::now();
        while temporaries(&d).is_empty() && start.elapsed() < Duration::from_secs(60) {
            if running.try_wait().unwrap().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        // SIGKILL: nothing of the child runs after it.
        running.kill().unwrap();
        running.wait().unwrap();
        if std::fs::read(&path).unwrap() == good {
            killed_midway = true;
            break;
        }
        old.save_safetensors(&path).unwrap();
    }
    assert!(
        killed_midway,
        "no child was killed in the middle of its save"
    );
    // The old file, whole: it loads, with its own data.
    let back = Manager::new_base();
    let loaded = back.load_safetensors(&path).unwrap();
    assert_eq!(loaded.len(), 1);
    assert_eq!(
        loaded.get(0).unwrap().to_vec::<f32>().unwrap(),
        vec![1.0, 2.0, 3.0]
    );
    // The killed save left its temporary; the next save removes it.
    assert_eq!(temporaries(&d).len(), 1, "{:?}", temporaries(&d));
    old.save_safetensors(&path).unwrap();
    assert!(temporaries(&d).is_empty(), "{:?}", temporaries(&d));
    back.close().unwrap();
    old.close().unwrap();
    std::fs::remove_dir_all(&d).unwrap();
}
