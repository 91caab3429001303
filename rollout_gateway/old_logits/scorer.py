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


def score_payload(prompt_ids: np.ndarray, output_ids: np.ndarray, temperature: float,
                  version: int | None = None) -> dict[str, Any]:
    """/generate body that scores ``output_ids`` after ``prompt_ids`` without sampling:
    input logprobs from position P - 1 (its own value is None, as SGLang's), so the values
    of positions P .. P+T-1 are log p(output_t | prompt, output_<t) at ``temperature``
    (the behavior logprob's scaling, so pi_old and mu are comparable). With ``version``
    (the weights loaded) the request carries that version's prefix-cache namespace
    (``cache_salt``), so no prefix hit serves KV another version computed: a weight load
    needs no cache flush (which SGLang refuses while a request is resident)."""
    p = int(prompt_ids.shape[0])
    if p < 1:
        raise FailedPrecondition("cannot score a trajectory with an empty prompt")
    ids = np.concatenate([prompt_ids, output_ids]).astype(np.int64).tolist()
    t = float(temperature)
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": p - 1,
            "sampling_params": {"max_new_tokens": 0, "temperature": t if t > 0 else 1.0}}
    if version is not None:
        body["cache_salt"] = kv_namespace(version)
    return body


def parse_scores(body: bytes, n: int, engine_id: str) -> np.ndarray:
    """float32 [n] log-probabilities of the scored tokens from a /generate response."""
    data = orjson.loads(body)
    if isinstance(data, list):
        data = data[0]
    rows = (data.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(rows, list) or len(rows) != n + 1:
        got = len(rows) if isinstance(rows, list) else None
        raise EngineError(f"scorer {engine_id}: expected {n + 1} input_token_logprobs, got {got}",
                          details={"engine_id": engine_id})
    vals = [r[0] for r in rows[1:]]
    if any(v is None for v in vals):
        raise EngineError(f"scorer {engine_id}: a scored token has no logprob",
                          details={"engine_id": engine_id})
    return np.asarray(vals, dtype=np.float32)


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
        body = await self.client.generate(score_payload(prompt_ids, output_ids, temperature,
                                                        self.version))
        out = parse_scores(body, n, self.client.engine_id)
        self.counters["score_calls"] += 1
        self.counters["scored_tokens"] += n
        self.counters["prefill_tokens"] += n + int(prompt_ids.shape[0])
        self.counters["score_seconds"] += time.perf_counter() - t0
        return out

    async def close(self) -> None:
        await self.client.close()
