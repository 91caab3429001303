"""Synthetic trajectories for the transport's tests and benchmark (deterministic)."""

from __future__ import annotations

import numpy as np

from rollout_gateway.core.trajectory import (
    FinishReason,
    RoutedExperts,
    Segment,
    TokenColumns,
    Trajectory,
    Transition,
)


def make_trajectory(tid: str, *, num_tokens: int = 16, prompt_len: int = 8,
                    versions: tuple[int, ...] = (0,), num_layers: int = 0, top_k: int = 8,
                    num_experts: int = 64, seed: int = 0, group_id: str = "g",
                    sample_index: int = 0, reward: float | None = 1.0,
                    old_logprobs: bool = False) -> Trajectory:
    """A trajectory whose output is split into len(versions) segments, one per version
    (ascending), with routed experts [P + T - 1, num_layers, top_k] when num_layers > 0."""
    rng = np.random.default_rng(seed)
    bounds = np.linspace(0, num_tokens, len(versions) + 1).astype(int)
    pv = np.zeros(num_tokens, np.int32)
    segments = []
    for i, v in enumerate(versions):
        a, b = int(bounds[i]), int(bounds[i + 1])
        pv[a:b] = v
        segments.append(Segment(a, b, v, "engine-0",
                                began=Transition.START if i == 0 else Transition.IN_PLACE,
                                ended=(Transition.FINISHED if i == len(versions) - 1
                                       else Transition.IN_PLACE)))
    kv = np.full_like(pv, pv.min()) if num_tokens else pv
    cols = TokenColumns(
        token_ids=rng.integers(0, 32000, num_tokens),
        logprobs=-rng.random(num_tokens, dtype=np.float32),
        entropy=rng.random(num_tokens, dtype=np.float32),
        policy_version=pv, kv_version=kv,
        old_logprobs=-rng.random(num_tokens, dtype=np.float32) if old_logprobs else None,
    )
    routed = None
    if num_layers:
        rows = prompt_len + num_tokens - 1
        routed = RoutedExperts(rng.integers(0, num_experts, (rows, num_layers, top_k)),
                               num_experts=num_experts)
    return Trajectory(
        trajectory_id=tid, prompt_token_ids=rng.integers(0, 32000, prompt_len),
        tokens=cols, finish_reason=FinishReason("length", length=num_tokens),
        segments=segments, group_id=group_id, sample_index=sample_index,
        routed_experts=routed, metadata={"source": "synthetic"}, reward=reward,
        finished_at=1.0,
    )
