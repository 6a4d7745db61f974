//! Saving and loading arrays in the [safetensors](https://github.com/huggingface/safetensors)
//! format, through the `safetensors` crate (the format's reference implementation): a JSON
//! header of names, dtypes, shapes and byte ranges, then the little-endian data.
//!
//! | Call | What it does |
//! |---|---|
//! | [`Manager::save_safetensors`] | the arrays the manager holds, by name |
//! | [`NDList::save_safetensors`] | the list's arrays, by name (or position) |
//! | [`Manager::load_safetensors`] | every tensor of a file, as new named arrays of the manager |
//! | [`Manager::restore_safetensors`], [`NDList::restore_safetensors`] | overwrites existing arrays in place (DJL's `loadParameters`) |
//!
//! Every call checks everything before it changes anything:
//! - Loading reads the header first: its size bounded (100 MB, and the file's length), its JSON
//!   checked by the `safetensors` crate, every byte range inside the file, which must be a
//!   regular file of exactly the length the header states (a FIFO, a device such as
//!   `/dev/zero` or a directory is refused at once, never read). A file that is not valid
//!   safetensors (truncated, a corrupt header, byte ranges that do not cover the data, a `BOOL`
//!   tensor holding a byte other than 0 or 1) is `Error::Io` with kind `InvalidData`, naming
//!   the file (and the tensor and the offset). A tensor of a dtype ndscope has no equivalent
//!   for (`BF16`, `F16`, …) is `Unsupported`.
//! - The tensors are charged to the device's memory limit before any is read
//!   (`OutOfMemory`, nothing read), then each is read from the file straight into its array's
//!   values: the file is never held in memory whole. A file whose length or modification time
//!   changed while it was read is an error (`InvalidData`), never arrays of mixed data.
//! - `load_safetensors` creates all arrays or none: if one cannot be created (the manager is
//!   capped or closed, the memory limit), those created before it are closed again.
//! - `restore_safetensors` needs the file's names to be exactly the arrays' names, with the same
//!   shapes and dtypes (`InvalidArgument` naming the missing and the extra tensors,
//!   `ShapeMismatch`, `DTypeMismatch`); on any refusal no array has changed.
//! - Saving refuses names the format cannot hold (`__metadata__`, its reserved key, and the
//!   empty name). It writes a temporary file beside `path` (`.<name>.ndscope-tmp-<pid>-<n>`,
//!   with the target's permissions, or `0666` less the umask for a new file), syncs it to
//!   disk, renames it over `path` and syncs the directory: a crash, a power cut or a full disk
//!   leaves the old file or the whole new one, never a truncated model. Temporaries left by a
//!   killed save (their process is gone) are removed by the next save to the same path.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::SystemTime;

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype as FileDType;

use crate::backend::cpu::num::CastTo;
use crate::dtype::dispatch_float;
use crate::error::Ctx;
use crate::state;
use crate::{DType, Device, Element, Error, Manager, NDArray, NDList, Result, Shape};

/// The largest header read, as the `safetensors` crate's own bound (100 MB): a larger one is
/// refused before it is read.
const MAX_HEADER: u64 = 100_000_000;

/// The bytes read at a time while converting a tensor's little-endian data to its values.
const CHUNK: usize = 1 << 16;

fn file_dtype(dtype: DType) -> FileDType {
    match dtype {
        DType::F32 => FileDType::F32,
        DType::F64 => FileDType::F64,
        DType::I32 => FileDType::I32,
        DType::I64 => FileDType::I64,
        DType::U8 => FileDType::U8,
        DType::F16 => FileDType::F16,
        DType::BF16 => FileDType::BF16,
    }
}

/// ndscope's dtype for a file's; `BOOL` loads as `U8` (0 or 1), as comparisons produce.
fn our_dtype(dtype: FileDType) -> Option<DType> {
    match dtype {
        FileDType::F32 => Some(DType::F32),
        FileDType::F64 => Some(DType::F64),
        FileDType::I32 => Some(DType::I32),
        FileDType::I64 => Some(DType::I64),
        FileDType::U8 | FileDType::BOOL => Some(DType::U8),
        FileDType::F16 => Some(DType::F16),
        FileDType::BF16 => Some(DType::BF16),
        _ => None,
    }
}

fn io_error(ctx: &Ctx, path: &Path, source: io::Error) -> Error {
    Error::Io {
        op: ctx.op,
        at: ctx.at,
        path: path.to_path_buf(),
        source,
    }
}

fn invalid_file(ctx: &Ctx, path: &Path, why: impl std::fmt::Display) -> Error {
    io_error(
        ctx,
        path,
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a valid safetensors file: {why}"),
        ),
    )
}

/// The arrays `manager` holds (owned or borrowed), not those of its sub-managers.
fn held_arrays(ctx: &Ctx, manager: &Manager) -> Result<Vec<NDArray>> {
    let state = state::lock();
    let entry = state.manager(&manager.0, ctx)?;
    let mut arrays = Vec::with_capacity(entry.arrays.len);
    let mut next = entry.arrays.head;
    while let Some(key) = next {
        let array = state.array_entry(key);
        arrays.push(NDArray(Arc::clone(&array.shared)));
        next = array.next;
    }
    Ok(arrays)
}

/// `(name, array)` for the arrays a manager holds: each must be named, names unique.
fn named_by_manager(ctx: &Ctx, manager: &Manager) -> Result<Vec<(String, NDArray)>> {
    let mut named = Vec::new();
    for array in held_arrays(ctx, manager)? {
        let Some(name) = array.name() else {
            return Err(ctx.invalid(format!(
                "array {} (created at {}) held by manager {} has no name: name every array \
                 with set_name, or save an NDList",
                array.id(),
                array.created_at(),
                manager.0.describe()
            )));
        };
        named.push((name, array));
    }
    check_unique(ctx, &named)?;
    Ok(named)
}

/// `(name, array)` for a list: the array's name, else its position.
fn named_by_list(ctx: &Ctx, list: &NDList) -> Result<Vec<(String, NDArray)>> {
    let named: Vec<(String, NDArray)> = list
        .iter()
        .enumerate()
        .map(|(i, a)| (a.name().unwrap_or_else(|| i.to_string()), a.clone()))
        .collect();
    check_unique(ctx, &named)?;
    Ok(named)
}

fn check_unique(ctx: &Ctx, named: &[(String, NDArray)]) -> Result<()> {
    let mut seen = BTreeMap::new();
    for (name, array) in named {
        if let Some(other) = seen.insert(name.as_str(), array) {
            return Err(ctx.invalid(format!(
                "two arrays are named '{name}' ({} created at {}, and {} created at {}): \
                 names in a file must be unique",
                other.id(),
                other.created_at(),
                array.id(),
                array.created_at()
            )));
        }
    }
    Ok(())
}

/// Refuses names the format cannot hold: `__metadata__` is its reserved key (a tensor under it
/// makes a file no reader accepts), and an empty name.
fn check_names(ctx: &Ctx, named: &[(String, NDArray)]) -> Result<()> {
    for (name, array) in named {
        let why = match name.as_str() {
            "__metadata__" => {
                "'__metadata__' is the key the safetensors format reserves for its metadata"
            }
            "" => "a tensor name in a safetensors file cannot be empty",
            _ => continue,
        };
        return Err(ctx.invalid(format!(
            "array {} (created at {}) cannot be saved under the name {name:?}: {why}; rename it",
            array.id(),
            array.created_at()
        )));
    }
    Ok(())
}

#[track_caller]
fn le_bytes(array: &NDArray) -> Result<Vec<u8>> {
    fn bytes<T: Element>(values: Vec<T>, to: impl Fn(T, &mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::with_capacity(values.len() * std::mem::size_of::<T>());
        for v in values {
            to(v, &mut out);
        }
        out
    }
    Ok(match array.dtype() {
        DType::F32 => bytes(array.to_vec::<f32>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DType::F64 => bytes(array.to_vec::<f64>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DType::I32 => bytes(array.to_vec::<i32>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DType::I64 => bytes(array.to_vec::<i64>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DType::U8 => array.to_vec::<u8>()?,
        DType::F16 => bytes(array.to_vec::<half::f16>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
        DType::BF16 => bytes(array.to_vec::<half::bf16>()?, |v, o| {
            o.extend_from_slice(&v.to_le_bytes())
        }),
    })
}

/// The header of a file holding `named` (in this order), padded with spaces to a multiple of 8
/// bytes as the format's writers do, and the data's length.
fn header(ctx: &Ctx, named: &[(String, NDArray)]) -> Result<(Vec<u8>, u64)> {
    let mut infos = Vec::with_capacity(named.len());
    let mut offset = 0usize;
    for (name, array) in named {
        let len = array
            .dims()
            .iter()
            .try_fold(array.dtype().size_in_bytes(), |n, &d| n.checked_mul(d))
            .ok_or_else(|| ctx.invalid(format!("array '{name}' is too large to save")))?;
        let end = offset
            .checked_add(len)
            .ok_or_else(|| ctx.invalid("the arrays are too large to save in one file"))?;
        let info = TensorInfo {
            dtype: file_dtype(array.dtype()),
            shape: array.dims().to_vec(),
            data_offsets: (offset, end),
        };
        infos.push((name.clone(), info));
        offset = end;
    }
    let metadata = Metadata::new(None, infos)
        .map_err(|e| ctx.invalid(format!("the arrays cannot be written as safetensors: {e}")))?;
    let mut bytes = serde_json::to_vec(&metadata)
        .map_err(|e| ctx.invalid(format!("the arrays cannot be written as safetensors: {e}")))?;
    bytes.resize(bytes.len().next_multiple_of(8), b' ');
    if bytes.len() as u64 > MAX_HEADER {
        return Err(ctx.invalid(format!(
            "the header for {} arrays would take {} bytes, more than the format's {MAX_HEADER}",
            named.len(),
            bytes.len()
        )));
    }
    Ok((bytes, offset as u64))
}

/// Temporary files of a save are named `.<file name>.ndscope-tmp-<pid>-<n>`, beside the target.
const TMP_MARK: &str = ".ndscope-tmp-";

/// Tells apart the temporaries of one process's saves.
static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// The prefix of the temporaries of saves to `file_name`.
fn tmp_prefix(file_name: &str) -> String {
    format!(".{file_name}{TMP_MARK}")
}

/// Whether process `pid` is gone (a temporary it left is stale).
#[cfg(unix)]
fn process_gone(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: `kill` with signal 0 sends nothing; it only checks that the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    !alive && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

#[cfg(not(unix))]
fn process_gone(_pid: u32) -> bool {
    false
}

/// Removes the temporaries earlier saves to `file_name` in `dir` left behind (their process
/// was killed): those of processes that no longer exist. Best effort, never an error.
fn remove_stale_temporaries(dir: &Path, file_name: &str) {
    let prefix = tmp_prefix(file_name);
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if pid != std::process::id() && process_gone(pid) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// A new temporary file beside the target, with the target's permissions (or those a new file
/// gets: `0666` less the umask).
fn create_temporary(dir: &Path, file_name: &str, mode: Option<u32>) -> io::Result<(File, PathBuf)> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        // The umask applies to a new file's mode: `0666 & !umask`, as any new file gets.
        options.mode(0o666);
    }
    loop {
        let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(
            "{}{}-{n}",
            tmp_prefix(file_name),
            std::process::id()
        ));
        match options.open(&tmp) {
            Ok(file) => {
                #[cfg(unix)]
                if let Some(mode) = mode {
                    use std::os::unix::fs::PermissionsExt;
                    // The target's own mode, umask or not (set on the open file, not the path).
                    if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(mode)) {
                        let _ = std::fs::remove_file(&tmp);
                        return Err(e);
                    }
                }
                #[cfg(not(unix))]
                let _ = mode;
                return Ok((file, tmp));
            }
            // Left by an earlier process of the same id: take the next number.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Saves `named` to `path`: a temporary file beside it, written, synced, renamed over `path`,
/// and the directory synced, so `path` holds the old file or the whole new one, even after a
/// crash or a power cut. Stale temporaries of earlier saves to `path` are removed first.
#[track_caller]
fn save(ctx: &Ctx, mut named: Vec<(String, NDArray)>, path: &Path) -> Result<()> {
    check_names(ctx, &named)?;
    // The reference implementation's order: by dtype (its `Dtype` order, widest first), then
    // by name, so a file saved here is laid out byte for byte as `safetensors` writes it.
    named.sort_by(|(a, x), (b, y)| {
        file_dtype(y.dtype())
            .cmp(&file_dtype(x.dtype()))
            .then_with(|| a.cmp(b))
    });
    let Some(file_name) = path.file_name().and_then(|n| n.to_str()) else {
        return Err(ctx.invalid(format!(
            "cannot save to {}: the path must end in a file name (of UTF-8 text)",
            path.display()
        )));
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let (header, data_len) = header(ctx, &named)?;
    // The target's permissions are kept; a directory there is refused by the rename.
    let mode = match std::fs::metadata(path) {
        #[cfg(unix)]
        Ok(m) => {
            use std::os::unix::fs::PermissionsExt;
            Some(m.permissions().mode() & 0o7777)
        }
        #[cfg(not(unix))]
        Ok(_) => None,
        Err(e) if e.kind() == io::ErrorKind::NotFound => None,
        Err(e) => return Err(io_error(ctx, path, e)),
    };
    remove_stale_temporaries(&dir, file_name);
    let (file, tmp) =
        create_temporary(&dir, file_name, mode).map_err(|e| io_error(ctx, path, e))?;
    let written = write_and_sync(ctx, file, &header, data_len, &named, path);
    let renamed =
        written.and_then(|()| std::fs::rename(&tmp, path).map_err(|e| io_error(ctx, path, e)));
    if let Err(e) = renamed {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    // The rename itself is durable once the directory is synced (not possible everywhere: a
    // directory cannot be opened on some systems, which is then not an error).
    if let Ok(d) = File::open(&dir) {
        d.sync_all().map_err(|e| io_error(ctx, &dir, e))?;
    }
    Ok(())
}

/// Writes the file's bytes to `file` (one array's bytes at a time) and syncs it to disk.
#[track_caller]
fn write_and_sync(
    ctx: &Ctx,
    file: File,
    header: &[u8],
    data_len: u64,
    named: &[(String, NDArray)],
    path: &Path,
) -> Result<()> {
    let io = |e| io_error(ctx, path, e);
    let total = 8 + header.len() as u64 + data_len;
    file.set_len(total).map_err(io)?;
    let mut out = io::BufWriter::with_capacity(1 << 20, file);
    out.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    out.write_all(header).map_err(io)?;
    for (_, array) in named {
        out.write_all(&le_bytes(array)?).map_err(io)?;
    }
    let file = out.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)
}

/// One tensor of a file, checked and converted to ndscope's terms; its data is read later.
struct FileTensor {
    name: String,
    dtype: DType,
    /// `BOOL` in the file: every byte must be 0 or 1.
    boolean: bool,
    shape: Shape,
    /// Where its bytes start in the file.
    start: u64,
}

/// An open safetensors file whose header was read and checked; the tensors' data is read
/// later, each straight into its array.
struct SafetensorsFile {
    file: File,
    path: PathBuf,
    /// Its length and modification time when opened: the data read must come from this file,
    /// not one changed meanwhile.
    len: u64,
    modified: Option<SystemTime>,
    /// Sorted by name.
    tensors: Vec<FileTensor>,
}

/// Opens `path` without blocking (a FIFO would wait for a writer) and checks it is a regular
/// file.
fn open_regular(ctx: &Ctx, path: &Path) -> Result<File> {
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path).map_err(|e| io_error(ctx, path, e))?;
    let meta = file.metadata().map_err(|e| io_error(ctx, path, e))?;
    if !meta.is_file() {
        let what = if meta.is_dir() {
            "a directory"
        } else {
            "not a regular file (a FIFO, a socket or a device)"
        };
        return Err(io_error(
            ctx,
            path,
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{what}: safetensors files are read from regular files only"),
            ),
        ));
    }
    Ok(file)
}

impl SafetensorsFile {
    /// Opens `path` and reads its header: size bounded, JSON checked by the format's crate,
    /// byte ranges inside the file, which must be a regular file of exactly the length the
    /// header states. Every tensor of a dtype ndscope has and of an addressable shape.
    fn open(ctx: &Ctx, path: &Path) -> Result<SafetensorsFile> {
        let mut file = open_regular(ctx, path)?;
        let meta = file.metadata().map_err(|e| io_error(ctx, path, e))?;
        let len = meta.len();
        let modified = meta.modified().ok();
        if len < 8 {
            return Err(invalid_file(
                ctx,
                path,
                format!("{len} bytes, less than the 8 of the header's length"),
            ));
        }
        let mut n = [0u8; 8];
        file.read_exact(&mut n).map_err(|e| changed(ctx, path, e))?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER || n > len - 8 {
            return Err(invalid_file(
                ctx,
                path,
                format!(
                    "the header is said to take {n} bytes, more than the {} after its length{}",
                    len - 8,
                    if n > MAX_HEADER {
                        format!(" and the format's limit of {MAX_HEADER}")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact(&mut header)
            .map_err(|e| changed(ctx, path, e))?;
        let metadata: Metadata = serde_json::from_slice(&header)
            .map_err(|e| invalid_file(ctx, path, format!("the header: {e}")))?;
        let data_start = 8 + n;
        let data_len = metadata.data_len() as u64;
        if data_start.checked_add(data_len) != Some(len) {
            return Err(invalid_file(
                ctx,
                path,
                format!(
                    "the header describes {data_len} bytes of data, the file has {}",
                    len - data_start
                ),
            ));
        }
        let mut tensors = Vec::new();
        for (name, info) in metadata.tensors() {
            let Some(dtype) = our_dtype(info.dtype) else {
                return Err(ctx.unsupported(format!(
                    "tensor '{name}' of {} is {:?}, which ndscope has no dtype for (f32 f64 i32 i64 u8)",
                    path.display(),
                    info.dtype
                )));
            };
            let shape = Shape::from(info.shape.as_slice());
            crate::shape::check(ctx, &shape, dtype)?;
            let (start, end) = info.data_offsets;
            let size = shape.size().checked_mul(dtype.size_in_bytes());
            if end.checked_sub(start) != size {
                return Err(invalid_file(
                    ctx,
                    path,
                    format!(
                        "tensor '{name}' has bytes {start}..{end} for shape {shape} of {dtype}"
                    ),
                ));
            }
            tensors.push(FileTensor {
                name,
                dtype,
                boolean: info.dtype == FileDType::BOOL,
                shape,
                start: data_start + start as u64,
            });
        }
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(SafetensorsFile {
            file,
            path: path.to_path_buf(),
            len,
            modified,
            tensors,
        })
    }

    /// Refuses (`OutOfMemory`, nothing read) when the tensors' bytes (each in the dtype it is
    /// loaded as) cannot all be allocated on `device` under its memory limit now, before any is
    /// read.
    fn charge(&self, ctx: &Ctx, device: Device, tensors: &[(&FileTensor, DType)]) -> Result<()> {
        let bytes = tensors
            .iter()
            .try_fold(0usize, |sum, (t, to)| {
                sum.checked_add(t.shape.size().checked_mul(to.size_in_bytes())?)
            })
            .unwrap_or(usize::MAX);
        crate::memory::reserve(ctx, device, bytes)?;
        crate::memory::release(device, bytes);
        Ok(())
    }

    /// A new array of `manager` holding tensor `t` as dtype `to` (a float tensor may be loaded
    /// as another float dtype, by `to_dtype`'s rounding), read from the file straight into the
    /// array's values: a converted tensor is converted a chunk at a time, so the file's values
    /// never exist in memory in full beside the converted ones.
    #[track_caller]
    fn create(
        &mut self,
        ctx: &Ctx,
        manager: &Manager,
        t: &FileTensor,
        to: DType,
    ) -> Result<NDArray> {
        self.file
            .seek(SeekFrom::Start(t.start))
            .map_err(|e| io_error(ctx, &self.path, e))?;
        let count = t.shape.size();
        let shape = t.shape.clone();
        if to != t.dtype {
            debug_assert!(to.is_float() && t.dtype.is_float());
            macro_rules! load_as {
                ($s:ty) => {
                    dispatch_float!(to, U => manager.from_vec(
                        self.converted::<$s, U, { std::mem::size_of::<$s>() }>(ctx, count, <$s>::from_le_bytes)?,
                        shape,
                    ), _ => return Err(ctx.invalid(format!("tensor '{}' cannot load as {to}", t.name))))
                };
            }
            let array = match t.dtype {
                DType::F32 => load_as!(f32),
                DType::F64 => load_as!(f64),
                DType::F16 => load_as!(half::f16),
                DType::BF16 => load_as!(half::bf16),
                other => {
                    return Err(ctx.invalid(format!(
                        "tensor '{}' is {other}: only float tensors load as another dtype",
                        t.name
                    )))
                }
            }?;
            array.set_name(&t.name);
            return Ok(array);
        }
        let array = match t.dtype {
            DType::F32 => manager.from_vec(self.values(ctx, count, f32::from_le_bytes)?, shape),
            DType::F64 => manager.from_vec(self.values(ctx, count, f64::from_le_bytes)?, shape),
            DType::I32 => manager.from_vec(self.values(ctx, count, i32::from_le_bytes)?, shape),
            DType::I64 => manager.from_vec(self.values(ctx, count, i64::from_le_bytes)?, shape),
            DType::F16 => {
                manager.from_vec(self.values(ctx, count, half::f16::from_le_bytes)?, shape)
            }
            DType::BF16 => {
                manager.from_vec(self.values(ctx, count, half::bf16::from_le_bytes)?, shape)
            }
            DType::U8 => {
                let mut bytes = vec![0u8; count];
                (&self.file)
                    .read_exact(&mut bytes)
                    .map_err(|e| changed(ctx, &self.path, e))?;
                if t.boolean {
                    if let Some(at) = bytes.iter().position(|&b| b > 1) {
                        return Err(invalid_file(
                            ctx,
                            &self.path,
                            format!(
                                "BOOL tensor '{}' holds {} at element {at} (byte {} of the \
                                 file): a boolean is 0 or 1",
                                t.name,
                                bytes[at],
                                t.start + at as u64
                            ),
                        ));
                    }
                }
                manager.from_vec(bytes, shape)
            }
        }?;
        array.set_name(&t.name);
        #[cfg(test)]
        tests::after_tensor_read();
        Ok(array)
    }

    /// `count` values of `N` little-endian bytes each, read at the file's position.
    fn values<T, const N: usize>(
        &mut self,
        ctx: &Ctx,
        count: usize,
        from: fn([u8; N]) -> T,
    ) -> Result<Vec<T>>
    where
        T: CastTo<T>,
    {
        self.converted::<T, T, N>(ctx, count, from)
    }

    /// `count` values of `N` little-endian bytes each, read at the file's position, each
    /// converted to `U` as `to_dtype` converts.
    fn converted<T, U, const N: usize>(
        &mut self,
        ctx: &Ctx,
        count: usize,
        from: fn([u8; N]) -> T,
    ) -> Result<Vec<U>>
    where
        T: CastTo<U>,
    {
        let mut out = Vec::with_capacity(count);
        let mut chunk = vec![0u8; CHUNK.min(count * N)];
        let mut left = count;
        while left > 0 {
            let take = left.min(CHUNK / N);
            let bytes = &mut chunk[..take * N];
            (&self.file)
                .read_exact(bytes)
                .map_err(|e| changed(ctx, &self.path, e))?;
            out.extend(bytes.chunks_exact(N).map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                from(b).cast()
            }));
            left -= take;
        }
        Ok(out)
    }

    /// `InvalidData` if the file's length or modification time differ from when it was
    /// opened: what was read may mix two versions.
    fn check_unchanged(&self, ctx: &Ctx) -> Result<()> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| io_error(ctx, &self.path, e))?;
        if meta.len() != self.len || meta.modified().ok() != self.modified {
            return Err(changed(
                ctx,
                &self.path,
                io::Error::other(format!(
                    "length {} and modified {:?} when opened, {} and {:?} after reading",
                    self.len,
                    self.modified,
                    meta.len(),
                    meta.modified().ok()
                )),
            ));
        }
        Ok(())
    }
}

/// The error for a file that changed (or shrank) while it was read.
fn changed(ctx: &Ctx, path: &Path, source: io::Error) -> Error {
    io_error(
        ctx,
        path,
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("the file changed while it was read ({source}); nothing was loaded"),
        ),
    )
}

/// Checks that `file` has exactly the tensors `named`, each of the same shape and dtype.
fn check_match(
    ctx: &Ctx,
    path: &Path,
    named: &[(String, NDArray)],
    file: &[FileTensor],
) -> Result<()> {
    let in_file: BTreeMap<&str, &FileTensor> = file.iter().map(|t| (t.name.as_str(), t)).collect();
    let wanted: BTreeSet<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    let missing: Vec<&str> = wanted
        .iter()
        .filter(|n| !in_file.contains_key(*n))
        .copied()
        .collect();
    let extra: Vec<&str> = in_file
        .keys()
        .filter(|n| !wanted.contains(*n))
        .copied()
        .collect();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(ctx.invalid(format!(
            "the tensors of {} do not match the arrays: missing from the file {missing:?}, \
             in the file but not among the arrays {extra:?}",
            path.display()
        )));
    }
    for (name, array) in named {
        let Some(t) = in_file.get(name.as_str()) else {
            continue;
        };
        if !array.is_open() {
            return Err(array.0.closed_error(ctx));
        }
        if t.shape.dims() != array.dims() {
            return Err(ctx.shape(format!(
                "tensor '{name}' of {} has shape {}, array {} has shape {}",
                path.display(),
                t.shape,
                array.0.describe(),
                array.shape()
            )));
        }
        // A float tensor restores into an array of another float dtype, converted as it is
        // read (a bf16 checkpoint into f32 master weights, as PyTorch's `load_state_dict`).
        if t.dtype != array.dtype() && !(t.dtype.is_float() && array.dtype().is_float()) {
            return Err(ctx.dtype(
                t.dtype,
                format!(
                    "tensor '{name}' of {} is {}, array {} is {}",
                    path.display(),
                    t.dtype,
                    array.0.describe(),
                    array.dtype()
                ),
            ));
        }
    }
    Ok(())
}

/// Overwrites `named` with the file's tensors: every check first, then every staging copy
/// (read from the file, which must not change meanwhile), then the writes.
#[track_caller]
fn restore(ctx: &Ctx, named: Vec<(String, NDArray)>, path: &Path) -> Result<()> {
    let mut file = SafetensorsFile::open(ctx, path)?;
    check_match(ctx, path, &named, &file.tensors)?;
    // The file's data as arrays on each target's device, in a scratch manager per device; a
    // failure while staging (the memory limit, a file changed meanwhile) leaves every target
    // untouched.
    let mut staging: Vec<Manager> = Vec::new();
    let result = stage_and_write(ctx, &named, &mut file, &mut staging);
    for m in staging {
        m.close()?;
    }
    result
}

#[track_caller]
fn stage_and_write(
    ctx: &Ctx,
    named: &[(String, NDArray)],
    file: &mut SafetensorsFile,
    staging: &mut Vec<Manager>,
) -> Result<()> {
    let tensors = std::mem::take(&mut file.tensors);
    let by_name: BTreeMap<&str, &FileTensor> =
        tensors.iter().map(|t| (t.name.as_str(), t)).collect();
    // Charged to each device's limit before anything is read.
    let mut per_device: Vec<(Device, Vec<(&FileTensor, DType)>)> = Vec::new();
    for (name, array) in named {
        if let Some(&t) = by_name.get(name.as_str()) {
            let staged = (t, array.dtype());
            match per_device.iter_mut().find(|(d, _)| *d == array.device()) {
                Some((_, ts)) => ts.push(staged),
                None => per_device.push((array.device(), vec![staged])),
            }
        }
    }
    for (device, ts) in &per_device {
        file.charge(ctx, *device, ts)?;
    }
    let mut sources = Vec::with_capacity(named.len());
    for (name, array) in named {
        let scratch = match staging.iter().find(|m| m.device() == array.device()) {
            Some(m) => m.clone(),
            None => {
                let m = Manager::new_base_on(array.device())?.with_name("restore-staging");
                staging.push(m.clone());
                m
            }
        };
        if let Some(t) = by_name.get(name.as_str()) {
            sources.push((array, file.create(ctx, &scratch, t, array.dtype())?));
        }
    }
    file.check_unchanged(ctx)?;
    for (target, source) in &sources {
        target.assign_(source)?;
    }
    Ok(())
}

impl Manager {
    /// Saves the arrays this manager holds (owned or borrowed; not those of its sub-managers)
    /// to a safetensors file at `path`, each under its name. Every array must be named, with
    /// unique names (`InvalidArgument` naming the unnamed or duplicate array, and where it was
    /// created), none of them `__metadata__` (the format's reserved key) or empty. Writes a
    /// temporary file beside `path` (with the permissions of the file it replaces), syncs it
    /// and renames it, so `path` is never left half-written, even by a crash. `Io` when the
    /// file cannot be written; nothing is left behind then.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let dir = std::env::temp_dir().join(format!("ndscope-doc-{}", std::process::id()));
    /// std::fs::create_dir_all(&dir).unwrap();
    /// let path = dir.join("model.safetensors");
    ///
    /// let model = Manager::new_base().with_name("model");
    /// model.randn([3, 2], DType::F32)?.set_name("w");
    /// model.zeros([2], DType::F32)?.set_name("b");
    /// model.save_safetensors(&path)?;
    ///
    /// let other = Manager::new_base();
    /// let loaded = other.load_safetensors(&path)?;              // new arrays, named as saved
    /// assert_eq!(loaded.len(), 2);
    /// model.restore_safetensors(&path)?;                        // in place, same names and shapes
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("Manager::save_safetensors");
        let named = named_by_manager(&ctx, self)?;
        save(&ctx, named, path.as_ref())
    }

    /// Loads every tensor of the safetensors file at `path` as a new array of this manager
    /// (on its device; in its workspace block inside a cycle), named as in the file, sorted by
    /// name. All or nothing: on any error no array is left behind. Errors: `Io` (unreadable or
    /// invalid file), `Unsupported` (a dtype ndscope lacks), `Capped`, `ManagerClosed`,
    /// `OutOfMemory`.
    #[track_caller]
    pub fn load_safetensors(&self, path: impl AsRef<Path>) -> Result<NDList> {
        let ctx = Ctx::new("Manager::load_safetensors");
        self.load_converted(&ctx, path.as_ref(), None)
    }

    /// [`load_safetensors`](Self::load_safetensors), with every float tensor converted to the
    /// float `dtype` as it is read (as `to_dtype` rounds: to nearest even, NaN and infinities
    /// kept), a chunk at a time: a bf16 checkpoint loads as f32 master weights (or an f32 one
    /// as bf16) without the file's values ever being held in full beside the converted ones.
    /// Integer and boolean tensors load as stored (token ids stay integers, as PyTorch's
    /// `torch_dtype` leaves them). `InvalidArgument` for a `dtype` that is not a float.
    ///
    /// ```
    /// use ndscope::{bf16, DType, Manager};
    /// # let dir = std::env::temp_dir().join(format!("ndscope-doc-as-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let path = dir.join("half.safetensors");
    /// let m = Manager::new_base();
    /// m.from_vec(vec![bf16::from_f32(1.5), bf16::from_f32(-2.0)], [2])?.set_name("w");
    /// m.save_safetensors(&path)?;
    /// let w = Manager::new_base().load_safetensors_as(&path, DType::F32)?;
    /// assert_eq!(w.get(0).unwrap().to_vec::<f32>()?, vec![1.5, -2.0]);
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn load_safetensors_as(&self, path: impl AsRef<Path>, dtype: DType) -> Result<NDList> {
        let ctx = Ctx::new("Manager::load_safetensors_as");
        if !dtype.is_float() {
            return Err(ctx.invalid(format!(
                "tensors load as a float dtype (f32, f64, f16, bf16), not {dtype}"
            )));
        }
        self.load_converted(&ctx, path.as_ref(), Some(dtype))
    }

    #[track_caller]
    fn load_converted(&self, ctx: &Ctx, path: &Path, to: Option<DType>) -> Result<NDList> {
        let mut file = SafetensorsFile::open(ctx, path)?;
        let tensors = std::mem::take(&mut file.tensors);
        let target = |t: &FileTensor| match to {
            Some(d) if t.dtype.is_float() && !t.boolean => d,
            _ => t.dtype,
        };
        // Inside a workspace cycle the arrays go to its block, which the limit already counts.
        if !crate::ndarray::exec::allocates_from_workspace(self) {
            let charged: Vec<_> = tensors.iter().map(|t| (t, target(t))).collect();
            file.charge(ctx, self.device(), &charged)?;
        }
        let mut created = NDList::new();
        let mut result = Ok(());
        for t in &tensors {
            match file.create(ctx, self, t, target(t)) {
                Ok(array) => created.push(array),
                Err(e) => {
                    result = Err(e);
                    break;
                }
            }
        }
        if let Err(e) = result.and_then(|()| file.check_unchanged(ctx)) {
            // Nothing half-loaded: close what this call created.
            created.close()?;
            return Err(e);
        }
        Ok(created)
    }

    /// Overwrites, in place, the arrays this manager holds with the tensors of the same names
    /// in the safetensors file at `path` (DJL's `loadParameters`; allowed on a capped manager,
    /// as nothing new is created in it). The file must hold exactly these names, with the same
    /// shapes and dtypes (a float tensor may restore into an array of another float dtype,
    /// converted as it is read, as PyTorch's `load_state_dict` copies a bf16 checkpoint into
    /// f32 parameters); otherwise nothing changes and the error names the difference
    /// (`InvalidArgument` for missing or extra names, `ShapeMismatch`, `DTypeMismatch`). Every
    /// held array must be named, as for [`save_safetensors`](Self::save_safetensors).
    #[track_caller]
    pub fn restore_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("Manager::restore_safetensors");
        let named = named_by_manager(&ctx, self)?;
        restore(&ctx, named, path.as_ref())
    }
}

impl NDList {
    /// Saves the list's arrays to a safetensors file at `path`, each under its name, or its
    /// position in the list (`"0"`, `"1"`, …) if it has none. Names must be unique
    /// (`InvalidArgument`), none of them `__metadata__` or empty. Atomic and crash-safe as
    /// [`Manager::save_safetensors`].
    ///
    /// ```
    /// use ndscope::{DType, Manager, NDList};
    /// # let dir = std::env::temp_dir().join(format!("ndscope-doc-list-{}", std::process::id()));
    /// # std::fs::create_dir_all(&dir).unwrap();
    /// let path = dir.join("pair.safetensors");
    /// let m = Manager::new_base();
    /// let pair: NDList = vec![m.ones([2], DType::F32)?, m.zeros([3], DType::I64)?].into();
    /// pair.save_safetensors(&path)?;
    /// let back = Manager::new_base().load_safetensors(&path)?;
    /// assert_eq!(back.get(0).and_then(|a| a.name()).as_deref(), Some("0"));
    /// # std::fs::remove_dir_all(&dir).unwrap();
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn save_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("NDList::save_safetensors");
        let named = named_by_list(&ctx, self)?;
        save(&ctx, named, path.as_ref())
    }

    /// Overwrites the list's arrays in place with the tensors of a safetensors file, matched by
    /// name (or position, as [`save_safetensors`](Self::save_safetensors) names them). Checked
    /// in full first, as [`Manager::restore_safetensors`]: on any refusal nothing changes.
    #[track_caller]
    pub fn restore_safetensors(&self, path: impl AsRef<Path>) -> Result<()> {
        let ctx = Ctx::new("NDList::restore_safetensors");
        let named = named_by_list(&ctx, self)?;
        restore(&ctx, named, path.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::time::{Duration, SystemTime};

    use crate::{DType, Error, Manager};

    thread_local! {
        /// Run after each tensor is read (unit tests only): changes the file midway.
        static AFTER_TENSOR: RefCell<Option<Box<dyn FnMut()>>> = RefCell::new(None);
    }

    pub(super) fn after_tensor_read() {
        AFTER_TENSOR.with(|hook| {
            if let Some(f) = hook.borrow_mut().as_mut() {
                f();
            }
        });
    }

    fn saved(test: &str) -> (std::path::PathBuf, Manager, crate::NDArray) {
        let d = std::env::temp_dir().join(format!("ndscope-unit-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let path = d.join("model.safetensors");
        let m = Manager::new_base();
        m.full([64], 1.0, DType::F32).unwrap().set_name("a");
        let b = m.full([64], 2.0, DType::F32).unwrap().with_name("b");
        m.save_safetensors(&path).unwrap();
        b.fill_(3.0).unwrap();
        (path, m, b)
    }

    fn assert_changed(err: &Error) {
        match err {
            Error::Io { source, .. } => {
                assert_eq!(source.kind(), std::io::ErrorKind::InvalidData, "{err}");
                assert!(
                    err.to_string().contains("changed while it was read"),
                    "{err}"
                );
            }
            other => panic!("expected Io, got {other}"),
        }
    }

    /// The file rewritten in place after the first tensor is read (same length, a later
    /// modification time): a load or a restore fails and nothing is loaded or changed.
    #[test]
    fn a_file_changed_while_read_is_an_error_and_loads_nothing() {
        let (path, m, b) = saved("changed");
        let good = std::fs::read(&path).unwrap();
        for rewrite in [false, true] {
            let target = Manager::new_base();
            let p = path.clone();
            AFTER_TENSOR.with(|h| {
                *h.borrow_mut() = Some(Box::new(move || {
                    let f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
                    if rewrite {
                        // Same length, another modification time.
                        f.set_modified(SystemTime::now() + Duration::from_secs(5))
                            .unwrap();
                    } else {
                        // Longer.
                        use std::io::Write;
                        (&f).write_all(b"more").unwrap();
                    }
                }))
            });
            let err = target.load_safetensors(&path).unwrap_err();
            assert_changed(&err);
            assert_eq!(target.report().total_arrays(), 0, "nothing half-loaded");
            std::fs::write(&path, &good).unwrap();
            let err = m.restore_safetensors(&path).unwrap_err();
            AFTER_TENSOR.with(|h| *h.borrow_mut() = None);
            assert_changed(&err);
            assert_eq!(b.to_vec::<f32>().unwrap(), vec![3.0; 64], "not restored");
            target.close().unwrap();
            std::fs::write(&path, &good).unwrap();
        }
        m.close().unwrap();
    }
}
