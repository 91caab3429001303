"""The httpx transport (https engines) keeps the raw client's keep-alive rules: a request
whose reused connection the engine closes before answering is sent again once, on a fresh
connection; on a fresh connection that is a failure. Against a real loopback server."""

from __future__ import annotations

import pytest
from test_gateway_rawhttp import Closer, serve

from rollout_gateway.engines.transport import HttpxTransport
from rollout_gateway.errors import EngineError


async def test_httpx_resends_once_on_a_fresh_connection():
    closer = Closer("drop")
    srv, port = await serve(closer)
    t = HttpxTransport("e", f"http://127.0.0.1:{port}", connect_timeout=2, keep_alive_s=4)
    try:
        for _ in range(2):  # the second goes out on the pooled connection, which is dropped
            resp = await t.request("POST", "/cl", b"{}", read_timeout=2)
            assert resp.status == 200 and await resp.read() == b"ok"
        assert closer.connections == 2 and closer.requests == 3 and t.counters["resent"] == 1
        with pytest.raises(EngineError):  # a fresh connection dropped: not sent again
            await t.request("POST", "/drop", b"{}", read_timeout=2)
        assert closer.requests == 4 and t.counters["resent"] == 1
    finally:
        await t.aclose()
        srv.close()
