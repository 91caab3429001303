"""The weights manifest beside a checkpoint: checksums of a few sampled tensors.

A learner that writes a checkpoint may write ``weights_manifest.json`` into the same
directory::

    {"format": "rollout-gateway.weights-manifest/1", "truncate_size": 4,
     "tensors": {"model.layers.0.self_attn.q_proj.weight": "<sha256 hex>", ...}}

Each checksum covers what SGLang's ``/get_weights_by_name`` answers for the name with that
``truncate_size``: the parameter as float32 values, its first ``truncate_size`` rows
(``tensor.float().tolist()[:truncate_size]``). A refit reads every sampled tensor back
from each engine that loaded the checkpoint and compares (``swap.orchestrator``). JSON
floats written from float32 values round-trip exactly, so the sums are exact.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_gateway.errors import InvalidArgument

MANIFEST_FILE = "weights_manifest.json"
FORMAT = "rollout-gateway.weights-manifest/1"
#: rows read back per tensor by default (a few: the read-back crosses HTTP as JSON)
DEFAULT_TRUNCATE = 4


@dataclass(frozen=True, slots=True)
class Manifest:
    truncate_size: int
    tensors: dict[str, str]  # name -> checksum


def _flat(values: Any, out: list[float], shape: list[int], depth: int) -> None:
    if isinstance(values, list):
        if len(shape) <= depth:
            shape.append(len(values))
        for v in values:
            _flat(v, out, shape, depth + 1)
    else:
        out.append(float(values))


def checksum(values: Any) -> str:
    """sha256 of the float32 values (and their nesting) of a read-back parameter."""
    flat: list[float] = []
    shape: list[int] = []
    _flat(values, flat, shape, 0)
    h = hashlib.sha256(repr(shape).encode())
    h.update(struct.pack(f"<{len(flat)}f", *flat))
    return h.hexdigest()


def write_manifest(directory: str | Path, tensors: dict[str, Any],
                   truncate_size: int = DEFAULT_TRUNCATE) -> Path:
    """Write the manifest of ``tensors`` (name -> torch tensor, Hub names) into the
    checkpoint ``directory`` (the learner's side)."""
    sums = {n: checksum(t.detach().float().cpu().tolist()[:truncate_size])
            for n, t in tensors.items()}
    p = Path(directory) / MANIFEST_FILE
    p.write_text(json.dumps({"format": FORMAT, "truncate_size": truncate_size,
                             "tensors": sums}, indent=1))
    return p


def read_manifest(directory: str) -> Manifest | None:
    """The manifest beside a checkpoint; None when there is none (or the gateway cannot
    read the directory): verification is then by version only."""
    p = Path(directory) / MANIFEST_FILE
    try:
        raw = p.read_text()
    except OSError:
        return None
    try:
        d = json.loads(raw)
        size, sums = d["truncate_size"], d["tensors"]
        if d.get("format") != FORMAT or not isinstance(size, int) or size < 1 or not (
                isinstance(sums, dict) and sums
                and all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items())):
            raise ValueError("unexpected shape")
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidArgument(f"{p}: not a {FORMAT} manifest ({exc})") from exc
    return Manifest(truncate_size=size, tensors=sums)
