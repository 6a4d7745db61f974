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

With `--device cuda` both run on the GPU, served from host memory as a server is: each call
copies a host tensor in and the answer back to the host, and waits for it. PyTorch's input is a
pinned tensor copied with `non_blocking=True` and its answer lands in a pinned tensor, timed
two ways: eager (`net(x.to("cuda", non_blocking=True))`), and as a CUDA graph captured by hand
(`torch.cuda.CUDAGraph` over static input and output tensors: copy into the static input,
`graph.replay()`, copy the static output out). ndscope runs `examples/mlp_infer.rs --device
cuda` (built with `--features cuda`): the model on the GPU, host arrays in and out. Without a
GPU (`torch.cuda.is_available()` false) it says so and stops.

Run from anywhere: `python3 benches/peers/mlp_infer.py [--device cpu|cuda]` (it builds the
example with cargo first, or takes it from `NDSCOPE_BIN_DIR` where that names a folder of
prebuilt binaries). Needs `torch`; not part of CI.
"""

import argparse
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


class GpuCall:
    """One host-in, host-out call on the GPU: a pinned input copied in without blocking, the
    forward pass, the answer copied into a pinned output, and a wait for it. `graph` replays a
    hand-captured CUDA graph of the forward pass over static device tensors instead of running
    it eagerly."""

    def __init__(self, net, batch, graph):
        self.net = net
        self.x = torch.randn(batch, SIZES[0]).pin_memory()
        self.out = torch.empty(batch, SIZES[-1]).pin_memory()
        self.stream = torch.cuda.current_stream()
        self.graph = None
        if graph:
            self.static_in = torch.empty(batch, SIZES[0], device="cuda")
            self.static_in.copy_(self.x)
            # Warm up on a side stream before capturing, as PyTorch's CUDA graph docs ask.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.inference_mode():
                for _ in range(3):
                    net(self.static_in)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph), torch.inference_mode():
                self.static_out = net(self.static_in)
            torch.cuda.synchronize()

    def __call__(self):
        if self.graph is None:
            with torch.inference_mode():
                y = self.net(self.x.to("cuda", non_blocking=True))
                self.out.copy_(y, non_blocking=True)
        else:
            self.static_in.copy_(self.x, non_blocking=True)
            self.graph.replay()
            self.out.copy_(self.static_out, non_blocking=True)
        self.stream.synchronize()
        return self.out


def gpu_latency_us(call, calls):
    times = []
    for _ in range(20):
        call()
    for _ in range(calls):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def gpu_throughput(call, batch, batches):
    for _ in range(3):
        call()
    start = time.perf_counter()
    for _ in range(batches):
        call()
    return batch * batches / (time.perf_counter() - start)


def ndscope(binary, *args):
    # PyTorch's OpenMP workers keep spinning for a while after its last parallel region: let
    # them go to sleep first, or they take the cores from the process being timed.
    time.sleep(0.5)
    return subprocess.run([binary, *args], check=True, capture_output=True, text=True).stdout


def spread(ratios):
    ratios = sorted(ratios)
    return f"median {statistics.median(ratios):.2f} (rounds {ratios[0]:.2f} to {ratios[-1]:.2f})"


def build(features):
    """The example's binary: built with cargo, or, where `NDSCOPE_BIN_DIR` names a folder of
    prebuilt binaries (a GPU machine without Rust: `scripts/gpu-build.sh`), taken from there."""
    prebuilt = os.environ.get("NDSCOPE_BIN_DIR")
    if prebuilt:
        return os.path.join(prebuilt, "mlp_infer")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cargo = ["cargo", "build", "--release", "--quiet", "--example", "mlp_infer"]
    subprocess.run(cargo + features, cwd=root, check=True)
    target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
    return os.path.join(target, "release", "examples", "mlp_infer")


def latency_figures(out):
    m = re.search(r"service p50 ([0-9.]+) us; predictor p50 ([0-9.]+) us", out)
    if not m:
        sys.exit(f"mlp_infer.py: unexpected output: {out!r}")
    return float(m.group(1)), float(m.group(2))


def throughput_figure(out):
    m = re.search(r"([0-9.]+) samples/s", out)
    if not m:
        sys.exit(f"mlp_infer.py: unexpected output: {out!r}")
    return float(m.group(1))


def main_cuda():
    if not torch.cuda.is_available():
        print("mlp_infer.py: no GPU (torch.cuda.is_available() is false); nothing to compare on cuda")
        return
    binary = build(["--features", "cuda"])
    torch.manual_seed(0)
    net = model().to("cuda")
    print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, host tensors in and out; "
          "ndscope on cuda:0, host arrays in and out")
    calls = {
        "eager": (GpuCall(net, 1, graph=False), GpuCall(net, 64, graph=False)),
        "CUDA graph": (GpuCall(net, 1, graph=True), GpuCall(net, 64, graph=True)),
    }
    lat = {"eager": [], "CUDA graph": [], "service": [], "predictor": []}
    thr = {"eager": [], "CUDA graph": [], "ndscope": []}
    clients = 4
    for _ in range(ROUNDS):
        for name, (one, _) in calls.items():
            lat[name].append(gpu_latency_us(one, 1000))
        service, predictor = latency_figures(ndscope(binary, "--device", "cuda", "--what", "latency", "--requests", "1000"))
        lat["service"].append(service)
        lat["predictor"].append(predictor)

        for name, (_, many) in calls.items():
            thr[name].append(gpu_throughput(many, 64, 500))
        out = ndscope(binary, "--device", "cuda", "--what", "throughput", "--batch", "64", "--requests", "500",
                      "--clients", str(clients))
        thr["ndscope"].append(throughput_figure(out))

    print(f"batch 1 latency on the GPU, host in and out, p50 (median of {ROUNDS} rounds of 1000 calls):")
    for name in ("eager", "CUDA graph"):
        print(f"  PyTorch {name:<15}: {statistics.median(lat[name]):8.1f} us")
    for name in ("service", "predictor"):
        eager = [o / t for o, t in zip(lat[name], lat["eager"])]
        graph = [o / t for o, t in zip(lat[name], lat["CUDA graph"])]
        print(f"  ndscope {name:<15}: {statistics.median(lat[name]):8.1f} us; "
              f"/ eager {spread(eager)}; / CUDA graph {spread(graph)}")
    print(f"batch 64 throughput on the GPU, host in and out (median of {ROUNDS} rounds of 500 batches):")
    for name in ("eager", "CUDA graph"):
        print(f"  PyTorch {name:<15}: {statistics.median(thr[name]):8.0f} samples/s (one loop)")
    best = [max(a, b) for a, b in zip(thr["eager"], thr["CUDA graph"])]
    ratios = [o / t for o, t in zip(thr["ndscope"], best)]
    print(f"  ndscope service        : {statistics.median(thr['ndscope']):8.0f} samples/s "
          f"({clients} clients); ndscope / best PyTorch {spread(ratios)}")


def main():
    parser = argparse.ArgumentParser(description="MLP inference: PyTorch against ndscope's examples/mlp_infer.rs")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    if parser.parse_args().device == "cuda":
        main_cuda()
        return
    binary = build([])
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = model()
    print(f"PyTorch {torch.__version__} on the CPU, {threads} threads; ndscope with {threads} threads")

    lat = {"torch": [], "service": [], "predictor": []}
    thr = {"torch loop": [], "torch threads": [], "ndscope": []}
    for _ in range(ROUNDS):
        lat["torch"].append(torch_latency_us(net, 1000))
        service, predictor = latency_figures(ndscope(binary, "--what", "latency", "--requests", "1000"))
        lat["service"].append(service)
        lat["predictor"].append(predictor)

        thr["torch loop"].append(torch_throughput_loop(net, 64, 200, threads))
        thr["torch threads"].append(torch_throughput_threads(net, 64, 200, threads))
        out = ndscope(binary, "--what", "throughput", "--batch", "64", "--requests", "200", "--clients", str(2 * threads))
        thr["ndscope"].append(throughput_figure(out))

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
