"""Megatron-Core adapter: packing, vocab-parallel logprobs, loss_func, routing replay (R3).

Submodules (megatron-core is imported lazily, only where it is needed):

* ``packing``: :func:`pack_samples` -> :class:`PackedBatch` (THD layout, CP/SP padding).
* ``logprobs``: :func:`vocab_parallel_logprobs_entropy` (TP-aware, chunked, no in-place).
* ``loss``: :func:`make_loss_func` for ``forward_step`` (3-tuple return form).
* ``router_replay``: feed rollout routing into megatron-core's ``RouterReplay``.
* ``forward_step``: :func:`make_forward_step` (packed GPTModel call + R3 + loss_func).
"""

from learner_client.megatron.packing import (
    PackedBatch,
    PackSample,
    pack_samples,
    sequence_padding_multiple,
)

__all__ = ["PackSample", "PackedBatch", "pack_samples", "sequence_padding_multiple"]
