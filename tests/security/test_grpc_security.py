"""``rollout-gateway serve`` with every security setting on, as learners and strangers see
it: HTTPS, gRPC over mutual TLS (certificates made here), a token per role, and learner
tokens bound to their job's consumer groups."""

from __future__ import annotations

import json
import ssl
import uuid

import grpc
import httpx
import pytest
from _certs import make_pki
from _gateway_support import GatewayProcess
from _support import PATIENT_HEALTH

from learner_client import TrajectoryClient
from learner_client.client import TlsOptions
from learner_client.errors import TrajectoryClientError
from rollout_gateway.proc import wait_healthy
from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import service_pb2_grpc

pytestmark = pytest.mark.integration

ADMIN, LEARNER, CLIENT = "admin-key-0123456789", "learner-key-0123456789", "client-key-0123456789"
JOB_A = "job-a-token-0123456789"


class TlsGateway(GatewayProcess):
    """The gateway over HTTPS: readiness is polled with the test CA."""

    def __init__(self, *args, ca, **kw):
        super().__init__(*args, **kw)
        self.ca = str(ca)

    @property
    def url(self) -> str:
        return f"https://localhost:{self.port}"

    def start(self, timeout: float = 60.0) -> TlsGateway:
        import subprocess

        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        why = wait_healthy(self.proc, self.url + "/health", timeout, ok=None,
                           verify=ssl.create_default_context(cafile=self.ca))
        if why is None:
            return self
        self.stop()
        raise RuntimeError(f"gateway {why}:\n{self.log_tail()}")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def gw(engine, pki):
    env = {**PATIENT_HEALTH,
           "ROLLOUT_GATEWAY_ADMIN_API_KEY": ADMIN, "ROLLOUT_GATEWAY_LEARNER_API_KEY": LEARNER,
           "ROLLOUT_GATEWAY_CLIENT_API_KEY": CLIENT,
           "ROLLOUT_GATEWAY_LEARNER_JOBS": json.dumps([{"token": JOB_A, "groups": ["job-a*"]}]),
           "ROLLOUT_GATEWAY_TLS_CERT_FILE": str(pki.server_cert),
           "ROLLOUT_GATEWAY_TLS_KEY_FILE": str(pki.server_key),
           "ROLLOUT_GATEWAY_GRPC_CLIENT_CA_FILE": str(pki.client_cert.parent / "ca.pem")}
    with TlsGateway({"e0": engine.url}, env=env, ca=pki.ca) as g:
        yield g


def tls(pki, *, client_cert: bool = True) -> TlsOptions:
    return TlsOptions(root_certs=pki.ca.read_bytes(),
                      cert_chain=pki.client_cert.read_bytes() if client_cert else None,
                      private_key=pki.client_key.read_bytes() if client_cert else None)


def learner(gw, pki, group: str, token: str | None, **kw) -> TrajectoryClient:
    return TrajectoryClient(f"localhost:{gw.grpc_port}", group, token=token,
                            tls=kw.pop("tls", tls(pki)), call_timeout=kw.pop("timeout", 20.0),
                            **kw)


def code_of(fn) -> str:
    with pytest.raises(TrajectoryClientError) as info:
        fn()
    return info.value.code


def test_https_only(gw, pki):
    verify = ssl.create_default_context(cafile=str(pki.ca))
    assert httpx.get(gw.url + "/health", verify=verify).status_code == 200
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{gw.port}/health", timeout=5)  # plaintext is refused
    with pytest.raises(httpx.HTTPError):
        httpx.get(gw.url + "/health", timeout=5)  # an untrusted certificate is refused
    r = httpx.post(gw.url + "/v1/rollouts", verify=verify, timeout=120,
                   headers={"Authorization": f"Bearer {CLIENT}"},
                   json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 200, r.text


def test_grpc_needs_a_client_certificate(gw, pki):
    with learner(gw, pki, "job-a", LEARNER, tls=tls(pki, client_cert=False), timeout=3) as c:
        assert code_of(c.status) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")
    with TrajectoryClient(f"127.0.0.1:{gw.grpc_port}", "job-a", token=LEARNER,
                          call_timeout=3) as c:  # plaintext against the TLS port
        assert code_of(c.status) in ("UNAVAILABLE", "DEADLINE_EXCEEDED")


def test_roles_on_the_learner_port(gw, pki):
    with learner(gw, pki, "job-a", None) as c:
        assert code_of(c.create_group) == "UNAUTHENTICATED"
        assert code_of(lambda: c.pull(1, timeout=2)) == "UNAUTHENTICATED"
    with learner(gw, pki, "job-a", CLIENT) as c:
        assert code_of(c.status) == "PERMISSION_DENIED"
    with learner(gw, pki, "job-a", LEARNER) as c:
        c.create_group()
        assert c.status().learner_version >= 0
        # a learner may not swap weights: AnnounceVersion is the admin's
        assert code_of(lambda: c.announce(1_000_000, "/tmp/attacker-ckpt")) == "PERMISSION_DENIED"
    with learner(gw, pki, "job-a", "nope-nope-nope-nope") as c:
        assert code_of(lambda: c.announce(1_000_000, "/tmp/attacker-ckpt")) == "UNAUTHENTICATED"
    r = httpx.get(gw.url + "/v1/versions", verify=ssl.create_default_context(cafile=str(pki.ca)))
    assert r.json()["learner_version"] < 1_000_000  # nothing was announced


def test_health_stays_open_for_probes(gw, pki):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    creds = grpc.ssl_channel_credentials(pki.ca.read_bytes(), pki.client_key.read_bytes(),
                                         pki.client_cert.read_bytes())
    with grpc.secure_channel(f"localhost:{gw.grpc_port}", creds) as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        # a raw Pull with no token is refused before it reaches the store
        call = service_pb2_grpc.TrajectoryServiceStub(ch).Pull(
            iter([spb.PullRequest(open=spb.OpenStream(group="job-b"))]), timeout=10)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_job_tokens_are_isolated_to_their_groups(gw, pki):
    verify = ssl.create_default_context(cafile=str(pki.ca))
    run = uuid.uuid4().hex[:8]  # groups of this test only: it runs alone or in any order
    with learner(gw, pki, f"job-b-{run}", LEARNER) as owner_b, \
            learner(gw, pki, f"job-a-{run}", JOB_A) as job_a, \
            learner(gw, pki, f"job-b-{run}", JOB_A) as stranger:
        assert code_of(stranger.create_group) == "PERMISSION_DENIED"
        assert owner_b.create_group(from_latest=True) is True  # created now
        assert job_a.create_group(from_latest=True) is True
        assert owner_b.create_group(from_latest=True) is False  # already there
        r = httpx.post(gw.url + "/v1/rollouts", verify=verify, timeout=120,
                       headers={"Authorization": f"Bearer {CLIENT}"},
                       json={"input_ids": [5, 6, 7], "n": 2,
                             "sampling_params": {"max_new_tokens": 3}})
        assert r.status_code == 200, r.text
        ids = {t["trajectory_id"] for t in r.json()["trajectories"]}
        # the stranger (job-a's token) can neither pull nor ack job-b's deliveries
        assert code_of(lambda: stranger.pull(2, timeout=3)) == "PERMISSION_DENIED"
        got = owner_b.pull(2, timeout=30)
        assert {x.trajectory_id for x in got} == ids
        assert code_of(lambda: stranger.ack([x.entry_id for x in got])) == "PERMISSION_DENIED"
        assert code_of(lambda: stranger.nack([x.entry_id for x in got])) == "PERMISSION_DENIED"
        assert code_of(lambda: stranger.extend([x.entry_id for x in got])) == "PERMISSION_DENIED"
        assert owner_b.extend(got) == 2  # the owner renews its own leases
        assert owner_b.ack(got) == 2  # nothing was taken from its owner
        mine = job_a.pull(2, timeout=30)  # job-a reads its own group
        assert {x.trajectory_id for x in mine} == ids and job_a.ack(mine) == 2
