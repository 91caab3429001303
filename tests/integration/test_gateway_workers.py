"""``rollout-gateway serve --workers 2`` as a process: both workers serve rollouts on the one
HTTP port (published to the shared Redis store, pulled over the one gRPC port), a swap led
by one worker is seen by both, and SIGTERM stops every worker cleanly."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from _gateway_support import GatewayProcess, pull_ids, redis_urls, wait_for

pytestmark = pytest.mark.integration


def _workers(pid: int) -> list[int]:
    """The worker processes of the serve process ``pid`` (multiprocessing spawns; its
    resource tracker, also a child, exits on its own once the parent is gone)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for c in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes():
                out.append(int(c))
    return out


def _on_one_connection(url: str, *calls: tuple[str, str, dict | None]) -> tuple[int, list]:
    """Run ``calls`` on one keep-alive connection (so one worker answers all of them);
    returns (that worker's index, the responses)."""
    with httpx.Client(base_url=url, timeout=60) as c:
        out = [c.request(m, path, json=body) for m, path, body in calls]
        return c.get("/health").json()["worker"], out


def test_two_workers_share_the_ports_and_stop_cleanly(make_engine):
    engine = make_engine(seed=1)
    store, registry = redis_urls()
    gw = GatewayProcess({"e0": engine.url}, store_url=store, registry_url=registry,
                        extra_args=["--workers", "2"])
    with gw:
        body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4,
                                                         "ignore_eos": True}}
        served: dict[int, list[str]] = {0: [], 1: []}

        def both_served() -> bool:  # each new connection lands on a worker the kernel picks
            worker, (r,) = _on_one_connection(gw.url, ("POST", "/v1/rollouts", body))
            assert r.status_code == 200, r.text
            served[worker] += [t["trajectory_id"] for t in r.json()["trajectories"]]
            return all(served.values())

        wait_for(both_served, 120, "rollouts answered by both workers")
        got = pull_ids(gw, set(served[0] + served[1]))
        assert set(served[0] + served[1]) <= set(got)
        # the registry is shared: a learner version announced on one worker is every
        # worker's (read back on fresh connections until both have answered)
        _, (r,) = _on_one_connection(gw.url, ("POST", "/v1/weights", {"version": 7}))
        assert r.status_code in (200, 202), r.text
        seen: set[int] = set()

        def both_see_it() -> bool:  # (each caches the learner version version_cache_s)
            worker, (v,) = _on_one_connection(gw.url, ("GET", "/v1/versions", None))
            if v.json()["learner_version"] == 7:
                seen.add(worker)
            return seen == {0, 1}

        wait_for(both_see_it, 60, "learner version 7 on both workers")
        kids = _workers(gw.proc.pid)
        assert len(kids) == 2
        gw.proc.send_signal(signal.SIGTERM)
        assert gw.proc.wait(60) == 0, gw.log_tail()
        for pid in kids:
            assert not Path(f"/proc/{pid}").exists() or "Z" in Path(
                f"/proc/{pid}/stat").read_text().split()[2], f"worker {pid} left running"
