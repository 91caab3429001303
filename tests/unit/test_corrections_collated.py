"""The learner path on a real collated batch (wire bytes -> decode -> collate -> loss):
GRPO's reference-model input, old-logprob filling on the active tokens only, the staleness
monitor's sentinels, infinite scores and the dual clip. (The README's learner snippet runs
against a real gateway: tests/integration/test_readme_learner.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from learner_client.batch import collate
from learner_client.corrections import LossInputError, LossInputs, compute_loss
from learner_client.old_logits import (FillContext, WeightSnapshotStore, fill_old_logprobs,
                                       snapshot_strategy)
from learner_client.staleness_monitor import StalenessMonitor, batch_lags
from learner_client.wire import parse_batch
from rollout_gateway.core import trajectory_codec
from doubles.trajectories import make_trajectory
from rollout_proto import codec


def _rollouts(old_for=(0,)):
    specs = [(3, 6, (4, 5)), (2, 4, (5,)), (4, 7, (3, 4, 5))]
    entries = []
    for i, (p, t, versions) in enumerate(specs):
        tr = make_trajectory(f"t{i}", prompt_len=p, num_tokens=t, versions=versions,
                             num_layers=2, top_k=2, num_experts=8, seed=i,
                             old_logprobs=i in old_for, reward=float(i))
        entries.append((str(i + 1), 1, False, trajectory_codec.encode(tr)))
    return parse_batch(codec.encode_batch(entries, 0, 0))[0]


def _model_logprobs(batch):
    g = torch.Generator().manual_seed(0)
    lp = batch.rollout_logprobs + 0.05 * torch.randn(batch.rollout_logprobs.shape, generator=g)
    return lp.requires_grad_(True)


def test_grpo_on_a_collated_batch_needs_ref_logprobs():
    """GRPO's k3 KL (beta 0.04) needs a reference model: a clear refusal without
    ref_logprobs, a finite loss with them (the README snippet passes them; it runs against
    a real gateway in tests/integration/test_readme_learner.py)."""
    batch = collate(_rollouts(), learner_version=6, layout="packed")
    lp = _model_logprobs(batch)
    adv = torch.tensor([1.0, -1.0, 0.5])
    with pytest.raises(LossInputError, match="ref_logprobs"):
        compute_loss("grpo", batch.loss_inputs(lp, adv, fill_old="behavior"))
    loss, _ = compute_loss("grpo", batch.loss_inputs(lp, adv, fill_old="behavior",
                                                     ref_logprobs=batch.rollout_logprobs))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_losses_on_a_collated_batch_with_partial_old_logprobs(layout):
    """collate puts NaN in old_logprobs outside responses and for rollouts without the
    column: the PPO family falls back to mu per token, the pi_old losses refuse clearly."""
    batch = collate(_rollouts(old_for=(0,)), learner_version=6, layout=layout)
    assert batch.old_logprobs is not None and bool(torch.isnan(batch.old_logprobs).any())
    lp = _model_logprobs(batch)
    adv = torch.tensor([1.0, -1.0, 0.5])
    inp = batch.loss_inputs(lp, adv)
    for name in ("ppo_clip", "dapo", "dr_grpo", "gspo", "gspo_token", "sat", "estr",
                 "sat_gspo"):
        loss, _ = compute_loss(name, inp)
        assert torch.isfinite(loss), name
    # the fallback is per token: equal to the loss with mu written where old is NaN
    mu = batch.rollout_logprobs
    manual = torch.where(torch.isnan(batch.old_logprobs), mu, batch.old_logprobs)
    a, _ = compute_loss("ppo_clip", inp)
    b, _ = compute_loss("ppo_clip", batch.loss_inputs(lp, adv, old_logprobs=manual))
    assert torch.equal(a, b)
    for name in ("tis", "mis", "icepop", "decoupled_ppo", "ppo_ewma"):
        with pytest.raises(LossInputError, match="fill_old_logprobs"):
            compute_loss(name, inp)
        loss, _ = compute_loss(name, batch.loss_inputs(lp, adv, fill_old="behavior"))
        assert torch.isfinite(loss), name


def test_snapshot_fill_on_a_collated_batch_fills_only_active_positions():
    batch = collate(_rollouts(old_for=(0,)), learner_version=6, layout="packed")
    store = WeightSnapshotStore(max_versions=8)
    for v in range(3, 6):
        store.put(v, {"shift": torch.tensor(-0.1 * v)})
    asked = []

    def run(weights, idx):  # a "model" whose logprob is mu + shift(version)
        asked.extend(idx.tolist())
        return batch.rollout_logprobs.reshape(-1)[idx] + weights["shift"]

    ctx = FillContext(rollout_logprobs=batch.rollout_logprobs, versions=batch.versions,
                      learner_version=6, loss_mask=batch.loss_mask)
    filled, counts = fill_old_logprobs(batch.old_logprobs, snapshot_strategy(store, run), ctx)
    active = batch.loss_mask.reshape(-1) > 0
    was_nan = torch.isnan(batch.old_logprobs.reshape(-1))
    assert set(asked) == set(torch.nonzero(active & was_nan).reshape(-1).tolist())
    assert counts["filled"] == int((active & was_nan).sum())
    assert counts["left_inactive"] == int((~active & was_nan).sum()) > 0
    f = filled.reshape(-1)
    assert not bool(torch.isnan(f[active]).any()) and bool(torch.isnan(f[~active]).all())
    v = batch.versions.reshape(-1)
    want = batch.rollout_logprobs.reshape(-1) - 0.1 * v.to(torch.float32)
    sel = active & was_nan
    assert torch.allclose(f[sel], want[sel])
    # without a loss mask the version sentinel (-1) marks the positions to skip
    ctx2 = FillContext(rollout_logprobs=batch.rollout_logprobs, versions=batch.versions)
    filled2, _ = fill_old_logprobs(batch.old_logprobs, snapshot_strategy(store, run), ctx2)
    assert torch.equal(torch.isnan(filled2), torch.isnan(filled))


def test_staleness_monitor_without_mask_ignores_prompt_sentinels():
    batch = collate(_rollouts(), learner_version=6, layout="padded")
    s, mean = batch_lags(batch.versions, 6)
    v = batch.versions[batch.versions >= 0].to(torch.float64)
    assert s == int(6 - v.min()) == 3
    assert mean == pytest.approx(float((6 - v).mean()))
    rep = StalenessMonitor().step(1e-3, batch.versions, 6)
    assert rep.max_lag == 3


def _corrupt_inputs(n=64, seed=0, dual=None):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, generator=g) - 0.1
    lp = (mu + 0.05 * torch.randn(n, generator=g)).requires_grad_(True)
    mu = mu.clone()
    mu[5] = -40.0  # one corrupt behavior logprob: ratio e^20 after the clamp
    adv = torch.full((n,), -1.0)
    return LossInputs(lp, mu, adv, torch.ones(n), old_logprobs=mu.clone(),
                      entropy=torch.ones(n))


@pytest.mark.parametrize("name", ["ppo_clip", "sat", "estr", "tis", "mis", "icepop",
                                  "ppo_ewma", "decoupled_ppo", "gspo_token", "sat_gspo"])
def test_dual_clip_bounds_one_corrupt_token(name):
    inp = _corrupt_inputs()
    cfg = {"target_mask_rate": None, "tau": 1e9} if name == "estr" else {}
    if name in ("gspo_token", "sat_gspo"):
        inp = inp.replace(cu_seqlens=torch.tensor([0, 32, 64]))
    loss_plain, _ = compute_loss(name, inp, cfg)
    loss_dual, _ = compute_loss(name, inp, {**cfg, "dual_clip": 3.0})
    assert torch.isfinite(loss_dual)
    assert float(loss_dual.detach()) <= 3.0 + 1e-6  # c * |A| per token, token mean
    if name in ("ppo_clip", "sat", "estr"):
        assert float(loss_plain.detach()) > 1e5  # without it one token dominates


def test_estr_target_rate_never_lets_an_infinite_score_through():
    n = 20
    mu = torch.full((n,), -1.0)
    mu[:5] = -math.inf  # a quarter of the scores are +inf: the 0.9 quantile is inf
    lp = torch.full((n,), -1.1, requires_grad=True)
    inp = LossInputs(lp, mu, torch.ones(n), torch.ones(n), entropy=torch.ones(n))
    loss, m = compute_loss("estr", inp, {"tau": None, "target_mask_rate": 0.1})
    loss.backward()
    assert torch.isfinite(loss) and bool(torch.isfinite(lp.grad).all())
    assert bool((lp.grad[:5] == 0).all()) and bool((lp.grad[5:] != 0).all())
    assert float(m["mask_rate"]) == pytest.approx(5 / n)


def test_sat_quantile_ignores_masked_values_and_survives_infinite_active_ratios():
    n = 40
    g = torch.Generator().manual_seed(1)
    mu = -torch.rand(n, generator=g) - 0.2
    lp = mu + 0.1 * torch.randn(n, generator=g)
    mask = torch.ones(n)
    mask[:10] = 0
    adv = torch.randn(n, generator=g)
    clean = LossInputs(lp, mu, adv, mask)
    _, m0 = compute_loss("sat", clean)
    d = (lp - mu)[10:].abs()
    assert float(m0["sat_q"]) == pytest.approx(float(torch.quantile(d, 0.9)))
    mu2 = mu.clone()
    mu2[10:20] = -math.inf  # a quarter of the active ratios infinite
    loss, m = compute_loss("sat", LossInputs(lp.clone().requires_grad_(True), mu2, adv, mask))
    assert torch.isfinite(loss) and math.isfinite(float(m["sat_q"]))
