//! Fuzzes the safetensors loader: the input becomes a file on disk, which
//! `Manager::load_safetensors` and `restore_safetensors` read with a host memory limit set.
//! Neither may panic, hang or allocate past the limit; a refused load leaves no array behind; an
//! accepted one gives arrays whose bytes the file held (and restores, or is refused for lack of
//! memory, changing nothing), and the memory counters return to where they were once they are
//! closed.
//!
//! The first byte picks how the input becomes a file (modulo 3): 0, the input as it is; 1, a
//! header of the bytes up to the first 0 byte after it, with the right length prefix, then the
//! rest as data; 2, a well-formed JSON header built from the bytes (see [`structured`]), so most
//! inputs reach the byte ranges, the dtypes and the data checks.

#![no_main]

use std::path::PathBuf;
use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use ndscope::{memory_usage, set_memory_limit, Device, Manager};

/// The host memory limit: larger tensors must be refused before anything is read.
const LIMIT: usize = 4 << 20;

/// The file every input is written to (one per fuzzing process).
static PATH: LazyLock<PathBuf> = LazyLock::new(|| {
    let dir = std::env::temp_dir().join(format!("ndscope-fuzz-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    set_memory_limit(Device::Cpu, Some(LIMIT));
    dir.join("input.safetensors")
});

/// The file's bytes for an input (see the module docs), and its length: longer than the bytes
/// when a structured header states more data (the rest is a hole of zeros).
fn file_bytes(data: &[u8]) -> (Vec<u8>, usize) {
    match data.split_first() {
        Some((&mode, rest)) if mode % 3 == 1 => {
            let cut = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
            let (header, tail) = rest.split_at(cut);
            let body = tail.get(1..).unwrap_or(&[]);
            let bytes = with_header(header, body);
            let len = bytes.len();
            (bytes, len)
        }
        Some((&mode, rest)) if mode % 3 == 2 => structured(rest),
        _ => (data.to_vec(), data.len()),
    }
}

/// The length prefix, `header`, then `body`.
fn with_header(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    bytes.extend_from_slice(body);
    bytes
}

/// A file whose header is well-formed JSON built from the bytes: up to 4 tensors, each with a
/// name, a dtype (ndscope's, `BOOL`, others it lacks, a bad one), a shape of up to 3 small
/// dimensions (now and then one of 2^21, past the memory limit) and byte ranges that are right
/// or off by one; the data is the bytes left, cut or padded with zeros to the length the header
/// states (or one byte off).
fn structured(data: &[u8]) -> (Vec<u8>, usize) {
    const NAMES: [&str; 6] = ["a", "b", "w", "__metadata__", "", "a\"x"];
    const DTYPES: [&str; 10] = [
        "F32", "F64", "I32", "I64", "U8", "BOOL", "F16", "BF16", "U64", "Q",
    ];
    let mut bytes = data.iter().copied();
    let mut next = || usize::from(bytes.next().unwrap_or(0));
    let count = next() % 5;
    let mut entries = Vec::new();
    let mut offset = 0usize;
    for i in 0..count {
        let name = match next() % 8 {
            k @ 0..=5 => NAMES[k].to_string(),
            _ => format!("t{i}"),
        };
        let dtype = DTYPES[next() % DTYPES.len()];
        let rank = next() % 4;
        // At most one large dimension: the sizes stay far from overflowing.
        let mut large = false;
        let shape: Vec<usize> = (0..rank)
            .map(|_| match next() {
                250.. if !large => {
                    large = true;
                    1 << 21
                }
                d => d % 6,
            })
            .collect();
        let width = match dtype {
            "F64" | "I64" | "U64" => 8,
            "F32" | "I32" => 4,
            "F16" | "BF16" => 2,
            _ => 1,
        };
        let len = shape.iter().product::<usize>() * width;
        let start = offset + usize::from(next() % 16 == 0);
        let end = (start + len + usize::from(next() % 16 == 1))
            .saturating_sub(usize::from(next() % 16 == 2));
        offset = end.max(start);
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{start},{end}]}}"#
        ));
    }
    if next() % 4 == 0 {
        entries.push(r#""__metadata__":{"format":"pt"}"#.to_string());
    }
    let header = format!("{{{}}}", entries.join(","));
    let mut body: Vec<u8> = bytes.collect();
    let stated = match data.last().map(|b| b % 8) {
        Some(0) => offset + 1,
        Some(1) => offset.saturating_sub(1),
        _ => offset,
    };
    body.truncate(stated);
    let bytes = with_header(header.as_bytes(), &body);
    let len = bytes.len() + (stated - body.len());
    (bytes, len)
}

fuzz_target!(|data: &[u8]| {
    let path = &*PATH;
    let (bytes, len) = file_bytes(data);
    std::fs::write(path, &bytes).expect("the input file is written");
    if len > bytes.len() {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .expect("reopened");
        file.set_len(len as u64).expect("extended with a hole");
    }
    let before = memory_usage(Device::Cpu).in_use;
    let m = Manager::new_base().with_name("fuzz");
    match m.load_safetensors(path) {
        Ok(list) => {
            let held: usize = list.iter().map(|a| a.nbytes()).sum();
            assert!(held <= len, "{held} bytes of arrays from a {len}-byte file");
            assert!(memory_usage(Device::Cpu).in_use <= LIMIT);
            // Restoring the same file into what it gave succeeds and changes nothing, or is
            // refused for lack of memory (it stages a copy first) and changes nothing either.
            let copies: Vec<Vec<u8>> = list.iter().map(raw).collect();
            match list.restore_safetensors(path) {
                Ok(()) | Err(ndscope::Error::OutOfMemory { .. }) => {}
                Err(e) => panic!("a loaded file does not restore: {e}"),
            }
            let again: Vec<Vec<u8>> = list.iter().map(raw).collect();
            assert_eq!(copies, again);
        }
        Err(_) => assert_eq!(m.report().total_arrays(), 0, "a refused load left arrays"),
    }
    m.close().expect("the manager closes");
    assert_eq!(
        memory_usage(Device::Cpu).in_use,
        before,
        "memory given back"
    );
});

/// An array's values as bytes, whatever its dtype.
fn raw(a: &ndscope::NDArray) -> Vec<u8> {
    use ndscope::DType;
    match a.dtype() {
        DType::F32 => le(a.to_vec::<f32>(), f32::to_le_bytes),
        DType::F64 => le(a.to_vec::<f64>(), f64::to_le_bytes),
        DType::I32 => le(a.to_vec::<i32>(), i32::to_le_bytes),
        DType::I64 => le(a.to_vec::<i64>(), i64::to_le_bytes),
        DType::U8 => a.to_vec::<u8>().expect("a loaded array reads"),
    }
}

fn le<T, const N: usize>(values: ndscope::Result<Vec<T>>, to: fn(T) -> [u8; N]) -> Vec<u8> {
    let values = values.expect("a loaded array reads");
    values.into_iter().flat_map(to).collect()
}
