"""The gateway's own cost: stamped tokens/s on one core, and gateway vs direct throughput.

One command: ``python bench/bench_gateway.py`` (``--quick`` for a short run,
``--skip-e2e`` for part A only). Prints a table per part; every ratio is measured side
by side in the same run.

A. Hot path, in this process (one core): SGLang-format /generate response bytes (from
   ``bench/replay_engine.py``'s generator: 48 layers x top-8 routed experts over 128
   experts, mixed prompt/output lengths) -> ``engines.decode`` -> ``core.stamping`` ->
   ``Trajectory``. Side by side: the same with the decoder's byte-level fast paths off, a
   straightforward decoder (orjson + stdlib b64decode + numpy on the parsed lists),
   ``orjson.loads`` alone and a memcpy of the same bytes; then
   routed experts alone per wire format. Tokens are output tokens; per CPU-second of this
   thread, best of several interleaved rounds (the machine is shared).
B. End to end: a replay engine process, the gateway (``rollout-gateway serve``) process
   and a closed-loop client with N concurrent requests. Output tokens/s direct to the
   engine vs through the gateway's SGLang-compatible /generate (stamped + published to
   the embedded store; engines read streamed, the default, and non-streamed), the ratio,
   and stamped tokens per gateway CPU-second (from /proc).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from replay_engine import ReplayConfig, build_body  # noqa: E402

from rollout_gateway.core.stamping import Span, normalize_spans, stamp_request  # noqa: E402
from rollout_gateway.core.trajectory import (  # noqa: E402
    EntropyKind,
    FinishReason,
    RoutedExperts,
    TokenColumns,
    Trajectory,
    Transition,
)
from rollout_gateway.engines.decode import (  # noqa: E402
    Decoded,
    DecodeOptions,
    RoutingSpec,
    decode_one,
)
from rollout_gateway.engines.decode_entropy import topk_entropy  # noqa: E402
from rollout_gateway import native  # noqa: E402
from rollout_gateway.engines import decode as decode_mod  # noqa: E402
from rollout_gateway.engines import decode_experts  # noqa: E402
from rollout_gateway.engines.decode_experts import decode_routed_experts  # noqa: E402

LAYERS, TOPK, EXPERTS = 48, 8, 128
#: (prompt tokens, output tokens): RL-style mix of short and long reasoning outputs
MIX = [(128, 256), (256, 1024), (512, 2048), (256, 4096), (1024, 1024), (256, 2048)]


# ------------------------------------------------------------------------- part A
def stamp(d: Decoded, tid: str) -> Trajectory:
    """Stamp one decoded response and build the Trajectory (same for both decoders)."""
    spans = normalize_spans([Span(*s) for s in d.spans], d.num_tokens, d.weight_version)
    st = stamp_request(spans, offset=0, engine_id="e0", began=Transition.START,
                       installed_by={})
    cols = TokenColumns(d.output_ids, d.logprobs, d.entropy, st.policy_version, st.kv_version)
    return Trajectory(trajectory_id=tid, prompt_token_ids=np.zeros(d.prompt_tokens or 0),
                      tokens=cols, finish_reason=FinishReason.from_sglang(d.finish_reason),
                      segments=st.segments, entropy_kind=d.entropy_kind,
                      entropy_error_bound=d.entropy_error_bound, routed_experts=d.routed)


def naive_decode(body: bytes, opts: DecodeOptions) -> Decoded:
    """The straightforward decoder producing the same columns: parse everything with
    orjson, convert the parsed lists with numpy, b64decode the routing."""
    obj = orjson.loads(body)
    m = obj["meta_info"]
    ids = np.array(obj["output_ids"], dtype=np.int32)
    rows = m["output_token_logprobs"]
    lp = np.array([-np.inf if r[0] is None else r[0] for r in rows], dtype=np.float32)
    assert np.array_equal(np.array([r[1] for r in rows], dtype=np.int32), ids)
    err, bound = None, 0.0
    if m.get("output_token_entropy") is not None:
        ent, kind = np.array(m["output_token_entropy"], dtype=np.float32), EntropyKind.EXACT
    else:
        top = np.array([[e[0] for e in row] for row in m["output_top_logprobs"]])
        ent, err = topk_entropy(top, opts.vocab_size)
        kind, bound = EntropyKind.TOPK_ESTIMATE, float(err.max())
    routed = None
    if m.get("routed_experts") is not None:
        flat = np.frombuffer(base64.b64decode(m["routed_experts"]), dtype="<i4")
        spec = opts.routing
        routed = RoutedExperts.from_int32(flat, spec.num_layers, spec.top_k, spec.num_experts,
                                          start=opts.routed_experts_start_len)
    wv = m.get("weight_version")
    return Decoded(output_ids=ids, logprobs=lp, entropy=ent, entropy_kind=kind,
                   entropy_error=err, entropy_error_bound=bound, weight_version=int(wv),
                   weight_version_raw=wv,
                   spans=[(int(s["version"]), s["start"], s["end"]) for s in m["weight_versions"]],
                   finish_reason=m["finish_reason"], prompt_tokens=m["prompt_tokens"],
                   completion_tokens=m["completion_tokens"], cached_tokens=m["cached_tokens"],
                   rid=m["id"], index=None, text=obj["text"], input_token_ids=None,
                   routed_experts=None, routed=routed)


def decode_without_fast_paths(body: bytes, opts: DecodeOptions) -> Decoded:
    """engines.decode with its byte-level fast paths off (top-k logprobs parsed as nested
    JSON; routed experts found by a separate scan, then decoded in one piece): the
    decoder as it was before them, for the side-by-side column."""
    saved = decode_mod.splice_top, decode_experts._PY_CHUNK
    decode_mod.splice_top = lambda b, *_: (b, [])
    decode_experts._PY_CHUNK = 1 << 40
    try:
        with native.using("python"):
            return decode_one(body, opts)
    finally:
        decode_mod.splice_top, decode_experts._PY_CHUNK = saved


def _best(fns: list, bodies: list[bytes], rounds: int) -> list[float]:
    """Best CPU time (this thread) over rounds for each fn, interleaved round-robin, so a
    busy shared machine skews every column alike and descheduled time is not counted."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.thread_time()
            for b in bodies:
                fn(b)
            best[i] = min(best[i], time.thread_time() - t0)
    return best


def part_a(rounds: int) -> list[dict[str, Any]]:
    cfg = ReplayConfig(layers=LAYERS, top_k=TOPK, experts=EXPERTS, weight_version="3")
    spec = RoutingSpec(LAYERS, TOPK, EXPERTS)
    scenarios = [
        ("topk5 + routed(prompt+output)", dict(logprob=True, top_k=5, entropy=False,
                                               routed=True), True),
        ("exact entropy + routed(prompt+output)", dict(logprob=True, top_k=0, entropy=True,
                                                       routed=True), True),
        ("exact entropy + routed(output only)", dict(logprob=True, top_k=0, entropy=True,
                                                     routed=True), False),
        ("topk5, no routing", dict(logprob=True, top_k=5, entropy=False, routed=False), True),
    ]
    rows = []
    for name, kw, from_zero in scenarios:
        bodies, tokens, starts = [], 0, []
        for p, t in MIX:
            start = 0 if from_zero else p
            pre, post = build_body(cfg, p, t, routed_start=start, **kw)
            bodies.append(pre + b"rid-" + str(len(bodies)).encode() + post)
            tokens += t
            starts.append(start)
        mb = sum(map(len, bodies)) / 1e6
        opts_list = [DecodeOptions(routing=spec if kw["routed"] else None,
                                   routed_experts_start_len=s, vocab_size=151936)
                     for s in starts]
        it = iter(range(10**9))
        opt_of = dict(zip(map(id, bodies), opts_list))

        def ours(b: bytes) -> None:
            stamp(decode_one(b, opt_of[id(b)]), f"t{next(it)}")

        def python_plane(b: bytes) -> None:
            with native.using("python"):
                stamp(decode_one(b, opt_of[id(b)]), f"t{next(it)}")

        def base(b: bytes) -> None:
            stamp(naive_decode(b, opt_of[id(b)]), f"t{next(it)}")

        def slow(b: bytes) -> None:
            stamp(decode_without_fast_paths(b, opt_of[id(b)]), f"t{next(it)}")

        for b in bodies:  # correctness first: both decoders agree
            x = stamp(decode_one(b, opt_of[id(b)]), "a")
            y = stamp(naive_decode(b, opt_of[id(b)]), "b")
            z = stamp(decode_without_fast_paths(b, opt_of[id(b)]), "c")
            with native.using("python"):
                w = stamp(decode_one(b, opt_of[id(b)]), "d")
            for col in ("token_ids", "logprobs", "entropy"):  # fast paths: bit-identical
                assert getattr(x.tokens, col).tobytes() == getattr(z.tokens, col).tobytes()
                assert getattr(x.tokens, col).tobytes() == getattr(w.tokens, col).tobytes()
            assert (x.routed_experts is None
                    or x.routed_experts.data.tobytes() == z.routed_experts.data.tobytes())
            assert np.array_equal(x.tokens.token_ids, y.tokens.token_ids)
            assert np.array_equal(x.tokens.logprobs, y.tokens.logprobs)
            assert np.allclose(x.tokens.entropy, y.tokens.entropy)
            assert (x.routed_experts is None) == (y.routed_experts is None)
            if x.routed_experts is not None:
                assert np.array_equal(x.routed_experts.data, y.routed_experts.data)
        t_ours, t_py, t_slow, t_naive, t_parse, t_copy = _best(
            [ours, python_plane, slow, base, orjson.loads, lambda b: bytes(bytearray(b))],
            bodies, rounds)
        rows.append({"scenario": name, "MB": mb, "tokens": tokens, "plane": native.data_plane(),
                     "ours_tok_s": tokens / t_ours, "python_tok_s": tokens / t_py,
                     "slow_tok_s": tokens / t_slow,
                     "naive_tok_s": tokens / t_naive,
                     "parse_tok_s": tokens / t_parse, "memcpy_tok_s": tokens / t_copy})
    return rows


def part_a_wire(rounds: int) -> list[tuple[str, float, float]]:
    """Routed experts alone, per wire format, over the MIX (prompt+output rows): what the
    bytes SGLang sends cost us, and what narrower formats an engine could send would cost."""
    rng = np.random.default_rng(1)
    arrays = [rng.integers(0, EXPERTS, (p + t - 1, LAYERS, TOPK)).astype("<i4") for p, t in MIX]
    tokens = sum(t for _, t in MIX)
    b64_i32 = [base64.b64encode(a.tobytes()) for a in arrays]
    b64_u8 = [base64.b64encode(a.astype(np.uint8).tobytes()) for a in arrays]
    raw_u8 = [a.astype(np.uint8).tobytes() for a in arrays]

    def ours(b: bytes) -> None:
        decode_routed_experts(b, 0, len(b), num_experts=EXPERTS)

    def ours_numpy(b: bytes) -> None:
        decode_experts.USE_PYBASE64 = False
        try:
            decode_routed_experts(b, 0, len(b), num_experts=EXPERTS)
        finally:
            decode_experts.USE_PYBASE64 = decode_experts.pybase64 is not None

    def native_c(b: bytes) -> None:
        assert native.compiled().experts(b, 0, len(b), EXPERTS)[0] is not None

    def binascii_i32(b: bytes) -> None:
        flat = np.frombuffer(binascii.a2b_base64(b), "<i4")
        assert flat.min() >= 0 and flat.max() < EXPERTS
        flat.astype(np.uint8)

    def b64_uint8(b: bytes) -> None:
        raw = (decode_experts.pybase64.b64decode(b, validate=True) if decode_experts.pybase64
               else binascii.a2b_base64(b))
        assert np.frombuffer(raw, np.uint8).max() < EXPERTS

    def raw_uint8(b: bytes) -> None:
        assert np.frombuffer(b, np.uint8).max() < EXPERTS

    out = []
    for name, fn, data in [
            ("int32 base64 (SGLang): engines.decode (pybase64)", ours, b64_i32),
            ("int32 base64 (SGLang): numpy fallback path", ours_numpy, b64_i32),
            *([("int32 base64 (SGLang): native C (used without pybase64)", native_c, b64_i32)]
              if native.built() else []),
            ("int32 base64 (SGLang): stdlib binascii+astype", binascii_i32, b64_i32),
            ("uint8 base64 (if an engine sent it)", b64_uint8, b64_u8),
            ("uint8 raw bytes (binary side channel)", raw_uint8, raw_u8)]:
        (t,) = _best([fn], data, rounds)
        out.append((name, sum(map(len, data)) / 1e6, tokens / t))
    return out


def print_a_wire(rows: list[tuple[str, float, float]], rep=None) -> None:
    if rep is not None:
        for name, _mb, tps in rows:
            rep.row("A. routed experts alone, output tok per CPU-s", name, tps, "tok/CPU-s",
                    ratio=tps / rows[0][2], ratio_to=rows[0][0])
    print("\n   routed experts alone (prompt+output rows, validated, uint8 out), output tokens per "
          "CPU-second:")
    for name, mb, tps in rows:
        print(f"   {name:52s} {mb:6.1f} MB {tps / 1e6:9.2f}M")


def print_a(rows: list[dict[str, Any]], rep=None) -> None:
    if rep is not None:
        for r in rows:
            sec = "A. hot path on one core (decode + stamp + Trajectory), stamped tok per CPU-s"
            rep.row(sec, f"{r['scenario']}: engines.decode ({r['plane']} data plane)",
                    r["ours_tok_s"], "tok/CPU-s")
            rep.row(sec, f"{r['scenario']}: engines.decode (python data plane)",
                    r["python_tok_s"], "tok/CPU-s", ratio=r["ours_tok_s"] / r["python_tok_s"],
                    ratio_to=f"{r['plane']} / python")
            rep.row(sec, f"{r['scenario']}: straightforward decoder", r["naive_tok_s"],
                    "tok/CPU-s", ratio=r["ours_tok_s"] / r["naive_tok_s"],
                    ratio_to="engines.decode / this")
            if "top" in r["scenario"]:
                rep.goal(f"hot path, {r['scenario']}", r["ours_tok_s"], 1_000_000,
                         unit="tok/CPU-s")
    print("\nA. hot path on one core: decode + stamp + Trajectory, output tokens per CPU-second "
          f"(mix {MIX}, {LAYERS} layers x top-{TOPK})")
    print(f"{'scenario':40s} {'MB':>6s} {'ours':>10s} {'python':>10s} {'x':>6s} "
          f"{'no fast':>10s} {'x':>6s} "
          f"{'naive':>10s} {'x naive':>8s} {'parse':>10s} {'memcpy':>10s}")
    for r in rows:
        print(f"{r['scenario']:40s} {r['MB']:6.1f} {r['ours_tok_s'] / 1e6:9.2f}M "
              f"{r['python_tok_s'] / 1e6:9.2f}M {r['ours_tok_s'] / r['python_tok_s']:5.2f}x "
              f"{r['slow_tok_s'] / 1e6:9.2f}M {r['ours_tok_s'] / r['slow_tok_s']:5.2f}x "
              f"{r['naive_tok_s'] / 1e6:9.2f}M {r['ours_tok_s'] / r['naive_tok_s']:7.2f}x "
              f"{r['parse_tok_s'] / 1e6:9.2f}M {r['memcpy_tok_s'] / 1e6:9.2f}M")
    print(f"  ours = engines.decode on the {rows[0]['plane'] if rows else '?'} data plane; "
          "python = the same on the pure-Python data plane (ROLLOUT_GATEWAY_DATA_PLANE=python; "
          "results bit-identical)")
    print("  ours/naive = engines.decode / a straightforward decoder (orjson + numpy on parsed "
          "lists + b64decode), each + core.stamping + Trajectory; no fast = engines.decode with "
          "its byte-level fast paths off (top-k cut + flat parse, routed experts decoded in "
          "cache-sized chunks while finding the string's end; results bit-identical); "
          "parse = orjson.loads alone; memcpy = copying the bytes once")


# ------------------------------------------------------------------------- part B
def gateway_env(**extra: str) -> dict[str, str]:
    """The environment of a gateway (or engine) process a benchmark starts: one OpenMP
    thread, this checkout on the path, and, since nobody consumes the store in a benchmark,
    admission control (on, as in production) with a staleness bound the run cannot reach:
    its checks still run on every request, its 429s never come."""
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent),
                ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE="10000000", **extra)


def _free_port() -> int:
    """A free port outside the ephemeral range (an OS-chosen one can be taken by an
    outgoing connection before the server binds it)."""
    from rollout_gateway.commands.engine_process import free_port

    return free_port()


def _wait_http(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_JSON = {"content-type": "application/json"}


async def _load(url: str, body: dict[str, Any], tokens_per_req: int, concurrency: int,
                duration: float, rid: bool = True,
                stats: dict[str, float] | None = None) -> tuple[float, int, int]:
    """Closed loop: ``concurrency`` workers post for ``duration`` s. (tok/s, ok, errors).
    ``stats``: ``bytes`` (answer bytes received) and ``cpu`` (this process's CPU seconds,
    i.e. the client's) are added to it."""
    import httpx

    ok = err = 0
    nbytes = 0
    cpu0 = time.process_time()
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        stop = time.perf_counter() + duration

        async def worker() -> None:
            nonlocal ok, err, nbytes
            while time.perf_counter() < stop:
                b = dict(body, rid=f"b{uuid.uuid4().hex[:12]}") if rid else body
                try:
                    r = await client.post(url, content=orjson.dumps(b), headers=_JSON)
                except httpx.HTTPError as exc:
                    err += 1
                    if err <= 3:
                        print(f"  ! {url}: {type(exc).__name__}: {exc}")
                    continue
                if r.status_code == 200 and r.content:
                    ok += 1
                    nbytes += len(r.content)
                else:
                    err += 1
                    if err <= 3:
                        print(f"  ! {url}: HTTP {r.status_code}: {r.text[:200]}")

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t0
    if stats is not None:
        stats["bytes"] = stats.get("bytes", 0.0) + nbytes
        stats["cpu"] = stats.get("cpu", 0.0) + time.process_time() - cpu0
    return ok * tokens_per_req / elapsed, ok, err


def start_replay_engine(procs: list[subprocess.Popen], env: dict[str, str]) -> str:
    """Start the replay engine (48x8 routing over 128 experts) on a free port, appended to
    ``procs``; returns its URL once it answers /health."""
    port = _free_port()
    procs.append(subprocess.Popen(
        [sys.executable, str(HERE / "replay_engine.py"), "--port", str(port),
         "--layers", str(LAYERS), "--top-k", str(TOPK), "--experts", str(EXPERTS)],
        env=env, stdout=subprocess.DEVNULL))
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/health", procs[-1])
    return url


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def _floor_speeds() -> dict[str, float]:
    """This machine's memory speed (bytes/s, copying 64 MiB once, best of 5) and base64
    decode speed (text bytes/s, pybase64 if installed, best of 5): the physical floor."""
    import binascii

    buf = bytearray(os.urandom(1 << 20) * 64)
    text = binascii.b2a_base64(bytes(buf[: 3 << 20]), newline=False)
    b64 = decode_experts.pybase64.b64decode if decode_experts.pybase64 else binascii.a2b_base64

    def best(fn, n: int) -> float:
        t = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
        return n / min(t)

    dst = bytearray(len(buf))  # copy into memory already touched: no page faults
    view = memoryview(dst)
    return {"memcpy": best(lambda: view.__setitem__(slice(None), buf), len(buf)),
            "b64decode": best(lambda: b64(text), len(text))}


def floor_us(answer_bytes: float, routed_bytes: float, speeds: dict[str, float]) -> float:
    """The physical floor of the gateway's work per token, in microseconds: read the
    engine's answer once, write the answer back once (memory speed), base64-decode the
    routing text (``routed_bytes`` of it per token)."""
    return (2 * answer_bytes / speeds["memcpy"] + routed_bytes / speeds["b64decode"]) * 1e6


def part_b(concurrency: int, duration: float, prompt: int, out: int,
           rounds: int = 3, router: bool = True) -> dict[str, Any]:
    """Direct vs the gateway reading engines streamed (its default) and non-streamed.

    All three targets run at once; the load visits them in turn for ``rounds`` rounds of
    duration/rounds each, so drifting load on a shared machine hits every column alike."""
    env = gateway_env()
    topk = {"input_ids": list(range(1, prompt + 1)),
            "sampling_params": {"max_new_tokens": out, "temperature": 1.0},
            "return_logprob": True, "top_logprobs_num": 5, "return_routed_experts": True}
    plain = {k: v for k, v in topk.items() if k != "top_logprobs_num"}
    # sglang-router 0.3 drops return_routed_experts (its typed request lacks the field), so
    # with routing it forwards ~13x fewer bytes than the others; the third body has no
    # routing for anyone: the like-for-like column for the router
    no_routing = {k: v for k, v in topk.items() if k != "return_routed_experts"}
    bodies = {"top-5 logprobs + routing": topk, "routing, no top-k": plain,
              "top-5 logprobs, no routing": no_routing}
    procs: list[subprocess.Popen] = []
    try:
        engine = start_replay_engine(procs, env)
        targets: dict[str, tuple[str, subprocess.Popen | None]] = {"direct": (engine, None)}
        for name, streamed, fast in (("streamed", True, True), ("non-streamed", False, True),
                                     ("streamed, asyncio+h11", True, False),
                                     ("streamed, python data plane", True, True),
                                     ("streamed, record_routing off", True, True)):
            g_port = _free_port()
            plane = "python" if "python data plane" in name else "auto"
            record = "false" if "record_routing off" in name else "true"
            gw = subprocess.Popen(
                [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
                 "--port", str(g_port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
                 "--engine", f"replay={engine}", "--log-level", "warning"],
                env=dict(env, ROLLOUT_GATEWAY_STREAM_FROM_ENGINES=str(streamed).lower(),
                         ROLLOUT_GATEWAY_FAST_IO=str(fast).lower(),
                         ROLLOUT_GATEWAY_DATA_PLANE=plane,
                         ROLLOUT_GATEWAY_RECORD_ROUTING=record),
                stdout=subprocess.DEVNULL)
            procs.append(gw)
            targets[name] = (f"http://127.0.0.1:{g_port}", gw)
        if router:
            r_port = _free_port()
            rp = subprocess.Popen(
                [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                 "--port", str(r_port), "--worker-urls", engine, "--policy", "round_robin",
                 "--log-level", "error"], env=env, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL)
            procs.append(rp)
            targets["sglang-router"] = (f"http://127.0.0.1:{r_port}", rp)
        for url, proc in targets.values():
            if proc is not None:
                _wait_http(url + "/health", proc)
        warm = min(2.0, duration / 4)
        for url, _ in targets.values():
            asyncio.run(_load(url + "/generate", topk, out, concurrency, warm))
        # record_routing off only changes what a caller who does not ask for routing costs
        keys = [(b, t) for b in bodies for t in targets
                if "record_routing off" not in t or "no routing" in b]
        # /v1/rollouts on the default gateway: the gateway's own API (top-k from settings)
        targets["v1/rollouts"] = targets["streamed"]
        rollouts_body = {"input_ids": topk["input_ids"],
                         "sampling_params": {"max_new_tokens": out, "temperature": 1.0},
                         "return_routed_experts": True}
        keys.insert(len(targets) - 1, ("top-5 logprobs + routing", "v1/rollouts"))
        # seconds, ok, errors, gateway CPU, client CPU, engine CPU, answer bytes
        acc = {k: [0.0, 0, 0, 0.0, 0.0, 0.0, 0.0] for k in keys}
        e_pid = procs[0].pid
        for _ in range(rounds):
            for bname, name in keys:
                url, proc = targets[name]
                c0 = _cpu_seconds(proc.pid) if proc else 0.0
                e0 = _cpu_seconds(e_pid)
                st: dict[str, float] = {}
                t0 = time.perf_counter()
                if name == "v1/rollouts":
                    _, ok, err = asyncio.run(_load(url + "/v1/rollouts", rollouts_body, out,
                                                   concurrency, duration / rounds, rid=False,
                                                   stats=st))
                else:
                    _, ok, err = asyncio.run(_load(url + "/generate", bodies[bname], out,
                                                   concurrency, duration / rounds, stats=st))
                a = acc[(bname, name)]
                a[0] += time.perf_counter() - t0
                a[1] += ok
                a[2] += err
                a[3] += (_cpu_seconds(proc.pid) - c0) if proc else 0.0
                a[4] += st["cpu"]
                a[5] += _cpu_seconds(e_pid) - e0
                a[6] += st["bytes"]
        res = {k: (ok * out / secs, ok, err, cpu) for k, (secs, ok, err, cpu, *_) in acc.items()}
        # per output token: client / engine / gateway CPU microseconds, answer bytes
        per_tok = {k: tuple(x / max(ok * out, 1) * f for x, f in ((cc, 1e6), (ec, 1e6),
                                                                   (gc, 1e6), (nb, 1.0)))
                   for k, (_, ok, _, gc, cc, ec, nb) in acc.items()}
        # engine answer bytes per token as the gateway reads them (the caller's body with
        # routing; the gateway records routing whenever the engine can give it)
        engine_bytes = {b: per_tok[(b, "direct")][3] for b in bodies}
        engine_bytes["top-5 logprobs, no routing"] = engine_bytes["top-5 logprobs + routing"]
        return {"results": res, "per_tok": per_tok, "engine_bytes": engine_bytes,
                "speeds": _floor_speeds(), "prompt": prompt, "out": out,
                "concurrency": concurrency, "duration": duration, "rounds": rounds,
                "bodies": list(bodies)}
    finally:
        _stop(procs)


B_LABELS = {"direct": "direct to replay engine",
            "sglang-router": "SGLang's router (sglang-router, no stamping)",
            "streamed": "gateway /generate, engines read streamed (default)",
            "non-streamed": "gateway /generate, engines read non-streamed",
            "streamed, asyncio+h11": "gateway /generate, streamed, fast_io off (asyncio + h11)",
            "streamed, python data plane": "gateway /generate, streamed, python data plane "
                                           "(ROLLOUT_GATEWAY_DATA_PLANE=python)",
            "streamed, record_routing off": "gateway /generate, streamed, record_routing off "
                                            "(ROLLOUT_GATEWAY_RECORD_ROUTING=false)",
            "v1/rollouts": "gateway /v1/rollouts (default settings: streamed, top-5)"}

#: the gateway variants whose ratio to direct is a goal of issue 24 (per body)
B_GOALS = ("streamed", "non-streamed", "v1/rollouts", "streamed, record_routing off")


def print_b(r: dict[str, Any], rep=None) -> None:
    res, per_tok, speeds = r["results"], r["per_tok"], r["speeds"]
    out = r["out"]
    routed_b = (r["prompt"] + out - 1) / out * LAYERS * TOPK * 4 * 4 / 3  # base64 int32
    print(f"\nB. end to end, closed loop, {r['concurrency']} concurrent, {r['duration']:.0f} s "
          f"per target in {r['rounds']} interleaved rounds, prompt {r['prompt']} + output "
          f"{out} tokens, routed experts {LAYERS}x{TOPK}")
    print(f"   this machine: memcpy {speeds['memcpy'] / 1e9:.1f} GB/s, base64 decode "
          f"{speeds['b64decode'] / 1e9:.2f} GB/s; CPU microseconds per output token: "
          f"client / engine / gateway")
    floors: dict[str, tuple[float, float]] = {}
    for bname in r["bodies"]:
        eb = r["engine_bytes"][bname]
        fl = floor_us(eb, routed_b, speeds)
        floors[bname] = (fl, eb)
        print(f"  [{bname}] engine answer {eb / 1e3:.2f} KB/token as the gateway reads it; "
              f"floor {fl:.2f} us/token ({1e6 / fl / 1e3:.0f}k tok/CPU-s)")
    if rep is not None:
        rep.row("B. the physical floor", "memcpy (64 MiB, best of 5)", speeds["memcpy"] / 1e9,
                "GB/s")
        rep.row("B. the physical floor", "base64 decode (pybase64)", speeds["b64decode"] / 1e9,
                "GB/s")
        for bname, (fl, eb) in floors.items():
            rep.row("B. the physical floor", f"[{bname}] engine answer bytes per output token "
                    "(what the gateway reads)", eb / 1e3, "KB/tok")
            rep.row("B. the physical floor", f"[{bname}] gateway floor: read it + write the "
                    "answer once + base64-decode the routing", fl, "us/tok")
    for (bname, name), (tps, ok, err, cpu) in res.items():
        d = res[(bname, "direct")][0]
        cc, ec, gc, nb = per_tok[(bname, name)]
        label = f"[{bname}] {B_LABELS[name]}"
        line = f"  {label:70s} {tps / 1e3:8.1f}k tok/s  ({ok} requests, {err} errors)"
        per_cpu = ok * out / cpu if cpu > 0 and name.startswith(("streamed", "non-", "v1")) \
            else None
        if name != "direct":
            line += f"  ratio {tps / d if d else float('nan'):.3f}"
        if per_cpu:
            line += f"  {per_cpu / 1e3:.1f}k tok per gateway CPU-s"
        line += f"  cpu {cc:.2f}/{ec:.2f}/{gc:.2f} us/tok"
        print(line)
        if rep is None:
            continue
        fl, eb = floors[bname]
        routed = True  # the gateway records routing whenever the engine can give it
        if name == "streamed, record_routing off":  # reads only what the caller gets
            eb = per_tok[(bname, "direct")][3]
            fl, routed = floor_us(eb, 0.0, speeds), False
        dc, de = per_tok[(bname, "direct")][:2]
        # on cores the processes saturate, throughput ~ 1 / (CPU per token of all of them):
        # a gateway at its floor would reach (c+e) / (c+e+floor) of direct
        ceiling = (dc + de) / (dc + de + fl) if dc + de > 0 else float("nan")
        sec = f"B. end to end, {bname}"
        label = B_LABELS[name]
        if name == "sglang-router" and "no routing" not in bname:
            label += " [drops return_routed_experts: not like for like]"
        rep.row(sec, label + (f" ({err} errors)" if err else ""), tps, "tok/s",
                ratio=tps / d if d and name != "direct" else None,
                ratio_to="direct" if name != "direct" else None)
        rep.row(f"B. CPU per output token, {bname} (client / engine / gateway)",
                B_LABELS[name], gc if name != "direct" else cc + de, "us/tok",
                client_us=cc, engine_us=ec)
        if per_cpu:
            rep.row("B. stamped output tokens per gateway CPU-second", f"[{bname}] "
                    + B_LABELS[name], per_cpu, "tok/CPU-s")
        floor_txt = (f"{fl:.2f} us/tok ({eb / 1e3:.1f} KB/tok read, written back"
                     + (", routing base64-decoded" if routed else "")
                     + f"); a gateway at it: {ceiling:.2f} of direct (direct's client + "
                     f"engine: {dc + de:.2f} us/tok)")
        if name in B_GOALS:
            what = {"v1/rollouts": "gateway /v1/rollouts (default)",
                    "streamed": "gateway /generate, engines read streamed (default)",
                    "non-streamed": "gateway /generate, engines read non-streamed",
                    "streamed, record_routing off": "gateway /generate, streamed, "
                                                    "record_routing off"}[name]
            rep.goal(f"{what} vs direct [{bname}]", tps / d if d else 0.0, 0.9,
                     floor=floor_txt)
        if name == "streamed":
            rep.goal(f"stamped tok per gateway CPU-s e2e, streamed [{bname}]", per_cpu or 0.0,
                     500_000, unit="tok/CPU-s",
                     floor=f"{fl:.2f} us/tok = {1e6 / fl / 1e3:.0f}k tok/CPU-s "
                           f"(measured: {gc:.2f} us/tok)")
    print(f"  gateway = stamped + published to the embedded store; all processes share "
          f"{os.cpu_count()} cores (client, the gateways, SGLang's router, replay engine)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (fewer rounds, 5 s loads)")
    ap.add_argument("--skip-e2e", action="store_true", help="part A only")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--no-router", action="store_true",
                    help="leave out the sglang-router column (also when it is not installed)")
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args(argv)
    from _report import Report

    duration = 5.0 if args.quick else args.duration
    rep = Report("gateway", "Gateway: hot path and end to end (bench_gateway.py)",
                 concurrency=args.concurrency, seconds_per_target=duration,
                 prompt=args.prompt, output=args.out, routed_experts=f"{LAYERS}x{TOPK}")
    print_a(part_a(rounds=3 if args.quick else 7), rep)
    print_a_wire(part_a_wire(rounds=3 if args.quick else 7), rep)
    if decode_experts.pybase64 is None:
        print("   (pybase64 is not installed: engines.decode uses its numpy fallback)")
    if not args.skip_e2e:
        import importlib.util

        router = not args.no_router and importlib.util.find_spec("sglang_router") is not None
        if not router and not args.no_router:
            rep.note("sglang-router is not installed: its column is missing")
        print_b(part_b(args.concurrency, duration, args.prompt, args.out, router=router), rep)
        rep.note("Part B: the closed-loop client (httpx), the gateway(s), SGLang's router and "
                 "the replay engine all share the machine's cores; the gateway stamps every "
                 "token and publishes to the embedded store.")
        rep.note("\"no routing\" means the caller does not ask for routed_experts; the "
                 "gateway still asks the engine for them (it records routing for the "
                 "learner's routing replay whenever the engine's MoE shape is known), so it "
                 "reads ~2.7 KB per token from the engine that the direct client never sees.")
    rep.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
