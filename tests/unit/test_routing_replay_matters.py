"""Routing replay (R3) must matter, in both learners: the samples come from a router that
disagrees with the learner's (``rollout_demo.lab.routing.biased_routing``: top-k of the
logits plus a fixed per-layer expert bias, the model's own weights on the chosen
experts), so the learner's own routing is *not* the one that generated the tokens.

* R3 on: the learner routes every token to the recorded experts, and its log pi equals
  the sampler's log mu (same weights, same weighting rule);
* R3 off: the learner's own routing, measurably different log pi and gradients;
* a replay=False Megatron forward after a replayed one routes freely again (the routers
  keep no stale targets).

Before this file the Megatron learner's tests sampled from the learner's own weights, so
they passed with routing replay switched off.
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("megatron.core")

from learner_client.hf import load_model, packed_logprobs, record_routing
from rollout_demo import task
from rollout_demo.lab.routing import biased_routing, router_bias, routing_disagreement
from rollout_demo.learner import Learner, pack_batch
from rollout_demo.megatron_learner import (
    MegatronLearner,
    build_gpt,
    cpu_shims,
    load_engine_weights,
    single_process_parallel_state,
)
from rollout_demo.sampler import sample_groups
from reference_engine.checkpoint import init_checkpoint, read_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def mp_state():
    with single_process_parallel_state():
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return init_checkpoint(tmp_path_factory.mktemp("r3") / "v0", seed=4)


@pytest.fixture(scope="module")
def samples(ckpt):
    """GRPO groups sampled through the biased router (what an engine that routes
    differently from the trainer returns: tokens, log mu, routed experts)."""
    model = load_model(ckpt)
    rng = random.Random(1)
    prompts = [task.make_prompt(rng)[1] for _ in range(3)]
    with biased_routing(model, router_bias(model, 0.5, seed=1)):
        out = sample_groups(model, prompts, 4, 6, temperature=1.0, version=0,
                            groups=["a", "b", "c"], reward_fn=task.reward,
                            generator=torch.Generator().manual_seed(0))
    assert len({s.reward for s in out}) > 1  # non-zero advantages
    # the premise: the learner's own routing is not the sampler's on many (token, layer)s
    assert routing_disagreement(load_model(ckpt), out) > 0.1
    return out


def test_torch_r3_reproduces_the_samplers_logprobs_and_no_r3_does_not(ckpt, samples):
    model = load_model(ckpt)
    batch = pack_batch(samples, True)
    mu = batch.columns["rollout_logprobs"]
    with torch.no_grad():
        on, _ = packed_logprobs(model, batch, replay=True)
        off, _ = packed_logprobs(model, batch, replay=False)
    torch.testing.assert_close(on, mu, atol=1e-4, rtol=0)
    assert float((off - mu).abs().mean()) > 0.05


def _routing_maps(model):
    """Forward hooks on megatron's routers: {layer_number: routing_map [S, E] bool}."""
    from learner_client.megatron.router_replay import find_router_replays

    seen: dict[int, torch.Tensor] = {}
    hooks = [s.router.register_forward_hook(
        lambda mod, inp, out, n=s.layer_number: seen.__setitem__(n, out[1].detach().clone()))
        for s in find_router_replays(model)]
    return seen, hooks


def _as_map(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    m = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool)
    return m.scatter_(1, idx.long(), True)


def _mcore_logprobs(model, batch, replay: bool) -> torch.Tensor:
    from learner_client.megatron.forward_step import make_forward_step

    fs = make_forward_step("tis", replay=replay, attention="mask")
    with cpu_shims(), torch.no_grad():
        out, loss_func = fs(iter([batch]), model)
        return loss_func(out, non_loss_data=True)["logprobs"]


def test_megatron_r3_uses_the_recorded_routing_and_no_r3_its_own(mp_state, ckpt, samples):
    mc = read_config(ckpt)
    model = build_gpt(mc)
    load_engine_weights(model, ckpt, mc)
    replayed, free = pack_batch(samples, True), pack_batch(samples, False)
    mu = replayed.columns["rollout_logprobs"]
    hf = load_model(ckpt)
    with torch.no_grad(), record_routing(hf) as rec:
        hf_free, _ = packed_logprobs(hf, free, replay=False)
    seen, hooks = _routing_maps(model)
    try:
        on = _mcore_logprobs(model, replayed, replay=True)
        on_maps = dict(seen)
        off = _mcore_logprobs(model, free, replay=False)  # right after a replayed forward
    finally:
        for h in hooks:
            h.remove()
    assert sorted(on_maps) == [1, 2, 3, 4]
    differs = 0
    for n, got in on_maps.items():
        recorded = _as_map(replayed.routed_experts[:, n - 1], mc.num_experts)
        own = _as_map(rec["routed"][:, n - 1], mc.num_experts)
        assert torch.equal(got, recorded), f"layer {n}: R3 on did not use the recorded experts"
        assert torch.equal(seen[n], own), f"layer {n}: R3 off did not route by itself"
        differs += int((recorded != own).any(-1).sum())
    assert differs > 0.1 * replayed.total_len * len(on_maps)
    torch.testing.assert_close(on, mu, atol=1e-4, rtol=0)
    torch.testing.assert_close(off, hf_free, atol=2e-4, rtol=0)  # its own routing = HF's own
    assert float((off - mu).abs().mean()) > 0.05


def test_r3_changes_the_update_the_same_way_in_both_learners(mp_state, ckpt, samples,
                                                             tmp_path):
    start = load_file(str(ckpt / "model.safetensors"))
    weights = {}
    for replay in (True, False):
        kw = dict(loss="tis", lr=0.5, optimizer="sgd", grad_clip=0.0, replay=replay)
        plain, mega = Learner(ckpt, **kw), MegatronLearner(ckpt, **kw)
        a, b = plain.train_step(samples), mega.train_step(samples)
        # mismatch: mean |log pi - log mu| before the step on tokens of the learner's version
        assert b.mismatch == pytest.approx(a.mismatch, abs=1e-4)
        if replay:
            assert a.mismatch < 1e-4
        else:
            assert a.mismatch > 0.05
        want = load_file(str(plain.save(tmp_path / f"plain-{replay}") / "model.safetensors"))
        got = load_file(str(mega.save(tmp_path / f"mega-{replay}") / "model.safetensors"))
        for k in want:
            torch.testing.assert_close(got[k], want[k], atol=2e-5, rtol=1e-4, msg=k)
        weights[replay] = want
    step = max(float((weights[True][k] - start[k]).abs().max()) for k in start)
    apart = max(float((weights[True][k] - weights[False][k]).abs().max()) for k in start)
    assert step > 1e-3
    assert apart > 0.1 * step  # R3 off takes a measurably different step
