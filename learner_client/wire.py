"""Decode rollout.v1 deliveries into numpy columns (one frombuffer per column)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
class TurnInfo:
    """One turn of an agent session: output tokens [start, end); kind model | context."""

    start: int
    end: int
    kind: str
    index: int


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
    #: agent sessions: uint8 [T], 1 where the model sampled the token, 0 for context it
    #: only read (template, user/tool messages); None = every output token is the model's
    loss_mask: np.ndarray | None = None
    turns: list[TurnInfo] = field(default_factory=list)  # agent sessions; [] = one turn

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
        **_session_fields(t, array(t.loss_mask, "loss_mask") if t.HasField("loss_mask") else None),
    )
    _check(out)
    return out


# ---- fast path: parse a serialized Batch without copying the column bytes ----------------
#
# Columns become numpy views straight into the received message (np.frombuffer with an
# offset); only the small fields (ids, segments, metadata, ...) go through protobuf.

_ARRAY_FIELDS = {4: "prompt_token_ids", 5: "token_ids", 6: "logprobs", 7: "entropy",
                 10: "policy_version", 11: "kv_version", 12: "old_logprobs",
                 24: "loss_mask"}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    b = buf[i]
    if b < 0x80:
        return b, i + 1
    result, shift = b & 0x7F, 7
    i += 1
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise DecodeError("malformed varint")


def _fields(buf: bytes, i: int, end: int):
    """(field number, wire type, value, start of the field's key, end of the field); value
    is an int (varint) or (start, end) of the payload."""
    while i < end:
        first = i
        key, i = _varint(buf, i)
        wt = key & 7
        if wt == 2:
            ln, i = _varint(buf, i)
            stop = i + ln
            if stop > end:
                raise DecodeError("length-delimited field runs past its message")
            yield key >> 3, 2, (i, stop), first, stop
            i = stop
        elif wt == 0:
            v, i = _varint(buf, i)
            yield key >> 3, 0, v, first, i
        elif wt == 1:
            yield key >> 3, 1, (i, i + 8), first, i + 8
            i += 8
        elif wt == 5:
            yield key >> 3, 5, (i, i + 4), first, i + 4
            i += 4
        else:
            raise DecodeError(f"unsupported wire type {wt}")
    if i != end:
        raise DecodeError("truncated message")


def _array_view(buf: bytes, start: int, end: int, name: str) -> np.ndarray:
    # inlined field walk (this runs ~7x per trajectory): Array {dtype=1, shape=2, data=3}
    dtype, shape, d0, d1 = "", [], start, start
    i = start
    while i < end:
        key = buf[i]
        i += 1
        if key >= 0x80:
            key, i = _varint(buf, i - 1)
        wt, fno = key & 7, key >> 3
        if wt == 2:
            ln = buf[i]
            i += 1
            if ln >= 0x80:
                ln, i = _varint(buf, i - 1)
            stop = i + ln
            if stop > end:
                raise DecodeError("length-delimited field runs past its message")
            if fno == 3:
                d0, d1 = i, stop
            elif fno == 1:
                dtype = buf[i:stop].decode()
            elif fno == 2:
                while i < stop:
                    d, i = _varint(buf, i)
                    shape.append(d)
            i = stop
        elif wt == 0:
            v, i = _varint(buf, i)
            if fno == 2:
                shape.append(v)
        elif wt == 1:
            i += 8
        elif wt == 5:
            i += 4
        else:
            raise DecodeError(f"unsupported wire type {wt}")
    if i != end:
        raise DecodeError("truncated message")
    if dtype not in _DTYPES:
        raise DecodeError(f"{name}: unsupported dtype {dtype!r}")
    dt = np.dtype(dtype)
    count = math.prod(shape)
    if d1 - d0 != count * dt.itemsize:
        raise DecodeError(f"{name}: {d1 - d0} bytes do not match {shape} {dt.str}")
    return np.frombuffer(buf, dtype=dt, count=count, offset=d0).reshape(shape)


def _parse_trajectory(buf: bytes, start: int, end: int) -> tuple[dict, trajectory_pb2.Trajectory]:
    cols: dict[str, Any] = {}
    small: list[bytes] = []
    for fno, wt, v, first, stop in _fields(buf, start, end):
        name = _ARRAY_FIELDS.get(fno)
        if name is not None and wt == 2:
            cols[name] = _array_view(buf, v[0], v[1], name)
        elif fno == 13 and wt == 2:  # RoutedExperts {data=1, num_experts=2, start=3}
            for f2, w2, v2, _, _ in _fields(buf, v[0], v[1]):
                if f2 == 1 and w2 == 2:
                    cols["routed_experts"] = _array_view(buf, v2[0], v2[1], "routed_experts")
                elif f2 == 2 and w2 == 0:
                    cols["num_experts"] = v2
                elif f2 == 3 and w2 == 0:
                    cols["routed_start"] = v2
        else:  # small fields (ids, segments, metadata, ...): protobuf parses their bytes
            small.append(buf[first:stop])
    return cols, trajectory_pb2.Trajectory.FromString(b"".join(small))


def parse_batch(buf: bytes) -> tuple[list[Rollout], int, int]:
    """A serialized rollout.v1.Batch -> (rollouts, credit_trajectories, credit_tokens).
    Column arrays are read-only views into ``buf`` (zero copy). DecodeError if malformed."""
    try:
        return _parse_batch(buf)
    except DecodeError:
        raise
    except Exception as exc:  # noqa: BLE001 - any malformation is the same error
        raise DecodeError(f"malformed Batch message: {type(exc).__name__}: {exc}") from None


def _parse_batch(buf: bytes) -> tuple[list[Rollout], int, int]:
    out: list[Rollout] = []
    credit_n = credit_tok = 0
    for fno, wt, v, _, _ in _fields(buf, 0, len(buf)):
        if fno == 1 and wt == 2:
            entry_id, count, masked, traj = "", 0, False, None
            for f2, w2, v2, _, _ in _fields(buf, v[0], v[1]):
                if f2 == 1 and w2 == 2:
                    entry_id = buf[v2[0]:v2[1]].decode()
                elif f2 == 2 and w2 == 0:
                    count = v2
                elif f2 == 3 and w2 == 0:
                    masked = bool(v2)
                elif f2 == 4 and w2 == 2:
                    traj = v2
            if traj is None:
                raise DecodeError("delivery without a trajectory")
            cols, small = _parse_trajectory(buf, traj[0], traj[1])
            out.append(_rollout(entry_id, count, masked, small, cols))
        elif fno == 2 and wt == 0:
            credit_n = v
        elif fno == 3 and wt == 0:
            credit_tok = v
    return out, credit_n, credit_tok


_EMPTY_I4 = np.zeros(0, "<i4")
_EMPTY_F4 = np.zeros(0, "<f4")


def _rollout(entry_id: str, count: int, masked: bool, t: trajectory_pb2.Trajectory,
             cols: dict) -> Rollout:
    if not t.trajectory_id:
        raise DecodeError("delivery without a trajectory id")
    if "token_ids" not in cols:
        raise DecodeError(f"trajectory {t.trajectory_id} has no token_ids column")
    r = Rollout(
        entry_id=entry_id, delivery_count=count, masked=masked,
        trajectory_id=t.trajectory_id, group_id=t.group_id, sample_index=t.sample_index,
        prompt_token_ids=cols.get("prompt_token_ids", _EMPTY_I4), token_ids=cols["token_ids"],
        logprobs=cols.get("logprobs", _EMPTY_F4), entropy=cols.get("entropy", _EMPTY_F4),
        policy_version=cols.get("policy_version", _EMPTY_I4),
        kv_version=cols.get("kv_version", _EMPTY_I4), old_logprobs=cols.get("old_logprobs"),
        entropy_kind=t.entropy_kind, entropy_error_bound=t.entropy_error_bound,
        routed_experts=cols.get("routed_experts"), routed_start=cols.get("routed_start", 0),
        num_experts=cols.get("num_experts", 0),
        reward=t.reward if t.HasField("reward") else None, finish_reason=t.finish_reason.type,
        segments=[SegmentInfo(s.start, s.end, s.policy_version, s.engine_id, s.began, s.ended)
                  for s in t.segments],
        metadata=dict(t.metadata), created_at=t.created_at, finished_at=t.finished_at,
        **_session_fields(t, cols.get("loss_mask")))
    _check(r)
    return r


def _session_fields(t: trajectory_pb2.Trajectory, mask: np.ndarray | None) -> dict[str, Any]:
    """Agent-session fields (24 loss_mask, 25 turns)."""
    return {"loss_mask": mask,
            "turns": [TurnInfo(x.start, x.end, x.kind, x.index) for x in t.turns]}


def _check(out: Rollout) -> None:
    n = out.num_tokens
    for name in ("logprobs", "entropy", "policy_version", "kv_version"):
        if getattr(out, name).shape != (n,):
            raise DecodeError(f"{name} has shape {getattr(out, name).shape}, expected ({n},)")
    if out.old_logprobs is not None and out.old_logprobs.shape != (n,):
        raise DecodeError(f"old_logprobs has shape {out.old_logprobs.shape}, expected ({n},)")
    if out.loss_mask is not None and (out.loss_mask.shape != (n,)
                                      or out.loss_mask.dtype != np.uint8):
        raise DecodeError(f"loss_mask must be uint8 ({n},), got {out.loss_mask.dtype} "
                          f"{out.loss_mask.shape}")
    if out.routed_experts is not None and out.routed_experts.ndim != 3:
        raise DecodeError("routed_experts must be [R, L, K]")
