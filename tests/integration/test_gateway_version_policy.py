"""Per-request version policy (docs/gateway.md, "Version policy") against three reference
engines as processes, at versions 3, 1 and 2 (registered a, c, b: least-load routing
tries ``c`` before ``b`` when both are idle), the learner at 3: a request lands only on
engines its policy admits, in every form (body field, header, /generate, streams, the
OpenAI routes), a failover too; none qualifying is a 503 with Retry-After; a bad policy
is a 400."""

from __future__ import annotations

import subprocess
import sys

import httpx
import orjson
import pytest
from _gateway_support import GatewayProcess, rollout

pytestmark = pytest.mark.integration

SEED = 3
PROMPT = [5, 6, 7]


def _engines(trajs: list[dict]) -> set[str]:
    return {e for t in trajs for e in t["engine_ids"]}


def _versions(trajs: list[dict]) -> set[int]:
    return {v for t in trajs for v in t["policy_version"]}


def _post(gw: GatewayProcess, path: str, body: dict, policy: str | None = None,
          **kw) -> httpx.Response:
    headers = {"x-version-policy": policy} if policy is not None else {}
    return httpx.post(gw.url + path, json=body, headers=headers, timeout=60, **kw)


def _body(n: int = 1, tokens: int = 4, **extra) -> dict:
    return {"input_ids": PROMPT, "n": n,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}, **extra}


def _sse(r: httpx.Response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _refused(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    msg = r.json()["error"]["message"]
    for w in words:
        assert w in msg, msg
    if status == 503:
        assert r.headers.get("retry-after") == "1", r.headers


@pytest.fixture
def three(make_engine):
    a = make_engine(seed=SEED, weight_version="3", step_delay_ms=20)
    c = make_engine(seed=SEED, weight_version="1", step_delay_ms=20)
    b = make_engine(seed=SEED, weight_version="2", step_delay_ms=20)
    with GatewayProcess({"a": a.url, "c": c.url, "b": b.url}) as gw:
        r = httpx.post(gw.url + "/v1/weights", json={"version": 3}, timeout=30)
        assert r.status_code == 200, r.text  # the learner's version: engines keep theirs
        yield gw, {"a": a, "b": b, "c": c}


def test_requests_land_only_on_engines_their_policy_admits(three):
    gw, _ = three
    # the fleet's version cut at a glance: /v1/lag and rollout-gateway status
    cut = httpx.get(gw.url + "/v1/lag").json()["version_cut"]
    assert cut == [{"version": 3, "lag": 0, "engines": ["a"], "routable": ["a"]},
                   {"version": 2, "lag": 1, "engines": ["b"], "routable": ["b"]},
                   {"version": 1, "lag": 2, "engines": ["c"], "routable": ["c"]}]
    p = subprocess.run([sys.executable, "-m", "rollout_gateway", "status", "--url", gw.url],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "version cut: v3 (lag 0): a  |  v2 (lag 1): b  |  v1 (lag 2): c" in p.stdout
    # no policy: the load spreads over all three (what the policies below must narrow)
    r = _post(gw, "/v1/rollouts", _body(n=9))
    assert r.status_code == 200, r.text
    assert _engines(r.json()["trajectories"]) == {"a", "b", "c"}
    assert r.headers["x-weight-versions"] == "1,2,3"

    # body field: max_staleness:1 never lands on c, two versions behind the learner
    r = _post(gw, "/v1/rollouts", _body(n=9, version_policy="max_staleness:1"))
    assert r.status_code == 200, r.text
    trajs = r.json()["trajectories"]
    assert _engines(trajs) == {"a", "b"} and _versions(trajs) == {2, 3}
    assert r.headers["x-weight-versions"] == "2,3"
    assert not any(t["spanning_versions"] for t in trajs)
    assert {(t["min_version"], t["max_version"]) for t in trajs} <= {(2, 2), (3, 3)}

    # header, streamed: the trajectories come over SSE, from a and b only
    r = _post(gw, "/v1/rollouts", _body(n=6, stream=True), "max_staleness:1")
    assert r.status_code == 200, r.text
    evs = _sse(r)
    trajs = [e["trajectory"] for e in evs if e["type"] == "trajectory"]
    assert len(trajs) == 6 and _engines(trajs) == {"a", "b"}
    assert {e["engine_id"] for e in evs if e["type"] == "chunk"} <= {"a", "b"}

    # latest: only the engine at the learner's version
    r = _post(gw, "/v1/rollouts", _body(n=4), "latest")
    assert r.status_code == 200, r.text
    assert _engines(r.json()["trajectories"]) == {"a"}
    assert r.headers["x-weight-versions"] == "3"

    # /generate, body field min_version:2, n = 4 samples
    r = _post(gw, "/generate", {"input_ids": PROMPT, "version_policy": "min_version:2",
                                "sampling_params": {"max_new_tokens": 3, "n": 4}})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == 4
    used = {s["engine_id"] for o in outs for s in o["meta_info"]["segments"]}
    assert used == {"a", "b"}, used
    assert all(o["meta_info"]["spanning_versions"] is False for o in outs)
    assert set(r.headers["x-weight-versions"].split(",")) == {"2", "3"}

    # the OpenAI routes take the header: a chat completion under latest runs on a
    r = _post(gw, "/v1/chat/completions",
              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, "latest")
    assert r.status_code == 200, r.text
    info = r.json()["choices"][0]["rollout"]
    assert info["engine_ids"] == ["a"] and info["spanning_versions"] is False

    # no engine qualifies: 503 + Retry-After naming the policy and the versions, never
    # another version; streams are refused before their first event
    _refused(_post(gw, "/v1/rollouts", _body(version_policy="min_version:4")), 503,
             "min_version:4", "a v3", "c v1")
    _refused(_post(gw, "/v1/rollouts", _body(stream=True), "min_version:4"), 503,
             "no engine satisfies version policy")
    # the learner moves on: no engine is at latest any more
    r = httpx.post(gw.url + "/v1/weights", json={"version": 4}, timeout=30)
    assert r.status_code == 200, r.text
    _refused(_post(gw, "/v1/rollouts", _body(), "latest"), 503, "latest", "learner version 4")
    _refused(_post(gw, "/generate", {"input_ids": PROMPT, "stream": True,
                                     "version_policy": "latest"}), 503, "latest")
    _refused(_post(gw, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                   "latest"), 503, "latest")
    # ... while max_staleness:1 now admits a alone (b is two behind)
    r = _post(gw, "/v1/rollouts", _body(n=4), "max_staleness:1")
    assert r.status_code == 200 and _engines(r.json()["trajectories"]) == {"a"}, r.text

    m = httpx.get(gw.url + "/metrics").text
    counts = {line.split()[0]: float(line.split()[1]) for line in m.splitlines()
              if line.startswith("rollout_gateway_version_policy_")}
    # one per request refused; one per engine request a policy narrowed (9 + 6 + 4 + 4 + 1
    # + 4 samples above; the check before admission is not an engine request)
    assert counts["rollout_gateway_version_policy_unroutable_total"] == 5, counts
    assert counts["rollout_gateway_version_policy_filtered_total"] == 28, counts


def test_bad_policy_is_a_400(three):
    gw, _ = three
    _refused(_post(gw, "/v1/rollouts", _body(version_policy="max_staleness:x")), 400,
             "version_policy", "max_staleness:<k>")
    _refused(_post(gw, "/v1/rollouts", _body(), "latest-only"), 400, "x-version-policy",
             "'latest-only'")
    _refused(_post(gw, "/generate", {"input_ids": PROMPT, "version_policy": 3}), 400,
             "version_policy")
    _refused(_post(gw, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": "hi"}]}, "min_version:-1"),
             400, "x-version-policy")
    _refused(_post(gw, "/v1/rollouts", _body(version_policy="latest"), "any"), 400,
             "contradicts")
    # the same policy in both places is fine
    r = _post(gw, "/v1/rollouts", _body(version_policy="latest"), "latest")
    assert r.status_code == 200 and _engines(r.json()["trajectories"]) == {"a"}, r.text


def test_failover_keeps_the_policy(three):
    """The engine a max_staleness:1 sample runs on dies mid-generation: it resumes on b
    (one version behind), not on c (two behind), which least load would pick first."""
    gw, engines = three
    body = _body(tokens=40, stream=True, version_policy="max_staleness:1")
    trajs = []
    with httpx.stream("POST", gw.url + "/v1/rollouts", json=body, timeout=60) as r:
        assert r.status_code == 200
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = orjson.loads(line[6:])
            if ev["type"] == "chunk" and not killed:
                assert ev["engine_id"] == "a"  # idle a and b: a is first by least load
                engines["a"].kill()
                killed = True
            elif ev["type"] == "trajectory":
                trajs.append(ev["trajectory"])
            assert ev["type"] != "error", ev
    (t,) = trajs
    assert [s["engine_id"] for s in t["segments"]] == ["a", "b"], t["segments"]
    assert t["segments"][1]["began"] == "failover"
    assert t["num_tokens"] == 40 and t["spanning_versions"] is True
    assert (t["min_version"], t["max_version"]) == (2, 3)
