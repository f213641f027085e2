#!/usr/bin/env bash
# Installs what the FFI and admin tests need beyond Rust: a C++17 compiler (the C++ test
# engine is compiled against the cxx bridge), python3 (the ctypes examples; standard library
# only) and curl (the admin tests talk to the admin socket with it, as operators do). Idempotent: installs nothing when both are present.
set -euo pipefail

need=()
command -v g++ >/dev/null 2>&1 || need+=(g++)
command -v python3 >/dev/null 2>&1 || need+=(python3)
command -v curl >/dev/null 2>&1 || need+=(curl)
if [ "${#need[@]}" -eq 0 ]; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ffi-deps: please install: ${need[*]}" >&2
    exit 1
fi
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
    sudo_cmd=(sudo)
fi
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
