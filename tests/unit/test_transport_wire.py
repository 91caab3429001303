from rollout_gateway.store.base import StoredEntry
from rollout_gateway.transport import codec
from rollout_gateway.transport.synthetic import make_trajectory
from rollout_gateway.transport.wire import encode_batch
from rollout_proto.rollout.v1 import service_pb2


def test_hand_encoded_batch_parses_with_generated_class():
    big = make_trajectory("big", num_tokens=300, num_layers=48)  # > 127-byte varints
    small = make_trajectory("small", num_tokens=1)
    entries = [StoredEntry("1700000000000-0", "big", codec.encode(big), 308, 0, 0, 1),
               StoredEntry("7", "small", codec.encode(small), 9, 0, 0, 300, masked=True)]
    msg = service_pb2.Batch.FromString(encode_batch(entries, 5, 70000))
    assert [d.entry_id for d in msg.deliveries] == ["1700000000000-0", "7"]
    assert [d.delivery_count for d in msg.deliveries] == [1, 300]
    assert [d.masked for d in msg.deliveries] == [False, True]
    assert msg.deliveries[0].trajectory.SerializeToString() == entries[0].data
    assert codec.from_pb(msg.deliveries[1].trajectory).trajectory_id == "small"
    assert (msg.credit_trajectories, msg.credit_tokens) == (5, 70000)


def test_empty_batch_is_empty_bytes():
    assert encode_batch([], 0, 0) == b""
    assert service_pb2.Batch.FromString(b"") == service_pb2.Batch()


def test_fast_parse_matches_protobuf_decode():
    import numpy as np
    import pytest

    from learner_client.errors import DecodeError
    from learner_client.wire import decode_delivery, parse_batch

    trajs = [make_trajectory("a", num_tokens=300, num_layers=4, versions=(1, 2),
                             old_logprobs=True),
             make_trajectory("b", num_tokens=0, reward=None)]
    trajs[0].metadata["x"] = "y"
    entries = [StoredEntry(f"{i}-1", t.trajectory_id, codec.encode(t), 1, 0, 0, i + 1,
                           masked=bool(i)) for i, t in enumerate(trajs)]
    blob = encode_batch(entries, 3, 9)
    fast, n, tok = parse_batch(blob)
    slow = [decode_delivery(d) for d in service_pb2.Batch.FromString(blob).deliveries]
    assert (n, tok) == (3, 9)
    for f, s in zip(fast, slow, strict=True):
        for name in f.__slots__:
            a, b = getattr(f, name), getattr(s, name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                assert a is not None and b is not None and a.dtype == b.dtype, name
                np.testing.assert_array_equal(a, b)
            else:
                assert a == b, name
    assert fast[0].token_ids.base is not None  # a view into the message, not a copy
    with pytest.raises(DecodeError):
        parse_batch(blob[:-5])
