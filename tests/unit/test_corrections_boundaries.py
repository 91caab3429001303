"""Package boundaries and the 'no N x vocab tensor' guarantee of the losses."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_learner_side_does_not_import_the_gateway():
    code = ("import sys; import learner_client.corrections, learner_client.old_logits, "
            "learner_client.staleness_monitor; "
            "bad = [m for m in sys.modules if m.startswith('rollout_gateway')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


def _bench_module():
    path = ROOT / "bench" / "bench_losses.py"
    spec = importlib.util.spec_from_file_location("bench_losses", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_no_loss_allocates_more_than_order_n(backend):
    bench = _bench_module()
    from learner_client.corrections import LOSSES, LossInputs, compute_loss

    n = 4096
    data = bench.make_inputs(n, 256)
    for name in LOSSES:
        x = data["logprobs"].clone().requires_grad_()
        with bench.MaxNumel() as tr:
            loss, _ = compute_loss(name, LossInputs(**{**data, "logprobs": x}),
                                   {"backend": backend})
            loss.backward()
        assert tr.max_numel <= 2 * n, (name, tr.max_numel, tr.op)
    with bench.MaxNumel() as tr:  # the tracer does see an N x vocab allocation
        torch.zeros(n, 64).sum()
    assert tr.max_numel == n * 64
