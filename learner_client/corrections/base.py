"""Loss specs, configs and the aggregation rules (how token losses become one scalar).

Every loss is split into a per-token part and an aggregation, so that an adapter
(Megatron's loss_func) can either take the scalar or re-aggregate itself:

* ``spec.fn(inputs, config) -> (loss, metrics)``: the scalar loss and diagnostics.
* ``spec.per_token(inputs, config) -> TokenLoss``: per-token loss [N] (already weighted by
  the method's masks/weights, 0 on inactive tokens), the denominator mask [N] (which
  tokens count in the normalizer: loss_mask, minus tokens the method rejects where the
  method says they leave the denominator), and the method's diagnostics.

Aggregations (``config.aggregation``):

* ``token_mean``: sum_t l_t / sum_t m_t over the whole batch (micro-batch). normalizer =
  number of denominator tokens. Megatron: return (loss * normalizer, normalizer, report)
  or use ``TokenLoss`` with calculate_per_token_loss.
* ``seq_mean_token_mean``: mean over sequences (with >= 1 denominator token) of each
  sequence's token mean. normalizer = number of such sequences; per-token weight is
  1 / (|o_i| * G). Not a plain token sum: Megatron should use the (loss, report) form.
* ``constant``: sum_t l_t / C with C = ``config.constant_normalizer``, or when that is None
  the number of token slots (N, i.e. B*T for padded inputs = G * L_max, Dr.GRPO's
  normalizer). normalizer = C.

metrics always hold ``num_active_tokens`` (loss_mask sum), ``num_denominator_tokens``,
``normalizer`` (the denominator: for token_mean the denominator tokens, for
seq_mean_token_mean the number of sequences, for constant C) and ``num_sequences`` when
sequences are known. All metrics are detached 0-dim tensors.

For Megatron: ``spec.parts(inputs, config) -> (numerator, denominator, metrics)`` gives the
pair whose sums over micro-batches/ranks reproduce the global aggregate (the
(loss, num_tokens, report) form with calculate_per_token_loss); ``spec.fn`` gives the
already-normalized per-micro-batch loss (the (loss, report) form).

Backends (``config.backend``): every loss is the readable function of its module (plain
autograd, the paper's notation, diagnostics beside the math: the definition);
``backend="fused"`` runs the same loss through the hand-fused kernels of ``fused/`` (one
autograd node per loss, closed-form backward, fewer [N] buffers), equal in value, gradient
and metrics (tests/unit/test_corrections_fused_reference.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from .inputs import LossInputError, LossInputs

Aggregation = Literal["token_mean", "seq_mean_token_mean", "constant"]
Backend = Literal["reference", "fused"]


class LossConfig(BaseModel):
    """Fields every loss config has. Subclasses set their published defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    aggregation: Aggregation = Field(
        "token_mean",
        description="How per-token losses become one scalar: token_mean (over the batch's "
                    "denominator tokens), seq_mean_token_mean (mean of per-sequence token "
                    "means), constant (sum / constant_normalizer).")
    constant_normalizer: float | None = Field(
        None, gt=0,
        description="Divisor for aggregation='constant'; None = number of token slots N "
                    "(B*T for padded input, Dr.GRPO's G*L_max).")
    backend: Backend = Field(
        "reference",
        description="Which implementation computes the loss. 'reference': the readable "
                    "function of the loss's module (plain autograd, the definition). "
                    "'fused': the hand-fused kernel of corrections/fused/ (one autograd node, "
                    "closed-form backward, fewer [N] buffers; faster on large batches), "
                    "equal to the reference in value, gradient and metrics by test.")


class ClipConfig(LossConfig):
    """The fields of every loss built on PPO's clipped surrogate S(r, A; 1 - eps_low,
    1 + eps_high) (each loss's docstring says which ratio r is; a loss with other published
    clips re-declares eps_low / eps_high)."""

    eps_low: float = Field(0.2, ge=0.0, lt=1.0, description="Lower clip: r >= 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0.0, description="Upper clip: r <= 1 + eps_high.")
    dual_clip: float | None = Field(
        None, gt=1.0,
        description="Dual clip c (Ye et al. 2020): for A < 0 the token loss is capped at "
                    "c*|A|, so one corrupt token (ratio up to e^20) cannot dominate the "
                    "loss. None (the paper's form) disables it.")


@dataclass
class TokenLoss:
    """Per-token result of a loss before aggregation."""

    loss: Tensor  # [N], 0 where not counted; carries grad through logprobs
    denom_mask: Tensor  # [N] float 0/1, tokens that count in the normalizer (detached)
    metrics: dict[str, Tensor] = field(default_factory=dict)


TokenFn = Callable[[LossInputs, LossConfig], TokenLoss]


def aggregate_parts(tok: TokenLoss, inputs: LossInputs, cfg: LossConfig
                    ) -> tuple[Tensor, Tensor]:
    """(numerator, denominator) with loss = numerator / denominator.

    Summing numerators and denominators over micro-batches / data-parallel ranks gives the
    global aggregate of the same kind: token_mean -> (token-loss sum, denominator tokens);
    seq_mean_token_mean -> (sum of per-sequence token means, sequences with active tokens);
    constant -> (token-loss sum, C). This is the pair for Megatron's
    ``calculate_per_token_loss`` form (loss_sum, num_tokens, report).
    """
    m = tok.denom_mask
    if cfg.aggregation == "token_mean":
        return tok.loss.sum(), _denom_tokens(tok, inputs)
    if cfg.aggregation == "constant":
        c = cfg.constant_normalizer if cfg.constant_normalizer is not None else float(
            inputs.num_tokens)
        return tok.loss.sum(), torch.tensor(float(c), dtype=tok.loss.dtype,
                                            device=tok.loss.device)
    if cfg.aggregation == "seq_mean_token_mean":
        cnt = inputs.seq_active_counts if m is inputs.mask else inputs.seq_sum(m)
        per_seq = inputs.seq_sum(tok.loss) / cnt.clamp_min(1.0)
        return per_seq.sum(), (cnt > 0).to(per_seq.dtype).sum()
    raise LossInputError(f"unknown aggregation {cfg.aggregation!r}")


def aggregate(tok: TokenLoss, inputs: LossInputs, cfg: LossConfig
              ) -> tuple[Tensor, dict[str, Tensor]]:
    """Reduce a TokenLoss to (scalar loss, metrics) following ``cfg.aggregation``."""
    num, den = aggregate_parts(tok, inputs, cfg)
    loss = num / den.clamp_min(1e-12) if cfg.aggregation == "constant" else num / den.clamp_min(1.0)
    return loss, _metrics(tok, inputs, den)


def _denom_tokens(tok: TokenLoss, inputs: LossInputs) -> Tensor:
    """Number of denominator tokens (the cached mask count when the mask is the denominator)."""
    return inputs.mask_count if tok.denom_mask is inputs.mask else tok.denom_mask.sum()


def _metrics(tok: TokenLoss, inputs: LossInputs, den: Tensor) -> dict[str, Tensor]:
    metrics = dict(tok.metrics)
    metrics["num_active_tokens"] = inputs.mask_count
    metrics["num_denominator_tokens"] = _denom_tokens(tok, inputs)
    if inputs.has_sequences:
        metrics["num_sequences"] = torch.tensor(float(inputs.num_sequences),
                                                 device=den.device)
    metrics["normalizer"] = den.detach().to(torch.float32)
    return {k: v.detach() for k, v in metrics.items()}


@dataclass(frozen=True)
class LossSpec:
    """A registered loss: name, config model (published defaults), the readable per-token
    function (``reference``) and its fused backend (``fused``, chosen by config.backend)."""

    name: str
    config_cls: type[LossConfig]
    reference: TokenFn
    fused: TokenFn
    doc: str = ""

    @property
    def aggregation(self) -> Aggregation:
        """The default aggregation of this loss (a config may override it)."""
        return self.config_cls.model_fields["aggregation"].default

    def config(self, config: LossConfig | dict | None = None) -> LossConfig:
        """Validate/complete a config: None -> defaults; dict -> parsed; model -> checked."""
        if config is None:
            return self.config_cls()
        if isinstance(config, dict):
            return self.config_cls.model_validate(config)
        if not isinstance(config, self.config_cls):
            raise LossInputError(
                f"loss {self.name!r} takes {self.config_cls.__name__}, got {type(config).__name__}")
        return config

    def token_fn(self, inputs: LossInputs, cfg: LossConfig) -> TokenLoss:
        """The TokenLoss of the backend ``cfg.backend`` names (cfg already validated)."""
        return (self.fused if cfg.backend == "fused" else self.reference)(inputs, cfg)

    def per_token(self, inputs: LossInputs, config: LossConfig | dict | None = None) -> TokenLoss:
        return self.token_fn(inputs, self.config(config))

    def fn(self, inputs: LossInputs, config: LossConfig | dict | None = None
           ) -> tuple[Tensor, dict[str, Tensor]]:
        """(scalar loss, detached metrics)."""
        cfg = self.config(config)
        return aggregate(self.token_fn(inputs, cfg), inputs, cfg)

    def parts(self, inputs: LossInputs, config: LossConfig | dict | None = None
              ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(numerator, denominator, metrics), loss = numerator / denominator; see
        ``aggregate_parts`` for how they add up across micro-batches and ranks."""
        cfg = self.config(config)
        tok = self.token_fn(inputs, cfg)
        num, den = aggregate_parts(tok, inputs, cfg)
        return num, den.detach(), _metrics(tok, inputs, den)
