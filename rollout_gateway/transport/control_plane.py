"""The control plane the gRPC service talks to for versions and hot-swaps.

The gateway provides the implementation (version registry + hot-swap orchestrator,
``swap/learner_control.py``); tests use an in-memory double (``tests/doubles``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from rollout_gateway.core.staleness import lag
from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.wire_enum import WireEnum
from rollout_gateway.errors import InvalidArgument


class WeightSourceKind(WireEnum):
    """``rollout.v1.WeightSource.kind``: where the learner published the weights."""

    PATH = "path"  # a checkpoint directory the engines can read (HTTP's "disk" source)
    TENSOR_BUCKET = "tensor_bucket"
    DISTRIBUTED = "distributed"  # a torch.distributed broadcast from the learner


@dataclass(slots=True)
class WeightSource:
    kind: WeightSourceKind
    uri: str
    options: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class EngineVersion:
    engine_id: str
    version: int
    healthy: bool = True


@dataclass(slots=True)
class ControlStatus:
    learner_version: int
    engines: list[EngineVersion]
    swap_in_progress: bool = False

    @property
    def max_engine_lag(self) -> int:
        if not self.engines:
            return 0
        return max(lag(self.learner_version, e.version) for e in self.engines)


@dataclass(slots=True)
class AnnounceResult:
    accepted: bool
    version: int
    message: str = ""
    pause_seconds: float = 0.0


@dataclass(slots=True)
class VersionEvent:
    version: int
    kind: str  # announced | engine_updated | swap_done | swap_failed
    engine_id: str = ""
    at: float = field(default_factory=time.time)
    message: str = ""


@runtime_checkable
class ControlPlane(Protocol):
    async def status(self) -> ControlStatus:
        """Learner version, engine versions, whether a swap is running."""
        ...

    async def announce(self, version: int, source: WeightSource, mode: SwapMode,
                       rolling: bool = False) -> AnnounceResult:
        """The learner published weights ``version``; swap engines to it. Raises
        InvalidArgument for a bad version or source, FailedPrecondition for a version that
        does not move forward or while another swap runs."""
        ...

    def watch(self) -> AsyncIterator[VersionEvent]:
        """Version changes from now on, until the caller stops iterating."""
        ...


def validate_announce(version: int, source: WeightSource) -> None:
    if not 0 <= version <= 2**31 - 1:  # token stamps are int32
        raise InvalidArgument(f"version must be in [0, 2**31 - 1], got {version}")
    if not source.uri:
        raise InvalidArgument("weight source uri must be non-empty")
