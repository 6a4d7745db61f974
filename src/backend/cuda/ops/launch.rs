//! Queuing work on a device's stream: launch configurations (`linear`, `blocks`), kernel
//! arguments passed by address and checked against the kernel source, the addressing of
//! strided and broadcast operands, the one-device check of an op's operands, and `memset`.

use std::ffi::c_void;

use cudarc::driver::result;
use cudarc::driver::sys::CUdeviceptr;

use super::capture::{self, Call, KernelCall};
use crate::backend::cuda::buffer::DeviceBuffer;
use crate::backend::cuda::device::{self, Gpu};
use crate::backend::cuda::kernels::{self, Function};
use crate::backend::layout::{broadcast_strides, contiguous_strides, merge_dims};
use crate::dtype::dispatch;
use crate::error::Ctx;
use crate::{DType, Element, Result};

pub(super) type Src<'a> = (&'a DeviceBuffer, &'a [usize]);
pub(super) type Dst<'a> = (&'a mut DeviceBuffer, &'a [usize]);

/// Threads per block of the 1-d kernels.
pub(super) const THREADS: u32 = 256;
/// Most dims of a strided iteration after merging (`MAXR` in kernels/common.cu).
const MAX_RANK: usize = 8;

// ---- launching ----

/// A launch configuration: blocks, and threads per block in x and y.
#[derive(Clone, Copy)]
pub(super) struct Config {
    pub(super) blocks: u32,
    pub(super) threads: (u32, u32),
}

/// Blocks for a grid-stride loop over `n` items, `per_block` at a time: enough to fill the
/// device, at most one per `per_block` items.
pub(super) fn blocks(gpu: &Gpu, n: u64, per_block: u64) -> u32 {
    let wanted = n.div_ceil(per_block.max(1)).max(1);
    wanted.min(u64::from(gpu.sms) * 16) as u32
}

/// One block per 32×32 tile of a `rows × cols` result, `threads` per block: at most as many
/// blocks as fill the device (the kernels stride over the tiles).
pub(super) fn tiles32(gpu: &Gpu, (rows, cols): (usize, usize), threads: (u32, u32)) -> Config {
    let tiles = (rows.div_ceil(32) as u64).saturating_mul(cols.div_ceil(32) as u64);
    Config {
        blocks: blocks(gpu, tiles, 1),
        threads,
    }
}

pub(super) fn linear(gpu: &Gpu, n: u64) -> Config {
    Config {
        blocks: blocks(gpu, n, u64::from(THREADS)),
        threads: (THREADS, 1),
    }
}

/// Launches `f` on `gpu`'s stream with `params`.
///
/// # Safety
/// `params` must point to one value per parameter of the kernel `f`, of the kernel's types and
/// in its order (`kernels/*.cu`), and every device address among them must be memory of `gpu`
/// that stays allocated until the kernel has run: the storage of arrays whose data locks the
/// caller holds (freed only in stream order after), or scratch memory of `gpu`.
pub(super) unsafe fn launch_raw(
    ctx: &Ctx,
    gpu: &Gpu,
    f: Function,
    cfg: Config,
    params: &mut [*mut c_void],
    sizes: &[usize],
) -> Result<()> {
    if kernels::checking_launches() {
        kernels::check_launch(ctx, f.1, sizes)?;
    }
    if capture::watching(gpu.ordinal) {
        let call = KernelCall {
            f: f.0,
            name: f.1,
            blocks: cfg.blocks,
            threads: cfg.threads,
            params,
            sizes,
        };
        return capture::call(ctx, gpu, Call::Kernel(call));
    }
    gpu.bind(ctx)?;
    // SAFETY: per the contract.
    unsafe {
        result::launch_kernel(
            f.0,
            (cfg.blocks, 1, 1),
            (cfg.threads.0, cfg.threads.1, 1),
            0,
            gpu.cu_stream(),
            params,
        )
    }
    .map_err(|e| gpu.failed(ctx, "cuLaunchKernel", e))
}

/// `launch!(ctx, gpu, f, cfg; name = value, ...)`: each value is kept in a local named `name`
/// and passed by address, in order, with the sizes of the values (checked against the
/// kernel's parameter list where launches are checked). Expands to a call of the unsafe
/// [`launch_raw`], whose contract the caller keeps (and says so in a `// SAFETY:` comment).
macro_rules! launch {
    ($ctx:expr, $gpu:expr, $f:expr, $cfg:expr; $($arg:ident = $val:expr),+ $(,)?) => {{
        $(let mut $arg = $val;)+
        let sizes = [$($crate::backend::cuda::ops::launch::Arg::bytes(&$arg)),+];
        let mut params = [$(std::ptr::addr_of_mut!($arg).cast::<std::ffi::c_void>()),+];
        $crate::backend::cuda::ops::launch::launch_raw($ctx, $gpu, $f, $cfg, &mut params, &sizes)
    }};
}

/// A value passed to a kernel parameter.
pub(super) trait Arg {
    /// The bytes of the parameter it fills: its size, or less for a [`Scalar`].
    fn bytes(&self) -> usize;
}

macro_rules! arg_by_size {
    ($($t:ty),+) => {
        $(impl Arg for $t {
            fn bytes(&self) -> usize {
                std::mem::size_of::<$t>()
            }
        })+
    };
}
arg_by_size!(u64, u32, i32, f64, Strided);

impl Arg for Scalar {
    fn bytes(&self) -> usize {
        self.size
    }
}

/// An element-typed kernel parameter (`T v`): the value converted as `T::from_f64`, in the
/// first bytes of an 8-byte slot.
/// `size` is the element's size (what the kernel reads; the launch check compares it).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct Scalar {
    slot: [u8; 8],
    size: usize,
}

pub(super) fn scalar(dtype: DType, value: f64) -> Scalar {
    let mut scalar = Scalar {
        slot: [0; 8],
        size: dtype.size_in_bytes(),
    };
    dispatch!(dtype, T => {
        let v = T::from_f64(value);
        // SAFETY: every element type is at most 8 bytes; the write is unaligned-safe.
        unsafe { std::ptr::write_unaligned(scalar.slot.as_mut_ptr().cast::<T>(), v) };
    });
    scalar
}

/// The scalar operand of an arithmetic kernel (`<op>_scalar`, `scale`, `axpy`): an f32 for the
/// half types, which compute in f32 with the scalar unrounded (PyTorch's opmath, as the CPU
/// does), else the element type.
pub(super) fn opmath_scalar(dtype: DType, value: f64) -> Scalar {
    if dtype.is_half() {
        scalar(DType::F32, value)
    } else {
        scalar(dtype, value)
    }
}

/// `struct Strided` of kernels/common.cu.
#[repr(C)]
#[derive(Clone, Copy)]
pub(super) struct Strided {
    rank: i32,
    /// The padding C puts before `dims`, spelled out so that its bytes are set (0): a recorded
    /// launch is compared byte for byte (`capture.rs`).
    pad: i32,
    dims: [u64; MAX_RANK],
    sa: [u64; MAX_RANK],
    sb: [u64; MAX_RANK],
}

pub(super) const MODE_SAME: i32 = 0;
const MODE_B_ONE: i32 = 1;
const MODE_A_ONE: i32 = 2;
const MODE_STRIDED32: i32 = 3;
const MODE_STRIDED64: i32 = 4;
pub(super) const MODE_SELF: i32 = 5;

impl Strided {
    pub(super) fn none() -> Strided {
        Strided {
            rank: 0,
            pad: 0,
            dims: [0; MAX_RANK],
            sa: [0; MAX_RANK],
            sb: [0; MAX_RANK],
        }
    }
}

pub(super) fn size(dims: &[usize]) -> usize {
    dims.iter().product()
}

/// How the elementwise kernels address operands `a` (strides `sa`) and `b` (`sb`) of an output
/// of `out` dims: the fast modes when an operand is whole or one element, else merged strides.
/// With `broadcasting`, an operand as long as the output has the output's layout (true of
/// NumPy broadcasting, not of a permutation).
pub(super) fn addressing(
    ctx: &Ctx,
    out: &[usize],
    (a_len, sa): (usize, Vec<usize>),
    (b_len, sb): (usize, Vec<usize>),
    broadcasting: bool,
) -> Result<(i32, Strided)> {
    let n = size(out);
    if broadcasting {
        if a_len == n && b_len == n {
            return Ok((MODE_SAME, Strided::none()));
        }
        if b_len == 1 && a_len == n {
            return Ok((MODE_B_ONE, Strided::none()));
        }
        if a_len == 1 && b_len == n {
            return Ok((MODE_A_ONE, Strided::none()));
        }
    }
    let (dims, strides) = merge_dims(out, &[sa, sb]);
    if dims.len() > MAX_RANK {
        return Err(ctx.unsupported(format!(
            "`{}` on CUDA walks at most {MAX_RANK} dimensions after merging; shape {out:?} needs {}",
            ctx.op,
            dims.len()
        )));
    }
    let mut s = Strided::none();
    s.rank = dims.len() as i32;
    for (i, &d) in dims.iter().enumerate() {
        s.dims[i] = d as u64;
        s.sa[i] = strides[0][i] as u64;
        s.sb[i] = strides[1][i] as u64;
    }
    let fits = |v: usize| v <= u32::MAX as usize;
    let mode = if fits(n) && fits(a_len) && fits(b_len) {
        MODE_STRIDED32
    } else {
        MODE_STRIDED64
    };
    Ok((mode, s))
}

/// Addressing of a broadcast binary op.
pub(super) fn broadcast(
    ctx: &Ctx,
    a: &[usize],
    b: &[usize],
    out: &[usize],
) -> Result<(i32, Strided)> {
    addressing(
        ctx,
        out,
        (size(a), broadcast_strides(a, out)),
        (size(b), broadcast_strides(b, out)),
        true,
    )
}

/// Addressing of an in-place op whose source `b` broadcasts to `x` (the source is operand b).
pub(super) fn inplace_source(ctx: &Ctx, x: &[usize], b: &[usize]) -> Result<(i32, Strided)> {
    addressing(
        ctx,
        x,
        (size(x), contiguous_strides(x)),
        (size(b), broadcast_strides(b, x)),
        true,
    )
}

pub(super) fn same_gpu(ctx: &Ctx, gpus: &[&Gpu]) -> Result<&'static Gpu> {
    let first = gpus[0].ordinal;
    if let Some(other) = gpus.iter().find(|g| g.ordinal != first) {
        return Err(ctx.device_mismatch(format!(
            "`{}` got operands on cuda:{first} and cuda:{} (move one with to_device)",
            ctx.op, other.ordinal
        )));
    }
    device::existing(first).ok_or_else(|| ctx.unavailable(crate::Device::Cuda(first)))
}

pub(super) fn elements(buffer: &DeviceBuffer, dtype: DType) -> u64 {
    (buffer.bytes() / dtype.size_in_bytes()) as u64
}

/// Sets `bytes` bytes at `ptr` to `value`.
pub(super) fn memset(
    ctx: &Ctx,
    gpu: &Gpu,
    ptr: CUdeviceptr,
    value: u8,
    bytes: usize,
) -> Result<()> {
    if bytes == 0 {
        return Ok(());
    }
    if capture::watching(gpu.ordinal) {
        return capture::call(ctx, gpu, Call::Fill { ptr, value, bytes });
    }
    gpu.bind(ctx)?;
    // SAFETY: `ptr` holds `bytes` bytes of device memory of this context.
    unsafe { result::memset_d8_async(ptr, value, bytes, gpu.cu_stream()) }
        .map_err(|e| gpu.failed(ctx, "cuMemsetD8Async", e))
}
