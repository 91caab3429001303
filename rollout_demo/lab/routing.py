"""Routing replay (R3) shown to matter: the inference router differs from the learner's.

The preset ``routing-replay`` trains the toy Qwen3-MoE with a sampler whose routers pick
their top-k experts from ``logits + b`` (``b``: a fixed random per-layer expert bias, the
way an inference engine's routing differs from the trainer's: a selection bias such as
DeepSeek-V3's ``e_score_correction_bias`` applied on one side only, or bf16 logits that
flip near-ties), while the expert *weights* stay the model's own rule (softmax of the
router logits over the chosen experts, renormalized). Everything else (weights, dtype,
attention) is identical, so the whole train-inference mismatch is routing:

* with R3 the learner routes every token to the experts the sampler used and applies the
  same weighting rule, so its ``log pi`` equals the sampler's ``log mu`` to float error;
* without R3 the learner routes by itself, and ``log pi - log mu`` is what routing alone
  does to the policy.

Both learners run it: the plain PyTorch learner (``learner_client.hf.r3`` hooks) and the
Megatron-Core learner (``learner_client.megatron.router_replay``, megatron-core 0.16.1 on
CPU). The lag is 0 (the sampler always has the learner's current weights), so nothing
but routing separates behaviour and learner. The score is a held-out evaluation of the
deployed policy (the sampler's routing: what users of the inference engine get) on
prompts never trained on: the expected reward, estimated per position as the probability
mass the policy puts on the named class along its own samples (lower variance than the
sampled reward, same expectation).
"""

from __future__ import annotations

import contextlib
import math
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rollout_demo.lab.registry import Preset, RunContext, register
from rollout_demo.lab.report import claims_table, provenance
from rollout_demo.lab.stats import claim, paired_ci

LEARNERS = ("torch", "megatron")


# ---------------------------------------------------------------- a perturbed router
def router_bias(model: Any, scale: float, seed: int) -> dict[int, Any]:
    """A fixed random selection bias per MoE layer: ``{layer: [num_experts]}``, N(0, scale^2)."""
    import torch

    from learner_client.hf import moe_gates

    g = torch.Generator().manual_seed(seed)
    return {layer: torch.randn(gate.num_experts, generator=g) * scale
            for layer, gate in moe_gates(model)}


@contextlib.contextmanager
def biased_routing(model: Any, bias: dict[int, Any]) -> Iterator[None]:
    """Within the block the model's routers select ``top_k(logits + bias)`` and weight the
    chosen experts by the model's own rule (softmax of the logits over them, renormalized
    when ``norm_topk_prob``): a router that disagrees with the learner's on selection only.
    Hooks go first, so :func:`learner_client.hf.record_routing` records the biased choice."""
    import torch

    from learner_client.hf import moe_gates

    def make(b: torch.Tensor):
        def hook(mod: Any, args: Any, output: Any) -> Any:
            logits = output[0]
            idx = torch.topk(logits.float() + b.to(logits.device), mod.top_k, dim=-1).indices
            w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, idx)
            if getattr(mod, "norm_topk_prob", False):
                w = w / w.sum(dim=-1, keepdim=True)
            return logits, w.to(logits.dtype), idx
        return hook

    handles = [gate.register_forward_hook(make(bias[layer]), prepend=True)
               for layer, gate in moe_gates(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------- held-out evaluation
def held_out_prompts(n: int, seed: int = 10_000) -> list[list[int]]:
    """``n`` prompts from a stream no training run draws from (classes in turn)."""
    from rollout_demo import task

    rng = random.Random(seed)
    names = list(task.CLASSES)
    return [task.make_prompt(rng, [names[i % len(names)]])[1] for i in range(n)]


def held_out_reward(model: Any, prompts: list[list[int]], *, samples: int, max_new: int,
                    generator: Any, temperature: float = 1.0) -> float:
    """Expected reward of ``model`` on ``prompts``: along ``samples`` sampled responses per
    prompt, the mean over positions of the probability mass on the prompt's class (the
    reward is the mean of per-position indicators, so this has the same expectation as
    the sampled reward and less variance)."""
    import torch

    from rollout_demo import task

    was_training = model.training
    model.eval()
    width = max(len(p) for p in prompts)
    rows = [list(p) for p in prompts for _ in range(samples)]
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[0] * k + r for k, r in zip(pads, rows)], dtype=torch.long)
    mask = torch.tensor([[False] * k + [True] * len(r) for k, r in zip(pads, rows)])
    in_class = torch.zeros(len(rows), 512, dtype=torch.bool)
    for i, r in enumerate(rows):
        in_class[i, sorted(task.CLASSES[task.prompt_class(r)])] = True
    mass = torch.zeros(len(rows))
    with torch.no_grad():
        for _ in range(max_new):
            pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                           use_cache=False).logits[:, -1].float() / temperature
            p = torch.softmax(logits, -1)
            mass += (p * in_class[:, :p.shape[1]]).sum(-1)
            nxt = torch.multinomial(p, 1, generator=generator)
            ids = torch.cat((ids, nxt), 1)
            mask = torch.cat((mask, torch.ones_like(nxt, dtype=torch.bool)), 1)
    model.train(was_training)
    return float(mass.mean() / max_new)


# ---------------------------------------------------------------- one training run
@dataclass(frozen=True)
class RoutingSettings:
    loss: str = "tis"
    bias_scale: float = 0.5
    steps: int = 24
    groups: int = 3
    group_size: int = 8
    max_new: int = 8
    lr: float = 3e-3
    eval_every: int = 6
    eval_prompts: int = 24
    eval_samples: int = 2


QUICK = RoutingSettings(steps=2, eval_every=1, eval_prompts=6, eval_samples=1, max_new=4)


def routing_disagreement(model: Any, samples: list) -> float:
    """Fraction of (token, MoE layer) rows where the sampler's expert set is not the one
    ``model`` picks by itself on the same tokens (the learner's own routing)."""
    import torch

    from learner_client.hf import moe_gates, packed_logprobs, record_routing
    from rollout_demo.learner import pack_batch

    batch = pack_batch(samples, True)
    with torch.no_grad(), record_routing(model) as rec:
        packed_logprobs(model, batch, replay=False)
    layers = [layer for layer, _ in moe_gates(model)]
    own = rec["routed"][:, layers].sort(-1).values
    used = batch.routed_experts[:, layers].long().sort(-1).values
    return float((own != used).any(-1).float().mean())


def _make_learner(kind: str, ckpt: Path, s: RoutingSettings, replay: bool):
    if kind == "torch":
        from rollout_demo.learner import Learner

        return Learner(ckpt, loss=s.loss, lr=s.lr, replay=replay)
    from rollout_demo.megatron_learner import MegatronLearner

    return MegatronLearner(ckpt, loss=s.loss, lr=s.lr, replay=replay)


def _sync_sampler(sampler: Any, learner: Any, kind: str, scratch: Path) -> None:
    """The sampler takes the learner's current weights (lag 0)."""
    if kind == "torch":
        sampler.load_state_dict(learner.model.state_dict())
        return
    from learner_client.hf import load_model

    fresh = load_model(learner.save(scratch / "weights"))
    sampler.load_state_dict(fresh.state_dict())


def run_cell(kind: str, replay: bool, seed: int, ckpt: Path,
             s: RoutingSettings) -> dict:
    """One training run; returns its ``cells`` entry."""
    import torch

    from learner_client.hf import load_model
    from rollout_demo import task
    from rollout_demo.sampler import sample_groups

    torch.manual_seed(seed)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    eval_gen = torch.Generator().manual_seed(10_000 + seed)
    prompts_eval = held_out_prompts(s.eval_prompts)
    sampler = load_model(ckpt)
    bias = router_bias(sampler, s.bias_scale, seed=20_000 + seed)
    scratch = Path(tempfile.mkdtemp(prefix="lab-routing-"))
    t0 = time.process_time()
    with contextlib.ExitStack() as stack:
        if kind == "megatron":
            from rollout_demo.megatron_learner import single_process_parallel_state

            stack.enter_context(single_process_parallel_state())
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        learner = _make_learner(kind, ckpt, s, replay)
        stack.enter_context(biased_routing(sampler, bias))
        curve: list[list[float]] = []
        mismatch, clip, mask = [], [], []
        disagreement = float("nan")
        nonfinite = False
        for step in range(s.steps + 1):
            if step % s.eval_every == 0 or step == s.steps:
                curve.append([step, held_out_reward(sampler, prompts_eval,
                                                    samples=s.eval_samples,
                                                    max_new=s.max_new, generator=eval_gen)])
            if step == s.steps or nonfinite:
                break
            prompts = [task.make_prompt(rng)[1] for _ in range(s.groups)]
            samples = sample_groups(sampler, prompts, s.group_size, s.max_new,
                                    temperature=1.0, version=learner.version,
                                    groups=[f"{step}-{j}" for j in range(s.groups)],
                                    reward_fn=task.reward, generator=gen)
            if step == 0:  # the step-0 weights are the checkpoint's, unhooked
                disagreement = routing_disagreement(load_model(ckpt), samples)
            out = learner.train_step(samples)
            nonfinite = not math.isfinite(out.loss)
            mismatch.append(out.mismatch)
            clip.append(out.clip_rate)
            mask.append(out.mask_rate)
            _sync_sampler(sampler, learner, kind, scratch)
    final = curve[-1][1]
    return {"method": f"{kind} {'R3 on' if replay else 'R3 off'}", "learner": kind,
            "replay": replay, "lag": 0, "seed": seed, "eval_curve": curve,
            "final_eval": final, "collapsed": bool(nonfinite or final < 0.5 * curve[0][1]),
            "diagnostics": {"mismatch_mean": float(np.nanmean(mismatch)),
                            "mismatch_step0": mismatch[0] if mismatch else float("nan"),
                            "mismatch_curve": mismatch,
                            "clip_rate": float(np.nanmean(clip)) if clip else float("nan"),
                            "mask_rate": float(np.nanmean(mask)) if mask else float("nan"),
                            "routing_disagreement_step0": disagreement},
            "cpu_seconds": time.process_time() - t0}

