"""Agent sessions, pure parts: chat templates (reference byte template; a real tokenizer +
chat template through transformers, built here with the ``tokenizers`` library), message
validation, matching a request against the stored tokens (continue / branch), assembly
into one trajectory with loss mask and turns, the wire (codec, learner decode, collate)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_gateway.core.trajectory import (
    FinishReason,
    RoutedExperts,
    Segment,
    TokenColumns,
    Trajectory,
    Turn,
)
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.sessions.messages import assistant_message, canonical_messages
from rollout_gateway.sessions.session import Branch, Call, plan_chat, plan_completion
from rollout_gateway.sessions import templates
from rollout_gateway.sessions.templates import ReferenceTemplate, parse_tool_calls

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A real tokenizer directory (byte-level BPE trained here, ChatML specials and chat
    template), loaded by transformers.AutoTokenizer exactly as a model path would be."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["hello there, how are you today?", "user assistant system tool",
              "the answer is 42", "observation: step done"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=specials[1:])
    fast.chat_template = CHATML
    d = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(d)
    return str(d)


def turn_traj(prompt: list[int], out: list[int], version: int = 0, finish: str = "stop",
              routing: bool = False) -> Trajectory:
    n = len(out)
    v = np.full(n, version, np.int32)
    cols = TokenColumns(np.asarray(out, np.int32), -np.arange(1, n + 1, dtype=np.float32) / 10,
                        np.full(n, 0.5, np.float32), v, v)
    routed = None
    if routing:
        rows = len(prompt) + n - 1
        routed = RoutedExperts(np.full((rows, 2, 2), version + 1, np.uint8), num_experts=4)
    return Trajectory("t", np.asarray(prompt, np.int32), cols, FinishReason(type=finish),
                      [Segment(0, n, version, "e0")], routed_experts=routed)


def record(tpl, branch, plan, msgs, out, version=0, finish="stop", routing=False):
    """What the manager does after a call (minus I/O)."""
    if branch is None or plan.kind != "continue":
        prompt = list(plan.context_ids) if branch is None or plan.kind == "new" else \
            branch.sequence()[:plan.prefix_len].tolist() + list(plan.context_ids)
        branch = Branch("s.b0", 0, np.asarray(prompt, np.int32))
        branch.add_turn([], turn_traj(prompt, out, version, finish, routing))
    else:
        seq = branch.sequence().tolist() + list(plan.context_ids)
        branch.add_turn(list(plan.context_ids), turn_traj(seq, out, version, finish, routing))
    body = out[:-1] if out and out[-1] in tpl.end_ids else out
    content = tpl.decode(body)
    branch.messages = list(msgs) + [assistant_message(content, [])]
    seq_len = int(branch.prompt_ids.shape[0]) + branch.output_len
    branch.calls.append(Call(len(msgs), plan.prompt_text, seq_len, np.asarray(out, np.int32),
                             content))
    return branch, content


# ---- messages ----

def test_messages_canonical_form_and_rules():
    m = canonical_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}])
    assert m[0] == {"role": "system", "content": "be brief"}
    assert m[2]["tool_calls"][0]["function"]["arguments"] == '{"a": 2, "b": 1}'
    bad = [
        ([], "non-empty"),
        ([{"role": "wizard", "content": "x"}], "role"),
        ([{"role": "user"}], "content is required"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text parts"),
        ([{"role": "tool", "tool_call_id": "zz", "content": "x"}], "no earlier"),
        ([{"role": "tool", "content": "x"}], "tool_call_id"),
        ([{"role": "assistant", "content": None}], "content or tool_calls"),
        ([{"role": "user", "content": "x", "tool_calls": [{"id": "a"}]}], "only assistant"),
        ([{"role": "assistant", "content": "", "tool_calls": [{"id": "a", "function": {}}]}],
         "name"),
        (["just a string"], "object"),
    ]
    for msgs, needle in bad:
        with pytest.raises(InvalidArgument) as ei:
            canonical_messages(msgs)
        assert needle in ei.value.message, (msgs, ei.value.message)
    # a call answered once cannot be answered again
    calls = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "1"},
        {"role": "tool", "tool_call_id": "c", "content": "2"}]
    with pytest.raises(InvalidArgument):
        canonical_messages(calls)


def test_tool_call_parsing():
    text = 'let me see<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>'
    content, calls = parse_tool_calls(text, turn=3)
    assert content == "let me see"
    assert calls == [{"id": "call_3_0", "type": "function",
                      "function": {"name": "calc", "arguments": '{"x": 1}'}}]
    assert parse_tool_calls("<tool_call>not json</tool_call>", 0) == (
        "<tool_call>not json</tool_call>", [])
    two = '<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'
    assert [c["function"]["name"] for c in parse_tool_calls(two, 0)[1]] == ["a", "b"]
    content, calls = parse_tool_calls(two, 0, limit=1)  # parallel_tool_calls: false
    assert [c["function"]["name"] for c in calls] == ["a"]
    assert content == '<tool_call>{"name": "b"}</tool_call>'


# ---- reference template ----

def test_reference_template_renders_and_encodes_specials():
    tpl = ReferenceTemplate()
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hé"}]
    text = tpl.render(msgs, tools=None, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nS<|eos|>\n<|user|>\nhé<|eos|>\n<|assistant|>\n"
    ids = tpl.encode(text)
    assert ids[0] == 256 and ids.count(257) == 2 and ids[-1] == ord("\n")
    assert tpl.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=260), max_size=40), st.booleans())
def test_reference_template_vocabulary_is_the_reference_engines(ids, skip):
    """The gateway's byte template and the engine's tokenizer are two programs: same ids,
    same text, same token texts (specials between partial UTF-8 characters included)."""
    from reference_engine import tokenizer as engine_tok

    tpl, tok = ReferenceTemplate(), engine_tok.ByteTokenizer()
    assert tpl.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    assert [tpl.token_text(t) for t in ids] == [tok.token_text(t) for t in ids]
    assert {templates.BOS_ID, templates.EOS_ID, templates.PAD_ID} == {
        engine_tok.BOS_ID, engine_tok.EOS_ID, engine_tok.PAD_ID}
    assert templates.SPECIAL_NAMES == engine_tok.SPECIAL_NAMES


def test_continue_keeps_model_ids_and_tokenizes_only_the_new_context():
    tpl = ReferenceTemplate()
    msgs = [{"role": "user", "content": "hi"}]
    p0 = plan_chat(tpl, None, msgs, None)
    assert p0.kind == "new"
    # invalid UTF-8 from the model: text round trips to U+FFFD, ids must stay as sampled
    out = [0xC3, 0x28, ord("x"), 257]
    b, content = record(tpl, None, p0, msgs, out, routing=True)
    assert "\ufffd" in content
    msgs2 = msgs + [{"role": "assistant", "content": content}, {"role": "user", "content": "go"}]
    p1 = plan_chat(tpl, b, canonical_messages(msgs2), None)
    assert p1.kind == "continue" and p1.prefix_len == len(b.sequence())
    assert tpl.decode(p1.context_ids, skip_special_tokens=False) == \
        "\n<|user|>\ngo<|eos|>\n<|assistant|>\n"
    b, _ = record(tpl, b, p1, canonical_messages(msgs2), [ord("a"), ord("b")], version=1,
                  finish="length", routing=True)
    t = b.trajectory(session_id="s", ended_by="end", reward=1.0, template=tpl.name)
    n0, nc = len(out), len(p1.context_ids)
    assert t.tokens.token_ids[:n0].tolist() == out  # exactly as sampled
    assert t.loss_mask.tolist() == [1] * n0 + [0] * nc + [1, 1]
    assert [(x.start, x.end, x.kind, x.index) for x in t.turns] == [
        (0, n0, "model", 0), (n0, n0 + nc, "context", 1), (n0 + nc, n0 + nc + 2, "model", 1)]
    # context carries the version of the request that prefilled it, logprob/entropy 0
    assert (t.tokens.policy_version[n0:n0 + nc] == 1).all()
    assert (t.tokens.logprobs[n0:n0 + nc] == 0).all()
    assert [s.began.value for s in t.segments] == ["start", "context", "start"]
    # routing: rows of the first call, then the second call's rows past them
    assert t.routed_experts.data.shape[0] == len(t.prompt_token_ids) + t.num_tokens - 1
    first_rows = len(p0.context_ids) + n0 - 1
    assert (t.routed_experts.data[:first_rows] == 1).all()
    assert (t.routed_experts.data[first_rows:] == 2).all()
    assert t.metadata["session_turns"] == "2" and t.reward == 1.0
    # a reply cut by length: the template's end-of-turn token becomes context
    msgs3 = canonical_messages(msgs2) + [{"role": "assistant", "content": "ab"},
                                        {"role": "user", "content": "z"}]
    p2 = plan_chat(tpl, b, msgs3, None)
    assert p2.kind == "continue"
    assert tpl.decode(p2.context_ids, skip_special_tokens=False) == \
        "<|eos|>\n<|user|>\nz<|eos|>\n<|assistant|>\n"


def test_edited_history_branches_from_the_longest_matching_prefix():
    tpl = ReferenceTemplate()
    m0 = [{"role": "user", "content": "q"}]
    b, c0 = record(tpl, None, plan_chat(tpl, None, m0, None), m0, [ord("a"), 257])
    m1 = m0 + [{"role": "assistant", "content": c0}, {"role": "user", "content": "r"}]
    p = plan_chat(tpl, b, m1, None)
    b, c1 = record(tpl, b, p, m1, [ord("b"), 257])
    # the harness rewrites the second user message: branch after the first reply
    m2 = m0 + [{"role": "assistant", "content": c0}, {"role": "user", "content": "EDITED"}]
    p = plan_chat(tpl, b, m2, None)
    assert p.kind == "branch" and p.reason == "history_edited"
    assert p.prefix_len == b.calls[0].seq_len
    # rewrites the first user message: nothing matches, a fresh branch
    m3 = [{"role": "user", "content": "other"}, {"role": "assistant", "content": c0},
          {"role": "user", "content": "r"}]
    p = plan_chat(tpl, b, m3, None)
    assert p.kind == "branch" and p.prefix_len == 0
    assert p.context_ids == tpl.encode(tpl.render(m3, tools=None, add_generation_prompt=True))
    # edits the model's reply: also a branch, never a silent re-tokenization
    m4 = m0 + [{"role": "assistant", "content": "not what the model said"},
               {"role": "user", "content": "r"}]
    assert plan_chat(tpl, b, m4, None).kind == "branch"
    # changing the tools re-renders the top of the prompt
    assert plan_chat(tpl, b, m1 + [{"role": "assistant", "content": c1}], [{"type": "function"}]
                     ).reason == "tools_changed"


def test_completion_sessions_extend_text_or_ids():
    tpl = ReferenceTemplate()
    p = plan_completion(tpl, None, "abc")
    b = Branch("s.b0", 0, np.asarray(p.context_ids, np.int32))
    b.add_turn([], turn_traj(p.context_ids, [ord("d"), ord("e")], finish="length"))
    b.calls.append(Call(0, "abc", 5, np.asarray([ord("d"), ord("e")]), "de"))
    q = plan_completion(tpl, b, "abcde and more")
    assert q.kind == "continue" and q.context_ids == list(b" and more")
    assert plan_completion(tpl, b, "abX").kind == "branch"
    assert plan_completion(tpl, b, [1, 2]).kind == "branch"


# ---- a real tokenizer and chat template (transformers) ----

def test_hf_template_keeps_non_canonical_model_tokenization(hf_dir):
    from rollout_gateway.sessions.templates import HFTemplate, load_template

    tpl = load_template(hf_dir)
    assert isinstance(tpl, HFTemplate)
    im_end = tpl.tok.convert_tokens_to_ids("<|im_end|>")
    assert tpl.end_ids == {im_end}
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"}]
    p0 = plan_chat(tpl, None, msgs, None)
    assert tpl.decode(p0.context_ids, skip_special_tokens=False) == \
        "<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhello there<|im_end|>\n" \
        "<|im_start|>assistant\n"
    # the model spelled "hello" one character at a time: not how the tokenizer would
    chars = [tpl.tok.convert_tokens_to_ids(c) for c in "hello"]
    assert chars != tpl.encode("hello")
    out = chars + [im_end]
    b, content = record(tpl, None, p0, msgs, out)
    assert content == "hello"
    msgs2 = msgs + [{"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "the answer is 42"}]
    p1 = plan_chat(tpl, b, msgs2, None)
    assert p1.kind == "continue"
    assert tpl.decode(p1.context_ids, skip_special_tokens=False) == \
        "\n<|im_start|>user\nthe answer is 42<|im_end|>\n<|im_start|>assistant\n"
    b, _ = record(tpl, b, p1, msgs2, tpl.encode("done") + [im_end])
    t = b.trajectory(session_id="s", ended_by="end", reward=None, template=tpl.name)
    assert t.tokens.token_ids[:len(out)].tolist() == out  # never re-tokenized
    # the whole sequence reads as the template's rendering of the conversation
    full = tpl.decode(np.concatenate([t.prompt_token_ids, t.tokens.token_ids]).tolist(),
                      skip_special_tokens=False)
    conv = msgs2 + [{"role": "assistant", "content": "done"}]
    assert full + "\n" == tpl.render(conv, tools=None, add_generation_prompt=False)


def test_hf_template_tool_calls_render_and_match(hf_dir):
    from rollout_gateway.sessions.templates import load_template

    tpl = load_template(hf_dir)
    im_end = tpl.tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [{"role": "user", "content": "calc"}]
    p0 = plan_chat(tpl, None, msgs, None)
    raw = '<tool_call>{"name": "calc", "arguments": {"expr": "6*7"}}</tool_call>'
    out = tpl.encode(raw) + [im_end]
    b = Branch("s.b0", 0, np.asarray(p0.context_ids, np.int32))
    b.add_turn([], turn_traj(p0.context_ids, out))
    content, calls = parse_tool_calls(tpl.decode(tpl.encode(raw)), 0)
    assert content == "" and calls[0]["function"]["name"] == "calc"
    reply = assistant_message(content, calls)
    b.messages = msgs + [reply]
    b.calls.append(Call(1, p0.prompt_text, len(b.sequence()), np.asarray(out), content))
    # the harness echoes the call (arguments re-serialized) and answers it
    echoed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0_0", "type": "function",
         "function": {"name": "calc", "arguments": json.dumps({"expr": "6*7"})}}]}
    msgs2 = canonical_messages(msgs + [echoed, {"role": "tool", "tool_call_id": "call_0_0",
                                                "content": "42"}])
    p1 = plan_chat(tpl, b, msgs2, None)
    assert p1.kind == "continue", p1.reason
    assert tpl.decode(p1.context_ids, skip_special_tokens=False) == \
        "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"


def test_hf_template_bad_path():
    from rollout_gateway.sessions.templates import load_template

    with pytest.raises(InvalidArgument):
        load_template("/nonexistent/model/dir")


# ---- trajectory validation and the wire ----

def session_traj() -> Trajectory:
    tpl = ReferenceTemplate()
    m0 = [{"role": "user", "content": "q"}]
    p = plan_chat(tpl, None, m0, None)
    b, c0 = record(tpl, None, p, m0, [ord("a"), 257], routing=True)
    m1 = m0 + [{"role": "assistant", "content": c0}, {"role": "user", "content": "r"}]
    b, _ = record(tpl, b, plan_chat(tpl, b, m1, None), m1, [ord("b"), ord("c")], version=1,
                  finish="length", routing=True)
    return b.trajectory(session_id="s", ended_by="end", reward=0.5, template="reference")


def test_trajectory_rejects_bad_mask_and_turns():
    t = session_traj()
    with pytest.raises(InvalidArgument):
        Trajectory("x", t.prompt_token_ids, t.tokens, t.finish_reason, t.segments,
                   loss_mask=np.ones(3, np.uint8))
    with pytest.raises(InvalidArgument):
        Trajectory("x", t.prompt_token_ids, t.tokens, t.finish_reason, t.segments,
                   turns=[Turn(0, 1, "model")])
    with pytest.raises(InvalidArgument):
        Trajectory("x", t.prompt_token_ids, t.tokens, t.finish_reason, t.segments,
                   turns=[Turn(0, t.num_tokens, "other")])


def test_codec_learner_decode_and_collate_honour_the_mask():
    import torch

    from learner_client.batch import collate
    from learner_client.wire import parse_batch
    from rollout_gateway.core import trajectory_codec
    from rollout_proto import codec

    t = session_traj()
    back = trajectory_codec.decode(trajectory_codec.encode(t))
    assert back.loss_mask.tolist() == t.loss_mask.tolist()
    assert back.turns == t.turns
    data = trajectory_codec.encode(t)
    fast, _, _ = parse_batch(codec.encode_batch([("1-0", 1, False, data)], 0, 0))
    for r in fast:
        assert r.loss_mask.dtype == np.uint8 and r.loss_mask.tolist() == t.loss_mask.tolist()
        assert [(x.start, x.end, x.kind, x.index) for x in r.turns] == \
            [(x.start, x.end, x.kind, x.index) for x in t.turns]
    p = len(t.prompt_token_ids)
    for layout in ("padded", "packed"):
        b = collate(fast, learner_version=1, layout=layout)
        lm = b.loss_mask.reshape(-1)[p:p + t.num_tokens]
        assert torch.equal(lm, torch.from_numpy(t.loss_mask.astype(np.float32)))
        assert b.loss_mask.reshape(-1)[:p].sum() == 0
    ps = collate(fast, learner_version=1).pack_samples()
    assert ps[0].columns["loss_mask"].tolist() == t.loss_mask.astype(np.float32).tolist()
    # a plain rollout (no mask on the wire) still trains on every output token
    plain = Trajectory("p", t.prompt_token_ids, t.tokens, t.finish_reason, t.segments)
    r = parse_batch(codec.encode_batch([("2-0", 1, False, trajectory_codec.encode(plain))], 0, 0))[0][0]
    assert r.loss_mask is None and r.turns == []
    assert collate([r], 1).loss_mask[0, p:].sum() == t.num_tokens


def test_streamed_text_never_sends_what_a_stop_string_will_cut():
    from rollout_gateway.api.openai import _TextStream

    tpl = ReferenceTemplate()
    s = _TextStream(tpl, ["bX", "zz"], hold_all=False)
    assert s.feed(list(b"aab")) == "aa"  # "b" may begin "bX": held back
    assert s.feed(list(b"X")) == ""  # the stop string completed: nothing past it
    assert s.finish("aa") == ""
    s = _TextStream(tpl, ["bX"], hold_all=False)
    assert s.feed(list(b"aab")) == "aa" and s.feed(list(b"c")) == "bc"
    assert s.finish("aabc") == ""
    # a partial UTF-8 character is not sent until complete; the end-of-turn id is not text
    s = _TextStream(tpl, [], hold_all=False)
    assert s.feed([0xC3]) == "" and s.feed([0xA9, 257]) == "é"
    # with tools the whole content comes at the end
    s = _TextStream(tpl, [], hold_all=True)
    assert s.feed(list(b"abc")) == "" and s.finish("abc") == "abc"


# ---- the session manager: ending, rewards, idle timeout, stale turns (no engine) ----

class _GW:
    """The parts of the Gateway the manager touches when ending sessions."""

    def __init__(self, **settings):
        from rollout_gateway.settings import GatewaySettings
        from rollout_gateway.store.memory import MemoryStore

        self.settings = GatewaySettings(**settings)
        self.store = MemoryStore()


def _manager(**settings):
    from rollout_gateway.sessions.manager import SessionManager
    from rollout_gateway.sessions.records import BranchStart, apply, turn_record
    from rollout_gateway.sessions.store import Head

    gw = _GW(**settings)
    mgr = SessionManager(gw.settings, None, learner_version=None, engines=list,
                         publish=gw.store.publish)
    tpl = mgr.template
    m0 = [{"role": "user", "content": "q"}]

    async def open_session(sid, verdict=""):
        plan = plan_chat(tpl, None, m0, None)
        prompt = list(plan.context_ids)
        turn = turn_traj(prompt, [ord("a"), ord("b"), 257])
        if verdict:
            turn.metadata["stale_verdict"] = verdict
        start = BranchStart(f"{sid}.b0", 0, np.asarray(prompt, np.int32))
        rec = turn_record(apply(None, start), [], turn, kind="chat", plan_input=m0,
                          prompt_text=plan.prompt_text, content="ab",
                          reply_msg=assistant_message("ab", []), group_id="", metadata={})
        head = Head("default", sid, None, 1, 2)
        assert await mgr.store.create(head, "test", 30, 100, 100) == "ok"
        assert await mgr.store.commit(("default", sid), "test", head, [start, rec], True)

    return gw, mgr, open_session


async def _stored(gw) -> dict:
    import uuid

    from rollout_gateway.core import trajectory_codec

    g = f"g{uuid.uuid4().hex[:8]}"  # a fresh group sees everything stored
    await gw.store.create_group(g)
    return {e.trajectory_id: trajectory_codec.decode(e.data) for e in await gw.store.read(g, "c", 100)}


async def test_manager_end_reward_later_and_errors():
    from rollout_gateway.errors import FailedPrecondition, NotFound

    gw, mgr, open_session = _manager(session_reward_wait_s=30)
    await open_session("a")
    await open_session("b")
    res = await mgr.end("a", 2.0, await_reward=False)
    assert res["published"] and res["trajectory_id"] == "a.b0"
    with pytest.raises(FailedPrecondition):
        await mgr.end("a", None, await_reward=False)
    with pytest.raises(FailedPrecondition):  # a call after the end
        await mgr._session("default", "a")
    with pytest.raises(NotFound):
        await mgr.end("zzz", None, await_reward=False)
    held = await mgr.end("b", None, await_reward=True)
    assert held["published"] is False and held["awaiting_reward"]
    assert "b.b0" not in await _stored(gw)
    with pytest.raises(FailedPrecondition):  # published already, without a reward
        await mgr.attach_reward("a.b0", 1.0)
    with pytest.raises(NotFound):
        await mgr.attach_reward("nope", 1.0)
    assert (await mgr.attach_reward("b.b0", -1.0))["published"]
    got = await _stored(gw)
    assert got["a.b0"].reward == 2.0 and got["b.b0"].reward == -1.0
    assert got["a.b0"].loss_mask.tolist() == [1, 1, 1]
    assert mgr.counters["rewards_attached"] == 1


async def test_manager_idle_timeout_reward_wait_and_stale_drop():
    import time

    gw, mgr, open_session = _manager(session_idle_timeout_s=5, session_reward_wait_s=5)
    await open_session("idle")
    await open_session("fresh")
    await open_session("stale", verdict="drop")
    mgr.store.sessions[("default", "idle")].head.last_active = time.time() - 10
    await mgr.end("fresh", None, await_reward=True)
    mgr.store.held_["fresh.b0"] = (mgr.store.held_["fresh.b0"][0], time.time() - 1)  # over
    res = await mgr.end("stale", 1.0, await_reward=False)
    assert res["published"] is False and "staleness" in res["reason"]
    await mgr.sweep()
    got = await _stored(gw)
    assert got["idle.b0"].metadata["session_ended_by"] == "idle_timeout"
    assert got["fresh.b0"].metadata["reward"] == "missing" and got["fresh.b0"].reward is None
    assert "stale.b0" not in got
    assert mgr.counters["sessions_idle_ended"] == 1 and mgr.counters["session_stale_dropped"] == 1
    assert ("default", "idle") not in mgr.store.sessions
    assert mgr.store.ended[("default", "idle")] == "idle_timeout"


def test_stale_masked_turn_ranges_move_to_session_positions():
    tpl = ReferenceTemplate()
    m0 = [{"role": "user", "content": "q"}]
    p0 = plan_chat(tpl, None, m0, None)
    b, c0 = record(tpl, None, p0, m0, [ord("a"), 257])
    m1 = m0 + [{"role": "assistant", "content": c0}, {"role": "user", "content": "r"}]
    p1 = plan_chat(tpl, b, m1, None)
    turn = turn_traj(b.sequence().tolist() + p1.context_ids, [1, 2, 3], version=0)
    turn.metadata.update({"stale_verdict": "mask", "stale_masked_tokens": "0-2"})
    b.add_turn(p1.context_ids, turn)
    t = b.trajectory(session_id="s", ended_by="end", reward=None, template="reference")
    base = 2 + len(p1.context_ids)
    assert t.metadata["stale_verdict"] == "mask"
    assert t.metadata["stale_masked_tokens"] == f"{base}-{base + 2}"


def test_openai_routes_need_the_client_token_when_one_is_set():
    from fastapi.testclient import TestClient

    from rollout_gateway.api.app import create_app
    from rollout_gateway.gateway import Gateway
    from rollout_gateway.settings import GatewaySettings

    app = create_app(Gateway(GatewaySettings(client_api_key="client-key-0123456789",
                                             admin_api_key="admin-key-0123456789")))
    with TestClient(app) as c:
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions"), ("POST", "/v1/sessions/s/end"),
                             ("POST", "/v1/trajectories/t/reward")):
            assert c.request(method, path, json={}).status_code == 401, path
        ok = c.get("/v1/models", headers={"Authorization": "Bearer client-key-0123456789"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "reference"
