#!/usr/bin/env bash
# Sets up, starts and stops a loopback Mooncake master for kvtier's Mooncake tests and bench.
#
#   scripts/mooncake-env.sh install   # libibverbs1 + libclang-dev (Debian), venv .venv with the wheel
#   scripts/mooncake-env.sh start     # mooncake_master on 127.0.0.1, pid in .kvtier/mooncake-master.pid,
#                                     # and its HTTP metadata server, on 127.0.0.1 too
#
# Every port listens on loopback only: RPC (--rpc_address), metrics (--metrics_host) and the
# metadata server. The master's built-in metadata server binds 0.0.0.0 whatever
# --http_metadata_server_host says (wheel 0.3.x), so it is turned off and the wheel's own
# mooncake_http_metadata_server runs beside the master with --host 127.0.0.1.
#   scripts/mooncake-env.sh stop      # stop it (safe to call twice, or when it never started)
#   scripts/mooncake-env.sh env       # print the export lines the tests need
#   scripts/mooncake-env.sh status    # say whether the master is up
#
# Ports are fixed and local; override with KVTIER_MOONCAKE_RPC_PORT / KVTIER_MOONCAKE_HTTP_PORT.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVTIER_MOONCAKE_VENV:-$ROOT/.venv}"
STATE="$ROOT/.kvtier"
PIDFILE="$STATE/mooncake-master.pid"
LOG="$STATE/mooncake-master.log"
META_PIDFILE="$STATE/mooncake-metadata.pid"
META_LOG="$STATE/mooncake-metadata.log"
RPC_PORT="${KVTIER_MOONCAKE_RPC_PORT:-50351}"
HTTP_PORT="${KVTIER_MOONCAKE_HTTP_PORT:-50352}"
METRICS_PORT="${KVTIER_MOONCAKE_METRICS_PORT:-50353}"
# A client that stops heartbeating loses its segment after this many seconds (upstream: 10).
# Short here, so a killed helper's segment stops receiving objects quickly.
CLIENT_TTL="${KVTIER_MOONCAKE_CLIENT_TTL:-3}"
WHEEL="mooncake-transfer-engine-non-cuda"

log() { echo "mooncake-env: $*" >&2; }

apt_install() {
    local missing=()
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    log "installing ${missing[*]}"
    if ! $sudo apt-get install -y "${missing[@]}"; then
        $sudo apt-get update
        $sudo apt-get install -y "${missing[@]}"
    fi
}

install() {
    apt_install libibverbs1 libclang-dev
    if [ ! -x "$VENV/bin/python3" ]; then
        log "creating venv at $VENV"
        python3 -m venv "$VENV"
    fi
    if ! "$VENV/bin/python3" -c 'import mooncake.store' >/dev/null 2>&1; then
        "$VENV/bin/pip" install --quiet --disable-pip-version-check "$WHEEL"
    fi
    "$VENV/bin/python3" -c 'from mooncake.store import MooncakeDistributedStore' >/dev/null
    [ -x "$VENV/bin/mooncake_master" ] || { log "mooncake_master missing from $VENV/bin"; exit 1; }
    log "ok: $("$VENV/bin/pip" show "$WHEEL" 2>/dev/null | grep -i '^version' || true)"
}

running() {
    [ -f "$PIDFILE" ] && kill -0 "$(cat "$PIDFILE")" 2>/dev/null
}

reachable() {
    (exec 3<>"/dev/tcp/127.0.0.1/$RPC_PORT") 2>/dev/null &&
        (exec 3<>"/dev/tcp/127.0.0.1/$HTTP_PORT") 2>/dev/null
}

start() {
    mkdir -p "$STATE"
    if running; then
        log "master already running (pid $(cat "$PIDFILE"))"
        return 0
    fi
    [ -x "$VENV/bin/mooncake_master" ] || { log "run '$0 install' first"; exit 1; }
    if reachable; then
        log "ports $RPC_PORT/$HTTP_PORT are taken by another process; set KVTIER_MOONCAKE_RPC_PORT and KVTIER_MOONCAKE_HTTP_PORT"
        exit 1
    fi
    [ -x "$VENV/bin/mooncake_http_metadata_server" ] || { log "mooncake_http_metadata_server missing from $VENV/bin"; exit 1; }
    # setsid: each gets its own process group, so stop can end it and its children.
    setsid "$VENV/bin/mooncake_http_metadata_server" --host 127.0.0.1 --port "$HTTP_PORT" \
        >"$META_LOG" 2>&1 </dev/null &
    echo $! >"$META_PIDFILE"
    setsid "$VENV/bin/mooncake_master" \
        --rpc_address=127.0.0.1 --rpc_port="$RPC_PORT" \
        --enable_http_metadata_server=false \
        --metrics_host=127.0.0.1 --metrics_port="$METRICS_PORT" \
        --client_ttl="$CLIENT_TTL" \
        >"$LOG" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for _ in $(seq 1 100); do
        if running && reachable; then
            log "master up on 127.0.0.1:$RPC_PORT (metadata http://127.0.0.1:$HTTP_PORT/metadata), pid $(cat "$PIDFILE")"
            return 0
        fi
        running || break
        sleep 0.1
    done
    log "master did not come up; last log lines:"
    tail -n 20 "$LOG" >&2 || true
    stop
    exit 1
}

stop_pidfile() {
    local file="$1" what="$2"
    if [ -f "$file" ]; then
        local pid
        pid="$(cat "$file")"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -KILL "$pid" 2>/dev/null || true
            log "$what (pid $pid) stopped"
        fi
        rm -f "$file"
    fi
}

stop() {
    stop_pidfile "$PIDFILE" master
    stop_pidfile "$META_PIDFILE" "metadata server"
}

env_lines() {
    echo "export KVTIER_MOONCAKE_MASTER=127.0.0.1:$RPC_PORT"
    echo "export KVTIER_MOONCAKE_METADATA=http://127.0.0.1:$HTTP_PORT/metadata"
    echo "export KVTIER_MOONCAKE_MASTER_ADMIN=127.0.0.1:$METRICS_PORT"
    echo "export KVTIER_MOONCAKE_PYTHON=$VENV/bin/python3"
    echo "export KVTIER_MOONCAKE_MASTER_BIN=$VENV/bin/mooncake_master"
    echo "export KVTIER_MOONCAKE_MASTER_PIDFILE=$PIDFILE"
}

case "${1:-}" in
install) install ;;
start) start ;;
stop) stop ;;
env) env_lines ;;
status) if running && reachable; then echo "up (pid $(cat "$PIDFILE"))"; else echo "down"; exit 1; fi ;;
*)
    echo "usage: $0 {install|start|stop|env|status}" >&2
    exit 2
    ;;
esac
