"""Pack trajectories into Megatron-Core's packed ("thd") layout.

Pure torch/numpy: megatron-core is imported only by :meth:`PackedBatch.packed_seq_params`,
so the plain PyTorch adapter can use the same packing.

Layout of one packed microbatch (batch dimension 1)::

    tokens  [1, S]  = seq_0 (prompt_0 + response_0, padded) | seq_1 ... | tail padding
    cu_seqlens         int32 [B+1]  cumulative *real* lengths  (P_i + T_i)
    cu_seqlens_padded  int32 [B+1]  cumulative *padded* lengths (where each sequence starts)

Response token t of sequence i sits at packed position ``o_i + P_i + t`` (``o_i`` =
``cu_seqlens_padded[i]``); its log-probability comes from the logits at the previous
position, so ``logit_positions = response_positions - 1`` (positions start-1 .. end-2 of
the response span [start, end)).

Per-token columns (rollout logprobs, versions, advantages, loss mask, ...) stay in the
flat *response* layout ``[N = sum_i T_i]`` with boundaries ``cu_response``, aligned
with ``logit_positions``; that is what the correction losses consume.
:meth:`PackedBatch.to_packed` scatters a column onto the packed positions when a
consumer wants ``[1, S]``.

Padding rules (the rule of megatron-core 0.16.1,
``megatron.core.models.multimodal.context_parallel.get_padding``, applied per sequence):

- context parallel (cp > 1): every sequence is padded to a multiple of ``2 * cp``
  (TransformerEngine's ``thd_get_partitioned_indices`` splits each sequence into 2*cp
  chunks for load balancing), or of ``tp * cp * 2`` when sequence parallelism is also on;
- sequence parallel only: the packed total must divide by ``tp`` (the sequence dimension
  is scattered over TP ranks), so the last sequence is padded;
- neither: no padding.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

__all__ = ["PackSample", "PackedBatch", "pack_samples", "sequence_padding_multiple"]


@dataclass(frozen=True)
class PackSample:
    """One trajectory as the learner packs it.

    Attributes:
        prompt_ids: prompt token ids, length P >= 1.
        response_ids: response token ids, length T >= 0.
        columns: per response token values, each of length T (or a scalar, broadcast to
            T, handy for per-sequence advantages). Names are free; the loss adapter
            reads ``rollout_logprobs``, ``old_logprobs``, ``advantages``, ``loss_mask``,
            ``entropy``, ``versions``.
        routed_experts: optional MoE routing ``[R, L, K]`` over all model layers for
            positions 0..R-1 of prompt + response; R = P + T - 1 as SGLang returns it
            (the last token gets no forward pass) or R = P + T.
    """

    prompt_ids: Any
    response_ids: Any
    columns: Mapping[str, Any] = field(default_factory=dict)
    routed_experts: Any = None


def sequence_padding_multiple(tp_size: int = 1, cp_size: int = 1,
                              sequence_parallel: bool = False) -> int:
    """Multiple each packed sequence is padded to (Megatron-Core's get_padding rule)."""
    if tp_size < 1 or cp_size < 1:
        raise ValueError(f"tp_size and cp_size must be >= 1, got {tp_size}, {cp_size}")
    if cp_size > 1:
        return tp_size * cp_size * 2 if sequence_parallel else cp_size * 2
    return 1


@dataclass
class PackedBatch:
    """A packed microbatch plus the response-token view the losses need."""

    tokens: torch.Tensor  # [1, S] int64
    position_ids: torch.Tensor  # [1, S] int64, restarting at 0 for every sequence
    cu_seqlens: torch.Tensor  # [B+1] int32, real lengths
    cu_seqlens_padded: torch.Tensor  # [B+1] int32, padded lengths
    max_seqlen: int  # longest padded sequence
    prompt_lens: torch.Tensor  # [B] int64
    response_lens: torch.Tensor  # [B] int64
    response_positions: torch.Tensor  # [N] int64, packed positions of response tokens
    logit_positions: torch.Tensor  # [N] int64, = response_positions - 1
    targets: torch.Tensor  # [N] int64, the response token ids
    cu_response: torch.Tensor  # [B+1] int64, sequence boundaries in the response layout
    columns: dict[str, torch.Tensor]  # name -> [N]
    routed_experts: torch.Tensor | None = None  # [S, L, K] int32 (all layers)
    pad_token_id: int = 0

    @property
    def num_sequences(self) -> int:
        return int(self.prompt_lens.numel())

    @property
    def num_response_tokens(self) -> int:
        return int(self.targets.numel())

    @property
    def total_len(self) -> int:
        return int(self.tokens.shape[1])

    def column(self, name: str) -> torch.Tensor | None:
        """A per-response-token column, or None when absent."""
        return self.columns.get(name)

    def loss_mask(self) -> torch.Tensor:
        """``columns['loss_mask']`` as float, or all ones."""
        m = self.columns.get("loss_mask")
        if m is None:
            return torch.ones(self.num_response_tokens, dtype=torch.float32)
        return m.to(torch.float32)

    def to_packed(self, values: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter a ``[N]`` response-layout tensor onto packed positions: ``[1, S]``."""
        if values.shape[0] != self.num_response_tokens:
            raise ValueError(f"expected {self.num_response_tokens} values, got {values.shape[0]}")
        out = torch.full((self.total_len,), fill, dtype=values.dtype, device=values.device)
        out[self.response_positions.to(values.device)] = values
        return out.unsqueeze(0)

    def packed_seq_params(self) -> Any:
        """Megatron-Core ``PackedSeqParams`` (qkv_format "thd") for this batch."""
        from megatron.core.packed_seq_params import PackedSeqParams

        return PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=self.cu_seqlens,
            cu_seqlens_kv=self.cu_seqlens,
            cu_seqlens_q_padded=self.cu_seqlens_padded,
            cu_seqlens_kv_padded=self.cu_seqlens_padded,
            max_seqlen_q=self.max_seqlen,
            max_seqlen_kv=self.max_seqlen,
        )

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device`` (cu_seqlens included, as TE wants)."""
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return PackedBatch(
            tokens=mv(self.tokens), position_ids=mv(self.position_ids),
            cu_seqlens=mv(self.cu_seqlens), cu_seqlens_padded=mv(self.cu_seqlens_padded),
            max_seqlen=self.max_seqlen, prompt_lens=mv(self.prompt_lens),
            response_lens=mv(self.response_lens), response_positions=mv(self.response_positions),
            logit_positions=mv(self.logit_positions), targets=mv(self.targets),
            cu_response=mv(self.cu_response),
            columns={k: v.to(device) for k, v in self.columns.items()},
            routed_experts=mv(self.routed_experts), pad_token_id=self.pad_token_id,
        )


def _as_1d_int(x: Any, what: str, i: int) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1:
        raise ValueError(f"sample {i}: {what} must be 1-D, got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"sample {i}: {what} must be integers, got {a.dtype}")
    return a.astype(np.int64, copy=False)


def _column(x: Any, length: int, name: str, i: int) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim == 0:
        return np.full(length, a, dtype=a.dtype)
    if a.shape != (length,):
        raise ValueError(f"sample {i}: column {name!r} has shape {a.shape}, want ({length},)")
    return a


def _routing_rows(x: Any, p: int, t: int, padded: int, i: int,
                  lk: tuple[int, int] | None) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 3:
        raise ValueError(f"sample {i}: routed_experts must be [R, L, K], got shape {a.shape}")
    if lk is not None and a.shape[1:] != lk:
        raise ValueError(f"sample {i}: routed_experts layers/top_k {a.shape[1:]} != {lk}")
    n = p + t
    if a.shape[0] not in (n - 1, n) or a.shape[0] == 0:
        raise ValueError(
            f"sample {i}: routed_experts has {a.shape[0]} rows; want {n - 1} (SGLang: "
            f"prompt + response - 1) or {n}; routing must start at position 0"
        )
    out = np.empty((padded, a.shape[1], a.shape[2]), dtype=np.int32)
    out[: a.shape[0]] = a
    if a.shape[0] == n - 1:
        # The last token never had a forward pass on the engine; its routing cannot
        # affect any response logprob (causal attention), so reuse the previous row.
        out[n - 1] = a[-1]
    out[n:] = np.arange(a.shape[2], dtype=np.int32)  # padding rows: any distinct experts
    return out


def pack_samples(
    samples: Sequence[PackSample],
    *,
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
    pad_token_id: int = 0,
) -> PackedBatch:
    """Pack ``samples`` into one ``[1, S]`` microbatch (see the module docstring).

    Raises:
        ValueError: empty batch, an empty prompt, mismatched column lengths, or
            routed experts that do not cover every position from 0.
    """
    if not samples:
        raise ValueError("cannot pack an empty batch")
    multiple = sequence_padding_multiple(tp_size, cp_size, sequence_parallel)
    prompts, responses, real, padded = [], [], [], []
    for i, s in enumerate(samples):
        p = _as_1d_int(s.prompt_ids, "prompt_ids", i)
        r = _as_1d_int(s.response_ids, "response_ids", i)
        if p.size < 1:
            raise ValueError(f"sample {i}: empty prompt (the first response token needs a "
                             "preceding position to predict it)")
        prompts.append(p)
        responses.append(r)
        n = p.size + r.size
        real.append(n)
        padded.append(-(-n // multiple) * multiple)
    if sequence_parallel and tp_size > 1:
        total_multiple = tp_size * cp_size
        extra = (-sum(padded)) % total_multiple
        padded[-1] += extra
    bsz = len(samples)
    cu_real = np.zeros(bsz + 1, dtype=np.int64)
    cu_pad = np.zeros(bsz + 1, dtype=np.int64)
    cu_real[1:] = np.cumsum(real)
    cu_pad[1:] = np.cumsum(padded)
    total = int(cu_pad[-1])
    tokens = np.full(total, pad_token_id, dtype=np.int64)
    positions = np.zeros(total, dtype=np.int64)
    t_lens = np.array([r.size for r in responses], dtype=np.int64)
    cu_resp = np.zeros(bsz + 1, dtype=np.int64)
    cu_resp[1:] = np.cumsum(t_lens)
    resp_pos = np.empty(int(cu_resp[-1]), dtype=np.int64)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        o = int(cu_pad[i])
        tokens[o : o + p.size] = p
        tokens[o + p.size : o + p.size + r.size] = r
        positions[o : o + padded[i]] = np.arange(padded[i])
        resp_pos[cu_resp[i] : cu_resp[i + 1]] = np.arange(o + p.size, o + p.size + r.size)

    names = set().union(*(s.columns.keys() for s in samples))
    columns: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        parts = []
        for i, s in enumerate(samples):
            if name not in s.columns:
                raise ValueError(f"sample {i} lacks column {name!r} that other samples have")
            parts.append(_column(s.columns[name], int(t_lens[i]), name, i))
        columns[name] = torch.from_numpy(np.ascontiguousarray(np.concatenate(parts)))

    routed = None
    have_routing = [s.routed_experts is not None for s in samples]
    if any(have_routing):
        if not all(have_routing):
            raise ValueError("routed_experts must be given for every sample or for none")
        lk = None
        rows = []
        for i, s in enumerate(samples):
            rows.append(_routing_rows(s.routed_experts, prompts[i].size, int(t_lens[i]),
                                      padded[i], i, lk))
            lk = rows[-1].shape[1:]
        routed = torch.from_numpy(np.concatenate(rows))

    resp_pos_t = torch.from_numpy(resp_pos)
    return PackedBatch(
        tokens=torch.from_numpy(tokens).unsqueeze(0),
        position_ids=torch.from_numpy(positions).unsqueeze(0),
        cu_seqlens=torch.from_numpy(cu_real.astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(cu_pad.astype(np.int32)),
        max_seqlen=int(max(padded)),
        prompt_lens=torch.tensor([p.size for p in prompts], dtype=torch.int64),
        response_lens=torch.from_numpy(t_lens),
        response_positions=resp_pos_t,
        logit_positions=resp_pos_t - 1,
        targets=torch.from_numpy(tokens[resp_pos]),
        cu_response=torch.from_numpy(cu_resp),
        columns=columns,
        routed_experts=routed,
        pad_token_id=pad_token_id,
    )
