"""The reference engine's SGLang behaviours the gateway must survive, over HTTP: the radix
cache (honest ``cached_tokens``, old-weight KV reused after an in-place swap), SGLang's flush
rules, the defaults of ``--sglang-strict`` and uvicorn's keep-alive timeout. Numbers are
checked against recomputation through the reference model."""

from __future__ import annotations

import base64
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from reference_engine.config import ModelConfig
from reference_engine.reference import score, score_mixed

pytestmark = pytest.mark.integration
CFG = ModelConfig()
P = [256, *b"a prompt shared by many"]
N = 6


def gen(eng, ids, n=N, **kw) -> dict:
    r = httpx.post(eng.url + "/generate", timeout=60, json={
        "input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                              "ignore_eos": True},
        "return_logprob": True, "return_routed_experts": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def lps(out) -> np.ndarray:
    return np.array([t[0] for t in out["meta_info"]["output_token_logprobs"]])


def routed(out) -> np.ndarray:
    raw = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype="<i4")
    return raw.reshape(-1, CFG.num_hidden_layers, CFG.num_experts_per_tok)


def test_prefix_cache_after_in_place_swap_serves_old_weight_kv(make_engine, checkpoint_v2,
                                                               reference_model):
    eng = make_engine(seed=1, extra_args=["--enable-radix-cache"])
    old, new = reference_model((CFG, 1)), reference_model(checkpoint_v2)
    a = gen(eng, P)
    assert a["meta_info"]["cached_tokens"] == 0
    assert httpx.post(eng.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
    up = httpx.post(eng.url + "/update_weights_from_disk", timeout=60, json={
        "model_path": str(checkpoint_v2), "weight_version": "1", "flush_cache": False})
    assert up.json()["success"] is True
    httpx.post(eng.url + "/continue_generation", json={})

    n = len(P)
    b = gen(eng, P)  # same prompt: every position but the last is cached (old weights)
    assert b["meta_info"]["cached_tokens"] == n - 1
    assert b["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": N}]
    ids = P + b["output_ids"]
    first = score_mixed(old, new, ids, n - 1, n)  # the last prompt position recomputed ...
    later = score_mixed(old, new, ids, n, n)  # ... then the tree's old copy of it is used
    np.testing.assert_allclose(lps(b)[:1], first.logprobs[:1], atol=1e-4)
    np.testing.assert_allclose(lps(b)[1:], later.logprobs[1:], atol=1e-4)
    np.testing.assert_array_equal(routed(b), later.routed_experts)  # routing follows the KV
    assert np.abs(lps(b) - score(new, ids, n).logprobs).max() > 1e-3  # not fresh

    turn = P + a["output_ids"] + [7, 8]  # a follow-up turn: the old prompt and answer cached
    c = gen(eng, turn)
    k = c["meta_info"]["cached_tokens"]
    assert k == n + N - 1  # the answer's last token never got KV
    mixed = score_mixed(old, new, turn + c["output_ids"], k, len(turn))
    np.testing.assert_allclose(lps(c), mixed.logprobs, atol=1e-4)
    np.testing.assert_array_equal(routed(c), mixed.routed_experts)

    flushed = httpx.post(eng.url + "/flush_cache")
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    d = gen(eng, P)
    assert d["meta_info"]["cached_tokens"] == 0
    np.testing.assert_allclose(lps(d), score(new, P + d["output_ids"], n).logprobs, atol=1e-4)


def test_flush_rules_as_sglang(make_engine, checkpoint_v2):
    """Refused (400 "Flush cache failed.") while anything runs or an in_place pause keeps KV;
    allowed after a retract pause; ``?timeout=T`` waits for idle; an update with the default
    flush_cache=true empties the cache when nothing is resident."""
    eng = make_engine(seed=1, step_delay_ms=20, extra_args=["--enable-radix-cache"])
    gen(eng, P, n=2)
    long = {"input_ids": [256, 9, 9], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}
    with httpx.Client(timeout=60) as c:
        t = threading.Thread(target=c.post, args=(eng.url + "/generate",), kwargs={"json": long})
        t.start()
        running(c, eng)  # the request holds KV now
        r = c.post(eng.url + "/flush_cache")
        assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
        assert c.post(eng.url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert c.post(eng.url + "/flush_cache").status_code == 400  # KV still resident
        assert c.post(eng.url + "/pause_generation", json={"mode": "retract"}).status_code == 200
        assert c.post(eng.url + "/flush_cache").status_code == 200  # retracted: no KV held
        c.post(eng.url + "/continue_generation", json={})
        running(c, eng)  # resumed (re-prefilled): it holds KV again
        r = c.post(eng.url + "/flush_cache", params={"timeout": 60})  # waits for the request
        assert r.status_code == 200
        info = c.get(eng.url + "/server_info").json()  # flushed once it had finished
        assert info["num_running_reqs"] + info["num_waiting_reqs"] == 0
        assert info["radix_cache_tokens"] == 0
        t.join(60)
    gen(eng, P, n=2)
    assert gen(eng, P, n=2)["meta_info"]["cached_tokens"] == len(P) - 1
    up = httpx.post(eng.url + "/update_weights_from_disk", timeout=60,
                    json={"model_path": str(checkpoint_v2), "weight_version": "1"})
    assert up.json() == {"success": True, "num_paused_requests": 0, "message":
                         "Succeeded to update model weights. Weight version updated to 1."}
    assert gen(eng, P, n=2)["meta_info"]["cached_tokens"] == 0  # flushed by the update


@pytest.mark.parametrize("flags,on", [([], True),
                                      (["--disable-radix-cache", "--disable-overlap-schedule"],
                                       False)])
def test_strict_mode_defaults_are_sglang_defaults(make_engine, flags, on):
    eng = make_engine(seed=1, sglang_strict=True, extra_args=flags)
    info = httpx.get(eng.url + "/server_info").json()
    assert info["disable_radix_cache"] is (not on) and info["disable_overlap_schedule"] is (not on)
    gen(eng, P, n=3)
    assert gen(eng, P, n=3)["meta_info"]["cached_tokens"] == (len(P) - 1 if on else 0)


def running(c: httpx.Client, eng, timeout: float = 30.0) -> None:
    """Wait until the engine runs a request, unpaused (an event read from /server_info)."""
    deadline = time.monotonic() + timeout
    while True:
        info = c.get(eng.url + "/server_info").json()
        if info["num_running_reqs"] == 1 and not info["paused"]:
            return
        assert time.monotonic() < deadline, f"no request running: {info}"
        time.sleep(0.01)


def _idle_close_after(eng, wait: float) -> bool:
    """Send one keep-alive request, stay idle ``wait`` s: did the server close the socket?"""
    with socket.create_connection((eng.host, eng.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        time.sleep(wait)
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            return s.recv(4096) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_idle_keep_alive_connections_close_like_uvicorn(make_engine, monkeypatch):
    eng = make_engine(seed=1, extra_args=["--timeout-keep-alive", "1"])
    assert not _idle_close_after(eng, 0.2)
    assert _idle_close_after(eng, 2.0)
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "2")  # SGLang's variable
    eng = make_engine(seed=1)
    assert not _idle_close_after(eng, 1.0)
    assert _idle_close_after(eng, 3.0)
