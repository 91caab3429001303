"""rollout.v1.TrajectoryService: translates wire <-> store/control, nothing else.

Errors leave as gRPC status codes (GatewayError -> grpc.StatusCode[err.code.value]);
anything unexpected becomes INTERNAL with a generic message (logged here, never sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from rollout_gateway.auth import Authenticator, Principal, Role, bearer
from rollout_gateway.core.staleness import StalePolicy
from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.errors import FailedPrecondition, GatewayError, InvalidArgument, NotFound
from rollout_gateway.redact import clean_message
from rollout_gateway.store.base import StoredEntry, TrajectoryStore, check_name, is_entry_id
from rollout_gateway.transport.control_plane import ControlPlane, WeightSource, WeightSourceKind
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb

if TYPE_CHECKING:
    from rollout_gateway.observe.lag import LagReport

log = logging.getLogger(__name__)

SERVICE_NAME = spb.DESCRIPTOR.services_by_name["TrajectoryService"].full_name
_POLICIES = {spb.STALE_POLICY_DROP: StalePolicy.DROP, spb.STALE_POLICY_MASK: StalePolicy.MASK,
             spb.STALE_POLICY_RECYCLE: StalePolicy.RECYCLE}
_MAX_IDS = 10_000


async def _abort(context, exc: BaseException, *, private: bool = True):
    """Abort the call with the error's status; the message without class names or
    tracebacks, and (``private``: any caller but the admin) without addresses or paths."""
    if isinstance(exc, GatewayError):
        if exc.code.value in ("INTERNAL", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
            log.warning("trajectory service: %s", exc.message)
        await context.abort(grpc.StatusCode[exc.code.value],
                            clean_message(exc.message, private=private))
    log.exception("unexpected error in TrajectoryService", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error in the trajectory service")


def _unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            return await fn(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the single translation point
            await _abort(context, exc, private=not self._is_admin(context))
    return wrapper


def _streaming(fn):
    """``_unary`` for a method that streams its answers (an async generator)."""
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        try:
            async with contextlib.aclosing(fn(self, request, context)) as answers:
                async for msg in answers:
                    yield msg
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - the single translation point
            await _abort(context, exc, private=not self._is_admin(context))
    return wrapper


def _size(e: StoredEntry) -> int:
    """A delivery's share of one Pull message: its trajectory's bytes, also when only a
    reference is sent (a by-reference message then names ~target_batch_bytes of payload:
    what the learner fetches in one go)."""
    return codec.delivery_size(e.entry_id, e.size)


def _ids(ids) -> list[str]:
    if len(ids) > _MAX_IDS:
        raise InvalidArgument(f"at most {_MAX_IDS} entry ids per call, got {len(ids)}")
    bad = next((i for i in ids if not is_entry_id(i)), None)
    if bad is not None:
        raise InvalidArgument(f"malformed entry id {bad[:40]!r}: entry ids are ASCII digits "
                              "('<n>' or '<ms>-<seq>')")
    return list(ids)


@dataclass(slots=True)
class _Credit:
    """Outstanding credit; a dimension that no grant has bounded yet is unbounded (None)."""

    trajectories: int | None = None
    tokens: int | None = None

    def add(self, g: spb.CreditGrant) -> None:
        if g.trajectories == 0 and g.tokens == 0:
            raise InvalidArgument("a credit grant needs trajectories > 0 or tokens > 0")
        if g.trajectories:
            self.trajectories = (self.trajectories or 0) + g.trajectories
        if g.tokens:
            self.tokens = (self.tokens or 0) + g.tokens

    @property
    def granted(self) -> bool:
        return self.trajectories is not None or self.tokens is not None

    def open(self) -> bool:
        return self.granted and self.trajectories != 0 and self.tokens != 0

    def fits(self, e: StoredEntry) -> bool:
        return (self.trajectories is None or self.trajectories >= 1) and (
            self.tokens is None or e.num_tokens <= self.tokens)

    def take(self, e: StoredEntry) -> None:
        if self.trajectories is not None:
            self.trajectories -= 1
        if self.tokens is not None:
            self.tokens -= e.num_tokens


class TrajectoryServicer:
    def __init__(self, store: TrajectoryStore, control: ControlPlane, *,
                 default_policy: StalePolicy = StalePolicy.DROP, max_batch_bytes: int = 32 << 20,
                 max_read: int = 64, poll_ms: int = 200, target_batch_bytes: int = 32 << 20,
                 auth: Authenticator | None = None,
                 on_deliver: Callable[[list[StoredEntry], int], None] | None = None,
                 lag_report: Callable[[], Awaitable[LagReport]] | None = None):
        self.auth = auth  # role checks happen in the server's interceptor; groups here
        self.store = store
        self.control = control
        self.default_policy = StalePolicy(default_policy)
        self.max_batch_bytes = max_batch_bytes
        # soft size of one Pull message: deliveries are added while the message stays under
        # it (a single larger entry still goes alone, up to the hard max_batch_bytes)
        self.target_batch_bytes = min(target_batch_bytes, max_batch_bytes)
        self.max_read = max_read
        self.poll_ms = poll_ms
        #: called with (entries, learner_version) for every batch sent (dashboards: lag
        #: of delivered tokens); None: not observed
        self.on_deliver = on_deliver
        #: async () -> LagReport (the gateway's /v1/lag); fills Status.lag when set
        self.lag_report = lag_report

    def _is_admin(self, context) -> bool:
        if self.auth is None:
            return False
        md = context.invocation_metadata() or ()
        return self.auth.is_admin(next((v for k, v in md if k == "authorization"), None))

    def _job(self, context) -> Principal | None:
        """The caller when its token is a job's (bound to consumer groups), else None."""
        if self.auth is None:
            return None
        md = context.invocation_metadata() or ()
        p = self.auth.identify(bearer(next((v for k, v in md if k == "authorization"), None)))
        return p if p is not None and p.groups is not None else None

    def _group(self, context, kind: str, value: str) -> str:
        """A valid group name the caller's learner token may use (else PERMISSION_DENIED)."""
        group = check_name(kind, value)
        if self.auth is not None and not self.auth.open_for(Role.LEARNER):
            token = None
            for k, v in context.invocation_metadata() or ():
                if k == "authorization":
                    token = v
            self.auth.check_group(self.auth.require(token, Role.LEARNER), group)
        return group

    # ---- Pull: bidi, credit-based ----

    @_streaming
    async def Pull(self, request_iterator, context):
        stream: _PullStream | None = None
        try:
            first = await anext(aiter(request_iterator), None)
            if first is None or first.WhichOneof("kind") != "open":
                raise InvalidArgument("the first message on a Pull stream must be `open`")
            o = first.open
            group = self._group(context, "group", o.group)
            consumer = check_name("consumer", o.consumer or f"anon-{uuid.uuid4().hex[:8]}")
            if o.HasField("max_lag") and o.max_lag < 0:
                raise InvalidArgument("max_lag must be >= 0")
            if o.stale_policy and o.stale_policy not in _POLICIES:
                raise InvalidArgument(f"unknown stale_policy {o.stale_policy}")
            if o.payload not in spb.PayloadMode.values():
                raise InvalidArgument(f"unknown payload mode {o.payload}")
            ref_key = None if o.payload == spb.PAYLOAD_BYTES else self.store.reference_key()
            if ref_key is None and o.payload == spb.PAYLOAD_REFERENCE:
                raise FailedPrecondition(
                    "this server's trajectory store cannot serve references (only a Redis "
                    "store can); pull the bytes over gRPC (PAYLOAD_BYTES) or "
                    "PAYLOAD_PREFER_REFERENCE")
            if not await self.store.has_group(group):
                raise NotFound(f"consumer group {group!r} does not exist; call CreateGroup")
            stream = _PullStream(self, group, consumer, o.learner_version,
                                 o.max_lag if o.HasField("max_lag") else None,
                                 _POLICIES.get(o.stale_policy, self.default_policy), ref_key)
            async with contextlib.aclosing(stream.run(request_iterator)) as blobs:
                async for blob in blobs:
                    yield blob
        finally:
            if stream is not None:
                await stream.close()

    async def _reject_oversize(self, group: str, e: StoredEntry) -> None:
        """An entry larger than one gRPC message can never be delivered: dead-letter it."""
        log.error("trajectory %s (%d bytes) exceeds the max message size %d; dead-lettered",
                  e.trajectory_id, len(e.data), self.max_batch_bytes)
        await self.store.ack(group, [e.entry_id])
        await self.store._count(dead_lettered=1)

    # ---- unary ----

    @_unary
    async def Ack(self, request, context):
        n = await self.store.ack(self._group(context, "group", request.group),
                                 _ids(request.entry_ids))
        return spb.AckResponse(acked=n)

    @_unary
    async def Nack(self, request, context):
        requeued, dead = await self.store.nack(self._group(context, "group", request.group),
                                               _ids(request.entry_ids))
        return spb.NackResponse(requeued=requeued, dead_lettered=dead)

    @_unary
    async def ExtendLease(self, request, context):
        ids = _ids(request.entry_ids)
        done = await self.store.extend(self._group(context, "group", request.group),
                                       check_name("consumer", request.consumer), ids)
        kept = set(done)
        return spb.ExtendLeaseResponse(extended=len(done),
                                       lost=[i for i in ids if i not in kept],
                                       lease_seconds=self.store.config.lease_seconds)

    @_unary
    async def CreateGroup(self, request, context):
        created = await self.store.create_group(self._group(context, "group", request.group),
                                                from_latest=request.from_latest)
        return spb.CreateGroupResponse(created=created)

    @_unary
    async def GetStatus(self, request, context):
        st = await self.store.stats()
        cs = await self.control.status()
        store = spb.StoreStatus(
            published=st.published, duplicates=st.duplicates, backlog=st.backlog,
            max_backlog=st.max_backlog, stale_dropped=st.stale_dropped,
            stale_masked=st.stale_masked, stale_recycled=st.stale_recycled,
            dead_lettered=st.dead_lettered, redelivered=st.redelivered,
            lease_seconds=self.store.config.lease_seconds)
        if request.group:
            store.group_backlog = await self.store.group_backlog(
                self._group(context, "group", request.group))
        status = spb.Status(
            learner_version=cs.learner_version, max_engine_lag=cs.max_engine_lag,
            swap_in_progress=cs.swap_in_progress, store=store,
            engines=[spb.EngineVersion(engine_id=e.engine_id, version=e.version,
                                       healthy=e.healthy) for e in cs.engines])
        if self.lag_report is not None:
            try:  # the rest of Status stays valid when the lag figures cannot be read
                status.lag.CopyFrom(lag_status(await self.lag_report()))
            except GatewayError as exc:
                status.lag.error = f"{exc.code.value}: {exc.message}"[:500]
        job = self._job(context)
        if job is not None:  # a job sees its own groups only, and not the replica's host
            mine = [g for g in status.lag.groups if job.may_use_group(g.group)]
            del status.lag.groups[:]
            status.lag.groups.extend(mine)
            status.lag.replica = ""
        return status

    @_unary
    async def AnnounceVersion(self, request, context):
        src = request.source
        res = await self.control.announce(
            request.version,
            WeightSource(WeightSourceKind.parse(src.kind), src.uri, dict(src.options)),
            SwapMode.parse(request.mode), rolling=request.rolling)
        return spb.AnnounceResponse(accepted=res.accepted, version=res.version,
                                    message=res.message, pause_seconds=res.pause_seconds)

    @_streaming
    async def WatchVersions(self, request, context):
        async for ev in self.control.watch():
            yield spb.VersionEvent(version=ev.version, kind=ev.kind, engine_id=ev.engine_id,
                                   at=ev.at, message=ev.message)


class _PullStream:
    """One Pull stream: a producer leases entries from the store ahead of sending (up to
    the granted credit), the sender frames what fits the credit; requests move credit.
    Reading the store overlaps with sending the previous batch. With ``ref_key`` (a
    by-reference stream) each delivery carries a StoreReference instead of the
    trajectory; the learner reads the bytes from the store itself."""

    def __init__(self, svc: TrajectoryServicer, group: str, consumer: str, version: int,
                 max_lag: int | None, policy: StalePolicy, ref_key: str | None = None):
        self.svc, self.group, self.consumer = svc, group, consumer
        self.version, self.max_lag, self.policy = version, max_lag, policy
        self.ref_key = ref_key
        self.credit = _Credit()
        self.held: deque[StoredEntry] = deque()
        self.held_tokens = 0
        self.wake = asyncio.Event()  # any state change; loops clear, re-check, then wait
        self.failure: list[BaseException] = []
        self.requests_done = False
        self.drained = False  # after the requests ended, a store read came back empty
        self.read_hint = min(8, svc.max_read)  # entries per store read: ~ one message
        self.tasks: list[asyncio.Task] = []

    def _room(self) -> int:
        c = self.credit
        if not c.open() or (c.tokens is not None and self.held_tokens >= c.tokens):
            return 0
        n = self.svc.max_read if c.trajectories is None else c.trajectories - len(self.held)
        return min(n, self.read_hint)

    async def run(self, request_iterator):
        self.tasks = [asyncio.create_task(self._requests(request_iterator)),
                      asyncio.create_task(self._produce())]
        try:
            while True:
                self.wake.clear()
                if self.failure:
                    raise self.failure[0]
                if (self.held and self.ref_key is None
                        and _size(self.held[0]) > self.svc.max_batch_bytes):
                    await self.svc._reject_oversize(self.group, self._pop())
                    continue
                batch, size = [], 0
                while self.held and self.credit.fits(self.held[0]) and (
                        not batch or size + _size(self.held[0])
                        <= self.svc.target_batch_bytes):
                    e = self._pop()
                    self.credit.take(e)
                    batch.append(e)
                    size += _size(e)
                if batch:
                    self.wake.set()  # room for the producer
                    if self.svc.on_deliver is not None:
                        self.svc.on_deliver(batch, self.version)
                    yield self._frame(batch)
                    continue
                if self.requests_done and (not self.credit.open() or self.drained):
                    return
                await self.wake.wait()
        finally:
            await self._stop_tasks()

    def _frame(self, batch: list[StoredEntry]) -> bytes:
        left = (self.credit.trajectories or 0, self.credit.tokens or 0)
        if self.ref_key is None:
            return codec.encode_batch(
                ((e.entry_id, e.delivery_count, e.masked, e.data) for e in batch), *left)
        key = self.svc.store.reference_key  # the stream of the entry's shard
        return codec.encode_references(
            ((e.entry_id, e.delivery_count, e.masked, spb.StoreReference(
                kind=codec.REDIS_STREAM, key=key(e.entry_id), size=e.size,
                trajectory_id=e.trajectory_id, num_tokens=e.num_tokens)) for e in batch),
            *left)

    async def _stop_tasks(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def _pop(self) -> StoredEntry:
        e = self.held.popleft()
        self.held_tokens -= e.num_tokens
        return e

    async def _produce(self) -> None:
        try:
            while True:
                self.wake.clear()
                room = self._room()
                if room <= 0:
                    await self.wake.wait()
                    continue
                got = await self.svc.store.pull(
                    self.group, self.consumer, room, learner_version=self.version,
                    max_lag=self.max_lag, policy=self.policy, block_ms=self.svc.poll_ms,
                    payload=self.ref_key is None)
                if self.ref_key is not None:  # only references leave: do not hold the bytes
                    for e in got:
                        if e.nbytes < 0:
                            e.nbytes, e.data = len(e.data), b""
                self.held.extend(got)
                self.held_tokens += sum(e.num_tokens for e in got)
                if got:  # small reads of large entries: the first message leaves sooner
                    avg = max(sum(e.size for e in got) / len(got), 1)
                    self.read_hint = max(1, min(self.svc.max_read,
                                                int(self.svc.target_batch_bytes // avg)))
                if not got and self.requests_done:
                    self.drained = True
                self.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced by the sender
            self.failure.append(exc)
            self.wake.set()

    async def _requests(self, it) -> None:
        try:
            async for req in it:
                if req.WhichOneof("kind") != "credit":
                    raise InvalidArgument("only `credit` messages may follow `open`")
                g = req.credit
                self.credit.add(g)
                if g.HasField("learner_version"):
                    self.version = g.learner_version
                if g.HasField("max_lag"):
                    if g.max_lag < 0:
                        raise InvalidArgument("max_lag must be >= 0")
                    self.max_lag = g.max_lag
                self.wake.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced by the sender
            self.failure.append(exc)
        finally:
            self.requests_done = True
            self.wake.set()

    async def close(self) -> None:
        """Stop the tasks; entries leased but never sent become available again at once."""
        await self._stop_tasks()
        if not self.held:
            return
        ids = [e.entry_id for e in self.held]
        self.held.clear()
        try:
            await self.svc.store.nack(self.group, ids, delivered=False)
        except Exception:  # noqa: BLE001 - lease expiry still covers them
            log.warning("could not release %d held entries", len(ids))


def _dist(d) -> spb.LagDistribution:
    return spb.LagDistribution(buckets=[spb.LagBucket(lag=b.lag, tokens=b.tokens)
                                        for b in d.buckets], tokens=d.tokens)


def lag_status(rep) -> spb.LagStatus:
    """rollout_gateway.observe.lag.LagReport -> rollout.v1.LagStatus."""
    it, st = rep.intra_trajectory, rep.staleness
    return spb.LagStatus(
        replica=rep.replica,
        engines=[spb.EngineLag(engine_id=e.id, state=e.state, version=e.version, lag=e.lag)
                 for e in rep.engines],
        in_flight=_dist(rep.in_flight), unconsumed=_dist(rep.unconsumed),
        delivered=_dist(rep.delivered), in_flight_samples=rep.in_flight.samples,
        trajectories_finished=it.trajectories,
        trajectories_spanning_versions=it.spanning_versions, max_intra_lag=it.max_intra_lag,
        tokens_after_switch=it.tokens_after_switch, tokens_on_stale_kv=it.tokens_on_stale_kv,
        pause_windows=[spb.PauseWindow(swap_id=w.swap_id, version=w.version, mode=w.mode,
                                       engine_id=w.engine, paused_at=w.paused_at,
                                       resumed_at=w.resumed_at) for w in rep.pause_windows],
        tokens_reprefilled=st.tokens_reprefilled, dropped_at_finish=st.at_finish_dropped,
        masked_at_finish=st.at_finish_masked, recycled_at_finish=st.at_finish_recycled,
        groups=[spb.GroupLag(group=g.group, backlog=g.backlog, pending=g.pending,
                             redelivered=g.redelivered) for g in rep.groups])


def generic_handler(servicer: TrajectoryServicer) -> grpc.GenericRpcHandler:
    """Method handlers; Pull's responses are pre-encoded bytes (identity serializer)."""
    req = {m.name: m.input_type for m in spb.DESCRIPTOR.services_by_name[
        "TrajectoryService"].methods}
    import google.protobuf.message_factory as mf

    def des(name):
        return mf.GetMessageClass(req[name]).FromString

    def ser(msg):
        return msg.SerializeToString()

    handlers = {
        "Pull": grpc.stream_stream_rpc_method_handler(
            servicer.Pull, request_deserializer=des("Pull"), response_serializer=None),
        "WatchVersions": grpc.unary_stream_rpc_method_handler(
            servicer.WatchVersions, request_deserializer=des("WatchVersions"),
            response_serializer=ser),
    }
    for name in ("Ack", "Nack", "CreateGroup", "GetStatus", "AnnounceVersion", "ExtendLease"):
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, name), request_deserializer=des(name), response_serializer=ser)
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)
