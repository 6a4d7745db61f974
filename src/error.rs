//! [`Error`] and [`Result`].
//!
//! Every error says what failed (the operation), where (the caller's file:line, and the manager,
//! array or workspace involved) and why.

use std::fmt;
use std::panic::Location;
use std::path::PathBuf;

use crate::{DType, Device};

/// `std::result::Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The source file location of a call, as `file:line:column`.
pub type Site = &'static Location<'static>;

/// Where a memory limit came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// No limit is set: the system allocator itself refused.
    None,
    /// The CUDA driver refused: the device's memory is exhausted.
    Driver,
    /// The environment variable of this name (`NDSCOPE_MAX_HOST_BYTES`, `NDSCOPE_MAX_CUDA_BYTES`).
    Env(&'static str),
    /// A call to [`crate::set_memory_limit`].
    Api,
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::None => f.write_str("no limit set; the system allocator refused"),
            LimitSource::Driver => {
                f.write_str("the CUDA driver refused: the device's memory is exhausted")
            }
            LimitSource::Env(var) => write!(f, "limit {var}"),
            LimitSource::Api => f.write_str("limit set by ndscope::set_memory_limit"),
        }
    }
}

/// Everything that can go wrong. Each variant's message names the operation, the caller's
/// location and the objects involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The array was closed: by the user, by its manager closing, by its workspace cycle ending,
    /// or by a circular workspace writing over it.
    #[error("{op} at {at}: array {array} (created at {created_at}) is closed: {reason}")]
    ArrayClosed {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The array: its name if set, else its id.
        array: String,
        /// Where the array was created.
        created_at: Site,
        /// Why it is closed.
        reason: String,
    },

    /// The manager is closed.
    #[error("{op} at {at}: manager {manager} is closed")]
    ManagerClosed {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The manager, as `'name' (m12)`.
        manager: String,
    },

    /// The manager is capped and refuses new arrays. Nothing was allocated.
    #[error("{op} at {at}: manager {manager} is capped and accepts no new arrays; {what}")]
    Capped {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The manager, as `'name' (m12)`.
        manager: String,
        /// What would have landed there.
        what: String,
    },

    /// The operation is not allowed on the system manager.
    #[error("{op} at {at}: not allowed on the system manager ({reason})")]
    SystemManager {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// Why.
        reason: &'static str,
    },

    /// Shapes do not fit together.
    #[error("{op} at {at}: shape mismatch: {reason}")]
    ShapeMismatch {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The offending shapes and what was expected.
        reason: String,
    },

    /// The element type is not the one required.
    #[error("{op} at {at}: dtype mismatch: {reason}")]
    DTypeMismatch {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The dtype found.
        found: DType,
        /// What was expected.
        reason: String,
    },

    /// Arrays are on different devices.
    #[error("{op} at {at}: device mismatch: {reason}")]
    DeviceMismatch {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The devices involved.
        reason: String,
    },

    /// An argument is out of range or otherwise invalid.
    #[error("{op} at {at}: invalid argument: {reason}")]
    InvalidArgument {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// What is wrong.
        reason: String,
    },

    /// The allocation would exceed the device's memory limit, or the system allocator refused.
    /// Nothing was changed.
    #[error(
        "{op} at {at}: cannot allocate {} on {device}: {} of {} in use ({limit_source})",
        fmt_bytes(*requested),
        fmt_bytes(*in_use),
        limit.map_or_else(|| "unlimited".to_string(), fmt_bytes)
    )]
    OutOfMemory {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The device.
        device: Device,
        /// Bytes asked for.
        requested: usize,
        /// Bytes in use on the device when it was refused.
        in_use: usize,
        /// The limit in bytes, if one is set.
        limit: Option<usize>,
        /// Where the limit came from.
        limit_source: LimitSource,
    },

    /// A workspace with `SpillPolicy::Fail` has no room; the workspace is unchanged.
    #[error(
        "{op} at {at}: workspace '{workspace}' is full: {} requested, {} of {} used (spill policy Fail)",
        fmt_bytes(*requested),
        fmt_bytes(*used),
        fmt_bytes(*capacity)
    )]
    WorkspaceFull {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The workspace's name.
        workspace: String,
        /// Bytes asked for (rounded to the workspace alignment).
        requested: usize,
        /// Bytes in use in the block.
        used: usize,
        /// The block's capacity.
        capacity: usize,
    },

    /// A workspace cycle is already open.
    #[error(
        "{op} at {at}: workspace '{workspace}' already has an open cycle ({cycle}); close it first"
    )]
    WorkspaceBusy {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The workspace's name.
        workspace: String,
        /// The open cycle's manager.
        cycle: String,
    },

    /// A configuration is contradictory or conflicts with an existing one.
    #[error("{op} at {at}: invalid configuration: {reason}")]
    InvalidConfig {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// What is contradictory.
        reason: String,
    },

    /// The device is not present or not supported by this build.
    #[error("{op} at {at}: device {device} is unavailable: {reason}")]
    DeviceUnavailable {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The device asked for.
        device: Device,
        /// Why it is unavailable.
        reason: String,
    },

    /// The operation is not supported for these arguments.
    #[error("{op} at {at}: unsupported: {reason}")]
    Unsupported {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// What is not supported.
        reason: String,
    },

    /// A device driver or library failed.
    #[error("{op} at {at}: backend error: {reason}")]
    Backend {
        /// The operation that failed.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The driver's message.
        reason: String,
    },

    /// A file operation failed (memory-mapped workspaces, saved parameters). A file that is
    /// not valid safetensors (truncated, corrupt header, offsets outside the data) is reported
    /// here too, with `source.kind()` `InvalidData`.
    #[error("{op} at {at}: I/O error on {}: {source}", path.display())]
    Io {
        /// The operation that failed.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// User code run by ndscope (a predictor's step, a prefetch producer) panicked. The panic
    /// was caught where it happened and its memory freed; the message is the panic's.
    #[error("{op} at {at}: {during} panicked: {message}")]
    Panicked {
        /// The operation that ran the code.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// What was running, e.g. `the step of predictor 'worker-0' (m12)`.
        during: String,
        /// The panic message (`"<non-string panic payload>"` when it is not text).
        message: String,
    },

    /// A data-parallel training step failed on one of its devices: the step closure's error, a
    /// panic (as `Panicked`), or the device's own, with the device and rank named. No replica was
    /// updated by that step unless `after_all_reduce` says its gradients were already exchanged
    /// (then the trainer's communicators were aborted and it refuses further steps).
    #[error("{op} at {at}: step {step} failed on {device} (rank {rank}{}): {source}",
        if *after_all_reduce { ", after the all-reduce was queued" } else { "" })]
    ReplicaFailed {
        /// The operation that failed.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The device whose replica failed.
        device: crate::Device,
        /// Its rank (its place in the trainer's device list).
        rank: usize,
        /// The step's number (from 0).
        step: u64,
        /// Whether the failure came after the gradients' all-reduce was queued.
        after_all_reduce: bool,
        /// What went wrong there.
        #[source]
        source: Box<Error>,
    },

    /// Something ndscope waited for did not happen within the time the user allowed: a
    /// data-parallel rank that stopped answering (its step closure did not return, or a
    /// collective waited for a rank that never came). What was waited for was then abandoned
    /// (a communicator aborted), never left running against changed memory.
    #[error("{op} at {at}: {what} did not finish within {:.1} s ({why})", waited.as_secs_f64())]
    TimedOut {
        /// The operation that waited.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// What did not finish, e.g. `the step closure of rank 1 (cuda:1)`.
        what: String,
        /// How long it was waited for: the configured timeout.
        waited: std::time::Duration,
        /// Where the timeout comes from and what was done about it.
        why: String,
    },

    /// A service (parallel inference, a prefetching iterator) is shut down or shutting down and
    /// refuses the request; nothing of it ran.
    #[error("{op} at {at}: {service} is shut down: {reason}")]
    ShutDown {
        /// The operation that was refused.
        op: &'static str,
        /// Where it was called.
        at: Site,
        /// The service, e.g. `parallel inference 'mlp'`.
        service: String,
        /// Why the request was refused.
        reason: String,
    },
}

/// The text of a caught panic's payload.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}

/// The text of a caught panic's payload, and the payload dropped where its own `Drop` cannot
/// unwind into the caller: a payload whose `Drop` panics (a second panic, after the
/// `catch_unwind` that caught the first) is caught again, and that second payload is leaked
/// rather than dropped. Every `catch_unwind` of ndscope ends its payload here.
pub(crate) fn take_panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    let message = panic_message(&*payload);
    drop_panic_payload(payload);
    message
}

/// Drops a caught panic payload without letting a panic in its `Drop` escape (the payload of
/// that second panic is leaked: its `Drop` might panic as well).
pub(crate) fn drop_panic_payload(payload: Box<dyn std::any::Any + Send>) {
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(payload)));
    if let Err(again) = dropped {
        std::mem::forget(again);
    }
}

/// Formats a byte count as `512 B`, `1.50 KiB`, `4.00 MiB`, `7.99 GiB`.
pub fn fmt_bytes(bytes: usize) -> String {
    Bytes(bytes).to_string()
}

/// Displays a byte count as [`fmt_bytes`] does, without allocating.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bytes(pub usize);

impl fmt::Display for Bytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
        let bytes = self.0;
        if bytes < 1024 {
            return write!(f, "{bytes} B");
        }
        let mut value = bytes as f64 / 1024.0;
        let mut unit = 0;
        while value >= 1024.0 && unit + 1 < UNITS.len() {
            value /= 1024.0;
            unit += 1;
        }
        write!(f, "{value:.2} {}", UNITS[unit])
    }
}

/// The operation name and caller location every internal function carries, so errors can say
/// what and where.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ctx {
    pub op: &'static str,
    pub at: Site,
}

impl Ctx {
    /// A context for `op`, located at the caller of the `#[track_caller]` chain.
    #[track_caller]
    #[inline]
    pub fn new(op: &'static str) -> Ctx {
        Ctx {
            op,
            at: Location::caller(),
        }
    }

    pub fn shape(&self, reason: impl Into<String>) -> Error {
        Error::ShapeMismatch {
            op: self.op,
            at: self.at,
            reason: reason.into(),
        }
    }

    pub fn dtype(&self, found: DType, reason: impl Into<String>) -> Error {
        Error::DTypeMismatch {
            op: self.op,
            at: self.at,
            found,
            reason: reason.into(),
        }
    }

    pub fn invalid(&self, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            op: self.op,
            at: self.at,
            reason: reason.into(),
        }
    }

    pub fn unsupported(&self, reason: impl Into<String>) -> Error {
        Error::Unsupported {
            op: self.op,
            at: self.at,
            reason: reason.into(),
        }
    }

    pub fn config(&self, reason: impl Into<String>) -> Error {
        Error::InvalidConfig {
            op: self.op,
            at: self.at,
            reason: reason.into(),
        }
    }

    pub fn device_mismatch(&self, reason: impl Into<String>) -> Error {
        Error::DeviceMismatch {
            op: self.op,
            at: self.at,
            reason: reason.into(),
        }
    }

    pub fn system(&self, reason: &'static str) -> Error {
        Error::SystemManager {
            op: self.op,
            at: self.at,
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human_readable() {
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(4 << 20), "4.00 MiB");
        assert_eq!(fmt_bytes((8usize << 30) - (10 << 20)), "7.99 GiB");
    }

    #[test]
    fn out_of_memory_message_has_the_documented_form() {
        let e = Error::OutOfMemory {
            op: "zeros",
            at: Location::caller(),
            device: Device::Cpu,
            requested: 4 << 20,
            in_use: (8usize << 30) - (10 << 20),
            limit: Some(8 << 30),
            limit_source: LimitSource::Env("NDSCOPE_MAX_HOST_BYTES"),
        };
        let text = e.to_string();
        assert!(
            text.ends_with(
                "cannot allocate 4.00 MiB on cpu: 7.99 GiB of 8.00 GiB in use (limit NDSCOPE_MAX_HOST_BYTES)"
            ),
            "{text}"
        );
    }
}
