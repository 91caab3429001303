"""The staleness lab's arm through the product (``rollout_demo.lab.product.run_real``): a
reference engine process and the gateway process, in-place hot-swaps every step; the
loss (decoupled PPO with the log-linear proximal, built from per-token versions) must
receive exactly the ``policy_version`` stamps the gateway delivered, every step."""

from __future__ import annotations

from dataclasses import replace

import pytest

pytestmark = pytest.mark.integration


def test_the_loss_consumes_the_gateways_stamps(tmp_path):
    from rollout_demo.lab.product import QUICK, run_real

    s = replace(QUICK, steps=3, groups=2, group_size=4)
    cell = run_real(0, s, tmp_path)
    d = cell["diagnostics"]
    assert d["steps_checked"] == s.steps
    assert d["versions_equal"], "the loss's versions column is not the gateway's stamps"
    assert d["alpha_equal"] and d["max_alpha_error"] < 1e-5
    assert d["swap_failures"] == 0
    # every trained token counted once, lags within the admission bound
    hist = {int(k): v for k, v in cell["lag_histogram"].items()}
    assert sum(hist.values()) == d["tokens"] == s.steps * s.groups * s.group_size * s.max_new
    assert min(hist) >= 0 and max(hist) <= s.max_lag
    # held-out evaluation of versions 0..steps, each a probability
    assert cell["eval_steps"] == list(range(s.steps + 1))
    assert all(0.0 <= r <= 1.0 for r in cell["eval_curve"])
    assert cell["final_eval"] == cell["eval_curve"][-1]
