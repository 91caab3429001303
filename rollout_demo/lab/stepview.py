"""The small pieces the theory and old-logit presets share: one optimizer step that exposes
what the loss saw (log pi, log mu, versions), the held-out evaluation of the current
policy, and the flattened surrogate gradient of a batch.

The model and task are the lab's (the toy Qwen3-MoE of ``reference_engine`` on the
character-class task of ``rollout_demo.task``); nothing here is specific to a paper.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from learner_client.corrections import LossInputs
from learner_client.hf import packed_logprobs
from rollout_demo import task
from rollout_demo.learner import Learner, Sample, pack_batch
from rollout_demo.sampler import sample_groups

#: batch shape of every run: 3 prompts x 8 samples x 8 new tokens
GROUPS, GROUP_SIZE, MAX_NEW = 3, 8, 8
#: the held-out evaluation: these prompts, 4 samples each, one fixed sampling stream
EVAL_SEED, EVAL_PROMPTS, EVAL_SAMPLES = 10_007, 8, 6


@dataclass
class StepView:
    """What one optimizer step saw (all over the batch's active response tokens)."""

    loss: float
    logprobs: torch.Tensor  # log pi before the step [N]
    rollout_logprobs: torch.Tensor  # log mu [N]
    versions: torch.Tensor  # [N]
    mask: torch.Tensor  # [N] float
    metrics: dict[str, float]
    update_norm: float  # ||theta_after - theta_before|| / lr
    ref_logprobs: torch.Tensor | None = None  # log pi_ref [N] when a ref model was given


def eval_prompts() -> list[list[int]]:
    rng = random.Random(EVAL_SEED)
    return [task.make_prompt(rng)[1] for _ in range(EVAL_PROMPTS)]


@torch.no_grad()
def held_out(model: Any) -> tuple[float, float]:
    """(mean reward, mean per-token entropy in nats) of the current weights on the fixed
    held-out prompts (fresh samples from one fixed stream, so two policies are compared on
    the same randomness). The task's optimum is uniform within a class (entropy ln 10 to
    ln 26), so an entropy near 0 is a degenerate policy whatever its reward."""
    gen = torch.Generator().manual_seed(EVAL_SEED)
    samples = sample_groups(model, eval_prompts(), EVAL_SAMPLES, MAX_NEW, temperature=1.0,
                            version=0, groups=[f"eval-{j}" for j in range(EVAL_PROMPTS)],
                            reward_fn=task.reward, generator=gen)
    return (float(np.mean([s.reward for s in samples])),
            float(np.mean([s.entropy.mean() for s in samples])))


def held_out_eval(model: Any) -> float:
    """Mean held-out reward of the current weights (see :func:`held_out`)."""
    return held_out(model)[0]


def sample_batch(sampler: Any, rng: random.Random, gen: torch.Generator, version: int,
                 tag: str) -> list[Sample]:
    prompts = [task.make_prompt(rng)[1] for _ in range(GROUPS)]
    return sample_groups(sampler, prompts, GROUP_SIZE, MAX_NEW, temperature=1.0,
                         version=version, groups=[f"{tag}-{j}" for j in range(GROUPS)],
                         reward_fn=task.reward, generator=gen)


def _inputs(learner: Learner, samples: list[Sample], old_logprobs: torch.Tensor | None = None):
    batch = pack_batch(samples, learner.replay)
    lp, _ = packed_logprobs(learner.model, batch, temperature=learner.temperature,
                            replay=learner.replay)
    cols = batch.columns
    mask = batch.loss_mask()
    old = lp.detach() if old_logprobs is None else old_logprobs
    inputs = LossInputs(
        logprobs=lp, rollout_logprobs=cols["rollout_logprobs"],
        advantages=cols["advantages"], loss_mask=mask,
        old_logprobs=torch.where(mask > 0, old, cols["rollout_logprobs"]),
        entropy=cols["entropy"], versions=cols["versions"].to(torch.int64),
        learner_version=learner.version, cu_seqlens=batch.cu_response.to(torch.int64))
    return batch, lp, inputs


def logprobs_under(model: Any, learner: Learner, samples: list[Sample]) -> torch.Tensor:
    """log prob [N] of the batch's response tokens under ``model`` (no grad)."""
    batch = pack_batch(samples, learner.replay)
    with torch.no_grad():
        lp, _ = packed_logprobs(model, batch, temperature=learner.temperature,
                                replay=learner.replay)
    return lp


def surrogate_grad(learner: Learner, samples: list[Sample]) -> torch.Tensor:
    """The flattened gradient (float64) of the learner's loss on ``samples`` at its current
    weights; no optimizer step, no gradient clipping."""
    _, _, inputs = _inputs(learner, samples)
    loss, _ = learner.spec.fn(inputs, learner.loss_config)
    params = [p for p in learner.model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1).double()
                      for g, p in zip(grads, params)])


def train_step(learner: Learner, samples: list[Sample], *, ref_model: Any = None,
               old_logprobs: torch.Tensor | None = None, loss_fn: Any = None) -> StepView:
    """One optimizer step like ``Learner.train_step`` (gradient clipping included),
    returning what the loss saw and the update's norm. ``old_logprobs`` [N]: pi_old for
    the losses that use it (default: the learner's own detached log pi). ``loss_fn``:
    ``inputs -> (loss, metrics)`` instead of the learner's registered loss."""
    batch, lp, inputs = _inputs(learner, samples, old_logprobs)
    ref = None
    if ref_model is not None:
        with torch.no_grad():
            ref, _ = packed_logprobs(ref_model, batch, temperature=learner.temperature,
                                     replay=learner.replay)
    if loss_fn is None:
        loss, metrics = learner.spec.fn(inputs, learner.loss_config)
    else:
        loss, metrics = loss_fn(inputs)
    before = [p.detach().clone() for p in learner.model.parameters()]
    learner.opt.zero_grad(set_to_none=True)
    loss.backward()
    if learner.grad_clip:
        torch.nn.utils.clip_grad_norm_(learner.model.parameters(), learner.grad_clip)
    learner.opt.step()
    lr = learner.opt.param_groups[0]["lr"]
    delta = math.sqrt(sum(float(((p.detach() - b) ** 2).sum())
                          for p, b in zip(learner.model.parameters(), before)))
    cols = batch.columns
    view = StepView(loss=float(loss.detach()), logprobs=lp.detach(),
                    rollout_logprobs=cols["rollout_logprobs"],
                    versions=cols["versions"].to(torch.int64), mask=batch.loss_mask(),
                    metrics={k: float(v) for k, v in metrics.items() if v.numel() == 1},
                    update_norm=delta / lr if lr > 0 else 0.0, ref_logprobs=ref)
    learner.version += 1
    return view


def set_lr(learner: Learner, lr: float) -> None:
    for g in learner.opt.param_groups:
        g["lr"] = lr
