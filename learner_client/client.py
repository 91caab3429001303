"""Learner-side client of rollout.v1.TrajectoryService.

``AsyncTrajectoryClient`` (asyncio) and ``TrajectoryClient`` (blocking; the same client
driven on a private event-loop thread). One long-lived bidi Pull stream per client: a
``pull(n)`` grants just enough credit to bring n trajectories (and at most max_tokens
prompt+output tokens), then waits. Deliveries are leased to this consumer until
``ack`` (call it after the optimizer step) or ``nack``; a lease that expires (learner
died) is redelivered to another consumer with ``delivery_count > 1``. While deliveries
are held un-acked, the client renews their leases in the background (every third of the
server's ``lease_seconds``; ``auto_extend=False`` turns it off, ``extend()`` does it by
hand), so an optimizer step longer than the lease does not get its batch redelivered. Broken streams and
unreachable servers are retried with exponential backoff; NOT_FOUND, INVALID_ARGUMENT,
UNAUTHENTICATED and PERMISSION_DENIED are raised at once.

By reference (``store_url="redis://..."``, the gateway's Redis): the server sends each
delivery's stream key and entry id instead of its bytes and the client reads the bytes from
Redis itself (``learner_client.store``, on a fetch thread), so the bulk bytes skip gRPC;
credit, staleness decisions, leases and ack/nack stay on gRPC. A server whose store cannot
serve references (the embedded store) sends bytes instead, unless ``by_reference=True``
demanded references (then pull raises FAILED_PRECONDITION). An entry deleted from the
store between its reference and the fetch is nacked, logged and listed in ``missing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from learner_client.errors import TrajectoryClientError
from learner_client.wire import Rollout, StoreRef, decode_fetched, parse_deliveries
from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import service_pb2_grpc

log = logging.getLogger(__name__)

_POLICY = {None: spb.STALE_POLICY_UNSPECIFIED, "drop": spb.STALE_POLICY_DROP,
           "mask": spb.STALE_POLICY_MASK, "recycle": spb.STALE_POLICY_RECYCLE}


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """PEM bytes; all optional (None root_certs = system roots; cert+key = mutual TLS)."""

    root_certs: bytes | None = None
    cert_chain: bytes | None = None
    private_key: bytes | None = None
    server_name: str | None = None  # override the name checked in the server certificate


def _error(exc: grpc.aio.AioRpcError | grpc.RpcError) -> TrajectoryClientError:
    return TrajectoryClientError(exc.code().name, exc.details() or "")



async def _cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel a background task (if any) and wait until it stopped, whatever it raised."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class AsyncTrajectoryClient:
    def __init__(self, target: str, group: str, consumer: str | None = None, *,
                 learner_version: int = 0, max_lag: int | None = None,
                 stale_policy: str | None = None, token: str | None = None,
                 tls: TlsOptions | None = None, max_message_bytes: int = 256 << 20,
                 backoff_initial: float = 0.1, backoff_max: float = 5.0,
                 call_timeout: float = 30.0, prefetch: int = 0, auto_extend: bool = True,
                 store_url: str | None = None, by_reference: bool | None = None,
                 fetch_pipeline_bytes: int = 4 << 20):
        """``store_url``: the gateway's Redis (``redis://``, ``rediss://``, ``unix://``;
        the gateway's own ``prefix=``/store options are ignored): read trajectory bytes
        from it by reference. ``by_reference``: None (default) = by reference when
        store_url is set and the server's store can serve references, else bytes over
        gRPC; True = by reference or FAILED_PRECONDITION; False = always bytes.
        ``fetch_pipeline_bytes``: payload bytes per pipelined Redis round trip."""
        if stale_policy not in _POLICY:
            raise ValueError(f"stale_policy must be one of drop/mask/recycle/None, "
                             f"got {stale_policy!r}")
        if max_lag is not None and max_lag < 0:
            raise ValueError("max_lag must be >= 0")
        self.target, self.group = target, group
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}"
        self.learner_version, self.max_lag, self.stale_policy = learner_version, max_lag, stale_policy
        self._meta = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls
        self._opts = [("grpc.max_receive_message_length", max_message_bytes),
                      ("grpc.max_send_message_length", 16 << 20),
                      ("grpc.keepalive_time_ms", 60_000),
                      ("grpc.http2.lookahead_bytes", 64 << 20)]
        if tls and tls.server_name:
            self._opts.append(("grpc.ssl_target_name_override", tls.server_name))
        self._backoff = (backoff_initial, backoff_max)
        self._timeout = call_timeout
        if prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        self.prefetch = prefetch  # extra trajectories of credit kept in flight beyond a pull
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.TrajectoryServiceStub | None = None
        self._call = None
        self._requests: asyncio.Queue | None = None
        self._inbox: asyncio.Queue[Rollout | BaseException] | None = None
        self._receiver: asyncio.Task | None = None
        self._credit = [0, 0]  # outstanding (trajectories, tokens) granted, not yet received
        self._buffer: list[Rollout] = []
        self.auto_extend = auto_extend
        self._held: dict[str, None] = {}  # entry ids handed out by pull(), not acked/nacked
        self._extender: asyncio.Task | None = None
        self.lease_seconds: float | None = None  # the server's, learned on first use
        self.leases_lost: list[str] = []  # held entries a renewal found no longer ours
        if by_reference and not store_url:
            raise ValueError("by_reference=True needs store_url (the gateway's Redis URL)")
        self._payload = (spb.PAYLOAD_BYTES if not store_url or by_reference is False
                         else spb.PAYLOAD_REFERENCE if by_reference
                         else spb.PAYLOAD_PREFER_REFERENCE)
        self._store = None
        if self._payload != spb.PAYLOAD_BYTES:
            from learner_client.store import StoreReader

            self._store = StoreReader(store_url, pipeline_bytes=fetch_pipeline_bytes)
        self._fetch_pool: ThreadPoolExecutor | None = None
        self.fetched = 0  # trajectories read from the store by reference
        self.missing: list[str] = []  # referenced entries no longer in the store (nacked)

    # ---- connection ----

    def _ensure_channel(self) -> service_pb2_grpc.TrajectoryServiceStub:
        if self._stub is None:
            if self._tls is not None:
                creds = grpc.ssl_channel_credentials(self._tls.root_certs, self._tls.private_key,
                                                     self._tls.cert_chain)
                self._channel = grpc.aio.secure_channel(self.target, creds, options=self._opts)
            else:
                self._channel = grpc.aio.insecure_channel(self.target, options=self._opts)
            self._stub = service_pb2_grpc.TrajectoryServiceStub(self._channel)
        return self._stub

    async def _retry(self, fn, deadline: float | None = None):
        """Call fn() (a coroutine factory), retrying retryable failures with backoff."""
        delay = self._backoff[0]
        deadline = deadline if deadline is not None else time.monotonic() + self._timeout
        while True:
            try:
                return await fn()
            except grpc.aio.AioRpcError as exc:
                err = _error(exc)
            except TrajectoryClientError as exc:
                err = exc
            if not err.retryable or time.monotonic() + delay > deadline:
                raise err
            await asyncio.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 2, self._backoff[1])

    async def _unary(self, method: str, request, deadline: float | None = None):
        stub = self._ensure_channel()

        async def call():
            left = (deadline or time.monotonic() + self._timeout) - time.monotonic()
            return await getattr(stub, method)(request, metadata=self._meta,
                                               timeout=max(left, 0.05), wait_for_ready=True)
        return await self._retry(call, deadline)

    async def _open_stream(self) -> None:
        self._ensure_channel()
        await self._close_stream()
        self._requests = asyncio.Queue()
        self._inbox = asyncio.Queue()
        self._credit = [0, 0]
        opened = spb.OpenStream(group=self.group, consumer=self.consumer,
                                learner_version=self.learner_version,
                                stale_policy=_POLICY[self.stale_policy])
        if self.max_lag is not None:
            opened.max_lag = self.max_lag
        opened.payload = self._payload
        self._requests.put_nowait(spb.PullRequest(open=opened))
        requests = self._requests

        async def gen():
            while True:
                item = await requests.get()
                if item is None:
                    return
                yield item

        # raw response bytes: parse_batch makes zero-copy column views into them
        pull = self._channel.stream_stream(
            "/rollout.v1.TrajectoryService/Pull",
            request_serializer=spb.PullRequest.SerializeToString, response_deserializer=None)
        self._call = pull(gen(), metadata=self._meta, wait_for_ready=True)
        self._receiver = asyncio.create_task(self._receive(self._call, self._inbox))

    async def _receive(self, call, inbox: asyncio.Queue) -> None:
        try:
            async for raw in call:
                items = parse_deliveries(raw)[0]
                refs = [r for r in items if isinstance(r, StoreRef)]
                if refs:
                    fetched = iter(await self._fetch(refs))
                    items = [next(fetched) if isinstance(r, StoreRef) else r for r in items]
                for r in items:
                    if r is not None:
                        inbox.put_nowait(r)
            inbox.put_nowait(TrajectoryClientError("UNAVAILABLE", "pull stream ended"))
        except grpc.aio.AioRpcError as exc:
            inbox.put_nowait(_error(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - surfaced to pull()
            inbox.put_nowait(exc)

    async def _fetch(self, refs: list[StoreRef]) -> list[Rollout | None]:
        """Read and decode referenced deliveries on the fetch thread; None for an entry
        gone from the store (nacked here, logged, listed in ``missing``)."""
        if self._store is None:
            raise TrajectoryClientError("FAILED_PRECONDITION", "the server sent store "
                                        "references but this client has no store_url")
        if self._fetch_pool is None:
            self._fetch_pool = ThreadPoolExecutor(1, thread_name_prefix="store-fetch")
        try:
            got = await asyncio.get_running_loop().run_in_executor(
                self._fetch_pool, self._fetch_sync, refs)
        except TrajectoryClientError as exc:
            if exc.retryable:  # redeliver now rather than after the lease
                await self._nack_quietly([r.entry_id for r in refs], exc.message)
            raise
        gone = [r for r, x in zip(refs, got) if x is None]
        if gone:
            ids = [r.entry_id for r in gone]
            log.error("%d referenced trajectories are no longer in the store (trimmed or "
                      "deleted before the learner read them); nacked: %s", len(ids),
                      ", ".join(f"{r.entry_id} ({r.trajectory_id})" for r in gone))
            self.missing += ids
            self._credit[0] = max(self._credit[0] - len(gone), 0)
            self._credit[1] = max(self._credit[1] - sum(r.num_tokens for r in gone), 0)
            await self._nack_quietly(ids, "trajectory bytes missing from the store")
        return got

    def _fetch_sync(self, refs: list[StoreRef]) -> list[Rollout | None]:
        out = [None if d is None else decode_fetched(r, d)
               for r, d in zip(refs, self._store.fetch(refs))]
        self.fetched += sum(1 for r in out if r is not None)
        return out

    async def _nack_quietly(self, ids: list[str], reason: str) -> None:
        try:
            await self._unary("Nack", spb.NackRequest(group=self.group, entry_ids=ids,
                                                      reason=reason))
        except TrajectoryClientError as exc:  # their leases still expire
            log.warning("could not nack %d entries: %s", len(ids), exc)

    async def _close_stream(self) -> None:
        if self._requests is not None:
            self._requests.put_nowait(None)
        if self._call is not None:
            self._call.cancel()
        await _cancel_and_wait(self._receiver)
        self._call = self._receiver = self._requests = self._inbox = None

    # ---- pulling ----

    def set_learner_version(self, version: int, max_lag: int | None = None) -> None:
        """Move the staleness reference (sent with the next credit grant)."""
        self.learner_version = version
        if max_lag is not None:
            self.max_lag = max_lag

    async def pull(self, max_trajectories: int, max_tokens: int = 0,
                   timeout: float = 10.0) -> list[Rollout]:
        """Up to max_trajectories (and, if max_tokens > 0, at most max_tokens prompt+output
        tokens). Returns when that many arrived or after ``timeout`` seconds (maybe fewer,
        maybe none). Deliveries that arrive later are kept for the next pull."""
        if max_trajectories < 1:
            raise ValueError("max_trajectories must be >= 1")
        deadline = time.monotonic() + timeout
        delay = self._backoff[0]
        while True:
            try:
                return await self._pull_once(max_trajectories, max_tokens, deadline)
            except TrajectoryClientError as err:
                if not err.retryable:
                    await self._close_stream()
                    raise
                await self._close_stream()
                if time.monotonic() + delay >= deadline:
                    return self._take(max_trajectories, max_tokens)
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, self._backoff[1])

    def _take(self, n: int, max_tokens: int) -> list[Rollout]:
        out, used = [], 0
        while self._buffer and len(out) < n:
            r = self._buffer[0]
            if max_tokens and used + r.seq_len > max_tokens:
                break
            out.append(self._buffer.pop(0))
            used += r.seq_len
        for r in out:
            self._held[r.entry_id] = None
        if out and self.auto_extend and (self._extender is None or self._extender.done()):
            self._extender = asyncio.create_task(self._extend_loop())
        return out

    # ---- leases ----

    async def _learn_lease(self) -> float:
        if self.lease_seconds is None:
            st = await self.status()
            self.lease_seconds = st.store.lease_seconds or 0.0
        return self.lease_seconds

    async def _extend_loop(self) -> None:
        """Renew held deliveries every third of the lease while any are held."""
        try:
            lease = await self._learn_lease()
        except TrajectoryClientError:
            lease = 0.0
        if lease <= 0:  # a server without lease renewal: nothing to do
            return
        period = max(lease / 3, 0.05)
        while self._held:
            await asyncio.sleep(period)
            if not self._held:
                return
            try:
                await self.extend(list(self._held))
            except TrajectoryClientError:
                continue  # retried next period; the lease still has two thirds left

    async def extend(self, items: Iterable[Rollout | str]) -> int:
        """Renew the leases of held deliveries for another ``lease_seconds``; returns how
        many were renewed. Entries no longer ours (already acked, nacked, or expired and
        redelivered) are dropped from the held set and listed in ``leases_lost``."""
        ids = self._entry_ids(items)
        if not ids:
            return 0
        res = await self._unary("ExtendLease", spb.ExtendLeaseRequest(
            group=self.group, consumer=self.consumer, entry_ids=ids))
        if res.lease_seconds:
            self.lease_seconds = res.lease_seconds
        for eid in res.lost:
            if eid in self._held:
                del self._held[eid]
                self.leases_lost.append(eid)
        return res.extended

    def _release(self, ids: list[str]) -> None:
        for eid in ids:
            self._held.pop(eid, None)

    async def _pull_once(self, n: int, max_tokens: int, deadline: float) -> list[Rollout]:
        if self._call is None:
            await self._open_stream()
        buffered_tok = sum(r.seq_len for r in self._buffer)
        want_n = n + self.prefetch - len(self._buffer) - self._credit[0]
        want_tok = (max_tokens * (1 + (self.prefetch > 0)) - buffered_tok - self._credit[1]
                    if max_tokens else 0)
        if want_n > 0 and (not max_tokens or want_tok > 0):
            grant = spb.CreditGrant(trajectories=want_n, tokens=max(want_tok, 0),
                                    learner_version=self.learner_version)
            if self.max_lag is not None:
                grant.max_lag = self.max_lag
            self._requests.put_nowait(spb.PullRequest(credit=grant))
            self._credit[0] += want_n
            self._credit[1] += max(want_tok, 0)
        while len(self._buffer) < n:
            if not self._inbox.empty():  # already here: no timer task per delivery
                item = self._inbox.get_nowait()
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = await asyncio.wait_for(self._inbox.get(), timeout=left)
                except TimeoutError:
                    break
            if isinstance(item, BaseException):
                raise item
            self._credit[0] = max(self._credit[0] - 1, 0)
            self._credit[1] = max(self._credit[1] - item.seq_len, 0)
            self._buffer.append(item)
            if max_tokens and sum(r.seq_len for r in self._buffer) >= max_tokens:
                break
        return self._take(n, max_tokens)

    # ---- acks and control ----

    @staticmethod
    def _entry_ids(items: Iterable[Rollout | str]) -> list[str]:
        return [i if isinstance(i, str) else i.entry_id for i in items]

    async def ack(self, items: Iterable[Rollout | str]) -> int:
        """Acknowledge trained-on trajectories (after the optimizer step)."""
        ids = self._entry_ids(items)
        if not ids:
            return 0
        res = await self._unary("Ack", spb.AckRequest(group=self.group, entry_ids=ids))
        self._release(ids)
        return res.acked

    async def nack(self, items: Iterable[Rollout | str], reason: str = "") -> tuple[int, int]:
        """Reject: requeued now, or dead-lettered past the store's max deliveries."""
        ids = self._entry_ids(items)
        if not ids:
            return 0, 0
        res = await self._unary("Nack", spb.NackRequest(group=self.group, entry_ids=ids,
                                                        reason=reason))
        self._release(ids)
        return res.requeued, res.dead_lettered

    async def create_group(self, from_latest: bool = False) -> bool:
        res = await self._unary("CreateGroup", spb.CreateGroupRequest(
            group=self.group, from_latest=from_latest))
        return res.created

    async def status(self) -> spb.Status:
        return await self._unary("GetStatus", spb.StatusRequest(group=self.group))

    async def announce(self, version: int, uri: str, *, kind: str = "path",
                       mode: str = "in_place", rolling: bool = False,
                       options: dict[str, str] | None = None) -> spb.AnnounceResponse:
        """Announce policy ``version`` (weights at ``uri``) and request the hot-swap."""
        req = spb.AnnounceRequest(version=version, mode=mode, rolling=rolling,
                                  source=spb.WeightSource(kind=kind, uri=uri,
                                                          options=options or {}))
        return await self._unary("AnnounceVersion", req)

    async def watch_versions(self) -> AsyncIterator[spb.VersionEvent]:
        stub = self._ensure_channel()
        call = stub.WatchVersions(spb.WatchRequest(), metadata=self._meta, wait_for_ready=True)
        try:
            async for ev in call:
                yield ev
        except grpc.aio.AioRpcError as exc:
            raise _error(exc) from None
        finally:
            call.cancel()

    async def close(self) -> None:
        await _cancel_and_wait(self._extender)
        self._extender = None
        await self._close_stream()
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = None
        if self._fetch_pool is not None:
            self._fetch_pool.shutdown(wait=True)
            self._fetch_pool = None
        if self._store is not None:
            self._store.close()

    async def __aenter__(self) -> AsyncTrajectoryClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class TrajectoryClient:
    """Blocking facade: the async client on a private event-loop thread."""

    def __init__(self, target: str, group: str, consumer: str | None = None, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="trajectory-client")
        self._thread.start()
        self._client = self._run(self._make(target, group, consumer, kwargs))

    @staticmethod
    async def _make(target, group, consumer, kwargs) -> AsyncTrajectoryClient:
        return AsyncTrajectoryClient(target, group, consumer, **kwargs)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    @property
    def consumer(self) -> str:
        return self._client.consumer

    def set_learner_version(self, version: int, max_lag: int | None = None) -> None:
        self._loop.call_soon_threadsafe(self._client.set_learner_version, version, max_lag)

    def pull(self, max_trajectories: int, max_tokens: int = 0,
             timeout: float = 10.0) -> list[Rollout]:
        return self._run(self._client.pull(max_trajectories, max_tokens, timeout))

    def ack(self, items: Iterable[Rollout | str]) -> int:
        return self._run(self._client.ack(list(items)))

    def nack(self, items: Iterable[Rollout | str], reason: str = "") -> tuple[int, int]:
        return self._run(self._client.nack(list(items), reason))

    def extend(self, items: Iterable[Rollout | str]) -> int:
        return self._run(self._client.extend(list(items)))

    @property
    def leases_lost(self) -> list[str]:
        return self._client.leases_lost

    @property
    def missing(self) -> list[str]:
        return self._client.missing

    @property
    def fetched(self) -> int:
        return self._client.fetched

    def create_group(self, from_latest: bool = False) -> bool:
        return self._run(self._client.create_group(from_latest))

    def status(self) -> spb.Status:
        return self._run(self._client.status())

    def announce(self, version: int, uri: str, **kwargs) -> spb.AnnounceResponse:
        return self._run(self._client.announce(version, uri, **kwargs))

    def watch_versions(self) -> Iterator[spb.VersionEvent]:
        agen = self._client.watch_versions()
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._run(agen.aclose())

    def close(self) -> None:
        if self._loop.is_running():
            self._run(self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)

    def __enter__(self) -> TrajectoryClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
