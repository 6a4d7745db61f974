//! CUDA ops, launches and transfers (issue 17, part b): driver calls counted on the simulated
//! GPU, deferred index and division checks, transfers around the staging size, `addmm_` with
//! `beta = 0`, batched products past the grid limit, and reduction launch shapes.
//!
//! Without a usable GPU each test prints why it skipped. Parts that count driver calls read the
//! simulator's counters (`cudasim_stats` in the loaded `libcuda.so.1`) and skip that part on a
//! real driver, which has no such symbols.

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{DType, Device, Error, Manager, Transpose, WorkspaceConfig};

mod common;

static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU with this file's lock held, or `None` after printing why the test skips.
fn gpu() -> Option<(MutexGuard<'static, ()>, Device)> {
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    common::cuda_device().map(|dev| (serial, dev))
}

use common::sim;

#[test]
fn creating_and_closing_in_a_learned_cycle_makes_no_driver_call() {
    let Some((_serial, dev)) = gpu() else { return };
    let owner = Manager::new_base_on(dev).unwrap();
    let ws = owner
        .workspace("cycle", WorkspaceConfig::default())
        .unwrap();
    for _ in 0..3 {
        ws.cycle(|s| {
            let a = s.empty([1 << 18], DType::F32)?;
            let b = s.empty([1000], DType::I64)?;
            a.close()?;
            b.close()
        })
        .unwrap();
    }
    let before = sim::stats();
    for _ in 0..20 {
        ws.cycle(|s| {
            let a = s.empty([1 << 18], DType::F32)?;
            let b = s.empty([1000], DType::I64)?;
            a.close()?;
            b.close()
        })
        .unwrap();
    }
    let after = sim::stats();
    if let (Some(before), Some(after)) = (before, after) {
        let calls = sim::calls(&sim::diff(&before, &after));
        assert!(
            calls.is_empty(),
            "driver calls in 20 learned cycles: {calls:?}"
        );
    }
    // The same in one open scope of the learned workspace, as the bench does it.
    let scope = ws.open().unwrap();
    let before = sim::stats();
    for _ in 0..20 {
        let a = scope.empty([1 << 18], DType::F32).unwrap();
        a.close().unwrap();
    }
    let after = sim::stats();
    drop(scope);
    if let (Some(before), Some(after)) = (before, after) {
        let calls = sim::calls(&sim::diff(&before, &after));
        assert!(
            calls.is_empty(),
            "driver calls for 20 creates and closes: {calls:?}"
        );
    }
    owner.close().unwrap();
}

/// The op and call site an `InvalidArgument` names, and its reason.
fn invalid(e: &Error) -> (&'static str, u32, String) {
    match e {
        Error::InvalidArgument { op, at, reason } => {
            assert!(at.file().ends_with("cuda_ops.rs"), "site {at}");
            (op, at.line(), reason.clone())
        }
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn a_bad_index_is_reported_at_the_next_read_naming_the_op_and_its_site() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base_on(dev).unwrap();
    let x = m
        .from_vec((0..12).map(|v| v as f32).collect(), [4, 3])
        .unwrap();
    let good = m.from_slice(&[0i64, 2, 1, 2], [4]).unwrap();
    let bad = m.from_slice(&[0i64, 2, 3, -1], [4]).unwrap();
    let other = m.from_slice(&[1.5f32, 2.5], [2]).unwrap();

    // pick: queued without a wait; the next read on the device (of any array) reports it.
    let ok = x.pick(&good, 1).unwrap();
    let (picked, line) = (x.pick(&bad, 1), line!());
    let picked = picked.expect("the bad index is reported at the next wait, not here");
    let e = other.to_vec::<f32>().unwrap_err();
    let (op, at, reason) = invalid(&e);
    assert_eq!((op, at), ("pick", line), "{e}");
    assert!(
        reason.contains("flat position 2") && reason.contains("below the size of the axis, 3"),
        "{reason}"
    );
    // Reported once; the good pick's result is right, the device works on.
    assert_eq!(other.to_vec::<f32>().unwrap(), vec![1.5, 2.5]);
    assert_eq!(ok.to_vec::<f32>().unwrap(), vec![0.0, 5.0, 7.0, 11.0]);
    picked.close().unwrap();

    // one_hot: reported by Device::synchronize; the first failing op is the one named.
    let (first, line) = (bad.one_hot(3, DType::F32).unwrap(), line!());
    let second = x.pick(&bad, 1).unwrap();
    let e = dev.synchronize().unwrap_err();
    let (op, at, reason) = invalid(&e);
    assert_eq!((op, at), ("one_hot", line), "{e}");
    assert!(
        reason.contains("flat position 2") && reason.contains("below the depth, 3"),
        "{reason}"
    );
    dev.synchronize().unwrap();
    first.close().unwrap();
    second.close().unwrap();

    // u8 and i32 indices, a bad one far into a long array.
    for from in [DType::U8, DType::I32] {
        let mut idx = vec![1i64; 70_001];
        idx[69_999] = 7;
        let idx = m.from_vec(idx, [70_001]).unwrap().to_dtype(from).unwrap();
        let y = m.zeros([70_001, 4], DType::F64).unwrap();
        let (p, line) = (y.pick(&idx, 1).unwrap(), line!());
        let e = p.to_vec::<f64>().unwrap_err();
        let (op, at, reason) = invalid(&e);
        assert_eq!((op, at), ("pick", line), "{e}");
        assert!(reason.contains("flat position 69999"), "{reason}");
    }
    m.close().unwrap();
}

#[test]
fn an_integer_division_by_zero_is_reported_at_the_next_read() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base_on(dev).unwrap();
    for dtype in [DType::I32, DType::I64, DType::U8] {
        let a = m
            .from_slice(&[6i64, 8, 9], [3])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let b = m
            .from_slice(&[3i64, 0, 1], [3])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let (q, line) = (a.div(&b).unwrap(), line!());
        let e = match dtype {
            DType::I64 => q.to_vec::<i64>().unwrap_err(),
            _ => q.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap_err(),
        };
        let (op, at, reason) = invalid(&e);
        assert_eq!((op, at), ("div", line), "{e}");
        assert!(reason.contains("flat position 1"), "{reason}");
        // A divisor broadcast from one element, reported by `synchronize`.
        let z = m.zeros([1], dtype).unwrap();
        let (_q, line) = (a.div(&z).unwrap(), line!());
        let e = dev.synchronize().unwrap_err();
        let (op, at, reason) = invalid(&e);
        assert_eq!((op, at), ("div", line), "{e}");
        assert!(reason.contains("flat position 0"), "{reason}");
        // Without a 0 nothing is reported.
        let c = m
            .from_slice(&[2i64, 4, 3], [3])
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let d = c.div(&c).unwrap();
        assert_eq!(
            d.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(),
            vec![1, 1, 1]
        );
    }
    m.close().unwrap();
}

#[test]
fn checked_ops_do_not_wait_for_the_device() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base_on(dev).unwrap();
    let x = m
        .from_vec((0..40).map(|v| v as f32).collect(), [10, 4])
        .unwrap();
    let idx = m
        .from_slice(&[0i64, 3, 1, 2, 0, 1, 2, 3, 3, 0], [10])
        .unwrap();
    let a = m.from_slice(&[7i64, 9, 12], [3]).unwrap();
    let b = m.from_slice(&[2i64, 3, 5], [3]).unwrap();
    let step = || {
        let p = x.pick(&idx, 1).unwrap();
        let h = idx.one_hot(4, DType::F32).unwrap();
        let q = a.div(&b).unwrap();
        p.close().unwrap();
        h.close().unwrap();
        q.close().unwrap();
    };
    step();
    dev.synchronize().unwrap();
    let before = sim::stats();
    for _ in 0..10 {
        step();
    }
    let after = sim::stats();
    dev.synchronize().unwrap();
    if let (Some(before), Some(after)) = (before, after) {
        let d = sim::diff(&before, &after);
        assert_eq!(
            d["blocking_syncs"],
            0,
            "waits in 10 steps of pick, one_hot, div: {:?}",
            sim::calls(&d)
        );
        assert_eq!(d["d2h"], 0, "reads in 10 steps: {:?}", sim::calls(&d));
        assert_eq!(d["launches"], 30, "{:?}", sim::calls(&d));
    }
    m.close().unwrap();
}

#[test]
fn addmm_with_beta_zero_does_not_read_its_target() {
    // The CPU first: it runs without a GPU too.
    let mut devices = vec![Device::Cpu];
    let serial = gpu();
    if let Some((_, dev)) = &serial {
        devices.push(*dev);
    }
    for dev in devices {
        let m = Manager::new_base_on(dev).unwrap();
        for dtype in [DType::F32, DType::F64] {
            for k in [3usize, 0, 40] {
                let a = m
                    .arange(0.0, (2 * k) as f64, 1.0, dtype)
                    .unwrap()
                    .reshape([2, k])
                    .unwrap();
                let b = m
                    .arange(0.0, (k * 3) as f64, 1.0, dtype)
                    .unwrap()
                    .reshape([k, 3])
                    .unwrap();
                let want: Vec<f64> = (0..6)
                    .map(|q| {
                        let (i, j) = (q / 3, q % 3);
                        2.0 * (0..k)
                            .map(|p| ((i * k + p) * (p * 3 + j)) as f64)
                            .sum::<f64>()
                    })
                    .collect();
                for special in [f64::NAN, f64::INFINITY] {
                    let v = m.full([2, 3], special, dtype).unwrap();
                    v.addmm_(&a, &b, Transpose::None, 0.0, 2.0).unwrap();
                    let got = v.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
                    assert_eq!(got, want, "{dev} {dtype} k={k} over {special}");
                    // Transposed operands, as an SGD step without momentum reads them.
                    let at = a.transpose().unwrap();
                    let w = m.full([2, 3], special, dtype).unwrap();
                    w.addmm_(&at, &b, Transpose::Left, 0.0, 2.0).unwrap();
                    let got = w.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
                    assert_eq!(got, want, "{dev} {dtype} k={k} Left over {special}");
                }
            }
        }
        m.close().unwrap();
    }
}

#[test]
fn batched_products_past_the_grid_limit_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    let batches = 70_000usize;
    for dtype in [DType::F32, DType::I64] {
        let a = m
            .from_vec(
                (0..batches * 4).map(|i| (i % 7) as f64).collect(),
                [batches * 4],
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .reshape([batches, 2, 2])
            .unwrap();
        let b = m
            .from_vec(
                (0..batches * 2).map(|i| (i % 5) as f64).collect(),
                [batches * 2],
            )
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .reshape([batches, 2, 1])
            .unwrap();
        let want = a
            .matmul(&b)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec::<f64>()
            .unwrap();
        let (ga, gb) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
        let before = sim::stats();
        let got = ga.matmul(&gb).unwrap();
        let after = sim::stats();
        let got = got.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap();
        assert_eq!(got.len(), want.len());
        assert!(
            got == want,
            "{dtype}: batched product of {batches} differs from the CPU"
        );
        if let (Some(before), Some(after), DType::F32) = (before, after, dtype) {
            // The simulator has no grid limit: count that the batch was split for one.
            let d = sim::diff(&before, &after);
            assert_eq!(
                d["cublas"],
                2,
                "cuBLAS calls for {batches} products: {:?}",
                sim::calls(&d)
            );
        }
    }
    m.close().unwrap();
}

/// Bytes of each page-locked staging buffer (`STAGING` in the backend).
const STAGING: usize = 4 << 20;

/// `n` bytes that differ from chunk to chunk and from run to run (`seed`).
fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31) ^ ((i >> 12) as u8) ^ seed)
        .collect()
}

#[test]
fn transfers_around_the_staging_size_keep_every_byte() {
    let Some((_serial, dev)) = gpu() else { return };
    let host = Manager::new_base();
    let sizes = [
        0,
        1,
        7,
        STAGING - 1,
        STAGING,
        STAGING + 1,
        2 * STAGING - 1,
        2 * STAGING,
        2 * STAGING + 3,
        3 * STAGING + 5,
    ];
    // Pageable memory, both directions: several transfers in a row, so a staging buffer
    // reused before its copy finished would show as wrong bytes.
    for (s, &n) in sizes.iter().enumerate() {
        let arrays: Vec<_> = (0..3u8)
            .map(|r| {
                let data = pattern(n, r ^ s as u8);
                let a = host.from_vec(data.clone(), [n]).unwrap();
                (data, a.to_device(dev).unwrap(), a)
            })
            .collect();
        for (r, (data, g, a)) in arrays.iter().enumerate() {
            assert_eq!(g.to_vec::<u8>().unwrap(), *data, "{n} bytes, upload {r}");
            let back = g.to_device(Device::Cpu).unwrap();
            assert!(
                back.to_vec::<u8>().unwrap() == *data,
                "{n} bytes, download {r}"
            );
            back.close().unwrap();
            a.close().unwrap();
        }
    }
    // Page-locked memory (a HostOnly workspace's block), both directions, copied directly.
    let owner = Manager::new_base_on(dev).unwrap();
    let conf = WorkspaceConfig::builder()
        .mirroring(ndscope::MirroringPolicy::HostOnly)
        .build()
        .unwrap();
    let ws = owner.workspace("pinned", conf).unwrap();
    for (s, &n) in sizes.iter().enumerate() {
        for cycle in 0..2u8 {
            ws.cycle(|c| {
                let data = pattern(n, cycle ^ s as u8 ^ 0x5a);
                let a = c.from_vec(data.clone(), [n])?;
                assert_eq!(a.device(), Device::Cpu);
                let g = a.to_device(dev)?;
                let twice = g.add(&g)?;
                let back = twice.to_device(Device::Cpu)?;
                let want: Vec<u8> = data.iter().map(|v| v.wrapping_add(*v)).collect();
                assert!(
                    back.to_vec::<u8>()? == want,
                    "{n} bytes, pinned, cycle {cycle}"
                );
                Ok(())
            })
            .unwrap();
        }
    }
    owner.close().unwrap();
    host.close().unwrap();
}

#[test]
fn a_pinned_upload_waits_for_its_copy_not_a_stream_synchronisation() {
    let Some((_serial, dev)) = gpu() else { return };
    let owner = Manager::new_base_on(dev).unwrap();
    let conf = WorkspaceConfig::builder()
        .mirroring(ndscope::MirroringPolicy::HostOnly)
        .build()
        .unwrap();
    let ws = owner.workspace("pinned", conf).unwrap();
    let n = 3 * STAGING + 5;
    for cycle in 0..3 {
        ws.cycle(|c| {
            let a = c.zeros([n], DType::U8)?;
            let before = sim::stats();
            let g = a.to_device(dev)?;
            let after = sim::stats();
            if let (Some(before), Some(after), true) = (before, after, cycle > 0) {
                let d = sim::diff(&before, &after);
                // One direct copy (no staging chunks), waited for through an event.
                assert_eq!(d["h2d"], 1, "{:?}", sim::calls(&d));
                assert_eq!(d["event_records"], 1, "{:?}", sim::calls(&d));
            }
            g.close()
        })
        .unwrap();
    }
    owner.close().unwrap();
}

/// Deterministic floats with ties and a varied maximum, from `seed`.
fn floats(n: usize, seed: u64) -> Vec<f64> {
    common::values(n, seed, 1000)
        .into_iter()
        .map(|v| v as f64 / 16.0)
        .collect()
}

/// `got` against `want` element by element, within `tol` relative to max(1, |want|).
fn close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0) || (g.is_nan() && w.is_nan()),
            "{what}[{i}]: cuda {g}, cpu {w}"
        );
    }
}

#[test]
fn row_ops_of_short_long_and_odd_rows_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    let shapes: &[&[usize]] = &[
        &[5000, 3],      // many short rows (13 rows per block of 4 threads)
        &[1000, 10],     // the MLP's logits
        &[300, 33],      // odd lengths
        &[7, 1000],      // few rows of a block each
        &[3, 70_001],    // few long rows, split into slices
        &[1, 1_000_000], // one row of a million
        &[1, 1],
        &[2, 5, 3],      // a middle axis: 32-column blocks
        &[3, 20_000, 5], // few columns, a long axis: split into slices
        &[40_000, 7],    // axis 0 of many rows, few columns
    ];
    for (s, &dims) in shapes.iter().enumerate() {
        let len: usize = dims.iter().product();
        for dtype in [DType::F32, DType::F64] {
            let cpu = m
                .from_vec(floats(len, s as u64), dims)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let gpu = cpu.to_device(dev).unwrap();
            for axis in 0..dims.len() as isize {
                let what = |op: &str| format!("{op} {dtype} {dims:?} axis {axis}");
                let read = |a: ndscope::NDArray| -> Vec<f64> {
                    a.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
                };
                let tol = if dtype == DType::F32 { 1e-5 } else { 1e-12 };
                assert_eq!(
                    read(gpu.argmax(axis).unwrap()),
                    read(cpu.argmax(axis).unwrap()),
                    "{}",
                    what("argmax")
                );
                close(
                    &what("softmax"),
                    &read(gpu.softmax(axis).unwrap()),
                    &read(cpu.softmax(axis).unwrap()),
                    tol,
                );
                close(
                    &what("log_softmax"),
                    &read(gpu.log_softmax(axis).unwrap()),
                    &read(cpu.log_softmax(axis).unwrap()),
                    tol,
                );
                assert_eq!(
                    read(gpu.max(axis, false).unwrap()),
                    read(cpu.max(axis, false).unwrap()),
                    "{}",
                    what("max")
                );
                // Multiples of 1/16 in ±62.5: sums are exact in f64 accumulation.
                assert_eq!(
                    read(gpu.sum(&[axis], false).unwrap()),
                    read(cpu.sum(&[axis], false).unwrap()),
                    "{}",
                    what("sum")
                );
            }
            gpu.close().unwrap();
            cpu.close().unwrap();
        }
    }
    m.close().unwrap();
}

/// `gelu` (one row of the unary table plus its CPU and CUDA kernels) gives the CPU's values on
/// the device: f32 and f64, short and long arrays (one block and a full grid), the tails.
#[test]
fn gelu_matches_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    for n in [1usize, 7, 1000, 70_001] {
        let mut x = floats(n, n as u64);
        let tails = [0.0, 40.0, -40.0, 1e-30, -1e-30, 6.0, -6.0];
        for (v, t) in x.iter_mut().zip(tails) {
            *v = t;
        }
        for dtype in [DType::F32, DType::F64] {
            let cpu = m.from_vec(x.clone(), [n]).unwrap().to_dtype(dtype).unwrap();
            let gpu = cpu.to_device(dev).unwrap();
            let read = |a: ndscope::NDArray| -> Vec<f64> {
                a.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap()
            };
            let tol = if dtype == DType::F32 { 1e-6 } else { 1e-14 };
            close(
                &format!("gelu {dtype} [{n}]"),
                &read(gpu.gelu().unwrap()),
                &read(cpu.gelu().unwrap()),
                tol,
            );
            gpu.close().unwrap();
            cpu.close().unwrap();
        }
    }
    let ints = m.zeros([3], DType::I32).unwrap().to_device(dev).unwrap();
    assert!(matches!(ints.gelu(), Err(Error::DTypeMismatch { .. })));
    m.close().unwrap();
}

#[test]
fn bad_input_is_reported_to_the_thread_that_queued_it() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.zeros([2, 3], DType::F32).unwrap();
    let bad = m.from_slice(&[0i64, 5], [2]).unwrap();
    let (picked, line) = (x.pick(&bad, 1).unwrap(), line!());
    // Another thread's read waits for the device and finds the bad index, but it is not its
    // error: its read succeeds.
    std::thread::scope(|s| {
        s.spawn(|| assert_eq!(x.to_vec::<f32>().unwrap(), vec![0.0; 6]))
            .join()
            .unwrap();
    });
    // This thread's next wait gets it, once.
    let e = dev.synchronize().unwrap_err();
    let (op, at, _) = invalid(&e);
    assert_eq!((op, at), ("pick", line), "{e}");
    dev.synchronize().unwrap();
    picked.close().unwrap();
    m.close().unwrap();
}

/// Driver calls per op on the simulator, printed as a table (`-- --nocapture`) and held to what
/// each op needs: one kernel or one cuBLAS product, no wait, no copy, no allocation once the
/// caches are warm (the first call of each op is a warm-up).
#[test]
fn driver_calls_per_op() {
    let Some((_serial, dev)) = gpu() else { return };
    if sim::stats().is_none() {
        println!("skipped: counting driver calls needs the simulator");
        return;
    }
    let m = Manager::new_base_on(dev).unwrap();
    let a = m.randn([64, 64], DType::F32).unwrap();
    let b = m.randn([64, 64], DType::F32).unwrap();
    let idx = m.from_slice(&[0i64, 3, 5, 7], [4]).unwrap();
    type Op<'a> = (
        &'static str,
        Box<dyn Fn() -> ndscope::Result<()> + 'a>,
        u64,
        u64,
    );
    let ops: Vec<Op> = vec![
        ("add", Box::new(|| a.add(&b)?.close()), 1, 0),
        ("relu", Box::new(|| a.relu()?.close()), 1, 0),
        (
            "mul_scalar_ (in place)",
            Box::new(|| a.mul_scalar_(1.0)),
            1,
            0,
        ),
        ("matmul", Box::new(|| a.matmul(&b)?.close()), 0, 1),
        (
            "sum over an axis",
            Box::new(|| a.sum(&[1], false)?.close()),
            1,
            0,
        ),
        ("softmax", Box::new(|| a.softmax(1)?.close()), 1, 0),
        (
            "one_hot (checked)",
            Box::new(|| idx.one_hot(8, DType::F32)?.close()),
            1,
            0,
        ),
        ("transpose", Box::new(|| a.transpose()?.close()), 1, 0),
    ];
    println!("| op | launches | cuBLAS | waits | copies | allocations |");
    println!("|---|---|---|---|---|---|");
    for (name, op, launches, cublas) in &ops {
        op().unwrap();
        let before = sim::stats().unwrap();
        for _ in 0..10 {
            op().unwrap();
        }
        let d = sim::diff(&before, &sim::stats().unwrap());
        let per = |k: &str| d[k] as f64 / 10.0;
        let copies = per("h2d") + per("d2h") + per("d2d");
        let allocs = per("allocs") + per("async_allocs") + per("host_allocs");
        println!(
            "| {name} | {} | {} | {} | {copies} | {allocs} |",
            per("launches"),
            per("cublas"),
            per("blocking_syncs"),
        );
        assert!(per("launches") <= *launches as f64, "{name}: {d:?}");
        assert!(per("cublas") <= *cublas as f64, "{name}: {d:?}");
        assert_eq!(per("blocking_syncs"), 0.0, "{name} waits: {d:?}");
        assert_eq!(allocs, 0.0, "{name} allocates: {d:?}");
    }
    m.close().unwrap();
}
