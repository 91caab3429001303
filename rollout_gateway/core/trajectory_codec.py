"""Trajectory <-> the bytes the store keeps and the learner receives (rollout.v1.Trajectory).

A thin mapping between the gateway's dataclasses and proto field names; the codec itself
(framing, field numbers, dtype policy, validation) is ``rollout_proto.codec``, shared with
the learner.
"""

from __future__ import annotations

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
from rollout_proto import codec


def fields(traj: Trajectory) -> dict:
    """The trajectory as rollout.v1.Trajectory field names -> values."""
    cols = traj.tokens
    fr = traj.finish_reason
    finish: dict = {"type": fr.type, "length": fr.length, "message": fr.message}
    if isinstance(fr.matched, int) and not isinstance(fr.matched, bool):
        finish["matched_token"] = fr.matched
    elif fr.matched is not None and not isinstance(fr.matched, bool):
        finish["matched_text"] = str(fr.matched)
    re = traj.routed_experts
    return {
        "trajectory_id": traj.trajectory_id, "group_id": traj.group_id,
        "sample_index": traj.sample_index, "prompt_token_ids": traj.prompt_token_ids,
        "token_ids": cols.token_ids, "logprobs": cols.logprobs, "entropy": cols.entropy,
        "entropy_kind": traj.entropy_kind.value,
        "entropy_error_bound": traj.entropy_error_bound,
        "policy_version": cols.policy_version, "kv_version": cols.kv_version,
        "old_logprobs": cols.old_logprobs,
        "routed_experts": (None if re is None else
                           {"data": re.data, "num_experts": re.num_experts, "start": re.start}),
        "finish_reason": finish,
        "segments": [{"start": s.start, "end": s.end, "policy_version": s.policy_version,
                      "engine_id": s.engine_id, "began": s.began.value, "ended": s.ended.value,
                      "started_at": s.started_at, "ended_at": s.ended_at}
                     for s in traj.segments],
        "metadata": {str(k): str(v) for k, v in traj.metadata.items()},
        "reward": None if traj.reward is None else float(traj.reward),
        "created_at": traj.created_at, "finished_at": traj.finished_at,
        "loss_mask": traj.loss_mask,
        "turns": [{"start": t.start, "end": t.end, "kind": t.kind, "index": t.index}
                  for t in traj.turns],
    }


def encode(traj: Trajectory) -> bytes:
    """Serialized rollout.v1.Trajectory: what the store keeps and the wire carries."""
    try:
        return codec.encode_trajectory(fields(traj))
    except codec.CodecError as exc:
        raise InvalidArgument(str(exc)) from None


def _enum(cls, value: str, name: str):
    try:
        return cls(value)
    except ValueError:
        raise InvalidArgument(f"{name}: unknown value {value!r}") from None


def decode(data: bytes) -> Trajectory:
    """Decode and validate; InvalidArgument on anything malformed."""
    try:
        d = codec.decode_trajectory(data)
    except codec.CodecError as exc:
        raise InvalidArgument(f"not a valid rollout.v1.Trajectory: {exc}") from None
    c, m = d.columns, d.message
    fr = m.finish_reason
    which = fr.WhichOneof("matched")
    routed = None
    if d.has("routed_experts"):
        if "routed_experts.data" not in c:
            raise InvalidArgument("routed_experts without data")
        routed = RoutedExperts(data=c["routed_experts.data"],
                               num_experts=m.routed_experts.num_experts,
                               start=m.routed_experts.start)
    return Trajectory(
        trajectory_id=m.trajectory_id, prompt_token_ids=c["prompt_token_ids"],
        tokens=TokenColumns(
            token_ids=c["token_ids"], logprobs=c["logprobs"], entropy=c["entropy"],
            policy_version=c["policy_version"], kv_version=c["kv_version"],
            old_logprobs=c.get("old_logprobs")),
        finish_reason=FinishReason(
            type=fr.type or "abort", matched=getattr(fr, which) if which else None,
            length=fr.length if fr.HasField("length") else None,
            message=fr.message if fr.HasField("message") else None),
        segments=[Segment(start=s.start, end=s.end, policy_version=s.policy_version,
                          engine_id=s.engine_id,
                          began=_enum(Transition, s.began or "start", "segment.began"),
                          ended=_enum(Transition, s.ended or "finished", "segment.ended"),
                          started_at=s.started_at, ended_at=s.ended_at)
                  for s in m.segments],
        group_id=m.group_id, sample_index=m.sample_index,
        entropy_kind=_enum(EntropyKind, m.entropy_kind or "exact", "entropy_kind"),
        entropy_error_bound=m.entropy_error_bound, routed_experts=routed,
        created_at=m.created_at, finished_at=m.finished_at, metadata=dict(m.metadata),
        reward=m.reward if m.HasField("reward") else None,
        loss_mask=c.get("loss_mask"),
        turns=[Turn(start=t.start, end=t.end, kind=t.kind, index=t.index) for t in m.turns],
    )
