//! Fuzzes the ownership rules: the input bytes decode into a sequence of [`Op`]s (create managers
//! and arrays, add, attach, temp_attach, detach, ret, cap, close, and the same moves on several
//! arrays at once: `attach_all`, `temp_attach_all`, `NDList`), which run on the library and on
//! the reference model of `tests/model/mod.rs`, compared after every step: ownership, reports,
//! memory counters and every array's contents (the same harness as the proptest model test,
//! `tests/model.rs`). The `workspace` target drives the same harness towards workspaces.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/model/mod.rs"]
mod model;

use model::{ListAction, Op};

/// Longer inputs are cut here: every step checks the whole state, so long sequences mostly cost
/// time without reaching states that shorter ones cannot.
const MAX_OPS: usize = 128;

/// One byte picks the op (modulo 12), the bytes after it its operands (indices are taken modulo
/// the live counts by the harness). A missing operand byte reads as 0.
fn decode(data: &[u8]) -> Vec<Op> {
    let mut bytes = data.iter().map(|&b| usize::from(b));
    let mut ops = Vec::new();
    while let Some(kind) = bytes.next() {
        if ops.len() == MAX_OPS {
            break;
        }
        let mut operand = || bytes.next().unwrap_or(0);
        let op = match kind % 12 {
            0 => {
                // A quarter of the values make a base manager, the rest a sub-manager.
                let p = operand();
                let parent = (p % 4 != 0).then_some(p / 4);
                Op::CreateManager { parent }
            }
            1 => Op::CreateArray {
                manager: operand(),
                len: operand(),
            },
            2 => Op::BinaryOp {
                a: operand(),
                b: operand(),
            },
            3 => Op::Attach {
                array: operand(),
                manager: operand(),
            },
            4 => Op::TempAttach {
                array: operand(),
                manager: operand(),
            },
            5 => Op::Detach { array: operand() },
            6 => Op::Ret {
                manager: operand(),
                array: operand(),
            },
            7 => Op::Cap { manager: operand() },
            8 => Op::CloseArray { array: operand() },
            9 => Op::CloseManager { manager: operand() },
            10 => {
                let (arrays, count) = ([operand(), operand(), operand()], operand());
                let manager = operand();
                match operand() % 2 {
                    0 => Op::AttachAll {
                        arrays,
                        count,
                        manager,
                    },
                    _ => Op::TempAttachAll {
                        arrays,
                        count,
                        manager,
                    },
                }
            }
            _ => Op::List {
                arrays: [operand(), operand(), operand()],
                count: operand(),
                manager: operand(),
                action: ListAction::ALL[operand() % ListAction::ALL.len()],
            },
        };
        ops.push(op);
    }
    ops
}

fuzz_target!(|data: &[u8]| model::run_from_nothing(&[&decode(data)]));
