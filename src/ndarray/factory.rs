//! Array factories on [`Manager`], and the global seed.

use parking_lot::Mutex;

use super::exec::{self, Target};
use crate::backend::contract::{Draw, ElementwiseOps, TransferOps};
use crate::backend::{AnyDevice, Storage};
use crate::error::Ctx;
use crate::state;
use crate::{DType, Element, Manager, NDArray, Result, Shape};

/// The seed and the next counter offset of the random stream.
static RNG: Mutex<(u64, u64)> = Mutex::new((0x6E64_7363_6F70_6521, 0));

/// Seeds the random stream used by `randn` and `rand`, and restarts it: after
/// `manual_seed(s)`, the same sequence of draws gives the same numbers, on every device.
///
/// ```
/// use ndscope::{manual_seed, DType, Manager};
/// let m = Manager::new_base();
/// manual_seed(42);
/// let a = m.randn([4], DType::F32)?.to_vec::<f32>()?;
/// manual_seed(42);
/// let b = m.randn([4], DType::F32)?.to_vec::<f32>()?;
/// assert_eq!(a, b);
/// # Ok::<(), ndscope::Error>(())
/// ```
pub fn manual_seed(seed: u64) {
    *RNG.lock() = (seed, 0);
}

/// Reserves `n` counters of the random stream.
fn draw(n: usize) -> (u64, u64) {
    let mut rng = RNG.lock();
    let (seed, start) = *rng;
    rng.1 = start.wrapping_add(n as u64);
    (seed, start)
}

impl Manager {
    fn create(&self, ctx: &Ctx, shape: Shape, dtype: DType) -> Result<(NDArray, bool)> {
        exec::new_array(ctx, Target::Manager(self), shape, dtype, self.device())
    }

    /// `ManagerClosed` or `Capped` if this manager cannot take a new array now. A manager that
    /// passes may still be closed or capped before the array is inserted, so the insertion checks
    /// again; this check only keeps a refused call from reserving memory first.
    fn check_accepts_new_array(&self, ctx: &Ctx, shape: &Shape, dtype: DType) -> Result<()> {
        let state = state::lock();
        if state.manager(&self.0, ctx)?.capped {
            let what = format!("a new {dtype} array of shape {shape} would be created in it");
            return Err(state::capped(ctx, &self.0, what));
        }
        Ok(())
    }

    /// Creates an array and fills it with `fill` (under its data lock); `fill` is told whether
    /// the bytes may hold stale data (workspace or device memory) or are zeroed.
    fn create_filled(
        &self,
        ctx: &Ctx,
        shape: Shape,
        dtype: DType,
        fill: impl FnOnce(&mut Storage, bool) -> Result<()>,
    ) -> Result<NDArray> {
        let (array, dirty) = self.create(ctx, shape, dtype)?;
        let result = exec::compute(ctx, &[], &array, |_, out| fill(out, dirty));
        match result {
            Ok(()) => Ok(array),
            Err(e) => {
                exec::discard(&array);
                Err(e)
            }
        }
    }

    /// An array of zeros.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let a = Manager::new_base().zeros([2, 3], DType::I64)?;
    /// assert_eq!(a.to_vec::<i64>()?, vec![0; 6]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn zeros(&self, shape: impl Into<Shape>, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("zeros");
        self.create_filled(&ctx, shape.into(), dtype, |out, dirty| {
            if dirty {
                AnyDevice::zero(&ctx, out)?;
            }
            Ok(())
        })
    }

    /// An array whose contents are unspecified, as PyTorch's `torch.empty`: for an output every
    /// element of which the caller writes before reading. Fresh host memory is zeroed, but
    /// memory of a workspace block or of a CUDA device holds whatever an earlier array left
    /// there, so creating it costs no write at all (on a learned workspace, no allocation
    /// either). The bytes are always initialised memory, so reading them is never undefined
    /// behaviour, only meaningless.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let out = m.empty([2, 3], DType::F32)?;
    /// out.fill_(1.5)?;
    /// assert_eq!(out.to_vec::<f32>()?, vec![1.5; 6]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn empty(&self, shape: impl Into<Shape>, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("empty");
        self.create(&ctx, shape.into(), dtype)
            .map(|(array, _)| array)
    }

    /// An array of ones.
    #[track_caller]
    pub fn ones(&self, shape: impl Into<Shape>, dtype: DType) -> Result<NDArray> {
        self.fill_value(Ctx::new("ones"), shape.into(), 1.0, dtype)
    }

    /// An array filled with `value` (converted to `dtype` as by `as`).
    #[track_caller]
    pub fn full(&self, shape: impl Into<Shape>, value: f64, dtype: DType) -> Result<NDArray> {
        self.fill_value(Ctx::new("full"), shape.into(), value, dtype)
    }

    fn fill_value(&self, ctx: Ctx, shape: Shape, value: f64, dtype: DType) -> Result<NDArray> {
        self.create_filled(&ctx, shape, dtype, |out, _| {
            AnyDevice::fill(&ctx, dtype, out, value)
        })
    }

    /// An array holding a copy of `data`, whose length must equal the shape's size
    /// (`ShapeMismatch` otherwise).
    #[track_caller]
    pub fn from_slice<T: Element>(&self, data: &[T], shape: impl Into<Shape>) -> Result<NDArray> {
        let ctx = Ctx::new("from_slice");
        let shape = shape.into();
        check_len(&ctx, data.len(), &shape)?;
        self.create_filled(&ctx, shape, T::DTYPE, |out, _| {
            AnyDevice::write(&ctx, out, data)
        })
    }

    /// An array that takes over `data`'s allocation without copying (copied instead when this
    /// manager allocates from a workspace cycle). The length must equal the shape's size.
    #[track_caller]
    pub fn from_vec<T: Element>(&self, data: Vec<T>, shape: impl Into<Shape>) -> Result<NDArray> {
        let ctx = Ctx::new("from_vec");
        let shape = shape.into();
        check_len(&ctx, data.len(), &shape)?;
        if !self.device().is_cpu() || exec::allocates_from_workspace(self) {
            return self.create_filled(&ctx, shape, T::DTYPE, |out, _| {
                AnyDevice::write(&ctx, out, &data)
            });
        }
        // Refuse before the vector's bytes are reserved, as every other factory does.
        self.check_accepts_new_array(&ctx, &shape, T::DTYPE)?;
        let buffer = Storage::from_vec(&ctx, data)?;
        exec::adopt(&ctx, self, shape, T::DTYPE, buffer)
    }

    /// A 0-dimensional array holding `value`.
    #[track_caller]
    pub fn scalar<T: Element>(&self, value: T) -> Result<NDArray> {
        let ctx = Ctx::new("scalar");
        self.create_filled(&ctx, Shape::scalar(), T::DTYPE, |out, _| {
            AnyDevice::write(&ctx, out, &[value])
        })
    }

    /// `[start, start + step, …]` up to but excluding `stop`, as NumPy's `arange`.
    /// `InvalidArgument` for a zero or non-finite step or non-finite bounds.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let a = Manager::new_base().arange(0.0, 1.0, 0.25, DType::F64)?;
    /// assert_eq!(a.to_vec::<f64>()?, vec![0.0, 0.25, 0.5, 0.75]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn arange(&self, start: f64, stop: f64, step: f64, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("arange");
        if !(start.is_finite() && stop.is_finite() && step.is_finite()) || step == 0.0 {
            return Err(ctx.invalid(format!(
                "arange({start}, {stop}, {step}) needs finite bounds and a non-zero finite step"
            )));
        }
        let count = ((stop - start) / step).ceil();
        let count = if count > 0.0 { count } else { 0.0 };
        if count > (isize::MAX as f64) {
            return Err(ctx.invalid(format!(
                "arange({start}, {stop}, {step}) would have {count} elements"
            )));
        }
        let n = count as usize;
        self.create_filled(&ctx, Shape::new(&[n]), dtype, |out, _| {
            AnyDevice::arange(&ctx, dtype, out, start, step)
        })
    }

    /// The `n × n` identity matrix.
    #[track_caller]
    pub fn eye(&self, n: usize, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("eye");
        let shape = Shape::new(&[n, n]);
        self.create_filled(&ctx, shape, dtype, |out, _| {
            AnyDevice::eye(&ctx, dtype, out, n)
        })
    }

    /// Standard normal samples from the seeded stream ([`manual_seed`]). Float dtypes only
    /// (`DTypeMismatch` otherwise).
    #[track_caller]
    pub fn randn(&self, shape: impl Into<Shape>, dtype: DType) -> Result<NDArray> {
        let ctx = Ctx::new("randn");
        if !dtype.is_float() {
            return Err(ctx.dtype(
                dtype,
                format!("randn needs a float dtype (f32, f64, f16, bf16), got {dtype}"),
            ));
        }
        let shape = shape.into();
        let n = shape.size();
        // Drawn only once the array exists: a refused call consumes no numbers.
        self.create_filled(&ctx, shape, dtype, |out, _| {
            let (seed, start) = draw(n);
            AnyDevice::randn(&ctx, dtype, out, Draw { seed, start })
        })
    }

    /// Uniform samples in `[low, high)` from the seeded stream; integer dtypes get the integers
    /// of `[low, high)`, each equally likely. `InvalidArgument` unless `low < high`, both finite;
    /// for an integer dtype, also unless the interval holds an integer and every integer in it
    /// fits the dtype (`U8`: 0 to 255; `I64`: within ±2⁵³, where f64 counts exactly), as
    /// PyTorch's `randint` refuses rather than saturating or wrapping.
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let dice = m.rand([6], 1.0, 7.0, DType::U8)?;
    /// assert!(dice.to_vec::<u8>()?.iter().all(|&d| (1..=6).contains(&d)));
    /// assert!(m.rand([6], 0.0, 300.0, DType::U8).is_err());   // 256..299 do not fit a u8
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn rand(
        &self,
        shape: impl Into<Shape>,
        low: f64,
        high: f64,
        dtype: DType,
    ) -> Result<NDArray> {
        let ctx = Ctx::new("rand");
        if !(low.is_finite() && high.is_finite() && low < high) {
            return Err(ctx.invalid(format!(
                "rand needs finite bounds with low < high, got [{low}, {high})"
            )));
        }
        if !dtype.is_float() {
            let (first, last) = (low.ceil(), high.ceil() - 1.0);
            if last < first {
                return Err(ctx.invalid(format!(
                    "rand of {dtype} needs an integer in [{low}, {high})"
                )));
            }
            let (min, max) = match dtype {
                DType::U8 => (0.0, 255.0),
                DType::I32 => (i32::MIN as f64, i32::MAX as f64),
                _ => (-(2f64.powi(53)), 2f64.powi(53)),
            };
            if first < min || last > max {
                return Err(ctx.invalid(format!(
                    "rand of {dtype} draws the integers {first} to {last} of [{low}, {high}), but {dtype} holds {min} to {max}"
                )));
            }
        }
        let shape = shape.into();
        let n = shape.size();
        // Drawn only once the array exists: a refused call consumes no numbers.
        self.create_filled(&ctx, shape, dtype, |out, _| {
            let (seed, start) = draw(n);
            AnyDevice::rand(&ctx, dtype, out, Draw { seed, start }, (low, high))
        })
    }
}

fn check_len(ctx: &Ctx, len: usize, shape: &Shape) -> Result<()> {
    match shape.checked_size() {
        Some(size) if size == len => Ok(()),
        _ => Err(ctx.shape(format!(
            "{len} elements given for shape {shape}, which holds {}",
            shape.size()
        ))),
    }
}
