//! Cases of the model test (`tests/model.rs`) kept as plain tests: the inputs the random search
//! found failing, replayed on every run whatever proptest's seed. In a file of their own, as the
//! model test compares the process-wide memory counters with its model, so nothing else may
//! allocate arrays in its process meanwhile; the cases here run one after another in one test.

#[path = "model/mod.rs"]
mod model;

use model::{ListAction, Op};

#[test]
fn found_cases_match_the_reference_model() {
    a_list_whose_copies_overwrite_one_of_its_arrays();
}

/// A case the random search found: copying the arrays of an `NDList` attach into a circular
/// workspace cycle overwrote another array of the same list before its own copy was made.
fn a_list_whose_copies_overwrite_one_of_its_arrays() {
    let ops = vec![
        Op::CreateArray { manager: 3, len: 0 },
        Op::CycleArray {
            workspace: 5,
            len: 0,
        },
        Op::CycleArray {
            workspace: 1,
            len: 0,
        },
        Op::CycleArray {
            workspace: 20,
            len: 1,
        },
        Op::CycleArray {
            workspace: 1,
            len: 0,
        },
        Op::CycleArray {
            workspace: 47,
            len: 0,
        },
        Op::BinaryOp { a: 9, b: 0 },
        Op::CreateManager { parent: None },
        Op::CreateArray { manager: 0, len: 0 },
        Op::BinaryOp { a: 59, b: 0 },
        Op::CreateArray { manager: 0, len: 0 },
        Op::BinaryOp { a: 58, b: 0 },
        Op::CycleArray {
            workspace: 30,
            len: 0,
        },
        Op::CreateWorkspace {
            manager: 0,
            config: 0,
        },
        Op::CloseCycle { workspace: 29 },
        Op::TempAttach {
            array: 0,
            manager: 3,
        },
        Op::OpenCycle { workspace: 1 },
        Op::CreateArray { manager: 0, len: 0 },
        Op::CycleRet {
            workspace: 8,
            array: 28,
        },
        Op::CycleRet {
            workspace: 8,
            array: 21,
        },
        Op::CreateArray { manager: 0, len: 0 },
        Op::CreateManager { parent: None },
        Op::CloseManager { manager: 50 },
        Op::CycleArray {
            workspace: 0,
            len: 0,
        },
        Op::OpenCycle { workspace: 3 },
        Op::CreateArray { manager: 5, len: 0 },
        Op::CycleArray {
            workspace: 14,
            len: 1,
        },
        Op::List {
            arrays: [10, 40, 0],
            count: 1,
            manager: 8,
            action: ListAction::Attach,
        },
    ];
    model::run_from_nothing(&[&model::setup_ops(&[(3, true), (0, true)]), &ops]);
}
