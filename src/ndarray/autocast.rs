//! Autocast: mixed precision as PyTorch's `torch.autocast`. While an [`AutocastGuard`] lives on
//! a thread, the ops that gain most from half precision (products: `matmul`, `matmul_t`,
//! `linear`, `Dense::forward`) run in its dtype, their float inputs converted to it, and the
//! ops that need range or accumulate error (`softmax`, `log_softmax`, `softmax_cross_entropy`,
//! `sum`, `mean`, `sum_all`, `mean_all`) run in f32, their half inputs converted up. A binary
//! op of two float dtypes runs in the wider one. Everything else runs in its input's dtype.
//!
//! The conversions are ordinary `to_dtype` ops: recorded by an open
//! [`GradientCollector`](crate::GradientCollector) (the gradient is converted back, so an f32
//! parameter gets an f32 gradient) and placed as any op's result, in the active scope or
//! workspace cycle. The low-precision copy of an array that requires gradients (a parameter)
//! is made once per guard and reused by every op that reads it, as long as the parameter is
//! unchanged and the copy open (PyTorch's autocast weight cache): one copy per training step
//! when the guard is opened inside the step. `linear` and `Dense::forward` make no copy of f32
//! weights at all where the device's product reads them rounded as it loads them (the CPU, and
//! CUDA for products up to 2^25 multiply-adds).

use std::cell::{Cell, RefCell};
use std::marker::PhantomData;
use std::sync::atomic::Ordering;

use crate::error::Ctx;
use crate::{DType, NDArray, Result};

thread_local! {
    /// The dtype of the innermost guard on this thread, if any.
    static LOW: Cell<Option<DType>> = const { Cell::new(None) };
    /// Parameters' low-precision copies made under the guards of this thread: the parameter,
    /// its version when copied, and the copy.
    static CACHE: RefCell<Vec<(NDArray, u64, NDArray)>> = const { RefCell::new(Vec::new()) };
}

/// Autocast on this thread while it lives (see [`autocast`]); restores the previous state when
/// dropped, and forgets the copies made under it.
#[must_use = "autocast applies only while the guard lives"]
pub struct AutocastGuard {
    previous: Option<DType>,
    cached: usize,
    /// The state is the thread's: the guard stays on it.
    _not_send: PhantomData<*const ()>,
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        LOW.set(self.previous);
        // The copies belong to the scopes they were made in; only the cache forgets them.
        CACHE.with(|c| c.borrow_mut().truncate(self.cached));
    }
}

/// Runs the products of this thread in `dtype` (`F16` or `BF16`) and its precision-sensitive
/// ops in f32 until the guard drops (see the module docs): PyTorch's
/// `with torch.autocast(device_type, dtype=torch.bfloat16):`. Guards nest; the innermost
/// applies. `InvalidArgument` for a dtype that is not a half type.
///
/// ```
/// use ndscope::{autocast, DType, Manager};
/// let m = Manager::new_base();
/// let x = m.randn([4, 8], DType::F32)?;
/// let w = m.randn([8, 3], DType::F32)?;
/// {
///     let _bf16 = autocast(DType::BF16)?;
///     let y = x.matmul(&w)?;                       // a bf16 product
///     assert_eq!(y.dtype(), DType::BF16);
///     assert_eq!(y.softmax(-1)?.dtype(), DType::F32);   // softmax in f32
/// }
/// assert_eq!(x.matmul(&w)?.dtype(), DType::F32);
/// # Ok::<(), ndscope::Error>(())
/// ```
#[track_caller]
pub fn autocast(dtype: DType) -> Result<AutocastGuard> {
    let ctx = Ctx::new("autocast");
    if !dtype.is_half() {
        return Err(ctx.invalid(format!(
            "autocast runs products in a half type (f16 or bf16), not {dtype}"
        )));
    }
    let guard = AutocastGuard {
        previous: LOW.get(),
        cached: CACHE.with(|c| c.borrow().len()),
        _not_send: PhantomData,
    };
    LOW.set(Some(dtype));
    Ok(guard)
}

/// The dtype products run in on this thread, if an [`autocast`] guard is open.
pub fn autocast_dtype() -> Option<DType> {
    LOW.get()
}

/// `x` in the autocast dtype, when a guard is open and `x` is a float of another dtype; a
/// parameter's copy comes from the cache while it is unchanged.
pub(crate) fn lowered(x: &NDArray) -> Result<Option<NDArray>> {
    let Some(low) = LOW.get() else {
        return Ok(None);
    };
    if !x.dtype().is_float() || x.dtype() == low {
        return Ok(None);
    }
    if !x.requires_gradient() {
        return x.to_dtype(low).map(Some);
    }
    let version = x.0.grad.version.load(Ordering::Relaxed);
    let hit = CACHE.with(|c| {
        c.borrow()
            .iter()
            .find(|(p, v, copy)| p == x && *v == version && copy.is_open() && copy.dtype() == low)
            .map(|(_, _, copy)| copy.clone())
    });
    if let Some(copy) = hit {
        return Ok(Some(copy));
    }
    let copy = x.to_dtype(low)?;
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        c.retain(|(p, _, copy)| p != x && copy.is_open());
        c.push((x.clone(), version, copy.clone()));
    });
    Ok(Some(copy))
}

/// `x` in f32 when a guard is open and `x` is a half type.
pub(crate) fn widened(x: &NDArray) -> Result<Option<NDArray>> {
    if LOW.get().is_none() || !x.dtype().is_half() {
        return Ok(None);
    }
    x.to_dtype(DType::F32).map(Some)
}

/// `(a, b)` in the wider of their dtypes when a guard is open and both are floats of different
/// dtypes.
pub(crate) fn promoted(a: &NDArray, b: &NDArray) -> Result<Option<(NDArray, NDArray)>> {
    let (x, y) = (a.dtype(), b.dtype());
    if LOW.get().is_none() || x == y || !x.is_float() || !y.is_float() {
        return Ok(None);
    }
    // f16 with bf16 meet in f32 (neither holds the other), as PyTorch promotes them.
    let wide = match x.size_in_bytes().cmp(&y.size_in_bytes()) {
        std::cmp::Ordering::Greater => x,
        std::cmp::Ordering::Less => y,
        std::cmp::Ordering::Equal => DType::F32,
    };
    let convert = |v: &NDArray| {
        if v.dtype() == wide {
            Ok(v.clone())
        } else {
            v.to_dtype(wide)
        }
    };
    Ok(Some((convert(a)?, convert(b)?)))
}
