"""Staleness monitor for asynchronous GRPO (after arXiv 2607.01083, Song, Xu et al. 2026,
"Staleness-Learning Rate Scaling Laws for Asynchronous RLHF"; abstract-level).

With max rollout lag S and learning rate eta, stale rollouts add a per-step
surrogate-gradient bias of order O(S * eta); stability needs
    eta << min{ R_batch / (S * G_upd), R_crit / (T * G_upd) }
(G_upd bounds the per-step update-direction norm, T = learner steps so far, R_batch = the
drift at which a batch leaves the clip band, R_crit = a critical cumulative drift). The
first term binds (stale-limited regime: the max stable eta scales like 1/S) while
S / T > R_batch / R_crit; otherwise the horizon term binds and the max stable eta does not
depend on S.

Per step the monitor reports S (max lag over the batch's active tokens), S * eta, the
cumulative drift (sum of eta_t * ||update direction_t|| when norms are given, else
T * eta * G_upd), both terms of the bound, which one binds, and the eta bound for the
observed S. ``scaled_lr`` lowers a base learning rate like 1/S only where the stale term
binds. Pure: no I/O, no logging.

The bound's constants come from the config when set, else from the run (proxies; the
paper gives no estimators, these definitions are ours). Two different observables feed
R_batch and R_crit, so their ratio (where the regimes switch) is measured, not fixed:
* G_upd: the largest update-direction norm ||u_t|| seen so far (``update_norm``).
* kappa, c: a token of lag L was sampled D_T - D_{T-L} of cumulative drift ago (D = sum
  eta_k ||u_k||); each step pairs x_t = that drift averaged over the active tokens with
  y_t = mean |log pi - log mu| over them (``log_ratio``) and fits y = c + kappa x (least
  squares with an intercept in [0, min y]: c is the train-inference mismatch at zero
  drift; it is identified by batches of different drift, e.g. the first steps of a run).
* R_batch = (log(1 + clip_eps) - c) / kappa (0 when c already exceeds the band): the
  drift at which the typical token of a batch leaves the clip band [1 - eps, 1 + eps].
* kappa_ref, c_ref: each step pairs the cumulative drift D_T with the mean
  |log pi - log pi_ref| over the active tokens (``ref_log_ratio``, pi_ref = the policy
  at the monitor's first step) and fits y = c_ref + kappa_ref D (with an intercept).
* R_crit = (crit_log_ratio - c_ref) / kappa_ref: the cumulative drift at which the
  typical token's probability has moved by crit_log_ratio from where the run started
  (default 1: e-fold). Without ``ref_log_ratio`` (and no configured r_crit) R_crit is
  unknown and the bound has its stale term only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor


class StalenessMonitorConfig(BaseModel):
    """Constants of the stability bound; leave None when unknown (then estimated)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    g_upd: float | None = Field(
        None, gt=0, description="G_upd: bound on the per-step update-direction norm; used for "
                                "the drift when no per-step norm is given, and in the bound.")
    r_batch: float | None = Field(
        None, gt=0, description="R_batch: drift at which a batch leaves the clip band.")
    r_crit: float | None = Field(
        None, gt=0, description="R_crit: critical cumulative drift.")
    clip_eps: float = Field(
        0.2, gt=0, description="Clip half-width whose band defines the estimated R_batch.")
    crit_log_ratio: float = Field(
        1.0, gt=0, description="Log-ratio drift from the starting policy that defines the "
                               "estimated R_crit.")


Binding = Literal["stale", "horizon"]


@dataclass(frozen=True)
class StalenessReport:
    step: int  # T, learner steps reported so far (this one included)
    max_lag: int  # S over active tokens of this batch
    mean_lag: float  # mean lag over active tokens
    lr: float  # eta used this step
    s_eta: float  # S * eta: order of the per-step stale-gradient bias
    cumulative_drift: float  # sum_t eta_t * ||u_t||, or T * eta * G_upd
    eta_bound: float | None  # min{R_batch/(S G), R_crit/(T G)} over the known terms
    lr_over_bound: float | None  # eta / eta_bound (>= 1: outside the stable regime)
    g_upd: float | None = None  # G_upd used (config, else the largest ||u_t|| seen)
    r_batch: float | None = None  # R_batch used (config, else (log(1+eps) - c)/kappa)
    r_crit: float | None = None  # R_crit used (config, else (crit - c_ref)/kappa_ref)
    kappa: float | None = None  # fitted log-ratio drift per unit parameter drift
    mismatch_floor: float | None = None  # c: fitted mean |log pi - log mu| at zero drift
    kappa_ref: float | None = None  # fitted |log pi - log pi_ref| per unit cumulative drift
    stale_term: float | None = None  # R_batch / (S G_upd)
    horizon_term: float | None = None  # R_crit / (T G_upd)
    binding: Binding | None = None  # the smaller term (None when either is unknown)
    batch_drift: float | None = None  # x_t: mean parameter drift behind this batch's tokens
    mean_abs_log_ratio: float | None = None  # y_t: mean |log pi - log mu| (active)
    mean_abs_ref_log_ratio: float | None = None  # mean |log pi - log pi_ref| (active)

    def as_dict(self) -> dict[str, float | int | str | None]:
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


class LineFit:
    """Running least squares y = c + k x with the intercept constrained to [0, min y]
    (y is a mean absolute log-ratio: the floor cannot be negative, nor above a value
    observed at some drift); None until two distinct x were seen."""

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.y_min = math.inf

    def add(self, x: float, y: float) -> None:
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y
        self.y_min = min(self.y_min, y)

    def fit(self) -> tuple[float, float] | None:
        """(slope k, intercept c), or None without two distinct x."""
        den = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or den <= 1e-12 * max(self.n * self.sxx, 1e-300):
            return None
        k = (self.n * self.sxy - self.sx * self.sy) / den
        c = (self.sy - k * self.sx) / self.n
        if not 0.0 <= c <= self.y_min:  # the constrained optimum sits on the bound
            c = min(max(c, 0.0), self.y_min)
            k = (self.sxy - c * self.sx) / self.sxx
        return k, c


def _radius(threshold: float, fit: tuple[float, float] | None) -> float | None:
    """Drift at which the fitted line y = c + k x reaches ``threshold`` (0 when c already
    does; None without a fit or with a slope <= 0)."""
    if fit is None or fit[0] <= 0:
        return None
    k, c = fit
    return max(threshold - c, 0.0) / k


def _mean_abs(t: Tensor | None, keep: Tensor) -> float | None:
    if t is None:
        return None
    d = torch.as_tensor(t).detach().reshape(-1).to(torch.float64)[keep]
    d = d[torch.isfinite(d)]
    return float(d.abs().mean()) if d.numel() else None


class StalenessMonitor:
    """Call ``step`` once per optimizer step; it returns a StalenessReport."""

    def __init__(self, config: StalenessMonitorConfig | None = None) -> None:
        self.config = config or StalenessMonitorConfig()
        self.steps = 0
        self.cumulative_drift = 0.0
        self.max_lag_seen = 0
        self.g_max: float | None = None  # largest ||u_t|| seen
        self._drift_hist: list[float] = [0.0]  # D_0, D_1, ... (cumulative drift per step)
        self._lag_fit = LineFit()  # mean |log pi - log mu| against the drift behind tokens
        self._ref_fit = LineFit()  # mean |log pi - log pi_ref| against D_T

    @property
    def kappa(self) -> float | None:
        f = self._lag_fit.fit()
        return f[0] if f is not None and f[0] > 0 else None

    @property
    def mismatch_floor(self) -> float | None:
        f = self._lag_fit.fit()
        return f[1] if f is not None and f[0] > 0 else None

    @property
    def kappa_ref(self) -> float | None:
        f = self._ref_fit.fit()
        return f[0] if f is not None and f[0] > 0 else None

    def constants(self) -> tuple[float | None, float | None, float | None]:
        """(G_upd, R_batch, R_crit): configured values, else the run's estimates."""
        c = self.config
        g = c.g_upd if c.g_upd is not None else self.g_max
        rb = c.r_batch if c.r_batch is not None else _radius(
            math.log1p(c.clip_eps), self._lag_fit.fit())
        rc = c.r_crit if c.r_crit is not None else _radius(
            c.crit_log_ratio, self._ref_fit.fit())
        return g, rb, rc

    def terms(self, max_lag: int, steps: int) -> tuple[float | None, float | None]:
        """(R_batch / (S G_upd), R_crit / (T G_upd)), None where a constant is unknown."""
        g, rb, rc = self.constants()
        if not g:
            return None, None
        stale = rb / (max(max_lag, 1) * g) if rb is not None else None
        horizon = rc / (max(steps, 1) * g) if rc is not None else None
        return stale, horizon

    def eta_bound(self, max_lag: int, steps: int) -> float | None:
        """min{R_batch / (S G_upd), R_crit / (T G_upd)} over the known terms."""
        known = [t for t in self.terms(max_lag, steps) if t is not None]
        return min(known) if known else None

    def binding(self, max_lag: int, steps: int) -> Binding | None:
        """Which term of the bound is smaller: "stale" (the max stable eta ~ 1/S) or
        "horizon" (independent of S); None when either term is unknown."""
        stale, horizon = self.terms(max_lag, steps)
        if stale is None or horizon is None:
            return None
        return "stale" if stale < horizon else "horizon"

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

    def scaled_lr(self, base_lr: float, max_lag: int, steps: int | None = None) -> float:
        """``base_lr`` lowered like 1/S only where staleness limits it: when the stale
        term of the bound binds at (S, T), base_lr * S_switch / S with S_switch = T *
        R_batch / R_crit (the lag at which the two terms are equal); ``base_lr``
        unchanged in the horizon-limited regime and while either constant is unknown
        (no evidence that S matters). ``steps`` defaults to the steps recorded so far."""
        t = max(self.steps if steps is None else int(steps), 1)
        s = max(int(max_lag), 1)
        _, rb, rc = self.constants()
        if rb is None or rc is None or rc <= 0:
            return base_lr
        s_switch = t * rb / rc
        return base_lr * min(1.0, s_switch / s)

    def step(self, lr: float, versions: Tensor, learner_version: int,
             mask: Tensor | None = None, update_norm: float | None = None,
             log_ratio: Tensor | None = None, ref_log_ratio: Tensor | None = None
             ) -> StalenessReport:
        """Record one learner step (call after the optimizer step of the batch).
        ``update_norm`` = ||u_t||, the update direction's norm (parameter change / lr);
        without it G_upd is used, and without either the drift stays unchanged.
        ``log_ratio`` = log pi - log mu on the batch grid (the loss' ratio before this
        step's update): with it the monitor fits kappa and the mismatch floor (R_batch).
        ``ref_log_ratio`` = log pi - log pi_ref on the same grid (pi_ref: the policy at
        the monitor's first step, before this step's update): with it the monitor fits
        kappa_ref (R_crit)."""
        if lr < 0:
            raise ValueError("lr must be >= 0")
        v = torch.as_tensor(versions).reshape(-1)
        keep = (torch.as_tensor(mask).reshape(-1) > 0) if mask is not None else (v >= 0)
        s, mean_lag = batch_lags(versions, learner_version, mask)
        x = self._batch_drift(versions, learner_version, keep)
        y = _mean_abs(log_ratio, keep)
        if y is not None:
            self._lag_fit.add(x, y)
        y_ref = _mean_abs(ref_log_ratio, keep)
        if y_ref is not None:
            self._ref_fit.add(self.cumulative_drift, y_ref)
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
        stale, horizon = self.terms(s, self.steps)
        bound = self.eta_bound(s, self.steps)
        g_used, rb, rc = self.constants()
        return StalenessReport(
            step=self.steps, max_lag=s, mean_lag=mean_lag, lr=lr, s_eta=s * lr,
            cumulative_drift=self.cumulative_drift, eta_bound=bound,
            lr_over_bound=(lr / bound if bound else (math.inf if bound == 0 else None)),
            g_upd=g_used, r_batch=rb, r_crit=rc, kappa=self.kappa,
            mismatch_floor=self.mismatch_floor, kappa_ref=self.kappa_ref,
            stale_term=stale, horizon_term=horizon, binding=self.binding(s, self.steps),
            batch_drift=x, mean_abs_log_ratio=y, mean_abs_ref_log_ratio=y_ref)
