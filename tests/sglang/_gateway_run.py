"""Driving the gateway in front of real SGLang from a test: prompts, requests (every route, plain
and streamed) converted to :class:`_stamp_truth.Stamped`, swaps landed mid-generation, and the
exactness assertion. Shared by the ``test_gateway_*`` files of this directory."""

from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
from _stamp_truth import (
    ChunkGate,
    GatewayServe,
    Report,
    from_generate,
    from_rollout,
    generate_chunks,
    post_json,
    rollout_chunks,
    sse,
)

from reference_engine.tokenizer import BOS_ID, ByteTokenizer

TOK = ByteTokenizer()
NEW = 24  # output tokens per sample of a swap test (10-35 tok/s each under overlap)
SWAP_AFTER = 2  # chunks every stream has delivered (so each is decoding) before the swap


def prompt(seed: int, length: int = 12, bos: bool = True) -> list[int]:
    """A prompt of its own: ``<|bos|>`` (shared by every prompt, as in real use) then a byte
    no other prompt of the test has; ``bos=False``: no prefix shared with any other."""
    rng = np.random.default_rng(seed)
    head = [BOS_ID] if bos else []
    body = [33 + seed % 90] + [int(x) for x in rng.integers(32, 127, length - 1 - len(head))]
    return head + body


def sampling(n_new: int = NEW, temperature: float = 1.0) -> dict:
    return {"max_new_tokens": n_new, "temperature": temperature, "ignore_eos": True}



def assert_exact(rep: Report, title: str, *gateways: GatewayServe) -> None:
    print("\n" + rep.summary(title))
    logs = "".join(f"\n--- {gw.log_path} (tail)\n{gw.log_tail(3000)}" for gw in gateways)
    assert rep.total == 0, rep.summary(title) + logs


def disk(ckpts, version: int, mode: str, **kw) -> dict:
    return {"version": version, "source": {"kind": "disk", "path": str(ckpts.path(version))},
            "mode": mode, **kw}


# ---------------------------------------------------------------------------------------------
# scenarios (asyncio: streams are read while other calls are made)


class Run:
    """Requests against one gateway, their answers converted to :class:`Stamped`."""

    def __init__(self, gw: GatewayServe, incremental: bool = False) -> None:
        self.gw = gw
        self.incremental = incremental
        self.gate = ChunkGate()
        self.items = []

    async def rollout(self, c, ids, *, n=1, temperature=1.0, n_new=NEW, label="", **extra):
        body = {"input_ids": ids, "n": n, "sampling_params": sampling(n_new, temperature),
                **extra}
        got = await post_json(c, "/v1/rollouts", body)
        out = [from_rollout(t, temperature, f"{label}/rollouts[{i}]")
               for i, t in enumerate(got["trajectories"])]
        assert len(out) == n
        self.items += out
        return out

    async def rollout_stream(self, c, ids, *, n=1, temperature=1.0, n_new=NEW, label="",
                             gated=True, **extra):
        key = (label, "rollouts")
        keys = [(key, i) for i in range(n)]
        if gated:
            for k in keys:
                self.gate.register(k)
        body = {"input_ids": ids, "n": n, "sampling_params": sampling(n_new, temperature),
                **extra}

        def on_event(ev):
            if ev.get("type") == "chunk":
                self.gate.hit((key, ev["sample_index"]), ev.get("engine_id"))
        events = await sse(c, "/v1/rollouts", body, on_event)
        errors = [e for e in events if e.get("type") == "error"]
        assert not errors, errors
        trajs = {e["sample_index"]: e["trajectory"] for e in events if e["type"] == "trajectory"}
        assert sorted(trajs) == list(range(n)), events[-3:]
        out = [from_rollout(trajs[i], temperature, f"{label}/rollouts-stream[{i}]",
                            rollout_chunks(events, i)) for i in range(n)]
        self.items += out
        return out

    async def generate(self, c, body, *, temperature=1.0, label="", stream=False, gated=False):
        body = {**body, "sampling_params": {**sampling(NEW, temperature),
                                            **body.get("sampling_params", {})}}
        ids = body.get("input_ids")
        start = body.get("logprob_start_len", -1)
        if not stream:
            got = await post_json(c, "/generate", body)
            outs = got if isinstance(got, list) else [got]
            res = [from_generate(o, ids, temperature, f"{label}/generate[{k}]",
                                 logprob_start_len=start) for k, o in enumerate(outs)]
        else:
            key = (label, "generate")
            if gated:
                self.gate.register(key)
            events = await sse(c, "/generate", body, lambda ev: self.gate.hit(key))
            n = body.get("sampling_params", {}).get("n", 1)
            res = []
            for k in range(n):
                idx = k if n > 1 else None
                mine = [e for e in events if idx is None or e.get("index") == idx]
                final = mine[-1]
                assert final["meta_info"]["finish_reason"] is not None, final
                if self.incremental:  # deltas: the answer is their concatenation
                    final = merge_incremental(mine)
                res.append(from_generate(final, ids, temperature,
                                         f"{label}/generate-stream[{k}]",
                                         generate_chunks(mine[:-1], idx, self.incremental),
                                         logprob_start_len=start))
        self.items += res
        return res


_PER_TOKEN = ("output_token_logprobs", "output_top_logprobs", "output_token_entropy",
              "policy_versions", "kv_versions")


def merge_incremental(events: list[dict]) -> dict:
    """The whole answer from an incremental ``/generate`` stream (per-token lists are deltas;
    the last event carries the rest and every per-request field)."""
    last = events[-1]
    meta = dict(last["meta_info"])
    ids = []
    per = {k: [] for k in _PER_TOKEN}
    for e in events:
        ids += list(e["output_ids"])
        for k in _PER_TOKEN:
            if e["meta_info"].get(k) is not None:
                per[k] += list(e["meta_info"][k])
    for k in _PER_TOKEN:
        if per[k] or k in meta:
            meta[k] = per[k]
    assert meta["completion_tokens"] == len(ids), (meta["completion_tokens"], len(ids))
    return {**last, "output_ids": ids, "meta_info": meta}


def client(gw: GatewayServe) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=gw.url, timeout=httpx.Timeout(300.0, connect=10.0))


async def swap_mid_generation(run: Run, c: httpx.AsyncClient, streams, swap_body: dict) -> dict:
    """Start ``streams`` (coroutines from ``run``), wait until every gated stream delivered
    ``SWAP_AFTER`` chunks, post the swap and wait for the streams. Returns the swap's answer,
    with the round's timings (seconds from the streams' start): ``_posted_s`` (the swap
    posted), ``_took_s`` (the swap's own time), ``_streams_s`` (the first stream done)."""
    t_start = time.monotonic()
    tasks = [asyncio.create_task(s) for s in streams]
    ended: list[float] = []  # when each stream ended
    for t in tasks:
        t.add_done_callback(lambda _: ended.append(time.monotonic()))
    waiter = asyncio.create_task(run.gate.wait(SWAP_AFTER))
    done, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if waiter not in done:  # a stream ended (or failed) before the others were under way
        for t in done:
            t.result()  # a failed stream fails the test
        # on a loaded machine a short stream can end before another one started: swap
        # now anyway (land_swap runs another round if no trajectory straddles the swap)
        waiter.cancel()
    t0 = time.monotonic()
    r = await c.post("/v1/weights", json=swap_body)
    swap_s = time.monotonic() - t0
    if r.status_code != 200:
        raise AssertionError(f"swap {swap_body} answered {r.status_code}: {r.text}\n"
                             f"engines: {(await c.get('/v1/engines')).text}\n"
                             f"gateway log ({run.gw.log_path}):\n{run.gw.log_tail(4000)}")
    rec = r.json()
    assert rec["status"] == "succeeded", rec
    await asyncio.gather(*tasks)
    rec["_posted_s"], rec["_took_s"] = t0 - t_start, swap_s
    rec["_streams_s"] = min(ended) - t_start
    return rec


#: the longest samples a retried round asks for (SGLang's context and the truth check's time)
MAX_ROUND_TOKENS = 768


def next_round_tokens(n_new: int, rec: dict) -> int:
    """Output tokens per sample for the round after one whose swap reached the engines after
    its streams ended: what a stream generates (at the rate the last round's fastest did,
    from start to end) over the time from the streams' start to the swap's end, twice over,
    and at least double the last round's. Measured, so a loaded machine gets longer streams
    rather than the same race again."""
    rate = n_new / max(rec["_streams_s"], 1e-3)  # tokens per second of the fastest stream
    need = 2 * rate * (rec["_posted_s"] + rec["_took_s"])
    return min(MAX_ROUND_TOKENS, max(2 * n_new, int(need) + 1))


async def land_swap(run: Run, c: httpx.AsyncClient, streams_for, body_for, *,
                    n_new: int = NEW, tries: int = 3, straddle: bool = True
                    ) -> tuple[dict, int]:
    """Rounds of :func:`swap_mid_generation` (round ``k``: ``streams_for(k, n_new)``, samples
    of ``n_new`` output tokens, the swap to version ``k`` ``body_for(k)``) until one lands
    mid-generation: a trajectory of the round stamped with both versions. A loaded machine
    can deliver a swap after every stream ended: the next round's samples are then as long
    as the last round's timings say they must be (:func:`next_round_tokens`). The truth check
    afterwards covers every round. Returns (the last swap's answer, its version)."""
    for k in range(1, tries + 1):
        before = len(run.items)
        rec = await swap_mid_generation(run, c, streams_for(k, n_new), body_for(k))
        landed = any(len(set(st.policy_version.tolist())) > 1 for st in run.items[before:])
        print(f"swap round {k}: {n_new} tokens per sample; swap posted at "
              f"{rec['_posted_s']:.2f}s, took {rec['_took_s']:.2f}s; first stream ended at "
              f"{rec['_streams_s']:.2f}s; {'a' if landed else 'no'} sample spans it")
        if not straddle or landed:
            break
        n_new = next_round_tokens(n_new, rec)
    return rec, k


def spans_swap(rep: Report) -> list[str]:
    return [b["label"] for b in rep.boundaries if b["versions"] > 1]
