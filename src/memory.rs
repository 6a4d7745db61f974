//! Per-device memory accounting and limits (ND4J's `maxbytes`), process-wide.
//!
//! Every byte ndscope takes from a device is reserved here first: array buffers, workspace blocks
//! and spills. A reservation that would pass the limit fails with [`Error::OutOfMemory`] before
//! anything is allocated.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::LazyLock;

use crate::error::{Ctx, LimitSource};
use crate::observe::{self, Event};
use crate::{Device, Error, Result};

/// CUDA ordinals with their own counters; larger ordinals cannot be created.
pub(crate) const MAX_CUDA_DEVICES: usize = 64;

const NO_LIMIT: usize = usize::MAX;
const SOURCE_NONE: u8 = 0;
const SOURCE_ENV: u8 = 1;
const SOURCE_API: u8 = 2;
/// The environment variable is set to something that is not a byte count: every allocation on
/// the device fails with `InvalidConfig` naming it, until [`set_memory_limit`] replaces it.
const SOURCE_BAD_ENV: u8 = 3;

/// A memory-limit variable as read from the environment.
#[derive(Clone)]
enum EnvLimit {
    Unset,
    Bytes(usize),
    /// Set, but not to a byte count: its text.
    Bad(String),
}

/// Reads `env_var` once (at the first use of the device's counters) and, when its value is not
/// a byte count, says so on stderr and in the log.
fn env_limit(env_var: &'static str) -> EnvLimit {
    let text = match std::env::var(env_var) {
        Ok(text) => text,
        Err(std::env::VarError::NotPresent) => return EnvLimit::Unset,
        Err(std::env::VarError::NotUnicode(raw)) => raw.to_string_lossy().into_owned(),
    };
    // Set to nothing is unset (as `VAR= cmd` reads); a zero limit is an explicit `0`.
    if text.trim().is_empty() {
        return EnvLimit::Unset;
    }
    match parse_bytes(&text) {
        Some(bytes) => EnvLimit::Bytes(bytes),
        None => {
            let message = bad_env_message(env_var, &text);
            eprintln!("ndscope: {message}");
            tracing::error!(target: "ndscope::memory", "{message}");
            EnvLimit::Bad(text)
        }
    }
}

fn bad_env_message(env_var: &str, text: &str) -> String {
    format!(
        "{env_var}={text:?} is not a byte count: expected a whole number of bytes (0 for none at \
         all) or a number with a unit K, M, G or T (binary multiples, optionally followed by B or \
         iB), such as 1073741824, 512M, 8G or 1.5GiB; every allocation it limits fails with \
         InvalidConfig until it is fixed or set_memory_limit replaces it"
    )
}

/// A device's memory figures, from [`memory_usage`]: what is in use now, and counters like
/// PyTorch's `torch.cuda.memory_stats` (accumulated since the process started or since
/// [`reset_memory_stats`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DeviceUsage {
    /// Bytes currently reserved: live array buffers, workspace blocks and spills.
    pub in_use: usize,
    /// The largest `in_use` seen since the process started (or since [`reset_peak`] or
    /// [`reset_memory_stats`]).
    pub peak: usize,
    /// The limit, if one is set.
    pub limit: Option<usize>,
    /// Open arrays on the device.
    pub arrays: usize,
    /// Times ndscope asked the system allocator (host) or the driver (CUDA) for memory since
    /// the process started: array buffers, workspace blocks, spills and page-locked staging.
    /// A learned workspace cycle makes none, so this stays put across steady-state steps.
    /// [`reset_memory_stats`] leaves it alone, so differences taken across a reset stay right.
    pub driver_allocations: u64,
    /// Arrays created on the device (`allocation.all.allocated` in PyTorch's terms), in a
    /// workspace block or not.
    pub allocations: u64,
    /// Arrays freed on the device (closed by any means).
    pub frees: u64,
    /// Bytes of the arrays counted by `allocations` (`allocated_bytes.all.allocated`).
    pub allocated_bytes: u64,
    /// Bytes of the arrays counted by `frees` (`allocated_bytes.all.freed`).
    pub freed_bytes: u64,
    /// Workspace allocations that did not fit the block and got their own buffer.
    pub spills: u64,
    /// Workspace blocks replaced by a larger one (`SpillPolicy::Reallocate`).
    pub reallocations: u64,
    /// Allocations refused with [`Error::OutOfMemory`] (`num_ooms`).
    pub ooms: u64,
    /// Bytes the backend holds for reuse that no array uses, apart from `in_use` (PyTorch's
    /// reserved minus allocated): on a CUDA device the cache of freed array memory, the
    /// reduction scratch, the page-locked staging buffers, cuBLAS's workspace and memory the
    /// driver's pool keeps; and the device memory of the live NCCL communicators on the device
    /// (a [`ParallelTrainer`](crate::ParallelTrainer)'s, one per device: NCCL's channel
    /// buffers and the like, measured as the device's memory grew while NCCL set them up, see
    /// `ndscope::cuda::communicator_bytes`), until they are destroyed or aborted. 0 on the CPU.
    /// `ndscope::cuda::release_cached` gives back all but the communicators' memory, which
    /// goes back when the trainer is closed.
    pub cached: usize,
}

/// The accumulated counters come in pairs: a total that only grows, and its value at the last
/// [`reset_memory_stats`]. Live arrays are `opened - closed`. The four array counters are written
/// only under the arena lock, with plain loads and stores: creating and freeing an array costs
/// no locked instruction for them.
pub(crate) struct Counters {
    in_use: AtomicUsize,
    peak: AtomicUsize,
    opened: AtomicU64,
    closed: AtomicU64,
    opened_bytes: AtomicU64,
    closed_bytes: AtomicU64,
    spills: AtomicU64,
    reallocations: AtomicU64,
    ooms: AtomicU64,
    /// The totals above at the last reset, in the same order.
    at_reset: [AtomicU64; 7],
    driver_allocations: AtomicU64,
    /// Bytes of the backend's caches (see [`DeviceUsage::cached`]), without the driver pool's.
    cached: AtomicUsize,
    /// Bytes of device memory the live NCCL communicators on the device hold (see
    /// [`DeviceUsage::cached`]).
    communicators: AtomicUsize,
    limit: AtomicUsize,
    source: AtomicU8,
    env_var: &'static str,
    /// The variable's text when it is not a byte count (`SOURCE_BAD_ENV`).
    bad_env: Option<String>,
}

impl Counters {
    fn new(env_var: &'static str, env: EnvLimit) -> Counters {
        // A bad value refuses every allocation: a limit of 0 sends each one to the refusal,
        // which then reports the variable rather than a lack of memory.
        let (limit, source, bad_env) = match env {
            EnvLimit::Bytes(bytes) => (bytes, SOURCE_ENV, None),
            EnvLimit::Bad(text) => (0, SOURCE_BAD_ENV, Some(text)),
            EnvLimit::Unset => (NO_LIMIT, SOURCE_NONE, None),
        };
        Counters {
            in_use: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            opened: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            opened_bytes: AtomicU64::new(0),
            closed_bytes: AtomicU64::new(0),
            spills: AtomicU64::new(0),
            reallocations: AtomicU64::new(0),
            ooms: AtomicU64::new(0),
            at_reset: Default::default(),
            driver_allocations: AtomicU64::new(0),
            cached: AtomicUsize::new(0),
            communicators: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
            source: AtomicU8::new(source),
            env_var,
            bad_env,
        }
    }

    fn limit(&self) -> Option<usize> {
        if self.source.load(Ordering::Relaxed) == SOURCE_BAD_ENV {
            return None;
        }
        match self.limit.load(Ordering::Relaxed) {
            NO_LIMIT => None,
            limit => Some(limit),
        }
    }

    /// `InvalidConfig` naming the variable, while it holds a value that is not a byte count.
    fn bad_env_error(&self, ctx: &Ctx) -> Option<Error> {
        if self.source.load(Ordering::Relaxed) != SOURCE_BAD_ENV {
            return None;
        }
        let text = self.bad_env.as_deref().unwrap_or_default();
        Some(ctx.config(bad_env_message(self.env_var, text)))
    }

    /// The accumulated totals, in the order of `at_reset`.
    fn totals(&self) -> [u64; 7] {
        [
            &self.opened,
            &self.closed,
            &self.opened_bytes,
            &self.closed_bytes,
            &self.spills,
            &self.reallocations,
            &self.ooms,
        ]
        .map(|c| c.load(Ordering::Relaxed))
    }

    fn source(&self) -> LimitSource {
        match self.source.load(Ordering::Relaxed) {
            SOURCE_ENV => LimitSource::Env(self.env_var),
            SOURCE_API => LimitSource::Api,
            _ => LimitSource::None,
        }
    }
}

static CPU: LazyLock<Counters> = LazyLock::new(|| {
    const VAR: &str = "NDSCOPE_MAX_HOST_BYTES";
    Counters::new(VAR, env_limit(VAR))
});
static CUDA: LazyLock<Vec<Counters>> = LazyLock::new(|| {
    const VAR: &str = "NDSCOPE_MAX_CUDA_BYTES";
    let env = env_limit(VAR);
    (0..MAX_CUDA_DEVICES)
        .map(|_| Counters::new(VAR, env.clone()))
        .collect()
});

fn counters(device: Device) -> Option<&'static Counters> {
    match device {
        Device::Cpu => Some(&CPU),
        Device::Cuda(ordinal) => CUDA.get(ordinal),
    }
}

/// Reserves `bytes` on `device`, or fails with `OutOfMemory` and reserves nothing.
pub(crate) fn reserve(ctx: &Ctx, device: Device, bytes: usize) -> Result<()> {
    let Some(c) = counters(device) else {
        return Err(ctx.unavailable(device));
    };
    let limit = c.limit.load(Ordering::Relaxed);
    let mut current = c.in_use.load(Ordering::Relaxed);
    loop {
        let next = match current.checked_add(bytes) {
            Some(next) if next <= limit => next,
            _ => {
                if let Some(error) = c.bad_env_error(ctx) {
                    return Err(error);
                }
                return Err(out_of_memory(
                    ctx,
                    Some(c),
                    device,
                    bytes,
                    current,
                    c.source(),
                ));
            }
        };
        match c
            .in_use
            .compare_exchange_weak(current, next, Ordering::Relaxed, Ordering::Relaxed)
        {
            Ok(_) => {
                c.peak.fetch_max(next, Ordering::Relaxed);
                return Ok(());
            }
            Err(actual) => current = actual,
        }
    }
}

/// Gives back a reservation made by [`reserve`].
pub(crate) fn release(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        c.in_use.fetch_sub(bytes, Ordering::Relaxed);
    }
}

/// The error for a refusal by the system allocator itself (no limit involved).
pub(crate) fn system_refused(ctx: &Ctx, device: Device, bytes: usize) -> Error {
    refused(ctx, device, bytes, LimitSource::None)
}

/// The error for a refusal by the CUDA driver (device memory exhausted).
// Used by the CUDA backend only.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn driver_refused(ctx: &Ctx, device: Device, bytes: usize) -> Error {
    refused(ctx, device, bytes, LimitSource::Driver)
}

fn refused(ctx: &Ctx, device: Device, bytes: usize, limit_source: LimitSource) -> Error {
    let c = counters(device);
    let in_use = c.map_or(0, |c| c.in_use.load(Ordering::Relaxed));
    out_of_memory(ctx, c, device, bytes, in_use, limit_source)
}

/// Every `OutOfMemory` refusal is built here: it is counted, logged and recorded.
#[cold]
fn out_of_memory(
    ctx: &Ctx,
    c: Option<&Counters>,
    device: Device,
    requested: usize,
    in_use: usize,
    limit_source: LimitSource,
) -> Error {
    if let Some(c) = c {
        c.ooms.fetch_add(1, Ordering::Relaxed);
    }
    let limit = c.and_then(Counters::limit);
    let error = Error::OutOfMemory {
        op: ctx.op,
        at: ctx.at,
        device,
        requested,
        in_use,
        limit,
        limit_source,
    };
    tracing::warn!(target: "ndscope::memory", %device, requested, in_use, "{error}");
    if observe::on() {
        observe::emit(Event::OutOfMemory {
            site: ctx.at,
            op: ctx.op,
            device,
            requested,
            in_use,
            limit,
        });
    }
    error
}

/// Counts one allocation from the system allocator or the driver on `device`.
pub(crate) fn driver_allocated(device: Device) {
    if let Some(c) = counters(device) {
        c.driver_allocations.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts `bytes` more held by a backend cache of `device` (memory no array uses).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cache_held(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        c.cached.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Counts `bytes` no longer held by a backend cache of `device` (reused or given back).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn cache_dropped(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        take_back(&c.cached, bytes);
    }
}

/// Subtracts `bytes` from `counter`, never below 0.
fn take_back(counter: &AtomicUsize, bytes: usize) {
    let _ = counter.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
        Some(v.saturating_sub(bytes))
    });
}

/// Counts `bytes` more of device memory held by the live NCCL communicators on `device`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn communicators_hold(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        c.communicators.fetch_add(bytes, Ordering::Relaxed);
    }
}

/// Counts `bytes` of a communicator's device memory on `device` given back (it was destroyed or
/// aborted).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn communicators_released(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        take_back(&c.communicators, bytes);
    }
}

/// What ndscope holds on `device` from its allocator, the NCCL communicators' memory apart:
/// [`memory_usage`]'s `in_use` and `cached` without the communicators' bytes (reservations,
/// the backend's caches and what the driver's pool keeps after frees).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn held(device: Device) -> usize {
    let Some(c) = counters(device) else {
        return 0;
    };
    c.in_use
        .load(Ordering::Relaxed)
        .saturating_add(backend_cached(c, device))
}

/// The backend's caches on `device` and what its driver's pool keeps, the communicators apart.
fn backend_cached(c: &Counters, device: Device) -> usize {
    c.cached
        .load(Ordering::Relaxed)
        .saturating_add(POOL_PROBE.get().map_or(0, |probe| probe(device)))
}

/// Bytes of device memory the live NCCL communicators on `device` hold (0 on the CPU).
pub(crate) fn communicator_bytes(device: Device) -> usize {
    counters(device).map_or(0, |c| c.communicators.load(Ordering::Relaxed))
}

/// What a backend reports of the memory its driver keeps for reuse beyond ndscope's own caches
/// (a CUDA memory pool's reserved minus used bytes), per device; registered by the backend when
/// it sets a device up, so this layer needs no knowledge of it.
static POOL_PROBE: std::sync::OnceLock<fn(Device) -> usize> = std::sync::OnceLock::new();

/// Registers the backend's [`POOL_PROBE`] (once; later calls change nothing).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn set_pool_probe(probe: fn(Device) -> usize) {
    let _ = POOL_PROBE.set(probe);
}

/// Adds `n` to a counter that only the holder of the arena lock writes: a plain load and store
/// (no locked read-modify-write), since the lock already orders the writers. Readers load it
/// without the lock and see some recent value, as with any relaxed counter.
fn bump_locked(counter: &AtomicU64, n: u64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(n),
        Ordering::Relaxed,
    );
}

/// Counts an array created on `device`. Called by `State::insert_array`, under the arena lock.
pub(crate) fn array_opened(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        bump_locked(&c.opened, 1);
        bump_locked(&c.opened_bytes, bytes as u64);
    }
}

/// Counts an array freed on `device`. Called by `State::remove_array`, under the arena lock.
pub(crate) fn array_closed(device: Device, bytes: usize) {
    if let Some(c) = counters(device) {
        bump_locked(&c.closed, 1);
        bump_locked(&c.closed_bytes, bytes as u64);
    }
}

/// Counts one workspace allocation that spilled on `device`.
pub(crate) fn spilled(device: Device) {
    if let Some(c) = counters(device) {
        c.spills.fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts one workspace block replaced by a larger one on `device`.
pub(crate) fn reallocated(device: Device) {
    if let Some(c) = counters(device) {
        c.reallocations.fetch_add(1, Ordering::Relaxed);
    }
}

/// Bytes in use on `device` now.
pub(crate) fn in_use(device: Device) -> usize {
    counters(device).map_or(0, |c| c.in_use.load(Ordering::Relaxed))
}

/// Sets (or with `None` removes) the memory limit of `device`, in bytes. Overrides
/// `NDSCOPE_MAX_HOST_BYTES` / `NDSCOPE_MAX_CUDA_BYTES`. A limit below the bytes already in use
/// refuses every new allocation until enough is freed; nothing already allocated is touched.
/// CUDA ordinals of 64 and above cannot exist here and are ignored.
///
/// ```
/// use ndscope::{memory_limit, set_memory_limit, Device};
/// set_memory_limit(Device::Cuda(3), Some(1 << 30));
/// assert_eq!(memory_limit(Device::Cuda(3)), Some(1 << 30));
/// set_memory_limit(Device::Cuda(3), None);
/// assert_eq!(memory_limit(Device::Cuda(3)), None);
/// ```
pub fn set_memory_limit(device: Device, limit: Option<usize>) {
    if let Some(c) = counters(device) {
        c.limit.store(limit.unwrap_or(NO_LIMIT), Ordering::Relaxed);
        let source = if limit.is_some() {
            SOURCE_API
        } else {
            SOURCE_NONE
        };
        c.source.store(source, Ordering::Relaxed);
    }
}

/// The memory limit of `device`, if one is set.
pub fn memory_limit(device: Device) -> Option<usize> {
    counters(device).and_then(Counters::limit)
}

/// The memory figures of `device`.
///
/// ```
/// use ndscope::{memory_usage, Device, DType, Manager};
/// let m = Manager::new_base();
/// let a = m.zeros([256], DType::F32)?;
/// assert!(memory_usage(Device::Cpu).in_use >= 1024);
/// m.close()?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub fn memory_usage(device: Device) -> DeviceUsage {
    let Some(c) = counters(device) else {
        return DeviceUsage::default();
    };
    let total = c.totals();
    let base = c.at_reset.each_ref().map(|b| b.load(Ordering::Relaxed));
    let since = |i: usize| total[i].saturating_sub(base[i]);
    DeviceUsage {
        in_use: c.in_use.load(Ordering::Relaxed),
        peak: c.peak.load(Ordering::Relaxed),
        limit: c.limit(),
        arrays: total[0].saturating_sub(total[1]) as usize,
        driver_allocations: c.driver_allocations.load(Ordering::Relaxed),
        allocations: since(0),
        frees: since(1),
        allocated_bytes: since(2),
        freed_bytes: since(3),
        spills: since(4),
        reallocations: since(5),
        ooms: since(6),
        cached: backend_cached(c, device).saturating_add(c.communicators.load(Ordering::Relaxed)),
    }
}

/// Resets the accumulated counters of `device` (`allocations`, `frees`, `allocated_bytes`,
/// `freed_bytes`, `spills`, `reallocations`, `ooms`) to zero and its peak to the bytes in use
/// now, like PyTorch's `reset_accumulated_memory_stats` and `reset_peak_memory_stats` together.
/// `in_use`, `arrays`, `limit` and `driver_allocations` are left alone.
///
/// ```
/// use ndscope::{memory_usage, reset_memory_stats, DType, Device, Manager};
/// let m = Manager::new_base();
/// m.zeros([8], DType::F32)?;
/// reset_memory_stats(Device::Cuda(7));        // another device: the CPU's counters stay
/// assert!(memory_usage(Device::Cpu).allocations >= 1);
/// m.close()?;
/// # Ok::<(), ndscope::Error>(())
/// ```
pub fn reset_memory_stats(device: Device) {
    if let Some(c) = counters(device) {
        for (base, total) in c.at_reset.iter().zip(c.totals()) {
            base.store(total, Ordering::Relaxed);
        }
        reset_peak(device);
    }
}

/// Resets the peak of `device` to the bytes in use now, so a phase's peak can be measured.
pub fn reset_peak(device: Device) {
    if let Some(c) = counters(device) {
        c.peak
            .store(c.in_use.load(Ordering::Relaxed), Ordering::Relaxed);
    }
}

/// Parses a byte count: a whole number of bytes (`1073741824`, `0`), or a number with a unit
/// `K`, `M`, `G` or `T` (binary multiples, any case, optionally followed by `B` or `iB`: `8G`,
/// `512m`, `64KiB`), where the number may have a fraction if the bytes come out whole (`1.5G`).
/// Spaces around are ignored. Anything else is `None`: signs, exponents, a fraction of a byte
/// (`0.5`, `1e-9`, `-0`), an empty value.
pub(crate) fn parse_bytes(text: &str) -> Option<usize> {
    let text = text.trim();
    let lower = text.to_ascii_lowercase();
    let (number, shift) = match lower.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        None => (lower.as_str(), 0),
        Some(at) => {
            let shift = match &lower[at..] {
                "b" => 0,
                "k" | "kb" | "kib" => 10,
                "m" | "mb" | "mib" => 20,
                "g" | "gb" | "gib" => 30,
                "t" | "tb" | "tib" => 40,
                _ => return None,
            };
            (&lower[..at], shift)
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() || (number.contains('.') && (shift == 0 || fraction.is_empty())) {
        return None;
    }
    // value = (whole · 10^f + fraction) · 2^shift / 10^f, which must be a whole number.
    let scale = 10u128.checked_pow(u32::try_from(fraction.len()).ok()?)?;
    let digits: u128 = format!("{whole}{fraction}").parse().ok()?;
    let scaled = digits.checked_mul(1u128 << shift)?;
    if scaled % scale != 0 {
        return None;
    }
    usize::try_from(scaled / scale).ok()
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse_like_the_documentation_says() {
        assert_eq!(parse_bytes("8G"), Some(8 << 30));
        assert_eq!(parse_bytes("512M"), Some(512 << 20));
        assert_eq!(parse_bytes("64k"), Some(64 << 10));
        assert_eq!(parse_bytes("64KiB"), Some(64 << 10));
        assert_eq!(parse_bytes("1.5GiB"), Some(3 << 29));
        assert_eq!(parse_bytes("1.5g"), Some(3 << 29));
        assert_eq!(parse_bytes(" 1048576 "), Some(1 << 20));
        assert_eq!(parse_bytes("1073741824"), Some(1 << 30));
        assert_eq!(parse_bytes("100B"), Some(100));
        assert_eq!(parse_bytes("12MB"), Some(12 << 20));
        assert_eq!(parse_bytes("0"), Some(0), "a zero limit is an explicit 0");
        assert_eq!(parse_bytes("0K"), Some(0));
        assert_eq!(parse_bytes("1T"), Some(1 << 40));
    }

    #[test]
    fn anything_else_is_not_a_byte_count() {
        for bad in [
            "",
            " ",
            "G",
            "lots",
            "-1G",
            "-0",
            "+5",
            "0.5",
            "1e-9",
            "1e9",
            ".5G",
            "5.G",
            "1.5",
            "0.0000001K",
            "1.2.3G",
            "8 G",
            "8GG",
            "8Gi",
            "8P",
            "NaN",
            "inf",
            "0x10",
            "99999999999999999999999",
            "20000000000T",
        ] {
            assert_eq!(parse_bytes(bad), None, "{bad:?}");
        }
    }
}
