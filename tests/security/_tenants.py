"""What the tenant tests share: tokens, the gateway environment, small HTTP and pull
helpers (against a real ``serve``)."""

from __future__ import annotations

import json
import uuid

import httpx
from _gateway_support import pull_ids

ADMIN, LEARNER = "admin-key-0123456789", "learner-key-0123456789"
A, B, C = ("team-a-token-0123456789", "team-b-token-0123456789",
           "team-c-token-0123456789")
TENANTS = json.dumps([{"name": "team-a", "token": A}, {"name": "team-b", "token": B},
                      {"name": "team-c", "token": C}])
ENV = {"ROLLOUT_GATEWAY_ADMIN_API_KEY": ADMIN, "ROLLOUT_GATEWAY_LEARNER_API_KEY": LEARNER,
       "ROLLOUT_GATEWAY_CLIENT_TENANTS": TENANTS}


def h(token: str, **extra: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **extra}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def chat(gw, token: str, sid: str | None, messages: list | str, **kw) -> httpx.Response:
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    body = {"model": "reference", "messages": messages, "max_tokens": 4, **kw}
    headers = h(token, **({"x-session-id": sid} if sid else {}))
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


def end(gw, token: str, sid: str, body: dict | None = None, **params) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/sessions/{sid}/end", json=body or {}, headers=h(token),
                      params=params, timeout=60)


def reward(gw, token: str, tid: str, value: float) -> httpx.Response:
    return httpx.post(f"{gw.url}/v1/trajectories/{tid}/reward", json={"reward": value},
                      headers=h(token), timeout=60)


def rollout(gw, token: str, body: dict) -> httpx.Response:
    return httpx.post(gw.url + "/v1/rollouts", json=body, headers=h(token), timeout=120)


def traj_id(resp: httpx.Response) -> str:
    return resp.json()["choices"][0]["rollout"]["trajectory_id"]


def pull_until(gw, want: set[str], *, group: str | None = None, token: str = LEARNER,
               timeout: float = 60.0) -> dict:
    """{id: Rollout} once every id in ``want`` arrived (the learner token by default)."""
    return pull_ids(gw, want, group=group, token=token, timeout=timeout)
