"""Gateway memory with many rollouts in flight: RSS before, at the peak of each wave, after.

One command: ``python bench/bench_memory.py [--in-flight 1000 --hold 8 --waves 3]``

A replay engine process holds every /generate for ``--hold`` seconds, so ``--in-flight``
concurrent /generate requests through the gateway (``rollout-gateway serve``, engines read
streamed, the default; admission control on with a bound the run cannot reach) are all in
flight at once. The gateway's resident memory (VmRSS from /proc) is sampled throughout.
Output 256 tokens + prompt 64 with routed experts 48x8 per rollout; each stamped
trajectory is also published to the embedded store, which keeps it (nobody consumes them
here), so the store's retained bytes are reported beside RSS.

Bounded means nothing accumulates per finished rollout: RSS after a wave, once the
gateway is idle again (``--settle`` seconds, longer than its ``heap_trim_s``), grows from
wave 1 to the last by no more than the trajectories the store retained meanwhile (the
goal). The peaks are reported but not compared: how many answers sit in the gateway at
the top of a wave depends on how the client, gateway and engine processes happen to share
the cores, so peak-to-peak differences swing by +-80 MiB between waves of one run. The
figure per rollout is wave 1's peak rise over the rollouts in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))  # doubles.trajectories
sys.path.insert(0, str(HERE))

from bench_gateway import _free_port, _stop, _wait_http, gateway_env  # noqa: E402


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class Sampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0.0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return
            time.sleep(0.05)


async def wave(url: str, body: dict, n: int) -> tuple[int, int, float]:
    """n concurrent POSTs; aiohttp (httpx's pool needs ~50 s of client CPU for 1000 at once
    here, which would measure the client, not the gateway)."""
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one() -> bool:
            data = orjson.dumps(dict(body, rid=uuid.uuid4().hex))
            async with session.post(url, data=data,
                                    headers={"content-type": "application/json"}) as r:
                await r.read()
                return r.status == 200
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        secs = time.perf_counter() - t0
    ok = sum(1 for g in got if g is True)
    return ok, n - ok, secs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--in-flight", type=int, default=1000)
    ap.add_argument("--hold", type=float, default=8.0, help="seconds the engine holds each")
    ap.add_argument("--waves", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out", type=int, default=256)
    ap.add_argument("--redis", default="",
                    help="the gateway publishes here (a unique key prefix, deleted after), so "
                         "its RSS is request state, not retained trajectories; '' = the "
                         "embedded store (then RSS also holds every published trajectory)")
    ap.add_argument("--settle", type=float, default=7.0,
                    help="seconds after a wave before RSS is read as 'after' (the gateway "
                         "gives freed heap back every heap_trim_s = 5 s by default)")
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args(argv)
    prefix = f"benchmem-{uuid.uuid4().hex[:8]}"
    store = f"{args.redis}?prefix={prefix}" if args.redis else "memory://"
    from _report import Report

    env = gateway_env()
    body = {"input_ids": list(range(1, args.prompt + 1)),
            "sampling_params": {"max_new_tokens": args.out, "temperature": 1.0},
            "return_logprob": True, "top_logprobs_num": 5, "return_routed_experts": True}
    rep = Report("memory", "Gateway memory with rollouts in flight (bench_memory.py)",
                 in_flight=args.in_flight, hold_s=args.hold, waves=args.waves,
                 prompt=args.prompt, output=args.out, routed_experts="48x8")
    procs: list[subprocess.Popen] = []
    try:
        e_port, g_port = _free_port(), _free_port()
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "replay_engine.py"), "--port", str(e_port),
             "--delay", str(args.hold)], env=env, stdout=subprocess.DEVNULL))
        engine = f"http://127.0.0.1:{e_port}"
        _wait_http(engine + "/health", procs[0])
        gw = subprocess.Popen(
            [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
             "--port", str(g_port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
             "--engine", f"replay={engine}", "--log-level", "warning", "--store", store],
            env=env, stdout=subprocess.DEVNULL)
        procs.append(gw)
        url = f"http://127.0.0.1:{g_port}"
        _wait_http(url + "/health", gw)
        asyncio.run(wave(url + "/generate", body, 8))  # imports, connections, caches
        base = rss_mib(gw.pid)
        print(f"gateway RSS at rest: {base:.0f} MiB; {args.waves} waves of {args.in_flight} "
              f"concurrent /generate held {args.hold:.0f} s by the engine")
        rep.row("gateway resident memory (VmRSS)", "at rest, before the waves", base, "MiB")
        peaks, afters = [], []
        for i in range(args.waves):
            s = Sampler(gw.pid)
            s.start()
            ok, err, secs = asyncio.run(wave(url + "/generate", body, args.in_flight))
            s.stop.set()
            s.join()
            time.sleep(args.settle)
            after = rss_mib(gw.pid)
            peaks.append(s.peak)
            afters.append(after)
            print(f"  wave {i + 1}: {ok} ok, {err} failed in {secs:.1f} s (hold {args.hold:.0f} s:"
                  f" {'all in flight at once' if secs < 2 * args.hold else 'queued'}); "
                  f"peak {s.peak:.0f} MiB, after {after:.0f} MiB ({args.settle:g} s later)")
            rep.row("gateway resident memory (VmRSS)", f"wave {i + 1}: peak", s.peak, "MiB",
                    ratio=s.peak / base, ratio_to="at rest")
            rep.row("gateway resident memory (VmRSS)", f"wave {i + 1}: after (settled)", after,
                    "MiB",
                    ratio=after / base, ratio_to="at rest")
            rep.row("wave", f"wave {i + 1}: seconds for {args.in_flight} requests", secs, "s",
                    ratio=secs / args.hold, ratio_to="engine hold (1 = all in flight at once)")
            rep.row("wave", f"wave {i + 1}: requests failed", err, "requests")
        per = (peaks[0] - base) * 1024 / args.in_flight
        growth = afters[-1] - afters[0]
        print(f"peak rise per rollout in flight: {per:.0f} KiB; after the last wave - after "
              f"the first: {growth:+.0f} MiB (peaks: {peaks[-1] - peaks[0]:+.0f} MiB)")
        rep.row("per rollout", "peak rise per rollout in flight (wave 1)", per, "KiB")
        rep.row("per rollout", "last wave's peak minus the first's (not compared: timing)",
                peaks[-1] - peaks[0], "MiB")
        rep.row("per rollout", "RSS after the last wave minus after the first", growth, "MiB")
        from rollout_gateway.core import trajectory_codec
        from doubles.trajectories import make_trajectory

        stored = 0.0 if args.redis else len(trajectory_codec.encode(make_trajectory(
            "m", num_tokens=args.out, prompt_len=args.prompt, num_layers=48, top_k=8,
            num_experts=128))) * args.in_flight * (args.waves - 1) / 2**20
        rep.row("per rollout", "trajectories the embedded store retained meanwhile", stored,
                "MiB")
        print(f"beyond the {stored:.0f} MiB of trajectories the store retained meanwhile: "
              f"{growth - stored:+.0f} MiB")
        rep.goal(f"gateway RSS growth after wave 1 -> after wave {args.waves} beyond retained "
                 f"trajectories ({args.in_flight} in flight)", growth - stored,
                 0.1 * peaks[0], "<=", unit="MiB")
        rep.note(f"Store: {'Redis Streams (out of the gateway process)' if args.redis else 'embedded (RSS includes every published trajectory: nobody consumes them here)'}.")
    finally:
        _stop(procs)
        if args.redis:
            import redis

            r = redis.Redis.from_url(args.redis)
            keys = list(r.scan_iter(f"{prefix}:*"))
            if keys:
                r.delete(*keys)
            r.close()
    rep.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
