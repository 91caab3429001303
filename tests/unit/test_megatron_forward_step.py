"""make_forward_step with replay, driving megatron-core's real TopKRouter/RouterReplay on CPU.

GPTModel's full forward needs CUDA (router gating) and TransformerEngine (THD attention),
so the model here is a small stand-in with GPTModel's call signature whose MoE layers use
the real routers of a tiny megatron GPTModel (routing + replay run in megatron code).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from _megatron_support import single_rank_model_parallel
from learner_client.megatron.forward_step import make_forward_step
from learner_client.megatron.packing import PackSample, pack_samples
from learner_client.megatron.router_replay import RouterReplayError, find_router_replays

torch.set_num_threads(1)
E, K, LAYERS, H, V = 6, 2, 4, 16, 32


@pytest.fixture(scope="module")
def routers():
    with single_rank_model_parallel():
        yield _routers()


def _routers():
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=2,
                            num_moe_experts=E, moe_router_topk=K, moe_layer_freq=[0, 1, 0, 1],
                            moe_enable_routing_replay=True, use_cpu_initialization=True,
                            moe_token_dispatcher_type="allgather", moe_ffn_hidden_size=8,
                            ffn_hidden_size=32, add_bias_linear=False)
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_decoder_block_spec(
        cfg, use_transformer_engine=False), vocab_size=V, max_sequence_length=64)
    return [s.router for s in find_router_replays(gpt)]


class StandIn(torch.nn.Module):
    """embedding -> (real megatron router + toy experts) per MoE layer -> vocab logits."""

    def __init__(self, routers, recompute=False):
        super().__init__()
        torch.manual_seed(1)
        self.emb = torch.nn.Embedding(V, H)
        self.routers = torch.nn.ModuleList(routers)
        self.experts = torch.nn.Parameter(0.3 * torch.randn(len(routers), E, H, H))
        self.out = torch.nn.Linear(H, V)
        self.recompute = recompute
        self.seen = []  # (layer_number, routing map, grad enabled?) per router call

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        assert packed_seq_params.qkv_format == "thd" and attention_mask is None
        h = self.emb(input_ids[0])
        for i in range(len(self.routers)):
            if self.recompute:
                h = checkpoint(self._moe, h, i, use_reentrant=False)
            else:
                h = self._moe(h, i)
        return self.out(h)[None]  # [b=1, s, V] like GPTModel without labels

    def _moe(self, h, i):
        r = self.routers[i]
        probs, rmap = r.routing(F.linear(h, r.weight)[:, None])
        self.seen.append((r.layer_number, rmap.clone()))
        return h + torch.einsum("se,ehk,sk->sh", probs, self.experts[i], h)


def _batches(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        samples = []
        for p, t in [(3, 4), (2, 5)]:
            routing = np.stack([np.stack([rng.permutation(E)[:K] for _ in range(LAYERS)])
                                for _ in range(p + t - 1)])
            samples.append(PackSample(rng.integers(0, V, p), rng.integers(0, V, t),
                                      {"rollout_logprobs": np.full(t, -2.0, np.float32),
                                       "advantages": np.float32(rng.normal())},
                                      routed_experts=routing))
        out.append(pack_samples(samples))
    return out


def _want(batch, layer_number):
    m = torch.zeros(batch.total_len, E, dtype=torch.bool)
    return m.scatter_(1, batch.routed_experts[:, layer_number - 1].long(), True)


def test_forward_step_replays_and_keeps_the_backward_queue_bounded(routers):
    model = StandIn(routers)
    batches = _batches(3)
    fs = make_forward_step("ppo_clip", replay=True, tp_group=None)
    it = iter(batches)
    for b in batches:
        model.seen.clear()
        out, lf = fs(it, model)
        loss, num, _ = lf(out)
        (loss / num).backward()
        assert [ln for ln, _ in model.seen] == [2, 4]
        for ln, rmap in model.seen:
            assert torch.equal(rmap, _want(b, ln))
        # without recompute nothing stays queued, and no stale replay is left set
        assert all(len(r.router_replay.replay_backward_list) == 0 for r in routers)
        assert all(r.router_replay.router_replay_action is None for r in routers)
    assert model.experts.grad is not None and routers[0].weight.grad is not None


def test_recompute_replays_the_same_experts_in_backward(routers):
    b = _batches(1, seed=1)[0]
    grads = {}
    for recompute in (False, True):
        model = StandIn(routers, recompute=recompute)
        for r in routers:
            r.weight.grad = None
            r.router_replay.clear_indices()
        fs = make_forward_step("ppo_clip", replay=True, recompute=recompute, tp_group=None)
        out, lf = fs(iter([b]), model)
        loss, num, _ = lf(out)
        (loss / num).backward()
        if recompute:  # forward + recompute in backward, both with the rollout's experts
            assert [ln for ln, _ in model.seen] == [2, 4, 4, 2]
            assert all(len(r.router_replay.replay_backward_list) == 0 for r in routers)
        for ln, rmap in model.seen:
            assert torch.equal(rmap, _want(b, ln))
        grads[recompute] = [model.experts.grad.clone(), routers[0].weight.grad.clone()]
    for a, c in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, c)
    with torch.no_grad():  # a forward-only pass leaves nothing queued for backward
        make_forward_step("ppo_clip", replay=True, recompute=True, tp_group=None)(iter([b]), model)
    assert all(len(r.router_replay.replay_backward_list) == 0 for r in routers)


def test_without_replay_routing_is_free_and_missing_routing_is_refused(routers):
    for r in routers:
        r.router_replay.clear_indices()
        r.router_replay.clear_router_replay_action()
    model = StandIn(routers)
    b = _batches(1, seed=2)[0]
    out, lf = make_forward_step("ppo_clip", tp_group=None)(iter([b]), model)
    assert not all(torch.equal(rmap, _want(b, ln)) for ln, rmap in model.seen)
    b.routed_experts = None
    with pytest.raises(RouterReplayError, match="no routed_experts"):
        make_forward_step("ppo_clip", replay=True, tp_group=None)(iter([b]), model)
    with pytest.raises(TypeError, match="PackedBatch"):
        make_forward_step("ppo_clip", tp_group=None)(iter([{"tokens": 1}]), model)
