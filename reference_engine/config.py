"""Model configuration of the reference engine (Hugging Face ``Qwen3MoeConfig`` fields).

No torch here: the launcher and CLI use it without importing torch.
``to_hf_dict()`` is exactly what goes into a checkpoint's ``config.json`` and loads with
``transformers.Qwen3MoeConfig`` / ``Qwen3MoeForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reference_engine.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE


class ModelConfig(BaseModel):
    """A Qwen3-MoE architecture. Defaults are the toy model the tests and demo run."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: int = Field(VOCAB_SIZE, ge=VOCAB_SIZE, le=1 << 20,
                            description="Vocabulary size; at least the byte tokenizer's 259.")
    hidden_size: int = Field(64, ge=8, le=16384, description="Residual stream width.")
    intermediate_size: int = Field(128, ge=1, le=65536,
                                   description="Dense MLP width (layers in mlp_only_layers).")
    moe_intermediate_size: int = Field(32, ge=1, le=65536, description="Width of each expert.")
    num_hidden_layers: int = Field(4, ge=1, le=256, description="Number of decoder layers.")
    num_attention_heads: int = Field(4, ge=1, le=256, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, le=256, description="KV heads (GQA).")
    head_dim: int = Field(16, ge=2, le=1024, description="Per-head width (even, for RoPE).")
    num_experts: int = Field(8, ge=1, le=1024, description="Experts per MoE layer.")
    num_experts_per_tok: int = Field(2, ge=1, le=64, description="Router top-k.")
    norm_topk_prob: bool = Field(True, description="Renormalize the top-k router probabilities.")
    decoder_sparse_step: int = Field(1, ge=1, le=256,
                                     description="Layer i is MoE when (i+1) % step == 0.")
    mlp_only_layers: list[int] = Field(default_factory=list,
                                       description="Layer indices forced to a dense MLP.")
    rms_norm_eps: float = Field(1e-6, gt=0, le=1e-2, description="RMSNorm epsilon.")
    rope_theta: float = Field(10000.0, gt=0, description="RoPE base.")
    max_position_embeddings: int = Field(4096, ge=16, le=1 << 20,
                                         description="Longest prompt+output the engine accepts.")
    tie_word_embeddings: bool = Field(False, description="Share embed_tokens and lm_head weights.")
    attention_bias: bool = Field(False, description="Bias on q/k/v/o projections.")
    hidden_act: str = Field("silu", pattern="^silu$", description="Only silu is supported.")
    initializer_range: float = Field(0.3, gt=0, le=10,
                                     description="Std of the seeded random init (large so the "
                                     "toy model's distributions are far from uniform).")
    bos_token_id: int = Field(BOS_ID, ge=0, description="Begin-of-sequence token.")
    eos_token_id: int = Field(EOS_ID, ge=0, description="End-of-sequence token.")
    pad_token_id: int = Field(PAD_ID, ge=0, description="Padding token.")

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok must be <= num_experts")
        if any(not 0 <= i < self.num_hidden_layers for i in self.mlp_only_layers):
            raise ValueError("mlp_only_layers entries must be layer indices")
        return self

    def is_moe_layer(self, i: int) -> bool:
        return (i not in self.mlp_only_layers and self.num_experts > 0
                and (i + 1) % self.decoder_sparse_step == 0)

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``config.json`` content (transformers' Qwen3MoeConfig fields)."""
        d = self.model_dump()
        d.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            use_sliding_window=False,
            sliding_window=None,
            attention_dropout=0.0,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            use_cache=True,
            torch_dtype="float32",
        )
        return d

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        rp = d.get("rope_parameters") or {}
        if "rope_theta" not in d and isinstance(rp, dict) and "rope_theta" in rp:
            d["rope_theta"] = rp["rope_theta"]
        # transformers 5 writes the expert count as ``num_local_experts``.
        if "num_experts" not in d and "num_local_experts" in d:
            d["num_experts"] = d["num_local_experts"]
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = d["eos_token_id"][0]
        if d.get("mlp_only_layers") is None:
            d.pop("mlp_only_layers", None)
        d = {k: v for k, v in d.items() if v is not None}
        return cls.model_validate(d)

    @classmethod
    def from_arg(cls, arg: str | None) -> ModelConfig:
        """Parse ``--model-config``: inline JSON, a path to a JSON file, or None (toy default)."""
        if not arg:
            return cls()
        text = arg.strip()
        if not text.startswith("{"):
            p = Path(text)
            if p.is_dir():
                p = p / "config.json"
            text = p.read_text()
        return cls.from_hf_dict(json.loads(text))
