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
