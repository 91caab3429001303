"""The learner gRPC service over real loopback gRPC, against both stores."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from _redis_support import delete_prefix
from learner_client.client import AsyncTrajectoryClient
from learner_client.errors import TrajectoryClientError
from rollout_gateway.store.base import StoreConfig
from rollout_gateway.store.factory import store_from_url
from doubles.control_plane import InProcessControlPlane
from rollout_gateway.transport.server import GrpcServer
from doubles.trajectories import make_trajectory
from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import service_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(params=["memory", "redis"])
async def gateway(request):
    prefix = f"test-{uuid.uuid4().hex[:10]}"
    url = "memory://" if request.param == "memory" else f"redis://127.0.0.1:6379/0?prefix={prefix}"
    store = store_from_url(url, StoreConfig(lease_seconds=30))
    control = InProcessControlPlane(["e0", "e1"], version=0)
    server = GrpcServer(store, control, port=0, poll_ms=50)
    port = await server.start()
    await server.set_serving(True)
    await store.create_group("job")
    yield store, control, server, f"127.0.0.1:{port}"
    await server.stop(0)
    await store.close()
    if request.param == "redis":
        await delete_prefix(prefix)


async def publish(store, n, start=0, **kw):
    for i in range(start, start + n):
        await store.publish(make_trajectory(f"t{i}", seed=i, **kw))


async def raw_pull(target, group, grants, expect, barrier=None, timeout=30.0, **open_kw):
    """Open a raw Pull stream, send ``grants`` and collect Batches until ``expect``
    deliveries arrived. Then grant ``barrier`` (default: one trajectory) and read until its
    delivery: the stream is ordered, so anything the server sent beyond ``grants`` arrives
    before it, and must be the barrier's entry (the next one published). Counting ends on
    events, never after a sleep. Returns the Batches of ``grants``; asserts the barrier got
    exactly one delivery, the entry after the last one granted."""
    barrier = barrier or spb.CreditGrant(trajectories=1)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = service_pb2_grpc.TrajectoryServiceStub(ch)
        q: asyncio.Queue = asyncio.Queue()
        q.put_nowait(spb.PullRequest(open=spb.OpenStream(group=group, consumer="raw", **open_kw)))
        for g in grants:
            q.put_nowait(spb.PullRequest(credit=g))

        async def gen():
            while True:
                yield await q.get()

        call = stub.Pull(gen())
        batches, after = [], []

        async def collect():
            it = call.__aiter__()
            while sum(len(b.deliveries) for b in batches) < expect:
                batches.append(await it.__anext__())
            q.put_nowait(spb.PullRequest(credit=barrier))
            while not after or not after[-1].deliveries:
                after.append(await it.__anext__())

        try:
            await asyncio.wait_for(collect(), timeout)
        finally:
            call.cancel()
    got = [d.trajectory.trajectory_id for b in batches for d in b.deliveries]
    extra = [d.trajectory.trajectory_id for b in after for d in b.deliveries]
    assert len(got) == expect, f"{len(got)} deliveries for a credit of {expect}: {got}"
    assert len(extra) == 1, f"the barrier's grant of one got {extra}"
    return batches, extra[0]


async def until(pred, what: str, timeout: float = 10.0) -> None:
    """Yield to the loop until ``pred()`` holds (the server runs in this loop)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def tid_after(batches) -> str:
    """The id published after the last one delivered in ``batches`` (ids ``t<i>``)."""
    return f"t{int(batches[-1].deliveries[-1].trajectory.trajectory_id[1:]) + 1}"


async def test_pull_ack_roundtrip_and_duplicates_deliver_once(gateway):
    store, _, _, target = gateway
    await publish(store, 3)
    await publish(store, 3)  # duplicates
    async with AsyncTrajectoryClient(target, "job", "l1") as c:
        got = await c.pull(10, timeout=1.0)
        assert sorted(r.trajectory_id for r in got) == ["t0", "t1", "t2"]
        assert all(r.delivery_count == 1 and not r.redelivered for r in got)
        assert got[0].routed_experts is None and got[0].logprobs.dtype.str == "<f4"
        assert await c.ack(got) == 3
        assert await c.pull(10, timeout=0.3) == []
        st = await c.status()
    assert (st.store.published, st.store.duplicates, st.store.group_backlog) == (3, 3, 0)


async def test_flow_control_never_exceeds_credit(gateway):
    store, _, _, target = gateway
    await publish(store, 12, prompt_len=8, num_tokens=16)  # 24 tokens each
    # (each pull ends with a barrier: one more granted entry, the next in order, arrives;
    # an over-credit delivery would have come before it)
    batches, nxt = await raw_pull(target, "job", [spb.CreditGrant(trajectories=3)], 3)
    assert batches[-1].credit_trajectories == 0 and nxt == tid_after(batches)
    # token credit: 50 tokens admit two 24-token trajectories, not three
    batches, nxt = await raw_pull(target, "job", [spb.CreditGrant(trajectories=10, tokens=50)],
                                  2, barrier=spb.CreditGrant(tokens=24))
    assert batches[-1].credit_tokens == 2 and nxt == tid_after(batches)
    # more credit on the same stream is honoured, exactly
    batches, nxt = await raw_pull(target, "job", [spb.CreditGrant(trajectories=1),
                                                  spb.CreditGrant(trajectories=2)], 3)
    got = [d for b in batches for d in b.deliveries]
    assert nxt == tid_after(batches)
    # entries the server leased but never sent (no credit) were released, not "redelivered"
    assert [d.delivery_count for d in got] == [1, 1, 1]


async def test_client_pull_respects_token_budget(gateway):
    store, _, _, target = gateway
    await publish(store, 6, prompt_len=8, num_tokens=16)
    async with AsyncTrajectoryClient(target, "job", "l1") as c:
        got = await c.pull(6, max_tokens=72, timeout=1.0)
        assert len(got) == 3 and sum(r.seq_len for r in got) == 72


async def _code(coro) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    return info.value.code()


async def test_malformed_requests_are_invalid_argument(gateway):
    _, _, _, target = gateway
    async with grpc.aio.insecure_channel(target) as ch:
        stub = service_pb2_grpc.TrajectoryServiceStub(ch)
        inv = grpc.StatusCode.INVALID_ARGUMENT
        assert await _code(stub.Ack(spb.AckRequest(group="bad group!", entry_ids=["1"]))) == inv
        assert await _code(stub.Ack(spb.AckRequest(group="job", entry_ids=["x y"]))) == inv
        assert await _code(stub.CreateGroup(spb.CreateGroupRequest(group=""))) == inv
        assert await _code(stub.AnnounceVersion(spb.AnnounceRequest(
            version=1, mode="yolo", source=spb.WeightSource(kind="path", uri="/w")))) == inv

        async def one(*reqs):
            call = stub.Pull(iter(reqs))
            async for _ in call:
                pass

        assert await _code(one(spb.PullRequest(credit=spb.CreditGrant(trajectories=1)))) == inv
        op = spb.PullRequest(open=spb.OpenStream(group="job", consumer="c"))
        assert await _code(one(op, spb.PullRequest(credit=spb.CreditGrant()))) == inv
        assert await _code(one(op, op)) == inv
        assert await _code(one(spb.PullRequest(open=spb.OpenStream(
            group="job", consumer="c", max_lag=-1)))) == inv
    # the service is still fine afterwards
    async with AsyncTrajectoryClient(target, "job") as c:
        assert (await c.status()).learner_version == 0


async def test_unknown_group_is_not_found(gateway):
    _, _, _, target = gateway
    async with AsyncTrajectoryClient(target, "nobody", backoff_max=0.2) as c:
        with pytest.raises(TrajectoryClientError) as info:
            await c.pull(1, timeout=2.0)
        assert info.value.code == "NOT_FOUND"
        with pytest.raises(TrajectoryClientError) as info:
            await c.ack(["1-0"])
        assert info.value.code == "NOT_FOUND"
        assert await c.create_group()
        assert await c.pull(1, timeout=0.2) == []


@pytest.mark.parametrize("policy", ["drop", "mask", "recycle"])
async def test_staleness_filter_over_grpc(gateway, policy):
    store, _, _, target = gateway
    # learner at 10, max_lag 3: fresh iff min version >= 7
    versions = {"a": (7, 9), "b": (6, 10), "c": (10,), "d": (2,), "e": (7,)}
    for i, (tid, v) in enumerate(versions.items()):
        await store.publish(make_trajectory(tid, versions=v, seed=i))
    async with AsyncTrajectoryClient(target, "job", learner_version=10, max_lag=3,
                                     stale_policy=policy) as c:
        got = await c.pull(5, timeout=1.0)
        st = (await c.status()).store
    seen = {r.trajectory_id: r.masked for r in got}
    if policy == "mask":
        assert seen == {"a": False, "b": True, "c": False, "d": True, "e": False}
        assert st.stale_masked == 2 and st.stale_dropped == 0
    else:
        assert seen == {"a": False, "c": False, "e": False}
        assert (st.stale_dropped, st.stale_recycled) == ((2, 0) if policy == "drop" else (0, 2))
        if policy == "recycle":
            assert sorted(t.trajectory_id for t in await store.take_recycled(10)) == ["b", "d"]


async def test_nack_redelivers_with_count(gateway):
    store, _, _, target = gateway
    await publish(store, 1)
    async with AsyncTrajectoryClient(target, "job", "l1") as c:
        [r] = await c.pull(1, timeout=1.0)
        assert await c.nack([r]) == (1, 0)
        [again] = await c.pull(1, timeout=1.0)
        assert again.trajectory_id == r.trajectory_id and again.delivery_count == 2


async def test_health_reflection_and_shutdown(gateway):
    _, _, server, target = gateway
    async with grpc.aio.insecure_channel(target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        name = "rollout.v1.TrajectoryService"
        res = await health.Check(health_pb2.HealthCheckRequest(service=name))
        assert res.status == health_pb2.HealthCheckResponse.SERVING
        await server.set_serving(False)
        res = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert res.status == health_pb2.HealthCheckResponse.NOT_SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)

        async def reqs():
            yield reflection_pb2.ServerReflectionRequest(list_services="")

        async for resp in refl.ServerReflectionInfo(reqs()):
            names = {s.name for s in resp.list_services_response.service}
            break
        assert name in names and "grpc.health.v1.Health" in names


async def test_announce_watch_and_status(gateway):
    _, control, _, target = gateway
    async with AsyncTrajectoryClient(target, "job") as c:
        events = []

        async def watch():
            async for ev in c.watch_versions():
                events.append(ev)
                if ev.kind == "swap_done":
                    return

        task = asyncio.create_task(watch())
        await until(lambda: control.watchers == 1 or task.done(), "the watch stream to open")
        res = await c.announce(1, "/ckpt/v1", mode="in_place")
        assert res.accepted and res.version == 1
        await asyncio.wait_for(task, 5)
        assert [e.kind for e in events] == ["announced", "engine_updated", "engine_updated",
                                            "swap_done"]
        st = await c.status()
        assert st.learner_version == 1 and {e.version for e in st.engines} == {1}
        with pytest.raises(TrajectoryClientError) as info:
            await c.announce(1, "/ckpt/v1")
        assert info.value.code == "FAILED_PRECONDITION"


async def test_bearer_token_required():
    store = store_from_url("memory://")
    server = GrpcServer(store, InProcessControlPlane(), port=0, auth_token="s3cret")
    port = await server.start()
    await server.set_serving(True)
    try:
        async with AsyncTrajectoryClient(f"127.0.0.1:{port}", "job") as c:
            with pytest.raises(TrajectoryClientError) as info:
                await c.create_group()
            assert info.value.code == "UNAUTHENTICATED"
        async with AsyncTrajectoryClient(f"127.0.0.1:{port}", "job", token="s3cret") as c:
            assert await c.create_group()
            assert await c.pull(1, timeout=0.2) == []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:  # streams too
            stub = service_pb2_grpc.TrajectoryServiceStub(ch)
            call = stub.Pull(iter([spb.PullRequest(open=spb.OpenStream(group="job"))]))
            assert await _code(_drain(call)) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await server.stop(0)
        await store.close()


async def _drain(call):
    async for _ in call:
        pass


async def test_tls_with_token(tmp_path):
    import shutil
    import subprocess

    from learner_client.client import TlsOptions

    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed (needed to mint a test certificate)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    store = store_from_url("memory://")
    server = GrpcServer(store, InProcessControlPlane(), host="localhost", port=0,
                        auth_token="tok", tls_cert=str(cert), tls_key=str(key))
    port = await server.start()
    await server.set_serving(True)
    try:
        tls = TlsOptions(root_certs=cert.read_bytes())
        async with AsyncTrajectoryClient(f"localhost:{port}", "job", tls=tls, token="tok") as c:
            assert await c.create_group()
            await store.publish(make_trajectory("secure"))
            [r] = await c.pull(1, timeout=2.0)
            assert r.trajectory_id == "secure" and await c.ack([r]) == 1
        async with AsyncTrajectoryClient(f"localhost:{port}", "job", call_timeout=1.0) as c:
            with pytest.raises(TrajectoryClientError):  # plaintext against a TLS port
                await c.status()
    finally:
        await server.stop(0)
        await store.close()


async def test_oversize_trajectory_is_dead_lettered_not_looped():
    store = store_from_url("memory://")
    await store.create_group("job")
    await store.publish(make_trajectory("huge", num_tokens=400, num_layers=48))  # ~190 KB
    await store.publish(make_trajectory("ok", num_tokens=4))
    server = GrpcServer(store, InProcessControlPlane(), port=0, max_send_bytes=160 << 10)
    port = await server.start()
    try:
        async with AsyncTrajectoryClient(f"127.0.0.1:{port}", "job") as c:
            got = await c.pull(2, timeout=1.0)
            assert [r.trajectory_id for r in got] == ["ok"]
            assert (await c.status()).store.dead_lettered == 1
    finally:
        await server.stop(0)
        await store.close()


async def test_messages_split_at_the_target_size_within_credit():
    """A soft per-message target splits a grant into several Batch messages (each under
    the target unless one entry alone exceeds it); all granted entries arrive, no more."""
    store = store_from_url("memory://")
    await store.create_group("job")
    for i in range(6):  # ~19 KB each with 48x8 routing
        await store.publish(make_trajectory(f"t{i}", num_tokens=40, num_layers=48, seed=i))
    server = GrpcServer(store, InProcessControlPlane(), port=0, target_message_bytes=40 << 10)
    port = await server.start()
    try:
        batches, nxt = await raw_pull(f"127.0.0.1:{port}", "job",
                                      [spb.CreditGrant(trajectories=5)], 5)
        assert nxt == "t5"
        sizes = [len(b.deliveries) for b in batches]
        assert sum(sizes) == 5 and len(sizes) >= 3 and max(sizes) <= 2
        assert all(b.ByteSize() <= 40 << 10 for b in batches)
        ids = [d.trajectory.trajectory_id for b in batches for d in b.deliveries]
        assert ids == [f"t{i}" for i in range(5)]
    finally:
        await server.stop(0)
        await store.close()


async def test_blocking_client(gateway):
    from learner_client.client import TrajectoryClient

    store, _, _, target = gateway
    await store.publish(make_trajectory("old", versions=(0,)))
    await store.publish(make_trajectory("new", versions=(5,), seed=1))

    def learner():
        with TrajectoryClient(target, "job", "sync-learner", learner_version=5, max_lag=2,
                              stale_policy="drop") as c:
            got = c.pull(2, timeout=1.5)
            acked = c.ack(got)
            c.set_learner_version(6)
            ann = c.announce(1, "/ckpt/1")
            st = c.status()
            return [r.trajectory_id for r in got], acked, ann.accepted, st

    ids, acked, accepted, st = await asyncio.to_thread(learner)
    assert ids == ["new"] and acked == 1 and accepted
    assert st.learner_version == 1 and st.store.stale_dropped == 1


async def test_health_not_serving_until_ready():
    store = store_from_url("memory://")
    server = GrpcServer(store, InProcessControlPlane(), port=0)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            req = health_pb2.HealthCheckRequest(service="rollout.v1.TrajectoryService")
            assert (await health.Check(req)).status == health_pb2.HealthCheckResponse.NOT_SERVING
            await server.set_serving(True)
            assert (await health.Check(req)).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)
        await store.close()
