"""Sampling math (pure torch, no I/O).

As SGLang: logprobs and entropy come from the temperature-scaled distribution *before*
top-p/top-k/min-p filtering; temperature below 1e-6 means greedy, treated as temperature
1.0 with top_k=1 (so the reported logprobs are those of the unscaled distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GREEDY_EPS = 1e-6


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or >= vocab: disabled
    min_p: float = 0.0

    @property
    def is_plain(self) -> bool:
        """No top-k/top-p/min-p filtering: sample the scaled distribution as is."""
        return self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0.0

    @classmethod
    def make(cls, temperature: float, top_p: float, top_k: int, min_p: float) -> SamplingSpec:
        if temperature < GREEDY_EPS:
            return cls(1.0, 1.0, 1, 0.0)
        return cls(float(temperature), float(top_p), int(top_k), float(min_p))


@dataclass
class SampleResult:
    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] float32: logprob of the sampled token (temperature-scaled)
    entropy: torch.Tensor  # [B] float32: exact entropy of the temperature-scaled distribution
    logp: torch.Tensor  # [B, V] float32 full temperature-scaled log-distribution


def scaled_logprobs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) row-wise, float32."""
    return torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)


def entropy_of(logp: torch.Tensor) -> torch.Tensor:
    """Exact entropy of each row's distribution given its log-probabilities."""
    return -(logp.exp() * logp).sum(-1)


def filtered_probs(logp: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """The distribution actually sampled from: top-k, then top-p, then min-p, renormalized."""
    probs = logp.exp()
    vocab = probs.shape[-1]
    if 0 < spec.top_k < vocab:
        kth = torch.topk(probs, spec.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if spec.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        csum = torch.cumsum(sp, 0)
        drop = (csum - sp) > spec.top_p * csum[-1]
        sp = torch.where(drop, torch.zeros_like(sp), sp)
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    if spec.min_p > 0.0:
        probs = torch.where(probs >= spec.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs / probs.sum()


def sample(logits: torch.Tensor, specs: list[SamplingSpec],
           generators: list[torch.Generator | None]) -> SampleResult:
    """Sample one token per row of ``logits`` [B, V]."""
    temps = torch.tensor([s.temperature for s in specs], dtype=torch.float32)
    logp = scaled_logprobs(logits, temps)
    ent = entropy_of(logp)
    toks = torch.empty(len(specs), dtype=torch.long)
    plain = []  # unseeded rows without filters: one multinomial call for all of them
    for i, (spec, gen) in enumerate(zip(specs, generators)):
        if spec.top_k == 1:
            toks[i] = torch.argmax(logp[i])
        elif gen is None and spec.is_plain:
            plain.append(i)
        else:
            toks[i] = torch.multinomial(filtered_probs(logp[i], spec), 1, generator=gen)[0]
    if plain:
        rows = torch.tensor(plain)
        toks[rows] = torch.multinomial(logp[rows].exp(), 1)[:, 0]
    lp = logp.gather(1, toks[:, None])[:, 0]
    return SampleResult(tokens=toks, logprobs=lp, entropy=ent, logp=logp)
