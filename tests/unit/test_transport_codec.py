import numpy as np
import pytest

from rollout_gateway.errors import InvalidArgument
from rollout_gateway.transport import codec
from rollout_gateway.transport.synthetic import make_trajectory
from rollout_proto.rollout.v1 import trajectory_pb2 as pb


def test_roundtrip_preserves_every_field():
    t = make_trajectory("x", versions=(3, 4), num_layers=5, top_k=2, num_experts=300,
                        old_logprobs=True, reward=None)
    t.metadata["k"] = "v"
    t.finish_reason.matched = 151643
    back = codec.decode(codec.encode(t))
    assert back.trajectory_id == "x" and back.group_id == t.group_id
    assert back.reward is None and back.metadata == t.metadata
    assert back.finish_reason == t.finish_reason
    assert back.segments == t.segments
    for name in ("token_ids", "logprobs", "entropy", "policy_version", "kv_version",
                 "old_logprobs"):
        np.testing.assert_array_equal(getattr(back.tokens, name), getattr(t.tokens, name))
    np.testing.assert_array_equal(back.prompt_token_ids, t.prompt_token_ids)
    re = back.routed_experts
    assert re.data.dtype == np.uint16 and re.data.shape == t.routed_experts.data.shape
    np.testing.assert_array_equal(re.data, t.routed_experts.data)


def test_columns_are_packed_bytes_with_dtype_and_shape():
    t = make_trajectory("x", num_tokens=7, num_layers=48, top_k=8, num_experts=128)
    msg = codec.to_pb(t)
    assert (msg.token_ids.dtype, list(msg.token_ids.shape)) == ("<i4", [7])
    assert len(msg.token_ids.data) == 28
    assert msg.routed_experts.data.dtype == "|u1"
    assert list(msg.routed_experts.data.shape) == [8 + 7 - 1, 48, 8]
    assert not msg.HasField("old_logprobs")


def test_text_stop_string_and_missing_reward():
    t = make_trajectory("x", reward=None)
    t.finish_reason.matched = "</s>"
    back = codec.decode(codec.encode(t))
    assert back.finish_reason.matched == "</s>" and back.reward is None


@pytest.mark.parametrize("mutate, match", [
    (lambda m: setattr(m.token_ids, "dtype", "object"), "unsupported dtype"),
    (lambda m: setattr(m.logprobs, "data", b"\x00" * 3), "bytes for shape"),
    (lambda m: m.ClearField("token_ids"), "no token_ids"),
    (lambda m: setattr(m, "entropy_kind", "guess"), "entropy_kind"),
    (lambda m: setattr(m.segments[0], "end", 99), "segments cover"),
])
def test_malformed_messages_raise_invalid_argument(mutate, match):
    msg = codec.to_pb(make_trajectory("x"))
    mutate(msg)
    with pytest.raises(InvalidArgument, match=match):
        codec.from_pb(msg)


def test_garbage_bytes_raise_invalid_argument():
    with pytest.raises(InvalidArgument):
        codec.decode(b"\xff\xff\xff\xff")


def test_empty_trajectory_roundtrips():
    t = make_trajectory("e", num_tokens=0, versions=(0,))
    back = codec.decode(codec.encode(t))
    assert back.num_tokens == 0 and back.min_version == -1
    assert isinstance(pb.Trajectory.FromString(codec.encode(t)), pb.Trajectory)
