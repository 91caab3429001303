"""Agent sessions over HTTP against a real gateway process and reference engines: branches
on edited history, calls without a session, completions sessions, rewards later, the idle
timeout, streaming with stop strings, sticky engines, and clear 4xx on bad input."""

from __future__ import annotations

import uuid

import httpx
import pytest
from _gateway_support import GatewayProcess, pull_ids

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def two_engines():
    from rollout_gateway.commands.engine_process import EngineProcess

    with EngineProcess(seed=1) as a, EngineProcess(seed=1) as b:
        yield a, b


@pytest.fixture(scope="module")
def gw(two_engines):
    a, b = two_engines
    with GatewayProcess({"e0": a.url, "e1": b.url},
                        env={"ROLLOUT_GATEWAY_SESSION_IDLE_TIMEOUT_S": "2",
                             "ROLLOUT_GATEWAY_SESSION_REWARD_WAIT_S": "60"}) as g:
        yield g


@pytest.fixture(scope="module")
def oai(gw):
    import openai

    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def pull_until(gw, want: set[str], timeout: float = 30.0) -> dict:
    return pull_ids(gw, want, timeout=timeout)


def chat(oai, sid, messages, **kw):
    kw.setdefault("max_tokens", 4)
    headers = {"x-session-id": sid} if sid else {}
    return oai.chat.completions.create(model="reference", messages=messages,
                                       extra_headers=headers, **kw)


def test_edited_history_starts_a_counted_branch(gw, oai):
    sid = f"br-{uuid.uuid4().hex[:6]}"
    m = [{"role": "user", "content": "start"}]
    r0 = chat(oai, sid, m)
    m += [{"role": "assistant", "content": r0.choices[0].message.content},
          {"role": "user", "content": "next"}]
    r1 = chat(oai, sid, m)
    assert r1.choices[0].model_extra["rollout"]["trajectory_id"].startswith(f"{sid}.b0.")
    # the harness rewrites the last user message (keeps the first reply)
    edited = m[:2] + [{"role": "user", "content": "something else"}]
    r2 = chat(oai, sid, edited)
    info = r2.choices[0].model_extra["rollout"]
    assert info["branched"] == "history_edited" and info["trajectory_id"].startswith(f"{sid}.b1.")
    assert info["branch"] == 1
    metrics = httpx.get(gw.url + "/metrics").text
    assert "rollout_gateway_session_branches_total" in metrics
    end = httpx.post(gw.url + f"/v1/sessions/{sid}/end", json={"reward": 1.0}).json()
    assert end["trajectory_id"].startswith(f"{sid}.b1.") and end["published"]
    got = pull_until(gw, {f"{sid}.b0", f"{sid}.b1"})
    old, new = got[f"{sid}.b0"], got[f"{sid}.b1"]
    assert old.metadata["session_ended_by"] == "branch" and old.reward is None
    assert [t.kind for t in old.turns] == ["model", "context", "model"]
    assert new.metadata["branched_from"].startswith(f"{sid}.b0.")
    assert new.metadata["branch_reason"] == "history_edited" and new.reward == 1.0
    # the new branch keeps the first call's exact tokens as its prompt prefix
    first = r0.choices[0].model_extra["rollout"]["token_ids"]
    p0 = len(old.prompt_token_ids)
    assert new.prompt_token_ids[:p0 + len(first)].tolist() == \
        old.prompt_token_ids.tolist() + first
    assert [t.kind for t in new.turns] == ["model"]
    assert new.token_ids.tolist() == info["token_ids"]


def test_calls_without_a_session_are_trajectories_of_their_own(gw, oai):
    r = chat(oai, None, [{"role": "user", "content": "solo"}], n=2, max_tokens=3,
             logprobs=True, top_logprobs=2, extra_body={"group_id": "task-7"},
             metadata={"task": "t7"})
    assert len(r.choices) == 2 and r.usage.completion_tokens == 6
    ids = {c.model_extra["rollout"]["trajectory_id"] for c in r.choices}
    assert len(ids) == 2
    got = pull_until(gw, ids)
    for c in r.choices:
        t = got[c.model_extra["rollout"]["trajectory_id"]]
        assert t.token_ids.tolist() == c.model_extra["rollout"]["token_ids"]
        assert t.loss_mask.tolist() == [1] * 3
        assert [e.logprob for e in c.logprobs.content] == pytest.approx(t.logprobs.tolist())
        for e in c.logprobs.content:  # the engine's top-2, best first, the sample among them
            alts = [a.logprob for a in e.top_logprobs]
            assert len(alts) == 2 and alts[0] >= alts[1] and e.logprob <= alts[0] + 1e-4
        assert t.metadata["session_ended_by"] == "single_call"
        assert t.group_id == "task-7" and t.metadata["task"] == "t7"


def test_completions_session_and_reward_later(gw, oai):
    sid = f"cp-{uuid.uuid4().hex[:6]}"
    h = {"x-session-id": sid}
    a = oai.completions.create(model="reference", prompt="Q: 1+1\nA:", max_tokens=3,
                               logprobs=0, extra_headers=h)
    text = "Q: 1+1\nA:" + a.choices[0].text + "\nQ: again\nA:"
    b = oai.completions.create(model="reference", prompt=text, max_tokens=3, extra_headers=h)
    assert b.choices[0].model_extra["rollout"]["branched"] is None
    assert len(a.choices[0].logprobs.token_logprobs) == 3
    end = httpx.post(gw.url + f"/v1/sessions/{sid}/end", json={"await_reward": True}).json()
    assert end["published"] is False and end["awaiting_reward"] is True
    tid = end["trajectory_id"]
    r = httpx.post(gw.url + f"/v1/trajectories/{tid}/reward", json={"reward": -0.5})
    assert r.status_code == 200 and r.json()["published"] is True
    t = pull_until(gw, {tid})[tid]
    assert t.reward == -0.5
    assert [x.kind for x in t.turns] == ["model", "context", "model"]
    ctx = t.turns[1]
    assert bytes(t.token_ids[ctx.start:ctx.end].tolist()) == b"\nQ: again\nA:"
    # a reward for a published trajectory / an unknown one: clear 4xx
    again = httpx.post(gw.url + f"/v1/trajectories/{tid}/reward", json={"reward": 1})
    assert again.status_code == 409 and "await_reward" in again.json()["error"]["message"]
    assert httpx.post(gw.url + "/v1/trajectories/nope/reward",
                      json={"reward": 1}).status_code == 404


def test_idle_session_is_ended_and_published(gw, oai):
    sid = f"idle-{uuid.uuid4().hex[:6]}"
    r = chat(oai, sid, [{"role": "user", "content": "then silence"}])
    t = pull_until(gw, {f"{sid}.b0"}, timeout=30)[f"{sid}.b0"]
    assert t.metadata["session_ended_by"] == "idle_timeout"
    assert t.token_ids.tolist() == r.choices[0].model_extra["rollout"]["token_ids"]
    late = httpx.post(gw.url + "/v1/chat/completions", headers={"x-session-id": sid},
                      json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
    assert late.status_code == 409 and "idle_timeout" in late.json()["error"]["message"]


def test_streaming_with_a_stop_string(gw, oai):
    # find a stop string the model will produce: the 2nd-3rd characters of a seeded reply
    m = [{"role": "user", "content": "stream me"}]
    full = chat(oai, None, m, max_tokens=12, seed=7, temperature=0.0)
    text = full.choices[0].message.content
    stop = text[4:6]
    assert stop and "\ufffd" not in stop
    parts, finish, usage = [], None, None
    for ch in chat(oai, None, m, max_tokens=12, seed=7, temperature=0.0, stop=[stop],
                   stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            usage = ch.usage
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    out = "".join(parts)
    assert out == text[:text.index(stop)] and stop not in out
    assert finish == "stop" and usage.completion_tokens >= 1


def test_session_turns_stay_on_one_engine(gw, oai):
    for k in range(3):
        sid = f"st-{k}-{uuid.uuid4().hex[:6]}"
        m = [{"role": "user", "content": "a"}]
        engines = set()
        for _ in range(3):
            r = chat(oai, sid, m, max_tokens=2)
            engines |= set(r.choices[0].model_extra["rollout"]["engine_ids"])
            m += [{"role": "assistant", "content": r.choices[0].message.content},
                  {"role": "user", "content": "b"}]
        assert len(engines) == 1
        httpx.post(gw.url + f"/v1/sessions/{sid}/end", json={})


def test_bad_input_is_a_clear_4xx(gw):
    u = gw.url
    good = [{"role": "user", "content": "x"}]
    cases = [
        ("/v1/chat/completions", {"messages": []}, {}, 400, "non-empty"),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c9",
                                                "content": "r"}]}, {}, 400, "no earlier"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, {}, 400, "role"),
        ("/v1/chat/completions", {"messages": "hello"}, {}, 422, "messages"),
        ("/v1/chat/completions", {"messages": good, "model": "gpt-9"}, {}, 404, "not served"),
        ("/v1/chat/completions", {"messages": good, "top_logprobs": 3}, {}, 400,
         "needs logprobs"),
        ("/v1/chat/completions", {"messages": good, "logprobs": True, "top_logprobs": 21}, {},
         422, "top_logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 6}, {}, 422, "logprobs"),
        ("/v1/chat/completions", {"messages": good, "n": 2}, {"x-session-id": "nn"}, 400, "n > 1"),
        ("/v1/chat/completions", {"messages": good, "session_id": "a"}, {"x-session-id": "b"},
         400, "differ"),
        ("/v1/chat/completions", {"messages": good}, {"x-session-id": "bad id!"}, 400,
         "session id"),
        ("/v1/chat/completions", {"messages": good, "max_tokens": 10**9}, {}, 400, "limit"),
        ("/v1/chat/completions", {"messages": good, "n": 2, "seed": 1}, {}, 400, "identical"),
        ("/v1/chat/completions", {"messages": good, "tool_choice": "required"}, {}, 400,
         "tool_choice"),
        ("/v1/chat/completions", {"messages": good, "response_format": {}}, {}, 422,
         "response_format"),
        ("/v1/completions", {"prompt": ["a", "b"]}, {}, 400, "one request each"),
        ("/v1/completions", {"prompt": ""}, {}, 400, "empty"),
        ("/v1/completions", {"prompt": "a", "echo": True}, {}, 400, "echo"),
        ("/v1/sessions/never-seen/end", {}, {}, 404, "no session"),
        ("/v1/sessions/x/end", {"reward": "high"}, {}, 400, "invalid"),
        ("/v1/trajectories/x/reward", {}, {}, 422, "reward"),
    ]
    for path, body, headers, status, needle in cases:
        r = httpx.post(u + path, json=body, headers=headers, timeout=60)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        assert needle in r.json()["error"]["message"], (path, r.text)
    # end twice; a turn after the end
    sid = f"e-{uuid.uuid4().hex[:6]}"
    assert httpx.post(u + "/v1/chat/completions", headers={"x-session-id": sid},
                      json={"messages": good, "max_tokens": 2}, timeout=60).status_code == 200
    assert httpx.post(u + f"/v1/sessions/{sid}/end").status_code == 200
    r = httpx.post(u + f"/v1/sessions/{sid}/end")
    assert r.status_code == 409 and "already ended" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/chat/completions", headers={"x-session-id": sid},
                   json={"messages": good, "max_tokens": 2})
    assert r.status_code == 409
    assert httpx.get(u + "/v1/models/gpt-9").status_code == 404
    # a session stays in its group
    sid = f"grp-{uuid.uuid4().hex[:6]}"
    ok = httpx.post(u + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=60,
                    json={"messages": good, "max_tokens": 2, "group_id": "ga"})
    assert ok.status_code == 200, ok.text
    r = httpx.post(u + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=60,
                   json={"messages": good, "max_tokens": 2, "group_id": "gb"})
    assert r.status_code == 400 and "group" in r.json()["error"]["message"]
    r = httpx.post(u + "/v1/chat/completions", json={"messages": good, "metadata": {"k": 1}})
    assert r.status_code == 422


def test_open_sessions_are_published_on_shutdown_of_the_embedded_store(two_engines, tmp_path):
    """The embedded store (journaled: it outlives the process) has no other replica to
    continue a session: a shutdown publishes it (ended_by shutdown)."""
    a, _ = two_engines
    url = f"memory:///{tmp_path}/journal.db"
    sid = f"sd-{uuid.uuid4().hex[:6]}"
    with GatewayProcess({"e0": a.url}, store_url=url) as g:
        r = httpx.post(g.url + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=60,
                       json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3})
        assert r.status_code == 200, r.text
        ids = r.json()["choices"][0]["rollout"]["token_ids"]
        tid = r.json()["choices"][0]["rollout"]["trajectory_id"]
        assert g.stop() == 0
    with GatewayProcess({"e0": a.url}, store_url=url) as g2:
        t = pull_until(g2, {tid})[tid]
    assert t.metadata["session_ended_by"] == "shutdown" and t.token_ids.tolist() == ids


def test_open_sessions_outlive_a_restart_on_the_shared_store(two_engines):
    """On Redis the session lives in the store: a restarted (or any other) gateway serves
    its next turn, and the published trajectory holds both turns."""
    from _gateway_support import redis_urls

    store, registry = redis_urls()
    a, _ = two_engines
    sid = f"sd-{uuid.uuid4().hex[:6]}"
    m = [{"role": "user", "content": "x"}]
    with GatewayProcess({"e0": a.url}, store_url=store, registry_url=registry) as g:
        r = httpx.post(g.url + "/v1/chat/completions", headers={"x-session-id": sid}, timeout=60,
                       json={"messages": m, "max_tokens": 3})
        assert r.status_code == 200, r.text
        first = r.json()["choices"][0]
        assert g.stop() == 0
    m += [{"role": "assistant", "content": first["message"]["content"]},
          {"role": "user", "content": "y"}]
    with GatewayProcess({"e0": a.url}, store_url=store, registry_url=registry) as g2:
        r = httpx.post(g2.url + "/v1/chat/completions", headers={"x-session-id": sid},
                       timeout=60, json={"messages": m, "max_tokens": 3})
        assert r.status_code == 200, r.text
        second = r.json()["choices"][0]["rollout"]
        assert second["trajectory_id"] == first["rollout"]["trajectory_id"]
        assert second["turn"] == 1 and not second.get("branched")
        e = httpx.post(g2.url + f"/v1/sessions/{sid}/end", json={"reward": 1.0}, timeout=30)
        assert e.status_code == 200 and e.json()["published"], e.text
        tid = e.json()["trajectory_id"]
        t = pull_until(g2, {tid})[tid]
    assert t.metadata["session_ended_by"] == "end" and t.metadata["session_turns"] == "2"
    out = t.token_ids.tolist()
    assert out[:len(first["rollout"]["token_ids"])] == first["rollout"]["token_ids"]
    assert out[-len(second["token_ids"]):] == second["token_ids"]


def test_a_model_chat_template_through_serve(two_engines, tmp_path):
    """``--chat-template DIR``: a real tokenizer + chat template loaded by transformers
    (byte-level BPE built here with ``tokenizers``, no merges so its 259 ids fit the
    reference model's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(["x"], trainers.BpeTrainer(
        vocab_size=259, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    assert tok.get_vocab_size() <= 259
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    a, _ = two_engines
    sid = f"hf-{uuid.uuid4().hex[:6]}"
    with GatewayProcess({"e0": a.url}, env={"ROLLOUT_GATEWAY_CHAT_TEMPLATE": str(tmp_path),
                                            "ROLLOUT_GATEWAY_SERVED_MODEL_NAME": "tiny-chatml"}) as g:
        import openai

        c = openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["tiny-chatml"]
        m = [{"role": "user", "content": "hello"}]
        r0 = c.chat.completions.create(model="tiny-chatml", messages=m, max_tokens=4,
                                       extra_body={"session_id": sid})
        m += [{"role": "assistant", "content": r0.choices[0].message.content},
              {"role": "user", "content": "again"}]
        r1 = c.chat.completions.create(model="tiny-chatml", messages=m, max_tokens=4,
                                       extra_body={"session_id": sid})
        assert r1.choices[0].model_extra["rollout"]["branched"] is None
        httpx.post(g.url + f"/v1/sessions/{sid}/end", json={"reward": 1})
        t = pull_until(g, {f"{sid}.b0"})[f"{sid}.b0"]
    first = hf.apply_chat_template(m[:1], tokenize=False, add_generation_prompt=True)
    assert t.prompt_token_ids.tolist() == hf.encode(first, add_special_tokens=False)
    assert t.metadata["chat_template"] == f"hf:{tmp_path}"
    t0, ctx, t1 = t.turns
    out0 = r0.choices[0].model_extra["rollout"]["token_ids"]
    assert t.token_ids[t0.start:t0.end].tolist() == out0
    ctx_text = hf.decode(t.token_ids[ctx.start:ctx.end].tolist(), skip_special_tokens=False)
    tail = "\n" if out0[-1] == hf.eos_token_id else "<|im_end|>\n"
    assert ctx_text == tail + "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    assert t.token_ids[t1.start:t1.end].tolist() == r1.choices[0].model_extra["rollout"]["token_ids"]


def test_follow_up_leaves_an_engine_outside_the_staleness_bound(make_engine, checkpoint_v2):
    """Turns stay on the engine holding the session's prefix while its version is within
    the bound; once the learner moved on and only another engine took the new version,
    the next turn goes there (visible in its segments)."""
    a, b = make_engine(seed=1), make_engine(seed=1)
    sid = f"ver-{uuid.uuid4().hex[:6]}"
    with GatewayProcess({"e0": a.url, "e1": b.url},
                        env={"ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "0"}) as g:
        def turn(m):
            r = httpx.post(g.url + "/v1/chat/completions", headers={"x-session-id": sid},
                           json={"messages": m, "max_tokens": 3}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        m = [{"role": "user", "content": "hi"}]
        c0 = turn(m)
        held = c0["rollout"]["engine_ids"]
        assert len(held) == 1
        other = "e1" if held[0] == "e0" else "e0"
        m += [{"role": "assistant", "content": c0["message"]["content"]},
              {"role": "user", "content": "more"}]
        c1 = turn(m)
        assert c1["rollout"]["engine_ids"] == held  # the prefix's engine, version 0 is fine
        sw = httpx.post(g.url + "/v1/weights", timeout=120, json={
            "version": 1, "source": {"kind": "disk", "path": str(checkpoint_v2)},
            "mode": "retract", "engines": [other]})
        assert sw.status_code == 200, sw.text
        m += [{"role": "assistant", "content": c1["message"]["content"]},
              {"role": "user", "content": "and now"}]
        c2 = turn(m)
        assert c2["rollout"]["engine_ids"] == [other]
        assert set(c2["rollout"]["policy_version"]) == {1}
        # same trajectory, new engine
        assert c2["rollout"]["trajectory_id"] == c0["rollout"]["trajectory_id"]
