//! A workspace's memory block: one allocation carved by offset into array storage.
//!
//! The block is host RAM, a memory-mapped file, page-locked host memory (a CUDA owner's
//! `MirroringPolicy::HostOnly` block) or one allocation of device memory. It stands over those
//! raw regions and under the buffers carved from it: the workspace's allocator decides the
//! offsets, and `Block::carve` (in `storage.rs`, above both buffers) turns a range into
//! `Storage` that keeps the block alive.

use std::alloc::Layout;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapMut;
use parking_lot::Mutex;

use super::cuda::{DeviceMemory, PinnedMemory};
use crate::error::Ctx;
use crate::memory;
use crate::observe::{self, Event};
use crate::{Device, Error, Result};

/// Alignment of every host allocation ndscope makes (blocks and heap buffers): a cache line,
/// and a full AVX-512 vector.
pub(crate) const STORAGE_ALIGN: usize = 64;

/// One contiguous block. Freed (and its reservation released) when the last `Arc` drops: the
/// workspace holds one, and so does every array still living in it.
pub(crate) struct Block {
    /// Process-unique, so a workspace can tell its current block from one it replaced.
    id: u64,
    capacity: usize,
    /// The device whose memory limit the block is reserved against (its arrays' device).
    device: Device,
    kind: Kind,
}

enum Kind {
    Ram {
        base: NonNull<u8>,
        layout: Layout,
    },
    Mmap {
        base: NonNull<u8>,
        // Held for its Drop (unmapping); `base` points into it.
        _map: MmapMut,
        // Held for its lock, released when the file closes.
        _file: File,
        // This process's claim on the path, given up on drop.
        _claim: MappedFile,
        path: PathBuf,
        remove: bool,
    },
    /// Page-locked host memory (CUDA `HostOnly` mirroring).
    Pinned(PinnedMemory),
    /// Device memory of one CUDA device.
    Device(DeviceMemory),
}

// SAFETY: the block's bytes are only reached through storage that each owns a disjoint range and
// is itself guarded by its array's lock; the block itself only hands out its base pointer and
// frees the memory when the last reference drops.
unsafe impl Send for Block {}
// SAFETY: see `Send`.
unsafe impl Sync for Block {}

static NEXT_FILE: AtomicU64 = AtomicU64::new(0);
static NEXT_BLOCK: AtomicU64 = AtomicU64::new(0);

fn next_id() -> u64 {
    NEXT_BLOCK.fetch_add(1, Ordering::Relaxed)
}

/// Files mapped by live blocks of this process, with the workspace that maps each.
static MAPPED: Mutex<Vec<(PathBuf, String)>> = Mutex::new(Vec::new());

/// This process's claim on a file for one block: registered in [`MAPPED`] until dropped.
struct MappedFile(PathBuf);

impl MappedFile {
    /// Claims `path` for `workspace`, or `InvalidConfig` naming the workspace that maps it.
    fn claim(ctx: &Ctx, path: &Path, workspace: &str) -> Result<MappedFile> {
        let id = file_identity(path);
        let mut mapped = MAPPED.lock();
        if let Some((_, other)) = mapped.iter().find(|(p, _)| *p == id) {
            return Err(ctx.config(format!(
                "mmap_path {} of workspace '{workspace}' is already mapped by workspace '{other}' \
                 of this process; two live workspaces cannot share one file (their memory would \
                 alias)",
                path.display()
            )));
        }
        mapped.push((id.clone(), workspace.to_string()));
        Ok(MappedFile(id))
    }
}

impl Drop for MappedFile {
    fn drop(&mut self) {
        MAPPED.lock().retain(|(p, _)| *p != self.0);
    }
}

/// One name for a file however it is spelled: the canonical path (of its folder, if the file
/// does not exist yet).
fn file_identity(path: &Path) -> PathBuf {
    if let Ok(canonical) = std::fs::canonicalize(path) {
        return canonical;
    }
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    match (absolute.parent(), absolute.file_name()) {
        (Some(dir), Some(name)) => std::fs::canonicalize(dir)
            .map(|d| d.join(name))
            .unwrap_or(absolute.clone()),
        _ => absolute,
    }
}

impl Block {
    /// A zeroed block of `capacity > 0` bytes in host RAM, reserved against the CPU's limit.
    pub fn ram(ctx: &Ctx, capacity: usize) -> Result<Block> {
        let device = Device::Cpu;
        let layout = Layout::from_size_align(capacity.max(1), STORAGE_ALIGN)
            .map_err(|_| memory::system_refused(ctx, device, capacity))?;
        memory::reserve(ctx, device, capacity)?;
        // SAFETY: the layout is not zero-sized.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        match NonNull::new(ptr) {
            Some(base) => {
                memory::driver_allocated(device);
                Ok(Block {
                    id: next_id(),
                    capacity,
                    device,
                    kind: Kind::Ram { base, layout },
                })
            }
            None => {
                memory::release(device, capacity);
                Err(memory::system_refused(ctx, device, capacity))
            }
        }
    }

    /// A block of `capacity > 0` bytes of page-locked host memory (zeroed), reserved against the
    /// CPU's limit; `ordinal` is the CUDA device it is registered with.
    pub fn pinned(ctx: &Ctx, ordinal: usize, capacity: usize) -> Result<Block> {
        let device = Device::Cpu;
        memory::reserve(ctx, device, capacity)?;
        match PinnedMemory::alloc(ctx, ordinal, capacity) {
            Ok(pinned) => {
                memory::driver_allocated(device);
                Ok(Block {
                    id: next_id(),
                    capacity,
                    device,
                    kind: Kind::Pinned(pinned),
                })
            }
            Err(e) => {
                memory::release(device, capacity);
                Err(e)
            }
        }
    }

    /// A block of `capacity > 0` bytes of memory of CUDA device `ordinal` (not zeroed), reserved
    /// against its limit.
    pub fn device(ctx: &Ctx, ordinal: usize, capacity: usize) -> Result<Block> {
        let device = Device::Cuda(ordinal);
        memory::reserve(ctx, device, capacity)?;
        match DeviceMemory::alloc(ctx, ordinal, capacity) {
            Ok(memory) => Ok(Block {
                id: next_id(),
                capacity,
                device,
                kind: Kind::Device(memory),
            }),
            Err(e) => {
                memory::release(device, capacity);
                Err(e)
            }
        }
    }

    /// A block of `capacity > 0` bytes mapped from `path`, or from a new temporary file that is
    /// removed when the block is freed; `workspace` names the owner in errors.
    ///
    /// A file is mapped by one live block at a time: a path already mapped in this process is
    /// refused with `InvalidConfig` before anything is touched (two blocks on one file would
    /// alias each other's memory, and a shorter second mapping would truncate the file under
    /// the first), and an exclusive advisory lock on the file refuses a path mapped by another
    /// process that also locks (another ndscope).
    pub fn mmap(ctx: &Ctx, capacity: usize, path: Option<&Path>, workspace: &str) -> Result<Block> {
        let (path, remove) = match path {
            Some(p) => (p.to_path_buf(), false),
            None => {
                let safe: String = workspace
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
        let claim = MappedFile::claim(ctx, &path, workspace)?;
        let io = |source: std::io::Error| Error::Io {
            op: ctx.op,
            at: ctx.at,
            path: path.clone(),
            source,
        };
        memory::reserve(ctx, Device::Cpu, capacity)?;
        let opened = (|| {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)?;
            Ok(file)
        })();
        let file = match opened {
            Ok(file) => file,
            Err(e) => {
                memory::release(Device::Cpu, capacity);
                return Err(io(e));
            }
        };
        if let Err(e) = file.try_lock() {
            memory::release(Device::Cpu, capacity);
            return Err(match e {
                std::fs::TryLockError::WouldBlock => ctx.config(format!(
                    "mmap_path {} of workspace '{workspace}' is locked by another process that maps it; \
                     two workspaces cannot share one file",
                    path.display()
                )),
                std::fs::TryLockError::Error(e) => io(e),
            });
        }
        let mapped = (|| {
            // The old contents go (as a fresh block is zeroed), then the file takes its size.
            file.set_len(0)?;
            file.set_len(capacity as u64)?;
            // SAFETY: we hold the file's exclusive lock and this process maps it nowhere else
            // (`claim`); it was just emptied and sized to `capacity`, and is never truncated
            // while mapped. A process that ignores the advisory lock is outside our control, as
            // for any mapped file.
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
        memory::driver_allocated(Device::Cpu);
        Ok(Block {
            id: next_id(),
            capacity,
            device: Device::Cpu,
            kind: Kind::Mmap {
                base,
                _map: map,
                _file: file,
                _claim: claim,
                path,
                remove,
            },
        })
    }

    /// Bytes in the block.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The block's process-unique id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The address of its first byte (host or device pointer; for the memory timeline).
    pub fn address(&self) -> u64 {
        match &self.kind {
            Kind::Ram { base, .. } | Kind::Mmap { base, .. } => base.as_ptr() as usize as u64,
            Kind::Pinned(pinned) => pinned.base().as_ptr() as usize as u64,
            Kind::Device(memory) => memory.address(),
        }
    }

    /// The device whose memory limit the block counts against.
    pub fn memory_device(&self) -> Device {
        self.device
    }

    // Used by the CUDA backend only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    /// Whether the block is page-locked host memory.
    pub fn is_pinned(&self) -> bool {
        matches!(self.kind, Kind::Pinned(_))
    }

    /// Where the block's bytes are, for carving it into storage.
    #[inline]
    pub fn base(&self) -> Base<'_> {
        match &self.kind {
            Kind::Ram { base, .. } | Kind::Mmap { base, .. } => Base::Host(*base),
            Kind::Pinned(pinned) => Base::Host(pinned.base()),
            Kind::Device(memory) => Base::Device(memory),
        }
    }
}

/// Where a block's bytes are ([`Block::base`]).
pub(crate) enum Base<'a> {
    /// Host memory (RAM, a mapped file or page-locked memory), from its first byte.
    Host(NonNull<u8>),
    /// Memory of a CUDA device.
    Device(&'a DeviceMemory),
}

impl Drop for Block {
    fn drop(&mut self) {
        match &self.kind {
            Kind::Ram { base, layout } => {
                // SAFETY: `base` was allocated with exactly `layout` and is freed only here.
                unsafe { std::alloc::dealloc(base.as_ptr(), *layout) };
            }
            Kind::Mmap { path, remove, .. } => {
                // The map itself is unmapped when the field drops, after this.
                if *remove {
                    let _ = std::fs::remove_file(path);
                }
            }
            // Freed by their own Drop (stream-ordered for device memory).
            Kind::Pinned(_) | Kind::Device(_) => {}
        }
        memory::release(self.device, self.capacity);
        if observe::on() {
            observe::emit(Event::BlockFreed {
                block: self.id,
                device: self.device,
                capacity: self.capacity,
            });
        }
    }
}
