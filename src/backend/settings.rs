//! Process-wide settings the backends read. A leaf: the CUDA devices read it, and the crate's
//! public switches (`set_allow_tf32`) write it, without either importing the other.

use std::sync::atomic::AtomicBool;

/// Whether float matrix products on CUDA devices may use TF32 tensor cores
/// ([`crate::set_allow_tf32`]). Off: strict FP32.
pub(crate) static ALLOW_TF32: AtomicBool = AtomicBool::new(false);
