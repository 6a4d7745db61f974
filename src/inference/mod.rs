//! Inference: DJL's predictor tree (model → predictor → one context per call) and ND4J's
//! `ParallelInference`, on ndscope's managers and workspaces.
//!
//! - [`Predictor`] (`predictor.rs`): a step closure over a capped model, each call in its own
//!   context scope; what leaves a call is data the caller owns.
//! - [`ParallelInference`] (`parallel.rs`): worker threads, each with its own predictor and
//!   workspace over the model's shared parameters, a request queue with optional batching,
//!   and an explicit shutdown.

mod parallel;
mod predictor;

pub use parallel::{
    InferenceMode, InferenceStats, ParallelInference, ParallelInferenceBuilder, Pending,
    ShutdownMode, ShutdownReport,
};
pub use predictor::{Predictor, PredictorBuilder};
