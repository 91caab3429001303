"""Fixtures of the security suite: a reference engine, and the integration helpers
(``GatewayProcess``) on the import path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from rollout_gateway.commands.engine_process import EngineProcess  # noqa: E402


@pytest.fixture(scope="session")
def engine():
    with EngineProcess(seed=1, weight_version="0") as eng:
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
