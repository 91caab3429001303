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


class RevisedPPOEWMA:
    """The revised PPO-EWMA wired end to end: EWMA proximal weights, pi_prox filled from
    them, the registered ``ppo_ewma_revised`` loss, the window tied to the observed
    staleness and the reset rule.

    Per optimizer step::

        loss, metrics = ewma.loss(inputs)      # fills old_logprobs = log pi_prox
        loss.backward(); optimizer.step()
        ewma.after_step(model.state_dict(), metrics)

    ``run(weights, token_index) -> logprobs [K]`` scores the batch's tokens with given
    weights (``snapshots.functional_runner``). ``loss`` sets beta from W_stale = S + 1
    (S = max lag of the batch's active tokens); ``after_step`` folds theta into the EWMA
    and resets theta_prox <- theta when the loss's active-token fraction < the threshold.
    Before the first ``after_step`` the tracker starts from ``initial`` weights.
    """

    def __init__(self, run, initial: Weights, config=None, **tracker_kw) -> None:
        from learner_client.corrections import get_loss

        self.spec = get_loss("ppo_ewma_revised")
        self.config = self.spec.config(config)
        self.run = run
        self.tracker = EwmaWeightTracker(reset_threshold=self.config.reset_threshold,
                                         **tracker_kw)
        self.tracker.update(initial)
        self.window = 1

    def loss(self, inputs):
        from learner_client.corrections.decoupled import observed_window

        if inputs.versions is not None and inputs.learner_version is not None:
            self.window = observed_window(inputs.flat("versions"), inputs.learner_version,
                                          inputs.active)
            self.tracker.set_window(self.window)
        idx = torch.nonzero(inputs.active).reshape(-1)
        old = torch.zeros(inputs.num_tokens, dtype=inputs.logprobs.dtype,
                          device=inputs.logprobs.device)
        if idx.numel():
            old[idx] = self.run(self.tracker.weights, idx).to(old.device, old.dtype)
        filled = inputs.replace(old_logprobs=old.reshape(inputs.logprobs.shape))
        return self.spec.fn(filled, self.config)

    def after_step(self, theta: Weights, metrics) -> bool:
        """EWMA update with the new weights; True when the reset rule fired."""
        self.tracker.update(theta)
        return self.tracker.maybe_reset(metrics["active_token_fraction"], theta)
