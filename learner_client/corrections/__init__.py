"""Off-policy correction losses: pure functions of per-token tensors (see corrections.md).

Public API
----------
* ``LossInputs`` (inputs.py): the one input type.
* ``LOSSES``: name -> ``LossSpec`` with ``.fn(inputs, config) -> (loss, metrics)``,
  ``.parts(inputs, config) -> (numerator, denominator, metrics)`` (loss = num / den; sums
  over micro-batches give the global aggregate), ``.per_token(inputs, config) ->
  TokenLoss``, ``.config_cls`` (pydantic, published defaults) and ``.aggregation``
  (default normalizer rule; see base.py). ``config`` may be None, a dict or the model.
* Each loss is the readable function of its module (ppo.py, gspo.py, mismatch.py,
  decoupled.py, sat.py, estr.py: paper notation, diagnostics beside the math; the
  definition). ``{"backend": "fused"}`` in its config runs the hand-fused kernels of
  ``fused/`` instead (``spec.reference`` / ``spec.fused``), equal by test.
* ``compute_loss(name, inputs, config=None) -> (loss, metrics)``; ``get_loss(name)``.
* ``advantages``: grpo_advantages, dr_grpo_advantages, dapo_dynamic_sampling_keep,
  overlong_penalty.
"""

from __future__ import annotations

from torch import Tensor

from . import advantages, decoupled, estr, fused, gspo, mismatch, ppo, sat
from .base import Aggregation, LossConfig, LossSpec, TokenLoss, aggregate
from .inputs import LossInputError, LossInputs

LOSSES: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    if spec.name in LOSSES:
        raise ValueError(f"loss {spec.name!r} registered twice")
    LOSSES[spec.name] = spec
    return spec


def _reg(name: str, cfg: type[LossConfig], module, doc: str, fn: str | None = None) -> None:
    """Register ``module.<fn>`` (the readable loss) with ``fused.<fn>`` as its fused backend;
    fn defaults to the loss's name."""
    fn = fn or name
    register(LossSpec(name=name, config_cls=cfg, reference=getattr(module, fn),
                      fused=getattr(fused, fn), doc=doc))


_reg("ppo_clip", ppo.PPOClipConfig, ppo, "PPO clipped surrogate, r = pi/pi_old.")
_reg("grpo", ppo.GRPOConfig, ppo, "GRPO: PPO clip, per-sequence token mean, k3 KL.")
_reg("dr_grpo", ppo.DrGRPOConfig, ppo, "Dr.GRPO: PPO clip, constant normalizer.", "ppo_clip")
_reg("dapo", ppo.DAPOConfig, ppo, "DAPO: clip-higher, token mean over the batch.", "ppo_clip")
_reg("gspo", gspo.GSPOConfig, gspo, "GSPO: length-normalized sequence ratio, seq clip.")
_reg("gspo_token", gspo.GSPOConfig, gspo, "GSPO-token: sg[s_i] * pi_t / sg[pi_t].")
_reg("tis", mismatch.TISConfig, mismatch, "PPO x truncated IS weight min(pi_old/mu, C).")
_reg("mis", mismatch.MISConfig, mismatch, "PPO x masked IS (token/sequence/geometric, veto).")
_reg("icepop", mismatch.IcePopConfig, mismatch, "PPO x IcePop band mask on pi_old/mu.")
_reg("decoupled_ppo", decoupled.DecoupledPPOConfig, decoupled,
     "AReaL decoupled PPO with the r_d x r_s decomposition and proximal modes.")
_reg("ppo_ewma", decoupled.PPOEWMAConfig, decoupled,
     "PPO-EWMA: (pi_prox/mu) * S(pi/pi_prox, A), total ratio capped.")
_reg("ppo_ewma_revised", decoupled.RevisedPPOEWMAConfig, decoupled,
     "Revised PPO-EWMA: EWMA proximal, r_d mask [1/c, c], PPO clip on pi/pi_prox.")
_reg("sat", sat.SATConfig, sat, "Staleness-Adaptive Trust Region on PPO (r = pi/mu).")
_reg("sat_gspo", sat.SATGSPOConfig, sat, "SAT on the GSPO sequence ratio.")
_reg("estr", estr.ESTRConfig, estr, "Entropy-Scaled Trust Region mask on PPO (r = pi/mu).")


def get_loss(name: str) -> LossSpec:
    try:
        return LOSSES[name]
    except KeyError:
        raise LossInputError(f"unknown loss {name!r}; known: {sorted(LOSSES)}") from None


def compute_loss(name: str, inputs: LossInputs, config: LossConfig | dict | None = None
                 ) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss and detached diagnostics of registered loss ``name``."""
    return get_loss(name).fn(inputs, config)


__all__ = ["LOSSES", "advantages", "Aggregation", "LossConfig", "LossInputError", "LossInputs",
           "LossSpec",
           "TokenLoss", "aggregate", "compute_loss", "get_loss", "register"]
