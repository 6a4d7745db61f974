//! Arrays in and out of the caller's hands: [`NDArray::to_host`] and [`Manager::from_host`]
//! convert between managed arrays and [`HostArray`], the owned data of `src/host.rs` (which
//! knows nothing of managers).

use crate::host::{HostArray, HostData};
use crate::{DType, Manager, NDArray, Result};

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
        }
    }
}
