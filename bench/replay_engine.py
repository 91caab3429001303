"""A replay engine: serves recorded-shape SGLang 0.5.23 /generate responses over HTTP.

It costs (almost) nothing per request, so a benchmark against it measures the client's
(the gateway's) cost. Responses have the exact SGLang field shapes: output_ids,
output_token_logprobs ``[[lp, id, null], ...]``, optional output_top_logprobs (top-k rows
consistent with the sampled token), output_token_entropy (the reference engine's
extension, when ``return_entropy``), weight_versions spans, and routed_experts as base64
LE int32 of shape (prompt + output - 1 - start, layers, top_k). Bodies are built once per
(prompt length, output length, options) and cached as bytes around the rid.

Run: ``python bench/replay_engine.py --port 30001 [--layers 48 --top-k 8 --experts 128]``.
A tiny HTTP/1.1 server on asyncio streams (keep-alive; Content-Length bodies, and streams
chunked with one chunk per SSE event, as SGLang's uvicorn sends them) keeps the engine side
cheap; it is a benchmark fixture, not a product server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

VOCAB = 151936
#: the rid's place in a cached body: the JSON text of meta_info.id "\x00RID\x00"
_RID_MARK = b"\\u0000RID\\u0000"


@dataclass
class ReplayConfig:
    layers: int = 48
    top_k: int = 8
    experts: int = 128
    weight_version: str = "0"
    #: tokens per SSE chunk (incremental streaming) when the request does not say
    #: (sampling_params.stream_interval): as if SGLang ran with --stream-interval 64
    stream_interval: int = 64
    seed: int = 0
    delay: float = 0.0  # seconds each /generate is held before its answer (requests in flight)
    cache: dict[tuple, tuple[bytes, bytes]] = field(default_factory=dict)


def _columns(rng: np.random.Generator, t: int, k: int) -> dict[str, Any]:
    """Token ids, sampled logprobs and top-k rows that agree with each other."""
    p_top = rng.uniform(0.3, 0.999, t)
    ids = rng.integers(0, VOCAB, (t, max(k, 1)))
    lp = np.log(p_top)
    out: dict[str, Any] = {"ids": ids[:, 0].tolist(), "lp": lp.tolist(),
                           "entropy": rng.uniform(0.0, 3.0, t).tolist()}
    if k > 0:
        rest = 1.0 - p_top  # spread part of the leftover mass decreasingly over k-1 entries
        share = rng.dirichlet(np.ones(k), t)[:, : k - 1] * 0.8
        share = -np.sort(-share, axis=1)
        top = np.concatenate([p_top[:, None], np.minimum(share * rest[:, None],
                                                         p_top[:, None])], axis=1)
        out["top"] = np.log(top).tolist()
        out["top_ids"] = ids.tolist()
    return out


def build_body(cfg: ReplayConfig, prompt_len: int, t: int, *, logprob: bool, top_k: int,
               entropy: bool, routed: bool, routed_start: int) -> tuple[bytes, bytes]:
    """The response split around the rid: (prefix, suffix)."""
    key = (prompt_len, t, logprob, top_k, entropy, routed, routed_start, cfg.weight_version)
    hit = cfg.cache.get(key)
    if hit is not None:
        return hit
    rng = np.random.default_rng([cfg.seed, prompt_len, t, top_k])
    cols = _columns(rng, t, top_k if logprob else 0)
    meta: dict[str, Any] = {
        "id": "\x00RID\x00", "finish_reason": {"type": "length", "length": t},
        "prompt_tokens": prompt_len, "weight_version": cfg.weight_version,
        "num_retractions": 0}
    if logprob:
        meta["output_token_logprobs"] = [[lp, i, None] for lp, i in zip(cols["lp"], cols["ids"])]
        if top_k > 0:
            meta["output_top_logprobs"] = [
                [[lp, i, None] for lp, i in zip(row, ids)]
                for row, ids in zip(cols["top"], cols["top_ids"])]
    if entropy:
        meta["output_token_entropy"] = cols["entropy"]
    meta.update(reasoning_tokens=0, completion_tokens=t, cached_tokens=0)
    meta["weight_versions"] = [{"version": cfg.weight_version, "start": 0, "end": t}]
    if routed:
        rows = max(prompt_len + t - 1 - routed_start, 0)
        arr = rng.integers(0, cfg.experts, (rows, cfg.layers, cfg.top_k), dtype=np.int32)
        meta["routed_experts"] = base64.b64encode(arr.astype("<i4").tobytes()).decode()
    meta["e2e_latency"] = 0.001
    body = orjson.dumps({"text": "x" * t, "output_ids": cols["ids"], "meta_info": meta})
    pre, post = body.split(_RID_MARK, 1)
    cfg.cache[key] = (pre, post)
    return pre, post


def _sse_chunks(cfg: ReplayConfig, req: dict[str, Any], prompt_len: int,
                t: int) -> list[bytes]:
    """Incremental-streaming SSE, framed for chunked transfer (one HTTP chunk per event, as
    uvicorn sends them): pieces to write one after the other. Events are built once per
    shape (cached) as the bytes before and after their rid; only each event's chunk-size
    line and the rid are per request, so a 2.8 MB stream costs no copy of itself."""
    opts = _opts(req)
    every = int((req.get("sampling_params") or {}).get("stream_interval") or cfg.stream_interval)
    key = ("sse", prompt_len, t, every, *sorted(opts.items()), cfg.weight_version)
    events = cfg.cache.get(key)
    if events is None:
        events = _build_sse(cfg, prompt_len, t, opts, every)
        cfg.cache[key] = events
    rid = orjson.dumps(str(req.get("rid") or "replay"))[1:-1]
    out: list[bytes] = []
    for pre, post in events:
        out += (b"%x\r\n" % (len(pre) + len(rid) + len(post)), pre, rid, post, b"\r\n")
    out += (b"%x\r\n" % len(_DONE), _DONE, b"\r\n0\r\n\r\n")
    return out


_DONE = b"data: [DONE]\n\n"


def _chunk_ends(t: int, every: int) -> list[int]:
    """Where SGLang 0.5.23 cuts a stream of t tokens (output_streamer): the first token
    at once, then whenever ``every`` tokens are unsent, the rest in the final chunk."""
    ends = [1] + list(range(1 + every, t, every))
    return ends + [t] if ends[-1] != t else ends


def _build_sse(cfg: ReplayConfig, prompt_len: int, t: int, opts: dict[str, Any],
               every: int) -> list[tuple[bytes, bytes]]:
    """The events of the stream (``data: {...}\\n\\n``; [DONE] is not one of them), each
    split around its rid (meta_info.id)."""
    pre, post = build_body(cfg, prompt_len, t, **opts)
    full = orjson.loads(pre + _RID_MARK + post)
    meta = full["meta_info"]
    rid = meta["id"]
    out: list[tuple[bytes, bytes]] = []
    a = 0
    for b in _chunk_ends(t, every):
        last = b == t
        m = {k: v for k, v in meta.items() if k not in ("routed_experts", "weight_versions")}
        m.update(id=rid, completion_tokens=b, finish_reason=meta["finish_reason"] if last else None)
        for col in ("output_token_logprobs", "output_top_logprobs", "output_token_entropy"):
            if col in meta:
                m[col] = meta[col][a:b]
        if last:
            for col in ("routed_experts", "weight_versions"):
                if col in meta:
                    m[col] = meta[col]
        chunk = {"text": full["text"][a:b], "output_ids": full["output_ids"][a:b], "meta_info": m}
        pre, post = (b"data: " + orjson.dumps(chunk) + b"\n\n").split(_RID_MARK, 1)
        out.append((pre, post))
        a = b
    return out


def _opts(req: dict[str, Any]) -> dict[str, Any]:
    return dict(logprob=bool(req.get("return_logprob")),
                top_k=int(req.get("top_logprobs_num") or 0),
                entropy=bool(req.get("return_entropy")),
                routed=bool(req.get("return_routed_experts")),
                routed_start=int(req.get("routed_experts_start_len") or 0))


def generate(cfg: ReplayConfig, req: dict[str, Any]) -> tuple[bytes, bytes | list[bytes]]:
    """(content type, body) for one /generate request (one prompt; no batches); a stream's
    body is the pieces of its chunked transfer encoding."""
    sp = req.get("sampling_params") or {}
    t = int(sp.get("max_new_tokens", 128))
    if "input_ids" in req:
        prompt_len = len(req["input_ids"])
    else:
        prompt_len = len(str(req.get("text", "")).encode())
    if prompt_len < 1 or t < 1:
        raise ValueError("need a non-empty prompt and max_new_tokens >= 1")
    if req.get("stream"):
        return b"text/event-stream", _sse_chunks(cfg, req, prompt_len, t)
    pre, post = build_body(cfg, prompt_len, t, **_opts(req))
    rid = orjson.dumps(str(req.get("rid") or "replay"))[1:-1]
    return b"application/json", pre + rid + post


def _route(cfg: ReplayConfig, method: bytes, path: bytes,
           body: bytes) -> tuple[int, bytes, bytes | list[bytes]]:
    if path == b"/generate" and method == b"POST":
        try:
            ctype, data = generate(cfg, orjson.loads(body))
        except (ValueError, TypeError, orjson.JSONDecodeError) as exc:
            return 400, b"application/json", orjson.dumps({"error": {"message": str(exc)}})
        return 200, ctype, data
    if path == b"/server_info":
        return 200, b"application/json", orjson.dumps(
            {"version": "0.5.23", "incremental_streaming_output": True,
             "enable_return_routed_experts": True})
    if path in (b"/model_info", b"/get_model_info"):
        return 200, b"application/json", orjson.dumps({
            "model_path": "replay", "weight_version": cfg.weight_version, "is_generation": True,
            "model_config": {"num_hidden_layers": cfg.layers, "num_experts_per_tok": cfg.top_k,
                             "num_experts": cfg.experts}})
    if path in (b"/health", b"/health_generate", b"/ready"):
        return 200, b"text/plain", b""
    if method == b"POST" and path in (b"/pause_generation", b"/continue_generation",
                                      b"/abort_request", b"/flush_cache"):
        return 200, b"application/json", b"{}"
    return 404, b"application/json", orjson.dumps({"error": {"message": "not found"}})


async def _serve_conn(cfg: ReplayConfig, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path, _ = lines[0].split(b" ", 2)
            length = 0
            close = False
            for ln in lines[1:]:
                k, _, v = ln.partition(b":")
                k = k.strip().lower()
                if k == b"content-length":
                    length = int(v)
                elif k == b"connection" and v.strip().lower() == b"close":
                    close = True
            body = await reader.readexactly(length) if length else b""
            if cfg.delay and path.startswith(b"/generate"):
                await asyncio.sleep(cfg.delay)
            status, ctype, data = _route(cfg, method, path.split(b"?", 1)[0], body)
            if isinstance(data, list):  # a stream, already framed: one chunk per event
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\n"
                             b"transfer-encoding: chunked\r\n\r\n" % (status, ctype))
                writer.writelines(data)
            else:
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n"
                             % (status, ctype, len(data)))
                writer.write(data)
            await writer.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(cfg: ReplayConfig, host: str, port: int) -> None:
    server = await asyncio.start_server(lambda r, w: _serve_conn(cfg, r, w), host, port,
                                        limit=1 << 24, backlog=4096)  # 1000s connect at once
    print(f"replay engine on http://{host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30001)
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--weight-version", default="0")
    ap.add_argument("--delay", type=float, default=0.0,
                    help="hold each /generate this many seconds (many requests in flight)")
    args = ap.parse_args(argv)
    cfg = ReplayConfig(layers=args.layers, top_k=args.top_k, experts=args.experts,
                       weight_version=args.weight_version, delay=args.delay)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        asyncio.run(serve(cfg, args.host, args.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
