#!/usr/bin/env python3
"""The MLP training step of benches/training.rs (784→1024→1024→10, softmax cross-entropy, SGD
with momentum 0.9) in PyTorch on the CPU, with as many threads as ndscope's pool uses (one per
core), and its ratio to ndscope's step from the same machine.

Run `cargo bench --bench training` first (it saves its medians to
target/ndscope-bench/training.json), then `python3 benches/peers/mlp_step.py`. Needs `torch`;
not part of CI.
"""

import json
import os
import statistics
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("mlp_step.py: torch is not installed (pip install torch); nothing to compare")

SIZES = [784, 1024, 1024, 10]
LR, MOMENTUM = 0.01, 0.9


def params(gen):
    layers = []
    for fan_in, fan_out in zip(SIZES, SIZES[1:]):
        w = torch.randn(fan_in, fan_out, generator=gen) * (2.0 / fan_in) ** 0.5
        layers.append((w, torch.zeros(fan_out)))
    return layers


def autograd_step_fn(batch, gen):
    """What a PyTorch user writes: autograd and torch.optim.SGD."""
    layers = [(w.requires_grad_(), b.requires_grad_()) for w, b in params(gen)]
    opt = torch.optim.SGD([t for wb in layers for t in wb], lr=LR, momentum=MOMENTUM)
    x = torch.randn(batch, SIZES[0], generator=gen)
    y = torch.arange(batch) % SIZES[-1]

    def step():
        h = x
        for i, (w, b) in enumerate(layers):
            h = h @ w + b
            if i + 1 < len(layers):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return step


def manual_step_fn(batch, gen):
    """The same op sequence as ndscope's examples/mlp/mod.rs, without autograd."""
    layers = [(w, b, torch.zeros_like(w), torch.zeros_like(b)) for w, b in params(gen)]
    x = torch.randn(batch, SIZES[0], generator=gen)
    y = torch.arange(batch) % SIZES[-1]
    one_hot = torch.nn.functional.one_hot(y, SIZES[-1]).float()

    @torch.no_grad()
    def step():
        inputs, h = [], x
        for i, (w, b, _, _) in enumerate(layers):
            inputs.append(h)
            h = h @ w + b
            if i + 1 < len(layers):
                h = torch.relu(h)
        log_probs = torch.log_softmax(h, 1)
        loss = -log_probs.gather(1, y[:, None]).mean()
        grad = (log_probs.exp() - one_hot) / batch
        for i in reversed(range(len(layers))):
            w, b, vw, vb = layers[i]
            dw, db = inputs[i].T @ grad, grad.sum(0)
            if i > 0:
                grad = (grad @ w.T) * (inputs[i] > 0).float()
            vw.mul_(MOMENTUM).add_(dw)
            w.add_(vw, alpha=-LR)
            vb.mul_(MOMENTUM).add_(db)
            b.add_(vb, alpha=-LR)
        return loss

    return step


def median_ms(step, steps):
    for _ in range(10):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    ours = {}
    path = os.path.join(os.environ.get("CARGO_TARGET_DIR", "target"), "ndscope-bench", "training.json")
    if os.path.exists(path):
        with open(path) as f:
            ours = json.load(f)
    else:
        print(f"({path} not found: run `cargo bench --bench training` first for the ratios)")
    print(f"PyTorch {torch.__version__} on the CPU, {threads} threads")
    for batch, steps in [(256, 40), (16, 300)]:
        key = f"mlp_step_b{batch}/ndscope step in a workspace cycle"
        mine = ours.get(key)
        for name, make in [("autograd + optim.SGD", autograd_step_fn), ("manual backward", manual_step_fn)]:
            ms = median_ms(make(batch, gen), steps)
            line = f"batch {batch:>3}, {name:<21}: {ms:8.3f} ms/step"
            if mine:
                line += f"   ndscope {mine / 1e6:.3f} ms/step: ndscope is {ms / (mine / 1e6):.2f}x faster"
            print(line)


if __name__ == "__main__":
    main()
