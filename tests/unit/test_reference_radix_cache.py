"""The reference engine's radix cache and overlap emulation, driven step by step in-process.

Every number is checked against recomputation through the reference model
(``reference_engine.reference``): a cached prefix keeps the KV (and routing rows) of whatever
weights computed it, exactly as SGLang 0.5.23's radix cache does.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from reference_engine.checkpoint import build_model
from reference_engine.config import ModelConfig
from reference_engine.radix_cache import RadixCache
from reference_engine.reference import score, score_mixed
from reference_engine.request import GenParams, Request
from reference_engine.scheduler import Scheduler

torch.set_num_threads(1)
CFG = ModelConfig()
P = [256, *b"a shared prompt"]


@pytest.fixture(scope="module")
def models():
    return {1: build_model(CFG, 1), 2: build_model(CFG, 2)}


def sched(models, **kw) -> Scheduler:
    m = build_model(CFG, 1)  # its own copy: swaps load into it
    return Scheduler(m, "0", **kw)


def submit(s: Scheduler, rid: str, prompt: list[int], n: int, **params) -> Request:
    params.setdefault("temperature", 0.0)
    params.setdefault("ignore_eos", True)
    r = Request(rid, list(prompt), GenParams(max_new_tokens=n, return_logprob=True, **params),
                CFG.num_hidden_layers, CFG.num_experts_per_tok)
    r.listeners.append(asyncio.Queue())
    s.submit(r)
    return r


async def drain(s: Scheduler) -> None:
    while s.waiting or s.running or s._inflight:
        await s.iteration()


async def swap(s: Scheduler, models, version: str = "1", flush: bool = False):
    state = {k: v.clone() for k, v in models[2].state_dict().items()}
    return await s.load_named(lambda: state, version, flush, complete=True)


def lps(r: Request) -> np.ndarray:
    return np.array(r.out_logprobs, dtype=np.float64)


# ---------------------------------------------------------------------- the tree itself
def _vals(tokens):
    n = len(tokens)
    kv = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1, 1).expand(2, 2, n, 1, 1).clone()
    return kv, np.arange(n, dtype=np.int32).reshape(n, 1, 1)


def test_tree_keeps_oldest_values_and_splits_on_match():
    t = RadixCache(1000)
    kv, ro = _vals([1, 2, 3, 4])
    assert t.insert([1, 2, 3, 4], kv, ro)[0] == 0
    kv2 = kv + 100
    have, node = t.insert([1, 2, 9], kv2[:, :, :3], ro[:3] + 100)
    assert have == 2 and t.size == 5
    got, _ = t.values(node)
    assert got[0, 0, :, 0, 0].tolist() == [0, 1, 102]  # cached values kept, suffix added
    m, node = t.match([1, 2, 3, 4, 5], limit=3)
    assert m == 3 and node.key == [3]  # split at the limit
    assert t.values(node)[1][:, 0, 0].tolist() == [0, 1, 2]
    assert t.match([7], 1)[0] == 0 and t.match([1, 2], 0)[0] == 0


def test_tree_evicts_lru_unlocked_leaves_only():
    t = RadixCache(1000)
    for i, toks in enumerate(([1, 1, 1], [2, 2, 2], [3, 3, 3])):
        t.insert(toks, *_vals(toks))
    t.match([2, 2, 2], 3)  # touched last; [1..] is the least recently used
    assert t.evict(1) == 3 and t.match([1, 1, 1], 3)[0] == 0
    t.lock(t.match([3, 3, 3], 3)[1])
    assert t.evict(100) == 3  # only [2..] could go; [3..] is locked
    assert t.match([3, 3, 3], 3)[0] == 3 and t.size == 3
    t.reset()
    assert t.size == 0 and t.match([3, 3, 3], 3)[0] == 0


# ---------------------------------------------------------------------- cached_tokens rules
async def test_cached_tokens_follow_sglang_rules(models):
    s = sched(models, radix_cache=True)
    a = submit(s, "a", P, 6)
    await drain(s)
    assert a.cached_tokens == 0 and s.tree.size == len(P) + 5  # last token never forwarded
    b = submit(s, "b", P, 6)  # same prompt: all but the last token (always recomputed)
    c = submit(s, "c", P + a.output + [7, 8], 4)  # a follow-up turn
    d = submit(s, "d", P, 3, logprob_start_len=4)  # input logprobs cap the match
    await drain(s)
    assert (b.cached_tokens, c.cached_tokens, d.cached_tokens) == (len(P) - 1, len(P) + 5, 4)
    assert b.output == a.output
    np.testing.assert_allclose(lps(b), lps(a), atol=1e-5)
    ref = score(models[1], P, 5)
    np.testing.assert_allclose(d.input_logprobs[1:], ref.logprobs, atol=1e-5)
    ref_c = score(models[1], c.prompt + c.output, len(c.prompt))
    np.testing.assert_allclose(lps(c), ref_c.logprobs, atol=1e-5)
    np.testing.assert_array_equal(c.routed[:len(c.prompt) + 3], ref_c.routed_experts)
    off = sched(models)  # radix cache off: nothing is ever cached
    e = submit(off, "e", P, 2)
    f = submit(off, "f", P, 2)
    await drain(off)
    assert (e.cached_tokens, f.cached_tokens, off.tree) == (0, 0, None)


@pytest.mark.parametrize("overlap", [False, True])
async def test_stopped_request_caches_its_last_token_only_under_overlap(models, overlap):
    """SGLang's overlap loop forwards a request once more before it sees the stop (the result
    comes one batch late), so the stop token's KV is committed and cached; a length finish is
    skipped (``_reqs_finishing_inflight``) and the last token never gets KV."""
    s = sched(models, radix_cache=True, overlap=overlap)
    probe = submit(s, "probe", P, 4)
    await drain(s)
    s.flush_cache()
    r = submit(s, "r", P, 10, ignore_eos=False, stop_token_ids=[probe.output[2]])
    await drain(s)
    assert r.finish == {"type": "stop", "matched": probe.output[2]} and len(r.output) == 3
    follow = submit(s, "f", P + r.output + [9], 2)
    await drain(s)
    assert follow.cached_tokens == len(P) + 3 - (0 if overlap else 1)


async def test_retracted_request_reuses_cache_but_adds_no_cached_tokens(models):
    s = sched(models, radix_cache=True)
    submit(s, "a", P, 3)
    await drain(s)
    r = submit(s, "r", P, 8)
    for _ in range(4):
        await s.iteration()
    await s.pause("retract")
    await s.resume()
    await drain(s)
    assert r.num_retractions == 1 and r.cached_tokens == len(P) - 1
    ref = score(models[1], P + r.output, len(P))
    np.testing.assert_allclose(lps(r), ref.logprobs, atol=1e-5)


async def test_eviction_under_max_total_tokens(models):
    s = sched(models, radix_cache=True, max_total_tokens=64)
    p1, p2 = [256, *range(1, 40)], [257, *range(100, 139)]
    for rid, p, cached in (("a", p1, 0), ("b", p2, 0), ("c", p1, 0), ("d", p1, 39)):
        r = submit(s, rid, p, 4)
        await drain(s)
        assert r.cached_tokens == cached, rid
        assert s.tree.size <= 64


# ---------------------------------------------------------------------- weights and old KV
async def test_in_place_swap_leaves_old_kv_in_the_cache(models):
    """After pause(in_place) + update(flush_cache=false) + continue, a request sharing the
    prefix reuses the old-weight KV (and routing rows); the last prompt position is
    recomputed under the new weights for the first token, then redirected to the tree's old
    copy for every later token (SGLang ``RadixCache.checkpoint``)."""
    s = sched(models, radix_cache=True)
    a = submit(s, "a", P, 6)
    await drain(s)
    await s.pause("in_place")
    assert (await swap(s, models))[0] is True
    await s.resume()
    b = submit(s, "b", P, 6)
    c = submit(s, "c", P + a.output + [3], 4)
    await drain(s)
    old, new, n = models[1], models[2], len(P)
    first = score_mixed(old, new, P + b.output, n - 1, n)  # position n-1 recomputed, new
    later = score_mixed(old, new, P + b.output, n, n)  # ... then the tree's old KV there
    assert b.cached_tokens == n - 1
    np.testing.assert_allclose(lps(b)[:1], first.logprobs[:1], atol=1e-5)
    np.testing.assert_allclose(lps(b)[1:], later.logprobs[1:], atol=1e-5)
    np.testing.assert_array_equal(b.routed[:n + 5], later.routed_experts)
    assert np.abs(lps(b)[1:] - first.logprobs[1:]).max() > 1e-3  # the redirect is visible
    k = c.cached_tokens
    assert k == n + 5
    mixed = score_mixed(old, new, c.prompt + c.output, k, len(c.prompt))
    np.testing.assert_allclose(lps(c), mixed.logprobs, atol=1e-5)
    np.testing.assert_array_equal(c.routed[:len(c.prompt) + 3], mixed.routed_experts)
    # a flush drops the old KV: then everything is computed by the new weights
    assert s.flush_cache() and s.tree.size == 0
    d = submit(s, "d", P, 4)
    await drain(s)
    assert d.cached_tokens == 0
    np.testing.assert_allclose(lps(d), score(new, P + d.output, n).logprobs, atol=1e-5)


async def test_update_flushes_the_cache_only_when_nothing_is_resident(models):
    s = sched(models, radix_cache=True)
    submit(s, "a", P, 3)
    await drain(s)
    assert await swap(s, models, "1", flush=True) == (
        True, "Succeeded to update model weights. Weight version updated to 1.")
    assert s.tree.size == 0 and s.served_version == "1"
    r = submit(s, "r", P, 20)
    for _ in range(3):
        await s.iteration()
    await s.pause("in_place")
    ok, msg = await swap(s, models, "2", flush=True)
    assert not ok and "cache was not flushed" in msg and s.tree.size > 0
    assert s.weight_version == "2" and s.served_version == "1"  # /model_info keeps "1"
    await s.pause("retract")  # retracted requests hold no KV: a flush succeeds
    assert s.flush_cache() and s.tree.size == 0
    await s.resume()
    await drain(s)
    assert r.finished


# ---------------------------------------------------------------------- overlap scheduler
@pytest.mark.parametrize("overlap", [False, True])
async def test_in_place_boundary_is_one_token_late_under_overlap(models, overlap):
    s = sched(models, overlap=overlap, separate_prefill=True)
    r = submit(s, "r", P, 12)
    for _ in range(6):
        await s.iteration()
    await s.pause("in_place")
    k = r.n_pub  # what a client has seen
    assert k == (5 if overlap else 6)
    await swap(s, models)
    await s.resume()
    await drain(s)
    spans = r.final_spans
    assert spans == [{"version": "0", "start": 0, "end": k},
                     {"version": "1", "start": k, "end": 12}]
    n = len(P)
    switch = n + k if overlap else n + k - 1  # first position the new weights computed
    mixed = score_mixed(models[1], models[2], P + r.output, switch, n)
    np.testing.assert_allclose(lps(r), mixed.logprobs, atol=1e-5)
    np.testing.assert_array_equal(r.routed[:n + 11], mixed.routed_experts)
    labelled = score_mixed(models[1], models[2], P + r.output, n + k - 1, n)
    assert bool(np.abs(lps(r) - labelled.logprobs).max() > 1e-3) == overlap


async def test_overlap_lag_hits_only_the_in_flight_batch(models):
    """SGLang runs a prefill batch before decoding (scheduler.py 3991-3993): when the batch
    in flight at the pause is a new request's prefill, that request lags (its prompt and first
    token are old, its spans all new) and the running ones do not."""
    s = sched(models, overlap=True, separate_prefill=True)
    a = submit(s, "a", P, 10)
    for _ in range(4):
        await s.iteration()
    b = submit(s, "b", [256, *b"late"], 6)
    await s.iteration()  # b's prefill launched; a's last decode processed
    await s.pause("in_place")
    ka, kb = a.n_pub, b.n_pub
    assert kb == 0 and ka == len(a.output)
    await swap(s, models)
    await s.resume()
    await drain(s)
    assert b.final_spans == [{"version": "1", "start": 0, "end": 6}]
    nb = len(b.prompt)
    mixed_b = score_mixed(models[1], models[2], b.prompt + b.output, nb, nb)
    np.testing.assert_allclose(lps(b), mixed_b.logprobs, atol=1e-5)
    na = len(P)
    mixed_a = score_mixed(models[1], models[2], P + a.output, na + ka - 1, na)  # exact
    np.testing.assert_allclose(lps(a), mixed_a.logprobs, atol=1e-5)


async def test_flush_refused_while_a_result_is_unprocessed(models):
    s = sched(models, radix_cache=True, overlap=True)
    r = submit(s, "r", P, 2)
    await s.iteration()
    await s.iteration()  # both tokens computed; the last result not processed yet
    assert r.stopping and not r.finished
    await s.pause("in_place")
    assert not s.flush_cache()
    await s.resume()
    await drain(s)
    assert r.finished and s.flush_cache()
