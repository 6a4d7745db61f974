//! The simulated GPU's counters (`../shared/cudasim`), read in-process from the loaded driver:
//! launch overhead counted without a GPU. On a real driver `stats` is `None`.

use std::collections::HashMap;
use std::ffi::{c_char, CStr};

type Stats = unsafe extern "C" fn(*mut u64, usize) -> usize;
type Name = unsafe extern "C" fn(usize) -> *const c_char;

/// The counters by name, or `None` on a real driver (no `cudasim_stats`).
pub fn stats() -> Option<HashMap<String, u64>> {
    // SAFETY: RTLD_NOLOAD only looks up a library the process already loaded; the symbols,
    // when present, have the simulator's documented signatures.
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
                let s = CStr::from_ptr(name(i)).to_string_lossy().into_owned();
                (s, out[i])
            })
            .collect();
        libc::dlclose(lib);
        Some(map)
    }
}

/// `after - before` for every counter.
pub fn diff(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .collect()
}

/// Counters that ask the driver for anything (all but queries).
pub fn calls(d: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = d
        .iter()
        .filter(|(k, &v)| v > 0 && !k.ends_with("_bytes"))
        .map(|(k, &v)| (k.clone(), v))
        .collect();
    v.sort();
    v
}
