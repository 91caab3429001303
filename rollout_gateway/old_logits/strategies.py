"""The gateway's exact old-logit strategies: ``model`` (a dedicated scorer scores each
finished trajectory under each token's version) and ``interruption`` (partial rollouts are
scored at each swap under the outgoing version, before the new weights load; the tail at
finish under the current one). Hooks: ``RolloutService`` calls ``fill`` before judging and
publishing; ``SampleRunner`` calls ``track``/``untrack``/``busy``; ``SwapOrchestrator``
calls ``check_swap``, ``before_load`` and ``after_swap``."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.errors import FailedPrecondition, GatewayError
from rollout_gateway.registry.base import read_swaps
from rollout_gateway.settings import GatewaySettings, OldLogitsMode

from .scorer import OldLogitScorer

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """A sample in flight: what the swap hook needs to score its partial output."""

    state: Any  # rollouts.sample.SampleState
    temperature: float
    busy_engine: str | None = None  # engine of the request in progress (None: between calls)
    scored: list[np.ndarray] = field(default_factory=list)  # old logprobs of tokens [0, n)

    @property
    def n_scored(self) -> int:
        return sum(int(a.shape[0]) for a in self.scored)


class OldLogitService:
    def __init__(self, settings: GatewaySettings, registry: Any = None) -> None:
        self.registry = registry  # swap history: checkpoints of versions other replicas led
        self.cfg = settings.old_logits
        self.mode = self.cfg.mode
        self.scorer = OldLogitScorer(self.cfg, settings.timeouts)
        self.live: dict[str, _Live] = {}
        self._settled = asyncio.Condition()
        self.counters = {"trajectories_filled": 0, "tokens_filled": 0, "tokens_at_swaps": 0,
                         "swaps_scored": 0, "fill_failed": 0, "late_at_swaps": 0,
                         "fill_seconds": 0.0, "swap_scoring_seconds": 0.0}

    async def start(self) -> None:
        await self.scorer.start()
        log.info("old logits: mode=%s, scorer at version %s", self.mode, self.scorer.version)

    async def close(self) -> None:
        await self.scorer.close()

    def metrics(self) -> dict[str, Any]:
        return {"mode": self.mode, "scorer_version": self.scorer.version,
                **self.counters, **{f"scorer_{k}": v for k, v in self.scorer.counters.items()}}

    # ---- sample hooks (interruption mode keeps partial scores per sample) -------------
    def track(self, state: Any, temperature: float) -> None:
        if self.mode is OldLogitsMode.INTERRUPTION:
            self.live[state.trajectory_id] = _Live(state, temperature)

    def untrack(self, trajectory_id: str) -> _Live | None:
        return self.live.pop(trajectory_id, None)

    async def busy(self, trajectory_id: str, engine_id: str | None) -> None:
        """The sample enters (engine id) or leaves (None) an engine call; leaving means its
        partial output is in its state."""
        live = self.live.get(trajectory_id)
        if live is None:
            return
        live.busy_engine = engine_id
        if engine_id is None:
            async with self._settled:
                self._settled.notify_all()

    # ---- swap hooks ---------------------------------------------------------------------
    def check_swap(self, req: Any) -> None:
        """Refuse what the strategy cannot follow (before anything is paused)."""
        if self.mode is OldLogitsMode.OFF or req.source is None:
            return
        from rollout_gateway.swap.models import DiskSource

        if not isinstance(req.source, DiskSource):
            raise FailedPrecondition(
                f"old_logits.mode={self.mode} needs disk sources: the scorer reloads "
                "checkpoints by path (a distributed broadcast cannot be replayed)")
        if self.mode is OldLogitsMode.INTERRUPTION:
            if req.mode not in (SwapMode.ABORT_RESUME, SwapMode.DRAIN):
                raise FailedPrecondition(
                    "old_logits.mode=interruption needs swap mode abort_resume or drain: "
                    "in_place/retract requests straddle the swap inside the engine, so their "
                    "partial output cannot be scored before the weights change")
            if req.rolling:
                raise FailedPrecondition("old_logits.mode=interruption does not support "
                                         "rolling swaps (engines would mix versions)")

    async def before_load(self, engine_ids: set[str], outgoing: int | None,
                          timeout: float) -> None:
        """Interruption sync: after the fence (requests aborted), wait until every sample
        that was on these engines has its partial output, then score the unscored tokens
        under the outgoing version (the scorer holds it) before the new weights load."""
        if self.mode is not OldLogitsMode.INTERRUPTION:
            return
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        async with self._settled:
            while any(lv.busy_engine in engine_ids for lv in self.live.values()):
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    await asyncio.wait_for(self._settled.wait(), left)
                except asyncio.TimeoutError:
                    break
        late = [lv for lv in self.live.values() if lv.busy_engine in engine_ids]
        if late:  # a request sent after the pause waits in the engine with no output; one
            # whose aborted response is still on its way: its last piece is scored at
            # finish under its own version (exact, one more weight load)
            self.counters["late_at_swaps"] += len(late)
            log.warning("interruption sync: %d sample(s) still in an engine call after %.1fs",
                        len(late), timeout)
        async with self.scorer.lock:
            if outgoing is not None and self.scorer.version != outgoing:
                try:
                    await self.scorer.ensure(outgoing)
                except GatewayError as exc:
                    log.warning("interruption sync: scorer cannot load version %s: %s",
                                outgoing, exc.message)
            for lv in list(self.live.values()):
                # the pieces in a state are complete engine requests: score them all
                try:
                    await self._score_partial(lv)
                except GatewayError as exc:  # left for the finish-time fill
                    log.warning("interruption sync: scoring %s failed: %s",
                                lv.state.trajectory_id, exc.message)
        self.counters["swaps_scored"] += 1
        self.counters["swap_scoring_seconds"] += time.perf_counter() - t0

    async def _score_partial(self, lv: _Live) -> None:
        st = lv.state
        out = st.output_ids()
        done = lv.n_scored
        if st.prompt_ids is None or out.shape[0] <= done:
            return
        pv = np.concatenate([p.cols.policy_version for p in st.pieces])[done:]
        if np.any(pv != self.scorer.version):
            # tokens of another version (a failover to a lagging engine): the finish-time
            # fill scores them under their own version
            return
        vals = await self.scorer.score(st.prompt_ids, out, lv.temperature)
        lv.scored.append(vals[done:])
        self.counters["tokens_at_swaps"] += int(out.shape[0] - done)

    async def after_swap(self, version: int, source: str | None, ok: bool) -> None:
        """Record the new version's checkpoint; interruption mode moves the scorer now
        (inside the pause window), model mode loads lazily when a token needs it."""
        if self.mode is OldLogitsMode.OFF or not source:
            return
        self.scorer.add_source(version, source)
        if self.mode is OldLogitsMode.INTERRUPTION and ok:
            async with self.scorer.lock:
                await self.scorer.ensure(version)

    async def _learn_sources(self) -> None:
        """Checkpoints of swaps another replica led (shared registry's swap history)."""
        if self.registry is None:
            return
        for r in await read_swaps(self.registry, 100, "old logits"):
            if r.checkpoint:
                self.scorer.sources.setdefault(int(r.version), r.checkpoint)

    # ---- finish: fill the column before judge/publish -----------------------------------
    async def fill(self, traj: Trajectory, temperature: float) -> None:
        """Fill ``traj.tokens.old_logprobs`` (every token, exact under its version). On
        failure the trajectory is delivered without the column, marked
        ``metadata["old_logits_error"]`` and counted (``fill_failed``) - never a silent gap."""
        if self.mode is OldLogitsMode.OFF:
            return
        live = self.untrack(traj.trajectory_id)
        n = traj.num_tokens
        t0 = time.perf_counter()
        old = np.full(n, np.nan, np.float32)
        if live is not None and live.scored:
            pre = np.concatenate(live.scored)[:n]
            old[:pre.shape[0]] = pre
        try:
            todo = np.isnan(old)
            if todo.any():
                pv = traj.tokens.policy_version
                async with self.scorer.lock:
                    # the loaded version first: no weight load when it is the one needed
                    vs = sorted(set(pv[todo].tolist()),
                                key=lambda v: (v != self.scorer.version, v))
                    for v in vs:
                        if int(v) not in self.scorer.sources and v != self.scorer.version:
                            await self._learn_sources()
                        await self.scorer.ensure(int(v))
                        vals = await self.scorer.score(traj.prompt_token_ids,
                                                       traj.tokens.token_ids, temperature)
                        sel = todo & (pv == v)
                        old[sel] = vals[sel]
            traj.tokens.old_logprobs = old
            self.counters["trajectories_filled"] += 1
            self.counters["tokens_filled"] += n
        except GatewayError as exc:
            self.counters["fill_failed"] += 1
            traj.metadata["old_logits_error"] = f"{exc.code.value}: {exc.message}"[:300]
            log.error("old logits for %s: %s", traj.trajectory_id, exc.message)
        finally:
            self.counters["fill_seconds"] += time.perf_counter() - t0
