"""``serve`` and ``up`` as commands: no listening beyond loopback without the admin and
learner keys, unless ``--insecure``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rollout_gateway

pytestmark = pytest.mark.integration


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_GATEWAY_")}
    root = str(Path(rollout_gateway.__file__).resolve().parent.parent)
    e["PYTHONPATH"] = root + os.pathsep + e.get("PYTHONPATH", "")
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "rollout_gateway", *args], env=e,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("cmd", [["serve", "--host", "0.0.0.0", "--port", "0"],
                                 ["serve", "--grpc-host", "0.0.0.0"],
                                 ["up", "--host", "0.0.0.0"]])
def test_refuses_public_bind_without_keys(cmd):
    r = run(*cmd)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to listen on 0.0.0.0" in r.stdout and "--insecure" in r.stdout
    # with only the admin key the learner's is still missing
    r = run(*cmd, env={"ROLLOUT_GATEWAY_ADMIN_API_KEY": "admin-key-0123456789"})
    assert r.returncode == 2 and "LEARNER_API_KEY" in r.stdout and "admin-key" not in r.stdout


def test_bad_tls_settings_are_refused():
    r = run("serve", "--tls-cert", "/nonexistent/cert.pem")
    assert r.returncode == 2 and "tls_key_file" in r.stdout
