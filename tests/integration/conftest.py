"""Reference-engine fixtures for integration tests (reusable by every part).

Stable names:

``engine`` (session)
    One shared :class:`~rollout_gateway.commands.engine_process.EngineProcess` (seed 1, weight
    version "0", toy config). Do not change its weights or pause it; use ``make_engine``.
``make_engine`` (function)
    Factory ``make_engine(**kwargs) -> EngineProcess`` (kwargs of ``EngineProcess``:
    seed, checkpoint, weight_version, incremental_streaming_output, max_running_requests,
    step_delay_ms, ...). Started and ready; stopped at the end of the test.
``checkpoint_v1`` / ``checkpoint_v2`` (session)
    Checkpoint dirs built by ``init_checkpoint`` with seeds 1 (same weights as ``engine``)
    and 2 (different weights, e.g. to hot-swap to).
``reference_model`` (session)
    ``reference_model(source)`` -> a cached :class:`Qwen3MoeLM` for a checkpoint dir or a
    ``(ModelConfig, seed)`` pair; score with ``reference_engine.reference.score`` /
    ``score_mixed`` to check what an engine stamped.
``redis_cluster`` (session)
    A :class:`_cluster_support.LocalCluster` of 3 masters + 3 replicas on loopback (started
    on first use, ~3 s): ``.url`` is its ``redis+cluster://`` URL. Shared: use a unique
    key prefix, and never kill its nodes (start your own ``LocalCluster`` for that).
``ENGINE_SEED`` = 1 is the seed of ``engine``'s weights.
"""

from __future__ import annotations

import pytest

from rollout_gateway.commands.engine_process import EngineProcess

ENGINE_SEED = 1


@pytest.fixture(scope="session")
def engine():
    with EngineProcess(seed=ENGINE_SEED, weight_version="0") as eng:
        yield eng


@pytest.fixture
def make_engine():
    started: list[EngineProcess] = []

    def factory(**kwargs) -> EngineProcess:
        eng = EngineProcess(**kwargs)
        started.append(eng)
        return eng.start()

    yield factory
    for eng in started:
        eng.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    from _cluster_support import LocalCluster

    with LocalCluster(masters=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def checkpoint_v1(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt_v1"), seed=ENGINE_SEED)


@pytest.fixture(scope="session")
def checkpoint_v2(tmp_path_factory):
    from reference_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("ckpt_v2"), seed=2)


@pytest.fixture(scope="session")
def reference_model():
    import torch

    from reference_engine.reference import model_from

    torch.set_num_threads(1)
    cache: dict = {}

    def get(source):
        key = str(source) if not isinstance(source, tuple) else (source[0].model_dump_json(), source[1])
        if key not in cache:
            cache[key] = model_from(source)
        return cache[key]

    return get
