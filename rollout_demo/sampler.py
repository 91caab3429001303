"""In-process sampling from a transformers Qwen3-MoE (the staleness lab's rollout engine).

The lab controls lag exactly, so it samples from a frozen copy of the policy ``S`` steps old
instead of going through engine processes. A group is ``n`` samples of one prompt (same
length, no padding): ``max_new`` full forward passes, then one scoring pass that records the
behaviour logprobs, exact entropy and the router's choices (the stamps the gateway would
give). No KV cache: sequences are a few dozen tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from learner_client.hf import padded_logprobs, record_routing
from rollout_demo.learner import Sample


@torch.no_grad()
def sample_group(model, prompt: list[int], n: int, max_new: int, *, temperature: float,
                 version: int, group: str, reward_fn, generator: torch.Generator) -> list[Sample]:
    was_training = model.training
    model.eval()
    ids = torch.tensor([prompt] * n, dtype=torch.long)
    for _ in range(max_new):
        logits = model(input_ids=ids, use_cache=False).logits[:, -1].float() / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        ids = torch.cat((ids, nxt), 1)
    with record_routing(model) as rec:
        lp, ent = padded_logprobs(model, ids, torch.ones_like(ids, dtype=torch.bool),
                                  temperature=temperature)
    model.train(was_training)
    p = len(prompt)
    routed = rec["routed"].reshape(n, ids.shape[1], *rec["routed"].shape[1:]).numpy()
    out = []
    for i in range(n):
        resp = ids[i, p:].numpy()
        out.append(Sample(
            prompt_ids=np.asarray(prompt, np.int64), response_ids=resp,
            rollout_logprobs=lp[i, p - 1:].numpy().astype(np.float32),
            entropy=ent[i, p - 1:].numpy().astype(np.float32),
            versions=np.full(max_new, version, np.int32), reward=reward_fn(prompt, resp),
            group=group, routed_experts=routed[i].astype(np.int64)))
    return out
