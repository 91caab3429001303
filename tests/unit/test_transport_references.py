"""By-reference Pull framing (references instead of trajectory bytes) and the learner's
store URL handling; pure code, no Redis."""

from __future__ import annotations

import pytest

from learner_client.errors import DecodeError
from learner_client.store import redis_url
from learner_client.wire import Rollout, StoreRef, decode_fetched, parse_batch, parse_deliveries
from rollout_gateway.core import trajectory_codec
from doubles.trajectories import make_trajectory
from rollout_proto import codec
from rollout_proto.rollout.v1 import service_pb2 as spb


def _ref(tid: str, size: int, key: str = "p:stream") -> spb.StoreReference:
    return spb.StoreReference(kind=codec.REDIS_STREAM, key=key, size=size, trajectory_id=tid,
                              num_tokens=24)


def test_reference_batch_parses_to_store_refs_and_credit():
    raw = codec.encode_references([("1-0", 1, False, _ref("a", 100)),
                                   ("2-0", 3, True, _ref("b", 7))], 5, 60)
    items, n, tok = parse_deliveries(raw)
    assert (n, tok) == (5, 60)
    assert items == [StoreRef("1-0", 1, False, codec.REDIS_STREAM, "p:stream", 100, "a", 24),
                     StoreRef("2-0", 3, True, codec.REDIS_STREAM, "p:stream", 7, "b", 24)]


def test_mixed_batch_and_the_bytes_only_parser():
    data = trajectory_codec.encode(make_trajectory("x"))
    raw = codec.encode_batch([("1-0", 1, False, data)], 0, 0) + codec.encode_references(
        [("2-0", 1, False, _ref("y", 10))], 0, 0)
    items, _, _ = parse_deliveries(raw)
    assert isinstance(items[0], Rollout) and isinstance(items[1], StoreRef)
    with pytest.raises(DecodeError, match="references"):
        parse_batch(raw)


def test_a_delivery_with_neither_bytes_nor_reference_is_malformed():
    raw = spb.Batch(deliveries=[spb.Delivery(entry_id="1-0")]).SerializeToString()
    with pytest.raises(DecodeError, match="neither|without a trajectory or a reference"):
        parse_deliveries(raw)


def test_decode_fetched_checks_size_and_identity():
    data = trajectory_codec.encode(make_trajectory("x", num_layers=2))
    ref = StoreRef("1-0", 2, True, codec.REDIS_STREAM, "k", len(data), "x", 24)
    r = decode_fetched(ref, data)
    assert (r.entry_id, r.delivery_count, r.masked, r.trajectory_id) == ("1-0", 2, True, "x")
    assert r.routed_experts is not None and not r.token_ids.flags.writeable
    with pytest.raises(DecodeError, match="bytes"):
        decode_fetched(ref, data[:-1])
    other = StoreRef("1-0", 1, False, codec.REDIS_STREAM, "k", len(data), "not-x", 24)
    with pytest.raises(DecodeError, match="not-x"):
        decode_fetched(other, data)


def test_store_url_drops_the_gateway_options_only():
    assert redis_url("redis://h:1/2?prefix=run&max_backlog=9&lease_seconds=3") == "redis://h:1/2"
    assert redis_url("rediss://:pw@h/0?prefix=a&ssl_cert_reqs=none") == \
        "rediss://:pw@h/0?ssl_cert_reqs=none"
    with pytest.raises(ValueError):
        redis_url("memory://")


def test_buffer_pool_reuses_only_unreferenced_buffers():
    from learner_client.store import BufferPool

    pool = BufferPool(max_bytes=1 << 20)
    a = pool.get(100_000)
    b = pool.get(100_000)
    assert a is not b and len(pool) == 2  # both held: two buffers
    a_id = id(a)
    del a
    c = pool.get(90_000)
    assert id(c) == a_id and len(pool) == 2  # the free one is reused
    view = memoryview(c)[:10].toreadonly()  # what a decoded column keeps alive
    del c
    d = pool.get(90_000)
    assert id(d) != a_id and len(pool) == 3  # still referenced through the view: not reused
    del view, b, d
    assert len(pool.get(900_000)) >= 900_000  # over max_bytes: unreferenced ones evicted
    assert len(pool) == 1


def test_replies_parse_resp_and_pool_big_payloads():
    import socket
    import threading

    from learner_client.store import BufferPool, _payload
    from rollout_proto.resp import Replies, Skipped

    big = bytes(range(256)) * 1024  # 256 KiB: into a pooled buffer
    reply = (b"*1\r\n*2\r\n$3\r\n1-0\r\n*4\r\n$3\r\ntid\r\n$1\r\na\r\n$1\r\nd\r\n"
             + b"$%d\r\n" % len(big) + big + b"\r\n" + b"*0\r\n" + b"-NOPERM no\r\n")
    s1, s2 = socket.socketpair()
    try:
        threading.Thread(target=s1.sendall, args=(reply * 2,), daemon=True).start()
        r = Replies(s2, BufferPool().get)
        got = _payload(r.read())
        assert isinstance(got, memoryview) and got.readonly and bytes(got) == big
        assert _payload(r.read()) is None  # entry gone
        with pytest.raises(Exception, match="NOPERM"):
            r.read()
        skip = Replies(s2, None, big=1 << 10)  # the gateway's mode: payloads not kept
        skip.buf, skip.mv, skip.lo, skip.hi = r.buf, r.mv, r.lo, r.hi
        [[eid, [_, tid, _, d]]] = skip.read()
        assert (eid, tid, d) == (b"1-0", b"a", Skipped(len(big))) and isinstance(d, Skipped)
        assert skip.read() == []
    finally:
        s1.close()
        s2.close()
