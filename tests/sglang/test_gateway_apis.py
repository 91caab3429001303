"""The gateway's APIs in front of real SGLang 0.5.23 (its default overlap scheduler) beyond what
``test_gateway_stamps`` covers, every stamp compared with recomputation
(``_stamp_truth.GroundTruth``):

* ``/generate`` at a temperature != 1 with top-k and input logprobs (SGLang scales the output
  rows by the temperature, never the input rows), ``routed_experts_start_len``, and
  ``meta_info.cached_tokens`` passed through from SGLang (a repeated prompt hits its radix
  cache);
* the exact old-logit strategies (``--old-logits model`` and ``interruption``) scoring with a
  real SGLang scorer engine across an ``abort_resume`` swap at temperature 0.7: every old
  logprob equals recomputation of the whole sequence under the token's ``policy_version``
  at that temperature (the definition of the sampled-token logprobs);
* OpenAI chat completions and an agent session with the checkpoint's own Hugging Face
  tokenizer and chat template (what SGLang loads): the prompt ids equal SGLang's
  tokenization, each model turn stamped exactly, context turns masked.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import numpy as np
import pytest
from _gateway_run import Run, assert_exact, client, disk, land_swap, prompt, sampling, spans_swap
from _stamp_truth import Report, Stamped, from_rollout, from_wire, rollout_chunks, sse

T_OLD = 0.7  # a temperature != 1: SGLang's input logprobs (what a scorer reads) are at T = 1


def metric(gw, name: str) -> float:
    text = httpx.get(gw.url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:_total)?(?:{{[^}}]*}})?\s+([-0-9.e+]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


# ---------------------------------------------------------------------------------------------
# 1. /generate fields


def test_generate_temperature_rows_routing_offset_and_cached_tokens(sglang, sglang_inc, serve,
                                                                    truth):
    """At temperature 0.6: output logprobs and their top-k scaled, input logprobs and their
    top-k at temperature 1 (plain answer from a cumulative server, stream of deltas from an
    incremental one), the routed rows from ``routed_experts_start_len``. A prompt sharing
    nothing with any other, sent twice: the second answer's ``cached_tokens`` is SGLang's
    radix-cache hit (> 0, at most the prompt less its last token), the first's 0."""
    g_cum, g_inc = serve(e0=sglang), serve(e0=sglang_inc)
    start = 5

    async def rows(gw, incremental: bool, base: int) -> Run:
        run = Run(gw, incremental)
        async with client(gw) as c:
            got = await run.generate(
                c, {"input_ids": prompt(base, 14), "return_logprob": True,
                    "top_logprobs_num": 3, "logprob_start_len": 0,
                    "return_routed_experts": True, "routed_experts_start_len": start,
                    "sampling_params": {"max_new_tokens": 10, "temperature": 0.6}},
                temperature=0.6, label=f"T0.6-{'inc' if incremental else 'cum'}",
                stream=incremental)
        for st in got:  # the answer's rows are positions start ..
            st.routed_start = st.routed_asked = start
        return run

    async def both():
        return await asyncio.gather(rows(g_cum, False, 1000), rows(g_inc, True, 1001))

    runs = asyncio.run(both())
    rep = Report()
    for run in runs:
        rep.add(truth.check_all(run.items, (0,), engines={"e0"}))
        st = run.items[0]
        assert st.rows.shape[0] == st.p + st.n - 1 - start, st.rows.shape
        assert st.top is not None and st.input_top is not None and st.input_lp is not None

    fresh = prompt(1002, 20, bos=False)
    body = {"input_ids": fresh, "sampling_params": sampling(6)}
    with httpx.Client(base_url=g_cum.url, timeout=120) as c:
        first = c.post("/generate", json=body).json()["meta_info"]
        second = c.post("/generate", json=body).json()["meta_info"]
    assert first["cached_tokens"] == 0, first
    assert 0 < second["cached_tokens"] <= len(fresh) - 1, second
    rep.notes.insert(0, f"cached_tokens: first {first['cached_tokens']}, repeat "
                        f"{second['cached_tokens']} of a {len(fresh)}-token prompt")
    assert_exact(rep, "/generate at T 0.6, routed from 5, cached_tokens", g_cum, g_inc)


# ---------------------------------------------------------------------------------------------
# 2. exact old logits with a real SGLang scorer


def recomputed_old(truth, st: Stamped, temperature: float) -> np.ndarray:
    """log p(token | prompt, earlier tokens) with the whole sequence under the token's
    ``policy_version``, at ``temperature`` (the behavior logprobs' definition)."""
    import torch

    from reference_engine.model import KVCache
    from reference_engine.sampling import scaled_logprobs

    ids = torch.tensor(st.prompt + st.out, dtype=torch.long)
    p, n = st.p, st.n
    out = np.full(n, np.nan)
    for v in sorted(set(st.policy_version.tolist())):
        m = truth.model_of(str(v))
        o = m.forward_chunks([ids], [KVCache()])
        logp = scaled_logprobs(m.logits(o.hidden)[p - 1:p + n - 1],
                               torch.full((n,), float(temperature)))
        vals = logp.gather(1, torch.tensor(st.out)[:, None])[:, 0].numpy()
        sel = st.policy_version == v
        out[sel] = vals[sel]
    return out


@pytest.mark.parametrize("mode", ["model", "interruption"])
def test_old_logits_scored_by_sglang_match_recomputation(mode, sglang, sglang_inc, serve, truth,
                                                         sglang_checkpoints):
    """Generation on ``sglang`` (e0), old logits scored by ``sglang_inc`` (the scorer, outside
    the pool, starting at v0); rollouts at temperature 0.7 streaming across an abort_resume
    swap v0 -> v1, one more after it. ``model``: every finished trajectory re-scored under
    each token's version; ``interruption``: the partial rollouts scored at the swap under v0,
    the tails at finish under v1. Every old logprob equals recomputation under its token's
    version at 0.7 (1e-4), and differs from the temperature-1 value (the scorer's raw input
    logprobs); the behavior stamps are exact."""
    gw = serve(env={"ROLLOUT_GATEWAY_OLD_LOGITS__MODE": mode,
                    "ROLLOUT_GATEWAY_OLD_LOGITS__SCORER_URL": sglang_inc.url,
                    "ROLLOUT_GATEWAY_OLD_LOGITS__INITIAL_SOURCE":
                        str(sglang_checkpoints.path(0))}, e0=sglang)
    run = Run(gw)
    raw: dict[str, dict] = {}  # label -> the trajectory as JSON (old_logprobs)

    async def stream(c, ids, label, n_new):
        key = (label, "rollouts")
        keys = [(key, i) for i in range(2)]
        for k in keys:
            run.gate.register(k)
        body = {"input_ids": ids, "n": 2, "sampling_params": sampling(n_new, T_OLD)}

        def on_event(ev):
            if ev.get("type") == "chunk":
                run.gate.hit((key, ev["sample_index"]))
        events = await sse(c, "/v1/rollouts", body, on_event)
        assert not [e for e in events if e.get("type") == "error"], events[-3:]
        for e in events:
            if e["type"] == "trajectory":
                i = e["sample_index"]
                lab = f"{label}[{i}]"
                raw[lab] = e["trajectory"]
                run.items.append(from_rollout(e["trajectory"], T_OLD, lab,
                                              rollout_chunks(events, i)))

    async def go():
        async with client(gw) as c:
            rec, v = await land_swap(
                run, c, lambda k, n_new: [stream(c, prompt(1100 + 40 * (k - 1) + j),
                                                 f"{mode}{j}.r{k}", n_new) for j in range(2)],
                lambda k: disk(sglang_checkpoints, k, "abort_resume"))
            got = await c.post("/v1/rollouts", json={"input_ids": prompt(1125), "n": 1,
                                                     "sampling_params": sampling(8, T_OLD)})
            assert got.status_code == 200, got.text
            t = got.json()["trajectories"][0]
            raw[f"{mode}-after"] = t
            run.items.append(from_rollout(t, T_OLD, f"{mode}-after"))
            return rec, v

    rec, v = asyncio.run(go())
    rep = truth.check_all(run.items, tuple(range(v + 1)), engines={"e0"},
                          began_at_switch={"abort_resume"})
    assert spans_swap(rep), rep.summary("no trajectory spans the swap")
    bad, checked, moved = [], 0, 0.0
    for st in run.items:
        t = raw[st.label]
        assert "old_logits_error" not in t.get("metadata", {}), t["metadata"]
        old = t.get("old_logprobs")
        assert old is not None and len(old) == st.n, (st.label, old)
        old = np.array(old, np.float64)
        want = recomputed_old(truth, st, T_OLD)
        at_one = recomputed_old(truth, st, 1.0)
        checked += st.n
        moved = max(moved, float(np.abs(want - at_one).max()))
        off = np.flatnonzero(np.abs(old - want) > truth.tol)
        if off.size:
            bad.append(f"{st.label}: old logprobs at {off.tolist()} off by up to "
                       f"{np.abs(old - want).max():.2e} (pv {st.policy_version.tolist()}); "
                       f"vs T=1 values off by {np.abs(old - at_one).max():.2e}")
    rep.checked["old_logprobs"] += checked
    rep.miss("old_logprobs", len(bad), "; ".join(bad) if bad else None)
    assert moved > 1e-3, "temperature 0.7 does not move the old logprobs: the check is vacuous"
    if mode == "interruption":  # the partial rollouts were scored at the swap, under v0
        assert metric(gw, "rollout_gateway_old_logits_tokens_at_swaps") > 0
    rep.notes.insert(0, f"swap abort_resume: {rec['_took_s']:.2f}s; {checked} old logprobs "
                        f"checked at T {T_OLD}")
    assert_exact(rep, f"old logits ({mode}) by an SGLang scorer ({len(run.items)} "
                      f"trajectories)", gw)


# ---------------------------------------------------------------------------------------------
# 3. OpenAI chat and agent sessions with the checkpoint's tokenizer


def model_turns(r, temperature: float) -> list[Stamped]:
    """Each model turn of a session trajectory as its own sample: prompt = everything
    before it, output = the turn (the stamps, rows and entropies of those tokens)."""
    whole = from_wire(r, temperature, r.trajectory_id)
    out = []
    for tr in r.turns:
        if tr.kind != "model":
            continue
        a, b = tr.start, tr.end
        pv = whole.policy_version[a:b]
        rows = None if whole.rows is None else whole.rows[:whole.p + b - 1 - whole.routed_start]
        out.append(Stamped(
            label=f"{r.trajectory_id} turn {tr.index}", prompt=whole.prompt + whole.out[:a],
            out=whole.out[a:b], logprobs=whole.logprobs[a:b], policy_version=pv,
            kv_version=whole.kv_version[a:b],
            segments=[{"start": 0, "end": b - a, "policy_version": int(pv[0]),
                       "engine_id": "e0", "began": "start", "ended": "finished"}],
            temperature=temperature, entropy=whole.entropy[a:b],
            entropy_bound=whole.entropy_bound, rows=rows, routed_start=whole.routed_start))
    return out


def test_chat_and_session_through_the_checkpoint_tokenizer(sglang, serve, truth,
                                                           sglang_checkpoints):
    """The gateway with ``chat_template`` = the checkpoint directory (the HF byte tokenizer and
    chat template SGLang itself loads). A single chat call and a two-turn session
    (temperature 0.7), the session ended with a reward; both pulled over gRPC. The single
    call's prompt ids equal SGLang's own tokenization of the rendered conversation; every
    model token of both is stamped exactly; the session's context tokens carry loss mask 0
    and logprob 0."""
    import jinja2
    from _sglang_support import CHAT_TEMPLATE
    from learner_client import TrajectoryClient

    ck = str(sglang_checkpoints.path(0))
    gw = serve(env={"ROLLOUT_GATEWAY_CHAT_TEMPLATE": ck}, e0=sglang)
    user = [{"role": "user", "content": "Tell me about bytes."}]
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        one = c.post("/v1/chat/completions", json={"messages": user, "max_tokens": 8,
                                                    "temperature": T_OLD, "logprobs": True})
        assert one.status_code == 200, one.text
        t1 = c.post("/v1/chat/completions", json={"messages": user, "max_tokens": 8,
                                                   "temperature": T_OLD, "session_id": "s1"})
        assert t1.status_code == 200, t1.text
        reply = t1.json()["choices"][0]["message"]["content"]
        follow = user + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "And more?"}]
        t2 = c.post("/v1/chat/completions", json={"messages": follow, "max_tokens": 8,
                                                   "temperature": T_OLD, "session_id": "s1"})
        assert t2.status_code == 200, t2.text
        end = c.post("/v1/sessions/s1/end", json={"reward": 1.0})
        assert end.status_code == 200, end.text
    got = []
    with TrajectoryClient(gw.grpc_target, group="chat", learner_version=0, max_lag=4) as lc:
        lc.create_group()
        deadline = time.monotonic() + 60
        while len(got) < 2 and time.monotonic() < deadline:
            got += lc.pull(2 - len(got), timeout=10)
        lc.ack(got)
    assert len(got) == 2, [r.trajectory_id for r in got]
    session = next(r for r in got if r.metadata.get("session_id") == "s1")
    single = next(r for r in got if r is not session)
    assert single.metadata.get("session_ended_by") == "single_call", single.metadata

    # SGLang's own tokenization of the conversation (the checkpoint's template, rendered as
    # transformers renders it: trim_blocks, lstrip_blocks)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(CHAT_TEMPLATE).render(messages=user, tools=None,
                                                 add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nTell me about bytes.<|eos|>\n<|assistant|>\n", text
    r = httpx.post(sglang.url + "/generate", timeout=60, json={
        "text": text, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1}})
    sg_ids = [row[1] for row in r.json()["meta_info"]["input_token_logprobs"]]
    assert single.prompt_token_ids.tolist() == sg_ids
    assert session.prompt_token_ids.tolist() == sg_ids

    alone = model_turns(single, T_OLD) if single.turns else [from_wire(single, T_OLD, "chat")]
    assert len(alone) == 1
    turns = model_turns(session, T_OLD)
    assert len(turns) == 2, session.turns
    rep = truth.check_all(alone + turns, (0,), engines={"e0"})
    mask = session.loss_mask.astype(bool)
    ctx = ~mask
    assert ctx.any() and mask.any()
    assert np.all(session.logprobs[ctx] == 0), session.logprobs[ctx]
    assert_exact(rep, "chat + a 2-turn session with the checkpoint's tokenizer", gw)
