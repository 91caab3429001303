"""Packing trajectories into Megatron-Core's THD layout (pure; no megatron import needed)."""

import numpy as np
import pytest
import torch

from learner_client.megatron.packing import PackSample, pack_samples, sequence_padding_multiple


def _samples(rng, lens=((3, 4), (5, 2), (2, 6)), with_routing=False, layers=3, k=2):
    out = []
    for i, (p, t) in enumerate(lens):
        cols = {
            "rollout_logprobs": -rng.random(t).astype(np.float32),
            "versions": np.full(t, 7 + i, dtype=np.int32),
            "advantages": np.float32(i - 1.0),  # scalar -> broadcast
        }
        routing = rng.integers(0, 8, size=(p + t - 1, layers, k)) if with_routing else None
        out.append(PackSample(prompt_ids=rng.integers(1, 50, p),
                              response_ids=rng.integers(1, 50, t),
                              columns=cols, routed_experts=routing))
    return out


def test_round_trip_tokens_positions_and_columns():
    rng = np.random.default_rng(0)
    samples = _samples(rng)
    b = pack_samples(samples)
    assert b.tokens.shape == (1, 3 + 4 + 5 + 2 + 2 + 6)
    assert b.cu_seqlens.dtype == torch.int32 and b.cu_seqlens_padded.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 7, 14, 22] == b.cu_seqlens_padded.tolist()
    assert b.max_seqlen == 8
    for i, s in enumerate(samples):
        o = int(b.cu_seqlens_padded[i])
        seq = b.tokens[0, o : o + len(s.prompt_ids) + len(s.response_ids)].numpy()
        np.testing.assert_array_equal(seq, np.concatenate([s.prompt_ids, s.response_ids]))
        assert b.position_ids[0, o : o + 3].tolist() == [0, 1, 2]
        r0, r1 = int(b.cu_response[i]), int(b.cu_response[i + 1])
        # response token t sits at o + P + t; its logit is at the previous position
        got = b.tokens[0, b.response_positions[r0:r1]].numpy()
        np.testing.assert_array_equal(got, s.response_ids)
        assert (b.logit_positions[r0:r1] == b.response_positions[r0:r1] - 1).all()
        assert int(b.logit_positions[r0]) == o + len(s.prompt_ids) - 1  # start - 1
        assert int(b.logit_positions[r1 - 1]) == o + len(s.prompt_ids) + len(s.response_ids) - 2
        np.testing.assert_array_equal(b.columns["rollout_logprobs"][r0:r1].numpy(),
                                      s.columns["rollout_logprobs"])
        assert (b.columns["advantages"][r0:r1] == i - 1.0).all()
    want = np.concatenate([s.response_ids for s in samples])
    np.testing.assert_array_equal(b.targets.numpy(), want)
    packed = b.to_packed(b.columns["versions"], fill=-1)
    assert packed.shape == b.tokens.shape
    assert (packed[0, b.response_positions] == b.columns["versions"]).all()
    assert int((packed != -1).sum()) == b.num_response_tokens


def test_packed_seq_params_thd():
    b = pack_samples(_samples(np.random.default_rng(1)))
    p = b.packed_seq_params()
    assert p.qkv_format == "thd"
    assert p.cu_seqlens_q is b.cu_seqlens and p.cu_seqlens_kv_padded is b.cu_seqlens_padded
    assert p.max_seqlen_q == p.max_seqlen_kv == b.max_seqlen


@pytest.mark.parametrize("tp,cp,sp,want", [(1, 1, False, 1), (4, 1, False, 1), (2, 2, False, 4),
                                           (2, 2, True, 8), (4, 1, True, 1)])
def test_padding_multiple_follows_megatron_get_padding(tp, cp, sp, want):
    from megatron.core.models.multimodal.context_parallel import get_padding

    assert sequence_padding_multiple(tp, cp, sp) == want
    if cp > 1:  # megatron's own rule for one sequence agrees
        for n in (1, 5, 13):
            assert (n + get_padding(n, cp, tp, sp)) % want == 0


@pytest.mark.parametrize("tp,cp,sp", [(2, 2, False), (2, 2, True), (4, 1, True), (2, 3, True)])
def test_cp_and_sp_padding(tp, cp, sp):
    rng = np.random.default_rng(2)
    b = pack_samples(_samples(rng, with_routing=True), tp_size=tp, cp_size=cp, sequence_parallel=sp)
    lens = (b.cu_seqlens_padded[1:] - b.cu_seqlens_padded[:-1]).tolist()
    real = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
    assert real == [7, 7, 8]
    if cp > 1:
        assert all(n % (2 * cp) == 0 for n in lens)
    if sp:
        assert b.total_len % (tp * cp) == 0
    assert all(p >= r for p, r in zip(lens, real))
    # padding slots hold the pad token and no response position
    is_resp = torch.zeros(b.total_len, dtype=torch.bool)
    is_resp[b.response_positions] = True
    for i in range(3):
        o, r = int(b.cu_seqlens_padded[i]), real[i]
        assert (b.tokens[0, o + r : o + lens[i]] == 0).all()
        assert not is_resp[o + r : o + lens[i]].any()
    assert b.routed_experts.shape == (b.total_len, 3, 2)


def test_routed_experts_adds_last_token_row_and_padding_rows():
    rng = np.random.default_rng(3)
    samples = _samples(rng, with_routing=True)
    b = pack_samples(samples, cp_size=2)
    for i, s in enumerate(samples):
        o = int(b.cu_seqlens_padded[i])
        n = len(s.prompt_ids) + len(s.response_ids)
        np.testing.assert_array_equal(b.routed_experts[o : o + n - 1].numpy(), s.routed_experts)
        np.testing.assert_array_equal(b.routed_experts[o + n - 1].numpy(), s.routed_experts[-1])
        pad = b.routed_experts[o + n : int(b.cu_seqlens_padded[i + 1])]
        assert (pad == torch.arange(2)).all()


def test_bad_input_is_refused_with_a_message():
    rng = np.random.default_rng(4)
    good = _samples(rng, with_routing=True)
    with pytest.raises(ValueError, match="empty batch"):
        pack_samples([])
    with pytest.raises(ValueError, match="empty prompt"):
        pack_samples([PackSample(prompt_ids=[], response_ids=[1, 2])])
    with pytest.raises(ValueError, match="column 'x' has shape"):
        pack_samples([PackSample(prompt_ids=[1], response_ids=[1, 2], columns={"x": [1.0]})])
    with pytest.raises(ValueError, match="lacks column"):
        pack_samples([PackSample([1], [2], {"x": [1.0]}), PackSample([1], [2], {})])
    bad = PackSample(good[0].prompt_ids, good[0].response_ids, good[0].columns,
                     routed_experts=good[0].routed_experts[1:])
    with pytest.raises(ValueError, match="routed_experts has"):
        pack_samples([bad])
    with pytest.raises(ValueError, match="every sample or for none"):
        no_routing = PackSample(good[1].prompt_ids, good[1].response_ids, good[1].columns)
        pack_samples([good[0], no_routing])
    with pytest.raises(ValueError, match="integers"):
        pack_samples([PackSample(prompt_ids=[1.5], response_ids=[1])])
