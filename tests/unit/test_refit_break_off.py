"""Which requests in flight a refit breaks off before its pause, and why (pure: the
orchestrator's ``_to_break_off`` over an engine's leases)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.version_policy import ANY, VersionPolicy
from rollout_gateway.engines.pool import (
    BREAK_KV_POLICY,
    BREAK_STALE_PUBLISH,
    BREAK_STALE_REQUEUE,
    Lease,
)
from rollout_gateway.registry.base import EngineSwapOutcome
from rollout_gateway.swap.models import SwapRequest
from rollout_gateway.swap.orchestrator import SwapOrchestrator


def lease(rid: str, *, policy: str = "any", kv: int | None = 3, start: int | None = 3,
          routed: bool = False) -> Lease:
    return Lease(engine=None, tokens=8, rid=rid, routed=routed,  # type: ignore[arg-type]
                 policy=VersionPolicy.parse(policy), kv_version=kv, start_version=start)


def broken(mode: SwapMode, leases: list[Lease], **req) -> tuple[dict[str, str | None], tuple]:
    r = EngineSwapOutcome(engine_id="e")
    out = SwapOrchestrator._to_break_off(SimpleNamespace(leases=set(leases)),
                                         SwapRequest(version=5, mode=mode, **req), mode, r)
    return {x.rid: x.broken_off for x in out}, (r.stale_dropped, r.kv_refused)


def test_a_default_refit_breaks_nothing_off():
    ls = [lease("a", start=0, kv=0), lease("b", policy="max_staleness:2", kv=4)]
    for mode in SwapMode:
        assert broken(mode, ls) == ({}, (0, 0))


def test_drop_stale_takes_samples_that_started_below_the_threshold_in_every_mode():
    ls = [lease("old", start=2), lease("edge", start=3), lease("new", start=4),
          lease("unknown", start=None), lease("", start=0)]  # no rid yet: nothing to abort
    for mode in SwapMode:
        for then, why in (("publish", BREAK_STALE_PUBLISH), ("requeue", BREAK_STALE_REQUEUE)):
            got = broken(mode, ls, drop_stale={"below_version": 3, "then": then})
            assert got == ({"old": why}, (1, 0)), (mode, then)


def test_in_place_refuses_kv_the_policy_does_not_admit():
    # the refit publishes 5: KV of 4 is one version old, of 3 two
    ls = [lease("any", kv=3), lease("s1-ok", policy="max_staleness:1", kv=4),
          lease("s1-old", policy="max_staleness:1", kv=3), lease("latest", policy="latest", kv=4),
          lease("min", policy="min_version:3", kv=3), lease("unknown", policy="latest", kv=None)]
    got, counts = broken(SwapMode.IN_PLACE, ls)
    assert got == {"s1-old": BREAK_KV_POLICY, "latest": BREAK_KV_POLICY,
                   "unknown": BREAK_KV_POLICY} and counts == (0, 3)
    # retract, abort_resume, drain rebuild the KV: no request is refused for it
    for mode in (SwapMode.RETRACT, SwapMode.ABORT_RESUME, SwapMode.DRAIN):
        assert broken(mode, ls) == ({}, (0, 0))


def test_a_stale_request_counts_once_and_routed_requests_resume_under_retract():
    ls = [lease("both", policy="latest", kv=4, start=1), lease("routed", routed=True)]
    assert broken(SwapMode.IN_PLACE, ls, drop_stale={"below_version": 2}) == (
        {"both": BREAK_STALE_PUBLISH}, (1, 0))
    assert broken(SwapMode.RETRACT, ls) == ({"routed": None}, (0, 0))
    assert ANY == VersionPolicy.parse("any")


def test_drop_stale_is_validated():
    for bad in ({"below_version": -1}, {"below_version": 2, "then": "discard"},
                {"below_version": 2, "extra": 1}, {}):
        with pytest.raises(ValidationError):
            SwapRequest(version=5, drop_stale=bad)
