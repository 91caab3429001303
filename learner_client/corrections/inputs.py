"""The one input type every correction loss takes: per-token tensors over N tokens.

Layouts
-------
* flat ``[N]`` (packed): every field is 1-D; sequence boundaries come from ``seq_ids``
  (one int per token, equal ids = same sequence) or ``cu_seqlens`` (``[S+1]`` int offsets,
  Megatron/THD style). Sequence-level losses (GSPO, SAT-GSPO, sequence MIS, the
  per-sequence aggregation) need one of them; token-level losses do not.
* padded ``[B, T]``: each row is one sequence; padding must carry ``loss_mask = 0``.

Field meanings (paper notation of corrections.md): ``logprobs`` = log pi (current policy,
carries the gradient); ``old_logprobs`` = log pi_old (proximal / trainer-side old policy,
optional, NaN allowed only before filling, see ``learner_client.old_logits.fill``);
``rollout_logprobs`` = log mu (behavior, stamped by the gateway); ``ref_logprobs`` =
log pi_ref (KL reference, optional); ``entropy`` = H of the
behavior distribution; ``versions`` = policy_version per token; ``learner_version`` =
the version of the weights being optimized (v_theta).

Pure PyTorch: no I/O, no logging.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np
import torch
from torch import Tensor


class LossInputError(ValueError):
    """Inputs that a loss cannot use (shape mismatch, missing column, bad dtype)."""


# Finite values up to this magnitude at masked positions are left in place (harmless under
# the mask, see LossInputs._sanitize_inactive); a field holding anything else is zeroed there.
MASKED_ABS_BOUND = 1e6

_FLOAT_FIELDS = ("logprobs", "rollout_logprobs", "advantages", "old_logprobs", "ref_logprobs",
                 "entropy", "entropy_error_bound")
_TOKEN_FIELDS = ("logprobs", "rollout_logprobs", "advantages", "loss_mask",
                 "old_logprobs", "ref_logprobs", "entropy", "versions", "seq_ids",
                 "entropy_error_bound")


@dataclass(eq=False)
class LossInputs:
    """Per-token tensors over N tokens, all of the same shape ([N] or [B, T])."""

    logprobs: Tensor  # log pi, current policy; the only field that carries grad
    rollout_logprobs: Tensor  # log mu, behavior (inference engine)
    advantages: Tensor  # A per token (sequence advantages broadcast to their tokens)
    loss_mask: Tensor  # 1/True = active token; bool, int or float 0/1
    old_logprobs: Tensor | None = None  # log pi_old (proximal); None -> behavior is used
    ref_logprobs: Tensor | None = None  # log pi_ref, reference policy (GRPO's k3 KL term)
    entropy: Tensor | None = None  # H of the behavior distribution (ESTR)
    versions: Tensor | None = None  # policy_version per token (int)
    seq_ids: Tensor | None = None  # [N] int sequence id per token (flat layout)
    cu_seqlens: Tensor | None = None  # [S+1] int offsets (flat layout), alternative to seq_ids
    learner_version: int | None = None  # v_theta: version of the weights being optimized
    # per-token bound on |H_estimate - H| (0 exact; a top-k estimate's bound; inf: none)
    entropy_error_bound: Tensor | None = None

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() not in (1, 2):
            raise LossInputError(f"logprobs must be [N] or [B, T], got shape {tuple(shape)}")
        if not torch.is_floating_point(self.logprobs):
            raise LossInputError("logprobs must be a floating-point tensor")
        for name in _TOKEN_FIELDS[1:]:
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor):
                raise LossInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != shape:
                raise LossInputError(
                    f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)} like logprobs")
        if self.seq_ids is not None and self.cu_seqlens is not None:
            raise LossInputError("give either seq_ids or cu_seqlens, not both")
        if self.logprobs.dim() == 2 and (self.seq_ids is not None or self.cu_seqlens is not None):
            raise LossInputError("[B, T] inputs use one row per sequence; drop seq_ids/cu_seqlens")
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens
            if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != shape[0]:
                raise LossInputError(
                    f"cu_seqlens must be 1-D, start at 0 and end at N={shape[0]}")
            if bool((cu[1:] < cu[:-1]).any()):
                raise LossInputError("cu_seqlens must be non-decreasing")
        self._sanitize_inactive()

    def _sanitize_inactive(self) -> None:
        """Tokens with loss_mask 0 never change a loss or its gradient. The losses multiply
        by the mask (or only compare) at masked positions, which neutralizes moderate finite
        values there: the most a loss forms from an input x is a ratio clamped at e^20 times
        a weight clamped at e^20 times x, far below float32's max (3.4e38) for
        |x| <= ``MASKED_ABS_BOUND`` (1e6). Anything else survives the multiply as NaN:
        NaN/+-inf (collate's NaN old_logprobs outside responses, an engine's -inf logprob;
        NaN * 0 = NaN) and huge finite values (an advantage or log-ratio of 1e30:
        r * A = e^20 * 1e30 overflows float32 to inf, inf * 0 = NaN). So a float field that
        fails one cheap reduction, its sum of squares ``dot(x, x) <= bound^2`` (False for
        NaN/+-inf and whenever some |x| > bound; a large batch of ordinary values may fail
        it too, which only costs the where), is replaced by ``torch.where(active, x, 0)``
        (detached: the losses never differentiate through them). ``logprobs`` keeps the
        caller's tensor: ``flat("logprobs")`` then applies the same where on each call (a
        fresh autograd node, so one LossInputs can feed several losses and backward passes;
        the gradient at masked positions is exactly 0). Nothing happens when every token is
        active (one count, cached as ``mask_count``)."""
        self._mask_logprobs = False
        if int(self.mask_count) == self.num_tokens:
            return
        act = None
        for name in _FLOAT_FIELDS:
            t = getattr(self, name)
            if t is None or not torch.is_floating_point(t) or t.numel() == 0:
                continue
            x = t.detach().reshape(-1)
            if bool(torch.dot(x, x) <= MASKED_ABS_BOUND ** 2):  # False for NaN/inf too
                continue
            if name == "logprobs":
                self._mask_logprobs = True
                continue
            if act is None:
                act = self.active.reshape(self.logprobs.shape)
            setattr(self, name, torch.where(act, t.detach(),
                                            torch.zeros((), dtype=t.dtype, device=t.device)))

    # ---- flat views (cheap: reshape, no copies for contiguous inputs) -------------------

    def flat(self, name: str) -> Tensor | None:
        """Field ``name`` as a 1-D [N] tensor (None when absent); at masked positions 0 or a
        finite value of magnitude <= MASKED_ABS_BOUND (see _sanitize_inactive)."""
        t = getattr(self, name)
        if t is None:
            return None
        if name == "logprobs" and self._mask_logprobs:
            return torch.where(self.active, t.reshape(-1),
                               torch.zeros((), dtype=t.dtype, device=t.device))
        return t.reshape(-1)

    @property
    def num_tokens(self) -> int:
        return self.logprobs.numel()

    @cached_property
    def mask(self) -> Tensor:
        """Active-token mask as float [N] in logprobs' dtype (detached); a token is active
        where loss_mask > 0 (a NaN loss_mask entry counts as inactive)."""
        m = self.loss_mask.reshape(-1).detach()
        if m.dtype == torch.bool:
            return m.to(self.logprobs.dtype)
        m = m.to(self.logprobs.dtype)
        if torch.is_floating_point(self.loss_mask) and not bool(torch.isfinite(m.sum())):
            m = torch.where(m > 0, m, torch.zeros((), dtype=m.dtype))
            m = torch.where(torch.isfinite(m), m, torch.ones((), dtype=m.dtype))
        return m

    @cached_property
    def active(self) -> Tensor:
        """Active-token mask as bool [N]."""
        m = self.mask
        if m.device.type == "cpu" and m.dtype in (torch.float32, torch.float64):
            return torch.from_numpy(m.numpy() > 0)  # numpy's compare: ~4x torch's on CPU
        return m > 0

    @cached_property
    def mask_count(self) -> Tensor:
        """Number of active tokens (0-dim tensor, float)."""
        return self.mask.sum()

    @cached_property
    def num_sequences(self) -> int:
        """S without building the per-token index when the layout gives it directly."""
        if self.logprobs.dim() == 2:
            return self.logprobs.shape[0]
        if self.cu_seqlens is not None:
            return self.cu_seqlens.numel() - 1
        return self.seq_index[1]

    @cached_property
    def seq_active_counts(self) -> Tensor:
        """Active tokens per sequence [S] (float, detached)."""
        return self.seq_sum(self.mask)

    @cached_property
    def seq_lengths(self) -> Tensor | None:
        """[S] long lengths when sequences are contiguous runs of tokens ([B, T] rows or
        cu_seqlens), else None (seq_ids may interleave)."""
        if self.logprobs.dim() == 2:
            b, t = self.logprobs.shape
            return torch.full((b,), t, dtype=torch.long, device=self.logprobs.device)
        if self.cu_seqlens is not None:
            cu = self.cu_seqlens.to(device=self.logprobs.device, dtype=torch.long)
            return cu[1:] - cu[:-1]
        return None

    def seq_sum(self, x: Tensor) -> Tensor:
        """Per-sequence sums [S] of a float [N] tensor (differentiable): a row sum for
        [B, T], segment_reduce over cu_seqlens runs, index_add over seq_ids."""
        if self.logprobs.dim() == 2:
            return x.reshape(self.logprobs.shape).sum(1)
        lens = self.seq_lengths
        if lens is not None:
            if lens.numel() == 0:  # no sequence (N = 0): an empty view keeps the graph
                return x[:0]
            return torch.segment_reduce(x, "sum", lengths=lens, unsafe=True)
        idx, s = self.seq_index
        return torch.zeros(s, dtype=x.dtype, device=x.device).index_add(0, idx, x)

    @property
    def has_sequences(self) -> bool:
        return self.logprobs.dim() == 2 or self.seq_ids is not None or self.cu_seqlens is not None

    @cached_property
    def seq_index(self) -> tuple[Tensor, int]:
        """(index [N] long in 0..S-1 of each token's sequence, S)."""
        dev = self.logprobs.device
        if self.logprobs.dim() == 2:
            b, t = self.logprobs.shape
            return torch.arange(b, device=dev).repeat_interleave(t), b
        if self.cu_seqlens is not None:
            lens = self.seq_lengths
            s = lens.numel()
            if dev.type == "cpu":  # numpy's repeat is ~3x faster than repeat_interleave
                return torch.from_numpy(np.repeat(np.arange(s, dtype=np.int64),
                                                  lens.numpy())), s
            return torch.arange(s, device=dev).repeat_interleave(lens), s
        if self.seq_ids is not None:
            _, inverse = torch.unique(self.seq_ids.reshape(-1), return_inverse=True)
            return inverse.to(dev), int(inverse.max().item()) + 1 if inverse.numel() else 0
        raise LossInputError(
            "this loss needs sequence boundaries: pass [B, T] tensors, seq_ids or cu_seqlens")

    def behavior_or_old(self) -> Tensor:
        """log pi_old as [N] (detached): old_logprobs where present, the behavior logprobs
        where old_logprobs is None or NaN (a rollout that carried no old logits; the
        on-policy assumption of the PPO family, per token)."""
        mu = self.rollout_logprobs.reshape(-1).detach()
        if self.old_logprobs is None:
            return mu
        old = self.old_logprobs.reshape(-1).detach()
        if bool(torch.isnan(old.sum())):
            old = torch.where(torch.isnan(old), mu, old)
        return old

    def require_old(self) -> Tensor:
        """log pi_old [N] (detached) for losses that need real old logprobs: raises
        LossInputError when the column is absent or NaN on an active token (fill it first
        with ``learner_client.old_logits.fill_old_logprobs`` or ``batch.loss_inputs(...,
        fill_old=...)``)."""
        self.require("old_logprobs")
        old = self.old_logprobs.reshape(-1).detach()
        if bool(torch.isnan(old.sum())):
            n = int(torch.isnan(old).sum())
            raise LossInputError(
                f"old_logprobs is NaN on {n} active token(s) (rollouts without old logits): "
                "fill them with learner_client.old_logits.fill_old_logprobs or "
                "TrajectoryBatch.loss_inputs(..., fill_old=strategy)")
        return old

    def require(self, *names: str) -> None:
        """Raise LossInputError naming the first absent optional field."""
        for n in names:
            if getattr(self, n) is None:
                raise LossInputError(f"this loss needs the '{n}' field")

    @cached_property
    def seq_version_bounds(self) -> tuple[Tensor, Tensor] | None:
        """(v_first, v_last): float64 [S'] min / max policy_version over the active tokens
        of each of the S' sequences that have one (None without versions or sequence
        boundaries). Computed once per LossInputs (detached), so several losses or
        diagnostics on one batch share it."""
        if self.versions is None or not self.has_sequences:
            return None
        v = self.versions.reshape(-1).detach()
        if torch.is_floating_point(v):
            v = v.to(torch.int64)
        if self.cu_seqlens is not None and v.device.type == self.mask.device.type == "cpu":
            first, last = _cpu_segment_min_max(
                v.numpy(), None if int(self.mask_count) == v.numel() else self.active.numpy(),
                self.cu_seqlens.detach().cpu().numpy().astype(np.int64))
            return torch.from_numpy(first), torch.from_numpy(last)
        inactive = ~self.active
        big = torch.iinfo(v.dtype).max
        small = torch.iinfo(v.dtype).min
        if self.logprobs.dim() == 2:  # one row per sequence: plain row reductions
            b, t = self.logprobs.shape
            v_first = v.masked_fill(inactive, big).view(b, t).amin(1)
            v_last = v.masked_fill(inactive, small).view(b, t).amax(1)
        else:
            idx, s = self.seq_index
            v_first = torch.full((s,), big, dtype=v.dtype, device=v.device).scatter_reduce(
                0, idx, v.masked_fill(inactive, big), "amin")
            v_last = torch.full((s,), small, dtype=v.dtype, device=v.device).scatter_reduce(
                0, idx, v.masked_fill(inactive, small), "amax")
        has = v_first != big
        return v_first[has].to(torch.float64), v_last[has].to(torch.float64)

    def replace(self, **changes: object) -> LossInputs:
        """A copy with some fields replaced (validated again)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        kw.update(changes)
        return LossInputs(**kw)  # type: ignore[arg-type]


def _cpu_segment_min_max(v: np.ndarray, active: np.ndarray | None, cu: np.ndarray
                         ) -> tuple[np.ndarray, np.ndarray]:
    """(v_first, v_last) as float64 arrays over the cu_seqlens runs that have active tokens
    (``active`` bool [N], None = all). Branch-free passes (a masked fill is several times
    slower on a scattered mask):

    * all active: integer min/max reduceat on the versions, no copy;
    * versions within a 255-wide window (the usual case: a few policy versions in flight):
      lags hi - v as uint8 (a quarter of the bytes), inactive tokens set to 255 by an OR
      for the min and to 0 by an AND for the max, min/max reduceat; a min lag of 255 = a
      sequence with no active token;
    * otherwise: the versions as floats with NaN on inactive tokens (added as 0/active)
      and fmin/fmax.reduceat (NaN-ignoring). float32 holds every |version| < 2**24
      exactly; a result at or beyond that is redone in float64.
    """
    offs = cu[:-1][cu[1:] > cu[:-1]]  # non-empty sequences (empty ones have no tokens)
    if offs.size == 0:
        return np.zeros(0), np.zeros(0)
    if active is None:
        return (np.minimum.reduceat(v, offs).astype(np.float64),
                np.maximum.reduceat(v, offs).astype(np.float64))
    lo, hi = (int(b) for b in torch.aminmax(torch.from_numpy(v)))  # one pass (numpy: two)
    if hi - lo <= 254:
        # hi - v in 0..254, computed mod 256 (unsafe casting wraps) in one pass
        lag = np.subtract(np.uint8(hi & 0xFF), v, dtype=np.uint8, casting="unsafe")
        off = np.subtract(active.view(np.uint8), np.uint8(1), dtype=np.uint8)  # 255 inactive
        lag_min = np.minimum.reduceat(np.bitwise_or(lag, off), offs)
        lag_max = np.maximum.reduceat(np.bitwise_and(lag, np.bitwise_not(off, out=off),
                                                     out=lag), offs)
        keep = lag_min != 255
        return ((hi - lag_max[keep].astype(np.float64)),
                (hi - lag_min[keep].astype(np.float64)))
    first = last = np.zeros(0)
    for dt in (np.float32, np.float64):
        w = v.astype(dt)
        with np.errstate(invalid="ignore"):
            w += np.divide(dt(0), active, dtype=dt)  # 0 on active tokens, NaN elsewhere
        first = np.fmin.reduceat(w, offs)
        last = np.fmax.reduceat(w, offs)
        keep = ~np.isnan(first)
        first, last = first[keep], last[keep]
        if not (np.abs(first).max(initial=0) >= 2**24 or np.abs(last).max(initial=0) >= 2**24):
            break
    return first.astype(np.float64), last.astype(np.float64)
