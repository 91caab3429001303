"""The reference engine's batched decode loop, pause modes and weight swaps.

One asyncio task drives the loop; each step runs in a worker thread (``asyncio.to_thread``)
while holding ``step_lock``. Requests join at step boundaries (their prefill runs in the
same forward as the others' decode) and leave when finished. Control operations (pause,
abort, weight loads) take ``step_lock``, so they happen strictly between steps: every token
sampled in a step carries the version loaded at that step.

SGLang 0.5.23 semantics reproduced here:
- ``pause(mode)``: ``abort`` aborts every request (partial output, finish_reason abort);
  ``retract`` frees every running request's KV (re-prefilled over prompt+output under the
  weights current at the next step, ``num_retractions`` += 1); ``in_place`` keeps it.
  New requests wait in the HTTP layer until ``resume``.
- weight loads: when not paused they first wait until no request is in flight;
  ``flush_cache=true`` fails (success false, weights *are* swapped) while a request holds KV.
- versions: on a change every live request with outputs records ``(old_version, n_out)``;
  spans come from :func:`weight_version_spans`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reference_engine import checkpoint as ckpt
from reference_engine.model import KVCache, Qwen3MoeLM
from reference_engine.request import Request, VersionEvent
from reference_engine.scheduler_spans import weight_version_spans  # noqa: F401 (re-export)
from reference_engine.sampling import SamplingSpec, sample, scaled_logprobs
from reference_engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")


class Scheduler:
    def __init__(self, model: Qwen3MoeLM, weight_version: str, max_running: int = 64,
                 step_delay_s: float = 0.0) -> None:
        self.model = model
        self.cfg = model.config
        self.tok = ByteTokenizer()
        self.weight_version = str(weight_version)
        self.max_running = max_running
        self.step_delay_s = step_delay_s  # test knob: pause between steps (never busy-waits)
        self.requests: dict[str, Request] = {}  # every unfinished request, by rid
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.paused = False
        self.pause_mode: str | None = None
        self.updating = False  # a non-paused weight update is draining requests
        self.step_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.update_session_open = False
        self.dist_group: Any = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    async def wait_admissible(self) -> None:
        """Block while paused or while an update drains (new /generate calls wait)."""
        while self.paused or self.updating:
            await self._resumed.wait()

    def submit(self, req: Request) -> None:
        if req.params.sampling_seed is not None:
            req.generator = torch.Generator().manual_seed(int(req.params.sampling_seed))
        self.requests[req.rid] = req
        self.waiting.append(req)
        self._idle.clear()
        self._wake.set()

    # ---------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            if self.paused or not (self.waiting or self.running):
                if not (self.waiting or self.running):
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.step_lock:
                if self.paused:
                    continue
                room = self.max_running - len(self.running)
                if room > 0 and self.waiting:
                    self.running.extend(self.waiting[:room])
                    del self.waiting[:room]
                batch = list(self.running)
                try:
                    await asyncio.to_thread(self._step, batch)
                except Exception as exc:  # noqa: BLE001 - never kill the loop
                    log.exception("engine step failed")
                    for r in batch:
                        self._finish(r, {"type": "abort", "message": f"engine step failed: {exc}",
                                         "status_code": 500, "err_type": "InternalServerError"})
                self.steps += 1
                self._publish(batch)
            await asyncio.sleep(self.step_delay_s)

    def _publish(self, batch: list[Request]) -> None:
        for r in batch:
            n = len(r.output)
            for q in r.listeners:
                q.put_nowait(n)
        self.running = [r for r in self.running if not r.finished]

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        if r.finished:
            return
        r.finish = reason
        r.final_spans = weight_version_spans(r.version_events, self.weight_version, len(r.output))
        r.finished_at = time.monotonic()
        r.cache = None
        self.requests.pop(r.rid, None)

    # ---------------------------------------------------------------- one step (worker thread)
    def _step(self, batch: list[Request]) -> None:
        ids, caches, starts, prefill = [], [], [], []
        for r in batch:
            if r.cache is None:
                r.cache = KVCache()
                seq = r.prompt + r.output
                prefill.append(True)
            else:
                seq = r.output[-1:]
                prefill.append(False)
            starts.append(r.cache.length)
            ids.append(torch.tensor(seq, dtype=torch.long))
            caches.append(r.cache)
        out = self.model.forward_chunks(ids, caches)
        topk = out.topk.numpy().astype(np.int32)
        rows, samplers = [], []
        for i, r in enumerate(batch):
            off, n = out.offsets[i], int(ids[i].numel())
            r.set_routing(starts[i], topk[off:off + n])
            first = prefill[i] and not r.admitted
            r.admitted = True
            if first and r.params.return_logprob and r.params.logprob_start_len >= 0:
                self._input_logprobs(r, out.hidden[off:off + n])
            if len(r.output) >= r.params.max_new_tokens:
                self._finish(r, {"type": "length", "length": r.params.max_new_tokens})
                continue
            rows.append(off + n - 1)
            samplers.append(r)
        if not samplers:
            return
        logits = self.model.logits(out.hidden[rows])
        specs = [SamplingSpec.make(r.params.temperature, r.params.top_p, r.params.top_k,
                                   r.params.min_p) for r in samplers]
        for j, r in enumerate(samplers):  # min_new_tokens: hold back stop tokens
            if len(r.output) < r.params.min_new_tokens:
                for t in self._stop_ids(r):
                    logits[j, t] = float("-inf")
        res = sample(logits, specs, [r.generator for r in samplers])
        toks, lps, ents = res.tokens.tolist(), res.logprobs.tolist(), res.entropy.tolist()
        top_n = max(r.params.top_logprobs_num for r in samplers)
        if top_n > 0:
            tv, ti = torch.topk(res.logp, min(top_n, res.logp.shape[1]), dim=-1)
            tv, ti = tv.tolist(), ti.tolist()
        for j, r in enumerate(samplers):
            r.output.append(toks[j])
            r.out_logprobs.append(lps[j])
            r.out_entropy.append(ents[j])
            if r.params.top_logprobs_num > 0:
                k = r.params.top_logprobs_num
                r.out_top.append(list(zip(tv[j][:k], ti[j][:k])))
            self._check_stop(r)

    def _input_logprobs(self, r: Request, hidden: torch.Tensor) -> None:
        s = r.params.logprob_start_len
        p = len(r.prompt)
        if s >= p:
            r.input_logprobs, r.input_top = [], []
            return
        # logits at positions s..p-2 score tokens s+1..p-1; token s itself gets None (as SGLang)
        h = hidden[s:p - 1]
        vals: list[float | None] = [None]
        tops: list[Any] = [None]
        if h.shape[0]:
            t = 1.0 if r.params.temperature < 1e-6 else r.params.temperature
            logp = scaled_logprobs(self.model.logits(h), torch.full((h.shape[0],), t))
            tgt = torch.tensor(r.prompt[s + 1:p], dtype=torch.long)
            vals += logp.gather(1, tgt[:, None])[:, 0].tolist()
            if r.params.top_logprobs_num > 0:
                tv, ti = torch.topk(logp, min(r.params.top_logprobs_num, logp.shape[1]), dim=-1)
                tops += [list(zip(a, b)) for a, b in zip(tv.tolist(), ti.tolist())]
        r.input_logprobs, r.input_top = vals, tops

    def _stop_ids(self, r: Request) -> list[int]:
        ids = list(r.params.stop_token_ids)
        if not r.params.ignore_eos:
            ids.append(self.cfg.eos_token_id)
        return ids

    def _check_stop(self, r: Request) -> None:
        t = r.output[-1]
        n = len(r.output)
        if n >= r.params.min_new_tokens and t in self._stop_ids(r):
            self._finish(r, {"type": "stop", "matched": t})
        elif r.params.stop and n >= r.params.min_new_tokens:
            tail = self.tok.decode(r.output[-64:])
            for s in r.params.stop:
                if s and tail.endswith(s):
                    r.stop_trim = 0 if r.params.no_stop_trim else len(s)
                    self._finish(r, {"type": "stop", "matched": s})
                    break
        if r.finished:
            return
        if n >= r.params.max_new_tokens:
            self._finish(r, {"type": "length", "length": r.params.max_new_tokens})
        elif len(r.prompt) + n >= self.cfg.max_position_embeddings:
            self._finish(r, {"type": "length", "length": n})

    # ---------------------------------------------------------------- control (event loop)
    def _abort(self, reqs: list[Request], message: str = "Aborted") -> int:
        n = 0
        for r in reqs:
            if r.finished:
                continue
            self._finish(r, {"type": "abort", "message": message, "status_code": None,
                             "err_type": None})
            for q in r.listeners:
                q.put_nowait(len(r.output))
            n += 1
        self.waiting = [r for r in self.waiting if not r.finished]
        self.running = [r for r in self.running if not r.finished]
        if not (self.waiting or self.running):
            self._idle.set()
        return n

    async def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """Abort as SGLang 0.5.23 does: everything with ``abort_all``; otherwise only if ``rid``
        is a live request's exact id, and then every request whose rid starts with it (the
        scheduler matches by prefix). An empty or unknown rid is ignored. Returns how many."""
        if not abort_all and (not rid or rid not in self.requests):
            return 0
        async with self.step_lock:
            live = [*self.waiting, *self.running]
            return self._abort([r for r in live if abort_all or r.rid.startswith(rid)])

    async def abort_many(self, reqs: list[Request]) -> int:
        async with self.step_lock:
            return self._abort([r for r in reqs if not r.finished])

    async def pause(self, mode: str) -> None:
        async with self.step_lock:
            self.paused = True
            self.pause_mode = mode
            self._resumed.clear()
            if mode == "abort":
                self._abort([*self.waiting, *self.running])
            elif mode == "retract":
                for r in self.running:
                    if r.cache is not None:
                        r.cache = None
                        r.num_retractions += 1
                self.waiting = self.running + self.waiting
                self.running = []

    async def resume(self) -> None:
        async with self.step_lock:
            self.paused = False
            self.pause_mode = None
            if not self.updating:
                self._resumed.set()
            self._wake.set()

    def kv_resident(self) -> int:
        """Requests a flush would refuse for (SGLang ``is_fully_idle(ignore_waiting=paused)``):
        while paused, those still holding KV (in_place); otherwise any live request."""
        live = [*self.running, *self.waiting]
        if self.paused:
            return sum(1 for r in live if r.cache is not None)
        return len(live)

    def flush_cache(self) -> bool:
        return self.kv_resident() == 0

    def _record_version(self, new_version: str | None) -> None:
        if new_version is None or str(new_version) == self.weight_version:
            return
        old = self.weight_version
        for r in [*self.waiting, *self.running]:
            if r.output:
                r.version_events.append(VersionEvent(old, len(r.output)))
        self.weight_version = str(new_version)

    async def _drain_if_not_paused(self) -> None:
        if self.paused:
            return
        self.updating = True
        self._resumed.clear()
        while not (self._idle.is_set() or self.paused):
            await asyncio.sleep(0.01)

    def _end_drain(self) -> None:
        if self.updating:
            self.updating = False
            if not self.paused:
                self._resumed.set()

    async def load_named(self, loader, weight_version: str | None, flush_cache: bool,
                         complete: bool) -> tuple[bool, str]:
        """Swap in weights from ``loader()`` -> named tensors or a full state dict.

        ``complete``: the loader returns a full internal state dict (disk); otherwise a
        partial set of named tensors applied over the current weights."""
        try:
            await self._drain_if_not_paused()
            try:
                if complete:
                    state = await asyncio.to_thread(loader)
                else:
                    named = await asyncio.to_thread(loader)
                    state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                    await asyncio.to_thread(ckpt.apply_named_tensors, state, named, self.cfg)
            except Exception as exc:  # noqa: BLE001 - a bad source never breaks serving
                return False, (f"Failed to update weights: {exc}. "
                               "Kept the old weights (nothing was changed).")
            async with self.step_lock:
                self.model.load_state_dict(state)
                self._record_version(weight_version)
                if flush_cache and not self.flush_cache():
                    return False, FLUSH_REFUSED
            return True, "Succeeded to update model weights."
        finally:
            self._end_drain()

    async def update_from_disk(self, path: str, weight_version: str | None,
                               flush_cache: bool) -> tuple[bool, str]:
        return await self.load_named(lambda: ckpt.load_state_dict(Path(path), self.model),
                                     weight_version, flush_cache, complete=True)

    async def update_version(self, new_version: str) -> None:
        async with self.step_lock:
            self._record_version(new_version)
