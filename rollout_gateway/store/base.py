"""The trajectory store interface.

The gateway core only ever calls :meth:`TrajectoryStore.publish` and
:meth:`TrajectoryStore.backlog` (admission control). The learner-facing gRPC
service uses the rest. Implementations: Redis Streams (production) and an
embedded in-process store (one machine). Both have the same semantics:

* idempotent by trajectory_id: publishing an id twice stores it once;
* consumer groups (one per learner job), at-least-once delivery with leases
  that expire and are re-claimed by another consumer;
* nothing is evicted unacknowledged; depth is bounded by configuration and
  publish raises ResourceExhausted past the bound.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from rollout_gateway.core.trajectory import Trajectory


@dataclass(slots=True)
class StoreStats:
    published: int  # distinct trajectories accepted since start (or ever, for Redis)
    duplicates: int  # publishes ignored because the id was already stored
    backlog: int  # stored but not yet acknowledged by every group (max over groups)
    max_backlog: int  # configured bound on backlog


class TrajectoryStore(abc.ABC):
    """Abstract trajectory store. All methods are coroutines."""

    @abc.abstractmethod
    async def publish(self, trajectory: Trajectory) -> bool:
        """Store a finished trajectory. Returns False if the id was already stored
        (duplicate publish; nothing changes). Raises ResourceExhausted when the
        backlog bound is reached and StoreError when the backend fails."""

    @abc.abstractmethod
    async def backlog(self) -> int:
        """Finished-but-unconsumed trajectories (for admission control)."""

    @abc.abstractmethod
    async def stats(self) -> StoreStats:
        """Counters for dashboards."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""
