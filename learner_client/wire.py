"""Decode rollout.v1 deliveries into numpy columns (one frombuffer per column)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from learner_client.errors import DecodeError
from rollout_proto.rollout.v1 import service_pb2, trajectory_pb2

_DTYPES = {"<i4", "<f4", "|u1", "<u2", "<u4", "<i8", "<f8"}


def array(msg: trajectory_pb2.Array, name: str) -> np.ndarray:
    """Read-only numpy view over the message's bytes."""
    if msg.dtype not in _DTYPES:
        raise DecodeError(f"{name}: unsupported dtype {msg.dtype!r}")
    dt = np.dtype(msg.dtype)
    shape = tuple(msg.shape)
    if len(msg.data) != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
        raise DecodeError(f"{name}: {len(msg.data)} bytes do not match {shape} {dt.str}")
    return np.frombuffer(msg.data, dtype=dt).reshape(shape)


@dataclass(slots=True)
class SegmentInfo:
    start: int
    end: int
    policy_version: int
    engine_id: str
    began: str
    ended: str


@dataclass(slots=True)
class Rollout:
    """One delivered trajectory, columnar. ``entry_id`` is the ack/nack handle."""

    entry_id: str
    delivery_count: int
    masked: bool  # delivered under the MASK stale policy: stale tokens get no loss
    trajectory_id: str
    group_id: str
    sample_index: int
    prompt_token_ids: np.ndarray  # int32 [P]
    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T], behavior
    entropy: np.ndarray  # float32 [T]
    policy_version: np.ndarray  # int32 [T]
    kv_version: np.ndarray  # int32 [T]
    old_logprobs: np.ndarray | None
    entropy_kind: str
    entropy_error_bound: float
    routed_experts: np.ndarray | None  # uint [R, L, K], rows = positions start .. start+R-1
    routed_start: int
    num_experts: int
    reward: float | None
    finish_reason: str
    segments: list[SegmentInfo] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    finished_at: float = 0.0

    @property
    def redelivered(self) -> bool:
        return self.delivery_count > 1

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.prompt_token_ids.shape[0]) + self.num_tokens


def decode_delivery(d: service_pb2.Delivery) -> Rollout:
    t = d.trajectory
    if not t.trajectory_id:
        raise DecodeError("delivery without a trajectory id")
    re = t.routed_experts if t.HasField("routed_experts") else None
    out = Rollout(
        entry_id=d.entry_id, delivery_count=d.delivery_count, masked=d.masked,
        trajectory_id=t.trajectory_id, group_id=t.group_id, sample_index=t.sample_index,
        prompt_token_ids=array(t.prompt_token_ids, "prompt_token_ids"),
        token_ids=array(t.token_ids, "token_ids"), logprobs=array(t.logprobs, "logprobs"),
        entropy=array(t.entropy, "entropy"),
        policy_version=array(t.policy_version, "policy_version"),
        kv_version=array(t.kv_version, "kv_version"),
        old_logprobs=array(t.old_logprobs, "old_logprobs") if t.HasField("old_logprobs") else None,
        entropy_kind=t.entropy_kind, entropy_error_bound=t.entropy_error_bound,
        routed_experts=array(re.data, "routed_experts") if re is not None else None,
        routed_start=re.start if re is not None else 0,
        num_experts=re.num_experts if re is not None else 0,
        reward=t.reward if t.HasField("reward") else None,
        finish_reason=t.finish_reason.type,
        segments=[SegmentInfo(s.start, s.end, s.policy_version, s.engine_id, s.began, s.ended)
                  for s in t.segments],
        metadata=dict(t.metadata), created_at=t.created_at, finished_at=t.finished_at,
    )
    n = out.num_tokens
    for name in ("logprobs", "entropy", "policy_version", "kv_version"):
        if getattr(out, name).shape != (n,):
            raise DecodeError(f"{name} has shape {getattr(out, name).shape}, expected ({n},)")
    if out.routed_experts is not None and out.routed_experts.ndim != 3:
        raise DecodeError("routed_experts must be [R, L, K]")
    return out
