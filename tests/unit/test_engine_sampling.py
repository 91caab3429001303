"""Sampling math: logprobs/entropy before filtering, filters, greedy, tokenizer."""

from __future__ import annotations

import math

import torch

from reference_engine.sampling import SamplingSpec, entropy_of, filtered_probs, sample
from reference_engine.tokenizer import EOS_ID, ByteTokenizer


def test_logprobs_and_entropy_are_temperature_scaled_and_unfiltered():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    spec = SamplingSpec.make(0.5, 0.5, 2, 0.0)
    gen = torch.Generator().manual_seed(0)
    res = sample(logits, [spec], [gen])
    p = torch.softmax(logits[0] / 0.5, -1)
    assert math.isclose(res.logprobs[0].item(), math.log(p[res.tokens[0]].item()), rel_tol=1e-5)
    assert math.isclose(res.entropy[0].item(), -(p * p.log()).sum().item(), rel_tol=1e-5)


def test_filters():
    logp = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.equal(filtered_probs(logp, SamplingSpec(1.0, 1.0, 2, 0.0)) > 0,
                       torch.tensor([True, True, False, False]))
    assert torch.equal(filtered_probs(logp, SamplingSpec(1.0, 0.7, -1, 0.0)) > 0,
                       torch.tensor([True, True, False, False]))
    assert torch.equal(filtered_probs(logp, SamplingSpec(1.0, 1.0, -1, 0.2)) > 0,
                       torch.tensor([True, True, True, False]))
    assert math.isclose(filtered_probs(logp, SamplingSpec(1.0, 0.7, -1, 0.0)).sum().item(), 1.0,
                        rel_tol=1e-6)


def test_greedy_and_seeded_sampling():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    greedy = sample(logits, [SamplingSpec.make(0.0, 1.0, -1, 0.0)] * 3, [None] * 3)
    assert torch.equal(greedy.tokens, logits.argmax(-1))
    assert torch.allclose(greedy.logprobs, torch.log_softmax(logits, -1).max(-1).values)
    specs = [SamplingSpec.make(1.0, 1.0, -1, 0.0)] * 3
    a = sample(logits, specs, [torch.Generator().manual_seed(i) for i in range(3)])
    b = sample(logits, specs, [torch.Generator().manual_seed(i) for i in range(3)])
    assert torch.equal(a.tokens, b.tokens)
    assert torch.allclose(entropy_of(torch.log_softmax(logits, -1)), a.entropy)


def test_tokenizer_roundtrip_and_partial_utf8():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓", add_bos=True)
    assert tok.decode(ids) == "héllo ✓"
    partial = tok.encode("✓")[:2]
    assert tok.decode(partial) == "\ufffd" or "\ufffd" in tok.decode(partial)
    assert tok.decode([EOS_ID, 65], skip_special_tokens=False) == "<|eos|>A"
    assert tok.decode([999, 65]) == "A"


def test_complete_prefix_len_holds_back_partial_characters():
    tok = ByteTokenizer()
    ids = tok.encode("a✓é")  # 1 + 3 + 2 bytes
    cuts = [tok.complete_prefix_len(ids[:i]) for i in range(len(ids) + 1)]
    assert cuts == [0, 1, 1, 1, 4, 4, 6]
    assert tok.complete_prefix_len([0xFF]) == 1  # invalid byte: nothing to wait for


def test_unseeded_plain_rows_sample_from_the_scaled_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0]]).repeat(4000, 1)
    res = sample(logits, [SamplingSpec.make(2.0, 1.0, -1, 0.0)] * 4000, [None] * 4000)
    freq = torch.bincount(res.tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.03)
    assert torch.allclose(res.logprobs, torch.log_softmax(logits / 2.0, -1).gather(
        1, res.tokens[:, None])[:, 0])
