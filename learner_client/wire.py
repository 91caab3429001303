"""rollout.v1 deliveries as numpy columns: ``rollout_proto.codec`` splits a received Batch
into zero-copy column views; this module names them for the learner. On a by-reference
Pull stream a delivery is a :class:`StoreRef` until the learner fetched its bytes from the
store (``learner_client.store``) and :func:`decode_fetched` made it a Rollout."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from learner_client.errors import DecodeError
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb


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
    #: columns the wire carries that have no attribute here (fields added to the .proto
    #: later), by path, e.g. ``{"new_column": array}``: read-only views like the others
    extra_columns: dict[str, np.ndarray] = field(default_factory=dict)

    @property
    def redelivered(self) -> bool:
        return self.delivery_count > 1

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.prompt_token_ids.shape[0]) + self.num_tokens


@dataclass(frozen=True, slots=True)
class StoreRef:
    """A delivery whose trajectory bytes stay in the store (a by-reference Pull stream):
    leased to this consumer like any delivery; the learner fetches ``size`` bytes."""

    entry_id: str
    delivery_count: int
    masked: bool
    kind: str  # codec.REDIS_STREAM
    key: str
    size: int
    trajectory_id: str
    num_tokens: int  # prompt + output tokens (credit)


_KNOWN = frozenset({"prompt_token_ids", "token_ids", "logprobs", "entropy", "policy_version",
                    "kv_version", "old_logprobs", "routed_experts.data", "loss_mask"})


def parse_batch(buf: bytes) -> tuple[list[Rollout], int, int]:
    """A serialized rollout.v1.Batch -> (rollouts, credit_trajectories, credit_tokens).
    Column arrays are read-only views into ``buf`` (zero copy). DecodeError if malformed
    or if a delivery is a reference (see :func:`parse_deliveries`)."""
    items, n, tok = parse_deliveries(buf)
    if any(isinstance(r, StoreRef) for r in items):
        raise DecodeError("the Batch carries store references; use parse_deliveries")
    return items, n, tok  # type: ignore[return-value]


def parse_deliveries(buf: bytes) -> tuple[list[Rollout | StoreRef], int, int]:
    """Like :func:`parse_batch`; a delivery carrying a reference becomes a StoreRef."""
    try:
        deliveries, batch = codec.parse_batch(buf)
    except codec.CodecError as exc:
        raise DecodeError(f"malformed Batch message: {exc}") from None
    return ([_rollout(d.entry_id, d.delivery_count, d.masked, t) if t is not None
             else _ref(d) for d, t in deliveries],
            batch.credit_trajectories, batch.credit_tokens)


def _ref(d: spb.Delivery) -> StoreRef:
    r = d.reference
    return StoreRef(d.entry_id, d.delivery_count, d.masked, r.kind, r.key, r.size,
                    r.trajectory_id, r.num_tokens)


def decode_fetched(ref: StoreRef, data: bytes) -> Rollout:
    """The Rollout of a reference whose bytes were fetched (views into ``data``).
    DecodeError if they are not the trajectory the reference names."""
    if len(data) != ref.size:
        raise DecodeError(f"entry {ref.entry_id} ({ref.trajectory_id}): fetched "
                          f"{len(data)} bytes, the reference says {ref.size}")
    try:
        t = codec.decode_trajectory(data)
    except codec.CodecError as exc:
        raise DecodeError(f"entry {ref.entry_id}: malformed trajectory: {exc}") from None
    if t.message.trajectory_id != ref.trajectory_id:
        raise DecodeError(f"entry {ref.entry_id}: fetched trajectory "
                          f"{t.message.trajectory_id!r}, the reference names "
                          f"{ref.trajectory_id!r}")
    return _rollout(ref.entry_id, ref.delivery_count, ref.masked, t)


def _rollout(entry_id: str, delivery_count: int, masked: bool, t: codec.Decoded) -> Rollout:
    c, m = t.columns, t.message
    re = m.routed_experts
    return Rollout(
        entry_id=entry_id, delivery_count=delivery_count, masked=masked,
        trajectory_id=m.trajectory_id, group_id=m.group_id, sample_index=m.sample_index,
        prompt_token_ids=c["prompt_token_ids"], token_ids=c["token_ids"],
        logprobs=c["logprobs"], entropy=c["entropy"], policy_version=c["policy_version"],
        kv_version=c["kv_version"], old_logprobs=c.get("old_logprobs"),
        entropy_kind=m.entropy_kind, entropy_error_bound=m.entropy_error_bound,
        routed_experts=c.get("routed_experts.data"), routed_start=re.start,
        num_experts=re.num_experts,
        reward=m.reward if m.HasField("reward") else None, finish_reason=m.finish_reason.type,
        segments=[SegmentInfo(s.start, s.end, s.policy_version, s.engine_id, s.began, s.ended)
                  for s in m.segments],
        metadata=dict(m.metadata), created_at=m.created_at, finished_at=m.finished_at,
        loss_mask=c.get("loss_mask"),
        turns=[TurnInfo(x.start, x.end, x.kind, x.index) for x in m.turns],
        extra_columns={k: v for k, v in c.items() if k not in _KNOWN})
