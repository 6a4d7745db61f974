//! Gradient checks for every differentiable op (issue 21, item 4): the gradient `backward`
//! computes for `loss = Σ op(x) · r` (with a fixed random `r`, so every output element counts)
//! against central finite differences in `F64`, as property tests over shapes, broadcasting,
//! axes and inputs that reach the op through `transpose`/`permute`/`narrow` inside the recorded
//! function (ndscope has no views: every shape op returns a copy, so that is what a
//! non-contiguous input is, and the gradient must flow back through those ops too).
//!
//! Each check also computes the `F32` gradient on the same values and compares it with the
//! `F64` one. On a CUDA device (where the CUDA tests run; the `cuda` half of each test skips
//! without one) the same cases compare the device's `F64` and `F32` gradients with the CPU's
//! `F64` gradient, which the CPU half checked against finite differences.
//!
//! Inputs stay away from kinks by construction: `relu`/`abs` inputs away from 0, `max`/
//! `maximum`/`minimum` operands with no ties, `log`/`sqrt`/`pow_scalar` inputs positive, divisors
//! away from 0 (a fused `Dense` with `Relu`, whose kink is in `x · w + b`, skips a case whose
//! pre-activation comes within 1e-3 of 0).
//!
//! Last, the tests of what is not differentiated: comparisons, `argmax`, `one_hot` and integer
//! results record nothing; an op with no gradient (`gelu`) is an error at `backward`; and the
//! errors of `backward` itself (a seed of the wrong shape, a second `backward` through the same
//! tape, a loss that was not recorded).

use std::sync::{Mutex, MutexGuard, PoisonError};

use ndscope::{
    concat, no_gradient, stack, Activation, DType, Dense, Device, Error, Manager, NDArray,
    Transpose,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::TestCaseError;

mod common;
use common::device_tests;

/// The step of the central differences.
const H: f64 = 1e-6;
/// Analytic `F64` against central differences, relative to the largest gradient element + 1.
const FD_TOL: f64 = 1e-6;
/// `F32` against `F64` (same values), relative to the largest gradient element + 1.
const F32_TOL: f64 = 2e-4;
/// A CUDA device's `F64` gradient against the CPU's.
const DEVICE_F64_TOL: f64 = 1e-9;
/// `F16` against `F64`, relative to the largest gradient element + 1: the inputs round to 11
/// bits (2^-11 relative) and every op rounds its result once more, so a chain of a few ops with
/// products over short sums stays within a few hundred ulps of 2^-11.
const F16_TOL: f64 = 1e-2;
/// `BF16` against `F64`: as for `F16`, with 8 bits (2^-8 relative).
const BF16_TOL: f64 = 6e-2;
/// The largest input magnitude the half checks take: beyond it a square or a product of the
/// larger cases overflows f16 (65504), which is f16's range, not a wrong gradient.
const HALF_INPUT_MAX: f64 = 8.0;

/// The checks take turns: a CUDA case holds the device for a while, and the CPU cases are fast.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The proptest configuration: `cpu` cases on the CPU (each checked against finite
/// differences), fewer on a CUDA device (each compared with the CPU; the simulated GPU is slow).
fn config(dev: Device, cpu: u32) -> ProptestConfig {
    let cases = if dev == Device::Cpu {
        cpu
    } else {
        (cpu / 16).max(2)
    };
    ProptestConfig {
        cases,
        max_shrink_iters: 256,
        ..ProptestConfig::default()
    }
}

/// Where an input's values come from (all of them exactly representable in `F32`, so the `F32`
/// and `F64` gradients are of the same values).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Domain {
    /// In [-2, 2].
    Any,
    /// In [0.5, 2] (`log`, `sqrt`, `pow_scalar`).
    Positive,
    /// In ±[0.25, 2] (`abs`, `relu`, divisors).
    AwayFromZero,
    /// On the grid 0.1·k + offset, k in -20..=20: two operands with offsets 0 and 0.05 never tie
    /// (`maximum`, `minimum`).
    Grid(f64),
    /// All different, at least 0.04 apart (`max` along an axis).
    Distinct,
}

fn f32_exact(v: f64) -> f64 {
    f64::from(v as f32)
}

/// `n` values of `domain`, different for each `seed`.
fn gen(domain: Domain, n: usize, seed: u64) -> Vec<f64> {
    let raw = common::values(n, seed, 1000);
    let values: Vec<f64> = match domain {
        Domain::Any => raw.iter().map(|&v| v as f64 / 500.0).collect(),
        Domain::Positive => raw
            .iter()
            .map(|&v| 0.5 + 1.5 * (v + 1000) as f64 / 2000.0)
            .collect(),
        Domain::AwayFromZero => raw
            .iter()
            .map(|&v| {
                let magnitude = 0.25 + 1.75 * v.unsigned_abs() as f64 / 1000.0;
                if v >= 0 {
                    magnitude
                } else {
                    -magnitude
                }
            })
            .collect(),
        Domain::Grid(offset) => raw
            .iter()
            .map(|&v| 0.1 * (v % 21) as f64 + offset)
            .collect(),
        Domain::Distinct => {
            // A permutation of 0..n (Fisher–Yates driven by `raw`), spread over [-2, 2).
            let mut order: Vec<usize> = (0..n).collect();
            for i in (1..n).rev() {
                let j = raw[i].unsigned_abs() as usize % (i + 1);
                order.swap(i, j);
            }
            let step = 4.0 / n.max(1) as f64;
            order.iter().map(|&p| -2.0 + step * p as f64).collect()
        }
    };
    values.into_iter().map(f32_exact).collect()
}

/// How a case's input reaches its op.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// The leaf itself.
    Plain,
    /// The leaf holds the input with its axes reversed; `transpose` (2-D) or `permute` turns
    /// it back.
    Reversed,
    /// The leaf is longer along `axis` (modulo the rank) by `before` and `after` entries;
    /// `narrow` takes the input out of it.
    Padded {
        axis: usize,
        before: usize,
        after: usize,
    },
}

impl Layout {
    /// The shape of the leaf behind an input of `shape`.
    fn leaf_shape(self, shape: &[usize]) -> Vec<usize> {
        let mut dims = shape.to_vec();
        match self {
            Layout::Plain => {}
            Layout::Reversed => dims.reverse(),
            Layout::Padded {
                axis,
                before,
                after,
            } => {
                if !dims.is_empty() {
                    let a = axis % dims.len();
                    dims[a] += before + after;
                }
            }
        }
        dims
    }

    /// The input of `shape` taken from its `leaf` (an op on the tape unless `Plain`).
    fn view(self, leaf: &NDArray, shape: &[usize]) -> ndscope::Result<NDArray> {
        match self {
            Layout::Plain => Ok(leaf.clone()),
            Layout::Reversed => match shape.len() {
                0 => Ok(leaf.clone()),
                2 => leaf.transpose(),
                n => leaf.permute(&(0..n).rev().collect::<Vec<_>>()),
            },
            Layout::Padded { axis, before, .. } => {
                if shape.is_empty() {
                    Ok(leaf.clone())
                } else {
                    let a = axis % shape.len();
                    leaf.narrow(a as isize, before, shape[a])
                }
            }
        }
    }
}

fn layout() -> impl Strategy<Value = Layout> {
    prop_oneof![
        2 => Just(Layout::Plain),
        1 => Just(Layout::Reversed),
        1 => (0usize..4, 0usize..3, 0usize..3).prop_map(|(axis, before, after)| Layout::Padded {
            axis,
            before,
            after
        }),
    ]
}

fn layouts(n: usize) -> impl Strategy<Value = Vec<Layout>> {
    prop::collection::vec(layout(), n)
}

/// A shape of `ndim` dimensions (a range), each 1 to 3.
fn dims(ndim: std::ops::Range<usize>) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1usize..4, ndim)
}

/// A dimension: 1 to 3, sometimes 0 (an empty array, whose gradient is empty, but whose
/// result may not be: a product over an empty inner dimension, a bias added to no rows).
fn dim_or_empty() -> impl Strategy<Value = usize> {
    prop_oneof![8 => 1usize..4, 1 => Just(0usize)]
}

/// A shape of `ndim` dimensions (a range), each [`dim_or_empty`].
fn dims_or_empty(ndim: std::ops::Range<usize>) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim_or_empty(), ndim)
}

/// Two shapes that broadcast (each a suffix of the result's shape with some dimensions 1).
fn broadcastable_pair() -> impl Strategy<Value = (Vec<usize>, Vec<usize>)> {
    dims_or_empty(0..5).prop_flat_map(|out| {
        let n = out.len();
        (
            Just(out),
            0..=n,
            0..=n,
            prop::collection::vec(any::<bool>(), n),
            prop::collection::vec(any::<bool>(), n),
        )
            .prop_map(|(out, la, lb, ones_a, ones_b)| {
                let pick = |len: usize, ones: &[bool]| -> Vec<usize> {
                    (out.len() - len..out.len())
                        .map(|i| if ones[i] { 1 } else { out[i] })
                        .collect()
                };
                (pick(la, &ones_a), pick(lb, &ones_b))
            })
    })
}

type OpFn = Box<dyn Fn(&Manager, &[NDArray]) -> ndscope::Result<NDArray>>;

/// One input of a case: its shape at the op, how it gets there, and its leaf's values.
struct Input {
    shape: Vec<usize>,
    layout: Layout,
    values: Vec<f64>,
}

/// A gradient check: the op (applied to the inputs as the op sees them, with a manager for any
/// constants it needs, like `pick`'s indices), the leaves' values, and `r`.
struct Case {
    name: String,
    inputs: Vec<Input>,
    f: OpFn,
    /// A function of the inputs whose every element must stay 1e-3 away from 0 (the kinks of
    /// a fused `Relu`), if any.
    kink: Option<OpFn>,
    /// Which inputs require gradients (the others are constants of the loss).
    requires: Vec<bool>,
    /// For large inputs: about how many elements of each the central differences check
    /// (0: all of them).
    sample: usize,
    r: Vec<f64>,
}

impl Case {
    fn new(
        name: impl Into<String>,
        specs: &[(Vec<usize>, Layout, Domain)],
        seed: u64,
        f: impl Fn(&Manager, &[NDArray]) -> ndscope::Result<NDArray> + 'static,
    ) -> Case {
        let inputs = specs
            .iter()
            .enumerate()
            .map(|(i, (shape, layout, domain))| {
                let leaf = layout.leaf_shape(shape);
                Input {
                    shape: shape.clone(),
                    layout: *layout,
                    values: gen(
                        *domain,
                        common::size(&leaf),
                        seed ^ ((i as u64 + 1) * 0x5151),
                    ),
                }
            })
            .collect();
        let mut case = Case {
            name: name.into(),
            requires: vec![true; specs.len()],
            sample: 0,
            inputs,
            f: Box::new(f),
            kink: None,
            r: Vec::new(),
        };
        let values: Vec<Vec<f64>> = case.inputs.iter().map(|i| i.values.clone()).collect();
        let m = Manager::new_base();
        let y = case.forward(&m, DType::F64, &values).unwrap();
        case.r = common::values(y.size(), seed ^ 0xF00D, 1000)
            .into_iter()
            .map(|v| f32_exact(v as f64 / 1000.0))
            .collect();
        m.close().unwrap();
        case
    }

    fn with_kink(
        mut self,
        kink: impl Fn(&Manager, &[NDArray]) -> ndscope::Result<NDArray> + 'static,
    ) -> Case {
        self.kink = Some(Box::new(kink));
        self
    }

    /// Central differences for about `count` elements of each input (spread over it, the first
    /// and last included) instead of all.
    fn sampled(mut self, count: usize) -> Case {
        self.sample = count;
        self
    }

    /// Only the inputs whose bit is set in `mask` require gradients.
    fn requiring(mut self, mask: u32) -> Case {
        for (i, r) in self.requires.iter_mut().enumerate() {
            *r = mask & (1 << i) != 0;
        }
        self
    }

    fn describe(&self) -> String {
        let inputs: Vec<String> = self
            .inputs
            .iter()
            .zip(&self.requires)
            .map(|(i, r)| {
                let constant = if *r { "" } else { " (constant)" };
                format!("{:?} via {:?}{constant}", i.shape, i.layout)
            })
            .collect();
        format!("{} of [{}]", self.name, inputs.join(", "))
    }

    /// The leaves in `m` (on its device) as `dtype`, holding `values`.
    fn leaves(&self, m: &Manager, dtype: DType, values: &[Vec<f64>]) -> Vec<NDArray> {
        self.inputs
            .iter()
            .zip(values)
            .map(|(input, v)| array(m, dtype, &input.layout.leaf_shape(&input.shape), v))
            .collect()
    }

    /// The inputs as the op sees them, from the leaves.
    fn views(&self, leaves: &[NDArray]) -> ndscope::Result<Vec<NDArray>> {
        self.inputs
            .iter()
            .zip(leaves)
            .map(|(input, leaf)| input.layout.view(leaf, &input.shape))
            .collect()
    }

    /// The op's result for leaves holding `values`.
    fn forward(&self, m: &Manager, dtype: DType, values: &[Vec<f64>]) -> ndscope::Result<NDArray> {
        let leaves = self.leaves(m, dtype, values);
        (self.f)(m, &self.views(&leaves)?)
    }

    /// Whether the case keeps 1e-3 away from its op's kinks.
    fn clear_of_kinks(&self) -> bool {
        let Some(kink) = &self.kink else {
            return true;
        };
        let m = Manager::new_base();
        let values: Vec<Vec<f64>> = self.inputs.iter().map(|i| i.values.clone()).collect();
        let leaves = self.leaves(&m, DType::F64, &values);
        let z = kink(&m, &self.views(&leaves).unwrap()).unwrap();
        let clear = z.to_vec::<f64>().unwrap().iter().all(|v| v.abs() > 1e-3);
        m.close().unwrap();
        clear
    }

    /// Whether the op's kinks fall on the same side in `dtype` as in `F64` (a half type's
    /// rounded inputs can move a pre-activation near 0 across its ReLU, which changes the
    /// gradient there by design: such a case is not compared in that dtype).
    fn same_side_of_kinks_in(&self, dtype: DType) -> bool {
        let Some(kink) = &self.kink else {
            return true;
        };
        let m = Manager::new_base();
        let values: Vec<Vec<f64>> = self.inputs.iter().map(|i| i.values.clone()).collect();
        let side = |d: DType| -> Vec<bool> {
            let leaves = self.leaves(&m, d, &values);
            let z = kink(&m, &self.views(&leaves).unwrap()).unwrap();
            common::as_f64(&z).iter().map(|&v| v > 0.0).collect()
        };
        let same = side(DType::F64) == side(dtype);
        m.close().unwrap();
        same
    }

    /// `Σ op(x) · r` in `F64` on the CPU, without recording.
    fn loss(&self, m: &Manager, values: &[Vec<f64>]) -> f64 {
        let step = m.new_sub_manager().unwrap();
        let y = self.forward(&step, DType::F64, values).unwrap();
        let out = y.to_vec::<f64>().unwrap();
        step.close().unwrap();
        out.iter().zip(&self.r).map(|(y, r)| y * r).sum()
    }

    /// The gradient of the loss with respect to every leaf that requires gradients, by central
    /// differences. A sampled case takes the elements it skips from `reference`.
    fn finite_differences(&self, reference: &[Vec<f64>]) -> Vec<Vec<f64>> {
        let m = Manager::new_base();
        let mut values: Vec<Vec<f64>> = self.inputs.iter().map(|i| i.values.clone()).collect();
        let mut grads = Vec::new();
        for i in 0..values.len() {
            if !self.requires[i] {
                continue;
            }
            let len = values[i].len();
            let step = if self.sample == 0 {
                1
            } else {
                len.div_ceil(self.sample).max(1)
            };
            let mut g = reference[grads.len()].clone();
            for j in (0..len).filter(|&j| j % step == i % step || j + 1 == len) {
                let v = values[i][j];
                values[i][j] = v + H;
                let plus = self.loss(&m, &values);
                values[i][j] = v - H;
                let minus = self.loss(&m, &values);
                values[i][j] = v;
                g[j] = (plus - minus) / (2.0 * H);
            }
            grads.push(g);
        }
        m.close().unwrap();
        grads
    }

    /// The gradients `backward` adds into the `gradient()` arrays of the leaves that require
    /// them, computed on `dev` in `dtype`, read back as f64.
    fn analytic(&self, dev: Device, dtype: DType) -> Result<Vec<Vec<f64>>, TestCaseError> {
        let values: Vec<Vec<f64>> = self.inputs.iter().map(|i| i.values.clone()).collect();
        self.analytic_at(dev, dtype, &values, &self.r)
    }

    /// The CPU's `F64` gradient of the case with every input value and every weight of `r`
    /// made non-negative: where the gradient is a sum of terms (over a broadcast axis, a
    /// product's inner axis), the sum of their magnitudes, which the rounding errors of a half
    /// computation scale with even when the terms cancel (`-Σ r·a / b²` for a divisor `b` near
    /// 0.25 is a sum of terms up to 32·|r| that can cancel to below 1).
    fn magnitudes(&self) -> Result<Vec<Vec<f64>>, TestCaseError> {
        let values: Vec<Vec<f64>> = self
            .inputs
            .iter()
            .map(|i| i.values.iter().map(|v| v.abs()).collect())
            .collect();
        let r: Vec<f64> = self.r.iter().map(|v| v.abs()).collect();
        self.analytic_at(Device::Cpu, DType::F64, &values, &r)
    }

    fn analytic_at(
        &self,
        dev: Device,
        dtype: DType,
        values: &[Vec<f64>],
        r: &[f64],
    ) -> Result<Vec<Vec<f64>>, TestCaseError> {
        let m = Manager::new_base_on(dev).unwrap();
        let leaves = self.leaves(&m, dtype, values);
        for (leaf, requires) in leaves.iter().zip(&self.requires) {
            if *requires {
                leaf.set_requires_gradient(true).unwrap();
            }
        }
        {
            let collector = m.gradient_collector().unwrap();
            let xs = self.views(&leaves).unwrap();
            let y = (self.f)(&m, &xs).unwrap();
            prop_assert_eq!(y.dtype(), dtype, "{}", self.describe());
            prop_assert_eq!(y.device(), dev, "{}", self.describe());
            let r = array(&m, dtype, y.dims(), r);
            let loss = y.mul(&r).unwrap().sum_all().unwrap();
            if let Err(e) = collector.backward(&loss) {
                return Err(TestCaseError::fail(format!(
                    "{} on {dev} in {dtype}: backward failed: {e}",
                    self.describe()
                )));
            }
        }
        let mut grads = Vec::new();
        for (leaf, requires) in leaves.iter().zip(&self.requires) {
            if !*requires {
                prop_assert!(leaf.gradient().is_err());
                continue;
            }
            let g = leaf.gradient().unwrap();
            prop_assert_eq!(g.shape(), leaf.shape(), "{}", self.describe());
            prop_assert_eq!(g.dtype(), dtype);
            prop_assert_eq!(g.device(), dev);
            grads.push(common::as_f64(&g));
        }
        m.close().unwrap();
        Ok(grads)
    }
}

/// An array of `dtype` in `m` holding `values`.
fn array(m: &Manager, dtype: DType, shape: &[usize], values: &[f64]) -> NDArray {
    match dtype {
        DType::F64 => m.from_vec(values.to_vec(), shape),
        DType::F32 => m.from_vec(values.iter().map(|&v| v as f32).collect(), shape),
        DType::F16 => m.from_vec(
            values
                .iter()
                .map(|&v| <ndscope::f16 as ndscope::Element>::from_f64(v))
                .collect(),
            shape,
        ),
        DType::BF16 => m.from_vec(
            values
                .iter()
                .map(|&v| <ndscope::bf16 as ndscope::Element>::from_f64(v))
                .collect(),
            shape,
        ),
        other => panic!("no float array of {other}"),
    }
    .unwrap()
}

/// `got` within `tol` of `want`, relative to 1 + the largest element of each input's `want`.
fn close_to(
    case: &Case,
    what: &str,
    got: &[Vec<f64>],
    want: &[Vec<f64>],
    tol: f64,
) -> Result<(), TestCaseError> {
    close_to_scaled(case, what, got, want, (tol, None))
}

/// [`close_to`], relative to the larger of each input's largest `want` and largest finite
/// `magnitudes` element (see [`Case::magnitudes`]) when they are given.
fn close_to_scaled(
    case: &Case,
    what: &str,
    got: &[Vec<f64>],
    want: &[Vec<f64>],
    (tol, magnitudes): (f64, Option<&[Vec<f64>]>),
) -> Result<(), TestCaseError> {
    let largest = |v: &[f64]| {
        v.iter()
            .filter(|x| x.is_finite())
            .fold(0.0f64, |m, x| m.max(x.abs()))
    };
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let terms = magnitudes
            .and_then(|m| m.get(i))
            .map_or(0.0, |m| largest(m));
        let scale = 1.0 + largest(w).max(terms);
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            if (a - b).abs() > tol * scale || !a.is_finite() {
                return Err(TestCaseError::fail(format!(
                    "{}: {what}: input {i} element {j}: {a} vs {b} (tolerance {tol} × {scale})\n  \
                     got  {g:?}\n  want {w:?}\n  input values {:?}",
                    case.describe(),
                    case.inputs[i].values
                )));
            }
        }
    }
    Ok(())
}

/// The whole check of a case on `dev`: on the CPU the `F64` gradient against central
/// differences and the `F32` one against it; on a CUDA device both against the CPU's `F64`.
fn check(dev: Device, case: &Case) -> Result<(), TestCaseError> {
    let reference = case.analytic(Device::Cpu, DType::F64)?;
    if dev == Device::Cpu {
        let numeric = case.finite_differences(&reference);
        close_to(
            case,
            "F64 gradient vs central differences",
            &reference,
            &numeric,
            FD_TOL,
        )?;
        let single = case.analytic(Device::Cpu, DType::F32)?;
        close_to(case, "F32 gradient vs F64", &single, &reference, F32_TOL)?;
        // The half types: every op in f32 with each result rounded once (issue 29, item 4).
        let fits = case
            .inputs
            .iter()
            .all(|i| i.values.iter().all(|v| v.abs() <= HALF_INPUT_MAX))
            && case.inputs.iter().map(|i| i.values.len()).sum::<usize>() <= 4096;
        if fits {
            for (dtype, tol) in [(DType::F16, F16_TOL), (DType::BF16, BF16_TOL)] {
                if !case.same_side_of_kinks_in(dtype) {
                    continue;
                }
                let half = case.analytic(Device::Cpu, dtype)?;
                let what = format!("{dtype} gradient vs F64");
                if close_to(case, &what, &half, &reference, tol).is_err() {
                    // Terms that cancel: the errors scale with the terms, not with their sum.
                    let magnitudes = case.magnitudes()?;
                    let what = format!("{what}, relative to the magnitudes of its terms");
                    close_to_scaled(case, &what, &half, &reference, (tol, Some(&magnitudes)))?;
                }
            }
        }
    } else {
        let double = case.analytic(dev, DType::F64)?;
        close_to(
            case,
            &format!("F64 gradient on {dev} vs the CPU's"),
            &double,
            &reference,
            DEVICE_F64_TOL,
        )?;
        let single = case.analytic(dev, DType::F32)?;
        close_to(
            case,
            &format!("F32 gradient on {dev} vs the CPU's F64"),
            &single,
            &reference,
            F32_TOL,
        )?;
    }
    Ok(())
}

/// Which of `n` inputs require gradients, as bit masks: all of them, then each alone.
fn masks(n: usize) -> Vec<u32> {
    let mut masks = vec![(1u32 << n) - 1];
    if n > 1 {
        masks.extend((0..n).map(|i| 1u32 << i));
    }
    masks
}

// ---------------------------------------------------------------------------------------------
// Elementwise ops

const BINARY: [&str; 6] = ["add", "sub", "mul", "div", "maximum", "minimum"];

fn binary(op: &str, a: &NDArray, b: &NDArray) -> ndscope::Result<NDArray> {
    match op {
        "add" => a.add(b),
        "sub" => a.sub(b),
        "mul" => a.mul(b),
        "div" => a.div(b),
        "maximum" => a.maximum(b),
        "minimum" => a.minimum(b),
        _ => unreachable!("{op}"),
    }
}

device_tests!(binary_ops_sum_gradients_over_broadcast_dims);
fn binary_ops_sum_gradients_over_broadcast_dims(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 128), |(
        (ash, bsh) in broadcastable_pair(),
        lay in layouts(2),
        swap in any::<bool>(),
        seed in any::<u64>(),
    )| {
        let (ash, bsh) = if swap { (bsh, ash) } else { (ash, bsh) };
        for op in BINARY {
            let (da, db) = match op {
                "div" => (Domain::Any, Domain::AwayFromZero),
                "maximum" | "minimum" => (Domain::Grid(0.0), Domain::Grid(0.05)),
                _ => (Domain::Any, Domain::Any),
            };
            for mask in masks(2) {
                let case = Case::new(
                    op,
                    &[(ash.clone(), lay[0], da), (bsh.clone(), lay[1], db)],
                    seed,
                    move |_, x| binary(op, &x[0], &x[1]),
                )
                .requiring(mask);
                check(dev, &case)?;
            }
        }
    });
}

device_tests!(binary_ops_with_one_array_on_both_sides);
fn binary_ops_with_one_array_on_both_sides(dev: Device) {
    let _serial = serial();
    // `x op x`: both inputs' gradients reach the same leaf (maximum and minimum tie everywhere
    // and split the gradient evenly, which sums to the gradient of x itself).
    for op in BINARY {
        for layout in [Layout::Plain, Layout::Reversed] {
            let case = Case::new(
                format!("{op}(x, x)"),
                &[(vec![2, 3], layout, Domain::AwayFromZero)],
                7,
                move |_, x| binary(op, &x[0], &x[0]),
            );
            check(dev, &case).unwrap();
        }
    }
}

device_tests!(scalar_ops);
fn scalar_ops(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        shape in dims(0..5),
        lay in layout(),
        c in (0.5f64..3.0, any::<bool>()).prop_map(|(c, neg)| f32_exact(if neg { -c } else { c })),
        p in prop::sample::select(vec![-1.5, -1.0, 0.5, 1.0, 2.0, 3.0]),
        seed in any::<u64>(),
    )| {
        for op in ["add_scalar", "sub_scalar", "mul_scalar", "div_scalar", "pow_scalar"] {
            let domain = if op == "pow_scalar" { Domain::Positive } else { Domain::Any };
            let case = Case::new(
                format!("{op}({})", if op == "pow_scalar" { p } else { c }),
                &[(shape.clone(), lay, domain)],
                seed,
                move |_, x| match op {
                    "add_scalar" => x[0].add_scalar(c),
                    "sub_scalar" => x[0].sub_scalar(c),
                    "mul_scalar" => x[0].mul_scalar(c),
                    "div_scalar" => x[0].div_scalar(c),
                    _ => x[0].pow_scalar(p),
                },
            );
            check(dev, &case)?;
        }
    });
}

const UNARY: [(&str, Domain); 9] = [
    ("neg", Domain::Any),
    ("abs", Domain::AwayFromZero),
    ("exp", Domain::Any),
    ("log", Domain::Positive),
    ("sqrt", Domain::Positive),
    ("square", Domain::Any),
    ("relu", Domain::AwayFromZero),
    ("sigmoid", Domain::Any),
    ("tanh", Domain::Any),
];

fn unary(op: &str, x: &NDArray) -> ndscope::Result<NDArray> {
    match op {
        "neg" => x.neg(),
        "abs" => x.abs(),
        "exp" => x.exp(),
        "log" => x.log(),
        "sqrt" => x.sqrt(),
        "square" => x.square(),
        "relu" => x.relu(),
        "sigmoid" => x.sigmoid(),
        "tanh" => x.tanh(),
        _ => unreachable!("{op}"),
    }
}

device_tests!(unary_ops);
fn unary_ops(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        shape in dims(0..5),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        for (op, domain) in UNARY {
            let case = Case::new(op, &[(shape.clone(), lay, domain)], seed, move |_, x| {
                unary(op, &x[0])
            });
            check(dev, &case)?;
        }
    });
}

device_tests!(chained_ops_reuse_intermediates);
fn chained_ops_reuse_intermediates(dev: Device) {
    let _serial = serial();
    // An intermediate read by several later ops (its gradient is the sum of theirs), and a
    // leaf read at several depths.
    proptest!(config(dev, 64), |(
        (ash, bsh) in broadcastable_pair(),
        lay in layouts(2),
        seed in any::<u64>(),
    )| {
        let case = Case::new(
            "tanh(a·b) + sigmoid(a·b)·a − (a·b)²/4",
            &[(ash, lay[0], Domain::Any), (bsh, lay[1], Domain::Any)],
            seed,
            |_, x| {
                let ab = x[0].mul(&x[1])?;
                let left = ab.tanh()?.add(&ab.sigmoid()?.mul(&x[0])?)?;
                left.sub(&ab.square()?.div_scalar(4.0)?)
            },
        );
        check(dev, &case)?;
    });
}

// ---------------------------------------------------------------------------------------------
// Reductions

/// The axes of `mask` as a list, negative (from the end) when `negative`.
fn axes_of(mask: &[bool], negative: bool) -> Vec<isize> {
    let n = mask.len() as isize;
    (0..n)
        .filter(|&i| mask[i as usize])
        .map(|i| if negative { i - n } else { i })
        .collect()
}

device_tests!(sum_and_mean_over_axes_and_all);
fn sum_and_mean_over_axes_and_all(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        (shape, mask) in dims_or_empty(1..5).prop_flat_map(|s| {
            let n = s.len();
            (Just(s), prop::collection::vec(any::<bool>(), n))
        }),
        negative in any::<bool>(),
        keep in any::<bool>(),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        let axes = axes_of(&mask, negative);
        let variants: [(&str, Vec<isize>); 6] = [
            ("sum", axes.clone()),
            ("mean", axes.clone()),
            ("sum", Vec::new()),
            ("mean", Vec::new()),
            ("sum_all", Vec::new()),
            ("mean_all", Vec::new()),
        ];
        for (op, axes) in variants {
            let case = Case::new(
                format!("{op}({axes:?}, keep_dims {keep})"),
                &[(shape.clone(), lay, Domain::Any)],
                seed,
                move |_, x| match op {
                    "sum" => x[0].sum(&axes, keep),
                    "mean" => x[0].mean(&axes, keep),
                    "sum_all" => x[0].sum_all(),
                    _ => x[0].mean_all(),
                },
            );
            check(dev, &case)?;
        }
    });
}

device_tests!(max_routes_the_gradient_to_the_arg_max);
fn max_routes_the_gradient_to_the_arg_max(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        shape in dims(1..5),
        axis in any::<Index>(),
        negative in any::<bool>(),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        let n = shape.len();
        let a = axis.index(n);
        let axis = if negative { a as isize - n as isize } else { a as isize };
        for keep in [false, true] {
            let case = Case::new(
                format!("max({axis}, keep_dims {keep})"),
                &[(shape.clone(), lay, Domain::Distinct)],
                seed,
                move |_, x| x[0].max(axis, keep),
            );
            check(dev, &case)?;
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Matrix products and the fused layer

device_tests!(matmul_2d_and_batched);
fn matmul_2d_and_batched(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 64), |(
        (b, m, k, n) in (dim_or_empty(), dim_or_empty(), dim_or_empty(), dim_or_empty()),
        lay in layouts(2),
        seed in any::<u64>(),
    )| {
        let forms = [
            (vec![m, k], vec![k, n]),
            (vec![b, m, k], vec![b, k, n]),
            (vec![b, m, k], vec![k, n]),
            (vec![m, k], vec![b, k, n]),
        ];
        for (ash, bsh) in forms {
            for mask in masks(2) {
                let case = Case::new(
                    "matmul",
                    &[(ash.clone(), lay[0], Domain::Any), (bsh.clone(), lay[1], Domain::Any)],
                    seed,
                    |_, x| x[0].matmul(&x[1]),
                )
                .requiring(mask);
                check(dev, &case)?;
            }
        }
    });
}

device_tests!(matmul_t_all_transposes);
fn matmul_t_all_transposes(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 64), |(
        (m, k, n) in (dim_or_empty(), dim_or_empty(), dim_or_empty()),
        lay in layouts(2),
        seed in any::<u64>(),
    )| {
        for t in [Transpose::None, Transpose::Left, Transpose::Right, Transpose::Both] {
            let (ta, tb) = match t {
                Transpose::None => (false, false),
                Transpose::Left => (true, false),
                Transpose::Right => (false, true),
                Transpose::Both => (true, true),
            };
            let ash = if ta { vec![k, m] } else { vec![m, k] };
            let bsh = if tb { vec![n, k] } else { vec![k, n] };
            for mask in masks(2) {
                let case = Case::new(
                    format!("matmul_t({t:?})"),
                    &[(ash.clone(), lay[0], Domain::Any), (bsh.clone(), lay[1], Domain::Any)],
                    seed,
                    move |_, x| x[0].matmul_t(&x[1], t),
                )
                .requiring(mask);
                check(dev, &case)?;
            }
        }
    });
}

device_tests!(dense_forward_with_and_without_bias_and_relu);
fn dense_forward_with_and_without_bias_and_relu(dev: Device) {
    // f32 weights on the CPU are packed, f64 ones are not: the CPU's F32-vs-F64 comparison is
    // the packed layer's gradient against the unpacked one's.
    layer_cases(dev, "Dense", |x, activation| {
        let dense = Dense::new(&x[1], x.get(2), activation)?;
        let y = dense.forward(&x[0])?;
        dense.close()?;
        Ok(y)
    });
}

device_tests!(linear_with_and_without_bias_and_relu);
fn linear_with_and_without_bias_and_relu(dev: Device) {
    // The fused op (on CUDA a cuBLASLt epilogue forward; the ReLU mask and the bias gradient
    // in one kernel backward, the bias gradient written into the leaf's own gradient).
    layer_cases(dev, "linear", |x, activation| {
        x[0].linear(&x[1], x.get(2), activation)
    });
}

/// `layer(&[x, w, b?], activation)`, a dense layer, against finite differences: inputs of any
/// leading shape, empty dimensions, with and without a bias, identity and ReLU (clear of its
/// kink), every subset of inputs requiring gradients.
fn layer_cases(
    dev: Device,
    name: &'static str,
    layer: fn(&[NDArray], Activation) -> ndscope::Result<NDArray>,
) {
    let _serial = serial();
    proptest!(config(dev, 64), |(
        lead in dims_or_empty(0..3),
        (k, n) in (dim_or_empty(), dim_or_empty()),
        lay in layouts(3),
        seed in any::<u64>(),
    )| {
        let mut xsh = lead.clone();
        xsh.push(k);
        for bias in [false, true] {
            for activation in [Activation::Identity, Activation::Relu] {
                let mut specs = vec![
                    (xsh.clone(), lay[0], Domain::Any),
                    (vec![k, n], lay[1], Domain::Any),
                ];
                if bias {
                    specs.push((vec![n], lay[2], Domain::Any));
                }
                for mask in masks(specs.len()) {
                    let case = Case::new(
                        format!("{name}(bias {bias}, {activation:?}) of x {xsh:?}"),
                        &specs,
                        seed,
                        move |_, x| layer(x, activation),
                    )
                    .requiring(mask);
                    let case = if activation == Activation::Relu {
                        case.with_kink(move |_, x| layer(x, Activation::Identity))
                    } else {
                        case
                    };
                    if case.clear_of_kinks() {
                        check(dev, &case)?;
                    }
                }
            }
        }
    });
}

device_tests!(empty_dimensions);
fn empty_dimensions(dev: Device) {
    let _serial = serial();
    // Inputs with no elements whose results have some (products over an empty inner dimension,
    // a bias added through a layer with no inputs), each case named (the property tests above
    // reach them only now and then).
    let p = Layout::Plain;
    let any = Domain::Any;
    let mut cases = vec![
        Case::new(
            "matmul k=0",
            &[(vec![2, 0], p, any), (vec![0, 3], p, any)],
            1,
            |_, x| x[0].matmul(&x[1]),
        ),
        Case::new(
            "batched matmul k=0",
            &[(vec![2, 3, 0], p, any), (vec![0, 2], p, any)],
            2,
            |_, x| x[0].matmul(&x[1]),
        ),
        Case::new(
            "matmul_t(Both) k=0",
            &[(vec![0, 2], p, any), (vec![3, 0], p, any)],
            3,
            |_, x| x[0].matmul_t(&x[1], Transpose::Both),
        ),
        Case::new(
            "sum over an empty axis",
            &[(vec![3, 0], p, any)],
            4,
            |_, x| x[0].sum(&[1], true),
        ),
        Case::new(
            "add of [0, 3] and [3]",
            &[(vec![0, 3], p, any), (vec![3], p, any)],
            5,
            |_, x| x[0].add(&x[1]),
        ),
    ];
    for (lead, name) in [(vec![2], "2-D"), (vec![2, 3], "3-D"), (vec![], "1-D")] {
        for activation in [Activation::Identity, Activation::Relu] {
            let mut xsh = lead.clone();
            xsh.push(0);
            cases.push(Case::new(
                format!("Dense({activation:?}) of {name} x with 0 features"),
                &[
                    (xsh, p, any),
                    (vec![0, 3], p, any),
                    (vec![3], p, Domain::AwayFromZero),
                ],
                6,
                move |_, x| Dense::new(&x[1], Some(&x[2]), activation)?.forward(&x[0]),
            ));
        }
    }
    for case in &cases {
        check(dev, case).unwrap();
    }
}

device_tests!(large_inputs);
fn large_inputs(dev: Device) {
    let _serial = serial();
    // Sizes where the kernels the gradients are made of take their blocked and parallel paths
    // (products, transposes, reductions, broadcasting over thousands of elements); central
    // differences for a sample of each input's elements.
    let p = Layout::Plain;
    let any = Domain::Any;
    let narrowed = Layout::Padded {
        axis: 1,
        before: 3,
        after: 5,
    };
    let cases = vec![
        Case::new(
            "matmul [70, 90] · [90, 80]",
            &[
                (vec![70, 90], p, any),
                (vec![90, 80], Layout::Reversed, any),
            ],
            1,
            |_, x| x[0].matmul(&x[1]),
        ),
        Case::new(
            "matmul_t(Right) [64, 96] · [48, 96]ᵀ",
            &[(vec![64, 96], narrowed, any), (vec![48, 96], p, any)],
            2,
            |_, x| x[0].matmul_t(&x[1], Transpose::Right),
        ),
        // A short result (m ≤ n / 8): the CPU computes it as (b · aᵀ)ᵀ.
        Case::new(
            "matmul_t(Right) [4, 96] · [64, 96]ᵀ",
            &[(vec![4, 96], p, any), (vec![64, 96], narrowed, any)],
            8,
            |_, x| x[0].matmul_t(&x[1], Transpose::Right),
        ),
        // Two rows and 96 features: the input gradient g · wᵀ is such a short product too.
        Case::new(
            "Dense of [2, 96] by [96, 16] + [16]",
            &[
                (vec![2, 96], p, any),
                (vec![96, 16], p, any),
                (vec![16], p, any),
            ],
            9,
            |_, x| Dense::new(&x[1], Some(&x[2]), Activation::Identity)?.forward(&x[0]),
        ),
        Case::new(
            "batched matmul [6, 40, 30] · [6, 30, 20]",
            &[
                (vec![6, 40, 30], p, any),
                (vec![6, 30, 20], Layout::Reversed, any),
            ],
            3,
            |_, x| x[0].matmul(&x[1]),
        ),
        Case::new(
            "Dense(Relu) of [4, 16, 96] by [96, 64] + [64]",
            &[
                (vec![4, 16, 96], p, any),
                (vec![96, 64], p, any),
                (vec![64], p, any),
            ],
            4,
            |_, x| Dense::new(&x[1], Some(&x[2]), Activation::Relu)?.forward(&x[0]),
        )
        .with_kink(|_, x| Dense::new(&x[1], Some(&x[2]), Activation::Identity)?.forward(&x[0])),
        Case::new(
            "mul [128, 1, 64] by [1, 32, 64]",
            &[(vec![128, 1, 64], p, any), (vec![1, 32, 64], narrowed, any)],
            5,
            |_, x| x[0].mul(&x[1]),
        ),
        Case::new(
            "transpose [130, 70] then sum over 0, mean over 1",
            &[(vec![130, 70], p, any)],
            6,
            |_, x| {
                let t = x[0].transpose()?.square()?;
                t.sum(&[0], false)?.add(&t.mean(&[1], false)?.sum_all()?)
            },
        ),
        Case::new(
            "log_softmax over [32, 300] then pick",
            &[(vec![32, 300], p, any)],
            7,
            |m, x| {
                let labels: Vec<i64> = (0..32).map(|i| (i * 37) % 300).collect();
                let labels = m.from_vec(labels, [32])?;
                x[0].log_softmax(1)?.pick(&labels, 1)
            },
        ),
    ];
    for case in cases {
        let case = case.sampled(24);
        if case.clear_of_kinks() {
            check(dev, &case).unwrap();
        } else {
            panic!(
                "{}: the pre-activation comes near 0 (pick another seed)",
                case.describe()
            );
        }
    }
}

#[test]
fn dense_f32_layers_on_the_cpu_are_packed() {
    // What the Dense check above relies on to cover the packed path.
    let m = Manager::new_base();
    let w = m.from_slice(&[1.0f32, 2.0], [1, 2]).unwrap();
    let w64 = w.to_dtype(DType::F64).unwrap();
    assert!(Dense::new(&w, None, Activation::Relu).unwrap().is_packed());
    assert!(!Dense::new(&w64, None, Activation::Relu)
        .unwrap()
        .is_packed());
    m.close().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Shape ops

/// The indices that sort `keys` (a permutation of `0..keys.len()`).
fn argsort(keys: &[u32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by_key(|&i| (keys[i], i));
    order
}

device_tests!(shape_ops);
fn shape_ops(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        shape in dims(1..5),
        picks in prop::collection::vec(any::<Index>(), 4),
        keys in prop::collection::vec(any::<u32>(), 5),
        ones in prop::collection::vec(any::<bool>(), 4),
        lay in layouts(5),
        seed in any::<u64>(),
    )| {
        let n = shape.len();
        let size = common::size(&shape);
        let mut cases = Vec::new();
        let one = |s: &Vec<usize>, l: Layout| vec![(s.clone(), l, Domain::Any)];

        // reshape: reversed dims, and flat.
        let reversed: Vec<usize> = shape.iter().rev().copied().collect();
        cases.push(Case::new(format!("reshape to {reversed:?}"), &one(&shape, lay[0]), seed,
            move |_, x| x[0].reshape(reversed.clone())));
        cases.push(Case::new("reshape to [size]", &one(&shape, lay[1]), seed,
            move |_, x| x[0].reshape([size])));

        // duplicate (a copy).
        cases.push(Case::new("duplicate", &one(&shape, lay[2]), seed, |_, x| x[0].duplicate()));

        // transpose of a 2-D input.
        let two = vec![shape[0], shape[n - 1]];
        cases.push(Case::new("transpose", &one(&two, lay[2]), seed, |_, x| x[0].transpose()));

        // permute.
        let perm = argsort(&keys[..n]);
        cases.push(Case::new(format!("permute({perm:?})"), &one(&shape, lay[3]), seed,
            move |_, x| x[0].permute(&perm)));

        // broadcast_to from a suffix of the shape with some dims 1.
        let lead = picks[0].index(n + 1);
        let small: Vec<usize> = (lead..n).map(|i| if ones[i] { 1 } else { shape[i] }).collect();
        let target = shape.clone();
        cases.push(Case::new(format!("broadcast_to {target:?}"), &one(&small, lay[4]), seed,
            move |_, x| x[0].broadcast_to(target.clone())));

        // narrow.
        let a = picks[1].index(n);
        let len = 1 + picks[2].index(shape[a]);
        let start = picks[3].index(shape[a] - len + 1);
        cases.push(Case::new(format!("narrow({a}, {start}, {len})"), &one(&shape, lay[0]), seed,
            move |_, x| x[0].narrow(a as isize, start, len)));

        // squeeze of an inserted size-1 axis (named, negative, and every size-1 axis).
        let at = picks[0].index(n + 1);
        let mut with_one = shape.clone();
        with_one.insert(at, 1);
        let neg = at as isize - (n as isize + 1);
        cases.push(Case::new(format!("squeeze([{at}])"), &one(&with_one, lay[1]), seed,
            move |_, x| x[0].squeeze(&[at as isize])));
        cases.push(Case::new(format!("squeeze([{neg}])"), &one(&with_one, lay[2]), seed,
            move |_, x| x[0].squeeze(&[neg])));
        cases.push(Case::new("squeeze([])", &one(&with_one, lay[3]), seed,
            |_, x| x[0].squeeze(&[])));

        // unsqueeze at every valid axis form.
        let u = picks[1].index(2 * n + 2) as isize - (n as isize + 1);
        cases.push(Case::new(format!("unsqueeze({u})"), &one(&shape, lay[4]), seed,
            move |_, x| x[0].unsqueeze(u)));

        // concat of 1 to 5 arrays (past the three a record holds inline) along an axis.
        let count = 1 + picks[2].index(5);
        let ca = picks[3].index(n);
        let specs: Vec<_> = (0..count)
            .map(|i| {
                let mut s = shape.clone();
                s[ca] = 1 + keys[i] as usize % 3;
                (s, lay[i], Domain::Any)
            })
            .collect();
        cases.push(Case::new(format!("concat of {count} along {ca}"), &specs, seed,
            move |_, x| concat(x, ca as isize)));

        // stack of 1 to 5 arrays along a new axis.
        let sa = picks[0].index(n + 1);
        let specs: Vec<_> = (0..count).map(|i| (shape.clone(), lay[i], Domain::Any)).collect();
        cases.push(Case::new(format!("stack of {count} along {sa}"), &specs, seed,
            move |_, x| stack(x, sa as isize)));

        for case in &cases {
            check(dev, case)?;
        }
    });
}

device_tests!(one_leaf_in_concat_and_stack_several_times);
fn one_leaf_in_concat_and_stack_several_times(dev: Device) {
    let _serial = serial();
    for layout in [Layout::Plain, Layout::Reversed] {
        let specs = [
            (vec![2, 3], layout, Domain::Any),
            (vec![2, 3], Layout::Plain, Domain::Any),
        ];
        let case = Case::new("concat [a, b, a, a]", &specs, 3, |_, x| {
            concat(&[x[0].clone(), x[1].clone(), x[0].clone(), x[0].clone()], 1)
        });
        check(dev, &case).unwrap();
        let case = Case::new("stack [a, a, b, a]", &specs, 4, |_, x| {
            stack(&[x[0].clone(), x[0].clone(), x[1].clone(), x[0].clone()], 0)
        });
        check(dev, &case).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// softmax, log_softmax, pick

device_tests!(softmax_log_softmax_and_pick_over_axes);
fn softmax_log_softmax_and_pick_over_axes(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 96), |(
        shape in dims(1..5),
        axis in any::<Index>(),
        negative in any::<bool>(),
        index_dtype in prop::sample::select(vec![DType::I64, DType::I32, DType::U8]),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        let n = shape.len();
        let a = axis.index(n);
        let axis = if negative { a as isize - n as isize } else { a as isize };
        let mut index_shape = shape.clone();
        index_shape.remove(a);
        let len = shape[a] as i64;
        let indices: Vec<i64> = common::values(common::size(&index_shape), seed ^ 0x1D, 1000)
            .into_iter()
            .map(|v| v.rem_euclid(len))
            .collect();
        let make_indices = move |m: &Manager| -> ndscope::Result<NDArray> {
            match index_dtype {
                DType::I64 => m.from_vec(indices.clone(), index_shape.clone()),
                DType::I32 => m.from_vec(
                    indices.iter().map(|&i| i as i32).collect(),
                    index_shape.clone(),
                ),
                _ => m.from_vec(indices.iter().map(|&i| i as u8).collect(), index_shape.clone()),
            }
        };
        let picked = make_indices.clone();
        let cases = [
            Case::new(format!("softmax({axis})"), &[(shape.clone(), lay, Domain::Any)], seed,
                move |_, x| x[0].softmax(axis)),
            Case::new(format!("log_softmax({axis})"), &[(shape.clone(), lay, Domain::Any)], seed,
                move |_, x| x[0].log_softmax(axis)),
            Case::new(format!("pick({axis}, {index_dtype})"), &[(shape.clone(), lay, Domain::Any)],
                seed, move |m, x| x[0].pick(&picked(m)?, axis)),
            Case::new(format!("pick(log_softmax({axis}))"),
                &[(shape.clone(), lay, Domain::Any)], seed,
                move |m, x| x[0].log_softmax(axis)?.pick(&make_indices(m)?, axis)),
        ];
        for case in &cases {
            check(dev, case)?;
        }
    });
}

device_tests!(softmax_cross_entropy_over_rows);
fn softmax_cross_entropy_over_rows(dev: Device) {
    let _serial = serial();
    proptest!(config(dev, 64), |(
        rows in 1usize..5,
        classes in 1usize..6,
        index_dtype in prop::sample::select(vec![DType::I64, DType::I32, DType::U8]),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        let labels: Vec<i64> = common::values(rows, seed ^ 0xCE, 1000)
            .into_iter()
            .map(|v| v.rem_euclid(classes as i64))
            .collect();
        let make_labels = move |m: &Manager| -> ndscope::Result<NDArray> {
            match index_dtype {
                DType::I64 => m.from_vec(labels.clone(), [rows]),
                DType::I32 => m.from_vec(labels.iter().map(|&i| i as i32).collect(), [rows]),
                _ => m.from_vec(labels.iter().map(|&i| i as u8).collect(), [rows]),
            }
        };
        let composed = make_labels.clone();
        let cases = [
            Case::new(format!("softmax_cross_entropy({index_dtype})"),
                &[(vec![rows, classes], lay, Domain::Any)], seed,
                move |m, x| x[0].softmax_cross_entropy(&make_labels(m)?)),
            // Twice in one loss, so its output gradient is a sum, not the seed.
            Case::new(format!("softmax_cross_entropy({index_dtype}) twice"),
                &[(vec![rows, classes], lay, Domain::Any)], seed,
                move |m, x| {
                    let labels = composed(m)?;
                    x[0].softmax_cross_entropy(&labels)?
                        .add(&x[0].mul_scalar(2.0)?.softmax_cross_entropy(&labels)?)
                }),
        ];
        for case in &cases {
            check(dev, case)?;
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Conversions: to_dtype between floats, to_device

/// The other float dtype.
fn other_float(dtype: DType) -> DType {
    if dtype == DType::F32 {
        DType::F64
    } else {
        DType::F32
    }
}

device_tests!(to_dtype_between_floats);
fn to_dtype_between_floats(dev: Device) {
    let _serial = serial();
    // Σ r · square(x as the other float dtype), back to x's: the gradient is 2·r·x, in x's dtype.
    proptest!(config(dev, 48), |(
        shape in dims(0..5),
        lay in layout(),
        seed in any::<u64>(),
    )| {
        for dtype in [DType::F64, DType::F32] {
            let leaf_shape = lay.leaf_shape(&shape);
            let m = Manager::new_base_on(dev).unwrap();
            let values = gen(Domain::Any, common::size(&leaf_shape), seed);
            let x = array(&m, dtype, &leaf_shape, &values);
            x.set_requires_gradient(true).unwrap();
            let (r, want) = {
                let collector = m.gradient_collector().unwrap();
                let v = lay.view(&x, &shape).unwrap();
                let y = v.to_dtype(other_float(dtype)).unwrap().square().unwrap();
                let y = y.to_dtype(dtype).unwrap();
                let r_values = gen(Domain::Any, y.size(), seed ^ 0xF00D);
                let r = array(&m, dtype, y.dims(), &r_values);
                collector.backward(&y.mul(&r).unwrap().sum_all().unwrap()).unwrap();
                // The expected gradient: 2·r·x at the input's elements, 0 on the padding
                // (computed without recording, on the same layout).
                let want = no_gradient(|| {
                    let probe = array(&m, DType::F64, &leaf_shape, &(0..values.len()).map(|i| i as f64).collect::<Vec<_>>());
                    let positions = common::as_f64(&lay.view(&probe, &shape).unwrap());
                    let mut want = vec![0.0; values.len()];
                    for (p, rv) in positions.iter().zip(&r_values) {
                        want[*p as usize] += 2.0 * rv * values[*p as usize];
                    }
                    want
                });
                (r, want)
            };
            let g = x.gradient().unwrap();
            prop_assert_eq!(g.dtype(), dtype);
            prop_assert_eq!(g.device(), dev);
            let got = common::as_f64(&g);
            for (a, b) in got.iter().zip(&want) {
                prop_assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{dtype}: {got:?} vs {want:?}");
            }
            r.close().unwrap();
            m.close().unwrap();
        }
    });
}

device_tests!(to_device_passes_gradients_across_devices);
fn to_device_passes_gradients_across_devices(dev: Device) {
    let _serial = serial();
    // A CPU leaf moved to `dev` and back, and a leaf on `dev` moved to the CPU and back (CPU to
    // CPU on the CPU): Σ r · (3·x²) has gradient 6·r·x, on each leaf's own device.
    for dtype in [DType::F64, DType::F32] {
        for (home, away) in [(Device::Cpu, dev), (dev, Device::Cpu)] {
            let m = Manager::new_base_on(home).unwrap();
            let values = gen(Domain::Any, 6, 11);
            let r_values = gen(Domain::Any, 6, 12);
            let x = array(&m, dtype, &[2, 3], &values);
            x.set_requires_gradient(true).unwrap();
            {
                let collector = m.gradient_collector().unwrap();
                let moved = x.to_device(away).unwrap();
                assert_eq!(moved.device(), away);
                let y = moved.square().unwrap().to_device(home).unwrap();
                let y = y.mul_scalar(3.0).unwrap();
                let r = array(&m, dtype, &[2, 3], &r_values);
                collector
                    .backward(&y.mul(&r).unwrap().sum_all().unwrap())
                    .unwrap();
            }
            let g = x.gradient().unwrap();
            assert_eq!((g.device(), g.dtype()), (home, dtype));
            let got = common::as_f64(&g);
            for (i, a) in got.iter().enumerate() {
                let want = 6.0 * r_values[i] * values[i];
                assert!(
                    (a - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{dtype} {home}->{away}: {got:?}"
                );
            }
            m.close().unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// What is not differentiated, and backward's own errors

fn assert_not_recorded(result: ndscope::Result<()>, what: &str) {
    match result {
        Err(e @ Error::InvalidArgument { .. }) => {
            assert!(e.to_string().contains("not recorded"), "{what}: {e}");
        }
        other => panic!("{what}: backward through it gave {other:?}, not 'not recorded'"),
    }
}

device_tests!(comparisons_argmax_one_hot_and_integer_ops_record_nothing);
fn comparisons_argmax_one_hot_and_integer_ops_record_nothing(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m
        .from_slice(&[0.5f64, -1.0, 2.0, -0.25, 1.5, 3.0], [2, 3])
        .unwrap();
    let z = m.from_slice(&[0.0f64, 1.0, -1.0], [3]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let collector = m.gradient_collector().unwrap();
    let results: Vec<(&str, NDArray)> = vec![
        ("gt", x.gt(&z).unwrap()),
        ("lt", x.lt(&z).unwrap()),
        ("eq", x.eq(&z).unwrap()),
        ("gt_scalar", x.gt_scalar(0.0).unwrap()),
        ("lt_scalar", x.lt_scalar(0.0).unwrap()),
        ("eq_scalar", x.eq_scalar(0.5).unwrap()),
        ("argmax", x.argmax(1).unwrap()),
        (
            "one_hot",
            x.argmax(-1).unwrap().one_hot(3, DType::F64).unwrap(),
        ),
        ("to_dtype(I64)", x.to_dtype(DType::I64).unwrap()),
        (
            "integer add",
            x.to_dtype(DType::I32)
                .unwrap()
                .add(&x.to_dtype(DType::I32).unwrap())
                .unwrap(),
        ),
        (
            "integer sum",
            x.to_dtype(DType::I64).unwrap().sum(&[0], false).unwrap(),
        ),
    ];
    for (what, result) in &results {
        let loss = result.to_dtype(DType::F64).unwrap().sum_all().unwrap();
        assert_not_recorded(collector.backward(&loss), what);
    }
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![0.0; 6]);
    // A mask from a comparison passes no gradient of its own: d/dx Σ x·[x > 0] = [x > 0].
    let mask = x.gt_scalar(0.0).unwrap().to_dtype(DType::F64).unwrap();
    collector
        .backward(&x.mul(&mask).unwrap().sum_all().unwrap())
        .unwrap();
    assert_eq!(
        common::as_f64(&x.gradient().unwrap()),
        vec![1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    );
    // Integer arrays cannot require gradients.
    let i = m.from_slice(&[1i64, 2], [2]).unwrap();
    assert!(matches!(
        i.set_requires_gradient(true),
        Err(Error::DTypeMismatch { .. })
    ));
    drop(collector);
    m.close().unwrap();
}

device_tests!(an_op_without_gradient_is_an_error_at_backward);
fn an_op_without_gradient_is_an_error_at_backward(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.from_slice(&[0.5f32, -1.0, 2.0], [3]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let collector = m.gradient_collector().unwrap();
    // gelu has no gradient: a loss through it is refused, naming it, and nothing is added (not
    // even the gradient of the other path, x·gelu(x)'s direct use of x).
    let loss = x.gelu().unwrap().mul(&x).unwrap().sum_all().unwrap();
    let err = collector.backward(&loss).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("`gelu`") && text.contains("has no gradient"),
        "{text}"
    );
    assert!(
        text.contains("autograd_gradcheck.rs"),
        "names the call site: {text}"
    );
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![0.0; 3]);
    // A gelu the loss does not depend on is no obstacle.
    let _unused = x.gelu().unwrap();
    collector
        .backward(&x.square().unwrap().sum_all().unwrap())
        .unwrap();
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![1.0, -2.0, 4.0]);
    // Nor is one on an array that does not require gradients.
    let c = m
        .from_slice(&[1.0f32, 1.0, 1.0], [3])
        .unwrap()
        .gelu()
        .unwrap();
    collector
        .backward(&x.mul(&c).unwrap().sum_all().unwrap())
        .unwrap();
    let gelu1 = common::as_f64(&c)[0];
    let got = common::as_f64(&x.gradient().unwrap());
    for (g, want) in got.iter().zip([1.0 + gelu1, -2.0 + gelu1, 4.0 + gelu1]) {
        assert!((g - want).abs() < 1e-6, "{got:?}");
    }
    drop(collector);
    m.close().unwrap();
}

device_tests!(backward_with_a_seed);
fn backward_with_a_seed(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m
        .from_slice(&[1.0f64, -2.0, 3.0, 0.5, 4.0, -1.0], [2, 3])
        .unwrap();
    x.set_requires_gradient(true).unwrap();
    let seed = m
        .from_slice(&[1.0f64, 0.5, -1.0, 2.0, 0.0, 3.0], [2, 3])
        .unwrap();
    let collector = m.gradient_collector().unwrap();
    let y = x.square().unwrap();
    // Not a scalar: backward refuses, backward_with needs a seed of y's shape, dtype, device.
    assert!(matches!(
        collector.backward(&y),
        Err(Error::ShapeMismatch { .. })
    ));
    let wrong_shape = m.from_slice(&[1.0f64; 6], [3, 2]).unwrap();
    assert!(matches!(
        collector.backward_with(&y, &wrong_shape),
        Err(Error::ShapeMismatch { .. })
    ));
    let wrong_dtype = m.from_slice(&[1.0f32; 6], [2, 3]).unwrap();
    assert!(collector.backward_with(&y, &wrong_dtype).is_err());
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![0.0; 6]);
    // d/dx Σ seed·x² = 2·x·seed.
    collector.backward_with(&y, &seed).unwrap();
    assert_eq!(
        common::as_f64(&x.gradient().unwrap()),
        vec![2.0, -2.0, -6.0, 2.0, 0.0, -6.0]
    );
    drop(collector);
    m.close().unwrap();
}

device_tests!(a_loss_that_is_itself_a_leaf);
fn a_loss_that_is_itself_a_leaf(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.from_slice(&[2.5f32], [1]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let collector = m.gradient_collector().unwrap();
    // d x / d x = 1 (and, from a seed, the seed).
    collector.backward(&x).unwrap();
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![1.0]);
    let seed = m.from_slice(&[-3.0f32], [1]).unwrap();
    collector.backward_with(&x, &seed).unwrap();
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![-2.0]);
    drop(collector);
    m.close().unwrap();
}

device_tests!(an_op_result_that_requires_gradients_receives_its_gradient);
fn an_op_result_that_requires_gradients_receives_its_gradient(dev: Device) {
    let _serial = serial();
    // `backward` computes the gradient of every array that requires gradients and that the loss
    // depends on: an op's result marked so (after it was recorded) too, not only the leaves.
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.from_slice(&[1.0f64, -2.0, 3.0], [3]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let collector = m.gradient_collector().unwrap();
    let y = x.square().unwrap();
    y.set_requires_gradient(true).unwrap();
    let z = y.mul_scalar(3.0).unwrap();
    z.set_requires_gradient(true).unwrap();
    // loss = Σ z·y + z, with y = x² and z = 3y.
    let loss = z.mul(&y).unwrap().add(&z).unwrap().sum_all().unwrap();
    collector.backward(&loss).unwrap();
    let (xs, ys, zs) = ([1.0, -2.0, 3.0], [1.0, 4.0, 9.0], [3.0, 12.0, 27.0]);
    // ∂loss/∂z = y + 1; ∂loss/∂y = z + 3·(y + 1) (directly, and through z); ∂loss/∂x = 2x·∂loss/∂y.
    let dz: Vec<f64> = ys.iter().map(|y| y + 1.0).collect();
    let dy: Vec<f64> = (0..3).map(|i| zs[i] + 3.0 * dz[i]).collect();
    let dx: Vec<f64> = (0..3).map(|i| 2.0 * xs[i] * dy[i]).collect();
    assert_eq!(common::as_f64(&z.gradient().unwrap()), dz);
    assert_eq!(common::as_f64(&y.gradient().unwrap()), dy);
    assert_eq!(common::as_f64(&x.gradient().unwrap()), dx);
    // The loss itself, marked, receives 1.
    let loss = x.sum_all().unwrap();
    loss.set_requires_gradient(true).unwrap();
    collector.backward(&loss).unwrap();
    assert_eq!(common::as_f64(&loss.gradient().unwrap()), vec![1.0]);
    drop(collector);
    m.close().unwrap();
}

device_tests!(backward_twice_through_one_tape_is_an_error);
fn backward_twice_through_one_tape_is_an_error(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.from_slice(&[1.0f64, 2.0], [2]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let collector = m.gradient_collector().unwrap();
    let loss = x.square().unwrap().sum_all().unwrap();
    collector.backward(&loss).unwrap();
    assert_not_recorded(collector.backward(&loss), "a second backward");
    // The gradient was added once.
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![2.0, 4.0]);
    // Recording goes on after backward: a new loss works, and adds.
    let loss = x.square().unwrap().sum_all().unwrap();
    collector.backward(&loss).unwrap();
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![4.0, 8.0]);
    drop(collector);
    m.close().unwrap();
}

device_tests!(a_loss_that_was_not_recorded_is_an_error);
fn a_loss_that_was_not_recorded_is_an_error(dev: Device) {
    let _serial = serial();
    let m = Manager::new_base_on(dev).unwrap();
    let x = m.from_slice(&[1.0f64, 2.0], [2]).unwrap();
    let plain = m.from_slice(&[3.0f64, 4.0], [2]).unwrap();
    x.set_requires_gradient(true).unwrap();
    let before = x.square().unwrap().sum_all().unwrap();
    let collector = m.gradient_collector().unwrap();
    assert_not_recorded(
        collector.backward(&before),
        "a loss computed before the collector opened",
    );
    let paused = no_gradient(|| x.square().unwrap().sum_all().unwrap());
    assert_not_recorded(
        collector.backward(&paused),
        "a loss computed in no_gradient",
    );
    let unrelated = plain.square().unwrap().sum_all().unwrap();
    assert_not_recorded(
        collector.backward(&unrelated),
        "a loss of arrays that do not require gradients",
    );
    assert_eq!(common::as_f64(&x.gradient().unwrap()), vec![0.0, 0.0]);
    drop(collector);
    m.close().unwrap();
}
