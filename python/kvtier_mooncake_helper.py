#!/usr/bin/env python3
"""kvtier's Mooncake helper: holds the official Mooncake Store client for the kvtier daemon.

The daemon (Rust) spawns this process, listens on a Unix socket and passes its path. The
helper connects, maps the shared-memory regions it is given (kvtier's host arena and a
small staging region), registers them with Mooncake, and then serves batch requests whose
items name a region, an offset and a length. Bytes move between the mappings and the store
through Mooncake's own `batch_put_from` / `batch_get_into`; only keys and offsets cross the
socket.

Frames are little-endian: `u32 length | u64 request id | u8 op-or-status | body`. A request's
body starts with its deadline, `u64` nanoseconds of CLOCK_MONOTONIC (the daemon's clock, the
same on this host), so the time a request waits here counts against it. A request is
answered with status 0 (`u32 n`, then `n` i64 results, Mooncake's own codes), 1 (store
unavailable, utf-8 reason), 2 (bad request, utf-8 message) or 3 (busy: not run, because the
queue was full or its deadline passed before a worker took it; nothing was read or
written). The helper never logs object bytes; it logs counts and reasons only, to stderr.

Requests run concurrently on `--workers` threads (the wheel's calls release the GIL), behind
a queue of at most `--max-queued`; the reading thread answers `status` itself, so a probe
is answered while every worker is busy, and reports how long the workers have gone without
finishing anything (`stalled_ms`): the daemon replaces a helper that is hung, never one
that is only busy.

`--raw-bench` is not used by the daemon: it is the baseline of `kvtier bench pool`, the
wheel's Python client timing its own batch calls over the same registered regions.
"""

import argparse
import array
import ctypes
import json
import mmap
import os
import socket
import struct
import sys
import threading
import time

OP_PUT, OP_GET, OP_EXISTS, OP_REMOVE, OP_STATUS, OP_RAW_BENCH = 1, 2, 3, 4, 5, 6
ST_OK, ST_UNAVAILABLE, ST_BAD, ST_BUSY = 0, 1, 2, 3
MAX_FRAME = 16 << 20
HEAD = struct.Struct("<IQB")
DEADLINE = struct.Struct("<Q")


def log(msg):
    sys.stderr.write(f"kvtier-mooncake-helper[{os.getpid()}]: {msg}\n")
    sys.stderr.flush()


class Region:
    """One shared-memory file mapped whole; `addr` is its base address in this process."""

    def __init__(self, path, length):
        self.fd = os.open(path, os.O_RDWR)
        self.map = mmap.mmap(self.fd, length)
        self.len = length
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.map))


class Store:
    """The Mooncake client and whether it can serve now.

    `setup` is only tried while the master's port accepts connections: Mooncake's own setup
    retries for about 90 s against a missing master, which would leave the helper deaf.
    A monitor thread probes the master twice a second; the client reconnects and remounts
    its segment by itself after a master restart.
    """

    def __init__(self, args, regions):
        self.args = args
        self.regions = regions
        self.lock = threading.Lock()
        self.store = None
        self.master_up = False
        self.reason = "connecting to the Mooncake master"
        host, _, port = args.master.rpartition(":")
        self.master = (host, int(port))
        from mooncake.store import ReplicateConfig

        # One config for every put: how many segments hold a copy of each object.
        self.replicate = ReplicateConfig()
        self.replicate.replica_num = max(1, args.replicas)

    def ready(self):
        with self.lock:
            return self.store is not None and self.master_up, self.reason

    def probe(self):
        try:
            with socket.create_connection(self.master, timeout=0.5):
                return True
        except OSError:
            return False

    def monitor(self):
        backoff = 0.2
        while True:
            up = self.probe()
            with self.lock:
                self.master_up = up
                if not up:
                    self.reason = f"Mooncake master {self.args.master} unreachable"
                have = self.store is not None
            if up and not have:
                if self.connect():
                    backoff = 0.2
                else:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
            time.sleep(0.25)

    def connect(self):
        from mooncake.store import MooncakeDistributedStore

        store = MooncakeDistributedStore()
        t = time.monotonic()
        rc = store.setup(
            self.args.hostname,
            self.args.metadata,
            self.args.segment_bytes,
            self.args.local_buffer_bytes,
            self.args.protocol,
            self.args.device,
            self.args.master,
        )
        if rc != 0:
            with self.lock:
                self.reason = f"Mooncake setup failed with code {rc}"
            log(f"setup failed: {rc}")
            return False
        for r in self.regions:
            rc = store.register_buffer(r.addr, r.len)
            if rc != 0:
                with self.lock:
                    self.reason = f"register_buffer failed with code {rc}"
                log(f"register_buffer of {r.len} bytes failed: {rc}")
                return False
        with self.lock:
            self.store = store
            self.reason = ""
        log(f"connected to {self.args.master} in {time.monotonic() - t:.3f}s, {len(self.regions)} regions registered")
        return True


def parse_items(body, regions):
    """`u32 n | n x u16 key length | n x u8 region | n x u64 offset | n x u64 length | keys`.

    Column-wise, so a batch decodes with a few struct calls instead of one per field.
    """
    (n,) = struct.unpack_from("<I", body, 0)
    at = 4
    klens = struct.unpack_from(f"<{n}H", body, at)
    at += 2 * n
    regs = body[at : at + n]
    at += n
    offs = struct.unpack_from(f"<{n}Q", body, at)
    at += 8 * n
    sizes = list(struct.unpack_from(f"<{n}Q", body, at))
    at += 8 * n
    keys = []
    for length in klens:
        keys.append(body[at : at + length].decode())
        at += length
    ptrs = []
    for r, off, length in zip(regs, offs, sizes):
        region = regions[r]
        if off + length > region.len:
            raise ValueError(f"item of {length} bytes at {off} is outside region {r}")
        ptrs.append(region.addr + off)
    return keys, ptrs, sizes


def parse_keys(body, at):
    """A key list: u32 count, then the keys joined by NUL (keys never hold one).

    The keys stay `bytes`: the wheel's pybind signature takes `std::string`, which accepts
    bytes as they are, so no key is decoded into a `str` only to be encoded again. One
    split, where a loop over length-prefixed keys had cost most of an existence query's
    time in the helper (`bench pool`'s remote_lookup row)."""
    (n,) = struct.unpack_from("<I", body, at)
    if n == 0:
        return []
    keys = body[at + 4 :].split(b"\0")
    if len(keys) != n:
        raise ValueError(f"key list says {n} keys, holds {len(keys)}")
    return keys


# `array("q")` writes i64 in the machine's order; the protocol is little-endian.
_NATIVE_LE = sys.byteorder == "little"


def results(codes):
    if _NATIVE_LE:
        return struct.pack("<I", len(codes)) + array.array("q", codes).tobytes()
    return struct.pack(f"<I{len(codes)}q", len(codes), *codes)


def raw_bench(store, regions, spec):
    """Times the wheel's own batch calls over registered memory: the bench's baseline."""
    if spec["op"] == "exists":
        # One batched existence query over the given keys, as a HiCache client asks it.
        t = time.perf_counter()
        codes = store.batch_is_exist(spec["keys"])
        return {"seconds": time.perf_counter() - t, "failed": sum(1 for c in codes if c != 1)}
    r = regions[spec["region"]]
    items = spec["items"]
    keys = [f"{spec['prefix']}{i}" for i in range(len(items))]
    batch = max(1, int(spec["batch"]))
    failed = 0
    t = time.perf_counter()
    for s in range(0, len(items), batch):
        ks = keys[s : s + batch]
        ptrs = [r.addr + off for off, _ in items[s : s + batch]]
        sizes = [n for _, n in items[s : s + batch]]
        if spec["op"] == "put":
            codes = store.batch_put_from(ks, ptrs, sizes)
            failed += sum(1 for c in codes if c != 0)
        else:
            codes = store.batch_get_into(ks, ptrs, sizes)
            failed += sum(1 for c, n in zip(codes, sizes) if c != n)
    return {"seconds": time.perf_counter() - t, "failed": failed}


def frames(conn):
    """Yields `(request id, op, body)` per request frame, until the socket closes.

    Reads whatever the socket holds (the daemon writes a frame's head and body in one
    write), so a request usually costs one `recv`, not one for the head and one for the
    body: each wake-up of this process is on the path of a lookup's existence query.
    Bytes past a whole frame stay for the next one.
    """
    pending = bytearray()
    while True:
        while len(pending) < HEAD.size:
            chunk = conn.recv(1 << 16)
            if not chunk:
                return
            pending += chunk
        length, rid, op = HEAD.unpack_from(pending)
        if length < 9 or length > MAX_FRAME:
            log(f"bad frame length {length}; closing")
            return
        total = 4 + length
        while len(pending) < total:
            chunk = conn.recv(max(1 << 16, total - len(pending)))
            if not chunk:
                return
            pending += chunk
        body = bytes(pending[HEAD.size : total])
        del pending[:total]
        yield rid, op, body


class Work:
    """The bounded queue of requests, the worker threads that run them, and their progress.

    `stalled_ms` is how long requests have been running with none finishing: 0 while idle or
    while any request keeps completing, growing only when every running request is stuck.
    """

    def __init__(self, conn, state, regions, workers, max_queued, get_delay):
        self.conn = conn
        self.state = state
        self.regions = regions
        self.get_delay = get_delay
        self.send_lock = threading.Lock()
        self.cv = threading.Condition()
        self.queue = []
        self.max_queued = max_queued
        self.running = 0
        self.done = 0
        self.expired = 0
        self.busy = 0
        self.progress = time.monotonic()
        for i in range(max(1, workers)):
            threading.Thread(target=self.worker, name=f"worker-{i}", daemon=True).start()

    def reply(self, rid, status, out):
        frame = HEAD.pack(len(out) + 9, rid, status) + out
        with self.send_lock:
            self.conn.sendall(frame)

    def submit(self, rid, op, deadline, body):
        with self.cv:
            full = len(self.queue) >= self.max_queued
            if full:
                self.busy += 1
            else:
                self.queue.append((rid, op, deadline, body))
                self.cv.notify()
        if full:
            self.reply(rid, ST_BUSY, f"helper busy: {self.max_queued} requests queued".encode())

    def stats(self):
        with self.cv:
            stalled = 0
            if self.running:
                stalled = int((time.monotonic() - self.progress) * 1000)
            return {
                "running": self.running,
                "queued": len(self.queue),
                "done": self.done,
                "expired": self.expired,
                "busy": self.busy,
                "stalled_ms": stalled,
            }

    def worker(self):
        while True:
            with self.cv:
                while not self.queue:
                    self.cv.wait()
                rid, op, deadline, body = self.queue.pop(0)
                late = time.monotonic_ns() >= deadline
                if late:
                    self.expired += 1
                else:
                    if self.running == 0:
                        self.progress = time.monotonic()
                    self.running += 1
            if late:
                # Its caller has given up: running it now could write memory it reuses.
                self.reply(rid, ST_BUSY, b"deadline passed in the helper's queue")
                continue
            try:
                if op == OP_GET and self.get_delay > 0:
                    time.sleep(self.get_delay)
                status, out = handle(op, body, self.state, self.regions)
            finally:
                with self.cv:
                    self.running -= 1
                    self.done += 1
                    self.progress = time.monotonic()
            try:
                self.reply(rid, status, out)
            except OSError:
                return


def serve(conn, state, regions, workers=8, max_queued=64, get_delay=0.0):
    work = Work(conn, state, regions, workers, max_queued, get_delay)
    for rid, op, body in frames(conn):
        if len(body) < DEADLINE.size:
            work.reply(rid, ST_BAD, b"request without a deadline")
            continue
        (deadline,) = DEADLINE.unpack_from(body)
        body = body[DEADLINE.size :]
        if op == OP_STATUS:
            ok, reason = state.ready()
            doc = {"ready": ok, "reason": reason, "pid": os.getpid()}
            doc.update(work.stats())
            work.reply(rid, ST_OK, json.dumps(doc).encode())
        else:
            work.submit(rid, op, deadline, body)


def handle(op, body, state, regions):
    ok, reason = state.ready()
    if not ok:
        return ST_UNAVAILABLE, reason.encode()
    store = state.store
    try:
        if op == OP_PUT:
            keys, ptrs, sizes = parse_items(body, regions)
            return ST_OK, results(store.batch_put_from(keys, ptrs, sizes, state.replicate))
        if op == OP_GET:
            keys, ptrs, sizes = parse_items(body, regions)
            return ST_OK, results(store.batch_get_into(keys, ptrs, sizes))
        if op == OP_EXISTS:
            return ST_OK, results(store.batch_is_exist(parse_keys(body, 0)))
        if op == OP_REMOVE:
            force = body[0] != 0
            keys = parse_keys(body, 1)
            # One request to the master for the whole list (same codes as `remove`): one
            # `remove` per key was a round trip each, and 1,024 of them on a loaded
            # machine outlasted the op timeout and degraded the pool.
            batch_remove = getattr(store, "batch_remove", None)
            if batch_remove is not None:
                return ST_OK, results(batch_remove(keys, force))
            return ST_OK, results([store.remove(k, force) for k in keys])
        if op == OP_RAW_BENCH:
            return ST_OK, json.dumps(raw_bench(store, regions, json.loads(body))).encode()
        return ST_BAD, f"unknown op {op}".encode()
    except (ValueError, KeyError, IndexError, struct.error, UnicodeDecodeError) as e:
        return ST_BAD, str(e).encode()
    except Exception as e:  # the client raised: answer, so one bad call never kills the helper
        log(f"op {op} raised {type(e).__name__}")
        return ST_BAD, f"{type(e).__name__}: {e}".encode()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--socket", required=True)
    p.add_argument("--master", required=True, help="host:port of mooncake_master")
    p.add_argument("--metadata", required=True, help="metadata server, e.g. http://host:port/metadata")
    p.add_argument("--hostname", default="127.0.0.1")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device", default="")
    p.add_argument("--segment-bytes", type=int, default=512 << 20)
    p.add_argument("--local-buffer-bytes", type=int, default=16 << 20)
    p.add_argument("--replicas", type=int, default=1, help="replicas of each object put")
    p.add_argument("--region", action="append", default=[], help="PATH:LENGTH, in region-id order")
    p.add_argument("--workers", type=int, default=8, help="requests run at once")
    p.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond those running")
    p.add_argument("--test-get-delay-ms", type=int, default=0, help="test only: wait before each get")
    args = p.parse_args()

    regions = []
    for spec in args.region:
        path, _, length = spec.rpartition(":")
        regions.append(Region(path, int(length)))
    state = Store(args, regions)
    threading.Thread(target=state.monitor, name="master-monitor", daemon=True).start()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(args.socket)
    log(f"serving {len(regions)} regions for master {args.master}")
    try:
        serve(conn, state, regions, args.workers, args.max_queued, args.test_get_delay_ms / 1000)
    except OSError as e:
        log(f"control socket failed: {e}")
    log("control socket closed; exiting")
    # Unmount our segment so the master stops placing objects in it, but never hang on a
    # dead master; the store's threads would keep the process alive, so leave with _exit.
    if state.store is not None:
        t = threading.Thread(target=state.store.close, daemon=True)
        t.start()
        t.join(2.0)
    os._exit(0)


if __name__ == "__main__":
    main()
