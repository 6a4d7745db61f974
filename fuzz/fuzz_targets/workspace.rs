//! Fuzzes workspaces and placement: the input bytes decode into a sequence of [`Op`]s weighted
//! towards workspace cycles (six configurations: learned, fixed, growing, circular, refusing),
//! arrays created in and returned out of cycles, moves into and out of them (`attach`,
//! `temp_attach`, `detach`, `attach_all`, `NDList`), `activate` placement and closes. They run on
//! the library and on the reference model of `tests/model/mod.rs` (which places every workspace
//! allocation with the plain ring model of `tests/model/block.rs`), compared after every step:
//! ownership, reports, workspace figures, memory counters and every array's contents.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/model/mod.rs"]
mod model;

use model::{ListAction, Op};

/// Longer inputs are cut here: every step checks the whole state, so long sequences mostly cost
/// time without reaching states that shorter ones cannot.
const MAX_OPS: usize = 160;

/// The first byte picks how many workspaces to start with (one or two, each owned by a new base
/// manager, its configuration from the next byte). Then one byte picks each op (modulo 20), the
/// bytes after it its operands (indices are taken modulo the live counts by the harness). A
/// missing operand byte reads as 0.
fn decode(data: &[u8]) -> Vec<Op> {
    let mut bytes = data.iter().map(|&b| usize::from(b));
    let mut ops = Vec::new();
    let workspaces = 1 + bytes.next().unwrap_or(0) % 2;
    for w in 0..workspaces {
        ops.push(Op::CreateManager { parent: None });
        ops.push(Op::CreateWorkspace {
            // The newest base manager: the last of the managers other than the system one.
            manager: w,
            config: bytes.next().unwrap_or(0),
        });
    }
    while let Some(kind) = bytes.next() {
        if ops.len() == MAX_OPS {
            break;
        }
        let mut operand = || bytes.next().unwrap_or(0);
        let op = match kind % 20 {
            0 | 1 => Op::OpenCycle {
                workspace: operand(),
            },
            2 => Op::CloseCycle {
                workspace: operand(),
            },
            3..=5 => Op::CycleArray {
                workspace: operand(),
                len: operand(),
            },
            6 => Op::CycleRet {
                workspace: operand(),
                array: operand(),
            },
            7 => Op::ActivateCycle {
                workspace: operand(),
            },
            8 => Op::Activate { manager: operand() },
            9 => Op::Deactivate,
            10 | 11 => Op::BinaryOp {
                a: operand(),
                b: operand(),
            },
            12 => Op::CreateArray {
                manager: operand(),
                len: operand(),
            },
            13 => Op::Attach {
                array: operand(),
                manager: operand(),
            },
            14 => Op::TempAttach {
                array: operand(),
                manager: operand(),
            },
            15 => Op::Detach { array: operand() },
            16 => {
                let (arrays, count) = ([operand(), operand(), operand()], operand());
                let manager = operand();
                match operand() % 7 {
                    5 => Op::AttachAll {
                        arrays,
                        count,
                        manager,
                    },
                    6 => Op::TempAttachAll {
                        arrays,
                        count,
                        manager,
                    },
                    action => Op::List {
                        arrays,
                        count,
                        manager,
                        action: ListAction::ALL[action],
                    },
                }
            }
            17 => Op::CreateWorkspace {
                manager: operand(),
                config: operand(),
            },
            18 => Op::CloseArray { array: operand() },
            _ => match operand() % 4 {
                0 => Op::CloseManager { manager: operand() },
                1 => Op::CreateManager {
                    parent: Some(operand()),
                },
                2 => Op::Cap { manager: operand() },
                _ => Op::Ret {
                    manager: operand(),
                    array: operand(),
                },
            },
        };
        ops.push(op);
    }
    ops
}

fuzz_target!(|data: &[u8]| model::run_from_nothing(&[&decode(data)]));
