"""The reference engine's checkpoint format (what a learner must write to hot-swap weights).

A checkpoint is a directory with two files:

``config.json``
    Hugging Face ``Qwen3MoeConfig`` fields (``model_type: "qwen3_moe"``,
    ``architectures: ["Qwen3MoeForCausalLM"]``, vocab_size, hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
    moe_intermediate_size, num_experts, num_experts_per_tok, norm_topk_prob,
    decoder_sparse_step, mlp_only_layers, rms_norm_eps, rope_theta (also inside
    ``rope_parameters``), tie_word_embeddings, ...). See ``ModelConfig.to_hf_dict``.
``model.safetensors``
    float32 tensors under the Hugging Face Hub key names (one tensor per expert), the
    format ``transformers.Qwen3MoeForCausalLM.from_pretrained(dir)`` loads and SGLang reads:

    - ``model.embed_tokens.weight`` [V, H]; ``model.norm.weight`` [H];
      ``lm_head.weight`` [V, H] (absent when tie_word_embeddings)
    - per layer ``L``: ``model.layers.L.input_layernorm.weight`` [H],
      ``model.layers.L.post_attention_layernorm.weight`` [H],
      ``model.layers.L.self_attn.{q,k,v,o}_proj.weight`` ([nh*d, H], [nkv*d, H], [nkv*d, H],
      [H, nh*d]), ``model.layers.L.self_attn.{q,k}_norm.weight`` [d]
    - MoE layer: ``model.layers.L.mlp.gate.weight`` [E, H] (the router) and per expert ``e``:
      ``model.layers.L.mlp.experts.e.gate_proj.weight`` [I, H],
      ``...experts.e.up_proj.weight`` [I, H], ``...experts.e.down_proj.weight`` [H, I]
    - dense layer: ``model.layers.L.mlp.{gate,up,down}_proj.weight``

Loading also accepts transformers 5's fused in-memory names
(``model.layers.L.mlp.experts.gate_up_proj`` [E, 2I, H] = gate rows then up rows, and
``model.layers.L.mlp.experts.down_proj`` [E, H, I]), so ``model.state_dict()`` of a
transformers 5 model can be saved with safetensors directly. The same names (either form)
are valid in ``/update_weights_from_distributed``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from reference_engine.config import ModelConfig
from reference_engine.model import Qwen3MoeLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint or named tensor set that does not fit the model."""


def build_model(config: ModelConfig, seed: int) -> Qwen3MoeLM:
    """A model with deterministic weights drawn from ``seed`` (same seed -> same weights)."""
    model = Qwen3MoeLM(config)
    gen = torch.Generator().manual_seed(int(seed))
    std = config.initializer_range
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1:  # norms: near one, so they matter in equivalence tests
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.requires_grad_(False)
    model.eval()
    return model


def to_hub_state_dict(model: Qwen3MoeLM) -> dict[str, torch.Tensor]:
    """The model's weights under Hub key names (per-expert tensors)."""
    cfg = model.config
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len(".gate_up_proj")]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                out[f"{base}.{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                out[f"{base}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t.detach().contiguous()
    return out


def apply_named_tensors(state: dict[str, torch.Tensor], named: dict[str, torch.Tensor],
                        config: ModelConfig) -> set[str]:
    """Write ``named`` (Hub or fused names) into ``state`` (internal names) in place.

    Returns the internal names touched (a fused expert tensor counts once all its experts
    arrived). Raises :class:`CheckpointError` on an unknown name or a wrong shape; callers
    apply to a copy so a failure leaves the served weights untouched.
    """
    inter = config.moe_intermediate_size
    touched: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}
    for name, t in named.items():
        m = _EXPERT_KEY.match(name)
        if m:
            base, e, kind = m.group(1), int(m.group(2)), m.group(3)
            target = f"{base}.down_proj" if kind == "down_proj" else f"{base}.gate_up_proj"
            if target not in state:
                raise CheckpointError(f"unknown weight name {name!r}")
            full = state[target]
            if e >= full.shape[0]:
                raise CheckpointError(f"{name!r}: expert {e} out of range ({full.shape[0]} experts)")
            rows = {"gate_proj": slice(0, inter), "up_proj": slice(inter, 2 * inter),
                    "down_proj": slice(None)}[kind]
            dest = full[e, rows]
            if tuple(t.shape) != tuple(dest.shape):
                raise CheckpointError(f"{name!r}: shape {tuple(t.shape)} != expected {tuple(dest.shape)}")
            dest.copy_(t.to(dest.dtype))
            expert_parts.setdefault(target, set()).add((e, kind))
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        if name not in state:
            raise CheckpointError(f"unknown weight name {name!r}")
        if tuple(t.shape) != tuple(state[name].shape):
            raise CheckpointError(
                f"{name!r}: shape {tuple(t.shape)} != expected {tuple(state[name].shape)}")
        state[name].copy_(t.to(state[name].dtype))
        touched.add(name)
    if config.tie_word_embeddings and "lm_head.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]  # keep the tie
    for target, parts in expert_parts.items():
        kinds = ("down_proj",) if target.endswith("down_proj") else ("gate_proj", "up_proj")
        if all((e, k) in parts for e in range(state[target].shape[0]) for k in kinds):
            touched.add(target)
    return touched


def save_checkpoint(directory: str | Path, model: Qwen3MoeLM) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (Hub format) into ``directory``."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2))
    save_file(to_hub_state_dict(model), str(d / WEIGHTS_FILE), metadata={"format": "pt"})
    return d


def init_checkpoint(directory: str | Path, config: ModelConfig | None = None, seed: int = 0) -> Path:
    """Build seeded weights (see :func:`build_model`) and save them as a checkpoint."""
    return save_checkpoint(directory, build_model(config or ModelConfig(), seed))


def read_config(directory: str | Path) -> ModelConfig:
    p = Path(directory) / CONFIG_FILE
    if not p.is_file():
        raise CheckpointError(f"no {CONFIG_FILE} in {directory}")
    try:
        return ModelConfig.from_hf_dict(json.loads(p.read_text()))
    except Exception as exc:  # noqa: BLE001 - any parse problem is a bad checkpoint
        raise CheckpointError(f"bad {p}: {exc}") from exc


def load_state_dict(directory: str | Path, model: Qwen3MoeLM) -> dict[str, torch.Tensor]:
    """A complete new internal state dict for ``model`` from a checkpoint dir (validated).

    Does not touch ``model``; raises :class:`CheckpointError` if anything is missing,
    unknown or of the wrong shape.
    """
    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"checkpoint directory {str(d)!r} does not exist")
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors file in {str(d)!r}")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    named: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            named.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"cannot read {f.name}: {exc}") from exc
    touched = apply_named_tensors(state, named, model.config)
    need = set(state)
    if model.config.tie_word_embeddings:
        need.discard("lm_head.weight")
    missing = sorted(need - touched)
    if missing:
        raise CheckpointError(f"checkpoint is missing weights: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    return state


def load_model(directory: str | Path) -> Qwen3MoeLM:
    """A model built from a checkpoint directory's config and weights."""
    model = Qwen3MoeLM(read_config(directory))
    model.load_state_dict(load_state_dict(directory, model))
    model.requires_grad_(False)
    model.eval()
    return model
