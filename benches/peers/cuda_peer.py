#!/usr/bin/env python3
"""ndscope's CUDA figures beside PyTorch's, on the same GPU, with the ratios the CUDA issue sets
as targets.

ndscope's side comes from the CUDA benchmark (`benches/cuda.rs`; its medians are saved to
target/ndscope-bench/cuda.json) and from `examples/mlp_step.rs` run with `--device cuda`, which
this script runs in turns with the same MLP step in PyTorch (autograd + torch.optim.SGD with
momentum, eager), so both are timed under the same machine conditions; the median of the
per-round ratios is printed with their range.

PyTorch's side, timed here:
- torch.empty of 1 MiB and its release, on the caching allocator;
- torch.mm of two 4096² f32 matrices in strict FP32 (TF32 off);
- the MLP step 784→1024→1024→10 at batch 256 and 16, eager and captured by hand as one CUDA
  graph (`torch.cuda.graph`, replayed each step);
- host→device copies of 256 MiB from pinned and from pageable memory.

Usage (scripts/gpu-run.sh runs it): python3 benches/peers/cuda_peer.py \\
    --json target/ndscope-bench/cuda.json --mlp-step .device-bin/bin/mlp_step
Needs torch with CUDA and a GPU; not part of CI.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("cuda_peer.py: torch is not installed; nothing to compare")

SIZES = [784, 1024, 1024, 10]
LR, MOMENTUM = 0.01, 0.9


def sync():
    torch.cuda.synchronize()


def per_call(fn, calls, repeats=7):
    """Median seconds per call over `repeats` timings of `calls` calls, each ending in a sync."""
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def torch_empty_release():
    def once():
        t = torch.empty(1 << 18, dtype=torch.float32, device="cuda")
        del t

    return per_call(once, 2000)


def torch_mm():
    torch.backends.cuda.matmul.allow_tf32 = False
    a = torch.randn(4096, 4096, device="cuda")
    b = torch.randn(4096, 4096, device="cuda")
    return per_call(lambda: torch.mm(a, b), 20)


def mlp_model():
    """The MLP's parameters (He-initialised, seeded) and its SGD-with-momentum optimizer."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    layers = []
    for fan_in, fan_out in zip(SIZES, SIZES[1:]):
        w = torch.randn(fan_in, fan_out, device="cuda", generator=gen) * (2.0 / fan_in) ** 0.5
        layers.append((w.requires_grad_(), torch.zeros(fan_out, device="cuda").requires_grad_()))
    opt = torch.optim.SGD([t for wb in layers for t in wb], lr=LR, momentum=MOMENTUM)
    return gen, layers, opt


def mlp_step_fn(batch):
    """What a PyTorch user writes: autograd and torch.optim.SGD, eager."""
    gen, layers, opt = mlp_model()
    x = torch.randn(batch, SIZES[0], device="cuda", generator=gen)
    y = torch.arange(batch, device="cuda") % SIZES[-1]

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

    return step


def mlp_graph_fn(batch):
    """The same step captured by hand as one CUDA graph, as PyTorch's documentation shows
    (whole-network capture): warm-up iterations on a side stream, then the forward pass, the
    loss, backward and optimizer.step() captured once; each call replays the graph (one launch).
    Inputs stay in the static tensors the graph reads."""
    gen, layers, opt = mlp_model()
    static_x = torch.randn(batch, SIZES[0], device="cuda", generator=gen)
    static_y = torch.arange(batch, device="cuda") % SIZES[-1]

    def forward_backward():
        h = static_x
        for i, (w, b) in enumerate(layers):
            h = h @ w + b
            if i + 1 < len(layers):
                h = torch.relu(h)
        loss = torch.nn.functional.cross_entropy(h, static_y)
        loss.backward()
        opt.step()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            forward_backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        forward_backward()
    return graph.replay


def ndscope_step_ms(mlp_step, batch, steps, graph=False):
    """mlp_step's median ms per step: eager (--no-graph) or replayed as a CUDA graph."""
    flags = [] if graph else ["--no-graph"]
    out = subprocess.run(
        [mlp_step, "--batch", str(batch), "--steps", str(steps), "--device", "cuda", *flags],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return float(re.search(r"([0-9.]+) ms/step", out).group(1))


def h2d(pinned):
    host = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=pinned)
    dev = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    seconds = per_call(lambda: dev.copy_(host, non_blocking=pinned), 10, repeats=5)
    return (256 << 20) / seconds / 1e9


def row(what, ours, theirs, ratio, target):
    print(f"| {what} | {ours} | {theirs} | {ratio} | {target} |")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="target/ndscope-bench/cuda.json")
    p.add_argument("--mlp-step", default="target/release/examples/mlp_step")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("cuda_peer.py: torch has no usable CUDA device")
    with open(args.json) as f:
        nd = json.load(f)
    print(f"\nPyTorch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}\n")
    print("| What | ndscope | Baseline | Ratio | Target |")
    print("|---|---|---|---|---|")

    create = nd["alloc/ndscope"] / 1e3
    malloc = nd["alloc/cuMemAlloc+cuMemFree"] / 1e3
    empty = torch_empty_release() * 1e6
    row("create + close 1 MiB in a learned workspace cycle", f"{create:.3f} µs",
        f"cuMemAlloc + cuMemFree: {malloc:.1f} µs", f"{malloc / create:.0f}× faster", "≥ 100×")
    row("same", f"{create:.3f} µs", f"torch.empty + release (caching allocator): {empty:.2f} µs",
        f"{empty / create:.1f}× faster", "≥ 5×")
    per_cycle = nd.get("cycle/driver_allocations_per_cycle", float("nan"))
    row("driver allocations per learned cycle (MLP step)", f"{per_cycle:g}", "", "", "0")

    ours = nd["matmul_4096_f32/ndscope"] / 1e6
    cublas = nd["matmul_4096_f32/cublas"] / 1e6
    mm = torch_mm() * 1e3
    flops = 2 * 4096 ** 3
    row("matmul 4096² f32 (strict FP32)", f"{ours:.2f} ms ({flops / ours / 1e9:.1f} TFLOP/s)",
        f"torch.mm: {mm:.2f} ms", f"{mm / ours:.2f}", "≥ 0.95")
    row("same", f"{ours:.2f} ms", f"cuBLAS sgemm directly: {cublas:.2f} ms", f"{cublas / ours:.2f}", "")

    for batch in (256, 16):
        step = mlp_step_fn(batch)
        ratios, torch_ms, nd_ms, replayed_ms = [], [], [], []
        for _ in range(args.rounds):
            t = per_call(step, 20, repeats=10) * 1e3
            n = ndscope_step_ms(args.mlp_step, batch, 200)
            r = ndscope_step_ms(args.mlp_step, batch, 200, graph=True)
            torch_ms.append(t)
            nd_ms.append(n)
            replayed_ms.append(r)
            ratios.append(t / n)
        row(f"MLP step 784→1024→1024→10, batch {batch}", f"{statistics.median(nd_ms):.3f} ms",
            f"PyTorch eager (autograd + SGD): {statistics.median(torch_ms):.3f} ms",
            f"{statistics.median(ratios):.2f}× faster ({min(ratios):.2f}–{max(ratios):.2f})", "≥ 2×")
        graph = mlp_graph_fn(batch)
        captured = per_call(graph, 50, repeats=10) * 1e3
        target = "0.08 ms" if batch == 16 else "0.17 ms"
        row(f"same, batch {batch}", f"{statistics.median(nd_ms):.3f} ms (eager)",
            f"PyTorch, step captured by hand as one CUDA graph: {captured:.3f} ms",
            f"{captured / statistics.median(nd_ms):.2f}", "")
        replayed = statistics.median(replayed_ms)
        row(f"same, batch {batch}, replayed (graph_replay)", f"{replayed:.3f} ms",
            f"PyTorch, step captured by hand as one CUDA graph: {captured:.3f} ms",
            f"{captured / replayed:.2f}", f"≤ {target}")

    nd_h2d = (256 << 20) / (nd["h2d_256MiB/ndscope"] / 1e9) / 1e9
    nd_pageable = (256 << 20) / (nd["h2d_256MiB/pageable"] / 1e9) / 1e9
    row("host→device 256 MiB: ndscope to_device (pinned staging)", f"{nd_h2d:.1f} GB/s",
        f"pageable cuMemcpyHtoD: {nd_pageable:.1f} GB/s", f"{nd_h2d / nd_pageable:.1f}×", "")
    row("same in PyTorch: pinned vs pageable", f"{h2d(True):.1f} GB/s", f"{h2d(False):.1f} GB/s", "", "")


if __name__ == "__main__":
    main()
