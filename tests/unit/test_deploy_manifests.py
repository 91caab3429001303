"""deploy/: the Kubernetes manifests validate offline against the Kubernetes schemas, and the
ports, probe paths, environment variables and metric names they (and the Grafana dashboard
and Dockerfiles) use are ones the code serves and reads. Changing a port, a path, a setting
or a metric name in the code without deploy/ fails here."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
GRAFANA = ROOT / "deploy" / "grafana" / "rollout-gateway.json"
DOCKER = ROOT / "deploy" / "docker"
#: CRDs are not in the Kubernetes schemas: checked by hand below, kind by kind
CRD_KINDS = {"ServiceMonitor": "monitoring.coreos.com/v1"}


def _docs() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(K8S.glob("*.yaml")):
        if p.name == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(p.read_text()):
            if d:
                out.append((p.name, d))
    return out


DOCS = _docs()


def _one(kind: str, name: str) -> dict:
    [d] = [d for _f, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def _gateway_container() -> dict:
    [c] = _one("Deployment", "rollout-gateway")["spec"]["template"]["spec"]["containers"]
    return c


def _config() -> dict[str, str]:
    return _one("ConfigMap", "rollout-gateway-config")["data"]


def test_kustomization_lists_every_manifest():
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files
    images = {i["name"] for i in k["images"]}
    used = {c["image"] for _f, d in DOCS if d["kind"] in ("Deployment", "Job", "StatefulSet")
            for c in d["spec"]["template"]["spec"]["containers"]}
    # our images are the ones built from deploy/docker
    ours = {u for u in used if u.startswith("rollout-gateway")}
    assert ours == images
    built = {p.name.removesuffix(".Dockerfile") for p in DOCKER.glob("*.Dockerfile")}
    assert {"rollout-gateway": "gateway", "rollout-gateway-learner": "learner"}.keys() == images
    assert {"gateway", "learner", "engine"} <= built


@pytest.mark.parametrize("doc", [d for _f, d in DOCS if d["kind"] not in CRD_KINDS],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_kubernetes_schema(doc):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(doc, latest_version(), strict=True)


def test_invalid_manifest_is_refused_by_the_validator():
    import kubernetes_validate
    from kubernetes_validate.utils import ValidationError, latest_version

    bad = json.loads(json.dumps(_one("Deployment", "rollout-gateway")))
    bad["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "http"
    with pytest.raises(ValidationError):
        kubernetes_validate.validate(bad, latest_version(), strict=True)


def test_crds_by_kind():
    for _f, d in DOCS:
        if d["kind"] in CRD_KINDS:
            assert d["apiVersion"] == CRD_KINDS[d["kind"]]
    sm = _one("ServiceMonitor", "rollout-gateway")
    [ep] = sm["spec"]["endpoints"]
    http = _one("Service", "rollout-gateway-http")
    assert ep["port"] in {p["name"] for p in http["spec"]["ports"]}
    assert sm["spec"]["selector"]["matchLabels"].items() <= http["metadata"]["labels"].items()
    assert ep["path"] == "/metrics"
    _assert_served(ep["path"])


def _served(paths: set[str]) -> dict[str, int]:
    """GET each path on the real app (lifespan run): path -> status."""
    from rollout_gateway.api.app import create_app
    from rollout_gateway.gateway import Gateway
    from rollout_gateway.settings import GatewaySettings

    async def get() -> dict[str, int]:
        app = create_app(Gateway(GatewaySettings()))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as c:
                return {p: (await c.get(p)).status_code for p in paths}

    return asyncio.run(get())


def _assert_served(*paths: str) -> None:
    got = _served(set(paths))
    assert all(v != 404 and v < 500 for v in got.values()), got


def test_path_check_catches_a_path_the_code_does_not_serve():
    assert _served({"/livez", "/no-such-probe"}) == {"/livez": 200, "/no-such-probe": 404}


def test_gateway_ports_match_the_code():
    from rollout_gateway.settings import GatewaySettings

    s = GatewaySettings()
    c = _gateway_container()
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    cfg = _config()
    assert ports == {"http": int(cfg["ROLLOUT_GATEWAY_HTTP_PORT"]),
                     "grpc": int(cfg["ROLLOUT_GATEWAY_GRPC_PORT"])}
    # the image's defaults are the settings' defaults (EXPOSE in the Dockerfile)
    assert ports == {"http": s.http_port, "grpc": s.grpc_port}
    expose = re.search(r"^EXPOSE (.+)$", (DOCKER / "gateway.Dockerfile").read_text(), re.M)
    assert sorted(map(int, expose.group(1).split())) == sorted(ports.values())
    for svc, name in (("rollout-gateway-http", "http"), ("rollout-gateway-grpc", "grpc")):
        [p] = _one("Service", svc)["spec"]["ports"]
        assert p["targetPort"] == name and p["port"] == ports[name]


def test_gateway_probes_match_the_service_states():
    c = _gateway_container()
    grpc_port = _config()["ROLLOUT_GATEWAY_GRPC_PORT"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = c[probe]
        if "httpGet" in p:
            _assert_served(p["httpGet"]["path"])
            assert p["httpGet"]["port"] in {x["name"] for x in c["ports"]}
        else:
            assert p["grpc"]["port"] == int(grpc_port), (probe, p)
    # readiness follows the drain: gRPC health flips to NOT_SERVING at SIGTERM
    assert "grpc" in c["readinessProbe"] and "grpc" in c["startupProbe"]
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_grpc_health_probe_service_is_the_one_the_server_sets():
    """Kubernetes' grpc probe asks service "" (unless it names one): serve it, flip it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rollout_gateway.store.memory import MemoryStore
    from doubles.control_plane import InProcessControlPlane
    from rollout_gateway.transport.server import GrpcServer

    svc = _gateway_container()["readinessProbe"]["grpc"].get("service", "")

    async def check() -> list[int]:
        server = GrpcServer(MemoryStore(), InProcessControlPlane(), "127.0.0.1", 0)
        port = await server.start()
        seen = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = health_pb2_grpc.HealthStub(ch)
                for serving in (False, True, False):
                    await server.set_serving(serving)
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=svc))
                    seen.append(r.status)
        finally:
            await server.stop(0)
        return seen

    S, N = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert asyncio.run(check()) == [N, S, N]


def test_termination_grace_exceeds_the_drain():
    spec = _one("Deployment", "rollout-gateway")["spec"]
    drain = float(_config()["ROLLOUT_GATEWAY_DRAIN_GRACE_S"])
    margin = 5.0  # serve exits within drain_grace_s; the store's close and exit on top
    assert spec["template"]["spec"]["terminationGracePeriodSeconds"] > drain + margin
    assert spec["replicas"] >= 2
    hpa = _one("HorizontalPodAutoscaler", "rollout-gateway")["spec"]
    assert hpa["minReplicas"] >= 2 and hpa["scaleTargetRef"]["name"] == "rollout-gateway"
    pdb = _one("PodDisruptionBudget", "rollout-gateway")["spec"]
    assert pdb["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    sc = spec["template"]["spec"]["securityContext"]
    assert sc["runAsNonRoot"] and sc["runAsUser"] != 0
    assert "requests" in _gateway_container()["resources"]


def _env_names() -> set[str]:
    names = set(_config())
    for _f, d in DOCS:
        if d["kind"] in ("Deployment", "Job", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                names |= {e["name"] for e in c.get("env", [])}
    return {n for n in names if n.startswith("ROLLOUT_GATEWAY_")}


def _settings_env_names() -> set[str]:
    from pydantic import BaseModel

    from rollout_gateway.settings import ENV_PREFIX, GatewaySettings

    out = set()

    def walk(model, prefix: str) -> None:
        for name, f in model.model_fields.items():
            env = prefix + name.upper()
            out.add(env)
            t = f.annotation
            if isinstance(t, type) and issubclass(t, BaseModel):
                walk(t, env + "__")

    walk(GatewaySettings, ENV_PREFIX)
    return out


def test_environment_variables_are_settings_the_code_reads():
    known = _settings_env_names()
    assert _env_names() - known == set()
    # the tokens come from the Secret, one per role the gateway knows
    env = {e["name"]: e for e in _gateway_container()["env"]}
    for role in ("ADMIN", "LEARNER", "CLIENT"):
        ref = env[f"ROLLOUT_GATEWAY_{role}_API_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "rollout-gateway-tokens"
    # and the ConfigMap's values are valid settings
    from rollout_gateway.settings import GatewaySettings

    env = dict(_config())
    mp = pytest.MonkeyPatch()
    try:
        for k, v in env.items():
            mp.setenv(k, v)
        s = GatewaySettings()
    finally:
        mp.undo()
    assert s.engine_discovery.dns_name == "sglang-engine"


def test_engines_redis_and_discovery_agree():
    cfg = _config()
    svc = _one("Service", "sglang-engine")["spec"]
    assert svc["clusterIP"] == "None" and svc["publishNotReadyAddresses"] is True
    assert cfg["ROLLOUT_GATEWAY_ENGINE_DISCOVERY__DNS_NAME"] == "sglang-engine"
    [port] = svc["ports"]
    assert port["port"] == int(cfg["ROLLOUT_GATEWAY_ENGINE_DISCOVERY__PORT"])
    sts = _one("StatefulSet", "sglang-engine")["spec"]
    assert sts["serviceName"] == "sglang-engine"
    [c] = sts["template"]["spec"]["containers"]
    args = c["args"]
    assert "--enable-return-routed-experts" in args
    assert f"--port={port['port']}" in args and any(a.startswith("--weight-version=") for a in args)
    assert c["resources"]["requests"]["nvidia.com/gpu"] == c["resources"]["limits"]["nvidia.com/gpu"]
    # never restart an engine for a 503 while paused for a swap
    assert c["livenessProbe"]["httpGet"]["path"] != "/health"
    redis = _one("StatefulSet", "redis")["spec"]
    [rc] = redis["template"]["spec"]["containers"]
    assert rc["args"][:2] == ["--appendonly", "yes"]
    data = rc["args"][rc["args"].index("--dir") + 1]
    assert {"name": "data", "mountPath": data} in rc["volumeMounts"]
    assert redis["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    rport = _one("Service", "redis")["spec"]["ports"][0]["port"]
    assert f"redis://redis:{rport}/" in cfg["ROLLOUT_GATEWAY_STORE_URL"]


def test_learner_job_targets_the_grpc_service():
    job = _one("Job", "example-learner")["spec"]["template"]["spec"]
    [c] = job["containers"]
    target = {e["name"]: e.get("value") for e in c["env"]}["GATEWAY_GRPC"]
    host, port = target.split(":")
    [p] = _one("Service", host)["spec"]["ports"]
    assert p["name"] == "grpc" and p["port"] == int(port)
    compile(c["args"][0], "learner-job", "exec")  # the inline script is valid Python


def _exported_metric_names() -> set[str]:
    """Sample names the gateway's /metrics serves (histogram series included)."""
    from prometheus_client.parser import text_string_to_metric_families

    from rollout_gateway.api.app import create_app
    from rollout_gateway.gateway import Gateway
    from rollout_gateway.settings import GatewaySettings

    async def scrape() -> str:
        app = create_app(Gateway(GatewaySettings()))
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw") as c:
                return (await c.get("/metrics")).text

    names = set()
    for f in text_string_to_metric_families(asyncio.run(scrape())):
        suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(
            f.type, ("",))
        names |= {f.name + s for s in suffixes}
    return names


def test_grafana_and_manifests_use_exported_metric_names():
    exported = _exported_metric_names()
    for h in ("rollout_gateway_http_request_duration_seconds",
              "rollout_gateway_time_to_first_token_seconds", "rollout_gateway_swap_pause_seconds",
              "rollout_gateway_admission_wait_seconds", "rollout_gateway_delivered_token_lag"):
        assert h + "_bucket" in exported, h
    dash = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"rollout_gateway_[a-z0-9_]+", e)}
    assert len(used) >= 15
    assert used <= exported, used - exported
    text = "\n".join(p.read_text() for p in K8S.glob("*.yaml"))
    assert set(re.findall(r"rollout_gateway_[a-z0-9_]+", text)) <= exported


# ---- the Redis Cluster variant (deploy/k8s/redis-cluster: an overlay of deploy/k8s) ----

CLUSTER = K8S / "redis-cluster"


def _cluster_docs() -> list[tuple[str, dict]]:
    out = []
    for p in sorted(CLUSTER.glob("*.yaml")):
        if p.name != "kustomization.yaml":
            out += [(p.name, d) for d in yaml.safe_load_all(p.read_text()) if d]
    return out


CLUSTER_DOCS = _cluster_docs()


def _cluster_one(kind: str, name: str) -> dict:
    [d] = [d for _f, d in CLUSTER_DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


@pytest.mark.parametrize("doc", [d for f, d in CLUSTER_DOCS if f != "gateway-configmap.yaml"],
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_cluster_manifest_validates_against_kubernetes_schema(doc):
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    kubernetes_validate.validate(doc, latest_version(), strict=True)


def test_cluster_overlay_replaces_redis_and_patches_the_config():
    k = yaml.safe_load((CLUSTER / "kustomization.yaml").read_text())
    assert k["resources"] == ["..", "redis-cluster.yaml"]
    files = {p.name for p in CLUSTER.glob("*.yaml")} - {"kustomization.yaml"}
    patched = {p["path"] for p in k["patches"] if "path" in p}
    assert files == set(k["resources"][1:]) | patched
    deleted = {(yaml.safe_load(p["patch"])["kind"], yaml.safe_load(p["patch"])["metadata"]["name"])
               for p in k["patches"] if "patch" in p}
    assert deleted == {("StatefulSet", "redis"), ("Service", "redis")}
    [(_f, cm)] = [(f, d) for f, d in CLUSTER_DOCS if f == "gateway-configmap.yaml"]
    assert cm["metadata"]["name"] == "rollout-gateway-config" and cm["kind"] == "ConfigMap"


def test_cluster_settings_match_the_cluster():
    """The patched ConfigMap is valid settings; its URLs name nodes of the StatefulSet on
    its Service's port; the shards are a multiple of the masters the Job creates."""
    from rollout_gateway.settings import GatewaySettings
    from rollout_gateway.store.factory import store_from_url
    from rollout_gateway.store.redis_streams import RedisStore
    from rollout_proto.redis_url import parse_cluster_url

    [(_f, patch)] = [(f, d) for f, d in CLUSTER_DOCS if f == "gateway-configmap.yaml"]
    env = {**_config(), **patch["data"]}
    mp = pytest.MonkeyPatch()
    try:
        for k, v in env.items():
            mp.setenv(k, v)
        s = GatewaySettings()
    finally:
        mp.undo()
    sts = _cluster_one("StatefulSet", "redis-cluster")["spec"]
    svc = _cluster_one("Service", "redis-cluster")["spec"]
    assert svc["clusterIP"] == "None" and sts["serviceName"] == "redis-cluster"
    port = {p["name"]: p["port"] for p in svc["ports"]}["redis"]
    hosts = {f"redis-cluster-{i}.redis-cluster" for i in range(sts["replicas"])}
    for url in (s.store_url, s.registry_url):
        t = parse_cluster_url(url)
        assert t.nodes and all(h in hosts and p == port for h, p in t.nodes), t.nodes
    [c] = sts["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--cluster-enabled") + 1] == "yes"
    data = c["args"][c["args"].index("--dir") + 1]
    assert {"name": "data", "mountPath": data} in c["volumeMounts"]
    assert c["args"][c["args"].index("--cluster-config-file") + 1].startswith(data + "/")
    [job] = _cluster_one("Job", "redis-cluster-create")["spec"]["template"]["spec"]["containers"]
    script = job["args"][0]
    per_master = 1 + int(re.search(r"--cluster-replicas (\d+)", script).group(1))
    assert f"for i in {' '.join(map(str, range(sts['replicas'])))}; do" in script
    masters = sts["replicas"] // per_master
    assert s.store_shards % masters == 0 and s.store_shards >= masters
    store = store_from_url(s.store_url, shards=s.store_shards)  # builds without connecting
    assert isinstance(store, RedisStore) and store.shards == s.store_shards and store.cluster
    asyncio.run(store.close())
    pdb = _cluster_one("PodDisruptionBudget", "redis-cluster")["spec"]
    assert pdb["maxUnavailable"] == 1
    assert pdb["selector"]["matchLabels"] == sts["selector"]["matchLabels"]


def test_hpa_scales_on_a_metric_the_gateway_exports():
    hpa = _one("HorizontalPodAutoscaler", "rollout-gateway")["spec"]
    pods = [m["pods"]["metric"]["name"] for m in hpa["metrics"] if m["type"] == "Pods"]
    assert pods == ["rollout_gateway_inflight_samples"]
    assert set(pods) <= _exported_metric_names()
