"""A rollout: n samples of one prompt, run concurrently, stamped, published."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import numpy as np

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.admission import Verdict
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.core.version_policy import ANY
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import AlreadyExists, GatewayError, InvalidArgument
from rollout_gateway.redact import clean_message
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.sample import (
    CUT_SHORT,
    VERSION_POLICY,
    PassThrough,
    SampleRunner,
)
from rollout_gateway.rollouts.tenancy import (
    DIGEST_KEY,
    TENANT_KEY,
    check_same,
    digest,
    request_base,
)
from rollout_gateway.settings import DEFAULT_TENANT, GatewaySettings
from rollout_gateway.store.base import TrajectoryStore

log = logging.getLogger(__name__)

REPREFILLS = frozenset({Transition.RETRACT, Transition.ABORT_RESUME, Transition.FAILOVER})

#: a request_id another replica runs: first wait and cap between looks (seconds)
CLAIM_BACKOFF = (0.02, 0.5)


class RequestClaims(Protocol):
    """Leases on request ids shared by the replicas (the session store implements it)."""

    async def claim_request(self, rid: str, owner: str, ttl: float) -> bool: ...

    async def renew_request(self, rid: str, owner: str, ttl: float) -> bool: ...

    async def release_request(self, rid: str, owner: str) -> None: ...


class RolloutService:
    """Validates, admits, runs, judges (staleness policy) and publishes rollouts."""

    def __init__(self, pool: EnginePool, store: TrajectoryStore, settings: GatewaySettings,
                 gatekeeper: Gatekeeper, oldlogits: Any = None) -> None:
        self.pool = pool
        self.store = store
        self.settings = settings
        self.gatekeeper = gatekeeper
        self.oldlogits = oldlogits  # oldlogits.OldLogitService: fills old_logprobs, or None
        self.counters = {"rollouts": 0, "samples": 0, "tokens": 0, "published": 0,
                         "duplicates": 0, "failed_samples": 0, "failovers": 0,
                         "abort_resumes": 0, "tokens_reprefilled": 0, "publish_failed": 0,
                         "replayed": 0, "cut_short": 0}
        # the runner adds its version-policy counters to these
        self.runner = SampleRunner(pool, settings, gatekeeper.registry, oldlogits,
                                   counters=self.counters)
        self.default_policy = self.runner.default_policy
        self._background: set[asyncio.Task[None]] = set()
        self._running_ids: dict[str, asyncio.Event] = {}  # request_id -> its run's end
        #: request ids shared across replicas (the session store's request claims; None:
        #: this replica alone), and the claims held here: request_id -> (owner, renewer)
        self.claims: RequestClaims | None = None
        self._shared_claims: dict[str, tuple[str, asyncio.Task[None]]] = {}
        #: observers (dashboards/metrics): on_finished(traj); on_admission_wait(kind,
        #: admitted, seconds) with kind "new" or "recycled"
        self.on_finished = None
        self.on_admission_wait = None

    async def _timed_admission(self, kind: str, admit) -> None:
        t0 = time.monotonic()
        ok = False
        try:
            await admit
            ok = True
        finally:
            if self.on_admission_wait is not None:
                self.on_admission_wait(kind, ok, time.monotonic() - t0)

    @property
    def inflight_samples(self) -> int:
        return self.gatekeeper.running

    def validate(self, req: RolloutRequest) -> None:
        s = self.settings
        if req.n > s.max_samples_per_request:
            raise InvalidArgument(f"n={req.n} exceeds the limit of {s.max_samples_per_request} "
                                  "samples per request", details={"limit": s.max_samples_per_request})
        if req.sampling_params.max_new_tokens > s.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens={req.sampling_params.max_new_tokens} exceeds "
                                  f"the limit of {s.max_new_tokens_limit}")
        if req.input_ids is not None and len(req.input_ids) > s.max_prompt_tokens:
            raise InvalidArgument(f"prompt has {len(req.input_ids)} tokens; the limit is "
                                  f"{s.max_prompt_tokens}")
        if req.prompt is not None and len(req.prompt) > s.max_prompt_chars:
            raise InvalidArgument(f"prompt has {len(req.prompt)} characters; the limit is "
                                  f"{s.max_prompt_chars}")
        vocab = self.pool.vocab_size() if self.pool is not None else None  # None: no engines
        if vocab is not None:  # one place for every route (SGLang does not check them)
            bad = max(max(req.input_ids or (), default=-1),
                      max(req.sampling_params.stop_token_ids or (), default=-1))
            if bad >= vocab:
                raise InvalidArgument(f"token id {bad} is out of the model's vocabulary; "
                                      f"valid ids are [0, {vocab})",
                                      details={"vocab_size": vocab})
        if req.metadata:
            size = sum(len(k.encode()) + len(v.encode()) for k, v in req.metadata.items())
            if size > s.max_metadata_bytes:
                raise InvalidArgument(f"metadata has {size} bytes; the limit is "
                                      f"{s.max_metadata_bytes}")

    def cut_short(self) -> int:
        """Shutdown past ``drain_grace_s``: every sample in flight ends with the output it
        has (finish_reason abort, message :data:`CUT_SHORT`; judged and published as any
        other, counted as ``cut_short``); one with no output yet fails. The engine requests
        are broken off (an engine aborts a request whose client left). Returns how many
        requests were broken off."""
        self.runner.cutting = True
        return sum(e.client.abort_inflight(CUT_SHORT) for e in self.pool.list())

    async def check_policy(self) -> None:
        """Before admission: a request whose version policy no engine satisfies is answered
        503 + Retry-After now (streams too, before their first event), not per sample.
        Samples a retried ``request_id`` stored earlier are answered whatever the fleet's
        versions now."""
        policy = VERSION_POLICY.get() or self.default_policy
        if policy != ANY:
            await self.runner.route(policy, probe=True)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no sample is in flight (graceful shutdown)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.gatekeeper.running > 0:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _ids(self, req: RolloutRequest, tenant: str) -> tuple[str, list[str], str | None]:
        group = req.group_id or uuid.uuid4().hex
        base = request_base(tenant, req.request_id) if req.request_id else uuid.uuid4().hex
        ids = [f"{base}:{i}" for i in range(req.n)]
        sticky = req.session_id or req.group_id
        return group, ids, sticky

    async def _publish(self, traj: Trajectory, req: RolloutRequest) -> Trajectory | None:
        """Publish; a store failure does not throw the generated tokens away: the caller
        still gets the trajectory, marked ``metadata["publish_error"]``, and it is counted.
        When the id was already stored (the same request_id run elsewhere at the same
        time), returns the stored copy: the caller is answered what the learner gets."""
        if not req.publish:
            return None
        try:
            stored = await self.store.publish(traj)
        except GatewayError as exc:
            self.counters["publish_failed"] += 1
            traj.metadata["publish_error"] = clean_message(
                f"{exc.code.value}: {exc.message}")[:300]  # shown to clients: no addresses
            log.error("publishing %s failed: %s", traj.trajectory_id, exc.message)
            return None
        self.counters["published" if stored else "duplicates"] += 1
        if stored or req.request_id is None:
            return None
        try:
            data = (await self.store.lookup([traj.trajectory_id])).get(traj.trajectory_id)
        except GatewayError:
            return None
        kept = trajectory_codec.decode(data) if data else None
        if kept is not None:  # the other run's body must be this one's (409 otherwise)
            check_same(req.request_id, kept.metadata.get(DIGEST_KEY),
                       traj.metadata.get(DIGEST_KEY, ""))
        return kept

    def _count(self, traj: Trajectory) -> None:
        self.counters["samples"] += 1
        self.counters["tokens"] += traj.num_tokens
        self.counters["failovers"] += sum(1 for s in traj.segments if s.began == "failover")
        self.counters["abort_resumes"] += sum(1 for s in traj.segments
                                              if s.began is Transition.ABORT_RESUME)
        # a retract / resubmission re-prefills prompt + output so far (exact, from segments)
        p = int(traj.prompt_token_ids.shape[0])
        self.counters["tokens_reprefilled"] += sum(
            p + s.start for s in traj.segments if s.began in REPREFILLS)
        if self.on_finished is not None:
            self.on_finished(traj)

    async def one_with_text(self, req: RolloutRequest, tid: str, group: str, i: int,
                            sticky: str | None, prompt: np.ndarray | None,
                            on_chunk=None, slot: Slot | None = None,
                            passthrough: PassThrough | None = None,
                            stamp: dict[str, str] | None = None) -> tuple[Trajectory, str]:
        """One admitted sample: run, judge against the staleness bound, publish.

        Releases its admission slot exactly once (``slot.held`` says whether it still
        holds one; whoever admitted releases a slot still held when the sample ends). A
        recycled sample is generated again (re-admitted, waiting up to
        ``admission.recycle_wait_s`` for a slot) up to ``admission.max_recycles`` times;
        with no slot in time its request fails with 429 (counted as ``recycle_refused``).
        ``stamp``: gateway-owned metadata (tenant, request digest) set over the caller's."""
        slot = slot or Slot()
        recycles = 0
        while True:
            try:
                traj, text = await self.runner.run(req, tid, group, i, sticky_key=sticky,
                                                   prompt_ids=prompt, on_chunk=on_chunk,
                                                   passthrough=passthrough)
                if stamp:
                    traj.metadata.update(stamp)
                if traj.finish_reason.message == CUT_SHORT:
                    self.counters["cut_short"] += 1
                self._count(traj)
                if self.oldlogits is not None:  # exact old logits before delivery
                    await self.oldlogits.fill(traj, req.sampling_params.temperature)
            except BaseException:
                slot.release(self.gatekeeper)
                self.counters["failed_samples"] += 1
                raise
            try:  # judging releases the slot, whatever happens inside
                verdict = (await self.gatekeeper.judge(traj, recycles)).verdict
            except BaseException:
                self.counters["failed_samples"] += 1
                raise
            finally:
                slot.held = False
            if verdict is Verdict.RECYCLE:
                recycles += 1
                try:  # waits for a slot (bounded); never drops the prompt silently
                    await self._timed_admission("recycled",
                                                self.gatekeeper.readmit_recycled(tid))
                except BaseException:
                    self.counters["failed_samples"] += 1
                    raise
                slot.held = True
                continue
            if verdict is not Verdict.DROP and (kept := await self._publish(traj, req)):
                return kept, ""  # an earlier run's copy of this sample
            return traj, text

    async def run(self, req: RolloutRequest, tenant: str = DEFAULT_TENANT) -> list[Trajectory]:
        """Run every sample; returns trajectories in sample order. Finished samples are
        published even when a sibling fails (then the first error is raised)."""
        return [t for t, _ in await self.run_with_text(req, tenant=tenant)]

    @staticmethod
    def _stamp(req: RolloutRequest, tenant: str) -> dict[str, str]:
        out = {TENANT_KEY: tenant}
        if req.request_id is not None:
            out[DIGEST_KEY] = digest(req)
        return out

    async def _claim(self, req: RolloutRequest, tenant: str) -> asyncio.Event | None:
        """One run per request_id (of a tenant) at a time: a retry that arrives while the
        original still runs waits for it, then answers what it stored. On this replica an
        event; across replicas sharing a store (``claims``) a lease the run holds (renewed
        while it runs; a dead replica's lapses after ``session_lease_s``), so two replicas
        never generate one request twice (nor send the engines one request id twice)."""
        if req.request_id is None:
            return None
        rid = request_base(tenant, req.request_id)
        while (other := self._running_ids.get(rid)) is not None:
            await other.wait()
        done = self._running_ids[rid] = asyncio.Event()
        if self.claims is not None:
            try:
                await self._claim_shared(rid)
            except BaseException:
                self._running_ids.pop(rid, None)
                done.set()
                raise
        return done

    async def _claim_shared(self, rid: str) -> None:
        assert self.claims is not None
        claims, ttl = self.claims, self.settings.session_lease_s
        owner = f"{self.gatekeeper.replica_id}/{uuid.uuid4().hex[:12]}"
        delay, cap = CLAIM_BACKOFF
        while not await claims.claim_request(rid, owner, ttl):
            await asyncio.sleep(delay)  # another replica runs it: it ends or its lease lapses
            delay = min(delay * 2, cap)

        async def renew() -> None:
            while True:
                await asyncio.sleep(ttl / 3)
                with contextlib.suppress(GatewayError):
                    await claims.renew_request(rid, owner, ttl)

        task = asyncio.get_running_loop().create_task(renew())
        self._shared_claims[rid] = (owner, task)

    def _unclaim(self, req: RolloutRequest, tenant: str, done: asyncio.Event | None) -> None:
        if done is not None:
            rid = request_base(tenant, req.request_id)
            self._running_ids.pop(rid, None)
            held = self._shared_claims.pop(rid, None)
            if held is not None and self.claims is not None:
                owner, renewer = held
                renewer.cancel()
                task = asyncio.get_running_loop().create_task(
                    self._release_shared(rid, owner))
                self._background.add(task)
                task.add_done_callback(self._background.discard)
            done.set()

    async def _release_shared(self, rid: str, owner: str) -> None:
        assert self.claims is not None
        try:
            await self.claims.release_request(rid, owner)
        except GatewayError as exc:  # its lease lapses
            log.warning("request %s: releasing its claim failed: %s", rid, exc.message)

    async def _plan(self, req: RolloutRequest, tenant: str, stamp: dict[str, str]
                    ) -> tuple[str, list[str], str | None, dict[int, Trajectory]]:
        """Ids of the samples, and those a previous run with this request_id stored
        (answered from the store, not generated again; 409 when that run's body differs)."""
        group, ids, sticky = self._ids(req, tenant)
        if req.request_id is None or not req.publish:
            return group, ids, sticky, {}
        found = await self.store.lookup(ids)
        gone = sorted(t for t, d in found.items() if d is None)
        if gone:
            raise AlreadyExists(
                f"request {req.request_id} finished earlier and its trajectories were "
                f"consumed and are no longer retained ({', '.join(gone[:8])}); use a new "
                "request_id to generate again", details={"trajectory_ids": gone})
        stored = {i: trajectory_codec.decode(found[t]) for i, t in enumerate(ids) if t in found}
        for t in stored.values():
            check_same(req.request_id, t.metadata.get(DIGEST_KEY), stamp[DIGEST_KEY])
        if stored:
            self.counters["replayed"] += len(stored)
            group = next(iter(stored.values())).group_id or group
        return group, ids, sticky, stored

    async def run_with_text(self, req: RolloutRequest, passthrough: PassThrough | None = None,
                            *, tenant: str = DEFAULT_TENANT) -> list[tuple[Trajectory, str]]:
        """Samples a previous run with the same ``request_id`` (of the same ``tenant``)
        stored are answered from the store (their text is not stored: ""); only the others
        are generated."""
        self.validate(req)
        stamp = self._stamp(req, tenant)
        claim = await self._claim(req, tenant)
        try:
            group, ids, sticky, stored = await self._plan(req, tenant, stamp)
            todo = [i for i in range(req.n) if i not in stored]
            results: list[Any] = [(stored[i], "") if i in stored else None
                                  for i in range(req.n)]
            if todo:
                await self.check_policy()
                await self._timed_admission("new", self.gatekeeper.admit(len(todo)))
                slots = [Slot() for _ in todo]
                try:  # every exit path below returns the slots no sample released
                    self.counters["rollouts"] += 1
                    prompt = _prompt_array(req)
                    ran = await asyncio.gather(
                        *(self.one_with_text(req, ids[i], group, i, sticky, prompt, slot=slot,
                                            passthrough=passthrough, stamp=stamp)
                          for i, slot in zip(todo, slots)), return_exceptions=True)
                finally:
                    self._release_held(slots)
                for i, r in zip(todo, ran):
                    results[i] = r
        finally:
            self._unclaim(req, tenant, claim)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            if isinstance(first, GatewayError):
                first.details.setdefault("failed_samples", len(errors))
                first.details.setdefault("finished_ids", [r[0].trajectory_id for r in results
                                                          if isinstance(r, tuple)])
            raise first
        return results

    def _release_held(self, slots: list[Slot]) -> None:
        for s in slots:
            s.release(self.gatekeeper)

    async def open_stream(self, req: RolloutRequest, passthrough: PassThrough | None = None,
                          *, tenant: str = DEFAULT_TENANT, on_done: Callable[[], None] | None
                          = None) -> AsyncIterator[dict[str, Any]]:
        """Validate and admit now (errors raise here), start the samples; then stream
        events: {"type": "chunk", ...} per finished engine request (stamped tokens),
        {"type": "trajectory", ...} per finished sample, {"type": "error"} per failed one.
        The samples run (judge, publish, release their slots) whether or not the stream
        is read to the end, or at all. Samples stored by an earlier run with the same
        ``request_id`` come first, from the store. ``on_done`` is called once every sample
        has ended (not when errors raise here)."""
        self.validate(req)
        stamp = self._stamp(req, tenant)
        claim = await self._claim(req, tenant)
        slots: list[Slot] = []
        try:
            group, ids, sticky, stored = await self._plan(req, tenant, stamp)
            todo = [i for i in range(req.n) if i not in stored]
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            for i, t in stored.items():
                queue.put_nowait({"type": "trajectory", "sample_index": i, "trajectory": t,
                                  "text": ""})
            if todo:
                await self.check_policy()
                await self._timed_admission("new", self.gatekeeper.admit(len(todo)))
                slots = [Slot() for _ in todo]
                self.counters["rollouts"] += 1
            prompt = _prompt_array(req) if todo else None

            async def one(i: int, tid: str, slot: Slot) -> None:
                async def on_chunk(chunk: dict[str, Any]) -> None:
                    await queue.put({"type": "chunk", "sample_index": i, "trajectory_id": tid,
                                     **chunk})
                try:
                    traj, text = await self.one_with_text(req, tid, group, i, sticky, prompt,
                                                          on_chunk=on_chunk, slot=slot,
                                                          passthrough=passthrough, stamp=stamp)
                    # objects, not JSON: each HTTP route renders them its own way
                    await queue.put({"type": "trajectory", "sample_index": i,
                                     "trajectory": traj, "text": text})
                except GatewayError as exc:
                    await queue.put({"type": "error", "sample_index": i,
                                     "error": exc.to_dict()})
                except Exception:  # noqa: BLE001 - reported, never silently absent
                    log.exception("sample %s failed", tid)
                    await queue.put({"type": "error", "sample_index": i, "error": GatewayError(
                        f"sample {tid} failed with an internal error").to_dict()})

            tasks = [asyncio.create_task(one(i, ids[i], slot)) for i, slot in zip(todo, slots)]
        except BaseException:
            self._release_held(slots)
            self._unclaim(req, tenant, claim)
            raise

        async def closer() -> None:
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                self._release_held(slots)
                self._unclaim(req, tenant, claim)
                if on_done is not None:
                    on_done()
                await queue.put(None)

        closing = asyncio.create_task(closer())
        self._background.add(closing)
        closing.add_done_callback(self._background.discard)
        return self._drain_queue(queue)

    @staticmethod
    async def _drain_queue(queue: asyncio.Queue) -> AsyncIterator[dict[str, Any]]:
        # if the client goes away, the sample tasks still finish, judge and publish
        while (ev := await queue.get()) is not None:
            yield ev


class Slot:
    """One sample's admission slot: ``held`` until the sample releases it (judged or
    failed); :meth:`release` is idempotent."""

    __slots__ = ("held",)

    def __init__(self) -> None:
        self.held = True

    def release(self, gatekeeper: Gatekeeper) -> None:
        if self.held:
            self.held = False
            gatekeeper.release_failed(1)


def _prompt_array(req: RolloutRequest) -> np.ndarray | None:
    """The prompt's token ids as int32; ids that do not fit are a client error."""
    if req.input_ids is None:
        return None
    try:
        return np.asarray(req.input_ids, np.int32)
    except (OverflowError, ValueError) as exc:
        raise InvalidArgument("input_ids must be token ids below 2**31") from exc
