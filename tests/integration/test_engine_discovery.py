"""Engine discovery through DNS (headless Service), with a fake resolver in front of a
real reference engine: engines appear, stay through a failed lookup, and leave."""

from __future__ import annotations

import pytest

from rollout_gateway.gateway import Gateway
from rollout_gateway.settings import GatewaySettings

pytestmark = pytest.mark.integration


async def test_dns_discovery_adds_keeps_and_removes_engines(engine):
    answers: list = [["127.0.0.1"]]
    asked: list[str] = []

    async def resolver(name: str) -> list[str]:
        asked.append(name)
        a = answers[-1]
        if isinstance(a, Exception):
            raise a
        return a

    s = GatewaySettings(engine_discovery={"dns_name": "sglang.ns.svc.cluster.local",
                                          "port": engine.port, "interval_s": 3600,
                                          "id_prefix": "sglang"})
    gw = Gateway(s, resolver=resolver)
    await gw.start()
    try:
        # found at start-up, before serving
        assert asked == ["sglang.ns.svc.cluster.local"]
        [eng] = gw.pool.list()
        assert eng.id == "sglang-127-0-0-1" and eng.url == f"http://127.0.0.1:{engine.port}"
        assert eng.routable and eng.version == 0
        assert await gw.registry.engine_versions() == {"sglang-127-0-0-1": 0}
        # a failed lookup keeps the pool as it is
        answers.append(OSError("Temporary failure in name resolution"))
        assert await gw.discovery.sync_once() == ([], [])
        assert [e.id for e in gw.pool.list()] == ["sglang-127-0-0-1"]
        # an address that does not answer yet is registered offline, not dropped
        answers.append(["127.0.0.1", "::1"])
        added, removed = await gw.discovery.sync_once()
        assert added == ["sglang---1"] and removed == []
        off = gw.pool.get("sglang---1")
        assert not off.routable and off.url == f"http://[::1]:{engine.port}"
        # gone from DNS: deregistered (and forgotten by the registry)
        answers.append([])
        added, removed = await gw.discovery.sync_once()
        assert added == [] and sorted(removed) == ["sglang---1", "sglang-127-0-0-1"]
        assert gw.pool.list() == [] and await gw.registry.engine_versions() == {}
    finally:
        await gw.stop()


def test_discovery_settings_from_env(monkeypatch):
    monkeypatch.setenv("ROLLOUT_GATEWAY_ENGINE_DISCOVERY__DNS_NAME", "e.ns.svc")
    monkeypatch.setenv("ROLLOUT_GATEWAY_ENGINE_DISCOVERY__PORT", "30001")
    s = GatewaySettings()
    assert s.engine_discovery.dns_name == "e.ns.svc" and s.engine_discovery.port == 30001
    monkeypatch.setenv("ROLLOUT_GATEWAY_ENGINE_DISCOVERY__SCHEME", "ftp")
    with pytest.raises(ValueError):
        GatewaySettings()


def test_serve_discovers_engines_through_the_system_resolver(engine):
    """`rollout-gateway serve` with only a DNS name: "localhost" through the system resolver
    (as a pod resolves its headless Service), then a rollout through the found engine."""
    import httpx
    from _gateway_support import GatewayProcess, rollout

    admin = "admin-key-0123456789"
    env = {"ROLLOUT_GATEWAY_ADMIN_API_KEY": admin,
           "ROLLOUT_GATEWAY_ENGINE_DISCOVERY__DNS_NAME": "localhost",
           "ROLLOUT_GATEWAY_ENGINE_DISCOVERY__PORT": str(engine.port),
           "ROLLOUT_GATEWAY_ENGINE_DISCOVERY__INTERVAL_S": "1"}
    with GatewayProcess({}, env=env) as gw:
        engines = {e["id"]: e for e in httpx.get(
            gw.url + "/v1/engines", headers={"Authorization": f"Bearer {admin}"}).json()["engines"]}
        assert engines["engine-127-0-0-1"]["state"] == "healthy"
        assert engines["engine-127-0-0-1"]["url"] == f"http://127.0.0.1:{engine.port}"
        body = rollout(gw.url, [1, 2, 3], max_new_tokens=4)
        assert body["trajectories"][0]["segments"][0]["engine_id"] == "engine-127-0-0-1"
