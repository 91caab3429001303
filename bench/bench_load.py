"""Bounded load test on loopback: 1000 concurrent rollouts against one gateway.

One run, three scenarios side by side, all against the same replay engine
(``bench/replay_engine.py --delay S``: every /generate answers after S seconds, so requests
stay in flight together):

- ``direct``: N concurrent ``/generate`` straight to the engine: the baseline latency.
- ``held``: N concurrent ``/v1/rollouts`` through a gateway whose limits are above N:
  every rollout is held and answered 200. Added latency = gateway - direct, per percentile.
- ``overload``: the same N against a gateway bounded at ``--limit`` pending requests
  (``ROLLOUT_GATEWAY_MAX_PENDING_REQUESTS``): the excess is answered 429 with Retry-After
  at once (the body is not read); each client waits Retry-After (with jitter) and retries,
  at most ``--attempts`` times. Nothing may fail otherwise.

Per scenario: rollouts finished, 429 answers, errors (5xx, transport), p50/p99 latency of
the successful attempt, and the gateway's resident memory (before, peak while loaded).
Every loop is bounded in count and time; all traffic stays on 127.0.0.1.

Run: ``python bench/bench_load.py`` (defaults: 1000 concurrent, 500 ms engine, limit 200).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_gateway import _free_port, _stop, _wait_http, gateway_env  # noqa: E402


def _rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


async def _sample_rss(pid: int, out: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        out.append(_rss_mb(pid))
        try:
            await asyncio.wait_for(stop.wait(), 0.05)
        except asyncio.TimeoutError:
            pass


class _Conn:
    """A minimal HTTP/1.1 keep-alive client (Content-Length bodies): a thousand of these
    cost the load generator far less than a pooled client, so latencies are the servers'."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n" % (path.encode(), self.host.encode(),
                                                         len(body)) + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            headers[k.strip().lower()] = v.strip()
        data = await self.reader.readexactly(int(headers.get(b"content-length", b"0")))
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return status, headers, data

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _scenario(url: str, body: dict, n: int, attempts: int, pid: int | None,
                    deadline_s: float) -> dict:
    import orjson

    u = httpx.URL(url)
    payload = orjson.dumps(body)
    lat: list[float] = []
    counts = {"ok": 0, "429": 0, "errors": 0, "gave_up": 0}
    errors: dict[str, int] = {}
    rss: list[float] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_rss(pid, rss, stop)) if pid else None
    before = _rss_mb(pid) if pid else float("nan")
    end_by = time.monotonic() + deadline_s
    gate = asyncio.Event()  # every client starts together

    async def one() -> None:
        conn = _Conn(u.host, u.port)
        try:
            await gate.wait()
            for _ in range(attempts):
                if time.monotonic() > end_by:
                    break
                t0 = time.perf_counter()
                try:
                    status, headers, _ = await conn.post(u.path, payload)
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    counts["errors"] += 1
                    errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                    return
                if status == 200:
                    lat.append(time.perf_counter() - t0)
                    counts["ok"] += 1
                    return
                if status == 429:
                    counts["429"] += 1
                    wait = float(headers.get(b"retry-after", b"1"))
                    await asyncio.sleep(wait * random.uniform(0.5, 1.5))
                    continue
                counts["errors"] += 1
                errors[str(status)] = errors.get(str(status), 0) + 1
                return
            counts["gave_up"] += 1
        finally:
            conn.close()

    tasks = [asyncio.create_task(one()) for _ in range(n)]
    await asyncio.sleep(0.1)
    t0 = time.perf_counter()
    gate.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    stop.set()
    if sampler:
        await sampler
    a = np.array(lat) * 1000 if lat else np.array([np.nan])
    return {**counts, "errors_by_kind": errors, "wall_s": wall,
            "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "rss_before_mb": before, "rss_peak_mb": max(rss) if rss else float("nan")}


def _gateway(engine: str, env: dict[str, str], extra: dict[str, str]
             ) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
         "--port", str(port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
         "--engine", f"replay={engine}", "--log-level", "warning"],
        env=dict(env, **extra), stdout=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=1000)
    ap.add_argument("--delay-ms", type=float, default=500.0, help="engine time per request")
    ap.add_argument("--limit", type=int, default=200, help="pending-request bound (overload)")
    ap.add_argument("--attempts", type=int, default=60, help="tries per client (429 retries)")
    ap.add_argument("--out", type=int, default=32, help="max_new_tokens")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds per scenario")
    args = ap.parse_args(argv)
    n = args.concurrency
    env = gateway_env()
    body = {"input_ids": list(range(1, 17)), "publish": False,
            "sampling_params": {"max_new_tokens": args.out}}
    direct_body = {"input_ids": body["input_ids"], "sampling_params": body["sampling_params"],
                   "return_logprob": True, "return_routed_experts": True, "stream": True}
    procs: list[subprocess.Popen] = []
    results: dict[str, dict] = {}
    try:
        e_port = _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "replay_engine.py"), "--port", str(e_port),
             "--layers", "4", "--top-k", "2", "--experts", "8",
             "--delay", str(args.delay_ms / 1000)], env=env, stdout=subprocess.DEVNULL))
        engine = f"http://127.0.0.1:{e_port}"
        _wait_http(engine + "/health", procs[0])
        results["direct"] = asyncio.run(_scenario(engine + "/generate", direct_body, n, 1,
                                                  None, args.deadline))
        for name, extra in (("held", {"ROLLOUT_GATEWAY_MAX_PENDING_REQUESTS": str(2 * n)}),
                            ("overload", {"ROLLOUT_GATEWAY_MAX_PENDING_REQUESTS":
                                          str(args.limit)})):
            gw, url = _gateway(engine, env, extra)
            procs.append(gw)
            _wait_http(url + "/health", gw)
            for _ in range(3):  # warm the engine connections
                httpx.post(url + "/v1/rollouts", json=body, timeout=60)
            attempts = 1 if name == "held" else args.attempts
            results[name] = asyncio.run(_scenario(url + "/v1/rollouts", body, n, attempts,
                                                  gw.pid, args.deadline))
            _stop([gw])
            procs.remove(gw)
    finally:
        _stop(procs)
    print(f"{n} concurrent rollouts, engine {args.delay_ms:g} ms/request, "
          f"{args.out} new tokens, overload limit {args.limit}")
    print(f"{'scenario':10} {'ok':>5} {'429s':>6} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'wall s':>7} {'RSS before':>10} {'RSS peak':>9}")
    for name, r in results.items():
        print(f"{name:10} {r['ok']:5d} {r['429']:6d} {r['errors']:6d} {r['p50_ms']:8.0f} "
              f"{r['p99_ms']:8.0f} {r['wall_s']:7.1f} {r['rss_before_mb']:9.0f}M "
              f"{r['rss_peak_mb']:8.0f}M" + (f"  {r['errors_by_kind']}" if r["errors"] else "")
              + (f"  gave up: {r['gave_up']}" if r["gave_up"] else ""))
    d, h = results["direct"], results["held"]
    print("added latency through the gateway (held - direct): "
          f"p50 {h['p50_ms'] - d['p50_ms']:.0f} ms, p99 {h['p99_ms'] - d['p99_ms']:.0f} ms")
    bad = sum(r["errors"] + r["gave_up"] for r in results.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
