"""A single-rank megatron-core world (gloo, TP=1) for CPU unit tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def single_rank_model_parallel() -> Iterator[None]:
    """Initialise torch.distributed (gloo, world 1) and megatron's parallel state; tear
    both down on exit so the next module can initialise again."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rollout_gateway.commands.engine_process import free_port

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
