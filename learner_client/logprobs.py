"""Per-token log-probabilities and entropy from (possibly vocab-parallel) logits.

One autograd function serves every learner adapter:

- plain PyTorch / transformers: full-vocabulary logits, ``tp_group=None``;
- Megatron-Core: vocab-parallel logits (each tensor-parallel rank holds the contiguous
  vocabulary slice ``[rank * V_local, (rank + 1) * V_local)``), ``tp_group`` = the TP group.

Forward, per chunk of rows (temperature-scaled, float32)::

    m      = all_reduce_MAX(max_v z_v)
    S      = all_reduce_SUM(sum_v exp(z_v - m))
    logp_t = z_t - m - log S                  (z_t lives on exactly one rank)
    H      = log S - all_reduce_SUM(sum_v exp(z_v - m) (z_v - m)) / S

The three SUMs travel in one stacked all-reduce per chunk. Nothing of size rows x vocab is
kept for backward: the backward pass recomputes softmax chunk by chunk from the saved
per-row ``lse`` and ``H``. The input logits are never modified (every in-place operation
runs on a chunk copy made by ``index_select``).

Gradients follow Megatron's convention for vocab-parallel losses: every TP rank computes
the same (replicated) loss, so the backward pass needs no collective; each rank writes
the gradient of its own vocabulary slice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["token_logprobs_entropy"]

_DEFAULT_CHUNK = 1024


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (for gradcheck); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits2d, rows, targets, temperature, group, chunk_size, with_entropy):
        rank, size = _group_rank_size(group)
        v_local = logits2d.shape[-1]
        vocab_start = rank * v_local
        m_rows = rows.numel()
        cdt = _compute_dtype(logits2d.dtype)
        logp = torch.empty(m_rows, dtype=cdt, device=logits2d.device)
        ent = torch.empty(m_rows, dtype=cdt, device=logits2d.device)
        lse = torch.empty(m_rows, dtype=cdt, device=logits2d.device)
        for c0 in range(0, m_rows, chunk_size):
            c1 = min(c0 + chunk_size, m_rows)
            z = logits2d.index_select(0, rows[c0:c1]).to(cdt)  # a copy: safe to edit
            if temperature != 1.0:
                z.div_(temperature)
            m = z.max(dim=-1).values
            if size > 1:
                dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            z.sub_(m.unsqueeze(-1))
            t_local = targets[c0:c1] - vocab_start
            in_range = (t_local >= 0) & (t_local < v_local)
            t_z = z.gather(1, t_local.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
            t_z = torch.where(in_range, t_z, torch.zeros_like(t_z))
            e = torch.exp(z)
            sums = [e.sum(dim=-1), t_z]
            if with_entropy:
                sums.append((e * z).sum(dim=-1))
            stacked = torch.stack(sums)
            if size > 1:
                dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
            log_s = torch.log(stacked[0])
            logp[c0:c1] = stacked[1] - log_s
            lse[c0:c1] = m + log_s
            if with_entropy:
                ent[c0:c1] = log_s - stacked[2] / stacked[0]
            else:
                ent[c0:c1] = 0.0
        ctx.save_for_backward(logits2d, rows, targets, lse, ent)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.vocab_start = vocab_start
        ctx.with_entropy = with_entropy
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, grad_logp, grad_ent, _grad_lse):
        logits2d, rows, targets, lse, ent = ctx.saved_tensors
        temperature = ctx.temperature
        v_local = logits2d.shape[-1]
        grad = torch.zeros_like(logits2d)
        for c0 in range(0, rows.numel(), ctx.chunk_size):
            c1 = min(c0 + ctx.chunk_size, rows.numel())
            idx = rows[c0:c1]
            z = logits2d.index_select(0, idx).to(lse.dtype)
            if temperature != 1.0:
                z.div_(temperature)
            logp_all = z.sub_(lse[c0:c1].unsqueeze(-1))  # log p_v, in place on the copy
            p = torch.exp(logp_all)
            # d logp_t / d z_v = 1[v = t] - p_v
            g = p * (-grad_logp[c0:c1]).unsqueeze(-1)
            if ctx.with_entropy:
                # d H / d z_v = -p_v (log p_v + H)
                g -= grad_ent[c0:c1].unsqueeze(-1) * p * (logp_all + ent[c0:c1].unsqueeze(-1))
            t_local = targets[c0:c1] - ctx.vocab_start
            in_range = (t_local >= 0) & (t_local < v_local)
            add = torch.where(in_range, grad_logp[c0:c1], torch.zeros_like(grad_logp[c0:c1]))
            g.scatter_add_(1, t_local.clamp(0, v_local - 1).unsqueeze(-1), add.unsqueeze(-1))
            if temperature != 1.0:
                g.div_(temperature)
            grad.index_add_(0, idx, g.to(grad.dtype))
        return grad, None, None, None, None, None, None


def token_logprobs_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    temperature: float = 1.0,
    tp_group: dist.ProcessGroup | None = None,
    chunk_size: int = _DEFAULT_CHUNK,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets`` and entropy of the full next-token distribution.

    Args:
        logits: ``[..., V_local]`` logits (any float dtype); the leading dims are flattened
            in C order to "rows". Never modified.
        targets: global token ids (int). Shape ``logits.shape[:-1]`` when ``rows`` is None,
            else ``[M]`` aligned with ``rows``.
        rows: optional ``[M]`` flat row indices into the flattened logits: compute only
            these rows (e.g. the logits that predict response tokens).
        temperature: the logits are divided by it first (SGLang reports logprobs after
            temperature scaling). Must be > 0.
        tp_group: the tensor-parallel group the vocabulary is split over, or None.
        chunk_size: rows processed at once; bounds the temporary memory to
            ``chunk_size x V_local`` floats (two such buffers).
        with_entropy: skip the entropy (returned as zeros) to save one reduction.

    Returns:
        ``(logprobs, entropy)``, float32 (float64 for float64 logits), shaped like
        ``targets``. Both are differentiable
        with respect to ``logits``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    out_shape = targets.shape
    logits2d = logits.reshape(-1, logits.shape[-1])
    if rows is None:
        if tuple(targets.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"targets shape {tuple(targets.shape)} != logits rows {tuple(logits.shape[:-1])}"
            )
        rows = torch.arange(logits2d.shape[0], device=logits.device)
    else:
        rows = rows.reshape(-1).to(device=logits.device, dtype=torch.long)
        if rows.numel() != targets.numel():
            raise ValueError(f"rows ({rows.numel()}) and targets ({targets.numel()}) differ")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= logits2d.shape[0]):
            raise ValueError(f"rows out of range [0, {logits2d.shape[0]})")
    flat_targets = targets.reshape(-1).to(device=logits.device, dtype=torch.long)
    logp, ent, _ = _LogprobEntropy.apply(
        logits2d, rows, flat_targets, float(temperature), tp_group, int(chunk_size),
        bool(with_entropy),
    )
    return logp.reshape(out_shape), ent.reshape(out_shape)
