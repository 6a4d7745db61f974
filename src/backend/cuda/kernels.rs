//! ndscope's CUDA kernels (`kernels/*.cu`, one file per op family): compiled by NVRTC as one program for the device's own architecture
//! once per process, cached on disk so a later process loads the binary instead of compiling
//! again, and looked up by name and dtype.
//!
//! The f16 and bf16 kernels (`kernels/half.cu`) are a second program, compiled (or loaded from
//! the cache) the first time one of them is looked up on a device: it includes the CUDA
//! toolkit's `cuda_fp16.h` and `cuda_bf16.h`, which NVRTC 13 does not build in, so users of the
//! other dtypes never need them. Where the headers are is found at that point
//! ([`find_cuda_include`]); without them, or if the program does not compile, half-precision ops
//! on the device fail with `DeviceUnavailable` saying what was searched, and everything else
//! keeps working.
//!
//! The cache key holds the source, the architecture, the NVRTC version and the options (for the
//! half program also the include directory and a hash of its headers); a file whose key differs
//! (or that is damaged) is compiled anew and replaced. The directory is `NDSCOPE_KERNEL_CACHE` if
//! set, else `$XDG_CACHE_HOME/ndscope`, else `~/.cache/ndscope`, else the temp directory. A cache
//! that cannot be written only costs the compile next time.

use std::collections::HashMap;
use std::ffi::OsString;
use std::ffi::{c_char, CStr, CString};
use std::hash::BuildHasherDefault;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys::CUfunction;
use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys, Ptx};

use crate::backend::{Binary, Compare, Unary};
use crate::error::Ctx;
use crate::{DType, Device, Error, Result};

/// The kernel source: the files of `kernels/`, the shared part first, then one file per op
/// family, compiled as one program (a change to any file changes the cache key).
pub(crate) const SOURCE: &str = concat!(
    include_str!("kernels/common.cu"),
    include_str!("kernels/device.cu"),
    include_str!("kernels/transfer.cu"),
    include_str!("kernels/elementwise.cu"),
    include_str!("kernels/shape.cu"),
    include_str!("kernels/reduce.cu"),
    include_str!("kernels/nn.cu"),
    include_str!("kernels/matmul.cu"),
    include_str!("kernels/optim.cu"),
);

/// The f16/bf16 kernel source: the toolkit's half-precision headers, the shared part of the main
/// program (types, addressing, device functions; no kernels), then `half.cu`.
pub(crate) const HALF_SOURCE: &str = concat!(
    include_str!("kernels/half_headers.cu"),
    include_str!("kernels/common.cu"),
    include_str!("kernels/device.cu"),
    include_str!("kernels/half.cu"),
);

/// The two NVRTC programs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Program {
    /// Every dtype but the half-precision ones ([`SOURCE`]), compiled when a device is set up.
    Main,
    /// f16 and bf16 ([`HALF_SOURCE`]), compiled at the first lookup of one of its kernels.
    Half,
}

impl Program {
    fn source(self) -> &'static str {
        match self {
            Program::Main => SOURCE,
            Program::Half => HALF_SOURCE,
        }
    }

    /// The name of the program (NVRTC's, for its messages) and of its cache files.
    fn name(self) -> &'static str {
        match self {
            Program::Main => "kernels",
            Program::Half => "half-kernels",
        }
    }
}

/// NVRTC options: no fused multiply-adds, so float arithmetic rounds as on the CPU.
const OPTIONS: [&str; 2] = ["--fmad=false", "-std=c++17"];

/// The element types a kernel family is compiled for.
#[derive(Clone, Copy)]
enum Types {
    All,
    Float,
    /// f16 and bf16 only.
    Half,
    Int,
    /// The index dtypes of `one_hot` and `pick`: i32, i64, u8.
    Index,
}

impl Types {
    fn dtypes(self) -> Vec<DType> {
        DType::ALL
            .into_iter()
            .filter(|d| match self {
                Types::All => true,
                Types::Float => d.is_float(),
                Types::Half => d.is_half(),
                Types::Int | Types::Index => !d.is_float(),
            })
            .collect()
    }
}

/// Kernels taking one dtype, named `<base>_<dtype>` (besides those of the elementwise families,
/// listed by their op tables).
const ONE_DTYPE: &[(&str, Types)] = &[
    ("fill", Types::All),
    ("arange", Types::All),
    ("eye", Types::All),
    ("randn", Types::All),
    ("rand", Types::All),
    ("pow", Types::All),
    ("scale", Types::All),
    ("axpy", Types::All),
    ("div_checked", Types::Int),
    ("div_checked_inplace", Types::Int),
    ("max", Types::All),
    ("argmax", Types::All),
    ("argmax_parts", Types::All),
    ("softmax", Types::Float),
    ("softmax_split", Types::Float),
    ("bias_act", Types::Float),
    ("bias_act_grad", Types::Float),
    ("gemm_rounded", Types::Half),
    ("matmul", Types::Int),
    ("sgd_update", Types::Float),
    ("adam_update", Types::Float),
    ("sgd_multi", Types::Float),
    ("adam_multi", Types::Float),
    ("adam_count", Types::Float),
];

/// Kernels taking two dtypes, named `<base>_<a>_<b>`, with the pairs they are compiled for.
const TWO_DTYPES: &[(&str, Types, Types)] = &[
    ("cast", Types::All, Types::All),
    ("one_hot", Types::Index, Types::All),
    ("pick", Types::All, Types::Index),
    ("softmax_ce", Types::Float, Types::Index),
];

/// `sum_<in>_<out>`: floats accumulate in f64, integers in i64 (sums) or f64 (means); the half
/// types' partial sums pass through f64 (`_f64` out, then `f64_` in).
const SUMS: &[(DType, DType)] = &[
    (DType::F16, DType::F16),
    (DType::F16, DType::F64),
    (DType::F64, DType::F16),
    (DType::BF16, DType::BF16),
    (DType::BF16, DType::F64),
    (DType::F64, DType::BF16),
    (DType::F32, DType::F32),
    (DType::F32, DType::F64),
    (DType::F64, DType::F64),
    (DType::F64, DType::F32),
    (DType::I32, DType::I64),
    (DType::I32, DType::F64),
    (DType::I64, DType::I64),
    (DType::I64, DType::F64),
    (DType::U8, DType::I64),
    (DType::U8, DType::F64),
];

/// Kernels that only move bits, by element size: `<base>_b1`, `_b2`, `_b4`, `_b8` (in the main
/// program: moving half-precision elements needs no header).
const BY_SIZE: &[&str] = &["gather", "transpose", "copy_rows"];

/// The lookup key of a kernel: its base name and two dtype codes or an element size.
type Key = (&'static str, u8, u8);

/// Every kernel the backend may launch: its lookup key, its name in the kernel source, and the
/// program that holds it (the half one for every kernel with a half-precision dtype).
fn expected() -> Vec<(Key, String, Program)> {
    let mut all = Vec::new();
    // The elementwise families' kernels, from their rows in `backend::op_table`.
    let binary = Binary::ALL.iter().flat_map(|op| {
        let (array, scalar, inplace) = op.kernel_names();
        [array, scalar, inplace].map(|name| (name, Types::All))
    });
    let compare = Compare::ALL.iter().flat_map(|op| {
        let (array, scalar) = op.kernel_names();
        [array, scalar].map(|name| (name, Types::All))
    });
    let unary = Unary::ALL.iter().map(|op| {
        let types = if op.float_only() {
            Types::Float
        } else {
            Types::All
        };
        (op.kernel_name(), types)
    });
    let table: Vec<(&'static str, Types)> = binary.chain(compare).chain(unary).collect();
    for &(base, types) in ONE_DTYPE.iter().chain(&table) {
        for d in types.dtypes() {
            all.push((
                (base, dtype_code(d), NO_DTYPE),
                format!("{base}_{d}"),
                program_of(&[d]),
            ));
        }
    }
    let mut pairs: Vec<(&'static str, DType, DType)> =
        SUMS.iter().map(|&(a, b)| ("sum", a, b)).collect();
    for &(base, first, second) in TWO_DTYPES {
        for a in first.dtypes() {
            for b in second.dtypes() {
                pairs.push((base, a, b));
            }
        }
    }
    for (base, a, b) in pairs {
        all.push((
            (base, dtype_code(a), dtype_code(b)),
            format!("{base}_{a}_{b}"),
            program_of(&[a, b]),
        ));
    }
    for &base in BY_SIZE {
        for size in [1u8, 2, 4, 8] {
            all.push((
                (base, size, NO_DTYPE),
                format!("{base}_b{size}"),
                Program::Main,
            ));
        }
    }
    all
}

/// The program of a kernel for `dtypes`.
fn program_of(dtypes: &[DType]) -> Program {
    if dtypes.iter().any(|d| d.is_half()) {
        Program::Half
    } else {
        Program::Main
    }
}

/// [`expected`], computed once: the names the handles of every device refer to.
fn names() -> &'static [(Key, String, Program)] {
    static NAMES: OnceLock<Vec<(Key, String, Program)>> = OnceLock::new();
    NAMES.get_or_init(expected)
}

/// Kernel handles by lookup key.
type Table = HashMap<Key, Function, BuildHasherDefault<KeyHasher>>;

/// The loaded kernels of one device: the main program's, and the half-precision program's once
/// one of them has been looked up.
pub(crate) struct Kernels {
    _module: Arc<CudaModule>,
    functions: Table,
    /// The device's context and the architecture compiled for, to load the half program.
    ctx: Arc<CudaContext>,
    arch: String,
    ordinal: usize,
    /// The half program's module and kernels, or why it cannot be had (kept: the headers or the
    /// compiler will not appear during the process).
    half: OnceLock<std::result::Result<(Arc<CudaModule>, Table), String>>,
}

/// The hasher of the kernel table's keys (a short name and two bytes), looked up on every
/// launch: a multiply-and-rotate per word, as rustc's own `FxHasher`. Measured: SipHash, the
/// default, was about a quarter of the host's cost of a replayed op (`benches/cuda.rs`,
/// `replay_check`: 113 → 94 ns per op). The keys are the backend's own names, not input.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl KeyHasher {
    #[inline]
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl std::hash::Hasher for KeyHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w.copy_from_slice(c);
            self.add(u64::from_le_bytes(w));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            // The last bytes, zero-padded, shifted into a register: copying them into a buffer
            // to load it as one word is a `memcpy` call whose stores the load then waits for
            // (a failed store-to-load forward), which was the single slowest step of a replayed
            // op's host cost (`benches/cuda.rs`, `replay_check`).
            let word = rest
                .iter()
                .enumerate()
                .fold(0u64, |w, (i, &b)| w | u64::from(b) << (8 * i));
            self.add(word);
        }
    }

    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.add(u64::from(i));
    }

    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

/// A kernel handle (valid while the module lives, which is the process) and the kernel's name
/// in the kernel source (for the launch check, [`check_launch`]).
#[derive(Clone, Copy)]
pub(crate) struct Function(pub CUfunction, pub &'static str);

// SAFETY: a CUfunction is an immutable handle into a module that is never unloaded; the driver
// allows launching it from any thread.
unsafe impl Send for Function {}
// SAFETY: as above.
unsafe impl Sync for Function {}

fn dtype_code(dtype: DType) -> u8 {
    match dtype {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::I32 => 2,
        DType::I64 => 3,
        DType::U8 => 4,
        DType::F16 => 5,
        DType::BF16 => 6,
    }
}

const NO_DTYPE: u8 = u8::MAX;

impl Kernels {
    /// Compiles (or loads from the disk cache) the kernels for compute capability
    /// `major.minor` and loads them into `ctx`: a CUBIN for the device's own architecture, or,
    /// for a GPU newer than every architecture this NVRTC knows, PTX of the newest one it knows,
    /// which the driver compiles for the device when it loads it.
    pub fn load(
        ctx: &Arc<CudaContext>,
        ordinal: usize,
        (major, minor): (i32, i32),
    ) -> std::result::Result<Kernels, String> {
        let device = u32::try_from(major * 10 + minor).unwrap_or(0);
        let arch = target(device, &supported_archs()?)
            .map_err(|why| format!("NVRTC {} {why}", nvrtc_version().unwrap_or_default()))?;
        let (module, functions) = load_program(ctx, &arch, Program::Main, None)?;
        Ok(Kernels {
            _module: module,
            functions,
            ctx: Arc::clone(ctx),
            arch,
            ordinal,
            half: OnceLock::new(),
        })
    }

    /// The half-precision kernels, compiled (or loaded from the cache) and loaded into the
    /// device's context at the first call.
    fn half(&self) -> std::result::Result<&Table, &String> {
        self.half
            .get_or_init(|| {
                let include = find_cuda_include()?;
                load_program(&self.ctx, &self.arch, Program::Half, Some(&include))
            })
            .as_ref()
            .map(|(_, table)| table)
    }
}

/// Compiles (or loads from the disk cache) `program` for `arch` and loads it into `ctx`, with its
/// kernels found; a damaged cache entry (a truncated or overwritten file whose key still
/// matches) is compiled again and replaced, instead of disabling the device.
fn load_program(
    ctx: &Arc<CudaContext>,
    arch: &str,
    program: Program,
    include: Option<&Path>,
) -> std::result::Result<(Arc<CudaModule>, Table), String> {
    let (cubin, cached) = cached_or_compiled(program, arch, include, false)?;
    match from_cubin(ctx, arch, program, cubin) {
        Ok(loaded) => Ok(loaded),
        Err(why) if cached => {
            tracing::warn!(
                target: "ndscope::cuda",
                "ndscope's cached CUDA {} for {arch} could not be used ({}); compiling them again",
                program.name(),
                why.lines().next().unwrap_or("")
            );
            let (cubin, _) = cached_or_compiled(program, arch, include, true)?;
            from_cubin(ctx, arch, program, cubin)
        }
        Err(why) => Err(why),
    }
}

/// Loads `image`, `program` compiled for `arch`, into `ctx` and finds each of its kernels: a
/// CUBIN, or for a virtual architecture PTX text, which the driver compiles for the device.
fn from_cubin(
    ctx: &Arc<CudaContext>,
    arch: &str,
    program: Program,
    image: Vec<u8>,
) -> std::result::Result<(Arc<CudaModule>, Table), String> {
    let image = if arch.starts_with("compute_") {
        Ptx::from_src(String::from_utf8_lossy(&image).into_owned())
    } else {
        Ptx::from_binary(image)
    };
    let module = ctx.load_module(image).map_err(|e| {
        format!(
            "loading the compiled kernels failed: {}",
            super::driver::describe(e)
        )
    })?;
    let mut functions = HashMap::default();
    for (key, name, _) in names().iter().filter(|(_, _, p)| *p == program) {
        let f = module.load_function(name).map_err(|e| {
            format!(
                "kernel `{name}` is missing from the compiled module: {}",
                super::driver::describe(e)
            )
        })?;
        functions.insert(*key, Function(f.cu_function(), name.as_str()));
    }
    Ok((module, functions))
}

/// Whether a lookup key names a half-precision kernel (of the half program).
fn is_half_key(key: Key) -> bool {
    let half = |code: u8| code == dtype_code(DType::F16) || code == dtype_code(DType::BF16);
    half(key.1) || half(key.2)
}

impl Kernels {
    /// The kernel of `key`: from the main program's table (one lookup, the hot path), else for
    /// a half-precision key from the half program's, loaded at the first such lookup.
    #[inline]
    fn find(&self, ctx: &Ctx, key: Key, what: impl Fn() -> String) -> Result<Function> {
        if let Some(&f) = self.functions.get(&key) {
            return Ok(f);
        }
        let missing = || ctx.unsupported(format!("no CUDA kernel for {}", what()));
        if !is_half_key(key) {
            return Err(missing());
        }
        match self.half() {
            Ok(table) => table.get(&key).copied().ok_or_else(missing),
            Err(why) => Err(Error::DeviceUnavailable {
                op: ctx.op,
                at: ctx.at,
                device: Device::Cuda(self.ordinal),
                reason: format!("no f16/bf16 kernels ({}): {why}", what()),
            }),
        }
    }

    /// The kernel `<base>_<dtype>`.
    pub fn one(&self, ctx: &Ctx, base: &'static str, dtype: DType) -> Result<Function> {
        self.find(ctx, (base, dtype_code(dtype), NO_DTYPE), || {
            format!("`{base}` on {dtype}")
        })
    }

    /// The kernel `<base>_<a>_<b>`.
    pub fn two(&self, ctx: &Ctx, base: &'static str, a: DType, b: DType) -> Result<Function> {
        self.find(ctx, (base, dtype_code(a), dtype_code(b)), || {
            format!("`{base}` from {a} to {b}")
        })
    }

    /// The kernel `<base>_b<size>` moving elements of `size` bytes.
    pub fn sized(&self, ctx: &Ctx, base: &'static str, size: usize) -> Result<Function> {
        self.find(ctx, (base, size as u8, NO_DTYPE), || {
            format!("`{base}` of {size}-byte elements")
        })
    }
}

/// The CUBIN of `program` for `arch` and whether it came from the disk cache: from the cache
/// when its key matches (unless `fresh`), else compiled now and written to the cache (replacing
/// what was there). `include`: the toolkit's include directory (the half program's headers),
/// whose path and header contents are part of the key.
fn cached_or_compiled(
    program: Program,
    arch: &str,
    include: Option<&Path>,
    fresh: bool,
) -> std::result::Result<(Vec<u8>, bool), String> {
    let version = nvrtc_version()?;
    let options = options(arch, include);
    let mut key = format!(
        "ndscope-kernels v1\narch {arch}\nnvrtc {version}\noptions {}\nsource {}\n",
        options.join(" "),
        fnv1a(program.source().as_bytes())
    );
    if let Some(dir) = include {
        key.push_str(&format!("headers {:016x}\n", headers_hash(dir)));
    }
    let path = cache_dir().map(|dir| {
        dir.join(format!(
            "{}-{arch}-{:016x}.bin",
            program.name(),
            fnv1a(key.as_bytes())
        ))
    });
    if let (Some(path), false) = (&path, fresh) {
        if let Ok(bytes) = std::fs::read(path) {
            if let Some(cubin) = bytes.strip_prefix(key.as_bytes()) {
                if !cubin.is_empty() {
                    return Ok((cubin.to_vec(), true));
                }
            }
        }
    }
    let cubin = compile(program, arch, include).map_err(|log| {
        format!(
            "NVRTC could not compile ndscope's {} for {arch}:\n{log}",
            program.name()
        )
    })?;
    if let Some(path) = &path {
        // Written whole under a temporary name, then renamed: a reader never sees half a file.
        // The name is unique per process and per thread (and per call), so two writers never
        // share a temporary file.
        static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let thread = format!("{:?}", std::thread::current().id());
        let thread: String = thread.chars().filter(char::is_ascii_digit).collect();
        let tmp = path.with_extension(format!(
            "tmp{}-{thread}-{}",
            std::process::id(),
            WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut contents = key.into_bytes();
        contents.extend_from_slice(&cubin);
        if let Some(dir) = path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if std::fs::write(&tmp, &contents).is_ok() && std::fs::rename(&tmp, path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok((cubin, false))
}

fn cache_dir() -> Option<PathBuf> {
    let env = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("NDSCOPE_KERNEL_CACHE")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("ndscope")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("ndscope")))
        .or_else(|| Some(std::env::temp_dir().join("ndscope-cache")))
}

/// The real architectures (`75` for sm_75, …) this NVRTC compiles CUBINs for, oldest first; for
/// tests, none past `NDSCOPE_CUDA_PRETEND`'s `nvrtc_max`.
fn supported_archs() -> std::result::Result<Vec<u32>, String> {
    let mut n = 0;
    // SAFETY: an out-parameter; the library was checked to be present before any call.
    unsafe { nvrtc_sys::nvrtcGetNumSupportedArchs(&mut n) }
        .result()
        .map_err(|e| format!("nvrtcGetNumSupportedArchs failed: {e:?}"))?;
    let mut archs = vec![0; usize::try_from(n).unwrap_or(0)];
    if !archs.is_empty() {
        // SAFETY: `archs` holds as many entries as NVRTC said it writes.
        unsafe { nvrtc_sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()) }
            .result()
            .map_err(|e| format!("nvrtcGetSupportedArchs failed: {e:?}"))?;
    }
    let max = super::driver::pretend("nvrtc_max").unwrap_or(i32::MAX);
    let mut archs: Vec<u32> = archs
        .into_iter()
        .filter(|&a| a <= max)
        .filter_map(|a| u32::try_from(a).ok())
        .collect();
    archs.sort_unstable();
    Ok(archs)
}

/// What to compile for a device of architecture `device` (`90` for sm_90) with an NVRTC that
/// knows `supported`: `sm_XY`, a CUBIN, when it knows the device's own; else `compute_XY`, PTX of
/// the newest architecture below the device's (the driver compiles PTX for newer GPUs); an
/// error for a device older than everything NVRTC knows (which the caller prefixes with NVRTC's
/// name and version: this needs no NVRTC loaded).
fn target(device: u32, supported: &[u32]) -> std::result::Result<String, String> {
    if supported.contains(&device) {
        return Ok(format!("sm_{device}"));
    }
    match supported.iter().copied().filter(|&a| a < device).max() {
        Some(older) => Ok(format!("compute_{older}")),
        None => Err(format!(
            "compiles for sm_{} to sm_{}, none of which runs on this sm_{device} GPU",
            supported.first().copied().unwrap_or(0),
            supported.last().copied().unwrap_or(0),
        )),
    }
}

// ---- the toolkit's include directory (the half program's headers) ----

/// The variable naming the directory that holds `cuda_fp16.h` and `cuda_bf16.h`: when set, the
/// only place looked at.
pub(crate) const INCLUDE_VAR: &str = "NDSCOPE_CUDA_INCLUDE";

/// The directory holding the CUDA toolkit's `cuda_fp16.h` (and `cuda_bf16.h`), which the
/// half-precision kernels include: `$NDSCOPE_CUDA_INCLUDE` if set (then only it), else the first
/// of `$CUDA_PATH/include`, `$CUDA_HOME/include`, `$CUDA_ROOT/include`, the `include` directory
/// beside the loaded NVRTC's library directory (a toolkit's `lib64/../include`, or PyPI's
/// `nvidia/cu13/include`, which `nvidia-cuda-runtime` fills), `/usr/local/cuda/include`,
/// `/opt/cuda/include` and `/usr/include` that has `cuda_fp16.h`. The error says what was
/// searched and which variable to set.
pub(crate) fn find_cuda_include() -> std::result::Result<PathBuf, String> {
    search_include(
        &|name| std::env::var_os(name),
        loaded_nvrtc_dir().as_deref(),
        &|dir| dir.join("cuda_fp16.h").is_file(),
    )
}

/// [`find_cuda_include`] with the environment, the loaded NVRTC's directory and the header test
/// given (for tests).
fn search_include(
    env: &dyn Fn(&str) -> Option<OsString>,
    nvrtc_dir: Option<&Path>,
    has_headers: &dyn Fn(&Path) -> bool,
) -> std::result::Result<PathBuf, String> {
    let set = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(INCLUDE_VAR) {
        return if has_headers(&dir) {
            Ok(dir)
        } else {
            Err(format!(
                "{INCLUDE_VAR}={} holds no cuda_fp16.h: set it to the CUDA toolkit's include \
                 directory (e.g. /usr/local/cuda/include), or unset it to search the usual places",
                dir.display()
            ))
        };
    }
    let mut places: Vec<(String, PathBuf)> = Vec::new();
    for var in ["CUDA_PATH", "CUDA_HOME", "CUDA_ROOT"] {
        if let Some(root) = set(var) {
            let dir = root.join("include");
            places.push((format!("${var}/include ({})", dir.display()), dir));
        }
    }
    if let Some(dir) = nvrtc_dir.and_then(Path::parent).map(|p| p.join("include")) {
        places.push((format!("beside the loaded NVRTC ({})", dir.display()), dir));
    }
    for fixed in [
        "/usr/local/cuda/include",
        "/opt/cuda/include",
        "/usr/include",
    ] {
        places.push((fixed.to_string(), PathBuf::from(fixed)));
    }
    if let Some((_, dir)) = places.iter().find(|(_, dir)| has_headers(dir)) {
        return Ok(dir.clone());
    }
    let searched: Vec<&str> = places.iter().map(|(what, _)| what.as_str()).collect();
    Err(format!(
        "the CUDA toolkit's cuda_fp16.h and cuda_bf16.h, which the f16/bf16 kernels include \
         (NVRTC 13 does not build them in), were not found; searched {}; set {INCLUDE_VAR} to the \
         directory holding them (a CUDA toolkit's include directory, or \
         site-packages/nvidia/cu13/include of PyPI's nvidia-cuda-runtime)",
        searched.join(", ")
    ))
}

/// The directory of the NVRTC library this process loaded (from `/proc/self/maps`), if any.
fn loaded_nvrtc_dir() -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.find('/').map(|at| Path::new(&line[at..])))
        .find(|path| {
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libnvrtc.so"))
        })
        .and_then(Path::parent)
        .map(Path::to_path_buf)
}

/// FNV-1a, 64 bits: a stable hash for the cache file name and key (not for security: the file
/// holds the whole key and is checked against it).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// NVRTC's version as `major.minor`.
pub(crate) fn nvrtc_version() -> std::result::Result<String, String> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two out-parameters; the library was checked to be present before any call.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("nvrtcVersion failed: {e:?}"))?;
    Ok(format!("{major}.{minor}"))
}

/// NVRTC's options for `arch`, with the include directory of the half program's headers.
fn options(arch: &str, include: Option<&Path>) -> Vec<String> {
    let mut options: Vec<String> = OPTIONS.iter().map(|s| s.to_string()).collect();
    if let Some(dir) = include {
        options.push(format!("--include-path={}", dir.display()));
    }
    options.push(format!("--gpu-architecture={arch}"));
    options
}

/// A hash of the half-precision headers in `dir` (those present), for the cache key: another
/// toolkit's headers in the same place compile anew.
fn headers_hash(dir: &Path) -> u64 {
    let mut all = Vec::new();
    for name in HEADERS {
        all.extend_from_slice(name.as_bytes());
        if let Ok(bytes) = std::fs::read(dir.join(name)) {
            all.extend_from_slice(&bytes);
        }
    }
    fnv1a(&all)
}

/// The headers of the half program (and the `.hpp` files they include).
const HEADERS: [&str; 4] = [
    "cuda_fp16.h",
    "cuda_fp16.hpp",
    "cuda_bf16.h",
    "cuda_bf16.hpp",
];

/// Compiles `which` program for `arch`: a CUBIN for a real architecture (`sm_90`), PTX text for a
/// virtual one (`compute_90`); or returns the compiler's log.
fn compile(
    which: Program,
    arch: &str,
    include: Option<&Path>,
) -> std::result::Result<Vec<u8>, String> {
    let source = CString::new(which.source())
        .map_err(|_| "the kernel source holds a NUL byte".to_string())?;
    let name = match which {
        Program::Main => c"ndscope_kernels.cu",
        Program::Half => c"ndscope_half_kernels.cu",
    };
    let program = nvrtc::create_program(&source, Some(name))
        .map_err(|e| format!("nvrtcCreateProgram failed: {e:?}"))?;
    let options = options(arch, include);
    // SAFETY: `program` is live until the destroy below; the options hold no NUL bytes.
    let result = unsafe {
        match nvrtc::compile_program(program, &options) {
            Ok(()) if arch.starts_with("compute_") => ptx_of(program),
            Ok(()) => cubin_of(program),
            Err(e) => {
                let log = nvrtc::get_program_log(program)
                    .map(|raw| c_text(&raw))
                    .unwrap_or_default();
                Err(format!("{e:?}\n{log}"))
            }
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

/// The CUBIN of a compiled program.
///
/// # Safety
/// `program` must be a live, successfully compiled NVRTC program.
unsafe fn cubin_of(program: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    let mut size = 0usize;
    // SAFETY: per the contract; `size` is an out-parameter.
    unsafe { nvrtc_sys::nvrtcGetCUBINSize(program, &mut size) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBINSize failed: {e:?}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has the size NVRTC asked for.
    unsafe { nvrtc_sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast::<c_char>()) }
        .result()
        .map_err(|e| format!("nvrtcGetCUBIN failed: {e:?}"))?;
    if cubin.is_empty() {
        return Err("NVRTC produced no CUBIN (was a virtual architecture asked for?)".into());
    }
    Ok(cubin)
}

/// The PTX of a compiled program, as text without its terminating NUL.
///
/// # Safety
/// `program` must be a live, successfully compiled NVRTC program.
unsafe fn ptx_of(program: nvrtc_sys::nvrtcProgram) -> std::result::Result<Vec<u8>, String> {
    // SAFETY: per the contract.
    let raw =
        unsafe { nvrtc::get_ptx(program) }.map_err(|e| format!("nvrtcGetPTX failed: {e:?}"))?;
    let text = c_text(&raw);
    if text.is_empty() {
        return Err("NVRTC produced no PTX".into());
    }
    Ok(text.into_bytes())
}

fn c_text(raw: &[c_char]) -> String {
    // SAFETY: c_char and u8 have the same size and alignment.
    let bytes = unsafe { std::slice::from_raw_parts(raw.as_ptr().cast::<u8>(), raw.len()) };
    CStr::from_bytes_until_nul(bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(bytes).into_owned())
}

// ---- the launch check ----

/// Whether launches are checked against the kernels' parameter lists ([`check_launch`]): in
/// debug builds, and where `NDSCOPE_CHECK_LAUNCHES=1`. Read once; off, a launch pays one load.
pub(crate) fn checking_launches() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        cfg!(debug_assertions)
            || std::env::var_os("NDSCOPE_CHECK_LAUNCHES").is_some_and(|v| v == "1")
    })
}

/// Checks a launch of the kernel `name` passing arguments of `sizes` bytes against the
/// kernel's parameter list in [`SOURCE`] or [`HALF_SOURCE`]: the same count, each of the size its parameter
/// declares. The error names the kernel, the parameter and both sizes.
pub(crate) fn check_launch(ctx: &Ctx, name: &str, sizes: &[usize]) -> Result<()> {
    let signatures = signatures().as_ref().map_err(|why| {
        ctx.unsupported(format!(
            "the launch check cannot read the kernel source: {why}"
        ))
    })?;
    let Some(params) = signatures.get(name) else {
        return Err(ctx.unsupported(format!(
            "launch of `{name}`: the kernel source declares no kernel of that name"
        )));
    };
    if params.len() != sizes.len() {
        return Err(ctx.unsupported(format!(
            "launch of `{name}` passes {} arguments; the kernel source declares {} parameters \
             (sizes {params:?}, passed {sizes:?})",
            sizes.len(),
            params.len()
        )));
    }
    if let Some((i, (want, got))) = params
        .iter()
        .zip(sizes)
        .enumerate()
        .find(|(_, (want, got))| want != got)
    {
        return Err(ctx.unsupported(format!(
            "launch of `{name}`: parameter {i} is {want} bytes in the kernel source, the launch passes \
             {got} bytes"
        )));
    }
    Ok(())
}

/// The parameter sizes of every kernel of both programs, parsed once.
fn signatures() -> &'static std::result::Result<HashMap<String, Vec<usize>>, String> {
    static SIGNATURES: OnceLock<std::result::Result<HashMap<String, Vec<usize>>, String>> =
        OnceLock::new();
    SIGNATURES.get_or_init(|| {
        let mut all = parse_signatures(SOURCE)?;
        for (name, sizes) in parse_signatures(HALF_SOURCE)? {
            if all.insert(name.clone(), sizes).is_some() {
                return Err(format!("kernel `{name}` is defined in both programs"));
            }
        }
        Ok(all)
    })
}

/// The byte size of each parameter of each `__global__` function of CUDA `source`, by name:
/// a small preprocessor (line splicing, comments, object- and function-like `#define`s with
/// `##` pasting, rescanning) expands the kernel templates, then each signature is read with
/// the sizes of the x86-64/CUDA ABI, `typedef`s and the layouts of `struct`s of the source.
pub(crate) fn parse_signatures(
    source: &str,
) -> std::result::Result<HashMap<String, Vec<usize>>, String> {
    let text = strip_comments(&source.replace("\\\n", " "));
    let mut macros: HashMap<String, Macro> = HashMap::new();
    let mut code = String::new();
    for line in text.lines() {
        let trimmed = line.trim_start();
        if let Some(rest) = trimmed.strip_prefix('#') {
            if let Some(def) = rest.trim_start().strip_prefix("define") {
                let def = def.trim_start();
                let end = def
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .unwrap_or(def.len());
                let (name, rest) = def.split_at(end);
                let m = match rest.strip_prefix('(') {
                    Some(rest) => {
                        let close = rest
                            .find(')')
                            .ok_or_else(|| format!("#define {name}: no `)`"))?;
                        Macro {
                            params: Some(
                                rest[..close]
                                    .split(',')
                                    .map(|p| p.trim().to_string())
                                    .filter(|p| !p.is_empty())
                                    .collect(),
                            ),
                            body: rest[close + 1..].trim().to_string(),
                        }
                    }
                    None => Macro {
                        params: None,
                        body: rest.trim().to_string(),
                    },
                };
                macros.insert(name.to_string(), m);
            }
            continue;
        }
        code.push_str(line);
        code.push('\n');
    }
    let code = expand(&code, &macros, 0)?;
    let types = CTypes::of(&code)?;
    let mut kernels = HashMap::new();
    let mut rest = code.as_str();
    while let Some(at) = rest.find("__global__") {
        rest = &rest[at + "__global__".len()..];
        let open = rest.find('(').ok_or("a __global__ without `(`")?;
        let head = rest[..open].trim();
        let name = head.rsplit(char::is_whitespace).next().unwrap_or(head);
        let (args, after) = arguments(&rest[open..]).ok_or_else(|| format!("`{name}`: no `)`"))?;
        let layouts = args
            .iter()
            .filter(|a| !(a.is_empty() || a.as_str() == "void"))
            .map(|a| types.layout(a).map_err(|why| format!("`{name}`: {why}")))
            .collect::<std::result::Result<Vec<(usize, usize)>, String>>()?;
        // The parameter block, laid out as C does: a launch passes at most PARAM_BLOCK bytes.
        let block = layouts.iter().fold(0usize, |end, &(size, align)| {
            end.next_multiple_of(align) + size
        });
        if block > PARAM_BLOCK {
            return Err(format!(
                "`{name}`: its parameters take {block} bytes, over the {PARAM_BLOCK} bytes a \
                 launch may pass"
            ));
        }
        let sizes = layouts.into_iter().map(|(size, _)| size).collect();
        if kernels.insert(name.to_string(), sizes).is_some() {
            return Err(format!("kernel `{name}` is defined twice"));
        }
        rest = after;
    }
    Ok(kernels)
}

/// The most bytes of parameters a kernel launch may pass (CUDA's classic limit, which every
/// architecture and driver accepts).
pub(crate) const PARAM_BLOCK: usize = 4096;

/// A `#define`: its parameters (function-like) and body.
struct Macro {
    params: Option<Vec<String>>,
    body: String,
}

/// `text` without `//` and `/* */` comments (after line splicing, as C does).
fn strip_comments(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    loop {
        let line = rest.find("//");
        let block = rest.find("/*");
        match (line, block) {
            (Some(l), b) if b.is_none_or(|b| l < b) => {
                out.push_str(&rest[..l]);
                rest = &rest[l..];
                rest = rest.find('\n').map_or("", |e| &rest[e..]);
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                out.push(' ');
                rest = rest[b + 2..]
                    .find("*/")
                    .map_or("", |e| &rest[b + 2 + e + 2..]);
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// The comma-separated arguments of the parenthesised list `text` starts with (trimmed, nested
/// parentheses kept whole) and the text after its `)`.
fn arguments(text: &str) -> Option<(Vec<String>, &str)> {
    let mut depth = 0usize;
    let mut args = Vec::new();
    let mut start = 1;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    args.push(text[start..i].trim().to_string());
                    return Some((args, &text[i + 1..]));
                }
            }
            ',' if depth == 1 => {
                args.push(text[start..i].trim().to_string());
                start = i + 1;
            }
            _ => {}
        }
    }
    None
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// `text` with every macro invocation replaced by its expansion, rescanned.
fn expand(
    text: &str,
    macros: &HashMap<String, Macro>,
    depth: usize,
) -> std::result::Result<String, String> {
    if depth > 32 {
        return Err("macros nest more than 32 deep".into());
    }
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(start) = rest.find(|c: char| is_ident(c)) {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        let end = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        let word = &rest[..end];
        let after = &rest[end..];
        let expansion = match macros.get(word) {
            _ if word.starts_with(|c: char| c.is_ascii_digit()) => None,
            Some(Macro { params: None, body }) => Some((body.clone(), after)),
            Some(Macro {
                params: Some(params),
                body,
            }) if after.trim_start().starts_with('(') => {
                let open = after.len() - after.trim_start().len();
                let (args, tail) =
                    arguments(&after[open..]).ok_or_else(|| format!("`{word}(`: no `)`"))?;
                let args: Vec<String> = args.into_iter().filter(|a| !a.is_empty()).collect();
                if args.len() != params.len() {
                    return Err(format!(
                        "`{word}` takes {} arguments, given {}",
                        params.len(),
                        args.len()
                    ));
                }
                Some((substitute(body, params, &args), tail))
            }
            _ => None,
        };
        match expansion {
            Some((body, tail)) => {
                out.push_str(&expand(&body, macros, depth + 1)?);
                out.push(' ');
                rest = tail;
            }
            None => {
                out.push_str(word);
                rest = after;
            }
        }
    }
    out.push_str(rest);
    Ok(out)
}

/// `body` with each identifier among `params` replaced by its argument, then `##` pasted.
fn substitute(body: &str, params: &[String], args: &[String]) -> String {
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    while let Some(start) = rest.find(|c: char| is_ident(c)) {
        out.push_str(&rest[..start]);
        rest = &rest[start..];
        let end = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        let word = &rest[..end];
        match params.iter().position(|p| p == word) {
            Some(i) => out.push_str(&args[i]),
            None => out.push_str(word),
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    let mut pasted = String::with_capacity(out.len());
    for (i, piece) in out.split("##").enumerate() {
        if i == 0 {
            pasted.push_str(piece.trim_end());
        } else {
            pasted.push_str(piece.trim());
        }
    }
    pasted
}

/// Sizes and alignments of the types a kernel parameter may have: C's scalars, the source's
/// `typedef`s and `struct`s.
struct CTypes(HashMap<String, (usize, usize)>);

impl CTypes {
    fn of(code: &str) -> std::result::Result<CTypes, String> {
        let mut known: HashMap<String, (usize, usize)> = [
            ("bool", 1),
            ("char", 1),
            ("signed char", 1),
            ("unsigned char", 1),
            ("short", 2),
            ("unsigned short", 2),
            ("int", 4),
            ("unsigned", 4),
            ("unsigned int", 4),
            ("float", 4),
            ("long", 8),
            ("unsigned long", 8),
            ("long long", 8),
            ("unsigned long long", 8),
            ("size_t", 8),
            ("double", 8),
            ("__half", 2),
            ("__nv_bfloat16", 2),
        ]
        .into_iter()
        .map(|(t, size)| (t.to_string(), (size, size)))
        .collect();
        for statement in code.split(';') {
            // The statement starts at the last `;`: a function body's `}` may come first.
            let words: Vec<&str> = statement.split_whitespace().collect();
            if let Some(at) = words.iter().rposition(|w| *w == "typedef") {
                if let Some((alias, base)) = words[at + 1..].split_last() {
                    if let Some(&layout) = known.get(&base.join(" ")) {
                        known.insert(alias.to_string(), layout);
                    }
                }
            }
        }
        let mut types = CTypes(known);
        // `struct NAME { TYPE field; TYPE field[N]; ... };`, laid out as C does.
        let mut rest = code;
        while let Some(at) = rest.find("struct ") {
            rest = &rest[at + "struct ".len()..];
            let Some(open) = rest.find('{') else { break };
            let name = rest[..open].trim();
            if !name.chars().all(is_ident) || name.is_empty() {
                continue;
            }
            let Some(close) = rest[open..].find('}') else {
                break;
            };
            // A struct this simple reading cannot lay out (methods, templates) is left out:
            // a kernel taking it by value is refused below as of an unknown type.
            let fields = &rest[open + 1..open + close];
            if let Some(layout) = types.struct_layout(fields) {
                types.0.insert(name.to_string(), layout);
            }
            rest = &rest[open + close..];
        }
        Ok(types)
    }

    /// The C layout of a struct of `fields` (`TYPE name; TYPE name[N]; ...`), if they are that.
    fn struct_layout(&self, fields: &str) -> Option<(usize, usize)> {
        let (mut size, mut align) = (0, 1);
        for field in fields.split(';').map(str::trim).filter(|f| !f.is_empty()) {
            // `TYPE name[A][B]...`: A·B... elements.
            let (decl, count) = match field.split_once('[') {
                Some((decl, dims)) => {
                    let mut count = 1usize;
                    for dim in dims.split('[') {
                        let dim = dim.trim().strip_suffix(']')?.trim();
                        count = count.checked_mul(dim.parse().ok()?)?;
                    }
                    (decl, count)
                }
                None => (field, 1),
            };
            let (s, a) = self.layout(decl).ok()?;
            size = usize::next_multiple_of(size, a) + s * count;
            align = usize::max(align, a);
        }
        Some((usize::next_multiple_of(size, align), align))
    }

    /// The layout of the type of declaration `decl` (`const T* name`, `u64 n`).
    fn layout(&self, decl: &str) -> std::result::Result<(usize, usize), String> {
        if decl.contains('*') {
            return Ok((8, 8));
        }
        let words: Vec<&str> = decl
            .split_whitespace()
            .filter(|w| !matches!(*w, "const" | "volatile" | "__restrict__" | "struct"))
            .collect();
        let ty = match words.split_last() {
            Some((_, ty)) if !ty.is_empty() => ty.join(" "),
            _ => return Err(format!("cannot read the declaration `{decl}`")),
        };
        self.0
            .get(&ty)
            .copied()
            .ok_or_else(|| format!("unknown type `{ty}` in `{decl}`"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_key_hasher_reads_bytes_as_zero_padded_little_endian_words() {
        use std::hash::Hasher;
        let bytes: Vec<u8> = (1..=20u32).map(|i| (i * 37) as u8).collect();
        for len in 0..=bytes.len() {
            let mut hasher = KeyHasher::default();
            hasher.write(&bytes[..len]);
            let mut expected = KeyHasher::default();
            for chunk in bytes[..len].chunks(8) {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                expected.add(u64::from_le_bytes(word));
            }
            assert_eq!(hasher.finish(), expected.finish(), "{len} bytes");
        }
    }

    /// Whether `name` is set to `1`.
    fn required(name: &str) -> bool {
        std::env::var_os(name).is_some_and(|v| v == "1")
    }

    /// Compiles every kernel of both programs for sm_80 and sm_90 with NVRTC (no GPU needed),
    /// printing the compiler's log on failure. Skips, saying why, where NVRTC cannot be loaded:
    /// `.ci/run` installs it from PyPI (`nvidia-cuda-nvrtc`) and puts it on the library path.
    /// With `NDSCOPE_REQUIRE_NVRTC=1` or `NDSCOPE_REQUIRE_GPU=1` a missing NVRTC fails instead,
    /// and so do missing half-precision headers ([`find_cuda_include`]; `.ci/run` installs PyPI's
    /// `nvidia-cuda-runtime` for them and sets `NDSCOPE_CUDA_INCLUDE`).
    #[test]
    fn kernel_source_compiles_for_ampere_and_hopper() {
        let require = required("NDSCOPE_REQUIRE_NVRTC") || required("NDSCOPE_REQUIRE_GPU");
        // SAFETY: only tries to open the library.
        if !unsafe { nvrtc_sys::is_culib_present() } {
            let why = "NVRTC (libnvrtc.so.13) is not on the library path; .ci/run installs it";
            if require {
                panic!("NDSCOPE_REQUIRE_NVRTC=1 or NDSCOPE_REQUIRE_GPU=1, but {why}");
            }
            eprintln!("skipped: {why}");
            return;
        }
        // Loads the library (the include search looks beside it).
        let version = nvrtc_version().unwrap_or_else(|why| panic!("{why}"));
        let include = match find_cuda_include() {
            Ok(dir) => Some(dir),
            Err(why) if require => panic!("NVRTC {version} is here, but {why}"),
            Err(why) => {
                eprintln!("the half-precision program is skipped: {why}");
                None
            }
        };
        let mut programs = vec![(Program::Main, None)];
        programs.extend(include.as_deref().map(|dir| (Program::Half, Some(dir))));
        for (program, include) in programs {
            for arch in ["sm_80", "sm_90"] {
                let cubin = match compile(program, arch, include) {
                    Ok(cubin) => cubin,
                    Err(log) => {
                        panic!("the {program:?} program does not compile for {arch}:\n{log}")
                    }
                };
                // Every kernel the backend looks up is a symbol of the binary (its names are
                // NUL-terminated strings of the ELF string table).
                let symbols: std::collections::HashSet<&[u8]> = cubin.split(|&b| b == 0).collect();
                let missing: Vec<String> = expected()
                    .into_iter()
                    .filter(|(_, _, p)| *p == program)
                    .map(|(_, name, _)| name)
                    .filter(|name| !symbols.contains(name.as_bytes()))
                    .collect();
                assert!(
                    missing.is_empty(),
                    "{program:?}, {arch}: kernels missing from the CUBIN: {missing:?}"
                );
            }
        }
    }

    /// Every kernel the backend may launch has a parameter list read from the kernel source of
    /// its program, and the lists are what the source declares.
    #[test]
    fn every_kernel_has_a_parsed_parameter_list() {
        let main = parse_signatures(SOURCE).unwrap_or_else(|why| panic!("{why}"));
        let half = parse_signatures(HALF_SOURCE).unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(
            SOURCE.matches("__global__ void").count(),
            37,
            "kernel templates in the kernel source"
        );
        assert_eq!(
            HALF_SOURCE.matches("__global__ void").count(),
            HALF_TEMPLATES,
            "kernel templates in the half-precision source"
        );
        for (program, signatures) in [(Program::Main, &main), (Program::Half, &half)] {
            let names: Vec<String> = expected()
                .into_iter()
                .filter(|(_, _, p)| *p == program)
                .map(|(_, name, _)| name)
                .collect();
            let missing: Vec<&String> = names
                .iter()
                .filter(|name| !signatures.contains_key(*name))
                .collect();
            assert!(
                missing.is_empty(),
                "{program:?}: kernels without a parsed signature: {missing:?}"
            );
            assert_eq!(signatures.len(), names.len(), "{program:?}: parsed kernels");
        }
        let all = signatures().as_ref().unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(all.len(), expected().len());
        let sizes = |name: &str| all[name].clone();
        assert_eq!(sizes("fill_f32"), [8, 8, 4]);
        assert_eq!(sizes("fill_u8"), [8, 8, 1]);
        assert_eq!(sizes("fill_f64"), [8, 8, 8]);
        assert_eq!(sizes("fill_f16"), [8, 8, 2]);
        // Half arrays meet scalars in f32 (PyTorch's opmath): a 4-byte scalar.
        assert_eq!(sizes("add_scalar_bf16"), [8, 8, 8, 4]);
        assert_eq!(sizes("cast_u8_f64"), [8, 8, 8]);
        assert_eq!(sizes("cast_bf16_f16"), [8, 8, 8]);
        assert_eq!(sizes("add_i32"), [8, 8, 8, 8, 4, 200]);
        assert_eq!(sizes("add_f16"), [8, 8, 8, 8, 4, 200]);
        assert_eq!(sizes("gt_scalar_u8"), [8, 8, 8, 8]);
        assert_eq!(sizes("axpy_f32"), [8, 8, 8, 4, 4, 200]);
        assert_eq!(sizes("axpy_bf16"), [8, 8, 8, 4, 4, 200]);
        assert_eq!(sizes("gather_b1"), [8, 8, 8, 4, 200]);
        assert_eq!(sizes("gather_b2"), [8, 8, 8, 4, 200]);
        assert_eq!(sizes("sgd_update_f32"), [8, 8, 8, 8, 4, 4, 4, 4]);
        // The half steps take f32 coefficients.
        assert_eq!(sizes("sgd_update_f16"), [8, 8, 8, 8, 4, 4, 4, 4]);
        let mut adam = vec![8; 14];
        adam.push(4);
        assert_eq!(sizes("adam_update_f64"), adam);
        // The tensor list by value: 4·64 pointers, 64 sizes, 64 block ends, the count (padded),
        // the skip flag's address.
        assert_eq!(sizes("sgd_multi_f32"), [2832, 4, 4, 4, 4]);
        assert_eq!(sizes("sgd_multi_bf16"), [2832, 4, 4, 4, 4]);
        // ... and the device's step count (its address) with lr, β1 and β2 in f64.
        let mut adam = vec![2832];
        adam.extend([8; 9]);
        adam.extend([4, 8, 8, 8, 8]);
        assert_eq!(sizes("adam_multi_f64"), adam);
        assert_eq!(
            sizes("adam_multi_f32"),
            [2832, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 8, 8, 8, 8]
        );
        assert_eq!(sizes("adam_count_f32"), [8, 8]);
        // Four addresses, seven sizes and strides, then int, f32, f32, int.
        let mut rounded = vec![8; 11];
        rounded.extend([4; 4]);
        assert_eq!(sizes("gemm_rounded_bf16"), rounded);
    }

    /// Kernel templates (`__global__` functions in macros) of the half-precision source.
    const HALF_TEMPLATES: usize = 34;

    /// The include search: the override alone when set (a directory without the headers is an
    /// error naming it, nothing else is tried), else the variables, the directory beside the
    /// loaded NVRTC and the usual places, in order; nothing found is an error listing them.
    #[test]
    fn the_include_directory_is_searched_in_order() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let at =
            |dirs: &'static [&'static str]| move |d: &Path| dirs.iter().any(|x| Path::new(x) == d);
        // The override wins, even over a toolkit elsewhere.
        let found = search_include(
            &env(&[(INCLUDE_VAR, "/x/inc"), ("CUDA_HOME", "/cuda")]),
            None,
            &at(&["/x/inc", "/cuda/include"]),
        );
        assert_eq!(found.unwrap(), Path::new("/x/inc"));
        // An override without the headers is an error, not a fall-back to the others.
        let why = search_include(
            &env(&[(INCLUDE_VAR, "/empty"), ("CUDA_HOME", "/cuda")]),
            None,
            &at(&["/cuda/include", "/usr/local/cuda/include"]),
        )
        .unwrap_err();
        assert!(
            why.contains("NDSCOPE_CUDA_INCLUDE=/empty holds no cuda_fp16.h"),
            "{why}"
        );
        // An empty override counts as unset.
        let found = search_include(
            &env(&[(INCLUDE_VAR, ""), ("CUDA_HOME", "/cuda")]),
            None,
            &at(&["/cuda/include"]),
        );
        assert_eq!(found.unwrap(), Path::new("/cuda/include"));
        // CUDA_PATH before CUDA_HOME before the NVRTC's directory before the fixed places.
        let all = &[
            "/p/include",
            "/h/include",
            "/pip/nvidia/cu13/include",
            "/usr/local/cuda/include",
        ];
        let vars: &[(&str, &str)] = &[("CUDA_PATH", "/p"), ("CUDA_HOME", "/h")];
        let nvrtc = Path::new("/pip/nvidia/cu13/lib");
        assert_eq!(
            search_include(&env(vars), Some(nvrtc), &at(all)).unwrap(),
            Path::new("/p/include")
        );
        assert_eq!(
            search_include(&env(vars), Some(nvrtc), &at(&all[1..])).unwrap(),
            Path::new("/h/include")
        );
        assert_eq!(
            search_include(&env(vars), Some(nvrtc), &at(&all[2..])).unwrap(),
            Path::new("/pip/nvidia/cu13/include")
        );
        assert_eq!(
            search_include(&env(&[]), None, &at(&["/opt/cuda/include", "/usr/include"])).unwrap(),
            Path::new("/opt/cuda/include")
        );
        // Nothing found: every place searched is named, and the variable to set.
        let why = search_include(&env(&[("CUDA_ROOT", "/r")]), Some(nvrtc), &at(&[])).unwrap_err();
        for place in [
            "$CUDA_ROOT/include (/r/include)",
            "beside the loaded NVRTC (/pip/nvidia/cu13/include)",
            "/usr/local/cuda/include",
            "/opt/cuda/include",
            "/usr/include",
            "set NDSCOPE_CUDA_INCLUDE",
        ] {
            assert!(why.contains(place), "{place}: {why}");
        }
    }

    /// Half-precision lookup keys go to the half program, everything else stays in the main one
    /// (element sizes of the moving kernels never read as half dtype codes).
    #[test]
    fn half_keys_are_those_with_a_half_dtype() {
        for (key, name, program) in expected() {
            assert_eq!(is_half_key(key), program == Program::Half, "{name}");
            assert_eq!(program == Program::Half, name.contains("f16"), "{name}");
        }
    }

    #[test]
    fn the_preprocessor_pastes_and_rescans() {
        let source = "typedef unsigned char u8;\n#define N 3\nstruct P { u8 a; double b[N]; };\n\
                      #define K(T, NAME) extern \"C\" __global__ void NAME##_##T(const T* x, \\\n\
                      T v, P p) { /* ) */ }\n#define ALL(M) M(u8, one) M(float, two)\nALL(K)\n";
        let signatures = parse_signatures(source).unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(signatures.len(), 2, "{signatures:?}");
        assert_eq!(signatures["one_u8"], [8, 1, 32]);
        assert_eq!(signatures["two_float"], [8, 4, 32]);
    }

    /// Struct parameters: arrays of several dimensions are laid out whole, and a kernel whose
    /// parameters take more than the 4 KiB a launch may pass is refused.
    #[test]
    fn struct_parameters_and_the_parameter_block() {
        let source = "typedef unsigned int u32;\n#define N 4\nstruct L { void* p[2][N]; u32 e[N]; \
                      int c; };\nextern \"C\" __global__ void k(L l, float x) {}\n";
        let signatures = parse_signatures(source).unwrap_or_else(|why| panic!("{why}"));
        assert_eq!(signatures["k"], [88, 4]);
        let big = "struct B { double x[512]; };\nextern \"C\" __global__ void k(B b, int i) {}\n";
        let why = parse_signatures(big).expect_err("over 4 KiB");
        assert!(why.contains("4100 bytes") && why.contains("4096"), "{why}");
    }

    /// A launch whose arguments do not match the kernel's parameters is refused, naming the
    /// kernel, the parameter and both sizes.
    #[test]
    fn a_wrong_argument_list_is_refused() {
        let ctx = Ctx::new("test");
        check_launch(&ctx, "fill_f32", &[8, 8, 4]).unwrap();
        let message = |sizes: &[usize], name: &str| {
            check_launch(&ctx, name, sizes)
                .expect_err("refused")
                .to_string()
        };
        let wrong = message(&[8, 8, 8], "fill_f32");
        assert!(
            wrong.contains("`fill_f32`")
                && wrong.contains("parameter 2 is 4 bytes")
                && wrong.contains("passes 8 bytes"),
            "{wrong}"
        );
        let short = message(&[8, 8], "fill_f32");
        assert!(
            short.contains("passes 2 arguments") && short.contains("declares 3"),
            "{short}"
        );
        let unknown = message(&[8], "no_such_kernel");
        assert!(unknown.contains("`no_such_kernel`"), "{unknown}");
    }

    /// A CUBIN for a GPU NVRTC knows; PTX of the newest older architecture for one it does not
    /// (a GPU newer than NVRTC); an error for one older than everything it knows.
    #[test]
    fn the_target_is_a_cubin_or_ptx_for_a_newer_gpu() {
        let known = [75, 80, 86, 89, 90];
        assert_eq!(target(90, &known).unwrap(), "sm_90");
        assert_eq!(target(86, &known).unwrap(), "sm_86");
        assert_eq!(target(100, &known).unwrap(), "compute_90");
        assert_eq!(target(87, &known).unwrap(), "compute_86");
        let err = target(70, &known).unwrap_err();
        assert!(
            err.contains("sm_75 to sm_90") && err.contains("sm_70"),
            "{err}"
        );
    }

    #[test]
    fn cache_keys_change_with_the_source() {
        assert_ne!(fnv1a(b"a"), fnv1a(b"b"));
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
    }
}
