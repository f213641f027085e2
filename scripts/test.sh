#!/usr/bin/env bash
# Runs kvtier's whole test suite, setting up what the tests need first.
#
# Usage: scripts/test.sh [extra cargo test args]
# Everything is built once, in release mode, so the benches that .ci/run measures
# afterwards reuse the same build.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --release "$@"
