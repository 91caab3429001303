"""The reference engine's batched decode loop, pause modes and weight swaps.

One asyncio task drives the loop; each step runs in a worker thread (``asyncio.to_thread``)
while holding ``step_lock``. Requests join at step boundaries (their prefill runs in the
same forward as the others' decode, unless ``separate_prefill``) and leave when finished.
Control operations (pause, abort, weight loads) take ``step_lock``, so they happen strictly
between steps: every token sampled in a step carries the version loaded at that step.

SGLang 0.5.23 semantics reproduced here:
- ``pause(mode)``: ``abort`` aborts every request (partial output, finish_reason abort);
  ``retract`` frees every running request's KV (re-prefilled over prompt+output under the
  weights current at the next step, ``num_retractions`` += 1; the re-prefill rewrites the
  routed rows of every position, those of tokens sampled before included, as SGLang's
  slot-indexed capture does); ``in_place`` keeps it.
  New requests wait in the HTTP layer until ``resume``.
- weight loads: when not paused they first wait until no request is in flight;
  ``flush_cache=true`` fails (success false, weights *are* swapped) while a request holds KV.
- versions: on a change every live request with outputs records ``(old_version, n_out)``;
  spans come from :func:`weight_version_spans`.

Options that make the engine behave as SGLang's defaults do (on in ``--sglang-strict``):
- ``radix_cache``: the prefix cache of :mod:`reference_engine.radix_cache` (honest
  ``cached_tokens``; KV reused across requests, old-weight KV included after an in-place swap).
- ``overlap``: SGLang's overlap scheduler (``Scheduler.event_loop_overlap``, scheduler.py
  2061-2131) launches batch N+1 *before* it processes batch N's result. Processing (appending
  the tokens, publishing them, finishing, radix-cache inserts) therefore lags one step: a
  version change recorded while batch N is unprocessed (an ``in_place`` pause leaves it so,
  scheduler.py 5821-5831) counts ``len(output_ids)`` without N's tokens, so the first token
  labelled with the new version was sampled by the old weights. A request that stops (not by
  length) in batch N is still forwarded once in N+1, so its last token's KV is cached too.
- ``separate_prefill``: a step is either a prefill batch of newly admitted requests or a
  decode batch of the running ones, prefill first (``get_next_batch_to_run``, scheduler.py
  3991-3993), as SGLang schedules; otherwise a step prefills and decodes together.
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
from reference_engine.radix_cache import RadixCache
from reference_engine.request import Request, VersionEvent
from reference_engine.sampling import SamplingSpec, sample, scaled_logprobs
from reference_engine.scheduler_spans import weight_version_spans
from reference_engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)

FLUSH_REFUSED = ("Weights were updated, but the cache was not flushed because requests are "
                 "still running or queued. Retract or finish them, then call /flush_cache.")


class Scheduler:
    def __init__(self, model: Qwen3MoeLM, weight_version: str, max_running: int = 64,
                 step_delay_s: float = 0.0, *, radix_cache: bool = False,
                 max_total_tokens: int = 65536, overlap: bool = False,
                 separate_prefill: bool = False) -> None:
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
        self._task: asyncio.Task | None = None
        self.steps = 0
        self.update_session_open = False
        self.dist_group: Any = None
        self.tree = RadixCache(max_total_tokens) if radix_cache else None
        self.overlap = overlap
        self.separate_prefill = separate_prefill
        # overlap: the last step's results, computed but not processed yet
        self._inflight: list[tuple[Request, int, str, int, bool]] | None = None
        self._flush_pending = False
        # what /model_info reports (SGLang's tokenizer manager): moves only on success
        self.served_version = self.weight_version
        self.served_model_path: str | None = None
        self.loaded_model_path: str | None = None  # the scheduler's (internal_states)

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
        self._wake.set()

    # ---------------------------------------------------------------- the loop
    async def _loop(self) -> None:
        while True:
            if self.paused or self.fully_idle():
                self._wake.clear()
                await self._wake.wait()
                continue
            async with self.step_lock:
                if self.paused:
                    continue
                await self.iteration()
            await asyncio.sleep(self.step_delay_s)

    async def iteration(self) -> None:
        """One turn of the loop (caller holds ``step_lock``): run the next batch, then process
        results: this step's, or with ``overlap`` the previous step's."""
        batch = self._next_batch()
        results = None
        if batch:
            try:
                results = await asyncio.to_thread(self._step, batch)
            except Exception as exc:  # noqa: BLE001 - never kill the loop
                log.exception("engine step failed")
                results = []
                for r, _ in batch:
                    self._decide(r, {"type": "abort", "message": f"engine step failed: {exc}",
                                     "status_code": 500, "err_type": "InternalServerError"})
                    results.append((r, len(r.output), "decode", 0, True))
            self.steps += 1
        if self.overlap:  # process the previous step after launching this one
            prev, self._inflight = self._inflight, results
            if prev:
                self._process(prev)
        elif results:
            self._process(results)

    def _next_batch(self) -> list[tuple[Request, str]]:
        """The next step's work: ``(request, kind)`` with kind ``prefill`` (no KV yet),
        ``decode``, or ``tail`` (overlap: a stopped request's last token forwarded once more,
        its output discarded, as SGLang's overlap loop does before it sees the stop)."""
        active = [r for r in self.running if not r.stopping]
        room = self.max_running - len(active)
        admitted: list[Request] = []
        if room > 0 and self.waiting:
            admitted = self.waiting[:room]
            del self.waiting[:room]
            self.running.extend(admitted)
        if self.separate_prefill and admitted:
            return [(r, "prefill") for r in admitted]
        batch = []
        for r in self.running:
            if r.cache is None and not r.stopping:
                batch.append((r, "prefill"))
            elif not r.stopping:
                batch.append((r, "decode"))
            elif (self.overlap and not r.finished and not r.kv_tail_done
                  and r.cache is not None and r.pending_finish
                  and r.pending_finish.get("type") == "stop"):
                r.kv_tail_done = True
                batch.append((r, "tail"))
        return batch

    def _process(self, results: list[tuple[Request, int, str, int, bool]]) -> None:
        """Make a step's results visible: radix-cache checkpoints and releases, finishes,
        published token counts (what SGLang's ``process_batch_result`` does). Each result is
        ``(request, outputs after the step, kind, KV length after the step, finished in it)``."""
        for r, n, kind, extend_end, finishes in results:
            if r.finished:
                continue
            r.n_pub = max(r.n_pub, n)
            if finishes:
                self._complete(r)
            elif kind == "prefill" and self.tree is not None and r.cache is not None:
                self._checkpoint(r, extend_end)
            for q in r.listeners:
                q.put_nowait(n)
        self.running = [r for r in self.running if not r.finished]

    def _process_inflight(self) -> None:
        if self._inflight:
            prev, self._inflight = self._inflight, None
            self._process(prev)
        self._inflight = None

    # ---------------------------------------------------------------- finishing
    def _decide(self, r: Request, reason: dict[str, Any]) -> None:
        if not r.stopping:
            r.pending_finish = reason

    def _complete(self, r: Request) -> None:
        """Finish a decided request: spans fixed now (SGLang computes them when it processes
        the result), KV released into the radix cache."""
        if r.finished:
            return
        r.finish = r.pending_finish
        r.n_pub = len(r.output)
        r.final_spans = weight_version_spans(r.version_events, self.weight_version, len(r.output))
        r.finished_at = time.monotonic()
        self._release(r, insert=True)
        self.requests.pop(r.rid, None)

    def _finish(self, r: Request, reason: dict[str, Any]) -> None:
        self._decide(r, reason)
        self._complete(r)

    # ---------------------------------------------------------------- radix cache
    def _seq(self, r: Request) -> list[int]:
        return r.prompt + r.output

    def _match(self, r: Request) -> int:
        """Reuse the cached prefix for ``r``'s prefill (SGLang ``_compute_max_prefix_len``,
        schedule_batch.py 1766-1785: at most ``len - 1``, and with ``return_logprob`` at most
        ``logprob_start_len``, which the scheduler sets to the prompt length when it is -1,
        scheduler.py 3260-3264: a retracted request re-prefills its outputs). Returns the
        matched length."""
        r.cache = KVCache()
        r.protected_len = 0
        if self.tree is None:
            return 0
        seq = self._seq(r)
        limit = len(seq) - 1
        if r.params.return_logprob:
            start = r.params.logprob_start_len
            limit = min(limit, len(r.prompt) if start < 0 else start)
        m, node = self.tree.match(seq, limit)
        if m > 0:
            kv, routed = self.tree.values(node)
            r.cache = KVCache.from_values(kv)
            r.set_routing(0, routed)
            self.tree.lock(node)
            r.tree_node = node
            r.protected_len = m
        if not r.retracted:  # SGLang: only the first prefill counts (retracted_stain)
            r.cached_tokens = m
        return m

    def _checkpoint(self, r: Request, extend_end: int) -> None:
        """After a prefill: insert its KV; where the tree already had the tokens (at least the
        recomputed last one) the request switches to the tree's copy (SGLang
        ``RadixCache.checkpoint``, radix_cache.py 510-543)."""
        seq = self._seq(r)[:extend_end]
        have, node = self.tree.insert(seq, r.cache.values(0, extend_end), r.routed[:extend_end])
        if have > r.protected_len:
            kv, routed = self.tree.values(node)
            r.cache.overwrite(r.protected_len, kv[:, :, r.protected_len:have])
            r.routed[r.protected_len:have] = routed[r.protected_len:have]
        self.tree.unlock(r.tree_node)
        self.tree.lock(node)
        r.tree_node, r.protected_len = node, extend_end

    def _release(self, r: Request, insert: bool) -> None:
        """Free ``r``'s KV; ``insert``: the tree keeps what it did not have (SGLang
        ``release_kv_cache(checkpoint=True)`` at finish or abort; retraction does not)."""
        if self.tree is not None and r.cache is not None:
            if insert and r.cache.length:
                n = r.cache.length
                self.tree.insert(self._seq(r)[:n], r.cache.values(0, n), r.routed[:n])
            self.tree.unlock(r.tree_node)
        r.tree_node = None
        r.protected_len = 0
        r.cache = None

    def _make_room(self, need: int) -> None:
        """Evict least recently used cached prefixes when the KV pool (max_total_tokens: the
        tree plus every request's own positions) cannot hold ``need`` new tokens."""
        own = sum(r.cache.length - r.protected_len
                  for r in [*self.running, *self.waiting] if r.cache is not None)
        free = self.tree.capacity - self.tree.size - own
        if need > free:
            self.tree.evict(need - free)

    # ---------------------------------------------------------------- one step (worker thread)
    def _step(self, batch: list[tuple[Request, str]]
              ) -> list[tuple[Request, int, str, int, bool]]:
        ids, caches, starts = [], [], []
        for r, kind in batch:
            if kind == "prefill":
                m = self._match(r)
                seq = self._seq(r)[m:]
            else:
                seq = r.output[-1:]
            starts.append(r.cache.length)
            ids.append(torch.tensor(seq, dtype=torch.long))
            caches.append(r.cache)
        if self.tree is not None:
            self._make_room(sum(int(t.numel()) for t in ids))
        out = self.model.forward_chunks(ids, caches)
        topk = out.topk.numpy().astype(np.int32)
        rows, samplers = [], []
        results = []
        for i, (r, kind) in enumerate(batch):
            off, n = out.offsets[i], int(ids[i].numel())
            r.set_routing(starts[i], topk[off:off + n])
            results.append((r, kind, starts[i] + n))
            if kind == "tail":
                continue
            first = kind == "prefill" and not r.admitted
            r.admitted = True
            if first and r.params.return_logprob and r.params.logprob_start_len >= 0:
                self._input_logprobs(r, out.hidden[off:off + n], starts[i])
            if len(r.output) >= r.params.max_new_tokens:
                self._decide(r, {"type": "length", "length": r.params.max_new_tokens})
                continue
            rows.append(off + n - 1)
            samplers.append(r)
        if samplers:
            self._sample(samplers, out.hidden[rows])
        return [(r, len(r.output), kind, end, kind != "tail" and r.pending_finish is not None)
                for r, kind, end in results]

    def _sample(self, samplers: list[Request], hidden: torch.Tensor) -> None:
        logits = self.model.logits(hidden)
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

    def _input_logprobs(self, r: Request, hidden: torch.Tensor, start: int) -> None:
        """``hidden`` rows are positions ``start..`` (``start``: the cached prefix, never past
        logprob_start_len)."""
        s = r.params.logprob_start_len
        p = len(r.prompt)
        if s >= p:
            r.input_logprobs, r.input_top = [], []
            return
        # logits at positions s..p-2 score tokens s+1..p-1; token s itself gets None (as SGLang)
        h = hidden[s - start:p - 1 - start]
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
            self._decide(r, {"type": "stop", "matched": t})
        elif r.params.stop and n >= r.params.min_new_tokens:
            tail = self.tok.decode(r.output[-64:])
            for s in r.params.stop:
                if s and tail.endswith(s):
                    r.stop_trim = 0 if r.params.no_stop_trim else len(s)
                    self._decide(r, {"type": "stop", "matched": s})
                    break
        if r.stopping:
            return
        if n >= r.params.max_new_tokens:
            self._decide(r, {"type": "length", "length": r.params.max_new_tokens})
        elif len(r.prompt) + n >= self.cfg.max_position_embeddings:
            self._decide(r, {"type": "length", "length": n})

    # ---------------------------------------------------------------- control (event loop)
    def _abort(self, reqs: list[Request], message: str = "Aborted") -> int:
        self._process_inflight()  # the aborted requests' last results first, as SGLang
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
                # SGLang processes the in-flight result first (scheduler.py 5833-5841);
                # in_place leaves it unprocessed until the loop runs again after continue.
                self._process_inflight()
                for r in self.running:
                    if r.cache is not None:
                        self._release(r, insert=False)  # retraction frees, caches nothing
                        r.retracted = True
                        r.kv_tail_done = False
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
        """Requests a flush would refuse for (SGLang ``is_fully_idle(ignore_waiting=paused)``,
        scheduler.py 5337-5360): an unprocessed step counts; while paused, the requests still
        holding KV (in_place); otherwise any live request."""
        live = [*self.running, *self.waiting]
        busy = len(self._inflight or [])
        if self.paused:
            return busy + sum(1 for r in live if r.cache is not None)
        return busy + len(live)

    def fully_idle(self) -> bool:
        """SGLang ``is_fully_idle()``: nothing running, queued or unprocessed (paused or not)."""
        return not (self.running or self.waiting or self._inflight)

    def flush_cache(self) -> bool:
        """SGLang ``Scheduler.flush_cache`` (scheduler.py 5518-5545): refused while requests
        are resident; otherwise the radix cache is emptied."""
        if self.kv_resident():
            return False
        if self.tree is not None:
            self.tree.reset()
        return True

    async def flush_cache_within(self, timeout_s: float) -> tuple[bool, str]:
        """``/flush_cache?timeout=T`` (SGLang ``SchedulerFlushWrapper``): flush at once when
        fully idle, else wait up to T seconds for it; one such wait at a time."""
        if self._flush_pending:
            return False, "Another flush_cache is already in progress."
        if timeout_s <= 0 or self.fully_idle():
            async with self.step_lock:
                return self.flush_cache(), ""
        self._flush_pending = True
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                await asyncio.sleep(0.01)
                if self.fully_idle():
                    async with self.step_lock:
                        return self.flush_cache(), ""
            return False, "Timed out waiting for idle state."
        finally:
            self._flush_pending = False

    def _record_version(self, new_version: str | None) -> None:
        """SGLang ``record_weight_version_events``: each live request with processed outputs
        records how many (an unprocessed overlap step's tokens are not counted)."""
        if new_version is None or str(new_version) == self.weight_version:
            return
        old = self.weight_version
        for r in [*self.waiting, *self.running]:
            if r.n_pub and not r.finished:
                r.version_events.append(VersionEvent(old, r.n_pub))
        self.weight_version = str(new_version)

    async def _drain_if_not_paused(self) -> None:
        if self.paused:
            return
        self.updating = True
        self._resumed.clear()
        while not (self.fully_idle() or self.paused):
            await asyncio.sleep(0.01)

    def _end_drain(self) -> None:
        if self.updating:
            self.updating = False
            if not self.paused:
                self._resumed.set()

    async def load_named(self, loader, weight_version: str | None, flush_cache: bool,
                         complete: bool,
                         done: str = "Succeeded to update model weights.") -> tuple[bool, str]:
        """Swap in weights from ``loader()`` -> named tensors or a full state dict.

        ``complete``: the loader returns a full internal state dict (disk); otherwise a
        partial set of named tensors applied over the current weights.

        As SGLang (scheduler_components/weight_updater.py 118-164, tokenizer_manager.py
        2288-2322): the scheduler records the new version before it tries the flush, so a
        refused flush (HTTP 400, success false) leaves the weights swapped and later tokens
        labelled with the new version, while ``/model_info`` (the tokenizer manager's
        ``weight_version`` and ``model_path``) moves only on success."""
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
            if weight_version is not None:
                self.served_version = str(weight_version)
                done += f" Weight version updated to {weight_version}."
            return True, done
        finally:
            self._end_drain()

    async def update_from_disk(self, path: str, weight_version: str | None,
                               flush_cache: bool) -> tuple[bool, str]:
        ok, msg = await self.load_named(lambda: ckpt.load_state_dict(Path(path), self.model),
                                        weight_version, flush_cache, complete=True)
        if ok or msg == FLUSH_REFUSED:
            self.loaded_model_path = path  # the scheduler serves it either way
        if ok:
            self.served_model_path = path
        return ok, msg

    async def update_version(self, new_version: str) -> None:
        async with self.step_lock:
            self._record_version(new_version)
            self.served_version = str(new_version)
