//! CUDA behaviour (DESIGN §3–§6 on `Device::Cuda(0)`): every op and factory computed on the
//! GPU against the CPU, transfers and their owners, ops mixing devices, workspaces that make no
//! driver allocation once learned and report the same figures as on the CPU, memory limits,
//! reports, `synchronize` and TF32. Without a usable GPU each test prints why it skipped (all
//! but `the_comparison_itself_tells_results_apart`, which checks the comparison they rely on).
//!
//! The tests share one device, its memory counters and process-wide settings (limits, TF32,
//! the random seed), so each holds `SERIAL` while it runs.
//!
//! Results are compared exactly for integer dtypes, copies, shape ops, comparisons,
//! `add sub mul div neg abs square relu maximum minimum`, scalar arithmetic, fills, casts and
//! `arange`/`eye` (CUDA kernels are compiled without fused multiply-adds, so they round as the
//! CPU does), bit for bit for `randn`/`rand` after the same seed, and with a relative
//! tolerance for transcendental functions (element by element) and for reductions and matrix
//! products (relative to the result's largest magnitude: the order of summation differs; their
//! float inputs are multiples of 1/16, so most sums are exact and a wrong element stands out).

use std::mem::discriminant;
use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{
    concat, manual_seed, memory_limit, memory_usage, set_memory_limit, stack, AllocationPolicy,
    DType, Device, DeviceUsage, Element, Error, LearningPolicy, LocationPolicy, Manager,
    MirroringPolicy, NDArray, ResetPolicy, Result, SpillPolicy, Transpose, Workspace,
    WorkspaceConfig,
};

mod common;
use common::{as_f64, size};

const MIB: usize = 1 << 20;

static SERIAL: Mutex<()> = Mutex::new(());

/// The GPU with this file's lock held, or `None` after printing why the test skips.
fn gpu() -> Option<(MutexGuard<'static, ()>, Device)> {
    let serial = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    common::cuda_device().map(|dev| (serial, dev))
}

// ---------------------------------------------------------------------------------------------
// Comparing the devices

/// How results of the two devices must agree (integers always exactly).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cmp {
    /// The same values; NaN matches NaN.
    Exact,
    /// The same bits.
    Bits,
    /// Each element within 1e-5 (f32), 1e-12 (f64), 1e-3 (f16: one unit in the last place) or
    /// 8e-3 (bf16: one unit in the last place) of the CPU's, relative to its magnitude (at
    /// least 1): transcendental functions (the device's f32 `expf`, `erff`, ... may differ from
    /// the CPU's by an ulp of f32, which can move the rounding to half by one place).
    Close,
    /// Each element within 1e-4 (f32), 1e-12 (f64), 2e-3 (f16) or 1e-2 (bf16) of the CPU's,
    /// relative to the largest magnitude of the CPU's result (at least 1): reductions and
    /// products, whose order of summation differs (half products accumulate in f32 on both
    /// devices, in another order).
    Scaled,
}

/// Asserts that `gpu`, computed on `dev`, equals `cpu` as `cmp` says, then closes both.
fn check(what: &str, cpu: &NDArray, gpu: &NDArray, dev: Device, cmp: Cmp) {
    assert_eq!(cpu.device(), Device::Cpu, "{what}");
    assert_eq!(gpu.device(), dev, "{what}");
    assert_values(what, cpu, gpu, cmp);
    cpu.close().unwrap();
    gpu.close().unwrap();
}

/// Asserts that `got` has the shape, dtype and values of `want` as `cmp` says.
fn assert_values(what: &str, want: &NDArray, got: &NDArray, cmp: Cmp) {
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    match want.dtype() {
        DType::I32 => assert_eq!(got.to_vec::<i32>().unwrap(), want.to_vec::<i32>().unwrap()),
        DType::I64 => assert_eq!(got.to_vec::<i64>().unwrap(), want.to_vec::<i64>().unwrap()),
        DType::U8 => assert_eq!(got.to_vec::<u8>().unwrap(), want.to_vec::<u8>().unwrap()),
        DType::F32 if cmp == Cmp::Bits => {
            let bits = |a: &NDArray| -> Vec<u32> {
                a.to_vec::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(got), bits(want), "{what}: bits");
        }
        DType::F64 if cmp == Cmp::Bits => {
            let bits = |a: &NDArray| -> Vec<u64> {
                a.to_vec::<f64>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(got), bits(want), "{what}: bits");
        }
        DType::F16 if cmp == Cmp::Bits => {
            let bits = |a: &NDArray| -> Vec<u16> {
                a.to_vec::<ndscope::f16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(got), bits(want), "{what}: bits");
        }
        DType::BF16 if cmp == Cmp::Bits => {
            let bits = |a: &NDArray| -> Vec<u16> {
                a.to_vec::<ndscope::bf16>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(bits(got), bits(want), "{what}: bits");
        }
        dtype => {
            let (w, g) = (as_f64(want), as_f64(got));
            // (Close, Scaled) tolerances of the dtype.
            let (close, scaled) = match dtype {
                DType::F32 => (1e-5, 1e-4),
                DType::F16 => (1e-3, 2e-3),
                DType::BF16 => (8e-3, 1e-2),
                _ => (1e-12, 1e-12),
            };
            let scale = w
                .iter()
                .filter(|v| v.is_finite())
                .fold(1.0f64, |m, v| m.max(v.abs()));
            let bad: Vec<usize> = (0..w.len())
                .filter(|&i| {
                    let (x, y) = (w[i], g[i]);
                    let close = match cmp {
                        Cmp::Exact | Cmp::Bits => false,
                        Cmp::Close => (x - y).abs() <= close * x.abs().max(1.0),
                        Cmp::Scaled => (x - y).abs() <= scaled * scale,
                    };
                    !(x == y || (x.is_nan() && y.is_nan()) || close)
                })
                .collect();
            if let Some(&i) = bad.first() {
                panic!(
                    "{what}: {} of {} elements differ ({cmp:?}); first at [{i}]: cpu {} vs cuda {}",
                    bad.len(),
                    w.len(),
                    w[i],
                    g[i]
                );
            }
        }
    }
}

#[test]
fn the_comparison_itself_tells_results_apart() {
    // Runs on every machine: the GPU tests are only as strong as this check.
    let m = Manager::new_base();
    let a = m.from_slice(&[1.0f32, f32::NAN, -0.0, 100.0], [4]).unwrap();
    let one_ulp = m
        .from_slice(&[1.0f32 + f32::EPSILON, f32::NAN, 0.0, 100.0], [4])
        .unwrap();
    let off = m.from_slice(&[1.0f32, f32::NAN, 0.0, 100.1], [4]).unwrap();
    let fails = |want: &NDArray, got: &NDArray, cmp: Cmp| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            assert_values("self-check", want, got, cmp)
        }))
        .is_err()
    };
    assert!(!fails(&a, &a, Cmp::Bits));
    assert!(fails(&a, &one_ulp, Cmp::Exact), "one ulp apart");
    assert!(!fails(&a, &one_ulp, Cmp::Close));
    assert!(!fails(&a, &one_ulp, Cmp::Scaled));
    assert!(fails(&a, &off, Cmp::Close), "1e-3 relative");
    assert!(fails(&a, &off, Cmp::Scaled));
    let zero = m.from_slice(&[1.0f32, f32::NAN, 0.0, 100.0], [4]).unwrap();
    assert!(!fails(&a, &zero, Cmp::Exact), "-0 equals 0");
    assert!(fails(&a, &zero, Cmp::Bits), "but not bit for bit");
    let ints = m.from_slice(&[1i64, 2], [2]).unwrap();
    let other = m.from_slice(&[1i64, 3], [2]).unwrap();
    assert!(fails(&ints, &other, Cmp::Scaled), "integers always exactly");
    let reshaped = ints.reshape([1, 2]).unwrap();
    assert!(fails(&ints, &reshaped, Cmp::Exact), "shapes");
    assert!(
        fails(&ints, &ints.to_dtype(DType::I32).unwrap(), Cmp::Exact),
        "dtypes"
    );
    m.close().unwrap();
}

/// Asserts that both devices refused with the same kind of error.
fn same_error(what: &str, cpu: &Error, gpu: &Error) {
    assert_eq!(
        discriminant(cpu),
        discriminant(gpu),
        "{what}: cpu says {cpu}, cuda says {gpu}"
    );
}

/// An array on the CPU and its copy on the GPU.
struct Pair {
    cpu: NDArray,
    gpu: NDArray,
}

/// What test data holds.
#[derive(Clone, Copy, PartialEq)]
enum Data {
    /// Floats in about ±3.7 (not powers of two), integers in ±1000, bytes 0..=255.
    Plain,
    /// As `Plain`, with every 11th element a special value: NaN, ±∞, ±0 for floats, the
    /// extremes, -1, 0 and 1 for integers.
    Special,
    /// As `Plain`, without zeros (integer divisors).
    NonZero,
    /// As `Plain`, but floats are multiples of 1/16 in ±4: sums of up to 2^18 of them and of
    /// their products are exact in f32 whatever the order, so reductions and products
    /// compare the kernels rather than the rounding of a summation order.
    Grid,
}

/// Runs ops on the CPU and the GPU and compares them. The CPU manager owns everything, the
/// GPU copies too (`to_device` keeps the owner).
struct Parity {
    dev: Device,
    m: Manager,
}

impl Parity {
    fn new(dev: Device) -> Parity {
        Parity {
            dev,
            m: Manager::new_base().with_name("parity"),
        }
    }

    /// `host` and its copy on the GPU.
    fn pair(&self, host: NDArray) -> Pair {
        let gpu = host.to_device(self.dev).unwrap();
        assert_eq!(gpu.manager().unwrap(), self.m);
        Pair { cpu: host, gpu }
    }

    fn input(&self, dtype: DType, shape: &[usize], seed: u64, data: Data) -> Pair {
        self.pair(host_data(&self.m, dtype, shape, seed, data))
    }

    /// `f` of the CPU arrays against `f` of the GPU arrays: equal results, or the same error.
    fn op<const N: usize>(
        &self,
        what: &str,
        args: [&Pair; N],
        cmp: Cmp,
        f: impl Fn([&NDArray; N]) -> Result<NDArray>,
    ) {
        let cpu = f(args.map(|a| &a.cpu));
        let gpu = f(args.map(|a| &a.gpu));
        match (cpu, gpu) {
            (Ok(c), Ok(g)) => check(what, &c, &g, self.dev, cmp),
            (Err(c), Err(g)) => same_error(what, &c, &g),
            (c, g) => panic!("{what}: cpu gives {c:?}, cuda gives {g:?}"),
        }
    }

    /// `f` on both devices where the input is bad in a way only the device sees (an index out
    /// of range, an integer divisor of 0): the CPU refuses at the call; the GPU queues the op
    /// and its next wait (here the read of the result) gives the same kind of error, from the
    /// same op.
    fn refused_at_next_wait<const N: usize>(
        &self,
        what: &str,
        args: [&Pair; N],
        f: impl Fn([&NDArray; N]) -> Result<NDArray>,
    ) {
        let cpu = f(args.map(|a| &a.cpu)).expect_err(what);
        let gpu = f(args.map(|a| &a.gpu)).unwrap_or_else(|e| panic!("{what}: cuda gives {e}"));
        let read = gpu.to_dtype(DType::F64).and_then(|g| g.to_vec::<f64>());
        let err = read.expect_err(what);
        same_error(what, &cpu, &err);
        let op = |e: &Error| match e {
            Error::InvalidArgument { op, .. } => *op,
            _ => "",
        };
        assert_eq!(op(&cpu), op(&err), "{what}: {cpu} / {err}");
        gpu.close().unwrap();
    }

    /// The in-place `f` on the CPU target with CPU arguments and on the GPU target with GPU
    /// arguments: equal targets after, or the same error with both targets unchanged.
    fn inplace<const N: usize>(
        &self,
        what: &str,
        target: &Pair,
        args: [&Pair; N],
        cmp: Cmp,
        f: impl Fn(&NDArray, [&NDArray; N]) -> Result<()>,
    ) {
        let before = target.cpu.duplicate().unwrap();
        let cpu = f(&target.cpu, args.map(|a| &a.cpu));
        let gpu = f(&target.gpu, args.map(|a| &a.gpu));
        match (cpu, gpu) {
            (Ok(()), Ok(())) => assert_values(what, &target.cpu, &target.gpu, cmp),
            (Err(c), Err(g)) => {
                same_error(what, &c, &g);
                assert_values(what, &before, &target.cpu, Cmp::Exact);
                assert_values(what, &before, &target.gpu, Cmp::Exact);
            }
            (c, g) => panic!("{what}: cpu gives {c:?}, cuda gives {g:?}"),
        }
        before.close().unwrap();
    }

    fn close(self) {
        self.m.close().unwrap();
    }
}

/// Deterministic test data of `dtype` on `m` (see [`Data`]).
fn host_data(m: &Manager, dtype: DType, shape: &[usize], seed: u64, data: Data) -> NDArray {
    let v = common::values(size(shape), seed, 1000);
    let special = |i: usize| data == Data::Special && i % 11 == 5;
    let pick = |i: usize, list: &[f64]| list[(i / 11) % list.len()];
    let float = |i: usize, x: i64| -> f64 {
        if special(i) {
            pick(i, &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -0.0, 0.0])
        } else if data == Data::Grid {
            (x.rem_euclid(129) - 64) as f64 / 16.0
        } else {
            x as f64 * 0.0037
        }
    };
    let int = |i: usize, x: i64, extremes: [i64; 2]| -> i64 {
        if special(i) {
            [extremes[0], extremes[1], -1, 0, 1][(i / 11) % 5]
        } else if data == Data::NonZero && x == 0 {
            1
        } else {
            x
        }
    };
    let vals = v.iter().copied().enumerate();
    match dtype {
        DType::F32 => m.from_vec(vals.map(|(i, x)| float(i, x) as f32).collect(), shape),
        DType::F64 => m.from_vec(vals.map(|(i, x)| float(i, x)).collect(), shape),
        DType::F16 => m.from_vec(
            vals.map(|(i, x)| ndscope::f16::from_f64(float(i, x)))
                .collect(),
            shape,
        ),
        DType::BF16 => m.from_vec(
            vals.map(|(i, x)| ndscope::bf16::from_f64(float(i, x)))
                .collect(),
            shape,
        ),
        DType::I32 => m.from_vec(
            vals.map(|(i, x)| int(i, x, [i32::MIN.into(), i32::MAX.into()]) as i32)
                .collect(),
            shape,
        ),
        DType::I64 => m.from_vec(
            vals.map(|(i, x)| int(i, x, [i64::MIN, i64::MAX])).collect(),
            shape,
        ),
        DType::U8 => m.from_vec(
            vals.map(|(i, x)| {
                if special(i) {
                    pick(i, &[0.0, 255.0, 128.0, 127.0, 1.0]) as u8
                } else {
                    match x.rem_euclid(256) as u8 {
                        0 if data == Data::NonZero => 1,
                        b => b,
                    }
                }
            })
            .collect(),
            shape,
        ),
    }
    .unwrap()
}

/// Which axes a bit mask names.
fn axes_of(bits: u32, ndim: usize) -> Vec<isize> {
    (0..ndim)
        .filter(|&d| bits >> d & 1 == 1)
        .map(|d| d as isize)
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Parity of every op

const PAIRS: &[(&[usize], &[usize])] = &[
    (&[], &[]),
    (&[7], &[]),
    (&[], &[7]),
    (&[1], &[33]),
    (&[33], &[33]),
    (&[2, 1, 3], &[4, 1]),
    (&[5, 1], &[1, 7]),
    (&[3, 1, 1, 2], &[1, 4, 5, 1]),
    (&[2, 1, 3, 1, 5], &[1, 4, 1, 6, 1]),
    (&[0, 3], &[3]),
    (&[2, 0], &[1, 1]),
    (&[300, 257], &[257]),
    (&[300, 1], &[1, 128]),
    (&[70_001], &[70_001]),
    (&[70_001], &[1]),
];

#[test]
fn elementwise_ops_and_comparisons_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let e = Cmp::Exact;
    for dtype in DType::ALL {
        for (i, &(ash, bsh)) in PAIRS.iter().enumerate() {
            let a = p.input(dtype, ash, i as u64, Data::Special);
            let b = p.input(dtype, bsh, 100 + i as u64, Data::Special);
            let w = |op: &str| format!("{op} {dtype} {ash:?} {bsh:?}");
            p.op(&w("add"), [&a, &b], e, |[x, y]| x.add(y));
            p.op(&w("sub"), [&a, &b], e, |[x, y]| x.sub(y));
            p.op(&w("mul"), [&a, &b], e, |[x, y]| x.mul(y));
            p.op(&w("maximum"), [&a, &b], e, |[x, y]| x.maximum(y));
            p.op(&w("minimum"), [&a, &b], e, |[x, y]| x.minimum(y));
            p.op(&w("gt"), [&a, &b], e, |[x, y]| x.gt(y));
            p.op(&w("lt"), [&a, &b], e, |[x, y]| x.lt(y));
            p.op(&w("eq"), [&a, &b], e, |[x, y]| x.eq(y));
            p.op(&w("eq self"), [&a, &a], e, |[x, y]| x.eq(y));
            // Floats divide by anything (IEEE); integer divisors must not hold 0.
            let d = p.input(dtype, bsh, 200 + i as u64, Data::NonZero);
            p.op(&w("div"), [&a, &d], e, |[x, y]| x.div(y));
            if dtype.is_float() {
                p.op(&w("div by specials"), [&a, &b], e, |[x, y]| x.div(y));
            }
        }
        // An integer divisor holding 0 is refused on both devices.
        if !dtype.is_float() {
            let a = p.input(dtype, &[5], 1, Data::Plain);
            let z = p.pair(p.m.zeros([5], dtype).unwrap());
            p.refused_at_next_wait(&format!("div by 0 {dtype}"), [&a, &z], |[x, y]| x.div(y));
        }
    }
    p.close();
}

#[test]
fn unary_and_scalar_ops_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let (e, close) = (Cmp::Exact, Cmp::Close);
    for dtype in DType::ALL {
        for shape in [&[][..], &[0], &[7], &[33, 5], &[70_001]] {
            for data in [Data::Plain, Data::Special] {
                let a = p.input(dtype, shape, size(shape) as u64, data);
                let w = |op: &str| format!("{op} {dtype} {shape:?}");
                p.op(&w("neg"), [&a], e, |[x]| x.neg());
                p.op(&w("abs"), [&a], e, |[x]| x.abs());
                p.op(&w("square"), [&a], e, |[x]| x.square());
                p.op(&w("relu"), [&a], e, |[x]| x.relu());
                // Floats only; integers give DTypeMismatch on both.
                p.op(&w("exp"), [&a], close, |[x]| x.exp());
                p.op(&w("log"), [&a], close, |[x]| x.log());
                p.op(&w("sqrt"), [&a], close, |[x]| x.sqrt());
                p.op(&w("tanh"), [&a], close, |[x]| x.tanh());
                p.op(&w("sigmoid"), [&a], close, |[x]| x.sigmoid());
                p.op(&w("gelu"), [&a], close, |[x]| x.gelu());
                let (add, sub, mul, div) = match dtype {
                    DType::F32 | DType::F64 => (0.37, -1.25, 3.3, 0.7),
                    DType::U8 => (7.0, 3.0, 3.0, 2.0),
                    _ => (7.0, -3.0, -3.0, -2.0),
                };
                p.op(&w("add_scalar"), [&a], e, |[x]| x.add_scalar(add));
                p.op(&w("sub_scalar"), [&a], e, |[x]| x.sub_scalar(sub));
                p.op(&w("mul_scalar"), [&a], e, |[x]| x.mul_scalar(mul));
                p.op(&w("div_scalar"), [&a], e, |[x]| x.div_scalar(div));
                // Refused for integers (fractional), IEEE for floats.
                p.op(&w("add_scalar 0.5"), [&a], e, |[x]| x.add_scalar(0.5));
                p.op(&w("div_scalar 0"), [&a], e, |[x]| x.div_scalar(0.0));
                for exponent in [0.0, 1.0, 2.0, 3.0] {
                    // Integer powers of integers are exact; floats go through pow.
                    let cmp = if dtype.is_float() { close } else { e };
                    let what = w(&format!("pow_scalar {exponent}"));
                    p.op(&what, [&a], cmp, |[x]| x.pow_scalar(exponent));
                }
                if dtype.is_float() {
                    for exponent in [0.5, -1.0, 1.7] {
                        let what = w(&format!("pow_scalar {exponent}"));
                        p.op(&what, [&a], close, |[x]| x.pow_scalar(exponent));
                    }
                }
                for value in [-1.0, 0.0, 0.5, 0.0037 * 5.0, 3.0, f64::NAN] {
                    let w = |op: &str| w(&format!("{op} {value}"));
                    p.op(&w("gt_scalar"), [&a], e, |[x]| x.gt_scalar(value));
                    p.op(&w("lt_scalar"), [&a], e, |[x]| x.lt_scalar(value));
                    p.op(&w("eq_scalar"), [&a], e, |[x]| x.eq_scalar(value));
                }
            }
        }
    }
    p.close();
}

#[test]
fn reductions_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let (e, scaled) = (Cmp::Exact, Cmp::Scaled);
    let small: &[&[usize]] = &[
        &[],
        &[1],
        &[7],
        &[3, 5],
        &[2, 3, 4],
        &[3, 1, 4, 2],
        &[0, 3],
        &[3, 0],
    ];
    // Past 2^16 elements along a contiguous axis the GPU reduces in two passes.
    let large: &[(&[usize], &[isize])] = &[
        (&[100_003], &[0]),
        (&[2, 100_000], &[1]),
        (&[3, 70_000], &[-1]),
        (&[100_000, 2], &[0]),
        (&[40_001, 3], &[0]),
        (&[8, 101, 50], &[1]),
        (&[20, 31, 40, 3], &[0, 2]),
        (&[6, 70, 7, 30], &[1, 3]),
    ];
    for dtype in DType::ALL {
        for (s, &shape) in small.iter().enumerate() {
            let a = p.input(dtype, shape, s as u64, Data::Grid);
            let nd = shape.len();
            for bits in 0..(1u32 << nd) {
                let axes = axes_of(bits, nd);
                for keep in [false, true] {
                    let w = |op: &str| format!("{op} {dtype} {shape:?} {axes:?} keep {keep}");
                    p.op(&w("sum"), [&a], scaled, |[x]| x.sum(&axes, keep));
                    p.op(&w("mean"), [&a], scaled, |[x]| x.mean(&axes, keep));
                }
            }
            for axis in -(nd as isize)..nd as isize {
                for keep in [false, true] {
                    let what = format!("max {dtype} {shape:?} {axis} keep {keep}");
                    p.op(&what, [&a], e, |[x]| x.max(axis, keep));
                }
                let what = format!("argmax {dtype} {shape:?} {axis}");
                p.op(&what, [&a], e, |[x]| x.argmax(axis));
            }
            let what = format!("sum_all {dtype} {shape:?}");
            p.op(&what, [&a], scaled, |[x]| x.sum_all());
            let what = format!("mean_all {dtype} {shape:?}");
            p.op(&what, [&a], scaled, |[x]| x.mean_all());
        }
        for (s, &(shape, axes)) in large.iter().enumerate() {
            let a = p.input(dtype, shape, 50 + s as u64, Data::Grid);
            for keep in [false, true] {
                let w = |op: &str| format!("{op} {dtype} {shape:?} {axes:?} keep {keep}");
                p.op(&w("sum"), [&a], scaled, |[x]| x.sum(axes, keep));
                p.op(&w("mean"), [&a], scaled, |[x]| x.mean(axes, keep));
                if let &[axis] = axes {
                    p.op(&w("max"), [&a], e, |[x]| x.max(axis, keep));
                }
            }
            if let &[axis] = axes {
                let what = format!("argmax {dtype} {shape:?} {axis}");
                p.op(&what, [&a], e, |[x]| x.argmax(axis));
            }
            p.op(&format!("sum_all {dtype} {shape:?}"), [&a], scaled, |[x]| {
                x.sum_all()
            });
            p.op(
                &format!("mean_all {dtype} {shape:?}"),
                [&a],
                scaled,
                |[x]| x.mean_all(),
            );
        }
        // NaN wins `max`, and `argmax` points at the first NaN; the extremes of integers.
        for shape in [&[40, 70][..], &[2, 100_000]] {
            let a = p.input(dtype, shape, 7, Data::Special);
            for axis in [0, 1] {
                let what = format!("max {dtype} {shape:?} {axis} with specials");
                p.op(&what, [&a], e, |[x]| x.max(axis, false));
                let what = format!("argmax {dtype} {shape:?} {axis} with specials");
                p.op(&what, [&a], e, |[x]| x.argmax(axis));
            }
            if !dtype.is_float() {
                p.op(
                    &format!("sum {dtype} {shape:?} with extremes"),
                    [&a],
                    e,
                    |[x]| x.sum(&[1], false),
                );
            }
        }
    }
    p.close();
}

#[test]
fn shape_ops_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let e = Cmp::Exact;
    for dtype in DType::ALL {
        let a = p.input(dtype, &[2, 3, 4], 1, Data::Special);
        for shape in [&[24][..], &[4, 6], &[1, 24, 1], &[2, 2, 2, 3], &[5]] {
            let what = format!("reshape {dtype} {shape:?}");
            p.op(&what, [&a], e, |[x]| x.reshape(shape));
        }
        for (r, c) in [(1, 1), (1, 7), (33, 17), (64, 64), (0, 5), (1025, 999)] {
            let m = p.input(dtype, &[r, c], 2, Data::Plain);
            p.op(&format!("transpose {dtype} {r}x{c}"), [&m], e, |[x]| {
                x.transpose()
            });
        }
        let perms: &[(&[usize], &[usize])] = &[
            (&[], &[]),
            (&[3, 5], &[1, 0]),
            (&[2, 3, 4], &[0, 1, 2]),
            (&[2, 3, 4], &[2, 0, 1]),
            (&[2, 3, 4], &[1, 2, 0]),
            (&[3, 1, 4, 2], &[3, 1, 0, 2]),
            (&[2, 0, 3], &[2, 0, 1]),
            (&[8, 70, 90], &[0, 2, 1]),
            (&[40, 30, 50], &[2, 1, 0]),
            (&[5, 6, 7, 8, 9], &[4, 2, 0, 3, 1]),
        ];
        for &(dims, perm) in perms {
            let x = p.input(dtype, dims, 3, Data::Plain);
            p.op(
                &format!("permute {dtype} {dims:?} {perm:?}"),
                [&x],
                e,
                |[x]| x.permute(perm),
            );
        }
        let broadcasts: &[(&[usize], &[usize])] = &[
            (&[], &[3, 2]),
            (&[1], &[7]),
            (&[3], &[2, 3]),
            (&[4, 1, 3], &[2, 4, 6, 3]),
            (&[1, 3], &[0, 3]),
            (&[300, 1], &[300, 257]),
            (&[2, 3], &[3, 3]),
        ];
        for &(from, to) in broadcasts {
            let x = p.input(dtype, from, 4, Data::Plain);
            p.op(
                &format!("broadcast_to {dtype} {from:?} {to:?}"),
                [&x],
                e,
                |[x]| x.broadcast_to(to),
            );
        }
        let narrows: &[(&[usize], isize, usize, usize)] = &[
            (&[7], 0, 2, 3),
            (&[7], 0, 7, 0),
            (&[4, 5], 1, 1, 3),
            (&[2, 3, 4], -2, 1, 2),
            (&[2, 0, 4], 2, 1, 2),
            (&[100, 1000], 1, 17, 900),
            (&[4, 5], 1, 3, 3),
        ];
        for &(dims, axis, start, len) in narrows {
            let x = p.input(dtype, dims, 5, Data::Plain);
            let what = format!("narrow {dtype} {dims:?} {axis} {start} {len}");
            p.op(&what, [&x], e, |[x]| x.narrow(axis, start, len));
        }
        let x = p.input(dtype, &[1, 3, 1, 2], 6, Data::Plain);
        for axes in [&[][..], &[0], &[-2], &[2, 0], &[1]] {
            p.op(&format!("squeeze {dtype} {axes:?}"), [&x], e, |[x]| {
                x.squeeze(axes)
            });
        }
        for axis in [0, 2, 4, -1, -5, 5] {
            p.op(&format!("unsqueeze {dtype} {axis}"), [&x], e, |[x]| {
                x.unsqueeze(axis)
            });
        }
        // concat and stack along every axis, with an empty piece and a shared input.
        for axis in 0..3usize {
            let piece = |s: usize, seed: u64| {
                let mut dims = vec![3usize, 4, 5];
                dims[axis] = s;
                p.input(dtype, &dims, seed, Data::Special)
            };
            let (x, y, z) = (piece(2, 7), piece(0, 8), piece(5, 9));
            for signed in [axis as isize, axis as isize - 3] {
                let what = format!("concat {dtype} axis {signed}");
                p.op(&what, [&x, &y, &z, &x], e, |[a, b, c, d]| {
                    concat(&[a.clone(), b.clone(), c.clone(), d.clone()], signed)
                });
            }
        }
        let parts: Vec<Pair> = (0..4)
            .map(|k| p.input(dtype, &[2, 3], 10 + k, Data::Special))
            .collect();
        for axis in [0, 1, 2, -1, -3, 3] {
            let what = format!("stack {dtype} axis {axis}");
            p.op(
                &what,
                [&parts[0], &parts[1], &parts[2], &parts[3]],
                e,
                |[a, b, c, d]| stack(&[a.clone(), b.clone(), c.clone(), d.clone()], axis),
            );
        }
        let big = p.input(dtype, &[300, 200], 11, Data::Plain);
        let other = p.input(dtype, &[300, 57], 12, Data::Plain);
        p.op(
            &format!("concat {dtype} large"),
            [&big, &other],
            e,
            |[a, b]| concat(&[a.clone(), b.clone()], 1),
        );
    }
    p.close();
}

#[test]
fn casts_copies_and_transfers_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let e = Cmp::Exact;
    // Values that probe every conversion rule: wrapping, saturation, NaN, truncation.
    let floats = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        -0.0,
        0.0,
        2.7,
        -2.7,
        0.5,
        -0.5,
        255.9,
        256.0,
        300.5,
        -1.0,
        1e10,
        -1e10,
        3e9,
        -3e9,
        1.5e19,
        -9.3e18,
        16_777_217.0,
    ];
    let ints = [
        i64::MIN,
        i64::MAX,
        i64::from(i32::MIN) - 1,
        i64::from(i32::MAX) + 1,
        i64::from(i32::MIN),
        i64::from(i32::MAX),
        -129,
        -1,
        0,
        127,
        128,
        255,
        256,
        300,
        (1 << 53) + 1,
    ];
    let sources: Vec<Pair> = vec![
        p.pair(p.m.from_slice(&floats, [floats.len()]).unwrap()),
        p.pair(
            p.m.from_vec(floats.iter().map(|&v| v as f32).collect(), [floats.len()])
                .unwrap(),
        ),
        p.pair(p.m.from_slice(&ints, [ints.len()]).unwrap()),
        p.pair(
            p.m.from_vec(ints.iter().map(|&v| v as i32).collect(), [ints.len()])
                .unwrap(),
        ),
        p.pair(
            p.m.from_vec(ints.iter().map(|&v| v as u8).collect(), [ints.len()])
                .unwrap(),
        ),
    ];
    for src in &sources {
        for to in DType::ALL {
            let what = format!("to_dtype {} -> {to}", src.cpu.dtype());
            p.op(&what, [src], e, |[x]| x.to_dtype(to));
        }
    }
    for from in DType::ALL {
        for shape in [&[][..], &[0], &[70_001], &[3, 0, 2]] {
            let a = p.input(from, shape, 3, Data::Special);
            for to in DType::ALL {
                let what = format!("to_dtype {from} -> {to} {shape:?}");
                p.op(&what, [&a], e, |[x]| x.to_dtype(to));
            }
            p.op(&format!("duplicate {from} {shape:?}"), [&a], e, |[x]| {
                x.duplicate()
            });
            // A GPU → GPU copy on the same device.
            p.op(&format!("to_device {from} {shape:?}"), [&a], e, |[x]| {
                x.to_device(x.device())
            });
        }
    }
    p.close();
}

#[test]
fn matrix_products_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let s = Cmp::Scaled;
    for dtype in DType::ALL {
        for &(m, k, n) in &[
            (1, 1, 1),
            (7, 1, 33),
            (33, 17, 7),
            (64, 64, 64),
            (129, 257, 65),
            (0, 3, 4),
            (3, 0, 4),
            (4, 3, 0),
        ] {
            let a = p.input(dtype, &[m, k], 1, Data::Grid);
            let b = p.input(dtype, &[k, n], 2, Data::Grid);
            p.op(
                &format!("matmul {dtype} {m}x{k}x{n}"),
                [&a, &b],
                s,
                |[x, y]| x.matmul(y),
            );
        }
        // Batched: [b, m, k]·[b, k, n], a shared right operand, a shared left operand.
        for &(b, m, k, n) in &[(3, 2, 5, 7), (7, 33, 17, 9), (0, 2, 3, 4), (5, 16, 0, 8)] {
            let x = p.input(dtype, &[b, m, k], 3, Data::Grid);
            let y = p.input(dtype, &[b, k, n], 4, Data::Grid);
            let (x2, y2) = (
                p.input(dtype, &[m, k], 5, Data::Grid),
                p.input(dtype, &[k, n], 6, Data::Grid),
            );
            let w = |layout: &str| format!("batched matmul {layout} {dtype} {b}x{m}x{k}x{n}");
            p.op(&w("both"), [&x, &y], s, |[x, y]| x.matmul(y));
            p.op(&w("shared right"), [&x, &y2], s, |[x, y]| x.matmul(y));
            p.op(&w("shared left"), [&x2, &y], s, |[x, y]| x.matmul(y));
        }
        for &(rows, k, n) in &[
            (3, 5, 7),
            (16, 64, 200),
            (1, 9, 1024),
            (70, 1, 8),
            (0, 3, 4),
            (3, 0, 4),
        ] {
            for t in [
                Transpose::None,
                Transpose::Left,
                Transpose::Right,
                Transpose::Both,
            ] {
                let left = matches!(t, Transpose::Left | Transpose::Both);
                let right = matches!(t, Transpose::Right | Transpose::Both);
                let a_shape = if left { [k, rows] } else { [rows, k] };
                let b_shape = if right { [n, k] } else { [k, n] };
                let a = p.input(dtype, &a_shape, 7, Data::Grid);
                let b = p.input(dtype, &b_shape, 8, Data::Grid);
                let what = format!("matmul_t {t:?} {dtype} {rows}x{k}x{n}");
                p.op(&what, [&a, &b], s, |[x, y]| x.matmul_t(y, t));
                // c = beta·c + alpha·op(a)·op(b); fractional or negative scales are refused
                // for integers (and bytes) on both devices.
                for (beta, alpha) in [(2.0, 3.0), (0.0, 1.0), (1.0, 0.0), (1.0, -1.0), (0.5, 2.0)] {
                    let c = p.input(dtype, &[rows, n], 9, Data::Grid);
                    let what = format!("addmm_ {t:?} {dtype} {rows}x{k}x{n} {beta} {alpha}");
                    p.inplace(&what, &c, [&a, &b], s, |c, [a, b]| {
                        c.addmm_(a, b, t, beta, alpha)
                    });
                }
            }
        }
    }
    // v ← μ·v + xᵀ·g; w ← w − lr·v, with batches inside and past the CPU's fused kernel and
    // an empty layer (an empty batch has its own test).
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for dims in [
            (7, 3, 5),
            (64, 16, 96),
            (33, 64, 130),
            (5, 100, 3),
            (1, 1, 1),
            (0, 4, 3),
        ] {
            for momentum in [0.9, 0.0] {
                sgd_parity(&p, dtype, dims, momentum);
            }
        }
    }
    p.close();
}

/// `sgd_dense_update_` of a `[fan_in, fan_out]` layer for a batch of `batch` on both devices.
/// Without momentum the velocity is first filled with NaN: the old velocity is not read.
fn sgd_parity(
    p: &Parity,
    dtype: DType,
    (fan_in, batch, fan_out): (usize, usize, usize),
    momentum: f64,
) {
    let x = p.input(dtype, &[batch, fan_in], 10, Data::Grid);
    let g = p.input(dtype, &[batch, fan_out], 11, Data::Grid);
    let v = p.input(dtype, &[fan_in, fan_out], 12, Data::Grid);
    let w = p.input(dtype, &[fan_in, fan_out], 13, Data::Grid);
    if momentum == 0.0 {
        v.cpu.fill_(f64::NAN).unwrap();
        v.gpu.fill_(f64::NAN).unwrap();
    }
    let what = format!("sgd_dense_update_ {dtype} {fan_in}x{batch}x{fan_out} μ {momentum}");
    p.inplace(&what, &w, [&v, &x, &g], Cmp::Scaled, |w, [v, x, g]| {
        w.sgd_dense_update_(v, x, g, 0.25, momentum)
    });
    assert_values(&format!("{what}: velocity"), &v.cpu, &v.gpu, Cmp::Scaled);
    assert!(
        as_f64(&v.gpu).iter().all(|x| !x.is_nan()),
        "{what}: the old velocity was read"
    );
}

#[test]
fn sgd_dense_update_of_an_empty_batch_matches_the_cpu() {
    // The gradient xᵀ·g of an empty batch is 0: v ← μ·v, and without momentum v ← 0 (the old
    // velocity is not read, as for any batch), w unchanged.
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for momentum in [0.9, 0.0] {
            sgd_parity(&p, dtype, (4, 0, 3), momentum);
        }
    }
    p.close();
}

#[test]
fn softmax_one_hot_and_pick_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let (e, close) = (Cmp::Exact, Cmp::Close);
    let shapes: &[&[usize]] = &[
        &[1],
        &[7],
        &[3, 5],
        &[2, 3, 4],
        &[1, 33, 1],
        &[200, 300],
        &[3, 70_000],
        &[6, 2000, 3],
        &[0, 4],
        &[3, 0],
    ];
    for dtype in DType::ALL {
        for (s, &dims) in shapes.iter().enumerate() {
            let a = p.input(dtype, dims, s as u64, Data::Plain);
            let nd = dims.len() as isize;
            for axis in -nd..=nd {
                let what = format!("softmax {dtype} {dims:?} {axis}");
                p.op(&what, [&a], close, |[x]| x.softmax(axis));
                let what = format!("log_softmax {dtype} {dims:?} {axis}");
                p.op(&what, [&a], close, |[x]| x.log_softmax(axis));
            }
        }
        // Large inputs do not overflow on either device.
        if dtype.is_float() {
            let big = p.pair(
                p.m.from_slice(&[1000.0f64, 1001.0, -1000.0, 89.0, 90.0, 91.0], [2, 3])
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            );
            for axis in [0, 1] {
                p.op(
                    &format!("softmax {dtype} large {axis}"),
                    [&big],
                    close,
                    |[x]| x.softmax(axis),
                );
                p.op(
                    &format!("log_softmax {dtype} large {axis}"),
                    [&big],
                    close,
                    |[x]| x.log_softmax(axis),
                );
            }
        }
    }
    for from in [DType::I32, DType::I64, DType::U8] {
        for dims in [&[][..], &[1], &[7], &[3, 5], &[0], &[2, 0, 3], &[70_001]] {
            let depth = 9;
            let idx: Vec<i64> = (0..size(dims)).map(|i| (i * 7 % depth) as i64).collect();
            let indices = p.pair(p.m.from_vec(idx, dims).unwrap().to_dtype(from).unwrap());
            for to in DType::ALL {
                let what = format!("one_hot {from} -> {to} {dims:?}");
                p.op(&what, [&indices], e, |[x]| x.one_hot(depth, to));
            }
        }
        // Out of range: refused on both devices.
        let bad = p.pair(
            p.m.from_slice(&[0i64, 9, 1], [3])
                .unwrap()
                .to_dtype(from)
                .unwrap(),
        );
        p.refused_at_next_wait(&format!("one_hot {from} out of range"), [&bad], |[x]| {
            x.one_hot(9, DType::F32)
        });
    }
    let pick_shapes: &[&[usize]] = &[
        &[7],
        &[4, 3],
        &[1, 33],
        &[2, 3, 4],
        &[1000, 10],
        &[3, 70_000],
    ];
    for dtype in DType::ALL {
        for from in [DType::I32, DType::I64, DType::U8] {
            for (s, &dims) in pick_shapes.iter().enumerate() {
                let a = p.input(dtype, dims, 20 + s as u64, Data::Special);
                for ax in 0..dims.len() {
                    let mut rest = dims.to_vec();
                    let n = rest.remove(ax);
                    let idx: Vec<i64> = (0..size(&rest))
                        .map(|q| ((q * 5 + 3) % n.min(200)) as i64)
                        .collect();
                    let indices = p.pair(
                        p.m.from_vec(idx, &rest[..])
                            .unwrap()
                            .to_dtype(from)
                            .unwrap(),
                    );
                    for axis in [ax as isize, ax as isize - dims.len() as isize] {
                        let what = format!("pick {dtype} {from} {dims:?} {axis}");
                        p.op(&what, [&a, &indices], e, |[x, i]| x.pick(i, axis));
                    }
                    // An index past the axis: refused on both devices.
                    let over = p.pair(p.m.full(&rest[..], n.min(255) as f64, from).unwrap());
                    if n < 255 {
                        let what = format!("pick {dtype} {from} {dims:?} out of range");
                        p.refused_at_next_wait(&what, [&a, &over], |[x, i]| x.pick(i, ax as isize));
                    }
                }
            }
        }
    }
    p.close();
}

/// Source shapes for in-place ops, each with a target shape it broadcasts to.
const INPLACE: &[(&[usize], &[usize])] = &[
    (&[], &[]),
    (&[7], &[]),
    (&[7], &[1]),
    (&[33], &[33]),
    (&[3, 5], &[5]),
    (&[3, 5], &[3, 1]),
    (&[2, 3, 4], &[1, 3, 1]),
    (&[0, 4], &[4]),
    (&[300, 257], &[257]),
    (&[300, 130], &[300, 1]),
    (&[70_001], &[70_001]),
];

#[test]
fn inplace_ops_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let p = Parity::new(dev);
    let e = Cmp::Exact;
    for dtype in DType::ALL {
        for (i, &(tsh, ssh)) in INPLACE.iter().enumerate() {
            let t = p.input(dtype, tsh, i as u64, Data::Plain);
            let s = p.input(dtype, ssh, 50 + i as u64, Data::Plain);
            let w = |op: &str| format!("{op} {dtype} {tsh:?} {ssh:?}");
            p.inplace(&w("add_"), &t, [&s], e, |t, [s]| t.add_(s));
            p.inplace(&w("sub_"), &t, [&s], e, |t, [s]| t.sub_(s));
            p.inplace(&w("mul_"), &t, [&s], e, |t, [s]| t.mul_(s));
            for alpha in [1.0, -2.0, 0.5] {
                let what = w(&format!("axpy_ {alpha}"));
                p.inplace(&what, &t, [&s], e, |t, [s]| t.axpy_(alpha, s));
            }
            p.inplace(&w("assign_"), &t, [&s], e, |t, [s]| t.assign_(s));
            // The source is the target itself.
            p.inplace(&w("add_ self"), &t, [], e, |t, []| t.add_(t));
            p.inplace(&w("axpy_ self"), &t, [], e, |t, []| t.axpy_(2.0, t));
            p.inplace(&w("mul_ self"), &t, [], e, |t, []| t.mul_(t));
            p.inplace(&w("assign_ self"), &t, [], e, |t, []| t.assign_(t));
            for value in [3.0, -2.7, 300.0, f64::NAN, 1e10] {
                let what = w(&format!("fill_ {value}"));
                p.inplace(&what, &t, [], e, |t, []| t.fill_(value));
            }
            let t = p.input(dtype, tsh, 100 + i as u64, Data::Special);
            for value in [3.0, -1.5, 0.0] {
                let what = w(&format!("mul_scalar_ {value}"));
                p.inplace(&what, &t, [], e, |t, []| t.mul_scalar_(value));
            }
            // A source that would grow the target: refused on both, target unchanged.
            let grow = p.input(dtype, &[2, 1, 1, 1, 1], 7, Data::Plain);
            p.inplace(&w("add_ growing"), &t, [&grow], e, |t, [s]| t.add_(s));
        }
    }
    p.close();
}

#[test]
fn factories_match_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    let cpu = Manager::new_base().with_name("cpu");
    let gpu_m = Manager::new_base_on(dev).unwrap().with_name("gpu");
    let both = |what: &str, f: &dyn Fn(&Manager) -> Result<NDArray>| match (f(&cpu), f(&gpu_m)) {
        (Ok(c), Ok(g)) => {
            assert_eq!(g.manager().unwrap(), gpu_m, "{what}");
            check(what, &c, &g, dev, Cmp::Exact);
        }
        (Err(c), Err(g)) => same_error(what, &c, &g),
        (c, g) => panic!("{what}: cpu gives {c:?}, cuda gives {g:?}"),
    };
    for dtype in DType::ALL {
        for shape in [&[][..], &[7], &[0, 4], &[300, 257], &[70_001]] {
            let w = |op: &str| format!("{op} {dtype} {shape:?}");
            both(&w("zeros"), &|m| m.zeros(shape, dtype));
            both(&w("ones"), &|m| m.ones(shape, dtype));
            for value in [2.7, -1.0, 300.0, -0.0, f64::NAN, 1e10, -1e10] {
                both(&w(&format!("full {value}")), &|m| {
                    m.full(shape, value, dtype)
                });
            }
            // `empty`: only the shape and dtype are specified; what is written reads back.
            let e = gpu_m.empty(shape, dtype).unwrap();
            assert_eq!((e.dims(), e.dtype(), e.device()), (shape, dtype, dev));
            e.fill_(5.0).unwrap();
            assert!(as_f64(&e).iter().all(|&v| v == 5.0), "{}", w("empty"));
            e.close().unwrap();
            // from_slice, from_vec and scalar of the same host data.
            let data = host_data(&cpu, dtype, shape, 3, Data::Special);
            match dtype {
                DType::F32 => uploads::<f32>(&cpu, &gpu_m, dev, &data),
                DType::F64 => uploads::<f64>(&cpu, &gpu_m, dev, &data),
                DType::I32 => uploads::<i32>(&cpu, &gpu_m, dev, &data),
                DType::I64 => uploads::<i64>(&cpu, &gpu_m, dev, &data),
                DType::U8 => uploads::<u8>(&cpu, &gpu_m, dev, &data),
                DType::F16 => uploads::<ndscope::f16>(&cpu, &gpu_m, dev, &data),
                DType::BF16 => uploads::<ndscope::bf16>(&cpu, &gpu_m, dev, &data),
            }
            data.close().unwrap();
        }
        for (start, stop, step) in [
            (0.0, 10.0, 1.0),
            (0.0, 1.0, 0.1),
            (-3.5, 7.2, 0.37),
            (10.0, 0.0, -1.5),
            (5.0, 5.0, 1.0),
            (0.0, 100_000.0, 1.0),
            (-300.0, 300.0, 2.5),
        ] {
            let what = format!("arange {dtype} {start} {stop} {step}");
            both(&what, &|m| m.arange(start, stop, step, dtype));
        }
        for n in [0, 1, 5, 300] {
            both(&format!("eye {dtype} {n}"), &|m| m.eye(n, dtype));
        }
    }
    cpu.close().unwrap();
    gpu_m.close().unwrap();
}

/// `from_slice`, `from_vec` and `scalar` of `data`'s elements, on both devices.
fn uploads<T: Element>(cpu: &Manager, gpu: &Manager, dev: Device, data: &NDArray) {
    let v: Vec<T> = data.to_vec().unwrap();
    let shape = data.dims();
    let what = format!("uploads {} {shape:?}", T::DTYPE);
    let c = cpu.from_slice(&v, shape).unwrap();
    let g = gpu.from_slice(&v, shape).unwrap();
    assert_eq!(g.to_vec::<T>().unwrap().len(), v.len());
    check(&format!("from_slice {what}"), &c, &g, dev, Cmp::Exact);
    let c = cpu.from_vec(v.clone(), shape).unwrap();
    let g = gpu.from_vec(v.clone(), shape).unwrap();
    check(&format!("from_vec {what}"), &c, &g, dev, Cmp::Exact);
    if let Some(&first) = v.first() {
        let g = gpu.scalar(first).unwrap();
        assert_eq!(g.device(), dev);
        assert_eq!(
            g.to_scalar::<T>().unwrap().to_f64().to_bits(),
            first.to_f64().to_bits()
        );
        check(
            &format!("scalar {what}"),
            &cpu.scalar(first).unwrap(),
            &g,
            dev,
            Cmp::Exact,
        );
    }
}

#[test]
fn random_numbers_are_the_same_bits_on_both_devices() {
    let Some((_serial, dev)) = gpu() else { return };
    let cpu = Manager::new_base();
    let gpu_m = Manager::new_base_on(dev).unwrap();
    // Half types too: each value rounded once from the f64 draw, a uniform draw that rounds up
    // to `high` made the largest value below it (many of the 300 001 draws near 3 do in bf16).
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for shape in [&[][..], &[1], &[7], &[1000, 3], &[300_001]] {
            manual_seed(1234);
            let c = cpu.randn(shape, dtype).unwrap();
            let c2 = cpu.rand(shape, -2.0, 3.0, dtype).unwrap();
            manual_seed(1234);
            let g = gpu_m.randn(shape, dtype).unwrap();
            let g2 = gpu_m.rand(shape, -2.0, 3.0, dtype).unwrap();
            check(&format!("randn {dtype} {shape:?}"), &c, &g, dev, Cmp::Bits);
            check(&format!("rand {dtype} {shape:?}"), &c2, &g2, dev, Cmp::Bits);
        }
    }
    for (dtype, low, high) in [
        (DType::I32, -5.0, 1000.0),
        (DType::I32, 0.5, 2.5),
        (DType::I64, -1e6, 1e6),
        (DType::U8, 0.0, 256.0),
        (DType::F32, -1e-3, 1e-3),
        (DType::F64, 1e6, 1e6 + 1.0),
        // Half ranges whose top rounds up often, a range inside one half step, one at 0.
        (DType::F16, 0.0, 1.0),
        (DType::BF16, 1000.0, 1003.0),
        (DType::F16, 1.0, 1.0004),
        (DType::BF16, -1e-3, 0.0),
    ] {
        manual_seed(99);
        let c = cpu.rand([10_007], low, high, dtype).unwrap();
        manual_seed(99);
        let g = gpu_m.rand([10_007], low, high, dtype).unwrap();
        let what = format!("rand {dtype} [{low}, {high})");
        check(&what, &c, &g, dev, Cmp::Bits);
    }
    // One stream, whichever device draws: interleaving devices changes nothing.
    manual_seed(7);
    let (c1, g2) = (
        cpu.randn([1000], DType::F32).unwrap(),
        gpu_m.randn([777], DType::F32).unwrap(),
    );
    manual_seed(7);
    let (g1, c2) = (
        gpu_m.randn([1000], DType::F32).unwrap(),
        cpu.randn([777], DType::F32).unwrap(),
    );
    check("randn interleaved, first draw", &c1, &g1, dev, Cmp::Bits);
    check("randn interleaved, second draw", &c2, &g2, dev, Cmp::Bits);
    // And another seed gives other numbers.
    manual_seed(8);
    let other = gpu_m
        .randn([1000], DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    manual_seed(7);
    let again = gpu_m
        .randn([1000], DType::F32)
        .unwrap()
        .to_vec::<f32>()
        .unwrap();
    assert_ne!(other, again);
    cpu.close().unwrap();
    gpu_m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Transfers and mixed devices

#[test]
fn to_device_both_ways_keeps_the_owner_and_the_values() {
    let Some((_serial, dev)) = gpu() else { return };
    let host = Manager::new_base().with_name("host");
    let device = Manager::new_base_on(dev).unwrap().with_name("device");
    let other = Manager::new_base().with_name("other");
    for dtype in DType::ALL {
        // Empty, small, and larger than the two 4 MiB staging buffers together.
        for shape in [&[][..], &[0], &[7], &[1000, 3], &[2_100_000]] {
            let what = format!("{dtype} {shape:?}");
            let a = host_data(&host, dtype, shape, 5, Data::Special);
            let (g, back) = {
                let _active = other.activate();
                let g = a.to_device(dev).unwrap();
                let back = g.to_device(Device::Cpu).unwrap();
                (g, back)
            };
            assert_eq!(g.manager().unwrap(), host, "{what}");
            assert_eq!(g.device(), dev);
            assert_eq!(back.manager().unwrap(), host, "{what}");
            assert_eq!(back.device(), Device::Cpu);
            assert_values(&format!("{what} up"), &a, &g, Cmp::Bits);
            assert_values(&format!("{what} round trip"), &a, &back, Cmp::Bits);

            // An array of a GPU manager: its host copy and its device copy stay with it.
            g.attach(&device).unwrap();
            let (to_host, on_device) = {
                let _active = other.activate();
                (g.to_device(Device::Cpu).unwrap(), g.to_device(dev).unwrap())
            };
            assert_eq!(to_host.manager().unwrap(), device, "{what}");
            assert_eq!(to_host.device(), Device::Cpu);
            assert_eq!(on_device.manager().unwrap(), device, "{what}");
            assert_eq!(on_device.device(), dev);
            assert_ne!(on_device.id(), g.id(), "a copy");
            assert_values(&format!("{what} down"), &a, &to_host, Cmp::Bits);
            assert_values(&format!("{what} device copy"), &a, &on_device, Cmp::Bits);

            // Copies are independent of their source.
            g.fill_(1.0).unwrap();
            assert_values(&format!("{what} after fill"), &a, &to_host, Cmp::Bits);
            assert_values(&format!("{what} after fill"), &a, &on_device, Cmp::Bits);
            for x in [a, g, back, to_host, on_device] {
                x.close().unwrap();
            }
        }
    }
    assert!(
        other.report().arrays.is_empty(),
        "nothing went to the active scope"
    );
    // A capped owner refuses the copy before allocating.
    let x = host.ones([4], DType::F32).unwrap();
    host.cap();
    let before = memory_usage(dev);
    assert!(matches!(x.to_device(dev), Err(Error::Capped { .. })));
    assert_eq!(memory_usage(dev).arrays, before.arrays);
    assert_eq!(memory_usage(dev).in_use, before.in_use);
    for m in [host, device, other] {
        m.close().unwrap();
    }
}

#[test]
fn ops_mixing_devices_are_device_mismatch_naming_both() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base();
    let c = m
        .from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])
        .unwrap();
    let g = c.to_device(dev).unwrap();
    let ct = m.ones([3, 2], DType::F32).unwrap();
    let gt = ct.to_device(dev).unwrap();
    let idx = m.from_slice(&[0i64, 2], [2]).unwrap();
    let gidx = idx.to_device(dev).unwrap();
    let square = m.zeros([3, 3], DType::F32).unwrap();
    let gsquare = square.to_device(dev).unwrap();
    let arrays = m.report().arrays.len();
    let refused: Vec<(&str, Result<()>)> = vec![
        ("add", c.add(&g).map(drop)),
        ("add", g.add(&c).map(drop)),
        ("sub", c.sub(&g).map(drop)),
        ("mul", g.mul(&c).map(drop)),
        ("div", c.div(&g).map(drop)),
        ("maximum", c.maximum(&g).map(drop)),
        ("minimum", g.minimum(&c).map(drop)),
        ("gt", c.gt(&g).map(drop)),
        ("lt", g.lt(&c).map(drop)),
        ("eq", c.eq(&g).map(drop)),
        ("matmul", c.matmul(&gt).map(drop)),
        ("matmul", g.matmul(&ct).map(drop)),
        ("matmul_t", c.matmul_t(&g, Transpose::Right).map(drop)),
        ("concat", concat(&[c.clone(), g.clone()], 0).map(drop)),
        ("stack", stack(&[g.clone(), c.clone()], 0).map(drop)),
        ("pick", c.pick(&gidx, 1).map(drop)),
        ("pick", g.pick(&idx, 1).map(drop)),
        ("add_", c.add_(&g)),
        ("sub_", g.sub_(&c)),
        ("mul_", c.mul_(&g)),
        ("axpy_", g.axpy_(2.0, &c)),
        ("assign_", c.assign_(&g)),
        ("addmm_", square.addmm_(&c, &g, Transpose::Left, 1.0, 1.0)),
        ("addmm_", gsquare.addmm_(&g, &c, Transpose::Left, 1.0, 1.0)),
        (
            "sgd_dense_update_",
            square.sgd_dense_update_(&gsquare, &c, &c, 0.1, 0.9),
        ),
        (
            "sgd_dense_update_",
            gsquare.sgd_dense_update_(&square, &g, &g, 0.1, 0.9),
        ),
    ];
    for (op, result) in refused {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::DeviceMismatch { .. }), "{op}: {err}");
        let text = err.to_string();
        assert!(text.contains(op), "{text}");
        assert!(
            text.contains("cpu") && text.contains(&dev.to_string()),
            "{text}"
        );
    }
    assert_eq!(m.report().arrays.len(), arrays, "nothing was created");
    let want = vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
    assert_eq!(c.to_vec::<f32>().unwrap(), want);
    assert_eq!(g.to_vec::<f32>().unwrap(), want);
    assert_eq!(square.to_vec::<f32>().unwrap(), vec![0.0; 9]);
    assert_eq!(gsquare.to_vec::<f32>().unwrap(), vec![0.0; 9]);
    m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Workspaces on a CUDA owner

/// A small MLP whose parameters live on `owner`'s device; the same numbers on every device.
struct Mlp {
    x: NDArray,
    w1: NDArray,
    b1: NDArray,
    w2: NDArray,
}

impl Mlp {
    fn new(owner: &Manager) -> Mlp {
        let f = |shape: &[usize], seed: u64| {
            let v: Vec<f32> = common::values(size(shape), seed, 100)
                .iter()
                .map(|&v| v as f32 / 256.0)
                .collect();
            owner.from_vec(v, shape).unwrap()
        };
        Mlp {
            x: f(&[16, 32], 1),
            w1: f(&[32, 64], 2),
            b1: f(&[64], 3),
            w2: f(&[64, 10], 4),
        }
    }

    /// One training-like step, run inside a workspace cycle (its temporaries land there):
    /// forward, a loss read back, a gradient and an in-place update of `w2`.
    fn step(&self) -> Result<f32> {
        let h = self.x.matmul(&self.w1)?.add(&self.b1)?.relu()?;
        let p = h.matmul(&self.w2)?.softmax(1)?;
        let loss = p.mul(&p)?.sum(&[1], false)?.sum_all()?.to_scalar::<f32>()?;
        let g = h.matmul_t(&p, Transpose::Left)?;
        self.w2.axpy_(-0.05, &g)?;
        Ok(loss)
    }
}

/// `cycles` steps of the MLP in a default workspace of an owner on `dev`: the losses and the
/// final `w2`, read back.
fn mlp_run(
    dev: Device,
    cycles: usize,
    mut each: impl FnMut(usize, &Workspace),
) -> (Vec<f32>, Vec<f32>) {
    let owner = Manager::new_base_on(dev).unwrap().with_name("trainer");
    let mlp = Mlp::new(&owner);
    let ws = owner.workspace("step", WorkspaceConfig::default()).unwrap();
    let mut losses = Vec::new();
    for i in 0..cycles {
        losses.push(ws.cycle(|_| mlp.step()).unwrap());
        each(i, &ws);
    }
    let w2 = mlp.w2.to_vec::<f32>().unwrap();
    owner.close().unwrap();
    (losses, w2)
}

#[test]
fn a_learned_cuda_workspace_cycle_makes_no_driver_allocation() {
    let Some((_serial, dev)) = gpu() else { return };
    const WARMUP: usize = 3;
    const LEARNED: usize = 20;
    let mut before = None;
    let (losses, w2) = mlp_run(dev, WARMUP + LEARNED, |i, ws| {
        if i + 1 == WARMUP {
            before = Some((memory_usage(dev), ws.stats()));
        } else if i + 1 > WARMUP {
            let (usage, stats) = before.clone().unwrap();
            let now = memory_usage(dev);
            assert_eq!(
                now.driver_allocations, usage.driver_allocations,
                "cycle {i}: a learned cycle asked the driver for memory"
            );
            assert_eq!(
                (now.in_use, now.arrays),
                (usage.in_use, usage.arrays),
                "cycle {i}"
            );
            let s = ws.stats();
            assert!(s.initialized);
            assert_eq!(
                (s.capacity, s.spilled_count, s.reallocations),
                (stats.capacity, stats.spilled_count, stats.reallocations),
                "cycle {i}"
            );
        }
    });
    // The GPU computed the same steps as the CPU.
    let (cpu_losses, cpu_w2) = mlp_run(Device::Cpu, WARMUP + LEARNED, |_, _| {});
    for (i, (g, c)) in losses.iter().zip(&cpu_losses).enumerate() {
        assert!(
            (g - c).abs() <= 1e-4 * c.abs().max(1.0),
            "loss {i}: cuda {g} vs cpu {c}"
        );
    }
    let scale = cpu_w2.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, c)) in w2.iter().zip(&cpu_w2).enumerate() {
        assert!(
            (g - c).abs() <= 1e-4 * scale,
            "w2[{i}]: cuda {g} vs cpu {c}"
        );
    }
}

#[test]
fn host_only_mirroring_puts_workspace_arrays_on_the_cpu_and_mmap_is_unsupported() {
    let Some((_serial, dev)) = gpu() else { return };
    let owner = Manager::new_base_on(dev).unwrap();
    let conf = WorkspaceConfig::builder()
        .mirroring(MirroringPolicy::HostOnly)
        .build()
        .unwrap();
    let ws = owner.workspace("pinned", conf).unwrap();
    for cycle in 0..3 {
        ws.cycle(|c| {
            let a = c.arange(0.0, 1000.0, 1.0, DType::F32)?;
            assert_eq!(a.device(), Device::Cpu, "cycle {cycle}");
            let y = a.mul_scalar(2.0)?;
            assert_eq!(y.device(), Device::Cpu);
            let g = y.to_device(dev)?;
            assert_eq!(g.device(), dev);
            assert_eq!(g.manager()?, *c, "to_device keeps the owner");
            assert_eq!(g.to_vec::<f32>()?, y.to_vec::<f32>()?);
            let back = g.add_scalar(1.0)?.to_device(Device::Cpu)?;
            assert_eq!(back.sum_all()?.to_scalar::<f32>()?, 1000.0 * 999.0 + 1000.0);
            assert!(matches!(a.add(&g), Err(Error::DeviceMismatch { .. })));
            Ok(())
        })
        .unwrap();
    }
    assert!(ws.stats().initialized);
    assert!(ws.stats().capacity > 0);

    let mmap = WorkspaceConfig::builder()
        .location(LocationPolicy::Mmap)
        .learning(LearningPolicy::None)
        .initial_size(1 << 16)
        .build()
        .unwrap();
    let err = owner.workspace("mapped", mmap).unwrap_err();
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
    assert!(err.to_string().contains(&dev.to_string()), "{err}");
    assert_eq!(owner.report().workspaces.len(), 1, "only 'pinned'");
    owner.close().unwrap();
}

fn strict() -> ndscope::WorkspaceConfigBuilder {
    WorkspaceConfig::builder().allocation(AllocationPolicy::Strict)
}

/// One configuration of every policy that changes the figures.
fn policy_configs() -> Vec<(&'static str, WorkspaceConfig)> {
    let none =
        |b: ndscope::WorkspaceConfigBuilder| b.learning(LearningPolicy::None).initial_size(4096);
    vec![
        ("default", WorkspaceConfig::default()),
        ("first loop, external", strict().build().unwrap()),
        (
            "first loop, reallocate",
            strict().spill(SpillPolicy::Reallocate).build().unwrap(),
        ),
        (
            "first loop, fail",
            strict().spill(SpillPolicy::Fail).build().unwrap(),
        ),
        (
            "over time, reallocate",
            WorkspaceConfig::builder()
                .learning(LearningPolicy::OverTime)
                .cycles_before_initialization(3)
                .spill(SpillPolicy::Reallocate)
                .build()
                .unwrap(),
        ),
        ("none, external", none(strict()).build().unwrap()),
        (
            "none, fail",
            none(strict()).spill(SpillPolicy::Fail).build().unwrap(),
        ),
        (
            "circular",
            strict()
                .learning(LearningPolicy::None)
                .initial_size(8192)
                .reset(ResetPolicy::EndOfBuffer)
                .build()
                .unwrap(),
        ),
        (
            "bounded, overallocate 1.0",
            WorkspaceConfig::builder()
                .overallocation_limit(1.0)
                .min_size(2048)
                .max_size(8192)
                .spill(SpillPolicy::Reallocate)
                .build()
                .unwrap(),
        ),
        (
            "host-only mirroring",
            strict()
                .spill(SpillPolicy::Reallocate)
                .mirroring(MirroringPolicy::HostOnly)
                .build()
                .unwrap(),
        ),
    ]
}

/// The kind of an error, without the parts that differ from run to run (ids, sites).
fn kind(e: &Error) -> &'static str {
    match e {
        Error::WorkspaceFull { .. } => "WorkspaceFull",
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::OutOfMemory { .. } => "OutOfMemory",
        _ => "other",
    }
}

/// Fixed cycles of allocations in a workspace of `conf` on an owner on `dev`: a trace of the
/// figures after every allocation and cycle, of refusals, and of which `ret`-ed arrays are
/// still open.
fn policy_trace(dev: Device, conf: WorkspaceConfig) -> Vec<String> {
    let owner = Manager::new_base_on(dev).unwrap();
    let ws = owner.workspace("ws", conf).unwrap();
    let mut trace = vec![format!("created {:?}", ws.stats())];
    let mut kept: Vec<NDArray> = Vec::new();
    let cycles: [&[usize]; 6] = [
        &[100, 50],
        &[1000],
        &[10, 100, 20],
        &[3000],
        &[100, 50],
        &[700, 700],
    ];
    for (i, sizes) in cycles.iter().enumerate() {
        let c = ws.open().unwrap();
        for (j, &n) in sizes.iter().enumerate() {
            match c.full([n], j as f64 + 1.0, DType::F32) {
                Ok(a) => {
                    trace.push(format!("cycle {i} array {j}: {:?}", ws.stats()));
                    if j == 0 {
                        kept.push(c.ret(&a).unwrap());
                    }
                }
                Err(e) => trace.push(format!(
                    "cycle {i} array {j}: {} {:?}",
                    kind(&e),
                    ws.stats()
                )),
            }
        }
        c.close().unwrap();
        let open: Vec<bool> = kept.iter().map(NDArray::is_open).collect();
        trace.push(format!(
            "after cycle {i}: {:?} kept open {open:?}",
            ws.stats()
        ));
        for (k, a) in kept.iter().enumerate().filter(|(_, a)| a.is_open()) {
            let sum = a.sum_all().unwrap().to_scalar::<f32>().unwrap();
            trace.push(format!("kept {k}: {} elements, sum {sum}", a.size()));
        }
    }
    match ws.initialize() {
        Ok(()) => trace.push(format!("initialized {:?}", ws.stats())),
        Err(e) => trace.push(format!("initialize: {} {:?}", kind(&e), ws.stats())),
    }
    owner.close().unwrap();
    trace
}

#[test]
fn every_workspace_policy_gives_the_same_figures_on_cuda_as_on_the_cpu() {
    let Some((_serial, dev)) = gpu() else { return };
    for (name, conf) in policy_configs() {
        let cpu = policy_trace(Device::Cpu, conf.clone());
        let gpu = policy_trace(dev, conf);
        assert_eq!(cpu.len(), gpu.len(), "{name}");
        for (c, g) in cpu.iter().zip(&gpu) {
            assert_eq!(c, g, "{name}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Limits, reports, synchronisation, TF32

/// Resets the device's memory limit when dropped, also when a test fails.
struct LimitReset(Device);

impl Drop for LimitReset {
    fn drop(&mut self) {
        set_memory_limit(self.0, None);
    }
}

#[test]
fn a_cuda_memory_limit_refuses_allocations_and_changes_nothing() {
    let Some((_serial, dev)) = gpu() else { return };
    let m = Manager::new_base_on(dev).unwrap();
    let host = Manager::new_base();
    let keep = m.ones([1024], DType::F32).unwrap();
    let big_host = host.zeros([MIB], DType::F32).unwrap(); // 4 MiB
                                                           // Transfers both ways once, so any staging memory exists before the figures are taken.
    let warm = host.ones([4], DType::F32).unwrap().to_device(dev).unwrap();
    assert_eq!(warm.to_vec::<f32>().unwrap(), vec![1.0; 4]);
    warm.close().unwrap();

    let _reset = LimitReset(dev);
    let limit = memory_usage(dev).in_use + MIB;
    set_memory_limit(dev, Some(limit));
    assert_eq!(memory_limit(dev), Some(limit));
    let before = memory_usage(dev);
    assert_eq!(before.limit, Some(limit));
    let four_mib_ws = WorkspaceConfig::builder()
        .learning(LearningPolicy::None)
        .initial_size(4 * MIB)
        .build()
        .unwrap();
    let refused: Vec<(&str, Result<()>)> = vec![
        ("zeros", m.zeros([MIB], DType::F32).map(drop)),
        ("to_device", big_host.to_device(dev).map(drop)),
        ("op result", keep.broadcast_to([1024, 1024]).map(drop)),
        ("workspace block", m.workspace("big", four_mib_ws).map(drop)),
    ];
    let refusals = refused.len() as u64;
    for (what, result) in refused {
        let err = result.unwrap_err();
        match &err {
            Error::OutOfMemory {
                device,
                requested,
                limit: l,
                ..
            } => {
                assert_eq!(*device, dev, "{what}");
                assert_eq!(*l, Some(limit), "{what}");
                assert!(*requested >= 4 * MIB, "{what}: {requested}");
            }
            other => panic!("{what}: expected OutOfMemory, got {other}"),
        }
        let text = err.to_string();
        assert!(text.contains(&dev.to_string()), "{what}: {text}");
        assert!(text.contains(&ndscope::fmt_bytes(limit)), "{what}: {text}");
        assert!(text.contains("set_memory_limit"), "{what}: {text}");
        // The refusals (all made above) change nothing but the count of refusals.
        let after = memory_usage(dev);
        assert_eq!(after.ooms, before.ooms + refusals, "{what} is counted");
        assert_eq!(
            DeviceUsage {
                ooms: before.ooms,
                ..after
            },
            before,
            "{what} changed nothing else"
        );
    }
    assert_eq!(m.report().arrays.len(), 1);
    assert!(m.report().workspaces.is_empty());
    // Under the limit allocations go on; without it, so does the big one.
    let small = m.ones([1000], DType::F32).unwrap();
    assert_eq!(small.sum_all().unwrap().to_scalar::<f32>().unwrap(), 1000.0);
    set_memory_limit(dev, None);
    assert_eq!(memory_limit(dev), None);
    let big = m.zeros([MIB], DType::F32).unwrap();
    assert_eq!(big.size(), MIB);
    host.close().unwrap();
    m.close().unwrap();
}

#[test]
fn reports_and_dumps_list_cuda_arrays_with_their_device() {
    let Some((_serial, dev)) = gpu() else { return };
    let gpu_m = Manager::new_base_on(dev).unwrap().with_name("gpu");
    let host = Manager::new_base().with_name("host");
    let _x = gpu_m
        .zeros([4, 8], DType::F32)
        .unwrap()
        .with_name("weights");
    let _y = host.ones([3], DType::F64).unwrap().with_name("on_host");
    let _z = host
        .ones([5], DType::F64)
        .unwrap()
        .to_device(dev)
        .unwrap()
        .with_name("moved");

    let r = gpu_m.report();
    assert_eq!(r.device, dev);
    assert_eq!(r.arrays.len(), 1);
    let a = &r.arrays[0];
    assert_eq!(a.name.as_deref(), Some("weights"));
    assert_eq!((a.device, a.dtype, a.bytes), (dev, DType::F32, 128));
    assert_eq!(a.shape.dims(), &[4, 8]);
    let hr = host.report();
    let find = |name: &str| {
        hr.arrays
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
            .unwrap()
    };
    assert_eq!(
        find("moved").device,
        dev,
        "a CPU manager's array on the GPU"
    );
    assert_eq!(find("on_host").device, Device::Cpu);
    let listed = Manager::system()
        .report()
        .children
        .iter()
        .any(|m| m.id == r.id && m.device == dev);
    assert!(listed, "the system report lists the GPU manager");

    let dump = gpu_m.debug_dump(1);
    let first = dump.lines().next().unwrap();
    assert!(
        first.contains("gpu") && first.contains(&dev.to_string()),
        "{dump}"
    );
    assert!(dump.contains("'weights'"), "{dump}");
    let dump = host.debug_dump(1);
    let moved = dump.lines().find(|l| l.contains("'moved'")).unwrap();
    assert!(
        moved.contains(&dev.to_string()),
        "the array line names its device: {dump}"
    );
    let on_host = dump.lines().find(|l| l.contains("'on_host'")).unwrap();
    // The line names no device of the GPU (its creation site, `tests/cuda.rs:…`, says "cuda").
    assert!(!on_host.contains(&dev.to_string()), "{dump}");
    gpu_m.close().unwrap();
    host.close().unwrap();
}

#[test]
fn synchronize_waits_for_queued_work() {
    let Some((_serial, dev)) = gpu() else { return };
    let cpu = Manager::new_base();
    manual_seed(5);
    let a = cpu.randn([512, 512], DType::F32).unwrap();
    let g = a.to_device(dev).unwrap();
    let want = a
        .matmul(&a)
        .unwrap()
        .relu()
        .unwrap()
        .add_scalar(1.0)
        .unwrap();
    let got = g
        .matmul(&g)
        .unwrap()
        .relu()
        .unwrap()
        .add_scalar(1.0)
        .unwrap();
    for _ in 0..200 {
        g.mul_scalar_(1.0).unwrap();
    }
    dev.synchronize().unwrap();
    dev.synchronize().unwrap();
    check("after synchronize", &want, &got, dev, Cmp::Scaled);
    assert_values("untouched", &a, &g, Cmp::Bits);
    cpu.close().unwrap();
}

/// Restores strict FP32 when dropped, also when a test fails.
struct Tf32Reset;

impl Drop for Tf32Reset {
    fn drop(&mut self) {
        ndscope::set_allow_tf32(false);
    }
}

#[test]
fn tf32_products_stay_close_to_the_cpu_and_strict_ones_closer() {
    let Some((_serial, dev)) = gpu() else { return };
    let _reset = Tf32Reset;
    let cpu = Manager::new_base();
    manual_seed(11);
    let a = cpu.randn([256, 256], DType::F32).unwrap();
    let b = cpu.randn([256, 256], DType::F32).unwrap();
    // The reference: the product in f64 of the same f32 inputs.
    let n = 256;
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    let mut want = vec![0.0f64; n * n];
    for i in 0..n {
        for k in 0..n {
            let x = f64::from(av[i * n + k]);
            for j in 0..n {
                want[i * n + j] += x * f64::from(bv[k * n + j]);
            }
        }
    }
    let (ga, gb) = (a.to_device(dev).unwrap(), b.to_device(dev).unwrap());
    let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let worst = |got: &[f32]| -> f64 {
        got.iter()
            .zip(&want)
            .map(|(&g, w)| (f64::from(g) - w).abs())
            .fold(0.0, f64::max)
            / scale
    };
    ndscope::set_allow_tf32(true);
    let tf32 = ga.matmul(&gb).unwrap().to_vec::<f32>().unwrap();
    assert!(worst(&tf32) <= 1e-2, "TF32: {}", worst(&tf32));
    ndscope::set_allow_tf32(false);
    let strict = ga.matmul(&gb).unwrap().to_vec::<f32>().unwrap();
    assert!(worst(&strict) <= 1e-5, "strict FP32: {}", worst(&strict));
    // TF32 must change something: inputs rounded to 10 mantissa bits give other products,
    // further from the reference than strict FP32's.
    let differing = tf32.iter().zip(&strict).filter(|(t, s)| t != s).count();
    assert!(
        differing > 0,
        "TF32 gave the strict FP32 result bit for bit: `set_allow_tf32(true)` changed nothing"
    );
    assert!(
        worst(&tf32) > worst(&strict),
        "TF32 is no further from the f64 reference ({}) than strict FP32 ({}); \
         {differing} of {} elements differ",
        worst(&tf32),
        worst(&strict),
        n * n
    );
    cpu.close().unwrap();
}
