"""Pure-torch stand-in for the few ``sgl_kernel`` helpers SGLang 0.5.23 imports by name on a
CPU without AMX (rollout-gateway test bed; see docs/gateway.md "Real SGLang in the test bed").

There is no CPU build of ``sgl_kernel`` on the package registry (``sglang-kernel`` is CUDA;
SGLang's CPU kernels need AVX-512/AMX and the full source tree). Without AMX, SGLang runs its
torch-native attention, MoE, top-k, activation and sampling paths and registers no
``torch.ops.sgl_kernel.*`` ops; it still imports these names at module level:

* :func:`assign_req_to_token_pool_cpu` (``sglang/srt/mem_cache/allocation.py``)
* :func:`copy_all_layer_kv_cache_cpu` (``sglang/kernels/ops/kvcache/cache_move.py``)
* the speculative-decoding helpers (``sglang/kernels/ops/speculative/*``,
  ``intel_amx_backend.py``): here they raise :class:`SglKernelStandInUnsupported` when called.

This package registers NO ``torch.ops.sgl_kernel`` op and defines nothing else: SGLang decides
on its AMX paths with ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")``, which stays
False, and every other ``from sgl_kernel import X`` fails with ImportError as it does without
the package. Semantics follow SGLang's C++ kernels (``sgl-kernel/csrc/cpu``) and the Triton
kernels they replace.
"""

from __future__ import annotations

import ctypes

import torch

__all__ = [
    "SglKernelStandInUnsupported",
    "assign_req_to_token_pool_cpu",
    "copy_all_layer_kv_cache_cpu",
]

STAND_IN = True  # lets a test tell this package from a real sgl_kernel


class SglKernelStandInUnsupported(NotImplementedError):
    """An ``sgl_kernel`` CPU op that the rollout-gateway stand-in does not implement."""

    def __init__(self, op: str) -> None:
        super().__init__(
            f"sgl_kernel.{op} is not available: this is rollout-gateway's pure-torch stand-in "
            "for the CPU sgl_kernel helpers (scripts/sglang_cpu), which implements only "
            "assign_req_to_token_pool_cpu and copy_all_layer_kv_cache_cpu. Speculative "
            "decoding is not supported on this test bed.")
        self.op = op


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Scatter freshly allocated KV slots into the request -> token table, in place:

    ``req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]] =
    out_cache_loc[p_i : p_i + (end_offset[i] - start_offset[i])]`` with ``p_i`` the sum of the
    lengths of requests ``0..i-1``. ``req_to_token`` is ``[max_reqs, pool_len]`` int32,
    ``out_cache_loc`` int64 (cast to int32 on store), offsets int32 or int64.
    """
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError("req_to_token must be a 2-D int32 tensor")
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"req_to_token.shape[1]={req_to_token.shape[1]} != pool_len={pool_len}")
    if start_offset.dtype != end_offset.dtype:
        raise ValueError("start_offset and end_offset must have the same dtype")
    bs = req_pool_indices.numel()
    if bs == 0:
        return
    start = start_offset[:bs].to(torch.int64)
    lengths = end_offset[:bs].to(torch.int64) - start
    if bool((lengths < 0).any()):
        raise ValueError("end_offset < start_offset")
    total = int(lengths.sum())
    if total == 0:
        return
    if out_cache_loc.numel() < total:
        raise ValueError(f"out_cache_loc has {out_cache_loc.numel()} slots, {total} needed")
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64), lengths)
    first = torch.cumsum(lengths, 0) - lengths  # where each request's run starts in out_cache_loc
    cols = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(first - start, lengths)
    req_to_token[rows, cols] = out_cache_loc[:total].to(torch.int32)


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor,
                                tgt_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
    """For every K/V buffer ``b`` (base address ``data_ptrs[b]``, ``strides[b]`` bytes per slot
    row): ``buf_b[tgt_loc[i], :] = buf_b[src_loc[i], :]`` for every ``i``. All source rows of a
    buffer are read before any target row is written (gather, then scatter), so overlapping
    ``tgt_loc``/``src_loc`` are safe, as in the C++ and Triton kernels.
    """
    if data_ptrs.dtype != torch.uint64 or strides.dtype != torch.int64:
        raise ValueError("data_ptrs must be uint64 and strides int64")
    if tgt_loc.dtype != src_loc.dtype or tgt_loc.numel() != src_loc.numel():
        raise ValueError("tgt_loc and src_loc must have the same dtype and length")
    if data_ptrs.numel() != strides.numel():
        raise ValueError("data_ptrs and strides must have the same length")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    tgt = tgt_loc.to(torch.int64)
    src = src_loc.to(torch.int64)
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # advanced indexing on the right copies first


def _unsupported(op: str):
    def raiser(*args, **kwargs):
        raise SglKernelStandInUnsupported(op)

    raiser.__name__ = raiser.__qualname__ = op
    raiser.__doc__ = f"Not implemented by the stand-in: raises SglKernelStandInUnsupported({op!r})."
    return raiser


# The speculative-decoding CPU helpers SGLang imports by name when is_cpu().
_SPECULATIVE = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu",
    "verify_tree_greedy_cpu",
)
for _op in _SPECULATIVE:
    globals()[_op] = _unsupported(_op)
    __all__.append(_op)
del _op
