"""The version policy: which engines' weight versions may serve one request.

Parsed once at the edge (the ``version_policy`` setting, the ``x-version-policy`` header,
the ``version_policy`` body field of ``/v1/rollouts`` and ``/generate``) into a
:class:`VersionPolicy`; routing asks :meth:`VersionPolicy.admits` of each engine. Words:

* ``any``: every engine (also one whose version is unknown);
* ``latest``: engines at the learner's version or newer (lag <= 0);
* ``min_version:<v>``: engines at version ``v`` or newer;
* ``max_staleness:<k>``: engines whose lag (``core.staleness``: learner version - engine
  version) is at most ``k`` (inclusive, as ``admission.max_staleness``).

Under every policy but ``any``, an engine whose version is unknown does not qualify.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rollout_gateway.core.staleness import lag
from rollout_gateway.core.wire_enum import WireEnum
from rollout_gateway.errors import InvalidArgument

#: largest bound accepted (a version / lag beyond any real job; fits int32 like versions)
MAX_BOUND = (1 << 31) - 1
_FORM = re.compile(r"([a-z_]+)(?::(\d{1,10}))?")


class PolicyKind(WireEnum):
    ANY = "any"
    LATEST = "latest"
    MIN_VERSION = "min_version"
    MAX_STALENESS = "max_staleness"


_BOUNDED = (PolicyKind.MIN_VERSION, PolicyKind.MAX_STALENESS)


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    kind: PolicyKind = PolicyKind.ANY
    bound: int | None = None  # min_version's v, max_staleness's k

    @classmethod
    def parse(cls, text: object) -> VersionPolicy:
        """``any`` | ``latest`` | ``min_version:<v>`` | ``max_staleness:<k>``; anything else
        raises InvalidArgument naming the forms."""
        m = _FORM.fullmatch(text.strip()) if isinstance(text, str) else None
        kind = next((k for k in PolicyKind if m and k.value == m.group(1)), None)
        bound = int(m.group(2)) if m and m.group(2) is not None else None
        if kind is None or (kind in _BOUNDED) != (bound is not None) or (
                bound is not None and bound > MAX_BOUND):
            shown = text[:80] if isinstance(text, str) else type(text).__name__
            raise InvalidArgument(
                f"version policy must be any, latest, min_version:<v> or max_staleness:<k> "
                f"(v, k: integers 0..{MAX_BOUND}), got {shown!r}")
        return cls(kind, bound)

    @property
    def needs_learner(self) -> bool:
        """Whether :meth:`admits` reads the learner version."""
        return self.kind in (PolicyKind.LATEST, PolicyKind.MAX_STALENESS)

    def admits(self, version: int | None, learner_version: int) -> bool:
        """Whether an engine at ``version`` (None: unknown) may serve the request."""
        if self.kind is PolicyKind.ANY:
            return True
        if version is None:
            return False
        if self.kind is PolicyKind.MIN_VERSION:
            return version >= self.bound
        allowed = 0 if self.kind is PolicyKind.LATEST else self.bound
        return lag(learner_version, version) <= allowed

    def __str__(self) -> str:
        return self.kind.value if self.bound is None else f"{self.kind.value}:{self.bound}"


ANY = VersionPolicy()
