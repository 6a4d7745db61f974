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
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}
