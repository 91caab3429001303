"""Property tests of rollout_proto.codec: round trips of random trajectories, and random,
truncated, mutated and hostile bytes never raise anything but CodecError; whatever the
codec accepts agrees with protobuf's generated classes."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from learner_client.wire import parse_batch as learner_parse
from rollout_gateway.core import trajectory_codec
from rollout_gateway.errors import InvalidArgument
from doubles.trajectories import make_trajectory
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import trajectory_pb2 as tpb

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


def _blob(n_tokens=(40, 0, 3), layers=(3, 0, 2)):
    trajs = [make_trajectory(f"t{i}", num_tokens=t, num_layers=lay, num_experts=16,
                             old_logprobs=i == 0, seed=i, versions=(1, 2) if t > 1 else (1,))
             for i, (t, lay) in enumerate(zip(n_tokens, layers))]
    trajs[0].metadata["q"] = "ü"
    return codec.encode_batch([(f"{i}-0", i + 1, bool(i % 2), trajectory_codec.encode(t))
                               for i, t in enumerate(trajs)], 7, 123)


BLOB = _blob()


def _agrees_with_protobuf(data: bytes, got) -> None:
    """What the codec accepted must be what protobuf reads (the reference decoder)."""
    deliveries, batch = got
    ref = spb.Batch.FromString(data)
    assert (batch.credit_trajectories, batch.credit_tokens) == (ref.credit_trajectories,
                                                                ref.credit_tokens)
    assert len(deliveries) == len(ref.deliveries)
    for (d, t), rd in zip(deliveries, ref.deliveries):
        assert (d.entry_id, d.delivery_count, d.masked) == (rd.entry_id, rd.delivery_count,
                                                            rd.masked)
        if t is None:  # a delivery by reference (a mutated field number can make one)
            assert rd.HasField("reference") and not rd.HasField("trajectory")
            assert d.reference == rd.reference
            continue
        rt = rd.trajectory
        assert t.message.trajectory_id == rt.trajectory_id
        assert list(t.message.segments) == list(rt.segments)
        assert dict(t.message.metadata) == dict(rt.metadata)
        for path, arr in t.columns.items():
            msg = rt
            for part in path.split("."):
                msg = getattr(msg, part)
            assert arr.dtype.str == msg.dtype and list(arr.shape) == list(msg.shape)
            assert arr.tobytes() == msg.data


def _decode_all(data: bytes) -> None:
    try:
        got = codec.parse_batch(data)
    except codec.CodecError:
        pass
    else:
        _agrees_with_protobuf(data, got)
    try:
        codec.decode_trajectory(data)
    except codec.CodecError:
        pass
    try:
        learner_parse(data)
    except Exception as exc:  # noqa: BLE001 - the property: only the documented error
        assert type(exc).__name__ == "DecodeError", repr(exc)
    try:
        trajectory_codec.decode(data)
    except InvalidArgument:
        pass


@FUZZ
@given(st.binary(max_size=400))
def test_random_bytes_raise_only_codec_errors(data):
    _decode_all(data)


@FUZZ
@given(st.integers(0, len(BLOB)))
def test_every_truncation_is_rejected_or_agrees(cut):
    _decode_all(BLOB[:cut])


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(BLOB) - 1), st.integers(0, 255)),
                min_size=1, max_size=4))
def test_mutated_bytes_are_rejected_or_agree(edits):
    data = bytearray(BLOB)
    for pos, val in edits:
        data[pos] = val
    _decode_all(bytes(data))


def test_a_delivery_by_reference_agrees_with_protobuf():
    """Found by the fuzzer: a mutated field number can turn a delivery's trajectory (field
    4) into a reference (field 5); the codec hands back None for it, and the comparison
    with protobuf must read the reference then, not a trajectory."""
    ref = spb.StoreReference(kind="redis-stream", key="k", size=3)
    data = spb.Batch(deliveries=[spb.Delivery(entry_id="1-0", delivery_count=1,
                                              reference=ref)]).SerializeToString()
    got = codec.parse_batch(data)
    assert got[0][0][1] is None
    _agrees_with_protobuf(data, got)


@FUZZ
@given(st.binary(max_size=64), st.integers(0, len(BLOB)))
def test_inserted_bytes_are_rejected_or_agree(junk, pos):
    _decode_all(BLOB[:pos] + junk + BLOB[pos:])


def _array(dtype, shape, data):
    return tpb.Array(dtype=dtype, shape=shape, data=data)


@pytest.mark.parametrize("arr", [
    _array("<i4", [1 << 40, 1 << 40], b""),          # huge shape, no bytes
    _array("<i4", [-1], b""),                         # negative dimension
    _array("<i4", [0, 1 << 62], b""),                 # empty but absurd
    _array("<i4", [1] * 40, b"\x00" * 4),             # more dims than numpy allows
    _array("<i4", [3], b"\x00" * (1 << 20)),          # far too many bytes
    _array("\xff\xfe", [1], b"\x00"),                 # undecodable dtype name
    _array("V4", [1], b"\x00" * 4),                   # numpy-valid, not in the policy
])
def test_hostile_arrays_are_clean_errors(arr):
    msg = tpb.Trajectory.FromString(trajectory_codec.encode(make_trajectory("h", num_tokens=3)))
    msg.token_ids.CopyFrom(arr)
    data = msg.SerializeToString()
    with pytest.raises(codec.CodecError):
        codec.decode_trajectory(data)
    _decode_all(codec.encode_batch([("1-0", 1, False, data)], 0, 0))


@pytest.mark.parametrize("data", [
    b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a length past 2**63
    b"\x0a" + b"\xff" * 11,                              # a varint that never ends
    b"\x0b\x0c",                                         # group wire types
    b"\x00\x00",                                         # field number 0
    b"\x0a\x02\x22\x00",                                 # a delivery, empty trajectory
    b"\x0a\x04\x22\x02\x2a\x00" * 3,                     # trajectory with an empty column
])
def test_hostile_framing_is_a_clean_error(data):
    with pytest.raises(codec.CodecError):
        codec.parse_batch(data)
    _decode_all(data)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 70), prompt=st.integers(0, 20), layers=st.integers(0, 3),
       experts=st.sampled_from([2, 255, 256, 70000]), nver=st.integers(1, 3),
       reward=st.one_of(st.none(), st.floats(allow_nan=False)),
       meta=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
       masked=st.booleans(), count=st.integers(1, 2**32 - 1))
def test_roundtrip_through_every_path(tokens, prompt, layers, experts, nver, reward, meta,
                                      masked, count):
    versions = tuple(range(min(nver, max(tokens, 1))))
    t = make_trajectory("r", num_tokens=tokens, prompt_len=max(prompt, 1), num_layers=layers,
                        num_experts=experts, versions=versions, reward=reward, top_k=2)
    t.metadata.update(meta)
    data = trajectory_codec.encode(t)
    back = trajectory_codec.decode(data)
    # store -> decode -> store gives the same message (map order may differ)
    assert tpb.Trajectory.FromString(trajectory_codec.encode(back)) == tpb.Trajectory.FromString(data)
    [r], n, tok = learner_parse(codec.encode_batch([("9-9", count, masked, data)], 1, 2))
    assert (r.delivery_count, r.masked, n, tok) == (count, masked, 1, 2)
    assert r.metadata == t.metadata and r.reward == t.reward
    np.testing.assert_array_equal(r.token_ids, t.tokens.token_ids)
    np.testing.assert_array_equal(r.policy_version, t.tokens.policy_version)
    np.testing.assert_array_equal(r.prompt_token_ids, t.prompt_token_ids)
    if layers:
        assert r.routed_experts.dtype == t.routed_experts.data.dtype
        np.testing.assert_array_equal(r.routed_experts, t.routed_experts.data)
    else:
        assert r.routed_experts is None
