//! Arrays in and out of the caller's hands: [`NDArray::to_host`] and [`Manager::from_host`]
//! convert between managed arrays and [`HostArray`], the owned data of `src/host.rs` (which
//! knows nothing of managers); [`NDArray::to_vec`] and [`NDArray::to_scalar`] copy the elements
//! out.

use super::exec;
use crate::backend::contract::TransferOps;
use crate::backend::AnyDevice;
use crate::error::Ctx;
use crate::host::{HostArray, HostData};
use crate::{DType, Element, Manager, NDArray, Result};

impl NDArray {
    /// Copies the array out of its manager into a [`HostArray`] the caller owns (CUDA arrays are
    /// read back). `ArrayClosed` for a closed array.
    #[track_caller]
    pub fn to_host(&self) -> Result<HostArray> {
        let shape = self.shape().clone();
        let data = match self.dtype() {
            DType::F32 => HostData::F32(self.to_vec()?),
            DType::F64 => HostData::F64(self.to_vec()?),
            DType::I32 => HostData::I32(self.to_vec()?),
            DType::I64 => HostData::I64(self.to_vec()?),
            DType::U8 => HostData::U8(self.to_vec()?),
            DType::F16 => HostData::F16(self.to_vec()?),
            DType::BF16 => HostData::BF16(self.to_vec()?),
        };
        Ok(HostArray { shape, data })
    }
}

impl Manager {
    /// A new array in this manager (its device; its workspace block inside a cycle) holding a
    /// copy of `host`. Errors as for [`Manager::from_slice`].
    #[track_caller]
    pub fn from_host(&self, host: &HostArray) -> Result<NDArray> {
        let shape = host.shape().clone();
        match &host.data {
            HostData::F32(v) => self.from_slice(v, shape),
            HostData::F64(v) => self.from_slice(v, shape),
            HostData::I32(v) => self.from_slice(v, shape),
            HostData::I64(v) => self.from_slice(v, shape),
            HostData::U8(v) => self.from_slice(v, shape),
            HostData::F16(v) => self.from_slice(v, shape),
            HostData::BF16(v) => self.from_slice(v, shape),
        }
    }
}

impl NDArray {
    /// Copies the elements out, row-major. `T` must match the dtype (`DTypeMismatch`).
    #[track_caller]
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let ctx = Ctx::new("NDArray::to_vec");
        self.check_element::<T>(&ctx)?;
        let mut values = vec![T::ZERO; self.size()];
        exec::read_all(&ctx, &[self], |b| AnyDevice::read(&ctx, b[0], &mut values))?;
        Ok(values)
    }

    /// The only element of a one-element array (any shape). `T` must match the dtype.
    #[track_caller]
    pub fn to_scalar<T: Element>(&self) -> Result<T> {
        let ctx = Ctx::new("NDArray::to_scalar");
        self.check_element::<T>(&ctx)?;
        if self.size() != 1 {
            return Err(ctx.shape(format!(
                "to_scalar needs exactly one element; array {} has shape {} ({} elements)",
                self.0.describe(),
                self.shape(),
                self.size()
            )));
        }
        let mut value = [T::ZERO];
        exec::read_all(&ctx, &[self], |b| AnyDevice::read(&ctx, b[0], &mut value))?;
        Ok(value[0])
    }

    fn check_element<T: Element>(&self, ctx: &Ctx) -> Result<()> {
        if T::DTYPE != self.dtype() {
            return Err(ctx.dtype(
                self.dtype(),
                format!(
                    "array {} holds {}, asked for {}",
                    self.0.describe(),
                    self.dtype(),
                    T::DTYPE
                ),
            ));
        }
        Ok(())
    }
}
