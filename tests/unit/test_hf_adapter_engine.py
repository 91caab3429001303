"""The transformers adapter against the reference engine's own checkpoint code and model.

Crosses the learner/gateway boundary only inside the test: learner_client itself never
imports rollout_gateway. Verifies that the checkpoint format is the same both ways and
that R3 with the engine's routing reproduces the engine's expert choices.
"""

import numpy as np
import pytest
import torch

from learner_client.hf import load_model, packed_logprobs, record_routing, save_for_engine
from learner_client.megatron.packing import PackSample, pack_samples

torch.set_num_threads(1)
engine_ckpt = pytest.importorskip("reference_engine.checkpoint")
from reference_engine.config import ModelConfig  # noqa: E402

CFG = ModelConfig(num_hidden_layers=3, mlp_only_layers=[1], hidden_size=32, num_experts=6)


def _engine_run(engine, ids):
    logits, topk = engine.forward_full(torch.as_tensor(ids))
    return torch.log_softmax(logits, -1), topk


def test_engine_checkpoint_loads_and_matches_engine_forward(tmp_path):
    d = engine_ckpt.init_checkpoint(tmp_path / "eng", CFG, seed=3)
    engine = engine_ckpt.load_model(d)
    hf = load_model(d)
    rng = np.random.default_rng(0)
    prompt, resp = rng.integers(0, CFG.vocab_size, 5), rng.integers(0, CFG.vocab_size, 7)
    ids = np.concatenate([prompt, resp])
    ls, topk = _engine_run(engine, ids)
    b = pack_samples([PackSample(prompt, resp)])
    with record_routing(hf) as rec, torch.no_grad():
        lp, ent = packed_logprobs(hf, b)
    want = ls[4:11].gather(-1, torch.as_tensor(resp)[:, None])[:, 0]
    torch.testing.assert_close(lp, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent, -(ls.exp() * ls).sum(-1)[4:11], atol=1e-4, rtol=1e-4)
    assert torch.equal(rec["routed"], topk)  # same experts, same layout (dense = zeros)


def test_save_for_engine_is_loaded_by_the_engine(tmp_path):
    src = engine_ckpt.init_checkpoint(tmp_path / "a", CFG, seed=1)
    hf = load_model(src)
    with torch.no_grad():  # a "training step"
        for p in hf.parameters():
            p.add_(0.01 * torch.randn_like(p))
    d = save_for_engine(hf, tmp_path / "b")
    engine = engine_ckpt.load_model(d)
    ids = torch.randint(0, CFG.vocab_size, (10,))
    with torch.no_grad():
        hf_logits = hf(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(engine.forward_full(ids)[0], hf_logits, atol=1e-4, rtol=1e-4)


def test_r3_with_engine_routing_from_older_weights(tmp_path):
    old = engine_ckpt.load_model(engine_ckpt.init_checkpoint(tmp_path / "v0", CFG, seed=5))
    new_dir = engine_ckpt.init_checkpoint(tmp_path / "v1", CFG, seed=6)
    hf_new = load_model(new_dir)
    rng = np.random.default_rng(1)
    samples, routing = [], []
    for p, t in [(4, 6), (3, 5)]:
        prompt, resp = rng.integers(0, CFG.vocab_size, p), rng.integers(0, CFG.vocab_size, t)
        _, topk = _engine_run(old, np.concatenate([prompt, resp]))
        routing.append(topk)
        # as SGLang returns it: P + T - 1 rows (no forward pass for the last token)
        samples.append(PackSample(prompt, resp, routed_experts=topk[:-1].numpy()))
    b = pack_samples(samples)
    with record_routing(hf_new) as free, torch.no_grad():
        lp_free, _ = packed_logprobs(hf_new, b)
    with record_routing(hf_new) as rep, torch.no_grad():
        lp_rep, _ = packed_logprobs(hf_new, b, replay=True)
    for i, topk in enumerate(routing):
        o, n = int(b.cu_seqlens_padded[i]), topk.shape[0]
        moe = [0, 2]
        assert torch.equal(rep["routed"][o : o + n - 1][:, moe], topk[:-1][:, moe])
    assert not torch.equal(free["routed"], rep["routed"])
    assert not torch.allclose(lp_free, lp_rep)
