"""Profile the gateway end to end with py-spy (bench_gateway part B's setup, one target).

    python bench/profile_gateway.py [--seconds 15 --streamed true --top 30 --body topk]
    python bench/profile_gateway.py --prompt 32 --new-tokens 32   # per-request costs
    python bench/profile_gateway.py --profiler cprofile   # the gateway's own CPU only

Starts a replay engine and ``rollout-gateway serve`` under ``py-spy record`` (as its
child: attaching to a running process needs ptrace rights containers rarely grant), drives
the closed-loop /generate load, stops the gateway, and prints where its samples went: by
function (self and inclusive) and by area (HTTP server, engine client, decode, stamping,
publishing, JSON answer, event loop). ``--out`` keeps the raw collapsed stacks
(flamegraph.pl / speedscope can draw them).

py-spy counts a thread preempted in a system call as running: on this 2-core machine a
socket write that wakes the engine or the client shows as the writer's time (the request's
one write to the engine: 32 us of the gateway's CPU, 530 us of wall time, measured with
``time.thread_time``). ``--profiler cprofile`` profiles the event loop's thread on its own
CPU clock instead (deterministic, so with its per-call overhead: read the shares, not the
speed); C functions are charged to the area of the Python code calling them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_gateway import _free_port, _load, _stop, _wait_http, gateway_env  # noqa: E402

#: area -> substrings of a frame "function (file:line)"; the first match from the leaf wins
AREAS = [
    ("decode (engines/decode*)", ("engines/decode",)),
    ("engine client / SSE (engines/client, rawhttp)", ("engines/client", "engines/rawhttp",
                                                       "engines/rawconn")),
    ("stamping + trajectory (core/)", ("core/stamping", "core/trajectory", "core/segments")),
    ("store publish (core/wire, store/)", ("core/wire", "store/", "rollout_proto/codec")),
    ("answer JSON (api/generate, api/errors, orjson)", ("api/generate", "api/errors",
                                                        "api/serialize", "orjson")),
    ("rollout orchestration (rollouts/)", ("rollouts/",)),
    ("API middleware, models, metrics (api/, pydantic, prometheus_client)",
     ("rollout_gateway/api/", "pydantic", "prometheus_client")),
    ("HTTP server (uvicorn, starlette, fastapi, h11)", ("uvicorn", "starlette", "fastapi",
                                                        "h11", "anyio")),
    ("event loop / asyncio", ("asyncio", "selectors")),
]


def area(stack: list[str]) -> str:
    for frame in reversed(stack):
        for name, keys in AREAS:
            if any(k in frame for k in keys):
                return name
    return "other"


def summarize(raw: str, top: int) -> str:
    selfc: collections.Counter = collections.Counter()
    incl: collections.Counter = collections.Counter()
    areas: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack_s, _, n = line.rpartition(" ")
        if not stack_s:
            continue
        n = int(n)
        stack = stack_s.split(";")
        if stack[-1].startswith(("select (", "EpollSelector.select", "Condition.wait")):
            continue  # waiting, not CPU
        if any("_find_and_load" in f or "settings_from_args" in f for f in stack):
            continue  # start-up (imports), not the request path
        total += n
        selfc[stack[-1]] += n
        for f in set(stack):
            incl[f] += n
        areas[area(stack)] += n
    if not total:
        return "no samples"
    out = [f"{total} CPU samples (waits and start-up imports excluded)", "",
           "by area (leaf-most match):"]
    out += [f"  {100 * c / total:5.1f}%  {a}" for a, c in areas.most_common()]
    out += ["", f"top {top} functions by self time:"]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in selfc.most_common(top)]
    out += ["", f"top {top} functions by inclusive time:"]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in incl.most_common(top)]
    return "\n".join(out)


def summarize_cprofile(path: str, top: int) -> str:
    """Areas and top functions by own CPU time from ``_cpu_profile``'s stats; a C
    function's time goes to the areas of its Python callers (split as the calls were)."""
    import pstats

    stats = pstats.Stats(path).stats  # type: ignore[attr-defined]
    areas: collections.Counter = collections.Counter()
    selfc: collections.Counter = collections.Counter()

    def name(func: tuple) -> str:
        file, line, fn = func
        return fn if file == "~" else f"{fn} ({file.split('site-packages/')[-1]}:{line})"

    def area_of(func: tuple, depth: int = 0) -> collections.Counter:
        file = func[0]
        if file != "~" or depth > 3:
            return collections.Counter({area([file]): 1.0})
        callers = stats[func][4]
        total = sum(edge[2] for edge in callers.values()) or 1.0
        got: collections.Counter = collections.Counter()
        for caller, edge in callers.items():
            for a, share in area_of(caller, depth + 1).items():
                got[a] += share * edge[2] / total
        return got or collections.Counter({"other": 1.0})

    for func, (_, _, tt, _, _) in stats.items():
        selfc[name(func)] += tt
        for a, share in area_of(func).items():
            areas[a] += tt * share
    total = sum(areas.values()) or 1.0
    out = [f"{total:.2f} s of the event loop thread's CPU (from the gateway's first answer)",
           "",
           "by area (C functions charged to their callers' areas):"]
    out += [f"  {100 * c / total:5.1f}%  {a}" for a, c in areas.most_common()]
    out += ["", f"top {top} functions by own CPU time:"]
    out += [f"  {100 * c / total:5.1f}%  {f}" for f, c in selfc.most_common(top)]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--streamed", default="true", choices=["true", "false"])
    ap.add_argument("--body", default="topk", choices=["topk", "plain", "topk-norouting", "rollouts"],
                    help="/generate bodies, or rollouts: POST /v1/rollouts (default settings)")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=1024,
                    help="output tokens (short outputs show the per-request costs)")
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", help="keep the raw collapsed stacks here")
    ap.add_argument("--summarize", metavar="FILE", help="only summarize a recorded FILE")
    ap.add_argument("--profiler", default="py-spy", choices=["py-spy", "cprofile"],
                    help="cprofile: the event loop thread's own CPU (time.thread_time)")
    args = ap.parse_args(argv)
    if args.summarize:
        print(summarize(Path(args.summarize).read_text(), args.top))
        return 0
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    env = gateway_env(ROLLOUT_GATEWAY_STREAM_FROM_ENGINES=args.streamed)
    body = {"input_ids": list(range(1, args.prompt + 1)),
            "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 1.0},
            "return_logprob": True, "return_routed_experts": True}
    if args.body.startswith("topk"):
        body["top_logprobs_num"] = 5
    if args.body == "topk-norouting":
        del body["return_routed_experts"]
    path = "/generate"
    if args.body == "rollouts":
        path = "/v1/rollouts"
        body = {k: body[k] for k in ("input_ids", "sampling_params", "return_routed_experts")}
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        raw_path = Path(args.out or Path(tmp) / "stacks.txt")
        try:
            e_port, g_port = _free_port(), _free_port()
            procs.append(subprocess.Popen([sys.executable, str(HERE / "replay_engine.py"),
                                           "--port", str(e_port)], env=env,
                                          stdout=subprocess.DEVNULL))
            engine = f"http://127.0.0.1:{e_port}"
            _wait_http(engine + "/health", procs[0])
            serve = ["serve", "--host", "127.0.0.1", "--port", str(g_port), "--grpc-host",
                     "127.0.0.1", "--grpc-port", "0", "--engine", f"replay={engine}",
                     "--log-level", "warning"]
            if args.profiler == "cprofile":
                rec = subprocess.Popen([sys.executable, str(HERE / "_cpu_profile.py"), *serve],
                                       env=dict(env, GATEWAY_CPROFILE=str(raw_path)),
                                       stdout=subprocess.DEVNULL)
            else:
                rec = subprocess.Popen(
                    [spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw_path),
                     "--nonblocking", "--", sys.executable, "-m", "rollout_gateway", *serve],
                    env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            url = f"http://127.0.0.1:{g_port}"
            _wait_http(url + "/health", rec)
            if args.profiler == "cprofile":
                rec.send_signal(signal.SIGUSR2)  # from here on: the request path only
            tps, ok, err = asyncio.run(_load(url + path, body, args.new_tokens, args.concurrency,
                                             args.seconds, rid=path == "/generate"))
            print(f"load: {tps / 1e3:.1f}k tok/s through the gateway ({ok} ok, {err} errors, "
                  f"{args.prompt} + {args.new_tokens} tokens each)")
            if args.profiler == "cprofile":
                rec.send_signal(signal.SIGUSR1)
            else:
                kids = Path(f"/proc/{rec.pid}/task/{rec.pid}/children").read_text().split()
                for k in kids:
                    os.kill(int(k), signal.SIGTERM)
            rec.wait(60)
        finally:
            _stop(procs)
        if args.profiler == "cprofile":
            print(summarize_cprofile(str(raw_path), args.top))
        else:
            print(summarize(raw_path.read_text() if raw_path.exists() else "", args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
