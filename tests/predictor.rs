//! Predictors: each call in its own context scope, owned data out, leaks refused at their line,
//! many threads, panics, and freeing from any thread.

use std::sync::Arc;

use ndscope::{
    destroy_all_workspaces_for_current_thread, DType, Error, HostArray, Manager, NDArray, Predictor,
};

/// A model with one weight matrix `[4, 3]` of 0.5.
fn model() -> (Manager, NDArray) {
    let m = Manager::new_base().with_name("model");
    let w = m.full([4, 3], 0.5, DType::F32).unwrap().with_name("w");
    (m, w)
}

fn input(v: f32) -> HostArray {
    HostArray::from_vec(vec![v; 4], [1, 4]).unwrap()
}

#[test]
fn every_call_runs_in_a_context_that_closes_with_it() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        assert_eq!(
            Manager::active().as_ref(),
            Some(ctx),
            "the context is active"
        );
        let x = ctx.from_host(x)?;
        let h = x.matmul(&w)?; // a temporary: lands in the context
        assert_eq!(h.manager()?, *ctx);
        h.relu()?.sum_all()?.to_scalar::<f32>()
    })
    .unwrap();
    for i in 0..10 {
        assert_eq!(predictor.predict(&input(i as f32)).unwrap(), 6.0 * i as f32);
    }
    assert_eq!(predictor.calls(), 10);
    assert_eq!(predictor.contexts(), 1, "one thread: one context, reused");
    let report = predictor.manager().report();
    assert_eq!(report.total_arrays(), 0, "nothing of a call survives it");
    assert!(report.children.is_empty());
    let ws = &report.workspaces[0];
    assert_eq!(ws.name, "context-0");
    assert_eq!(ws.stats.cycles, 10);
    assert!(ws.stats.initialized, "learned from the first call");
    assert!(model.is_capped() && predictor.manager().is_capped());
    assert!(predictor.debug_dump(0).contains("context-0"));
    drop(predictor);
    model.close().unwrap();
}

#[test]
fn an_array_returned_from_a_step_is_closed_with_its_context() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        ctx.from_host(x)?.matmul(&w)
    })
    .unwrap();
    let y = predictor.predict(&input(1.0)).unwrap();
    let err = y.to_vec::<f32>().unwrap_err();
    assert!(matches!(err, Error::ArrayClosed { .. }), "{err}");
    assert!(err.to_string().contains("workspace cycle ended"), "{err}");
    model.close().unwrap();
}

#[test]
fn a_step_that_leaves_an_array_in_the_predictor_or_the_model_fails_at_its_line() {
    let (model, w) = model();
    let lines = Arc::new(std::sync::Mutex::new(0u32));
    let seen = Arc::clone(&lines);
    let predictor = Predictor::new(&model, move |ctx: &Manager, which: &u32| {
        let y = ctx.ones([2], DType::F32)?;
        let model = w.manager()?;
        let (line, result) = match which {
            0 => (line!(), ctx.ret(&y).map(drop)),
            1 => (line!(), y.attach(&model)),
            _ => (line!(), model.zeros([1], DType::F32).map(drop)),
        };
        *seen.lock().unwrap() = line;
        result
    })
    .unwrap();
    for (which, into) in [(0u32, "predictor"), (1, "model"), (2, "model")] {
        let err = predictor.predict(&which).unwrap_err();
        match &err {
            Error::Capped { at, manager, .. } => {
                assert_eq!(at.file(), file!(), "{err}");
                assert_eq!(at.line(), *lines.lock().unwrap(), "{err}");
                assert!(manager.contains(into), "{err}");
            }
            other => panic!("expected Capped, got {other}"),
        }
    }
    assert_eq!(model.report().total_arrays(), 1, "only w");
    assert_eq!(predictor.manager().report().total_arrays(), 0);
    model.close().unwrap();
}

#[test]
fn a_predictor_serves_many_threads_at_once() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        let x = ctx.from_host(x)?;
        x.matmul(&w)?.to_host()
    })
    .unwrap();
    std::thread::scope(|s| {
        for t in 0..8 {
            let predictor = &predictor;
            s.spawn(move || {
                for i in 0..50 {
                    let v = (t * 100 + i) as f32;
                    let y = predictor.predict(&input(v)).unwrap();
                    assert_eq!(y.dims(), &[1, 3]);
                    assert_eq!(y.as_slice::<f32>().unwrap(), &[2.0 * v; 3]);
                }
            });
        }
    });
    assert_eq!(predictor.calls(), 400);
    assert!(
        (1..=8).contains(&predictor.contexts()),
        "{}",
        predictor.contexts()
    );
    assert_eq!(predictor.manager().report().total_arrays(), 0);
    model.close().unwrap();
}

#[test]
fn a_panicking_step_gives_an_error_frees_its_context_and_the_predictor_goes_on() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        let x = ctx.from_host(x)?;
        let y = x.matmul(&w)?;
        if x.to_vec::<f32>()?[0] < 0.0 {
            panic!("negative input");
        }
        y.to_host()
    })
    .unwrap();
    let err = predictor.predict(&input(-1.0)).unwrap_err();
    match &err {
        Error::Panicked {
            message, during, ..
        } => {
            assert_eq!(message, "negative input");
            assert!(during.contains("predictor"), "{err}");
        }
        other => panic!("expected Panicked, got {other}"),
    }
    assert!(Manager::active().is_none(), "the context was deactivated");
    assert_eq!(predictor.manager().report().total_arrays(), 0, "freed");
    let y = predictor.predict(&input(1.0)).unwrap();
    assert_eq!(y.as_slice::<f32>().unwrap(), &[2.0; 3]);
    model.close().unwrap();
}

#[test]
fn without_workspace_each_call_is_a_plain_scope() {
    let (model, w) = model();
    let predictor = Predictor::builder(&model)
        .name("plain")
        .no_workspace()
        .build(move |ctx: &Manager, x: &HostArray| {
            assert!(ctx.report().workspaces.is_empty());
            ctx.from_host(x)?.matmul(&w)?.to_host()
        })
        .unwrap();
    for _ in 0..3 {
        predictor.predict(&input(2.0)).unwrap();
    }
    assert_eq!(predictor.contexts(), 0);
    assert_eq!(predictor.manager().name(), "plain");
    let report = predictor.manager().report();
    assert!(report.workspaces.is_empty() && report.children.is_empty());
    assert_eq!(report.total_arrays(), 0);
    model.close().unwrap();
}

#[test]
fn a_closed_model_or_predictor_refuses_calls() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        ctx.from_host(x)?.matmul(&w)?.to_host()
    })
    .unwrap();
    predictor.predict(&input(1.0)).unwrap();
    predictor.close().unwrap();
    let err = predictor.predict(&input(1.0)).unwrap_err();
    assert!(matches!(err, Error::ManagerClosed { .. }), "{err}");
    model.close().unwrap();
    let err = Predictor::new(&model, |_: &Manager, _: &HostArray| Ok(())).unwrap_err();
    assert!(matches!(err, Error::ManagerClosed { .. }), "{err}");
}

#[test]
fn a_predictor_dropped_on_another_thread_frees_everything() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        ctx.from_host(x)?.matmul(&w)?.to_host()
    })
    .unwrap();
    predictor.predict(&input(1.0)).unwrap();
    predictor.predict(&input(1.0)).unwrap();
    let manager = predictor.manager().clone();
    assert!(manager.report().workspaces[0].stats.capacity > 0);
    std::thread::spawn(move || drop(predictor)).join().unwrap();
    assert!(
        !manager.is_open(),
        "its manager and workspace were freed there"
    );
    assert!(model.children().is_empty());
    model.close().unwrap();
}

#[test]
fn a_context_destroyed_by_thread_cleanup_is_replaced() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        ctx.from_host(x)?.matmul(&w)?.to_host()
    })
    .unwrap();
    predictor.predict(&input(1.0)).unwrap();
    assert!(destroy_all_workspaces_for_current_thread() >= 1);
    assert!(predictor.manager().report().workspaces.is_empty());
    let y = predictor.predict(&input(3.0)).unwrap();
    assert_eq!(y.as_slice::<f32>().unwrap(), &[6.0; 3]);
    assert_eq!(predictor.contexts(), 2);
    model.close().unwrap();
}

#[test]
fn a_step_error_is_returned_as_it_is() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        ctx.from_host(x)?.matmul(&w)?.to_host() // [1, 5] · [4, 3]: ShapeMismatch
    })
    .unwrap();
    let err = predictor
        .predict(&HostArray::from_vec(vec![1.0f32; 5], [1, 5]).unwrap())
        .unwrap_err();
    assert!(matches!(err, Error::ShapeMismatch { .. }), "{err}");
    assert_eq!(predictor.manager().report().total_arrays(), 0);
    model.close().unwrap();
}

/// A panic payload whose own `Drop` panics: dropped after `catch_unwind`, it would unwind
/// into the caller.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("the payload's drop panics too");
    }
}

#[test]
fn a_panic_payload_whose_drop_panics_gives_panicked_and_the_predictor_goes_on() {
    let (model, w) = model();
    let predictor = Predictor::new(&model, move |ctx: &Manager, x: &HostArray| {
        let x = ctx.from_host(x)?;
        let y = x.matmul(&w)?;
        if x.to_vec::<f32>()?[0] < 0.0 {
            std::panic::panic_any(Bomb);
        }
        y.to_host()
    })
    .unwrap();
    match predictor.predict(&input(-1.0)) {
        Err(Error::Panicked { message, .. }) => {
            assert_eq!(message, "<non-string panic payload>")
        }
        other => panic!("expected Panicked, got {other:?}"),
    }
    assert!(Manager::active().is_none(), "the context was deactivated");
    for i in 0..100 {
        let y = predictor.predict(&input(i as f32)).unwrap();
        assert_eq!(y.as_slice::<f32>().unwrap(), &[2.0 * i as f32; 3]);
    }
    assert_eq!(predictor.manager().report().total_arrays(), 0, "freed");
    model.close().unwrap();
}
