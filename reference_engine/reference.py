"""Ground truth for tests: fresh full forward passes (no KV cache reuse), pure torch.

Used by the engine's tests and the gateway's integration tests to check what an engine
stamped: per-position logprobs of the next token (temperature-scaled), exact entropies and
the router's top-k.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from reference_engine.checkpoint import build_model, load_model
from reference_engine.config import ModelConfig
from reference_engine.model import KVCache, Qwen3MoeLM
from reference_engine.sampling import GREEDY_EPS, entropy_of, scaled_logprobs


@dataclass
class Scored:
    """Scores of the tokens ``ids[start:]`` of a sequence, each given all tokens before it."""

    logprobs: np.ndarray  # [n] float32
    entropy: np.ndarray  # [n] float32
    routed_experts: np.ndarray  # [len(ids) - 1, num_layers, top_k] int32 (routing of inputs)


def model_from(source: str | Path | tuple[ModelConfig, int] | Qwen3MoeLM) -> Qwen3MoeLM:
    """A model from a checkpoint dir, a ``(config, seed)`` pair, or a model itself."""
    if isinstance(source, Qwen3MoeLM):
        return source
    if isinstance(source, tuple):
        return build_model(source[0], source[1])
    return load_model(source)


def _score(logits: torch.Tensor, topk: torch.Tensor, ids: torch.Tensor, start: int,
           temperature: float) -> Scored:
    t = 1.0 if temperature < GREEDY_EPS else float(temperature)
    logp = scaled_logprobs(logits[start - 1:-1], torch.full((logits.shape[0] - start,), t))
    target = ids[start:]
    lp = logp.gather(1, target[:, None])[:, 0]
    return Scored(logprobs=lp.numpy().astype(np.float32),
                  entropy=entropy_of(logp).numpy().astype(np.float32),
                  routed_experts=topk[:-1].numpy().astype(np.int32))


def score(model: Qwen3MoeLM, ids: list[int], start: int, temperature: float = 1.0,
          routing: np.ndarray | None = None) -> Scored:
    """Full forward over ``ids`` under ``model``; scores positions ``start..len(ids)-1``.
    ``routing`` [len(ids), layers, k]: replay those experts instead of the router's."""
    if not 1 <= start <= len(ids):
        raise ValueError("start must be in [1, len(ids)]")
    t = torch.tensor(ids, dtype=torch.long)
    logits, topk = model.forward_full(t, _routes(routing))
    return _score(logits, topk, t, start, temperature)


def score_mixed(old: Qwen3MoeLM, new: Qwen3MoeLM, ids: list[int], switch: int, start: int,
                temperature: float = 1.0, routing: np.ndarray | None = None) -> Scored:
    """Like :func:`score`, but positions ``< switch`` are computed by ``old`` (their KV and
    routing stay old) and positions ``>= switch`` by ``new`` attending to the old KV: what an
    in-place weight swap produces."""
    t = torch.tensor(ids, dtype=torch.long)
    cache = KVCache()
    r = _routes(routing)
    a = old.forward_chunks([t[:switch]], [cache], None if r is None else r[:switch])
    b = new.forward_chunks([t[switch:]], [cache], None if r is None else r[switch:])
    logits = torch.cat((old.logits(a.hidden), new.logits(b.hidden)))
    topk = torch.cat((a.topk, b.topk))
    return _score(logits, topk, t, start, temperature)


def _routes(routing: np.ndarray | None) -> torch.Tensor | None:
    return None if routing is None else torch.as_tensor(np.asarray(routing, dtype=np.int64))
