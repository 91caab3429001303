"""Fixtures of the fault suite (its parts live in _faults_support.py)."""

from __future__ import annotations

import os

import pytest
from _faults_support import FAULT_SEED, RedisServer

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def redis_server(tmp_path):
    """Our own redis-server (AOF, fsync as shipped) on a free port, in a temp dir."""
    srv = RedisServer(tmp_path).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def fault_models():
    """version -> reference model of the engines built with seed FAULT_SEED + version."""
    import torch

    from reference_engine.config import ModelConfig
    from reference_engine.reference import model_from

    torch.set_num_threads(1)

    class Models(dict):
        def __missing__(self, v):
            self[v] = model_from((ModelConfig(), FAULT_SEED + v))
            return self[v]

    return Models()
