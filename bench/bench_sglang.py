"""The gateway in front of the real SGLang 0.5.23 server: /generate through it vs direct.

One command: ``python bench/bench_sglang.py`` (``--quick``: 2 rounds of 8 s per target).

Part B of ``bench_gateway.py`` measures the gateway's own cost against a replay engine
that costs almost nothing per token, so its ratio is a bound on the gateway, not what a
deployment sees. Here the engine is the real SGLang server (CPU build,
``scripts/sglang-cpu.sh``; the toy Qwen3-MoE checkpoint of the test bed, 4 layers x top-2
routed experts, ``--enable-return-routed-experts``, ``--incremental-streaming-output`` as
docs/gateway.md recommends, ``--disable-overlap-schedule``) and the gateway
(``rollout-gateway serve``, engines read streamed, and a second one reading them
non-streamed) stands in front of it, all alive at once. A closed-loop client posts SGLang ``/generate`` bodies (top-5 logprobs + routing,
routing alone, top-5 alone, neither) to each target in interleaved rounds: output tokens/s,
the ratio to direct measured side by side, and the CPU each process spends per output token
(client, the SGLang server's process tree, the gateway).
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT / "tests" / "sglang"))

from bench_gateway import _cpu_seconds, _free_port, _load, _stop, _wait_http, gateway_env  # noqa: E402
from bench_workers import tree_cpu_seconds  # noqa: E402

BASE = {"sampling_params": {"max_new_tokens": 32, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True}
BODIES: dict[str, dict[str, Any]] = {
    "top-5 logprobs + routing": {**BASE, "top_logprobs_num": 5, "return_routed_experts": True},
    "routing, no top-k": {**BASE, "return_routed_experts": True},
    "top-5 logprobs, no routing": {**BASE, "top_logprobs_num": 5},
    "no top-k, no routing": dict(BASE),
}
LABELS = {"direct": "direct to SGLang",
          "streamed": "gateway /generate, engines read streamed (default)",
          "non-streamed": "gateway /generate, engines read non-streamed"}


def run(concurrency: int, duration: float, rounds: int, prompt: int) -> dict[str, Any]:
    from _sglang_support import SGLangServer, write_checkpoint

    out = BODIES["top-5 logprobs + routing"]["sampling_params"]["max_new_tokens"]
    ids = [(7 * i) % 250 + 1 for i in range(prompt)]
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        ckpt = write_checkpoint(Path(tmp) / "v0", seed=1, tokenizer=False)
        # launched as docs/gateway.md "In front of real SGLang" says (incremental streaming),
        # the overlap scheduler off (on 2 cores its thread fights the model for a core)
        server = SGLangServer(model_path=ckpt, overlap_schedule=False, skip_tokenizer_init=True,
                              incremental_streaming_output=True,
                              log_path=Path(tmp) / "sglang.log")
        t0 = time.perf_counter()
        server.start()
        started = time.perf_counter() - t0
        try:
            env = gateway_env()
            targets: dict[str, tuple[str, subprocess.Popen | None]] = {
                "direct": (server.url, None)}
            for name, streamed in (("streamed", True), ("non-streamed", False)):
                port = _free_port()
                gw = subprocess.Popen(
                    [sys.executable, "-m", "rollout_gateway", "serve", "--host", "127.0.0.1",
                     "--port", str(port), "--grpc-host", "127.0.0.1", "--grpc-port", "0",
                     "--engine", f"sglang={server.url}", "--log-level", "warning"],
                    env=dict(env, ROLLOUT_GATEWAY_STREAM_FROM_ENGINES=str(streamed).lower()),
                    stdout=subprocess.DEVNULL)
                procs.append(gw)
                targets[name] = (f"http://127.0.0.1:{port}", gw)
            for url, proc in targets.values():
                if proc is not None:
                    _wait_http(url + "/health", proc)
            for url, _ in targets.values():  # warm: SGLang compiles nothing, but caches fill
                asyncio.run(_load(url + "/generate", {**BODIES["no top-k, no routing"],
                                                      "input_ids": ids}, out, concurrency, 1.0))
            keys = [(b, t) for b in BODIES for t in targets]
            acc = {k: [0.0, 0, 0, 0.0, 0.0, 0.0] for k in keys}  # s, ok, err, gw, client, sglang
            for _ in range(rounds):
                for bname, name in keys:
                    url, proc = targets[name]
                    g0 = _cpu_seconds(proc.pid) if proc else 0.0
                    e0 = tree_cpu_seconds(server.pid)
                    st: dict[str, float] = {}
                    t0 = time.perf_counter()
                    # one prompt for all: SGLang's radix cache serves its prefill alike for
                    # every target, so the targets differ only by what stands in between
                    _, ok, err = asyncio.run(_load(url + "/generate",
                                                   {**BODIES[bname], "input_ids": ids}, out,
                                                   concurrency, duration, stats=st))
                    a = acc[(bname, name)]
                    a[0] += time.perf_counter() - t0
                    a[1] += ok
                    a[2] += err
                    a[3] += (_cpu_seconds(proc.pid) - g0) if proc else 0.0
                    a[4] += st["cpu"]
                    a[5] += tree_cpu_seconds(server.pid) - e0
        finally:
            _stop(procs)
            server.stop()
    res = {f"{b}|{t}": {"tok_s": ok * out / s if s else 0.0, "ok": ok, "err": err,
                         "gw_us": g / max(ok * out, 1) * 1e6, "client_us": c / max(ok * out, 1) * 1e6,
                         "engine_us": e / max(ok * out, 1) * 1e6}
           for (b, t), (s, ok, err, g, c, e) in acc.items()}
    return {"results": res, "out": out, "prompt": prompt, "concurrency": concurrency,
            "duration": duration, "rounds": rounds, "start_s": started}


def report(r: dict[str, Any], rep=None) -> None:
    res = r["results"]
    print(f"\nthe real SGLang server (toy Qwen3-MoE, CPU, started in {r['start_s']:.0f} s), "
          f"closed loop, {r['concurrency']} concurrent, prompt {r['prompt']} + output "
          f"{r['out']} tokens, {r['rounds']} interleaved rounds of {r['duration']:.0f} s")
    for bname in BODIES:
        d = res[f"{bname}|direct"]["tok_s"]
        for name, label in LABELS.items():
            x = res[f"{bname}|{name}"]
            ratio = x["tok_s"] / d if d else 0.0
            print(f"  [{bname}] {label:52s} {x['tok_s']:8.1f} tok/s ({x['ok']} ok, "
                  f"{x['err']} errors)" + (f"  ratio {ratio:.3f}" if name != "direct" else "")
                  + f"  CPU us/tok: client {x['client_us']:.0f}, SGLang {x['engine_us']:.0f}"
                  + (f", gateway {x['gw_us']:.1f}" if name != "direct" else ""))
            if rep is None:
                continue
            errs = f" ({x['err']} errors)" if x["err"] else ""
            rep.row(f"output tokens/s, {bname}", label + errs, x["tok_s"], "tok/s",
                    ratio=ratio if name != "direct" else None,
                    ratio_to="direct to SGLang" if name != "direct" else None)
            rep.row(f"CPU per output token, {bname}", f"{label}: SGLang (all its processes)",
                    x["engine_us"], "us/tok")
            if name != "direct":
                rep.row(f"CPU per output token, {bname}", f"{label}: gateway", x["gw_us"],
                        "us/tok")
                rep.goal(f"gateway in front of real SGLang: {label} vs direct [{bname}]",
                         ratio, 0.9,
                         floor=f"the gateway spends {x['gw_us']:.1f} us/tok beside SGLang's "
                               f"{x['engine_us']:.0f}")
    if rep is not None:
        rep.note("SGLang on this CPU costs milliseconds of CPU per token (it computes the "
                 "model there); on a GPU host the model runs on the GPU and SGLang's own "
                 "CPU per token is its scheduler, tokenizer and detokenizer, still several "
                 "times the gateway's. The replay-engine figures (bench_gateway part B) bound "
                 "the gateway's own cost; these say what it costs in front of a real engine.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 rounds of 8 s per target")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--duration", type=float, default=15.0,
                    help="seconds per target per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--json", help="write the results here (bench/run_all)")
    args = ap.parse_args(argv)
    from _report import Report

    if args.quick:
        args.duration, args.rounds = 8.0, 2
    rep = Report("sglang", "The gateway in front of the real SGLang server (bench_sglang.py)",
                 concurrency=args.concurrency, seconds_per_target=args.duration,
                 rounds=args.rounds, prompt=args.prompt,
                 output=BASE["sampling_params"]["max_new_tokens"])
    r = run(args.concurrency, args.duration, args.rounds, args.prompt)
    report(r, rep)
    rep.write(args.json)
    failed = {k: x["err"] for k, x in r["results"].items() if x["err"]}
    if failed:  # a figure measured among refusals is not a figure: run_all reports a failure
        print(f"bench_sglang: requests failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
