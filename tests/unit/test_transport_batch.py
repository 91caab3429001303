"""Tensor assembly from delivered rollouts, checked against a naive per-sequence loop."""

import numpy as np
import pytest
import torch

from learner_client.batch import collate
from learner_client.wire import parse_batch
from rollout_gateway.core import trajectory_codec
from doubles.trajectories import make_trajectory
from rollout_proto import codec


def rollouts(specs, masked=()):
    entries = []
    for i, (p, t, versions, layers) in enumerate(specs):
        tr = make_trajectory(f"t{i}", prompt_len=p, num_tokens=t, versions=versions,
                             num_layers=layers, top_k=2, num_experts=16, seed=i,
                             old_logprobs=(i == 0), reward=None if i == 1 else float(i))
        entries.append((str(i + 1), 1, i in masked, trajectory_codec.encode(tr)))
    return parse_batch(codec.encode_batch(entries, 0, 0))[0]


SPECS = [(3, 5, (4, 6), 3), (2, 0, (6,), 3), (4, 7, (2, 5, 6), 3)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_collate_matches_naive_assembly(layout):
    rs = rollouts(SPECS, masked={2})
    b = collate(rs, learner_version=6, layout=layout, max_lag=1)
    assert b.num_sequences == 3 and b.num_tokens == 8 + 2 + 11
    assert b.cu_seqlens.tolist() == [0, 8, 10, 21]
    for i, r in enumerate(rs):
        p, t = len(r.prompt_token_ids), r.num_tokens
        if layout == "padded":
            def row(x, i=i, n=p + t):
                return x[i, :n]
            assert not b.attention_mask[i, p + t:].any() and b.attention_mask[i, :p + t].all()
        else:
            def row(x, i=i):
                return x[int(b.cu_seqlens[i]):int(b.cu_seqlens[i + 1])]
        assert row(b.input_ids).tolist() == [*r.prompt_token_ids, *r.token_ids]
        assert row(b.position_ids).tolist() == list(range(p + t))
        np.testing.assert_array_equal(row(b.rollout_logprobs)[p:].numpy(), r.logprobs)
        np.testing.assert_array_equal(row(b.entropy)[p:].numpy(), r.entropy)
        assert row(b.versions)[:p].eq(-1).all()
        np.testing.assert_array_equal(row(b.versions)[p:].numpy(), r.policy_version)
        np.testing.assert_array_equal(row(b.kv_versions)[p:].numpy(), r.kv_version)
        np.testing.assert_array_equal(row(b.lags)[p:].numpy(), 6 - r.policy_version)
        want_mask = np.ones(t, np.float32)
        if i == 2:  # masked delivery: tokens with lag > 1 get no loss
            want_mask = (6 - r.policy_version <= 1).astype(np.float32)
        assert row(b.loss_mask)[:p].eq(0).all()
        np.testing.assert_array_equal(row(b.loss_mask)[p:].numpy(), want_mask)
        re = row(b.routed_experts)
        assert re.dtype == torch.uint8 and re.shape[1:] == (3, 2)
        np.testing.assert_array_equal(re[:p + t - 1].numpy(), r.routed_experts)
        assert row(b.routed_mask).tolist() == [True] * (p + t - 1) + [False]
        if i == 0:
            np.testing.assert_array_equal(row(b.old_logprobs)[p:].numpy(), r.old_logprobs)
        else:
            assert torch.isnan(row(b.old_logprobs)[p:]).all()
    assert b.loss_mask.sum().item() == 5 + 0 + 5  # t2: its 2 version-2 tokens are masked
    assert torch.isnan(b.rewards[1]) and b.rewards[2].item() == 2.0


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_routed_cells_nobody_covers_are_zero(layout):
    """Rows outside each rollout's routed span (prompt rows before ``routed_start``, the
    last row, padding, a rollout without routing) are zero and unmasked."""
    rs = rollouts([(3, 5, (4,), 3), (2, 4, (4,), 0), (4, 6, (4,), 3)])
    rs[2].routed_start, rs[2].routed_experts = 2, rs[2].routed_experts[:5] + 1
    for _ in range(3):  # reused allocations must not leak old contents either
        b = collate(rs, learner_version=4, layout=layout)
        re, mask = b.routed_experts, b.routed_mask
        assert mask.sum().item() == 7 + 0 + 5
        assert re[~mask].eq(0).all()
        want = torch.zeros(mask.shape, dtype=torch.bool)
        if layout == "packed":
            want[0:7], want[8 + 6 + 2:8 + 6 + 7] = True, True
            np.testing.assert_array_equal(re[16:21].numpy(), rs[2].routed_experts)
        else:
            want[0, 0:7], want[2, 2:7] = True, True
            np.testing.assert_array_equal(re[2, 2:7].numpy(), rs[2].routed_experts)
        assert torch.equal(mask, want)
        b.routed_experts.fill_(7)  # dirty the memory before it is freed and reused


def test_loss_inputs_from_batch():
    rs = rollouts(SPECS)
    for layout in ("padded", "packed"):
        b = collate(rs, learner_version=6, layout=layout)
        logp = torch.zeros_like(b.rollout_logprobs, requires_grad=True)
        li = b.loss_inputs(logp, torch.tensor([1.0, 2.0, 3.0]))
        assert li.logprobs.shape == b.input_ids.shape
        assert torch.equal(li.loss_mask, b.loss_mask)
        assert li.learner_version == 6
        if layout == "packed":
            assert li.cu_seqlens.tolist() == [0, 8, 10, 21]
            assert li.advantages[8:10].eq(2.0).all()
        else:
            assert li.advantages[2].eq(3.0).all()
        # NaN at masked positions (old_logprobs outside responses) never reaches a loss
        li2 = b.loss_inputs(logp, torch.tensor([1.0, 2.0, 3.0]),
                            old_logprobs=torch.full_like(b.rollout_logprobs, float("nan")))
        assert not torch.isnan(li2.old_logprobs[b.loss_mask == 0]).any()


def test_pack_samples_for_megatron():
    rs = rollouts(SPECS, masked={2})
    b = collate(rs, learner_version=6, layout="packed", max_lag=1)
    samples = b.pack_samples(advantages=[1.0, 2.0, 3.0])
    assert len(samples) == 3
    np.testing.assert_array_equal(samples[2].columns["loss_mask"],
                                  (6 - rs[2].policy_version <= 1).astype(np.float32))
    assert samples[0].routed_experts.shape == (7, 3, 2)


def test_collate_rejects_empty_and_bad_layout():
    with pytest.raises(ValueError):
        collate([], 0)
    with pytest.raises(ValueError):
        collate(rollouts(SPECS[:1]), 0, layout="ragged")


def test_learner_client_never_imports_rollout_gateway():
    import subprocess
    import sys

    code = ("import sys, learner_client.client, learner_client.batch, learner_client.wire; "
            "bad = [m for m in sys.modules if m.startswith('rollout_gateway')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_routed_experts_buffer_is_reused_only_after_the_batch_is_dropped():
    import gc

    rs = rollouts(SPECS)
    first = collate(rs, learner_version=6, layout="packed")
    expected = first.routed_experts.clone()
    held = first.routed_experts[1:]  # a view keeps the buffer alive
    del first
    gc.collect()
    second = collate(rs[::-1], learner_version=6, layout="packed")
    assert second.routed_experts.data_ptr() != held.data_ptr() - held.stride(0)
    assert torch.equal(held, expected[1:])  # untouched by the second batch
    ptr = second.routed_experts.data_ptr()
    del second
    gc.collect()
    third = collate(rs[::-1], learner_version=6, layout="packed")
    assert third.routed_experts.data_ptr() == ptr  # dropped: its buffer is reused
