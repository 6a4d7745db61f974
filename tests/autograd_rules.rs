//! The rules of gradients, one test each: the `gradient()` array of an array that requires
//! gradients (made once, zeroed, owned and closed by the array's manager, named after it,
//! allowed on a capped model); the gradient collector (one per thread, where it comes from,
//! what closing it frees, `backward` adding up, `no_gradient`, predictors that never record);
//! and where the memory goes (the tape saves handles, backward's temporaries land in the
//! active scope, only the gradients are written in the model), with the errors for a saved
//! array closed or written in place before `backward`, a capped model, and two threads
//! training at once. The rules that involve device memory also run on a CUDA device where one
//! is usable (`device_tests!`).
//!
//! The tests count arrays with `memory_usage`, which is process-wide, so each holds `SERIAL`.
//! A counting allocator (per thread) sees whether closing a collector drops the handles its
//! tape held.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{Barrier, Mutex, MutexGuard, PoisonError};

use ndscope::{
    gradient_collector, is_grad_enabled, memory_usage, no_gradient, DType, Device, Error,
    HostArray, LearningPolicy, Manager, NDArray, NoGradientGuard, ParallelInference, Predictor,
    ResetPolicy, SgdUpdate, WorkspaceConfig,
};

mod common;
use common::{as_f64, device_tests};

// ---------------------------------------------------------------------------------------------
// Counting this thread's heap bytes

struct Counting;

thread_local! {
    /// Bytes allocated minus bytes freed by this thread.
    static LIVE: Cell<isize> = const { Cell::new(0) };
}

fn note(delta: isize) {
    // `try_with`: a thread being torn down may still free memory.
    let _ = LIVE.try_with(|c| c.set(c.get() + delta));
}

// SAFETY: every call is forwarded unchanged to the system allocator; we only count on the side
// (a const-initialised thread-local `Cell`, which allocates nothing).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract, which we pass on.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        // SAFETY: `ptr` came from `System` with this layout (all our allocations do).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize);
        // SAFETY: as for `dealloc`, and the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn live_heap_bytes() -> isize {
    LIVE.with(Cell::get)
}

// ---------------------------------------------------------------------------------------------
// Helpers

static SERIAL: Mutex<()> = Mutex::new(());

/// Held by every test: they compare process-wide array counts.
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Open arrays on `dev`, all managers together.
fn live(dev: Device) -> usize {
    memory_usage(dev).arrays
}

/// The names of the arrays `m` owns itself (not its children's), sorted; unnamed ones as `?`.
fn owned(m: &Manager) -> Vec<String> {
    let mut names: Vec<String> = m
        .report()
        .arrays
        .iter()
        .map(|a| a.name.clone().unwrap_or_else(|| "?".to_string()))
        .collect();
    names.sort();
    names
}

fn f32s(m: &Manager, data: &[f32], shape: &[usize]) -> NDArray {
    m.from_slice(data, shape).unwrap()
}

/// `n` small deterministic values (multiples of 1/8 in `[-1, 1]`), varied by `seed`.
fn data(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
        .collect()
}

/// A small classifier's parameters, in a manager named "model" on `dev`, all requiring
/// gradients: `w1 [6, 5]`, `b1 [5]`, `w2 [5, 3]`.
struct Mlp {
    model: Manager,
    w1: NDArray,
    b1: NDArray,
    w2: NDArray,
}

impl Mlp {
    fn new(dev: Device, seed: usize) -> Mlp {
        let model = Manager::new_base_on(dev).unwrap().with_name("model");
        let w1 = f32s(&model, &data(30, seed), &[6, 5]).with_name("w1");
        let b1 = f32s(&model, &data(5, seed + 1), &[5]).with_name("b1");
        let w2 = f32s(&model, &data(15, seed + 2), &[5, 3]).with_name("w2");
        for p in [&w1, &b1, &w2] {
            p.set_requires_gradient(true).unwrap();
        }
        Mlp { model, w1, b1, w2 }
    }

    fn params(&self) -> [&NDArray; 3] {
        [&self.w1, &self.b1, &self.w2]
    }

    /// The mean negative log-likelihood of a batch of 4 (input and labels made in the active
    /// scope): matmul, add, relu, matmul, log_softmax, pick, mean_all, neg.
    fn loss(&self, batch: &Manager, seed: usize) -> ndscope::Result<NDArray> {
        let (h, labels) = self.hidden(batch, seed)?;
        self.head(&h, &labels)
    }

    /// The first half of [`loss`](Self::loss): the hidden layer, and the labels.
    fn hidden(&self, batch: &Manager, seed: usize) -> ndscope::Result<(NDArray, NDArray)> {
        let x = batch
            .from_slice(&data(24, seed + 7), [4, 6])?
            .with_name("x");
        let labels = batch.from_slice(&[0i64, 2, 1, 2], [4])?.with_name("labels");
        let h = x.matmul(&self.w1)?.add(&self.b1)?.relu()?;
        Ok((h, labels))
    }

    /// The second half of [`loss`](Self::loss).
    fn head(&self, h: &NDArray, labels: &NDArray) -> ndscope::Result<NDArray> {
        let logp = h.matmul(&self.w2)?.log_softmax(1)?;
        logp.pick(labels, 1)?.mean_all()?.neg()
    }

    fn grads(&self) -> Vec<Vec<f64>> {
        self.params()
            .iter()
            .map(|p| as_f64(&p.gradient().unwrap()))
            .collect()
    }
}

/// `true` when every value is 0.
fn all_zero(a: &NDArray) -> bool {
    as_f64(a).iter().all(|&v| v == 0.0)
}

// ---------------------------------------------------------------------------------------------
// Gradients on arrays

device_tests!(the_gradient_is_made_once_zeroed_in_the_arrays_manager_and_named_after_it);
fn the_gradient_is_made_once_zeroed_in_the_arrays_manager_and_named_after_it(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap().with_name("model");
    let w = f32s(&m, &[1.0, 2.0, 3.0], &[3]).with_name("w");
    assert!(!w.requires_gradient());
    let before = live(dev);
    let err = w.gradient().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("'w'") && msg.contains("does not require gradients"),
        "{msg}"
    );
    assert!(
        msg.contains("set_requires_gradient(true)"),
        "says what to do: {msg}"
    );
    assert_eq!(live(dev), before, "asking made nothing");
    assert_eq!(owned(&m), ["w"]);

    w.set_requires_gradient(true).unwrap();
    assert!(w.requires_gradient());
    assert_eq!(live(dev), before + 1, "one array: the gradient");
    assert_eq!(owned(&m), ["w", "w.grad"], "owned by the array's manager");
    let g = w.gradient().unwrap();
    assert_eq!(g.manager().unwrap(), m);
    assert_eq!(g.name().as_deref(), Some("w.grad"));
    assert_eq!(
        (g.dims(), g.dtype(), g.device()),
        (w.dims(), w.dtype(), dev)
    );
    assert!(all_zero(&g), "zeroed");
    assert!(!g.requires_gradient(), "a gradient has no gradient itself");

    // Made once: asking again, or requiring again, gives the same array.
    assert_eq!(w.gradient().unwrap().id(), g.id());
    w.set_requires_gradient(true).unwrap();
    assert_eq!(w.gradient().unwrap().id(), g.id());
    assert_eq!(live(dev), before + 1);

    // Renamed with the array.
    w.set_name("weight");
    assert_eq!(g.name().as_deref(), Some("weight.grad"));
    assert_eq!(owned(&m), ["weight", "weight.grad"]);

    // An unnamed array's gradient is named after its id.
    let u = f32s(&m, &[1.0], &[1]);
    u.set_requires_gradient(true).unwrap();
    assert_eq!(
        u.gradient().unwrap().name(),
        Some(format!("{}.grad", u.id()))
    );

    // Closed with the manager.
    m.close().unwrap();
    assert!(!g.is_open());
    let err = w.gradient().unwrap_err();
    assert!(matches!(err, Error::ArrayClosed { .. }), "{err}");
    assert_eq!(live(dev), before - 1, "w, its gradient and u's are gone");
}

device_tests!(a_gradient_made_in_reused_workspace_memory_is_zeroed);
fn a_gradient_made_in_reused_workspace_memory_is_zeroed(dev: Device) {
    let _serial = serial();
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let ws = t.workspace("step", WorkspaceConfig::default()).unwrap();
    let fill = |c: &Manager| -> ndscope::Result<()> {
        c.full([64], 7.0, DType::F32)?;
        c.full([64], 7.0, DType::F32)?;
        Ok(())
    };
    ws.cycle(fill).unwrap(); // learned
    ws.cycle(fill).unwrap(); // in the block: its bytes now hold 7.0
    assert!(ws.stats().initialized);
    ws.cycle(|c| {
        let x = c.full([64], 1.0, DType::F32)?.with_name("x");
        x.set_requires_gradient(true)?;
        let g = x.gradient()?;
        assert_eq!(
            g.manager()?,
            *c,
            "the gradient of a cycle's array is the cycle's"
        );
        assert!(c.report().arrays.iter().all(|a| a.in_workspace));
        assert!(all_zero(&g), "stale block bytes are zeroed");
        Ok(())
    })
    .unwrap();
    t.close().unwrap();
}

device_tests!(the_gradient_of_a_borrowed_array_is_its_owners_and_outlives_the_borrower);
fn the_gradient_of_a_borrowed_array_is_its_owners_and_outlives_the_borrower(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap().with_name("model");
    let w = f32s(&m, &[1.0, 2.0], &[2]).with_name("w");
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let g = {
        let step = t.sub_scope().unwrap();
        w.temp_attach(&step).unwrap();
        assert_eq!(w.manager().unwrap(), *step, "borrowed");
        w.set_requires_gradient(true).unwrap();
        let g = w.gradient().unwrap();
        assert_eq!(
            g.manager().unwrap(),
            m,
            "made in the manager the array belongs to, not in the borrower"
        );
        step.close().unwrap();
        g
    };
    assert_eq!(w.manager().unwrap(), m, "given back");
    assert!(g.is_open(), "the gradient did not close with the borrower");
    assert_eq!(w.gradient().unwrap().id(), g.id());
    assert_eq!(owned(&m), ["w", "w.grad"]);
    m.close().unwrap();
    assert!(!g.is_open(), "closed with its owner");
    t.close().unwrap();
}

#[test]
fn requiring_gradients_toggles_and_needs_a_float_array() {
    let _serial = serial();
    let m = Manager::new_base().with_name("model");
    let w = f32s(&m, &[1.0, 2.0], &[2]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let g = w.gradient().unwrap();
    w.set_requires_gradient(false).unwrap();
    assert!(!w.requires_gradient());
    let err = w.gradient().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    w.set_requires_gradient(true).unwrap();
    assert!(w.requires_gradient());
    assert_eq!(w.gradient().unwrap().id(), g.id(), "turning it off kept it");

    let n = m.from_slice(&[1i32, 2], [2]).unwrap().with_name("n");
    let before = live(Device::Cpu);
    let err = n.set_requires_gradient(true).unwrap_err();
    assert!(matches!(err, Error::DTypeMismatch { .. }), "{err}");
    assert!(err.to_string().contains("'n'"), "{err}");
    assert!(!n.requires_gradient(), "refused: nothing changed");
    assert_eq!(live(Device::Cpu), before, "no gradient made");
    // Turning it off is always fine.
    n.set_requires_gradient(false).unwrap();
    m.close().unwrap();
}

#[test]
fn gradients_are_allowed_on_a_capped_model() {
    let _serial = serial();
    let m = Manager::new_base().with_name("model");
    let w = f32s(&m, &[1.0, 2.0], &[2]).with_name("w");
    m.cap();
    assert!(matches!(
        m.zeros([2], DType::F32).unwrap_err(),
        Error::Capped { .. }
    ));
    w.set_requires_gradient(true).unwrap();
    assert_eq!(owned(&m), ["w", "w.grad"]);
    assert!(m.is_capped(), "still capped");
    m.close().unwrap();
    assert!(!w.is_open());
}

// ---------------------------------------------------------------------------------------------
// The collector

#[test]
fn a_collector_comes_from_a_manager_or_the_active_scope() {
    let _serial = serial();
    assert!(Manager::active().is_none());
    let err = gradient_collector().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("no scope is active"), "{err}");
    assert!(!is_grad_enabled(), "the failed call opened nothing");

    let t = Manager::new_base().with_name("trainer");
    {
        let s = t.sub_scope().unwrap();
        let _active = s.activate();
        let c = gradient_collector().unwrap();
        assert_eq!(c.manager(), &*s, "the active scope's");
        assert!(is_grad_enabled());
    }
    assert!(!is_grad_enabled(), "dropping it ends recording");
    let c = t.gradient_collector().unwrap();
    assert_eq!(c.manager(), &t);
    c.close();

    // Not on a capped manager: backward's temporaries would stay in it.
    t.cap();
    let err = t.gradient_collector().unwrap_err();
    assert!(matches!(err, Error::Capped { .. }), "{err}");
    assert!(!is_grad_enabled());
    t.close().unwrap();
}

#[test]
fn one_collector_per_thread_and_the_second_says_where_the_first_was_opened() {
    let _serial = serial();
    let t = Manager::new_base().with_name("trainer");
    let (first, line) = (t.gradient_collector().unwrap(), line!());
    let err = t.gradient_collector().unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("already open"), "{msg}");
    assert!(
        msg.contains(&format!("{}:{line}:", file!())),
        "names where the first was opened (line {line}): {msg}"
    );
    // Another thread has its own.
    std::thread::scope(|s| {
        s.spawn(|| {
            assert!(!is_grad_enabled(), "threads are independent");
            let other = t.gradient_collector().unwrap();
            assert!(is_grad_enabled());
            other.close();
        });
    });
    assert!(is_grad_enabled(), "the other thread closed its own only");
    drop(first);
    let second = t.gradient_collector().unwrap();
    second.close();
    let third = t.gradient_collector().unwrap();
    drop(third);
    t.close().unwrap();
}

/// One step in a scope of `t` with a collector; records `exp` and `sum_all` on `w` when
/// `record`, then closes the collector (`close` or drop) and the scope.
fn step_and_close(t: &Manager, w: &NDArray, record: bool, by_drop: bool) {
    let s = t.sub_scope().unwrap();
    let active = s.activate();
    let c = s.gradient_collector().unwrap();
    if record {
        let y = w.exp().unwrap();
        let _z = y.sum_all().unwrap();
    }
    if by_drop {
        drop(c);
    } else {
        c.close();
    }
    drop(active);
    s.close().unwrap();
}

#[test]
fn closing_a_collector_frees_its_tape() {
    let _serial = serial();
    let t = Manager::new_base().with_name("trainer");
    let w = f32s(&t, &[1.0, 2.0], &[2]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    for by_drop in [false, true] {
        // Warm up: the tape's capacity is kept, the thread's scope stack grows once.
        step_and_close(&t, &w, true, by_drop);
        step_and_close(&t, &w, false, by_drop);
        let before = live_heap_bytes();
        step_and_close(&t, &w, true, by_drop);
        let left = live_heap_bytes() - before;
        assert_eq!(
            left, 0,
            "closing the collector (by drop: {by_drop}) left {left} heap bytes: its tape still \
             holds the handles of the arrays it recorded"
        );
    }
    // And what was recorded under a closed collector is on no tape.
    let s = t.sub_scope().unwrap();
    let _active = s.activate();
    let c = gradient_collector().unwrap();
    let loss = w.square().unwrap().sum_all().unwrap();
    c.close();
    let c = gradient_collector().unwrap();
    let err = c.backward(&loss).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    assert!(err.to_string().contains("was not recorded"), "{err}");
    assert!(all_zero(&w.gradient().unwrap()));
    drop(c);
    drop(_active);
    s.close().unwrap();
    t.close().unwrap();
}

#[test]
fn backward_adds_into_the_gradient() {
    let _serial = serial();
    let m = Manager::new_base().with_name("model");
    let w = f32s(&m, &[1.0, -2.0, 3.0], &[3]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let g = w.gradient().unwrap();
    let t = Manager::new_base().with_name("trainer");
    // Two collectors, one backward each: 2w + 2w.
    for _ in 0..2 {
        t.scope(|s| {
            let c = s.gradient_collector()?;
            c.backward(&w.square()?.sum_all()?)
        })
        .unwrap();
    }
    assert_eq!(g.to_vec::<f32>().unwrap(), [4.0, -8.0, 12.0]);
    // One collector, two backwards: the tape starts again after each.
    t.scope(|s| {
        let c = s.gradient_collector()?;
        let first = w.square()?.sum_all()?;
        c.backward(&first)?;
        c.backward(&w.mul_scalar(3.0)?.sum_all()?)?;
        // The first loss's records were used up.
        let err = c.backward(&first).unwrap_err();
        assert!(err.to_string().contains("was not recorded"), "{err}");
        Ok(())
    })
    .unwrap();
    assert_eq!(g.to_vec::<f32>().unwrap(), [9.0, -9.0, 21.0]);
    assert_eq!(w.gradient().unwrap().id(), g.id(), "in place");
    assert_eq!(owned(&m), ["w", "w.grad"]);
    t.close().unwrap();
    m.close().unwrap();
}

#[test]
fn no_gradient_and_its_guard_turn_recording_off() {
    let _serial = serial();
    assert!(!is_grad_enabled(), "no collector");
    let m = Manager::new_base().with_name("model");
    let w = f32s(&m, &[1.0, 2.0], &[2]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let t = Manager::new_base().with_name("trainer");
    let s = t.sub_scope().unwrap();
    let _active = s.activate();
    let c = gradient_collector().unwrap();
    assert!(is_grad_enabled());

    // Ops in no_gradient are not recorded: backward from them finds nothing.
    let (untracked, inside) = no_gradient(|| (w.square().unwrap(), is_grad_enabled()));
    assert!(!inside);
    assert!(is_grad_enabled(), "on again after it");
    let err = c.backward(&untracked.sum_all().unwrap()).unwrap_err();
    assert!(err.to_string().contains("was not recorded"), "{err}");
    // A loss with a recorded and an unrecorded part: only the recorded one has a gradient.
    let loss = w
        .sum_all()
        .unwrap()
        .add(&no_gradient(|| w.square().unwrap().sum_all().unwrap()))
        .unwrap();
    c.backward(&loss).unwrap();
    assert_eq!(
        w.gradient().unwrap().to_vec::<f32>().unwrap(),
        [1.0, 1.0],
        "d(Σw)/dw only: the square was not recorded"
    );

    // The guard, nested.
    {
        let _outer = NoGradientGuard::new();
        assert!(!is_grad_enabled());
        {
            let _inner = NoGradientGuard::default();
            assert!(!is_grad_enabled());
        }
        assert!(!is_grad_enabled(), "the outer guard still holds");
        let y = w.exp().unwrap();
        drop(_outer);
        assert!(is_grad_enabled());
        let err = c.backward(&y.sum_all().unwrap()).unwrap_err();
        assert!(err.to_string().contains("was not recorded"), "{err}");
    }
    // In-place ops reading tracked arrays are allowed while recording is off.
    let z = s.zeros([2], DType::F32).unwrap();
    assert!(z.add_(&w).is_err(), "refused while recording");
    no_gradient(|| z.add_(&w)).unwrap();
    assert_eq!(z.to_vec::<f32>().unwrap(), [1.0, 2.0]);
    drop(c);
    assert!(!is_grad_enabled());
    drop(_active);
    s.close().unwrap();
    t.close().unwrap();
    m.close().unwrap();
}

#[test]
fn predictors_never_record() {
    let _serial = serial();
    let m = Manager::new_base().with_name("model");
    let w = f32s(&m, &[0.5; 4], &[4]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let step_w = w.clone();
    // The step reports whether it records, and reads `w` in an in-place op, which a recording
    // collector refuses.
    let predictor = Predictor::new(&m, move |c: &Manager, x: &HostArray| {
        let seen = is_grad_enabled();
        let acc = c.from_host(x)?;
        acc.add_(&step_w)?;
        Ok((seen, acc.mul(&step_w)?.sum_all()?.to_scalar::<f32>()?))
    })
    .unwrap();
    let pi_w = w.clone();
    let service = ParallelInference::builder(&m)
        .workers(2)
        .build(move |c, x| {
            assert!(!is_grad_enabled());
            // Even a collector the step opens on the worker thread records nothing.
            let collector = c.gradient_collector()?;
            let seen = is_grad_enabled();
            drop(collector);
            let acc = x.mul_scalar(1.0)?;
            acc.add_(&pi_w)?;
            acc.mul_scalar(if seen { -1.0 } else { 1.0 })
        })
        .unwrap();
    let input = HostArray::from_vec(vec![1.0f32; 4], [4]).unwrap();

    let t = Manager::new_base().with_name("trainer");
    let s = t.sub_scope().unwrap();
    let _active = s.activate();
    let c = gradient_collector().unwrap();
    let (seen, value) = predictor.predict(&input).unwrap();
    assert!(!seen, "the predictor's step ran with recording off");
    assert_eq!(value, 3.0);
    assert!(is_grad_enabled(), "on again on the calling thread");
    for _ in 0..4 {
        let out = service.predict(input.clone()).unwrap();
        assert_eq!(
            out.as_slice::<f32>().unwrap(),
            [1.5; 4],
            "no worker recorded"
        );
    }
    assert!(is_grad_enabled());
    // The calling thread's collector works as before.
    c.backward(&w.square().unwrap().sum_all().unwrap()).unwrap();
    assert_eq!(w.gradient().unwrap().to_vec::<f32>().unwrap(), [1.0; 4]);
    drop(c);
    drop(_active);
    s.close().unwrap();
    drop(service);
    drop(predictor);
    t.close().unwrap();
    m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Where the memory goes

/// Where a step runs.
#[derive(Clone, Copy, Debug)]
enum StepIn {
    Scope,
    Cycle,
}

device_tests!(the_tape_saves_handles_and_backward_writes_only_the_gradients_in_the_model);
fn the_tape_saves_handles_and_backward_writes_only_the_gradients_in_the_model(dev: Device) {
    let _serial = serial();
    let mlp = Mlp::new(dev, 1);
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let model_arrays = owned(&mlp.model);
    assert_eq!(model_arrays.len(), 6, "3 parameters, 3 gradients");
    let grad_ids: Vec<_> = mlp
        .params()
        .iter()
        .map(|p| p.gradient().unwrap().id())
        .collect();
    let ws = t.workspace("step", WorkspaceConfig::default()).unwrap();
    let baseline = live(dev);

    // The forward pass alone, unrecorded: how many arrays it makes.
    let unrecorded = t
        .scope(|s| {
            mlp.loss(s, 3)?;
            Ok(s.report().arrays.len())
        })
        .unwrap();
    assert_eq!(unrecorded, 2 + 8, "x, labels and 8 op results");
    assert_eq!(live(dev), baseline);

    for (round, place) in [StepIn::Scope, StepIn::Cycle, StepIn::Cycle, StepIn::Scope]
        .into_iter()
        .enumerate()
    {
        let step = |s: &Manager| -> ndscope::Result<()> {
            let c = s.gradient_collector()?;
            let loss = mlp.loss(s, 3)?;
            // Recording made no array: the tape holds the forward's own results.
            assert_eq!(s.report().arrays.len(), unrecorded, "{place:?}");
            assert_eq!(
                live(dev),
                baseline + unrecorded,
                "{place:?}: none elsewhere"
            );
            c.backward(&loss)?;
            // Backward's temporaries are in the step, not anywhere else.
            let here = s.report().arrays.len();
            assert!(here > unrecorded, "{place:?}: backward's temporaries");
            assert_eq!(
                live(dev),
                baseline + here,
                "{place:?}: all of them in the step"
            );
            assert_eq!(
                owned(&mlp.model),
                model_arrays,
                "{place:?}: the model holds the same"
            );
            assert_eq!(t.report().arrays.len(), 0, "{place:?}");
            Ok(())
        };
        match place {
            StepIn::Scope => t.scope(step).unwrap(),
            StepIn::Cycle => ws.cycle(step).unwrap(),
        }
        assert_eq!(live(dev), baseline, "{place:?}: all freed with the step");
        let ids: Vec<_> = mlp
            .params()
            .iter()
            .map(|p| p.gradient().unwrap().id())
            .collect();
        assert_eq!(ids, grad_ids, "the same gradient arrays");
        // Every step adds the same gradient.
        let grads = mlp.grads();
        if round == 0 {
            assert!(
                grads.iter().all(|g| g.iter().any(|&v| v != 0.0)),
                "{grads:?}"
            );
        }
        for p in mlp.params() {
            p.gradient().unwrap().fill_(0.0).unwrap();
        }
        if round > 0 {
            assert_eq!(grads, first_grads(dev), "round {round}");
        }
    }
    t.close().unwrap();
    mlp.model.close().unwrap();
}

/// The gradients of `Mlp::loss(3)` from a fresh model of seed 1, computed once.
fn first_grads(dev: Device) -> Vec<Vec<f64>> {
    let fresh = Mlp::new(dev, 1);
    let t = Manager::new_base_on(dev).unwrap();
    t.scope(|s| s.gradient_collector()?.backward(&fresh.loss(s, 3)?))
        .unwrap();
    let grads = fresh.grads();
    t.close().unwrap();
    fresh.model.close().unwrap();
    grads
}

device_tests!(backward_temporaries_go_to_the_active_scope_else_to_the_collectors_manager);
fn backward_temporaries_go_to_the_active_scope_else_to_the_collectors_manager(dev: Device) {
    let _serial = serial();
    let mlp = Mlp::new(dev, 2);
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let baseline = live(dev);

    // Forward in one scope, backward with another one active.
    let forward = t.sub_scope().unwrap();
    let collector;
    let loss;
    {
        let _active = forward.activate();
        collector = gradient_collector().unwrap();
        loss = mlp.loss(&forward, 4).unwrap();
    }
    let made = forward.report().arrays.len();
    let later = t.sub_scope().unwrap();
    {
        let _active = later.activate();
        collector.backward(&loss).unwrap();
    }
    assert_eq!(
        forward.report().arrays.len(),
        made,
        "nothing added to the forward's scope"
    );
    let temporaries = later.report().arrays.len();
    assert!(temporaries > 0);
    assert_eq!(live(dev), baseline + made + temporaries);
    assert_eq!(owned(&mlp.model).len(), 6);
    later.close().unwrap();
    assert_eq!(live(dev), baseline + made, "freed when that scope closes");
    drop(collector);
    forward.close().unwrap();
    assert_eq!(live(dev), baseline);
    let want = mlp.grads();
    for p in mlp.params() {
        p.gradient().unwrap().fill_(0.0).unwrap();
    }

    // No scope active: the forward's results go to the owner of their first input (`x`, in
    // `inputs`), backward's temporaries to the collector's manager.
    assert!(Manager::active().is_none());
    let inputs = t.new_sub_manager().unwrap().with_name("inputs");
    let home = t.new_sub_manager().unwrap().with_name("home");
    let collector = home.gradient_collector().unwrap();
    let x = inputs.from_slice(&data(24, 4 + 7), [4, 6]).unwrap();
    let labels = inputs.from_slice(&[0i64, 2, 1, 2], [4]).unwrap();
    let h = x
        .matmul(&mlp.w1)
        .unwrap()
        .add(&mlp.b1)
        .unwrap()
        .relu()
        .unwrap();
    let loss = h
        .matmul(&mlp.w2)
        .unwrap()
        .log_softmax(1)
        .unwrap()
        .pick(&labels, 1)
        .unwrap()
        .mean_all()
        .unwrap()
        .neg()
        .unwrap();
    let made = inputs.report().arrays.len();
    assert_eq!(made, 10);
    assert_eq!(home.report().arrays.len(), 0);
    collector.backward(&loss).unwrap();
    assert_eq!(inputs.report().arrays.len(), made);
    let temporaries = home.report().arrays.len();
    assert!(
        temporaries > 0,
        "backward's temporaries went to the collector's manager"
    );
    assert_eq!(live(dev), baseline + made + temporaries);
    assert_eq!(
        mlp.grads(),
        want,
        "the same gradients wherever the temporaries go"
    );
    assert!(Manager::active().is_none(), "backward left no scope active");
    drop(collector);
    home.close().unwrap();
    inputs.close().unwrap();
    assert_eq!(live(dev), baseline);
    t.close().unwrap();
    mlp.model.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Saved arrays closed or written before backward

/// Asserts `err` is the `ArrayClosed` of backward for `array` saved by `op` at `line`.
fn assert_closed_saved(err: &Error, array: &str, op: &str, line: u32) {
    assert!(matches!(err, Error::ArrayClosed { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("GradientCollector::backward"), "{msg}");
    assert!(
        msg.contains(&format!("'{array}'")),
        "names the array: {msg}"
    );
    assert!(msg.contains(&format!("`{op}`")), "names the op: {msg}");
    assert!(
        msg.contains(&format!("{}:{line}:", file!())),
        "says where the op was called (line {line}): {msg}"
    );
}

device_tests!(a_saved_array_closed_before_backward_is_array_closed_naming_it_and_its_op);
fn a_saved_array_closed_before_backward_is_array_closed_naming_it_and_its_op(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap().with_name("model");
    let w = f32s(&m, &[0.5; 64], &[64]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let collector = t.gradient_collector().unwrap();

    // Its scope ended (`exp` saves its result; the loss was returned out of the scope).
    let s = t.sub_scope().unwrap();
    let (loss, line) = {
        let _active = s.activate();
        let (y, line) = (w.exp().unwrap().with_name("y"), line!());
        (s.ret(&y.sum_all().unwrap()).unwrap(), line)
    };
    s.close().unwrap();
    let err = collector.backward(&loss).unwrap_err();
    assert_closed_saved(&err, "y", "exp", line);
    assert!(all_zero(&w.gradient().unwrap()), "nothing accumulated");

    // close() (`mul` saves its inputs).
    let x = t.full([64], 2.0, DType::F32).unwrap().with_name("x");
    let (y, line) = (w.mul(&x).unwrap(), line!());
    let loss = y.sum_all().unwrap();
    x.close().unwrap();
    let err = collector.backward(&loss).unwrap_err();
    assert_closed_saved(&err, "x", "mul", line);
    assert!(err.to_string().contains("closed by the user"), "{err}");
    assert!(all_zero(&w.gradient().unwrap()));

    // A circular workspace wrote over it.
    let conf = WorkspaceConfig::builder()
        .allocation(ndscope::AllocationPolicy::Strict)
        .initial_size(1024)
        .learning(LearningPolicy::None)
        .reset(ResetPolicy::EndOfBuffer)
        .build()
        .unwrap();
    let ring = t.workspace("ring", conf).unwrap();
    let (y, line) = ring
        .cycle(|c| Ok((c.ret(&w.exp()?.with_name("ring-y"))?, line!())))
        .unwrap();
    let loss = y.sum_all().unwrap(); // in `t`, which holds y now
    for _ in 0..4 {
        ring.cycle(|c| c.full([64], 3.0, DType::F32).map(|_| ()))
            .unwrap();
    }
    assert!(!y.is_open(), "overwritten");
    let err = collector.backward(&loss).unwrap_err();
    assert_closed_saved(&err, "ring-y", "exp", line);
    assert!(err.to_string().contains("overwritten"), "{err}");
    assert!(all_zero(&w.gradient().unwrap()));

    // Still usable afterwards.
    collector.backward(&w.sum_all().unwrap()).unwrap();
    assert_eq!(as_f64(&w.gradient().unwrap()), vec![1.0; 64]);
    drop(collector);
    t.close().unwrap();
    m.close().unwrap();
}

/// Asserts `err` is backward's error for `array` written in place after `op` saved it.
fn assert_modified(err: &Error, array: &str, op: &str) {
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("modified by an in-place operation"), "{msg}");
    assert!(msg.contains(&format!("'{array}'")), "{msg}");
    assert!(msg.contains(&format!("`{op}`")), "{msg}");
}

device_tests!(a_saved_array_written_in_place_before_backward_is_an_error_not_a_wrong_gradient);
fn a_saved_array_written_in_place_before_backward_is_an_error_not_a_wrong_gradient(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap().with_name("model");
    let w = f32s(&m, &[0.5, -1.0, 2.0], &[3]).with_name("w");
    w.set_requires_gradient(true).unwrap();
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let s = t.sub_scope().unwrap();
    let _active = s.activate();
    let collector = gradient_collector().unwrap();
    let x = s.full([3], 2.0, DType::F32).unwrap().with_name("x");
    let c = s.full([3], 1.0, DType::F32).unwrap().with_name("c");

    type Case<'a> = (&'a str, &'a str, Box<dyn Fn(&NDArray, &NDArray) + 'a>);
    let cases: Vec<Case> = vec![
        // `exp` saves its output; written by mul_scalar_.
        ("y", "exp", Box::new(|_, y| y.mul_scalar_(2.0).unwrap())),
        // `mul` saves its inputs: x written by fill_, by add_, the leaf w by mul_scalar_.
        ("x", "mul", Box::new(|x, _| x.fill_(3.0).unwrap())),
        ("x", "mul", Box::new(|x, _| x.add_(&c).unwrap())),
        ("w", "mul", Box::new(|_, _| w.mul_scalar_(1.0).unwrap())),
        // `add` saves nothing, but its result written in place would change the gradient.
        ("y", "add", Box::new(|_, y| y.mul_scalar_(2.0).unwrap())),
    ];
    for (array, op, write) in cases {
        let y = match op {
            "exp" => w.exp(),
            "mul" => w.mul(&x),
            _ => w.add(&x),
        }
        .unwrap()
        .with_name("y");
        write(&x, &y);
        let loss = y.sum_all().unwrap();
        let err = collector.backward(&loss).unwrap_err();
        assert_modified(&err, array, op);
        assert!(
            all_zero(&w.gradient().unwrap()),
            "{array} {op}: nothing accumulated"
        );
    }

    // An in-place op reading a tracked array while recording is refused at the call, and
    // changes nothing.
    let z = s.zeros([3], DType::F32).unwrap().with_name("z");
    let y = w.mul(&x).unwrap().with_name("tracked");
    for (source, name) in [(&w, "'w'"), (&y, "'tracked'")] {
        let line = line!() + 1;
        let err = z.add_(source).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("in-place") && msg.contains(name), "{msg}");
        assert!(msg.contains(&format!("{}:{line}:", file!())), "{msg}");
        assert!(all_zero(&z), "unchanged");
    }
    // The tape is intact: backward through y works.
    collector.backward(&y.sum_all().unwrap()).unwrap();
    assert_eq!(
        as_f64(&w.gradient().unwrap()),
        as_f64(&x),
        "d(Σ w·x)/dw = x"
    );
    drop(collector);
    drop(_active);
    s.close().unwrap();
    t.close().unwrap();
    m.close().unwrap();
}

device_tests!(a_step_on_a_capped_model_without_its_scope_is_capped_at_its_line);
fn a_step_on_a_capped_model_without_its_scope_is_capped_at_its_line(dev: Device) {
    let _serial = serial();
    let mlp = Mlp::new(dev, 5);
    mlp.model.cap();
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let err = mlp.model.gradient_collector().unwrap_err();
    assert!(matches!(err, Error::Capped { .. }), "{err}");

    let collector = t.gradient_collector().unwrap();
    // No scope active: the result would land in the model, which owns the first input.
    let (result, line) = (mlp.w1.mul_scalar(2.0), line!());
    match result {
        Err(Error::Capped { at, manager, .. }) => {
            assert_eq!((at.file(), at.line()), (file!(), line));
            assert!(manager.contains("model"), "{manager}");
        }
        other => panic!("expected Capped, got {other:?}"),
    }
    assert_eq!(owned(&mlp.model).len(), 6);
    drop(collector);

    // With the step's scope active it works and leaves nothing in the model.
    let before = owned(&mlp.model);
    t.scope(|s| {
        let c = s.gradient_collector()?;
        c.backward(&mlp.loss(s, 5)?)
    })
    .unwrap();
    assert_eq!(owned(&mlp.model), before);
    assert!(mlp.grads().iter().all(|g| g.iter().any(|&v| v != 0.0)));
    assert!(mlp.model.is_capped());
    t.close().unwrap();
    mlp.model.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Threads

/// Two training threads in lockstep: at each step one leads (opens its collector and records
/// the first half of its forward pass, then the rest and backward) while the other runs a
/// whole step (opens its collector, records, backward, closes) between the leader's two
/// halves. Roles swap at each step. A tape or recording flag shared between threads would
/// lose the leader's second half or refuse the follower's collector.
#[derive(Clone, Copy)]
struct Lockstep<'a> {
    barrier: &'a Barrier,
    me: usize,
}

/// `steps` SGD steps of `Mlp::new(dev, seed)` with a collector each, in a workspace: the
/// gradients of every step (or its error). The barrier waits happen whatever fails, so the
/// other thread never hangs.
fn train(
    dev: Device,
    seed: usize,
    steps: usize,
    lockstep: Option<Lockstep>,
) -> Vec<Result<Vec<Vec<f64>>, String>> {
    let mlp = Mlp::new(dev, seed);
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let ws = t.workspace("step", WorkspaceConfig::default()).unwrap();
    let mut seen = Vec::new();
    for i in 0..steps {
        let at = seed + i;
        let result = ws.cycle(|s| match lockstep {
            None => gradient_collector()?.backward(&mlp.loss(s, at)?),
            Some(Lockstep { barrier, me }) if (i + me) % 2 == 0 => {
                let collector = gradient_collector();
                barrier.wait();
                let first = mlp.hidden(s, at);
                barrier.wait();
                let result = (|| {
                    let collector = collector?;
                    let (h, labels) = first?;
                    collector.backward(&mlp.head(&h, &labels)?)
                })();
                barrier.wait();
                result
            }
            Some(Lockstep { barrier, .. }) => {
                barrier.wait();
                let result = (|| gradient_collector()?.backward(&mlp.loss(s, at)?))();
                barrier.wait();
                barrier.wait();
                result
            }
        });
        seen.push(result.map(|()| mlp.grads()).map_err(|e| e.to_string()));
        for p in mlp.params() {
            let g = p.gradient().unwrap();
            p.sgd_update_(&g, None, SgdUpdate::new(0.25)).unwrap();
            g.fill_(0.0).unwrap();
        }
    }
    t.close().unwrap();
    mlp.model.close().unwrap();
    seen
}

device_tests!(two_threads_train_two_models_with_their_own_collectors_at_once);
fn two_threads_train_two_models_with_their_own_collectors_at_once(dev: Device) {
    let _serial = serial();
    const STEPS: usize = 12;
    let alone: Vec<_> = [10, 20].map(|seed| train(dev, seed, STEPS, None)).into();
    assert!(alone.iter().flatten().all(Result::is_ok), "{alone:?}");
    assert_ne!(alone[0], alone[1], "two different computations");
    let barrier = Barrier::new(2);
    let together: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = [10, 20]
            .into_iter()
            .enumerate()
            .map(|(me, seed)| {
                let lockstep = Lockstep {
                    barrier: &barrier,
                    me,
                };
                s.spawn(move || train(dev, seed, STEPS, Some(lockstep)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        for (step, (a, b)) in a.iter().zip(b).enumerate() {
            assert_eq!(
                a, b,
                "thread {i}, step {step}: the gradients equal those of the step alone"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Memory over many steps

device_tests!(memory_stays_flat_over_thousands_of_autograd_steps);
fn memory_stays_flat_over_thousands_of_autograd_steps(dev: Device) {
    let _serial = serial();
    // The simulated GPU is slow: fewer steps there.
    let steps = if dev.is_cpu() { 2000 } else { 200 };
    let mlp = Mlp::new(dev, 6);
    mlp.model.cap();
    let t = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let ws = t.workspace("step", WorkspaceConfig::default()).unwrap();
    let step = |i: usize| -> ndscope::Result<()> {
        ws.cycle(|s| {
            let c = gradient_collector()?;
            let loss = mlp.loss(s, i % 5)?;
            c.backward(&loss)?;
            // Read, as a training loop does: a wait for the device, which also drains its
            // queue of `pick`'s index checks (bounded, but up to 65536 between two waits).
            loss.to_scalar::<f32>().map(|_| ())
        })?;
        for p in mlp.params() {
            let g = p.gradient()?;
            p.sgd_update_(&g, None, SgdUpdate::new(0.05))?;
            g.fill_(0.0)?;
        }
        Ok(())
    };
    ndscope::testing::assert_no_growth(&t, 5, steps, step);
    // Then the device's figures and this thread's heap over more steps.
    let before = memory_usage(dev);
    let heap = live_heap_bytes();
    for i in 0..100 {
        step(i).unwrap();
    }
    let after = memory_usage(dev);
    assert_eq!(after.in_use, before.in_use, "bytes in use are flat");
    assert_eq!(after.arrays, before.arrays);
    assert_eq!(
        after.driver_allocations, before.driver_allocations,
        "no allocation from the system after learning"
    );
    assert_eq!(
        live_heap_bytes(),
        heap,
        "heap bytes of this thread are flat (the tape does not grow)"
    );
    assert_eq!(ws.stats().cycles, steps as u64 + 105);
    assert_eq!(
        live_heap_bytes(),
        heap,
        "heap bytes of this thread are flat (the tape does not grow)"
    );
    t.close().unwrap();
    mlp.model.close().unwrap();
}
