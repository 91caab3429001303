"""Swap mode: one enum, its wire words unchanged, converted once at each edge."""

from __future__ import annotations

import json

import orjson
import pytest

from rollout_gateway.core.swap_mode import SwapMode
from rollout_gateway.core.trajectory import Transition
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.registry.base import SwapRecord, SwapStatus
from rollout_gateway.transport.control_plane import WeightSourceKind


def test_wire_words_and_parse():
    assert [m.value for m in SwapMode] == ["in_place", "retract", "abort_resume", "drain"]
    assert SwapMode.parse("retract") is SwapMode.RETRACT
    assert SwapMode.parse(SwapMode.DRAIN) is SwapMode.DRAIN
    with pytest.raises(InvalidArgument, match="swap mode must be one of in_place, retract"):
        SwapMode.parse("sideways")
    with pytest.raises(InvalidArgument, match="weight source kind must be one of path"):
        WeightSourceKind.parse("disk")
    assert orjson.dumps({"mode": SwapMode.IN_PLACE}) == b'{"mode":"in_place"}'
    assert json.dumps(SwapMode.ABORT_RESUME) == '"abort_resume"'


def test_each_mode_names_the_transition_it_stamps():
    assert {m: m.transition for m in SwapMode} == {
        SwapMode.IN_PLACE: Transition.IN_PLACE, SwapMode.RETRACT: Transition.RETRACT,
        SwapMode.ABORT_RESUME: Transition.ABORT_RESUME, SwapMode.DRAIN: Transition.DRAIN}


def test_a_stored_swap_record_reads_back_as_the_enum():
    rec = SwapRecord(version=3, mode=SwapMode.RETRACT)
    d = orjson.loads(orjson.dumps(rec.to_dict()))
    assert d["mode"] == "retract"
    assert SwapRecord.from_dict(d).mode is SwapMode.RETRACT


def test_a_record_names_the_checkpoint_it_installed():
    disk = {"version": 2, "mode": "abort_resume", "source": "/ckpt/v2"}
    assert SwapRecord(**disk, status="succeeded").checkpoint == "/ckpt/v2"
    assert SwapRecord(**disk, status=SwapStatus.PARTIAL).checkpoint == "/ckpt/v2"
    assert SwapRecord(**disk, status="failed").checkpoint is None
    assert SwapRecord(**disk).checkpoint is None  # still running
    assert SwapRecord(version=3, mode="drain", status="succeeded",
                      source="distributed:g@h:1").checkpoint is None
    assert SwapRecord(version=3, mode="drain", status="succeeded").checkpoint is None  # announce
    with pytest.raises(InvalidArgument, match="swap status must be one of running"):
        SwapRecord(version=1, mode="drain", status="done")
