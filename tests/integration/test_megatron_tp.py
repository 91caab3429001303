"""Vocab-parallel logprobs/entropy at TP=2: two gloo processes, megatron-core's own groups."""

import os

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.integration

V, ROWS = 22, 16


def _free_port() -> int:
    from rollout_gateway.commands.engine_process import free_port

    return free_port()


def _worker(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from learner_client.megatron.logprobs import vocab_parallel_logprobs_entropy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        assert parallel_state.get_tensor_model_parallel_world_size() == world
        g = torch.Generator().manual_seed(0)
        full = 4 * torch.randn(1, ROWS, V, generator=g)  # same on every rank
        targets = torch.randint(0, V, (1, ROWS), generator=g)
        w1, w2 = torch.randn(1, ROWS, generator=g), torch.randn(1, ROWS, generator=g)
        part = V // world
        local = full[..., rank * part : (rank + 1) * part].clone().requires_grad_()
        before = local.detach().clone()

        lp, ent = vocab_parallel_logprobs_entropy(local, targets, temperature=0.7, chunk_size=4)
        (lp * w1 + ent * w2).sum().backward()
        assert torch.equal(local.detach(), before), "input logits were modified"

        ref = full.clone().requires_grad_()
        ls = torch.log_softmax(ref / 0.7, -1)
        lp_ref = ls.gather(-1, targets[..., None])[..., 0]
        ent_ref = -(ls.exp() * ls).sum(-1)
        (lp_ref * w1 + ent_ref * w2).sum().backward()
        torch.testing.assert_close(lp, lp_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
        # each rank owns the gradient of its vocabulary slice
        torch.testing.assert_close(local.grad, ref.grad[..., rank * part : (rank + 1) * part],
                                   atol=1e-5, rtol=1e-4)

        # megatron's own vocab-parallel CE agrees (and needs a clone: it edits in place)
        scratch = (before / 0.7).clone()
        ce = vocab_parallel_cross_entropy(scratch, targets)
        torch.testing.assert_close(-ce, lp.detach(), atol=1e-5, rtol=1e-5)
        assert not torch.equal(scratch, before / 0.7), "megatron CE no longer edits in place?"

        # rows: only the requested positions, with the TP group given explicitly
        rows = torch.tensor([8, 0, 3])
        grp = parallel_state.get_tensor_model_parallel_group()
        lp_r, ent_r = vocab_parallel_logprobs_entropy(before, targets[0, rows], rows=rows,
                                                      tp_group=grp, temperature=0.7)
        torch.testing.assert_close(lp_r, lp.detach()[0, rows])
        torch.testing.assert_close(ent_r, ent.detach()[0, rows])

        _loss_func_at_tp2(rank, part, full)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def _loss_func_at_tp2(rank, part, full):
    """make_loss_func on vocab-parallel logits (TP group picked up from parallel_state)."""
    import numpy as np

    from learner_client.corrections import compute_loss
    from learner_client.megatron.loss import loss_inputs_from_batch, make_loss_func
    from learner_client.megatron.packing import PackSample, pack_samples

    rng = np.random.default_rng(0)
    batch = pack_samples([
        PackSample(rng.integers(0, V, p), rng.integers(0, V, t),
                   {"rollout_logprobs": np.log(rng.uniform(0.1, 0.9, t)).astype(np.float32),
                    "advantages": np.float32(rng.normal())})
        for p, t in [(3, 4), (2, 4)]])  # 13 positions
    assert batch.total_len <= ROWS
    logits = full[:, : batch.total_len]
    local = logits[..., rank * part : (rank + 1) * part].clone().requires_grad_()
    loss, num, _ = make_loss_func(batch, "ppo_clip", temperature=0.7)(local)
    ref_logits = logits.clone().requires_grad_()
    ls = torch.log_softmax(ref_logits[0] / 0.7, -1)
    ref, _ = compute_loss("ppo_clip", loss_inputs_from_batch(
        batch, ls[batch.logit_positions, batch.targets]))
    torch.testing.assert_close(loss / num, ref, atol=1e-5, rtol=1e-5)
    (loss / num).backward()
    ref.backward()
    torch.testing.assert_close(local.grad, ref_logits.grad[..., rank * part : (rank + 1) * part],
                               atol=1e-6, rtol=1e-4)


def test_vocab_parallel_logprobs_entropy_tp2_equal_full_vocabulary():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_worker, args=(2, _free_port()), nprocs=2, join=True)
