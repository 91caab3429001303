"""The gateway's metadata keys are its own: every key the gateway writes is in
``GATEWAY_KEYS`` (checked against the sources), and no request may name one."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

import rollout_gateway
from rollout_gateway.core.metadata import GATEWAY_KEYS, GATEWAY_PREFIX, gateway_owned
from rollout_gateway.rollouts.models import RolloutRequest

ROOT = Path(rollout_gateway.__file__).resolve().parent
#: ``metadata["k"] = ...``, ``md["k"] = ...`` and the keys of ``md.update({...})``
WRITE = re.compile(r'(?:metadata|\bmd)\["([A-Za-z0-9_.]+)"\]\s*=')
UPDATE = re.compile(r"\bmd\.update\(\{(.*?)\}\)", re.S)


def written_keys() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        for k in WRITE.findall(text):
            found[k] = path.name
        for body in UPDATE.findall(text):
            for k in re.findall(r'"([A-Za-z0-9_.]+)"\s*:', body):
                found[k] = path.name
    return found


def test_every_key_the_gateway_writes_is_reserved():
    found = written_keys()
    assert {"stale_verdict", "publish_error", "session_id", "reward"} <= set(found), found
    stray = {k: f for k, f in found.items() if not gateway_owned([k])}
    assert not stray, f"add these to core/metadata.py GATEWAY_KEYS: {stray}"


@pytest.mark.parametrize("key", sorted(GATEWAY_KEYS) + [GATEWAY_PREFIX + "x"])
def test_a_request_may_not_write_a_gateway_key(key):
    with pytest.raises(ValidationError, match="belong to the gateway"):
        RolloutRequest(input_ids=[1], metadata={"mine": "1", key: "forged"})


def test_other_keys_pass():
    req = RolloutRequest(input_ids=[1], metadata={"task": "t1", "stale": "x", "rewarded": "y"})
    assert req.metadata["task"] == "t1"
