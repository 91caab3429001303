"""Per-answer vetting: an engine answer is stamped only if it came from the engine the
request was sent to.

The pool registers an engine again when its identity changed behind the gateway's back
(engines.pool: a restart on the same URL, other weights or label) and bumps its
registration epoch. Between that change and the health probe that notices it, answers
may still arrive; each is vetted cheaply, with nothing but what the gateway holds:

* the engine's epoch now must be the epoch the request was sent in;
* every version label in the answer (``meta_info.weight_version`` of each chunk, the
  final ``weight_versions`` spans) must be the version the request was sent under, or a
  newer one a swap of this epoch installed under it (``Engine.installed_by``; a version
  another replica's swap installed is learnt from the shared swap history first).

Otherwise :class:`~rollout_gateway.errors.EngineChanged`: the answer is not stamped and
the sample resumes elsewhere from the output it had, as after an engine failure. Chunks
are checked as they arrive, so a stream keeps what arrived before the first foreign one;
a live client that already received some of the request's tokens gets the error instead
(the sample cannot resume behind tokens it was sent).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from rollout_gateway.core.stamping import foreign_label
from rollout_gateway.engines.decode import Decoded
from rollout_gateway.engines.pool import Engine
from rollout_gateway.errors import EngineChanged


class Vetting:
    """One engine request's vetting. ``learn(eng, versions)`` reads how versions this
    replica did not install were installed (the swap history), or None."""

    def __init__(self, eng: Engine,
                 learn: Callable[[Engine, set[int]], Awaitable[None]] | None = None) -> None:
        self.eng = eng
        self.epoch = eng.epoch
        self.version = eng.version
        self.learn = learn
        self.delivered = 0  # tokens of this request a live client has received

    def _changed(self, labels: list[int], *, epoch: bool = True) -> EngineChanged | None:
        eng = self.eng
        details = {"engine_id": eng.id, "sent_epoch": self.epoch,
                   "sent_version": self.version}
        if epoch and eng.epoch != self.epoch:
            return EngineChanged(f"engine {eng.id} was registered again (epoch {self.epoch} "
                                 f"-> {eng.epoch}) while the request ran", details=details)
        bad = foreign_label(labels, self.version, eng.installed_by)
        if bad is not None:
            return EngineChanged(f"engine {eng.id} answered with version {bad}, neither the "
                                 f"version {self.version} the request was sent under nor one "
                                 f"a swap installed: it changed behind the gateway",
                                 details=details)
        return None

    async def _learn(self, labels: list[int]) -> None:
        v0 = self.version
        unknown = {v for v in labels
                   if v0 is not None and v > v0 and v not in self.eng.installed_by}
        if unknown and self.learn is not None:
            await self.learn(self.eng, unknown)

    async def chunk(self, label: int | None) -> None:
        """A streamed chunk arrived (``label``: its version label, None when the chunk is
        not decoded yet): raise EngineChanged if it is not the engine's."""
        labels = [] if label is None else [label]
        await self._learn(labels)
        changed = self._changed(labels)
        if changed is not None:
            raise changed

    async def answer(self, dec: Decoded, *, epoch: bool = True) -> EngineChanged | None:
        """``dec`` (a whole answer, or with ``epoch`` False the output that arrived before a
        failure, its chunks checked on arrival): the error if it is not the engine's (raised
        at once when a live client already has some of the request's tokens), else None."""
        labels = [v for v, _, _ in dec.spans] or (
            [dec.weight_version] if dec.weight_version is not None else [])
        await self._learn(labels)
        changed = self._changed(labels, epoch=epoch)
        if changed is not None and self.delivered:
            raise changed
        return changed
