"""Checkpoint format: Hub per-expert keys on disk, fused names accepted, strict validation."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from reference_engine.checkpoint import (
    CheckpointError,
    apply_named_tensors,
    build_model,
    init_checkpoint,
    load_model,
    load_state_dict,
    to_hub_state_dict,
)
from reference_engine.config import ModelConfig


def test_roundtrip_and_hub_keys(tmp_path):
    cfg = ModelConfig()
    init_checkpoint(tmp_path, cfg, seed=9)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in keys
    assert "model.layers.3.mlp.gate.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    conf = json.loads((tmp_path / "config.json").read_text())
    assert conf["model_type"] == "qwen3_moe" and conf["num_experts"] == 8
    a, b = load_model(tmp_path).state_dict(), build_model(cfg, 9).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_fused_names_load(tmp_path):
    m = build_model(ModelConfig(), seed=2)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(m.config.to_hf_dict()))
    got = load_model(tmp_path).state_dict()
    assert all(torch.equal(got[k], v) for k, v in m.state_dict().items())


def test_wrong_shape_unknown_and_missing(tmp_path):
    m = build_model(ModelConfig(), seed=1)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(CheckpointError, match="shape"):
        apply_named_tensors(state, {"model.norm.weight": torch.ones(3)}, m.config)
    with pytest.raises(CheckpointError, match="unknown weight"):
        apply_named_tensors(state, {"model.bogus": torch.ones(3)}, m.config)
    with pytest.raises(CheckpointError, match="expert 9"):
        apply_named_tensors(state, {"model.layers.0.mlp.experts.9.up_proj.weight":
                                    torch.ones(32, 64)}, m.config)
    hub = to_hub_state_dict(m)
    hub.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    save_file(hub, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing"):
        load_state_dict(tmp_path, m)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_state_dict(tmp_path / "nope", m)


def test_partial_expert_update_touches_only_that_expert():
    m = build_model(ModelConfig(), seed=1)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    new = torch.full((32, 64), 0.5)
    touched = apply_named_tensors(
        state, {"model.layers.2.mlp.experts.4.up_proj.weight": new}, m.config)
    assert touched == set()  # the fused tensor is not complete from one expert
    gu = state["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(gu[4, 32:], new)
    old = m.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(gu[4, :32], old[4, :32]) and torch.equal(gu[3], old[3])


def test_config_accepts_transformers5_expert_count_key():
    from reference_engine.config import ModelConfig

    d = ModelConfig(num_experts=16, num_experts_per_tok=4).to_hf_dict()
    d.pop("num_experts")
    d["num_local_experts"] = 16
    assert ModelConfig.from_hf_dict(d).num_experts == 16
