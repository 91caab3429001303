"""A ready ``forward_step`` for Megatron-Core's pipeline schedules (GPTModel, packed THD).

``forward_step(data_iterator, model) -> (output_tensor, loss_func)``: takes the next
:class:`PackedBatch` from the iterator, moves it to the model's device, optionally feeds
the rollout routing into the routers (R3), runs
``model(tokens, position_ids, None, packed_seq_params=...)`` and returns the output with
a :func:`make_loss_func` bound to that batch.

THD packed attention needs TransformerEngine (GPU). ``attention="mask"`` runs the same
packed row through the local (non-TE) attention with a block-diagonal causal mask
``[1, 1, S, S]`` instead (O(S^2) memory: CPU runs, tests, small batches). Context
parallelism is not handled here (the loss needs all logits of the batch on the rank: cp = 1).

Routing replay bookkeeping: megatron's ``RouterReplay.set_target_indices`` also queues
the targets for ``REPLAY_BACKWARD`` (activation recompute pops them in forward order).
Without recompute the queue would only grow, so it is reset at every forward, and the
routers are cleared right after the forward (the backward needs no targets then): a
later forward of the same model routes freely unless it replays again. With
``recompute=True`` a gradient hook on the output switches the routers to
``REPLAY_BACKWARD`` when this microbatch's backward starts, and the next forward switches
back to ``REPLAY_FORWARD``; this matches the FIFO order of 1F1B schedules. Forward-only
passes (no grad) take their targets off the queue again. A ``replay=False`` forward
step clears whatever replay state an earlier step left on the model's routers, so
"replay off" always means the learner's own routing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from learner_client.corrections.base import LossConfig
from learner_client.megatron.loss import make_loss_func
from learner_client.megatron.packing import PackedBatch
from learner_client.megatron.router_replay import (
    RouterReplayError,
    ReplaySlot,
    find_router_replays,
    local_routing,
    clear_replay,
    replay_slots,
    set_replay_targets,
    start_backward_replay,
)

__all__ = ["block_causal_mask", "make_forward_step"]


def block_causal_mask(batch: PackedBatch) -> torch.Tensor:
    """``[1, 1, S, S]`` bool, True = masked (Megatron's convention): position i attends to
    j only when j <= i and both lie in the same packed sequence (tail padding attends to
    itself only, so no row is fully masked)."""
    s = batch.total_len
    dev = batch.tokens.device
    pos = torch.arange(s, device=dev)
    bounds = batch.cu_seqlens_padded.to(device=dev, dtype=torch.int64)[1:]
    seq = torch.bucketize(pos, bounds, right=True)  # tail padding -> id B
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
    return (~allowed)[None, None]


def _tp_rank_size() -> tuple[int, int]:
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def make_forward_step(
    loss_name: str,
    loss_config: LossConfig | dict | None = None,
    *,
    temperature: float = 1.0,
    learner_version: int | None = None,
    replay: bool = False,
    recompute: bool = False,
    sequence_parallel: bool = False,
    tp_group: dist.ProcessGroup | None | str = "auto",
    chunk_size: int = 1024,
    attention: str = "thd",
) -> Callable[[Iterator[PackedBatch], Any], tuple[torch.Tensor, Callable[..., Any]]]:
    """Build ``forward_step(data_iterator, model)`` for ``get_forward_backward_func()``.

    Args:
        loss_name, loss_config, temperature, learner_version, tp_group, chunk_size: see
            :func:`learner_client.megatron.loss.make_loss_func`.
        replay: route every token to the batch's ``routed_experts`` (R3); the model must
            be built with ``moe_enable_routing_replay=True`` and without router fusion.
        recompute: the model recomputes MoE layers in backward (activation recompute).
        sequence_parallel: the model runs with sequence parallelism (routers see a 1/tp
            slice of the tokens).
        attention: "thd" (PackedSeqParams, TransformerEngine) or "mask" (one packed row
            with :func:`block_causal_mask`, for the local non-TE attention on CPU).
    """
    if attention not in ("thd", "mask"):
        raise ValueError(f"attention must be 'thd' or 'mask', got {attention!r}")
    slots_cache: dict[int, list[ReplaySlot]] = {}

    def forward_step(data_iterator: Iterator[PackedBatch], model: Any
                     ) -> tuple[torch.Tensor, Callable[..., Any]]:
        batch = next(data_iterator)
        if not isinstance(batch, PackedBatch):
            raise TypeError(f"forward_step expects PackedBatch items, got {type(batch).__name__}")
        module = model[0] if isinstance(model, (list, tuple)) else model
        device = next(module.parameters()).device
        batch = batch.to(device)
        slots: list[ReplaySlot] = []
        if replay:
            if batch.routed_experts is None:
                raise RouterReplayError("replay=True but the batch has no routed_experts")
            if id(module) not in slots_cache:
                slots_cache[id(module)] = find_router_replays(model)
            slots = slots_cache[id(module)]
            rank, size = _tp_rank_size()
            routed = local_routing(batch.routed_experts, tp_rank=rank, tp_size=size,
                                   sequence_parallel=sequence_parallel)
            if not recompute:  # nothing will pop the backward queue: keep only this batch
                for s in slots:
                    s.replay.replay_backward_list.clear()
            set_replay_targets(slots, routed)
        else:  # the learner's own routing, whatever an earlier replay step left set
            if id(module) not in slots_cache:
                slots_cache[id(module)] = replay_slots(model)
            clear_replay(slots_cache[id(module)])
        if attention == "thd":
            output = model(batch.tokens, batch.position_ids, None,
                           packed_seq_params=batch.packed_seq_params())
        else:
            output = model(batch.tokens, batch.position_ids, block_causal_mask(batch))
        if replay and not recompute:
            clear_replay(slots)
        if replay and recompute:
            if output.requires_grad:
                def to_backward(grad: torch.Tensor) -> None:
                    start_backward_replay(slots)

                output.register_hook(to_backward)
            else:  # forward-only (e.g. old-logprob recompute): no backward will pop it
                for s in slots:
                    s.replay.replay_backward_list.pop()
        loss_func = make_loss_func(batch, loss_name, loss_config, temperature=temperature,
                                   tp_group=tp_group, learner_version=learner_version,
                                   chunk_size=chunk_size)
        return output, loss_func

    return forward_step
