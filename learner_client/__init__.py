"""What a learner imports: the gRPC client, tensor assembly, corrections, adapters.

Names are resolved lazily, so ``import learner_client`` stays cheap (no torch, no grpc)
until you touch something that needs them::

    from learner_client import TrajectoryClient, collate, compute_loss
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "AsyncTrajectoryClient": "learner_client.client",
    "TrajectoryClient": "learner_client.client",
    "TlsOptions": "learner_client.client",
    "TrajectoryClientError": "learner_client.errors",
    "Rollout": "learner_client.wire",
    "TrajectoryBatch": "learner_client.batch",
    "collate": "learner_client.batch",
    "LOSSES": "learner_client.corrections",
    "LossInputs": "learner_client.corrections",
    "compute_loss": "learner_client.corrections",
    "StalenessMonitor": "learner_client.staleness_monitor",
    "StalenessMonitorConfig": "learner_client.staleness_monitor",
    "token_logprobs_entropy": "learner_client.logprobs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'learner_client' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
