"""Server-Sent Events framing: the one splitter of an engine's streamed body into payloads.

An event ends at a blank line (``\\n\\n``, or ``\\r\\n\\r\\n``: a line may end in CR LF);
its payload is its ``data:`` field (each ``data:`` line's value stripped; several lines
of one event joined with ``\\n``, as the SSE standard joins them). Other lines (comments,
``event:``, ``id:``) are ignored, and an event without a ``data:`` line has no payload.
A lone CR as a line end (allowed by the standard, sent by no engine) is not recognised.

Used by :meth:`EngineClient.generate_stream` on the hot path and by
:class:`~rollout_gateway.engines.decode_stream.StreamDecoder` for raw bytes.
"""

from __future__ import annotations

from rollout_gateway.errors import EngineError

_WS = frozenset(b" \t\n\r\x0b\x0c")  # what bytes.strip() strips


def _stripped(buf: bytes | bytearray, a: int, e: int) -> tuple[int, int]:
    """``buf[a:e]``'s bounds without its leading and trailing whitespace (as
    ``bytes.strip``), found without copying the span."""
    while a < e and buf[a] in _WS:
        a += 1
    while e > a and buf[e - 1] in _WS:
        e -= 1
    return a, e


def _data_field(event: bytes) -> bytes | None:
    """The ``data:`` field of an event of several lines (None without a data line)."""
    lines = [ln[5:].strip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


class SSEPayloads:
    """Splits an SSE byte stream, fed in any pieces, into its events' payloads (bytes), in
    order.

    Linear: newlines are hopped at memchr speed, a partial event is never rescanned, and
    each payload of a one-line event (every event SGLang sends) is copied once (a
    multi-MB final payload with routed experts is not copied four times over). An event
    still incomplete past ``limit`` bytes raises :class:`EngineError`.
    """

    __slots__ = ("_buf", "_multi", "_scan", "limit")

    #: payloads from this size on are copied by index (once); smaller ones by C slicing
    LARGE = 1 << 16

    def __init__(self, limit: int | None = None) -> None:
        self._buf = bytearray()
        self._scan = 0  # bytes of _buf already searched for the event separator
        self._multi = False  # the pending event has a newline that did not end it
        self.limit = limit

    @property
    def pending(self) -> int:
        """Bytes of the event still incomplete."""
        return len(self._buf)

    def feed(self, chunk: bytes) -> list[bytes]:
        """Add ``chunk``; return the payloads of the events it completes."""
        buf = self._buf
        if not buf and chunk.startswith(b"data:") and chunk.find(b"\n") == len(chunk) - 2 \
                and chunk.endswith(b"\n\n"):
            # exactly one one-line event, as uvicorn streams them (a chunk per event): its
            # payload is sliced out of the chunk once, nothing is buffered
            a, e = _stripped(chunk, 5, len(chunk) - 2)
            return [chunk[a:e]]
        buf += chunk
        out: list[bytes] = []
        scan, multi, large = self._scan, self._multi, self.LARGE
        while True:
            cut = buf.find(b"\n", scan)
            end = -1  # where the blank line ending the event ends
            while cut >= 0:
                nxt = cut + 1
                if nxt < len(buf) and buf[nxt] == 0x0D:  # CR LF line ends
                    nxt += 1
                if nxt >= len(buf):
                    break  # the separator may still be arriving: look here again
                if buf[nxt] == 0x0A:
                    end = nxt + 1
                    break
                multi = True
                cut = buf.find(b"\n", cut + 1)
            if end < 0:
                self._scan = cut if cut >= 0 else len(buf)
                self._multi = multi
                if self.limit is not None and len(buf) > self.limit:
                    raise EngineError(f"engine stream event exceeds the size limit "
                                      f"({self.limit} bytes)")
                return out
            if multi:
                data = _data_field(bytes(buf[:cut]))
                if data is not None:
                    out.append(data)
            elif not buf.startswith(b"data:"):
                pass
            elif cut < large:  # small (a per-token delta): C-level copies beat index loops
                out.append(bytes(buf[5:cut]).strip())
            else:  # large (the final payload with routed experts): copy it once
                a, e = _stripped(buf, 5, cut)
                with memoryview(buf) as mv:
                    out.append(bytes(mv[a:e]))
            del buf[:end]
            scan, multi = 0, False

    def close(self) -> list[bytes]:
        """The payload of a last event not ended by a blank line (a stream cut short), if
        it has one; the splitter is empty afterwards."""
        rest = bytes(self._buf).strip()
        self._buf.clear()
        self._scan, self._multi = 0, False
        data = _data_field(rest) if rest else None
        return [data] if data is not None else []
