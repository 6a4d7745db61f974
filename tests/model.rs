//! Model test: random sequences of ownership, workspace and placement operations (create
//! managers and arrays, ops, attach, temp_attach, detach, ret, cap, close, `attach_all`,
//! `temp_attach_all`, `NDList` moves, workspace cycles of six configurations with spills, growth
//! and circular reuse, `activate`) applied to the library and to a plain reference model, compared
//! after every step: ownership, reports, workspace figures, memory counters and the contents of
//! every array. The fuzz targets (`fuzz/fuzz_targets/ownership.rs`, `workspace.rs`) drive the same
//! harness from raw bytes.
//!
//! This file holds a single test on purpose: it compares the process-wide memory counters with
//! the model, so no other test may allocate arrays in this process meanwhile (proptest runs its
//! cases one after another on this thread).

#[path = "model/mod.rs"]
mod model;

use model::{ListAction, Op};
use proptest::prelude::*;

/// Indices are taken modulo the live counts (at most a few dozen), so this range reaches them all.
fn index() -> impl Strategy<Value = usize> {
    0usize..64
}

/// Up to three array indices and how many of them to use.
fn several() -> impl Strategy<Value = ([usize; 3], usize)> {
    ([index(), index(), index()], 0usize..3)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => prop::option::weighted(0.7, index()).prop_map(|parent| Op::CreateManager { parent }),
        5 => (index(), 0usize..model::LENGTHS)
            .prop_map(|(manager, len)| Op::CreateArray { manager, len }),
        3 => (index(), index()).prop_map(|(a, b)| Op::BinaryOp { a, b }),
        2 => (index(), index()).prop_map(|(array, manager)| Op::Attach { array, manager }),
        2 => (index(), index()).prop_map(|(array, manager)| Op::TempAttach { array, manager }),
        1 => index().prop_map(|array| Op::Detach { array }),
        2 => (index(), index()).prop_map(|(manager, array)| Op::Ret { manager, array }),
        1 => index().prop_map(|manager| Op::Cap { manager }),
        1 => index().prop_map(|array| Op::CloseArray { array }),
        2 => index().prop_map(|manager| Op::CloseManager { manager }),
        2 => (index(), 0usize..model::WORKSPACE_CONFIGS)
            .prop_map(|(manager, config)| Op::CreateWorkspace { manager, config }),
        4 => index().prop_map(|workspace| Op::OpenCycle { workspace }),
        2 => index().prop_map(|workspace| Op::CloseCycle { workspace }),
        1 => index().prop_map(|manager| Op::Activate { manager }),
        1 => Just(Op::Deactivate),
        8 => (index(), 0usize..model::LENGTHS)
            .prop_map(|(workspace, len)| Op::CycleArray { workspace, len }),
        3 => (index(), index()).prop_map(|(workspace, array)| Op::CycleRet { workspace, array }),
        1 => index().prop_map(|workspace| Op::ActivateCycle { workspace }),
        1 => (several(), index()).prop_map(|((arrays, count), manager)| Op::AttachAll {
            arrays,
            count,
            manager
        }),
        1 => (several(), index()).prop_map(|((arrays, count), manager)| Op::TempAttachAll {
            arrays,
            count,
            manager
        }),
        2 => (several(), index(), prop::sample::select(&ListAction::ALL[..])).prop_map(
            |((arrays, count), manager, action)| Op::List {
                arrays,
                count,
                manager,
                action
            }
        ),
    ]
}

/// 10 000 cases of up to 80 ops (after a setup of one or two workspaces): about 17 s with
/// `cargo test --release --test model` on two cores. A debug build is about 15 times slower, so
/// plain `cargo test` runs 1 000; Miri runs 3 of up to 24 ops. `PROPTEST_CASES=n` overrides the count.
fn config() -> ProptestConfig {
    let from_env = ProptestConfig::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() {
        from_env.cases
    } else if cfg!(miri) {
        3
    } else if cfg!(debug_assertions) {
        1_000
    } else {
        10_000
    };
    ProptestConfig {
        cases,
        // The harness's `Drop` closes everything a failed case made, so every shrink step starts
        // from a clean state; shrink steps are cheap.
        max_shrink_iters: 100_000,
        // Miri runs without file access (the saved failures are replayed by normal runs).
        failure_persistence: if cfg!(miri) {
            None
        } else {
            from_env.failure_persistence
        },
        ..from_env
    }
}

/// Ops per case after the setup (fewer under Miri, which interprets every step about a thousand
/// times slower).
const MAX_OPS: usize = if cfg!(miri) { 24 } else { 80 };

proptest! {
    #![proptest_config(config())]

    #[test]
    fn library_matches_the_reference_model(
        setup in prop::collection::vec((0usize..model::WORKSPACE_CONFIGS, any::<bool>()), 1..=2),
        ops in prop::collection::vec(op(), 0..=MAX_OPS),
    ) {
        model::run_from_nothing(&[&model::setup_ops(&setup), &ops]);
    }
}
