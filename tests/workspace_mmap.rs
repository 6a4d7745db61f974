//! `LocationPolicy::Mmap`: the block is a memory-mapped file (ND4J `testMmap1`).

use std::path::PathBuf;

use ndscope::{DType, Error, LearningPolicy, LocationPolicy, Manager, WorkspaceConfig};

fn temp_files(tag: &str) -> Vec<PathBuf> {
    let prefix = format!("ndscope-ws-{}-", std::process::id());
    std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            name.starts_with(&prefix) && name.ends_with(&format!("-{tag}.bin"))
        })
        .collect()
}

#[test]
fn mmap_block_is_a_temp_file_removed_on_destroy() {
    let t = Manager::new_base();
    let conf = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(1_000_000)
        .build()
        .unwrap();
    let ws = t.workspace("mmap_temp", conf).unwrap();
    let files = temp_files("mmap_temp");
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(
        std::fs::metadata(&files[0]).unwrap().len(),
        1_300_000,
        "with 30% overallocation"
    );
    let sum = ws
        .cycle(|c| {
            let a = c.full([100], 10.0, DType::F64)?;
            a.sum_all()?.to_scalar::<f64>()
        })
        .unwrap();
    assert_eq!(sum, 1000.0);
    assert_eq!(ws.stats().spilled_count, 0, "allocated in the mapped block");
    ws.destroy().unwrap();
    assert!(temp_files("mmap_temp").is_empty(), "removed on destroy");
    t.close().unwrap();
}

#[test]
fn mmap_path_holds_the_arrays_bytes_and_stays() {
    let path = std::env::temp_dir().join(format!("ndscope-test-mmap-{}.bin", std::process::id()));
    let t = Manager::new_base();
    let conf = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .allocation(ndscope::AllocationPolicy::Strict)
        .initial_size(4096)
        .mmap_path(&path)
        .build()
        .unwrap();
    let ws = t.workspace("mmap_file", conf).unwrap();
    ws.cycle(|c| c.full([100], 10.0, DType::F64).map(|_| ()))
        .unwrap();
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(bytes.len(), 4096);
    let first = f64::from_le_bytes(bytes[..8].try_into().unwrap());
    let last = f64::from_le_bytes(bytes[792..800].try_into().unwrap());
    assert_eq!((first, last), (10.0, 10.0), "the array lived in the file");
    t.close().unwrap();
    assert!(path.exists(), "a user-given file is left in place");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn mmap_to_an_unwritable_path_is_an_io_error_and_creates_nothing() {
    let t = Manager::new_base();
    let conf = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .mmap_path("/nonexistent-dir/ndscope/block.bin")
        .build()
        .unwrap();
    let err = t.workspace("bad", conf).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("/nonexistent-dir/ndscope/block.bin"),
        "{err}"
    );
    assert!(t.report().workspaces.is_empty());
    t.close().unwrap();
}
