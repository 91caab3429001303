"""In-process sampling from a transformers Qwen3-MoE (the staleness lab's rollout engine).

The lab controls lag exactly, so it samples from a frozen copy of the policy ``S`` steps old
instead of going through engine processes. One call samples ``n`` responses for each of
several prompts in one left-padded batch: ``max_new`` full forward passes (no KV cache:
sequences are a few dozen tokens), then one scoring pass that records the behaviour
logprobs, exact entropy and the router's choices (the stamps the gateway would give).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from learner_client.hf import padded_logprobs, record_routing
from rollout_demo.learner import Sample


@torch.no_grad()
def sample_groups(model, prompts: Sequence[Sequence[int]], n: int, max_new: int, *,
                  temperature: float, version: int, groups: Sequence[str],
                  reward_fn: Callable, generator: torch.Generator,
                  pad_id: int = 0) -> list[Sample]:
    """``n`` samples of every prompt (group ``groups[j]`` for prompt ``j``)."""
    was_training = model.training
    model.eval()
    width = max(len(p) for p in prompts)
    rows = [list(p) for p in prompts for _ in range(n)]
    pads = [width - len(r) for r in rows]
    ids = torch.tensor([[pad_id] * k + r for k, r in zip(pads, rows)], dtype=torch.long)
    mask = torch.tensor([[False] * k + [True] * len(r) for k, r in zip(pads, rows)])
    for _ in range(max_new):
        pos = (mask.long().cumsum(-1) - 1).clamp_min(0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos,
                       use_cache=False).logits[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat((ids, nxt), 1)
        mask = torch.cat((mask, torch.ones_like(nxt, dtype=torch.bool)), 1)
    with record_routing(model) as rec:
        lp, ent = padded_logprobs(model, ids, mask, temperature=temperature)
    model.train(was_training)
    routed = rec["routed"].reshape(ids.shape[0], ids.shape[1], *rec["routed"].shape[1:])
    out = []
    for i, (row, k) in enumerate(zip(rows, pads)):
        p = len(row)
        resp = ids[i, width:].numpy()
        out.append(Sample(
            prompt_ids=np.asarray(row, np.int64), response_ids=resp,
            rollout_logprobs=lp[i, width - 1:].float().numpy(),
            entropy=ent[i, width - 1:].float().numpy(),
            versions=np.full(max_new, version, np.int32), reward=reward_fn(row, resp),
            group=groups[i // n], routed_experts=routed[i, k:].numpy().astype(np.int64)))
        assert out[-1].routed_experts.shape[0] == p + max_new
    return out


def sample_group(model, prompt: list[int], n: int, max_new: int, *, temperature: float,
                 version: int, group: str, reward_fn: Callable,
                 generator: torch.Generator) -> list[Sample]:
    """``n`` samples of one prompt."""
    return sample_groups(model, [prompt], n, max_new, temperature=temperature,
                         version=version, groups=[group], reward_fn=reward_fn,
                         generator=generator)
