"""The hook through which old logprobs reach the loss.

A trajectory may carry an optional ``old_logprobs`` column: logprobs of the generated tokens
under the weights that produced them, computed by the trainer side at interruption time
(strategy (3) of arXiv 2605.12070: before a weight update, the still-loaded version scores
the in-flight partial prefixes). After batch assembly that column is a tensor with NaN
where it is absent. ``fill_old_logprobs`` keeps every present value and fills the NaN
positions with a strategy:

* ``"behavior"``: log mu (the engine's logprob; pi_old = mu, i.e. bypass).
* ``"current"``: sg[log pi] of the current weights (on-policy assumption).
* ``"loglinear"``: AReaL's version interpolation log mu + alpha (log pi - log mu).
* ``snapshot_strategy(store, run)``: exact recompute from the snapshot of each token's
  version (tokens grouped by version; only the missing tokens are computed).
* ``ewma_strategy(tracker, run)``: logprobs under the EWMA proximal weights.
* any callable ``(missing_index [K] long, ctx: FillContext) -> Tensor [K]``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..corrections.decoupled import version_alpha
from .ewma import EwmaWeightTracker
from .snapshots import Runner, WeightSnapshotStore


@dataclass
class FillContext:
    """What a strategy may use; all [N] (flattened inside the strategy)."""

    rollout_logprobs: Tensor | None = None  # log mu
    logprobs: Tensor | None = None  # current policy log pi (detached inside)
    versions: Tensor | None = None  # policy_version per token
    learner_version: int | None = None
    loss_mask: Tensor | None = None  # only active tokens (> 0) are filled

    def active(self, n: int) -> Tensor:
        """bool [N]: the tokens a strategy fills. loss_mask > 0 when given; otherwise the
        tokens with a version >= 0 (collate writes -1 on prompt and padding positions);
        otherwise every token."""
        if self.loss_mask is not None:
            return self.loss_mask.reshape(-1) > 0
        if self.versions is not None:
            return self.versions.reshape(-1) >= 0
        return torch.ones(n, dtype=torch.bool)

    def need(self, name: str) -> Tensor:
        t = getattr(self, name)
        if t is None:
            raise ValueError(f"this fill strategy needs FillContext.{name}")
        return t.reshape(-1)


Strategy = Callable[[Tensor, FillContext], Tensor]


def _behavior(idx: Tensor, ctx: FillContext) -> Tensor:
    return ctx.need("rollout_logprobs")[idx]


def _current(idx: Tensor, ctx: FillContext) -> Tensor:
    return ctx.need("logprobs").detach()[idx]


def _loglinear(idx: Tensor, ctx: FillContext) -> Tensor:
    if ctx.learner_version is None:
        raise ValueError("the loglinear fill strategy needs FillContext.learner_version")
    mu = ctx.need("rollout_logprobs")[idx]
    lp = ctx.need("logprobs").detach()[idx]
    alpha = version_alpha(ctx.need("versions")[idx], ctx.learner_version, lp.dtype)
    return mu + alpha * (lp - mu)


STRATEGIES: dict[str, Strategy] = {"behavior": _behavior, "current": _current,
                                   "loglinear": _loglinear}


def snapshot_strategy(store: WeightSnapshotStore, run: Runner) -> Strategy:
    """Exact pi_old: recompute the missing tokens with their own version's snapshot."""

    def strat(idx: Tensor, ctx: FillContext) -> Tensor:
        v = ctx.need("versions")
        out = store.recompute(v, run, token_index=idx, missing="raise")
        return out.reshape(-1)[idx]

    return strat


def ewma_strategy(tracker: EwmaWeightTracker, run: Runner) -> Strategy:
    """pi_prox of PPO-EWMA: logprobs of the missing tokens under the EWMA weights."""

    def strat(idx: Tensor, ctx: FillContext) -> Tensor:
        if not tracker.weights:
            raise ValueError("the EWMA tracker has no weights yet (call update first)")
        return run(tracker.weights, idx)

    return strat


def fill_old_logprobs(old_logprobs: Tensor | None, strategy: str | Strategy,
                      ctx: FillContext, shape: torch.Size | None = None
                      ) -> tuple[Tensor, dict[str, int]]:
    """(filled old logprobs, counts) keeping present values, filling NaN with ``strategy``.

    Only active tokens are filled (``FillContext.active``: loss_mask > 0, else version >= 0):
    NaN at prompt and padding positions of a collated batch stays NaN (the losses ignore
    masked positions) and is never handed to a strategy (a snapshot strategy has no
    version -1). ``old_logprobs`` None means the column is absent everywhere (``shape`` or the context's
    rollout_logprobs give the shape). The result is detached. counts: ``present`` (values kept), ``filled``,
    ``left_inactive`` (NaN left at masked positions).
    """
    if old_logprobs is None:
        ref = ctx.rollout_logprobs if ctx.rollout_logprobs is not None else ctx.logprobs
        if shape is None and ref is None:
            raise ValueError("no old_logprobs column and no shape to build one")
        shp = shape if shape is not None else ref.shape  # type: ignore[union-attr]
        dtype = ref.dtype if ref is not None else torch.float32
        old_logprobs = torch.full(shp, float("nan"), dtype=dtype)
    strat = STRATEGIES.get(strategy) if isinstance(strategy, str) else strategy
    if strat is None:
        raise ValueError(f"unknown fill strategy {strategy!r}; known: {sorted(STRATEGIES)}")
    flat = old_logprobs.detach().reshape(-1).clone()
    nan = torch.isnan(flat)
    n_nan = int(nan.sum())
    missing = nan & ctx.active(flat.numel()).to(flat.device)
    idx = missing.nonzero().reshape(-1)
    if idx.numel():
        vals = strat(idx, ctx)
        if vals.shape != idx.shape:
            raise ValueError(f"fill strategy returned {tuple(vals.shape)} for {idx.numel()} tokens")
        flat[idx] = vals.detach().to(flat.dtype)
        if bool(torch.isnan(flat[idx]).any()):
            raise ValueError("fill strategy produced NaN old logprobs")
    counts = {"present": flat.numel() - n_nan, "filled": int(idx.numel()),
              "left_inactive": n_nan - int(idx.numel())}
    return flat.reshape(old_logprobs.shape), counts
