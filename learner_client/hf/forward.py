"""Per-token logprobs and entropy from a transformers causal LM, packed or padded.

Packed: a :class:`~learner_client.megatron.packing.PackedBatch` runs as one ``[1, S]``
row with per-sequence ``position_ids`` and no attention mask; transformers 5 then builds
a block-diagonal causal mask from the position resets (``find_packed_sequence_indices``),
so sequences do not attend to each other. Only the rows that predict response tokens go
through ``lm_head`` (``[N, V]``, not ``[S, V]``).

Padded: ``input_ids [B, T]`` + ``attention_mask``; logprobs of tokens 1..T-1.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch

from learner_client.hf.r3 import replay_routing
from learner_client.logprobs import token_logprobs_entropy
from learner_client.megatron.packing import PackedBatch

__all__ = ["packed_logprobs", "padded_logprobs"]


def _parts(model: Any) -> tuple[Any, Any]:
    backbone = getattr(model, model.base_model_prefix, None)
    head = model.get_output_embeddings()
    if backbone is None or head is None:
        raise ValueError(f"{type(model).__name__} is not a causal LM with a base model and lm_head")
    return backbone, head


def packed_logprobs(model: Any, batch: PackedBatch, *, temperature: float = 1.0,
                    replay: bool = False, chunk_size: int = 1024
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [N], entropy [N])`` of the batch's response tokens under ``model``.

    ``replay=True`` routes every token to ``batch.routed_experts`` (R3). Differentiable
    with respect to the model's parameters.
    """
    backbone, head = _parts(model)
    dev = head.weight.device
    if replay and batch.routed_experts is None:
        raise ValueError("replay=True but the packed batch has no routed_experts")
    ctx = replay_routing(model, batch.routed_experts) if replay else nullcontext()
    with ctx:
        out = backbone(input_ids=batch.tokens.to(dev), position_ids=batch.position_ids.to(dev),
                       attention_mask=None, use_cache=False)
    hidden = out.last_hidden_state[0].index_select(0, batch.logit_positions.to(dev))
    logits = head(hidden)
    return token_logprobs_entropy(logits, batch.targets.to(dev), temperature=temperature,
                                  chunk_size=chunk_size)


def padded_logprobs(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, *,
                    temperature: float = 1.0, routed_experts: torch.Tensor | None = None,
                    chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` ``[B, T-1]`` of tokens 1..T-1 (left or right padding).

    ``routed_experts``: optional ``[B, T, L, K]`` routing to replay (R3). Positions are
    counted over real tokens only, so left padding does not shift RoPE.
    """
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"input_ids {tuple(input_ids.shape)} and attention_mask "
                         f"{tuple(attention_mask.shape)} must both be [B, T]")
    backbone, head = _parts(model)
    dev = head.weight.device
    mask = attention_mask.to(dev)
    position_ids = (mask.long().cumsum(-1) - 1).clamp_min(0)
    ctx = nullcontext()
    if routed_experts is not None:
        b, t = input_ids.shape
        if routed_experts.dim() != 4 or routed_experts.shape[:2] != (b, t):
            raise ValueError(f"routed_experts must be [B={b}, T={t}, L, K], "
                             f"got {tuple(routed_experts.shape)}")
        ctx = replay_routing(model, routed_experts.reshape(b * t, *routed_experts.shape[2:]))
    with ctx:
        out = backbone(input_ids=input_ids.to(dev), attention_mask=mask,
                       position_ids=position_ids, use_cache=False)
    logits = head(out.last_hidden_state[:, :-1])
    return token_logprobs_entropy(logits, input_ids[:, 1:].to(dev), temperature=temperature,
                                  chunk_size=chunk_size)
