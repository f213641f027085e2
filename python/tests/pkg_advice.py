"""Pause and resume advice through the kvtier package: the daemon's pressure controller
pauses an acting session when host reaches its pause threshold and lets it back at the
resume threshold, and the engine hears both in its advice stream (``Client.take_advice``).

Run by tests/python_pkg.rs with the socket as argv[1] against a daemon with 100 pages of
host and exclusive tiers (a page loaded to device leaves host, which is how this engine
lowers host utilisation). Prints ``OK ...`` lines the Rust test asserts on.
"""

import sys
import time

import kvtier
from pkg_pages import store

socket = sys.argv[1]
layout = kvtier.Layout(layers=4, kv_heads=4, head_dim=16, dtype_bytes=2, page_tokens=4)


def advice_until(c, want, limit_s=15.0):
    """Advice entries taken until ``want`` of them came (a deadline, not a timing check)."""
    got = []
    end = time.monotonic() + limit_s
    while len(got) < want:
        if time.monotonic() > end:
            raise SystemExit(f"waited for {want} advice entries, got {got}")
        got.extend(c.take_advice()["advice"])
        time.sleep(0.02)
    return got


with kvtier.Client(layout, socket=socket, instance="py-engine", model="pkg-advice") as c:
    c.register_emulated(128)
    assert c.take_advice() == {"more": False, "advice": []}
    c.session("py-tool", None, "reasoning")
    mine = store(c, "py-tool", 0x1000, 10)
    c.session("py-tool", None, "acting")
    filler = store(c, "py-filler", 0x5000, 86)
    got = advice_until(c, 1)
    assert got == [{"kind": kvtier.ADVICE_PAUSE, "name": "pause", "session_id": "py-tool"}], got
    print("OK pause advice for the acting session at the pause threshold")

    assert c.load(filler, list(range(86))) == 86
    got = advice_until(c, 2)
    assert [(a["name"], a.get("session_id"), len(a.get("hashes", []))) for a in got] == [
        ("ready_to_load", None, 10),
        ("resume", "py-tool", 0),
    ], got
    assert got[0]["hashes"] == [h.to_bytes(8, "big").hex() for h in mine], got
    assert c.load(mine, list(range(10))) == 10
    print("OK resume advice and its pages ready to load at the resume threshold")
