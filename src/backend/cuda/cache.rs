//! The per-device cache of freed array memory: allocations of arrays that closed, kept by size
//! class and handed to the next array of the same class without asking the driver (see
//! `memory.rs`, which takes from it and puts into it). A leaf over device pointers and sizes:
//! the device (`device.rs`) empties it when it releases its caches.

use cudarc::driver::sys::CUdeviceptr;
use parking_lot::Mutex;

use crate::memory;

/// Most allocations a device's cache keeps.
pub(crate) const CACHE_ENTRIES: usize = 64;
/// Most bytes a device's cache keeps.
pub(crate) const CACHE_BYTES: usize = 256 << 20;
/// The largest allocation the cache keeps (larger ones go back to the driver at once).
pub(crate) const CACHE_LARGEST: usize = 64 << 20;

/// The size an array's own allocation of `bytes` is rounded up to, so arrays of nearly the
/// same size share allocations: 512 bytes up to 64 KiB, then a quarter of the power of two
/// below (at most 25 % more than asked).
pub(crate) fn size_class(bytes: usize) -> usize {
    if bytes <= 64 << 10 {
        return bytes.div_ceil(512) * 512;
    }
    let step = (1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 4;
    bytes.div_ceil(step).saturating_mul(step)
}

/// Freed device allocations of arrays of one device, by size class, oldest first. Held under
/// its mutex; the pointers belong to the device's context and are free for reuse (everything
/// queued before their free runs before whatever is queued after their reuse: one stream).
pub(crate) struct Cache {
    free: Vec<(usize, CUdeviceptr)>,
    bytes: usize,
}

impl Cache {
    const fn new() -> Cache {
        Cache {
            free: Vec::new(),
            bytes: 0,
        }
    }

    /// An allocation of exactly `size`, if one is kept (the most recently freed).
    pub fn take(&mut self, size: usize) -> Option<CUdeviceptr> {
        let at = self.free.iter().rposition(|&(s, _)| s == size)?;
        let (_, ptr) = self.free.remove(at);
        self.bytes -= size;
        Some(ptr)
    }

    /// Keeps `ptr` (of `size`); returns the allocations to free now: the oldest ones while the
    /// cache is over its limits.
    pub fn put(&mut self, size: usize, ptr: CUdeviceptr) -> Vec<(usize, CUdeviceptr)> {
        self.free.push((size, ptr));
        self.bytes += size;
        let mut evicted = Vec::new();
        while self.free.len() > CACHE_ENTRIES || self.bytes > CACHE_BYTES {
            let (s, p) = self.free.remove(0);
            self.bytes -= s;
            evicted.push((s, p));
        }
        evicted
    }

    /// Everything kept, emptying the cache: its bytes and the allocations.
    pub fn drain(&mut self) -> (usize, Vec<CUdeviceptr>) {
        let bytes = std::mem::take(&mut self.bytes);
        (bytes, self.free.drain(..).map(|(_, p)| p).collect())
    }
}

static CACHES: [Mutex<Cache>; memory::MAX_CUDA_DEVICES] =
    [const { Mutex::new(Cache::new()) }; memory::MAX_CUDA_DEVICES];

/// The cache of device `ordinal`.
pub(crate) fn of(ordinal: usize) -> &'static Mutex<Cache> {
    &CACHES[ordinal.min(memory::MAX_CUDA_DEVICES - 1)]
}
