#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, for a GPU machine that has the NVIDIA driver but
# no Rust toolchain: the kvtier binary, the GPU test binary and the engine library
# libkvtier.so (feature `cuda`, cudarc loaded at run time, so nothing here needs CUDA),
# stripped, in one folder together with gpu-check.sh, the Python package and its CUDA
# tensor check. Copy the folder to the GPU machine and run `<folder>/gpu-check.sh` there.
#
# Usage: scripts/gpu-bundle.sh [folder]   (default: target/gpu-bundle)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-bundle}
mkdir -p "$out"

# The executables cargo reports for a build, by target name.
executable() {
    python3 -c '
import json, sys
name = sys.argv[1]
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == name and m.get("executable"):
        print(m["executable"])
' "$1"
}

kvtier=$(cargo build --release --features cuda --bin kvtier --message-format=json | executable kvtier)
tests=$(cargo test --release --features cuda --test gpu --no-run --message-format=json | executable gpu)
# The library as engines load it (python/setup.py builds it the same way), with `cuda`.
cargo rustc --profile engine --lib --no-default-features --features cuda --crate-type cdylib
if [[ -z "$kvtier" || -z "$tests" ]]; then
    echo "gpu-bundle: cargo did not report the kvtier and gpu test executables" >&2
    exit 1
fi
install -m 0755 "$kvtier" "$out/kvtier"
install -m 0755 "$tests" "$out/gpu-tests"
install -m 0755 target/engine/libkvtier.so "$out/libkvtier.so"
install -m 0755 scripts/gpu-check.sh "$out/gpu-check.sh"
install -m 0644 scripts/gpu-tensors.py "$out/gpu-tensors.py"
rm -rf "$out/python"
mkdir -p "$out/python/kvtier"
install -m 0644 python/kvtier/*.py python/kvtier/py.typed "$out/python/kvtier/"
strip "$out/kvtier" "$out/gpu-tests" "$out/libkvtier.so" 2>/dev/null || true
du -sh "$out"/*
echo "gpu-bundle: copy $out to the GPU machine and run $out/gpu-check.sh there"
