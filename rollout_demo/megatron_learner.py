"""The demo's Megatron-Core learner: a GPTModel with the reference model's tiny MoE config.

Use it from the demo (``rollout-gateway demo --learner megatron``) or copy
:meth:`MegatronLearner.train_step` into a Megatron training loop: the pieces are the ones a
real job uses —

* :func:`transformer_config` / :func:`build_gpt`: ``TransformerConfig`` + ``GPTModel``
  (local, non-TransformerEngine layer spec) with the reference engine's Qwen3-MoE shape:
  RMSNorm, QK-norm, SwiGLU experts, GQA, RoPE, top-k softmax router, routing replay on.
* :func:`engine_to_mcore` / :func:`mcore_to_engine`: the engine checkpoint's Hugging Face
  Hub names <-> Megatron names (fused, group-interleaved QKV; fused gate|up ``linear_fc1``),
  so the learner starts from the engine's weights and :meth:`MegatronLearner.save` writes a
  checkpoint the engines hot-swap.
* ``learner_client.megatron.make_forward_step``: THD packing (``PackedBatch``), routing
  replay (R3) into megatron's routers, and the correction through ``make_loss_func``.
  pi_old is recomputed with the forward-only path (``loss_func(output, non_loss_data=True)``).

On a GPU with TransformerEngine use ``attention="thd"`` (PackedSeqParams). On CPU,
megatron-core 0.16.1 hard-codes CUDA in three places the local spec reaches (rotary
embedding device, the RNG tracker fork around attention dropout, and a name only defined
when TransformerEngine is installed in the router's gating); :func:`cpu_shims` works around
exactly those for the duration of a forward/backward, and ``attention="mask"`` runs the
packed row with a block-diagonal causal mask. Megatron's pipeline schedules need CUDA, so
the step here calls forward_step and loss_func directly (one microbatch, the
``calculate_per_token_loss=False`` scaling: loss = scaled / n).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rollout_demo.learner import Sample, StepResult, make_optimizer, pack_batch, step_result
from reference_engine.checkpoint import CONFIG_FILE, WEIGHTS_FILE, read_config
from reference_engine.config import ModelConfig


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Let megatron-core 0.16.1's local-spec GPTModel run forward/backward on CPU (see the
    module docstring). A no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils

    class _NoRngFork:
        def fork(self, name: str = "model-parallel-rng"):
            return contextlib.nullcontext()  # dropout is 0; no CUDA RNG state to fork

    saved = (torch.cuda.current_device, tensor_parallel.get_cuda_rng_tracker,
             mrandom.get_cuda_rng_tracker, getattr(moe_utils, "te_general_gemm", "<unset>"))
    torch.cuda.current_device = lambda: "cpu"  # rotary: inv_freq.to(current_device())
    tensor_parallel.get_cuda_rng_tracker = mrandom.get_cuda_rng_tracker = \
        lambda *a, **k: _NoRngFork()
    if saved[3] == "<unset>":
        moe_utils.te_general_gemm = None  # referenced before the fp64 check without TE
    try:
        yield
    finally:
        torch.cuda.current_device = saved[0]
        tensor_parallel.get_cuda_rng_tracker = saved[1]
        mrandom.get_cuda_rng_tracker = saved[2]
        if saved[3] == "<unset>":
            del moe_utils.te_general_gemm


@contextlib.contextmanager
def single_process_parallel_state() -> Iterator[None]:
    """torch.distributed (gloo, world 1) + megatron's model-parallel state, if not yet up."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    own = not dist.is_initialized()
    if own:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if own:
            dist.destroy_process_group()


def _check_supported(mc: ModelConfig) -> None:
    if not all(mc.is_moe_layer(i) for i in range(mc.num_hidden_layers)):
        raise ValueError("the Megatron learner maps all-MoE configs only "
                         "(decoder_sparse_step=1, no mlp_only_layers)")
    if mc.tie_word_embeddings or mc.attention_bias:
        raise ValueError("tie_word_embeddings / attention_bias are not mapped")


def transformer_config(mc: ModelConfig, **overrides: Any):
    """megatron-core ``TransformerConfig`` equal to the reference engine's Qwen3-MoE."""
    from megatron.core.transformer import TransformerConfig

    _check_supported(mc)
    kw: dict[str, Any] = dict(
        num_layers=mc.num_hidden_layers, hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_attention_heads, num_query_groups=mc.num_key_value_heads,
        kv_channels=mc.head_dim, ffn_hidden_size=mc.intermediate_size,
        moe_ffn_hidden_size=mc.moe_intermediate_size, num_moe_experts=mc.num_experts,
        moe_router_topk=mc.num_experts_per_tok,
        # norm_topk_prob: softmax over the chosen logits == renormalized full softmax
        moe_router_pre_softmax=not mc.norm_topk_prob,
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=False, moe_enable_routing_replay=True,
        normalization="RMSNorm", layernorm_epsilon=mc.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, bf16=False, fp16=False,
        apply_rope_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_gpt(mc: ModelConfig, **overrides: Any):
    """A ``GPTModel`` (local spec) of the reference model's shape; weights uninitialized
    for our purposes (load them with :func:`load_engine_weights`)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    cfg = transformer_config(mc, **overrides)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mc.vocab_size,
                    max_sequence_length=mc.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=int(mc.rope_theta),
                    share_embeddings_and_output_weights=False)


#: one-to-one renames (Hub name, GPTModel name): the whole model, then per layer (after
#: ``model.layers.{i}.`` / ``decoder.layers.{i}.``); used both ways
_RENAMES = (("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
            ("model.norm.weight", "decoder.final_layernorm.weight"),
            ("lm_head.weight", "output_layer.weight"))
_LAYER_RENAMES = (("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                  ("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
                  ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"),
                  ("input_layernorm.weight", "input_layernorm.weight"),
                  ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                  ("mlp.gate.weight", "mlp.router.weight"))


def engine_to_mcore(hub: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """Hub-named engine weights -> GPTModel state-dict names (parameters only)."""
    g, d, h = mc.num_key_value_heads, mc.head_dim, mc.hidden_size
    hpg = mc.num_attention_heads // g
    out = {mcore: hub[name] for name, mcore in _RENAMES}
    for i in range(mc.num_hidden_layers):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = hub[a + "self_attn.q_proj.weight"].reshape(g, hpg * d, h)
        k = hub[a + "self_attn.k_proj.weight"].reshape(g, d, h)
        v = hub[a + "self_attn.v_proj.weight"].reshape(g, d, h)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat((q, k, v), 1).reshape(-1, h)
        out.update({m + mcore: hub[a + name] for name, mcore in _LAYER_RENAMES})
        for e in range(mc.num_experts):
            x = f"{a}mlp.experts.{e}."
            y = f"{m}mlp.experts.local_experts.{e}."
            out[y + "linear_fc1.weight"] = torch.cat((hub[x + "gate_proj.weight"],
                                                      hub[x + "up_proj.weight"]))
            out[y + "linear_fc2.weight"] = hub[x + "down_proj.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def mcore_to_engine(state: dict[str, torch.Tensor], mc: ModelConfig) -> dict[str, torch.Tensor]:
    """GPTModel parameters -> Hub-named engine weights (inverse of :func:`engine_to_mcore`)."""
    g, d, h = mc.num_key_value_heads, mc.head_dim, mc.hidden_size
    hpg = mc.num_attention_heads // g
    inter = mc.moe_intermediate_size
    out = {name: state[mcore] for name, mcore in _RENAMES}
    for i in range(mc.num_hidden_layers):
        a, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = state[m + "self_attention.linear_qkv.weight"].reshape(g, (hpg + 2) * d, h)
        out[a + "self_attn.q_proj.weight"] = qkv[:, :hpg * d].reshape(-1, h)
        out[a + "self_attn.k_proj.weight"] = qkv[:, hpg * d:(hpg + 1) * d].reshape(-1, h)
        out[a + "self_attn.v_proj.weight"] = qkv[:, (hpg + 1) * d:].reshape(-1, h)
        out.update({a + name: state[m + mcore] for name, mcore in _LAYER_RENAMES})
        for e in range(mc.num_experts):
            x = f"{a}mlp.experts.{e}."
            fc1 = state[f"{m}mlp.experts.local_experts.{e}.linear_fc1.weight"]
            out[x + "gate_proj.weight"] = fc1[:inter]
            out[x + "up_proj.weight"] = fc1[inter:]
            out[x + "down_proj.weight"] = state[f"{m}mlp.experts.local_experts.{e}.linear_fc2.weight"]
    return {k: v.detach().to(torch.float32).contiguous() for k, v in out.items()}


def load_engine_weights(model: Any, checkpoint: str | Path, mc: ModelConfig) -> None:
    """Copy an engine checkpoint's weights into ``model``; every parameter must be covered."""
    from safetensors.torch import load_file

    hub: dict[str, torch.Tensor] = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        hub.update(load_file(str(f)))
    mapped = engine_to_mcore(hub, mc)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(mapped))
    extra = sorted(set(mapped) - set(params))
    if missing or extra:
        raise ValueError(f"weight mapping mismatch: missing {missing[:5]}, unknown {extra[:5]}")
    with torch.no_grad():
        for name, p in params.items():
            if p.shape != mapped[name].shape:
                raise ValueError(f"{name}: checkpoint {tuple(mapped[name].shape)} vs model "
                                 f"{tuple(p.shape)}")
            p.copy_(mapped[name])


def save_engine_checkpoint(model: Any, mc: ModelConfig, directory: str | Path) -> Path:
    """Write the model as an engine checkpoint, atomically (temp dir, then rename)."""
    from safetensors.torch import save_file

    target = Path(directory).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        state = {k: v for k, v in model.named_parameters()}
        save_file(mcore_to_engine(state, mc), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(mc.to_hf_dict(), indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


class MegatronLearner:
    """Same interface as :class:`rollout_demo.learner.Learner` (``version``, ``train_step``,
    ``save``), on a megatron-core GPTModel. Needs :func:`single_process_parallel_state`
    (or a Megatron job's own initialization) around its lifetime."""

    def __init__(self, checkpoint: str | Path, *, loss: str = "sat",
                 loss_config: dict[str, Any] | None = None, lr: float = 3e-3,
                 temperature: float = 1.0, replay: bool = True, version: int = 0,
                 grad_clip: float = 1.0, optimizer: str = "adam",
                 attention: str | None = None) -> None:
        from learner_client.corrections import get_loss

        self.mc = read_config(checkpoint)
        self.spec = get_loss(loss)
        self.loss_name = loss
        self.loss_config = self.spec.config(loss_config)
        self.model = build_gpt(self.mc)
        load_engine_weights(self.model, checkpoint, self.mc)
        self.ref_model = None
        if float(getattr(self.loss_config, "kl_coef", 0.0) or 0.0) > 0:
            self.ref_model = build_gpt(self.mc)
            load_engine_weights(self.ref_model, checkpoint, self.mc)
            self.ref_model.eval().requires_grad_(False)
        self.opt = make_optimizer(optimizer, self.model.parameters(), lr)
        self.temperature, self.replay, self.version = temperature, replay, version
        self.grad_clip = grad_clip
        self.attention = attention or ("thd" if torch.cuda.is_available() else "mask")

    def _forward_step(self):
        from learner_client.megatron.forward_step import make_forward_step

        return make_forward_step(self.loss_name, self.loss_config,
                                 temperature=self.temperature, learner_version=self.version,
                                 replay=self.replay, attention=self.attention)

    def _logprobs(self, model: Any, batch) -> torch.Tensor:
        """Forward-only log pi (the adapter's non_loss_data path), detached."""
        fs = self._forward_step()
        with torch.no_grad():
            out, loss_func = fs(iter([batch]), model)
            return loss_func(out, non_loss_data=True)["logprobs"]

    def train_step(self, samples: list[Sample]) -> StepResult:
        if not samples:
            raise ValueError("train_step needs at least one sample")
        batch = pack_batch(samples, self.replay)
        with cpu_shims():
            self.model.train()
            mask = batch.loss_mask() > 0
            rollout = batch.columns["rollout_logprobs"]
            old = self._logprobs(self.model, batch)  # pi_old = the weights before the step
            batch.columns["old_logprobs"] = torch.where(mask, old, rollout)
            if self.ref_model is not None:
                batch.columns["ref_logprobs"] = self._logprobs(self.ref_model, batch)
            out, loss_func = self._forward_step()(iter([batch]), self.model)
            scaled, num, report = loss_func(out)
            loss = scaled / num.clamp_min(1).to(scaled.dtype)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self._freeze_pad_row()
            if self.grad_clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            self.opt.step()
        metrics = {k: v[0] / v[1].clamp_min(1e-12) for k, v in report.items() if k != "loss"}
        res = step_result(samples, batch, old, loss, metrics, self.version)
        self.version += 1
        return res

    def _freeze_pad_row(self) -> None:
        """transformers' Qwen3-MoE embeds with ``padding_idx = pad_token_id``: that row gets
        no gradient. Sampled PAD tokens (the toy engine can sample any id) would otherwise
        make the two learners differ; do the same here."""
        w = self.model.embedding.word_embeddings.weight
        if w.grad is not None and 0 <= self.mc.pad_token_id < w.shape[0]:
            w.grad[self.mc.pad_token_id].zero_()

    def save(self, directory: str | Path) -> Path:
        return save_engine_checkpoint(self.model, self.mc, directory)
