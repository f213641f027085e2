"""Bad input straight through the C ABI (the ``kvtier`` package's ctypes declarations):
each call gets its kvtier error code, and the process lives on.

    python3 ffi_bad_input.py --socket /run/kvtier.sock [--lib target/engine/libkvtier.so]

Uses the installed ``kvtier`` package, or the one in this checkout's ``python/``. Prints one
``case name code`` line per case and ``OK bad-input`` at the end.
"""

import argparse
import ctypes
import os
import sys
from pathlib import Path


def expect(name, want, rc, lib):
    msg = lib.kvtier_last_error().decode(errors="replace")
    assert rc == want, f"{name}: code {rc} ({msg}), want {want}"
    assert want == kv.OK or msg, f"{name}: no message"
    print(f"case {name} {rc}")


def main():
    global kv
    ap = argparse.ArgumentParser()
    ap.add_argument("--socket", required=True)
    ap.add_argument("--lib", help="a built libkvtier.so instead of the packaged one")
    args = ap.parse_args()
    if args.lib:
        os.environ["KVTIER_LIB"] = args.lib
    try:
        import kvtier
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
        import kvtier
    from kvtier import _capi as kv

    lib = kv.lib()
    hit = kv.PrefixHit()
    one = (1).to_bytes(8, "big")
    layout = kvtier.Layout(layers=4, kv_heads=4, head_dim=16, dtype_bytes=2, page_tokens=4)

    expect("null-handle", kv.ERR_NULL, lib.kvtier_lookup(None, one, 8, 1, ctypes.byref(hit)), lib)
    expect("null-options", kv.ERR_NULL, lib.kvtier_connect(None, ctypes.byref(ctypes.c_void_p())), lib)
    # 4 bytes short: no version of the struct has that size (each older one ends 8 bytes
    # before the next).
    opts = kv.ConnectOptions(ctypes.sizeof(kv.ConnectOptions) - 4, os.fsencode(args.socket), b"bad", b"m")
    expect("wrong-struct-size", kv.ERR_INVALID, lib.kvtier_connect(ctypes.byref(opts), ctypes.byref(ctypes.c_void_p())),
           lib)
    try:
        kvtier.Client(layout, socket=args.socket + ".absent", instance="bad", model="m")
        raise AssertionError("connected to a closed daemon")
    except kvtier.UnavailableError as e:
        expect("closed-daemon", kv.ERR_UNAVAILABLE, e.code, lib)

    with kvtier.Client(layout, socket=args.socket, instance="bad-input", model="bad-model") as c:
        c.handle = c.raw_handle
        c.register_emulated(4)
        expect("zero-length-batch", kv.ERR_EMPTY_BATCH, lib.kvtier_lookup(c.handle, None, 8, 0, ctypes.byref(hit)), lib)
        expect("null-hashes", kv.ERR_NULL, lib.kvtier_lookup(c.handle, None, 8, 3, ctypes.byref(hit)), lib)
        expect("bad-hash-length", kv.ERR_INVALID, lib.kvtier_lookup(c.handle, one, 5, 1, ctypes.byref(hit)), lib)
        slots = (ctypes.c_uint32 * 1)(0)
        receipt = kv.StoreReceipt()
        rc = lib.kvtier_store(c.handle, one * 2, 8, 2, slots, 1, b"", ctypes.byref(receipt))
        expect("mismatched-lengths", kv.ERR_LENGTH_MISMATCH, rc, lib)
        expect("bad-slot", kv.ERR_DEVICE, lib.kvtier_device_fill_page(c.handle, 99, 1), lib)
        expect("wrong-object-size", kv.ERR_DEVICE, lib.kvtier_device_write_object(c.handle, 0, 0, b"xx", 2), lib)
        # Engine tensors: default layout (4 layers, K and V) needs 8 addresses.
        ptrs = (ctypes.c_uint64 * 8)(*[(1 + i) << 20 for i in range(8)])
        reg = lib.kvtier_register_cuda_tensors
        expect("tensors-null", kv.ERR_NULL, reg(c.handle, 0, None, 8, 512, 16, 0), lib)
        expect("tensors-wrong-count", kv.ERR_LENGTH_MISMATCH, reg(c.handle, 0, ptrs, 7, 512, 16, 0), lib)
        expect("tensors-zero-stride", kv.ERR_INVALID, reg(c.handle, 0, ptrs, 8, 0, 16, 0), lib)
        # Still alive and serving after all that.
        assert c.lookup([1]) == (0, 0, 0)
    # A closed handle: the library answers, it never frees twice or reads freed memory.
    expect("double-close", kv.ERR_CLOSED, lib.kvtier_close(c.handle), lib)
    expect("use-after-close", kv.ERR_CLOSED, lib.kvtier_lookup(c.handle, one, 8, 1, ctypes.byref(hit)), lib)
    print("OK bad-input")
    return 0


if __name__ == "__main__":
    sys.exit(main())
