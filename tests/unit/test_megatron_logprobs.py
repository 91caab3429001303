"""Per-token logprobs / entropy (learner_client.logprobs), single process, full vocabulary."""

import pytest
import torch

from learner_client.logprobs import token_logprobs_entropy

torch.set_num_threads(1)


def _reference(x, t, temp):
    ls = torch.log_softmax(x.double() / temp, -1)
    return ls.gather(-1, t[..., None])[..., 0], -(ls.exp() * ls).sum(-1)


@pytest.mark.parametrize("temp,chunk", [(1.0, 1024), (0.7, 3), (1.3, 1)])
def test_values_and_gradients_match_log_softmax(temp, chunk):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 7, 13, generator=g)).requires_grad_()
    t = torch.randint(0, 13, (2, 7), generator=g)
    lp, h = token_logprobs_entropy(x, t, temperature=temp, chunk_size=chunk)
    lpr, hr = _reference(x, t, temp)
    assert lp.dtype == torch.float32 and lp.shape == (2, 7)
    torch.testing.assert_close(lp.double(), lpr, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h.double(), hr, atol=1e-5, rtol=1e-5)
    w1, w2 = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)
    (g1,) = torch.autograd.grad((lp * w1 + h * w2).sum(), x)
    (g2,) = torch.autograd.grad((lpr * w1 + hr * w2).sum(), x)
    torch.testing.assert_close(g1, g2, atol=1e-5, rtol=1e-4)


def test_gradcheck_float64_with_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 6, dtype=torch.float64, generator=g, requires_grad=True)
    rows = torch.tensor([0, 5, 6, 11])
    tg = torch.randint(0, 6, (4,), generator=g)
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs_entropy(x, tg, rows=rows, temperature=0.8, chunk_size=3), (x,))


def test_rows_select_only_those_positions():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 9, 5, generator=g)
    t = torch.randint(0, 5, (1, 9), generator=g)
    full_lp, full_h = token_logprobs_entropy(x, t)
    rows = torch.tensor([8, 2, 3])
    lp, h = token_logprobs_entropy(x, t[0, rows], rows=rows)
    torch.testing.assert_close(lp, full_lp[0, rows])
    torch.testing.assert_close(h, full_h[0, rows])


def test_input_logits_unchanged_bf16_and_fp32():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 11).to(dtype).requires_grad_()
        before, version = x.detach().clone(), x._version
        t = torch.randint(0, 11, (5,))
        lp, h = token_logprobs_entropy(x, t, temperature=0.5, chunk_size=2)
        (lp.sum() + h.sum()).backward()
        assert torch.equal(x.detach(), before) and x._version == version
        assert x.grad.dtype == dtype and torch.isfinite(x.grad.float()).all()


def test_bad_arguments():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_entropy(x, torch.zeros(3, dtype=torch.long), temperature=0)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs_entropy(x, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="rows out of range"):
        token_logprobs_entropy(x, torch.zeros(1, dtype=torch.long), rows=torch.tensor([3]))
    with pytest.raises(ValueError, match="floating point"):
        token_logprobs_entropy(torch.ones(3, 4, dtype=torch.long), torch.zeros(3, dtype=torch.long))
