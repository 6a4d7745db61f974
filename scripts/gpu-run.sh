#!/usr/bin/env bash
# Runs the GPU suite that scripts/gpu-build.sh packed into .device-bin/, on a machine with an
# NVIDIA GPU and the CUDA 13 libraries on the loader path (no Rust toolchain needed), from the
# repository root, and prints a table:
#   1. every test binary with NDSCOPE_REQUIRE_GPU=1, so a CUDA test that finds no GPU fails
#      instead of skipping;
#   2. train_mlp on the GPU and on the CPU (same seed: the held-out accuracies must agree) and
#      the GPU run's allocations per epoch;
#   3. the CUDA benchmark (criterion; medians to target/ndscope-bench/cuda.json);
#   4. benches/peers/cuda_peer.py, which times PyTorch on the same GPU and prints the ratios
#      against the targets, then benches/peers/mlp_infer.py --device cuda (inference, host in
#      and out, against PyTorch eager and a hand-captured CUDA graph) with the prebuilt example
#      (NDSCOPE_BIN_DIR) (needs torch; skipped with a note without it).
# The table is also written to .device-bin/report.md, the logs to .device-bin/logs/.
# Exit status: non-zero if any test failed or the example failed.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.device-bin
[ -f "$dir/bin.tar.xz" ] || { echo "no $dir/bin.tar.xz: run scripts/gpu-build.sh first (on a machine with Rust)"; exit 2; }
rm -rf "$dir/bin"
tar -C "$dir" -xJf "$dir/bin.tar.xz"
bin=$dir/bin
logs=$dir/logs
rm -rf "$logs"
mkdir -p "$logs"
export NDSCOPE_KERNEL_CACHE=${NDSCOPE_KERNEL_CACHE:-$PWD/$dir/kernel-cache}
export NDSCOPE_REQUIRE_GPU=1
report=$dir/report.md
status=0

{
    echo "# ndscope GPU suite"
    echo
    echo "- machine: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo 'nvidia-smi not found')"
    echo "- CPU cores: $(nproc)"
    echo "- torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null || echo 'not installed')"
    echo
    echo "## Tests"
    echo
    echo "| binary | passed | failed | time |"
    echo "|---|---|---|---|"
} > "$report"

# Compile the kernels once (about ten seconds), into the disk cache every later process loads.
"$bin/mlp_step" --device cuda --batch 16 --steps 10 > "$logs/warm-up.log" 2>&1 || true

total_pass=0
total_fail=0
for t in "$bin"/test-*; do
    name=$(basename "$t")
    start=$(date +%s.%N)
    "$t" --test-threads=8 > "$logs/$name.log" 2>&1
    code=$?
    secs=$(python3 -c "import time; print(f'{time.time() - $start:.1f} s')" 2>/dev/null || echo "?")
    pass=$(grep -Eo '[0-9]+ passed' "$logs/$name.log" | awk '{s+=$1} END {print s+0}')
    fail=$(grep -Eo '[0-9]+ failed' "$logs/$name.log" | awk '{s+=$1} END {print s+0}')
    [ "$code" -ne 0 ] && [ "$fail" -eq 0 ] && fail="(exit $code)"
    echo "| $name | $pass | $fail | $secs |" >> "$report"
    total_pass=$((total_pass + pass))
    if [ "$code" -ne 0 ]; then
        status=1
        total_fail=$((total_fail + 1))
        grep -E "^(---- |thread .* panicked|test .* FAILED)" "$logs/$name.log" | head -20 >> "$logs/failures.txt"
    fi
done
echo "| **all** | **$total_pass** | **$total_fail binaries failing** | |" >> "$report"

{
    echo
    echo "## train_mlp"
    echo
} >> "$report"
if "$bin/train_mlp" --device cuda > "$logs/train_mlp_cuda.log" 2>&1; then
    echo "- GPU run: passed its own checks (loss fell, accuracy > 90%, live bytes flat, no allocations after the first epoch)" >> "$report"
else
    echo "- GPU run: **failed** (see $logs/train_mlp_cuda.log)" >> "$report"
    status=1
fi
grep -E "^epoch|held-out|workspace 'batch'" "$logs/train_mlp_cuda.log" | sed 's/^/    /' >> "$report"
if "$bin/train_mlp" > "$logs/train_mlp_cpu.log" 2>&1; then
    gpu_acc=$(grep -Eo 'held-out accuracy [0-9.]+%' "$logs/train_mlp_cuda.log")
    cpu_acc=$(grep -Eo 'held-out accuracy [0-9.]+%' "$logs/train_mlp_cpu.log")
    echo "- same run on the CPU: $cpu_acc; on the GPU: $gpu_acc" >> "$report"
fi

{
    echo
    echo "## Benchmarks"
    echo
} >> "$report"
if "$bin/bench-cuda" --bench > "$logs/bench-cuda.log" 2>&1; then
    sed -n '/^ratios/,$p' "$logs/bench-cuda.log" | sed 's/^/    /' >> "$report"
    grep -E "^cycle:" "$logs/bench-cuda.log" | sed 's/^/    /' >> "$report"
else
    echo "- the CUDA benchmark failed (see $logs/bench-cuda.log)" >> "$report"
fi
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    python3 benches/peers/cuda_peer.py --json target/ndscope-bench/cuda.json \
        --mlp-step "$bin/mlp_step" > "$logs/cuda_peer.log" 2>&1
    cat "$logs/cuda_peer.log" >> "$report"
    # Inference on the GPU, host in and out, against PyTorch eager and a hand-captured graph.
    NDSCOPE_BIN_DIR="$bin" python3 benches/peers/mlp_infer.py --device cuda \
        > "$logs/mlp_infer_cuda.log" 2>&1 || echo "- mlp_infer.py --device cuda failed" >> "$report"
    cat "$logs/mlp_infer_cuda.log" >> "$report"
    # The same calls with the contexts' learned cycles replayed as CUDA graphs.
    for batch in 1 64; do
        "$bin/mlp_infer" --device cuda --graph --batch "$batch" --requests 2000 \
            >> "$logs/mlp_infer_cuda_graph.log" 2>&1 || echo "- mlp_infer --graph failed" >> "$report"
    done
    cat "$logs/mlp_infer_cuda_graph.log" >> "$report"
    # Half precision: products against PyTorch's on the GPU (tensor cores) and on this
    # machine's CPU cores.
    for dev in cuda cpu; do
        NDSCOPE_BIN_DIR="$bin" python3 benches/peers/half_matmul.py --device "$dev" \
            >> "$logs/half_matmul.log" 2>&1 || echo "- half_matmul.py --device $dev failed" >> "$report"
    done
    cat "$logs/half_matmul.log" >> "$report"
else
    echo "- PyTorch with CUDA is not available: no comparison with PyTorch" >> "$report"
fi
# Mixed-precision training steps on the GPU, each against the f32 step in the same run: the
# wide MLP at batch 1024 and the small one at batch 256 (products on tensor cores, the weights
# converted once per step), then the small one at batch 16 and train_mlp's at batch 128, whose
# products read the f32 weights rounded through our own kernel (at most 2^25 multiply-adds).
for sizes_batch in "4096,4096,4096,10 1024" "784,1024,1024,10 256" "784,1024,1024,10 16" \
    "784,256,128,10 128"; do
    set -- $sizes_batch
    for dtype in f32 bf16 f16; do
        "$bin/mlp_step" --device cuda --dtype "$dtype" --sizes "$1" --batch "$2" --steps 200 \
            >> "$logs/mlp_step_half.log" 2>&1 || echo "- mlp_step --dtype $dtype failed" >> "$report"
    done
done
grep -E "ms/step" "$logs/mlp_step_half.log" | sed 's/^/    /' >> "$report"

cat "$report"
[ -f "$logs/failures.txt" ] && { echo; echo "failures:"; cat "$logs/failures.txt"; }
exit $status
