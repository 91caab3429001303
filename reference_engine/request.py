"""One generation request's state inside the reference engine (no torch at import)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class GenParams:
    """Validated per-request parameters (see :mod:`reference_engine.protocol`)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_entropy: bool = False
    stream: bool = False
    #: sampling_params.stream_interval (0: the server's, 1): a streamed chunk once this many
    #: tokens are unsent (the first token at once, the final chunk always), as SGLang 0.5.23
    stream_interval: int = 0


@dataclass
class VersionEvent:
    """The served version changed from ``old_version`` after ``num_output_tokens`` tokens."""

    old_version: str
    num_output_tokens: int


class Request:
    """Mutable state of one sequence. Written only by the scheduler (between or inside steps);
    readers format a prefix of ``n_out`` tokens published after a step (append-only lists)."""

    def __init__(self, rid: str, prompt: list[int], params: GenParams, num_layers: int,
                 top_k: int) -> None:
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []
        self.out_logprobs: list[float] = []
        self.out_entropy: list[float] = []
        self.out_top: list[list[tuple[float, int]]] = []
        self.input_logprobs: list[float | None] | None = None
        self.input_top: list[list[tuple[float, int]] | None] | None = None
        self.routed = np.zeros((max(len(prompt) + params.max_new_tokens, 1), num_layers, top_k),
                               dtype=np.int32)
        self.version_events: list[VersionEvent] = []
        self.finish: dict[str, Any] | None = None
        self.final_spans: list[dict] | None = None  # weight_versions, fixed at finish
        self.stop_trim = 0  # characters of a matched stop string to trim from text
        self.num_retractions = 0
        self.cache: Any = None  # KVCache while resident; None before prefill / after retract
        self.generator: Any = None
        self.created = time.monotonic()
        self.finished_at: float | None = None
        self.admitted = False  # has been scheduled at least once (got a prefill)
        self.cached_tokens = 0  # meta_info.cached_tokens: prefix reused at the first prefill
        self.retracted = False  # SGLang's retracted_stain: re-prefills add no cached_tokens
        self.tree_node: Any = None  # radix-cache node locked by this request
        self.protected_len = 0  # leading positions whose KV the radix cache owns
        self.pending_finish: dict[str, Any] | None = None  # decided, not yet processed
        self.kv_tail_done = False  # overlap: the stopped request's last token got its KV
        self.n_pub = 0  # output tokens processed (published; what version events count)
        self.listeners: list[Any] = []  # asyncio.Queue[int] of published output counts

    @property
    def finished(self) -> bool:
        """Finished and processed (its last chunk may be sent)."""
        return self.finish is not None

    @property
    def stopping(self) -> bool:
        """Finished or decided to finish (overlap: the result is not processed yet)."""
        return self.finish is not None or self.pending_finish is not None

    def set_routing(self, start: int, rows: np.ndarray) -> None:
        end = start + rows.shape[0]
        if end > self.routed.shape[0]:
            grown = np.zeros((max(end, 2 * self.routed.shape[0]), *self.routed.shape[1:]),
                             dtype=np.int32)
            grown[: self.routed.shape[0]] = self.routed
            self.routed = grown
        self.routed[start:end] = rows
