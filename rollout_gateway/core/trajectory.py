"""The tagged trajectory: one sampled response to one prompt, columnar per token.

Per-token data is a struct of numpy arrays (never per-token Python objects) from the
engine response to the wire. Validation happens once, at construction.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np

from rollout_gateway.errors import InvalidArgument

TOKEN_DTYPE = np.dtype("<i4")
LOGPROB_DTYPE = np.dtype("<f4")
VERSION_DTYPE = np.dtype("<i4")


class EntropyKind(StrEnum):
    """How the per-token entropy column was obtained."""

    EXACT = "exact"  # the engine computed the full-vocabulary entropy
    TOPK_ESTIMATE = "topk_estimate"  # derived from top-k logprobs; see entropy_error_bound
    NONE = "none"  # the engine gave nothing to estimate from; the column is NaN


class Transition(StrEnum):
    """How a segment began or ended."""

    START = "start"  # first segment of a trajectory
    FINISHED = "finished"  # generation ended normally (stop / length)
    IN_PLACE = "in_place"  # weights swapped under a paused request; KV kept
    RETRACT = "retract"  # KV dropped and re-prefilled under the new weights
    ABORT_RESUME = "abort_resume"  # aborted, resubmitted as prompt + partial output
    DRAIN = "drain"  # finished on the old weights before the swap
    FAILOVER = "failover"  # the engine died; resumed elsewhere from the tokens so far
    ABORTED = "aborted"  # ended by an abort that was not resumed
    CONTEXT = "context"  # agent session: tokens the model read but did not sample (loss mask 0)


@dataclass(slots=True)
class Segment:
    """One uninterrupted stretch of generation: output token indices [start, end)."""

    start: int
    end: int
    policy_version: int
    engine_id: str
    began: Transition = Transition.START
    ended: Transition = Transition.FINISHED
    started_at: float = 0.0
    ended_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(slots=True)
class Turn:
    """One turn of an agent session over output token indices [start, end).

    ``kind`` is ``model`` (tokens the policy sampled, loss mask 1) or ``context`` (chat
    template tokens and user / tool / environment messages, loss mask 0); ``index`` is the
    session's model call the turn belongs to (context is read by the call that follows it)."""

    start: int
    end: int
    kind: str
    index: int = 0


@dataclass(slots=True)
class FinishReason:
    """SGLang's finish_reason, flattened: type is stop | length | abort."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    @classmethod
    def from_sglang(cls, obj: dict[str, Any] | None) -> FinishReason:
        if obj is None:
            return cls(type="abort", message="engine returned no finish_reason")
        return cls(
            type=str(obj.get("type", "abort")),
            matched=obj.get("matched"),
            length=obj.get("length"),
            message=obj.get("message"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.length is not None:
            out["length"] = self.length
        if self.message is not None:
            out["message"] = self.message
        return out


def narrowest_uint(num_experts: int) -> np.dtype:
    """The narrowest unsigned integer dtype that holds expert ids 0..num_experts-1."""
    if num_experts <= 0:
        raise InvalidArgument(f"num_experts must be positive, got {num_experts}")
    for dt in ("<u1", "<u2", "<u4"):
        if num_experts - 1 <= np.iinfo(np.dtype(dt)).max:
            return np.dtype(dt)
    raise InvalidArgument(f"num_experts={num_experts} does not fit in uint32")


@dataclass(slots=True)
class RoutedExperts:
    """MoE routing decisions, [R, num_layers, top_k], in the narrowest uint dtype.

    Row i is the routing of sequence position ``start + i`` of prompt + output (SGLang
    returns rows for positions 0 .. prompt_len + output_len - 2: the last token never
    gets a forward pass). Layers are all model layers as the engine reports them
    (dense layers are zeros).
    """

    data: np.ndarray
    num_experts: int
    start: int = 0

    def __post_init__(self) -> None:
        if self.data.ndim != 3:
            raise InvalidArgument(f"routed_experts must be [R, L, K], got shape {self.data.shape}")
        want = narrowest_uint(self.num_experts)
        if self.data.dtype != want:
            self.data = np.ascontiguousarray(self.data, dtype=want)

    @classmethod
    def from_int32(cls, flat: np.ndarray, num_layers: int, top_k: int, num_experts: int,
                   start: int = 0) -> RoutedExperts:
        """Build from SGLang's flat little-endian int32 buffer."""
        if flat.size % (num_layers * top_k):
            raise InvalidArgument(
                f"routed_experts size {flat.size} is not a multiple of layers*top_k"
                f"={num_layers * top_k}"
            )
        if flat.size and (flat.min() < 0 or flat.max() >= num_experts):
            raise InvalidArgument(f"routed_experts ids outside [0, {num_experts})")
        data = flat.reshape(-1, num_layers, top_k).astype(narrowest_uint(num_experts))
        return cls(data=data, num_experts=num_experts, start=start)


@dataclass(slots=True)
class TokenColumns:
    """Per-output-token columns, all of length T."""

    token_ids: np.ndarray  # int32
    logprobs: np.ndarray  # float32, behavior (inference) logprob of the sampled token
    entropy: np.ndarray  # float32, inference-side entropy of the next-token distribution
    policy_version: np.ndarray  # int32, weight version that sampled the token
    kv_version: np.ndarray  # int32, oldest weight version among the KV it attended to
    old_logprobs: np.ndarray | None = None  # float32, optional proximal logprob

    def __post_init__(self) -> None:
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype=TOKEN_DTYPE)
        self.logprobs = np.ascontiguousarray(self.logprobs, dtype=LOGPROB_DTYPE)
        self.entropy = np.ascontiguousarray(self.entropy, dtype=LOGPROB_DTYPE)
        self.policy_version = np.ascontiguousarray(self.policy_version, dtype=VERSION_DTYPE)
        self.kv_version = np.ascontiguousarray(self.kv_version, dtype=VERSION_DTYPE)
        if self.old_logprobs is not None:
            self.old_logprobs = np.ascontiguousarray(self.old_logprobs, dtype=LOGPROB_DTYPE)
        n = self.token_ids.shape[0]
        cols = {"logprobs": self.logprobs, "entropy": self.entropy,
                "policy_version": self.policy_version, "kv_version": self.kv_version}
        if self.old_logprobs is not None:
            cols["old_logprobs"] = self.old_logprobs
        for name, col in cols.items():
            if col.ndim != 1 or col.shape[0] != n:
                raise InvalidArgument(f"column {name} has shape {col.shape}, expected ({n},)")
        if n and np.any(self.kv_version > self.policy_version):
            raise InvalidArgument("kv_version must never exceed policy_version")

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def empty(cls) -> TokenColumns:
        z = np.zeros(0)
        return cls(z, z, z, z, z)

    @classmethod
    def concat(cls, parts: list[TokenColumns]) -> TokenColumns:
        if not parts:
            return cls.empty()
        olds = [p.old_logprobs for p in parts]
        old = None
        if any(o is not None for o in olds):
            old = np.concatenate([o if o is not None else np.full(len(p), np.nan, LOGPROB_DTYPE)
                                  for o, p in zip(olds, parts)])
        return cls(
            token_ids=np.concatenate([p.token_ids for p in parts]),
            logprobs=np.concatenate([p.logprobs for p in parts]),
            entropy=np.concatenate([p.entropy for p in parts]),
            policy_version=np.concatenate([p.policy_version for p in parts]),
            kv_version=np.concatenate([p.kv_version for p in parts]),
            old_logprobs=old,
        )


@dataclass(slots=True)
class Trajectory:
    """One sampled response to one prompt with every token's provenance."""

    trajectory_id: str
    prompt_token_ids: np.ndarray
    tokens: TokenColumns
    finish_reason: FinishReason
    segments: list[Segment]
    group_id: str = ""
    sample_index: int = 0
    entropy_kind: EntropyKind = EntropyKind.EXACT
    entropy_error_bound: float = 0.0  # max |estimate - exact| in nats; 0 for exact
    routed_experts: RoutedExperts | None = None
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    reward: float | None = None
    #: agent sessions: 1 where the model sampled the token, 0 where it only read it
    #: (uint8 [T]); None = every output token is the model's (plain rollouts)
    loss_mask: np.ndarray | None = None
    turns: list[Turn] = field(default_factory=list)  # agent sessions; [] = one model turn

    def __post_init__(self) -> None:
        if not self.trajectory_id:
            raise InvalidArgument("trajectory_id must be non-empty")
        self.prompt_token_ids = np.ascontiguousarray(self.prompt_token_ids, dtype=TOKEN_DTYPE)
        if self.loss_mask is not None:
            self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=np.uint8)
            if self.loss_mask.shape != (len(self.tokens),):
                raise InvalidArgument(f"loss_mask has shape {self.loss_mask.shape}, expected "
                                      f"({len(self.tokens)},)")
        if self.turns:
            pos = 0
            for t in self.turns:
                if t.start != pos or t.end < t.start or t.kind not in ("model", "context"):
                    raise InvalidArgument(f"turns must tile the output in order with kind "
                                          f"model|context; got {t} at token {pos}")
                pos = t.end
            if pos != len(self.tokens):
                raise InvalidArgument(f"turns cover {pos} tokens but the trajectory has "
                                      f"{len(self.tokens)}")
        covered = sum(s.num_tokens for s in self.segments)
        if covered != len(self.tokens):
            raise InvalidArgument(
                f"segments cover {covered} tokens but the trajectory has {len(self.tokens)}"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def engine_ids(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.segments:
            seen.setdefault(s.engine_id, None)
        return list(seen)

    @property
    def min_version(self) -> int:
        return int(self.tokens.policy_version.min()) if self.num_tokens else -1

    @property
    def max_version(self) -> int:
        return int(self.tokens.policy_version.max()) if self.num_tokens else -1
