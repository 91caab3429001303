"""Hand-encoded rollout.v1.Batch: the store's Trajectory bytes are embedded as-is.

A protobuf sub-message field is encoded exactly like a bytes field with the same number,
so the server never parses or re-serializes a trajectory: it frames the stored bytes.
Learners parse the result with the generated ``Batch`` class.
"""

from __future__ import annotations

from rollout_gateway.store.base import StoredEntry


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def delivery_size(e: StoredEntry) -> int:
    """Upper bound of the encoded Delivery size in a Batch."""
    return len(e.data) + len(e.entry_id) + 32


def encode_batch(entries: list[StoredEntry], credit_trajectories: int, credit_tokens: int) -> bytes:
    parts: list[bytes] = []
    for e in entries:
        eid = e.entry_id.encode()
        head = b"".join((b"\x0a", _varint(len(eid)), eid, b"\x10", _varint(e.delivery_count),
                         b"\x18\x01" if e.masked else b"", b"\x22", _varint(len(e.data))))
        parts += (b"\x0a", _varint(len(head) + len(e.data)), head, e.data)
    if credit_trajectories:
        parts += (b"\x10", _varint(credit_trajectories))
    if credit_tokens:
        parts += (b"\x18", _varint(credit_tokens))
    return b"".join(parts)
