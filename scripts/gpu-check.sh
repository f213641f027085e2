#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and driver: runs the GPU tests, the Python package with
# PyTorch CUDA tensors (scripts/gpu-tensors.py, where python3 has torch) and the CUDA
# transfer bench (page moves vs raw cudaMemcpyAsync of the same bytes). Then, since such a
# machine is usually a second, larger one than a developer's, the host-memory benches
# whose goals must hold on any machine: `bench transfer --json` three times and `bench
# control --json` five times in a row (their goals are reported, not enforced). Fails when no
# driver is found, or when the tests ran only on the emulated driver CI uses, so a skipped
# or emulated run is never mistaken for a pass. A failing step does not stop the later
# ones (GPU time is scarce: one run shows everything); the exit status says whether all
# passed.
#
# Usage: scripts/gpu-check.sh [extra bench args, e.g. --mib 512]
#
# In a checkout it builds with cargo. Copied into a folder made by scripts/gpu-bundle.sh
# (for a GPU machine without a Rust toolchain) it runs the prebuilt `kvtier` and
# `gpu-tests` beside it instead.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ -x "$here/kvtier" ] && [ -x "$here/gpu-tests" ]; then
    echo "gpu-check: prebuilt binaries in $here"
    # The launcher that re-runs the tests on the emulated driver needs the source tree;
    # CI runs it, and here only the real driver matters.
    run_tests() {
        KVTIER_BIN="$here/kvtier" "$here/gpu-tests" --test-threads=1 \
            --skip every_gpu_test_runs_on_the_emulated_driver
    }
    run_bench() { "$here/kvtier" bench transfer --device cuda "$@"; }
    run_host_bench() { "$here/kvtier" bench "$@"; }
    run_tensors() {
        PYTHONPATH="$here/python" KVTIER_LIB="$here/libkvtier.so" python3 "$here/gpu-tensors.py" "$here/kvtier"
    }
else
    cd "$here/.."
    run_tests() { cargo test --release --features cuda --test gpu -- --test-threads=1; }
    run_bench() { cargo run --release --features cuda -- bench transfer --device cuda "$@"; }
    run_host_bench() { cargo run --release --features cuda -- bench "$@"; }
    run_tensors() {
        cargo build --release --features cuda --bin kvtier
        cargo rustc --profile engine --lib --no-default-features --features cuda --crate-type cdylib
        PYTHONPATH=python KVTIER_LIB="$PWD/target/engine/libkvtier.so" python3 scripts/gpu-tensors.py target/release/kvtier
    }
fi

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu-check: no NVIDIA GPU or driver found" >&2
    exit 1
fi
nvidia-smi -L
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv || true

# The emulated driver the tests build for CI must never stand in for the real one here:
# refuse a library path that already holds a libcuda.so from somewhere else than the
# system's driver install, and require the tests to report the real driver.
if [ -n "${LD_LIBRARY_PATH:-}" ]; then
    IFS=: read -ra dirs <<<"$LD_LIBRARY_PATH"
    for d in "${dirs[@]}"; do
        if [ -n "$d" ] && [ -e "$d/libcuda.so" ] && nm -D "$d/libcuda.so" 2>/dev/null | grep -q kvtier_fake_cuda; then
            echo "gpu-check: $d/libcuda.so on LD_LIBRARY_PATH is the emulated driver" >&2
            exit 1
        fi
    done
fi

failed=()
log=$(mktemp)
run_tests 2>&1 | tee "$log" || failed+=("GPU tests")
if grep -q "SKIPPED: no CUDA driver" "$log"; then
    echo "gpu-check: the GPU tests skipped although nvidia-smi sees a GPU" >&2
    failed+=("GPU tests skipped")
fi
if ! grep -q "GPU test ran on the real CUDA driver" "$log"; then
    echo "gpu-check: no GPU test reported running on the real CUDA driver" >&2
    failed+=("GPU tests not on the real driver")
fi

if python3 -c 'import torch' 2>/dev/null; then
    run_tensors || failed+=("Python CUDA tensors")
else
    echo "SKIPPED: Python CUDA tensors: python3 has no torch" >&2
    failed+=("Python CUDA tensors skipped")
fi

run_bench --sizes-kib 64,256,1024,4096 --runs 5 "$@" || failed+=("CUDA transfer bench")

# The host paths on this machine, as issue-style acceptance runs: every row's ratio
# against the whole-object and the run-by-run references, then the control bench's.
for i in 1 2 3; do
    echo "gpu-check: host bench transfer, run $i"
    run_host_bench transfer --json --mib 64 --runs 7 2>/dev/null | python3 -c '
import json, sys
for r in json.load(sys.stdin):
    runs = r.get("ratio_same_runs")
    print("  %-13s %5d KiB  ratio %.2f%s" % (r["path"], r["object_bytes"] // 1024, r["ratio"],
          "  ratio_same_runs %.2f" % runs if runs else ""))
' || failed+=("host transfer bench")
done
for i in 1 2 3 4 5; do
    run_host_bench control --json --slow-phases 0 --admin-phases 2 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin)
print("gpu-check: host bench control ratio_p50 %.2f (%s)" % (d["ratio_p50"], ", ".join(
      "%s %.2f" % (p["placement"], p["ratio_p50"]) for p in d["placements"])))
' || failed+=("host control bench")
done

if [ ${#failed[@]} -gt 0 ]; then
    printf 'gpu-check: FAILED: %s\n' "${failed[@]}" >&2
    exit 1
fi
echo "gpu-check: passed"
