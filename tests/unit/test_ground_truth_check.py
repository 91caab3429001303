"""The tests' ground-truth check (tests/integration/_gateway_support.py) accepts a logprob
mismatch only when a router flip explains it: the recorded routing differs at or before
the token and replaying it reproduces the stamped logprobs."""

from __future__ import annotations

import base64
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))

from _gateway_support import check_against_ground_truth  # noqa: E402

from reference_engine.config import ModelConfig  # noqa: E402
from reference_engine.reference import model_from, score  # noqa: E402

torch.set_num_threads(1)
PROMPT = [256, *b"Route me"]
OUT = list(b" through the experts")


def _traj(logprobs: np.ndarray, routing: np.ndarray) -> dict:
    t = len(OUT)
    return {"prompt_token_ids": PROMPT, "token_ids": OUT, "num_tokens": t,
            "policy_version": [0] * t, "kv_version": [0] * t,
            "logprobs": [float(x) for x in logprobs],
            "segments": [{"start": 0, "end": t, "policy_version": 0, "began": "start",
                          "ended": "finish"}],
            "routed_experts": {"shape": list(routing.shape), "dtype": "|u1", "start": 0,
                               "data_b64": base64.b64encode(
                                   routing.astype(np.uint8).tobytes()).decode()}}


@pytest.fixture(scope="module")
def models():
    return {0: model_from((ModelConfig(), 1))}


def test_a_flip_the_recorded_routing_explains_passes_and_one_it_does_not_fails(models):
    ids = PROMPT + OUT
    own = score(models[0], ids, len(PROMPT))
    rows = own.routed_experts.astype(np.int64)  # [len(ids) - 1, L, k]
    check_against_ground_truth(_traj(own.logprobs, rows), models)  # the plain case
    cfg = ModelConfig()
    li = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    pos = len(PROMPT) + 3  # the input producing output token 4
    flipped = rows.copy()
    flipped[pos, li, -1] = next(e for e in range(cfg.num_experts)
                                if e not in rows[pos, li].tolist())
    engine = score(models[0], ids, len(PROMPT),
                   routing=np.concatenate([flipped, rows[-1:]]))  # what the engine computed
    assert np.abs(engine.logprobs - own.logprobs).max() > 2e-3
    # the engine's logprobs with the routing it recorded: explained, accepted
    check_against_ground_truth(_traj(engine.logprobs, flipped), models)
    # the same logprobs with a routing that shows no flip: a real mismatch, refused
    with pytest.raises(AssertionError):
        check_against_ground_truth(_traj(engine.logprobs, rows), models)
    # a flip recorded only after the mismatching token explains nothing
    late = rows.copy()
    late[-1, li, -1] = flipped[pos, li, -1] if flipped[pos, li, -1] not in rows[-1, li] else \
        next(e for e in range(cfg.num_experts) if e not in rows[-1, li].tolist())
    with pytest.raises(AssertionError):
        check_against_ground_truth(_traj(engine.logprobs, late), models)
