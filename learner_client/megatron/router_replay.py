"""Routing replay (R3): feed the rollout's MoE routing into megatron-core's RouterReplay.

megatron-core 0.16.1 (``megatron/core/transformer/moe/router_replay.py``): with
``TransformerConfig.moe_enable_routing_replay=True`` every ``TopKRouter`` owns a
``router_replay``; under ``REPLAY_FORWARD`` its top-k step returns the target indices
and gathers their scores. For the default softmax score function (no pre-softmax) the
weights become ``softmax`` over the replayed experts' own logits, i.e. the R3 rule
``g_e = 1[e in I] exp(z_e) / sum_{e' in I} exp(z_e')``; with pre-softmax or sigmoid
scoring the model's own weighting rule is applied to the replayed set.
``REPLAY_BACKWARD`` pops the queued targets in forward order for activation recompute.

Replay is silently bypassed by megatron when ``moe_router_fusion=True`` (the fused TE
kernel never sees ``router_replay``) and by sinkhorn routing; token dropping
(``moe_expert_capacity_factor``) rewrites the replayed map afterwards. All three are
refused here with a clear error.

Layer mapping: the gateway/SGLang report routing for *all* model layers ``[N, L, K]``
(dense layers are zeros). Each router knows its global 1-based ``layer_number`` (set
by ``TransformerLayer``, pipeline offset included), so MoE layer ``n`` reads column
``n - 1``. Routers are found by walking the model's modules, never through the global
``RouterReplay.global_router_replay_instances`` list (which also holds routers of every
other model built in the process).

Token order: a router sees its input ``[s, b, h]`` flattened s-major; for a packed
batch (b = 1) that is packed-position order on this rank. Use :func:`local_routing` to
cut the packed ``[S, L, K]`` routing like the tokens (context-parallel index, then the
sequence-parallel chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RouterReplayError",
    "ReplaySlot",
    "check_replay_config",
    "find_router_replays",
    "replay_slots",
    "set_replay_targets",
    "start_backward_replay",
    "clear_replay",
    "routing_replay",
    "local_routing",
]


class RouterReplayError(ValueError):
    """Routing replay cannot run as asked (it would be ignored or mis-aligned)."""


@dataclass(frozen=True)
class ReplaySlot:
    """One MoE layer's router and its replay handle."""

    layer_number: int  # global, 1-based
    router: Any  # megatron.core.transformer.moe.router.TopKRouter
    replay: Any  # megatron.core.transformer.moe.router_replay.RouterReplay


def check_replay_config(config: Any) -> None:
    """Refuse configurations under which megatron would ignore or distort the replay."""
    if not getattr(config, "moe_enable_routing_replay", False):
        raise RouterReplayError(
            "routing replay needs TransformerConfig.moe_enable_routing_replay=True")
    if getattr(config, "moe_router_fusion", False):
        raise RouterReplayError(
            "moe_router_fusion=True makes megatron-core ignore router replay (the fused "
            "TopK kernel bypasses RouterReplay); set moe_router_fusion=False for R3")
    if getattr(config, "moe_router_load_balancing_type", None) == "sinkhorn":
        raise RouterReplayError("sinkhorn routing bypasses router replay; use another type")
    if getattr(config, "moe_expert_capacity_factor", None) is not None:
        raise RouterReplayError(
            "moe_expert_capacity_factor drops tokens after routing, so the replayed "
            "experts would not be used exactly; unset it for R3")


def _modules(model: Any) -> Iterable[Any]:
    chunks = model if isinstance(model, (list, tuple)) else [model]
    for chunk in chunks:
        yield from chunk.modules()


def find_router_replays(model: Any) -> list[ReplaySlot]:
    """All (layer_number, router, replay) of ``model`` (a module or list of model chunks).

    Raises:
        RouterReplayError: no MoE router with replay, a refused config, or a router
            without a layer number.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    slots = []
    for mod in _modules(model):
        if isinstance(mod, TopKRouter):
            check_replay_config(mod.config)
            if mod.router_replay is None:
                raise RouterReplayError("a TopKRouter has no router_replay "
                                        "(moe_enable_routing_replay was off when it was built)")
            if mod.layer_number is None:
                raise RouterReplayError("a TopKRouter has no layer_number; build it inside a "
                                        "TransformerLayer or call set_layer_number")
            slots.append(ReplaySlot(int(mod.layer_number), mod, mod.router_replay))
    if not slots:
        raise RouterReplayError("the model has no MoE router (TopKRouter) to replay")
    slots.sort(key=lambda s: s.layer_number)
    numbers = [s.layer_number for s in slots]
    if len(set(numbers)) != len(numbers):
        raise RouterReplayError(f"duplicate router layer numbers {numbers}")
    return slots


def replay_slots(model: Any) -> list[ReplaySlot]:
    """The (layer_number, router, replay) of every router of ``model`` that has a
    ``router_replay``, without :func:`find_router_replays`' checks: empty for a model
    built without routing replay (used to clear replay state before a free forward)."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [ReplaySlot(int(mod.layer_number or 0), mod, mod.router_replay)
            for mod in _modules(model)
            if isinstance(mod, TopKRouter) and mod.router_replay is not None]


def set_replay_targets(slots: list[ReplaySlot], routed_experts: torch.Tensor,
                       *, forward: bool = True) -> None:
    """Give every MoE layer its target experts from all-layer routing ``[N, L, K]``.

    ``N`` must equal the number of tokens each router sees on this rank, in its order.
    Sets ``REPLAY_FORWARD`` when ``forward`` (else only queues the targets).
    """
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if routed_experts.dim() != 3:
        raise RouterReplayError(
            f"routed_experts must be [tokens, layers, top_k], got {tuple(routed_experts.shape)}")
    n_layers, top_k = routed_experts.shape[1], routed_experts.shape[2]
    targets = []
    for s in slots:
        if s.layer_number > n_layers:
            raise RouterReplayError(
                f"MoE layer {s.layer_number} is beyond the {n_layers} layers of routing given")
        if s.router.topk != top_k:
            raise RouterReplayError(f"routing has top_k={top_k}, layer {s.layer_number} "
                                    f"routes to {s.router.topk} experts")
        idx = routed_experts[:, s.layer_number - 1, :].to(
            device=s.router.weight.device, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= s.router.num_experts):
            raise RouterReplayError(f"layer {s.layer_number}: expert ids outside "
                                    f"[0, {s.router.num_experts})")
        if idx.numel() and bool((idx.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise RouterReplayError(f"layer {s.layer_number}: a token repeats an expert "
                                    "(dense-layer zeros mapped to a MoE layer?)")
        targets.append(idx.contiguous())
    for s, idx in zip(slots, targets):
        s.replay.set_target_indices(idx)
        if forward:
            s.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def start_backward_replay(slots: list[ReplaySlot]) -> None:
    """Switch to REPLAY_BACKWARD (recompute pops the queued targets in forward order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    for s in slots:
        s.replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)


def clear_replay(slots: list[ReplaySlot]) -> None:
    """Drop targets, recorded indices and the action: routers route freely again."""
    for s in slots:
        s.replay.clear_indices()
        s.replay.clear_router_replay_action()


@contextmanager
def routing_replay(model: Any, routed_experts: torch.Tensor) -> Iterator[list[ReplaySlot]]:
    """``with routing_replay(model, routed):`` forward passes inside use the rollout's experts."""
    slots = find_router_replays(model)
    set_replay_targets(slots, routed_experts)
    try:
        yield slots
    finally:
        clear_replay(slots)


def local_routing(routed_experts: torch.Tensor, *, tp_rank: int = 0, tp_size: int = 1,
                  sequence_parallel: bool = False,
                  cp_index: torch.Tensor | None = None) -> torch.Tensor:
    """Cut packed ``[S, L, K]`` routing to the tokens this rank's routers see.

    ``cp_index``: the context-parallel partition index used for the tokens (e.g. from
    TransformerEngine's ``thd_get_partitioned_indices``); then, with sequence
    parallelism, the contiguous ``1/tp`` chunk of rank ``tp_rank``.
    """
    out = routed_experts
    if cp_index is not None:
        out = out.index_select(0, cp_index.to(out.device))
    if sequence_parallel and tp_size > 1:
        if out.shape[0] % tp_size:
            raise RouterReplayError(f"{out.shape[0]} tokens do not split over tp={tp_size}; "
                                    "pack with sequence_parallel=True")
        chunk = out.shape[0] // tp_size
        out = out[tp_rank * chunk : (tp_rank + 1) * chunk]
    return out
