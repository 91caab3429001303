"""Trajectory <-> rollout.v1.Trajectory protobuf.

Per-token columns travel as packed little-endian bytes with dtype and shape; encoding
is one ``tobytes`` per column, decoding one ``np.frombuffer`` per column.
"""

from __future__ import annotations

import numpy as np
from google.protobuf.message import DecodeError

from rollout_gateway.core.trajectory import (
    EntropyKind,
    FinishReason,
    RoutedExperts,
    Segment,
    TokenColumns,
    Trajectory,
    Transition,
    Turn,
)
from rollout_gateway.errors import InvalidArgument
from rollout_proto.rollout.v1 import trajectory_pb2 as pb

_ALLOWED_DTYPES = {"<i4", "<f4", "|u1", "<u2", "<u4", "<i8", "<f8", "<u1"}


def array_to_pb(arr: np.ndarray, out: pb.Array) -> None:
    """Fill ``out`` with a little-endian, C-contiguous copy of ``arr``."""
    dt = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
    arr = np.ascontiguousarray(arr, dtype=dt)
    out.dtype = arr.dtype.str
    out.shape[:] = arr.shape
    out.data = arr.tobytes()


def array_from_pb(msg: pb.Array, name: str) -> np.ndarray:
    """Decode an Array (read-only view over the message bytes); InvalidArgument if malformed."""
    if msg.dtype not in _ALLOWED_DTYPES:
        raise InvalidArgument(f"{name}: unsupported dtype {msg.dtype!r}")
    dt = np.dtype(msg.dtype)
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidArgument(f"{name}: negative shape {shape}")
    want = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if len(msg.data) != want:
        raise InvalidArgument(f"{name}: {len(msg.data)} bytes for shape {shape} dtype {dt.str}")
    return np.frombuffer(msg.data, dtype=dt).reshape(shape)


def to_pb(traj: Trajectory) -> pb.Trajectory:
    msg = pb.Trajectory(
        trajectory_id=traj.trajectory_id,
        group_id=traj.group_id,
        sample_index=traj.sample_index,
        entropy_kind=traj.entropy_kind.value,
        entropy_error_bound=traj.entropy_error_bound,
        created_at=traj.created_at,
        finished_at=traj.finished_at,
    )
    cols = traj.tokens
    array_to_pb(traj.prompt_token_ids, msg.prompt_token_ids)
    array_to_pb(cols.token_ids, msg.token_ids)
    array_to_pb(cols.logprobs, msg.logprobs)
    array_to_pb(cols.entropy, msg.entropy)
    array_to_pb(cols.policy_version, msg.policy_version)
    array_to_pb(cols.kv_version, msg.kv_version)
    if cols.old_logprobs is not None:
        array_to_pb(cols.old_logprobs, msg.old_logprobs)
    if traj.routed_experts is not None:
        re = traj.routed_experts
        array_to_pb(re.data, msg.routed_experts.data)
        msg.routed_experts.num_experts = re.num_experts
        msg.routed_experts.start = re.start
    fr = traj.finish_reason
    msg.finish_reason.type = fr.type
    if isinstance(fr.matched, bool) or fr.matched is None:
        pass
    elif isinstance(fr.matched, int):
        msg.finish_reason.matched_token = fr.matched
    else:
        msg.finish_reason.matched_text = str(fr.matched)
    if fr.length is not None:
        msg.finish_reason.length = fr.length
    if fr.message is not None:
        msg.finish_reason.message = fr.message
    for s in traj.segments:
        msg.segments.add(start=s.start, end=s.end, policy_version=s.policy_version,
                         engine_id=s.engine_id, began=s.began.value, ended=s.ended.value,
                         started_at=s.started_at, ended_at=s.ended_at)
    for k, v in traj.metadata.items():
        msg.metadata[str(k)] = str(v)
    if traj.reward is not None:
        msg.reward = float(traj.reward)
    _session_to_pb(traj, msg)
    return msg


# ---- agent sessions: loss mask and turns (fields 24, 25) ----

def _session_to_pb(traj: Trajectory, msg: pb.Trajectory) -> None:
    if traj.loss_mask is not None:
        array_to_pb(traj.loss_mask, msg.loss_mask)
    for t in traj.turns:
        msg.turns.add(start=t.start, end=t.end, kind=t.kind, index=t.index)


def _session_from_pb(msg: pb.Trajectory) -> dict:
    mask = array_from_pb(msg.loss_mask, "loss_mask") if msg.HasField("loss_mask") else None
    if mask is not None and mask.dtype != np.uint8:
        raise InvalidArgument(f"loss_mask must be |u1, got {mask.dtype.str}")
    return {"loss_mask": mask,
            "turns": [Turn(start=t.start, end=t.end, kind=t.kind, index=t.index)
                      for t in msg.turns]}


def encode(traj: Trajectory) -> bytes:
    """Serialized rollout.v1.Trajectory: what the store keeps and the wire carries."""
    return to_pb(traj).SerializeToString()


def _enum(cls, value: str, name: str):
    try:
        return cls(value)
    except ValueError:
        raise InvalidArgument(f"{name}: unknown value {value!r}") from None


def from_pb(msg: pb.Trajectory) -> Trajectory:
    """Decode and validate; raises InvalidArgument on anything malformed."""
    if not msg.HasField("token_ids"):
        raise InvalidArgument("trajectory has no token_ids column")
    old = array_from_pb(msg.old_logprobs, "old_logprobs") if msg.HasField("old_logprobs") else None
    cols = TokenColumns(
        token_ids=array_from_pb(msg.token_ids, "token_ids"),
        logprobs=array_from_pb(msg.logprobs, "logprobs"),
        entropy=array_from_pb(msg.entropy, "entropy"),
        policy_version=array_from_pb(msg.policy_version, "policy_version"),
        kv_version=array_from_pb(msg.kv_version, "kv_version"),
        old_logprobs=old,
    )
    routed = None
    if msg.HasField("routed_experts"):
        re = msg.routed_experts
        routed = RoutedExperts(data=array_from_pb(re.data, "routed_experts"),
                               num_experts=re.num_experts, start=re.start)
    fr = msg.finish_reason
    which = fr.WhichOneof("matched")
    finish = FinishReason(
        type=fr.type or "abort",
        matched=getattr(fr, which) if which else None,
        length=fr.length if fr.HasField("length") else None,
        message=fr.message if fr.HasField("message") else None,
    )
    segments = [
        Segment(start=s.start, end=s.end, policy_version=s.policy_version, engine_id=s.engine_id,
                began=_enum(Transition, s.began or "start", "segment.began"),
                ended=_enum(Transition, s.ended or "finished", "segment.ended"),
                started_at=s.started_at, ended_at=s.ended_at)
        for s in msg.segments
    ]
    return Trajectory(
        trajectory_id=msg.trajectory_id,
        prompt_token_ids=array_from_pb(msg.prompt_token_ids, "prompt_token_ids"),
        tokens=cols,
        finish_reason=finish,
        segments=segments,
        group_id=msg.group_id,
        sample_index=msg.sample_index,
        entropy_kind=_enum(EntropyKind, msg.entropy_kind or "exact", "entropy_kind"),
        entropy_error_bound=msg.entropy_error_bound,
        routed_experts=routed,
        created_at=msg.created_at,
        finished_at=msg.finished_at,
        metadata=dict(msg.metadata),
        reward=msg.reward if msg.HasField("reward") else None,
        **_session_from_pb(msg),
    )


def decode(data: bytes) -> Trajectory:
    try:
        msg = pb.Trajectory.FromString(data)
    except DecodeError as exc:
        raise InvalidArgument(f"not a serialized rollout.v1.Trajectory: {exc}") from None
    return from_pb(msg)
