//! Regression tests for the soundness and robustness defects of issue 9, one or more per defect:
//! 1. two memory-mapped workspaces on one `mmap_path` must not alias each other's memory (the
//!    second is refused, naming the path, creating nothing);
//! 2. handles are checked by identity, not only by slot key: not here, because a stale key only
//!    reaches another entry after its slot's version wraps (2³¹ closes and creations of one
//!    slot); `src/arena` has the unit test (`a_reused_key_does_not_reach_another_entry`), which
//!    forges such a handle;
//! 3. closing an array a kernel reads stalls no other thread (the fuller versions, with moves
//!    out of a workspace, are in `tests/races.rs`);
//! 4. shapes whose size in bytes cannot be addressed are refused with `InvalidArgument` wherever
//!    they would enter, whatever the order of their dimensions (empty arrays included), and ops
//!    on the largest shapes that can be addressed do not overflow (no panic in debug builds);
//! 5. and 7. the matmul and SGD kernels check their operand lengths in release builds, and the
//!    AVX-512 SGD kernel forms no address past its output for fully masked vectors: every
//!    front-end validates shapes before a kernel runs, so these are unit tests of the kernels
//!    (`src/backend/cpu/matmul.rs`, `src/backend/cpu/sgd.rs`);
//! 6. integer semantics: division wraps (`MIN / -1 == MIN`), integer-to-integer `to_dtype`
//!    wraps (two's complement truncation, as Rust's `as`), and `rand` of an integer dtype
//!    refuses a range the dtype cannot hold.

use ndscope::{concat, stack, DType, Error, LocationPolicy, Manager, Shape, WorkspaceConfig};

/// Checks that `result` is `InvalidArgument`; panics otherwise.
fn invalid<T: std::fmt::Debug>(result: ndscope::Result<T>, what: &str) {
    let mut wrong = Vec::new();
    refused(&mut wrong, result, what);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// Notes in `wrong` unless `result` is `InvalidArgument` (so one test lists every entry point
/// that gets it wrong).
fn refused<T: std::fmt::Debug>(wrong: &mut Vec<String>, result: ndscope::Result<T>, what: &str) {
    match result {
        Err(Error::InvalidArgument { .. }) => {}
        Ok(value) => wrong.push(format!(
            "{what}: expected InvalidArgument, got Ok({value:?})"
        )),
        Err(e) => wrong.push(format!("{what}: expected InvalidArgument, got {e:?}")),
    }
}

// ------------------------------------------------------------------------------------------------
// One file, one mapping.

#[cfg(not(miri))] // needs real files and mmap
#[test]
fn a_second_mmap_workspace_on_a_mapped_path_is_refused_and_the_first_keeps_its_data() {
    // (No check of the process-wide memory counters: the other tests here run alongside.)
    use ndscope::LearningPolicy;
    let dir = std::env::temp_dir().join(format!("ndscope-soundness-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("block.bin");
    let conf = |size: usize| {
        WorkspaceConfig::builder()
            .location(LocationPolicy::Mmap)
            .learning(LearningPolicy::None)
            .initial_size(size)
            .mmap_path(&path)
            .build()
            .unwrap()
    };
    let first_owner = Manager::new_base().with_name("first-owner");
    let first = first_owner.workspace("first", conf(1 << 16)).unwrap();
    let cycle = first.open().unwrap();
    let kept = cycle.full([1 << 12], 7.0, DType::F32).unwrap();

    // Another owner, a smaller size (which would truncate the file under the first mapping), or
    // the same size: all refused, naming the path, with nothing created.
    // The same file spelled another way is the same file.
    let other_spelling = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(4096)
        .mmap_path(dir.join(".").join("block.bin"))
        .build()
        .unwrap();
    let second_owner = Manager::new_base().with_name("second-owner");
    for c in [conf(4096), conf(1 << 16), other_spelling] {
        let err = second_owner.workspace("second", c).unwrap_err();
        assert!(matches!(err, Error::InvalidConfig { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("block.bin") && text.contains("'first'"),
            "{text}"
        );
    }
    assert!(
        second_owner.report().workspaces.is_empty(),
        "nothing created"
    );
    // The first workspace's memory is its own: its array still holds its values.
    assert_eq!(kept.to_vec::<f32>().unwrap(), vec![7.0; 1 << 12]);
    drop(cycle);
    // And its whole block is still mapped: a cycle may use all of it (past the 4 KiB a
    // truncating second mapping would have left, where a write was a SIGBUS).
    let got = first
        .cycle(|c| {
            c.full([(1 << 16) / 4], 1.0, DType::F32)?
                .sum_all()?
                .to_scalar::<f32>()
        })
        .unwrap();
    assert_eq!(got, 16384.0);

    // Once the first workspace is gone, the path may be mapped again.
    first_owner.close().unwrap();
    let again = second_owner.workspace("second", conf(4096)).unwrap();
    let value = again
        .cycle(|c| c.full([16], 3.0, DType::F32)?.sum_all()?.to_scalar::<f32>())
        .unwrap();
    assert_eq!(value, 48.0);
    second_owner.close().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

// ------------------------------------------------------------------------------------------------
// Shapes that can be addressed.

/// Shapes whose non-zero dimensions, times the element size, pass `isize::MAX` bytes, in every
/// order of their dimensions.
fn unaddressable() -> Vec<Vec<usize>> {
    let max = usize::MAX;
    vec![
        vec![0, max, 2],
        vec![2, max, 0],
        vec![max, 0, 2],
        vec![0, 1 << 62],
        vec![1 << 62, 0],
        vec![0, 1 << 61],
        vec![0, 1 << 31, 1 << 31],
        vec![1 << 31, 1 << 31, 0],
    ]
}

#[test]
fn unaddressable_shapes_are_refused_by_every_factory_whatever_the_dim_order() {
    let m = Manager::new_base();
    let mut wrong = Vec::new();
    for dims in unaddressable() {
        let shape = Shape::new(&dims);
        let what = format!("{shape}");
        refused(
            &mut wrong,
            m.zeros(shape.clone(), DType::F32),
            &format!("zeros {what}"),
        );
        refused(
            &mut wrong,
            m.ones(shape.clone(), DType::F32),
            &format!("ones {what}"),
        );
        refused(
            &mut wrong,
            m.full(shape.clone(), 1.0, DType::I32),
            &format!("full {what}"),
        );
        refused(
            &mut wrong,
            m.empty(shape.clone(), DType::F32),
            &format!("empty {what}"),
        );
        refused(
            &mut wrong,
            m.from_vec(Vec::<f32>::new(), shape.clone()),
            &format!("from_vec {what}"),
        );
        refused(
            &mut wrong,
            m.from_slice::<f32>(&[], shape.clone()),
            &format!("from_slice {what}"),
        );
        refused(
            &mut wrong,
            m.randn(shape.clone(), DType::F32),
            &format!("randn {what}"),
        );
        // Inside a workspace cycle too.
        let ws = m.workspace("batch", WorkspaceConfig::default()).unwrap();
        let cycle = ws.open().unwrap();
        refused(
            &mut wrong,
            cycle.zeros(shape.clone(), DType::F32),
            &format!("zeros in a cycle {what}"),
        );
        refused(
            &mut wrong,
            cycle.from_vec(Vec::<f32>::new(), shape),
            &format!("from_vec in a cycle {what}"),
        );
        drop(cycle);
        ws.destroy().unwrap();
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(m.report().total_arrays(), 0, "nothing was created");
    m.close().unwrap();
}

#[test]
fn unaddressable_shapes_are_refused_by_every_op_that_would_make_one() {
    let m = Manager::new_base();
    let mut wrong = Vec::new();
    let max = usize::MAX;
    // The largest empty f32 arrays that can be addressed: 2^60 × 4 bytes = 2^62 ≤ isize::MAX.
    let big = m.zeros([0, 1 << 60], DType::F32).unwrap();
    let empty = m.zeros([0, 1, 2], DType::F32).unwrap();
    let indices = m.zeros([0, 1 << 60], DType::I32).unwrap();
    refused(
        &mut wrong,
        empty.reshape([0, max, 2]),
        "reshape to [0, MAX, 2]",
    );
    refused(
        &mut wrong,
        empty.reshape([2, max, 0]),
        "reshape to [2, MAX, 0]",
    );
    refused(
        &mut wrong,
        empty.broadcast_to([0, max, 2]),
        "broadcast_to [0, MAX, 2]",
    );
    let lifted = big.unsqueeze(0).unwrap();
    refused(
        &mut wrong,
        lifted.broadcast_to([4, 0, 1 << 60]),
        "broadcast_to [4, 0, 2^60]",
    );
    // Joined or converted, they would pass isize::MAX bytes.
    refused(
        &mut wrong,
        concat(&[big.clone(), big.clone()], 1),
        "concat along the big axis",
    );
    refused(&mut wrong, stack(&[big.clone(), big.clone()], 0), "stack");
    refused(
        &mut wrong,
        big.to_dtype(DType::F64),
        "to_dtype to 8-byte elements",
    );
    refused(&mut wrong, indices.one_hot(1 << 62, DType::F32), "one_hot");
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert_eq!(m.report().total_arrays(), 4, "nothing else was created");
    m.close().unwrap();
}

#[test]
fn ops_on_the_largest_addressable_empty_shapes_do_not_overflow() {
    let m = Manager::new_base();
    let big = m.zeros([0, 1 << 30, 1 << 30], DType::F32).unwrap();
    for axis in [0, 1, 2, -1] {
        assert_eq!(big.softmax(axis).unwrap().dims(), big.dims());
        assert_eq!(big.log_softmax(axis).unwrap().dims(), big.dims());
    }
    // Reducing the empty axis would make 2^60 elements: refused as too much memory, not a panic
    // (Miri aborts on an allocation that large instead of failing it).
    #[cfg(not(miri))]
    assert!(matches!(
        big.sum(&[0], false),
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(big.sum(&[1, 2], true).unwrap().dims(), &[0, 1, 1]);
    assert_eq!(big.mean(&[2], false).unwrap().dims(), &[0, 1 << 30]);
    assert_eq!(
        big.permute(&[2, 0, 1]).unwrap().dims(),
        &[1 << 30, 0, 1 << 30]
    );
    assert_eq!(big.add(&big).unwrap().dims(), big.dims());
    assert_eq!(concat(&[big.clone(), big.clone()], 0).unwrap().size(), 0);
    assert_eq!(big.reshape([1 << 30, 0, 1 << 30]).unwrap().size(), 0);
    assert!(big.to_vec::<f32>().unwrap().is_empty());
    m.close().unwrap();
}

// ------------------------------------------------------------------------------------------------
// Integers wrap, everywhere.

#[test]
fn integer_division_wraps_like_every_other_integer_op() {
    let m = Manager::new_base();
    let a = m.from_slice(&[i32::MIN, i32::MIN, 7, -7], [4]).unwrap();
    let b = m.from_slice(&[-1i32, 1, -2, 2], [4]).unwrap();
    assert_eq!(
        a.div(&b).unwrap().to_vec::<i32>().unwrap(),
        vec![i32::MIN, i32::MIN, -3, -3]
    );
    let minus_one = m.from_slice(&[-1i32], [1]).unwrap();
    assert_eq!(
        a.div(&minus_one).unwrap().to_vec::<i32>().unwrap(),
        vec![i32::MIN, i32::MIN, -7, 7],
        "broadcast"
    );
    assert_eq!(
        a.div_scalar(-1.0).unwrap().to_vec::<i32>().unwrap(),
        vec![i32::MIN, i32::MIN, -7, 7]
    );
    let big = m.from_slice(&[i64::MIN, 9], [2]).unwrap();
    assert_eq!(
        big.div_scalar(-1.0).unwrap().to_vec::<i64>().unwrap(),
        vec![i64::MIN, -9]
    );
    let minus = m.from_slice(&[-1i64, -1], [2]).unwrap();
    assert_eq!(
        big.div(&minus).unwrap().to_vec::<i64>().unwrap(),
        vec![i64::MIN, -9]
    );
    // As the other integer ops do.
    assert_eq!(
        a.neg().unwrap().to_vec::<i32>().unwrap(),
        vec![i32::MIN, i32::MIN, -7, 7]
    );
    m.close().unwrap();
}

#[test]
fn integer_to_integer_to_dtype_wraps_as_numpy_astype() {
    let m = Manager::new_base();
    let wide = m
        .from_slice(&[300i64, -1, 256, 255, (1 << 32) + 5, -(1 << 31) - 1], [6])
        .unwrap();
    assert_eq!(
        wide.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(),
        vec![44, 255, 0, 255, 5, 255]
    );
    assert_eq!(
        wide.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap(),
        vec![300, -1, 256, 255, 5, i32::MAX]
    );
    // I32 → I64 sign-extends and back is the identity; I64 → I32 → I64 keeps the low 32 bits.
    let narrow = m.from_slice(&[i32::MIN, -1, i32::MAX, 44], [4]).unwrap();
    let widened = narrow.to_dtype(DType::I64).unwrap();
    assert_eq!(
        widened.to_vec::<i64>().unwrap(),
        vec![-(1 << 31), -1, (1 << 31) - 1, 44]
    );
    assert_eq!(
        widened
            .to_dtype(DType::I32)
            .unwrap()
            .to_vec::<i32>()
            .unwrap(),
        vec![i32::MIN, -1, i32::MAX, 44]
    );
    assert_eq!(
        wide.to_dtype(DType::I32)
            .unwrap()
            .to_dtype(DType::I64)
            .unwrap()
            .to_vec::<i64>()
            .unwrap(),
        vec![300, -1, 256, 255, 5, (1 << 31) - 1]
    );
    assert_eq!(
        narrow.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(),
        vec![0, 255, 255, 44]
    );
    let bytes = m.from_slice(&[200u8, 255], [2]).unwrap();
    assert_eq!(
        bytes.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap(),
        vec![200, 255]
    );
    m.close().unwrap();
}

#[test]
fn rand_of_an_integer_dtype_refuses_a_range_the_dtype_cannot_hold() {
    let m = Manager::new_base();
    invalid(m.rand([8], 0.0, 300.0, DType::U8), "U8 in [0, 300)");
    invalid(m.rand([8], -1.0, 10.0, DType::U8), "U8 in [-1, 10)");
    invalid(m.rand([8], 0.0, 3e9, DType::I32), "I32 in [0, 3e9)");
    invalid(m.rand([8], -3e9, 0.0, DType::I32), "I32 in [-3e9, 0)");
    assert_eq!(m.report().total_arrays(), 0, "nothing was created");
    let full_range = m.rand([4096], 0.0, 256.0, DType::U8).unwrap();
    let values = full_range.to_vec::<u8>().unwrap();
    assert!(
        values.iter().any(|&v| v > 200),
        "draws reach the top of the range"
    );
    let small = m.rand([256], 250.0, 256.0, DType::U8).unwrap();
    assert!(small.to_vec::<u8>().unwrap().iter().all(|&v| v >= 250));
    m.close().unwrap();
}

// ------------------------------------------------------------------------------------------------
// No global stalls (real time and a large kernel: not under Miri). `tests/races.rs` has the
// fuller versions (trials sized to the machine, moves out of a workspace too).

/// Thread A multiplies `x · w`; thread B closes `x` while A's kernel reads it; thread C, once
/// B's close has taken `x` out of the arena, counts unrelated ops and reports until A's kernel
/// returns. Before the fix B waited for A's kernel while holding the arena lock, so C could do
/// nothing until the kernel was over (0 ops counted).
#[cfg(not(miri))]
#[test]
fn closing_an_array_a_kernel_reads_stalls_no_other_thread() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::thread;
    use std::time::Duration;

    let base = Manager::new_base().with_name("base");
    let mut side = 1280;
    let mut seen = Vec::new();
    for _ in 0..6 {
        let m = base.new_sub_manager().unwrap();
        let x = m.ones([side, side], DType::F32).unwrap();
        let w = m.full([side, side], 0.5, DType::F32).unwrap();
        let started = AtomicBool::new(false);
        let done = AtomicBool::new(false);
        let progress = AtomicUsize::new(0);
        let kernel_ran = thread::scope(|t| {
            let a = t.spawn(|| {
                started.store(true, Ordering::Release);
                let result = x.matmul(&w);
                done.store(true, Ordering::Release);
                match result {
                    Ok(product) => {
                        let values = product.to_vec::<f32>().unwrap();
                        assert!(values.iter().all(|&v| v == side as f32 * 0.5));
                        true
                    }
                    // B closed x before the kernel took it: this trial says nothing.
                    Err(Error::ArrayClosed { .. }) => false,
                    Err(e) => panic!("matmul failed with {e}"),
                }
            });
            t.spawn(|| {
                while !started.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                thread::sleep(Duration::from_millis(5));
                x.close().unwrap();
            });
            t.spawn(|| {
                while !started.load(Ordering::Acquire) {
                    std::hint::spin_loop();
                }
                // Needs the arena lock: passes once B's close is through it.
                while x.is_open() {
                    std::hint::spin_loop();
                }
                while !done.load(Ordering::Acquire) {
                    let other = base.new_sub_manager().unwrap();
                    let y = other.full([16], 1.0, DType::F32).unwrap();
                    let sum = y.add(&y).unwrap().sum_all().unwrap();
                    assert_eq!(sum.to_scalar::<f32>().unwrap(), 32.0);
                    assert!(base.report().total_arrays() >= 2);
                    other.close().unwrap();
                    progress.fetch_add(1, Ordering::Relaxed);
                }
            });
            a.join().unwrap()
        });
        m.close().unwrap();
        let progress = progress.load(Ordering::Relaxed);
        seen.push((side, kernel_ran, progress));
        if kernel_ran && progress >= 10 {
            eprintln!("(side, kernel ran, C's ops) = {seen:?}");
            base.close().unwrap();
            return;
        }
        side = side * 5 / 4;
    }
    panic!(
        "thread C completed (almost) nothing while B's close waited for A's kernel: \
         (side, kernel ran, C's ops) = {seen:?}"
    );
}
