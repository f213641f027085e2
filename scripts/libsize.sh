#!/usr/bin/env bash
# The size of the libkvtier.so engines load: builds it the way the Python package does
# (python/setup.py: `cargo rustc --profile engine --lib --no-default-features --crate-type
# cdylib`, plus the features named in KVTIER_CARGO_FEATURES), strips a copy, and prints its
# size in bytes beside the reference, issue 16's 803 KB (822,272 bytes, the stripped
# library before the control plane moved to tokio and hyper), with its largest sections.
#
# Usage: scripts/libsize.sh [--limit BYTES]
# Fails when the stripped library is larger than the limit (default: the reference, the
# issue's goal that it stays as small): engines load this library into every rank.
set -euo pipefail
cd "$(dirname "$0")/.."

reference=822272
limit=$reference
while [ $# -gt 0 ]; do
    case "$1" in
        --limit) limit="$2"; shift 2 ;;
        *) echo "usage: $0 [--limit BYTES]" >&2; exit 2 ;;
    esac
done

features=()
if [ -n "${KVTIER_CARGO_FEATURES:-}" ]; then
    features=(--features "$KVTIER_CARGO_FEATURES")
fi
cargo rustc --profile engine --lib --no-default-features --crate-type cdylib "${features[@]}"

target="${CARGO_TARGET_DIR:-target}"
lib="$target/engine/libkvtier.so"
[ -f "$lib" ] || { echo "libsize: cargo finished but $lib does not exist" >&2; exit 1; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${STRIP:-strip}" -o "$tmp/libkvtier.so" "$lib"
size=$(stat -c %s "$tmp/libkvtier.so")

echo "libkvtier.so, engine build (profile engine, --no-default-features, cdylib only${KVTIER_CARGO_FEATURES:+, features $KVTIER_CARGO_FEATURES}), stripped:"
printf '  size_bytes %d  reference_bytes %d (issue 16: 803 KB)  ratio %s  limit_bytes %d\n' \
    "$size" "$reference" "$(awk -v a="$size" -v b="$reference" 'BEGIN { printf "%.3f", a / b }')" "$limit"
if command -v size > /dev/null; then
    echo "  largest sections (bytes):"
    size -A "$tmp/libkvtier.so" | awk '$1 ~ /^\./ { print $2, $1 }' | sort -rn | head -6 \
        | awk '{ printf "    %-20s %d\n", $2, $1 }'
fi
if [ "$size" -gt "$limit" ]; then
    echo "libsize: the engine library is $size bytes stripped, above the limit of $limit" >&2
    exit 1
fi
