"""The demo's learner: plain PyTorch (transformers' Qwen3-MoE) on the engine's own weights.

One :class:`Learner` owns the model and the optimizer. :meth:`Learner.train_step` takes
trajectories (``Sample``: prompt, response, the gateway's per-token stamps, a reward),
computes group-relative advantages, packs the batch (THD, ``learner_client.megatron.packing``),
computes ``log pi`` with routing replay (R3) when asked, applies the chosen registered
correction (``learner_client.corrections.LOSSES``) and takes one optimizer step.
:meth:`Learner.save` writes a checkpoint in the engine's format for the hot-swap.

pi_old: every batch gets exactly one optimizer step, so the proximal policy is the weights
before that step; the learner fills ``old_logprobs`` with its own detached ``log pi`` on the
response tokens (never NaN), which is what AReaL's decoupled objective uses as pi_prox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from learner_client.corrections import LossInputs, advantages, get_loss
from learner_client.hf import load_model, packed_logprobs, save_for_engine
from learner_client.megatron.packing import PackSample, pack_samples

#: loss metrics that count rejected (masked / gated) tokens, whichever the loss reports
MASK_METRICS = ("mask_rate", "behav_mask_rate", "gate_rate", "mis_reject_rate")


@dataclass
class Sample:
    """One trajectory as the learner trains on it (numpy columns over response tokens)."""

    prompt_ids: np.ndarray  # [P]
    response_ids: np.ndarray  # [T]
    rollout_logprobs: np.ndarray  # [T] log mu (the engine's stamp)
    entropy: np.ndarray  # [T]
    versions: np.ndarray  # [T] policy_version per token
    reward: float
    group: str
    routed_experts: np.ndarray | None = None  # [P+T-1, L, K] (R3), or None
    loss_mask: np.ndarray | None = None  # [T] 0 = masked by the gateway's stale policy
    kv_versions: np.ndarray | None = None


@dataclass
class StepResult:
    loss: float
    metrics: dict[str, float]
    tokens: int
    reward_mean: float
    clip_rate: float
    mask_rate: float
    mismatch: float  # mean |log pi - log mu| on tokens generated (weights and KV) by the
    # current weights: what differs between the engine and the learner, not staleness
    policy_gap: float = float("nan")  # mean |log pi - log mu| on all active tokens:
    # staleness and mismatch together
    lags: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0, np.int64))


def pack_batch(samples: list[Sample], replay: bool):
    """GRPO advantages per group, then the THD packing both learners consume."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    gids = {g: i for i, g in enumerate(dict.fromkeys(s.group for s in samples))}
    group_ids = torch.tensor([gids[s.group] for s in samples])
    adv = advantages.grpo_advantages(rewards, group_ids).to(torch.float32).numpy()
    packs = []
    for s, a in zip(samples, adv):
        t = s.response_ids.shape[0]
        cols = {"rollout_logprobs": s.rollout_logprobs, "entropy": s.entropy,
                "versions": s.versions, "advantages": np.float32(a),
                "loss_mask": (np.ones(t, np.float32) if s.loss_mask is None
                              else s.loss_mask.astype(np.float32))}
        if s.kv_versions is not None:
            cols["kv_versions"] = s.kv_versions
        packs.append(PackSample(s.prompt_ids, s.response_ids, cols,
                                s.routed_experts if replay else None))
    return pack_samples(packs)


def step_result(samples: list[Sample], batch, lp: torch.Tensor, loss: torch.Tensor,
                metrics: dict[str, torch.Tensor], version: int) -> StepResult:
    """Diagnostics of one step (``lp``: log pi before the step, on the response tokens)."""
    cols = batch.columns
    mask = batch.loss_mask() > 0
    versions = cols["versions"].to(torch.int64)
    m = {k: float(v) for k, v in metrics.items() if v.numel() == 1}
    diff = (lp.detach() - cols["rollout_logprobs"]).abs()
    # train-inference mismatch: tokens whose weights and KV were the learner's own
    fresh = (versions == version) & mask
    if "kv_versions" in cols:
        fresh &= cols["kv_versions"].to(torch.int64) == version
    mismatch = float(diff[fresh].mean()) if bool(fresh.any()) else float("nan")
    gap = float(diff[mask].mean()) if bool(mask.any()) else float("nan")
    return StepResult(
        loss=float(loss.detach()), metrics=m, tokens=int(batch.num_response_tokens),
        reward_mean=float(np.mean([s.reward for s in samples])),
        clip_rate=m.get("clipfrac", 0.0), mask_rate=sum(m.get(k, 0.0) for k in MASK_METRICS),
        mismatch=mismatch, policy_gap=gap, lags=(version - versions[mask]).numpy())


def make_optimizer(name: str, params, lr: float) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {name!r}")


def _quiet_transformers() -> None:
    """No per-checkpoint progress bars from transformers (the demo has its own)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class Learner:
    def __init__(self, checkpoint: str | Path, *, loss: str = "sat",
                 loss_config: dict[str, Any] | None = None, lr: float = 3e-3,
                 temperature: float = 1.0, replay: bool = True, version: int = 0,
                 grad_clip: float = 1.0, optimizer: str = "adam") -> None:
        self.spec = get_loss(loss)
        self.loss_name = loss
        self.loss_config = self.spec.config(loss_config)
        _quiet_transformers()
        self.model = load_model(checkpoint)
        self.model.train()
        # a KL-regularized loss (GRPO's k3 term) gets pi_ref = the starting weights, frozen
        self.ref_model = None
        if float(getattr(self.loss_config, "kl_coef", 0.0) or 0.0) > 0:
            import copy

            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.opt = make_optimizer(optimizer, self.model.parameters(), lr)
        self.temperature = temperature
        self.replay = replay
        self.version = version
        self.grad_clip = grad_clip

    def train_step(self, samples: list[Sample], prox_model: Any = None) -> StepResult:
        """One optimizer step on ``samples`` (whole GRPO groups); ``version`` += 1.

        ``prox_model``: a model whose logprobs are pi_prox (``old_logprobs``), e.g. the
        PPO-EWMA weights; default: this learner's weights before the step."""
        if not samples:
            raise ValueError("train_step needs at least one sample")
        batch = pack_batch(samples, self.replay)
        lp, _ = packed_logprobs(self.model, batch, temperature=self.temperature,
                                replay=self.replay)
        cols = batch.columns
        mask = batch.loss_mask()
        versions = cols["versions"].to(torch.int64)
        prox = lp.detach()
        if prox_model is not None:
            with torch.no_grad():
                prox, _ = packed_logprobs(prox_model, batch, temperature=self.temperature,
                                          replay=self.replay)
        ref = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref, _ = packed_logprobs(self.ref_model, batch, temperature=self.temperature,
                                         replay=self.replay)
        inputs = LossInputs(
            logprobs=lp, rollout_logprobs=cols["rollout_logprobs"],
            advantages=cols["advantages"], loss_mask=mask,
            old_logprobs=torch.where(mask > 0, prox, cols["rollout_logprobs"]),
            ref_logprobs=ref, entropy=cols["entropy"], versions=versions,
            learner_version=self.version,
            cu_seqlens=batch.cu_response.to(torch.int64))
        loss, metrics = self.spec.fn(inputs, self.loss_config)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()
        res = step_result(samples, batch, lp, loss, metrics, self.version)
        self.version += 1
        return res

    def save(self, directory: str | Path) -> Path:
        """The current weights as an engine checkpoint (atomic), for the hot-swap."""
        return save_for_engine(self.model, directory)
