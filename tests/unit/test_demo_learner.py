"""The demo's task and learner, in process (no engine): the reward is rule-checked and the
plain PyTorch learner measurably learns it within a few dozen steps."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from rollout_demo import task


def test_reward_is_the_fraction_of_bytes_in_the_named_class():
    _, prompt = task.make_prompt(random.Random(0), classes=["digits"])
    assert task.prompt_class(prompt) == "digits"
    assert task.reward(prompt, np.array([ord("1"), ord("2"), ord("a"), 257])) == 0.5
    assert task.reward(prompt, np.array([], np.int64)) == 0.0
    lower = [256, *b"lower:xy"]
    assert task.reward(lower, np.frombuffer(b"abcZ", np.uint8)) == 0.75
    with pytest.raises(ValueError, match="names no known class"):
        task.reward([256, *b"vowels:"], np.array([97]))


def test_learner_learns_the_task_with_lag(tmp_path):
    """Lag 2 (samples from the policy two steps old), SAT, routing replay: reward rises."""
    import copy

    from rollout_demo.learner import Learner
    from rollout_demo.sampler import sample_group
    from reference_engine.checkpoint import init_checkpoint

    torch.manual_seed(0)
    torch.set_num_threads(1)
    learner = Learner(init_checkpoint(tmp_path / "v0", seed=0), loss="sat", lr=3e-3)
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    old = [copy.deepcopy(learner.model)]
    rewards, lags = [], set()
    for step in range(40):
        sampler = old[0]
        version = learner.version - len(old) + 1
        samples = []
        for j in range(4):
            _, prompt = task.make_prompt(rng)
            samples += sample_group(sampler, prompt, 8, 8, temperature=1.0, version=version,
                                    group=f"{step}-{j}", reward_fn=task.reward, generator=gen)
        res = learner.train_step(samples)
        rewards.append(res.reward_mean)
        lags.update(res.lags.tolist())
        assert np.isfinite(res.loss)
        old.append(copy.deepcopy(learner.model))
        old = old[-3:]  # the sampler lags two versions behind
    assert lags == {0, 1, 2}
    assert np.mean(rewards[:5]) < 0.3
    assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.25, rewards


def test_checkpoint_round_trip_is_the_engines_model(tmp_path):
    """What the learner saves loads in the reference engine with identical logits."""
    from rollout_demo.learner import Learner
    from reference_engine.checkpoint import init_checkpoint, load_model

    learner = Learner(init_checkpoint(tmp_path / "v0", seed=3), loss="grpo")
    ids = torch.tensor([256, *b"digits:"])
    saved = learner.save(tmp_path / "v1")
    eng = load_model(saved)
    with torch.no_grad():
        want = learner.model(input_ids=ids[None], use_cache=False).logits[0]
        got, _ = eng.forward_full(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
