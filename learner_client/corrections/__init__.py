"""Off-policy correction losses: pure functions of per-token tensors (see corrections.md).

Public API
----------
* ``LossInputs`` (inputs.py): the one input type.
* ``LOSSES``: name -> ``LossSpec`` with ``.fn(inputs, config) -> (loss, metrics)``,
  ``.parts(inputs, config) -> (numerator, denominator, metrics)`` (loss = num / den; sums
  over micro-batches give the global aggregate), ``.per_token(inputs, config) ->
  TokenLoss``, ``.config_cls`` (pydantic, published defaults) and ``.aggregation``
  (default normalizer rule; see base.py). ``config`` may be None, a dict or the model.
* ``compute_loss(name, inputs, config=None) -> (loss, metrics)``; ``get_loss(name)``.
* ``advantages``: grpo_advantages, dr_grpo_advantages, dapo_dynamic_sampling_keep,
  overlong_penalty.
"""

from __future__ import annotations

from torch import Tensor

from . import advantages, decoupled, estr, gspo, mismatch, ppo, sat
from .base import Aggregation, LossConfig, LossSpec, TokenLoss, aggregate
from .inputs import LossInputError, LossInputs

LOSSES: dict[str, LossSpec] = {}


def register(spec: LossSpec) -> LossSpec:
    if spec.name in LOSSES:
        raise ValueError(f"loss {spec.name!r} registered twice")
    LOSSES[spec.name] = spec
    return spec


def _reg(name: str, cfg: type[LossConfig], fn, doc: str) -> None:
    register(LossSpec(name=name, config_cls=cfg, token_fn=fn, doc=doc))


_reg("ppo_clip", ppo.PPOClipConfig, ppo.ppo_clip, "PPO clipped surrogate, r = pi/pi_old.")
_reg("grpo", ppo.GRPOConfig, ppo.grpo, "GRPO: PPO clip, per-sequence token mean, k3 KL.")
_reg("dr_grpo", ppo.DrGRPOConfig, ppo.dr_grpo, "Dr.GRPO: PPO clip, constant normalizer.")
_reg("dapo", ppo.DAPOConfig, ppo.dapo, "DAPO: clip-higher, token mean over the batch.")
_reg("gspo", gspo.GSPOConfig, gspo.gspo, "GSPO: length-normalized sequence ratio, seq clip.")
_reg("gspo_token", gspo.GSPOConfig, gspo.gspo_token, "GSPO-token: sg[s_i] * pi_t / sg[pi_t].")
_reg("tis", mismatch.TISConfig, mismatch.tis, "PPO x truncated IS weight min(pi_old/mu, C).")
_reg("mis", mismatch.MISConfig, mismatch.mis, "PPO x masked IS (token/sequence/geometric, veto).")
_reg("icepop", mismatch.IcePopConfig, mismatch.icepop, "PPO x IcePop band mask on pi_old/mu.")
_reg("decoupled_ppo", decoupled.DecoupledPPOConfig, decoupled.decoupled_ppo,
     "AReaL decoupled PPO with the r_d x r_s decomposition and proximal modes.")
_reg("ppo_ewma", decoupled.PPOEWMAConfig, decoupled.ppo_ewma,
     "PPO-EWMA: (pi_prox/mu) * S(pi/pi_prox, A), total ratio capped.")
_reg("ppo_ewma_revised", decoupled.RevisedPPOEWMAConfig, decoupled.ppo_ewma_revised,
     "Revised PPO-EWMA: EWMA proximal, r_d mask [1/c, c], PPO clip on pi/pi_prox.")
_reg("sat", sat.SATConfig, sat.sat, "Staleness-Adaptive Trust Region on PPO (r = pi/mu).")
_reg("sat_gspo", sat.SATGSPOConfig, sat.sat_gspo, "SAT on the GSPO sequence ratio.")
_reg("estr", estr.ESTRConfig, estr.estr, "Entropy-Scaled Trust Region mask on PPO (r = pi/mu).")


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
