"""SSE splitting of engine streams (EngineClient.generate_stream's framing)."""

from __future__ import annotations

import random

import pytest

from rollout_gateway.engines.client import SSEPayloads


def reference(stream: bytes) -> list[bytes]:
    """The plain definition: complete events (ended by a blank line), their data: lines."""
    events = stream.split(b"\n\n")[:-1]  # the last piece is not terminated yet
    return [line[5:].strip() for ev in events for line in ev.split(b"\n")
            if line.startswith(b"data:")]


def random_stream(rng: random.Random) -> bytes:
    parts = []
    for _ in range(rng.randint(0, 12)):
        kind = rng.random()
        body = bytes(rng.choice(b'{}"abc:, 019\t\r') for _ in range(rng.randint(0, 40)))
        body = body.replace(b"\n", b"")
        if kind < 0.5:
            ev = b"data:" + rng.choice([b"", b" ", b"  \t"]) + body + rng.choice([b"", b" ", b"\r"])
        elif kind < 0.65:
            ev = b": keep-alive"
        elif kind < 0.8:
            ev = b"event: x\ndata: " + body + b"\nid: 3"
        elif kind < 0.9:
            ev = b"data: " + body + b"\ndata:" + body[::-1]
        else:
            ev = b""
        parts.append(ev + b"\n\n")
    tail = rng.choice([b"", b"data: {partial", b"data: x\n", b"\n"])
    return b"".join(parts) + tail


@pytest.mark.parametrize("large", [1 << 16, 0])  # 0: every payload takes the large path
def test_payloads_match_the_plain_definition_for_any_chunking(monkeypatch, large):
    monkeypatch.setattr(SSEPayloads, "LARGE", large)
    rng = random.Random(7)
    for _ in range(600):
        stream = random_stream(rng)
        cuts = sorted(rng.sample(range(len(stream) + 1), min(len(stream) + 1, rng.randint(0, 8))))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)])]
        if rng.random() < 0.2:  # byte by byte
            chunks = [stream[i:i + 1] for i in range(len(stream))]
        split = SSEPayloads()
        got = [p for c in chunks for p in split.feed(c)]
        assert got == reference(stream), (stream, chunks)
        assert all(type(p) is bytes for p in got)


def test_a_large_single_payload_arrives_whole_and_exact():
    body = b'{"meta_info": {"routed_experts": "' + b"QUJD" * 300_000 + b'"}}'
    stream = b"data: " + body + b"\n\n" + b"data: [DONE]\n\n"
    split = SSEPayloads()
    got = [p for i in range(0, len(stream), 65536) for p in split.feed(stream[i:i + 65536])]
    assert got == [body, b"[DONE]"]
