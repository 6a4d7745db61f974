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
//! - A file that is not valid safetensors (truncated, a corrupt header, byte ranges that do
//!   not cover the data) is `Error::Io` with kind `InvalidData`, naming the file. A tensor of a
//!   dtype ndscope has no equivalent for (`BF16`, `F16`, …) is `Unsupported`.
//! - `load_safetensors` creates all arrays or none: if one cannot be created (the manager is
//!   capped or closed, the memory limit), those created before it are closed again.
//! - `restore_safetensors` needs the file's names to be exactly the arrays' names, with the same
//!   shapes and dtypes (`InvalidArgument` naming the missing and the extra tensors,
//!   `ShapeMismatch`, `DTypeMismatch`); on any refusal no array has changed.
//! - Saving writes a temporary file beside `path` and renames it over `path`, so a crash or a
//!   full disk never leaves a truncated model where a good one was.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::Path;
use std::sync::Arc;

use safetensors::tensor::{SafeTensorError, SafeTensors, View};
use safetensors::Dtype as FileDType;

use crate::arena;
use crate::error::Ctx;
use crate::{DType, Element, Error, Manager, NDArray, NDList, Result, Shape};

/// One array's bytes, ready for the writer.
struct Tensor {
    dtype: FileDType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Tensor {
    fn dtype(&self) -> FileDType {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }
    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

fn file_dtype(dtype: DType) -> FileDType {
    match dtype {
        DType::F32 => FileDType::F32,
        DType::F64 => FileDType::F64,
        DType::I32 => FileDType::I32,
        DType::I64 => FileDType::I64,
        DType::U8 => FileDType::U8,
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
    let state = arena::lock();
    let entry = state.manager(&manager.0, ctx)?;
    let mut arrays = Vec::with_capacity(entry.arrays.len);
    let mut next = entry.arrays.head;
    while let Some(key) = next {
        let array = &state.arrays[key];
        arrays.push(NDArray(Arc::clone(&array.inner)));
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
    })
}

#[track_caller]
fn save(ctx: &Ctx, named: Vec<(String, NDArray)>, path: &Path) -> Result<()> {
    let mut tensors = Vec::with_capacity(named.len());
    for (name, array) in named {
        let tensor = Tensor {
            dtype: file_dtype(array.dtype()),
            shape: array.dims().to_vec(),
            bytes: le_bytes(&array)?,
        };
        tensors.push((name, tensor));
    }
    let views = tensors.iter().map(|(name, t)| (name.as_str(), t));
    safetensors::serialize_to_file(views, None, path).map_err(|e| match e {
        SafeTensorError::IoError(source) => io_error(ctx, path, source),
        other => ctx.invalid(format!(
            "the arrays cannot be written as safetensors: {other}"
        )),
    })
}

/// One tensor of a file, checked and converted to ndscope's terms.
struct FileTensor<'a> {
    name: String,
    dtype: DType,
    shape: Shape,
    data: &'a [u8],
}

/// Reads and checks a whole file: valid safetensors, every tensor of a dtype ndscope has and
/// of an addressable shape. Sorted by name.
fn read<'a>(ctx: &Ctx, path: &Path, bytes: &'a [u8]) -> Result<Vec<FileTensor<'a>>> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| invalid_file(ctx, path, e))?;
    let mut out = Vec::with_capacity(file.len());
    for (name, view) in file.iter() {
        let Some(dtype) = our_dtype(view.dtype()) else {
            return Err(ctx.unsupported(format!(
                "tensor '{name}' of {} is {:?}, which ndscope has no dtype for (f32 f64 i32 i64 u8)",
                path.display(),
                view.dtype()
            )));
        };
        let shape = Shape::from(view.shape());
        crate::shape::check(ctx, &shape, dtype)?;
        if view.data().len() != shape.size() * dtype.size_in_bytes() {
            return Err(invalid_file(
                ctx,
                path,
                format!(
                    "tensor '{name}' has {} bytes for shape {shape}",
                    view.data().len()
                ),
            ));
        }
        out.push(FileTensor {
            name: name.to_string(),
            dtype,
            shape,
            data: view.data(),
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

fn read_file(ctx: &Ctx, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| io_error(ctx, path, e))
}

/// A new array in `manager` holding a file tensor's data.
#[track_caller]
fn create(manager: &Manager, t: &FileTensor<'_>) -> Result<NDArray> {
    fn values<T: Element, const N: usize>(data: &[u8], from: fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                from(b)
            })
            .collect()
    }
    let shape = t.shape.clone();
    let array = match t.dtype {
        DType::F32 => manager.from_vec(values(t.data, f32::from_le_bytes), shape),
        DType::F64 => manager.from_vec(values(t.data, f64::from_le_bytes), shape),
        DType::I32 => manager.from_vec(values(t.data, i32::from_le_bytes), shape),
        DType::I64 => manager.from_vec(values(t.data, i64::from_le_bytes), shape),
        DType::U8 => manager.from_vec(t.data.to_vec(), shape),
    }?;
    array.set_name(&t.name);
    Ok(array)
}

/// Checks that `file` has exactly the tensors `named`, each of the same shape and dtype.
fn check_match(
    ctx: &Ctx,
    path: &Path,
    named: &[(String, NDArray)],
    file: &[FileTensor<'_>],
) -> Result<()> {
    let in_file: BTreeMap<&str, &FileTensor<'_>> =
        file.iter().map(|t| (t.name.as_str(), t)).collect();
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
        if t.dtype != array.dtype() {
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

/// Overwrites `named` with the file's tensors: every check first, then every staging copy,
/// then the writes.
#[track_caller]
fn restore(ctx: &Ctx, named: Vec<(String, NDArray)>, path: &Path) -> Result<()> {
    let bytes = read_file(ctx, path)?;
    let file = read(ctx, path, &bytes)?;
    check_match(ctx, path, &named, &file)?;
    // The file's data as arrays on each target's device, in a scratch manager per device; a
    // failure while staging (the memory limit) leaves every target untouched.
    let mut staging: Vec<Manager> = Vec::new();
    let result = stage_and_write(&named, &file, &mut staging);
    for m in staging {
        m.close()?;
    }
    result
}

#[track_caller]
fn stage_and_write(
    named: &[(String, NDArray)],
    file: &[FileTensor<'_>],
    staging: &mut Vec<Manager>,
) -> Result<()> {
    let by_name: BTreeMap<&str, &FileTensor<'_>> =
        file.iter().map(|t| (t.name.as_str(), t)).collect();
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
            sources.push((array, create(&scratch, t)?));
        }
    }
    for (target, source) in &sources {
        target.assign_(source)?;
    }
    Ok(())
}

impl Manager {
    /// Saves the arrays this manager holds (owned or borrowed; not those of its sub-managers)
    /// to a safetensors file at `path`, each under its name. Every array must be named, with
    /// unique names (`InvalidArgument` naming the unnamed or duplicate array, and where it was
    /// created). Writes a temporary file beside `path` and renames it, so `path` is never left
    /// half-written. `Io` when the file cannot be written.
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
        let path = path.as_ref();
        let bytes = read_file(&ctx, path)?;
        let file = read(&ctx, path, &bytes)?;
        let mut created = NDList::new();
        for t in &file {
            match create(self, t) {
                Ok(array) => created.push(array),
                Err(e) => {
                    // Nothing half-loaded: close what this call created.
                    created.close()?;
                    return Err(e);
                }
            }
        }
        Ok(created)
    }

    /// Overwrites, in place, the arrays this manager holds with the tensors of the same names
    /// in the safetensors file at `path` (DJL's `loadParameters`; allowed on a capped manager,
    /// as nothing new is created in it). The file must hold exactly these names, with the same
    /// shapes and dtypes; otherwise nothing changes and the error names the difference
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
    /// (`InvalidArgument`). Atomic as [`Manager::save_safetensors`].
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
