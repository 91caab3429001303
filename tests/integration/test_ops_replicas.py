"""Two gateway replicas sharing Redis in front of one engine: each exports its own work,
figures living in Redis are the same on both and marked ``shared="true"`` (max them, never
sum), and /v1/lag on either replica sees the shared store."""

from __future__ import annotations

import httpx
import pytest
from _gateway_support import GatewayProcess, redis_urls, rollout

from _redis_support import delete_prefix_sync

pytestmark = pytest.mark.integration


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_replicas_export_their_own_work_and_mark_shared_figures(engine):
    store, registry = redis_urls()
    prefix = store.split("prefix=")[1]
    try:
        with GatewayProcess({"e0": engine.url}, store_url=store, registry_url=registry) as a, \
                GatewayProcess({"e0": engine.url}, store_url=store, registry_url=registry) as b:
            body = rollout(a.url, [3, 1, 4, 1], n=2, max_new_tokens=7)
            tokens = sum(t["num_tokens"] for t in body["trajectories"])
            ma, mb = _samples(a.url), _samples(b.url)
            # per replica: A did the work, B did none (summing replicas counts it once)
            assert ma[("rollout_gateway_samples_total", ())] == 2
            assert mb[("rollout_gateway_samples_total", ())] == 0
            assert ma[("rollout_gateway_tokens_total", ())] == tokens
            # shared: the same on both, labelled, so max() across replicas is the truth
            key = ("rollout_gateway_store_backlog", (("shared", "true"),))
            assert ma[key] == mb[key] == 2
            un = ("rollout_gateway_unconsumed_token_lag_count", (("shared", "true"),))
            assert ma[un] == mb[un] == tokens
            # /v1/lag on B: the shared store's unconsumed tokens, B's own (empty) finishes
            la, lb = (httpx.get(u + "/v1/lag").json() for u in (a.url, b.url))
            assert la["unconsumed"]["tokens"] == lb["unconsumed"]["tokens"] == tokens
            assert la["intra_trajectory"]["trajectories"] == 2
            assert lb["intra_trajectory"]["trajectories"] == 0
            assert la["replica"] is None  # host:pid is for the admin only
    finally:
        delete_prefix_sync(prefix)
