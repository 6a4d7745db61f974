//! CUDA ops, launches and transfers (issue 17, part b): driver calls counted on the simulated
//! GPU, deferred index and division checks, transfers around the staging size, `addmm_` with
//! `beta = 0`, batched products past the grid limit, and reduction launch shapes.
//!
//! Without a usable GPU each test prints why it skipped. Parts that count driver calls read the
//! simulator's counters (`cudasim_stats` in the loaded `libcuda.so.1`) and skip that part on a
//! real driver, which has no such symbols.

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{DType, Device, Manager, WorkspaceConfig};

mod common;

static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU with this file's lock held, or `None` after printing why the test skips.
fn gpu() -> Option<(MutexGuard<'static, ()>, Device)> {
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    common::cuda_device().map(|dev| (serial, dev))
}

/// The simulator's counters, read in-process from the loaded driver.
mod sim {
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
    pub fn diff(
        before: &HashMap<String, u64>,
        after: &HashMap<String, u64>,
    ) -> HashMap<String, u64> {
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
}

#[test]
fn creating_and_closing_in_a_learned_cycle_makes_no_driver_call() {
    let Some((_serial, dev)) = gpu() else { return };
    let owner = Manager::new_base_on(dev).unwrap();
    let ws = owner
        .workspace("cycle", WorkspaceConfig::default())
        .unwrap();
    for _ in 0..3 {
        ws.cycle(|s| {
            let a = s.empty([1 << 18], DType::F32)?;
            let b = s.empty([1000], DType::I64)?;
            a.close()?;
            b.close()
        })
        .unwrap();
    }
    let before = sim::stats();
    for _ in 0..20 {
        ws.cycle(|s| {
            let a = s.empty([1 << 18], DType::F32)?;
            let b = s.empty([1000], DType::I64)?;
            a.close()?;
            b.close()
        })
        .unwrap();
    }
    let after = sim::stats();
    if let (Some(before), Some(after)) = (before, after) {
        let calls = sim::calls(&sim::diff(&before, &after));
        assert!(
            calls.is_empty(),
            "driver calls in 20 learned cycles: {calls:?}"
        );
    }
    // The same in one open scope of the learned workspace, as the bench does it.
    let scope = ws.open().unwrap();
    let before = sim::stats();
    for _ in 0..20 {
        let a = scope.empty([1 << 18], DType::F32).unwrap();
        a.close().unwrap();
    }
    let after = sim::stats();
    drop(scope);
    if let (Some(before), Some(after)) = (before, after) {
        let calls = sim::calls(&sim::diff(&before, &after));
        assert!(
            calls.is_empty(),
            "driver calls for 20 creates and closes: {calls:?}"
        );
    }
    owner.close().unwrap();
}
