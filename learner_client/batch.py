"""Assemble delivered rollouts into torch tensors: padded [B, S] or packed [N] (cu_seqlens).

Every sequence is prompt + response. Per-token columns sit on the same grid, each value at
the position of the token it describes (response token t of sequence i at P_i + t); the
model's log-probability for that token comes from the logits one position earlier.
Columns are zero (or NaN for old_logprobs, -1 for versions) outside the response.

* ``loss_mask``: 1 on response tokens, 0 on prompt and padding, 0 on tokens of a
  ``masked`` delivery whose lag exceeds ``max_lag`` (the MASK stale policy), and 0 on an
  agent session's context tokens (the rollout's ``loss_mask``: chat template, user / tool /
  environment messages; ``Rollout.turns`` has the turn boundaries).
* ``versions`` / ``kv_versions``: policy_version / kv_version per token; ``lags`` =
  learner_version - policy_version (0 outside the response).
* ``routed_experts``: [B, S, L, K] (padded) or [N, L, K] (packed); uint8 when the wire
  dtype is uint8 (<= 256 experts), else int32 (call ``.long()`` to index);
  rows placed at the positions the engine reported; ``routed_mask`` marks those rows.

Each column costs one copy from the received bytes (numpy views -> one preallocated
buffer -> torch.from_numpy, no further copy); no per-token Python loop. The routed-experts
buffer (the one multi-MB allocation per batch) comes from a pool and is reused once the
batch's tensors are dropped (``learner_client.buffers``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from learner_client.buffers import BufferPool
from learner_client.staleness import lag, stale_mask
from learner_client.wire import Rollout

_F32_COLS = ("rollout_logprobs", "entropy", "old_logprobs")
#: routed-experts buffers of dropped batches, reused (larger ones are allocated as before)
_ROUTED = BufferPool(512 << 20)


@dataclass
class TrajectoryBatch:
    layout: Literal["padded", "packed"]
    input_ids: torch.Tensor  # int64 [B, S] | [N]
    position_ids: torch.Tensor  # int64, restarting at 0 per sequence
    attention_mask: torch.Tensor | None  # bool [B, S] (padded only)
    cu_seqlens: torch.Tensor  # int32 [B+1], cumulative real lengths P_i + T_i
    prompt_lens: torch.Tensor  # int64 [B]
    response_lens: torch.Tensor  # int64 [B]
    loss_mask: torch.Tensor  # float32, grid shape
    rollout_logprobs: torch.Tensor  # float32 behavior logprob (log mu)
    entropy: torch.Tensor  # float32
    old_logprobs: torch.Tensor | None  # float32, NaN where a rollout had none
    versions: torch.Tensor  # int32, -1 outside the response
    kv_versions: torch.Tensor  # int32, -1 outside the response
    lags: torch.Tensor  # int32
    routed_experts: torch.Tensor | None  # [B, S, L, K] | [N, L, K]; uint8 or int32
    routed_mask: torch.Tensor | None  # bool [B, S] | [N]
    rewards: torch.Tensor  # float32 [B], NaN where a rollout had none
    learner_version: int
    max_lag: int | None = None  # the bound that decided masked tokens
    rollouts: list[Rollout] = field(repr=False, default_factory=list)

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def loss_inputs(self, logprobs: torch.Tensor, advantages: torch.Tensor, *,
                    fill_old: Any = None, **extra: Any):
        """learner_client.corrections.LossInputs on this batch's grid. ``logprobs`` (log pi,
        aligned like every column) has the grid shape; ``advantages`` has the grid shape or
        is [B] (one per sequence, broadcast over its tokens).

        Masked positions (prompt, padding, stale tokens) may hold NaN (old_logprobs) or any
        value: every loss ignores them. ``fill_old``: a strategy of
        ``learner_client.old_logits.fill_old_logprobs`` ("behavior", "current",
        "loglinear", ``snapshot_strategy(...)``, ...) that fills old_logprobs on the active
        tokens whose rollout carried none (the column is built when no rollout had it);
        None leaves the column as delivered (losses that need pi_old then refuse NaN on an
        active token with a clear error)."""
        from learner_client.corrections import LossInputs

        dev = logprobs.device
        if advantages.shape != logprobs.shape:
            if advantages.shape != (self.num_sequences,):
                raise ValueError(f"advantages must be {tuple(logprobs.shape)} or "
                                 f"({self.num_sequences},), got {tuple(advantages.shape)}")
            advantages = self.per_sequence(advantages.to(dev))
        kw: dict[str, Any] = dict(
            logprobs=logprobs, rollout_logprobs=self.rollout_logprobs.to(dev),
            advantages=advantages, loss_mask=self.loss_mask.to(dev),
            old_logprobs=None if self.old_logprobs is None else self.old_logprobs.to(dev),
            entropy=self.entropy.to(dev), versions=self.versions.to(dev),
            learner_version=self.learner_version)
        if self.layout == "packed":
            kw["cu_seqlens"] = self.cu_seqlens.to(device=dev, dtype=torch.int64)
        bounds = [float(r.entropy_error_bound) for r in self.rollouts]
        if any(x != 0.0 for x in bounds):  # top-k entropy somewhere: ESTR checks the bound
            kw["entropy_error_bound"] = self.per_sequence(torch.tensor(bounds)).to(dev)
        if fill_old is not None:
            from learner_client.old_logits import FillContext, fill_old_logprobs

            ctx = FillContext(rollout_logprobs=self.rollout_logprobs,
                              logprobs=logprobs.detach().cpu(), versions=self.versions,
                              learner_version=self.learner_version, loss_mask=self.loss_mask)
            old, _ = fill_old_logprobs(self.old_logprobs, fill_old, ctx,
                                       shape=self.rollout_logprobs.shape)
            kw["old_logprobs"] = old.to(dev)
        kw.update(extra)
        return LossInputs(**kw)

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """Broadcast a [B] tensor over each sequence's positions (grid shape)."""
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).to(torch.int64).to(values.device)
        if self.layout == "packed":
            return values.repeat_interleave(lens)
        return values[:, None].expand(-1, self.input_ids.shape[1]).clone()

    def pack_samples(self, advantages: Any = None) -> list:
        """learner_client.megatron.packing.PackSample per rollout (response layout), for
        the Megatron adapter. ``advantages``: optional [B] or per-rollout arrays."""
        from learner_client.megatron.packing import PackSample

        out = []
        for i, r in enumerate(self.rollouts):
            cols: dict[str, Any] = {
                "rollout_logprobs": r.logprobs, "entropy": r.entropy,
                "versions": r.policy_version,
                "loss_mask": _token_mask(r, self.learner_version, self.max_lag)}
            if r.old_logprobs is not None:
                cols["old_logprobs"] = r.old_logprobs
            if advantages is not None:
                cols["advantages"] = advantages[i]
            routed = None
            if r.routed_experts is not None and r.routed_start == 0:
                routed = r.routed_experts
            out.append(PackSample(r.prompt_token_ids, r.token_ids, cols, routed))
        return out


def _stale_tokens(r: Rollout, learner_version: int, max_lag: int | None) -> np.ndarray:
    if not r.masked:
        return np.zeros(r.num_tokens, dtype=bool)
    return stale_mask(learner_version, r.policy_version, max_lag)


def _token_mask(r: Rollout, learner_version: int, max_lag: int | None) -> np.ndarray:
    """float32 [T]: 1 on tokens that get a loss. 0 on stale tokens of a masked delivery and
    on an agent session's context tokens (its ``loss_mask``: template, user/tool messages)."""
    m = (~_stale_tokens(r, learner_version, max_lag)).astype(np.float32)
    if r.loss_mask is not None:
        m *= r.loss_mask
    return m


def collate(rollouts: list[Rollout], learner_version: int, *,
            layout: Literal["padded", "packed"] = "padded", max_lag: int | None = None,
            pad_token_id: int = 0, routed_experts: bool = True) -> TrajectoryBatch:
    """Assemble rollouts (as returned by ``pull``) into one batch.

    ``max_lag`` decides which tokens of ``masked`` deliveries are masked out of the loss
    (pass the bound the client pulled with)."""
    if not rollouts:
        raise ValueError("collate needs at least one rollout")
    if layout not in ("padded", "packed"):
        raise ValueError(f"layout must be 'padded' or 'packed', got {layout!r}")
    b = len(rollouts)
    plen = np.array([r.prompt_token_ids.shape[0] for r in rollouts], np.int64)
    tlen = np.array([r.num_tokens for r in rollouts], np.int64)
    seq = plen + tlen
    cu = np.zeros(b + 1, np.int64)
    np.cumsum(seq, out=cu[1:])
    n = int(cu[-1])
    padded = layout == "padded"
    width = int(seq.max()) if padded else 0
    grid = (b, width) if padded else (n,)
    # flat offsets of each sequence's first position in the grid
    base = np.arange(b, dtype=np.int64) * width if padded else cu[:-1]

    starts = base.tolist()
    spans = [(s0 + int(p), s0 + int(p) + int(t)) for s0, p, t in zip(starts, plen, tlen)]
    ids = np.full(grid, pad_token_id, np.int64)
    flat_ids = ids.reshape(-1)
    for r, s0, (a, e) in zip(rollouts, starts, spans):
        flat_ids[s0:a] = r.prompt_token_ids
        flat_ids[a:e] = r.token_ids

    def column(values: list[np.ndarray], dtype, fill) -> torch.Tensor:
        out = np.full(grid, fill, dtype)
        flat = out.reshape(-1)
        for v, (a, e) in zip(values, spans):
            flat[a:e] = v
        return torch.from_numpy(out)

    loss_mask = column([_token_mask(r, learner_version, max_lag) for r in rollouts],
                       np.float32, 0.0)
    versions = column([r.policy_version for r in rollouts], np.int32, -1)
    lags = column([lag(learner_version, r.policy_version) for r in rollouts], np.int32, 0)
    old = None
    if any(r.old_logprobs is not None for r in rollouts):
        old = column([r.old_logprobs if r.old_logprobs is not None
                      else np.full(r.num_tokens, np.nan, np.float32) for r in rollouts],
                     np.float32, np.nan)
    pos = np.arange(int(seq.max()) if padded else n, dtype=np.int64)
    if padded:
        position_ids = torch.from_numpy(np.broadcast_to(pos, grid).copy())
        attention_mask = torch.from_numpy(pos[None, :] < seq[:, None])
    else:
        position_ids = torch.from_numpy(pos - np.repeat(cu[:-1], seq))
        attention_mask = None
    re_t, re_mask = _routed(rollouts, grid, starts, seq) if routed_experts else (None, None)
    batch = TrajectoryBatch(
        layout=layout, input_ids=torch.from_numpy(ids), position_ids=position_ids,
        attention_mask=attention_mask, cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        prompt_lens=torch.from_numpy(plen), response_lens=torch.from_numpy(tlen),
        loss_mask=loss_mask,
        rollout_logprobs=column([r.logprobs for r in rollouts], np.float32, 0.0),
        entropy=column([r.entropy for r in rollouts], np.float32, 0.0),
        old_logprobs=old, versions=versions,
        kv_versions=column([r.kv_version for r in rollouts], np.int32, -1),
        lags=lags, routed_experts=re_t, routed_mask=re_mask,
        rewards=torch.tensor([np.nan if r.reward is None else r.reward for r in rollouts],
                             dtype=torch.float32),
        learner_version=learner_version, max_lag=max_lag, rollouts=list(rollouts))
    return batch


def _routed(rollouts: list[Rollout], grid: tuple[int, ...], starts: list[int],
            seq: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    have = [r.routed_experts for r in rollouts if r.routed_experts is not None]
    if not have:
        return None, None
    lk = have[0].shape[1:]
    if any(x.shape[1:] != lk for x in have):
        raise ValueError("rollouts disagree on routed_experts [L, K]")
    dt = np.uint8 if all(x.dtype == np.uint8 for x in have) else np.int32
    cells = int(np.prod(grid))
    row = int(np.prod(lk))
    # flat 1-D copies (one memcpy per rollout); only cells no rollout covers are zeroed
    nbytes = cells * row * np.dtype(dt).itemsize
    out = (_ROUTED.get(nbytes)[:nbytes].view(dt) if nbytes <= _ROUTED.max_bytes // 4
           else np.empty(cells * row, dt))
    mask = np.zeros(cells, bool)
    width = grid[1] if len(grid) == 2 else None
    for r, s0, n in zip(rollouts, starts, seq.tolist()):
        end = s0 + (width if width is not None else n)  # this sequence's cells in the grid
        src = r.routed_experts
        k = 0 if src is None else max(min(src.shape[0], n - r.routed_start), 0)
        a = s0 + (r.routed_start if k else 0)
        if k:
            out[a * row:(a + k) * row] = src.reshape(-1)[:k * row]
            mask[a:a + k] = True
        out[s0 * row:a * row] = 0
        out[(a + k) * row:end * row] = 0
    return (torch.from_numpy(out.reshape(*grid, *lk)),
            torch.from_numpy(mask.reshape(grid)))
