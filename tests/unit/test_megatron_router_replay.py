"""Routing replay (R3) on a tiny megatron-core 0.16.1 MoE GPTModel, CPU + gloo (world 1).

The routers' full forward (TopKRouter.gating) moves weights to CUDA, so on CPU the test
computes the router logits itself (hidden @ weight.T) and runs megatron's real
TopKRouter.routing, where replay happens. test_full_forward_replay_cuda runs the whole
model on a GPU.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _megatron_support import single_rank_model_parallel
from learner_client.megatron.packing import PackSample, pack_samples
from learner_client.megatron.router_replay import (
    RouterReplayError,
    find_router_replays,
    local_routing,
    routing_replay,
    set_replay_targets,
)

torch.set_num_threads(1)
E, K, LAYERS, H = 6, 2, 4, 16


@pytest.fixture(scope="module")
def mp_state():
    with single_rank_model_parallel():
        yield


def _model(**overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=LAYERS, hidden_size=H, num_attention_heads=2, num_moe_experts=E,
              moe_router_topk=K, moe_layer_freq=[0, 1, 0, 1], moe_enable_routing_replay=True,
              use_cpu_initialization=True, moe_token_dispatcher_type="allgather",
              moe_ffn_hidden_size=8, ffn_hidden_size=32, add_bias_linear=False)
    kw.update(overrides)
    cfg = TransformerConfig(**kw)
    torch.manual_seed(0)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=32, max_sequence_length=64)


def _random_routing(n, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.stack([torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(LAYERS)])
                     for _ in range(n)])
    r[:, [0, 2]] = 0  # dense layers are zeros, as SGLang reports them
    return r


def _route(slot, hidden):
    logits = F.linear(hidden, slot.router.weight)  # what gating computes (on CUDA)
    return logits, *slot.router.routing(logits.unsqueeze(1))  # [s, b=1, E]


def test_walk_finds_moe_layers_only_of_this_model(mp_state):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    other = _model()  # another model's routers live in the global list too
    model = _model()
    slots = find_router_replays(model)
    assert [s.layer_number for s in slots] == [2, 4]
    assert len(RouterReplay.global_router_replay_instances) >= 4
    others = {id(s.replay) for s in find_router_replays(other)}
    assert {id(s.replay) for s in slots}.isdisjoint(others)


def test_replay_reproduces_given_experts_with_r3_weights(mp_state):
    model = _model()
    n = 12
    routed = _random_routing(n, 1)
    hidden = torch.randn(n, H, generator=torch.Generator().manual_seed(2))
    natural = [_route(s, hidden)[2] for s in find_router_replays(model)]
    with routing_replay(model, routed) as slots:
        for s, nat in zip(slots, natural):
            logits, probs, rmap = _route(s, hidden)
            want = torch.zeros(n, E, dtype=torch.bool)
            want.scatter_(1, routed[:, s.layer_number - 1], True)
            assert torch.equal(rmap, want)
            # R3: softmax of the router's own logits over the replayed set only
            z = logits.masked_fill(~want, float("-inf"))
            torch.testing.assert_close(probs, torch.softmax(z, -1))
            assert not torch.equal(rmap, nat)  # replay really changed some choices
            (gw,) = torch.autograd.grad(probs[:, 0].sum() + probs[:, 3].sum(), s.router.weight)
            assert gw.abs().sum() > 0  # weights stay differentiable through the router
    # leaving the context restores free routing
    for s, nat in zip(find_router_replays(model), natural):
        assert torch.equal(_route(s, hidden)[2], nat)


def test_record_then_replay_round_trip(mp_state):
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    model = _model()
    slots = find_router_replays(model)
    hidden = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
    for s in slots:
        s.replay.set_router_replay_action(RouterReplayAction.RECORD)
        _route(s, hidden)
    recorded = torch.zeros(7, LAYERS, K, dtype=torch.long)
    for s in slots:
        recorded[:, s.layer_number - 1] = s.replay.get_recorded_indices()
    with torch.no_grad():
        for s in slots:
            s.router.weight.add_(torch.randn_like(s.router.weight))  # new weights
    with routing_replay(model, recorded):
        for s in slots:
            idx = _route(s, hidden)[2].nonzero()[:, 1].view(7, K)
            assert torch.equal(idx, recorded[:, s.layer_number - 1].sort(1).values)


def test_packed_rollout_routing_feeds_replay(mp_state):
    """Gateway routing [P+T-1, L, K] per sample -> packed [S, L, K] -> replay, SP-split."""
    model = _model()
    rng = np.random.default_rng(4)
    samples = []
    for p, t in [(3, 4), (2, 5)]:
        samples.append(PackSample(rng.integers(0, 32, p), rng.integers(0, 32, t),
                                  routed_experts=_random_routing(p + t - 1, p).numpy()
                                  .astype(np.uint8)))
    b = pack_samples(samples, tp_size=2, sequence_parallel=True)
    hidden = torch.randn(b.total_len, H)
    for rank in (0, 1):
        local = local_routing(b.routed_experts, tp_rank=rank, tp_size=2, sequence_parallel=True)
        h = hidden[rank * b.total_len // 2 : (rank + 1) * b.total_len // 2]
        with routing_replay(model, local) as slots:
            for s in slots:
                idx = _route(s, h)[2].nonzero()[:, 1].view(-1, K)
                assert torch.equal(idx, local[:, s.layer_number - 1].long().sort(1).values)
    with pytest.raises(RouterReplayError, match="do not split"):
        local_routing(b.routed_experts[:-1], tp_rank=0, tp_size=2, sequence_parallel=True)


def test_refuses_when_replay_would_be_ignored_or_wrong(mp_state):
    with pytest.raises(RouterReplayError, match="moe_router_fusion"):
        find_router_replays(_model(moe_router_fusion=True))
    with pytest.raises(RouterReplayError, match="moe_enable_routing_replay"):
        find_router_replays(_model(moe_enable_routing_replay=False))
    with pytest.raises(RouterReplayError, match="capacity"):
        find_router_replays(_model(moe_expert_capacity_factor=1.0))
    slots = find_router_replays(_model())
    good = _random_routing(5, 5)
    with pytest.raises(RouterReplayError, match="top_k"):
        set_replay_targets(slots, torch.zeros(5, LAYERS, 3, dtype=torch.long))
    with pytest.raises(RouterReplayError, match="beyond"):
        set_replay_targets(slots, good[:, :3])
    with pytest.raises(RouterReplayError, match="outside"):
        set_replay_targets(slots, good + E)
    with pytest.raises(RouterReplayError, match="repeats an expert"):
        set_replay_targets(slots, torch.zeros(5, LAYERS, K, dtype=torch.long))
    with pytest.raises(RouterReplayError, match="no MoE router"):
        find_router_replays(torch.nn.Linear(2, 2))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: TopKRouter.gating moves router weights to the GPU")
def test_full_forward_replay_cuda(mp_state):
    model = _model().cuda()
    tokens = torch.randint(0, 32, (1, 10), device="cuda")
    pos = torch.arange(10, device="cuda")[None]
    routed = _random_routing(10, 6).cuda()
    slots = find_router_replays(model)
    seen = {}
    hooks = [s.router.register_forward_hook(
        lambda mod, inp, out, n=s.layer_number: seen.__setitem__(n, out[1])) for s in slots]
    with routing_replay(model, routed):
        model(tokens, pos, None)
    for h in hooks:
        h.remove()
    for s in slots:  # the routing map the full forward used is the rollout's
        want = torch.zeros(10, E, dtype=torch.bool, device="cuda")
        want.scatter_(1, routed[:, s.layer_number - 1], True)
        assert torch.equal(seen[s.layer_number], want)
