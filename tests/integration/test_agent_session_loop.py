"""Done-means test of agent sessions: a multi-turn agent loop with a scripted tool
environment, through the official ``openai`` client, against a real gateway process with a
reference engine, across a hot-swap (one turn spans it); then the published trajectory is
pulled over gRPC and checked token by token: ids equal to what the engine produced, loss
mask, turn boundaries, versions, and logprobs against fresh forward passes."""

from __future__ import annotations

import threading
import time

import httpx
import numpy as np
import pytest
from _gateway_support import GatewayProcess, check_against_ground_truth

pytestmark = pytest.mark.integration

SID = "agent-loop-1"


class ToolEnv:
    """A scripted environment: a calculator tool call seeded in the history, then an
    observation per step derived from what the model said."""

    def __init__(self) -> None:
        self.steps = 0

    def initial(self) -> list[dict]:
        return [
            {"role": "system", "content": "You are an agent. Use tools when useful."},
            {"role": "user", "content": "What is 6*7? Then keep exploring."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_seed", "type": "function",
                 "function": {"name": "calc", "arguments": "{\"expr\": \"6*7\"}"}}]},
            {"role": "tool", "tool_call_id": "call_seed", "content": "42"},
        ]

    def observe(self, reply: str) -> dict:
        self.steps += 1
        return {"role": "user", "content": f"observation {self.steps}: {len(reply)} chars, "
                                           f"checksum {sum(map(ord, reply)) % 97}"}


TOOLS = [{"type": "function", "function": {"name": "calc", "description": "arithmetic",
                                           "parameters": {"type": "object", "properties": {
                                               "expr": {"type": "string"}}}}}]


def test_agent_loop_across_a_hot_swap(make_engine, checkpoint_v1, checkpoint_v2,
                                      reference_model):
    import openai

    from learner_client import TrajectoryClient, collate
    from rollout_gateway.sessions.templates import ReferenceTemplate

    eng = make_engine(seed=1, weight_version="0", step_delay_ms=25)
    models = {0: reference_model(checkpoint_v1), 1: reference_model(checkpoint_v2)}
    tpl = ReferenceTemplate()
    with GatewayProcess({"e0": eng.url}) as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0,
                               timeout=120)
        env = ToolEnv()
        messages = env.initial()
        replies = []  # per turn: (messages sent, choice)
        for turn in range(4):
            kw = dict(model="reference", messages=list(messages), tools=TOOLS,
                      max_tokens=16, temperature=1.0, seed=100 + turn, logprobs=True,
                      extra_headers={"x-session-id": SID})
            if turn == 2:  # streamed; the hot-swap lands while it generates
                swap: dict = {}

                def do_swap():
                    swap["r"] = httpx.post(gw.url + "/v1/weights", timeout=120, json={
                        "version": 1, "source": {"kind": "disk", "path": str(checkpoint_v2)},
                        "mode": "in_place"})

                th = threading.Thread(target=do_swap)
                content, lps, info = [], [], None
                for chunk in client.chat.completions.create(stream=True, **kw):
                    ch = chunk.choices[0]
                    if ch.delta.content:
                        content.append(ch.delta.content)
                    if ch.logprobs and ch.logprobs.content:
                        lps += [e.logprob for e in ch.logprobs.content]
                        if not th.is_alive() and "r" not in swap:
                            th.start()
                    if ch.finish_reason:
                        info = ch.model_extra["rollout"]
                th.join(120)
                assert swap["r"].status_code == 200, swap["r"].text
                text = "".join(content)
            else:
                resp = client.chat.completions.create(**kw)
                ch = resp.choices[0]
                text = ch.message.content
                lps = [e.logprob for e in ch.logprobs.content]
                info = ch.model_extra["rollout"]
                assert resp.usage.completion_tokens == len(info["token_ids"])
            assert info["session_id"] == SID and info["trajectory_id"].startswith(f"{SID}.b0.")
            assert info["turn"] == turn and info["branched"] is None
            assert len(lps) == len(info["token_ids"])
            # the reply text is the model's tokens detokenized (never the other way round)
            body = [t for t in info["token_ids"] if t != 257]
            assert text == tpl.decode(body)
            replies.append((list(messages), info, np.asarray(lps, np.float32), text))
            messages.append({"role": "assistant", "content": text})
            messages.append(env.observe(text))
        ended = httpx.post(gw.url + f"/v1/sessions/{SID}/end", json={"reward": 0.75}).json()
        assert ended["published"] is True and ended["turns"] == 4, ended
        # a turn after the end is refused with a clear 4xx
        with pytest.raises(openai.APIStatusError) as ei:
            client.chat.completions.create(model="reference", messages=messages, max_tokens=2,
                                           extra_headers={"x-session-id": SID})
        assert ei.value.status_code == 409 and "ended" in ei.value.message

        # independent ground truth for the last turn (v1, one segment): the engine itself,
        # asked directly for the same input and seed, samples the same ids
        info = replies[3][1]
        seq_before = tpl.encode(tpl.render(replies[0][0], tools=TOOLS, add_generation_prompt=True))
        lc = TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", group="agent")
        try:
            lc.create_group()
            got = []
            deadline = time.monotonic() + 60
            while not got and time.monotonic() < deadline:
                got = lc.pull(8, timeout=5)
            assert [r.trajectory_id for r in got] == [ended["trajectory_id"]]
            assert ended["trajectory_id"] == replies[0][1]["trajectory_id"]
            r = got[0]
            batch = collate(got, learner_version=1, layout="padded")
            lc.ack(got)
        finally:
            lc.close()

    last = [t for t in r.turns if t.kind == "model"][3]
    direct_in = np.concatenate([r.prompt_token_ids, r.token_ids[:last.start]]).tolist()
    assert direct_in[:len(seq_before)] == seq_before
    # (the engine process is still up: make_engine stops it at teardown)
    d = httpx.post(eng.url + "/generate", timeout=120, json={
        "input_ids": direct_in, "sampling_params": {"max_new_tokens": 16, "temperature": 1.0,
                                                    "sampling_seed": 103}}).json()
    assert d["output_ids"] == info["token_ids"]

    # ---- token by token ----
    assert r.reward == pytest.approx(0.75)
    assert r.metadata["session_id"] == SID and r.metadata["session_ended_by"] == "end"
    assert r.metadata["session_turns"] == "4"
    # the prompt is the template over the first request, tokenized once
    first_prompt = tpl.render(replies[0][0], tools=TOOLS, add_generation_prompt=True)
    assert r.prompt_token_ids.tolist() == tpl.encode(first_prompt)
    kinds = [t.kind for t in r.turns]
    assert kinds == ["model", "context", "model", "context", "model", "context", "model"]
    assert [t.index for t in r.turns] == [0, 1, 1, 2, 2, 3, 3]
    assert r.turns[0].start == 0 and r.turns[-1].end == r.num_tokens
    assert all(a.end == b.start for a, b in zip(r.turns, r.turns[1:]))
    seq = np.concatenate([r.prompt_token_ids, r.token_ids]).tolist()
    p = len(r.prompt_token_ids)
    mask = np.zeros(r.num_tokens, np.uint8)
    model_turns = [t for t in r.turns if t.kind == "model"]
    for k, t in enumerate(model_turns):
        sent, info, lps, text = replies[k]
        mask[t.start:t.end] = 1
        # ids equal to what the engine produced (and returned to the harness)
        assert r.token_ids[t.start:t.end].tolist() == info["token_ids"]
        assert r.policy_version[t.start:t.end].tolist() == info["policy_version"]
        assert r.kv_version[t.start:t.end].tolist() == info["kv_version"]
        np.testing.assert_array_equal(r.logprobs[t.start:t.end], lps)
        # the engine saw exactly the session's tokens so far as its prompt: the context
        # before this turn is the template's text after the previous reply
        if k:
            ctx = [c for c in r.turns if c.kind == "context" and c.index == k][0]
            prev_prompt = tpl.render(replies[k - 1][0], tools=TOOLS, add_generation_prompt=True)
            now_prompt = tpl.render(sent, tools=TOOLS, add_generation_prompt=True)
            assert now_prompt.startswith(prev_prompt)
            after = now_prompt[len(prev_prompt):]
            prev_ids = replies[k - 1][1]["token_ids"]
            reply_text = tpl.decode(prev_ids, skip_special_tokens=False)
            want = after[len(reply_text):] if prev_ids[-1] == 257 else \
                after[after.index("<|eos|>"):]
            assert r.token_ids[ctx.start:ctx.end].tolist() == tpl.encode(want)
            assert (r.policy_version[ctx.start:ctx.end] == info["kv_version"][0]).all()
        # logprobs against recomputation (segments: start, in_place across the swap)
        segs = [{"start": s.start - t.start, "end": s.end - t.start,
                 "policy_version": s.policy_version, "began": s.began, "ended": s.ended}
                for s in r.segments if t.start <= s.start < t.end]
        check_against_ground_truth({
            "prompt_token_ids": seq[:p + t.start], "token_ids": info["token_ids"],
            "num_tokens": t.end - t.start, "policy_version": info["policy_version"],
            "kv_version": info["kv_version"], "logprobs": lps.tolist(), "segments": segs},
            models)
    assert r.loss_mask.tolist() == mask.tolist()
    # versions: turns before the swap on v0, the streamed turn spans it, the last on v1
    assert set(replies[0][1]["policy_version"]) == set(replies[1][1]["policy_version"]) == {0}
    assert set(replies[2][1]["policy_version"]) == {0, 1}, replies[2][1]["segments"]
    assert [s["began"] for s in replies[2][1]["segments"]] == ["start", "in_place"]
    assert set(replies[3][1]["policy_version"]) == {1}
    # context segments are marked and cover the context turns
    ctx_segs = [s for s in r.segments if s.began == "context"]
    assert [(s.start, s.end) for s in ctx_segs] == [(t.start, t.end) for t in r.turns
                                                    if t.kind == "context"]
    # routing: one row per position that got a forward pass
    assert r.routed_experts is not None and r.routed_experts.shape[0] == len(seq) - 1
    # collate honours the loss mask: context tokens get no loss
    lm = batch.loss_mask[0, p:p + r.num_tokens].numpy()
    assert lm.tolist() == mask.astype(np.float32).tolist()
    assert batch.loss_mask[0, :p].sum() == 0
