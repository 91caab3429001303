"""The MoE routing shape of an engine's model, found the way a deployment has it.

SGLang 0.5.23's ``/model_info`` carries no layer or expert counts. The shape comes from,
in order (each field separately): the gateway settings (``ROLLOUT_GATEWAY_MODEL__*``), the
engine's own answer when it reports one (the reference engine's ``model_config``), and
the Hugging Face ``config.json`` under the ``model_path`` that ``/model_info`` /
``/server_info`` report, when the gateway can read that path (a shared mount). Whatever
is found, every ``routed_experts`` payload is still checked against it (rows x layers x
top_k ids, see :func:`rollout_gateway.engines.decode._shape_routed`).

When the shape cannot be known, or the engine was started without
``--enable-return-routed-experts``, :func:`routing_problem` says so in one sentence that
names what to configure; the pool logs it once at registration and a request that asks
for routing fails with it (:class:`~rollout_gateway.errors.FailedPrecondition`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rollout_gateway.engines.decode import RoutingSpec

#: HF config keys, first match wins (Qwen2/3-MoE, Mixtral/GPT-OSS, DeepSeek, others)
LAYER_KEYS = ("num_hidden_layers", "n_layers", "num_layers")
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k_experts")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
SETTINGS_HINT = ("set ROLLOUT_GATEWAY_MODEL__NUM_LAYERS, ROLLOUT_GATEWAY_MODEL__TOP_K and "
                 "ROLLOUT_GATEWAY_MODEL__NUM_EXPERTS (or mount the model directory at the "
                 "model_path the engine reports, so its config.json is readable)")


def _first_int(cfg: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = cfg.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def shape_from_hf_config(cfg: dict[str, Any]) -> tuple[int | None, int | None, int | None]:
    """(layers, top_k, num_experts) from a HF config dict; multimodal configs nest the
    language model under ``text_config`` / ``language_config``."""
    for sub in ("text_config", "language_config", "llm_config"):
        inner = cfg.get(sub)
        if isinstance(inner, dict) and _first_int(inner, EXPERT_KEYS):
            cfg = inner
            break
    return _first_int(cfg, LAYER_KEYS), _first_int(cfg, TOP_K_KEYS), _first_int(cfg, EXPERT_KEYS)


def vocab_from_hf_config(cfg: dict[str, Any]) -> int | None:
    """The vocabulary size (``vocab_size``; multimodal configs nest it like the shape)."""
    for sub in ("text_config", "language_config", "llm_config"):
        inner = cfg.get(sub)
        if isinstance(inner, dict) and _first_int(inner, ("vocab_size",)):
            return _first_int(inner, ("vocab_size",))
    return _first_int(cfg, ("vocab_size",))


def read_hf_config(model_path: str) -> tuple[dict[str, Any] | None, str]:
    """(config dict, where/why) for ``<model_path>/config.json``; None when unreadable."""
    p = Path(model_path)
    path = p if p.name == "config.json" else p / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{path} is not readable here ({type(exc).__name__})"
    if not isinstance(data, dict):
        return None, f"{path} does not hold a JSON object"
    return data, str(path)


def resolve_spec(override: Any, reported: tuple[int | None, int | None, int | None]
                 ) -> RoutingSpec | None:
    """Settings (``override``: an object with num_layers/top_k/num_experts) over what the
    engine reported; None unless all three are known."""
    layers = getattr(override, "num_layers", None) or reported[0]
    top_k = getattr(override, "top_k", None) or reported[1]
    n_exp = getattr(override, "num_experts", None) or reported[2]
    if layers and top_k and n_exp:
        return RoutingSpec(int(layers), int(top_k), int(n_exp))
    return None


def routing_problem(engine_id: str, info: Any, override: Any) -> str | None:
    """Why routing cannot be returned for this engine (None when it can)."""
    if info.routing_enabled is False:
        return (f"engine {engine_id} was started without --enable-return-routed-experts "
                f"(its /server_info says so): SGLang would silently return no routing; "
                f"restart it with that flag")
    if resolve_spec(override, (info.num_layers, info.top_k, info.num_experts)) is None:
        where = info.shape_source or "no model_path reported"
        missing = [n for n, v in (("layers", info.num_layers), ("top_k", info.top_k),
                                  ("num_experts", info.num_experts)) if not v]
        return (f"the MoE routing shape of engine {engine_id} is unknown (missing "
                f"{', '.join(missing)}; /model_info has no counts and {where}): "
                f"{SETTINGS_HINT}")
    return None
