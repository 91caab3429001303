"""The demo job: engines + gateway as processes, rollouts through HTTP, a learner over gRPC.

Asynchronous mode (the default): producer threads keep ``POST /v1/rollouts`` busy (one GRPO
group of ``group_size`` samples per request; the gateway's admission control answers 429
when generation runs more than ``max_lag`` versions ahead, and the producer backs off)
while the learner pulls finished trajectories over gRPC, trains one step per
``batch_groups`` complete groups, saves a checkpoint and announces it through the gateway,
which hot-swaps the engines with the chosen interruption mode. Generation never waits for
training, so tokens arrive stale by a few versions and the correction handles them.

Synchronous baseline (``sync=True``): generate exactly one batch, wait for it, train, swap,
repeat (no overlap, lag 0). ``--compare-sync`` runs both and reports the throughput ratio.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import numpy as np

from rollout_demo import task
from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.proc import wait_healthy

log = logging.getLogger("rollout_demo")


@dataclass
class DemoConfig:
    loss: str = "sat"
    loss_config: dict | None = None  # the loss's config fields (None: its defaults)
    steps: int = 60
    out: Path = Path("demo-out")
    engines: int = 1
    swap_mode: SwapMode = SwapMode.IN_PLACE
    redis_url: str | None = None
    by_reference: bool = False  # learner reads trajectory bytes from Redis (needs redis_url)
    batch_groups: int = 4
    group_size: int = 8
    max_new_tokens: int = 8
    lr: float = 3e-3
    temperature: float = 1.0
    max_lag: int = 2
    replay: bool = True
    learner: str = "torch"  # "torch" (transformers) or "megatron" (megatron-core GPTModel)
    seed: int = 0
    producers: int = 0  # 0 = batch_groups (one request in flight per group of a step)
    progress: bool = True
    host: str = "127.0.0.1"
    startup_timeout_s: float = 120.0
    stall_timeout_s: float = 300.0  # no trajectory for this long = the run failed


@dataclass
class RunResult:
    mode: str
    steps: int
    wall_s: float
    train_tokens: int
    tokens_per_s: float
    reward_curve: list[float]
    loss_curve: list[float]
    clip_rate: list[float]
    mask_rate: list[float]
    mismatch: list[float]
    policy_gap: list[float]
    lag_histogram: dict[str, int]
    pause_windows: list[dict]
    step_times: list[float]
    rollouts_trained: int
    producer_429: int = 0
    producer_errors: int = 0
    swap_failures: int = 0
    gateway_metrics: dict = field(default_factory=dict)
    redis_prefix: str | None = None
    fetched_by_reference: int = 0  # trajectories the learner read from Redis itself


def _prefix(url: str) -> str | None:
    from urllib.parse import parse_qs, urlsplit

    if not url.startswith(("redis://", "rediss://", "unix://")):
        return None
    return parse_qs(urlsplit(url).query).get("prefix", [None])[0]


def _free_port() -> int:
    from rollout_gateway.commands.engine_process import free_port

    return free_port()


class GatewayProc:
    """``python -m rollout_gateway serve`` on free ports, logs in ``log_path``."""

    def __init__(self, engines: list[str], store: str, registry: str, log_path: Path,
                 env: dict[str, str], host: str) -> None:
        self.host, self.port, self.grpc_port = host, _free_port(), _free_port()
        self.args = [sys.executable, "-m", "rollout_gateway", "serve", "--host", host,
                     "--port", str(self.port), "--grpc-host", host,
                     "--grpc-port", str(self.grpc_port), "--store", store,
                     "--registry", registry, "--log-level", "warning"]
        for i, url in enumerate(engines):
            self.args += ["--engine", f"engine-{i}={url}"]
        self.env = {**os.environ, **env}
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float) -> GatewayProc:
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env)
        why = wait_healthy(self.proc, self.url + "/health", timeout)
        if why is None:
            return self
        self.stop()
        raise RuntimeError(f"gateway {why}; see {self.log_path}")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc:
            self._log.close()


class Producer:
    """Threads that keep the gateway generating GRPO groups (one request = one group)."""

    def __init__(self, url: str, cfg: DemoConfig, rng: random.Random) -> None:
        self.url, self.cfg, self.rng = url, cfg, rng
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.refused = 0  # 429: admission control said "too far ahead"
        self.errors = 0
        self.groups = 0
        self.threads: list[threading.Thread] = []

    def _body(self) -> dict:
        with self.lock:
            name, prompt = task.make_prompt(self.rng)
        return {"input_ids": prompt, "n": self.cfg.group_size,
                "group_id": f"g-{uuid.uuid4().hex[:12]}", "metadata": {"class": name},
                "sampling_params": {"max_new_tokens": self.cfg.max_new_tokens,
                                    "temperature": self.cfg.temperature, "ignore_eos": True}}

    def request_group(self, client: httpx.Client) -> bool:
        """One group through the gateway; True when it was generated and published."""
        r = client.post(self.url + "/v1/rollouts", json=self._body(), timeout=600)
        with self.lock:
            if r.status_code == 200:
                self.groups += 1
                return True
            if r.status_code == 429:
                self.refused += 1
            else:
                self.errors += 1
                log.warning("rollout request failed: %s %s", r.status_code, r.text[:300])
        return False

    def _loop(self) -> None:
        delay = 0.05
        with httpx.Client() as client:
            while not self.stop.is_set():
                try:
                    ok = self.request_group(client)
                except httpx.HTTPError as exc:
                    with self.lock:
                        self.errors += 1
                    log.warning("rollout request error: %s", exc)
                    ok = False
                if ok:
                    delay = 0.05
                else:
                    self.stop.wait(delay)
                    delay = min(delay * 2, 1.0)

    def start(self, n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=self._loop, name=f"producer-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=660)


def to_sample(r, learner_version: int, max_lag: int):
    """A delivered ``learner_client.Rollout`` as a learner ``Sample`` (reward checked here)."""
    from rollout_demo.learner import Sample

    versions = r.policy_version.astype(np.int32)
    mask = None
    if r.masked:
        mask = ((learner_version - versions.astype(np.int64)) <= max_lag).astype(np.float32)
    routed = None
    if r.routed_experts is not None and r.routed_start == 0:
        routed = r.routed_experts.astype(np.int64)
    return Sample(prompt_ids=r.prompt_token_ids.astype(np.int64),
                  response_ids=r.token_ids.astype(np.int64),
                  rollout_logprobs=np.asarray(r.logprobs, np.float32),
                  entropy=np.asarray(r.entropy, np.float32), versions=versions,
                  reward=task.reward(r.prompt_token_ids, r.token_ids), group=r.group_id,
                  routed_experts=routed, loss_mask=mask,
                  kv_versions=r.kv_version.astype(np.int32))


class _Groups:
    """Buffers deliveries until whole GRPO groups are there (advantages need the group)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.partial: dict[str, list] = defaultdict(list)
        self.ready: list[list] = []

    def add(self, rollouts: list) -> None:
        for r in rollouts:
            g = self.partial[r.group_id]
            g.append(r)
            if len(g) == self.size:
                self.ready.append(self.partial.pop(r.group_id))

    def take(self, n: int) -> list[list]:
        out, self.ready = self.ready[:n], self.ready[n:]
        return out


def redis_run_url(url: str) -> str:
    """The user's Redis URL with a fresh key prefix for this run (``demo-<hex>``), unless
    the URL names a prefix already."""
    if "prefix=" in url:
        return url
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}prefix=demo-{uuid.uuid4().hex[:8]}"


def delete_redis_prefix(url: str) -> int:
    """Delete the keys of a run's own ``demo-`` prefix (its streams and registry)."""
    from urllib.parse import parse_qs, urlsplit

    import redis

    parts = urlsplit(url)
    prefix = parse_qs(parts.query).get("prefix", [""])[0]
    if not prefix.startswith("demo-"):
        return 0  # a prefix the user chose: leave it alone
    r = redis.Redis.from_url(parts._replace(query="").geturl())
    try:
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        return len(keys)
    finally:
        r.close()


def _services(cfg: DemoConfig, work: Path, ckpt0: Path):
    from rollout_gateway.commands.engine_process import EngineProcess

    engines = []
    try:
        for _ in range(cfg.engines):
            engines.append(EngineProcess(checkpoint=ckpt0, weight_version="0", host=cfg.host,
                                         startup_timeout=cfg.startup_timeout_s).start())
        if cfg.redis_url:
            store = registry = redis_run_url(cfg.redis_url)
        else:
            store = registry = "memory://"
        trajectories_per_step = cfg.batch_groups * cfg.group_size
        env = {"ROLLOUT_GATEWAY_ADMISSION__MAX_STALENESS": str(cfg.max_lag),
               "ROLLOUT_GATEWAY_ADMISSION__BATCH_SIZE": str(trajectories_per_step),
               "ROLLOUT_GATEWAY_ADMISSION__STALE_POLICY": "mask",
               "ROLLOUT_GATEWAY_HEALTH_INTERVAL_S": "1.0"}
        gw = GatewayProc([e.url for e in engines], store, registry, work / "gateway.log", env,
                         cfg.host).start(cfg.startup_timeout_s)
        gw.store_url = store
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines, gw


class StepObserver(Protocol):
    """Watches a run (the staleness lab's ``product-lag`` preset snapshots weights and
    checks the stamps the loss consumed)."""

    def started(self, learner: Any) -> None:
        """The learner is built, before the first step."""

    def stepped(self, step: int, learner: Any, rollouts: list, result: Any) -> None:
        """After each optimizer step: the learner (its weights are the new version), the
        delivered ``learner_client.Rollout``s it trained on (the gateway's stamps) and the
        :class:`~rollout_demo.learner.StepResult`."""


def run_once(cfg: DemoConfig, *, sync: bool, work: Path,
             observer: StepObserver | None = None) -> RunResult:
    """One training run (async or the synchronous baseline) on fresh services."""
    import torch

    from rollout_demo.learner import Learner
    from reference_engine.checkpoint import init_checkpoint

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    work.mkdir(parents=True, exist_ok=True)
    ckpt0 = init_checkpoint(work / "ckpt" / "v0", seed=cfg.seed)
    with contextlib.ExitStack() as stack:
        if cfg.learner == "megatron":
            from rollout_demo.megatron_learner import MegatronLearner, single_process_parallel_state

            stack.enter_context(single_process_parallel_state())
            learner = MegatronLearner(ckpt0, loss=cfg.loss, loss_config=cfg.loss_config,
                                      lr=cfg.lr, temperature=cfg.temperature,
                                      replay=cfg.replay)
        else:
            learner = Learner(ckpt0, loss=cfg.loss, loss_config=cfg.loss_config, lr=cfg.lr,
                              temperature=cfg.temperature, replay=cfg.replay)
        if observer is not None:
            observer.started(learner)
        return _train(cfg, sync, work, ckpt0, learner, observer)


def _train(cfg: DemoConfig, sync: bool, work: Path, ckpt0: Path, learner,
           observer: StepObserver | None = None) -> RunResult:
    from learner_client import TrajectoryClient

    engines, gw = _services(cfg, work, ckpt0)
    if cfg.progress:
        print(f"{'sync' if sync else 'async'} run: gateway {gw.url} (GET /v1/versions, "
              f"/v1/engines, /metrics while it runs), learner gRPC {cfg.host}:{gw.grpc_port}",
              flush=True)
    producer = Producer(gw.url, cfg, random.Random(cfg.seed))
    groups = _Groups(cfg.group_size)
    lags: dict[int, int] = defaultdict(int)
    res = dict(reward_curve=[], loss_curve=[], clip_rate=[], mask_rate=[], mismatch=[],
               policy_gap=[],
               pause_windows=[], step_times=[])
    tokens = trained = swap_failures = 0
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{'sync' if sync else 'async'} {cfg.loss}",
                   unit="step", dynamic_ncols=True)
    client = TrajectoryClient(f"{cfg.host}:{gw.grpc_port}", group="demo-learner",
                              learner_version=0, max_lag=cfg.max_lag, stale_policy="mask",
                              store_url=gw.store_url if cfg.by_reference else None,
                              by_reference=True if cfg.by_reference else None)
    try:
        client.create_group()
        t0 = time.monotonic()
        if not sync:
            producer.start(cfg.producers or cfg.batch_groups)
        http = httpx.Client()
        for step in range(cfg.steps):
            if sync:  # generate exactly one batch with the current weights, then train
                threads = [threading.Thread(target=producer.request_group, args=(http,))
                           for _ in range(cfg.batch_groups)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            while len(groups.ready) < cfg.batch_groups:
                want = (cfg.batch_groups - len(groups.ready)) * cfg.group_size
                got = client.pull(want, timeout=cfg.stall_timeout_s)
                if not got:  # nothing for a whole timeout: say why instead of hanging
                    raise RuntimeError(
                        f"no trajectories for {cfg.stall_timeout_s:.0f}s at step {step} "
                        f"(groups generated {producer.groups}, refused {producer.refused}, "
                        f"failed {producer.errors}); see {gw.log_path}")
                groups.add(got)
            batch = groups.take(cfg.batch_groups)
            rollouts = [r for g in batch for r in g]
            samples = [to_sample(r, learner.version, cfg.max_lag) for r in rollouts]
            out = learner.train_step(samples)
            if observer is not None:
                observer.stepped(step, learner, rollouts, out)
            for lag in out.lags.tolist():
                lags[int(lag)] += 1
            ckpt = learner.save(work / "ckpt" / f"v{learner.version}")
            a = time.monotonic()
            ann = client.announce(learner.version, str(ckpt), kind="path", mode=cfg.swap_mode)
            b = time.monotonic()
            if not ann.accepted:
                swap_failures += 1
                log.warning("hot-swap to v%d not accepted: %s", learner.version, ann.message)
            if learner.version >= 2:  # the engines run v; v-2 is no longer needed
                import shutil

                shutil.rmtree(work / "ckpt" / f"v{learner.version - 2}", ignore_errors=True)
            res["pause_windows"].append({"version": learner.version, "start_s": a - t0,
                                         "end_s": b - t0, "pause_s": float(ann.pause_seconds)})
            client.set_learner_version(learner.version, cfg.max_lag)
            client.ack(rollouts)
            tokens += out.tokens
            trained += len(rollouts)
            res["reward_curve"].append(out.reward_mean)
            res["loss_curve"].append(out.loss)
            res["clip_rate"].append(out.clip_rate)
            res["mask_rate"].append(out.mask_rate)
            res["mismatch"].append(out.mismatch)
            res["policy_gap"].append(out.policy_gap)
            res["step_times"].append(time.monotonic() - t0)
            if bar is not None:
                bar.set_postfix(reward=f"{out.reward_mean:.2f}",
                                lag=f"{float(out.lags.mean()) if out.lags.size else 0:.1f}")
                bar.update(1)
        wall = time.monotonic() - t0
        http.close()
        metrics = {}
        try:
            metrics = _gateway_counters(gw.url)
        except httpx.HTTPError:
            pass
    finally:
        if bar is not None:
            bar.close()
        producer.join()
        fetched = client.fetched
        client.close()
        gw.stop()
        for e in engines:
            e.stop()
        if cfg.redis_url:
            delete_redis_prefix(gw.store_url)
    return RunResult(mode="sync" if sync else "async", steps=cfg.steps, wall_s=wall,
                     train_tokens=tokens, tokens_per_s=tokens / wall if wall > 0 else 0.0,
                     lag_histogram={str(k): v for k, v in sorted(lags.items())},
                     rollouts_trained=trained, producer_429=producer.refused,
                     producer_errors=producer.errors, swap_failures=swap_failures,
                     gateway_metrics=metrics, redis_prefix=_prefix(gw.store_url),
                     fetched_by_reference=fetched, **res)


def _gateway_counters(url: str) -> dict:
    """A few counters from the gateway's Prometheus text (best effort)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, value = line.rpartition(" ")
        if any(k in name for k in ("swap", "stale", "admission", "trajector")):
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def run_demo(cfg: DemoConfig, *, compare_sync: bool = False) -> dict:
    """Run the demo (and the synchronous baseline when asked); write report.json + PNGs."""
    from rollout_demo.report import write_report

    cfg.swap_mode = SwapMode(cfg.swap_mode)  # ValueError for a word that names no mode
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="work-", dir=out))
    runs = {"async": run_once(cfg, sync=False, work=work / "async")}
    if compare_sync:
        runs["sync"] = run_once(cfg, sync=True, work=work / "sync")
    report = write_report(cfg, runs, out)
    import shutil

    shutil.rmtree(work / "async" / "ckpt", ignore_errors=True)
    shutil.rmtree(work / "sync" / "ckpt", ignore_errors=True)
    (out / "config.json").write_text(json.dumps(
        {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}, indent=2))
    return report
