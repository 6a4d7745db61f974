//! Model test: random sequences of ownership operations (create managers and arrays, ops,
//! attach, temp_attach, detach, ret, cap, close) applied to the library and to a plain reference
//! model, compared after every step. The fuzz target (`fuzz/fuzz_targets/ownership.rs`) drives
//! the same harness from raw bytes.
//!
//! This file holds a single test on purpose: it compares the process-wide memory counters with
//! the model, so no other test may allocate arrays in this process meanwhile (proptest runs its
//! cases one after another on this thread).

#[path = "model/mod.rs"]
mod model;

use model::{cpu_usage, Harness, Op};
use proptest::prelude::*;

/// Indices are taken modulo the live counts (at most a few dozen), so this range reaches them all.
fn index() -> impl Strategy<Value = usize> {
    0usize..64
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => prop::option::weighted(0.7, index()).prop_map(|parent| Op::CreateManager { parent }),
        4 => (index(), 0usize..model::LENGTHS)
            .prop_map(|(manager, len)| Op::CreateArray { manager, len }),
        3 => (index(), index()).prop_map(|(a, b)| Op::BinaryOp { a, b }),
        2 => (index(), index()).prop_map(|(array, manager)| Op::Attach { array, manager }),
        3 => (index(), index()).prop_map(|(array, manager)| Op::TempAttach { array, manager }),
        1 => index().prop_map(|array| Op::Detach { array }),
        2 => (index(), index()).prop_map(|(manager, array)| Op::Ret { manager, array }),
        1 => index().prop_map(|manager| Op::Cap { manager }),
        1 => index().prop_map(|array| Op::CloseArray { array }),
        2 => index().prop_map(|manager| Op::CloseManager { manager }),
    ]
}

/// 30 000 cases of up to 60 ops: about 10 s with `cargo test --release --test model` on two
/// cores. A debug build is about 15 times slower, so plain `cargo test` runs 3 000 (about 15 s).
/// `PROPTEST_CASES=n` overrides the count.
fn config() -> ProptestConfig {
    let from_env = ProptestConfig::default();
    let cases = if std::env::var_os("PROPTEST_CASES").is_some() {
        from_env.cases
    } else if cfg!(debug_assertions) {
        3_000
    } else {
        30_000
    };
    ProptestConfig {
        cases,
        // The harness's `Drop` closes everything a failed case made, so every shrink step starts
        // from a clean state; shrink steps are cheap.
        max_shrink_iters: 100_000,
        ..from_env
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn library_matches_the_reference_model(ops in prop::collection::vec(op(), 0..=60)) {
        // Every case starts with nothing allocated: the previous one closed all it made.
        prop_assert_eq!(cpu_usage(), (0, 0), "(in_use, arrays) before the case");
        let mut harness = Harness::new();
        harness.apply_all(&ops);
        harness.finish();
        prop_assert_eq!(cpu_usage(), (0, 0), "(in_use, arrays) after closing everything");
    }
}
