"""The reference model equals transformers' Qwen3MoeForCausalLM on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from reference_engine.checkpoint import build_model, init_checkpoint, load_model
from reference_engine.config import ModelConfig
from reference_engine.model import KVCache

torch.set_num_threads(1)
IDS = torch.tensor([256, *b"Hello, world! MoE"], dtype=torch.long)


@pytest.mark.parametrize("cfg", [
    ModelConfig(),
    ModelConfig(tie_word_embeddings=True, norm_topk_prob=False, mlp_only_layers=[1],
                num_hidden_layers=3, num_experts=4, num_experts_per_tok=3),
])
def test_matches_transformers(tmp_path, cfg):
    transformers = pytest.importorskip("transformers")
    init_checkpoint(tmp_path, cfg, seed=4)
    ours = load_model(tmp_path)
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", experts_implementation="eager").eval()
    logits, topk = ours.forward_full(IDS)
    with torch.no_grad():
        out = hf(IDS[None], output_router_logits=True)
    assert (out.logits[0] - logits).abs().max().item() < 1e-4
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert len(out.router_logits) == len(moe_layers)
    for li, router_logits in zip(moe_layers, out.router_logits):
        hf_top = torch.topk(torch.softmax(router_logits.float(), -1), cfg.num_experts_per_tok,
                            -1).indices
        assert torch.equal(hf_top, topk[:, li])
    for li in set(range(cfg.num_hidden_layers)) - set(moe_layers):
        assert not topk[:, li].any()  # dense layers report zeros, as SGLang


def test_incremental_kv_equals_full_forward():
    m = build_model(ModelConfig(), seed=3)
    full, full_top = m.forward_full(IDS)
    cache = KVCache()
    a = m.forward_chunks([IDS[:7]], [cache])
    rows = [m.logits(a.hidden)]
    tops = [a.topk]
    for t in IDS[7:]:
        o = m.forward_chunks([t[None]], [cache])
        rows.append(m.logits(o.hidden))
        tops.append(o.topk)
    assert cache.length == len(IDS)
    assert (torch.cat(rows) - full).abs().max().item() < 1e-4
    assert torch.equal(torch.cat(tops), full_top)


def test_batched_chunks_equal_separate_runs():
    m = build_model(ModelConfig(), seed=3)
    seqs = [IDS[:5], IDS[:11], IDS[3:4]]
    caches = [KVCache() for _ in seqs]
    out = m.forward_chunks(seqs, caches)
    for s, off in zip(seqs, out.offsets):
        alone, alone_top = m.forward_full(s)
        got = m.logits(out.hidden[off:off + len(s)])
        assert (got - alone).abs().max().item() < 1e-4
        assert torch.equal(out.topk[off:off + len(s)], alone_top)


def test_seeded_init_is_deterministic():
    a = build_model(ModelConfig(), seed=5).state_dict()
    b = build_model(ModelConfig(), seed=5).state_dict()
    c = build_model(ModelConfig(), seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_replaying_the_routing_is_the_router_and_another_route_changes_the_logits():
    """forward_full(routing=...) (R3 replay): the router's own choice gives the same bits,
    another expert for one token in one layer changes that token's logits and after."""
    import numpy as np

    from reference_engine.reference import score

    cfg = ModelConfig()
    model = build_model(cfg, 3)
    logits, topk = model.forward_full(IDS)
    same, top2 = model.forward_full(IDS, routing=topk)
    assert torch.equal(same, logits) and torch.equal(top2, topk)
    other = topk.clone()
    li = next(i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    row = other[5, li]
    spare = next(e for e in range(cfg.num_experts) if e not in row.tolist())
    other[5, li, 0] = spare
    moved, got = model.forward_full(IDS, routing=other)
    assert torch.equal(got, other)
    # earlier tokens: the same up to float order (an expert's batch of tokens changed)
    assert torch.allclose(moved[:5], logits[:5], atol=1e-5)
    assert (moved[5] - logits[5]).abs().max() > 1e-3
    ids = IDS.tolist()
    a = score(model, ids, 3)
    b = score(model, ids, 3, routing=np.concatenate([a.routed_experts,
                                                    topk[-1:].numpy().astype(np.int32)]))
    assert np.array_equal(a.logprobs, b.logprobs)
