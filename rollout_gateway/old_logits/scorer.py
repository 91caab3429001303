"""A dedicated old-logit scorer: one SGLang-protocol engine used for input-logprob
re-scoring (``max_new_tokens = 0``, ``return_logprob``, ``logprob_start_len = P - 1``), with
the checkpoint of whichever weight version a request needs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
import orjson

from rollout_gateway.core.stamping import kv_namespace
from rollout_gateway.engines.client import EngineClient
from rollout_gateway.errors import EngineError, FailedPrecondition
from rollout_gateway.settings import OldLogitsSettings, Timeouts

log = logging.getLogger(__name__)


def _scale(temperature: float) -> float:
    """The temperature the behavior logprobs were scaled by (greedy: 1, as SGLang stamps)."""
    t = float(temperature)
    return t if t > 0 else 1.0


def score_payload(prompt_ids: np.ndarray, output_ids: np.ndarray, temperature: float,
                  vocab_size: int | None = None, version: int | None = None) -> dict[str, Any]:
    """/generate body that scores ``output_ids`` after ``prompt_ids`` without sampling:
    input logprobs from position P - 1 (its own value is None, as SGLang's), so the values
    of positions P .. P+T-1 are log p(output_t | prompt, output_<t).

    SGLang 0.5.23 computes input logprobs from the raw logits (temperature 1, whatever the
    request's temperature; ``logprob_processor.py``) while its sampled-token logprobs are
    ``log_softmax(logits / T)``. So the body always asks at temperature 1; at another
    temperature it also asks for every position's whole distribution
    (``top_logprobs_num = vocab_size``), which :func:`parse_scores` rescales by ``T``
    (``log_softmax(l / T) = log_softmax(z / T)`` for ``l = log_softmax(z)``), so the old
    logprobs are comparable with the behavior ones (the same definition, exactly).

    With ``version`` (the weights loaded) the request carries that version's prefix-cache
    namespace (``cache_salt``), so no prefix hit serves KV another version computed: a
    weight load needs no cache flush (which SGLang refuses while a request is resident)."""
    p = int(prompt_ids.shape[0])
    if p < 1:
        raise FailedPrecondition("cannot score a trajectory with an empty prompt")
    ids = np.concatenate([prompt_ids, output_ids]).astype(np.int64).tolist()
    body: dict[str, Any] = {"input_ids": ids, "return_logprob": True, "logprob_start_len": p - 1,
                            "sampling_params": {"max_new_tokens": 0, "temperature": 1.0}}
    if _scale(temperature) != 1.0:
        if not vocab_size:
            raise FailedPrecondition(
                "old-logit scorer: scoring at temperature != 1 needs the model's vocabulary "
                "size (the engine's input logprobs are at temperature 1): mount the model "
                "directory at the model_path the scorer reports, so its config.json is "
                "readable")
        body["top_logprobs_num"] = int(vocab_size)
    if version is not None:
        body["cache_salt"] = kv_namespace(version)
    return body


def parse_scores(body: bytes, n: int, engine_id: str, output_ids: np.ndarray | None = None,
                 temperature: float = 1.0) -> np.ndarray:
    """float32 [n] log-probabilities of the scored tokens from a /generate response (at
    ``temperature``: rescaled from the whole distributions, see :func:`score_payload`)."""
    data = orjson.loads(body)
    if isinstance(data, list):
        data = data[0]
    meta = data.get("meta_info") or {}
    t = _scale(temperature)
    key = "input_token_logprobs" if t == 1.0 else "input_top_logprobs"
    rows = meta.get(key)
    if not isinstance(rows, list) or len(rows) != n + 1:
        got = len(rows) if isinstance(rows, list) else None
        raise EngineError(f"scorer {engine_id}: expected {n + 1} {key}, got {got}",
                          details={"engine_id": engine_id})
    if t == 1.0:
        vals = [r[0] for r in rows[1:]]
        if any(v is None for v in vals):
            raise EngineError(f"scorer {engine_id}: a scored token has no logprob",
                              details={"engine_id": engine_id})
        return np.asarray(vals, dtype=np.float32)
    if output_ids is None or int(output_ids.shape[0]) != n:
        raise ValueError("parse_scores at temperature != 1 needs the n scored token ids")
    out = np.empty(n, np.float64)
    for i, (row, y) in enumerate(zip(rows[1:], output_ids.tolist())):
        if not row:
            raise EngineError(f"scorer {engine_id}: no distribution at scored token {i}",
                              details={"engine_id": engine_id})
        lp = np.array([e[0] for e in row], np.float64) / t
        ids = [int(e[1]) for e in row]
        try:
            at = ids.index(int(y))
        except ValueError:
            raise EngineError(f"scorer {engine_id}: token {y} missing from the distribution "
                              f"at scored token {i} ({len(row)} entries)",
                              details={"engine_id": engine_id}) from None
        m = lp.max()
        out[i] = lp[at] - (m + np.log(np.exp(lp - m).sum()))
    return out.astype(np.float32)


class OldLogitScorer:
    """One scorer engine, one weight version at a time (a lock serializes loads and
    scores, so every score runs under the version it asked for)."""

    def __init__(self, cfg: OldLogitsSettings, timeouts: Timeouts | None = None) -> None:
        t = (timeouts or Timeouts()).model_copy(update={"generate_s": cfg.score_timeout_s})
        self.client = EngineClient("old-logit-scorer", cfg.scorer_url or "", timeouts=t,
                                   api_key=cfg.scorer_api_key)
        self.initial_source = cfg.initial_source
        self.version: int | None = None
        self.sources: dict[int, str] = {}
        self.lock = asyncio.Lock()
        self.counters = {"score_calls": 0, "scored_tokens": 0, "weight_loads": 0,
                         "score_seconds": 0.0, "load_seconds": 0.0, "prefill_tokens": 0}

    async def start(self) -> None:
        await self.client.detect()
        self.version = await self.client.weight_version()
        if self.version is not None and self.initial_source:
            self.sources.setdefault(self.version, self.initial_source)

    def add_source(self, version: int, path: str) -> None:
        self.sources[int(version)] = path

    async def ensure(self, version: int) -> None:
        """Load ``version`` unless it is loaded (call with ``lock`` held)."""
        if self.version == version:
            return
        path = self.sources.get(int(version))
        if path is None:
            raise FailedPrecondition(
                f"old-logit scorer: no checkpoint known for version {version} (known: "
                f"{sorted(self.sources)}); set old_logits.initial_source for the start-up "
                "version and swap from disk", details={"version": version})
        t0 = time.perf_counter()
        # no flush: scores carry the version's cache_salt (score_payload); a flush SGLang
        # refuses (a score that timed out may still be resident) would fail the load
        load = await self.client.update_weights_from_disk(path, version, flush_cache=False)
        if not load.cache_flushed:  # an engine that flushes anyway and refuses: relabel
            await self.client.update_weight_version(version, abort_all_requests=False)
        got = await self.client.weight_version()
        if got != version:
            raise EngineError(f"old-logit scorer reports version {got} after loading {version}")
        self.version = version
        self.counters["weight_loads"] += 1
        self.counters["load_seconds"] += time.perf_counter() - t0

    async def score(self, prompt_ids: np.ndarray, output_ids: np.ndarray,
                    temperature: float) -> np.ndarray:
        """Scores under the loaded version (call with ``lock`` held)."""
        n = int(output_ids.shape[0])
        if n == 0:
            return np.zeros(0, np.float32)
        t0 = time.perf_counter()
        body = await self.client.generate(score_payload(
            prompt_ids, output_ids, temperature, self.client.info.vocab_size, self.version))
        out = parse_scores(body, n, self.client.engine_id, output_ids, temperature)
        self.counters["score_calls"] += 1
        self.counters["scored_tokens"] += n
        self.counters["prefill_tokens"] += n + int(prompt_ids.shape[0])
        self.counters["score_seconds"] += time.perf_counter() - t0
        return out

    async def close(self) -> None:
        await self.client.close()
