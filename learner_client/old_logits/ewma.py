"""Revised PPO-EWMA proximal weights (arXiv 2605.12070, after Hilton et al. 2021).

Debiased EWMA of the learner weights:
    W <- beta * W + 1
    theta_prox <- theta_prox * (beta * W_prev / W) + theta / W
with the staleness-aware decay beta = W_stale / (W_stale + 2), W_stale = width of the live
version window, and the auto-reset rule: theta_prox <- theta when the active-token
fraction after masking and clipping drops below 0.9 (``reset_threshold``).
The first update sets theta_prox = theta exactly (W_prev = 0).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from .snapshots import Weights


def staleness_beta(w_stale: int) -> float:
    """beta = W_stale / (W_stale + 2); 0 for W_stale = 0 (no history: theta_prox = theta)."""
    if w_stale < 0:
        raise ValueError("W_stale must be >= 0")
    return w_stale / (w_stale + 2.0)


class EwmaWeightTracker:
    """Holds theta_prox (float32 CPU copies by default) and the debiasing weight W."""

    def __init__(self, w_stale: int = 1, beta: float | None = None,
                 reset_threshold: float = 0.9, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = torch.float32) -> None:
        if beta is not None and not 0.0 <= beta < 1.0:
            raise ValueError("beta must be in [0, 1)")
        if not 0.0 <= reset_threshold <= 1.0:
            raise ValueError("reset_threshold must be in [0, 1]")
        self.beta = staleness_beta(w_stale) if beta is None else float(beta)
        self.reset_threshold = reset_threshold
        self.device = torch.device(device)
        self.dtype = dtype
        self.W = 0.0
        self.resets = 0
        self.updates = 0
        self._prox: dict[str, Tensor] = {}

    def set_window(self, w_stale: int) -> None:
        """Re-derive beta from the current live version window width."""
        self.beta = staleness_beta(w_stale)

    @property
    def weights(self) -> dict[str, Tensor]:
        """theta_prox (do not modify in place)."""
        return self._prox

    def _copy(self, t: Tensor) -> Tensor:
        return t.detach().to(device=self.device, dtype=self.dtype or t.dtype, copy=True)

    @torch.no_grad()
    def update(self, theta: Weights) -> None:
        """Fold the learner's current weights into theta_prox (call after each optimizer step)."""
        w_prev = self.W
        self.W = self.beta * w_prev + 1.0
        keep = self.beta * w_prev / self.W
        if not self._prox or keep == 0.0:
            self._prox = {k: self._copy(v) for k, v in theta.items()}
        else:
            inv_w = 1.0 / self.W
            for k, v in theta.items():
                p = self._prox[k]
                p.mul_(keep).add_(v.detach().to(p.device, p.dtype), alpha=inv_w)
        self.updates += 1

    @torch.no_grad()
    def reset(self, theta: Weights) -> None:
        """theta_prox <- theta; W <- 1 (as after a first update)."""
        self._prox = {k: self._copy(v) for k, v in theta.items()}
        self.W = 1.0
        self.resets += 1

    def maybe_reset(self, active_token_fraction: float | Tensor, theta: Weights) -> bool:
        """Auto-reset: reset to theta when the fraction < reset_threshold. True if it reset."""
        if float(active_token_fraction) < self.reset_threshold:
            self.reset(theta)
            return True
        return False

    def state_dict(self) -> dict[str, object]:
        return {"beta": self.beta, "W": self.W, "prox": dict(self._prox),
                "resets": self.resets, "updates": self.updates}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        self.beta = float(state["beta"])  # type: ignore[arg-type]
        self.W = float(state["W"])  # type: ignore[arg-type]
        prox = state["prox"]
        self._prox = {k: self._copy(v) for k, v in prox.items()}  # type: ignore[union-attr]
        self.resets = int(state.get("resets", 0))  # type: ignore[arg-type]
        self.updates = int(state.get("updates", 0))  # type: ignore[arg-type]
