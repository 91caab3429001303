"""Tagged tokens/s from the store through gRPC into learner tensors, vs a raw Redis read.

    .venv/bin/python bench/bench_transport.py [--trajectories 256 --prompt 128 --response 1024
                                               --layers 48 --top-k 8 --batch 32 --cpu 0
                                               --gateway-cpu 1 --message-kb 4096]

One invocation measures, in interleaved rounds after an unmeasured warm-up read per setup
(--warmup), side by side:

* raw:        XRANGE the stream (the exact serialized trajectory bytes) with redis-py
              (hiredis parser when installed) in this process, pinned to --cpu;
* one core:   Redis -> gateway gRPC server (XREADGROUP, staleness filter, framing) ->
              gRPC -> learner client (parse, numpy views) -> collate into packed torch
              tensors (tokens, columns, routed experts [N, L, K] uint8) -> ack, with the
              gateway process AND the learner pinned to --cpu;
* split:      the same with the gateway process pinned to --gateway-cpu (default: another
              core), the learner on --cpu: like with like, since Redis' own server work
              also runs in its own process beside the raw reader;
* by reference: the split setup with the learner reading the bytes from Redis itself
              (``store_url``): gRPC carries only references, credit and acks; the gateway
              leases entries and skips their payloads as Redis sends them.

Tokens counted = output (tagged) tokens; routed experts cover prompt + output rows.
For each: tokens/s (wall clock; noisy on a shared machine) and CPU seconds per million
tokens of the reading process, the gateway process and Redis (from /proc and INFO cpu).
Ratios: wall clock transport/raw, and reader CPU (raw reader cpu-s/Mtok / learner
cpu-s/Mtok: what the consuming core pays per token).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # doubles: synthetic trajectories, the gRPC service alone


def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


async def fill(url: str, prefix: str, args) -> int:
    from rollout_gateway.store.base import StoreConfig
    from rollout_gateway.store.redis_streams import RedisStore
    from doubles.trajectories import make_trajectory

    store = RedisStore(url, prefix=prefix, config=StoreConfig(max_backlog=10**6))
    await store.create_group("bench")
    # a few distinct payloads, distinct ids (publishing is not what is measured)
    protos = [make_trajectory("p", prompt_len=args.prompt, num_tokens=args.response,
                              versions=(3, 4), num_layers=args.layers, top_k=args.top_k,
                              num_experts=128, seed=s) for s in range(4)]
    for i in range(args.trajectories):
        t = protos[i % 4]
        t.trajectory_id = f"bench-{i}"
        await store.publish(t)
    await store.close()
    return args.trajectories * args.response


def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def redis_cpu(url: str) -> float:
    import redis

    r = redis.Redis.from_url(url)
    info = r.info("cpu")
    r.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


class CpuMeter:
    """CPU seconds spent by this process, the gateway process and Redis over a block."""

    def __init__(self, url: str, server_pid: int | None):
        self.url, self.pid = url, server_pid

    def _now(self) -> tuple[float, float, float]:
        return (time.process_time(), proc_cpu(self.pid) if self.pid else 0.0,
                redis_cpu(self.url))

    def __enter__(self):
        self.t0 = self._now()
        return self

    def __exit__(self, *exc):
        self.parts = [b - a for a, b in zip(self.t0, self._now())]
        self.used = sum(self.parts)


def raw_read(url: str, prefix: str, batch: int) -> tuple[int, float, int]:
    import redis

    r = redis.Redis.from_url(url)
    key, start, n, nbytes = f"{prefix}:stream", "-", 0, 0
    t0 = time.perf_counter()
    while True:
        rows = r.xrange(key, min=start, count=batch)
        if not rows:
            break
        for eid, fields in rows:
            nbytes += len(fields[b"d"])
        n += len(rows)
        last = rows[-1][0].decode()
        ms, seq = last.split("-")
        start = f"{ms}-{int(seq) + 1}"
    dt = time.perf_counter() - t0
    r.close()
    return n, dt, nbytes


async def transport_read(target: str, args, group: str, store_url: str | None = None,
                         count: int | None = None) -> tuple[int, float, int]:
    import torch

    from learner_client.batch import collate
    from learner_client.client import AsyncTrajectoryClient

    torch.set_num_threads(1)
    n = tokens = 0
    count = count or args.trajectories
    async with AsyncTrajectoryClient(target, group, "bench-learner", learner_version=4,
                                     prefetch=args.prefetch * args.batch, store_url=store_url,
                                     by_reference=True if store_url else None) as c:
        await c.create_group()  # a fresh group re-reads the same retained entries
        t0 = time.perf_counter()
        while n < count:
            got = await c.pull(min(args.batch, count - n), timeout=30)
            if not got:
                raise RuntimeError("transport stalled")
            b = collate(got, learner_version=4, layout="packed")
            if args.layers:
                assert b.routed_experts is not None and b.routed_experts.dtype == torch.uint8
            tokens += int(b.response_lens.sum())
            await c.ack(got)
            n += len(got)
        dt = time.perf_counter() - t0
    return n, dt, tokens


def start_server(args, prefix: str, cpu: int, tmp: str, name: str) -> tuple[subprocess.Popen, str]:
    port_file = Path(tmp) / f"port-{name}"
    server = subprocess.Popen(
        ["taskset", "-c", str(cpu), sys.executable, "-m",
         "doubles.grpc_server", "--store",
         f"{args.redis}?prefix={prefix}&max_backlog=1000000", "--port", "0",
         "--port-file", str(port_file), "--grace", "1", "--message-kb", str(args.message_kb)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])},
        stderr=subprocess.DEVNULL)
    while not port_file.exists():
        if server.poll() is not None:
            raise RuntimeError("gRPC server failed to start")
        time.sleep(0.05)
    return server, f"127.0.0.1:{port_file.read_text()}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--response", type=int, default=1024)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prefetch", type=int, default=2,
                   help="batches of credit the learner keeps in flight beyond the current one")
    p.add_argument("--rounds", type=int, default=3,
                   help="interleaved raw/transport rounds; the medians are reported")
    p.add_argument("--warmup", type=int, default=96,
                   help="trajectories each setup reads once, unmeasured, before the rounds")
    p.add_argument("--message-kb", type=int, default=4096,
                   help="soft size of one gRPC Pull response message (KiB)")
    p.add_argument("--cpu", type=int, default=0,
                   help="core of the reader: raw redis-py reader and the learner")
    p.add_argument("--gateway-cpu", type=int, default=None,
                   help="core of the gateway in the split setup (default: another core; "
                        "-1 skips the split setup)")
    p.add_argument("--json", help="write the results here (bench/run_all)")
    args = p.parse_args()
    if args.gateway_cpu is None:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        others = [c for c in cores if c != args.cpu]
        args.gateway_cpu = others[0] if others else -1
    pin(args.cpu)
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    import redis
    import torch  # noqa: F401 - imported before any measured round

    import learner_client.batch  # noqa: F401
    import learner_client.client  # noqa: F401

    setups = {"one core": args.cpu}
    if args.gateway_cpu >= 0:
        setups["split"] = args.gateway_cpu
    setups["by reference"] = args.gateway_cpu if args.gateway_cpu >= 0 else args.cpu
    raw, raw_bytes = [], []
    tr: dict[str, list] = {k: [] for k in setups}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        asyncio.run(fill(args.redis, prefix, args))
        with tempfile.TemporaryDirectory() as tmp:
            try:
                for name, cpu in setups.items():
                    servers[name] = start_server(args, prefix, cpu, tmp, name.replace(" ", "-"))
                # warm-up, not measured: every setup's first round in this process (a
                # long-running learner's steady state: warm connections, allocator, pools)
                raw_read(args.redis, prefix, args.batch)
                for name, (server, target) in servers.items():
                    asyncio.run(transport_read(
                        target, args, f"bench-{name.replace(' ', '-')}-warm",
                        args.redis if name == "by reference" else None,
                        count=min(args.warmup, args.trajectories)))
                for i in range(args.rounds):
                    with CpuMeter(args.redis, None) as m:
                        n, dt, nbytes = raw_read(args.redis, prefix, args.batch)
                    raw.append((n * args.response, dt, m))
                    raw_bytes.append(nbytes)
                    for name, (server, target) in servers.items():
                        with CpuMeter(args.redis, server.pid) as m:
                            n, dt, tok = asyncio.run(transport_read(
                                target, args, f"bench-{name.replace(' ', '-')}-{i}",
                                args.redis if name == "by reference" else None))
                        tr[name].append((tok, dt, m))
            finally:
                for server, _ in servers.values():
                    server.terminate()
                    server.wait(timeout=10)
    finally:
        r = redis.Redis.from_url(args.redis)
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
    report(args, raw, raw_bytes, tr, setups)
    return 0


def json_report(args, rows) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import Report

    rep = Report("transport", "Transport: store -> gRPC -> learner tensors (bench_transport.py)",
                 trajectories=args.trajectories, prompt=args.prompt, response=args.response,
                 routed_experts=f"{args.layers}x{args.top_k} uint8", rounds=args.rounds,
                 message_kib=args.message_kb, hiredis=hiredis_on(),
                 warmup=min(args.warmup, args.trajectories))
    raw_tps, raw_cpu = rows[0][1], rows[0][2]
    for label, tps, me, gw, rd in rows:
        first = label == rows[0][0]
        rep.row("output tokens/s (wall clock)", label, tps, "tok/s",
                ratio=None if first else tps / raw_tps, ratio_to=None if first else rows[0][0])
        rep.row("reader CPU-s per million tokens", label, me, "CPU-s/Mtok",
                ratio=None if first else raw_cpu / me,
                ratio_to=None if first else "raw reader cpu / this")
        rep.row("gateway + Redis CPU-s per million tokens", label, gw + rd, "CPU-s/Mtok")
        if not first:
            rep.goal(f"transport tok per learner CPU-s ({label})", 1e6 / me, 2_000_000,
                     unit="tok/CPU-s")
            rep.goal(f"transport / raw Redis read, wall ({label})", tps / raw_tps, 0.5)
            rep.goal(f"transport / raw Redis read, reader CPU ({label})", raw_cpu / me, 0.5)
    rep.write(args.json)


def median(xs):
    return sorted(xs)[len(xs) // 2]


def hiredis_on() -> str:
    from redis.utils import HIREDIS_AVAILABLE

    return "on" if HIREDIS_AVAILABLE else "off"


def report(args, raw, raw_bytes, tr, setups) -> None:
    per = raw_bytes[0] / args.trajectories
    mbps = per / args.response / 1e6
    print(f"payload: {args.trajectories} trajectories x {args.response} output tokens "
          f"(+{args.prompt} prompt), routed experts {args.layers}x{args.top_k} uint8, "
          f"{per / 1e3:.0f} KB/trajectory, {args.message_kb} KiB gRPC messages, "
          f"hiredis {hiredis_on()}; "
          f"median of {args.rounds} interleaved rounds after a "
          f"{min(args.warmup, args.trajectories)}-trajectory warm-up per setup")
    print(f"reader (raw redis-py / learner) on cpu {args.cpu}; gateway: " + ", ".join(
        f"{k} -> cpu {v}" for k, v in setups.items()) + "; Redis where the OS puts it")

    rows = []

    def row(label, runs, ref=None):
        tps = median([tok / dt for tok, dt, _ in runs])
        # CPU seconds per million tokens: reader process, gateway process, Redis server
        me = median([m.parts[0] / tok * 1e6 for tok, _, m in runs])
        gw = median([m.parts[1] / tok * 1e6 for tok, _, m in runs])
        rd = median([m.parts[2] / tok * 1e6 for tok, _, m in runs])
        out = (f"{label:<30}: {tps / 1e6:5.2f} M tok/s ({tps * mbps:5.0f} MB/s)  "
               f"{me:5.3f} {gw:5.3f} {rd:5.3f} cpu-s/Mtok")
        if ref is not None:
            out += f"   ratio {tps / ref[0]:4.2f} wall, {ref[1] / me:4.2f} reader-cpu"
        print(out)
        rows.append((label, tps, me, gw, rd))
        return tps, me

    print(f"{'':<31}  {'wall clock':<27}  reader gateway redis")
    ref = row("raw redis XRANGE", raw)
    for name, runs in tr.items():
        row(f"store->gRPC->tensors {name}" if name != "by reference"
            else "store->tensors by reference", runs, ref)
    print("ratio wall = transport tok/s / raw tok/s; ratio reader-cpu = raw reader cpu-s/Mtok / "
          "learner cpu-s/Mtok (the work each reading core pays; Redis' and the gateway's own "
          "work runs beside it)")
    if args.json:
        json_report(args, rows)


if __name__ == "__main__":
    raise SystemExit(main())
