"""The demo's Megatron-Core learner on CPU (megatron-core 0.16.1, local spec, gloo world 1):
its GPTModel is the reference engine's model, and its first optimizer step equals the plain
PyTorch learner's on the same batch (same loss, same updated weights)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from rollout_demo import task
from rollout_demo.megatron_learner import (
    MegatronLearner,
    build_gpt,
    cpu_shims,
    engine_to_mcore,
    load_engine_weights,
    mcore_to_engine,
    single_process_parallel_state,
)
from reference_engine.checkpoint import init_checkpoint, load_model, read_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mp_state():
    with single_process_parallel_state():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_checkpoint(tmp_path_factory.mktemp("mcore") / "v0", seed=4)


def test_weight_mapping_round_trips_exactly(ckpt):
    hub = load_file(str(ckpt / "model.safetensors"))
    mc = read_config(ckpt)
    back = mcore_to_engine(engine_to_mcore(hub, mc), mc)
    assert set(back) == set(hub)
    for k, v in hub.items():
        assert torch.equal(back[k], v), k


def test_gpt_model_computes_the_engines_logits(mp_state, ckpt):
    mc = read_config(ckpt)
    model = build_gpt(mc)
    load_engine_weights(model, ckpt, mc)
    ids = torch.tensor([256, *b"digits:xy", 48, 49])
    mask = torch.triu(torch.ones(len(ids), len(ids), dtype=torch.bool), 1)[None, None]
    with cpu_shims(), torch.no_grad():
        got = model(ids[None], torch.arange(len(ids))[None], mask)[0]
        want, _ = load_model(ckpt).forward_full(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("loss", ["sat", "grpo"])
def test_first_step_matches_the_plain_pytorch_learner(mp_state, ckpt, tmp_path, loss):
    from rollout_demo.learner import Learner
    from rollout_demo.sampler import sample_groups

    plain = Learner(ckpt, loss=loss, lr=0.5, optimizer="sgd", grad_clip=0.0)
    mega = MegatronLearner(ckpt, loss=loss, lr=0.5, optimizer="sgd", grad_clip=0.0)
    rng = random.Random(1)
    prompts = [task.make_prompt(rng)[1] for _ in range(3)]  # different lengths: real packing
    samples = sample_groups(plain.model, prompts, 4, 6, temperature=1.0, version=0,
                            groups=["a", "b", "c"], reward_fn=task.reward,
                            generator=torch.Generator().manual_seed(0))
    assert len({s.reward for s in samples}) > 1  # non-zero advantages
    a = plain.train_step(samples)
    b = mega.train_step(samples)
    assert b.loss == pytest.approx(a.loss, abs=1e-5)
    assert b.tokens == a.tokens and np.array_equal(b.lags, a.lags)
    want = load_file(str(plain.save(tmp_path / "plain") / "model.safetensors"))
    got = load_file(str(mega.save(tmp_path / "mega") / "model.safetensors"))
    start = load_file(str(ckpt / "model.safetensors"))
    assert set(got) == set(want)
    moved = max(float((want[k] - start[k]).abs().max()) for k in want)
    assert moved > 1e-3  # the step really changed the weights
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4, msg=k)
    # what the Megatron learner saved is a checkpoint the engine loads
    assert load_model(tmp_path / "mega").config == read_config(ckpt)


def test_block_causal_mask_keeps_packed_sequences_apart():
    from learner_client.megatron.forward_step import block_causal_mask
    from learner_client.megatron.packing import PackSample, pack_samples

    batch = pack_samples([PackSample([1, 2], [3]), PackSample([4], [5, 6])])
    m = block_causal_mask(batch)[0, 0]  # True = masked
    allowed = ~m
    want = torch.tensor([[1, 0, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0],
                         [0, 0, 0, 1, 0, 0],
                         [0, 0, 0, 1, 1, 0],
                         [0, 0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(allowed, want)
