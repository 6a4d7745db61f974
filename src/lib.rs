#![doc = include_str!("../README.md")]
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod amp;
mod arena;
mod backend;
pub mod cuda;
mod device;
mod distributed;
mod dtype;
mod error;
mod host;
mod inference;
mod layer_workspace;
mod locks;
mod manager;
mod memory;
mod ndarray;
mod observe;
mod optim;
mod persist;
mod prefetch;
mod print;
mod report;
mod shape;
mod state;
pub mod testing;
mod timeline;
mod training;
pub mod workspace;

pub use amp::{GradScaler, GradScalerOptions};
pub use device::Device;
pub use distributed::{DistributedConfig, DEFAULT_RENDEZVOUS_TIMEOUT};
pub use dtype::{DType, Element};
pub use error::{fmt_bytes, Error, LimitSource, Result, Site};
/// The half-precision element types of [`DType::F16`] and [`DType::BF16`], re-exported from the
/// `half` crate so arrays of them need no second dependency.
pub use half::{bf16, f16};
pub use host::HostArray;
pub use inference::{
    InferenceMode, InferenceStats, ParallelInference, ParallelInferenceBuilder, Pending, Predictor,
    PredictorBuilder, ShutdownMode, ShutdownReport,
};
pub use layer_workspace::{
    ArrayKind, KindScope, LayerWorkspaceMgr, LayerWorkspaceMgrBuilder, Placement,
};
pub use manager::{ActiveScope, Manager, ManagerId, Scope};
pub use memory::{
    memory_limit, memory_usage, reset_memory_stats, reset_peak, set_memory_limit, DeviceUsage,
};
pub use ndarray::{
    autocast, autocast_dtype, concat, gradient_collector, is_grad_enabled, manual_seed,
    no_gradient, stack, Activation, AdamUpdate, ArrayId, AutocastGuard, Dense, GradientCollector,
    NDArray, NDList, NoGradientGuard, SgdUpdate, Transpose,
};
pub use optim::{Adam, AdamW, Optimizer, OptimizerKind, Sgd};
pub use prefetch::{PrefetchStats, Prefetcher};
pub use print::{print_options, set_print_options, PrintOptions};
pub use report::{ArrayReport, Growth, ManagerReport, SiteGrowth, WorkspaceReport};
pub use shape::Shape;
pub use timeline::{
    is_recording, recording_snapshot, start_recording, stop_recording, EventKind, MemoryEvent,
    RecordOptions, Recording,
};
pub use training::{
    ParallelStep, ParallelTrainer, ParallelTrainerBuilder, ParallelTrainerStats,
    DEFAULT_TRAINER_TIMEOUT,
};
pub use workspace::{
    destroy_all_workspaces_for_current_thread, AllocationPolicy, GraphReplayStats, GraphState,
    LearningPolicy, LocationPolicy, MirroringPolicy, ResetPolicy, SpillPolicy, Workspace,
    WorkspaceConfig, WorkspaceConfigBuilder, WorkspaceStats,
};

/// Lets float matrix products on CUDA devices use TF32 tensor cores (10 bits of mantissa for
/// the products, f32 accumulation), or with `false` restores strict FP32, the default. Like
/// PyTorch's `torch.backends.cuda.matmul.allow_tf32`: several times faster on Ampere and Hopper
/// GPUs, with about 1e-3 relative error. Process-wide; affects products issued after the call.
/// CPU products are always strict.
///
/// ```
/// ndscope::set_allow_tf32(true);
/// assert!(ndscope::allow_tf32());
/// ndscope::set_allow_tf32(false);
/// ```
pub fn set_allow_tf32(allow: bool) {
    backend::ALLOW_TF32.store(allow, std::sync::atomic::Ordering::Relaxed);
}

/// Whether float matrix products on CUDA devices may use TF32 ([`set_allow_tf32`]).
pub fn allow_tf32() -> bool {
    backend::ALLOW_TF32.load(std::sync::atomic::Ordering::Relaxed)
}

/// Threads the CPU kernels run on: the calling thread plus helper threads of ndscope's own pool.
/// It is `NDSCOPE_NUM_THREADS` when that is set to a whole number from 1 to the larger of 4 ×
/// the cores the process may use and 64 (read once, at the first parallel kernel), else the
/// number of cores. A larger number is clamped to that maximum; `0` or anything not a whole
/// number is ignored; either way a warning naming the variable and its value goes to stderr and
/// to `tracing`. Kernel results are bit-identical for every thread count.
///
/// ```
/// assert!(ndscope::num_threads() >= 1);
/// ```
pub fn num_threads() -> usize {
    backend::cpu::pool::threads()
}

/// Caps the threads the CPU kernels run on at `n` (at least 1; a cap above the pool's size
/// means the whole pool) and returns [`num_threads`] as it now is. The pool keeps its threads
/// (those above the cap sleep), so the cap can be raised again later, up to the pool's size
/// (`NDSCOPE_NUM_THREADS`). Kernels cut their work by the problem's size alone, so results stay
/// bit-identical under any cap. Process-wide; meant for benchmarks and for sharing the machine
/// with other work.
///
/// ```
/// let pool = ndscope::num_threads();
/// assert_eq!(ndscope::set_num_threads(1), 1);
/// assert_eq!(ndscope::set_num_threads(usize::MAX), pool);
/// ```
pub fn set_num_threads(n: usize) -> usize {
    backend::cpu::pool::set_limit(n)
}

// The CPU's measured f32 FMA peak, to compare the kernels' GFLOP/s with.
pub use backend::cpu::peak::{measure_cpu_peak, CpuPeak};
