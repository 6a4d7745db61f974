//! How an operation runs: placement and allocation under the arena lock, then the kernel under
//! the arrays' data locks (never both at once; see `crate::state` for the lock order).
//!
//! Front-ends validate shapes and dtypes from the handles' metadata first (no lock needed: it
//! never changes), so a refused op touches nothing.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, RwLockReadGuard, RwLockWriteGuard,
};

use crate::arena::NewArray;
use crate::arena::{ArrayShared, CloseReason, Owner, Place};
use crate::backend::contract::{StepTensor, StepTensors};
use crate::backend::cuda::Noted;
use crate::backend::Storage;
use crate::error::Ctx;
use crate::locks::{self, Held, Rank};
use crate::manager::Manager;
use crate::ndarray::hooks;
use crate::state::{self, capped, Allocation};
use crate::{DType, Device, Error, NDArray, Result, Shape};

/// Where a new array goes.
pub(crate) enum Target<'a> {
    /// Into this manager (factories).
    Manager(&'a Manager),
    /// Where the result of an op on these inputs goes: the thread's active scope, else the owner
    /// of the first input (the borrower while borrowed), else (first input detached) the detached
    /// list.
    ResultOf(&'a [&'a NDArray]),
    /// Into the manager that holds this array now (the borrower while borrowed), whatever scope
    /// is active: `to_device` keeps the owner.
    OwnerOf(&'a NDArray),
    /// As `OwnerOf`, allowed on a capped owner: an array's gradient, which belongs to the
    /// model as the array does (as `restore_safetensors` is allowed). For a borrowed array,
    /// the manager it goes back to (its first lender, while open), not the borrower.
    GradientOf(&'a NDArray),
}

/// A new array of `shape`/`dtype` on `device`, placed by `target`. Returns it and whether its
/// bytes may hold stale data (workspace memory); heap buffers are zeroed.
pub(crate) fn new_array(
    ctx: &Ctx,
    target: Target<'_>,
    shape: Shape,
    dtype: DType,
    device: Device,
) -> Result<(NDArray, bool)> {
    let active = match target {
        Target::ResultOf(_) => Manager::active(),
        Target::Manager(_) | Target::OwnerOf(_) | Target::GradientOf(_) => None,
    };
    // A device's first use sets it up (seconds for a cold kernel compile): before the arena
    // lock, so other threads are not stalled, and with the cause of a failure reported.
    if device.is_available() {
        crate::backend::prepare(ctx, device)?;
    }
    let mut state = state::lock();
    let (owner, why) = match target {
        Target::Manager(m) => {
            let entry = state.manager(&m.0, ctx)?;
            if !m.device().is_available() {
                return Err(ctx.unavailable(m.device()));
            }
            let why = if entry.capped {
                Some(format!(
                    "a new {dtype} array of shape {shape} would be created in it"
                ))
            } else {
                None
            };
            (Owner::Manager(m.0.key), why)
        }
        Target::ResultOf(inputs) => {
            for input in inputs {
                state.array(&input.0, ctx)?;
            }
            match (&active, inputs.first()) {
                (Some(active), _) => {
                    let entry = state.manager(&active.0, ctx)?;
                    let why = entry.capped.then(|| {
                        format!(
                            "the result of `{}` would land there because it is this thread's active scope",
                            ctx.op
                        )
                    });
                    (Owner::Manager(active.0.key), why)
                }
                (None, Some(first)) => {
                    let owner = state.array_entry(first.0.key()).owner;
                    let why = match owner {
                        Owner::Manager(m) if state.manager_entry(m).capped => Some(format!(
                            "the result of `{}` would land there because it owns the first input, {} \
                             (activate a scope with Manager::activate or use Manager::scope to collect \
                             temporaries elsewhere)",
                            ctx.op,
                            first.0.describe()
                        )),
                        _ => None,
                    };
                    (owner, why)
                }
                (None, None) => (Owner::Detached, None),
            }
        }
        Target::OwnerOf(source) => {
            let owner = state.array(&source.0, ctx)?.owner;
            let why = match owner {
                Owner::Manager(m) if state.manager_entry(m).capped => Some(format!(
                    "the copy made by `{}` would land there because it holds {}",
                    ctx.op,
                    source.0.describe()
                )),
                _ => None,
            };
            (owner, why)
        }
        Target::GradientOf(source) => {
            let entry = state.array(&source.0, ctx)?;
            // A borrowed array goes back to the manager that lent it first (while that one is
            // open): its gradient is made there, not in the borrower, whose closing would
            // close the gradient while the array lives on.
            let home =
                entry
                    .returns
                    .first()
                    .and_then(|lender| match (lender.owner, &lender.shared) {
                        (Owner::Manager(_), Some(shared)) => {
                            state.live_manager(shared).map(|_| lender.owner)
                        }
                        (Owner::Detached, _) => Some(Owner::Detached),
                        (Owner::Manager(_), None) => None,
                    });
            (home.unwrap_or(entry.owner), None)
        }
    };
    if let (Some(what), Owner::Manager(m)) = (why, owner) {
        return Err(capped(ctx, &state.manager_entry(m).shared, what));
    }
    let allocation = state.allocate(ctx, owner, &shape, dtype, device)?;
    let dirty = allocation.buffer.may_be_stale();
    let array = NewArray {
        shape,
        dtype,
        device,
        created_at: ctx.at,
    };
    let inner = state.insert_array(array, allocation, owner);
    Ok((NDArray(inner), dirty))
}

/// Adopts `buffer` (host storage) as a new array in manager `m` (used by `from_vec` outside
/// workspaces).
pub(crate) fn adopt(
    ctx: &Ctx,
    m: &Manager,
    shape: Shape,
    dtype: DType,
    buffer: Storage,
) -> Result<NDArray> {
    let bytes = crate::shape::check(ctx, &shape, dtype)?;
    let mut state = state::lock();
    let entry = state.manager(&m.0, ctx)?;
    if entry.capped {
        let what = format!("a new {dtype} array of shape {shape} would be created in it");
        return Err(capped(ctx, &m.0, what));
    }
    let array = NewArray {
        shape,
        dtype,
        device: Device::Cpu,
        created_at: ctx.at,
    };
    let allocation = Allocation {
        buffer,
        place: Place::Heap,
        bytes,
    };
    let inner = state.insert_array(array, allocation, Owner::Manager(m.0.key));
    Ok(NDArray(inner))
}

/// Whether manager `m` allocates from a workspace block.
pub(crate) fn allocates_from_workspace(m: &Manager) -> bool {
    state::lock()
        .live_manager(&m.0)
        .is_some_and(|e| e.alloc.is_some())
}

/// Closes an array created for an op that then failed.
pub(crate) fn discard(array: &NDArray) {
    let mut state = state::lock();
    if state.live_array(&array.0).is_some() {
        state.remove_array(array.0.key(), CloseReason::Discarded);
    }
}

/// An array's bytes, read-locked (and counted in the lock order, see `crate::locks`; device
/// bytes noted as this thread's op's, for graph replay).
struct ReadGuard<'a> {
    // Dropped first: the note ends before the lock.
    _noted: Option<Noted>,
    guard: MappedRwLockReadGuard<'a, Storage>,
    _held: Held,
}

/// An array's bytes, write-locked (and counted in the lock order, see `crate::locks`; device
/// bytes noted as this thread's op's, for graph replay).
struct WriteGuard<'a> {
    _noted: Option<Noted>,
    guard: MappedRwLockWriteGuard<'a, Storage>,
    _held: Held,
}

impl std::ops::Deref for ReadGuard<'_> {
    type Target = Storage;
    #[inline]
    fn deref(&self) -> &Storage {
        &self.guard
    }
}

impl std::ops::Deref for WriteGuard<'_> {
    type Target = Storage;
    #[inline]
    fn deref(&self) -> &Storage {
        &self.guard
    }
}

impl std::ops::DerefMut for WriteGuard<'_> {
    #[inline]
    fn deref_mut(&mut self) -> &mut Storage {
        &mut self.guard
    }
}

/// Read-locks an array's bytes, or gives its `ArrayClosed` error.
#[inline]
fn read<'a>(ctx: &Ctx, a: &'a ArrayShared) -> Result<ReadGuard<'a>> {
    let held = locks::acquire(Rank::Data, a as *const ArrayShared as usize);
    let guard =
        RwLockReadGuard::try_map(a.data.read(), Option::as_ref).map_err(|_| a.closed_error(ctx))?;
    Ok(ReadGuard {
        _noted: guard.note_locked(false),
        guard,
        _held: held,
    })
}

/// Write-locks an array's bytes, or gives its `ArrayClosed` error.
#[inline]
fn write<'a>(ctx: &Ctx, a: &'a ArrayShared) -> Result<WriteGuard<'a>> {
    let guard = write_at(ctx, a, a as *const ArrayShared as usize)?;
    // An in-place write: the version a gradient tape checks.
    a.grad.version.fetch_add(1, Ordering::Relaxed);
    Ok(guard)
}

/// Write-locks the bytes of an op's fresh output, after its inputs whatever its address: no other
/// thread waits for a new array's data lock (closing it only tries), so it is counted as the
/// last of the data locks, after which the kernel takes no other.
fn write_fresh<'a>(ctx: &Ctx, a: &'a ArrayShared) -> Result<WriteGuard<'a>> {
    write_at(ctx, a, usize::MAX)
}

#[inline(always)]
fn write_at<'a>(ctx: &Ctx, a: &'a ArrayShared, address: usize) -> Result<WriteGuard<'a>> {
    let held = locks::acquire(Rank::Data, address);
    let guard = RwLockWriteGuard::try_map(a.data.write(), Option::as_mut)
        .map_err(|_| a.closed_error(ctx))?;
    Ok(WriteGuard {
        _noted: guard.note_locked(true),
        guard,
        _held: held,
    })
}

fn addr(a: &NDArray) -> usize {
    Arc::as_ptr(&a.0) as usize
}

/// Read-locks `inputs` in address order, each distinct array once. Returns the guards and, for
/// each input, the index of its guard.
fn read_sorted<'a>(ctx: &Ctx, inputs: &[&'a NDArray]) -> Result<(Vec<ReadGuard<'a>>, Vec<usize>)> {
    let mut order: Vec<usize> = (0..inputs.len()).collect();
    order.sort_by_key(|&i| addr(inputs[i]));
    let mut guards = Vec::with_capacity(inputs.len());
    let mut slot = vec![0; inputs.len()];
    let mut last: Option<usize> = None;
    for i in order {
        if last != Some(addr(inputs[i])) {
            guards.push(read(ctx, &inputs[i].0)?);
            last = Some(addr(inputs[i]));
        }
        slot[i] = guards.len() - 1;
    }
    Ok((guards, slot))
}

/// Computes the product pending in any of `arrays` that has one (a weight gradient; see
/// `hooks`), before their bytes are locked: no access sees an array without it.
#[inline]
fn settle(ctx: &Ctx, arrays: &[&NDArray]) -> Result<()> {
    for a in arrays {
        hooks::before_access(ctx, &a.0)?;
    }
    Ok(())
}

/// Runs `f` on the bytes of `inputs` (read-locked in address order, each once) and `out`
/// (write-locked). `out` must be a fresh array, not one of the inputs.
pub(crate) fn compute<R>(
    ctx: &Ctx,
    inputs: &[&NDArray],
    out: &NDArray,
    f: impl FnOnce(&[&Storage], &mut Storage) -> Result<R>,
) -> Result<R> {
    settle(ctx, inputs)?;
    let (guards, slot) = read_sorted(ctx, inputs)?;
    let mut out_guard = write_fresh(ctx, &out.0)?;
    let buffers: Vec<&Storage> = slot.iter().map(|&j| &*guards[j]).collect();
    f(&buffers, &mut out_guard)
}

/// Runs `f` on the bytes of `inputs`, read-only.
pub(crate) fn read_all<R>(
    ctx: &Ctx,
    inputs: &[&NDArray],
    f: impl FnOnce(&[&Storage]) -> Result<R>,
) -> Result<R> {
    settle(ctx, inputs)?;
    if let [a] = inputs {
        let guard = read(ctx, &a.0)?;
        return f(&[&guard]);
    }
    let (guards, slot) = read_sorted(ctx, inputs)?;
    let buffers: Vec<&Storage> = slot.iter().map(|&j| &*guards[j]).collect();
    f(&buffers)
}

/// Makes a new array for an op on `inputs` and fills it with `kernel`; on any failure the new
/// array is discarded and nothing else changed.
pub(crate) fn op(
    ctx: &Ctx,
    inputs: &[&NDArray],
    shape: Shape,
    dtype: DType,
    kernel: impl FnOnce(&[&Storage], &mut Storage) -> Result<()>,
) -> Result<NDArray> {
    let device = inputs.first().map_or(Device::Cpu, |a| a.device());
    let (out, _) = new_array(ctx, Target::ResultOf(inputs), shape, dtype, device)?;
    match compute(ctx, inputs, &out, kernel) {
        Ok(()) => Ok(out),
        Err(e) => {
            discard(&out);
            Err(e)
        }
    }
}

/// Fast path of [`op`] for one input.
pub(crate) fn op1(
    ctx: &Ctx,
    a: &NDArray,
    shape: Shape,
    dtype: DType,
    kernel: impl FnOnce(&Storage, &mut Storage) -> Result<()>,
) -> Result<NDArray> {
    op1_into(
        ctx,
        a,
        (Target::ResultOf(&[a]), a.device()),
        shape,
        dtype,
        kernel,
    )
}

/// [`op1`] with the result placed by `target` on `device`.
pub(crate) fn op1_into(
    ctx: &Ctx,
    a: &NDArray,
    (target, device): (Target<'_>, Device),
    shape: Shape,
    dtype: DType,
    kernel: impl FnOnce(&Storage, &mut Storage) -> Result<()>,
) -> Result<NDArray> {
    settle(ctx, &[a])?;
    let (out, _) = new_array(ctx, target, shape, dtype, device)?;
    let result = (|| {
        let input = read(ctx, &a.0)?;
        let mut output = write_fresh(ctx, &out.0)?;
        kernel(&input, &mut output)
    })();
    match result {
        Ok(()) => Ok(out),
        Err(e) => {
            discard(&out);
            Err(e)
        }
    }
}

/// Fast path of [`op`] for two inputs (which may be the same array).
pub(crate) fn op2(
    ctx: &Ctx,
    a: &NDArray,
    b: &NDArray,
    shape: Shape,
    dtype: DType,
    kernel: impl FnOnce(&Storage, &Storage, &mut Storage) -> Result<()>,
) -> Result<NDArray> {
    settle(ctx, &[a, b])?;
    let (out, _) = new_array(ctx, Target::ResultOf(&[a, b]), shape, dtype, a.device())?;
    let result = (|| {
        if addr(a) == addr(b) {
            let input = read(ctx, &a.0)?;
            let mut output = write_fresh(ctx, &out.0)?;
            return kernel(&input, &input, &mut output);
        }
        let (first, second) = if addr(a) < addr(b) { (a, b) } else { (b, a) };
        let g1 = read(ctx, &first.0)?;
        let g2 = read(ctx, &second.0)?;
        let (ga, gb) = if addr(a) < addr(b) {
            (&g1, &g2)
        } else {
            (&g2, &g1)
        };
        let mut output = write_fresh(ctx, &out.0)?;
        kernel(ga, gb, &mut output)
    })();
    match result {
        Ok(()) => Ok(out),
        Err(e) => {
            discard(&out);
            Err(e)
        }
    }
}

/// Makes the results of an op on `inputs` with two outputs, `first` and (when given) `second`
/// (shape, dtype), both placed as op results are, and fills them with `kernel`; on any failure
/// both are discarded and nothing else changed.
pub(crate) fn op_pair(
    ctx: &Ctx,
    inputs: &[&NDArray],
    first: (Shape, DType),
    second: Option<(Shape, DType)>,
    kernel: impl FnOnce(&[&Storage], &mut Storage, Option<&mut Storage>) -> Result<()>,
) -> Result<(NDArray, Option<NDArray>)> {
    settle(ctx, inputs)?;
    let device = inputs.first().map_or(Device::Cpu, |a| a.device());
    let (out, _) = new_array(ctx, Target::ResultOf(inputs), first.0, first.1, device)?;
    let extra = match second {
        None => None,
        Some((shape, dtype)) => {
            match new_array(ctx, Target::ResultOf(inputs), shape, dtype, device) {
                Ok((extra, _)) => Some(extra),
                Err(e) => {
                    discard(&out);
                    return Err(e);
                }
            }
        }
    };
    let result = (|| {
        let (guards, slot) = read_sorted(ctx, inputs)?;
        // Both outputs are fresh: counted after the inputs, the first before the second.
        let mut first = write_at(ctx, &out.0, usize::MAX - 1)?;
        let mut second = match &extra {
            Some(extra) => Some(write_fresh(ctx, &extra.0)?),
            None => None,
        };
        let buffers: Vec<&Storage> = slot.iter().map(|&j| &*guards[j]).collect();
        kernel(&buffers, &mut first, second.as_deref_mut())
    })();
    match result {
        Ok(()) => Ok((out, extra)),
        Err(e) => {
            discard(&out);
            if let Some(extra) = &extra {
                discard(extra);
            }
            Err(e)
        }
    }
}

/// Runs an in-place kernel on `target`; allocates nothing, takes no arena lock. The kernel
/// must validate before writing so a failure changes nothing.
pub(crate) fn inplace(
    ctx: &Ctx,
    target: &NDArray,
    kernel: impl FnOnce(&mut Storage) -> Result<()>,
) -> Result<()> {
    settle(ctx, &[target])?;
    let mut guard = write(ctx, &target.0)?;
    kernel(&mut guard)
}

/// Runs an in-place kernel on `target` with one source. The source is `None` when it is
/// `target` itself (then read from the target's own bytes).
pub(crate) fn inplace_with(
    ctx: &Ctx,
    target: &NDArray,
    source: &NDArray,
    kernel: impl FnOnce(&mut Storage, Option<&Storage>) -> Result<()>,
) -> Result<()> {
    hooks::before_inplace_reads(ctx, &[source])?;
    settle(ctx, &[target, source])?;
    if addr(target) == addr(source) {
        let mut guard = write(ctx, &target.0)?;
        return kernel(&mut guard, None);
    }
    // Address order, so crossed in-place ops on two threads cannot deadlock.
    if addr(target) < addr(source) {
        let mut t = write(ctx, &target.0)?;
        let s = read(ctx, &source.0)?;
        kernel(&mut t, Some(&s))
    } else {
        let s = read(ctx, &source.0)?;
        let mut t = write(ctx, &target.0)?;
        kernel(&mut t, Some(&s))
    }
}

/// Most arrays one [`locked`] call takes.
const MAX_LOCKED: usize = 4;

/// Write-locks `targets` and read-locks `sources` in address order (each distinct array once, so
/// crossed calls on two threads cannot deadlock), then runs `kernel` on their bytes, given in
/// the order of the arguments (every entry is `Some`; the arrays keep the borrows apart).
/// Sources may repeat; a target may not be another target or a source (`InvalidArgument`;
/// callers check first, for a better message). At most `MAX_LOCKED` arrays in all; allocates
/// nothing.
fn locked<const W: usize, const R: usize>(
    ctx: &Ctx,
    targets: [&NDArray; W],
    sources: [&NDArray; R],
    kernel: impl FnOnce([Option<&mut Storage>; W], [Option<&Storage>; R]) -> Result<()>,
) -> Result<()> {
    /// The data lock held on one distinct array: written or only read.
    enum Guard<'a> {
        Write(WriteGuard<'a>),
        Read(ReadGuard<'a>),
    }
    // Roles 0..W are the targets, W..W+R the sources.
    const { assert!(W + R <= MAX_LOCKED) };
    hooks::before_inplace_reads(ctx, &sources)?;
    settle(ctx, &targets)?;
    settle(ctx, &sources)?;
    let count = W + R;
    let role_array = |role: usize| {
        if role < W {
            targets[role]
        } else {
            sources[role - W]
        }
    };
    let mut order = [(usize::MAX, 0usize); MAX_LOCKED];
    for (role, entry) in order.iter_mut().enumerate().take(count) {
        *entry = (addr(role_array(role)), role);
    }
    order[..count].sort_unstable();
    // One guard per distinct array, with the roles it plays (a bit set).
    let mut guards: [Option<(u32, Guard<'_>)>; MAX_LOCKED] = [None, None, None, None];
    let mut used = 0;
    for pos in 0..count {
        let (address, role) = order[pos];
        if pos > 0 && order[pos - 1].0 == address {
            if role < W || order[pos - 1].1 < W {
                return Err(clash(ctx));
            }
            if let Some((roles, _)) = guards[used - 1].as_mut() {
                *roles |= 1 << role;
            }
            continue;
        }
        let array = role_array(role);
        let guard = if role < W {
            Guard::Write(write(ctx, &array.0)?)
        } else {
            Guard::Read(read(ctx, &array.0)?)
        };
        guards[used] = Some((1 << role, guard));
        used += 1;
    }
    let mut outs: [Option<&mut Storage>; W] = std::array::from_fn(|_| None);
    let mut ins: [Option<&Storage>; R] = [None; R];
    for (roles, guard) in guards.iter_mut().flatten() {
        match guard {
            Guard::Write(g) => outs[roles.trailing_zeros() as usize] = Some(&mut **g),
            Guard::Read(g) => {
                let buffer: &Storage = g;
                for (i, input) in ins.iter_mut().enumerate() {
                    if *roles & (1 << (W + i)) != 0 {
                        *input = Some(buffer);
                    }
                }
            }
        }
    }
    kernel(outs, ins)
}

fn clash(ctx: &Ctx) -> Error {
    ctx.invalid("an in-place target is also another operand")
}

/// Runs an in-place kernel on `target` with two sources, neither of which is `target` (the
/// caller checks; `a` and `b` may be the same array).
pub(crate) fn inplace_with2(
    ctx: &Ctx,
    target: &NDArray,
    a: &NDArray,
    b: &NDArray,
    kernel: impl FnOnce(&mut Storage, &Storage, &Storage) -> Result<()>,
) -> Result<()> {
    locked(ctx, [target], [a, b], |[out], [a, b]| match (out, a, b) {
        (Some(out), Some(a), Some(b)) => kernel(out, a, b),
        _ => Err(clash(ctx)),
    })
}

/// Runs an in-place kernel on two targets with two sources. The targets are distinct and
/// neither is a source (the caller checks); `a` and `b` may be the same array.
pub(crate) fn inplace2_with2(
    ctx: &Ctx,
    (t1, t2): (&NDArray, &NDArray),
    (a, b): (&NDArray, &NDArray),
    kernel: impl FnOnce(&mut Storage, &mut Storage, &Storage, &Storage) -> Result<()>,
) -> Result<()> {
    locked(ctx, [t1, t2], [a, b], |[o1, o2], [a, b]| {
        match (o1, o2, a, b) {
            (Some(o1), Some(o2), Some(a), Some(b)) => kernel(o1, o2, a, b),
            _ => Err(clash(ctx)),
        }
    })
}

/// Runs an in-place kernel on `target`, up to two more targets (an optimizer's state, `state`)
/// and `grad`, all write-locked (an optimizer step, which zeroes the gradient it reads when
/// asked to). The arrays are distinct (the caller checks). The kernel gets the state's bytes in
/// `state`'s order, `None` past its end.
pub(crate) fn inplace_state_grad(
    ctx: &Ctx,
    target: &NDArray,
    state: &[&NDArray],
    grad: &NDArray,
    kernel: impl FnOnce(&mut Storage, [Option<&mut Storage>; 2], &mut Storage) -> Result<()>,
) -> Result<()> {
    match *state {
        [] => locked(ctx, [target, grad], [], |[t, g], []| match (t, g) {
            (Some(t), Some(g)) => kernel(t, [None, None], g),
            _ => Err(clash(ctx)),
        }),
        [a] => locked(ctx, [target, a, grad], [], |[t, a, g], []| {
            match (t, a, g) {
                (Some(t), Some(a), Some(g)) => kernel(t, [Some(a), None], g),
                _ => Err(clash(ctx)),
            }
        }),
        [a, b] => locked(ctx, [target, a, b, grad], [], |[t, a, b, g], []| {
            match (t, a, b, g) {
                (Some(t), Some(a), Some(b), Some(g)) => kernel(t, [Some(a), Some(b)], g),
                _ => Err(clash(ctx)),
            }
        }),
        _ => Err(ctx.invalid("an in-place kernel takes at most two state arrays")),
    }
}

/// Memory that [`locked_steps`] reuses from call to call, kept by its caller (an optimizer):
/// once it has grown to the step's size, locking the step's arrays allocates nothing.
pub(crate) struct ManyLocks {
    /// `(address, role)` of each array, sorted: the order the locks are taken in.
    order: Vec<(usize, usize)>,
    /// The index of each role's guard.
    slot: Vec<usize>,
    /// The guards' memory, empty between calls.
    spare: SpareGuards,
}

impl ManyLocks {
    /// Memory for steps of up to `arrays` arrays, so that not even the first allocates.
    pub(crate) fn with_capacity(arrays: usize) -> ManyLocks {
        ManyLocks {
            order: Vec::with_capacity(arrays),
            slot: Vec::with_capacity(arrays),
            spare: SpareGuards(Vec::with_capacity(arrays)),
        }
    }
}

impl std::fmt::Debug for ManyLocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ManyLocks")
            .field("capacity", &self.order.capacity())
            .finish()
    }
}

/// The memory of a list of write guards, holding none.
struct SpareGuards(Vec<WriteGuard<'static>>);

// SAFETY: the list is empty whenever it is stored here (`locked_steps` empties it before putting
// it back): no guard, nothing tied to a thread, only the allocation moves between threads.
unsafe impl Send for SpareGuards {}
// SAFETY: as above; nothing is reachable through a shared reference to an empty list.
unsafe impl Sync for SpareGuards {}

/// The allocation of `list`, emptied, as a list of another type of the same size and alignment
/// (the guards' lifetimes): no allocation.
fn recycle<T, U>(mut list: Vec<T>) -> Vec<U> {
    list.clear();
    list.into_iter().filter_map(|_| None).collect()
}

/// The tensors of a multi-tensor step over the guards [`locked_steps`] holds.
struct LockedTensors<'g, 'a> {
    guards: &'g mut [WriteGuard<'a>],
    /// The guard of each role (tensor `t`, role `r` at `t·depth + r`), then the skip flag's,
    /// then the step counter's.
    slot: &'g [usize],
    depth: usize,
    count: usize,
    /// Whether the step has a skip flag (its slot follows the tensors').
    flagged: bool,
    /// Whether the step has a step counter (its slot is the last).
    counted: bool,
}

impl StepTensors<Storage> for LockedTensors<'_, '_> {
    fn len(&self) -> usize {
        self.count
    }

    fn tensor(&mut self, i: usize) -> Option<StepTensor<'_, Storage>> {
        if i >= self.count {
            return None;
        }
        let roles = self.slot.get(i * self.depth..(i + 1) * self.depth)?;
        match *roles {
            [g, p] => {
                let [g, p] = self.guards.get_disjoint_mut([g, p]).ok()?;
                Some(StepTensor {
                    grad: &mut *g.guard,
                    p: &mut *p.guard,
                    state: [None, None],
                })
            }
            [g, p, a] => {
                let [g, p, a] = self.guards.get_disjoint_mut([g, p, a]).ok()?;
                Some(StepTensor {
                    grad: &mut *g.guard,
                    p: &mut *p.guard,
                    state: [Some(&mut *a.guard), None],
                })
            }
            [g, p, a, b] => {
                let [g, p, a, b] = self.guards.get_disjoint_mut([g, p, a, b]).ok()?;
                Some(StepTensor {
                    grad: &mut *g.guard,
                    p: &mut *p.guard,
                    state: [Some(&mut *a.guard), Some(&mut *b.guard)],
                })
            }
            _ => None,
        }
    }

    fn skip_flag_mut(&mut self) -> Option<&mut Storage> {
        if !self.flagged {
            return None;
        }
        let at = *self.slot.get(self.count * self.depth)?;
        self.guards.get_mut(at).map(|g| &mut *g.guard)
    }

    fn step_count(&mut self) -> Option<&mut Storage> {
        if !self.counted {
            return None;
        }
        let role = self.count * self.depth + usize::from(self.flagged);
        let at = *self.slot.get(role)?;
        self.guards.get_mut(at).map(|g| &mut *g.guard)
    }
}

/// Runs a multi-tensor optimizer step's kernel on `count` tensors of `depth` arrays each (2 to
/// 4: role 0 the gradient, 1 the parameter, then the state), `array(t, role)` giving each: every
/// array's pending product settled first, then all write-locked in address order (each once:
/// an array in two roles is `InvalidArgument`, before any lock), the kernel given their bytes
/// tensor by tensor, the skip `flag` (see `StepTensors::skip_flag`) and an Adam step's
/// `counter` (`StepTensors::step_count`), locked with them. Reuses `locks`' memory: allocates
/// nothing once it has grown to the size of the step.
pub(crate) fn locked_steps<'a>(
    ctx: &Ctx,
    locks: &mut ManyLocks,
    (count, depth): (usize, usize),
    array: impl Fn(usize, usize) -> &'a NDArray,
    (flag, counter): (Option<&'a NDArray>, Option<&'a NDArray>),
    kernel: impl FnOnce(&mut dyn StepTensors<Storage>) -> Result<()>,
) -> Result<()> {
    if !(2..=4).contains(&depth) {
        return Err(ctx.invalid(format!(
            "a tensor of an optimizer step has 2 to 4 arrays, not {depth}"
        )));
    }
    let roles = count * depth;
    let flagged = usize::from(flag.is_some());
    let all = roles + flagged + usize::from(counter.is_some());
    // Role `roles` is the flag (if any), the next the counter (if any).
    let of = |role: usize| match (flag, counter) {
        (Some(f), _) if role == roles => f,
        (_, Some(c)) if role == roles + flagged => c,
        _ => array(role / depth, role % depth),
    };
    for role in 0..all {
        hooks::before_access(ctx, &of(role).0)?;
    }
    let ManyLocks { order, slot, spare } = locks;
    order.clear();
    order.extend((0..all).map(|role| (addr(of(role)), role)));
    order.sort_unstable();
    if order.windows(2).any(|w| w[0].0 == w[1].0) {
        return Err(clash(ctx));
    }
    slot.clear();
    slot.resize(all, 0);
    let mut guards: Vec<WriteGuard<'a>> = recycle(std::mem::take(&mut spare.0));
    let run = || {
        for (at, &(_, role)) in order.iter().enumerate() {
            guards.push(write(ctx, &of(role).0)?);
            slot[role] = at;
        }
        kernel(&mut LockedTensors {
            guards: &mut guards,
            slot,
            depth,
            count,
            flagged: flag.is_some(),
            counted: counter.is_some(),
        })
    };
    let result = run();
    spare.0 = recycle(guards);
    result
}

/// Runs `kernel` on the bytes of `arrays`, handed over in the order given: every array's pending
/// product settled first, then all write-locked in address order (each once: an array given
/// twice is `InvalidArgument`, before any lock). An in-place collective's path (the all-reduce
/// of a replica's gradients), where the order of the list is the order every rank must keep.
pub(crate) fn write_all(
    ctx: &Ctx,
    arrays: &[&NDArray],
    kernel: impl FnOnce(&mut [&mut Storage]) -> Result<()>,
) -> Result<()> {
    settle(ctx, arrays)?;
    let mut order: Vec<usize> = (0..arrays.len()).collect();
    order.sort_by_key(|&i| addr(arrays[i]));
    if order
        .windows(2)
        .any(|w| addr(arrays[w[0]]) == addr(arrays[w[1]]))
    {
        return Err(ctx.invalid("an array is given twice to an in-place collective"));
    }
    let mut guards = Vec::with_capacity(arrays.len());
    for &i in &order {
        guards.push(write(ctx, &arrays[i].0)?);
    }
    // The guard of array `i` is at `slot[i]`.
    let mut slot = vec![0; arrays.len()];
    for (at, &i) in order.iter().enumerate() {
        slot[i] = at;
    }
    let mut held: Vec<Option<&mut Storage>> = guards.iter_mut().map(|g| Some(&mut **g)).collect();
    let mut storages = Vec::with_capacity(arrays.len());
    for &at in &slot {
        match held.get_mut(at).and_then(Option::take) {
            Some(storage) => storages.push(storage),
            None => return Err(ctx.invalid("an array is given twice to an in-place collective")),
        }
    }
    kernel(&mut storages)
}

#[cfg(test)]
mod lock_order_tests {
    /// The checks exist in debug builds only (`cargo test` without `--release`).
    #[cfg(debug_assertions)]
    mod debug {
        use super::super::*;

        /// The lock order is checked where the locks are taken: a thread that holds an array's data
        /// lock and then waits for the arena lock (which could deadlock against a thread closing that
        /// array) panics in debug builds, naming both locks.
        #[test]
        #[should_panic(expected = "lock order broken: taking the Arena lock")]
        fn taking_the_arena_lock_while_holding_a_data_lock_panics() {
            let m = Manager::new_base();
            let a = m.zeros([4], DType::F32).expect("a small array");
            let ctx = Ctx::new("test");
            let _bytes = read(&ctx, &a.0).expect("open");
            let _state = state::lock();
        }

        /// Two data locks against address order panic; in order they pass.
        #[test]
        #[should_panic(expected = "lock order broken: taking the Data lock")]
        fn data_locks_against_address_order_panic() {
            let m = Manager::new_base();
            let a = m.zeros([4], DType::F32).expect("a small array");
            let b = m.zeros([4], DType::F32).expect("a small array");
            let (low, high) = if addr(&a) < addr(&b) { (a, b) } else { (b, a) };
            let ctx = Ctx::new("test");
            {
                let _low = read(&ctx, &low.0).expect("open");
                let _high = read(&ctx, &high.0).expect("open");
            }
            let _high = read(&ctx, &high.0).expect("open");
            let _low = read(&ctx, &low.0).expect("open");
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod replay_tests {
    use std::sync::mpsc;

    use super::*;
    use crate::backend::contract::TransferOps;
    use crate::backend::AnyDevice;
    use crate::WorkspaceConfig;

    /// A thread whose op locked its device array before another thread's cycle began replaying,
    /// and copies into it while that cycle holds calls back, touches nothing they touch: the
    /// cycle goes on replaying (it used to fall back, taking the op's footprint for unknown).
    #[test]
    fn an_op_that_locked_its_array_before_a_cycle_replayed_does_not_make_it_fall_back() {
        let dev = Device::Cuda(0);
        let m = match Manager::new_base_on(dev) {
            Ok(m) => m,
            Err(e) => {
                if std::env::var_os("NDSCOPE_REQUIRE_GPU").is_some_and(|v| v == "1") {
                    panic!("NDSCOPE_REQUIRE_GPU=1, but there is no usable GPU: {e}");
                }
                println!("skipped on cuda: {e}");
                return;
            }
        };
        let replay = WorkspaceConfig::builder()
            .graph_replay(true)
            .build()
            .expect("a valid config");
        let ws = m.workspace("steps", replay).expect("a workspace");
        let x = m.randn([32, 32], DType::F32).expect("x");
        let out = m.zeros([32, 32], DType::F32).expect("out");
        let theirs = m
            .zeros([256], DType::F32)
            .expect("the other thread's array");
        let data: Vec<f32> = (0..256).map(|i| i as f32).collect();
        let step = |between: &dyn Fn()| {
            ws.cycle(|_| {
                let y = x.matmul(&x)?;
                between();
                out.assign_(&y.relu()?)
            })
            .expect("a cycle")
        };
        // Learned, then recorded.
        step(&|| ());
        step(&|| ());
        let (locked_tx, locked_rx) = mpsc::channel();
        let (go_tx, go_rx) = mpsc::channel();
        let (done_tx, done_rx) = mpsc::channel();
        let (theirs_ref, data_ref) = (&theirs, &data);
        std::thread::scope(|s| {
            s.spawn(move || {
                let ctx = Ctx::new("from_slice");
                let result = (|| {
                    let mut guard = write(&ctx, &theirs_ref.0)?;
                    locked_tx.send(()).expect("the cycle's thread waits");
                    go_rx.recv().expect("the cycle's thread says when");
                    AnyDevice::write(&ctx, &mut guard, data_ref)
                })();
                done_tx.send(result).expect("the cycle's thread waits");
            });
            locked_rx
                .recv()
                .expect("the copying thread locked its array");
            // Replayed: the product is held back when the other thread copies.
            step(&|| {
                go_tx.send(()).expect("the copying thread waits");
                done_rx
                    .recv()
                    .expect("the copying thread is done")
                    .expect("the copy succeeds");
            });
        });
        let g = ws.stats().graph;
        assert_eq!((g.replays, g.fallbacks), (1, 0), "{g:?}");
        assert_eq!(theirs.to_vec::<f32>().expect("read back"), data);
        let want = x.matmul(&x).and_then(|y| y.relu()).expect("eager");
        assert_eq!(
            out.to_vec::<f32>().expect("read back"),
            want.to_vec::<f32>().expect("read back")
        );
        m.close().expect("closes");
    }
}
