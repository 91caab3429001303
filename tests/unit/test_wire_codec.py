"""The one wire codec (rollout_proto.codec), on every path: the gateway's store encoding
(core.wire), the servicer's Batch framing, the learner's zero-copy Batch parse; checked
against protobuf's generated classes as the reference decoder."""

import numpy as np
import pytest

from learner_client.errors import DecodeError
from learner_client.wire import parse_batch
from rollout_gateway.core import trajectory_codec
from rollout_gateway.errors import InvalidArgument
from doubles.trajectories import make_trajectory
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import trajectory_pb2 as tpb

COLS = ("token_ids", "logprobs", "entropy", "policy_version", "kv_version", "old_logprobs")


def _pb_array(a: tpb.Array) -> np.ndarray:
    return np.frombuffer(a.data, dtype=a.dtype).reshape(tuple(a.shape))


def test_gateway_roundtrip_preserves_every_field():
    t = make_trajectory("x", versions=(3, 4), num_layers=5, top_k=2, num_experts=300,
                        old_logprobs=True, reward=None)
    t.metadata["k"] = "v"
    t.finish_reason.matched = 151643
    back = trajectory_codec.decode(trajectory_codec.encode(t))
    assert back.trajectory_id == "x" and back.group_id == t.group_id
    assert back.reward is None and back.metadata == t.metadata
    assert back.finish_reason == t.finish_reason
    assert back.segments == t.segments
    for name in COLS:
        np.testing.assert_array_equal(getattr(back.tokens, name), getattr(t.tokens, name))
    np.testing.assert_array_equal(back.prompt_token_ids, t.prompt_token_ids)
    re = back.routed_experts
    assert re.data.dtype == np.uint16 and re.data.shape == t.routed_experts.data.shape
    np.testing.assert_array_equal(re.data, t.routed_experts.data)


def test_stored_bytes_are_a_generated_trajectory_with_packed_columns():
    t = make_trajectory("x", num_tokens=7, num_layers=48, top_k=8, num_experts=128)
    msg = tpb.Trajectory.FromString(trajectory_codec.encode(t))
    assert (msg.token_ids.dtype, list(msg.token_ids.shape)) == ("<i4", [7])
    assert len(msg.token_ids.data) == 28
    assert msg.routed_experts.data.dtype == "|u1"
    assert list(msg.routed_experts.data.shape) == [8 + 7 - 1, 48, 8]
    assert not msg.HasField("old_logprobs")
    np.testing.assert_array_equal(_pb_array(msg.logprobs), t.tokens.logprobs)


def test_text_stop_string_and_empty_trajectory():
    t = make_trajectory("x", reward=None)
    t.finish_reason.matched = "</s>"
    back = trajectory_codec.decode(trajectory_codec.encode(t))
    assert back.finish_reason.matched == "</s>" and back.reward is None
    e = trajectory_codec.decode(trajectory_codec.encode(make_trajectory("e", num_tokens=0)))
    assert e.num_tokens == 0 and e.min_version == -1


def test_every_array_field_of_the_descriptor_is_a_column():
    """Field numbers come from the descriptors: every Array field (at any depth) is
    decoded as a column, so a field added to the .proto needs no code in the codec."""
    want = {f.name for f in tpb.Trajectory.DESCRIPTOR.fields
            if f.message_type is tpb.Array.DESCRIPTOR}
    want |= {"routed_experts.data"}
    got = {p[1] for p in codec._TRAJ_PLAN.values() if p[0] == "a"}
    got |= {q[1] for p in codec._TRAJ_PLAN.values() if p[0] == "m" for q in p[2].values()}
    assert got == want


def _entries(trajs, masked=()):
    return [(f"{i}-1", i + 1, i in masked, trajectory_codec.encode(t)) for i, t in enumerate(trajs)]


def test_batch_store_to_learner_matches_the_generated_classes():
    trajs = [make_trajectory("big", num_tokens=300, num_layers=48, versions=(1, 2),
                             old_logprobs=True),
             make_trajectory("small", num_tokens=1, reward=None),
             make_trajectory("empty", num_tokens=0)]
    trajs[0].metadata["x"] = "y"
    blob = codec.encode_batch(_entries(trajs, masked={1}), 5, 70000)
    ref = spb.Batch.FromString(blob)  # the reference decoder
    assert (ref.credit_trajectories, ref.credit_tokens) == (5, 70000)
    assert [d.entry_id for d in ref.deliveries] == ["0-1", "1-1", "2-1"]
    assert (ref.deliveries[0].trajectory.SerializeToString(deterministic=True)
            == trajectory_codec.encode(trajs[0]))
    got, n, tok = parse_batch(blob)
    assert (n, tok) == (5, 70000)
    for r, d, t in zip(got, ref.deliveries, trajs, strict=True):
        assert (r.entry_id, r.delivery_count, r.masked) == (d.entry_id, d.delivery_count,
                                                            d.masked)
        assert r.trajectory_id == t.trajectory_id and r.metadata == t.metadata
        assert r.reward == t.reward and r.finish_reason == t.finish_reason.type
        assert [(s.start, s.end, s.policy_version) for s in r.segments] == \
            [(s.start, s.end, s.policy_version) for s in t.segments]
        for name in COLS:
            a = getattr(r, name)
            if not d.trajectory.HasField(name):
                assert a is None
                continue
            ref_a = _pb_array(getattr(d.trajectory, name))
            assert a.dtype == ref_a.dtype
            np.testing.assert_array_equal(a, ref_a)
        if t.routed_experts is not None:
            np.testing.assert_array_equal(r.routed_experts, t.routed_experts.data)
            assert r.num_experts == t.routed_experts.num_experts
        assert not r.extra_columns
    assert got[0].token_ids.base is not None and not got[0].token_ids.flags.writeable
    assert np.shares_memory(got[0].logprobs, np.frombuffer(blob, np.uint8))  # zero copy


def test_empty_batch_is_empty_bytes():
    assert codec.encode_batch([], 0, 0) == b""
    assert parse_batch(b"") == ([], 0, 0)


@pytest.mark.parametrize("mutate, match", [
    (lambda m: setattr(m.token_ids, "dtype", "object"), "dtype 'object' not allowed"),
    (lambda m: setattr(m.token_ids, "dtype", "<f4"), "token_ids: dtype '<f4' not allowed"),
    (lambda m: setattr(m.routed_experts.data, "dtype", "<i4"), "routed_experts.data: dtype"),
    (lambda m: setattr(m.logprobs, "data", b"\x00" * 3), "do not match"),
    (lambda m: m.ClearField("token_ids"), "no token_ids"),
    (lambda m: m.ClearField("entropy"), "no entropy"),
    (lambda m: m.logprobs.shape.append(1), "logprobs has shape"),
    (lambda m: setattr(m, "trajectory_id", ""), "trajectory_id"),
])
def test_one_dtype_and_shape_policy_on_both_sides(mutate, match):
    msg = tpb.Trajectory.FromString(trajectory_codec.encode(make_trajectory("x", num_layers=2,
                                                                 num_experts=16)))
    mutate(msg)
    data = msg.SerializeToString()
    with pytest.raises(codec.CodecError, match=match):
        codec.decode_trajectory(data)
    with pytest.raises(InvalidArgument, match=match):
        trajectory_codec.decode(data)
    with pytest.raises(DecodeError, match=match):
        parse_batch(codec.encode_batch([("1-0", 1, False, data)], 0, 0))


@pytest.mark.parametrize("mutate, match", [
    (lambda m: setattr(m, "entropy_kind", "guess"), "entropy_kind"),
    (lambda m: setattr(m.segments[0], "end", 99), "segments cover"),
])
def test_gateway_semantic_checks(mutate, match):
    msg = tpb.Trajectory.FromString(trajectory_codec.encode(make_trajectory("x")))
    mutate(msg)
    with pytest.raises(InvalidArgument, match=match):
        trajectory_codec.decode(msg.SerializeToString())


def test_garbage_and_unencodable_input():
    with pytest.raises(InvalidArgument):
        trajectory_codec.decode(b"\xff\xff\xff\xff")
    with pytest.raises(DecodeError):
        parse_batch(b"\x0a\x05abc")
    with pytest.raises(codec.CodecError, match="no field"):
        codec.encode_trajectory({"no_such_field": 1})
    with pytest.raises(codec.CodecError, match="cannot travel"):
        codec.encode_trajectory({"token_ids": np.zeros(2, np.complex64)})


def test_big_endian_input_is_stored_little_endian():
    data = codec.encode_trajectory({"trajectory_id": "b", "token_ids": np.arange(3, dtype=">i4"),
                                    "prompt_token_ids": np.zeros(0, "<i4"),
                                    "logprobs": np.zeros(3, "<f4"), "entropy": np.zeros(3, "<f4"),
                                    "policy_version": np.zeros(3, "<i4"),
                                    "kv_version": np.zeros(3, "<i4")})
    d = codec.decode_trajectory(data)
    assert d.columns["token_ids"].dtype.str == "<i4"
    assert d.columns["token_ids"].tolist() == [0, 1, 2]
