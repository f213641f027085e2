#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and driver: runs the GPU tests and the CUDA transfer
# bench (page moves vs raw cudaMemcpyAsync of the same bytes). Fails when no driver is
# found, so a skipped run is never mistaken for a pass.
#
# Usage: scripts/gpu-check.sh [extra bench args, e.g. --mib 512]
set -euo pipefail
cd "$(dirname "$0")/.."

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU or driver found" >&2
    exit 1
fi
nvidia-smi -L

log=$(mktemp)
cargo test --release --features cuda --test gpu -- --test-threads=1 2>&1 | tee "$log"
if grep -q "SKIPPED: no CUDA driver" "$log"; then
    echo "gpu-check: the GPU tests skipped although nvidia-smi sees a GPU" >&2
    exit 1
fi

cargo run --release --features cuda -- bench transfer --device cuda --sizes-kib 64,256,1024,4096 --runs 5 "$@"
