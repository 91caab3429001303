"""The fused backend (``backend="fused"`` in any loss config): every registered loss with
its per-token work in hand-fused autograd nodes (closed-form backward, fewer [N] buffers;
see kernel.py), equal to the readable loss in value, gradient and metrics
(tests/unit/test_corrections_fused_reference.py). bench/bench_losses.py times both.

Most losses are their readable function with the PPO term (``ppo.ppo_token_loss``) or the
sequence surrogate (``ppo.clipped_surrogate``) swapped for its fused node; grpo, SAT, ESTR
and decoupled PPO have kernels of their own (the k3 term, the gated tail, the sparse mask
and the folded discrepancy weight inside the node).
"""

from __future__ import annotations

from functools import partial

from .. import decoupled as _decoupled
from .. import gspo as _gspo
from .. import mismatch as _mismatch
from .. import ppo as _ppo
from .. import sat as _sat
from .decoupled import decoupled_ppo, ppo_ewma_revised
from .estr import estr
from .grpo import grpo
from .kernel import fused_clipped_surrogate, fused_ppo_token_loss
from .sat import sat

ppo_clip = partial(_ppo.ppo_clip, token_loss=fused_ppo_token_loss)
tis = partial(_mismatch.tis, token_loss=fused_ppo_token_loss)
mis = partial(_mismatch.mis, token_loss=fused_ppo_token_loss)
icepop = partial(_mismatch.icepop, token_loss=fused_ppo_token_loss)
ppo_ewma = partial(_decoupled.ppo_ewma, token_loss=fused_ppo_token_loss)
gspo = partial(_gspo.gspo, surrogate=fused_clipped_surrogate)
gspo_token = partial(_gspo.gspo_token, surrogate=fused_clipped_surrogate)
sat_gspo = partial(_sat.sat_gspo, surrogate=fused_clipped_surrogate)

__all__ = ["decoupled_ppo", "estr", "grpo", "gspo", "gspo_token", "icepop", "mis",
           "ppo_clip", "ppo_ewma", "ppo_ewma_revised", "sat", "sat_gspo", "tis"]
