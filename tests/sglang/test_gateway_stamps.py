"""The gateway as users start it (``rollout-gateway serve --engine e0=<SGLang url>``) in front of
the real SGLang 0.5.23 server (its default overlap scheduler), every stamp of every trajectory
compared with recomputation under each version's weights (``_stamp_truth.GroundTruth``: which
weights computed each token and which KV it attended to, found from the sampled tokens' logprobs
alone, never from the stamps).

Counted per test, each asserted to be 0: tokens no recomputation explains, ``policy_version``,
``kv_version``, logprobs against recomputation under the stamped versions (1e-4), routed-experts
rows (prompt and output: the routing of the forward that sampled from each position), segments
(tiling, one true version each, a boundary and the swap's transition at every true switch),
entropy within its stated bound, top-k and input logprobs where asked, and the stamps of every
streamed chunk.

Servers: ``sglang`` (SGLang's defaults: overlap scheduler, cumulative streams; restored to v0 by
its fixture) and ``sglang_inc`` (the same plus ``--incremental-streaming-output``, the launch
docs/gateway.md documents; restored here). A fresh gateway per test (its learner version starts
at 0 each time); swaps go through ``POST /v1/weights`` while rollouts stream, landed after every
stream has delivered its first chunks.
"""

from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest
from _gateway_run import (
    NEW,
    TOK,
    Run,
    assert_exact,
    client,
    disk,
    land_swap,
    prompt,
    sampling,
    spans_swap,
)
from _stamp_truth import GatewayServe, GroundTruth, Report, from_wire

# ---------------------------------------------------------------------------------------------
# 1. no swap: every route, stream kind and option


def test_every_route_stamped_exactly(sglang, sglang_inc, serve, truth):
    """``/v1/rollouts`` (n > 1; plain and streamed) and ``/generate`` (plain, streamed: cumulative
    from a default server, deltas from an ``--incremental-streaming-output`` one; top-k; input
    logprobs from ``logprob_start_len``; routed experts for prompt and output; a text prompt
    through SGLang's tokenizer; ``sampling_params.n``)."""
    g_cum, g_inc = serve(e0=sglang), serve(e0=sglang_inc)

    async def on(gw: GatewayServe, incremental: bool, base: int) -> Run:
        run = Run(gw, incremental)
        tag = "inc" if incremental else "cum"
        async with client(gw) as c:
            await asyncio.gather(
                run.rollout(c, prompt(base + 1), n=3, n_new=16, label=tag),
                run.rollout_stream(c, prompt(base + 2), n=2, n_new=16, temperature=0.7,
                                   label=tag, gated=False),
                run.generate(c, {"input_ids": prompt(base + 3), "return_logprob": True,
                                 "top_logprobs_num": 3, "logprob_start_len": 0,
                                 "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 12}}, label=tag),
                run.generate(c, {"input_ids": prompt(base + 4, 14), "return_logprob": True,
                                 "top_logprobs_num": 2, "logprob_start_len": 5,
                                 "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 12}},
                             label=tag, stream=True),
                run.generate(c, {"text": f"The quick brown fox {tag}", "return_logprob": True,
                                 "logprob_start_len": 0, "return_routed_experts": True,
                                 "sampling_params": {"max_new_tokens": 10, "n": 2}},
                             temperature=0.8, label=tag + "-text"),
            )
        return run

    async def both():
        return await asyncio.gather(on(g_cum, False, 100), on(g_inc, True, 200))

    runs = asyncio.run(both())
    rep = Report()
    for run in runs:
        rep.add(truth.check_all(run.items, (0,), engines={"e0"}))
    n_traj = sum(len(r.items) for r in runs)
    assert n_traj == 2 * (3 + 2 + 1 + 1 + 2)
    text_prompts = [st.prompt for r in runs for st in r.items if "text" in st.label]
    assert text_prompts[0] == TOK.encode("The quick brown fox cum")  # SGLang's tokenizer path
    assert_exact(rep, f"every route, no swap ({n_traj} trajectories)", g_cum, g_inc)
    checker_sees_wrong_stamps(truth, runs[0].items[0])


def checker_sees_wrong_stamps(truth: GroundTruth, st) -> None:
    """The check is not vacuous: each kind of wrong stamp on a true trajectory is counted."""
    import copy

    def bad(kind: str, edit) -> None:
        x = copy.deepcopy(st)
        edit(x)
        got = truth.check(x, (0, 1)).counts
        assert got[kind] > 0, (kind, dict(got))

    bad("policy_version", lambda x: x.policy_version.__setitem__(-1, 1))
    bad("kv_version", lambda x: x.kv_version.__setitem__(-1, 1))
    bad("unexplained", lambda x: x.logprobs.__setitem__(2, x.logprobs[2] + 1e-3))
    bad("routed_rows", lambda x: x.rows.__setitem__(  # an expert that did not run
        (x.p, 0, 0), next(e for e in range(1 << 10) if e not in x.rows[x.p, 0])))
    bad("segments", lambda x: x.segments.__setitem__(0, {**x.segments[0], "end": 2}))
    bad("entropy", lambda x: x.entropy.__setitem__(0, x.entropy[0] + x.entropy_bound + 0.1))


# ---------------------------------------------------------------------------------------------
# 2. every swap mode mid-generation, and rolling across two engines


SWAP_SERVER = {"in_place": "default", "retract": "incremental", "abort_resume": "default",
               "drain": "incremental"}


#: the ``began`` of the segment at the switch, by mode: a retract swap breaks off the requests
#: that asked for routed experts (all of these) and resumes them as abort_resume does
BEGAN_AT_SWITCH = {"in_place": {"in_place"}, "retract": {"abort_resume"},
                   "abort_resume": {"abort_resume"}, "drain": set()}


@pytest.mark.parametrize("mode", ["in_place", "retract", "abort_resume", "drain"])
def test_swap_mid_generation_stamped_exactly(mode, request, serve, truth, sglang_checkpoints):
    """Rollouts streaming (two ``/v1/rollouts`` with n=2, a streamed and a plain ``/generate``)
    when ``POST /v1/weights`` swaps v0 -> v1 in ``mode``; one more rollout after the swap.
    Every token of every trajectory stamped with the weights that computed it and the KV it
    saw.

    in_place under the overlap scheduler: SGLang labels the boundary one token early (the
    token in flight at the pause was computed by v0, research §1); the gateway must stamp the
    truth. retract: SGLang re-prefills prompt + output under v1 and returns the re-prefill's
    routing for every position (research §4); the rows of the positions that sampled the
    tokens before the swap must be the routing that sampled them (v0's), else routing replay
    trains the pre-swap tokens' logprobs under experts that never produced them: the gateway
    breaks off every request that asked for routed experts before the retract pause, so each
    resumes (``abort_resume``) and ``stitch_routing`` keeps each segment's own rows."""
    incremental = SWAP_SERVER[mode] == "incremental"
    srv = request.getfixturevalue("sglang_inc" if incremental else "sglang")
    gw = serve(e0=srv)
    run = Run(gw, incremental)
    tag = f"{mode}"

    def streams(c, k, n_new):
        s0 = 300 + 40 * (k - 1)
        out = [run.rollout_stream(c, prompt(s0 + j), n=2, n_new=n_new, label=f"{tag}{j}.r{k}")
               for j in range(2)]
        out.append(run.generate(c, {"input_ids": prompt(s0 + 10), "return_logprob": True,
                                    "top_logprobs_num": 2, "return_routed_experts": True,
                                    "sampling_params": sampling(n_new)},
                                label=f"{tag}.r{k}", stream=True, gated=True))
        out.append(run.generate(c, {"input_ids": prompt(s0 + 11), "return_logprob": True,
                                    "return_routed_experts": True,
                                    "sampling_params": sampling(n_new)}, label=f"{tag}.r{k}"))
        return out

    async def go():
        async with client(gw) as c:
            rec, v = await land_swap(run, c, lambda k, n_new: streams(c, k, n_new),
                                     lambda k: disk(sglang_checkpoints, k, mode),
                                     straddle=mode != "drain")
            await run.rollout(c, prompt(325), n=2, n_new=8, label=f"{tag}-after")
            return rec, v

    rec, v = asyncio.run(go())
    rep = truth.check_all(run.items, tuple(range(v + 1)), engines={"e0"},
                          began_at_switch=BEGAN_AT_SWITCH[mode])
    rep.notes.insert(0, f"swap {mode}: {rec['_took_s']:.2f}s, {rec['message']}")
    straddlers = spans_swap(rep)
    if mode == "drain":  # nothing straddles: the in-flight samples finished on v0
        assert not straddlers, rep.summary(f"{mode}: straddlers {straddlers}")
    else:
        assert straddlers, rep.summary(f"no trajectory spans the {mode} swap")
    after = [b for b in rep.boundaries if "-after" in b["label"]]
    assert after and all(set(b["truth"]) == {v} for b in after), rep.summary(f"after: {after}")
    assert_exact(rep, f"{mode} swap mid-generation ({len(run.items)} trajectories, "
                      f"{len(straddlers)} across it)", gw)


@pytest.mark.parametrize("mode", ["in_place", "abort_resume"])
def test_rolling_swap_across_two_engines(mode, sglang, sglang_inc, serve, truth,
                                         sglang_checkpoints):
    """Two SGLang engines (cumulative and incremental streams) behind one gateway; a rolling
    swap (one engine at a time, the other keeps serving) while samples stream on both."""
    gw = serve(e0=sglang, e1=sglang_inc)
    run = Run(gw, incremental=False)

    async def go():
        async with client(gw) as c:
            rec, v = await land_swap(
                run, c,
                lambda k, n_new: [run.rollout_stream(c, prompt(400 + 40 * (k - 1) + j), n=2,
                                                     n_new=n_new, label=f"roll-{mode}{j}.r{k}",
                                                     group_id=f"g{j}")
                                  for j in range(4)],
                lambda k: disk(sglang_checkpoints, k, mode, rolling=True),
                # the second engine's swap comes after the first's, and its streams must
                # still be running then: twice the tokens of the other swap tests
                n_new=2 * NEW)
            await run.rollout(c, prompt(425), n=2, n_new=8, label=f"roll-{mode}-after")
            return rec, v

    rec, v = asyncio.run(go())
    assert set(rec["engines"]) == {"e0", "e1"}
    rep = truth.check_all(run.items, tuple(range(v + 1)), engines={"e0", "e1"},
                          began_at_switch={mode})
    rep.notes.insert(0, f"rolling {mode}: {rec['_took_s']:.2f}s, {rec['message']}")
    used = {s["engine_id"] for st in run.items for s in st.segments}
    assert used == {"e0", "e1"}, rep.summary(f"samples ran on {used} only")
    assert spans_swap(rep), rep.summary("no trajectory spans the rolling swap")
    assert_exact(rep, f"rolling {mode} swap over two engines ({len(run.items)} trajectories)",
                 gw)


# ---------------------------------------------------------------------------------------------
# 3. prefix-cache hits after an in-place swap


_PREFILL = re.compile(r"Prefill batch.*?#new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")


def prefills(srv, since: int) -> tuple[list[tuple[int, int, int]], int]:
    """SGLang's own account of its prefill batches logged after byte ``since`` of its log:
    (sequences, new tokens, cached tokens) each; and the log's new end."""
    with open(srv.log_path, "rb") as f:
        f.seek(since)
        data = f.read()
    return ([tuple(map(int, m.groups())) for m in _PREFILL.finditer(data.decode(errors="replace"))],
            since + len(data))


def test_prefix_cache_hits_after_in_place_swap(sglang, serve, truth, sglang_checkpoints):
    """After an in-place swap (v0 -> v1, a sample straddling it) nothing is flushed: prompts
    sharing a prefix with one cached under v0 (by a v0 sample, by the straddler) and with one
    cached under v1 run afterwards; SGLang reports the cached tokens of each prefill (its log).
    Whatever KV a hit holds (the first writer's), ``kv_version`` must name it."""
    gw = serve(e0=sglang)
    run = Run(gw)
    # C's prompt shares nothing with what v0 wrote (no <|bos|>): its prefix is v1's KV only
    pa, pc = prompt(500, 16), prompt(502, 16, bos=False)
    ps = []  # the straddler's prompt (of the round that landed)
    hits: dict[str, list] = {}

    async def one(c, label, ids, n=1):
        """A sample after the swap; what SGLang logged for its prefill."""
        _, mark = prefills(sglang, 0)
        await run.rollout(c, ids, n=n, n_new=8, label=label)
        hits[label], _ = prefills(sglang, mark)

    async def go():
        async with client(gw) as c:
            await run.rollout(c, pa, n_new=8, label="A(v0)")  # cached under v0

            def straddler(k, n_new):
                ps[:] = prompt(501 + 40 * (k - 1), 16)
                return [run.rollout_stream(c, list(ps), n_new=n_new, label=f"S(straddler).r{k}")]
            _, v = await land_swap(run, c, straddler,
                                   lambda k: disk(sglang_checkpoints, k, "in_place"))
            await one(c, "B(prefix of A)", pa[:12] + [7, 8, 9])
            await one(c, "E(prefix of S)", ps[:12] + [7, 8, 9])
            await one(c, "C(v1)", pc)  # cached under v1 (nothing to hit)
            await one(c, "D(prefix of C)", pc[:12] + [7, 8, 9])
            await one(c, "F(= C's prompt)", pc, n=2)
            return v

    v = asyncio.run(go())
    rep = truth.check_all(run.items, tuple(range(v + 1)), engines={"e0"},
                          began_at_switch={"in_place"})
    for label, lines in hits.items():
        rep.notes.insert(0, f"SGLang prefill of {label}: (seqs, new, cached) {lines}")
    cached = {k: sum(x[2] for x in v) for k, v in hits.items()}
    # hits on KV the new weights wrote exist under any cache policy: these must be exercised
    assert cached["D(prefix of C)"] > 0 and cached["F(= C's prompt)"] > 0, hits
    assert spans_swap(rep), rep.summary("the straddler does not span the swap")
    assert_exact(rep, f"prefix-cache hits after an in-place swap (cached tokens {cached})", gw)


# ---------------------------------------------------------------------------------------------
# 4. a learner pulling over gRPC


def test_learner_pulls_exact_trajectories_over_grpc(sglang_inc, serve, truth, sglang_checkpoints):
    """Samples streamed across an abort_resume swap (and after it), then pulled by a learner
    (``learner_client.TrajectoryClient``, the README's calls) over the gateway's gRPC: every
    delivered trajectory equals what the HTTP client got, and its stamps equal recomputation."""
    from learner_client import TrajectoryClient

    gw = serve(e0=sglang_inc)
    run = Run(gw, incremental=True)

    async def go():
        async with client(gw) as c:
            rec, v = await land_swap(
                run, c,
                lambda k, n_new: [run.rollout_stream(c, prompt(600 + 40 * (k - 1) + j), n=2,
                                                     n_new=n_new, label=f"grpc{j}.r{k}")
                                  for j in range(2)],
                lambda k: disk(sglang_checkpoints, k, "abort_resume"))
            await run.rollout(c, prompt(625), n=2, n_new=8, label="grpc-after")
            return rec, v

    rec, v = asyncio.run(go())
    by_http = {st.label: st for st in run.items}
    want = len(run.items)
    got = []
    with TrajectoryClient(gw.grpc_target, group="conformance", learner_version=v,
                          max_lag=4) as learner:
        learner.create_group()
        deadline = time.monotonic() + 60
        while len(got) < want and time.monotonic() < deadline:
            got += learner.pull(want - len(got), timeout=10)
        learner.ack(got)
    assert len(got) == want, f"pulled {len(got)} of {want}"
    rep = Report()
    delivered = [from_wire(r, 1.0, f"grpc:{r.trajectory_id}") for r in got]
    # the same trajectories as over HTTP (ids, tokens, stamps, routing)
    http_by_tokens = {(tuple(s.prompt), tuple(s.out)): s for s in by_http.values()}
    for d in delivered:
        h = http_by_tokens.get((tuple(d.prompt), tuple(d.out)))
        assert h is not None, f"{d.label}: delivered a trajectory no HTTP client got"
        assert np.array_equal(h.policy_version, d.policy_version)
        assert np.array_equal(h.kv_version, d.kv_version)
        assert np.allclose(h.logprobs, d.logprobs, atol=1e-6, rtol=0)
        assert np.array_equal(h.rows, d.rows)
    rep.add(truth.check_all(delivered, tuple(range(v + 1)), engines={"e0"},
                            began_at_switch={"abort_resume"}))
    rep.notes.insert(0, f"swap abort_resume: {rec['_took_s']:.2f}s, {rec['message']}")
    assert spans_swap(rep), rep.summary("no delivered trajectory spans the swap")
    assert_exact(rep, f"delivered over gRPC ({len(delivered)} trajectories)", gw)
