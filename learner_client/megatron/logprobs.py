"""Per-token logprobs and entropy from Megatron's vocab-parallel logits.

A thin adapter over :func:`learner_client.logprobs.token_logprobs_entropy` that defaults
to Megatron's tensor-parallel group. Unlike
``megatron.core.tensor_parallel.vocab_parallel_cross_entropy`` (which overwrites its input
logits in place), this never modifies the logits, returns the entropy too, and keeps only
per-row statistics for backward (the softmax is recomputed chunk by chunk).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from learner_client.logprobs import token_logprobs_entropy

__all__ = ["vocab_parallel_logprobs_entropy"]


def vocab_parallel_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None | str = "auto",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)`` of ``targets`` under vocab-parallel ``logits [..., V/tp]``.

    ``tp_group="auto"`` uses Megatron's tensor-parallel group when model parallelism is
    initialized with tp > 1 (else no collective). Rank r holds vocabulary ids
    ``[r * V/tp, (r + 1) * V/tp)``, Megatron's ``VocabUtility`` partition.
    See :func:`learner_client.logprobs.token_logprobs_entropy` for the other arguments.
    """
    if tp_group == "auto":
        from learner_client.megatron.loss import default_tp_group

        tp_group = default_tp_group()
    return token_logprobs_entropy(logits, targets, rows=rows, temperature=temperature,
                                  tp_group=tp_group, chunk_size=chunk_size)
