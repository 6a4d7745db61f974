//! What a workspace's CUDA graph replay reports ([`WorkspaceConfig::graph_replay`]): the
//! figures the CUDA backend's recorder keeps, device-independent so that the workspace and the
//! reports read them in every build.
//!
//! [`WorkspaceConfig::graph_replay`]: crate::WorkspaceConfig

use std::fmt;

/// Where a workspace's graph replay stands.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub enum GraphState {
    /// Replay is off: not asked for, or the workspace is not on a CUDA device.
    #[default]
    Off,
    /// The block is not learned yet, or the last cycle fell back: the next learned cycle runs
    /// eagerly and is recorded.
    Learning,
    /// The learned cycle is captured: the next cycles are checked against it and replayed.
    Captured,
    /// Capturing failed (the reason); cycles run eagerly from then on.
    Failed(String),
}

impl fmt::Display for GraphState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GraphState::Off => f.write_str("off"),
            GraphState::Learning => f.write_str("learning"),
            GraphState::Captured => f.write_str("captured"),
            GraphState::Failed(why) => write!(f, "failed ({why})"),
        }
    }
}

/// A workspace's graph replay figures, in [`WorkspaceStats::graph`](crate::WorkspaceStats).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct GraphReplayStats {
    /// The state now.
    pub state: GraphState,
    /// Learned cycles captured into graphs.
    pub captures: u64,
    /// Cycles replayed: every call checked against the recorded one, the graphs launched.
    pub replays: u64,
    /// Replayed cycles that diverged from the recording and finished eagerly.
    pub fallbacks: u64,
    /// Why the last fallback happened (the op and what differed), or why the last capture
    /// failed.
    pub last_fallback: Option<String>,
    /// Kernel arguments (a scalar, an address) that differed from the recording and were
    /// written into the executable graph instead of forcing a new capture.
    pub updated_arguments: u64,
    /// Calls (kernels, cuBLAS products, copies, fills) the captured cycle stands for.
    pub calls: usize,
    /// Graph launches per replayed cycle: one, plus one per host read or transfer inside it.
    pub graphs: usize,
}
