"""``rollout-gateway engine`` argument handling (no server started)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from reference_engine import cli


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(argv)


def test_defaults():
    a = parse([])
    assert (a.port, a.seed, a.weight_version, a.incremental_streaming_output) == (30000, 0, None, False)
    assert (a.sglang_strict, a.enable_return_routed_experts, a.emulate_version) == (False, False, None)


def test_weight_version_default_follows_the_mode(monkeypatch):
    """'0' for the reference engine, SGLang's 'default' string in strict mode."""
    seen = {}

    def fake_create_app(settings):
        seen["s"] = settings

    import uvicorn

    from reference_engine import server
    monkeypatch.setattr(server, "create_app", fake_create_app)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    assert cli.run(parse([])) == 0 and seen["s"].weight_version == "0"
    assert cli.run(parse(["--sglang-strict"])) == 0
    assert seen["s"].weight_version == "default" and seen["s"].sglang_strict
    assert cli.run(parse(["--sglang-strict", "--weight-version", "3", "--emulate-version",
                          "0.5.20"])) == 0
    assert seen["s"].weight_version == "3" and seen["s"].emulate_version == "0.5.20"


def test_bad_emulated_version_fails_with_one_line(capsys):
    assert cli.run(parse(["--emulate-version", "latest"])) == 2
    assert "emulate_version" in capsys.readouterr().err


def test_bad_inputs_fail_fast_with_one_line(tmp_path, capsys):
    assert cli.run(parse(["--checkpoint", str(tmp_path / "nope")])) == 2
    assert "no config.json" in capsys.readouterr().err
    assert cli.run(parse(["--model-config", '{"num_attention_heads": 3}'])) == 2
    assert "multiple of num_key_value_heads" in capsys.readouterr().err


def test_help_does_not_import_torch():
    code = ("import sys; from rollout_gateway.cli import build_parser; "
            "build_parser(['engine']); print('torch' in sys.modules)")
    root = Path(cli.__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root)
    assert out.stdout.strip() == "False"


def test_sglang_scheduler_flags_default_by_mode(monkeypatch):
    """Radix cache and overlap scheduler: on with --sglang-strict (SGLang's defaults), off
    otherwise; either way SGLang's --disable-* flags (or --enable-*) decide."""
    seen = {}
    import uvicorn

    from reference_engine import server
    monkeypatch.setattr(server, "create_app", lambda settings: seen.setdefault("s", settings))
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: seen.update(kw=k))
    monkeypatch.delenv("SGLANG_TIMEOUT_KEEP_ALIVE", raising=False)
    for argv, radix, overlap in (
            ([], False, False), (["--sglang-strict"], True, True),
            (["--sglang-strict", "--disable-radix-cache", "--disable-overlap-schedule"],
             False, False),
            (["--enable-radix-cache", "--enable-overlap-schedule"], True, True)):
        seen.clear()
        assert cli.run(parse(argv)) == 0
        s = seen["s"]
        assert (s.radix_cache_on, s.overlap_on) == (radix, overlap), argv
        assert seen["kw"]["timeout_keep_alive"] == 5.0
    seen.clear()
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "9")
    assert cli.run(parse([])) == 0 and seen["kw"]["timeout_keep_alive"] == 9.0
    seen.clear()
    assert cli.run(parse(["--timeout-keep-alive", "2"])) == 0
    assert seen["kw"]["timeout_keep_alive"] == 2.0


def test_keep_alive_env_must_be_an_integer(monkeypatch, capsys):
    monkeypatch.setenv("SGLANG_TIMEOUT_KEEP_ALIVE", "soon")
    assert cli.run(parse([])) == 2
    assert "SGLANG_TIMEOUT_KEEP_ALIVE" in capsys.readouterr().err


def test_radix_flags_are_exclusive(capsys):
    import pytest

    with pytest.raises(SystemExit):
        parse(["--disable-radix-cache", "--enable-radix-cache"])
