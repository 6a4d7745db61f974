//! A workspace's memory block: one allocation (or one mapped file) carved by offset.

use std::alloc::Layout;
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;

use crate::arena::memory;
use crate::backend::cpu::buffer::STORAGE_ALIGN;
use crate::error::Ctx;
use crate::{Device, Error, Result};

/// One contiguous block. Freed (and its reservation released) when the last `Arc` drops: the
/// workspace holds one, and so does every array still living in it.
pub(crate) struct Block {
    base: NonNull<u8>,
    capacity: usize,
    device: Device,
    kind: Kind,
}

enum Kind {
    Ram(Layout),
    Mmap {
        // Held for its Drop (unmapping); the pointer above points into it.
        _map: MmapMut,
        path: PathBuf,
        remove: bool,
    },
}

// SAFETY: the block's bytes are only reached through `Buffer`s that each own a disjoint range
// and are themselves guarded by their array's lock; the block itself only hands out its base
// pointer and frees the memory when the last reference drops.
unsafe impl Send for Block {}
// SAFETY: see `Send`.
unsafe impl Sync for Block {}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);

impl Block {
    /// A zeroed block of `capacity > 0` bytes in RAM, reserved against `device`'s limit.
    pub fn ram(ctx: &Ctx, device: Device, capacity: usize) -> Result<Block> {
        debug_assert!(capacity > 0);
        let layout = Layout::from_size_align(capacity, STORAGE_ALIGN)
            .map_err(|_| memory::system_refused(ctx, device, capacity))?;
        memory::reserve(ctx, device, capacity)?;
        // SAFETY: `capacity > 0`, so the layout is not zero-sized.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        match NonNull::new(ptr) {
            Some(base) => Ok(Block {
                base,
                capacity,
                device,
                kind: Kind::Ram(layout),
            }),
            None => {
                memory::release(device, capacity);
                Err(memory::system_refused(ctx, device, capacity))
            }
        }
    }

    /// A block of `capacity > 0` bytes mapped from `path`, or from a new temporary file that is
    /// removed when the block is freed.
    pub fn mmap(ctx: &Ctx, capacity: usize, path: Option<&Path>, name: &str) -> Result<Block> {
        debug_assert!(capacity > 0);
        let (path, remove) = match path {
            Some(p) => (p.to_path_buf(), false),
            None => {
                let safe: String = name
                    .chars()
                    .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                    .take(32)
                    .collect();
                let file = format!(
                    "ndscope-ws-{}-{}-{safe}.bin",
                    std::process::id(),
                    NEXT_FILE.fetch_add(1, Ordering::Relaxed)
                );
                (std::env::temp_dir().join(file), true)
            }
        };
        let io = |source: std::io::Error| Error::Io {
            op: ctx.op,
            at: ctx.at,
            path: path.clone(),
            source,
        };
        memory::reserve(ctx, Device::Cpu, capacity)?;
        let mapped = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)?;
            file.set_len(capacity as u64)?;
            // SAFETY: the file was just created or truncated by us and sized to `capacity`; we
            // never truncate it while mapped. Other processes modifying it is outside our
            // control, as for any mapped file.
            unsafe { MmapMut::map_mut(&file) }
        })();
        let mut map = match mapped {
            Ok(map) => map,
            Err(e) => {
                memory::release(Device::Cpu, capacity);
                if remove {
                    let _ = std::fs::remove_file(&path);
                }
                return Err(io(e));
            }
        };
        let Some(base) = NonNull::new(map.as_mut_ptr()) else {
            memory::release(Device::Cpu, capacity);
            return Err(memory::system_refused(ctx, Device::Cpu, capacity));
        };
        Ok(Block {
            base,
            capacity,
            device: Device::Cpu,
            kind: Kind::Mmap {
                _map: map,
                path,
                remove,
            },
        })
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        match &self.kind {
            Kind::Ram(layout) => {
                // SAFETY: `base` was allocated with exactly `layout` and is freed only here.
                unsafe { std::alloc::dealloc(self.base.as_ptr(), *layout) };
            }
            Kind::Mmap { path, remove, .. } => {
                // The map itself is unmapped when the field drops, after this.
                if *remove {
                    let _ = std::fs::remove_file(path);
                }
            }
        }
        memory::release(self.device, self.capacity);
    }
}
