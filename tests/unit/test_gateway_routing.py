"""Pure parts of the pool and the adapters: routing choice, version parsing, request mapping."""

import pytest

from rollout_gateway.api.generate import to_rollout_request
from rollout_gateway.engines.client import EngineClient, parse_version, parse_weight_version
from rollout_gateway.engines.pool import Engine, EnginePool, EngineState
from rollout_gateway.errors import EngineError, InvalidArgument
from rollout_gateway.rollouts.gatekeeper import _ranges
from rollout_gateway.rollouts.models import SamplingParams
from rollout_gateway.settings import GatewaySettings


def pool_of(*ids: str, imbalance: int = 2) -> EnginePool:
    pool = EnginePool(GatewaySettings(sticky_imbalance=imbalance))
    for i in ids:  # never connects: choose() only reads counters and states
        pool._engines[i] = Engine(id=i, client=EngineClient(i, f"http://127.0.0.1:1/{i}"))
    return pool


def test_least_loaded_wins_without_a_sticky_key():
    pool = pool_of("a", "b", "c")
    pool.get("a").outstanding_requests = 3
    pool.get("b").outstanding_requests = 1
    pool.get("c").outstanding_requests = 2
    assert pool.choose().id == "b"
    pool.get("c").outstanding_requests = 1
    pool.get("c").outstanding_tokens = 10
    pool.get("b").outstanding_tokens = 50
    assert pool.choose().id == "c"  # tie on requests: fewer outstanding tokens


def test_sticky_key_is_stable_until_the_engine_is_overloaded():
    pool = pool_of("a", "b", "c", imbalance=2)
    first = pool.choose(sticky_key="group-7").id
    assert all(pool.choose(sticky_key="group-7").id == first for _ in range(5))
    keys = {pool.choose(sticky_key=f"g{i}").id for i in range(40)}
    assert keys == {"a", "b", "c"}  # keys spread over engines
    pool.get(first).outstanding_requests = 3  # 3 more than the least loaded > imbalance 2
    assert pool.choose(sticky_key="group-7").id != first


def test_unroutable_fenced_and_excluded_engines():
    pool = pool_of("a", "b")
    pool.get("a").state = EngineState.FAILED_LOAD
    assert pool.choose().id == "b"
    assert pool.choose(exclude={"b"}) is None
    pool.get("a").state = EngineState.PAUSED  # 503 while paused is still in rotation
    pool.close_gate(pool.get("b"))
    assert pool.choose().id == "a"  # open gates first
    assert pool.choose(prefer="b").id == "b"  # same engine after abort_resume, even fenced


def test_version_parsing():
    assert parse_version("0.5.23.post1") == (0, 5, 23)
    assert parse_version("v0.5") == (0, 5, 0)
    with pytest.raises(EngineError):
        parse_version("nightly")
    assert parse_weight_version("7") == 7 and parse_weight_version(None) is None
    with pytest.raises(EngineError, match="step-7.*--weight-version <int>"):
        parse_weight_version("step-7", "e0")
    # SGLang's default string is refused at registration with the flag that fixes it
    with pytest.raises(EngineError, match="e0 reports weight_version 'default'.*--weight-version"):
        parse_weight_version("default", "e0")


def test_sampling_params_forward_only_what_was_set_and_what_is_left():
    sp = SamplingParams(max_new_tokens=10, temperature=0.7, min_new_tokens=4)
    assert sp.to_engine(6) == {"max_new_tokens": 6, "temperature": 0.7, "min_new_tokens": 0}
    assert sp.to_engine(10)["min_new_tokens"] == 4


def test_generate_body_maps_onto_a_rollout_request():
    req, opts = to_rollout_request({"text": "hi", "rid": "r1", "return_logprob": True,
                                    "sampling_params": {"n": 3, "max_new_tokens": 5}})
    assert req.prompt == "hi" and req.n == 3 and req.request_id == "r1"
    assert req.sampling_params.max_new_tokens == 5 and opts.return_logprob
    for bad, needle in [([], "JSON object"), ({"text": "x", "lora_path": "y"}, "lora_path"),
                        ({"text": "x", "sampling_params": {"n": 0}}, "n"),
                        ({"text": "x", "sampling_params": {"made_up": 1}}, "made_up"),
                        ({"input_ids": [[1], [2]]}, "one prompt")]:
        with pytest.raises(InvalidArgument, match=needle):
            to_rollout_request(bad)


def test_mask_ranges():
    import numpy as np

    assert _ranges(np.array([0, 1, 2, 5, 7, 8])) == "0-3,5-6,7-9"
    assert _ranges(np.array([], dtype=np.int64)) == ""


def test_engines_without_spans_never_straddle_a_swap():
    from rollout_gateway.core.swap_mode import SwapMode
    from rollout_gateway.swap.orchestrator import effective_mode

    pool = pool_of("new", "old")
    pool.get("new").client.info.version = (0, 5, 23)
    pool.get("old").client.info.version = (0, 5, 12)  # pause modes, no weight_versions spans
    for mode in (SwapMode.IN_PLACE, SwapMode.RETRACT):
        assert effective_mode(pool.get("new"), mode) is mode
        assert effective_mode(pool.get("old"), mode) is SwapMode.ABORT_RESUME
    assert effective_mode(pool.get("old"), SwapMode.DRAIN) is SwapMode.DRAIN


def test_version_policy_narrows_the_choice_and_prefer():
    from rollout_gateway.core.version_policy import VersionPolicy

    pool = pool_of("a", "b", "c")
    for i, v in zip("abc", (3, 1, None)):
        pool.get(i).version = v
    stale1 = VersionPolicy.parse("max_staleness:1")
    pool.get("a").outstanding_requests = 5  # least load alone would pick b or c
    assert pool.choose(policy=stale1, learner_version=3).id == "a"
    assert pool.choose(policy=stale1, learner_version=3, prefer="b").id == "a"
    assert pool.choose(policy=stale1, learner_version=5) is None
    assert [e.id for e in pool.barred(stale1, 5)] == ["a", "b", "c"]
    assert pool.choose(policy=VersionPolicy.parse("min_version:1"), exclude={"a"}).id == "b"


async def test_acquire_waits_up_to_the_bound_for_a_qualifying_engine():
    import asyncio

    from rollout_gateway.core.version_policy import VersionPolicy
    from rollout_gateway.errors import Unavailable, VersionPolicyUnmet

    pool = EnginePool(GatewaySettings(version_policy_wait_s=0.3))
    for i, v in (("a", 1), ("b", 2)):
        pool._engines[i] = Engine(id=i, client=EngineClient(i, f"http://127.0.0.1:1/{i}"),
                                  version=v)
    latest = VersionPolicy.parse("latest")
    with pytest.raises(VersionPolicyUnmet, match=r"latest.*learner version 3.*a v1, b v2") as ei:
        await pool.acquire(policy=latest, learner_version=3)
    assert ei.value.retryable and ei.value.http_status == 503
    assert ei.value.details["engine_versions"] == {"a": 1, "b": 2}
    # an engine that reaches the version while the request waits takes it
    pool.settings.version_policy_wait_s = 60
    waiting = asyncio.ensure_future(pool.acquire(policy=latest, learner_version=3))
    await asyncio.sleep(0)
    assert not waiting.done()
    pool.get("b").version = 3
    await pool._notify()
    assert (await asyncio.wait_for(waiting, 5)).id == "b"
    # no engine in rotation at all is the plain 503 (no_engine_s), not the policy's
    pool.get("a").state = pool.get("b").state = EngineState.UNHEALTHY
    pool.settings.timeouts.no_engine_s = 0
    with pytest.raises(Unavailable) as ei:
        await pool.acquire(policy=latest, learner_version=3)
    assert type(ei.value) is Unavailable and "no engine available" in ei.value.message
