"""Plain transformers learner adapter: checkpoint format, packed/padded logprobs, R3."""

import json

import numpy as np
import pytest
import torch

from learner_client.hf import (
    RoutingReplayError,
    load_model,
    moe_gates,
    packed_logprobs,
    padded_logprobs,
    record_routing,
    replay_routing,
    save_for_engine,
)
from learner_client.megatron.packing import PackSample, pack_samples

torch.set_num_threads(1)
V, LAYERS, E, K = 300, 3, 6, 2


def _tiny(seed=0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=48,
                         moe_intermediate_size=16, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=E, num_experts_per_tok=K,
                         norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=128,
                         initializer_range=0.3)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def model():
    return _tiny()


def _batch(seed=0, lens=((4, 5), (3, 6), (6, 3)), routed=None):
    rng = np.random.default_rng(seed)
    return pack_samples([PackSample(rng.integers(0, V, p), rng.integers(0, V, t),
                                    routed_experts=None if routed is None else routed[i])
                         for i, (p, t) in enumerate(lens)])


def _per_sequence_reference(model, batch):
    lp, ent = [], []
    for i in range(batch.num_sequences):
        o, n = int(batch.cu_seqlens_padded[i]), int(batch.cu_seqlens[i + 1] - batch.cu_seqlens[i])
        ids = batch.tokens[:, o : o + n]
        with torch.no_grad():
            ls = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = int(batch.prompt_lens[i])
        lp.append(ls[p - 1 : n - 1].gather(-1, ids[0, p:, None])[:, 0])
        ent.append(-(ls.exp() * ls).sum(-1)[p - 1 : n - 1])
    return torch.cat(lp), torch.cat(ent)


def test_save_for_engine_round_trip_and_format(model, tmp_path):
    d = save_for_engine(model, tmp_path / "ckpt")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_experts"] == E == cfg["num_local_experts"]  # engine/SGLang read num_experts
    assert cfg["model_type"] == "qwen3_moe" and cfg["rope_theta"] > 0
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.experts.5.gate_proj.weight" in keys  # Hub per-expert names
    assert "model.layers.0.mlp.gate.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)
    loaded = load_model(d)
    assert loaded.config._experts_implementation == "eager"
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    save_for_engine(loaded, d)  # replacing an existing checkpoint leaves no temp dirs
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "missing")


def test_packed_logprobs_equal_separate_forwards(model):
    b = _batch()
    lp, ent = packed_logprobs(model, b)
    lp_ref, ent_ref = _per_sequence_reference(model, b)
    assert lp.shape == (b.num_response_tokens,)
    torch.testing.assert_close(lp.detach(), lp_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ent.detach(), ent_ref, atol=2e-5, rtol=1e-4)
    lp_t, _ = packed_logprobs(model, b, temperature=0.5)
    assert not torch.allclose(lp_t, lp)


def test_padded_logprobs_left_padding_matches_packed(model):
    b = _batch(1, lens=((3, 4), (5, 4)))
    lp_packed, _ = packed_logprobs(model, b)
    seqs = [b.tokens[0, int(b.cu_seqlens[i]) : int(b.cu_seqlens[i + 1])] for i in range(2)]
    t = max(len(s) for s in seqs)
    ids = torch.zeros(2, t, dtype=torch.long)
    mask = torch.zeros(2, t, dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding
        ids[i, t - len(s) :], mask[i, t - len(s) :] = s, 1
    lp, ent = padded_logprobs(model, ids, mask)
    assert lp.shape == (2, t - 1) and torch.isfinite(lp[mask[:, 1:].bool()]).all()
    got = torch.cat([lp[i, t - 1 - int(b.response_lens[i]) :] for i in range(2)])
    torch.testing.assert_close(got.detach(), lp_packed.detach(), atol=2e-5, rtol=1e-4)


def test_r3_replays_given_experts_and_changes_logprobs():
    a, bm = _tiny(0), _tiny(0)
    with torch.no_grad():  # B = A with other router weights
        for layer, gate in moe_gates(bm):
            gate.weight.add_(torch.randn_like(gate.weight))
    b = _batch(2)
    with record_routing(a) as rec_a, torch.no_grad():
        packed_logprobs(a, b)
    with record_routing(bm) as rec_b, torch.no_grad():
        lp_b, _ = packed_logprobs(bm, b)
    routed_a, routed_b = rec_a["routed"], rec_b["routed"]
    assert routed_a.shape == (b.total_len, LAYERS, K)
    assert (routed_a[:, 1] == 0).all()  # dense layer, as SGLang reports it
    assert not torch.equal(routed_a, routed_b)

    b.routed_experts = routed_a
    with record_routing(bm) as rec_r:
        lp_r, _ = packed_logprobs(bm, b, replay=True)
    assert torch.equal(rec_r["routed"], routed_a)  # B now uses A's experts
    assert not torch.allclose(lp_r.detach(), lp_b)  # ...which changes its logprobs
    lp_r.sum().backward()  # the router still learns: its logits weight the replayed experts
    for _, g in moe_gates(bm):
        assert g.weight.grad is not None and g.weight.grad.abs().sum() > 0

    b.routed_experts = routed_b  # replaying B's own routing is a no-op
    lp_same, _ = packed_logprobs(bm, b, replay=True)
    torch.testing.assert_close(lp_same.detach(), lp_b, atol=1e-6, rtol=1e-6)


def test_r3_weights_follow_the_formula(model):
    (layer, gate), _ = moe_gates(model)
    h = torch.randn(5, 32)
    routed = torch.stack([torch.randperm(E)[:K] for _ in range(5)])[:, None, :].expand(5, LAYERS, K)
    with replay_routing(model, routed):
        logits, w, idx = gate(h)
    z = logits.gather(1, routed[:, layer])
    torch.testing.assert_close(w, torch.softmax(z, -1))  # g_e = exp(z_e) / sum_{I} exp(z)
    assert torch.equal(idx, routed[:, layer])


def test_r3_refuses_bad_routing(model):
    b = _batch(3)
    with pytest.raises(ValueError, match="no routed_experts"):
        packed_logprobs(model, b, replay=True)
    n = b.total_len
    with pytest.raises(RoutingReplayError, match="top_k"):
        with replay_routing(model, torch.zeros(n, LAYERS, 3, dtype=torch.long)):
            pass
    with pytest.raises(RoutingReplayError, match="outside"):
        with replay_routing(model, torch.full((n, LAYERS, K), E)):
            pass
    with pytest.raises(RoutingReplayError, match="beyond"):
        with replay_routing(model, torch.arange(K).expand(n, 1, K)):
            pass
    routed = torch.arange(K).expand(n - 1, LAYERS, K)  # one row short
    b.routed_experts = routed
    with pytest.raises(RoutingReplayError, match="router sees"):
        packed_logprobs(model, b, replay=True)
    assert all(not g._forward_hooks for _, g in moe_gates(model))  # hooks removed
    with pytest.raises(RoutingReplayError, match="no MoE router"):
        moe_gates(torch.nn.Linear(2, 2))


def test_padded_r3_matches_packed_r3(model):
    b = _batch(4, lens=((3, 4), (5, 4)))
    routed = torch.stack([torch.stack([torch.randperm(E)[:K] for _ in range(LAYERS)])
                          for _ in range(b.total_len)])
    b.routed_experts = routed
    lp_packed, _ = packed_logprobs(model, b, replay=True)
    t = max(int(b.cu_seqlens[i + 1] - b.cu_seqlens[i]) for i in range(2))
    ids = torch.zeros(2, t, dtype=torch.long)
    mask = torch.zeros(2, t, dtype=torch.long)
    padded_routing = torch.zeros(2, t, LAYERS, K, dtype=torch.long)
    padded_routing[...] = torch.arange(K)
    for i in range(2):  # right padding this time
        o, n = int(b.cu_seqlens[i]), int(b.cu_seqlens[i + 1] - b.cu_seqlens[i])
        ids[i, :n], mask[i, :n] = b.tokens[0, o : o + n], 1
        padded_routing[i, :n] = routed[o : o + n]
    lp, _ = padded_logprobs(model, ids, mask, routed_experts=padded_routing)
    got = torch.cat([lp[i, int(b.prompt_lens[i]) - 1 : int(mask[i].sum()) - 1] for i in range(2)])
    torch.testing.assert_close(got.detach(), lp_packed.detach(), atol=2e-5, rtol=1e-4)
    lp_free, _ = padded_logprobs(model, ids, mask)
    assert not torch.allclose(lp_free, lp)
    with pytest.raises(ValueError, match="B=2, T="):
        padded_logprobs(model, ids, mask, routed_experts=padded_routing[:, 1:])
