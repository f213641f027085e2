"""The kvtier package's low-level client against a running daemon, and its bad input.

Run by tests/python_pkg.rs with the socket as argv[1] (and, unless the package is
installed, PYTHONPATH at the source package and KVTIER_LIB at a built libkvtier.so).
Host memory registered with ``register_host_tensors`` is a ctypes buffer here, so the test
needs no torch; every byte that comes back is compared. Prints ``OK ...`` lines the Rust
test asserts on.
"""

import ctypes
import os
import sys
import tempfile
from pathlib import Path

import kvtier
from kvtier import _capi

socket = sys.argv[1]
layout = kvtier.Layout(layers=4, kv_heads=4, head_dim=16, dtype_bytes=2, page_tokens=4)
run = layout.run_bytes
pages = 6

# A daemon that is not running: a clear exception naming the socket.
missing = Path(tempfile.mkdtemp()) / "nobody.sock"
try:
    kvtier.Client(layout, socket=missing)
    raise SystemExit("connecting to a missing daemon did not raise")
except kvtier.UnavailableError as e:
    assert str(missing) in str(e), e
    assert e.code == _capi.ERR_UNAVAILABLE and isinstance(e, ConnectionError), e
    print("OK unavailable names the socket")

# The daemon named as another uid than the one it runs as: refused before anything is sent,
# naming both uids; the same through KVTIER_DAEMON_UID, which connectors inherit.
me = os.geteuid()
for via_env in (False, True):
    try:
        if via_env:
            os.environ["KVTIER_DAEMON_UID"] = str(me + 1)
            kvtier.Client(layout, socket=socket)
        else:
            kvtier.Client(layout, socket=socket, daemon_uid=me + 1)
        raise SystemExit("a daemon of an unexpected uid was accepted")
    except kvtier.UntrustedError as e:
        assert e.code == _capi.ERR_UNTRUSTED and isinstance(e, PermissionError), e
        assert f"uid {me}" in str(e) and f"uid {me + 1}" in str(e), e
    finally:
        os.environ.pop("KVTIER_DAEMON_UID", None)
kvtier.Client(layout, socket=socket, daemon_uid=me).close()
os.environ["KVTIER_SOCKET"] = socket
assert kvtier.default_socket() == Path(socket), kvtier.default_socket()
del os.environ["KVTIER_SOCKET"]
print("OK a daemon of another uid is untrusted; the default socket is the library's")


def region():
    """vLLM's [2, pages, tokens, heads, dim] shape per layer, as one buffer per layer:
    K of page s at layer + s * run, V at layer + (pages + s) * run."""
    bufs = [ctypes.create_string_buffer(2 * pages * run) for _ in range(layout.layers)]
    base = [ctypes.addressof(b) for b in bufs]
    ptrs = base + [b + pages * run for b in base]
    return bufs, ptrs


def page_bytes(bufs, part, slot):
    return b"".join(b.raw[(part * pages + slot) * run:(part * pages + slot + 1) * run] for b in bufs)


writer_bufs, writer_ptrs = region()
for li, b in enumerate(writer_bufs):
    for i in range(len(b)):
        b[i] = (i * 31 + li * 7 + 3) % 251
hashes = [0xA000 + i for i in range(pages)]
with kvtier.Client(layout, socket=socket, instance="py-writer", model="pkg") as w:
    w.register_host_tensors(writer_ptrs, run, pages)
    receipt = w.store(hashes[:4], [2, 0, 5, 1], session="pkg-session")
    assert receipt.written == 4, receipt
    status = w.wait(receipt.ticket, 5000)
    assert status.complete == 4 and status.failed == 0, status
    assert sum(w.lookup(hashes)) == 4, w.lookup(hashes)
print("OK stored 4 pages from host tensors")

reader_bufs, reader_ptrs = region()
with kvtier.Client(layout, socket=socket, instance="py-reader", model="pkg") as r:
    r.register_host_tensors(reader_ptrs, run, pages)
    assert r.load(hashes[:4], [3, 4, 0, 2]) == 4
    for src, dst in [(2, 3), (0, 4), (5, 0), (1, 2)]:
        for part in (0, 1):
            assert page_bytes(reader_bufs, part, dst) == page_bytes(writer_bufs, part, src), (part, src, dst)
    # Slot 1 and 5 were never loaded into: still zero.
    for part in (0, 1):
        assert page_bytes(reader_bufs, part, 1) == bytes(layout.layers * run)
    # A wrong layout for the registered tensors: one layer missing; a stride below a page.
    try:
        r.register_host_tensors(reader_ptrs[:-1], run, pages)
        raise SystemExit("a short tensor list was accepted")
    except kvtier.InvalidArgumentError as e:
        assert e.code == _capi.ERR_LENGTH_MISMATCH, e
    try:
        r.register_host_tensors(reader_ptrs, run - 2, pages)
        raise SystemExit("a stride below one page was accepted")
    except kvtier.InvalidArgumentError as e:
        assert e.code == _capi.ERR_INVALID and "stride" in e.message, e
    # The earlier registration still serves.
    assert r.load(hashes[:1], [1]) == 1
    assert page_bytes(reader_bufs, 1, 1) == page_bytes(writer_bufs, 1, 2)
print("OK loaded 4 pages into host tensors byte for byte; wrong layouts refused")

# Sessions, token ids, request ends and router hints through the same client.
with kvtier.Client(layout, socket=socket, instance="py-routing", model="pkg") as h:
    h.register_host_tensors(writer_ptrs, run, pages)
    tokens = list(range(100, 100 + 2 * layout.page_tokens))
    assert h.store(hashes[4:6], [3, 4], "pkg-session", tokens=tokens, parent=hashes[3]).written == 2
    for bad, code in [({"tokens": tokens[:-1]}, _capi.ERR_LENGTH_MISMATCH), ({"parent": hashes[3]}, _capi.ERR_INVALID),
                      ({"tokens": tokens, "parent": b"\1" * 16}, _capi.ERR_INVALID)]:
        try:
            h.store(hashes[4:6], [3, 4], **bad)
            raise SystemExit(f"store with {sorted(bad)} was accepted")
        except kvtier.InvalidArgumentError as e:
            assert e.code == code, (bad, e)
    h.session("pkg-session", None, "acting")
    try:
        h.session("pkg-session", None, "napping")
        raise SystemExit("an unknown phase was accepted")
    except kvtier.InvalidArgumentError as e:
        assert "napping" in str(e), e
    h.request_end("pkg-session", hashes[:6], input_length=24, output_length=3)
    try:
        h.request_end("pkg-session", [])
        raise SystemExit("a request end naming no pages was accepted")
    except kvtier.InvalidArgumentError as e:
        assert e.code == _capi.ERR_EMPTY_BATCH, e
    fetch = {"source_control_endpoint": "tcp://10.1.2.3:25000", "block_hashes": hashes[:6] + [0xBEEF]}
    report = h.kv_hints({"protocol_version": "0.1", "message_id": "pkg-m", "actions": [
        {"action_id": "f1", "action_type": "kv.fetch", "action_version": "1.0", "payload": fetch},
        {"action_id": "f2", "action_type": "kv.fetch", "action_version": "2.0", "payload": fetch}]})
    assert report["message_id"] == "pkg-m", report
    got = [(a["action_id"], a["pages"], a.get("outcome")) for a in report["actions"]]
    assert got == [("f1", 7, {"outcome": "clipped", "applied": 6, "requested": 7, "reason": "not_complete"}),
                   ("f2", 0, {"outcome": "ignored", "reason": "unsupported_version"})], got
    # JSON text works too; a malformed envelope is the daemon's bad_hint, and the client
    # keeps serving.
    text = '{"protocol_version": "0.1", "message_id": "pkg-t", "actions": []}'
    assert h.kv_hints(text) == {"protocol_version": "0.1", "message_id": "pkg-t", "actions": []}
    try:
        h.kv_hints('{"protocol_version": "0.1", "actions": [{"action_type": "kv.fetch"}]}')
        raise SystemExit("a malformed envelope was accepted")
    except kvtier.RemoteError as e:
        assert e.code == _capi.ERR_REMOTE_BASE - 10, e
    assert sum(h.lookup(hashes)) == 6
print("OK token ids, sessions, request ends and KvHint envelopes through the client")

try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    import kvtier.tensors

    with kvtier.Client(layout, socket=socket, instance="py-torch", model="pkg") as t:
        kv = [torch.zeros(2, pages, layout.page_tokens, layout.kv_heads, layout.head_dim, dtype=torch.float16)
              for _ in range(layout.layers)]
        assert kvtier.tensors.register(t, [[x[0] for x in kv], [x[1] for x in kv]]) == pages
        assert t.load(hashes[:2], [4, 5]) == 2
        for li, x in enumerate(kv):
            got = x.view(torch.uint8).reshape(2, pages, run)
            for part in (0, 1):
                want = writer_bufs[li].raw[(part * pages + 2) * run:(part * pages + 3) * run]
                assert bytes(got[part, 4].tolist()) == want, (li, part)
        bad = torch.zeros(2, pages, layout.page_tokens, layout.kv_heads, layout.head_dim + 1, dtype=torch.float16)
        try:
            kvtier.tensors.register(t, [[bad[0]] * layout.layers, [bad[1]] * layout.layers])
            raise SystemExit("a wrong head_dim was accepted")
        except kvtier.LayoutError as e:
            assert "shape" in e.message, e
    print("OK torch tensors registered and loaded; wrong layout refused")
else:
    print("SKIPPED torch part: no torch in this interpreter")

# Closed handles: close twice is fine; any other call raises ClosedError from the library.
c = kvtier.Client(layout, socket=socket, instance="py-closed", model="pkg")
stale = c.raw_handle
c.close()
c.close()
assert c.closed
try:
    c.lookup(hashes)
    raise SystemExit("a closed client answered")
except kvtier.ClosedError as e:
    assert e.code == _capi.ERR_CLOSED, e
lib = _capi.lib()
# The C ABI itself: a second kvtier_close and a call on the closed handle return codes.
assert lib.kvtier_close(stale) == _capi.ERR_CLOSED
assert lib.kvtier_register_emulated(stale, 4) == _capi.ERR_CLOSED
assert "closed" in _capi.last_error()
assert lib.kvtier_close(ctypes.c_void_p(0xDEAD)) == _capi.ERR_CLOSED
print("OK closed handles are refused, close twice is harmless")
print("OK version", kvtier.__version__)
