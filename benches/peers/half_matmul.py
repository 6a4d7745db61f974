#!/usr/bin/env python3
"""Half-precision products against PyTorch on the same machine: `[n, n] @ [n, n]` in f32, f16
and bf16, PyTorch's (on the CPU with one thread per core, or on the GPU with `--device cuda`)
timed in turns with ndscope's `examples/half_matmul.rs`, round by round; it prints the median
time of each and the median of the per-round ratios.

Run from anywhere: `python3 benches/peers/half_matmul.py [--device cuda] [--n N]` (it builds the
example with cargo, or takes it from `NDSCOPE_BIN_DIR`). Needs `torch`; not part of CI.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError:
    sys.exit("half_matmul.py: torch is not installed (pip install torch); nothing to compare")

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def torch_ms(n, dtype, device, reps):
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(reps + 3):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ndscope_ms(binary, n, device, reps):
    time.sleep(0.5)  # PyTorch's OpenMP workers spin for a while after its last region
    out = subprocess.run(
        [binary, "--n", str(n), "--reps", str(reps), "--device", device],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    found = dict(re.findall(r"^(\w+) \d+x\d+: ([0-9.]+) ms/product", out, re.M))
    if set(found) != set(DTYPES):
        sys.exit(f"half_matmul.py: unexpected output from {binary}: {out!r}")
    return {k: float(v) for k, v in found.items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = args.n or (4096 if args.device == "cuda" else 1024)
    reps = 50 if args.device == "cuda" else 10
    prebuilt = os.environ.get("NDSCOPE_BIN_DIR")
    if prebuilt:
        binary = os.path.join(prebuilt, "half_matmul")
    else:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        features = ["--features", "cuda"] if args.device == "cuda" else []
        subprocess.run(["cargo", "build", "--release", "--quiet", "--example", "half_matmul"] + features, cwd=root, check=True)
        target = os.environ.get("CARGO_TARGET_DIR", os.path.join(root, "target"))
        binary = os.path.join(target, "release", "examples", "half_matmul")
    if args.device == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    ours = {k: [] for k in DTYPES}
    theirs = {k: [] for k in DTYPES}
    for _ in range(args.rounds):
        for name, dtype in DTYPES.items():
            theirs[name].append(torch_ms(n, dtype, args.device, reps))
        for name, ms in ndscope_ms(binary, n, args.device, reps).items():
            ours[name].append(ms)
    flops = 2.0 * n**3
    print(f"PyTorch {torch.__version__}, [{n}, {n}] products on {args.device} ({args.rounds} rounds in turns)")
    for name in DTYPES:
        o, t = statistics.median(ours[name]), statistics.median(theirs[name])
        ratios = sorted(a / b for a, b in zip(theirs[name], ours[name]))
        print(
            f"{name:>4}: ndscope {o:8.3f} ms ({flops / o / 1e6:8.1f} GFLOP/s), PyTorch {t:8.3f} ms"
            f" ({flops / t / 1e6:8.1f} GFLOP/s): ndscope at {statistics.median(ratios):.2f}x PyTorch's speed"
            f" (rounds {ratios[0]:.2f}x to {ratios[-1]:.2f}x)"
        )
    for name in ("f16", "bf16"):
        r = sorted(a / b for a, b in zip(ours["f32"], ours[name]))
        print(f"ndscope {name} against its own f32: {statistics.median(r):.2f}x the speed")


if __name__ == "__main__":
    main()
