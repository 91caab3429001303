"""Faults in front of real SGLang 0.5.23 (its default overlap scheduler), the gateway as users
start it (``rollout-gateway serve --engine ...``, default settings), every stamp of every
trajectory compared with recomputation (``_stamp_truth.GroundTruth``):

* one of two engines SIGKILLed, or frozen with SIGSTOP, while samples stream on both: the
  samples it held fail over to the other engine from their partial output (kept, stamped,
  its routing rows the ones that sampled it), nothing fails, a later request is served;
* an idle gap longer than SGLang's (uvicorn's) 5 s keep-alive after a burst that used several
  pooled connections, with the gateway's default keep-alive (4 s) and with one longer than
  SGLang's (the engine then closes connections the gateway still holds): no failover, no
  breaker trip, the engine stays healthy;
* a request SGLang itself refuses (inside a 200 stream as an error event, or as an HTTP 400)
  answers 4xx through the gateway, with no failover and the engine healthy; an input id
  outside the vocabulary (which would crash SGLang's scheduler) is refused by the gateway
  with a 400 that names the id and the vocabulary size.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest
from _gateway_run import Run, assert_exact, client, prompt
from _stamp_truth import ChunkGate, GatewayServe, Report

from reference_engine.config import ModelConfig

VOCAB = ModelConfig().vocab_size


def engines(gw: GatewayServe) -> dict[str, dict]:
    return {e["id"]: e for e in httpx.get(gw.url + "/v1/engines", timeout=10).json()["engines"]}


def wait_engine(gw: GatewayServe, eid: str, state: str, timeout: float = 90.0) -> dict:
    """Until the gateway reports engine ``eid`` in ``state`` with its breaker closed (the
    gateway's own view, polled: it has no event to wait on from outside)."""
    deadline = time.monotonic() + timeout
    while True:
        e = engines(gw)[eid]
        if e["state"] == state and not e["breaker"]["open"]:
            return e
        if time.monotonic() > deadline:
            raise AssertionError(f"engine {eid} not {state} after {timeout:g}s: {e}")
        time.sleep(0.5)


def failed_over(items) -> list:
    """Trajectories that ran on e0, were cut off there with output, and went on on e1."""
    out = []
    for st in items:
        segs = st.segments
        for a, b in zip(segs, segs[1:]):
            if (a["engine_id"], b["engine_id"]) == ("e0", "e1") and b["began"] == "failover" \
                    and a["end"] > a["start"]:
                out.append(st)
                break
    return out


# ---------------------------------------------------------------------------------------------
# 1. SIGKILL / SIGSTOP of one of two engines mid-generation


@pytest.mark.parametrize("sig", ["SIGSTOP", "SIGKILL"])
def test_engine_killed_or_frozen_mid_generation_fails_over_exactly(sig, sglang, sglang_inc,
                                                                     serve, truth):
    """e0 (``sglang``: cumulative streams) and e1 (``sglang_inc``: deltas) behind one gateway;
    once a stream from e0 has delivered 2 chunks, e0 gets ``sig`` (SIGSTOP: the port stays open,
    nothing answers; the gateway's health probes evict it). The samples e0 held finish on
    e1 from their partial output; a rollout sent afterwards is served by e1. SIGSTOP ends
    with SIGCONT and e0 back in rotation; SIGKILL leaves the ``sglang`` fixture to restart
    it. On a loaded host the client reads chunks late (SGLang also packs the tokens it has
    ready into one chunk), so e0 may have ended every sample it held before the signal:
    such a round tests nothing and is run again with outputs twice as long (at most 3)."""
    gw = serve(e0=sglang, e1=sglang_inc)
    run = Run(gw)
    rounds: list[str] = []

    async def go(r: int, n_new: int) -> bool:
        """One round; whether a sample e0 held failed over with output."""
        run.gate = ChunkGate()
        first = len(run.items)
        async with client(gw) as c:
            streams = [run.rollout_stream(c, prompt(700 + 20 * r + j), n=2, n_new=n_new,
                                          label=f"{sig}{r}.{j}", group_id=f"g{sig}{r}.{j}")
                       for j in range(4)]
            streams.append(run.generate(c, {"input_ids": prompt(710 + 20 * r),
                                            "return_logprob": True, "top_logprobs_num": 2,
                                            "return_routed_experts": True,
                                            "session_id": f"s-gen{r}",
                                            "sampling_params": {"max_new_tokens": n_new}},
                                        label=f"{sig}{r}-gen", stream=True, gated=True))
            tasks = [asyncio.create_task(s) for s in streams]
            # a stream of e0's, not every stream: e1's may not have started yet
            await run.gate.wait_on("e0", 2)
            if sig == "SIGKILL":
                sglang.kill()
            else:
                sglang.signal_group(signal.SIGSTOP)
            try:
                await asyncio.gather(*tasks)
                moved = len(failed_over(run.items[first:]))
                rounds.append(f"round {r} ({n_new} tokens): {moved} of "
                              f"{len(run.items) - first} failed over")
                if not moved:
                    return False
                await run.rollout(c, prompt(720), n=2, n_new=8, label=f"{sig}-after")
                return True
            finally:
                if sig == "SIGSTOP":
                    sglang.signal_group(signal.SIGCONT)

    n_new = 160
    for r in range(3):
        if asyncio.run(go(r, n_new)):
            break
        if sig == "SIGKILL":
            sglang.start()
        wait_engine(gw, "e0", "healthy")
        n_new *= 2
    rep = truth.check_all(run.items, (0,), engines={"e0", "e1"})
    moved = failed_over(run.items)
    rep.notes.insert(0, f"{sig}: {len(moved)} of {len(run.items)} trajectories failed over "
                        f"from e0 to e1 with partial output ({'; '.join(rounds)})")
    assert moved, rep.summary(f"{sig}: no sample failed over from e0 with partial output")
    after = [st for st in run.items if st.label.startswith(f"{sig}-after")]
    assert after and all(s["engine_id"] == "e1" for st in after for s in st.segments)
    assert_exact(rep, f"{sig} of e0 mid-generation ({len(run.items)} trajectories)", gw)
    e1 = engines(gw)["e1"]
    assert e1["state"] == "healthy" and e1["breaker"]["trips"] == 0, e1
    if sig == "SIGSTOP":  # thawed: back in rotation, serving exactly again
        wait_engine(gw, "e0", "healthy")

        async def again():
            async with client(gw) as c:
                return await run.rollout(c, prompt(730), n=1, n_new=6, label="thawed",
                                         group_id="g-thawed")
        asyncio.run(again())
        assert_exact(truth.check_all(run.items[-1:], (0,), engines={"e0", "e1"}),
                     "after SIGCONT", gw)
    else:
        assert engines(gw)["e0"]["state"] != "healthy"


# ---------------------------------------------------------------------------------------------
# 2. idle gaps longer than SGLang's keep-alive


KEEP_ALIVE_GAP_S = 6.0  # SGLang's uvicorn closes connections idle for 5 s


def test_idle_gap_past_sglang_keep_alive_never_fails_over(sglang, serve, truth):
    """A burst of concurrent requests (several pooled connections to the engine), 6 s of
    silence, a second burst; twice over: the gateway's default keep-alive (4 s, it closes
    first) and a keep-alive of 30 s (SGLang closes the connections the gateway still holds,
    so the second burst goes out on stale connections). The wait is a fixed 6 s on purpose:
    outlasting SGLang's keep-alive is the condition under test, no event marks it."""
    gws = {"default": serve(e0=sglang),
           "held": serve(env={"ROLLOUT_GATEWAY_TIMEOUTS__KEEP_ALIVE_S": "30"}, e0=sglang)}
    runs = {k: Run(gw) for k, gw in gws.items()}

    async def burst(tag: str):
        async def one(k: str, c):
            run = runs[k]
            await asyncio.gather(*(run.rollout(c, prompt(800 + j), n=1, n_new=4,
                                               label=f"{k}-{tag}{j}") for j in range(6)),
                                 run.rollout_stream(c, prompt(810), n=2, n_new=4,
                                                    label=f"{k}-{tag}s", gated=False))
        cs = {k: client(gw) for k, gw in gws.items()}
        try:
            await asyncio.gather(*(one(k, cs[k]) for k in gws))
        finally:
            for c in cs.values():
                await c.aclose()

    asyncio.run(burst("a"))
    time.sleep(KEEP_ALIVE_GAP_S)  # the condition under test (see the docstring)
    asyncio.run(burst("b"))
    rep = Report()
    for k, run in runs.items():
        rep.add(truth.check_all(run.items, (0,), engines={"e0"}))
        moved = [st.label for st in run.items if len(st.segments) > 1]
        assert not moved, f"{k}: samples resubmitted after the idle gap: {moved}"
        e0 = engines(gws[k])["e0"]
        assert e0["state"] == "healthy" and e0["breaker"]["trips"] == 0 and \
            e0["breaker"]["failures_in_a_row"] == 0 and e0["last_error"] is None, (k, e0)
    assert_exact(rep, f"bursts around a {KEEP_ALIVE_GAP_S:g}s idle gap "
                      f"({sum(len(r.items) for r in runs.values())} trajectories)", *gws.values())


# ---------------------------------------------------------------------------------------------
# 3. requests SGLang refuses, and ids it would crash on


def test_client_errors_answer_4xx_and_the_engine_stays_healthy(sglang, serve, truth):
    """A prompt SGLang's tokenizer manager refuses (prompt + max_new_tokens past the model's
    4096-token context): streamed, SGLang answers 200 with an error event
    (``{"code": 400, "retryable": false}``) and ``[DONE]``; not streamed, HTTP 400. Through the
    gateway every route answers 400 with SGLang's message, once each (no retry, no
    failover), the engine stays healthy with its breaker untouched and serves the next
    request exactly. An input id >= the vocabulary size is refused by the gateway itself."""
    gw = serve(e0=sglang)
    long = {"max_new_tokens": 4096, "temperature": 1.0}
    with httpx.Client(base_url=sglang.url, timeout=60) as direct:  # SGLang's own answers
        r = direct.post("/generate", json={"input_ids": prompt(900), "sampling_params": long,
                                           "stream": True})
        assert r.status_code == 200 and '"code": 400' in r.text.replace('"code":400',
                                                                         '"code": 400'), r.text
        r = direct.post("/generate", json={"input_ids": prompt(900), "sampling_params": long})
        assert r.status_code == 400, r.text
    with httpx.Client(base_url=gw.url, timeout=120) as c:
        bodies = {
            "generate": ("/generate", {"input_ids": prompt(900), "sampling_params": long}),
            "generate-stream": ("/generate", {"input_ids": prompt(900), "sampling_params": long,
                                              "stream": True}),
            "rollouts": ("/v1/rollouts", {"input_ids": prompt(900), "n": 2,
                                          "sampling_params": long}),
            "rollouts-stream": ("/v1/rollouts", {"input_ids": prompt(900),
                                                 "sampling_params": long, "stream": True}),
        }
        for name, (path, body) in bodies.items():
            r = c.post(path, json=body)
            assert r.status_code == 400, (name, r.status_code, r.text[:500])
            assert "context length" in r.text, (name, r.text[:500])
        for path in ("/generate", "/v1/rollouts"):
            bad = prompt(901)[:-1] + [VOCAB + 7]
            r = c.post(path, json={"input_ids": bad, "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 400, (path, r.status_code, r.text[:500])
            assert str(VOCAB + 7) in r.text and str(VOCAB) in r.text, r.text[:500]
    e0 = engines(gw)["e0"]
    assert e0["state"] == "healthy" and e0["breaker"]["trips"] == 0 and \
        e0["breaker"]["failures_in_a_row"] == 0, e0
    run = Run(gw)

    async def after():
        async with client(gw) as c:
            await run.rollout(c, prompt(902), n=2, n_new=6, label="after-errors")
    asyncio.run(after())
    assert_exact(truth.check_all(run.items, (0,), engines={"e0"}), "after the refusals", gw)
