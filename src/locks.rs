//! The lock order, checked. Every lock that may be held while another is taken has a [`Rank`];
//! a thread takes locks in increasing rank, and several data locks in increasing address. Debug
//! builds check it: each blocking acquisition goes through [`acquire`], which panics (naming
//! both locks) if the thread already holds a lock of a higher rank, or a data lock at a higher
//! or equal address. Release builds compile all of it away.
//!
//! The order (lowest first):
//!
//! 1. [`Rank::Arena`]: the arena lock (`state::lock`). Never taken while holding any other.
//! 2. [`Rank::Data`]: an array's data lock. Taken with the arena lock released, or only *tried*
//!    under it; several are taken in address order.
//! 3. [`Rank::Recorder`]: the memory recorder's lock, taken under the arena lock or data locks.
//!
//! Try-locks (`try_write`, `try_lock`) never wait, so they cannot close a wait cycle: they are not
//! checked. Leaf locks (names, print options, the thread-name table) take nothing while held and
//! have no rank.

/// Where a lock stands in the order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Rank {
    /// The arena lock.
    Arena,
    /// An array's data lock (several: in address order).
    Data,
    /// The memory recorder's lock.
    Recorder,
}

/// A lock acquisition counted as held by this thread (debug builds); releases it when dropped.
/// Keep it beside the guard, dropped after it.
#[must_use]
pub(crate) struct Held {
    #[cfg(debug_assertions)]
    entry: Option<(Rank, usize)>,
}

#[cfg(debug_assertions)]
thread_local! {
    /// The ranks (and addresses, for data locks) this thread holds, in taking order.
    static HELD: std::cell::RefCell<Vec<(Rank, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Checks that this thread may now wait for a lock of `rank` (at `address`, for data locks; 0
/// else), and counts it as held until the returned [`Held`] drops. Panics in debug builds if the
/// order would be broken.
#[inline]
pub(crate) fn acquire(rank: Rank, address: usize) -> Held {
    #[cfg(debug_assertions)]
    {
        HELD.with(|held| {
            let mut held = held.borrow_mut();
            if let Some(&(top_rank, top_address)) = held.iter().max() {
                let in_order = top_rank < rank || (rank == Rank::Data && top_rank == Rank::Data && top_address < address);
                assert!(
                    in_order,
                    "lock order broken: taking the {rank:?} lock (address {address:#x}) while holding the {top_rank:?} lock (address {top_address:#x}); see `crate::locks`"
                );
            }
            held.push((rank, address));
        });
        Held {
            entry: Some((rank, address)),
        }
    }
    #[cfg(not(debug_assertions))]
    {
        let _ = (rank, address);
        Held {}
    }
}

impl Held {
    /// Stops counting the lock as held (it was released early, e.g. around a closure that runs
    /// with it unlocked).
    #[inline]
    pub(crate) fn release(&mut self) {
        #[cfg(debug_assertions)]
        if let Some(entry) = self.entry.take() {
            // The thread-local is gone only while the thread exits: nothing to check then.
            let _ = HELD.try_with(|held| {
                let mut held = held.borrow_mut();
                if let Some(at) = held.iter().rposition(|&e| e == entry) {
                    held.remove(at);
                }
            });
        }
    }
}

impl Drop for Held {
    #[inline]
    fn drop(&mut self) {
        self.release();
    }
}

/// [`ARENA_FLAGS`]: this thread holds the arena lock (set by `state::lock`, cleared when it
/// unlocks).
const UNDER_ARENA: u8 = 1;
/// [`ARENA_FLAGS`]: `OUTSIDE` holds work, which the arena guard runs once it has unlocked.
const QUEUED: u8 = 2;

thread_local! {
    /// [`UNDER_ARENA`] and [`QUEUED`]: one plain cell that every lock and release of the arena
    /// reads and writes once, so the common case does not touch the queue (a thread-local with
    /// a destructor).
    static ARENA_FLAGS: std::cell::Cell<u8> = const { std::cell::Cell::new(0) };
    /// Work that must not run under the arena lock, queued by [`outside_arena`] while this
    /// thread holds it; run by the arena guard once it has unlocked.
    static OUTSIDE: std::cell::RefCell<Vec<Box<dyn FnOnce()>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Marks this thread as holding the arena lock. Only `state::lock` calls it.
#[inline]
pub(crate) fn enter_arena() {
    let _ = ARENA_FLAGS.try_with(|f| f.set(f.get() | UNDER_ARENA));
}

/// Marks this thread as no longer holding the arena lock, and says whether work queued by
/// [`outside_arena`] waits for the release ([`run_outside_work`]). Only the arena's guard calls
/// it.
#[inline]
pub(crate) fn leave_arena() -> bool {
    ARENA_FLAGS
        .try_with(|f| {
            let flags = f.get();
            f.set(flags & !UNDER_ARENA);
            flags & QUEUED != 0
        })
        .unwrap_or(false)
}

/// Whether this thread holds the arena lock.
#[cfg_attr(not(any(feature = "cuda", test)), allow(dead_code))]
pub(crate) fn under_arena() -> bool {
    ARENA_FLAGS
        .try_with(|f| f.get() & UNDER_ARENA != 0)
        .unwrap_or(false)
}

/// Runs `f` now, or, while this thread holds the arena lock, right after the lock is released.
/// For work that waits for a device (freeing page-locked memory synchronises it), which must
/// never stall every thread that needs the arena.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn outside_arena(f: impl FnOnce() + 'static) {
    let mut f = Some(f);
    if under_arena() {
        let queued = OUTSIDE.try_with(|q| {
            if let Some(f) = f.take() {
                q.borrow_mut().push(Box::new(f));
            }
        });
        if queued.is_ok() {
            let _ = ARENA_FLAGS.try_with(|f| f.set(f.get() | QUEUED));
            return;
        }
    }
    if let Some(f) = f {
        f();
    }
}

/// Runs the work [`outside_arena`] queued (the arena lock is released), including work queued
/// while it runs.
pub(crate) fn run_outside_work() {
    loop {
        let _ = ARENA_FLAGS.try_with(|f| f.set(f.get() & !QUEUED));
        let work = OUTSIDE
            .try_with(|q| std::mem::take(&mut *q.borrow_mut()))
            .unwrap_or_default();
        if work.is_empty() {
            return;
        }
        for f in work {
            f();
        }
    }
}

#[cfg(test)]
mod tests {
    /// The checks exist in debug builds only (`cargo test` without `--release`).
    #[cfg(debug_assertions)]
    mod debug {
        use super::super::*;

        #[test]
        fn locks_in_order_pass() {
            let arena = acquire(Rank::Arena, 0);
            let a = acquire(Rank::Data, 0x1000);
            let b = acquire(Rank::Data, 0x2000);
            let r = acquire(Rank::Recorder, 0);
            drop((r, b, a, arena));
            // Released out of taking order: the stack is empty again.
            let a = acquire(Rank::Data, 0x2000);
            drop(a);
            let _arena = acquire(Rank::Arena, 0);
        }

        #[test]
        #[should_panic(expected = "lock order broken: taking the Arena lock")]
        fn the_arena_after_a_data_lock_panics() {
            let _data = acquire(Rank::Data, 0x1000);
            let _arena = acquire(Rank::Arena, 0);
        }

        #[test]
        #[should_panic(expected = "lock order broken: taking the Data lock (address 0x1000)")]
        fn data_locks_out_of_address_order_panic() {
            let _b = acquire(Rank::Data, 0x2000);
            let _a = acquire(Rank::Data, 0x1000);
        }

        #[test]
        #[should_panic(expected = "lock order broken: taking the Arena lock")]
        fn the_arena_twice_panics() {
            let _a = acquire(Rank::Arena, 0);
            let _b = acquire(Rank::Arena, 0);
        }

        #[test]
        #[should_panic(expected = "lock order broken: taking the Data lock")]
        fn a_data_lock_under_the_recorder_panics() {
            let _r = acquire(Rank::Recorder, 0);
            let _d = acquire(Rank::Data, 0x1000);
        }

        #[test]
        fn a_released_lock_no_longer_counts() {
            let mut data = acquire(Rank::Data, 0x1000);
            data.release();
            let _arena = acquire(Rank::Arena, 0);
        }
    }
}
