"""The lab's small simulator: a tiny autoregressive policy, an echo + class task, exact lag.

Why not the demo's Qwen3-MoE: a reviewer's statistics need >= 6 seeds per cell and many
cells, and the machine is two shared cores. This policy (an MLP over the prompt, the
position and the previous token; ~20k parameters) trains a full run in seconds, and the
corrections are the very loss functions of ``learner_client.corrections`` (``LOSSES``).

The task (``EchoClassTask``): a prompt is a class ``c`` (one of 4) and an echo string of
``echo`` symbols (of 16). A response has ``echo + free`` tokens: the first ``echo`` should
copy the string (a near-deterministic optimum: entropy -> 0), the last ``free`` should lie
in the class's 4 symbols (a uniform optimum within the class: entropy ln 4). Reward = the
fraction of positions right, so it starts near (echo/16 + free/4)/(echo + free) and ends at
1. The held-out score is the expected reward of the *current* policy on a fixed set of
held-out prompts, Rao-Blackwellized: along a sampled response, the probability mass on the
right symbols at each position (low noise at few prompts).

Lag (``lag = S``): the batch of iteration ``k`` is sampled from the snapshot of version
``max(k - S, 0)`` (one version per batch). Each batch gets ``updates`` optimizer steps on
``updates`` disjoint minibatches of whole groups; ``pi_old`` = the learner's weights at the
start of the batch (recomputed log-probs, what an uncorrected GRPO learner does), ``mu`` =
the sampler's log-probs (what the gateway stamps). Injected mismatch (``mismatch_sigma``):
the stamped ``mu`` gets N(0, sigma^2) noise per token, independent of the entropy (an
engine whose log-prob kernel differs from the trainer's by a fixed numerical error).
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from learner_client.corrections import LossInputs, advantages, get_loss
from learner_client.corrections.sat import sat_factors

LOG_1P_EPS = math.log(1.2)  # SAT acts only on tokens with q < |d| < log(1 + eps), eps = 0.2


@dataclass(frozen=True)
class EchoClassTask:
    symbols: int = 16
    classes: int = 4
    echo: int = 4
    free: int = 4

    @property
    def length(self) -> int:
        return self.echo + self.free

    def prompts(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """[n, 1 + echo]: class id (offset by ``symbols``), then the echo string."""
        c = torch.randint(self.classes, (n, 1), generator=gen) + self.symbols
        e = torch.randint(self.symbols, (n, self.echo), generator=gen)
        return torch.cat((c, e), 1)

    def good(self, prompts: torch.Tensor) -> torch.Tensor:
        """[n, length, symbols] bool: the right symbols at each response position."""
        n = prompts.shape[0]
        out = torch.zeros(n, self.length, self.symbols, dtype=torch.bool)
        out[:, :self.echo] = nn.functional.one_hot(prompts[:, 1:], self.symbols).bool()
        per = self.symbols // self.classes
        cls = prompts[:, 0] - self.symbols
        sym = torch.arange(self.symbols)
        in_class = (sym[None] // per) == cls[:, None]  # [n, symbols]
        out[:, self.echo:] = in_class[:, None]
        return out

    def reward(self, prompts: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        g = self.good(prompts)
        return g.gather(2, resp[..., None]).squeeze(-1).float().mean(1)


class TinyPolicy(nn.Module):
    """logits(y_t | prompt, t, y_{t-1}): embeddings of each prompt slot, the position, the
    previous token and the prompt token "in view" at t (the echo symbol at t < echo, the
    class after), concatenated, through a 2-layer MLP (copying is then a lookup, so the
    echo positions become near-deterministic within a run)."""

    def __init__(self, task: EchoClassTask, dim: int = 16, hidden: int = 128) -> None:
        super().__init__()
        self.task = task
        vocab_in = task.symbols + task.classes + 1  # + BOS (previous token at t = 0)
        self.bos = vocab_in - 1
        self.tok = nn.Embedding(vocab_in, dim)
        self.slot = nn.Parameter(torch.randn(1 + task.echo, dim) * 0.1)
        self.pos = nn.Embedding(task.length, dim)
        self.mlp = nn.Sequential(nn.Linear((task.echo + 4) * dim, hidden), nn.Tanh(),
                                 nn.Linear(hidden, task.symbols))

    def logits(self, prompts: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        """Teacher-forced logits [n, T, symbols] for responses ``resp`` [n, T]."""
        n, t = resp.shape
        p = (self.tok(prompts) + self.slot).reshape(n, 1, -1).expand(n, t, -1)
        prev = torch.cat((torch.full((n, 1), self.bos, dtype=torch.long), resp[:, :-1]), 1)
        pos = self.pos(torch.arange(t))[None].expand(n, t, -1)
        view = torch.arange(t).add(1).masked_fill(torch.arange(t) >= self.task.echo, 0)
        seen = self.tok(prompts[:, view])  # [n, t, dim]
        return self.mlp(torch.cat((p, pos, self.tok(prev), seen), -1))

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, gen: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(responses [n, T], log mu [n, T], entropy [n, T]) at temperature 1."""
        n, length = prompts.shape[0], self.task.length
        resp = torch.zeros(n, length, dtype=torch.long)
        for t in range(length):
            lg = self.logits(prompts, resp[:, :t + 1])[:, t]
            resp[:, t] = torch.multinomial(torch.softmax(lg, -1), 1, generator=gen)[:, 0]
        logp = torch.log_softmax(self.logits(prompts, resp), -1)
        lp = logp.gather(2, resp[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
        return resp, lp, ent


def token_logprobs(model: TinyPolicy, prompts: torch.Tensor, resp: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(model.logits(prompts, resp), -1)
    return logp.gather(2, resp[..., None]).squeeze(-1), logp


@torch.no_grad()
def held_out_score(model: TinyPolicy, prompts: torch.Tensor, good: torch.Tensor,
                   seed: int) -> float:
    """Expected reward of ``model`` on the held-out prompts (Rao-Blackwellized, see module)."""
    resp, _, _ = model.sample(prompts, torch.Generator().manual_seed(seed))
    p = torch.softmax(model.logits(prompts, resp), -1)
    return float((p * good).sum(-1).mean())


@dataclass(frozen=True)
class Method:
    """A correction as the lab runs it: a registered loss, its config, and the lab's knobs."""

    label: str
    loss: str
    config: dict = field(default_factory=dict)
    #: the learner fills old_logprobs with its weights at the start of the batch (GRPO,
    #: uncorrected); False: old_logprobs = None, the loss anchors on mu (bypass, SAT, ESTR)
    recompute_old: bool = False
    #: ESTR's score with H replaced by a constant: the magnitude-only mask (delta^2 > tau)
    constant_entropy: bool = False


@dataclass(frozen=True)
class SimConfig:
    lag: int = 0
    lr: float = 1e-2
    iterations: int = 40  # batches (versions)
    prompts: int = 16  # groups per batch
    group: int = 8  # samples per prompt
    updates: int = 4  # minibatch optimizer steps per batch
    mismatch_sigma: float = 0.0
    eval_prompts: int = 256
    eval_every: int = 5
    grad_clip: float = 1.0
    task: EchoClassTask = EchoClassTask()


def collapse_flag(curve: list[float], nonfinite: bool) -> bool:
    """Collapsed: a non-finite loss, or the held-out score lost more than half of its gain
    (final < start + (peak - start)/2 after a gain of at least 0.1), or it ends below its
    start by more than 0.05."""
    if nonfinite:
        return True
    start, peak, final = curve[0], max(curve), curve[-1]
    if peak - start >= 0.1 and final < start + (peak - start) / 2:
        return True
    return final < start - 0.05


def run(method: Method, cfg: SimConfig, seed: int, keep: dict[int, dict] | None = None
        ) -> dict[str, Any]:
    """One training run; returns its cell (see results.json in docs/lab.md). ``keep``: a
    dict that receives every version's weights (for probes at fixed checkpoints)."""
    task = cfg.task
    torch.manual_seed(seed)
    model = TinyPolicy(task)
    sampler = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    spec = get_loss(method.loss)
    loss_cfg = spec.config(method.config)
    data_gen = torch.Generator().manual_seed(1000 + seed)
    noise_gen = torch.Generator().manual_seed(2000 + seed)
    eval_prompts = task.prompts(cfg.eval_prompts, torch.Generator().manual_seed(99))
    eval_good = task.good(eval_prompts)
    snapshots = {0: copy.deepcopy(model.state_dict())}
    if keep is not None:
        keep[0] = snapshots[0]
    curve: list[float] = []
    evals_at: list[int] = []
    diag: dict[str, list[float]] = {}
    nonfinite = False

    def log(key: str, value: float) -> None:
        diag.setdefault(key, []).append(float(value))

    def evaluate(k: int) -> None:
        curve.append(held_out_score(model, eval_prompts, eval_good, seed=7))
        evals_at.append(k)

    evaluate(0)
    g = cfg.group
    for k in range(cfg.iterations):
        sampler.load_state_dict(snapshots[max(k - cfg.lag, 0)])
        prompts = task.prompts(cfg.prompts, data_gen).repeat_interleave(g, 0)
        resp, mu, ent = sampler.sample(prompts, data_gen)
        if cfg.mismatch_sigma > 0:
            mu = mu + cfg.mismatch_sigma * torch.randn(mu.shape, generator=noise_gen)
        reward = task.reward(prompts, resp)
        gid = torch.arange(cfg.prompts).repeat_interleave(g)
        adv = advantages.grpo_advantages(reward.double(), gid).float()
        log("train_reward", float(reward.mean()))
        with torch.no_grad():
            old = token_logprobs(model, prompts, resp)[0] if method.recompute_old else None
        order = torch.randperm(cfg.prompts, generator=data_gen)
        for chunk in order.chunk(cfg.updates):
            rows = (chunk[:, None] * g + torch.arange(g)[None]).reshape(-1)
            lp, _ = token_logprobs(model, prompts[rows], resp[rows])
            h = ent[rows]
            inputs = LossInputs(
                logprobs=lp, rollout_logprobs=mu[rows],
                advantages=adv[rows, None].expand_as(lp).contiguous(),
                loss_mask=torch.ones_like(lp),
                old_logprobs=None if old is None else old[rows],
                entropy=torch.ones_like(h) if method.constant_entropy else h)
            loss, metrics = spec.fn(inputs, loss_cfg)
            if not torch.isfinite(loss):
                nonfinite = True
                break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            _mechanism_diagnostics(log, method, loss_cfg, metrics, lp.detach(), mu[rows], h,
                                   inputs.advantages)
        if nonfinite:
            break
        snapshots[k + 1] = copy.deepcopy(model.state_dict())
        if keep is not None:
            keep[k + 1] = snapshots[k + 1]
        snapshots.pop(k + 1 - cfg.lag - 1, None)
        if (k + 1) % cfg.eval_every == 0 or k + 1 == cfg.iterations:
            evaluate(k + 1)
    return {"method": method.label, "loss": method.loss, "config": method.config,
            "lag": cfg.lag, "lr": cfg.lr, "seed": seed, "eval_steps": evals_at,
            "eval_curve": curve, "final_eval": curve[-1], "peak_eval": max(curve),
            "collapsed": collapse_flag(curve, nonfinite), "nonfinite": nonfinite,
            "diagnostics": {k: _summary(v) for k, v in diag.items()},
            "sim": {k: v for k, v in asdict(cfg).items() if k != "task"}}


def _summary(v: list[float]) -> dict[str, float] | list[float]:
    a = np.asarray(v, float)
    return {"mean": float(np.nanmean(a)), "min": float(np.nanmin(a)),
            "max": float(np.nanmax(a)), "n": int(a.size)}


def _mechanism_diagnostics(log, method: Method, cfg, metrics: dict, lp: torch.Tensor,
                           mu: torch.Tensor, ent: torch.Tensor, adv: torch.Tensor) -> None:
    """Evidence that a mechanism acts, per optimizer step.

    Every method: |log pi - log mu| (mean) and q = its 0.9 quantile against log(1.2).
    SAT: the share of tokens whose gradient differs from bypass PPO's (clipped by SAT's
    contracted bound, not by PPO's). ESTR and the magnitude mask: the mask rate and the
    entropy of the masked tokens against that of all tokens."""
    d = (lp - mu).reshape(-1)
    log("abs_log_ratio_mu", float(d.abs().mean()))
    q = float(torch.quantile(d.abs(), 0.9))
    log("q90_abs_log_ratio_mu", q)
    log("q_below_log1p_eps", float(q < LOG_1P_EPS))
    for k in ("clipfrac", "gate_rate", "mask_rate", "tau", "kl"):
        if k in metrics:
            log(k, float(metrics[k]))
    if method.loss in ("sat", "sat_gspo"):
        log("sat_q", float(metrics["sat_q"]))
        if method.loss == "sat":
            a = adv.reshape(-1)
            c_minus, c_plus, _ = sat_factors(d, torch.ones_like(d), cfg)
            r = d.exp()
            lo, hi = 1 - cfg.eps_low, 1 + cfg.eps_high
            lo2, hi2 = 1 - cfg.eps_low * c_minus, 1 + cfg.eps_high * c_plus
            ppo_clip = ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))
            sat_clip = ((a > 0) & (r > hi2)) | ((a < 0) & (r < lo2))
            log("sat_changed_rate", float((sat_clip & ~ppo_clip).float().mean()))
    if method.loss == "estr":
        score = d.square() / ((torch.ones_like(ent) if method.constant_entropy else ent)
                              .reshape(-1) + cfg.eps_h)
        tau = float(metrics["tau"])
        drop = score > tau
        e = ent.reshape(-1)
        if bool(drop.any()):
            log("masked_entropy_median", float(e[drop].median()))
            log("masked_entropy_max", float(e[drop].max()))
            log("masked_entropy_min", float(e[drop].min()))
        log("all_entropy_median", float(e.median()))


def grid(methods: list[Method], cfgs: list[SimConfig], seeds: list[int], progress
         ) -> list[dict[str, Any]]:
    """Every method x config x seed (seeds innermost, so a partial grid is paired)."""
    cells = []
    for m in methods:
        for cfg in cfgs:
            for s in seeds:
                c = run(m, cfg, s)
                cells.append(c)
                progress(f"{m.label:14s} lag {cfg.lag:2d} lr {cfg.lr:g} seed {s}: held-out "
                         f"{c['eval_curve'][0]:.3f} -> {c['final_eval']:.3f} (peak "
                         f"{c['peak_eval']:.3f}){' COLLAPSED' if c['collapsed'] else ''}")
    return cells


def values(cells: list[dict], metric: str = "final_eval", **where: Any) -> list[float]:
    """``metric`` of the cells matching ``where`` (e.g. method=, lag=), in seed order."""
    sel = [c for c in cells if all(c.get(k) == v for k, v in where.items())]
    return [c[metric] for c in sorted(sel, key=lambda c: c["seed"])]


def quick(cfg: SimConfig) -> SimConfig:
    """The --quick form of a config: a few iterations, few prompts (seconds)."""
    from dataclasses import replace

    return replace(cfg, iterations=3, prompts=4, group=4, updates=2, eval_prompts=16,
                   eval_every=3)
