"""Engines under uvicorn as real processes, for the engine-connection tests.

``python _uvicorn_engines.py reference --port P --keep-alive S``: the reference engine's
app under uvicorn with ``timeout_keep_alive=S`` (uvicorn's and SGLang's default is 5 s).

``python _uvicorn_engines.py sglang-errors --port P``: an engine that answers /generate
with SGLang 0.5.23's own error bytes (``sglang/srt/entrypoints/http_server.py``,
``serve_generate_request`` and ``_create_error_response``) and otherwise a one-token
output. Request by request, from the first prompt token of ``input_ids`` (or a ``text``):

- ``text`` (what a ``--skip-tokenizer-init`` engine refuses): streamed, HTTP 200 and the
  event ``{"error": {"message", "type": "invalid_request_error", "code": 400,
  "retryable": false}}`` then ``[DONE]``; not streamed, HTTP 400 ``{"error": {"message"}}``;
- first token 503: the same shapes with code / status 503 (an engine failure);
- first token 429: a streamed error event with code 400 and ``"retryable": true``;
- first token 400 (a prompt the scheduler refuses, ``Req.set_finish_with_abort``):
  streamed, a chunk whose ``finish_reason`` is ``{"type": "abort", "status_code": 400,
  ...}`` then ``[DONE]``; not streamed, HTTP 400 ``{"error": {"message"}}``.

``GET /requests`` counts the /generate requests received.

:class:`UvicornEngine` starts one on a free port and stops it; :func:`established` counts
the server side's established TCP connections (from /proc/net/tcp*), to wait for the
server to close idle keep-alive connections.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import rollout_gateway
from rollout_gateway.commands.engine_process import free_port
from rollout_gateway.proc import wait_healthy

#: SGLang 0.5.23's message for text sent to an engine started with --skip-tokenizer-init
NO_TOKENIZER = ("The engine initialized with skip_tokenizer_init=True cannot accept text "
                "prompts. Please provide input_ids or re-initialize the engine with "
                "skip_tokenizer_init=False.")


#: SGLang 0.5.23's message for a prompt its scheduler refuses (managers/utils.py)
TOO_LONG = ("Input length (2 tokens) exceeds the maximum allowed length (1 tokens). Use a "
            "shorter input or enable --allow-auto-truncate.")


def sglang_errors_app():
    import orjson
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    seen = {"generate": 0}

    def dumps(obj) -> bytes:  # SGLang's dumps_json: orjson
        return orjson.dumps(obj)

    async def generate(request: Request) -> Response:
        seen["generate"] += 1
        body = orjson.loads(await request.body())
        ids = body.get("input_ids") or []
        first = ids[0] if ids and "text" not in body else None
        if "text" in body:
            code, message, retryable = 400, NO_TOKENIZER, False
        elif first == 503:
            code, message, retryable = 503, "engine overloaded", False
        elif first == 429:
            code, message, retryable = 400, "try again", True
        elif first == 400:
            code, message, retryable = 400, TOO_LONG, False
        else:
            code = 0
        if body.get("stream"):
            async def events():
                if first == 400:  # tokenizer_manager _handle_abort_finish_reason, streamed
                    yield b"data: " + dumps({"text": "", "output_ids": [], "meta_info": {
                        "id": body.get("rid"), "finish_reason": {
                            "type": "abort", "message": message, "status_code": 400,
                            "err_type": "BadRequestError"},
                        "prompt_tokens": len(ids), "completion_tokens": 0,
                        "cached_tokens": 0, "weight_version": "0"}}) + b"\n\n"
                elif code:  # http_server.py stream_results: the error event, then [DONE]
                    yield b"data: " + dumps({"error": {
                        "message": message, "type": "invalid_request_error", "code": code,
                        "retryable": retryable}}) + b"\n\n"
                else:
                    yield b"data: " + dumps(_output(ids)) + b"\n\n"
                yield b"data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        if code:  # http_server.py _create_error_response
            return Response(dumps({"error": {"message": message}}), status_code=code,
                            media_type="application/json")
        return Response(dumps(_output(ids)), media_type="application/json")

    def _output(ids: list[int]) -> dict:
        return {"text": "", "output_ids": [7], "meta_info": {
            "id": "r", "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(ids), "completion_tokens": 1, "cached_tokens": 0,
            "weight_version": "0", "output_token_logprobs": [[-0.5, 7, None]],
            "input_token_logprobs": [[None, t, None] for t in ids]}}

    async def json_of(obj) -> Response:
        return Response(dumps(obj), media_type="application/json")

    async def server_info(_: Request) -> Response:
        return await json_of({"version": "0.5.23", "skip_tokenizer_init": True})

    async def model_info(_: Request) -> Response:
        return await json_of({"model_path": "toy", "weight_version": "0"})

    async def health(_: Request) -> Response:
        return Response(b"")

    async def requests(_: Request) -> Response:
        return await json_of(seen)

    return Starlette(routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/server_info", server_info), Route("/model_info", model_info),
        Route("/health", health), Route("/requests", requests)])


def reference_app(seed: int):
    from reference_engine.server import EngineSettings, create_app

    return create_app(EngineSettings(seed=seed, weight_version="0"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("kind", choices=["reference", "sglang-errors"])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--keep-alive", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    import uvicorn

    app = reference_app(args.seed) if args.kind == "reference" else sglang_errors_app()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning",
                timeout_keep_alive=args.keep_alive)


class UvicornEngine:
    """One of the engines above as a subprocess on a free port (a context manager)."""

    def __init__(self, kind: str, *, keep_alive: float = 5.0, seed: int = 1) -> None:
        self.port = free_port()
        self.args = [sys.executable, str(Path(__file__).resolve()), kind, "--port",
                     str(self.port), "--keep-alive", str(keep_alive), "--seed", str(seed)]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> UvicornEngine:
        env = dict(os.environ)
        root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(self.args, env=env)
        why = wait_healthy(self.proc, self.url + "/health", 60)
        if why is not None:
            self.__exit__()
            raise RuntimeError(f"engine {why}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def established(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (the server's side)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "01":
                n += 1
    return n


def wait_closed(port: int, *, at_most: int = 0, timeout: float = 30.0) -> None:
    """Wait until the server on ``port`` holds at most ``at_most`` established connections
    (it closed the others: an event, polled every 20 ms, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while established(port) > at_most:
        if time.monotonic() > deadline:
            raise AssertionError(f"the server on port {port} still holds "
                                 f"{established(port)} connections after {timeout:g}s")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
