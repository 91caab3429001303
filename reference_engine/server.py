"""FastAPI app of the reference engine: SGLang 0.5.23's HTTP protocol subset.

``create_app(settings)`` builds the app; the model is built in the lifespan (no work at
import). Endpoints: /generate, /pause_generation, /continue_generation, /abort_request,
/update_weights_from_disk, /init_weights_update_group, /destroy_weights_update_group,
/begin_weight_update, /end_weight_update, /update_weights_from_distributed,
/update_weight_version, /flush_cache, /model_info (+/get_model_info), /server_info
(+/get_server_info), /get_weight_version, /get_weights_by_name, /health, /health_generate,
/ready.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import ORJSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from reference_engine import checkpoint as ckpt
from reference_engine import distributed as dist_update
from reference_engine.config import ModelConfig
from reference_engine.protocol import ProtocolError, format_output, parse_generate
from reference_engine.request import GenParams
from reference_engine.request import Request as GenRequest
from reference_engine.scheduler import Scheduler
from reference_engine.tokenizer import ByteTokenizer

log = logging.getLogger(__name__)
SGLANG_VERSION = "0.5.23"


class EngineSettings(BaseModel):
    """How one reference engine process is configured (filled from the CLI)."""

    model_config = ConfigDict(extra="forbid")

    model: ModelConfig = Field(default_factory=ModelConfig,
                               description="Architecture (ignored when checkpoint is set).")
    seed: int = Field(0, ge=0, description="Seed of the initial weights when no checkpoint.")
    checkpoint: str | None = Field(None, description="Checkpoint dir to load at start.")
    weight_version: str = Field("0", min_length=1, description="Initial weight version.")
    sglang_strict: bool = Field(
        False, description="Answer exactly as SGLang does: no entropy extension, /model_info "
        "and /server_info with SGLang's keys only, routed experts only with "
        "enable_return_routed_experts, config.json under model_path.")
    enable_return_routed_experts: bool = Field(
        False, description="Strict mode: SGLang's --enable-return-routed-experts (without it "
        "return_routed_experts is silently ignored, as in SGLang). Always on otherwise.")
    emulate_version: str = Field(
        SGLANG_VERSION, pattern=r"^\d+\.\d+\.\d+$",
        description="SGLang version to report and emulate: below 0.5.21 no weight_versions "
        "spans and no begin/end_weight_update; below 0.5.6 /pause_generation takes no mode "
        "(it aborts in-flight requests).")
    model_path: str | None = Field(
        None, description="Directory reported as model_path (strict mode writes the HF "
        "config.json there when it has none); default: the checkpoint dir, or a temp dir.")
    incremental_streaming_output: bool = Field(
        False, description="SSE chunks carry deltas instead of the cumulative output.")
    max_running_requests: int = Field(64, ge=1, le=4096,
                                      description="Requests decoded together per step.")
    step_delay_ms: float = Field(0.0, ge=0, le=10_000,
                                 description="Sleep between decode steps (tests use it to catch "
                                 "requests mid-flight on fast machines); 0 in production.")
    radix_cache: bool | None = Field(
        None, description="SGLang's prefix (radix) cache: requests sharing a token prefix reuse "
        "its cached KV (computed by whatever weights were loaded then) and report it as "
        "cached_tokens. Default: on with sglang_strict (SGLang's default), off otherwise.")
    max_total_tokens: int = Field(65536, ge=64, le=1 << 24,
                                  description="KV pool size in tokens (SGLang's "
                                  "--max-total-tokens): the radix cache evicts least recently "
                                  "used prefixes when a step's new tokens do not fit.")
    overlap_schedule: bool | None = Field(
        None, description="Emulate SGLang's overlap scheduler: a step's results are processed "
        "after the next step ran, so after pause(in_place) + update + continue the first token "
        "labelled with the new version was computed by the old weights. Default: on with "
        "sglang_strict (SGLang's default), off otherwise.")
    timeout_keep_alive: float = Field(5.0, gt=0, le=3600,
                                      description="Seconds an idle keep-alive connection stays "
                                      "open (uvicorn's timeout_keep_alive; SGLang reads "
                                      "SGLANG_TIMEOUT_KEEP_ALIVE, default 5).")

    @property
    def radix_cache_on(self) -> bool:
        return self.sglang_strict if self.radix_cache is None else self.radix_cache

    @property
    def overlap_on(self) -> bool:
        return self.sglang_strict if self.overlap_schedule is None else self.overlap_schedule


def _json(content: Any, status: int = 200) -> ORJSONResponse:
    return ORJSONResponse(content, status_code=status)


def _bad(message: str) -> ORJSONResponse:
    return _json({"error": {"message": message}}, 400)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(data, dict):
        raise ProtocolError("The request body must be a JSON object.")
    return data


def _vt(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def _model_path(settings: EngineSettings, cfg: ModelConfig) -> str:
    """What /model_info reports as model_path; strict mode makes it a real HF directory
    (config.json readable there), as an SGLang deployment's model directory is."""
    path = settings.model_path or settings.checkpoint
    if not settings.sglang_strict:
        return path or f"reference-seed-{settings.seed}"
    if path is None:
        import tempfile

        path = tempfile.mkdtemp(prefix=f"reference-seed-{settings.seed}-")
    cfg_file = Path(path) / ckpt.CONFIG_FILE
    if not cfg_file.exists():
        Path(path).mkdir(parents=True, exist_ok=True)
        cfg_file.write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    return str(Path(path).resolve())


async def _pump(i: int, r: GenRequest, merged: asyncio.Queue) -> None:
    """Move request ``i``'s published output counts to ``merged`` until it has finished;
    its last one is then its final count. (The request can finish, by an abort say, while
    older counts still wait in its queue: ending on the first count read after the finish
    would leave the final one unsent and the stream open forever.)"""
    q = r.listeners[0]
    while True:
        n = await q.get()
        if r.finished:
            merged.put_nowait((i, len(r.output)))
            return
        merged.put_nowait((i, n))


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or EngineSettings()
    tok = ByteTokenizer()
    state: dict[str, Any] = {}
    strict = settings.sglang_strict
    emulated = _vt(settings.emulate_version)
    has_spans = emulated >= (0, 5, 21)
    has_pause_modes = emulated >= (0, 5, 6)
    routing_on = settings.enable_return_routed_experts or not strict

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        if settings.checkpoint:
            model = await asyncio.to_thread(ckpt.load_model, settings.checkpoint)
        else:
            model = ckpt.build_model(settings.model, settings.seed)
        sched = Scheduler(model, settings.weight_version, settings.max_running_requests,
                          settings.step_delay_ms / 1000.0, radix_cache=settings.radix_cache_on,
                          max_total_tokens=settings.max_total_tokens,
                          overlap=settings.overlap_on, separate_prefill=strict)
        sched.start()
        state["sched"] = sched
        state["model_path"] = _model_path(settings, model.config)
        sched.served_model_path = sched.loaded_model_path = state["model_path"]
        # what tells one process from another, as SGLang's /server_info does: its measured
        # start-up durations (TokenizerManager.startup_time) and ServerArgs.random_seed,
        # drawn per process (serving_hook.py: random.randint(0, 1 << 30) when not given)
        graphs = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode",
                  "draft_extend")
        state["startup_time"] = {"load_weight": time.perf_counter() - t0,
                                 "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                                 "cuda_graph": dict.fromkeys(graphs, 0.0),
                                 "tokenizer_e2e": time.perf_counter() - t0}
        state["random_seed"] = random.randint(0, 1 << 30)
        yield
        await sched.stop()
        dist_update.destroy(sched)

    app = FastAPI(title="rollout-gateway reference engine", lifespan=lifespan)

    def sched() -> Scheduler:
        return state["sched"]

    @app.exception_handler(ProtocolError)
    async def _protocol_error(_: Request, exc: ProtocolError):
        return _json(exc.body(), 400)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _json({"error": {"message": f"internal error: {type(exc).__name__}: {exc}"}}, 500)

    # ------------------------------------------------------------------ generate
    @app.post("/generate")
    async def generate(request: Request):
        s = sched()
        cfg = s.cfg
        parsed = parse_generate(await _body(request), tok, cfg.vocab_size,
                                cfg.max_position_embeddings)
        for _, _, params in parsed.items:
            if strict:  # SGLang: return_entropy is a stub, never returned
                params.return_entropy = False
            if not routing_on:  # SGLang without the flag: silently no routing
                params.return_routed_experts = False
        await s.wait_admissible()
        for rid, _, _ in parsed.items:
            if rid in s.requests:
                raise ProtocolError(f"Duplicate request ID detected: {rid}")
        reqs = []
        for rid, prompt, params in parsed.items:
            r = GenRequest(rid, prompt, params, cfg.num_hidden_layers, cfg.num_experts_per_tok)
            r.listeners.append(asyncio.Queue())
            reqs.append(r)
        for r in reqs:
            s.submit(r)
        if parsed.stream:
            return StreamingResponse(_stream(s, reqs, settings.incremental_streaming_output),
                                     media_type="text/event-stream")
        try:
            outs = await asyncio.gather(*(_wait_final(s, r) for r in reqs))
        except asyncio.CancelledError:
            await s.abort_many(reqs)
            raise
        return _json(outs if parsed.is_list else outs[0])

    async def _wait_final(s: Scheduler, r: GenRequest) -> dict[str, Any]:
        q = r.listeners[0]
        while not r.finished:
            await q.get()
        return format_output(r, len(r.output), s.served_version, tok, final=True,
                             with_spans=has_spans)

    async def _stream(s: Scheduler, reqs: list[GenRequest], incremental: bool):
        sent = [0] * len(reqs)
        pending = set(range(len(reqs)))
        merged: asyncio.Queue = asyncio.Queue()

        tasks = [asyncio.create_task(_pump(i, r, merged)) for i, r in enumerate(reqs)]
        try:
            while pending:
                i, n = await merged.get()
                r = reqs[i]
                final = r.finished and n == len(r.output)
                if i not in pending or (n == sent[i] and not final):
                    continue
                # SGLang's output_streamer.accept: the first token at once, then a chunk
                # once stream_interval tokens are unsent (a step may pass the interval)
                every = r.params.stream_interval or 1
                if not final and every > 1 and sent[i] > 0 and n - sent[i] < every:
                    continue
                since = sent[i] if incremental else 0
                # chunks carry the tokenizer manager's version (SGLang tokenizer_manager.py
                # 2511); the final one the scheduler's spans
                chunk = format_output(r, n, s.served_version, tok, since=since, final=final,
                                      incremental=incremental, with_spans=has_spans)
                if len(reqs) > 1:
                    chunk["index"] = i
                sent[i] = n
                if final:
                    pending.discard(i)
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            if pending:  # client went away: abort what is left
                await s.abort_many([reqs[i] for i in pending])

    # ------------------------------------------------------------------ control
    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await _body(request)
        mode = body.get("mode", "abort") if has_pause_modes else "abort"  # old: no modes
        if mode not in ("abort", "retract", "in_place"):
            raise ProtocolError(f"mode must be one of abort, retract, in_place; got {mode!r}")
        await sched().pause(mode)
        return _json({"message": "Generation paused successfully.", "status": "ok", "mode": mode})

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await _body(request)
        await sched().resume()
        return _json({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await _body(request)
        rid = body.get("rid") or ""
        if not isinstance(rid, str):
            raise ProtocolError("rid must be a string.")
        n = await sched().abort(rid, bool(body.get("abort_all", False)))
        return _json({"success": True, "num_aborted": n})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache(timeout: float = 0.0):
        """SGLang http_server.py 1025-1040: 200 and this text when flushed; 400 and the
        scheduler's message (or "Flush cache failed.") when refused."""
        if timeout < 0:
            raise ProtocolError("timeout must be >= 0")
        ok, message = await sched().flush_cache_within(timeout)
        if ok:
            return Response("Cache flushed.\nPlease check backend logs for more details. (When "
                            "there are running or waiting requests, the operation will not be "
                            "performed.)\n", status_code=200)
        return Response(message or "Flush cache failed.\n", status_code=400)

    # ------------------------------------------------------------------ weights
    def _version(body: dict[str, Any], key: str = "weight_version") -> str | None:
        v = body.get(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, (str, int)):
            raise ProtocolError(f"{key} must be a string.")
        return str(v)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await _body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("model_path is required.")
        s = sched()
        if body.get("abort_all_requests", False):
            await s.abort("", abort_all=True)
        ok, msg = await s.update_from_disk(path, _version(body), bool(body.get("flush_cache", True)))
        return _json({"success": ok, "message": msg, "num_paused_requests": 0}, 200 if ok else 400)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: Request):
        """SGLang 0.5.23 for models that implement it (Llama and kin): the parameter under
        its Hub name as float32 values, the first ``truncate_size`` rows
        (``tensor.float().tolist()[:truncate_size]``), a bare JSON list; an unknown name
        answers 400 ``{"error": {"message": "Get parameter by name failed"}}`` (SGLang logs
        the cause and returns None). Strict mode answers as SGLang does for the
        Qwen3-MoE model this engine is: that 400 for every name."""
        body = await _body(request)
        if strict:
            # SGLang 0.5.23's Qwen models (Qwen3-MoE among them) have no
            # get_weights_by_name: the model runner's call raises, is logged, and the route
            # answers this 400 for every name
            log.error("Error when getting parameter %s: the model has no get_weights_by_name",
                      body.get("name"))
            return _bad("Get parameter by name failed")
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not isinstance(size, int) or isinstance(size, bool):
            raise ProtocolError("name (str) and truncate_size (int) are required.")
        s = sched()
        async with s.step_lock:  # not mid-load
            t = ckpt.to_hub_state_dict(s.model).get(name)
            if t is None and name == "lm_head.weight" and s.cfg.tie_word_embeddings:
                t = s.model.state_dict().get("model.embed_tokens.weight")
            param = None if t is None else t.detach().float().cpu().tolist()[:size]
        if param is None:
            log.error("Error when getting parameter %s: unknown name", name)
            return _bad("Get parameter by name failed")
        return _json(param)

    @app.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await _body(request)
        v = _version(body, "new_version")
        if v is None:
            raise ProtocolError("new_version is required.")
        s = sched()
        if body.get("abort_all_requests", True):
            await s.abort("", abort_all=True)
        await s.update_version(v)
        return _json({"success": True, "message": f"Weight version updated to {v}.",
                      "new_version": v})

    async def _update_session(request: Request, open_: bool, refusal: str):
        """Open (begin) or close (end) the weight-update session."""
        if not has_spans:  # routes added in 0.5.21
            return _json({"detail": "Not Found"}, 404)
        await _body(request)
        s = sched()
        if s.update_session_open == open_:
            return _json({"success": False, "message": refusal}, 400)
        s.update_session_open = open_
        return _json({"success": True, "message": "Success"})

    @app.post("/begin_weight_update")
    async def begin_weight_update(request: Request):
        return await _update_session(request, True, "a weight-update session is already "
                                     "open; call end_weight_update() first")

    @app.post("/end_weight_update")
    async def end_weight_update(request: Request):
        return await _update_session(request, False, "no weight-update session is open; "
                                     "call begin_weight_update() first")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await _body(request)
        ok, msg = await dist_update.init_group(sched(), body)
        return _json({"success": ok, "message": msg}, 200 if ok else 400)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        await _body(request)
        dist_update.destroy(sched())
        return _json({"success": True, "message": "Succeeded to destroy the update group."})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await _body(request)
        ok, msg = await dist_update.update(sched(), body, _version(body))
        return _json({"success": ok, "message": msg}, 200 if ok else 400)

    # ------------------------------------------------------------------ info / health
    def _model_info() -> dict[str, Any]:
        s = sched()
        if strict:  # SGLang 0.5.23's keys, nothing else (no layer or expert counts)
            return {"model_path": s.served_model_path, "tokenizer_path": state["model_path"],
                    "is_generation": True, "preferred_sampling_params": None,
                    "weight_version": s.served_version, "has_image_understanding": False,
                    "has_audio_understanding": False, "model_type": "qwen3_moe",
                    "architectures": ["Qwen3MoeForCausalLM"]}
        return {"model_path": s.served_model_path, "tokenizer_path": "byte-level",
                "is_generation": True, "weight_version": s.served_version,
                "served_model_name": "reference-qwen3-moe", "load_format": "safetensors",
                "model_config": s.cfg.to_hf_dict()}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return _json(_model_info())

    @app.get("/get_weight_version")
    async def get_weight_version():
        return _json({"weight_version": sched().served_version})

    def _server_info() -> dict[str, Any]:
        s = sched()
        if strict:  # SGLang: the server args, "version" and "internal_states"
            return {"model_path": state["model_path"], "tokenizer_path": state["model_path"],
                    "served_model_name": state["model_path"], "weight_version":
                    settings.weight_version, "tp_size": 1, "dp_size": 1,
                    "incremental_streaming_output": settings.incremental_streaming_output,
                    "enable_return_routed_experts": settings.enable_return_routed_experts,
                    "max_running_requests": settings.max_running_requests,
                    "disable_radix_cache": not settings.radix_cache_on,
                    "disable_overlap_schedule": not settings.overlap_on,
                    "max_total_tokens": settings.max_total_tokens, "page_size": 1,
                    "schedule_policy": "fcfs", "version": settings.emulate_version,
                    "random_seed": state["random_seed"], "startup_time": state["startup_time"],
                    "internal_states": [{"num_running_reqs": len(s.running),
                                         "num_waiting_reqs": len(s.waiting),
                                         # the scheduler's: moved even by a refused flush
                                         "weight_version": s.weight_version,
                                         "model_path": s.loaded_model_path}]}
        return {"version": SGLANG_VERSION, "reference_engine": True,
                "engine": "rollout-gateway-reference", "weight_version": s.served_version,
                "incremental_streaming_output": settings.incremental_streaming_output,
                "max_running_requests": settings.max_running_requests,
                "enable_return_routed_experts": True, "paused": s.paused,
                "disable_radix_cache": not settings.radix_cache_on,
                "disable_overlap_schedule": not settings.overlap_on,
                "max_total_tokens": settings.max_total_tokens,
                "radix_cache_tokens": s.tree.size if s.tree is not None else 0,
                "random_seed": state["random_seed"], "startup_time": state["startup_time"],
                "num_running_reqs": len(s.running), "num_waiting_reqs": len(s.waiting),
                "decode_steps": s.steps}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return _json(_server_info())

    @app.get("/health")
    async def health():
        return Response(status_code=503 if sched().paused else 200)

    @app.get("/health_generate")
    async def health_generate():
        s = sched()
        if s.paused:
            return Response(status_code=503)
        await s.wait_admissible()
        r = GenRequest(f"HEALTH_CHECK_{uuid.uuid4().hex}", [tok.bos_token_id],
                       GenParams(max_new_tokens=1), s.cfg.num_hidden_layers,
                       s.cfg.num_experts_per_tok)
        r.listeners.append(asyncio.Queue())
        s.submit(r)
        await _wait_final(s, r)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        return Response(status_code=200 if "sched" in state else 503)

    return app
