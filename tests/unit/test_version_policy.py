"""The version policy's words (core.version_policy): parsing at the edge, and which
engine versions each form admits."""

from __future__ import annotations

import pytest

from rollout_gateway.core.version_policy import ANY, PolicyKind, VersionPolicy
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.settings import GatewaySettings


@pytest.mark.parametrize("text, kind, bound", [
    ("any", PolicyKind.ANY, None),
    ("latest", PolicyKind.LATEST, None),
    (" latest ", PolicyKind.LATEST, None),
    ("min_version:0", PolicyKind.MIN_VERSION, 0),
    ("min_version:17", PolicyKind.MIN_VERSION, 17),
    ("max_staleness:1", PolicyKind.MAX_STALENESS, 1),
    ("max_staleness:2147483647", PolicyKind.MAX_STALENESS, 2147483647),
])
def test_parse_forms(text, kind, bound):
    p = VersionPolicy.parse(text)
    assert (p.kind, p.bound) == (kind, bound)
    assert VersionPolicy.parse(str(p)) == p  # the canonical text parses to the same policy


@pytest.mark.parametrize("text", [
    "", "ANY", "newest", "latest-only", "latest:1", "any:0", "min_version", "min_version:",
    "max_staleness:-1", "max_staleness:1.5", "max_staleness: 1", "min-version:3",
    "max_staleness:2147483648", "max_staleness:99999999999", "min_version:3;latest",
    "x" * 500, None, 3, ["any"],
])
def test_bad_values_name_the_forms(text):
    with pytest.raises(InvalidArgument) as ei:
        VersionPolicy.parse(text)
    msg = ei.value.message
    assert "any, latest, min_version:<v> or max_staleness:<k>" in msg
    assert len(msg) < 300  # a long value is cut, not echoed whole


def test_admits():
    learner = 5
    stale1 = VersionPolicy.parse("max_staleness:1")
    assert [stale1.admits(v, learner) for v in (3, 4, 5, 6)] == [False, True, True, True]
    latest = VersionPolicy.parse("latest")
    assert [latest.admits(v, learner) for v in (4, 5, 6)] == [False, True, True]
    floor = VersionPolicy.parse("min_version:3")
    assert [floor.admits(v, learner) for v in (2, 3, 9)] == [False, True, True]
    # an engine whose version is unknown qualifies under "any" only
    assert ANY.admits(None, learner) and ANY.admits(0, learner)
    assert not any(p.admits(None, learner) for p in (stale1, latest, floor))


def test_needs_learner():
    assert VersionPolicy.parse("latest").needs_learner
    assert VersionPolicy.parse("max_staleness:0").needs_learner
    assert not VersionPolicy.parse("min_version:2").needs_learner
    assert not ANY.needs_learner


def test_setting_is_validated_and_canonical(monkeypatch):
    assert GatewaySettings().version_policy == "any"
    monkeypatch.setenv("ROLLOUT_GATEWAY_VERSION_POLICY", " max_staleness:2")
    assert GatewaySettings().version_policy == "max_staleness:2"
    monkeypatch.setenv("ROLLOUT_GATEWAY_VERSION_POLICY", "stale")
    with pytest.raises(ValueError, match="version policy must be"):
        GatewaySettings()
    monkeypatch.setenv("ROLLOUT_GATEWAY_VERSION_POLICY_WAIT_S", "-1")
    with pytest.raises(ValueError):
        GatewaySettings(version_policy="any")


def test_version_cut_groups_engines_newest_first():
    from types import SimpleNamespace as E

    from rollout_gateway.observe.lag import version_cut

    engines = [E(id="a", version=3, routable=True), E(id="b", version=1, routable=False),
               E(id="c", version=None, routable=True), E(id="d", version=3, routable=True),
               E(id="e", version=2, routable=True)]
    cut = [c.model_dump() for c in version_cut(engines, 3)]
    assert cut == [{"version": 3, "lag": 0, "engines": ["a", "d"], "routable": ["a", "d"]},
                   {"version": 2, "lag": 1, "engines": ["e"], "routable": ["e"]},
                   {"version": 1, "lag": 2, "engines": ["b"], "routable": []},
                   {"version": None, "lag": None, "engines": ["c"], "routable": ["c"]}]
