"""The CPU ``sgl_kernel`` stand-in and the environment fixes (scripts/sglang_cpu/pythonpath).

The two helpers are checked against the semantics of SGLang's C++ kernels (per-request loops
written out plainly); the fixes are checked inside SGLang's own virtualenv, as the launched
server sees them: torchvision imports, the ``"cpu"`` allocator is there, and the stand-in does
not switch SGLang to its AMX kernels (no ``torch.ops.sgl_kernel`` op is registered).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess

import pytest
import torch
from _sglang_support import STAND_IN_PATH, SGLangServer

_spec = importlib.util.spec_from_file_location(
    "sgl_kernel_stand_in", STAND_IN_PATH / "sgl_kernel" / "__init__.py")
sk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sk)


def loop_assign(req_pool_indices, req_to_token, start, end, out_cache_loc):
    pt = 0
    for i in range(req_pool_indices.numel()):
        r, s, e = int(req_pool_indices[i]), int(start[i]), int(end[i])
        req_to_token[r, s:e] = out_cache_loc[pt:pt + e - s].to(torch.int32)
        pt += e - s


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool_cpu(idx_dtype):
    gen = torch.Generator().manual_seed(0)
    for trial in range(50):
        bs = int(torch.randint(1, 6, (1,), generator=gen))
        pool_len, reqs = 40, 8
        pool_idx = torch.randperm(reqs, generator=gen)[:bs].to(idx_dtype)
        start = torch.randint(0, 20, (bs,), generator=gen).to(idx_dtype)
        end = start + torch.randint(0, 20, (bs,), generator=gen).to(idx_dtype)  # some empty
        total = int((end - start).sum())
        loc = torch.randperm(10_000, generator=gen)[:total].to(torch.int64)
        table = torch.randint(0, 99, (reqs, pool_len), generator=gen, dtype=torch.int32)
        want = table.clone()
        loop_assign(pool_idx, want, start, end, loc)
        sk.assign_req_to_token_pool_cpu(pool_idx, table, start, end, loc, pool_len)
        assert torch.equal(table, want), trial


def test_assign_req_to_token_pool_cpu_rejects_wrong_pool_len():
    table = torch.zeros((2, 8), dtype=torch.int32)
    with pytest.raises(ValueError):
        sk.assign_req_to_token_pool_cpu(torch.tensor([0]), table, torch.tensor([0]),
                                        torch.tensor([2]), torch.tensor([5, 6]), 9)


def test_copy_all_layer_kv_cache_cpu_gathers_before_scattering():
    gen = torch.Generator().manual_seed(1)
    bufs = [torch.randn(64, 2, 16, generator=gen) for _ in range(4)]  # K/V of 2 layers
    bufs.append(torch.randint(0, 255, (64, 24), generator=gen, dtype=torch.uint8))
    # overlapping, chained moves: 3->5, 5->7, 7->3 (a cycle) and 10->11
    src = torch.tensor([3, 5, 7, 10])
    tgt = torch.tensor([5, 7, 3, 11])
    want = [b.clone() for b in bufs]
    for w in want:
        rows = w[src].clone()
        w[tgt] = rows
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    sk.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, w in zip(bufs, want):
        assert torch.equal(b, w)
    assert not torch.equal(bufs[0][5], bufs[0][3])  # something did move


def test_speculative_ops_raise_a_named_error():
    with pytest.raises(sk.SglKernelStandInUnsupported, match="verify_tree_greedy_cpu"):
        sk.verify_tree_greedy_cpu(1, 2)
    assert isinstance(sk.SglKernelStandInUnsupported("x"), NotImplementedError)
    assert not hasattr(sk, "fused_experts_cpu")  # what SGLang probes for stays absent


PROBE = r"""
import json, torch
import sitecustomize, torchvision
import sgl_kernel
from sglang.srt.utils.common import cpu_has_amx_support, is_cpu
from sglang.srt.mem_cache.pool_host import common
import sglang.srt.mem_cache.allocation as allocation
from sglang.srt.mem_cache.pool_host.common import HostTensorAllocator
buf = common.ALLOC_MEMORY_FUNCS["cpu"]((4, 2), dtype=torch.int32, device="cpu",
                                      pin_memory=True, allocator=HostTensorAllocator())
print(json.dumps({
    "applied": sitecustomize._APPLIED,
    "torchvision_ops": torchvision.extension._has_ops(),
    "stand_in": getattr(sgl_kernel, "STAND_IN", False),
    "is_cpu": is_cpu(),
    "amx": cpu_has_amx_support(),
    "sgl_kernel_ops": [n for n in torch._C._dispatch_get_all_op_names()
                       if n.startswith("sgl_kernel::")],
    "cpu_alloc": common.ALLOC_MEMORY_FUNCS["cpu"].__module__,
    "cuda_alloc": common.ALLOC_MEMORY_FUNCS["cuda"].__name__,
    "buf": [list(buf.shape), str(buf.device)],
    "allocation_uses_stand_in": allocation.assign_req_to_token_pool_cpu.__module__,
}))
"""


def test_fixes_as_the_server_sees_them(sglang_venv_python):
    env = SGLangServer(model_path=STAND_IN_PATH).environment()
    proc = subprocess.run([sglang_venv_python, "-c", PROBE], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["is_cpu"] is True and got["stand_in"] is True
    assert got["amx"] is False and got["sgl_kernel_ops"] == []
    assert got["torchvision_ops"] is False
    assert set(got["applied"]) == {"torchvision-meta-registrations-skipped",
                                   "pool-host-cpu-alloc"}
    assert got["cpu_alloc"] == "sitecustomize"
    assert got["cuda_alloc"] == "alloc_with_host_register"  # other devices: SGLang's own
    assert got["buf"] == [[4, 2], "cpu"]
    assert got["allocation_uses_stand_in"] == "sgl_kernel"
