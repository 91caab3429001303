"""Against real ``serve`` processes on the Redis store (a fresh key prefix per test): nothing
reported published is lost across a gateway restart (reused session ids, repeated request
ids), and one job's unread consumer group never stops another job's publishing."""

from __future__ import annotations

import json

import pytest
from _gateway_support import REDIS_URL, GatewayProcess
from _redis_support import delete_prefix_sync
from _support import PATIENT_HEALTH
from _tenants import ENV, A, B, chat, end, new_id, pull_until, rollout

pytestmark = pytest.mark.integration


@pytest.fixture
def prefix():
    p = new_id("gwtest-tenants")
    yield p
    delete_prefix_sync(p)


def test_nothing_reported_published_is_lost_across_a_restart(engine, prefix):
    url = f"{REDIS_URL}?prefix={prefix}"
    env = {**PATIENT_HEALTH, **ENV}
    sid, rid = new_id("sess"), new_id("req")
    body = {"input_ids": [5, 6, 7], "request_id": rid, "sampling_params": {"max_new_tokens": 3}}
    published: set[str] = set()
    with GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url, env=env) as g1:
        assert chat(g1, A, sid, "before").status_code == 200
        r = end(g1, A, sid, {"reward": 1.0})
        assert r.status_code == 200 and r.json()["published"], r.text
        published.add(r.json()["trajectory_id"])
        first = rollout(g1, A, body)
        assert first.status_code == 200, first.text
        ids = [t["trajectory_id"] for t in first.json()["trajectories"]]
        published.update(ids)
    with GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url, env=env) as g2:
        # the same session id after the restart: refused while its end is remembered (the
        # session store outlives the process), never a silently dropped publish
        r = chat(g2, A, sid, "after")
        assert r.status_code == 409 and "has ended" in r.text, r.text
        assert end(g2, A, sid, {"reward": 0.0}).status_code == 409
        # another tenant's session of that id is its own, published under a new id
        assert chat(g2, B, sid, "after").status_code == 200
        r = end(g2, B, sid, {"reward": 0.0})
        assert r.status_code == 200 and r.json()["published"], r.text
        assert r.json()["trajectory_id"] not in published
        published.add(r.json()["trajectory_id"])
        again = rollout(g2, A, body)  # answered from the store, across the restart
        assert again.status_code == 200, again.text
        assert [t["trajectory_id"] for t in again.json()["trajectories"]] == ids
        assert again.json()["trajectories"][0]["token_ids"] == \
            first.json()["trajectories"][0]["token_ids"]
        other = rollout(g2, A, {**body, "input_ids": [9]})
        assert other.status_code == 409 and "input_ids" in other.text, other.text
        mine = rollout(g2, B, body)  # b's request of the same id: b's own
        assert mine.status_code == 200 and mine.json()["trajectories"][0]["trajectory_id"] \
            not in ids
        published.add(mine.json()["trajectories"][0]["trajectory_id"])
        got = pull_until(g2, published)
        assert {got[t].metadata["tenant"] for t in published} == {"team-a", "team-b"}


def test_one_jobs_unread_group_never_stops_another_jobs_publishing(engine, prefix):
    job_a, job_b = "job-a-token-0123456789", "job-b-token-0123456789"
    jobs = json.dumps([{"token": job_a, "groups": ["job-a*"]},
                       {"token": job_b, "groups": ["job-b*"]}])
    url = f"{REDIS_URL}?prefix={prefix}&max_backlog=3"
    # admission's staleness bound is 2 samples: the zombie's backlog (3) would stop every
    # rollout if admission counted the worst group; it counts the most caught-up one
    env = {**PATIENT_HEALTH, **ENV, "ROLLOUT_GATEWAY_LEARNER_JOBS": jobs,
           "ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE": "1",
           "ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": "1"}
    from learner_client import TrajectoryClient

    with GatewayProcess({"e0": engine.url}, store_url=url, registry_url=url, env=env) as gw:
        target = f"127.0.0.1:{gw.grpc_port}"
        zombie = TrajectoryClient(target, group="job-a-zombie", token=job_a)
        zombie.create_group()  # created, then never read while the others publish
        live = TrajectoryClient(target, group="job-b", token=job_b)
        live.create_group()
        try:
            made: list[str] = []
            for i in range(6):
                r = rollout(gw, A, {"input_ids": [1, 2, i + 3],
                                    "sampling_params": {"max_new_tokens": 2}})
                assert r.status_code == 200, r.text
                t = r.json()["trajectories"][0]
                assert "publish_error" not in t["metadata"], t["metadata"]
                made.append(t["trajectory_id"])
                got = live.pull(1, timeout=30)
                assert [x.trajectory_id for x in got] == [made[-1]]
                live.ack(got)
            sid = new_id("s")  # a session end publishes too (no 429)
            assert chat(gw, B, sid, "hi").status_code == 200
            r = end(gw, B, sid)
            assert r.status_code == 200 and r.json()["published"], r.text
            made.append(r.json()["trajectory_id"])
            got = live.pull(1, timeout=30)
            assert [x.trajectory_id for x in got] == [made[-1]]
            # the full group kept its newest max_backlog entries; the rest were dropped
            # for it alone, and counted
            kept = zombie.pull(10, timeout=5)
            assert [x.trajectory_id for x in kept] == made[-3:]
            metrics = __import__("httpx").get(gw.url + "/metrics").text
            assert "overflow_dropped" in metrics and _metric(metrics, "job-a-zombie") == 4
        finally:
            zombie.close()
            live.close()


def _metric(text: str, group: str) -> float:
    for line in text.splitlines():
        if line.startswith("rollout_gateway_group_overflow_dropped") and f'"{group}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no overflow_dropped metric for {group}:\n{text[-3000:]}")
