"""Load and save the reference engine's checkpoint format with transformers.

The format (a directory): ``config.json`` with Hugging Face ``Qwen3MoeConfig`` fields and
``model.safetensors`` with Hugging Face Hub key names, one tensor per expert
(``model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight``); SGLang reads the same.

Verified against transformers 5.24: ``save_pretrained`` converts the in-memory fused
expert tensors (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I])
back to the per-expert Hub names, so the weights file is exactly the format. Its
``config.json`` however spells the expert count ``num_local_experts`` (the
``attribute_map`` alias), while readers of the plain HF dict (the reference engine,
SGLang's Qwen3-MoE config) read ``num_experts``; :func:`save_for_engine` therefore adds
``num_experts`` (and a top-level ``rope_theta``) to config.json.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["load_model", "save_for_engine", "CONFIG_FILE", "WEIGHTS_FILE"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def load_model(directory: str | Path, *, dtype: torch.dtype = torch.float32,
               experts_implementation: str = "eager",
               attn_implementation: str = "sdpa") -> Any:
    """A ``transformers`` causal LM (Qwen3MoeForCausalLM for the reference engine).

    ``experts_implementation="eager"``: on CPU transformers' default grouped_mm expert
    kernel is far slower for small models. Raises FileNotFoundError / ValueError with the
    directory named when it is not a checkpoint.
    """
    from transformers import AutoModelForCausalLM

    d = Path(directory)
    if not (d / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in checkpoint directory {str(d)!r}")
    if not any(d.glob("*.safetensors")):
        raise FileNotFoundError(f"no *.safetensors in checkpoint directory {str(d)!r}")
    model = AutoModelForCausalLM.from_pretrained(
        str(d), dtype=dtype, experts_implementation=experts_implementation,
        attn_implementation=attn_implementation)
    return model


def _engine_config_dict(path: Path) -> dict[str, Any]:
    cfg = json.loads(path.read_text())
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg["num_experts"] = cfg["num_local_experts"]
    rope = cfg.get("rope_parameters")
    if "rope_theta" not in cfg and isinstance(rope, dict) and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    return cfg


def save_for_engine(model: Any, directory: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write ``model`` as an engine checkpoint into ``directory``, atomically.

    Everything is written into a temporary sibling directory first and renamed into
    place, so an engine loading ``directory`` never sees a half-written checkpoint (an
    existing checkpoint there is replaced). ``dtype`` casts the saved weights (the
    reference engine computes in float32; default: keep the model's dtype).
    """
    target = Path(directory).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if dtype is not None and dtype != model.dtype:
            state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
            model.save_pretrained(str(tmp), state_dict=state, safe_serialization=True)
            cfg = json.loads((tmp / CONFIG_FILE).read_text())
            cfg["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
        else:
            model.save_pretrained(str(tmp), safe_serialization=True)
        if not any(tmp.glob("*.safetensors")):  # large models shard; the engine globs
            raise RuntimeError(f"save_pretrained wrote no *.safetensors: "
                               f"{sorted(p.name for p in tmp.iterdir())}")
        (tmp / CONFIG_FILE).write_text(json.dumps(_engine_config_dict(tmp / CONFIG_FILE),
                                                  indent=2))
        old = None
        if target.exists():
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
