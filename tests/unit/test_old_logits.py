"""Old-logit strategies: snapshot store + per-version recompute, EWMA tracker, fill hook."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from learner_client.corrections import LossInputs, compute_loss
from learner_client.old_logits import (EwmaWeightTracker, FillContext, SnapshotMissing,
                                       WeightSnapshotStore, ewma_strategy, fill_old_logprobs,
                                       functional_runner, live_window, snapshot_strategy,
                                       staleness_beta)

V, D = 11, 6


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.out = nn.Linear(D, V)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # [B, T] -> logits [B, T, V]
        return self.out(torch.tanh(self.emb(tokens)))


def _logprobs_of(forward, inputs, targets):
    logits = forward(inputs)
    return torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]


def _versions_of_model(n_versions=3, seed=0):
    torch.manual_seed(seed)
    model = TinyLM()
    snaps = []
    for _ in range(n_versions):
        snaps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
    return model, snaps


def test_store_is_bounded_lru_and_copies():
    store = WeightSnapshotStore(max_versions=2)
    w = {"a": torch.ones(3)}
    store.put(1, w)
    w["a"].add_(1.0)  # the live weights change after the snapshot
    store.put(2, w)
    assert store.get(1)["a"].tolist() == [1.0, 1.0, 1.0]  # not aliased; 1 is now most recent
    store.put(3, w)  # evicts 2, the least recently used
    assert store.versions == [1, 3] and store.evictions == 1
    with pytest.raises(SnapshotMissing, match="version 2"):
        store.get(2)
    assert store.drop_older_than(3) == 1 and store.versions == [3]
    assert store.nbytes() == 3 * 4
    assert live_window([4, 6, 5]) == 3 and live_window([]) == 0


def test_recompute_groups_by_version_and_matches_each_version():
    model, snaps = _versions_of_model()
    store = WeightSnapshotStore(max_versions=3)
    for v, s in enumerate(snaps):
        store.put(v, s)
    g = torch.Generator().manual_seed(1)
    inputs = torch.randint(0, V, (2, 5), generator=g)
    targets = torch.randint(0, V, (2, 5), generator=g)
    versions = torch.tensor([[0, 0, 1, 1, 2], [1, 2, 2, 2, 0]])
    calls = []

    run_inner = functional_runner(model, lambda fwd: _logprobs_of(fwd, inputs, targets))

    def run(weights, idx):
        calls.append(idx.clone())
        return run_inner(weights, idx)

    live_before = {k: v.clone() for k, v in model.state_dict().items()}
    got = store.recompute(versions, run, dtype=torch.float64)
    assert len(calls) == 3  # one call per distinct version
    for v, s in enumerate(snaps):  # independent: load each version into a fresh model
        ref_model = TinyLM()
        ref_model.load_state_dict(s)
        with torch.no_grad():
            ref = _logprobs_of(ref_model, inputs, targets)
        sel = versions == v
        assert torch.allclose(got[sel], ref[sel], atol=1e-6)
    for k, v in model.state_dict().items():  # the live model was not touched
        assert torch.equal(v, live_before[k])
    store2 = WeightSnapshotStore(max_versions=1)
    store2.put(2, snaps[2])
    with pytest.raises(SnapshotMissing):
        store2.recompute(versions, run)
    part = store2.recompute(versions, run, missing="nan")
    assert torch.isnan(part[versions != 2]).all() and not torch.isnan(part[versions == 2]).any()


def test_ewma_debiased_matches_closed_form():
    torch.manual_seed(0)
    thetas = [{"w": torch.randn(4, dtype=torch.float64)} for _ in range(5)]
    tr = EwmaWeightTracker(w_stale=2, dtype=torch.float64)
    assert tr.beta == pytest.approx(0.5) == staleness_beta(2)
    tr.update(thetas[0])
    assert torch.equal(tr.weights["w"], thetas[0]["w"])  # first update = theta exactly
    for t in thetas[1:]:
        tr.update(t)
    b = 0.5
    num = sum(b ** (4 - k) * thetas[k]["w"] for k in range(5))
    den = sum(b ** (4 - k) for k in range(5))
    assert torch.allclose(tr.weights["w"], num / den, rtol=1e-12)
    assert tr.W == pytest.approx(den)


def test_ewma_auto_reset_below_point_nine():
    tr = EwmaWeightTracker(w_stale=4)
    assert tr.beta == pytest.approx(4 / 6)
    tr.update({"w": torch.zeros(2)})
    tr.update({"w": torch.ones(2)})
    assert not tr.maybe_reset(0.95, {"w": torch.full((2,), 7.0)})
    assert tr.weights["w"].tolist() != [7.0, 7.0]
    assert tr.maybe_reset(torch.tensor(0.85), {"w": torch.full((2,), 7.0)})
    assert tr.weights["w"].tolist() == [7.0, 7.0] and tr.W == 1.0 and tr.resets == 1
    tr.set_window(0)
    assert tr.beta == 0.0


def test_fill_keeps_present_and_fills_missing():
    old = torch.tensor([-1.0, float("nan"), -2.0, float("nan"), float("nan")])
    mu = torch.tensor([-1.5, -0.5, -2.5, -0.7, -0.9])
    lp = torch.tensor([-1.1, -0.4, -2.1, -0.6, -1.0])
    ver = torch.tensor([3, 3, 4, 2, 5])
    ctx = FillContext(rollout_logprobs=mu, logprobs=lp, versions=ver, learner_version=5)
    b, counts = fill_old_logprobs(old, "behavior", ctx)
    assert b.tolist() == pytest.approx([-1.0, -0.5, -2.0, -0.7, -0.9])
    assert counts == {"present": 2, "filled": 3, "left_inactive": 0}
    c, _ = fill_old_logprobs(old, "current", ctx)
    assert c.tolist() == pytest.approx([-1.0, -0.4, -2.0, -0.6, -1.0])
    ll, _ = fill_old_logprobs(old, "loglinear", ctx)
    # alpha: v=3 -> (4-3)/(5-3) = 0.5; v=2 -> 2/3; v=5 -> 0
    assert ll.tolist() == pytest.approx([-1.0, -0.5 + 0.5 * 0.1, -2.0,
                                         -0.7 + (2 / 3) * 0.1, -0.9])
    none, counts2 = fill_old_logprobs(None, "behavior", ctx)
    assert torch.equal(none, mu) and counts2["filled"] == 5
    with pytest.raises(ValueError, match="unknown fill strategy"):
        fill_old_logprobs(old, "bogus", ctx)


def test_fill_with_snapshots_computes_only_missing_then_feeds_a_loss():
    model, snaps = _versions_of_model(n_versions=2, seed=3)
    store = WeightSnapshotStore(max_versions=4)
    for v, s in enumerate(snaps):
        store.put(v, s)
    inputs = torch.tensor([[1, 2, 3, 4]])
    targets = torch.tensor([[2, 3, 4, 5]])
    versions = torch.tensor([[0, 0, 1, 1]])
    seen = []
    inner = functional_runner(model, lambda fwd: _logprobs_of(fwd, inputs, targets))

    def run(w, idx):
        seen.extend(idx.tolist())
        return inner(w, idx)

    old = torch.tensor([[-3.0, float("nan"), float("nan"), -4.0]], dtype=torch.float64)
    ctx = FillContext(versions=versions)
    filled, counts = fill_old_logprobs(old, snapshot_strategy(store, run), ctx)
    assert sorted(seen) == [1, 2] and counts["filled"] == 2
    exact = store.recompute(versions, inner, dtype=torch.float64)
    assert filled[0, 0].item() == -3.0 and filled[0, 3].item() == -4.0
    assert filled[0, 1].item() == pytest.approx(exact[0, 1].item())
    assert filled[0, 2].item() == pytest.approx(exact[0, 2].item())
    lp = exact.clone().requires_grad_()
    loss, m = compute_loss("decoupled_ppo", LossInputs(lp, exact - 0.1, torch.ones_like(lp),
                                                       torch.ones_like(lp), old_logprobs=filled))
    assert math.isfinite(loss.item()) and m["behav_weight_mean"].item() > 0
    tr = EwmaWeightTracker(w_stale=1, dtype=None)
    for s in snaps:
        tr.update(s)
    e, _ = fill_old_logprobs(old, ewma_strategy(tr, inner), ctx)
    assert not torch.isnan(e).any() and e[0, 1].item() != filled[0, 1].item()
