"""The one rollout.v1 wire codec: Trajectory <-> bytes, and the Pull stream's Batch framing.

Used by the gateway's store (encode on publish, decode of recycled prompts), the gRPC
servicer (frames stored bytes into a Batch without parsing them) and the learner (splits a
received Batch into zero-copy numpy columns). ``rollout_proto`` imports neither side.

Design:

* **Field numbers come from the protobuf descriptors**, never written by hand. Every
  field whose type is ``rollout.v1.Array`` (at any depth, e.g. ``routed_experts.data``) is
  a *column*: the decoder turns it into a read-only ``np.frombuffer`` view into the
  received bytes; everything else (ids, segments, metadata, finish reason, credit, any
  field added later) is re-framed without the columns and parsed once by protobuf (C).
  A new scalar or Array field added to the .proto therefore flows through both ways with
  no code here.
* **One dtype policy** (:data:`COLUMN_DTYPES`): each known column has exactly the dtypes
  the producer writes; a column added later accepts :data:`DTYPES`. Byte counts must match
  ``prod(shape) * itemsize``. Per-token columns must all have length T.
* **Clean errors only**: any malformed, truncated or hostile input raises
  :class:`CodecError` (a ``ValueError``); the gateway maps it to INVALID_ARGUMENT, the
  learner to ``DecodeError``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError as _PbDecodeError

from rollout_proto.rollout.v1 import service_pb2 as spb
from rollout_proto.rollout.v1 import trajectory_pb2 as tpb

__all__ = [
    "COLUMN_DTYPES", "DTYPES", "PER_TOKEN", "REDIS_STREAM", "REQUIRED", "CodecError", "Decoded",
    "decode_trajectory", "delivery_size", "encode_batch", "encode_references",
    "encode_trajectory", "parse_batch", "stream_entry_id",
]


class CodecError(ValueError):
    """Bytes that are not a well-formed rollout.v1 message (or columns that do not fit)."""


#: every dtype an Array may carry (little-endian or byte-order-free)
DTYPES = frozenset({"|u1", "<u2", "<u4", "<i4", "<i8", "<f4", "<f8"})
_UINT = frozenset({"|u1", "<u2", "<u4"})
#: the dtypes each known column may carry (path = field names joined by '.'); a column
#: not listed here (added to the .proto later) may carry any of DTYPES
COLUMN_DTYPES: dict[str, frozenset[str]] = {
    "prompt_token_ids": frozenset({"<i4"}),
    "token_ids": frozenset({"<i4"}),
    "logprobs": frozenset({"<f4"}),
    "entropy": frozenset({"<f4"}),
    "policy_version": frozenset({"<i4"}),
    "kv_version": frozenset({"<i4"}),
    "old_logprobs": frozenset({"<f4"}),
    "routed_experts.data": _UINT,  # the narrowest uint that holds num_experts
    "loss_mask": frozenset({"|u1"}),  # agent sessions: 1 = sampled by the model, 0 = context
}
#: columns that have one entry per output token (length T = len(token_ids))
PER_TOKEN = ("logprobs", "entropy", "policy_version", "kv_version", "old_logprobs",
             "loss_mask")
#: columns every trajectory carries (the others may be absent)
REQUIRED = ("prompt_token_ids", "token_ids", "logprobs", "entropy", "policy_version",
            "kv_version")

_ARRAY = tpb.Array.DESCRIPTOR


# ------------------------------------------------------------------------------ encoding
def _array_fields(arr: np.ndarray) -> dict[str, Any]:
    arr = np.asarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    arr = np.ascontiguousarray(arr)
    if arr.dtype.str not in DTYPES:
        raise CodecError(f"dtype {arr.dtype.str!r} cannot travel as a rollout.v1.Array")
    return {"dtype": arr.dtype.str, "shape": arr.shape, "data": arr.tobytes()}


def _prepare(desc, fields: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None:
            continue
        f = desc.fields_by_name.get(name)
        if f is None:
            raise CodecError(f"{desc.full_name} has no field {name!r}")
        mt = f.message_type
        if mt is _ARRAY:
            out[name] = ([_array_fields(v) for v in value] if f.is_repeated
                         else _array_fields(value))
        elif mt is not None and not mt.GetOptions().map_entry:
            out[name] = ([_prepare(mt, v) for v in value] if f.is_repeated
                         else _prepare(mt, value))
        else:
            out[name] = value
    return out


def encode_trajectory(fields: Mapping[str, Any]) -> bytes:
    """A serialized rollout.v1.Trajectory from proto field names -> values: numpy arrays
    for Array fields, mappings for sub-messages (lists of them for repeated ones), plain
    values otherwise; ``None`` leaves a field absent. CodecError on unknown fields/dtypes."""
    try:
        return tpb.Trajectory(**_prepare(tpb.Trajectory.DESCRIPTOR, fields)).SerializeToString(
            deterministic=True)  # map entries (metadata) in key order: same trajectory, same bytes
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"cannot encode trajectory: {exc}") from None


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if not n:
            out.append(b)
            return bytes(out)
        out.append(b | 0x80)


def _key(desc, name: str, wire_type: int) -> bytes:
    return _varint(desc.fields_by_name[name].number << 3 | wire_type)


_B = spb.Batch.DESCRIPTOR
_D = spb.Delivery.DESCRIPTOR
_K_DELIVERY = _key(_B, "deliveries", 2)
_K_CREDIT_N = _key(_B, "credit_trajectories", 0)
_K_CREDIT_TOK = _key(_B, "credit_tokens", 0)
_K_ENTRY = _key(_D, "entry_id", 2)
_K_COUNT = _key(_D, "delivery_count", 0)
_K_MASKED = _key(_D, "masked", 0)
_K_TRAJ = _key(_D, "trajectory", 2)


def delivery_size(entry_id: str, nbytes: int) -> int:
    """Upper bound of one Delivery's encoded size inside a Batch, for a trajectory of
    ``nbytes`` bytes."""
    return nbytes + len(entry_id) + 32


#: StoreReference.kind of a Redis stream entry: ``XRANGE key id id``, field "d", where ``id``
#: is :func:`stream_entry_id` of the delivery's entry id
REDIS_STREAM = "redis-stream"


def stream_entry_id(entry_id: str) -> str:
    """The id inside its Redis stream of a delivery's entry id: a store of several shards
    writes ``<shard>/<ms>-<seq>`` (the reference's key names the shard's stream), one
    shard ``<ms>-<seq>``."""
    return entry_id.rpartition("/")[2]


def encode_batch(deliveries: Iterable[tuple[str, int, bool, bytes]], credit_trajectories: int,
                 credit_tokens: int) -> bytes:
    """A serialized rollout.v1.Batch from (entry_id, delivery_count, masked, stored
    Trajectory bytes). The trajectory bytes are embedded as they are (a sub-message is
    framed exactly like a bytes field), so the server never parses a trajectory."""
    parts: list[bytes] = []
    for entry_id, count, masked, data in deliveries:
        eid = entry_id.encode()
        head = b"".join((_K_ENTRY, _varint(len(eid)), eid, _K_COUNT, _varint(count),
                         (_K_MASKED + b"\x01") if masked else b"", _K_TRAJ,
                         _varint(len(data))))
        parts += (_K_DELIVERY, _varint(len(head) + len(data)), head, data)
    if credit_trajectories:
        parts += (_K_CREDIT_N, _varint(credit_trajectories))
    if credit_tokens:
        parts += (_K_CREDIT_TOK, _varint(credit_tokens))
    return b"".join(parts)


def encode_references(deliveries: Iterable[tuple[str, int, bool, spb.StoreReference]],
                      credit_trajectories: int, credit_tokens: int) -> bytes:
    """A serialized rollout.v1.Batch whose deliveries carry a StoreReference each instead
    of the trajectory (a by-reference Pull stream: small messages, plain protobuf)."""
    return spb.Batch(deliveries=[spb.Delivery(entry_id=e, delivery_count=n, masked=m,
                                              reference=ref)
                                 for e, n, m, ref in deliveries],
                     credit_trajectories=credit_trajectories,
                     credit_tokens=credit_tokens).SerializeToString()


# ------------------------------------------------------------------------------ decoding
class Decoded:
    """One decoded trajectory: ``columns`` maps column paths (``token_ids``,
    ``routed_experts.data``, ...) to read-only views into the received bytes; ``message``
    is the rollout.v1.Trajectory holding every other field (its Array fields are empty)."""

    __slots__ = ("columns", "message")

    def __init__(self, columns: dict[str, np.ndarray], message: tpb.Trajectory):
        self.columns = columns
        self.message = message

    def has(self, name: str) -> bool:
        """Whether the sub-message ``name`` (e.g. ``routed_experts``) was present."""
        return self.message.HasField(name) or any(k.startswith(name + ".") for k in self.columns)


def _plan(desc, prefix: str = "") -> dict[int, tuple]:
    """field number -> (kind, path, sub-plan) for the fields that hold columns:
    kind "a" = an Array, "m" = a message with Array fields somewhere below it."""
    plan: dict[int, tuple] = {}
    for f in desc.fields:
        mt = f.message_type
        if mt is None or f.is_repeated:
            continue  # repeated Arrays / messages of Arrays: parsed by protobuf (copied)
        path = prefix + f.name
        if mt is _ARRAY:
            plan[f.number] = ("a", path, None, COLUMN_DTYPES.get(path, DTYPES))
        else:
            sub = _plan(mt, path + ".")
            if sub:
                plan[f.number] = ("m", path, sub, None)
    return plan


_TRAJ_PLAN = _plan(tpb.Trajectory.DESCRIPTOR)
_N_DELIVERIES = _B.fields_by_name["deliveries"].number
_N_TRAJ = _D.fields_by_name["trajectory"].number


def _rd(buf, i: int) -> tuple[int, int]:
    """A varint at i -> (value, next index)."""
    b = buf[i]
    if b < 0x80:
        return b, i + 1
    result, shift = b & 0x7F, 7
    i += 1
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise CodecError("malformed varint")


def _skip(buf, wt: int, i: int, end: int) -> int:
    if wt == 0:
        return _rd(buf, i)[1]
    if wt == 1:
        return i + 8
    if wt == 5:
        return i + 4
    raise CodecError(f"unsupported wire type {wt}")


def _view(buf, start: int, end: int, path: str, allowed: frozenset[str]) -> np.ndarray:
    # rollout.v1.Array {dtype=1, shape=2 (packed or not), data=3}: this runs ~8x per
    # trajectory, so the walk is inlined
    dtype, shape, d0, d1 = b"", [], start, start
    i = start
    while i < end:
        key = buf[i]
        i += 1
        if key >= 0x80:
            key, i = _rd(buf, i - 1)
        wt, fno = key & 7, key >> 3
        if wt == 2:
            ln = buf[i]
            i += 1
            if ln >= 0x80:
                ln, i = _rd(buf, i - 1)
            stop = i + ln
            if stop > end:
                raise CodecError(f"{path}: a field runs past its message")
            if fno == 3:
                d0, d1 = i, stop
            elif fno == 1:
                dtype = buf[i:stop]
            elif fno == 2:
                while i < stop:
                    d, i = _rd(buf, i)
                    shape.append(d)
                if i != stop:
                    raise CodecError(f"{path}: truncated shape")
            i = stop
        elif wt == 0:
            v, i = _rd(buf, i)
            if fno == 2:
                shape.append(v)
        else:
            i = _skip(buf, wt, i, end)
    if i != end:
        raise CodecError(f"{path}: truncated message")
    dts = bytes(dtype).decode("ascii", "replace")
    if dts not in allowed:
        raise CodecError(f"{path}: dtype {dts!r} not allowed (expected one of {sorted(allowed)})")
    dt = np.dtype(dts)
    shape = [s - (1 << 64) if s >= 1 << 63 else s for s in shape]  # int64 on the wire
    if any(s < 0 for s in shape):
        raise CodecError(f"{path}: negative shape {shape}")
    count = math.prod(shape)
    if d1 - d0 != count * dt.itemsize:
        raise CodecError(f"{path}: {d1 - d0} bytes do not match shape {shape} {dts}")
    return np.frombuffer(buf, dtype=dt, count=count, offset=d0).reshape(shape)


def _split(buf, start: int, end: int, plan: dict[int, tuple], cols: dict, rest: list) -> None:
    """Walk one message: columns (per ``plan``) into ``cols``; every other field's bytes,
    and planned sub-messages re-framed without their columns, appended to ``rest``."""
    i = start
    while i < end:
        first = i
        key = buf[i]  # one-byte keys and lengths inline (the common case), varints otherwise
        i += 1
        if key >= 0x80:
            key, i = _rd(buf, i - 1)
        wt, fno = key & 7, key >> 3
        if fno == 0:
            raise CodecError("field number 0")
        if wt == 2:
            ln = buf[i]
            i += 1
            if ln >= 0x80:
                ln, i = _rd(buf, i - 1)
            stop = i + ln
            if stop > end:
                raise CodecError("a length-delimited field runs past its message")
            p = plan.get(fno)
            if p is None:
                rest.append(buf[first:stop])
            elif p[0] == "a":
                cols[p[1]] = _view(buf, i, stop, p[1], p[3])
            else:
                sub: list = []
                _split(buf, i, stop, p[2], cols, sub)
                body = b"".join(sub)
                rest += (_varint(key), _varint(len(body)), body)
            i = stop
        else:
            i = _skip(buf, wt, i, end)
            rest.append(buf[first:i])
    if i != end:
        raise CodecError("truncated message")


def _check(cols: dict[str, np.ndarray], msg: tpb.Trajectory) -> None:
    if not msg.trajectory_id:
        raise CodecError("trajectory without a trajectory_id")
    missing = [name for name in REQUIRED if name not in cols]
    if missing:
        raise CodecError(f"trajectory {msg.trajectory_id!r} has no {', '.join(missing)} column")
    tok = cols["token_ids"]
    if tok.ndim != 1:
        raise CodecError(f"token_ids has shape {tok.shape}, expected [T]")
    if cols["prompt_token_ids"].ndim != 1:
        raise CodecError(f"prompt_token_ids has shape {cols['prompt_token_ids'].shape}, "
                         "expected [P]")
    n = tok.shape[0]
    for name in PER_TOKEN:
        c = cols.get(name)
        if c is not None and c.shape != (n,):
            raise CodecError(f"{name} has shape {c.shape}, expected ({n},)")
    r = cols.get("routed_experts.data")
    if r is not None and r.ndim != 3:
        raise CodecError(f"routed_experts must be [R, L, K], got shape {r.shape}")


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except _PbDecodeError as exc:
        raise CodecError(f"not a serialized {cls.DESCRIPTOR.full_name}: {exc}") from None


def _guard(fn, *args):
    try:
        return fn(*args)
    except CodecError:
        raise
    except (IndexError, ValueError, TypeError, OverflowError, MemoryError) as exc:
        raise CodecError(f"malformed message: {type(exc).__name__}: {exc}") from None


def decode_trajectory(data: bytes | bytearray | memoryview) -> Decoded:
    """Serialized rollout.v1.Trajectory -> :class:`Decoded` (columns are views into
    ``data``; pass ``bytes`` to keep them immutable). CodecError if malformed."""
    return _guard(_decode_trajectory, data)


def _decode_trajectory(data) -> Decoded:
    cols: dict[str, np.ndarray] = {}
    rest: list = []
    _split(data, 0, len(data), _TRAJ_PLAN, cols, rest)
    msg = _parse(tpb.Trajectory, b"".join(rest))
    _check(cols, msg)
    return Decoded(cols, msg)


def parse_batch(data: bytes) -> tuple[list[tuple[spb.Delivery, Decoded | None]], spb.Batch]:
    """Serialized rollout.v1.Batch -> ([(delivery, trajectory)], batch). ``delivery`` and
    ``batch`` are the generated messages without the trajectories / deliveries (every
    other field, present and future: entry_id, delivery_count, credit, ...); columns are
    read-only views into ``data`` (zero copy). A delivery that carries a ``reference``
    instead of a trajectory comes with ``None`` (the caller fetches and decodes the bytes
    with :func:`decode_trajectory`). CodecError if malformed."""
    return _guard(_parse_batch, data)


def _parse_batch(buf) -> tuple[list[tuple[spb.Delivery, Decoded | None]], spb.Batch]:
    out: list[tuple[spb.Delivery, Decoded | None]] = []
    rest: list = []
    i, end = 0, len(buf)
    while i < end:
        first = i
        key, i = _rd(buf, i)
        wt, fno = key & 7, key >> 3
        if fno == 0:
            raise CodecError("field number 0")
        if wt != 2:
            i = _skip(buf, wt, i, end)
            rest.append(buf[first:i])
            continue
        ln, i = _rd(buf, i)
        stop = i + ln
        if stop > end:
            raise CodecError("a length-delimited field runs past its message")
        if fno != _N_DELIVERIES:
            rest.append(buf[first:stop])
            i = stop
            continue
        d_rest: list = []
        traj = None
        j = i
        while j < stop:
            f0 = j
            k2, j = _rd(buf, j)
            w2 = k2 & 7
            if k2 >> 3 == 0:
                raise CodecError("field number 0")
            if w2 == 2:
                l2, j = _rd(buf, j)
                s2 = j + l2
                if s2 > stop:
                    raise CodecError("a length-delimited field runs past its message")
                if k2 >> 3 == _N_TRAJ:
                    traj = (j, s2)
                else:
                    d_rest.append(buf[f0:s2])
                j = s2
            else:
                j = _skip(buf, w2, j, stop)
                d_rest.append(buf[f0:j])
        if j != stop:
            raise CodecError("truncated delivery")
        if traj is None:
            d = _parse(spb.Delivery, b"".join(d_rest))
            if not d.HasField("reference"):
                raise CodecError("delivery without a trajectory or a reference")
            out.append((d, None))
            i = stop
            continue
        cols: dict[str, np.ndarray] = {}
        t_rest: list = []
        _split(buf, traj[0], traj[1], _TRAJ_PLAN, cols, t_rest)
        msg = _parse(tpb.Trajectory, b"".join(t_rest))
        _check(cols, msg)
        out.append((_parse(spb.Delivery, b"".join(d_rest)), Decoded(cols, msg)))
        i = stop
    if i != end:
        raise CodecError("truncated batch")
    return out, _parse(spb.Batch, b"".join(rest))
