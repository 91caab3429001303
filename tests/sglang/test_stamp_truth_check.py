"""The ground-truth check itself (no server): a routing near tie is accepted only as what it
is, and nothing else passes for one."""

from __future__ import annotations

import numpy as np
import pytest
from _stamp_truth import GroundTruth, Stamped, _out_logprobs

from reference_engine.config import ModelConfig

PROMPT = [5, 9, 13, 2, 7]
OUT = [17, 40, 3, 99, 120, 8, 61, 33, 250, 14, 77, 5]


@pytest.fixture(scope="module")
def model():
    import torch

    from reference_engine.reference import model_from

    torch.set_num_threads(1)
    return model_from((ModelConfig(), 100))


def forward(model, routing=None):
    """(logprob of each OUT token, router top-k of every position) under ``routing``."""
    import torch

    ids = torch.tensor(PROMPT + OUT)
    logits, topk = model.forward_full(ids, None if routing is None else torch.as_tensor(routing))
    lp = _out_logprobs(logits, len(PROMPT), torch.tensor(OUT), 1.0).astype(np.float64)
    return lp, topk.numpy().astype(np.int64)


def stamped(lp, rows) -> Stamped:
    n = len(OUT)
    return Stamped("t", PROMPT, OUT, lp, np.zeros(n, np.int64), np.zeros(n, np.int64),
                   [{"start": 0, "end": n, "began": "start", "ended": "finished",
                     "policy_version": 0, "engine_id": "e0"}],
                   rows=rows[:len(PROMPT) + n - 1])


def flipped(topk, positions):
    """``topk`` with layer 0's first expert replaced at ``positions`` (one not in the row)."""
    out = topk.copy()
    for j in positions:
        row = set(out[j, 0].tolist())
        out[j, 0, 0] = next(e for e in range(ModelConfig().num_experts) if e not in row)
    return out


def test_a_replayed_near_tie_is_accepted_and_said(model):
    lp, topk = forward(model)
    j = len(PROMPT) + 3  # the input position that samples OUT[4]
    forced = flipped(topk, [j])
    tie_lp, _ = forward(model, forced)
    assert np.abs(tie_lp - lp).max() > 1e-3  # the flip shows in the logprobs
    rep = GroundTruth(lambda v: model).check(stamped(tie_lp, forced), (0,))
    assert rep.total == 0, rep.summary("near tie")
    assert any("routing near tie" in n and f"[{j}]" in n for n in rep.notes), rep.notes
    assert rep.checked["routed_rows"] > 0


@pytest.mark.parametrize("case", ["rows differ at many positions", "rows agree"])
def test_what_is_not_a_near_tie_stays_a_mismatch(model, case):
    lp, topk = forward(model)
    if case == "rows agree":  # a logprob off with the routing as recomputed: no excuse
        got, rows = lp.copy(), topk
        got[4] += 2e-2
    else:  # routing that is not the sampling forward's (a wrong stitch, say), replayed
        rows = flipped(topk, [len(PROMPT) + k for k in (1, 3, 5)])
        got, _ = forward(model, rows)
    rep = GroundTruth(lambda v: model).check(stamped(got, rows), (0,))
    assert rep.counts["unexplained"] >= 1, rep.summary(case)
    assert not any("routing near tie" in n for n in rep.notes)


def test_routed_rows_are_compared_as_the_experts_that_ran(model):
    """Two selected experts in the other order (a near tie of their router scores: the
    layer's output is the same) is the same routing; another expert is not."""
    lp, topk = forward(model)
    j = len(PROMPT) + 2
    swapped = topk.copy()
    swapped[j, 0] = swapped[j, 0][::-1]
    assert (swapped[j] != topk[j]).any()
    rep = GroundTruth(lambda v: model).check(stamped(lp, swapped), (0,))
    assert rep.total == 0, rep.summary("experts in another order")
    rep = GroundTruth(lambda v: model).check(stamped(lp, flipped(topk, [j])), (0,))
    assert rep.counts["routed_rows"] == 1, rep.summary("another expert")
