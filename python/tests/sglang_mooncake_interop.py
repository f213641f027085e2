"""SGLang 0.5.23's own MooncakeStore reads the pages kvtier wrote to a Mooncake Store, and
writes pages kvtier then loads, element by element.

Run by tests/sglang_interop.rs in the SGLang venv (which holds the Mooncake wheel) as
`serve SOCKET`: torch and SGLang are imported once (most of a request's cost), then each
connection to the Unix socket SOCKET is one request, served by a child forked for it (a
fresh process: its own MooncakeStore clients and segments, gone when it exits, as a
process per request would be). A request is one line, `MODE<TAB>STDERR_FILE<TAB>CASE`:
`read` or `write`, the file the child's stderr goes to, and the JSON case; the connection
is the child's stdin and stdout, and once the child exited the server writes
`STATUS <exit code>` (negative: killed by that signal) and closes it. The server exits when
its stdin ends (the test process is gone), removing SOCKET and its directory (the test
made both for it). The MOONCAKE_* variables point at the test's
mooncake_master. For every rank of the case it builds SGLang's real
`MooncakeStore` (its __init__, config prefix, key suffixes, warm-up and buffer
registration) over SGLang's real CPU host pool in the `page_first` layout, as HiCache
builds them; nothing of SGLang's key or buffer logic is copied here.

- `read`: `batch_get_v1` of every page into host slots in reverse order; every element of
  every page is compared with the value rule below, and slots not named stay zero.
- `write`: the host pool is filled by the value rule and stored with `batch_set_v1`; the
  stores stay alive (their segments hold the objects) until a line arrives on stdin.

Both print `KEYS <tp> <pp> <key>...`, the object keys SGLang's `_batch_preprocess` built
for that rank, so the Rust side compares them with kvtier's own keys.

Value rule (the Rust test computes the same): element (page, part, global layer, token,
global head, dim) holds the 16-bit pattern `(x * 2654435761 >> 13) & 0xffff` of
`x = page*1000003 + part*100003 + layer*10007 + token*1009 + head*101 + dim`, stored as
float16 bits and compared as int16, so no float rounding can hide a swapped element.
"""

import json
import os
import select
import signal
import socket
import sys
import traceback

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

def values(page, part, layer0, head0, shape):
    """int16 tensor of the value rule over [token][layer][head][dim] starting at layer0/head0."""
    t, l, h, d = torch.meshgrid(*(torch.arange(n, dtype=torch.int64) for n in shape), indexing="ij")
    x = page * 1000003 + part * 100003 + (l + layer0) * 10007 + t * 1009 + (h + head0) * 101 + d
    v = ((x * 2654435761) >> 13) & 0xFFFF
    return torch.where(v >= 32768, v - 65536, v).to(torch.int16)


def rank_store(tp, pp):
    layers = LAYERS // PP
    cfg = HiCacheStorageConfig(
        tp_rank=tp, tp_size=TP, pp_rank=pp, pp_size=PP, attn_cp_rank=0, attn_cp_size=1, is_mla_model=MLA,
        enable_storage_metrics=False, is_page_first_layout=True, model_name=CASE["model"], extra_config=None)
    size = SLOTS * PAGE
    if MLA:
        dev = MLATokenToKVPool(size, PAGE, torch.float16, CASE["dim"], 0, layers, "cpu", False, start_layer=0,
                               end_layer=layers)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers, target_layer_num=layers)
    else:
        dev = MHATokenToKVPool(size, PAGE, torch.float16, CASE["heads"] // TP, CASE["dim"], layers, "cpu", False,
                               start_layer=0, end_layer=layers)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 1.0, 0, PAGE, "page_first",
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers)
    store = MooncakeStore(cfg, host)
    store.register_mem_pool_host(host)
    host.kv_buffer.zero_()
    return store, host, pp * layers


def page_views(host, slot):
    """(part, [token][layer][head][dim] int16 view) of one host slot, in SGLang's layout."""
    buf = host.kv_buffer.view(torch.int16)
    span = slice(slot * PAGE, (slot + 1) * PAGE)
    if MLA:
        return [(0, buf[span])]
    return [(0, buf[0, span]), (1, buf[1, span])]


def indices(slots):
    return torch.cat([torch.arange(s * PAGE, (s + 1) * PAGE) for s in slots]).to(torch.int64)


def run(mode, case):
    """One request: the case's every rank, read or written (see the module's docstring)."""
    global MODE, CASE, PAGE, LAYERS, TP, PP, MLA, HASHES, N, SLOTS
    MODE, CASE = mode, case
    PAGE, LAYERS, TP, PP = CASE["page"], CASE["layers"], CASE["tp"], CASE["pp"]
    MLA, HASHES = CASE["mla"], CASE["hashes"]
    N = len(HASHES)
    SLOTS = N + 2
    elements, stores = 0, []
    for pp in range(PP):
        for tp in range(1 if MLA else TP):
            store, host, layer0 = rank_store(tp, pp)
            stores.append((store, host))
            head0 = 0 if MLA else tp * (CASE["heads"] // TP)
            slots = [SLOTS - 1 - i for i in range(N)]
            key_list, _, sizes = store._batch_preprocess(store._tag_keys(HASHES), indices(slots))
            print("KEYS", tp, pp, " ".join(key_list), flush=True)
            if MODE == "write":
                for i, s in enumerate(slots):
                    for part, view in page_views(host, s):
                        view.copy_(values(i, part, layer0, head0, view.shape))
                ok = store.batch_set_v1(HASHES, indices(slots))
                assert ok == [True] * N, ok
            else:
                ok = store.batch_get_v1(HASHES, indices(slots))
                assert ok == [True] * N, (tp, pp, ok)
                for i, s in enumerate(slots):
                    for part, view in page_views(host, s):
                        want = values(i, part, layer0, head0, view.shape)
                        bad = int((view != want).sum())
                        assert bad == 0, f"rank tp={tp} pp={pp} page {i} part {part}: {bad} of {view.numel()} differ"
                        elements += view.numel()
                for s in set(range(SLOTS)) - set(slots):
                    for _, view in page_views(host, s):
                        assert int(view.count_nonzero()) == 0, f"slot {s} was written"
            print(f"OK {MODE} tp={tp} pp={pp} {N} pages, object bytes {sorted({s for s in sizes if isinstance(s, int)})}", flush=True)
    print(f"OK {MODE} done, {elements} elements compared", flush=True)
    if MODE == "write":
        # A Mooncake client's objects live in the segment it mounted: keep every rank's store
        # alive until the reader is done (one line on stdin, or EOF).
        print("READY", flush=True)
        sys.stdin.readline()


def serve_request(conn):
    """The forked child's part: the request line, then :func:`run` with the connection as
    stdin and stdout. Exits with 0 when the case passed, 1 with the traceback on stderr."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(1 << 16)
        if not chunk:
            os._exit(2)
        line += chunk
    mode, err, case = line.decode().rstrip("\n").split("\t", 2)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 2)
    os.dup2(conn.fileno(), 0)
    os.dup2(conn.fileno(), 1)
    os.close(fd)
    conn.close()
    sys.stdin = open(0, "r", closefd=False)
    try:
        run(mode, json.loads(case))
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # A normal interpreter exit, as a process per request ends: the stores' destructors run.
    sys.exit(code)


def serve(path):
    conns = {}  # child pid -> its connection, answered with STATUS once the child exited

    def reap(*_):
        while conns:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = conns.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"STATUS {os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:
                    pass
                conn.close()

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    signal.signal(signal.SIGCHLD, reap)
    print("LISTENING", flush=True)
    while True:
        ready, _, _ = select.select([srv, sys.stdin.fileno()], [], [])
        if sys.stdin.fileno() in ready and not os.read(sys.stdin.fileno(), 4096):
            srv.close()
            os.unlink(path)
            os.rmdir(os.path.dirname(path))
            return
        if srv in ready:
            conn, _ = srv.accept()
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
                srv.close()
                serve_request(conn)
            conns[pid] = conn
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            reap()


if __name__ == "__main__":
    assert sys.argv[1] == "serve", "usage: sglang_mooncake_interop.py serve SOCKET"
    serve(sys.argv[2])
