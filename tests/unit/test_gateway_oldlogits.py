"""Gateway-side old-logit strategies, pure parts: the scoring request and its parsing, the
swap checks, and the fill bookkeeping (which tokens are scored under which version, in
which order, and what happens when a version cannot be loaded)."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.trajectory import (FinishReason, Segment, TokenColumns, Trajectory,
                                             Transition)
from rollout_gateway.errors import EngineError, FailedPrecondition
from rollout_gateway.old_logits.scorer import parse_scores, score_payload
from rollout_gateway.old_logits.strategies import OldLogitService
from rollout_gateway.settings import load_settings
from rollout_gateway.swap.models import DiskSource, DistributedSource, SwapRequest


def test_score_payload_scores_exactly_the_output_tokens():
    p = score_payload(np.array([3, 4, 5], np.int32), np.array([7, 8], np.int32), 1.0)
    assert p["input_ids"] == [3, 4, 5, 7, 8]
    assert p["logprob_start_len"] == 2  # the last prompt token: its own value is None
    assert p["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0}
    assert p["return_logprob"] is True and "top_logprobs_num" not in p
    # SGLang's input logprobs are at temperature 1 whatever the request says: at another
    # temperature the whole distribution is asked for (rescaled by parse_scores)
    p = score_payload(np.array([3, 4, 5], np.int32), np.array([7, 8], np.int32), 0.7, 259)
    assert p["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0}
    assert p["top_logprobs_num"] == 259
    assert "top_logprobs_num" not in score_payload(np.array([1]), np.array([2]), 0.0)  # greedy
    with pytest.raises(FailedPrecondition, match="vocabulary"):
        score_payload(np.array([1]), np.array([2]), 0.7)
    with pytest.raises(FailedPrecondition):
        score_payload(np.zeros(0, np.int32), np.array([2]), 1.0)


def test_parse_scores_rescales_the_whole_distribution_by_the_temperature():
    logits = np.array([[0.3, -1.0, 2.0, 0.5], [1.5, 0.0, -0.5, 0.25]])
    raw = logits - np.log(np.exp(logits).sum(1, keepdims=True))  # what the engine returns
    rows = [None] + [[[float(v), j, None] for j, v in sorted(enumerate(r), key=lambda e: -e[1])]
                     for r in raw]
    body = orjson.dumps({"meta_info": {"input_top_logprobs": rows}})
    t, ys = 0.6, np.array([2, 3])
    want = logits / t - np.log(np.exp(logits / t).sum(1, keepdims=True))
    got = parse_scores(body, 2, "s", ys, t)
    assert np.allclose(got, want[[0, 1], ys], atol=1e-6)
    assert not np.allclose(got, raw[[0, 1], ys], atol=1e-3)  # not the T = 1 values


def test_parse_scores_checks_the_count_and_missing_values():
    body = orjson.dumps({"meta_info": {"input_token_logprobs": [[None, 5, None],
                                                                [-0.5, 7, None],
                                                                [-1.25, 8, None]]}})
    assert parse_scores(body, 2, "s").tolist() == [-0.5, -1.25]
    with pytest.raises(EngineError, match="expected 4"):
        parse_scores(body, 3, "s")
    bad = orjson.dumps({"meta_info": {"input_token_logprobs": [[None, 5], [None, 7]]}})
    with pytest.raises(EngineError, match="no logprob"):
        parse_scores(bad, 1, "s")


def _svc(mode: str) -> OldLogitService:
    return OldLogitService(load_settings(old_logits={"mode": mode,
                                                     "scorer_url": "http://127.0.0.1:9"}))


def test_swap_checks_refuse_what_a_strategy_cannot_follow():
    disk = DiskSource(path="/ckpt/v1")
    dist = DistributedSource(master_address="h", master_port=1, world_size=2, names=["w"],
                             dtypes=["float32"], shapes=[[1]])
    inter, model = _svc("interruption"), _svc("model")
    inter.check_swap(SwapRequest(version=1, source=disk, mode=SwapMode.ABORT_RESUME))
    inter.check_swap(SwapRequest(version=1, source=disk, mode=SwapMode.DRAIN))
    inter.check_swap(SwapRequest(version=1, source=None, mode=SwapMode.IN_PLACE))  # announce
    for mode in (SwapMode.IN_PLACE, SwapMode.RETRACT):
        with pytest.raises(FailedPrecondition, match="abort_resume"):
            inter.check_swap(SwapRequest(version=1, source=disk, mode=mode))
    with pytest.raises(FailedPrecondition, match="rolling"):
        inter.check_swap(SwapRequest(version=1, source=disk, rolling=True))
    model.check_swap(SwapRequest(version=1, source=disk, mode=SwapMode.IN_PLACE))
    for svc in (inter, model):
        with pytest.raises(FailedPrecondition, match="disk sources"):
            svc.check_swap(SwapRequest(version=1, source=dist))


class _FakeScorer:
    """Stands in for the scorer engine: logprob of token t under version v = -(t + v/10)."""

    def __init__(self, version, sources):
        self.version = version
        self.sources = dict(sources)
        self.lock = asyncio.Lock()
        self.loads: list[int] = []
        self.calls: list[int] = []
        self.counters = {}

    def add_source(self, v, path):
        self.sources[v] = path

    async def ensure(self, v):
        if self.version == v:
            return
        if v not in self.sources:
            raise FailedPrecondition(f"no checkpoint known for version {v}")
        self.version = v
        self.loads.append(v)

    async def score(self, prompt, out, temperature):
        self.calls.append(self.version)
        return -(out.astype(np.float32) + self.version / 10)


def _traj(tokens, versions):
    n = len(tokens)
    cols = TokenColumns(token_ids=np.array(tokens), logprobs=np.zeros(n), entropy=np.zeros(n),
                        policy_version=np.array(versions), kv_version=np.array(versions))
    segs, start = [], 0
    for i in range(1, n + 1):
        if i == n or versions[i] != versions[start]:
            segs.append(Segment(start=start, end=i, policy_version=versions[start],
                                engine_id="e", began=Transition.START if start == 0
                                else Transition.ABORT_RESUME, ended=Transition.FINISHED
                                if i == n else Transition.ABORT_RESUME))
            start = i
    return Trajectory(trajectory_id="t", prompt_token_ids=np.array([1, 2]), tokens=cols,
                      finish_reason=FinishReason("length"), segments=segs)


def test_model_fill_scores_each_token_under_its_version_loaded_version_first():
    svc = _svc("model")
    svc.scorer = _FakeScorer(version=1, sources={0: "/v0", 1: "/v1"})
    t = _traj([10, 11, 12, 13], [0, 0, 1, 1])
    asyncio.run(svc.fill(t, 1.0))
    assert svc.scorer.calls == [1, 0] and svc.scorer.loads == [0]
    np.testing.assert_allclose(t.tokens.old_logprobs, [-10.0, -11.0, -12.1, -13.1])
    assert svc.counters["trajectories_filled"] == 1


def test_fill_failure_is_marked_and_counted_never_silent():
    svc = _svc("model")
    svc.scorer = _FakeScorer(version=1, sources={1: "/v1"})  # no checkpoint for v0
    t = _traj([10, 11], [0, 1])
    asyncio.run(svc.fill(t, 1.0))
    assert t.tokens.old_logprobs is None
    assert "no checkpoint known for version 0" in t.metadata["old_logits_error"]
    assert svc.counters["fill_failed"] == 1


def test_interruption_keeps_swap_scores_and_scores_only_the_tail_at_finish():
    from rollout_gateway.rollouts.sample import Piece, SampleState

    svc = _svc("interruption")
    svc.scorer = _FakeScorer(version=0, sources={0: "/v0", 1: "/v1"})
    st = SampleState("t", np.array([1, 2], np.int32))
    svc.track(st, 1.0)
    cols = TokenColumns(token_ids=np.array([10, 11]), logprobs=np.zeros(2), entropy=np.zeros(2),
                        policy_version=np.array([0, 0]), kv_version=np.array([0, 0]))
    st.pieces.append(Piece("e", 2, cols, [], None, 0.0, None, None))

    async def scenario():
        await svc.busy("t", "e")
        waiter = asyncio.create_task(svc.before_load({"e"}, 0, timeout=5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()  # waits for the aborted request's partial output
        await svc.busy("t", None)
        await waiter
        await svc.after_swap(1, "/v1", ok=True)
        await svc.fill(_traj([10, 11, 12], [0, 0, 1]), 1.0)

    asyncio.run(scenario())
    assert svc.counters["tokens_at_swaps"] == 2 and svc.counters["swaps_scored"] == 1
    assert svc.scorer.calls == [0, 1] and svc.scorer.loads == [1]  # never back to v0
    assert "t" not in svc.live


def test_interruption_sync_does_not_wait_forever_for_a_stuck_request():
    svc = _svc("interruption")
    svc.scorer = _FakeScorer(version=0, sources={0: "/v0"})
    from rollout_gateway.rollouts.sample import SampleState

    st = SampleState("t", np.array([1], np.int32))
    svc.track(st, 1.0)

    async def scenario():
        await svc.busy("t", "e")
        await svc.before_load({"e"}, 0, timeout=0.1)

    asyncio.run(scenario())
    assert svc.counters["late_at_swaps"] == 1  # left for the finish-time fill


def test_serve_flags_and_env_reach_the_settings(monkeypatch):
    import argparse

    from rollout_gateway.commands.serve import add_arguments, settings_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--engine", "e0=http://127.0.0.1:1", "--old-logits", "interruption",
                         "--old-logits-scorer", "http://127.0.0.1:2",
                         "--old-logits-initial-source", "/ckpt/v0"])
    s = settings_from_args(args)
    assert (s.old_logits.mode, s.old_logits.scorer_url, s.old_logits.initial_source) == (
        "interruption", "http://127.0.0.1:2", "/ckpt/v0")
    assert settings_from_args(p.parse_args([])).old_logits.mode == "off"
    monkeypatch.setenv("ROLLOUT_GATEWAY_OLD_LOGITS__MODE", "model")
    monkeypatch.setenv("ROLLOUT_GATEWAY_OLD_LOGITS__SCORER_URL", "http://127.0.0.1:3")
    assert load_settings().old_logits.mode == "model"
    monkeypatch.delenv("ROLLOUT_GATEWAY_OLD_LOGITS__SCORER_URL")
    with pytest.raises(Exception, match="scorer_url"):
        load_settings()


def test_model_fill_learns_checkpoints_of_swaps_another_replica_led():
    from rollout_gateway.registry.base import SwapRecord

    class _Registry:
        async def swaps(self, limit=20):
            return [SwapRecord(version=2, mode="abort_resume", source="/ckpt/v2",
                               status="succeeded"),
                    SwapRecord(version=3, mode="abort_resume", source="distributed:g@h:1",
                               status="succeeded")]

    svc = _svc("model")
    svc.registry = _Registry()
    svc.scorer = _FakeScorer(version=1, sources={1: "/v1"})
    t = _traj([10, 11], [1, 2])
    asyncio.run(svc.fill(t, 1.0))
    assert svc.scorer.sources[2] == "/ckpt/v2" and 3 not in svc.scorer.sources
    np.testing.assert_allclose(t.tokens.old_logprobs, [-10.1, -11.2])
