"""Plain PyTorch / transformers learner adapter (CPU demos, R3 on the reference model).

* ``checkpoint``: :func:`load_model`, :func:`save_for_engine` (the engine's format).
* ``forward``: :func:`packed_logprobs`, :func:`padded_logprobs`.
* ``r3``: :func:`replay_routing`, :func:`record_routing` for Qwen3-MoE.

Importing this package imports torch but not transformers (loaded on first use).
"""

from learner_client.hf.checkpoint import load_model, save_for_engine
from learner_client.hf.forward import packed_logprobs, padded_logprobs
from learner_client.hf.r3 import RoutingReplayError, moe_gates, record_routing, replay_routing

__all__ = ["RoutingReplayError", "load_model", "moe_gates", "packed_logprobs", "padded_logprobs",
           "record_routing", "replay_routing", "save_for_engine"]
