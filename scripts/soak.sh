#!/usr/bin/env bash
# Runs the soak (tests/soak.rs) for SECONDS (default 600): 32 clients on the local pool
# with the daemon SIGKILLed every 2 minutes, and beside them 8 clients on a Mooncake pool
# whose daemon is SIGKILLed as often (once in runs under 4 minutes) and whose master (one
# of the test's own, on fresh loopback ports) is killed once.
#
# Usage: scripts/soak.sh [SECONDS]
# Needs the Mooncake wheel (scripts/mooncake-env.sh install; done here). The test binary is
# built first and then run directly, so a cargo run beside it (.ci/run runs the README test
# command at the same time) never waits on a cargo lock the soak holds. Prints the soak's
# JSON lines (one per case, "soak": "local" and "mooncake") last; exits non-zero when the
# soak failed or skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-600}"
scripts/mooncake-env.sh install
bin=$(cargo test --release --test soak --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "soak" and m.get("executable"):
        print(m["executable"])')
[ -x "$bin" ] || { echo "soak.sh: the soak test binary was not built" >&2; exit 1; }
eval "$(scripts/mooncake-env.sh env)"
echo "soak.sh: running $bin for $seconds s"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
rc=0
KVTIER_SOAK_SECONDS="$seconds" timeout $((seconds * 2 + 300)) "$bin" --test-threads=2 --nocapture >"$out" 2>&1 || rc=$?
cat "$out"
echo "soak.sh: JSON lines:"
grep '^{"' "$out" || true
if grep -q "SKIPPED:" "$out"; then
    echo "soak.sh: a soak case skipped" >&2
    rc=1
fi
exit "$rc"
