"""The weights manifest (swap/manifest.py): checksums of read-back tensors, exact through
JSON, and a malformed manifest refused by name."""

from __future__ import annotations

import json

import orjson
import pytest
import torch

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.swap.manifest import MANIFEST_FILE, checksum, read_manifest, write_manifest


def test_a_tensor_read_back_through_json_matches_its_manifest(tmp_path):
    t = torch.randn(6, 5, dtype=torch.bfloat16)
    write_manifest(tmp_path, {"w": t, "b": torch.randn(7)}, truncate_size=3)
    m = read_manifest(str(tmp_path))
    assert m is not None and m.truncate_size == 3 and set(m.tensors) == {"w", "b"}
    back = orjson.loads(orjson.dumps(t.float().tolist()[:3]))  # what the engine answers
    assert checksum(back) == m.tensors["w"]
    other = t.float().clone()
    other[2, 4] += 1e-3  # one value differs
    assert checksum(other.tolist()[:3]) != m.tensors["w"]
    assert checksum(t.float().tolist()[:2]) != m.tensors["w"]  # fewer rows


def test_no_manifest_is_none_and_a_malformed_one_is_refused(tmp_path):
    assert read_manifest(str(tmp_path)) is None
    (tmp_path / MANIFEST_FILE).write_text(json.dumps({"format": "x", "tensors": {}}))
    with pytest.raises(InvalidArgument, match="not a rollout-gateway.weights-manifest/1"):
        read_manifest(str(tmp_path))
    (tmp_path / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(InvalidArgument):
        read_manifest(str(tmp_path))
