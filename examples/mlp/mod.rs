//! A multilayer perceptron built only from ndscope's public op set, trained either with
//! autograd (a [`GradientCollector`](ndscope::GradientCollector) and an
//! [`Optimizer`](ndscope::Optimizer): [`Mlp::autograd_step`]) or with a hand-written backward
//! pass ([`Mlp::train_step`]). Shared by `examples/train_mlp.rs`, `examples/serve_mlp.rs`, the
//! benches and the tests.
//!
//! The autograd step runs in the caller's active scope (a workspace cycle in training): the
//! tape's saved arrays are the forward pass's own results there, and backward's temporaries
//! land there too; only the parameters' gradients and the optimizer's state live in the model.
//!
//! Parameters (and their momentum buffers) live in the manager given to [`Mlp::new`]. A training
//! step places its arrays through a [`LayerWorkspaceMgr`] (DL4J's layer workspace manager): each
//! layer's forward and backward temporaries in working-memory scopes that close after the
//! layer, the activations the backward pass needs in an activations scope open for the step,
//! the gradients handed down the layers in an activation-gradient scope. With the model
//! manager capped, any temporary that would land in the model instead fails at its line with
//! `Error::Capped`.

#![allow(dead_code)]

use std::cell::RefCell;

use ndscope::{
    autocast, gradient_collector, Activation, ArrayKind, DType, Error, GradScaler,
    LayerWorkspaceMgr, Manager, NDArray, NDList, Optimizer, Result, Transpose,
};

/// The precision of an autograd step: f32 throughout, or mixed precision as PyTorch's AMP (the
/// forward pass under [`autocast`] in `low`, f32 parameters and optimizer; for f16 a
/// [`GradScaler`]).
#[derive(Default)]
pub struct Precision {
    /// The autocast dtype (`F16` or `BF16`), or `None` for f32.
    pub low: Option<DType>,
    /// The loss scaler (f16).
    pub scaler: Option<RefCell<GradScaler>>,
}

impl Precision {
    /// Mixed precision in `dtype` (`F16` gets a scaler, its state made in `model`), or f32.
    pub fn new(model: &Manager, dtype: DType) -> Result<Precision> {
        Ok(match dtype {
            DType::F16 => Precision {
                low: Some(DType::F16),
                scaler: Some(RefCell::new(GradScaler::new(model)?)),
            },
            DType::BF16 => Precision {
                low: Some(DType::BF16),
                scaler: None,
            },
            _ => Precision::default(),
        })
    }
}

/// One dense layer: weights `[fan_in, fan_out]`, bias `[fan_out]`, and, for the hand-written
/// step, their velocities (an autograd model's optimizer keeps its own).
pub struct Dense {
    pub w: NDArray,
    pub b: NDArray,
    pub velocities: Option<(NDArray, NDArray)>,
}

/// Dense layers with ReLU between them and softmax cross-entropy on top.
pub struct Mlp {
    pub layers: Vec<Dense>,
    pub classes: usize,
}

/// What one step reports, as 0-d arrays in the caller's active scope.
pub struct StepOut {
    /// Mean cross-entropy (f32).
    pub loss: NDArray,
    /// Correct predictions in the batch (i64).
    pub correct: NDArray,
}

impl Mlp {
    /// He-initialised parameters for layer sizes `sizes` (input first, classes last), created
    /// in `model` from the seeded random stream, with momentum buffers for the hand-written
    /// [`train_step`](Mlp::train_step).
    pub fn new(model: &Manager, sizes: &[usize]) -> Result<Mlp> {
        Mlp::build(model, sizes, false)
    }

    /// The same parameters (same random stream) requiring gradients, for
    /// [`autograd_step`](Mlp::autograd_step): no momentum buffers; the optimizer made with
    /// [`parameters`](Mlp::parameters) holds its state.
    pub fn with_gradients(model: &Manager, sizes: &[usize]) -> Result<Mlp> {
        Mlp::build(model, sizes, true)
    }

    /// The network over existing parameters `[w1, b1, w2, b2, …]` (as
    /// [`parameters`](Mlp::parameters) lists them), without momentum buffers: a data-parallel
    /// replica's model over its device's copies.
    pub fn from_parameters(params: &[NDArray], classes: usize) -> Mlp {
        Mlp {
            layers: params
                .chunks(2)
                .filter(|c| c.len() == 2)
                .map(|c| Dense {
                    w: c[0].clone(),
                    b: c[1].clone(),
                    velocities: None,
                })
                .collect(),
            classes,
        }
    }

    fn build(model: &Manager, sizes: &[usize], autograd: bool) -> Result<Mlp> {
        let mut layers = Vec::new();
        for (i, pair) in sizes.windows(2).enumerate() {
            let (fan_in, fan_out) = (pair[0], pair[1]);
            let w = model
                .randn([fan_in, fan_out], DType::F32)?
                .with_name(&format!("w{}", i + 1));
            w.mul_scalar_((2.0 / fan_in as f64).sqrt())?;
            let b = model
                .zeros([fan_out], DType::F32)?
                .with_name(&format!("b{}", i + 1));
            let velocities = if autograd {
                w.set_requires_gradient(true)?;
                b.set_requires_gradient(true)?;
                None
            } else {
                let vw = model
                    .zeros([fan_in, fan_out], DType::F32)?
                    .with_name(&format!("vw{}", i + 1));
                let vb = model
                    .zeros([fan_out], DType::F32)?
                    .with_name(&format!("vb{}", i + 1));
                Some((vw, vb))
            };
            layers.push(Dense { w, b, velocities });
        }
        Ok(Mlp {
            layers,
            classes: *sizes.last().unwrap_or(&1),
        })
    }

    /// The logits of `x` (`[batch, inputs]`), every temporary in the active scope.
    pub fn logits(&self, x: &NDArray) -> Result<NDArray> {
        logits(self.layers.iter().map(|l| (&l.w, &l.b)), x)
    }

    /// The parameters (weights and biases, not the momentum buffers), named `w1`, `b1`, …: what
    /// a trained model saves and a server loads.
    pub fn parameters(&self) -> NDList {
        self.layers
            .iter()
            .flat_map(|l| [l.w.clone(), l.b.clone()])
            .collect()
    }

    /// The mean softmax cross-entropy of `logits` against `labels` (`[batch]`, i64): one fused
    /// op (`log_softmax`, `pick`, `mean_all` and `neg` in one pass, one launch on a GPU), whose
    /// gradient is saved by the forward pass.
    pub fn loss(logits: &NDArray, labels: &NDArray) -> Result<NDArray> {
        logits.softmax_cross_entropy(labels)
    }

    /// One training step with autograd, as a DJL or PyTorch user writes it: a gradient
    /// collector on the active scope records the forward pass and the loss, `backward` adds
    /// the gradients into the parameters' `gradient()` arrays, and `optimizer.step()` updates
    /// the parameters in place and zeroes the gradients. Call it inside a scope (a workspace
    /// cycle), where the tape's arrays, backward's temporaries and the returned [`StepOut`]
    /// land.
    pub fn autograd_step(
        &self,
        optimizer: &mut Optimizer,
        x: &NDArray,
        labels: &NDArray,
    ) -> Result<StepOut> {
        self.autograd_step_in(&Precision::default(), optimizer, x, labels)
    }

    /// [`autograd_step`](Mlp::autograd_step) in `precision`: the forward pass and the loss
    /// under autocast (products in the low dtype, the loss in f32), `backward` of the scaled
    /// loss and the scaler's step when there is a scaler.
    pub fn autograd_step_in(
        &self,
        precision: &Precision,
        optimizer: &mut Optimizer,
        x: &NDArray,
        labels: &NDArray,
    ) -> Result<StepOut> {
        let collector = gradient_collector()?;
        let (logits, loss) = {
            let _low = precision.low.map(autocast).transpose()?;
            let logits = self.logits(x)?;
            let loss = Mlp::loss(&logits, labels)?;
            (logits, loss)
        };
        match &precision.scaler {
            Some(scaler) => collector.backward(&scaler.borrow().scale(&loss)?)?,
            None => collector.backward(&loss)?,
        }
        collector.close();
        let correct = logits.argmax(1)?.eq(labels)?.sum_all()?;
        match &precision.scaler {
            Some(scaler) => {
                let mut scaler = scaler.borrow_mut();
                scaler.step(optimizer)?;
                scaler.update()?;
            }
            None => optimizer.step()?,
        }
        Ok(StepOut { loss, correct })
    }

    /// One step of SGD with momentum on a batch: forward, softmax cross-entropy against
    /// `labels` (`[batch]`, i64), backward, and the in-place update of every parameter. Arrays
    /// are placed by `mgr`; call it inside a scope (a workspace cycle), where the returned
    /// [`StepOut`] lands.
    pub fn train_step(
        &self,
        mgr: &LayerWorkspaceMgr,
        x: &NDArray,
        labels: &NDArray,
        lr: f64,
        momentum: f64,
    ) -> Result<StepOut> {
        let batch = x.dims()[0] as f64;
        let mut velocities = Vec::with_capacity(self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let Some(v) = &layer.velocities else {
                return Err(Error::InvalidArgument {
                    op: "Mlp::train_step",
                    at: std::panic::Location::caller(),
                    reason: format!(
                        "layer {} has no momentum buffers: the model was made for autograd \
                         (Mlp::with_gradients); make it with Mlp::new for the hand-written step",
                        i + 1
                    ),
                });
            };
            velocities.push(v);
        }
        // Open for the whole step: what the backward pass reads, and what it hands down.
        let _activations = mgr.open(ArrayKind::Activations)?;
        let _gradients = mgr.open(ArrayKind::ActivationGrad)?;

        // Forward: each layer's temporaries in a working-memory scope of their own; its output
        // (the next layer's input, read again by the backward pass) kept as an activation.
        let last = self.layers.len() - 1;
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            inputs.push(h.clone());
            h = mgr.scope(ArrayKind::FfWorkingMem, |_| {
                let z = h.matmul(&layer.w)?.add(&layer.b)?;
                let out = if i < last { z.relu()? } else { z };
                mgr.leverage_to(ArrayKind::Activations, &out)
            })?;
        }
        let logits = h;
        let log_probs = mgr.scope(ArrayKind::FfWorkingMem, |_| {
            mgr.leverage_to(ArrayKind::Activations, &logits.log_softmax(1)?)
        })?;
        // The step's results: small, in the caller's active scope.
        let loss = log_probs.pick(labels, 1)?.mean_all()?.neg()?;
        let correct = logits.argmax(1)?.eq(labels)?.sum_all()?;

        // d loss / d logits = (softmax − one_hot) / batch
        let mut grad = mgr.scope(ArrayKind::BpWorkingMem, |_| {
            let g = log_probs
                .exp()?
                .sub(&labels.one_hot(self.classes, DType::F32)?)?
                .div_scalar(batch)?;
            mgr.leverage_to(ArrayKind::ActivationGrad, &g)
        })?;
        for (i, layer) in self.layers.iter().enumerate().rev() {
            let input = &inputs[i];
            grad = mgr.scope(ArrayKind::BpWorkingMem, |_| {
                let db = grad.sum(&[0], false)?;
                // Through this layer's weights (before they change) and the ReLU below it:
                // relu'(z) is 1 exactly where the layer's input h = relu(z) is positive.
                let below = if i > 0 {
                    let dh = grad.matmul_t(&layer.w, Transpose::Right)?; // grad · wᵀ, no copy
                    let active = input.gt_scalar(0.0)?.to_dtype(DType::F32)?;
                    Some(dh.mul(&active)?)
                } else {
                    None
                };
                // v ← μ·v + inputᵀ·grad; w ← w − lr·v, with no weight-gradient temporary (and,
                // for f32 batches up to 64 on AVX-512 CPUs, in one pass over w and v)
                let (vw, vb) = velocities[i];
                layer.w.sgd_dense_update_(vw, input, &grad, lr, momentum)?;
                vb.mul_scalar_(momentum)?;
                vb.add_(&db)?;
                layer.b.axpy_(-lr, vb)?;
                match below {
                    Some(below) => mgr.leverage_to(ArrayKind::ActivationGrad, &below),
                    None => Ok(grad.clone()),
                }
            })?;
        }
        Ok(StepOut { loss, correct })
    }

    /// Correct predictions on `x` against `labels` (an i64 0-d array in the active scope).
    pub fn correct(&self, x: &NDArray, labels: &NDArray) -> Result<NDArray> {
        self.logits(x)?.argmax(1)?.eq(labels)?.sum_all()
    }

    /// [`correct`](Mlp::correct) with the forward pass under autocast in `low` (if any).
    pub fn correct_in(&self, low: Option<DType>, x: &NDArray, labels: &NDArray) -> Result<NDArray> {
        let _low = low.map(autocast).transpose()?;
        self.correct(x, labels)
    }

    /// Multiply-adds of one training step at `batch` (forward, and backward without the
    /// gradient of the input), times 2 for FLOPs.
    pub fn step_flops(&self, batch: usize) -> f64 {
        let mut flops = 0.0;
        for (i, layer) in self.layers.iter().enumerate() {
            let (fan_in, fan_out) = (layer.w.dims()[0] as f64, layer.w.dims()[1] as f64);
            let one = 2.0 * batch as f64 * fan_in * fan_out;
            // forward, weight gradient, and (except for the first layer) input gradient
            flops += one * if i == 0 { 2.0 } else { 3.0 };
        }
        flops
    }
}

/// Dense layers with ReLU between them: `x · w + b` per layer.
fn logits<'a>(
    layers: impl ExactSizeIterator<Item = (&'a NDArray, &'a NDArray)>,
    x: &NDArray,
) -> Result<NDArray> {
    let last = layers.len().saturating_sub(1);
    let mut h = x.clone();
    for (i, (w, b)) in layers.enumerate() {
        let act = if i < last {
            Activation::Relu
        } else {
            Activation::Identity
        };
        h = h.linear(w, Some(b), act)?;
    }
    Ok(h)
}

/// A trained MLP for inference: its weights and biases only (no momentum buffers), run as
/// [`ndscope::Dense`] layers (weights packed once, bias and ReLU applied as each layer's output
/// is written).
pub struct Inference {
    /// `(w, b)` per layer, input first.
    pub layers: Vec<(NDArray, NDArray)>,
    /// The same layers, packed; made in the weights' manager.
    pub dense: Vec<ndscope::Dense>,
}

impl Inference {
    /// The layers from parameters named as [`Mlp::parameters`] names them (`w1`, `b1`, `w2`,
    /// …), in any order; `Ok(None)` if one is missing. Packs them into their manager (which
    /// must not be capped yet).
    pub fn from_parameters(params: &NDList) -> Result<Option<Inference>> {
        let find = |name: String| {
            params
                .iter()
                .find(|a| a.name().as_deref() == Some(name.as_str()))
                .cloned()
        };
        let mut layers = Vec::new();
        for i in 1.. {
            match (find(format!("w{i}")), find(format!("b{i}"))) {
                (Some(w), Some(b)) => layers.push((w, b)),
                _ => break,
            }
        }
        if layers.is_empty() || layers.len() * 2 != params.len() {
            return Ok(None);
        }
        let last = layers.len() - 1;
        let dense = layers
            .iter()
            .enumerate()
            .map(|(i, (w, b))| {
                let act = if i < last {
                    ndscope::Activation::Relu
                } else {
                    ndscope::Activation::Identity
                };
                ndscope::Dense::new(w, Some(b), act)
            })
            .collect::<Result<_>>()?;
        Ok(Some(Inference { layers, dense }))
    }

    /// The logits of `x` (`[batch, inputs]`): one array per layer, in the active scope.
    pub fn logits(&self, x: &NDArray) -> Result<NDArray> {
        let mut h = x.clone();
        for layer in &self.dense {
            h = layer.forward(&h)?;
        }
        Ok(h)
    }

    /// [`logits`](Inference::logits) run as `matmul`, `add` and `relu` on the unpacked
    /// weights (the comparison for the packed layers).
    pub fn logits_unpacked(&self, x: &NDArray) -> Result<NDArray> {
        logits(self.layers.iter().map(|(w, b)| (w, b)), x)
    }

    /// Input width, output width.
    pub fn io(&self) -> (usize, usize) {
        let first = self.layers.first().map_or(0, |(w, _)| w.dims()[0]);
        let last = self.layers.last().map_or(0, |(w, _)| w.dims()[1]);
        (first, last)
    }
}

/// A generated 10-class problem: each class is a mixture of `clusters` Gaussian blobs in
/// `features` dimensions. Returns `x` (`[n, features]`, f32) and `y` (`[n]`, i64), in `data`.
pub fn make_data(
    data: &Manager,
    n: usize,
    features: usize,
    classes: usize,
    clusters: usize,
    spread: f64,
) -> Result<(NDArray, NDArray)> {
    data.scope(|tmp| {
        let centers = tmp
            .randn([classes * clusters, features], DType::F32)?
            .mul_scalar(spread)?;
        let which: Vec<i64> = (0..n as i64)
            .map(|i| (i * 7919) % (classes * clusters) as i64)
            .collect();
        let which = tmp.from_vec(which, [n])?;
        let labels: Vec<i64> = which
            .to_vec::<i64>()?
            .iter()
            .map(|&c| c % classes as i64)
            .collect();
        // Row `i` of one_hot(which) · centers is the center of sample i's blob.
        let x = which
            .one_hot(classes * clusters, DType::F32)?
            .matmul(&centers)?
            .add(&tmp.randn([n, features], DType::F32)?)?;
        let y = tmp.from_vec(labels, [n])?;
        Ok((tmp.ret(&x)?, tmp.ret(&y)?))
    })
}

/// The learned training step `examples/mlp_step.rs` times and the launch-count tests count:
/// the MLP 784→1024→1024→10 (seed 2) with gradients in a capped `model`, SGD with momentum 0.9
/// (lr 0.01), a batch of random inputs and labels `i % 10` in `trainer`, one cycle of the
/// trainer's workspace `batch` per step.
pub struct AutogradStep {
    pub trainer: Manager,
    pub model: Manager,
    pub ws: ndscope::Workspace,
    pub net: Mlp,
    pub optimizer: Optimizer,
    pub x: NDArray,
    pub y: NDArray,
}

impl AutogradStep {
    /// The step on `device` at `batch`, its workspace configured by `config`.
    pub fn new(
        device: ndscope::Device,
        batch: usize,
        config: ndscope::WorkspaceConfig,
    ) -> Result<AutogradStep> {
        let trainer = Manager::new_base_on(device)?.with_name("trainer");
        let ws = trainer.workspace("batch", config)?;
        ndscope::manual_seed(2);
        let model = Manager::new_base_on(device)?.with_name("model");
        let net = Mlp::with_gradients(&model, &[784, 1024, 1024, 10])?;
        let sgd = ndscope::Sgd {
            momentum: 0.9,
            ..ndscope::Sgd::new(0.01)
        };
        let optimizer = Optimizer::new(net.parameters(), sgd)?;
        model.cap();
        let x = trainer.randn([batch, 784], DType::F32)?;
        let labels: Vec<i64> = (0..batch as i64).map(|i| i % 10).collect();
        let y = trainer.from_vec(labels, [batch])?;
        Ok(AutogradStep {
            trainer,
            model,
            ws,
            net,
            optimizer,
            x,
            y,
        })
    }

    /// One step, in one cycle of the workspace.
    pub fn run(&mut self) -> Result<()> {
        let AutogradStep {
            ws,
            net,
            optimizer,
            x,
            y,
            ..
        } = self;
        ws.cycle(|_| net.autograd_step(optimizer, x, y).map(|_| ()))
    }

    /// Closes the model and the trainer.
    pub fn close(self) -> Result<()> {
        self.model.close()?;
        self.trainer.close()
    }
}
