//! Leak checks for tests.
//!
//! ```
//! use ndscope::{testing::assert_no_growth, DType, Manager};
//! let trainer = Manager::new_base();
//! let w = trainer.ones([4], DType::F32)?;
//! assert_no_growth(&trainer, 2, 5, |_step| {
//!     trainer.scope(|batch| {
//!         let x = batch.ones([4], DType::F32)?;
//!         let _y = w.mul(&x)?;          // lands in `batch` (the active scope): no leak
//!         Ok(())
//!     })
//! });
//! # Ok::<(), ndscope::Error>(())
//! ```

use crate::report::Growth;
use crate::{Manager, Result};

/// Runs `step(0..warmup)`, takes a report of `manager`, runs `step(warmup..warmup + iters)`,
/// and returns what grew in `manager`'s subtree meanwhile. Stops at the first failing step.
pub fn measure_growth(
    manager: &Manager,
    warmup: usize,
    iters: usize,
    mut step: impl FnMut(usize) -> Result<()>,
) -> Result<Growth> {
    for i in 0..warmup {
        step(i)?;
    }
    let before = manager.report();
    for i in warmup..warmup + iters {
        step(i)?;
    }
    Ok(manager.report().diff(&before))
}

/// Panics (this is a test assertion) with the [`Growth`] report when `step` leaks arrays or
/// managers into `manager`'s subtree: after `warmup` steps, `iters` more steps must leave every
/// creation site's live count and bytes where they were. Also panics if a step fails.
///
/// To catch a leak at the line that causes it instead, `cap()` the long-lived manager: the
/// offending op then fails with `Error::Capped`.
#[track_caller]
pub fn assert_no_growth(
    manager: &Manager,
    warmup: usize,
    iters: usize,
    step: impl FnMut(usize) -> Result<()>,
) {
    match measure_growth(manager, warmup, iters, step) {
        Ok(growth) if growth.is_empty() => {}
        Ok(growth) => panic!(
            "memory grew in manager '{}' over {iters} steps after {warmup} warm-up steps:\n{growth}",
            manager.name()
        ),
        Err(e) => panic!("a step failed while checking for growth: {e}"),
    }
}
