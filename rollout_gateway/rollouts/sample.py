"""One sample of a rollout: engine requests until it finishes, stamped and assembled.

Each sample is its own engine request with its own rid. It continues across swaps:
an ``abort_resume`` swap ends the request with finish_reason abort and partial output,
and we resubmit prompt + output so far (same engine preferred); a dead engine (broken
stream, connection refused) or one that failed a weight load loses its request, and we
resubmit prompt + the output received so far to another engine. Output tokens are only
ever appended: none is lost or duplicated.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from rollout_gateway.core.stamping import (
    Span,
    kv_namespace,
    normalize_spans,
    stamp_request,
    stitch_routing,
)
from rollout_gateway.core.trajectory import (
    EntropyKind,
    FinishReason,
    RoutedExperts,
    Segment,
    TokenColumns,
    Trajectory,
    Transition,
)
from rollout_gateway.core.version_policy import ANY, VersionPolicy
from rollout_gateway.engines.client import refusal
from rollout_gateway.engines.decode import Decoded, DecodeOptions, decode_one
from rollout_gateway.engines.decode_stream import StreamDecoder
from rollout_gateway.engines.decode_toplogprobs import LogprobRows, cut_top
from rollout_gateway.engines.pool import (
    BREAK_KV_POLICY,
    BREAK_STALE_PUBLISH,
    BREAK_STALE_REQUEUE,
    Engine,
    EnginePool,
    Lease,
)
from rollout_gateway.engines.shape import resolve_spec, routing_problem
from rollout_gateway.errors import (
    EngineChanged,
    EngineError,
    FailedPrecondition,
    GatewayError,
    Timeout,
    Unavailable,
    VersionPolicyUnmet,
)
from rollout_gateway.registry.base import VersionRegistry, read_swaps
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.rollouts.vetting import Vetting
from rollout_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)

_KIND_RANK = {EntropyKind.EXACT: 0, EntropyKind.TOPK_ESTIMATE: 1, EntropyKind.NONE: 2}
#: what decoding an engine's garbage can raise besides GatewayError
_GARBAGE = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def _unreadable(eng: Engine, exc: BaseException) -> EngineError:
    return EngineError(f"engine {eng.id} sent an unreadable answer ({type(exc).__name__})",
                       details={"engine_id": eng.id, "dropped": True})


class RequestFailed(Exception):
    """An engine request failed with ``error`` after ``partial`` arrived (None: nothing
    usable did); the sample keeps that output and goes on from it."""

    def __init__(self, error: GatewayError, partial: Decoded | None = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.partial = partial


def _finished(eng: Engine, dec: Decoded | None, err: GatewayError | None) -> Decoded:
    """A stream's end: its output when it ended cleanly, else RequestFailed with what came."""
    if err is None and dec is None:
        err = EngineError(f"engine {eng.id} answered /generate with no output at all",
                          details={"engine_id": eng.id})
    if err is not None:
        raise RequestFailed(err, dec)
    return dec


@dataclass(slots=True)
class PassThrough:
    """SGLang ``/generate`` logprob fields a caller asked for, forwarded with SGLang's
    meaning (``rollout_gateway.api.generate``); the runner fills ``out[sample_index]``
    with ``output_top_logprobs`` (rows of every engine request, in order),
    ``input_token_logprobs`` and ``input_top_logprobs`` (from ``logprob_start_len``, of
    the first request, the only one whose input is the original prompt)."""

    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    #: forward the engine's own ``routed_experts`` text (base64 int32, from position 0)
    #: when the sample is one engine request's output (resumed samples are re-encoded)
    routed_experts: bool = False
    #: ``out[i]["cached_tokens"]``: the engine's ``cached_tokens``, summed over the sample's
    #: engine requests (the input tokens not prefilled again); always filled
    out: dict[int, dict[str, Any]] = field(default_factory=dict)

    def keys(self) -> frozenset[str]:
        k: set[str] = set()
        if self.return_text_in_logprobs:
            k.add("output_token_logprobs")
        if self.top_logprobs_num > 0:
            k.add("output_top_logprobs")
        if self.logprob_start_len >= 0:
            k.add("input_token_logprobs")
            if self.top_logprobs_num > 0:
                k.add("input_top_logprobs")
        return frozenset(k)

#: The engine a sample's first request goes to when it is routable, over sticky routing
#: (agent sessions: the engine holding the session's prefix, or a fresher one when that
#: engine's version is outside the staleness bound). Set by the caller around
#: ``RolloutService.run_with_text`` / the stream's consumer; tasks inherit it.
PREFERRED_ENGINE: ContextVar[str | None] = ContextVar("preferred_engine", default=None)
#: The request's version policy, parsed at the HTTP edge (header ``x-version-policy``, body
#: field ``version_policy``); None: the ``version_policy`` setting. Tasks inherit it.
VERSION_POLICY: ContextVar[VersionPolicy | None] = ContextVar("version_policy", default=None)


@dataclass(slots=True)
class Piece:
    """One engine request's decoded, stamped output."""

    engine_id: str
    input_len: int
    cols: TokenColumns
    segments: list[Segment]
    entropy_kind: EntropyKind
    entropy_bound: float
    finish: dict[str, Any] | None
    routing: np.ndarray | None  # [R, L, K] (narrow uint) with R = input_len + n - 1
    routing_b64: memoryview | None = None  # the engine's base64 text of ``routing``
    num_experts: int = 0
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)  # PassThrough rows of this request
    input_start: int = -1  # logprob_start_len this request was sent with
    cached_tokens: int = 0  # input tokens the engine served from its prefix cache


#: the finish message of a sample a refit dropped as stale (``drop_stale``, then publish)
STALE_DROPPED = "dropped as stale by a refit (drop_stale)"


def start_version(state: SampleState) -> int | None:
    """The version of the sample's first token (None before it has one)."""
    for p in state.pieces:
        if len(p.cols):
            return int(p.cols.policy_version[0])
    return None


#: the finish message of a sample cut short by shutdown (past ``drain_grace_s``)
CUT_SHORT = "cut short by gateway shutdown (drain_grace_s)"


@dataclass(slots=True)
class SampleState:
    """What a sample has so far (also what a stream reports)."""

    trajectory_id: str
    prompt_ids: np.ndarray | None
    pieces: list[Piece] = field(default_factory=list)
    engine_id: str | None = None  # the engine of the request in flight (dashboards)
    #: tokens of the request in flight so far by the version the engine reported with them
    #: (incremental engine streams only; dashboards)
    live: dict[int, int] = field(default_factory=dict)

    @property
    def generated(self) -> int:
        return sum(len(p.cols) for p in self.pieces)

    def output_ids(self) -> np.ndarray:
        if not self.pieces:
            return np.zeros(0, np.int32)
        return np.concatenate([p.cols.token_ids for p in self.pieces])


def decode_options(eng: Engine, settings: GatewaySettings, *, routing: bool = False,
                   passthrough: frozenset[str] = frozenset()) -> DecodeOptions:
    """Routing shape from settings, else from what the engine reported (engines.shape)."""
    info = eng.client.info
    spec = resolve_spec(settings.model, (info.num_layers, info.top_k, info.num_experts))
    return DecodeOptions(routing=spec, routed_experts_start_len=0,
                         require_routing=routing and spec is not None, passthrough=passthrough)


def wants_routing(eng: Engine, req: RolloutRequest, settings: GatewaySettings) -> bool:
    """Whether to ask ``eng`` for routed experts; refuses a request that requires them
    from an engine that cannot give them (never silently absent)."""
    if req.return_routed_experts is False or (req.return_routed_experts is None
                                              and not settings.record_routing):
        return False
    problem = routing_problem(eng.id, eng.client.info, settings.model)
    if problem is None:
        return True
    if req.return_routed_experts:
        raise FailedPrecondition(f"routed experts were requested but {problem}",
                                 details={"engine_id": eng.id})
    return False


class SampleRunner:
    """Runs one sample to completion against the pool."""

    def __init__(self, pool: EnginePool, settings: GatewaySettings,
                 registry: VersionRegistry | None = None, oldlogits: Any = None,
                 counters: dict[str, int] | None = None) -> None:
        self.pool = pool
        self.settings = settings
        self.default_policy = VersionPolicy.parse(settings.version_policy)
        #: engine requests whose version policy barred an engine in rotation
        #: (policy_filtered), and requests no engine's version could serve (policy_unroutable)
        self.counters = counters if counters is not None else {}
        self.counters.update(policy_filtered=0, policy_unroutable=0, stale_published=0,
                             stale_requeued=0, kv_policy_reprefills=0, engine_chunks=0)
        self.registry = registry
        self.oldlogits = oldlogits  # oldlogits.OldLogitService (interruption sync) or None
        #: samples running now, by trajectory id (dashboards: lag of tokens in flight)
        self.active: dict[str, SampleState] = {}
        #: called with the seconds from a sample's start to its first streamed chunk
        self.on_first_token = None
        #: shutdown past drain_grace_s (:meth:`RolloutService.cut_short`): an aborted engine
        #: request ends its sample with the output so far (finish_reason abort, message
        #: :data:`CUT_SHORT`) instead of resuming; a sample with no output yet fails
        self.cutting = False
        self.cut = 0  # samples ended that way

    def policy(self) -> VersionPolicy:
        """The version policy of the request being handled (``VERSION_POLICY``)."""
        return VERSION_POLICY.get() or self.default_policy

    async def route(self, policy: VersionPolicy, *, sticky_key: str | None = None,
                    prefer: str | None = None, exclude: set[str] | None = None,
                    why: str | None = None, probe: bool = False) -> Engine:
        """An engine ``policy`` admits (``EnginePool.acquire``), counted; failovers and
        resumes come here too, so every engine request of a sample obeys its policy.
        ``probe``: a check before admission, not an engine request (not counted as
        filtered; a 503 is counted)."""
        lv = 0
        if policy.needs_learner and self.registry is not None:
            lv = await self.registry.learner_version()
        if not probe and policy != ANY and self.pool.barred(policy, lv):
            self.counters["policy_filtered"] += 1
        try:
            return await self.pool.acquire(sticky_key=sticky_key, prefer=prefer,
                                           exclude=exclude or (), why=why, policy=policy,
                                           learner_version=lv)
        except VersionPolicyUnmet:
            self.counters["policy_unroutable"] += 1
            raise

    async def _learn_install_modes(self, eng: Engine, versions: set[int]) -> None:
        """A version this replica did not install (another replica led the swap): read how
        from the shared swap history, recorded before the leader paused any engine."""
        unknown = {v for v in versions if v not in eng.installed_by}
        if not unknown:
            return
        for r in await read_swaps(self.registry, 50, "rollouts"):
            if r.version in unknown and eng.id in r.engines:
                eng.installed_by[r.version] = r.mode.transition

    def _payload(self, eng: Engine, req: RolloutRequest, state: SampleState, rid: str,
                 remaining: int, *, want_prompt_ids: bool,
                 passthrough: PassThrough | None = None) -> dict[str, Any]:
        # top-k rows only feed the entropy estimate: skip them once the engine has shown it
        # returns exact entropy (they are most of the response bytes)
        top = 0 if eng.client.info.exact_entropy else self.settings.top_logprobs_num
        start = 0 if want_prompt_ids else -1
        if passthrough is not None:
            top = max(top, passthrough.top_logprobs_num)
            if passthrough.logprob_start_len >= 0 and state.generated == 0:
                start = 0 if want_prompt_ids else passthrough.logprob_start_len
        p: dict[str, Any] = {
            "rid": rid,
            "sampling_params": req.sampling_params.to_engine(remaining),
            "return_logprob": True,
            "logprob_start_len": start,
            "top_logprobs_num": top,
            "return_entropy": True,
        }
        if passthrough is not None and passthrough.return_text_in_logprobs:
            p["return_text_in_logprobs"] = True
        if wants_routing(eng, req, self.settings):
            p["return_routed_experts"] = True
            p["routed_experts_start_len"] = 0
        if eng.version is not None and eng.client.info.has_spans:
            # the prefix cache only matches within one salt: a hit holds KV of the version
            # this request was sent under, never an older one an in-place swap left behind
            p["cache_salt"] = kv_namespace(eng.version, eng.epoch)
        if state.prompt_ids is None:
            p["text"] = req.prompt
        else:
            p["input_ids"] = np.concatenate([state.prompt_ids, state.output_ids()]).tolist()
        return p

    async def _call(self, eng: Engine, payload: dict[str, Any], opts: DecodeOptions,
                    on_delta=None, first=None, on_tokens=None, check=None) -> Decoded:
        """One engine request -> its decoded output, or :class:`RequestFailed`. A broken,
        silent or unreadable stream keeps what arrived (``RequestFailed.partial``): the
        last cumulative chunk, or the merged deltas of an incremental stream.
        ``on_delta(d)`` (live streaming to a client) sees every chunk's new tokens;
        ``first()`` is called at the first answer byte and ``on_tokens(d)`` per chunk of
        new tokens (lag of tokens in flight); ``await check(label)`` per streamed chunk (its
        version label, None where not decoded yet: rollouts.vetting) raises EngineChanged
        when the engine changed since the request was sent: what arrived before is kept."""
        if not self.settings.stream_from_engines and on_delta is None:
            try:
                body = await eng.client.generate(payload)
                if first is not None:
                    first()
                return decode_one(body, opts)
            except GatewayError as exc:
                raise RequestFailed(exc) from exc
            except _GARBAGE as exc:
                raise RequestFailed(_unreadable(eng, exc)) from exc
        if eng.client.info.incremental_stream or on_delta is not None:
            # nobody reads the deltas' entropy one by one: estimate it once at the end
            sd = StreamDecoder(opts if on_delta is not None
                               else replace(opts, defer_entropy=True), keep=True)
            err: GatewayError | None = None
            try:
                async for data in eng.client.generate_stream(payload, patience=eng.patience):
                    self.counters["engine_chunks"] += 1
                    if first is not None:
                        first()
                        first = None
                    if check is not None:
                        await check(None)  # before the chunk joins the output
                    for d in sd.feed_payload(data):
                        if check is not None and d.num_tokens:
                            await check(d.weight_version)
                        if on_tokens is not None and d.num_tokens:
                            on_tokens(d)
                        if on_delta is not None and d.num_tokens:
                            await on_delta(d)
            except GatewayError as exc:
                err = exc
            except _GARBAGE as exc:
                err = _unreadable(eng, exc)
            try:
                merged = sd.result()
            except (GatewayError, *_GARBAGE) as exc:
                raise RequestFailed(err or EngineError(f"engine {eng.id}: {exc}")) from exc
            return _finished(eng, merged, err)
        last: bytes | None = None
        prev: bytes | None = None
        err = None
        try:
            async for data in eng.client.generate_stream(payload, patience=eng.patience):
                self.counters["engine_chunks"] += 1
                if first is not None:
                    first()
                    first = None
                if check is not None:
                    await check(None)
                prev, last = last, data  # cumulative: the newest chunk holds everything
        except GatewayError as exc:
            err = exc
        if last is None:
            return _finished(eng, None, err)
        try:
            newest = decode_one(last, opts)
        except (GatewayError, *_GARBAGE) as exc:
            bad = exc if isinstance(exc, GatewayError) else _unreadable(eng, exc)
            # the newest chunk is garbage: keep the output of the one before it, if it reads
            try:
                kept = decode_one(prev, opts) if prev is not None else None
            except (GatewayError, *_GARBAGE):
                kept = None
            raise RequestFailed(err or bad, kept) from exc
        return _finished(eng, newest, err)

    async def run(self, req: RolloutRequest, trajectory_id: str, group_id: str, index: int,
                  *, sticky_key: str | None, prompt_ids: np.ndarray | None,
                  on_chunk=None, passthrough: PassThrough | None = None
                  ) -> tuple[Trajectory, str]:
        """Run to completion; returns the trajectory and its output text (as the engines
        detokenized it, concatenated over requests)."""
        state = SampleState(trajectory_id, prompt_ids)
        self.active[trajectory_id] = state
        ol = self.oldlogits
        if ol is not None:  # exact old logits: a swap may score this sample's partial output
            ol.track(state, req.sampling_params.temperature)
        try:
            return await self._run(state, req, trajectory_id, group_id, index,
                                   sticky_key=sticky_key, on_chunk=on_chunk,
                                   passthrough=passthrough)
        except BaseException:
            if ol is not None:
                ol.untrack(trajectory_id)
            raise
        finally:
            self.active.pop(trajectory_id, None)

    async def _run(self, state: SampleState, req: RolloutRequest, trajectory_id: str,
                   group_id: str, index: int, *, sticky_key: str | None,
                   on_chunk=None, passthrough: PassThrough | None = None
                   ) -> tuple[Trajectory, str]:
        ol = self.oldlogits
        created = time.time()
        budget = req.sampling_params.max_new_tokens
        began = Transition.START
        prefer: str | None = PREFERRED_ENGINE.get()
        policy = self.policy()
        exclude: set[str] = set()
        finish: dict[str, Any] | None = None
        attempts = 0
        last_error: str | None = None
        while True:
            remaining = budget - state.generated
            if remaining <= 0:
                finish = {"type": "length", "length": budget}
                break
            if self.cutting:
                if state.pieces:  # the output so far is the answer, published as partial
                    finish = {"type": "abort", "message": CUT_SHORT}
                    self.cut += 1
                    break
                raise Unavailable(f"sample {trajectory_id}: the gateway is shutting down",
                                  details={"trajectory_id": trajectory_id})
            attempts += 1
            if attempts > self.settings.max_attempts:
                raise Unavailable(f"sample {trajectory_id}: gave up after "
                                  f"{self.settings.max_attempts} engine attempts"
                                  + (f"; last error: {last_error}" if last_error else ""),
                                  details={"trajectory_id": trajectory_id,
                                           "tokens_so_far": state.generated})
            if not state.generated:
                # nothing to resume from (an engine failed or aborted before the first
                # token): whatever went wrong, the trajectory's first segment is its start
                began = Transition.START
            eng = await self.route(policy, sticky_key=sticky_key, prefer=prefer,
                                   exclude=exclude, why=last_error)
            prefer = None
            state.engine_id = eng.id
            rid = f"{trajectory_id}.{attempts}"
            payload = self._payload(eng, req, state, rid, remaining,
                                    want_prompt_ids=state.prompt_ids is None,
                                    passthrough=passthrough)
            if on_chunk is None and self.settings.stream_from_engines \
                    and eng.client.info.has_stream_interval:
                # nobody waits on single tokens: fewer chunks, each costing engine and gateway
                payload["sampling_params"]["stream_interval"] = \
                    self.settings.engine_stream_interval
            t0 = time.time()
            vet = Vetting(eng, self._learn_install_modes if self.registry is not None
                          else None)
            on_delta = None
            if on_chunk is not None:
                base, how = state.generated, began

                labels: list[Span] = []  # this request's chunks by their version labels

                async def on_delta(d: Decoded, eng=eng, base=base, how=how,
                                   labels=labels, vet=vet) -> None:
                    await on_chunk(self._stamp_delta(eng, d, how, base, labels))
                    vet.delivered += d.num_tokens
            lease: Lease | None = None

            def first(cb=self.on_first_token if attempts == 1 else None, t0=created) -> None:
                # an engine's first chunk follows its first token: the request is prefilled
                if lease is not None:
                    lease.started()
                if cb is not None:
                    cb(time.time() - t0)
            state.live = {}

            def on_tokens(d: Decoded, live=state.live, eng=eng) -> None:
                v = d.weight_version if d.weight_version is not None else eng.version
                if v is not None:
                    live[v] = live.get(v, 0) + d.num_tokens
            if ol is not None:
                await ol.busy(trajectory_id, eng.id)
            try:
                routed = bool(payload.get("return_routed_experts"))
                async with self.pool.lease(eng, remaining, rid, routed, policy=policy,
                                           start_version=start_version(state)) as lease:
                    opts = decode_options(eng, self.settings, routing=routed,
                                          passthrough=passthrough.keys() if passthrough else
                                          frozenset())
                    dec = await self._call(eng, payload, opts, on_delta, first, on_tokens,
                                           vet.chunk)
                    changed = await vet.answer(dec)
                    if changed is not None:
                        raise RequestFailed(changed)
            except RequestFailed as failed:  # what arrived before the failure is kept
                partial = failed.partial
                if partial is not None and await vet.answer(partial, epoch=False):
                    partial = None  # a changed engine's output is never stamped
                await self._settle(state, eng, partial, began, payload, t0)
                last_error = self._failing_over(eng, failed.error, trajectory_id)
                exclude.add(eng.id)
                if (partial is not None and partial.num_tokens) or not isinstance(
                        failed.error, EngineChanged):
                    began = Transition.FAILOVER
                # else: nothing of the changed engine's answer is kept, so the next request
                # begins as this one did
                continue
            finally:
                state.live = {}
            await self._settle(state, eng, dec, began, payload, t0)
            fin = dec.finish_reason
            if fin is not None and fin.get("type") != "abort":
                self.pool.record_success(eng)
                finish = fin
                break
            # aborted: by a swap's pause (ours or another replica's), a retract swap breaking
            # off a request that asked for routing (swap.orchestrator), or a failed load. Resume
            # from the tokens so far, same engine if it is still in rotation; max_attempts
            # bounds an engine that keeps aborting. (Cut short at shutdown: the loop's top
            # ends it.)
            if self.cutting:
                attempts -= 1
                continue
            broken = lease.broken_off if lease is not None else None
            if broken in (BREAK_STALE_PUBLISH, BREAK_STALE_REQUEUE) and state.pieces:
                # a refit's drop_stale: the output so far was sampled by weights the
                # learner would judge stale; a stream has sent it already (never taken back)
                if broken == BREAK_STALE_PUBLISH or on_chunk is not None:
                    finish = {"type": "abort", "message": STALE_DROPPED}
                    self.counters["stale_published"] += 1
                    break
                state.pieces.clear()  # requeued: starts again from the prompt (as a start)
                self.counters["stale_requeued"] += 1
                prefer = None
                continue
            if broken == BREAK_KV_POLICY:
                self.counters["kv_policy_reprefills"] += 1
            if eng.routable:
                began, prefer = Transition.ABORT_RESUME, eng.id
            else:
                began = Transition.FAILOVER
                exclude.add(eng.id)
        text = "".join(p.text for p in state.pieces)
        traj = self._assemble(req, state, group_id, index, finish, created)
        if passthrough is not None:
            passthrough.out[index] = self._passed(passthrough, state, trajectory_id)
        return traj, text

    async def _settle(self, state: SampleState, eng: Engine, dec: Decoded | None,
                      began: Transition, payload: dict[str, Any], t0: float) -> None:
        """An engine request is over: its output (all of it, or what arrived before it
        failed) leaves ``live`` and joins the sample's pieces (unless the engine refused the
        request: that is raised)."""
        state.live = {}
        t1 = time.time()
        if dec is not None:
            refused = refusal(eng.id, dec.finish_reason)
            if refused is not None:  # the request is bad: failing over would not help
                raise refused
            input_len = len(payload.get("input_ids", ()))
            if dec.num_tokens:
                eng.client.info.exact_entropy = dec.entropy_kind is EntropyKind.EXACT
            if state.prompt_ids is None:  # the request was sent as text
                ids = dec.input_token_ids
                if ids is None or len(ids) == 0:
                    raise EngineError(f"engine {eng.id} did not return the prompt's token ids")
                state.prompt_ids = np.asarray(ids, np.int32)
                input_len = len(ids)
            if len(dec.output_ids) > 0:
                if len(dec.spans) > 1 and self.registry is not None:
                    await self._learn_install_modes(eng, {v for v, _, _ in dec.spans[1:]})
                piece = self._piece(eng, dec, began, state.generated, input_len, t0, t1)
                piece.input_start = payload["logprob_start_len"]
                state.pieces.append(piece)
        if self.oldlogits is not None:  # the partial output is in the state: a swap may score it
            await self.oldlogits.busy(state.trajectory_id, None)

    def _failing_over(self, eng: Engine, err: GatewayError, trajectory_id: str) -> str:
        """An engine request failed: raise when another engine would not help (the failure
        is not the engine's); otherwise count it against the engine and return why (an
        engine that changed behind the gateway is not counted: the pool registers it
        again)."""
        if not isinstance(err, EngineError | Timeout):
            raise err  # e.g. InvalidArgument: the engine refused our request (a 4xx)
        if isinstance(err, EngineChanged):
            log.warning("sample %s: %s; resuming elsewhere", trajectory_id, err.message)
            if err.details.get("sent_epoch") == eng.epoch:  # the pool has not seen it yet
                self.pool.suspect(eng, err.message)
            return err.message
        log.warning("sample %s: engine %s failed (%s); failing over", trajectory_id, eng.id,
                    err.message)
        self.pool.record_failure(eng, err.message)
        return err.message

    @staticmethod
    def _passed(pt: PassThrough, state: SampleState, tid: str) -> dict[str, Any]:
        """The forwarded rows of a finished sample; anything asked for and missing is an
        engine error (never silently absent)."""
        pieces = state.pieces
        out: dict[str, Any] = {"cached_tokens": sum(p.cached_tokens for p in pieces)}
        if pt.routed_experts and len(pieces) == 1 and pieces[0].routing_b64 is not None:
            out["routed_experts"] = pieces[0].routing_b64
        if pt.return_text_in_logprobs:
            rows = []
            for p in pieces:
                got = p.extra.get("output_token_logprobs")
                if got is None or len(got) != len(p.cols):
                    raise EngineError(f"sample {tid}: engine {p.engine_id} returned no "
                                      f"output_token_logprobs rows for {len(p.cols)} tokens")
                rows.extend(got)
            out["output_token_logprobs"] = rows
        if pt.top_logprobs_num > 0:
            tops: list[LogprobRows | list] = []
            for p in pieces:
                got = p.extra.get("output_top_logprobs")
                if got is None or len(got) != len(p.cols):
                    raise EngineError(f"sample {tid}: engine {p.engine_id} returned no "
                                      f"output_top_logprobs for {len(p.cols)} tokens although "
                                      f"top_logprobs_num was sent")
                tops.append(cut_top(got, pt.top_logprobs_num))
            out["output_top_logprobs"] = LogprobRows.concat(tops)
        if pt.logprob_start_len >= 0:
            first = pieces[0] if pieces else None
            for key in ("input_token_logprobs", "input_top_logprobs"):
                if key == "input_top_logprobs" and pt.top_logprobs_num <= 0:
                    continue
                got = first.extra.get(key) if first is not None else None
                if got is None or first.input_start < 0:
                    if first is None:  # no output at all (max_new_tokens reached at once)
                        continue
                    raise EngineError(f"sample {tid}: engine {first.engine_id} returned no "
                                      f"{key} although logprob_start_len was sent")
                cut = max(pt.logprob_start_len - first.input_start, 0)
                rows = list(got[cut:])
                if cut and rows and rows[0] is not None:  # SGLang: the start token gets None
                    rows[0] = None if key == "input_top_logprobs" else [None, *rows[0][1:]]
                if key == "input_top_logprobs":
                    rows = cut_top(rows, pt.top_logprobs_num)
                out[key] = rows
        return out

    @staticmethod
    def _stamp_delta(eng: Engine, d: Decoded, began: Transition, base: int,
                     labels: list[Span]) -> dict[str, Any]:
        """A live chunk: the new tokens of one engine stream chunk, stamped. Only the final
        chunk carries the engine's spans; before it, ``labels`` (this request's chunks so far,
        each under the version the engine labelled it with) stands in for them, so an
        in-place switch inside the request keeps the older KV and moves by the label lag."""
        total = d.offset + d.num_tokens
        if d.spans:
            spans = normalize_spans([Span(int(v), int(a), int(b)) for v, a, b in d.spans
                                     if a < total], total, d.weight_version)
        else:
            v = d.weight_version if d.weight_version is not None else eng.version
            if v is not None and labels and labels[-1].version == v:
                labels[-1] = Span(v, labels[-1].start, total)
            elif v is not None:
                labels.append(Span(int(v), d.offset, total))
            spans = normalize_spans(labels, total, v)
        st = stamp_request(spans, offset=base, engine_id=eng.id, began=began,
                           installed_by=eng.installed_by, label_lag=eng.client.info.label_lag,
                           kv_kept=eng.kv_kept)
        out = {"offset": base + d.offset, "engine_id": eng.id, "token_ids": d.output_ids,
               "logprobs": d.logprobs, "entropy": d.entropy,
               "policy_version": st.policy_version[d.offset:],
               "kv_version": st.kv_version[d.offset:]}
        if "output_top_logprobs" in d.extra:  # /generate pass-through only
            out["top_logprobs"] = d.extra["output_top_logprobs"]
        return out

    def _piece(self, eng: Engine, dec, began: Transition, offset: int, input_len: int,
               t0: float, t1: float) -> Piece:
        n = len(dec.output_ids)
        spans = normalize_spans([Span(int(v), int(s), int(e)) for v, s, e in dec.spans], n,
                                dec.weight_version if dec.weight_version is not None
                                else eng.version)
        st = stamp_request(spans, offset=offset, engine_id=eng.id, began=began,
                           installed_by=eng.installed_by, started_at=t0, ended_at=t1,
                           label_lag=eng.client.info.label_lag, kv_kept=eng.kv_kept)
        if dec.logprobs is None:
            raise EngineError(f"engine {eng.id} returned no output_token_logprobs")
        cols = TokenColumns(token_ids=dec.output_ids, logprobs=dec.logprobs, entropy=dec.entropy,
                            policy_version=st.policy_version, kv_version=st.kv_version)
        return Piece(engine_id=eng.id, input_len=input_len, cols=cols, segments=st.segments,
                     entropy_kind=EntropyKind(dec.entropy_kind),
                     entropy_bound=float(dec.entropy_error_bound), finish=dec.finish_reason,
                     routing=dec.routed.data if dec.routed is not None else None,
                     routing_b64=dec.routed_b64 if dec.routed is not None else None,
                     num_experts=dec.routed.num_experts if dec.routed is not None else 0,
                     text=dec.text or "", extra=dec.extra,
                     cached_tokens=dec.cached_tokens or 0)

    def _assemble(self, req: RolloutRequest, state: SampleState, group_id: str, index: int,
                  finish: dict[str, Any], created: float) -> Trajectory:
        segments: list[Segment] = []
        for i, p in enumerate(state.pieces):
            if segments and p.segments:
                segments[-1].ended = p.segments[0].began
            segments.extend(p.segments)
        fr = FinishReason.from_sglang(finish)
        if segments:
            segments[-1].ended = Transition.ABORTED if fr.type == "abort" else Transition.FINISHED
        kind = max((p.entropy_kind for p in state.pieces), key=_KIND_RANK.__getitem__,
                   default=EntropyKind.EXACT)
        bound = max((p.entropy_bound for p in state.pieces), default=0.0)
        routed = None
        rows = stitch_routing([(p.input_len, p.routing) for p in state.pieces])
        num_experts = max((p.num_experts for p in state.pieces), default=0)
        if rows is not None and num_experts:
            routed = RoutedExperts(data=rows, num_experts=num_experts)
        return Trajectory(
            trajectory_id=state.trajectory_id,
            prompt_token_ids=state.prompt_ids if state.prompt_ids is not None else np.zeros(0, np.int32),
            tokens=TokenColumns.concat([p.cols for p in state.pieces]),
            finish_reason=fr, segments=segments, group_id=group_id, sample_index=index,
            entropy_kind=kind, entropy_error_bound=bound if kind is EntropyKind.TOPK_ESTIMATE else 0.0,
            routed_experts=routed, created_at=created, finished_at=time.time(),
            metadata=dict(req.metadata))
