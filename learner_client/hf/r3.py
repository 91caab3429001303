"""Routing replay (R3) and routing capture for transformers' Qwen3-MoE (transformers 5).

In transformers 5 a sparse block is ``mlp.gate`` (``Qwen3MoeTopKRouter``: returns
``(router_logits, top-k weights, top-k indices)``) followed by ``mlp.experts``
(``Qwen3MoeExperts``, called with those indices and weights). Replay is a forward hook on
the gate that keeps the router's own logits (and their gradient) and substitutes the
rollout's expert set ``I``::

    w_e = softmax(z)_e for e in I,  renormalized over I when norm_topk_prob
        = exp(z_e) / sum_{e' in I} exp(z_e')        (norm_topk_prob=True: the R3 rule)

i.e. the model's own weighting rule applied to the replayed experts. Nothing in
transformers is patched; hooks are removed on exit.

Routing layout is the gateway's / SGLang's: ``[N, num_hidden_layers, top_k]`` over all
layers (dense layers ignored), rows in the order the router sees tokens: the model input
``[B, T]`` flattened row-major (for a packed ``[1, S]`` batch: packed positions).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["RoutingReplayError", "moe_gates", "replay_routing", "record_routing"]

_GATE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.gate$")


class RoutingReplayError(ValueError):
    """Routing that cannot be replayed on this model (shape, ids, layers)."""


def moe_gates(model: Any) -> list[tuple[int, Any]]:
    """``(decoder layer index, router module)`` of every sparse MoE layer, in layer order."""
    gates = []
    for name, mod in model.named_modules():
        m = _GATE_NAME.search(name)
        if m and hasattr(mod, "top_k") and hasattr(mod, "num_experts"):
            gates.append((int(m.group(1)), mod))
    if not gates:
        raise RoutingReplayError("the model has no MoE router (layers.N.mlp.gate) to replay")
    return sorted(gates, key=lambda g: g[0])


def _targets(gates: list[tuple[int, Any]], routed: torch.Tensor) -> dict[int, torch.Tensor]:
    if routed.dim() != 3:
        raise RoutingReplayError(f"routed experts must be [tokens, layers, top_k], "
                                 f"got {tuple(routed.shape)}")
    out = {}
    for layer, gate in gates:
        if layer >= routed.shape[1]:
            raise RoutingReplayError(f"MoE layer {layer} is beyond the {routed.shape[1]} "
                                     "layers of routing given")
        if routed.shape[2] != gate.top_k:
            raise RoutingReplayError(f"routing has top_k={routed.shape[2]}, layer {layer} "
                                     f"routes to {gate.top_k}")
        idx = routed[:, layer, :].to(device=gate.weight.device, dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= gate.num_experts):
            raise RoutingReplayError(f"layer {layer}: expert ids outside [0, {gate.num_experts})")
        if idx.numel() and bool((idx.sort(dim=1).values.diff(dim=1) == 0).any()):
            raise RoutingReplayError(f"layer {layer}: a token repeats an expert")
        out[layer] = idx.contiguous()
    return out


def _replay_hook(idx: torch.Tensor, layer: int):
    def hook(mod: Any, args: Any, output: Any) -> Any:
        router_logits = output[0]
        if router_logits.shape[0] != idx.shape[0]:
            raise RoutingReplayError(
                f"layer {layer}: the router sees {router_logits.shape[0]} tokens, the replayed "
                f"routing has {idx.shape[0]} rows")
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)
        weights = probs.gather(1, idx)
        if getattr(mod, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(router_logits.dtype), idx

    return hook


@contextmanager
def replay_routing(model: Any, routed_experts: torch.Tensor) -> Iterator[None]:
    """Within the block every forward of ``model`` routes tokens to ``routed_experts``.

    Validation (layers, top_k, expert range, duplicates) happens before any hook is set;
    a token-count mismatch is raised at forward time.
    """
    gates = moe_gates(model)
    targets = _targets(gates, routed_experts)
    handles = [g.register_forward_hook(_replay_hook(targets[layer], layer), prepend=True)
               for layer, g in gates]  # first, so observer hooks see the replayed routing
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def record_routing(model: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Capture the experts the model picks: yields a dict whose ``"routed"`` entry is set
    on exit to ``[N, num_hidden_layers, top_k]`` int64 (zeros for dense layers) of the
    last forward pass, the gateway's layout."""
    gates = moe_gates(model)
    seen: dict[int, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}

    def make(layer: int):
        def hook(mod: Any, args: Any, output: Any) -> None:
            seen[layer] = output[2].detach().clone()
        return hook

    handles = [g.register_forward_hook(make(layer)) for layer, g in gates]
    try:
        yield result
    finally:
        for h in handles:
            h.remove()
        if seen:
            n_layers = int(getattr(model.config, "num_hidden_layers", max(seen) + 1))
            first = next(iter(seen.values()))
            routed = torch.zeros(first.shape[0], n_layers, first.shape[1], dtype=torch.long)
            for layer, idx in seen.items():
                routed[:, layer] = idx.cpu()
            result["routed"] = routed
