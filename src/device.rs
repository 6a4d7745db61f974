//! Where an array's memory lives.

use std::fmt;

/// A compute device: the host CPU or a CUDA GPU by ordinal.
///
/// ```
/// use ndscope::Device;
/// assert_eq!(Device::Cpu.to_string(), "cpu");
/// assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
/// // Without the `cuda` feature, or on a machine without a driver, there are no GPUs.
/// if Device::cuda_count() == 0 {
///     assert!(!Device::Cuda(0).is_available());
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Device {
    /// Host memory, computed on the CPU.
    #[default]
    Cpu,
    /// The CUDA device with this ordinal.
    Cuda(usize),
}

impl Device {
    /// The number of CUDA devices usable by this build on this machine.
    ///
    /// Never panics: it is 0 without the `cuda` feature, without a driver, or without a GPU.
    pub fn cuda_count() -> usize {
        crate::backend::cuda_count()
    }

    /// Whether arrays can be created on this device here.
    pub fn is_available(&self) -> bool {
        match self {
            Device::Cpu => true,
            Device::Cuda(ordinal) => *ordinal < Device::cuda_count(),
        }
    }

    /// `true` for [`Device::Cpu`].
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Waits until all work queued on the device has finished, and reports an error an earlier
    /// asynchronous kernel ran into as `Error::Backend`, and bad input a kernel found since the
    /// last wait (an index out of range in `pick`/`one_hot`, an integer divisor of 0) as the
    /// `InvalidArgument` of the op that queued it, with its call site. The host thread sleeps
    /// while it waits (a blocking-sync event), it does not spin. CUDA ops return once their work is
    /// queued; reads (`to_vec`, `to_scalar`) wait by themselves, so this is for timing and for
    /// checking errors at a chosen point. Does nothing for the CPU, whose ops finish before they
    /// return. `DeviceUnavailable` for an absent device.
    ///
    /// ```
    /// use ndscope::Device;
    /// Device::Cpu.synchronize()?;
    /// # Ok::<(), ndscope::Error>(())
    /// ```
    #[track_caller]
    pub fn synchronize(&self) -> crate::Result<()> {
        let ctx = crate::error::Ctx::new("Device::synchronize");
        if !self.is_available() {
            return Err(ctx.unavailable(*self));
        }
        crate::backend::synchronize(&ctx, *self)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}
