import subprocess
import sys


def test_help_is_fast_and_does_not_import_torch():
    code = ("import sys; from rollout_gateway.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "engine" in out.stdout and "serve" in out.stdout
