//! [`Prefetcher`]: ND4J's `AsyncDataSetIterator` — batches prepared ahead on a background thread
//! into a circular workspace, with the overwrite that ND4J leaves silent made an error.

use std::fmt;
use std::panic::{self, AssertUnwindSafe, Location};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::arena::{CloseReason, Owner};
use crate::error::{take_panic_message, Ctx};
use crate::state;
use crate::{
    AllocationPolicy, Error, LearningPolicy, Manager, NDList, ResetPolicy, Result, SpillPolicy,
    Workspace, WorkspaceConfig,
};

/// Counters of a [`Prefetcher`], from [`Prefetcher::stats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Batches the background thread has produced.
    pub produced: u64,
    /// Batches handed to the consumer.
    pub consumed: u64,
    /// Calls of `next` that found no batch ready and had to wait for the producer.
    pub waits: u64,
    /// Total time `next` waited for the producer: what prefetching did not hide.
    pub waited: Duration,
    /// Batches closed because the consumer asked for the batch `depth` places after them while
    /// still holding them (arrays moved elsewhere with `detach`/`attach` are not counted).
    pub overwritten: u64,
    /// Batches built (partly) outside the ring because the ring had no free room: the batches
    /// still readable were in the way, and are never overwritten. Such a batch's arrays have
    /// buffers of their own, freed as the ring's are.
    pub spilled: u64,
    /// Times the ring was replaced by a larger one because a batch outgrew it (batches that
    /// live in the old one stay readable; it is freed with the last of them).
    pub ring_growths: u64,
}

/// The hand-off between the producer thread and the consumer, under `Shared::queue`: the
/// batches ready, and the counts and flags each side waits on (`Shared::changed`).
struct Queue {
    /// Produced batches not yet taken (or the producer's error, last).
    ready: std::collections::VecDeque<Result<NDList>>,
    /// Batches the consumer has asked for.
    asked: u64,
    produced: u64,
    /// The producer returned `None`, an error or panicked: nothing more will come.
    ended: bool,
    /// The consumer is gone: the producer stops.
    stop: bool,
}

struct Shared {
    queue: Mutex<Queue>,
    changed: Condvar,
    waits: AtomicU64,
    waited_ns: AtomicU64,
    overwritten: AtomicU64,
    spilled: AtomicU64,
    ring_growths: AtomicU64,
}

/// An iterator over batches ([`NDList`]s) that a background thread prepares ahead, up to
/// `depth` batches, into a circular workspace (ND4J's `AsyncDataSetIterator`).
///
/// ```text
/// owner
/// └─ prefetch        capped; holds the batches handed out, in workspace "ring"
///    └─ ring#N       the producer's scope for batch N (a cycle of the circular workspace)
/// ```
///
/// The producer runs on its own thread. For each batch it gets a fresh scope (a cycle of the
/// ring workspace, active on its thread), builds the batch's arrays there and returns them;
/// its other temporaries die with the scope. The batch stays in the ring, zero-copy.
///
/// **How long a batch lives.** The consumer holds at most `depth` batches: the one `next`
/// just returned and the `depth - 1` before it. A batch stays valid until `next` is called for
/// the batch `depth` places after it: with `depth` 2, batch 5 is valid while `next` returns
/// batch 6, and is closed when `next` is called for batch 7 (with `depth` 1, a batch is closed
/// by the next call). A handle kept longer gives `Error::ArrayClosed` saying it was overwritten
/// by the circular workspace — never another batch's data, which is what ND4J hands back. To
/// keep a batch, move it out first: `list.detach()` (then close it yourself), `list.attach(&m)`
/// or `scope.ret(…)`; each copies it out of the ring.
///
/// **The ring** holds `2·depth + 1` batches' worth of memory, sized from the first batch: at
/// most `depth` handed out, at most `depth` prepared or being prepared, and one of slack. A
/// batch is never overwritten while it is valid, whatever the sizes: when a larger batch finds
/// no free room, it is built outside the ring (counted in [`PrefetchStats::spilled`]), and the
/// ring is replaced by one of `2·depth + 1` of the largest batch
/// ([`PrefetchStats::ring_growths`]); batches in the old ring stay readable.
///
/// **The prefetch manager is capped**, so an op whose first input is a batch array, run with
/// no active scope, fails with `Capped` at its line instead of piling results up in it. Run
/// steps in a scope (`Manager::scope`, `Workspace::cycle`).
///
/// **Errors and panics** of the producer reach the consumer as the next item: the producer's
/// `Err`, or `Error::Panicked`; the iterator ends after it. **Dropping** the iterator stops the
/// producer thread (after the batch it is building, if any), waits for it, and frees the ring
/// and every batch in it.
///
/// ```
/// use ndscope::{DType, Manager, Prefetcher, Workspace, WorkspaceConfig};
/// let data = Manager::new_base().with_name("data");
/// let x = data.arange(0.0, 40.0, 1.0, DType::F32)?.reshape([10, 4])?;
/// let batches = Prefetcher::from_iter(&data, 2, 0..5, move |_scope, i: usize| {
///     Ok(vec![x.narrow(0, 2 * i, 2)?].into())     // built on the background thread
/// })?;
/// let trainer = Manager::new_base();
/// let ws = trainer.workspace("step", WorkspaceConfig::default())?;
/// let mut total = 0.0;
/// for batch in batches {
///     let batch = batch?;
///     total += ws.cycle(|_| batch.get(0).unwrap().sum_all()?.to_scalar::<f32>())?;
/// }
/// assert_eq!(total, (0..40).sum::<i32>() as f32);
/// # Ok::<(), ndscope::Error>(())
/// ```
pub struct Prefetcher {
    shared: Arc<Shared>,
    manager: Manager,
    ring: Workspace,
    depth: usize,
    /// The batches handed out that may still be valid, oldest first.
    held: std::collections::VecDeque<NDList>,
    consumed: u64,
    finished: bool,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for Prefetcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Prefetcher")
            .field("manager", &self.manager)
            .field("depth", &self.depth)
            .field("consumed", &self.consumed)
            .finish()
    }
}

impl Prefetcher {
    /// Starts a producer thread that calls `produce(scope)` for each batch until it returns
    /// `Ok(None)` (the end) or an error, at most `depth` batches ahead of the consumer. The
    /// prefetch manager is a child of `owner`, on its device. `InvalidArgument` for `depth` 0;
    /// `ManagerClosed` if `owner` is closed.
    #[track_caller]
    pub fn new<F>(owner: &Manager, depth: usize, produce: F) -> Result<Prefetcher>
    where
        F: FnMut(&Manager) -> Result<Option<NDList>> + Send + 'static,
    {
        let ctx = Ctx::new("Prefetcher::new");
        if depth == 0 {
            return Err(ctx.invalid("a prefetcher needs a depth of at least 1 batch"));
        }
        let manager = owner.new_sub_manager()?.with_name("prefetch");
        // Sized from the first batch (which spills while it is measured): 2·depth + 1 batches;
        // a larger batch later grows the block to fit it.
        let config = WorkspaceConfig::builder()
            .learning(LearningPolicy::FirstLoop)
            .allocation(AllocationPolicy::Overallocate)
            .overallocation_limit(2.0 * depth as f64)
            .spill(SpillPolicy::Reallocate)
            .reset(ResetPolicy::EndOfBuffer)
            .build()?;
        let ring = manager.workspace("ring", config)?;
        // Never overwrite a batch still readable: spill and grow instead.
        ring.keep_open_arrays(&ctx)?;
        manager.cap();
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                ready: std::collections::VecDeque::new(),
                asked: 0,
                produced: 0,
                ended: false,
                stop: false,
            }),
            changed: Condvar::new(),
            waits: AtomicU64::new(0),
            waited_ns: AtomicU64::new(0),
            overwritten: AtomicU64::new(0),
            spilled: AtomicU64::new(0),
            ring_growths: AtomicU64::new(0),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            let ring = ring.clone();
            let manager = manager.clone();
            thread::Builder::new()
                .name(format!("ndscope-prefetch-{}", manager.id()))
                .spawn(move || run_producer(shared, ring, manager, depth, produce))
                .map_err(|e| ctx.invalid(format!("cannot start the producer thread: {e}")))?
        };
        Ok(Prefetcher {
            shared,
            manager,
            ring,
            depth,
            held: std::collections::VecDeque::new(),
            consumed: 0,
            finished: false,
            thread: Some(thread),
        })
    }

    /// [`new`](Self::new) over the items of `source`: `to_batch(scope, item)` turns each item
    /// into a batch, on the background thread.
    #[track_caller]
    pub fn from_iter<S, T, F>(
        owner: &Manager,
        depth: usize,
        source: S,
        mut to_batch: F,
    ) -> Result<Prefetcher>
    where
        S: IntoIterator<Item = T>,
        S::IntoIter: Send + 'static,
        F: FnMut(&Manager, T) -> Result<NDList> + Send + 'static,
    {
        let mut items = source.into_iter();
        Prefetcher::new(owner, depth, move |scope| match items.next() {
            Some(item) => to_batch(scope, item).map(Some),
            None => Ok(None),
        })
    }

    /// The prefetch manager (a capped child of the owner; holds the batches handed out).
    pub fn manager(&self) -> &Manager {
        &self.manager
    }

    /// The circular workspace the batches live in.
    pub fn workspace(&self) -> &Workspace {
        &self.ring
    }

    /// How many batches the producer may run ahead, and how many batches the consumer holds
    /// at most: a batch is closed by the `depth`-th `next` call after the one that returned it.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The counters so far.
    pub fn stats(&self) -> PrefetchStats {
        let produced = self.shared.queue.lock().produced;
        PrefetchStats {
            produced,
            consumed: self.consumed,
            waits: self.shared.waits.load(Ordering::Relaxed),
            waited: Duration::from_nanos(self.shared.waited_ns.load(Ordering::Relaxed)),
            overwritten: self.shared.overwritten.load(Ordering::Relaxed),
            spilled: self.shared.spilled.load(Ordering::Relaxed),
            ring_growths: self.shared.ring_growths.load(Ordering::Relaxed),
        }
    }

    /// Closes the arrays of `batch` still held by the prefetch manager, as overwritten (the
    /// consumer moved the others elsewhere: those stay).
    fn expire(&self, batch: NDList, at: &'static Location<'static>) {
        let reason = CloseReason::Overwritten {
            workspace: Arc::from(format!(
                "{} of manager {}",
                self.ring.name(),
                self.manager.name()
            )),
            at,
        };
        let mut state = state::lock();
        let mut closed = false;
        for array in &batch {
            let held = state
                .live_array(&array.0)
                .is_some_and(|e| e.owner == Owner::Manager(self.manager.0.key));
            if held {
                state.remove_array(array.0.key(), reason.clone());
                closed = true;
            }
        }
        if closed {
            self.shared.overwritten.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn stop(&mut self) {
        self.shared.queue.lock().stop = true;
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            // The producer catches its closure's panics, so the thread itself does not panic.
            let _ = thread.join();
        }
    }
}

impl Iterator for Prefetcher {
    type Item = Result<NDList>;

    /// The next batch: at once if the producer has it ready, else after waiting for it. Closes
    /// the batch handed out `depth` calls ago (see the type's docs).
    #[track_caller]
    fn next(&mut self) -> Option<Result<NDList>> {
        if self.finished {
            return None;
        }
        let at = Location::caller();
        if self.held.len() >= self.depth {
            if let Some(old) = self.held.pop_front() {
                self.expire(old, at);
            }
        }
        let mut queue = self.shared.queue.lock();
        queue.asked += 1;
        self.shared.changed.notify_all();
        if queue.ready.is_empty() && !queue.ended {
            let start = Instant::now();
            while queue.ready.is_empty() && !queue.ended {
                self.shared.changed.wait(&mut queue);
            }
            self.shared.waits.fetch_add(1, Ordering::Relaxed);
            self.shared
                .waited_ns
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        let item = queue.ready.pop_front();
        drop(queue);
        match item {
            Some(Ok(batch)) => {
                self.consumed += 1;
                self.held.push_back(batch.clone());
                Some(Ok(batch))
            }
            Some(Err(e)) => {
                self.finished = true;
                Some(Err(e))
            }
            None => {
                self.finished = true;
                None
            }
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.stop();
        // Never the system manager, whose close is the only one that fails.
        let _ = self.manager.close();
    }
}

/// The producer thread's body: [`producer`], and if anything panics outside the closure (which
/// `producer` catches itself), the consumer is told all the same rather than left waiting.
fn run_producer<F>(shared: Arc<Shared>, ring: Workspace, manager: Manager, depth: usize, produce: F)
where
    F: FnMut(&Manager) -> Result<Option<NDList>>,
{
    let ctx = Ctx::new("Prefetcher producer");
    let during = format!("the producer of prefetcher {}", manager.0.describe());
    let ran = {
        let shared = Arc::clone(&shared);
        panic::catch_unwind(AssertUnwindSafe(move || {
            producer(shared, ring, manager, depth, produce)
        }))
    };
    if let Err(payload) = ran {
        let error = Error::Panicked {
            op: ctx.op,
            at: ctx.at,
            during,
            message: take_panic_message(payload),
        };
        let mut queue = shared.queue.lock();
        if !queue.ended {
            queue.ready.push_back(Err(error));
            queue.ended = true;
        }
        drop(queue);
        shared.changed.notify_all();
    }
}

/// The producer thread: one ring cycle per batch, at most `depth` batches ahead of the
/// consumer.
fn producer<F>(shared: Arc<Shared>, ring: Workspace, manager: Manager, depth: usize, mut produce: F)
where
    F: FnMut(&Manager) -> Result<Option<NDList>>,
{
    let ctx = Ctx::new("Prefetcher producer");
    loop {
        {
            let mut queue = shared.queue.lock();
            while !queue.stop && queue.produced >= queue.asked + depth as u64 {
                shared.changed.wait(&mut queue);
            }
            if queue.stop {
                return;
            }
        }
        let before = ring.stats();
        let made = panic::catch_unwind(AssertUnwindSafe(|| {
            ring.cycle(|scope| {
                let batch = produce(scope)?;
                if let Some(batch) = &batch {
                    adopt(&ctx, scope, &manager, batch)?;
                }
                Ok(batch)
            })
        }));
        let after = ring.stats();
        if before.initialized && after.spilled_count > before.spilled_count {
            shared.spilled.fetch_add(1, Ordering::Relaxed);
        }
        let grown = after.reallocations.saturating_sub(before.reallocations);
        shared.ring_growths.fetch_add(grown, Ordering::Relaxed);
        let item = match made {
            Ok(Ok(Some(batch))) => Some(Ok(batch)),
            Ok(Ok(None)) => None,
            Ok(Err(e)) => Some(Err(e)),
            Err(payload) => Some(Err(Error::Panicked {
                op: ctx.op,
                at: ctx.at,
                during: format!("the producer of prefetcher {}", manager.0.describe()),
                message: take_panic_message(payload),
            })),
        };
        let mut queue = shared.queue.lock();
        let end = !matches!(item, Some(Ok(_)));
        if let Some(item) = item {
            if item.is_ok() {
                queue.produced += 1;
            }
            queue.ready.push_back(item);
        }
        queue.ended = end;
        drop(queue);
        shared.changed.notify_all();
        if end {
            return;
        }
    }
}

/// Moves the batch's arrays from the producer's scope to the prefetch manager, in place
/// (zero-copy, as a circular workspace's `ret`; the cap of the prefetch manager is for the
/// consumer's stray results, not for the batches themselves). Each array must belong to the
/// scope; nothing moves otherwise.
fn adopt(ctx: &Ctx, scope: &Manager, manager: &Manager, batch: &NDList) -> Result<()> {
    let mut state = state::lock();
    let target = Owner::Manager(manager.0.key);
    for array in batch {
        let entry = state.array(&array.0, ctx)?;
        if entry.owner != Owner::Manager(scope.0.key) || entry.is_borrowed() {
            return Err(ctx.invalid(format!(
                "batch array {} is not owned by the producer's scope {}: build each batch's \
                 arrays in the scope the producer is given (op results land there)",
                array.0.describe(),
                scope.0.describe()
            )));
        }
    }
    for array in batch {
        if state
            .live_array(&array.0)
            .is_some_and(|e| e.owner != target)
        {
            state.set_owner(array.0.key(), target);
        }
    }
    Ok(())
}
