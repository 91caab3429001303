"""The three exact old-logit strategies side by side, on real processes.

    python bench/bench_old_logits.py [--rollouts 6] [--new-tokens 24]

One run per strategy on the same workload: ``--rollouts`` prompts x 2 samples with one
abort_resume hot-swap (v0 -> v1) landing mid-generation, a reference engine (step delay so
the swap interrupts), the gateway (``rollout-gateway serve``) and a learner pulling over
gRPC. Strategies:

* ``snapshots``: the learner keeps a CPU weight copy per live version and recomputes
  pi_old for each token under its version after the pull (learner_client.old_logits).
* ``model``: ``--old-logits model``, a dedicated scorer engine re-scores every finished
  trajectory under each token's version before delivery.
* ``interruption``: ``--old-logits interruption``, partial rollouts are scored at the swap
  under the outgoing version, the tail at finish.

Reported per strategy: exactness (max |pi_old - fresh forward under the token's version|),
extra compute (tokens run through a forward pass for pi_old, per trajectory token), extra
memory (snapshot bytes on the learner / the scorer process RSS), latency (rollout request
to response, mean; the swap's wall time; the learner's recompute time).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from reference_engine.checkpoint import init_checkpoint, load_model  # noqa: E402
from rollout_gateway.commands.engine_process import EngineProcess, free_port  # noqa: E402
from reference_engine.reference import score  # noqa: E402


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def serve(engine_url: str, extra: list[str]) -> tuple[subprocess.Popen, str, int]:
    port, gport = free_port(), free_port()
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "rollout_gateway", "serve", "--host",
                             "127.0.0.1", "--port", str(port), "--grpc-host", "127.0.0.1",
                             "--grpc-port", str(gport), "--engine", f"e0={engine_url}",
                             "--log-level", "warning", *extra], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url, gport
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("gateway did not start")


def one_rollout(url: str, i: int, new_tokens: int) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/rollouts", timeout=600, json={
        "input_ids": [5 + i, 6, 7 + i, 8], "n": 2,
        "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True}})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["trajectories"]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("rollout_gateway_old_logits_"):
            k, v = line.rsplit(" ", 1)
            out[k.removeprefix("rollout_gateway_old_logits_").removesuffix("_total")] = float(v)
    return out


def run(strategy: str, ckpts: dict[int, Path], models: dict, args) -> dict[str, object]:
    from learner_client.client import TrajectoryClient
    from learner_client.old_logits import WeightSnapshotStore

    res: dict[str, object] = {"strategy": strategy}
    with EngineProcess(checkpoint=ckpts[0], step_delay_ms=args.step_ms) as e0, \
            EngineProcess(checkpoint=ckpts[0]) as scorer:
        extra = [] if strategy == "snapshots" else [
            "--old-logits", strategy, "--old-logits-scorer", scorer.url,
            "--old-logits-initial-source", str(ckpts[0])]
        proc, url, gport = serve(e0.url, extra)
        try:
            with ThreadPoolExecutor(args.rollouts + 1) as ex:
                futs = [ex.submit(one_rollout, url, i, args.new_tokens)
                        for i in range(args.rollouts)]
                time.sleep(args.swap_after)
                t0 = time.perf_counter()
                r = httpx.post(url + "/v1/weights", timeout=600, json={
                    "version": 1, "mode": "abort_resume",
                    "source": {"kind": "disk", "path": str(ckpts[1])}})
                res["swap_s"] = time.perf_counter() - t0
                r.raise_for_status()
                outs = [f.result() for f in futs]
            res["rollout_latency_s"] = float(np.mean([o[0] for o in outs]))
            n_traj = sum(len(o[1]) for o in outs)
            client = TrajectoryClient(f"127.0.0.1:{gport}", group="bench")
            client.create_group()
            got = []
            while len(got) < n_traj:
                got += client.pull(n_traj - len(got), timeout=10)
            client.ack(got)
            client.close()
            tokens = sum(g.num_tokens for g in got)
            res["trajectories"] = len(got)
            res["spanning"] = sum(len(set(g.policy_version.tolist())) > 1 for g in got)
            if strategy == "snapshots":
                store = WeightSnapshotStore(max_versions=4)
                for v, m in models.items():
                    store.put(v, m.state_dict())
                res["extra_mem_mib"] = store.nbytes() / 2**20
                t0 = time.perf_counter()
                fwd = 0
                olds = []
                for g in got:  # per trajectory, one forward per version it holds
                    ids = g.prompt_token_ids.tolist() + g.token_ids.tolist()
                    p = len(g.prompt_token_ids)
                    old = np.full(g.num_tokens, np.nan, np.float32)
                    for v in sorted(set(g.policy_version.tolist())):
                        m = models[v]
                        with torch.no_grad():
                            m.load_state_dict(store.get(v))
                            sc = score(m, ids, p).logprobs
                        sel = g.policy_version == v
                        old[sel] = sc[sel]
                        fwd += len(ids)
                    olds.append(old)
                res["learner_recompute_s"] = time.perf_counter() - t0
                res["forward_tokens_per_token"] = fwd / tokens
            else:
                olds = [g.old_logprobs for g in got]
                m = metrics(url)
                res["forward_tokens_per_token"] = m["scorer_prefill_tokens"] / tokens
                res["scorer_weight_loads"] = m["scorer_weight_loads"]
                res["scorer_load_s"] = m["scorer_load_seconds"]
                res["tokens_scored_at_swap"] = m["tokens_at_swaps"]
                res["extra_mem_mib"] = rss_mib(scorer.pid)
                res["learner_recompute_s"] = 0.0
            err = 0.0
            for g, old in zip(got, olds):
                ids = g.prompt_token_ids.tolist() + g.token_ids.tolist()
                p = len(g.prompt_token_ids)
                for v in set(g.policy_version.tolist()):
                    sel = g.policy_version == v
                    want = score(models[v], ids, p).logprobs[sel]
                    err = max(err, float(np.abs(old[sel] - want).max()))
            res["max_abs_err"] = err
        finally:
            proc.terminate()
            proc.wait(30)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rollouts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--step-ms", type=float, default=20.0)
    ap.add_argument("--swap-after", type=float, default=0.3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-oldlogits-"))
    ckpts = {v: init_checkpoint(root / f"v{v}", seed=50 + v) for v in range(2)}
    models = {v: load_model(ckpts[v]) for v in range(2)}
    rows = [run(s, ckpts, models, args) for s in ("snapshots", "model", "interruption")]
    keys = ["strategy", "trajectories", "spanning", "max_abs_err", "forward_tokens_per_token",
            "extra_mem_mib", "rollout_latency_s", "swap_s", "learner_recompute_s",
            "scorer_weight_loads", "tokens_scored_at_swap"]
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "-")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
