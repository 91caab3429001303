"""A rollout: n samples of one prompt, run concurrently, stamped, published."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from rollout_gateway.core import trajectory_codec
from rollout_gateway.core.admission import Verdict
from rollout_gateway.core.trajectory import Trajectory, Transition
from rollout_gateway.engines.pool import EnginePool
from rollout_gateway.errors import AlreadyExists, GatewayError, InvalidArgument
from rollout_gateway.redact import clean_message
from rollout_gateway.rollouts.gatekeeper import Gatekeeper
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.sample import PassThrough, SampleRunner
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.store.base import TrajectoryStore

log = logging.getLogger(__name__)

REPREFILLS = frozenset({Transition.RETRACT, Transition.ABORT_RESUME, Transition.FAILOVER})


class RolloutService:
    """Validates, admits, runs, judges (staleness policy) and publishes rollouts."""

    def __init__(self, pool: EnginePool, store: TrajectoryStore, settings: GatewaySettings,
                 gatekeeper: Gatekeeper, oldlogits: Any = None) -> None:
        self.pool = pool
        self.store = store
        self.settings = settings
        self.gatekeeper = gatekeeper
        self.oldlogits = oldlogits  # oldlogits.OldLogitService: fills old_logprobs, or None
        self.runner = SampleRunner(pool, settings, gatekeeper.registry, oldlogits)
        self.counters = {"rollouts": 0, "samples": 0, "tokens": 0, "published": 0,
                         "duplicates": 0, "failed_samples": 0, "failovers": 0,
                         "abort_resumes": 0, "tokens_reprefilled": 0, "publish_failed": 0,
                         "replayed": 0}
        self._background: set[asyncio.Task[None]] = set()
        self._running_ids: dict[str, asyncio.Event] = {}  # request_id -> its run's end
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
        if req.input_ids is not None:
            self._check_vocab(req.input_ids)
        if req.prompt is not None and len(req.prompt) > s.max_prompt_chars:
            raise InvalidArgument(f"prompt has {len(req.prompt)} characters; the limit is "
                                  f"{s.max_prompt_chars}")
        if req.metadata:
            size = sum(len(k.encode()) + len(v.encode()) for k, v in req.metadata.items())
            if size > s.max_metadata_bytes:
                raise InvalidArgument(f"metadata has {size} bytes; the limit is "
                                      f"{s.max_metadata_bytes}")

    def _check_vocab(self, ids: list[int]) -> None:
        """An id outside the engines' vocabulary is the caller's error (SGLang 0.5.23 would
        crash its scheduler on it): 400 naming the id and the size. The smallest vocabulary
        any engine reports (from its model's config); nothing is checked when none does."""
        sizes = [e.client.info.vocab_size for e in self.pool.list()
                 if e.client.info.vocab_size is not None]
        if not sizes or not ids:
            return
        vocab = min(sizes)
        if min(ids) < 0 or max(ids) >= vocab:  # builtins: a long prompt costs ~1 ms
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise InvalidArgument(f"input_ids holds token id {bad}, outside the model's "
                                  f"vocabulary of {vocab} ids (valid: 0 .. {vocab - 1})",
                                  details={"token_id": bad, "vocab_size": vocab})

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no sample is in flight (graceful shutdown)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.gatekeeper.running > 0:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def _ids(self, req: RolloutRequest) -> tuple[str, list[str], str | None]:
        group = req.group_id or uuid.uuid4().hex
        base = req.request_id or uuid.uuid4().hex
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
        return trajectory_codec.decode(data) if data else None

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
                            passthrough: PassThrough | None = None) -> tuple[Trajectory, str]:
        """One admitted sample: run, judge against the staleness bound, publish.

        Releases its admission slot exactly once (``slot.held`` says whether it still
        holds one; whoever admitted releases a slot still held when the sample ends). A
        recycled sample is generated again (re-admitted, waiting up to
        ``admission.recycle_wait_s`` for a slot) up to ``admission.max_recycles`` times;
        with no slot in time its request fails with 429 (counted as ``recycle_refused``)."""
        slot = slot or Slot()
        recycles = 0
        while True:
            try:
                traj, text = await self.runner.run(req, tid, group, i, sticky_key=sticky,
                                                   prompt_ids=prompt, on_chunk=on_chunk,
                                                   passthrough=passthrough)
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

    async def run(self, req: RolloutRequest) -> list[Trajectory]:
        """Run every sample; returns trajectories in sample order. Finished samples are
        published even when a sibling fails (then the first error is raised)."""
        return [t for t, _ in await self.run_with_text(req)]

    async def _claim(self, req: RolloutRequest) -> asyncio.Event | None:
        """One run per request_id at a time on this replica: a retry that arrives while
        the original still runs waits for it, then answers what it stored."""
        rid = req.request_id
        if rid is None:
            return None
        while (other := self._running_ids.get(rid)) is not None:
            await other.wait()
        done = self._running_ids[rid] = asyncio.Event()
        return done

    def _unclaim(self, req: RolloutRequest, done: asyncio.Event | None) -> None:
        if done is not None:
            self._running_ids.pop(req.request_id, None)
            done.set()

    async def _plan(self, req: RolloutRequest) -> tuple[str, list[str], str | None,
                                                         dict[int, Trajectory]]:
        """Ids of the samples, and those a previous run with this request_id stored
        (answered from the store, not generated again)."""
        group, ids, sticky = self._ids(req)
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
        if stored:
            self.counters["replayed"] += len(stored)
            group = next(iter(stored.values())).group_id or group
        return group, ids, sticky, stored

    async def run_with_text(self, req: RolloutRequest, passthrough: PassThrough | None = None
                            ) -> list[tuple[Trajectory, str]]:
        """Samples a previous run with the same ``request_id`` stored are answered from the
        store (their text is not stored: ""); only the others are generated."""
        self.validate(req)
        claim = await self._claim(req)
        try:
            group, ids, sticky, stored = await self._plan(req)
            todo = [i for i in range(req.n) if i not in stored]
            results: list[Any] = [(stored[i], "") if i in stored else None
                                  for i in range(req.n)]
            if todo:
                await self._timed_admission("new", self.gatekeeper.admit(len(todo)))
                slots = [Slot() for _ in todo]
                try:  # every exit path below returns the slots no sample released
                    self.counters["rollouts"] += 1
                    prompt = _prompt_array(req)
                    ran = await asyncio.gather(
                        *(self.one_with_text(req, ids[i], group, i, sticky, prompt, slot=slot,
                                            passthrough=passthrough)
                          for i, slot in zip(todo, slots)), return_exceptions=True)
                finally:
                    self._release_held(slots)
                for i, r in zip(todo, ran):
                    results[i] = r
        finally:
            self._unclaim(req, claim)
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

    async def open_stream(self, req: RolloutRequest, passthrough: PassThrough | None = None
                          ) -> AsyncIterator[dict[str, Any]]:
        """Validate and admit now (errors raise here), start the samples; then stream
        events: {"type": "chunk", ...} per finished engine request (stamped tokens),
        {"type": "trajectory", ...} per finished sample, {"type": "error"} per failed one.
        The samples run (judge, publish, release their slots) whether or not the stream
        is read to the end, or at all. Samples stored by an earlier run with the same
        ``request_id`` come first, from the store."""
        self.validate(req)
        claim = await self._claim(req)
        slots: list[Slot] = []
        try:
            group, ids, sticky, stored = await self._plan(req)
            todo = [i for i in range(req.n) if i not in stored]
            queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
            for i, t in stored.items():
                queue.put_nowait({"type": "trajectory", "sample_index": i, "trajectory": t,
                                  "text": ""})
            if todo:
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
                                                          passthrough=passthrough)
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
            self._unclaim(req, claim)
            raise

        async def closer() -> None:
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                self._release_held(slots)
                self._unclaim(req, claim)
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
