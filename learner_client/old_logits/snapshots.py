"""Snapshot tracking: a bounded store of weight copies per live version, and the exact
recompute of old logprobs per token version (strategy (1) of arXiv 2605.12070).

The store holds CPU copies (detached, contiguous) keyed by version, at most ``max_versions``
of them; when full, the least recently used version (put or get) is evicted. Versions that
left the live window can be dropped explicitly with ``drop_older_than``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

Weights = Mapping[str, Tensor]
# run(weights, token_index) -> logprobs of the tokens at token_index (same length).
Runner = Callable[[Weights, Tensor], Tensor]


class SnapshotMissing(KeyError):
    """A token's version has no snapshot (evicted or never stored)."""


def cpu_copy(weights: Weights) -> dict[str, Tensor]:
    """Detached, contiguous CPU copies of every tensor (never aliases the live weights)."""
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in weights.items()}


class WeightSnapshotStore:
    """Bounded LRU store: version -> CPU copy of the weights that produced it."""

    def __init__(self, max_versions: int) -> None:
        if max_versions < 1:
            raise ValueError("max_versions must be >= 1")
        self.max_versions = max_versions
        self._snaps: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self.evictions = 0

    def __contains__(self, version: int) -> bool:
        return int(version) in self._snaps

    def __len__(self) -> int:
        return len(self._snaps)

    @property
    def versions(self) -> list[int]:
        return sorted(self._snaps)

    def put(self, version: int, weights: Weights) -> None:
        """Store a CPU copy of ``weights`` as ``version`` (replaces an existing copy)."""
        v = int(version)
        self._snaps[v] = cpu_copy(weights)
        self._snaps.move_to_end(v)
        while len(self._snaps) > self.max_versions:
            self._snaps.popitem(last=False)
            self.evictions += 1

    def get(self, version: int) -> dict[str, Tensor]:
        v = int(version)
        try:
            snap = self._snaps[v]
        except KeyError:
            raise SnapshotMissing(f"no weight snapshot for version {v}; held: "
                                  f"{self.versions}") from None
        self._snaps.move_to_end(v)
        return snap

    def drop_older_than(self, min_live_version: int) -> int:
        """Drop every snapshot below ``min_live_version``; returns how many were dropped."""
        dead = [v for v in self._snaps if v < min_live_version]
        for v in dead:
            del self._snaps[v]
        return len(dead)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for s in self._snaps.values() for t in s.values())

    def recompute(self, versions: Tensor, run: Runner, token_index: Tensor | None = None,
                  missing: str = "raise", dtype: torch.dtype = torch.float32) -> Tensor:
        """Old logprobs [N] for tokens of the given per-token ``versions``.

        Tokens are grouped by version; ``run`` is called once per distinct version with that
        version's weights and the indices (into the [N] batch) of its tokens. When
        ``token_index`` is given, only those tokens are computed (others are NaN).
        ``missing``: ``raise`` (SnapshotMissing) or ``nan`` (leave those tokens NaN).
        """
        flat_v = versions.reshape(-1)
        if missing not in ("raise", "nan"):
            raise ValueError("missing must be 'raise' or 'nan'")
        out = torch.full(flat_v.shape, float("nan"), dtype=dtype)
        idx_all = (torch.arange(flat_v.numel()) if token_index is None
                   else token_index.reshape(-1).to(torch.long))
        if idx_all.numel() == 0:
            return out.reshape(versions.shape)
        v_sel = flat_v[idx_all]
        for v in torch.unique(v_sel).tolist():
            idx = idx_all[v_sel == v]
            if int(v) not in self._snaps:
                if missing == "nan":
                    continue
                raise SnapshotMissing(f"no weight snapshot for version {int(v)}; held: "
                                      f"{self.versions}")
            vals = run(self.get(int(v)), idx)
            if vals.shape != idx.shape:
                raise ValueError(f"runner returned shape {tuple(vals.shape)} for "
                                 f"{idx.numel()} tokens")
            out[idx] = vals.detach().to("cpu", dtype)
        return out.reshape(versions.shape)


def functional_runner(model: nn.Module, batch_logprobs: Callable[[Callable[..., Any]], Tensor],
                      device: torch.device | str | None = None) -> Runner:
    """A Runner for an nn.Module: ``batch_logprobs(forward)`` must return the [N] logprobs of
    the whole batch, where ``forward(*args, **kwargs)`` runs ``model`` with the snapshot's
    weights (torch.func.functional_call; the live parameters are never touched). Runs under
    no_grad; the requested tokens are then selected."""

    def run(weights: Weights, token_index: Tensor) -> Tensor:
        w = weights if device is None else {k: v.to(device) for k, v in weights.items()}

        def forward(*args: Any, **kwargs: Any) -> Any:
            return torch.func.functional_call(model, dict(w), args, kwargs, strict=False)

        with torch.no_grad():
            lp = batch_logprobs(forward).reshape(-1)
        return lp[token_index.to(lp.device)].to("cpu")

    return run


def live_window(versions: Iterable[int]) -> int:
    """W_stale: width of the live version window (max - min + 1), 0 when empty."""
    vs = list(versions)
    return (max(vs) - min(vs) + 1) if vs else 0
