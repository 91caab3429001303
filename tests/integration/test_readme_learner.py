"""Docs that run: the README's learner snippet, verbatim, for every registered loss, against a
real ``rollout-gateway serve`` in front of a real reference engine (real gRPC pulls of
stamped trajectories, one batch of 64 each).

The test gives the snippet only what it leaves to the reader: ``model_logprobs`` and
``ref_model_logprobs`` (stand-ins for the learner's model and a frozen reference model:
the stamped behavior logprobs plus a little noise) and its two settings lines (``GATEWAY``,
this gateway's gRPC port; ``LOSS``). Each run publishes what the snippet pulls: 63
rollouts over ``/v1/rollouts`` (no reward) and one agent session ended with a reward, so
the advantages are not all zero and the loss reaches the model."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch
from _gateway_support import GatewayProcess, rollout

from learner_client.corrections import LOSSES

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
PULL = 64  # the snippet's client.pull(64, ...)


def readme_learner_snippet() -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.DOTALL)
    return next(b for b in blocks if "TrajectoryClient(" in b and "compute_loss(" in b)


def with_setting(code: str, name: str, value: str) -> str:
    """The snippet with its settings line ``NAME = ...`` set to ``value``; nothing else."""
    line = re.compile(rf"^{name} = .*$", re.MULTILINE)
    assert len(line.findall(code)) == 1, f"the README snippet has no single {name} line"
    return line.sub(f"{name} = {value!r}", code)


def model_logprobs(batch) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    noise = 0.05 * torch.randn(batch.rollout_logprobs.shape, generator=g)
    return (batch.rollout_logprobs + noise).requires_grad_(True)


def ref_model_logprobs(batch) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return batch.rollout_logprobs + 0.05 * torch.randn(batch.rollout_logprobs.shape, generator=g)


@pytest.fixture(scope="module")
def gateway(engine):
    with GatewayProcess({"e0": engine.url}) as gw:
        yield gw


def publish_one_batch(gw: GatewayProcess, tag: str) -> None:
    """PULL trajectories in the store: PULL - 1 plain rollouts, one rewarded session."""
    rollout(gw.url, [3, 1, 4, 1, 5], n=PULL - 1, max_new_tokens=3)
    r = httpx.post(gw.url + "/v1/completions", headers={"x-session-id": tag}, timeout=60,
                   json={"model": "reference", "prompt": [2, 7, 1, 8], "max_tokens": 3})
    assert r.status_code == 200, r.text
    r = httpx.post(gw.url + f"/v1/sessions/{tag}/end", json={"reward": 1.0}, timeout=60)
    assert r.status_code == 200 and r.json()["published"], r.text


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_readme_learner_snippet_runs_verbatim_against_serve(gateway, name):
    publish_one_batch(gateway, f"readme-{name}")
    code = with_setting(readme_learner_snippet(), "GATEWAY", f"127.0.0.1:{gateway.grpc_port}")
    code = with_setting(code, "LOSS", name)
    ns = {"model_logprobs": model_logprobs, "ref_model_logprobs": ref_model_logprobs}
    exec(compile(code, str(README), "exec"), ns)  # noqa: S102 (the README, run as written)
    loss, metrics, batch = ns["loss"], ns["metrics"], ns["batch"]
    assert len(ns["rollouts"]) == PULL and bool((batch.rewards == 1.0).any())
    assert torch.isfinite(loss), (name, loss)
    g = ns["logprobs"].grad
    assert g is not None and bool(torch.isfinite(g).all())
    assert bool((g[batch.loss_mask == 0] == 0).all())
    assert bool((g[batch.loss_mask > 0] != 0).any())  # the loss reaches the model
    assert all(bool(torch.isfinite(v).all()) for v in metrics.values()), metrics
