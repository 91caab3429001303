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
T * eta * G_upd), and the eta bound for the observed S. It also offers ``scaled_lr``: a
base learning rate scaled by 1/S. Pure: no I/O, no logging.

The bound's constants come from the config when set, else from the run (proxies; the
theory paper is abstract-level, these definitions are ours):
* G_upd: the largest update-direction norm ||u_t|| seen so far (``update_norm``).
* kappa: log-ratio drift per unit parameter drift. A token of lag L was sampled D_T -
  D_{T-L} of cumulative drift ago (D = sum eta_k ||u_k||); each step pairs x_t = that drift
  averaged over the active tokens with y_t = mean |log pi - log mu| over them (``log_ratio``)
  and kappa = sum x y / sum x^2 (least squares through the origin).
* R_batch = log(1 + clip_eps) / kappa: the drift at which the typical token of a batch
  leaves the clip band [1 - eps, 1 + eps].
* R_crit = crit_log_ratio / kappa: the cumulative drift at which the typical token's
  probability has moved by crit_log_ratio in log space (default 1: e-fold).
"""

from __future__ import annotations

import math
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
    clip_eps: float = Field(
        0.2, gt=0, description="Clip half-width whose band defines the estimated R_batch.")
    crit_log_ratio: float = Field(
        1.0, gt=0, description="Log-ratio drift that defines the estimated R_crit.")


@dataclass(frozen=True)
class StalenessReport:
    step: int  # T, learner steps reported so far (this one included)
    max_lag: int  # S over active tokens of this batch
    mean_lag: float  # mean lag over active tokens
    lr: float  # eta used this step
    s_eta: float  # S * eta: order of the per-step stale-gradient bias
    cumulative_drift: float  # sum_t eta_t * ||u_t||, or T * eta * G_upd
    eta_bound: float | None  # min{R_batch/(S G), R_crit/(T G)} when known
    lr_over_bound: float | None  # eta / eta_bound (>= 1: outside the stable regime)
    g_upd: float | None = None  # G_upd used (config, else the largest ||u_t|| seen)
    r_batch: float | None = None  # R_batch used (config, else log(1+eps)/kappa)
    r_crit: float | None = None  # R_crit used (config, else crit_log_ratio/kappa)
    kappa: float | None = None  # estimated log-ratio drift per unit parameter drift
    batch_drift: float | None = None  # x_t: mean parameter drift behind this batch's tokens
    mean_abs_log_ratio: float | None = None  # y_t: mean |log pi - log mu| (active)

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
        self.g_max: float | None = None  # largest ||u_t|| seen
        self._drift_hist: list[float] = [0.0]  # D_0, D_1, ... (cumulative drift per step)
        self._sxy = 0.0
        self._sxx = 0.0

    @property
    def kappa(self) -> float | None:
        return self._sxy / self._sxx if self._sxx > 0 and self._sxy > 0 else None

    def constants(self) -> tuple[float | None, float | None, float | None]:
        """(G_upd, R_batch, R_crit): configured values, else the run's estimates."""
        c = self.config
        g = c.g_upd if c.g_upd is not None else self.g_max
        k = self.kappa
        rb = c.r_batch if c.r_batch is not None else (
            math.log1p(c.clip_eps) / k if k else None)
        rc = c.r_crit if c.r_crit is not None else (c.crit_log_ratio / k if k else None)
        return g, rb, rc

    def eta_bound(self, max_lag: int, steps: int) -> float | None:
        """min{R_batch / (S G_upd), R_crit / (T G_upd)} over the known terms."""
        g, rb, rc = self.constants()
        if not g:
            return None
        terms = []
        if rb is not None:
            terms.append(rb / (max(max_lag, 1) * g))
        if rc is not None:
            terms.append(rc / (max(steps, 1) * g))
        return min(terms) if terms else None

    def _batch_drift(self, versions: Tensor, learner_version: int, keep: Tensor) -> float:
        """Mean over the kept tokens of D_T - D_{T-lag}: the parameter drift since each
        token's policy, from the recorded cumulative drift (lags beyond the record count
        the whole record)."""
        v = torch.as_tensor(versions).reshape(-1).to(torch.int64)[keep]
        if v.numel() == 0:
            return 0.0
        lag = (int(learner_version) - v).clamp_min(0)
        lags, counts = torch.unique(lag, return_counts=True)
        hist = self._drift_hist
        now = hist[-1]
        tot = 0.0
        for lg, cnt in zip(lags.tolist(), counts.tolist()):
            past = hist[max(len(hist) - 1 - lg, 0)]
            tot += (now - past) * cnt
        return tot / v.numel()

    def scaled_lr(self, base_lr: float, max_lag: int) -> float:
        """base_lr * s_ref / max(S, s_ref): the max stable eta scales like 1/S."""
        s_ref = self.config.s_ref
        return base_lr * s_ref / max(int(max_lag), s_ref)

    def step(self, lr: float, versions: Tensor, learner_version: int,
             mask: Tensor | None = None, update_norm: float | None = None,
             log_ratio: Tensor | None = None) -> StalenessReport:
        """Record one learner step (call after the optimizer step of the batch).
        ``update_norm`` = ||u_t||, the update direction's norm (parameter change / lr);
        without it G_upd is used, and without either the drift stays unchanged.
        ``log_ratio`` = log pi - log mu on the batch grid (the loss' ratio before this
        step's update): with it the monitor estimates kappa, R_batch and R_crit."""
        if lr < 0:
            raise ValueError("lr must be >= 0")
        v = torch.as_tensor(versions).reshape(-1)
        keep = (torch.as_tensor(mask).reshape(-1) > 0) if mask is not None else (v >= 0)
        s, mean_lag = batch_lags(versions, learner_version, mask)
        x = self._batch_drift(versions, learner_version, keep)
        y = None
        if log_ratio is not None:
            d = torch.as_tensor(log_ratio).detach().reshape(-1).to(torch.float64)[keep]
            d = d[torch.isfinite(d)]
            if d.numel():
                y = float(d.abs().mean())
                if x > 0:
                    self._sxy += x * y
                    self._sxx += x * x
        self.steps += 1
        self.max_lag_seen = max(self.max_lag_seen, s)
        if update_norm is not None:
            self.g_max = max(self.g_max or 0.0, float(update_norm))
        g = update_norm if update_norm is not None else self.config.g_upd
        if g is not None:
            self.cumulative_drift += lr * float(g)
        self._drift_hist.append(self.cumulative_drift)
        if len(self._drift_hist) > 4096:  # lags beyond that count the whole record
            self._drift_hist = self._drift_hist[-4096:]
        bound = self.eta_bound(s, self.steps)
        g_used, rb, rc = self.constants()
        return StalenessReport(
            step=self.steps, max_lag=s, mean_lag=mean_lag, lr=lr, s_eta=s * lr,
            cumulative_drift=self.cumulative_drift, eta_bound=bound,
            lr_over_bound=(lr / bound) if bound else None, g_upd=g_used, r_batch=rb,
            r_crit=rc, kappa=self.kappa, batch_drift=x, mean_abs_log_ratio=y)
