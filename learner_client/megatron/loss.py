"""A ``loss_func`` factory for Megatron-Core's forward_step contract.

``forward_step(data_iterator, model) -> (output_tensor, partial(loss_func))``; on the last
pipeline stage Megatron calls ``loss_func(output_tensor)`` where ``output_tensor`` is the
vocab-parallel logits ``[b, s, V/tp]`` of ``GPTModel`` (called without labels).

Return form: **the 3-tuple** ``(loss * n, n, report)``, where ``loss`` is the registered
correction's scalar (its own aggregation) and ``n`` its normalizer as an int tensor:
the number of denominator tokens (``token_mean``), of live sequences
(``seq_mean_token_mean``) or the constant (``constant``). Megatron then

* with ``calculate_per_token_loss=False`` divides by ``n`` and by ``num_microbatches``:
  each microbatch contributes exactly the correction's own loss, averaged over
  microbatches;
* with ``calculate_per_token_loss=True`` sums ``loss * n`` and ``n`` over microbatches
  (and data-parallel ranks) and scales gradients by ``1 / sum n``: the result is the
  correction aggregated over the *whole* global batch in its own unit (the global token
  mean for token_mean losses, the mean over all sequences for GRPO's per-sequence mean).

``report`` follows Megatron-LM's convention for 3-tuples: every value is a float tensor
``[sum, count]`` that the training loop sums over microbatches and divides. Loss and the
correction's diagnostics are weighted by ``n``; counts (``num_*``, ``normalizer``) are
reported as ``[count, 1]`` (mean per microbatch).

With ``collect_non_loss_data`` Megatron calls ``loss_func(output, non_loss_data=True)``;
this returns ``{"logprobs": [N], "entropy": [N]}`` (detached, float32): the old-logprob
recompute path.

Context parallelism: the loss needs the logits of every position of the packed batch on
this rank (cp = 1); with cp > 1 gather the logits first. A length mismatch is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from learner_client.corrections import LossInputs, get_loss
from learner_client.corrections.base import LossConfig
from learner_client.logprobs import token_logprobs_entropy
from learner_client.megatron.packing import PackedBatch

__all__ = ["make_loss_func", "default_tp_group", "loss_inputs_from_batch"]

_COUNT_METRICS = ("num_active_tokens", "num_denominator_tokens", "num_sequences", "normalizer")


def default_tp_group() -> dist.ProcessGroup | None:
    """Megatron's tensor-parallel group when model parallelism is initialized with tp > 1."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()


def loss_inputs_from_batch(batch: PackedBatch, logprobs: torch.Tensor,
                           learner_version: int | None = None) -> LossInputs:
    """LossInputs over the batch's response tokens (flat [N], boundaries = cu_response)."""
    dev = logprobs.device

    def col(name: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        t = batch.column(name)
        if t is None:
            return None
        return t.to(device=dev, dtype=dtype if dtype is not None else t.dtype)

    rollout = col("rollout_logprobs", torch.float32)
    adv = col("advantages", torch.float32)
    if rollout is None or adv is None:
        missing = [n for n in ("rollout_logprobs", "advantages") if batch.column(n) is None]
        raise ValueError(f"packed batch lacks column(s) {missing} that every loss needs")
    return LossInputs(
        logprobs=logprobs,
        rollout_logprobs=rollout,
        advantages=adv,
        loss_mask=batch.loss_mask().to(dev),
        old_logprobs=col("old_logprobs", torch.float32),
        ref_logprobs=col("ref_logprobs", torch.float32),
        entropy=col("entropy", torch.float32),
        versions=col("versions"),
        cu_seqlens=batch.cu_response.to(dev),
        learner_version=learner_version,
    )


def _check_integral_normalizer(cfg: LossConfig) -> None:
    c = cfg.constant_normalizer
    if cfg.aggregation == "constant" and c is not None and float(c) != int(c):
        raise ValueError(
            f"constant_normalizer={c} is not an integer; Megatron counts normalizers as int")


def make_loss_func(
    batch: PackedBatch,
    loss_name: str,
    loss_config: LossConfig | dict | None = None,
    *,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None | str = "auto",
    learner_version: int | None = None,
    chunk_size: int = 1024,
) -> Callable[..., Any]:
    """Build Megatron's ``loss_func(output_tensor, non_loss_data=False)`` for one microbatch.

    Args:
        batch: the packed microbatch that produced ``output_tensor``.
        loss_name: a key of ``learner_client.corrections.LOSSES``.
        loss_config: its config (model, dict or None for the published defaults).
        temperature: the rollout temperature (behavior logprobs are temperature-scaled).
        tp_group: the vocab-parallel group; "auto" = Megatron's TP group if initialized.
        learner_version: v_theta, for losses that use per-token versions.
        chunk_size: rows per chunk in the logprob/entropy computation.
    """
    spec = get_loss(loss_name)  # unknown names fail here, not inside the training loop
    cfg = spec.config(loss_config)
    _check_integral_normalizer(cfg)
    group = default_tp_group() if tp_group == "auto" else tp_group
    rows = batch.logit_positions
    targets = batch.targets

    def loss_func(output_tensor: torch.Tensor, non_loss_data: bool = False) -> Any:
        seq = output_tensor.shape[:-1].numel()
        if seq != batch.total_len:
            raise ValueError(
                f"logits cover {seq} positions but the packed batch has {batch.total_len}; "
                "the loss needs every position on this rank (gather context-parallel logits)")
        logp, ent = token_logprobs_entropy(
            output_tensor, targets.to(output_tensor.device), rows=rows.to(output_tensor.device),
            temperature=temperature, tp_group=group, chunk_size=chunk_size,
        )
        if non_loss_data:
            return {"logprobs": logp.detach(), "entropy": ent.detach()}
        inputs = loss_inputs_from_batch(batch, logp, learner_version)
        loss, metrics = spec.fn(inputs, cfg)
        norm = metrics["normalizer"].to(loss.device)
        live = metrics["num_denominator_tokens"].to(loss.device) > 0
        num = torch.where(live, norm, torch.zeros_like(norm)).round().to(torch.int)
        scaled = loss * num.to(loss.dtype)
        report = _report(scaled, num, metrics, inputs, ent)
        return scaled, num, report

    return loss_func


def _report(scaled: torch.Tensor, num: torch.Tensor, metrics: dict[str, torch.Tensor],
            inputs: LossInputs, ent: torch.Tensor) -> dict[str, torch.Tensor]:
    dev = scaled.device
    n = num.to(device=dev, dtype=torch.float32)
    one = torch.ones((), device=dev)
    mask = inputs.mask.to(torch.float32)
    active = mask.sum()
    cur_ent = (ent.detach() * mask).sum() / active.clamp_min(1.0)
    report = {
        "loss": torch.stack([scaled.detach().float(), n]),
        "entropy_current": torch.stack([cur_ent * active, active]),
    }
    for k, v in metrics.items():
        v = v.detach().to(device=dev, dtype=torch.float32).reshape(())
        if k in _COUNT_METRICS:
            report[k] = torch.stack([v, one])
        else:
            report[k] = torch.stack([v * n, n])
    return report
