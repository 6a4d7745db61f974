#!/usr/bin/env python3
"""The MLP training step of benches/training.rs (784→1024→1024→10, softmax cross-entropy, SGD
with momentum 0.9) in PyTorch on the CPU, with as many threads as ndscope's pool uses (one per
core), against ndscope's step on the same machine.

The two are timed in turns (PyTorch, then ndscope's `examples/mlp_step.rs`, then PyTorch
again, ...) and the ratio is taken round by round, so a comparison holds when a shared machine's
speed drifts; the median round is printed with the range.

Each ndscope run also prints the CPU's f32 FMA peak, measured on as many threads
(`ndscope::measure_cpu_peak`); with the step's floating-point operations (its products, counted
as in `examples/mlp/mod.rs`) this gives each step's GFLOP/s and share of that peak, and how much
faster than PyTorch any implementation could be at most (peak / PyTorch).

Run from anywhere: `python3 benches/peers/mlp_step.py` (it builds the example with cargo first,
or takes it from `NDSCOPE_BIN_DIR` where that names a folder of prebuilt binaries).
Needs `torch`; not part of CI.
"""

import os
import re
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("mlp_step.py: torch is not installed (pip install torch); nothing to compare")

SIZES = [784, 1024, 1024, 10]
LR, MOMENTUM = 0.01, 0.9


def step_flops(batch):
    """Floating-point operations of one step's products, as `Mlp::step_flops` counts them: per
    layer 2·batch·in·out for the forward product, as many for the weight gradient, and (except
    for the first layer) as many for the input gradient."""
    return sum(
        2.0 * batch * fan_in * fan_out * (2 if i == 0 else 3)
        for i, (fan_in, fan_out) in enumerate(zip(SIZES, SIZES[1:]))
    )


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


def ndscope_ms(binary, batch, steps, manual=False):
    """The median ms/step that examples/mlp_step.rs prints (autograd, or the hand-written
    backward pass with manual=True), and the CPU's f32 FMA peak in GFLOP/s it measured after
    its steps."""
    # PyTorch's OpenMP workers keep spinning for a while after its last parallel region (up to
    # 200 ms with Intel's runtime): let them go to sleep first, or they take the cores from the
    # process being timed.
    time.sleep(0.5)
    out = subprocess.run(
        [binary, "--batch", str(batch), "--steps", str(steps)] + (["--manual-backward"] if manual else []),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    match = re.search(r"([0-9.]+) ms/step", out)
    peak = re.search(r"peak of ([0-9.]+) GFLOP/s", out)
    if not match or not peak:
        sys.exit(f"mlp_step.py: unexpected output from {binary}: {out!r}")
    return float(match.group(1)), float(peak.group(1))


def main():
    # Prebuilt binaries (a machine without Rust: `scripts/gpu-build.sh`), else cargo builds it.
    prebuilt = os.environ.get("NDSCOPE_BIN_DIR")
    if prebuilt:
        binary = os.path.join(prebuilt, "mlp_step")
    else:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "mlp_step"], cwd=root, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
        binary = os.path.join(target, "release", "examples", "mlp_step")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    print(f"PyTorch {torch.__version__} on the CPU, {threads} threads; ndscope with {threads} threads")
    for batch, steps, rounds in [(256, 30, 5), (16, 200, 11)]:
        steps_fns = [("autograd + optim.SGD", autograd_step_fn(batch, gen)), ("manual backward", manual_step_fn(batch, gen))]
        times = {name: [] for name, _ in steps_fns}
        ours = {"autograd": [], "hand-written backward": []}
        peaks = []
        for _ in range(rounds):
            for name, step in steps_fns:
                times[name].append(median_ms(step, steps))
            for kind, manual in [("autograd", False), ("hand-written backward", True)]:
                ms, peak = ndscope_ms(binary, batch, steps, manual=manual)
                ours[kind].append(ms)
                peaks.append(peak)
        for kind, mine in ours.items():
            print(
                f"batch {batch:>3}: ndscope {kind:<21} {statistics.median(mine):7.3f} ms/step"
                f" (median of {rounds} rounds of {steps} steps)"
            )
            for name, ms in times.items():
                ratios = sorted(t / o for t, o in zip(ms, mine))
                print(
                    f"  PyTorch {name:<21}: {statistics.median(ms):7.3f} ms/step;"
                    f" ndscope {kind} is {statistics.median(ratios):.2f}x faster"
                    f" (rounds: {ratios[0]:.2f}x to {ratios[-1]:.2f}x)"
                )
        ratios = sorted(a / m for a, m in zip(ours["autograd"], ours["hand-written backward"]))
        print(
            f"  ndscope autograd / hand-written: {statistics.median(ratios):.3f}"
            f" (rounds: {ratios[0]:.3f} to {ratios[-1]:.3f})"
        )
        flops = step_flops(batch)
        peak = statistics.median(peaks)
        print(
            f"  the step's products: {flops / 1e9:.3f} GFLOP; the CPU's f32 FMA peak: {peak:.1f} GFLOP/s"
            f" (median of {len(peaks)} measurements on {threads} threads, {min(peaks):.1f} to {max(peaks):.1f})"
        )
        rates = [(f"ndscope {kind}", statistics.median(mine)) for kind, mine in ours.items()]
        rates += [(f"PyTorch {name}", statistics.median(ms)) for name, ms in times.items()]
        for name, ms in rates:
            gflops = flops / (ms * 1e-3) / 1e9
            print(f"  {name:<29} {gflops:7.1f} GFLOP/s, {100 * gflops / peak:5.1f}% of the peak")
        for name, ms in times.items():
            gflops = flops / (statistics.median(ms) * 1e-3) / 1e9
            print(
                f"  the most any implementation could be faster than PyTorch ({name}) here:"
                f" peak / PyTorch = {peak / gflops:.2f}x"
            )


if __name__ == "__main__":
    main()
