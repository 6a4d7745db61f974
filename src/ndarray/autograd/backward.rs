//! `backward`: checks the saved arrays of every record the output gradient reaches, then walks
//! the tape from the end, each record turning its output gradient into its inputs' (composed
//! from the public ops, so every backend has them), and last adds the leaves' gradients into
//! their `gradient()` arrays.

use std::sync::atomic::Ordering;

use super::pending;
use super::tape::{self, Backward, Node, Pause, Track, INLINE_INPUTS, TAPE};
use crate::backend::contract::NnOps;
use crate::backend::{AnyDevice, Binary, Unary};
use crate::error::Ctx;
use crate::manager::Manager;
use crate::ndarray::exec::{self, Target};
use crate::{concat, DType, Error, NDArray, Result, Shape, Transpose};

/// An input's gradient: an array, or a matrix product not computed yet, which a leaf's
/// gradient takes in place in one pass (`addmm_`, no temporary).
enum Grad {
    Array(NDArray),
    Product(NDArray, NDArray, Transpose),
    /// An array to convert to this dtype: a leaf's gradient through `to_dtype` (an autocast
    /// copy of a parameter), converted as it is written into the leaf's gradient, with no
    /// converted copy made.
    Converted(NDArray, DType),
}

impl Grad {
    fn into_array(self) -> Result<NDArray> {
        match self {
            Grad::Array(a) => Ok(a),
            Grad::Product(a, b, t) => a.matmul_t(&b, t),
            Grad::Converted(a, dtype) => a.to_dtype(dtype),
        }
    }
}

/// Runs backward from `y` (seeded with ones, or `seed`) on this thread's tape, then frees the
/// tape (recording goes on on a new one).
pub(super) fn run(ctx: &Ctx, manager: &Manager, y: &NDArray, seed: Option<&NDArray>) -> Result<()> {
    let (id, mut nodes) = TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        (tape.id, std::mem::take(&mut tape.nodes))
    });
    let start = match tape::track(y, id) {
        Track::Node(i) if (i as usize) < nodes.len() => Some(i as usize),
        Track::Leaf => None,
        _ => {
            TAPE.with(|t| t.borrow_mut().nodes = nodes);
            return Err(ctx.invalid(format!(
                "{} was not recorded by this gradient collector: it does not depend on an array \
                 that requires gradients, or it was computed before the collector opened, in \
                 no_gradient, or before a backward that already ran through it",
                y.0.describe()
            )));
        }
    };
    let result = {
        let _pause = Pause::new();
        // Temporaries go to the active scope, else to the collector's manager.
        let _active = Manager::active().is_none().then(|| manager.activate());
        walk(ctx, &mut nodes, start, y, seed)
    };
    // The tape is used up: its records are dropped (capacity kept) and a new id starts.
    nodes.clear();
    TAPE.with(|t| {
        let mut tape = t.borrow_mut();
        if tape.id != 0 {
            tape.id = tape::next_tape_id();
        }
        tape.nodes = nodes;
    });
    result
}

fn walk(
    ctx: &Ctx,
    nodes: &mut [Node],
    start: Option<usize>,
    y: &NDArray,
    seed: Option<&NDArray>,
) -> Result<()> {
    let Some(start) = start else {
        // `y` is itself a leaf.
        let seed = match seed {
            Some(s) => s.clone(),
            None => full(ctx, y, y.shape().clone(), 1.0)?,
        };
        return accumulate(ctx, &[(y.clone(), Grad::Array(seed))]);
    };
    // Which records the gradient reaches. A record's inputs were recorded before it, so they
    // sit before it on the tape.
    nodes[start].reached = true;
    for i in (0..=start).rev() {
        let (before, rest) = nodes.split_at_mut(i);
        if !rest[0].reached {
            continue;
        }
        for (_, track) in rest[0].all_inputs() {
            if let Track::Node(j) = track {
                if let Some(n) = before.get_mut(j as usize) {
                    n.reached = true;
                }
            }
        }
    }
    // Everything checked before anything is computed.
    for node in nodes[..=start].iter().filter(|n| n.reached) {
        check(ctx, node)?;
    }
    // Without a seed, the root's output gradient is ones, left implicit: a record whose
    // backward needs no array for it (`input_grads_of_ones`) uses none, the others get it
    // materialised.
    nodes[start].grad = seed.cloned();
    let mut leaves: Vec<(NDArray, Grad)> = Vec::with_capacity(16);
    // Output gradients of records that are matrix products not computed yet: an autocast copy
    // of an f32 parameter whose only gradient is a product of halves (see `product_into_leaf`).
    let mut products: Vec<(usize, Grad)> = Vec::new();
    for i in (0..=start).rev() {
        let (before, rest) = nodes.split_at_mut(i);
        let node = &mut rest[0];
        if !node.reached {
            continue;
        }
        if let Some(at) = products.iter().position(|(k, _)| *k == i) {
            let (_, product) = products.swap_remove(at);
            match node.input(0) {
                // The product goes into the parameter's f32 gradient as it is (halves
                // multiplied into f32): no product in the half type, no conversion.
                Some((leaf, Track::Leaf)) if node.grad.is_none() => {
                    leaves.push((leaf.clone(), product));
                    continue;
                }
                _ => {
                    let g = product.into_array()?;
                    node.grad = Some(match node.grad.take() {
                        None => g,
                        Some(sum) => sum.add(&g)?,
                    });
                }
            }
        }
        let g = match node.grad.take() {
            Some(g) => Some(g),
            // The root without a seed: its ones stay implicit until something needs them.
            None if i == start => None,
            None => continue,
        };
        // A result that itself requires gradients (marked after it was recorded) receives its
        // gradient too, as a leaf does (the ones materialised): its output gradient is complete
        // here.
        let g = if node.output.requires_gradient() {
            let g = match g {
                Some(g) => g,
                None => ones_like(ctx, &node.output)?,
            };
            leaves.push((node.output.clone(), Grad::Array(g.clone())));
            Some(g)
        } else {
            g
        };
        let mut grads = match g {
            Some(g) => input_grads(node, &g)?,
            None => match input_grads_of_ones(node)? {
                Some(grads) => grads,
                None => input_grads(node, &ones_like(ctx, &node.output)?)?,
            },
        };
        for (k, (input, track)) in node.all_inputs().enumerate() {
            let Some(grad) = grads.take(k) else { continue };
            match track {
                Track::No => {}
                Track::Leaf => leaves.push((input.clone(), grad)),
                Track::Node(j) => {
                    let j = j as usize;
                    let Some(source) = before.get_mut(j) else {
                        continue;
                    };
                    let earlier = products.iter().position(|(k, _)| *k == j);
                    if earlier.is_none()
                        && source.grad.is_none()
                        && product_into_leaf(source, &grad)
                    {
                        products.push((j, grad));
                        continue;
                    }
                    let mut grad = grad.into_array()?;
                    if let Some(at) = earlier {
                        // A second gradient: the product is computed after all.
                        let (_, product) = products.swap_remove(at);
                        grad = product.into_array()?.add(&grad)?;
                    }
                    source.grad = Some(match source.grad.take() {
                        None => grad,
                        Some(sum) => sum.add(&grad)?,
                    });
                }
            }
        }
    }
    accumulate(ctx, &leaves)
}

/// Whether `grad`, the first output gradient reaching record `node`, may stay a product: it
/// multiplies halves, and `node` converts an f32 leaf (an autocast copy of a parameter) on the
/// same device to that half type, so the leaf's f32 gradient can take the product straight
/// from the halves (`addmm_` into f32: no product rounded to the half type, none kept in the
/// step's workspace, no conversion pass).
fn product_into_leaf(node: &Node, grad: &Grad) -> bool {
    let Grad::Product(a, b, _) = grad else {
        return false;
    };
    matches!(node.backward, Backward::Convert)
        && !node.output.requires_gradient()
        && a.dtype().is_half()
        && b.dtype() == a.dtype()
        && node.input(0).is_some_and(|(leaf, track)| {
            track == Track::Leaf && leaf.dtype() == DType::F32 && leaf.device() == a.device()
        })
}

/// The checks of one record the gradient reaches: it has a gradient, the arrays it saved are
/// open and unchanged, its output was not written in place, its leaves' gradients are open.
fn check(ctx: &Ctx, node: &Node) -> Result<()> {
    let no_gradient = matches!(node.backward, Backward::None)
        || matches!(node.backward, Backward::Unary(Unary::Gelu));
    if no_gradient {
        return Err(ctx.invalid(format!(
            "`{}` (called at {}) has no gradient, and the loss depends on its result through an \
             array that requires gradients (compute it in no_gradient, or on arrays that do not \
             require gradients)",
            node.op, node.at
        )));
    }
    let saved = node
        .inputs
        .iter()
        .enumerate()
        .filter(|(i, _)| node.saved & (1 << i) != 0)
        .filter_map(|(_, slot)| slot.as_ref().map(|(a, _, v)| (a, *v)));
    let output = node
        .saves_output
        .then_some((&node.output, node.out_version));
    for (array, version) in saved.chain(output) {
        if !array.is_open() {
            let reason = array.0.closed.reason();
            return Err(Error::ArrayClosed {
                op: ctx.op,
                at: ctx.at,
                array: array.0.describe(),
                created_at: array.created_at(),
                reason: format!(
                    "{reason}; backward needs it because `{}` (called at {}) saved it",
                    node.op, node.at
                ),
            });
        }
        if array.0.grad.version.load(Ordering::Relaxed) != version {
            return Err(modified(ctx, array, node, "saved it"));
        }
    }
    if node.output.0.grad.version.load(Ordering::Relaxed) != node.out_version {
        return Err(modified(ctx, &node.output, node, "computed it"));
    }
    let output = std::iter::once((&node.output, Track::Leaf));
    for (input, track) in node.all_inputs().chain(output) {
        if track == Track::Leaf && input.requires_gradient() && input.gradient_if_open().is_none() {
            return Err(ctx.invalid(format!(
                "the gradient of {} is closed, so backward cannot add into it",
                input.0.describe()
            )));
        }
    }
    Ok(())
}

fn modified(ctx: &Ctx, array: &NDArray, node: &Node, what: &str) -> Error {
    ctx.invalid(format!(
        "{} was modified by an in-place operation after `{}` (called at {}) {what}: its \
         gradient would be wrong (write the result to a new array instead)",
        array.0.describe(),
        node.op,
        node.at
    ))
}

/// Adds each leaf's gradient into its `gradient()` array, in place.
fn accumulate(ctx: &Ctx, leaves: &[(NDArray, Grad)]) -> Result<()> {
    for (leaf, grad) in leaves {
        if !leaf.requires_gradient() {
            continue;
        }
        let Some(target) = leaf.gradient_if_open() else {
            return Err(ctx.invalid(format!(
                "the gradient of {} is closed, so backward cannot add into it",
                leaf.0.describe()
            )));
        };
        // A gradient that holds zeros takes the first contribution without being read: an
        // array is copied in, a weight gradient's product is left pending (computed when the
        // gradient is used, or fused into the optimizer's step).
        let zero = holds_zeros(ctx, &target)?;
        match grad {
            Grad::Array(g) if zero => target.assign_(g)?,
            Grad::Array(g) => target.add_(g)?,
            Grad::Product(a, b, t) if zero => pending::set_pending(&target, a, b, t.flags()),
            Grad::Product(a, b, t) => target.addmm_(a, b, *t, 1.0, 1.0)?,
            Grad::Converted(g, _) if zero => target.assign_converted_(g)?,
            Grad::Converted(g, dtype) => target.add_(&g.to_dtype(*dtype)?)?,
        }
    }
    Ok(())
}

/// Whether a leaf's gradient `target` is known to hold zeros, its pending product (if any)
/// computed first: a contribution then overwrites it instead of being added.
fn holds_zeros(ctx: &Ctx, target: &NDArray) -> Result<bool> {
    pending::settle(ctx, &target.0)?;
    Ok(pending::known_zero(&target.0))
}

/// A new array of `shape` like `like` (dtype, device), filled with `value`, placed as an op
/// result.
fn full(ctx: &Ctx, like: &NDArray, shape: Shape, value: f64) -> Result<NDArray> {
    let (out, _) = exec::new_array(
        ctx,
        Target::ResultOf(&[like]),
        shape,
        like.dtype(),
        like.device(),
    )?;
    if let Err(e) = out.fill_(value) {
        exec::discard(&out);
        return Err(e);
    }
    Ok(out)
}

/// A dense layer's `dz` (`g` masked by its ReLU, `y > 0`; `g` itself without) and its bias
/// gradient, in one kernel pass ([`NnOps::bias_act_grad`]). A bias that is a leaf requiring
/// gradients gets its gradient written straight into its `gradient()` (overwritten when that
/// is known to hold zeros, else added to: no zeroing and no copy) and `None` is returned for
/// it; another bias gets a new array; without a bias (`bias` `None`) only the mask is applied.
fn dense_bias_grad(
    g: &NDArray,
    y: &NDArray,
    relu: bool,
    (m, n): (usize, usize),
    bias: Option<(&NDArray, Track)>,
) -> Result<(NDArray, Option<NDArray>)> {
    let ctx = Ctx::new("backward (linear)");
    let dtype = g.dtype();
    let fresh = |shape: Shape| -> Result<NDArray> {
        exec::new_array(&ctx, Target::ResultOf(&[g]), shape, dtype, g.device()).map(|(a, _)| a)
    };
    // Where the bias gradient goes: the leaf's own gradient, or a new array.
    let into_leaf = match bias {
        Some((b, Track::Leaf)) if b.requires_gradient() => b.gradient_if_open(),
        _ => None,
    };
    let (db, accumulate) = match (&into_leaf, bias) {
        (Some(target), _) => (target.clone(), !holds_zeros(&ctx, target)?),
        (None, Some(_)) => (fresh(Shape::new(&[n]))?, false),
        (None, None) if relu => (fresh(Shape::new(&[n]))?, false),
        (None, None) => return Ok((g.clone(), None)),
    };
    let discard = |a: &NDArray| {
        if into_leaf.is_none() {
            exec::discard(a);
        }
    };
    let dz = if relu {
        let dz = match fresh(g.shape().clone()) {
            Ok(dz) => dz,
            Err(e) => {
                discard(&db);
                return Err(e);
            }
        };
        let ran = exec::inplace2_with2(&ctx, (&db, &dz), (g, y), |db, dz, g, y| {
            AnyDevice::bias_act_grad(&ctx, dtype, (m, n), g, Some((y, dz)), db, accumulate)
        });
        if let Err(e) = ran {
            exec::discard(&dz);
            discard(&db);
            return Err(e);
        }
        dz
    } else {
        let ran = exec::inplace_with(&ctx, &db, g, |db, g| match g {
            Some(g) => AnyDevice::bias_act_grad(&ctx, dtype, (m, n), g, None, db, accumulate),
            None => Err(ctx.invalid("the bias gradient is the output gradient itself")),
        });
        if let Err(e) = ran {
            discard(&db);
            return Err(e);
        }
        g.clone()
    };
    let gb = match (into_leaf, bias) {
        (None, Some(_)) => Some(db),
        _ => {
            if bias.is_none() {
                exec::discard(&db);
            }
            None
        }
    };
    Ok((dz, gb))
}

/// Ones of `y`'s shape, dtype and device, placed as an op result: a root's implicit seed,
/// materialised.
fn ones_like(ctx: &Ctx, y: &NDArray) -> Result<NDArray> {
    full(ctx, y, y.shape().clone(), 1.0)
}

/// The gradients of a record's inputs for an output gradient of ones left implicit (the seed of
/// `backward(&loss)`), for the records whose backward needs no array for it; `None` for the
/// others, which get the ones materialised. `softmax_cross_entropy` hands on the gradient its
/// forward pass saved, as it is: no kernel.
fn input_grads_of_ones(node: &Node) -> Result<Option<Grads>> {
    let mut out = Grads::default();
    match &node.backward {
        Backward::SoftmaxCrossEntropy => match node.input(2) {
            Some((saved, _)) => out[0] = Some(Grad::Array(saved.clone())),
            None => return unreachable_gradient(node),
        },
        _ => return Ok(None),
    }
    for (i, (_, track)) in node.all_inputs().enumerate() {
        if track == Track::No {
            out.take(i);
        }
    }
    Ok(Some(out))
}

/// `g` summed over the axes it was broadcast along, to `shape` (NumPy broadcasting undone).
fn sum_to(g: NDArray, shape: &Shape) -> Result<NDArray> {
    if g.shape() == shape {
        return Ok(g);
    }
    let (gd, sd) = (g.dims(), shape.dims());
    let lead = gd.len() - sd.len();
    let mut axes: Vec<isize> = (0..lead as isize).collect();
    let mut kept = false;
    for (i, &d) in sd.iter().enumerate() {
        if d == 1 && gd[lead + i] != 1 {
            axes.push((lead + i) as isize);
            kept = true;
        }
    }
    if !kept {
        return g.sum(&axes, false);
    }
    let summed = g.sum(&axes, true)?;
    if summed.shape() == shape {
        Ok(summed)
    } else {
        summed.reshape(shape.clone())
    }
}

/// A `U8` mask as `dtype` 0/1.
fn float_mask(mask: NDArray, dtype: DType) -> Result<NDArray> {
    mask.to_dtype(dtype)
}

/// The permutation that moves the last axis of an `ndim`-D array to `axis`.
fn last_to(axis: usize, ndim: usize) -> Option<Vec<usize>> {
    if axis + 1 == ndim {
        return None;
    }
    let mut perm: Vec<usize> = (0..ndim - 1).collect();
    perm.insert(axis, ndim - 1);
    Some(perm)
}

/// `one_hot(indices, n)` (as `dtype`) with its new last axis moved to `axis`, times `g`
/// broadcast along it: the gradient that `pick` and `max` route to one element per lane.
fn scatter(indices: &NDArray, n: usize, axis: usize, g_keep: &NDArray) -> Result<NDArray> {
    let oh = indices.one_hot(n, g_keep.dtype())?;
    let oh = match last_to(axis, oh.ndim()) {
        Some(perm) => oh.permute(&perm)?,
        None => oh,
    };
    oh.mul(g_keep)
}

/// The gradients of a record's inputs from its output gradient `g` (`None` for inputs whose
/// gradient goes nowhere), in input order.
fn input_grads(node: &Node, g: &NDArray) -> Result<Grads> {
    let wants = |i: usize| node.input(i).is_some_and(|(_, t)| t != Track::No);
    // Every record has the inputs its backward reads (the front-end records them).
    let x = |i: usize| match node.input(i) {
        Some((a, _)) => Ok(a),
        None => unreachable_gradient(node),
    };
    let y = &node.output;
    let dtype = g.dtype();
    let arr = |a: NDArray| Some(Grad::Array(a));
    let mut out = Grads::default();
    match &node.backward {
        Backward::Unary(op) => {
            let a = x(0)?;
            let ga = match op {
                Unary::Neg => g.neg()?,
                Unary::Abs => {
                    let pos = float_mask(a.gt_scalar(0.0)?, dtype)?;
                    let neg = float_mask(a.lt_scalar(0.0)?, dtype)?;
                    g.mul(&pos.sub(&neg)?)?
                }
                Unary::Square => g.mul(a)?.mul_scalar(2.0)?,
                Unary::Relu => g.mul(&float_mask(y.gt_scalar(0.0)?, dtype)?)?,
                Unary::Exp => g.mul(y)?,
                Unary::Log => g.div(a)?,
                Unary::Sqrt => g.div(y)?.mul_scalar(0.5)?,
                Unary::Tanh => g.mul(&y.square()?.neg()?.add_scalar(1.0)?)?,
                Unary::Sigmoid => g.mul(&y.mul(&y.neg()?.add_scalar(1.0)?)?)?,
                Unary::Gelu => unreachable_gradient(node)?,
            };
            out[0] = arr(ga);
        }
        Backward::Binary(op) => {
            let (a, b) = (x(0)?, x(1)?);
            let (ga, gb) = match op {
                Binary::Add => (wants(0).then(|| g.clone()), wants(1).then(|| g.clone())),
                Binary::Sub => (
                    wants(0).then(|| g.clone()),
                    if wants(1) { Some(g.neg()?) } else { None },
                ),
                Binary::Mul => (
                    if wants(0) { Some(g.mul(b)?) } else { None },
                    if wants(1) { Some(g.mul(a)?) } else { None },
                ),
                Binary::Div => (
                    if wants(0) { Some(g.div(b)?) } else { None },
                    if wants(1) {
                        // −g·a/b²
                        Some(g.mul(a)?.div(&b.square()?)?.neg()?)
                    } else {
                        None
                    },
                ),
                Binary::Maximum | Binary::Minimum => {
                    // The larger (smaller) operand takes the gradient; ties split it evenly.
                    let wins = if *op == Binary::Maximum {
                        a.gt(b)?
                    } else {
                        a.lt(b)?
                    };
                    let ties = float_mask(a.eq(b)?, dtype)?.mul_scalar(0.5)?;
                    let share_a = float_mask(wins, dtype)?.add(&ties)?;
                    let ga = if wants(0) {
                        Some(g.mul(&share_a)?)
                    } else {
                        None
                    };
                    let gb = if wants(1) {
                        Some(g.mul(&share_a.neg()?.add_scalar(1.0)?)?)
                    } else {
                        None
                    };
                    (ga, gb)
                }
            };
            if let Some(ga) = ga {
                out[0] = arr(sum_to(ga, a.shape())?);
            }
            if let Some(gb) = gb {
                out[1] = arr(sum_to(gb, b.shape())?);
            }
        }
        Backward::Shift => out[0] = arr(g.clone()),
        Backward::Scale(c) => out[0] = arr(g.mul_scalar(*c)?),
        Backward::PowScalar(p) => {
            let a = x(0)?;
            out[0] = arr(g.mul(&a.pow_scalar(p - 1.0)?)?.mul_scalar(*p)?);
        }
        Backward::Sum { keep, scale } => {
            let a = x(0)?;
            let spread = g.reshape(keep.clone())?.broadcast_to(a.shape().clone())?;
            out[0] = arr(if *scale == 1.0 {
                spread
            } else {
                spread.mul_scalar(*scale)?
            });
        }
        Backward::Max { axis } => {
            let a = x(0)?;
            let mut keep = a.dims().to_vec();
            keep[*axis] = 1;
            let g_keep = g.reshape(Shape::new(&keep))?;
            let indices = a.argmax(*axis as isize)?;
            out[0] = arr(scatter(&indices, a.dims()[*axis], *axis, &g_keep)?);
        }
        Backward::Matmul => {
            let (a, b) = (x(0)?, x(1)?);
            let (ga, gb) = match (a.ndim(), b.ndim()) {
                (2, 2) => (
                    Grad::Product(g.clone(), b.clone(), Transpose::Right),
                    Grad::Product(a.clone(), g.clone(), Transpose::Left),
                ),
                (3, 3) => (
                    Grad::Array(if wants(0) {
                        g.matmul(&b.permute(&[0, 2, 1])?)?
                    } else {
                        g.clone()
                    }),
                    Grad::Array(if wants(1) {
                        a.permute(&[0, 2, 1])?.matmul(g)?
                    } else {
                        g.clone()
                    }),
                ),
                (3, 2) => {
                    let (batch, m, k) = (a.dims()[0], a.dims()[1], a.dims()[2]);
                    let n = b.dims()[1];
                    let ga = if wants(0) {
                        g.matmul(&b.transpose()?)?
                    } else {
                        g.clone()
                    };
                    let gb = if wants(1) {
                        Grad::Product(
                            a.reshape([batch * m, k])?,
                            g.reshape([batch * m, n])?,
                            Transpose::Left,
                        )
                    } else {
                        Grad::Array(g.clone())
                    };
                    (Grad::Array(ga), gb)
                }
                _ => {
                    // [m, k] · [b, k, n]
                    let ga = if wants(0) {
                        g.matmul(&b.permute(&[0, 2, 1])?)?.sum(&[0], false)?
                    } else {
                        g.clone()
                    };
                    let gb = if wants(1) {
                        a.transpose()?.matmul(g)?
                    } else {
                        g.clone()
                    };
                    (Grad::Array(ga), Grad::Array(gb))
                }
            };
            if wants(0) {
                out[0] = Some(ga);
            }
            if wants(1) {
                out[1] = Some(gb);
            }
        }
        Backward::MatmulT { left, right } => {
            let (a, b) = (x(0)?, x(1)?);
            let (ta, tb) = (*left, *right);
            let flags = |l: bool, r: bool| match (l, r) {
                (false, false) => Transpose::None,
                (true, false) => Transpose::Left,
                (false, true) => Transpose::Right,
                (true, true) => Transpose::Both,
            };
            if wants(0) {
                out[0] = Some(if ta {
                    Grad::Product(b.clone(), g.clone(), flags(tb, true))
                } else {
                    Grad::Product(g.clone(), b.clone(), flags(false, !tb))
                });
            }
            if wants(1) {
                out[1] = Some(if tb {
                    Grad::Product(g.clone(), a.clone(), flags(true, ta))
                } else {
                    Grad::Product(a.clone(), g.clone(), flags(!ta, false))
                });
            }
        }
        Backward::Dense { relu } => {
            let (a, w) = (x(0)?, x(1)?);
            let (k, n) = (w.dims()[0], w.dims()[1]);
            // The rows: every axis of x but the last (not x's size over k, which is 0 for k = 0).
            let m: usize = a.dims()[..a.ndim().saturating_sub(1)].iter().product();
            // The ReLU mask and the bias gradient in one pass (the bias's own gradient written
            // in place when it is a leaf's).
            let bias = node.input(2).filter(|_| wants(2));
            let (gz, gb) = dense_bias_grad(g, y, *relu, (m, n), bias)?;
            let flat = |t: &NDArray, cols: usize| -> Result<NDArray> {
                if t.ndim() == 2 {
                    Ok(t.clone())
                } else {
                    t.reshape([m, cols])
                }
            };
            let gz2 = flat(&gz, n)?;
            if wants(0) {
                // f32 weights that the forward read rounded to the half type are read so again.
                let gx = if w.dtype() == gz2.dtype() {
                    gz2.matmul_t(w, Transpose::Right)?
                } else {
                    gz2.matmul_t_rounded(w, Transpose::Right)?
                };
                out[0] = arr(if a.ndim() == 2 {
                    gx
                } else {
                    gx.reshape(a.shape().clone())?
                });
            }
            if wants(1) {
                out[1] = Some(Grad::Product(flat(a, k)?, gz2.clone(), Transpose::Left));
            }
            out[2] = gb.map(Grad::Array);
        }
        Backward::Reshape => out[0] = arr(g.reshape(x(0)?.shape().clone())?),
        Backward::Transpose => out[0] = arr(g.transpose()?),
        Backward::Permute(axes) => {
            let mut inverse = vec![0; axes.ndim()];
            for (i, &a) in axes.dims().iter().enumerate() {
                inverse[a] = i;
            }
            out[0] = arr(g.permute(&inverse)?);
        }
        Backward::BroadcastTo => out[0] = arr(sum_to(g.clone(), x(0)?.shape())?),
        Backward::Narrow { axis, start } => {
            let a = x(0)?;
            let len = g.dims()[*axis];
            let size = a.dims()[*axis];
            let mut parts = Vec::with_capacity(3);
            let zeros = |count: usize| -> Result<NDArray> {
                let mut dims = a.dims().to_vec();
                dims[*axis] = count;
                full(&Ctx::new("narrow (backward)"), g, Shape::new(&dims), 0.0)
            };
            if *start > 0 {
                parts.push(zeros(*start)?);
            }
            parts.push(g.clone());
            if start + len < size {
                parts.push(zeros(size - start - len)?);
            }
            out[0] = arr(if parts.len() == 1 {
                g.clone()
            } else {
                concat(&parts, *axis as isize)?
            });
        }
        Backward::Concat { axis } => {
            let mut offset = 0;
            for (i, (input, track)) in node.all_inputs().enumerate() {
                let len = input.dims()[*axis];
                if track != Track::No {
                    out[i] = arr(g.narrow(*axis as isize, offset, len)?);
                }
                offset += len;
            }
        }
        Backward::Stack { axis } => {
            for (i, (input, track)) in node.all_inputs().enumerate() {
                if track != Track::No {
                    out[i] = arr(g
                        .narrow(*axis as isize, i, 1)?
                        .reshape(input.shape().clone())?);
                }
            }
        }
        Backward::Softmax { axis } => {
            let gs = g.mul(y)?;
            let total = gs.sum(&[*axis as isize], true)?;
            out[0] = arr(gs.sub(&y.mul(&total)?)?);
        }
        Backward::LogSoftmax { axis } => {
            let total = g.sum(&[*axis as isize], true)?;
            out[0] = arr(g.sub(&y.exp()?.mul(&total)?)?);
        }
        Backward::Pick { axis } => {
            let (a, indices) = (x(0)?, x(1)?);
            let g_keep = g.unsqueeze(*axis as isize)?;
            out[0] = arr(scatter(indices, a.dims()[*axis], *axis, &g_keep)?);
        }
        Backward::SoftmaxCrossEntropy => out[0] = arr(x(2)?.mul(g)?),
        Backward::Convert
            if node.input(0).is_some_and(|(a, t)| {
                t == Track::Leaf && a.device() == g.device() && a.dtype() != g.dtype()
            }) =>
        {
            // Into a leaf: converted as it is written into the leaf's gradient.
            out[0] = Some(Grad::Converted(g.clone(), x(0)?.dtype()));
        }
        Backward::Convert => {
            let a = x(0)?;
            let mut ga = g.clone();
            if ga.device() != a.device() {
                ga = ga.to_device(a.device())?;
            }
            if ga.dtype() != a.dtype() {
                ga = ga.to_dtype(a.dtype())?;
            }
            out[0] = arr(ga);
        }
        Backward::None => unreachable_gradient(node)?,
    }
    // Only the inputs whose gradients go somewhere.
    for (i, (_, track)) in node.all_inputs().enumerate() {
        if track == Track::No {
            out.take(i);
        }
    }
    Ok(out)
}

/// The gradients of a record's inputs, by input index: inline for the first three (no
/// allocation per record), in a list past them (`concat`, `stack`).
#[derive(Default)]
struct Grads {
    inline: [Option<Grad>; INLINE_INPUTS],
    more: Vec<Option<Grad>>,
}

impl Grads {
    /// Takes input `i`'s gradient out.
    fn take(&mut self, i: usize) -> Option<Grad> {
        match i.checked_sub(INLINE_INPUTS) {
            None => self.inline[i].take(),
            Some(j) => self.more.get_mut(j).and_then(Option::take),
        }
    }
}

impl std::ops::Index<usize> for Grads {
    type Output = Option<Grad>;
    fn index(&self, i: usize) -> &Option<Grad> {
        match i.checked_sub(INLINE_INPUTS) {
            None => &self.inline[i],
            Some(j) => self.more.get(j).unwrap_or(&None),
        }
    }
}

impl std::ops::IndexMut<usize> for Grads {
    fn index_mut(&mut self, i: usize) -> &mut Option<Grad> {
        match i.checked_sub(INLINE_INPUTS) {
            None => &mut self.inline[i],
            Some(j) => {
                if self.more.len() <= j {
                    self.more.resize_with(j + 1, || None);
                }
                &mut self.more[j]
            }
        }
    }
}

/// `check` refuses records without a gradient before backward starts; this is its message
/// again, should one get here.
fn unreachable_gradient<T>(node: &Node) -> Result<T> {
    Err(Ctx::new("GradientCollector::backward").invalid(format!(
        "`{}` (called at {}) has no gradient",
        node.op, node.at
    )))
}
