import subprocess
import sys


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys; from rollout_gateway.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "engine" in out.stdout and "serve" in out.stdout


def test_gateway_side_never_imports_torch():
    code = ("import sys\n"
            "from rollout_gateway.api.app import create_app\n"
            "from rollout_gateway.gateway import Gateway\n"
            "from rollout_gateway.settings import GatewaySettings\n"
            "from rollout_gateway.commands import serve\n"
            "from rollout_gateway.transport import server\n"
            "from rollout_gateway.store import memory, redis_streams\n"
            "from rollout_gateway.registry import redis_registry\n"
            "create_app(Gateway(GatewaySettings()))\n"
            "assert 'torch' not in sys.modules, 'the gateway imported torch'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
