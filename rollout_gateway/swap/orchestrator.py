"""Hot-swap (a refit): fence the pool, update every engine, verify, publish, resume, record.

One refit is one transaction (``SwapRecord.swap_id``) with a version cut: each engine's
outcome is recorded, and the learner version is published once, after the engines that
took the new weights verified and before any of them resumes.

Guarantees:
* an engine is resumed only after it reports the new version (``/model_info``); until
  then its gate stays closed, so no new request reaches it;
* with a disk source and a ``weights_manifest.json`` beside the checkpoint
  (``swap.manifest``), an engine verifies only when every sampled tensor it reads back
  (``/get_weights_by_name``) matches its checksum; one that differs runs weights that are
  neither the old nor the announced ones and leaves rotation (``failed_load``, below).
  Without a manifest, or on an engine that cannot read parameters back, verification is
  by version only and the outcome's ``verification`` says so;
* only engines that verified get the new version (``Engine.version``, the registry's
  engine versions); nothing else is published for the others;
* an engine whose load fails but that still reports its old version afterwards (SGLang
  and the reference engine keep the served weights when a load fails) stays in rotation at
  that version: nothing is aborted, its paused requests continue, ``kept_version`` is
  recorded and ``last_error`` says why it lags;
* an engine whose state cannot be confirmed (no answer, another version reported) leaves
  rotation (``failed_load``): its requests are aborted and fail over to engines that did
  load, so no token is stamped with a version the engine did not run;
* the learner version advances only when at least one engine took the new version (or
  the announce has no source); a swap no engine took changes nothing and can be retried;
* kv stamping learns how each version was installed (``Engine.installed_by``);
* before the pause, requests are broken off on purpose only (``_to_break_off``): a retract
  swap's requests that asked for routed experts (they resume as after ``abort_resume``:
  SGLang would re-prefill them under the new weights and return the re-prefill's routing
  for the tokens sampled before the swap), with ``drop_stale`` the samples that started
  below its version (published as they are, or requeued), and under in_place the requests
  whose version policy refuses the KV they would keep (re-prefilled instead);
* an engine that swapped the weights but refused the cache flush asked for (SGLang answers
  HTTP 400 ``success: false`` yet serves the new weights, ``/model_info`` keeps the old
  label) has its label repaired with ``/update_weight_version`` (``abort_all_requests:
  false``) and the version's KV counts as kept (``Engine.kv_kept``, as for in_place);
* after every swap the engine's identity is read again while it is still fenced, so the
  health probe does not mistake the swap for a change behind the gateway's back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.engines.client import WeightLoad
from rollout_gateway.engines.identity import EngineIdentity
from rollout_gateway.core.version_policy import ANY
from rollout_gateway.engines.pool import (
    BREAK_KV_POLICY,
    BREAK_STALE_PUBLISH,
    BREAK_STALE_REQUEUE,
    Engine,
    EnginePool,
    EngineState,
    Lease,
)
from rollout_gateway.errors import (
    FailedPrecondition,
    GatewayError,
    InvalidArgument,
    NotFound,
    Timeout,
    Unavailable,
)
from rollout_gateway.registry.base import (
    DISTRIBUTED_SOURCE,
    EngineSwapOutcome,
    SwapRecord,
    SwapStatus,
    VersionRegistry,
    read_swaps,
)
from rollout_gateway.settings import GatewaySettings
from rollout_gateway.swap.manifest import MANIFEST_FILE, Manifest, checksum, read_manifest
from rollout_gateway.swap.models import DiskSource, DistributedSource, SwapRequest

log = logging.getLogger(__name__)

#: the engine's pause_generation mode for each swap mode that pauses (drain does not)
_PAUSE_MODE = {SwapMode.IN_PLACE: "in_place", SwapMode.RETRACT: "retract",
               SwapMode.ABORT_RESUME: "abort"}


#: a retract swap repeats its abort of a routed request that has not ended after this long
_ABORT_REPEAT_S = 0.5


def _manifest(req: SwapRequest) -> Manifest | None:
    """The checkpoint's weights manifest (a disk source with one), else None."""
    return read_manifest(req.source.path) if isinstance(req.source, DiskSource) else None


def effective_mode(e: Engine, mode: SwapMode) -> SwapMode:
    """Engines without weight_versions spans (SGLang < 0.5.21) cannot say where inside a
    request the version changed, so requests must not straddle a swap there: in_place and
    retract become abort_resume (the gateway resubmits prompt + partial output)."""
    if mode in (SwapMode.IN_PLACE, SwapMode.RETRACT) and not e.client.info.has_spans:
        return SwapMode.ABORT_RESUME
    return mode


@dataclass(slots=True)
class RefitTally:
    """What the refits one replica led came to (``/metrics``, ``/v1/lag``)."""

    #: (kind: refit | catch_up, status: succeeded | partial | failed) -> transactions
    transactions: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (engine id, result: verified | kept_version | failed) -> outcomes
    engine_results: dict[tuple[str, str], int] = field(default_factory=dict)
    stale_dropped: int = 0  # requests broken off by drop_stale
    kv_refused: int = 0  # requests broken off before in_place: their policy refuses the KV

    def count(self, kind: str, rec: SwapRecord) -> None:
        key = (kind, rec.status.value)
        self.transactions[key] = self.transactions.get(key, 0) + 1
        for eid, res in rec.results().items():
            k = (eid, res["result"])
            self.engine_results[k] = self.engine_results.get(k, 0) + 1
        self.stale_dropped += sum(o.stale_dropped for o in rec.engines.values())
        self.kv_refused += sum(o.kv_refused for o in rec.engines.values())


class SwapOrchestrator:
    """One swap at a time per replica; across replicas, the registry's lease decides."""

    def __init__(self, pool: EnginePool, registry: VersionRegistry, settings: GatewaySettings,
                 holder: str = "gateway", oldlogits: Any = None) -> None:
        self.oldlogits = oldlogits  # oldlogits.OldLogitService (scores at swaps) or None
        self.pool = pool
        self.registry = registry
        self.settings = settings
        self.holder = holder
        self._lock = asyncio.Lock()
        self.in_progress: SwapRequest | None = None
        #: called with (engine id, seconds paused) after each engine resumes (metrics)
        self.on_pause_window = None
        self.tally = RefitTally()

    async def current_version(self) -> int:
        return await self.registry.learner_version()

    async def swap(self, req: SwapRequest) -> SwapRecord:
        """Run one swap; returns its record (``status``: succeeded | partial | failed)."""
        if self._lock.locked():
            raise FailedPrecondition("a weight swap is already in progress",
                                     details={"version": self.in_progress.version
                                              if self.in_progress else None})
        async with self._lock:
            self.in_progress = req
            try:
                async with self.registry.swap_lease(self.holder) as lease:
                    return await self._swap(req, lease)
            finally:
                self.in_progress = None

    async def catch_up(self, eng: Engine) -> SwapRecord | None:
        """Bring an engine that (re)joined behind the pool up to the newest version a swap
        delivered from disk, before it serves (its gate stays closed meanwhile). One that
        already reports that version (or a newer one a refit delivered) but whose weights
        the gateway has not verified in its current epoch (it joined, restarted, or changed
        behind the gateway's back) is re-verified against that checkpoint's manifest, and
        the checkpoint is loaded again when its sampled tensors differ. Returns the record,
        or None when there is nothing to do (or nothing on disk to load from)."""
        self.pool.close_gate(eng)
        try:
            records = await self.registry.swaps(50)
            done = [r for r in records if r.checkpoint]
            if not done:
                return None
            target = max(done, key=lambda r: r.version)
            why = f"catch-up of {eng.id}"
            if eng.version is not None and eng.version >= target.version:
                mine = next((r for r in done if r.version == eng.version), None)
                if mine is None or eng.verified_version == eng.version:
                    return None
                differs = await self._reverify(eng, mine.checkpoint)
                if differs is None:
                    return None
                target, why = mine, f"re-verification of {eng.id} failed ({differs}): " \
                                    f"checkpoint loaded again"
            req = SwapRequest(version=target.version, source=DiskSource(path=target.checkpoint),
                              mode=SwapMode.ABORT_RESUME, engines=[eng.id])
            async with self._lock:
                self.in_progress = req
                try:
                    async with self.registry.swap_lease(self.holder):
                        rec = SwapRecord(version=target.version, mode=req.mode,
                                         source=target.source, leader=self.holder,
                                         message=why)
                        rec.engines[eng.id] = EngineSwapOutcome(
                            engine_id=eng.id, version_before=eng.version,
                            version_after=eng.version)
                        await self._swap_group([eng], req, rec, None, _manifest(req))
                        ok = rec.engines[eng.id].ok
                        rec.status = SwapStatus.SUCCEEDED if ok else SwapStatus.FAILED
                        rec.finished_at = time.time()
                        self.tally.count("catch_up", rec)
                        await self.registry.record_swap(rec)
                        return rec
                finally:
                    self.in_progress = None
        finally:
            await self.pool.open_gate(eng)

    async def _reverify(self, eng: Engine, checkpoint: str) -> str | None:
        """Read ``eng``'s sampled tensors back against ``checkpoint``'s manifest: None when
        they match (or nothing can be checked: no manifest, an engine that cannot read
        parameters back), else what differs."""
        try:
            manifest = read_manifest(checkpoint)
        except InvalidArgument:
            manifest = None
        if manifest is None:
            return None
        r = EngineSwapOutcome(engine_id=eng.id)
        await self._verify_tensors(eng, r, manifest)
        if r.error:
            log.warning("engine %s at version %s does not match its checkpoint: %s", eng.id,
                        eng.version, r.error)
            return r.error.removeprefix("verify: ")
        eng.verified_version = eng.version
        return None

    async def swapped_elsewhere(self, eng: Engine, now: EngineIdentity) -> bool:
        """Whether the shared swap history holds a swap of ``eng`` to the version it now
        reports (led by another replica), from the checkpoint it now reports loading (a
        disk refit): its new label is then no change behind the gateway's back."""
        if now.weight_version is None:  # (this replica may have learnt the version already)
            return False
        records = await read_swaps(self.registry, 50, "engine identity")
        # a disk refit moves model_path to its checkpoint: other weights under the label
        # of a refit (someone loaded another path) are a change behind the gateway's back
        return any(r.version == now.weight_version and eng.id in r.engines and (
            now.model_path is None or r.checkpoint is None or r.checkpoint == now.model_path)
            for r in records)

    def _targets(self, req: SwapRequest) -> list[Engine]:
        if req.engines is not None:
            engines = [self.pool.get(e) for e in req.engines]  # NotFound for unknown ids
        else:
            engines = self.pool.list()
        return [e for e in engines if e.routable]

    async def _swap(self, req: SwapRequest, lease: Any) -> SwapRecord:
        if self.oldlogits is not None:
            self.oldlogits.check_swap(req)
        current = await self.registry.learner_version()
        if req.version <= current:
            raise FailedPrecondition(
                f"version {req.version} does not increase the current version {current}",
                details={"current_version": current, "requested_version": req.version})
        source = ""
        if isinstance(req.source, DiskSource):
            source = req.source.path
        elif isinstance(req.source, DistributedSource):
            source = f"{DISTRIBUTED_SOURCE}{req.source.group_name}@" \
                     f"{req.source.master_address}:{req.source.master_port}"
        rec = SwapRecord(version=req.version, mode=req.mode, rolling=req.rolling,
                         source=source, leader=self.holder)
        manifest = _manifest(req)  # read once per refit; malformed: 400 before any pause
        published = False

        async def publish() -> None:
            """The version cut: the learner version is published once, when the first
            engines verified, before any of them resumes at it."""
            nonlocal published
            if not published:
                await self.registry.set_learner_version(req.version)
                published = True

        if req.source is not None:
            targets = self._targets(req)
            if not targets:
                raise Unavailable("no engine in rotation to update" + (
                    f" among {', '.join(req.engines)}" if req.engines else ""))
            for e in targets:
                if e.version is not None and e.version >= req.version:
                    raise FailedPrecondition(
                        f"engine {e.id} already runs version {e.version} >= {req.version}",
                        details={"engine_id": e.id, "engine_version": e.version})
            unexact = [(e.id, e.client.info.in_place_unexact) for e in targets
                       if effective_mode(e, req.mode) is SwapMode.IN_PLACE
                       and e.client.info.in_place_unexact]
            if unexact:
                raise FailedPrecondition(
                    "in_place cannot be stamped exactly on "
                    + "; ".join(f"engine {i}: {why}" for i, why in unexact)
                    + "; use mode=retract (exact under every scheduler)",
                    details={"engines": [i for i, _ in unexact]})
            if req.mode is not SwapMode.DRAIN and not all(
                    e.client.info.has_pause_modes for e in targets):
                raise FailedPrecondition("an engine predates pause modes (SGLang < 0.5.6); use "
                                         "mode=drain")
            for e in targets:
                rec.engines[e.id] = EngineSwapOutcome(engine_id=e.id, version_before=e.version,
                                                      version_after=e.version)
            await self.registry.record_swap(rec)
            groups = [[e] for e in targets] if req.rolling else [targets]
            for g in groups:
                lease.check()
                await self._swap_group(g, req, rec, publish, manifest)
            if not req.rolling and targets:
                rec.paused_at = min((o.paused_at for o in rec.engines.values() if o.paused_at),
                                    default=None)
                rec.resumed_at = max((o.resumed_at for o in rec.engines.values()
                                      if o.resumed_at), default=None)
        oks = [o.ok for o in rec.engines.values()]
        if req.source is None or any(oks):
            await publish()
        rec.status = (SwapStatus.SUCCEEDED if all(oks) else SwapStatus.FAILED if not any(oks)
                      else SwapStatus.PARTIAL)
        kept = [f"{o.engine_id} (still v{o.version_after})" for o in rec.engines.values()
                if not o.ok and o.kept_version]
        out = [o.engine_id for o in rec.engines.values() if not o.ok and not o.kept_version]
        rec.message = (f"{sum(oks)}/{len(oks)} engine(s) now run version {req.version}"
                       + (f"; kept their weights and serve: {', '.join(kept)}" if kept else "")
                       + (f"; out of rotation: {', '.join(out)}" if out else "")
                       + ("" if any(oks) or req.source is None else
                          f"; learner version stays {current}"))
        rec.finished_at = time.time()
        self.tally.count("refit", rec)
        await self.registry.record_swap(rec)
        return rec

    async def _swap_group(self, group: list[Engine], req: SwapRequest, rec: SwapRecord,
                          publish: Callable[[], Awaitable[None]] | None,
                          manifest: Manifest | None) -> None:
        res = {e.id: rec.engines[e.id] for e in group}
        for e in group:
            self.pool.close_gate(e)
        try:
            await asyncio.gather(*(self._fence(e, req, res[e.id]) for e in group))
            if self.oldlogits is not None:  # interruption sync: score the partial rollouts
                outgoing = {res[e.id].version_before for e in group}
                await self.oldlogits.before_load(
                    {e.id for e in group}, outgoing.pop() if len(outgoing) == 1 else None,
                    timeout=min(self.settings.timeouts.control_s, 5.0))
            if isinstance(req.source, DistributedSource):
                await self._load_distributed(group, req, res)
            else:
                await asyncio.gather(*(self._load_disk(e, req, res[e.id]) for e in group))
            await asyncio.gather(*(self._verify(e, req, res[e.id], manifest) for e in group))
            if self.oldlogits is not None and isinstance(req.source, DiskSource):
                try:  # inside the pause window: the scorer follows the pool
                    await self.oldlogits.after_swap(req.version, req.source.path,
                                                    any(r.ok for r in res.values()))
                except GatewayError as exc:  # the fill loads it on demand later
                    log.warning("old-logit scorer did not take version %s: %s", req.version,
                                exc.message)
        finally:
            try:
                await asyncio.gather(*(self._settle(e, req, res[e.id]) for e in group))
                if publish is not None and any(r.ok for r in res.values()):
                    await publish()  # verified engines are at the cut before any resumes
            finally:
                await asyncio.gather(*(self._resume(e, req, res[e.id]) for e in group))

    async def _fence(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome) -> None:
        try:
            if req.mode is SwapMode.DRAIN:
                await self._break_off(e, self._to_break_off(e, req, SwapMode.DRAIN, r))
                try:
                    await asyncio.wait_for(e.idle.wait(), self.settings.timeouts.drain_s)
                except asyncio.TimeoutError as exc:
                    raise Timeout(f"engine {e.id} did not drain within "
                                  f"{self.settings.timeouts.drain_s}s") from exc
                r.paused_at = time.time()
                return
            # record how the version is installed *before* any token can be sampled with it
            mode = effective_mode(e, req.mode)
            if mode is SwapMode.IN_PLACE:
                await self._quiesce(e)
            await self._break_off(e, self._to_break_off(e, req, mode, r))
            e.installed_by[req.version] = mode.transition
            await e.client.pause(_PAUSE_MODE[mode])
            r.paused_at = time.time()
        except GatewayError as exc:
            r.error = f"fence: {exc.message}"

    async def _quiesce(self, e: Engine) -> None:
        """Fenced, wait until every request in flight to ``e`` has streamed a token: none is
        then being prefilled, so the batch SGLang's overlap scheduler holds in flight at the
        pause is a decode batch of all of them, and each request's labels run exactly
        ``label_lag`` tokens ahead of the weights (core.stamping)."""
        limit = self.settings.timeouts.quiesce_s
        try:
            await asyncio.wait_for(e.all_started.wait(), limit)
        except asyncio.TimeoutError as exc:
            raise Timeout(f"engine {e.id} did not quiesce within {limit}s: {e.unstarted} "
                          f"request(s) in flight had not streamed a token (an in-place pause "
                          f"now could not tell which weights computed them; "
                          f"ROLLOUT_GATEWAY_TIMEOUTS__QUIESCE_S)") from exc

    @staticmethod
    def _to_break_off(e: Engine, req: SwapRequest, mode: SwapMode,
                      r: EngineSwapOutcome) -> list[Lease]:
        """The requests in flight to ``e`` this refit breaks off before the pause, each
        marked with why (``Lease.broken_off``; None: it simply resumes), counted in ``r``:

        * ``drop_stale``: a sample that started below ``below_version`` ends (publish) or
          starts again (requeue) instead of resuming on weights it will be judged stale by;
        * retract: a request that asked for routed experts resumes (SGLang would re-prefill
          it under the new weights and return the re-prefill's routing for the tokens
          sampled before the swap);
        * in_place: a request whose version policy does not admit the KV it would keep
          (computed by ``Lease.kv_version``, judged against the version this refit
          publishes) resumes re-prefilled under the new weights instead of being served
          from the old KV: in_place is refused for that request."""
        out: list[Lease] = []
        stale = req.drop_stale
        for x in e.leases:
            if not x.rid:
                continue
            if stale is not None and x.start_version is not None \
                    and x.start_version < stale.below_version:
                x.broken_off = BREAK_STALE_PUBLISH if stale.then == "publish" \
                    else BREAK_STALE_REQUEUE
                r.stale_dropped += 1
            elif mode is SwapMode.RETRACT and x.routed:
                pass
            elif mode is SwapMode.IN_PLACE and x.policy != ANY \
                    and not x.policy.admits(x.kv_version, req.version):
                x.broken_off = BREAK_KV_POLICY
                r.kv_refused += 1
            else:
                continue
            out.append(x)
        return out

    async def _break_off(self, e: Engine, leases: list[Lease]) -> None:
        """Before the pause, abort (by rid) ``leases`` and wait until each has ended; their
        samples resume once the gate opens (or end, as ``Lease.broken_off`` says). The abort
        is repeated until the request ends: one sent before SGLang registered the rid is a
        no-op."""
        if not leases:
            return
        log.info("engine %s: the refit breaks off %d request(s) before its pause (%s)", e.id,
                 len(leases), ", ".join(sorted({x.broken_off or "routed experts"
                                                 for x in leases})))
        limit = self.settings.timeouts.quiesce_s
        deadline = time.monotonic() + limit
        while True:
            left = [x for x in leases if not x.ended.is_set()]
            if not left:
                return
            if time.monotonic() >= deadline:
                raise Timeout(f"engine {e.id}: {len(left)} request(s) broken off by the refit "
                              f"did not end within {limit}s of their abort "
                              f"(ROLLOUT_GATEWAY_TIMEOUTS__QUIESCE_S)")
            await asyncio.gather(*(e.client.abort(x.rid) for x in left))
            waits = [asyncio.ensure_future(x.ended.wait()) for x in left]
            try:
                await asyncio.wait(waits, timeout=min(_ABORT_REPEAT_S,
                                                      max(deadline - time.monotonic(), 0)),
                                   return_when=asyncio.ALL_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()

    async def _load_disk(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome) -> None:
        if r.error:
            return
        assert isinstance(req.source, DiskSource)
        try:
            load = await e.client.update_weights_from_disk(
                req.source.path, req.version,
                flush_cache=effective_mode(e, req.mode) is not SwapMode.IN_PLACE)
            await self._flush_refused(e, req, r, load)
        except GatewayError as exc:
            r.error = f"load: {exc.message}"

    async def _flush_refused(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome,
                             load: WeightLoad) -> None:
        """The weights were swapped but the flush refused: repair the label SGLang left at
        the old version (its scheduler already labels tokens with the new one) and count
        the old KV as kept. A label that cannot be repaired leaves the engine unconfirmed
        (it must not be taken for one that kept its old weights)."""
        if load.cache_flushed:
            return
        r.cache_kept = True
        e.kv_kept.add(req.version)
        log.warning("engine %s swapped to version %s but refused the cache flush (%s); "
                    "repairing its label, old KV counts as kept", e.id, req.version,
                    load.message)
        await e.client.update_weight_version(req.version, abort_all_requests=False)

    async def _load_distributed(self, group: list[Engine], req: SwapRequest,
                                res: dict[str, EngineSwapOutcome]) -> None:
        src = req.source
        assert isinstance(src, DistributedSource)
        offsets = src.rank_offsets or {e.id: i + 1 for i, e in enumerate(self.pool.list())}

        async def one(e: Engine) -> None:
            r = res[e.id]
            if r.error:
                return
            try:
                await e.client.begin_weight_update()
                if src.init_group:
                    if e.id not in offsets:
                        raise NotFound(f"no rank offset for engine {e.id}")
                    await e.client.init_weights_update_group(
                        master_address=src.master_address, master_port=src.master_port,
                        rank_offset=offsets[e.id], world_size=src.world_size,
                        group_name=src.group_name, backend=src.backend)
                load = await e.client.update_weights_from_distributed(
                    names=src.names, dtypes=src.dtypes, shapes=src.shapes,
                    group_name=src.group_name, version=req.version,
                    flush_cache=effective_mode(e, req.mode) is not SwapMode.IN_PLACE)
                await self._flush_refused(e, req, r, load)
            except GatewayError as exc:
                r.error = f"load: {exc.message}"
            finally:
                with contextlib.suppress(GatewayError):
                    await e.client.end_weight_update()

        await asyncio.gather(*(one(e) for e in group))

    async def _verify(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome,
                      manifest: Manifest | None) -> None:
        if r.error:
            await self._check_kept(e, r)
            return
        try:
            got = await e.client.weight_version()
        except GatewayError as exc:
            r.error = f"verify: {exc.message}"
            return
        r.version_after = got
        if got != req.version:
            r.error = f"verify: engine reports version {got}, expected {req.version}"
            return
        if not isinstance(req.source, DiskSource):
            r.verification = "version only: a distributed source has no manifest"
        elif manifest is None:
            r.verification = (f"version only: no {MANIFEST_FILE} beside the checkpoint "
                              "(that the gateway can read)")
        else:
            await self._verify_tensors(e, r, manifest)
            if r.error:
                return
        r.ok = True

    async def _verify_tensors(self, e: Engine, r: EngineSwapOutcome, manifest: Manifest) -> None:
        """Read each sampled tensor back (``/get_weights_by_name``) and compare its checksum
        with the manifest's. An engine that cannot read parameters back (a 4xx answer) is
        verified by version only, and the outcome says so."""
        for name, want in manifest.tensors.items():
            try:
                got = await e.client.weights_by_name(name, manifest.truncate_size)
            except GatewayError as exc:
                status = (exc.details or {}).get("status")
                if isinstance(exc, InvalidArgument) or (
                        isinstance(status, int) and 400 <= status < 500):
                    r.verification = f"version only: the engine cannot read {name} back " \
                                     f"({exc.message})"
                    return
                r.error = f"verify: reading {name} back failed: {exc.message}"
                return
            if checksum(got) != want:
                r.error = f"verify: tensor {name} differs from the checkpoint's manifest"
                return
        r.verification = f"version and {len(manifest.tensors)} sampled tensor(s)"

    async def _check_kept(self, e: Engine, r: EngineSwapOutcome) -> None:
        """After a failed step: does the engine still run the weights it ran before?"""
        if r.cache_kept:  # it swapped them (flush refused), then its label repair failed
            return
        try:
            got = await e.client.weight_version()
        except GatewayError as exc:
            r.error += f"; its version could not be read afterwards: {exc.message}"
            return
        r.version_after = got
        r.kept_version = got == r.version_before

    async def _settle(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome) -> None:
        """Still fenced: record what the engine runs now (or take it out of rotation)."""
        if r.ok or r.kept_version:  # still fenced: the swap is no change behind our back
            await self.pool.reread_identity(e)
        if r.ok:
            # requests sent from now on use the new version's prefix-cache namespace
            # (stamping.kv_namespace): no hit can serve KV the old weights left behind
            e.version = req.version
            e.verified_version = req.version
            with contextlib.suppress(GatewayError):
                await self.registry.set_engine_version(e.id, req.version)
        elif r.kept_version:
            # it answered that it kept its weights: it goes on serving them; its paused
            # requests continue (resume below) and are stamped with the old version
            e.installed_by.pop(req.version, None)
            e.kv_kept.discard(req.version)
            e.last_error = f"swap to version {req.version} failed, serving version " \
                           f"{r.version_after}: {r.error}"
            log.error("engine %s kept version %s: %s", e.id, r.version_after, r.error)
        else:
            # out of rotation first, so rollouts that see their request end fail over
            e.state = EngineState.FAILED_LOAD
            e.last_error = r.error
            e.installed_by.pop(req.version, None)
            e.kv_kept.discard(req.version)
            with contextlib.suppress(GatewayError):
                await e.client.abort(abort_all=True)
            log.error("engine %s failed to take version %s: %s", e.id, req.version, r.error)

    async def _resume(self, e: Engine, req: SwapRequest, r: EngineSwapOutcome) -> None:
        resumed = False
        if req.mode is not SwapMode.DRAIN or not r.ok:
            with contextlib.suppress(GatewayError):
                await e.client.resume()
                resumed = True
        r.resumed_at = time.time()
        if self.on_pause_window is not None and r.paused_at is not None:
            self.on_pause_window(e.id, r.resumed_at - r.paused_at)
        await self.pool.open_gate(e, resumed=resumed)
