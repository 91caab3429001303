"""Staleness monitor for asynchronous GRPO (after arXiv 2607.01083, abstract-level).

With max rollout lag S and learning rate eta, stale rollouts add a per-step
surrogate-gradient bias of order O(S * eta); stability needs
    eta << min{ R_batch / (S * G_upd), R_crit / (T * G_upd) }
(G_upd bounds the per-step update-direction norm, T = learner steps so far, R_batch = the
drift at which a batch leaves the clip band, R_crit = a critical cumulative drift).
Consequences a learner can watch: the max stable eta scales like 1/S; collapse time * S *
eta ~ constant.

Per step the monitor reports S (max lag over the batch's active tokens), S * eta, the
cumulative drift (sum of eta_t * ||update direction_t|| when norms are given, else
T * eta * G_upd), and, when R_batch / R_crit / G_upd are configured, the eta bound. It also
offers ``scaled_lr``: a base learning rate scaled by 1/S. Pure: no I/O, no logging.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor


class StalenessMonitorConfig(BaseModel):
    """Constants of the stability bound; leave None when unknown (the bound is then None)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    g_upd: float | None = Field(
        None, gt=0, description="G_upd: bound on the per-step update-direction norm; used for "
                                "the drift when no per-step norm is given, and in the bound.")
    r_batch: float | None = Field(
        None, gt=0, description="R_batch: drift at which a batch leaves the clip band.")
    r_crit: float | None = Field(
        None, gt=0, description="R_crit: critical cumulative drift.")
    s_ref: int = Field(
        1, ge=1, description="Lag at which scaled_lr returns the base lr unchanged (lr*s_ref/S).")


@dataclass(frozen=True)
class StalenessReport:
    step: int  # T, learner steps reported so far (this one included)
    max_lag: int  # S over active tokens of this batch
    mean_lag: float  # mean lag over active tokens
    lr: float  # eta used this step
    s_eta: float  # S * eta: order of the per-step stale-gradient bias
    cumulative_drift: float  # sum_t eta_t * ||u_t||, or T * eta * G_upd
    eta_bound: float | None  # min{R_batch/(S G), R_crit/(T G)} when configured
    lr_over_bound: float | None  # eta / eta_bound (>= 1: outside the stable regime)

    def as_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


def batch_lags(versions: Tensor, learner_version: int, mask: Tensor | None = None
               ) -> tuple[int, float]:
    """(max lag S, mean lag) over active tokens; (0, 0.0) when none is active. Without a
    mask the tokens with a version >= 0 count (collate's -1 marks prompt and padding)."""
    v = torch.as_tensor(versions).reshape(-1).to(torch.int64)
    lag = int(learner_version) - v
    if mask is not None:
        lag = lag[torch.as_tensor(mask).reshape(-1) > 0]
    else:
        lag = lag[v >= 0]
    if lag.numel() == 0:
        return 0, 0.0
    return int(lag.max()), float(lag.to(torch.float64).mean())


class StalenessMonitor:
    """Call ``step`` once per optimizer step; it returns a StalenessReport."""

    def __init__(self, config: StalenessMonitorConfig | None = None) -> None:
        self.config = config or StalenessMonitorConfig()
        self.steps = 0
        self.cumulative_drift = 0.0
        self.max_lag_seen = 0

    def eta_bound(self, max_lag: int, steps: int) -> float | None:
        c = self.config
        if c.g_upd is None:
            return None
        terms = []
        if c.r_batch is not None:
            terms.append(c.r_batch / (max(max_lag, 1) * c.g_upd))
        if c.r_crit is not None:
            terms.append(c.r_crit / (max(steps, 1) * c.g_upd))
        return min(terms) if terms else None

    def scaled_lr(self, base_lr: float, max_lag: int) -> float:
        """base_lr * s_ref / max(S, s_ref): the max stable eta scales like 1/S."""
        s_ref = self.config.s_ref
        return base_lr * s_ref / max(int(max_lag), s_ref)

    def step(self, lr: float, versions: Tensor, learner_version: int,
             mask: Tensor | None = None, update_norm: float | None = None) -> StalenessReport:
        """Record one learner step. ``update_norm`` = ||u_t||, the update direction's norm
        (parameter change / lr); without it G_upd is used, and without either the drift
        term stays unchanged."""
        if lr < 0:
            raise ValueError("lr must be >= 0")
        s, mean_lag = batch_lags(versions, learner_version, mask)
        self.steps += 1
        self.max_lag_seen = max(self.max_lag_seen, s)
        g = update_norm if update_norm is not None else self.config.g_upd
        if g is not None:
            self.cumulative_drift += lr * float(g)
        bound = self.eta_bound(s, self.steps)
        return StalenessReport(
            step=self.steps, max_lag=s, mean_lag=mean_lag, lr=lr, s_eta=s * lr,
            cumulative_drift=self.cumulative_drift, eta_bound=bound,
            lr_over_bound=(lr / bound) if bound else None)
