//! [`WorkspaceConfig`] and its policies, with ND4J's names and defaults.

use std::path::{Path, PathBuf};

use crate::error::Ctx;
use crate::Result;

/// How big the block is made, relative to the bytes it must hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum AllocationPolicy {
    /// Exactly the bytes learned (or `initial_size`).
    Strict,
    /// The bytes learned plus `floor(bytes × overallocation_limit)`.
    #[default]
    Overallocate,
}

/// How the block size is found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LearningPolicy {
    /// From the first cycle's total (that cycle spills while it is measured).
    #[default]
    FirstLoop,
    /// From the largest cycle seen, once `cycles_before_initialization` cycles have ended.
    OverTime,
    /// No learning: the block is `initial_size`, allocated when the workspace is created.
    None,
}

/// What happens to an allocation that does not fit in the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum SpillPolicy {
    /// It gets its own buffer, freed when its array closes; the block never grows.
    #[default]
    External,
    /// As `External`, and at the end of the cycle the block grows to the largest cycle seen.
    Reallocate,
    /// The allocation fails with `Error::WorkspaceFull`; the workspace is unchanged.
    Fail,
}

/// What happens to the allocation offset between cycles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ResetPolicy {
    /// Back to 0 at every cycle; the cycle's arrays are closed with it.
    #[default]
    BlockLeft,
    /// Circular: the offset carries on across cycles and wraps to 0 when an allocation does not
    /// fit at the end. Arrays `ret`-ed out of a cycle stay in place, zero-copy, until the offset
    /// comes round over them; then their handles give `ArrayClosed` ("overwritten").
    EndOfBuffer,
}

/// Where the block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LocationPolicy {
    /// Ordinary memory of the owner's device.
    #[default]
    Ram,
    /// A memory-mapped file (`mmap_path`, or a temporary file removed when the block is freed).
    /// CPU only; needs `initial_size` and `LearningPolicy::None`.
    Mmap,
}

/// For workspaces of CUDA managers: where the block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MirroringPolicy {
    /// The block is device memory.
    #[default]
    Full,
    /// The block is page-locked host memory; its arrays are on `Device::Cpu`.
    HostOnly,
}

/// How a workspace sizes, fills and recycles its block. `WorkspaceConfig::default()` is ND4J's
/// default configuration; [`WorkspaceConfig::builder`] changes it and [`build`] checks it.
///
/// [`build`]: WorkspaceConfigBuilder::build
///
/// ```
/// use ndscope::{AllocationPolicy, LearningPolicy, SpillPolicy, WorkspaceConfig};
/// let conf = WorkspaceConfig::builder()
///     .learning(LearningPolicy::FirstLoop)
///     .allocation(AllocationPolicy::Overallocate)
///     .spill(SpillPolicy::Reallocate)
///     .build()?;
/// assert_eq!(conf.overallocation_limit(), 0.3);
/// // OverTime with 0 cycles would never learn; ND4J accepts it silently, we refuse it.
/// assert!(WorkspaceConfig::builder().learning(LearningPolicy::OverTime).build().is_err());
/// # Ok::<(), ndscope::Error>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct WorkspaceConfig {
    initial_size: usize,
    min_size: usize,
    max_size: usize,
    allocation: AllocationPolicy,
    overallocation_limit: f64,
    learning: LearningPolicy,
    cycles_before_initialization: usize,
    spill: SpillPolicy,
    reset: ResetPolicy,
    location: LocationPolicy,
    mmap_path: Option<PathBuf>,
    mirroring: MirroringPolicy,
    graph_replay: bool,
}

impl Default for WorkspaceConfig {
    fn default() -> Self {
        WorkspaceConfig {
            initial_size: 0,
            min_size: 0,
            max_size: 0,
            allocation: AllocationPolicy::Overallocate,
            overallocation_limit: 0.3,
            learning: LearningPolicy::FirstLoop,
            cycles_before_initialization: 0,
            spill: SpillPolicy::External,
            reset: ResetPolicy::BlockLeft,
            location: LocationPolicy::Ram,
            mmap_path: None,
            mirroring: MirroringPolicy::Full,
            graph_replay: false,
        }
    }
}

impl WorkspaceConfig {
    /// A builder starting from the defaults.
    pub fn builder() -> WorkspaceConfigBuilder {
        WorkspaceConfigBuilder {
            config: WorkspaceConfig::default(),
        }
    }

    /// Bytes of the block allocated at creation (0: none until learned).
    pub fn initial_size(&self) -> usize {
        self.initial_size
    }
    /// The smallest block ever allocated.
    pub fn min_size(&self) -> usize {
        self.min_size
    }
    /// The largest block ever allocated (0: unbounded).
    pub fn max_size(&self) -> usize {
        self.max_size
    }
    /// The allocation policy.
    pub fn allocation(&self) -> AllocationPolicy {
        self.allocation
    }
    /// The overallocation fraction (0.3 by default).
    pub fn overallocation_limit(&self) -> f64 {
        self.overallocation_limit
    }
    /// The learning policy.
    pub fn learning(&self) -> LearningPolicy {
        self.learning
    }
    /// Cycles to watch before `OverTime` learns.
    pub fn cycles_before_initialization(&self) -> usize {
        self.cycles_before_initialization
    }
    /// The spill policy.
    pub fn spill(&self) -> SpillPolicy {
        self.spill
    }
    /// The reset policy.
    pub fn reset(&self) -> ResetPolicy {
        self.reset
    }
    /// The location policy.
    pub fn location(&self) -> LocationPolicy {
        self.location
    }
    /// The file backing an `Mmap` block, if given.
    pub fn mmap_path(&self) -> Option<&Path> {
        self.mmap_path.as_deref()
    }
    /// The mirroring policy.
    pub fn mirroring(&self) -> MirroringPolicy {
        self.mirroring
    }
    /// Whether learned cycles on a CUDA device are replayed as CUDA graphs (off by default).
    pub fn graph_replay(&self) -> bool {
        self.graph_replay
    }

    /// The block size for `bytes` of demand: the allocation policy applied, then clamped to
    /// `min_size` and `max_size`.
    pub(crate) fn block_size_for(&self, bytes: usize) -> usize {
        let grown = match self.allocation {
            AllocationPolicy::Strict => bytes,
            AllocationPolicy::Overallocate => {
                let extra = (bytes as f64 * self.overallocation_limit).floor();
                bytes.saturating_add(extra as usize)
            }
        };
        let at_least = grown.max(self.min_size);
        if self.max_size > 0 {
            at_least.min(self.max_size)
        } else {
            at_least
        }
    }
}

/// Builds a [`WorkspaceConfig`]; every setter takes and returns the builder.
#[derive(Clone, Debug)]
#[must_use = "call .build() to get the configuration"]
pub struct WorkspaceConfigBuilder {
    config: WorkspaceConfig,
}

macro_rules! setter {
    ($(#[$doc:meta])* $name:ident: $t:ty) => {
        $(#[$doc])*
        pub fn $name(mut self, value: $t) -> Self {
            self.config.$name = value;
            self
        }
    };
}

impl WorkspaceConfigBuilder {
    setter!(
        /// Bytes of the block allocated when the workspace is created (any learning policy).
        initial_size: usize
    );
    setter!(
        /// The smallest block ever allocated.
        min_size: usize
    );
    setter!(
        /// The largest block ever allocated; 0 means unbounded.
        max_size: usize
    );
    setter!(
        /// `Strict` or `Overallocate`.
        allocation: AllocationPolicy
    );
    setter!(
        /// The fraction added under `Overallocate` (default 0.3).
        overallocation_limit: f64
    );
    setter!(
        /// `FirstLoop`, `OverTime` or `None`.
        learning: LearningPolicy
    );
    setter!(
        /// Cycles `OverTime` watches before it sizes the block; must be at least 1 for it.
        cycles_before_initialization: usize
    );
    setter!(
        /// `External`, `Reallocate` or `Fail`.
        spill: SpillPolicy
    );
    setter!(
        /// `BlockLeft` or `EndOfBuffer`.
        reset: ResetPolicy
    );
    setter!(
        /// `Ram` or `Mmap`.
        location: LocationPolicy
    );
    setter!(
        /// `Full` or `HostOnly`.
        mirroring: MirroringPolicy
    );
    setter!(
        /// Replays learned cycles on a CUDA device as CUDA graphs (default off; nothing changes
        /// on the CPU). The first cycle with a learned block runs eagerly and is recorded; at
        /// its end it is captured (one graph per stretch between host reads and transfers).
        /// From then on each kernel, product, copy and fill the cycle's thread asks for is
        /// checked against the recorded one instead of being launched, and the graphs are
        /// launched at the cycle's end (or at the read that ends a stretch): one launch for the
        /// whole step where nothing is read in it. Kernel arguments that change (a learning
        /// rate, Adam's step count, an address) are written into the executable graph; any
        /// other difference (another op, shape or product, a read in a new place, another
        /// thread's op on arrays the held calls use) makes that cycle finish eagerly, with the
        /// results of an eager run, and the next one record again.
        /// [`WorkspaceStats::graph`](crate::WorkspaceStats) says how it went.
        ///
        /// Off by default because it moves when work reaches the device: a replayed cycle's
        /// kernels run when its graph is launched, not when each op returns, so another thread
        /// that uses the cycle's arrays in the middle of it makes it fall back, and a cycle
        /// whose ops differ every time pays for recording without replaying.
        graph_replay: bool
    );

    /// The file that backs an `Mmap` block. It is created (or truncated to the block size) when
    /// the block is allocated and left in place afterwards.
    pub fn mmap_path(mut self, path: impl Into<PathBuf>) -> Self {
        self.config.mmap_path = Some(path.into());
        self
    }

    /// Checks the configuration and returns it, or `Error::InvalidConfig` naming the
    /// contradiction.
    #[track_caller]
    pub fn build(self) -> Result<WorkspaceConfig> {
        let ctx = Ctx::new("WorkspaceConfig::build");
        let c = self.config;
        if !(c.overallocation_limit.is_finite() && c.overallocation_limit >= 0.0) {
            return Err(ctx.config(format!(
                "overallocation_limit must be a finite number >= 0, got {}",
                c.overallocation_limit
            )));
        }
        if c.max_size > 0 && c.min_size > c.max_size {
            return Err(ctx.config(format!(
                "min_size {} is larger than max_size {}",
                c.min_size, c.max_size
            )));
        }
        if c.max_size > 0 && c.initial_size > c.max_size {
            return Err(ctx.config(format!(
                "initial_size {} is larger than max_size {}",
                c.initial_size, c.max_size
            )));
        }
        match c.learning {
            LearningPolicy::OverTime if c.cycles_before_initialization == 0 => {
                return Err(ctx.config(
                    "LearningPolicy::OverTime with cycles_before_initialization 0 would never learn \
                     (ND4J silently never sizes such a workspace); set it to at least 1",
                ))
            }
            LearningPolicy::FirstLoop | LearningPolicy::None
                if c.cycles_before_initialization > 0 =>
            {
                return Err(ctx.config(format!(
                    "cycles_before_initialization {} is only used by LearningPolicy::OverTime, not {:?}",
                    c.cycles_before_initialization, c.learning
                )))
            }
            LearningPolicy::None if c.initial_size == 0 && c.spill != SpillPolicy::Reallocate => {
                return Err(ctx.config(format!(
                    "LearningPolicy::None with initial_size 0 and SpillPolicy::{:?} has nothing to \
                     allocate from: every allocation would {}; set initial_size or learn",
                    c.spill,
                    if c.spill == SpillPolicy::Fail { "fail" } else { "spill" }
                )))
            }
            _ => {}
        }
        if c.location == LocationPolicy::Mmap {
            if c.learning != LearningPolicy::None {
                return Err(ctx.config(format!(
                    "LocationPolicy::Mmap needs LearningPolicy::None (the file is sized once), not {:?}",
                    c.learning
                )));
            }
            if c.initial_size == 0 {
                return Err(ctx.config("LocationPolicy::Mmap needs initial_size > 0"));
            }
            if c.spill == SpillPolicy::Reallocate {
                return Err(ctx.config(
                    "LocationPolicy::Mmap cannot use SpillPolicy::Reallocate: the mapped file is not resized",
                ));
            }
        } else if c.mmap_path.is_some() {
            return Err(ctx.config("mmap_path is set but the location policy is Ram"));
        }
        Ok(c)
    }
}
