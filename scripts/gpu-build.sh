#!/usr/bin/env bash
# Builds everything the GPU suite runs, on a machine with Rust (no GPU needed), into .device-bin/
# (git-ignored): the test binaries (unit and integration), the examples and the CUDA benchmark,
# all with `--features cuda`, stripped and packed into one archive small enough to carry.
#
# Then, on a machine with an NVIDIA GPU and the CUDA 13 libraries (libcuda.so.1,
# libcublas.so.13, libnvrtc.so.13) on the loader path, in a copy of this repository that holds
# .device-bin/, run scripts/gpu-run.sh: it needs no Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.device-bin
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/bin"

# `cargo ... --message-format=json` names every artifact it builds; keep the executables.
executables() {
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    kind = m["target"]["kind"][0]
    print(kind, m["target"]["name"], m["executable"])
'
}

echo "== test binaries (cargo test --release --features cuda --no-run)"
cargo test --release --features cuda --no-run --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        case "$kind" in
            lib) cp "$path" "$stage/bin/test-unit" ;;
            test) cp "$path" "$stage/bin/test-$name" ;;
        esac
    done

echo "== examples (cargo build --release --features cuda --examples)"
cargo build --release --features cuda --examples --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        [ "$kind" = example ] && cp "$path" "$stage/bin/$name"
    done

echo "== CUDA benchmark (cargo bench --features cuda --bench cuda --no-run)"
cargo bench --features cuda --bench cuda --no-run --message-format=json 2>/dev/null | executables |
    while read -r kind name path; do
        [ "$kind" = bench ] && cp "$path" "$stage/bin/bench-$name"
    done

strip --strip-debug "$stage"/bin/* 2>/dev/null || true
rm -rf "$out"
mkdir -p "$out"
tar -C "$stage" -cf - bin | xz -T0 -6 > "$out/bin.tar.xz"
ls "$stage/bin" > "$out/manifest.txt"
echo "== packed $(wc -l < "$out/manifest.txt") binaries into $out/bin.tar.xz ($(du -h "$out/bin.tar.xz" | cut -f1))"
echo "   next, on the GPU machine: scripts/gpu-run.sh"
