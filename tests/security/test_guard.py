"""The ASGI guard on a real uvicorn server: an unexpected exception is a generic 500 that
keeps the keep-alive connection; limits answer before the route runs."""

from __future__ import annotations

import asyncio
import http.client
import threading

import pytest
import uvicorn
from fastapi import FastAPI, Request

from rollout_gateway.api.errors import install_error_handlers
from rollout_gateway.api.security import RequestGuard


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(RequestGuard, max_body_bytes=1024, max_pending=1, retry_after_s=2)

    @app.post("/boom")
    async def boom() -> dict:
        raise RuntimeError("secret at /srv/app/db.sqlite 10.1.2.3:5432")

    @app.post("/v1/rollouts")
    async def rollouts(request: Request) -> dict:
        await request.body()
        await asyncio.sleep(float(request.query_params.get("sleep", "0")))
        return {"ok": True}
    return app


@pytest.fixture
def server():
    config = uvicorn.Config(_app(), host="127.0.0.1", port=0, log_level="critical")
    srv = uvicorn.Server(config)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        t.join(0.02)
    yield srv.servers[0].sockets[0].getsockname()[1]
    srv.should_exit = True
    t.join(10)


def test_unexpected_500_keeps_the_connection(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    conn.connect()
    sock = conn.sock
    for _ in range(3):
        conn.request("POST", "/boom", body=b"{}")
        r = conn.getresponse()
        body = r.read().decode()
        assert r.status == 500 and "internal error" in body
        for leak in ("RuntimeError", "secret", "10.1.2.3", "/srv"):
            assert leak not in body
        assert not r.will_close and conn.sock is sock
    conn.request("POST", "/v1/rollouts", body=b"{}")
    assert conn.getresponse().status == 200 and conn.sock is sock


def test_limits(server):
    conn = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    conn.request("POST", "/v1/rollouts", body=b"x" * 2048)
    r = conn.getresponse()
    assert r.status == 413 and b"limit" in r.read()
    conn.request("POST", "/v1/rollouts", body=iter([b"x" * 600, b"x" * 600]),
                 encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    r = conn.getresponse()
    assert r.status == 413
    r.read()
    conn.close()
    slow = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    slow.request("POST", "/v1/rollouts?sleep=1.5", body=b"{}")
    other = http.client.HTTPConnection("127.0.0.1", server, timeout=10)
    for _ in range(200):  # until the slow one is in (it holds the only slot)
        other.request("POST", "/v1/rollouts", body=b"{}")
        r = other.getresponse()
        r.read()
        if r.status == 429:
            break
    assert r.status == 429 and r.getheader("retry-after") == "2"
    assert slow.getresponse().status == 200
    other.request("POST", "/v1/rollouts", body=b"{}")
    assert other.getresponse().status == 200
