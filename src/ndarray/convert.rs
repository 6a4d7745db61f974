//! Copies of an array on another device or in another dtype: [`NDArray::to_device`] and
//! [`NDArray::to_dtype`].

use super::autograd::{record, Backward};
use super::exec;
use crate::backend::contract::TransferOps;
use crate::backend::AnyDevice;
use crate::error::Ctx;
use crate::{DType, Device, NDArray, Result};

impl NDArray {
    /// A copy on `device`, owned by the manager that holds this array (whatever scope is
    /// active: an array's device is its own, and moving it keeps its owner). Host↔device copies
    /// go through page-locked staging memory. `DeviceUnavailable` for absent devices; `Capped`
    /// if the owner is capped.
    ///
    /// ```
    /// use ndscope::{Device, Manager};
    /// let m = Manager::new_base();
    /// let a = m.from_slice(&[1.0f32, 2.0], [2])?;
    /// let b = a.to_device(Device::Cpu)?;                 // a copy, owned by `m`
    /// assert_eq!(b.manager()?, m);
    /// assert!(a.to_device(Device::Cuda(64)).is_err()); // no such device
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn to_device(&self, device: Device) -> Result<NDArray> {
        let ctx = Ctx::new("NDArray::to_device");
        if !device.is_available() {
            return Err(ctx.unavailable(device));
        }
        let out = exec::op1_into(
            &ctx,
            self,
            (exec::Target::OwnerOf(self), device),
            self.shape().clone(),
            self.dtype(),
            |src, dst| AnyDevice::copy(&ctx, src, dst),
        )?;
        record(&ctx, &[self], &out, || Backward::Convert);
        Ok(out)
    }

    /// A copy converted to `dtype`, placed like an op result. Conversions follow Rust's `as`:
    /// integers to integers wrap (two's complement, as NumPy's `astype` and PyTorch's `to`: 300
    /// as `U8` is 44), integers to floats and floats to floats round to nearest, floats to
    /// integers truncate toward zero and saturate at the bounds (NaN gives 0).
    ///
    /// ```
    /// use ndscope::{DType, Manager};
    /// let m = Manager::new_base();
    /// let a = m.from_slice(&[300i64, -1], [2])?;
    /// assert_eq!(a.to_dtype(DType::U8)?.to_vec::<u8>()?, vec![44, 255]);
    /// let f = m.from_slice(&[2.7f32, -2.7, 1e10], [3])?;
    /// assert_eq!(f.to_dtype(DType::I32)?.to_vec::<i32>()?, vec![2, -2, i32::MAX]);
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<NDArray> {
        self.copy_as(&Ctx::new("NDArray::to_dtype"), dtype)
    }

    /// A copy, placed like an op result (the active scope, else this array's owner).
    #[track_caller]
    pub fn duplicate(&self) -> Result<NDArray> {
        self.copy_as(&Ctx::new("NDArray::duplicate"), self.dtype())
    }

    /// Writes `src` converted to this array's dtype into it, in place (same shape and device;
    /// both floats, checked by the caller: backward's delivery of a converted gradient).
    pub(crate) fn assign_converted_(&self, src: &NDArray) -> Result<()> {
        let ctx = Ctx::new("assign_converted_");
        if src.shape() != self.shape() || src.device() != self.device() {
            return Err(ctx.shape(format!(
                "{} {} on {} cannot be written into {} {} on {}",
                src.0.describe(),
                src.shape(),
                src.device(),
                self.0.describe(),
                self.shape(),
                self.device()
            )));
        }
        let (from, to) = (src.dtype(), self.dtype());
        exec::inplace_with(&ctx, self, src, |target, source| match source {
            Some(s) => AnyDevice::convert(&ctx, (from, to), s, target),
            None => Ok(()),
        })
    }

    fn copy_as(&self, ctx: &Ctx, dtype: DType) -> Result<NDArray> {
        let from = self.dtype();
        let out = exec::op1(ctx, self, self.shape().clone(), dtype, |src, dst| {
            AnyDevice::convert(ctx, (from, dtype), src, dst)
        })?;
        record(ctx, &[self], &out, || Backward::Convert);
        Ok(out)
    }
}
