#!/usr/bin/env python3
"""Inference of the MLP 784→1024→1024→10 in PyTorch on the CPU (`torch.inference_mode`), with as
many threads as ndscope uses (one per core), against ndscope's `examples/mlp_infer.rs` on the
same machine:

- latency at batch 1: the median time of one forward pass, called in a loop;
- throughput at batch 64: samples per second, both as a PyTorch user writes it (one loop, the
  intra-op threads splitting each product) and with one Python thread per core (each with one
  intra-op thread; PyTorch releases the GIL inside its ops). The ratio is taken against the
  faster of the two.

The two libraries are timed in turns (PyTorch, then ndscope, then PyTorch again, ...), and each
ratio is taken round by round, so a comparison holds when a shared machine's speed drifts; the
median round is printed with the range.

Run from anywhere: `python3 benches/peers/mlp_infer.py` (it builds the example with cargo
first). Needs `torch`; not part of CI.
"""

import os
import re
import statistics
import subprocess
import sys
import threading
import time

try:
    import torch
except ImportError:
    sys.exit("mlp_infer.py: torch is not installed (pip install torch); nothing to compare")

SIZES = [784, 1024, 1024, 10]
ROUNDS = 5


def model():
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(SIZES, SIZES[1:])):
        layers.append(torch.nn.Linear(fan_in, fan_out))
        if i + 2 < len(SIZES):
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).eval()


def torch_latency_us(net, calls):
    x = torch.randn(1, SIZES[0])
    times = []
    with torch.inference_mode():
        for _ in range(20):
            net(x)
        for _ in range(calls):
            start = time.perf_counter()
            net(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def torch_throughput_loop(net, batch, batches, threads):
    torch.set_num_threads(threads)
    x = torch.randn(batch, SIZES[0])
    with torch.inference_mode():
        for _ in range(3):
            net(x)
        start = time.perf_counter()
        for _ in range(batches):
            net(x)
        return batch * batches / (time.perf_counter() - start)


def torch_throughput_threads(net, batch, batches, threads):
    """One Python thread per core, each running forward passes with one intra-op thread."""
    torch.set_num_threads(1)
    x = torch.randn(batch, SIZES[0])
    per = batches // threads

    def work():
        with torch.inference_mode():
            for _ in range(per):
                net(x)

    with torch.inference_mode():
        net(x)
    pool = [threading.Thread(target=work) for _ in range(threads)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    elapsed = time.perf_counter() - start
    torch.set_num_threads(threads)
    return batch * per * threads / elapsed


def ndscope(binary, *args):
    # PyTorch's OpenMP workers keep spinning for a while after its last parallel region: let
    # them go to sleep first, or they take the cores from the process being timed.
    time.sleep(0.5)
    return subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "mlp_infer"], cwd=root, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    binary = os.path.join(target, "release", "examples", "mlp_infer")
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = model()
    print(f"PyTorch {torch.__version__} on the CPU, {threads} threads; ndscope with {threads} threads")

    lat = {"torch": [], "service": [], "predictor": []}
    thr = {"torch loop": [], "torch threads": [], "ndscope": []}
    for _ in range(ROUNDS):
        lat["torch"].append(torch_latency_us(net, 1000))
        out = ndscope(binary, "--what", "latency", "--requests", "1000")
        m = re.search(r"service p50 ([0-9.]+) us; predictor p50 ([0-9.]+) us", out)
        if not m:
            sys.exit(f"mlp_infer.py: unexpected output: {out!r}")
        lat["service"].append(float(m.group(1)))
        lat["predictor"].append(float(m.group(2)))

        thr["torch loop"].append(torch_throughput_loop(net, 64, 200, threads))
        thr["torch threads"].append(torch_throughput_threads(net, 64, 200, threads))
        out = ndscope(binary, "--what", "throughput", "--batch", "64", "--requests", "200", "--clients", str(2 * threads))
        m = re.search(r"([0-9.]+) samples/s", out)
        if not m:
            sys.exit(f"mlp_infer.py: unexpected output: {out!r}")
        thr["ndscope"].append(float(m.group(1)))

    def spread(ratios):
        ratios = sorted(ratios)
        return f"median {statistics.median(ratios):.2f} (rounds {ratios[0]:.2f} to {ratios[-1]:.2f})"

    print(f"batch 1 latency, p50 (median of {ROUNDS} rounds of 1000 calls):")
    print(f"  PyTorch                : {statistics.median(lat['torch']):8.1f} us")
    for name in ("service", "predictor"):
        ratios = [o / t for o, t in zip(lat[name], lat["torch"])]
        print(f"  ndscope {name:<15}: {statistics.median(lat[name]):8.1f} us; ndscope / PyTorch {spread(ratios)}")
    print(f"batch 64 throughput (median of {ROUNDS} rounds of 200 batches):")
    for name in ("torch loop", "torch threads"):
        print(f"  PyTorch {name:<15}: {statistics.median(thr[name]):8.0f} samples/s")
    best = [max(a, b) for a, b in zip(thr["torch loop"], thr["torch threads"])]
    ratios = [o / t for o, t in zip(thr["ndscope"], best)]
    print(f"  ndscope service        : {statistics.median(thr['ndscope']):8.0f} samples/s; "
          f"ndscope / best PyTorch {spread(ratios)}")


if __name__ == "__main__":
    main()
