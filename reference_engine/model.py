"""A compact Qwen3-MoE causal LM in PyTorch with per-request KV caches.

Parameter names equal transformers 5's in-memory ``Qwen3MoeForCausalLM`` names
(``model.layers.{i}.mlp.experts.gate_up_proj`` is ``[E, 2*I, H]``, ``down_proj`` is
``[E, H, I]``, the router is ``model.layers.{i}.mlp.gate.weight``). The on-disk format
(per-expert Hub keys) is handled by :mod:`reference_engine.checkpoint`.

:meth:`Qwen3MoeLM.forward_chunks` runs several sequences at once: every new token of
every sequence goes through the linear and MoE layers as one batch; attention runs per
sequence against that sequence's own :class:`KVCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from reference_engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.nh, self.nkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        b = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.nh * self.d, bias=b)
        self.k_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=b)
        self.v_proj = nn.Linear(cfg.hidden_size, self.nkv * self.d, bias=b)
        self.o_proj = nn.Linear(self.nh * self.d, cfg.hidden_size, bias=b)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size))


class SparseMoe(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Router(cfg)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, route: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> (out [N, H], top-k expert ids [N, k]). ``route`` [N, k] replays given
        expert ids instead of the router's choice (weights: the router's probabilities of
        those experts), as routing replay (R3) does."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float)
        if route is None:
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:
            top_i = route.to(torch.long)
            top_w = probs.gather(-1, top_i)
        if self.norm_topk:
            top_w = top_w / top_w.sum(-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        out = torch.zeros_like(x)
        gu, dn = self.experts.gate_up_proj, self.experts.down_proj
        for e in torch.unique(top_i).tolist():
            tok, slot = torch.where(top_i == e)
            g, u = F.linear(x[tok], gu[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(g) * u, dn[e]) * top_w[tok, slot, None]
            out.index_add_(0, tok, y)
        return out, top_i


class DenseMlp(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.is_moe = cfg.is_moe_layer(idx)
        self.mlp: nn.Module = SparseMoe(cfg) if self.is_moe else DenseMlp(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class KVCache:
    """One sequence's keys/values: per layer a time-major ``[capacity, num_kv_heads, head_dim]``
    buffer that grows by doubling (no per-step copy of the cache); ``length`` positions valid."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``/``v`` ``[n, nkv, d]`` after the first ``length`` positions of ``layer``;
        return views ``[length + n, nkv, d]`` of all keys/values so far."""
        end = self.length + k.shape[0]
        if layer == len(self.k):
            cap = max(16, 2 * end)
            self.k.append(k.new_empty(cap, *k.shape[1:]))
            self.v.append(v.new_empty(cap, *v.shape[1:]))
        elif end > self.k[layer].shape[0]:
            for buf in (self.k, self.v):
                old = buf[layer]
                grown = old.new_empty(2 * end, *old.shape[1:])
                grown[: self.length] = old[: self.length]
                buf[layer] = grown
        self.k[layer][self.length:end] = k
        self.v[layer][self.length:end] = v
        return self.k[layer][:end], self.v[layer][:end]

    @classmethod
    def from_values(cls, kv: torch.Tensor) -> KVCache:
        """A cache holding ``kv`` ``[layers, 2, n, kv_heads, head_dim]`` (a cached prefix)."""
        c = cls()
        n = kv.shape[2]
        for layer in range(kv.shape[0]):
            for buf, src in ((c.k, kv[layer, 0]), (c.v, kv[layer, 1])):
                b = src.new_empty(max(16, 2 * n), *src.shape[1:])
                b[:n] = src
                buf.append(b)
        c.length = n
        return c

    def values(self, start: int, end: int) -> torch.Tensor:
        """Copy of positions ``start:end`` as ``[layers, 2, end - start, kv_heads, head_dim]``."""
        return torch.stack([torch.stack((k[start:end], v[start:end]))
                            for k, v in zip(self.k, self.v)])

    def overwrite(self, start: int, kv: torch.Tensor) -> None:
        """Replace positions ``start:start + n`` (already filled) with ``kv``."""
        end = start + kv.shape[2]
        assert end <= self.length
        for layer in range(len(self.k)):
            self.k[layer][start:end] = kv[layer, 0]
            self.v[layer][start:end] = kv[layer, 1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: list[int],
           offsets: list[int], caches: list[KVCache], layer: int) -> torch.Tensor:
    """Causal attention of every new token against its own sequence's cache.

    ``q`` [N, nh, d], ``k``/``v`` [N, nkv, d] (rows of all sequences concatenated). Sequences
    adding one token (decode) are attended together, padded to the longest; longer chunks
    (prefill) one by one with a causal mask. Returns [N, nh * d]."""
    n_tok, nh, d = q.shape
    out = q.new_empty(n_tok, nh * d)
    dec_rows, dec_k, dec_v = [], [], []
    for off, n, cache in zip(offsets, lens, caches):
        ks, vs = cache.append(layer, k[off:off + n], v[off:off + n])
        if n == 1:
            dec_rows.append(off)
            dec_k.append(ks)
            dec_v.append(vs)
            continue
        t = ks.shape[0]
        mask = torch.arange(t)[None, :] <= torch.arange(t - n, t)[:, None]
        o = F.scaled_dot_product_attention(q[off:off + n].transpose(0, 1)[None],
                                           ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                                           attn_mask=mask, enable_gqa=True)
        out[off:off + n] = o[0].transpose(0, 1).reshape(n, nh * d)
    if dec_rows:
        rows = torch.tensor(dec_rows)
        kp = pad_sequence(dec_k, batch_first=True).transpose(1, 2)  # [B, nkv, T, d]
        vp = pad_sequence(dec_v, batch_first=True).transpose(1, 2)
        lengths = torch.tensor([t.shape[0] for t in dec_k])
        mask = (torch.arange(kp.shape[2])[None, :] < lengths[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(q[rows][:, :, None, :], kp, vp, attn_mask=mask,
                                           enable_gqa=True)  # [B, nh, 1, d]
        out[rows] = o.reshape(len(dec_rows), nh * d)
    return out


@dataclass
class ChunkOutput:
    """Result of one forward over new tokens of several sequences (rows concatenated)."""

    hidden: torch.Tensor  # [N, H] final-normed hidden states of every new token
    topk: torch.Tensor  # [N, num_layers, top_k] int64; zeros for dense layers
    offsets: list[int]  # row offset of each sequence's first new token


class Qwen3MoeLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        d = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        self.register_buffer("inv_freq", inv, persistent=False)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def forward_chunks(self, ids: list[torch.Tensor], caches: list[KVCache],
                       routing: torch.Tensor | None = None) -> ChunkOutput:
        """Append ``ids[i]`` (1-D int64) to sequence i, whose past is ``caches[i]`` (updated).
        ``routing`` [N, layers, k] (N: all tokens of ``ids``) replays those experts in the
        MoE layers (see SparseMoe.forward)."""
        cfg = self.config
        lens = [int(t.numel()) for t in ids]
        offsets = [0]
        for n in lens[:-1]:
            offsets.append(offsets[-1] + n)
        pos = torch.cat([torch.arange(c.length, c.length + n) for c, n in zip(caches, lens)])
        freqs = pos[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]  # [N, 1, d]
        x = self.model.embed_tokens(torch.cat(ids))
        n_tok = x.shape[0]
        k_top = cfg.num_experts_per_tok
        topk = torch.zeros(n_tok, cfg.num_hidden_layers, k_top, dtype=torch.long)
        for li, layer in enumerate(self.model.layers):
            att = layer.self_attn
            h = layer.input_layernorm(x)
            q = att.q_norm(att.q_proj(h).view(n_tok, att.nh, att.d))
            k = att.k_norm(att.k_proj(h).view(n_tok, att.nkv, att.d))
            v = att.v_proj(h).view(n_tok, att.nkv, att.d)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            x = x + att.o_proj(attend(q, k, v, lens, offsets, caches, li))
            h = layer.post_attention_layernorm(x)
            if layer.is_moe:
                y, ti = layer.mlp(h, None if routing is None else routing[:, li])
                topk[:, li] = ti
            else:
                y = layer.mlp(h)
            x = x + y
        for cache, n in zip(caches, lens):
            cache.length += n
        return ChunkOutput(hidden=self.model.norm(x), topk=topk, offsets=offsets)

    @torch.no_grad()
    def forward_full(self, ids: torch.Tensor, routing: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole sequence from scratch: (logits [T, V] float32, router top-k [T, L, k])."""
        out = self.forward_chunks([ids], [KVCache()], routing)
        return self.logits(out.hidden), out.topk
