"""SGLang HTTP adapter: one engine's endpoints, version-aware, with per-phase timeouts.

Every call goes through the engine's :class:`~rollout_gateway.engines.transport.Transport`
(chosen once, by URL scheme). Every transport failure or unusable answer becomes
:class:`EngineError` (or :class:`Timeout`) here, at the adapter, except an answer in
which the engine refuses the request itself (a 4xx, also as an error event inside a 200
stream): that is the caller's :class:`InvalidArgument` (:func:`answer_error`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import orjson

from rollout_gateway.engines.identity import EngineIdentity, process_marker
from rollout_gateway.engines.shape import (
    read_hf_config,
    shape_from_hf_config,
    vocab_from_hf_config,
)
from rollout_gateway.engines.transport import Transport, open_transport
from rollout_gateway.errors import EngineError, GatewayError, InvalidArgument
from rollout_gateway.settings import Timeouts

#: first SGLang version with begin/end_weight_update and weight_versions spans
SPANS_SINCE = (0, 5, 21)
#: first SGLang version with pause modes (abort | retract | in_place)
PAUSE_MODES_SINCE = (0, 5, 6)
#: SGLang versions known to take sampling_params.stream_interval per request (read in
#: 0.5.23's scheduler_components/output_streamer.py); older ones are not sent it
STREAM_INTERVAL_SINCE = (0, 5, 23)


def parse_version(text: str) -> tuple[int, ...]:
    """'0.5.23.post1' -> (0, 5, 23). Unparseable -> EngineError."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise EngineError(f"cannot parse engine version {text!r}")
    return tuple(int(g or 0) for g in m.groups())


def parse_weight_version(value: Any, engine_id: str = "?") -> int | None:
    """SGLang keeps weight_version as a string, "default" unless the server was started
    with ``--weight-version``; the gateway stamps integers. None (not reported) -> None;
    anything that is not an integer, "default" included, is refused here, at
    registration, with the fix in the message (never a failure mid-rollout)."""
    if value is None:
        return None
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return int(str(value).strip())
    except ValueError as exc:
        hint = ("SGLang's default when started without --weight-version"
                if value == "default" else "not an integer")
        raise EngineError(
            f"engine {engine_id} reports weight_version {value!r} ({hint}): the gateway stamps "
            f"integer policy versions; start the engine with --weight-version <int> (the "
            f"learner's current version, e.g. 0)",
            details={"engine_id": engine_id, "weight_version": str(value)}) from exc


class Health(StrEnum):
    OK = "ok"
    PAUSED = "paused"  # 503 while paused: alive, not serving new work
    DOWN = "down"


@dataclass(slots=True)
class EngineInfo:
    """What we learned from /server_info and /model_info."""

    version: tuple[int, ...] = (0, 0, 0)
    version_text: str = "unknown"
    weight_version: int | None = None
    num_layers: int | None = None
    top_k: int | None = None
    num_experts: int | None = None
    incremental_stream: bool = False  # --incremental-streaming-output: chunks are deltas
    #: /server_info's enable_return_routed_experts (None: the engine does not say)
    routing_enabled: bool | None = None
    model_path: str | None = None
    #: the model's vocabulary (HF config ``vocab_size``, found as the shape is): SGLang
    #: 0.5.23 crashes its scheduler on an input id at or above it, so the gateway refuses
    #: such prompts first (None: unknown, nothing checked)
    vocab_size: int | None = None
    #: where num_layers / top_k / num_experts came from, or why they could not be read
    shape_source: str | None = None
    exact_entropy: bool = False  # its last answer carried output_token_entropy
    #: /server_info's scheduler: SGLang's default overlap scheduler keeps one batch in
    #: flight, so its in-place version labels run one token ahead of the weights
    #: (core.stamping). False when the engine does not report ``disable_overlap_schedule``.
    overlap_schedule: bool = False
    #: why in-place labels cannot be corrected on this engine (speculative decoding commits
    #: an unknown number of tokens per step; pipeline parallelism keeps several batches in
    #: flight), or None
    in_place_unexact: str | None = None
    #: who the engine was when these facts were read (engines.identity)
    identity: EngineIdentity = field(default_factory=EngineIdentity)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_spans(self) -> bool:
        return self.version >= SPANS_SINCE

    @property
    def has_pause_modes(self) -> bool:
        return self.version >= PAUSE_MODES_SINCE

    @property
    def has_stream_interval(self) -> bool:
        return self.version >= STREAM_INTERVAL_SINCE

    @property
    def label_lag(self) -> int:
        """Tokens by which in-place version labels run ahead of the weights (0 or 1)."""
        return 1 if self.overlap_schedule else 0


def scheduler_facts(server: dict[str, Any]) -> tuple[bool, str | None]:
    """(overlap scheduler on, why in-place labels cannot be made exact) from /server_info."""
    overlap = server.get("disable_overlap_schedule") is False
    spec = server.get("speculative_algorithm")
    pp = server.get("pp_size")
    if spec not in (None, "", "None"):
        return overlap, f"speculative decoding ({spec}) commits an unknown number of tokens " \
                        "per step, so in-place version labels cannot be corrected"
    if isinstance(pp, int) and pp > 1:
        return overlap, f"pipeline parallelism (pp_size {pp}) keeps several batches in flight, " \
                        "so in-place version labels cannot be corrected"
    return overlap, None


def _json(content: bytes, what: str) -> Any:
    try:
        return orjson.loads(content)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"{what}: engine answered non-JSON: {content[:200]!r}") from exc


#: 4xx codes that are not the request's fault: the gateway's credentials (401, 403) and
#: the codes HTTP itself calls retryable (408, 429)
_NOT_THE_REQUEST = frozenset({401, 403, 408, 429})


def answer_error(engine_id: str, what: str, status: int, body: bytes) -> GatewayError:
    """An engine's error answer as the gateway's error: a body with HTTP ``status`` other
    than 200, or (``status`` 200) the payload of an error event inside a stream.

    SGLang 0.5.23's shapes: ``{"error": {"message", "type", "code", "retryable"}}`` as an
    SSE event of a 200 stream (a ValueError while admitting a streamed request, e.g. text
    sent to a ``--skip-tokenizer-init`` engine: code 400, retryable false), followed by
    ``data: [DONE]``; ``{"error": {"message"}}`` with the status of the error (400 unless
    it says otherwise) for a non-streamed request; ``{"error": "<text>"}`` with 400 for a
    body that breaks the request contract (an unknown sampling key).

    A 4xx code (the HTTP status, or the event's ``code``) that is not marked retryable
    and is not in ``_NOT_THE_REQUEST`` means the request is bad: :class:`InvalidArgument`,
    which the caller answers as a 400 without failing over or counting it against the
    engine. Anything else is an :class:`EngineError` (the engine failed)."""
    err: Any = None
    with contextlib.suppress(orjson.JSONDecodeError):
        obj = orjson.loads(body)
        err = obj.get("error") if isinstance(obj, dict) else None
    fields = err if isinstance(err, dict) else {}
    code, retryable = status, fields.get("retryable")
    if status == 200:  # an event in a stream: its own code
        c = fields.get("code")
        code = int(c) if isinstance(c, int | str) and str(c).isdigit() else 500
    message = fields.get("message") if isinstance(fields.get("message"), str) else \
        err if isinstance(err, str) else body[:300].decode("utf-8", "replace")
    details = {"engine_id": engine_id, "status": code}
    if _request_fault(code, retryable):
        return InvalidArgument(f"the engine rejected the request: {message}", details=details)
    where = "stream error" if status == 200 else f"HTTP {status}"
    return EngineError(f"engine {engine_id} {what}: {where}: {message}", details=details)


def _request_fault(code: int, retryable: Any = None) -> bool:
    return 400 <= code < 500 and code not in _NOT_THE_REQUEST and retryable is not True


def refusal(engine_id: str, finish_reason: dict[str, Any] | None) -> InvalidArgument | None:
    """SGLang's other way to refuse a streamed request: one its scheduler rejects (input
    longer than it admits, past the KV budget: ``Req.set_finish_with_abort``) ends, in a
    200 stream, with ``finish_reason {"type": "abort", "status_code": 400, "message",
    "err_type"}`` (not streamed, the same is an HTTP 400). By :func:`answer_error`'s rule
    that is the caller's InvalidArgument; None for any other finish (the aborts of a
    swap's pause or of /abort_request carry no status_code; a 503 abort is the engine's)."""
    if not finish_reason or finish_reason.get("type") != "abort":
        return None
    code = finish_reason.get("status_code")
    if not isinstance(code, int) or isinstance(code, bool) or not _request_fault(code):
        return None
    return InvalidArgument(f"the engine rejected the request: {finish_reason.get('message')}",
                           details={"engine_id": engine_id, "status": code})


#: the start of SGLang's message when ``update_weights_from_*`` swapped the weights but
#: refused the cache flush asked for (requests resident): HTTP 400, ``success: false``
#: (scheduler_components/weight_updater.py ``flush_cache_after_weight_update``)
FLUSH_REFUSED = "Weights were updated, but the cache was not flushed"


@dataclass(frozen=True, slots=True)
class WeightLoad:
    """A weight update the engine performed. ``cache_flushed`` False: the flush asked
    for was refused (SGLang: requests were resident) although the weights were swapped;
    SGLang then leaves ``/model_info``'s ``weight_version`` and ``model_path`` at the old
    values (its tokenizer manager moves them only on success) while its scheduler labels
    tokens with the new version, and the old KV stays in the prefix cache."""

    cache_flushed: bool
    message: str = ""


def weight_load(engine_id: str, path: str, status: int, content: bytes) -> WeightLoad:
    """The answer of a weight update (``path``): done (:class:`WeightLoad`), or EngineError
    when the engine did not swap the weights. A refused flush (HTTP 400, ``success: false``,
    SGLang's :data:`FLUSH_REFUSED` message) swapped them: ``cache_flushed=False``."""
    data: Any = None
    with contextlib.suppress(orjson.JSONDecodeError):
        data = orjson.loads(content)
    message = data.get("message") if isinstance(data, dict) else None
    if (status in (200, 400) and isinstance(data, dict) and data.get("success") is False
            and isinstance(message, str) and message.startswith(FLUSH_REFUSED)):
        return WeightLoad(cache_flushed=False, message=message)
    if status != 200:
        raise EngineError(f"engine {engine_id} {path}: HTTP {status}: "
                          f"{content[:300].decode('utf-8', 'replace')}",
                          details={"engine_id": engine_id, "status": status})
    if data is None:
        raise EngineError(f"engine {engine_id} {path}: engine answered non-JSON: "
                          f"{content[:200]!r}", details={"engine_id": engine_id})
    ok = EngineClient._check_success(data, path.lstrip("/"), engine_id)
    return WeightLoad(cache_flushed=True, message=str(ok.get("message", "")))


class AnswerGate:
    """How many large engine answers are read and decoded at once, over every engine that
    shares the gate (the pool's).

    Large: an answer with at least ``large`` bytes in the gateway (streamed: an event not
    complete yet, e.g. the final chunk with the routed experts, plus the bytes received
    and not read yet; non-streamed: the body's Content-Length). Such an answer reads on
    only with a slot; without one it waits unread in its socket (the reader buffers at
    most ~2 x 64 KiB plus one socket read, then stops reading: TCP backpressure).
    When many rollouts finish together, the gateway thus holds a bounded number of raw
    answers and their decoded rows, not every answer at once. A slot is given back once
    the consumer has taken the payload (streamed: when it asks for the next one; a body:
    when :meth:`EngineClient.generate` returns, the caller decoding it before it awaits).
    """

    def __init__(self, slots: int, large: int = 1 << 16) -> None:
        if slots < 1:
            raise ValueError("an AnswerGate needs at least one slot")
        self.slots = slots
        self.large = large
        self._sem = asyncio.Semaphore(slots)

    @property
    def waiting(self) -> int:
        """Answers waiting for a slot now."""
        return len(self._sem._waiters or ())

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self.slots - self._sem._value

    async def acquire(self) -> None:
        await self._sem.acquire()

    def release(self) -> None:
        self._sem.release()


#: bytes read past ``data: [DONE]`` to finish a body, so its connection is kept alive
_DRAIN_LIMIT = 1 << 16
_DRAIN_S = 1.0


async def _drain(source: AsyncIterator[Any]) -> None:
    """Read what is left of a stream's body after [DONE] (its blank line, the chunked
    terminator), so the raw client can reuse the connection instead of closing it (a new
    TCP connection per streamed request otherwise). Anything longer is not read: the
    connection is then closed as before, and so it is when the rest does not come within
    a second or the connection fails: the answer is complete either way."""
    left = _DRAIN_LIMIT
    with contextlib.suppress(TimeoutError, GatewayError, OSError):
        async with asyncio.timeout(_DRAIN_S):
            async for chunk in source:  # bytes, or a batch of SSE payloads
                left -= len(chunk) if isinstance(chunk, bytes) else sum(map(len, chunk))
                if left < 0:
                    return


class EngineClient:
    """Async client for one SGLang-protocol engine."""

    def __init__(self, engine_id: str, url: str, *, timeouts: Timeouts | None = None,
                 api_key: str | None = None, gate: AnswerGate | None = None,
                 transport: Transport | None = None) -> None:
        self.engine_id = engine_id
        self.gate = gate  # bounds the large answers read at once (shared by the pool)
        self.url = url.rstrip("/")
        self.t = timeouts or Timeouts()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        #: every call to the engine (the raw keep-alive client for http, httpx for https)
        self.transport = transport or open_transport(
            engine_id, self.url, connect_timeout=self.t.connect_s,
            keep_alive_s=self.t.keep_alive_s, headers=headers)
        self.info = EngineInfo()

    async def _call(self, method: str, path: str, *, read: float,
                    body: Any = None) -> bytes:
        """A control call: its whole body, or EngineError for any status but 200."""
        resp = await self.transport.request(
            method, path, orjson.dumps(body) if body is not None else None,
            read_timeout=read, abortable=False)
        content = await resp.read()
        if resp.status != 200:
            raise EngineError(f"engine {self.engine_id} {path}: HTTP {resp.status}: "
                              f"{content[:300].decode('utf-8', 'replace')}",
                              details={"engine_id": self.engine_id, "status": resp.status})
        return content

    async def _get_json(self, path: str, read: float | None = None) -> dict[str, Any]:
        data = _json(await self._call("GET", path, read=read or self.t.control_s), path)
        if not isinstance(data, dict):
            raise EngineError(f"engine {self.engine_id} {path}: expected a JSON object")
        return data

    async def _post_json(self, path: str, body: dict[str, Any], *, read: float | None = None) -> Any:
        content = await self._call("POST", path, read=read or self.t.control_s, body=body)
        return _json(content, path) if content.strip() else {}

    # ---- discovery -------------------------------------------------------------------
    async def detect(self) -> EngineInfo:
        """Read /server_info (SGLang version) and /model_info (weight version, shape)."""
        server = await self._get_json("/server_info")
        vtext = server.get("version")
        if vtext is None:
            raise EngineError(f"engine {self.engine_id}: /server_info has no 'version'")
        model = await self._get_json("/model_info")
        info = EngineInfo(version=parse_version(vtext), version_text=str(vtext),
                          weight_version=parse_weight_version(model.get("weight_version"),
                                                              self.engine_id),
                          incremental_stream=bool(server.get("incremental_streaming_output")))
        info.overlap_schedule, info.in_place_unexact = scheduler_facts(server)
        flag = server.get("enable_return_routed_experts")
        info.routing_enabled = flag if isinstance(flag, bool) else None
        mp = model.get("model_path") or server.get("model_path")
        info.model_path = mp if isinstance(mp, str) and mp else None
        cfg = model.get("model_config") or model.get("hf_config")
        if isinstance(cfg, dict):  # the engine reports its config (reference engine)
            found, info.shape_source = shape_from_hf_config(cfg), "/model_info model_config"
            info.vocab_size = vocab_from_hf_config(cfg)
        elif info.model_path is not None:
            hf, where = await asyncio.to_thread(read_hf_config, info.model_path)
            found = shape_from_hf_config(hf) if hf is not None else (None, None, None)
            info.shape_source = where
            info.vocab_size = vocab_from_hf_config(hf) if hf is not None else None
        else:
            found = (None, None, None)
        info.num_layers, info.top_k, info.num_experts = found
        info.identity = EngineIdentity(process_marker(server), info.model_path,
                                       info.weight_version)
        self.info = info
        return info

    async def identity(self, read: float | None = None) -> EngineIdentity:
        """Who the engine is now (engines.identity): ``/model_info``, then ``/server_info``
        (its ``internal_states`` cost SGLang one round trip to the scheduler)."""
        model = await self._get_json("/model_info", read)
        server = await self._get_json("/server_info", read)
        mp = model.get("model_path") or server.get("model_path")
        return EngineIdentity(process_marker(server), mp if isinstance(mp, str) and mp else None,
                              parse_weight_version(model.get("weight_version"), self.engine_id))

    async def weight_version(self) -> int | None:
        model = await self._get_json("/model_info")
        v = parse_weight_version(model.get("weight_version"), self.engine_id)
        self.info.weight_version = v
        return v

    async def weights_by_name(self, name: str, truncate_size: int) -> Any:
        """SGLang's ``/get_weights_by_name``: the parameter's first ``truncate_size`` rows
        as float32 values (nested JSON lists). An engine that cannot read it back (no such
        route: 404; a model without it or an unknown name: SGLang answers 400) raises
        EngineError with ``details["status"]``."""
        return await self._post_json("/get_weights_by_name",
                                     {"name": name, "truncate_size": truncate_size})

    async def health(self) -> Health:
        try:
            async with asyncio.timeout(self.t.health_s):  # connect included
                resp = await self.transport.request("GET", "/health",
                                                    read_timeout=self.t.health_s,
                                                    abortable=False)
                await resp.read()
        except (GatewayError, TimeoutError):
            return Health.DOWN
        if resp.status == 200:
            return Health.OK
        if resp.status == 503:
            return Health.PAUSED
        return Health.DOWN

    # ---- generation ------------------------------------------------------------------
    async def generate(self, payload: dict[str, Any]) -> bytes:
        """Non-streaming /generate; returns the raw JSON body. A large body is read with a
        slot of the gate, given back on return: decode it before awaiting anything."""
        resp = await self.transport.request("POST", "/generate", orjson.dumps(payload),
                                            read_timeout=self.t.generate_s)
        gate, size = self.gate, resp.content_length
        try:
            if gate is not None and not (size is not None and size < gate.large):
                await gate.acquire()
                try:
                    content = await resp.read()
                finally:
                    gate.release()
            else:
                content = await resp.read()
        finally:
            await resp.aclose()
        if resp.status != 200:
            raise answer_error(self.engine_id, "/generate", resp.status, content)
        return content

    def abort_inflight(self, why: str) -> int:
        """Break off every /generate in flight to this engine (they fail as dropped, and
        the gateway resumes them elsewhere from their partial output)."""
        return self.transport.abort_active(why)

    async def generate_stream(self, payload: dict[str, Any], *,
                              patience=None) -> AsyncIterator[bytes]:
        """Streaming /generate: yields each SSE ``data:`` payload (bytes), stops at [DONE].

        The transport hands over every event already received at once (parsed in place,
        one await per batch, not per event: ``Response.iter_events``). A dropped
        connection raises EngineError after the payloads received so far were yielded, so
        the caller keeps the partial output of a cumulative stream. An error event raises
        :func:`answer_error`'s error (InvalidArgument: the request is bad).
        ``patience()`` true: silence is expected (the engine is paused for a swap).
        Deadlines: ``first_byte_s`` to the response head and to the first bytes of the
        body, then ``stream_idle_s`` of silence, waived while ``patience()``.
        """
        gate, held = self.gate, False

        async def before_read(here: int) -> bool:
            """The consumer took every complete payload. This answer's bytes in the
            gateway (an incomplete event, plus those received and not read yet) past the
            gate's threshold read on only with a slot (else the rest waits in the socket);
            a slot held while there were that many is given back once there are fewer.
            Returns whether a slot is held (then the answer is buffered freely)."""
            nonlocal held
            if held and here < gate.large:
                gate.release()
                held = False
            elif not held and here >= gate.large:
                await gate.acquire()
                held = True
            return held

        resp = await self.transport.request("POST", "/generate",
                                            orjson.dumps(dict(payload, stream=True)),
                                            read_timeout=self.t.stream_idle_s,
                                            first_timeout=self.t.first_byte_s,
                                            patience=patience)
        if resp.status != 200:
            try:
                raise answer_error(self.engine_id, "/generate", resp.status, await resp.read())
            finally:
                await resp.aclose()
        events = resp.iter_events(before_read if gate is not None else None)
        try:
            async for batch in events:
                for data in batch:
                    if data == b"[DONE]":
                        await _drain(events)
                        return
                    if data.startswith(b'{"error"'):  # SGLang sends [DONE] after it
                        err = answer_error(self.engine_id, "/generate", 200, data)
                        await _drain(events)
                        raise err
                    yield data
                batch = data = None  # taken: not held while before_read waits
        finally:
            if held:
                gate.release()
            await events.aclose()
            await resp.aclose()
        raise EngineError(f"engine {self.engine_id} /generate stream ended without [DONE]",
                          details={"engine_id": self.engine_id, "dropped": True})

    # ---- control ---------------------------------------------------------------------
    async def pause(self, mode: str) -> None:
        body = {"mode": mode} if self.info.has_pause_modes else {}
        await self._post_json("/pause_generation", body)

    async def resume(self) -> None:
        await self._post_json("/continue_generation", {})

    async def abort(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        await self._post_json("/abort_request", {"rid": rid or "", "abort_all": abort_all})

    # ---- weights ---------------------------------------------------------------------
    @staticmethod
    def _check_success(data: Any, what: str, engine_id: str) -> dict[str, Any]:
        if not isinstance(data, dict) or "success" not in data:
            raise EngineError(f"engine {engine_id} {what}: unexpected answer {str(data)[:200]}")
        if not data["success"]:
            raise EngineError(f"engine {engine_id} {what} failed: {data.get('message', '')}",
                              details={"engine_id": engine_id, "message": data.get("message")})
        return data

    async def _load(self, path: str, body: dict[str, Any]) -> WeightLoad:
        """A weight update (:func:`weight_load` reads the answer)."""
        resp = await self.transport.request("POST", path, orjson.dumps(body),
                                            read_timeout=self.t.weight_load_s, abortable=False)
        return weight_load(self.engine_id, path, resp.status, await resp.read())

    async def update_weights_from_disk(self, model_path: str, version: int, *,
                                       flush_cache: bool) -> WeightLoad:
        return await self._load("/update_weights_from_disk", {
            "model_path": model_path, "weight_version": str(version),
            "flush_cache": flush_cache, "abort_all_requests": False})

    async def update_weight_version(self, version: int, *,
                                    abort_all_requests: bool = False) -> dict[str, Any]:
        """Relabel the engine's weights. SGLang's ``abort_all_requests`` defaults to TRUE
        (every in-flight request would end): the flag is always sent explicitly."""
        data = await self._post_json("/update_weight_version", {
            "new_version": str(version), "abort_all_requests": abort_all_requests})
        return self._check_success(data, "update_weight_version", self.engine_id)

    async def begin_weight_update(self) -> None:
        if self.info.has_spans:
            await self._post_json("/begin_weight_update", {"selector": "all"})

    async def end_weight_update(self) -> None:
        if self.info.has_spans:
            await self._post_json("/end_weight_update", {})

    async def init_weights_update_group(self, *, master_address: str, master_port: int,
                                        rank_offset: int, world_size: int, group_name: str,
                                        backend: str) -> dict[str, Any]:
        data = await self._post_json("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend}, read=self.t.weight_load_s)
        return self._check_success(data, "init_weights_update_group", self.engine_id)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str,
                                              version: int, flush_cache: bool) -> WeightLoad:
        return await self._load("/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": flush_cache, "weight_version": str(version)})

    async def close(self) -> None:
        await self.transport.aclose()
