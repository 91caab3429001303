"""The native data plane under AddressSanitizer: a separate copy of ``_native.c`` built
with ``-fsanitize=address`` runs the parity and hostile-input tests in a child Python
(``LD_PRELOAD`` of gcc's libasan, ``PYTHONMALLOC=malloc`` so every buffer is ASan's), where
any out-of-bounds read or write aborts the child with a report. Leak checking is off
(CPython keeps objects alive at exit by design). Bounded: ~15 s of CPU (the parity tests,
the hostile-input ones that reach the native parsers, and the engine connection's reads
that land in ``land()``'s bytes)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "rollout_gateway" / "_native.c"

#: the child: load the ASan build as rollout_gateway._native, then run the tests
CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("rollout_gateway._native", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules["rollout_gateway._native"] = mod
from rollout_gateway import native
assert native.compiled() is mod and native.data_plane() == "native"
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", *sys.argv[2:]]))
"""


def _libasan() -> str:
    gcc = shutil.which("gcc")
    assert gcc, "gcc is needed to build the AddressSanitizer copy of the native module"
    path = subprocess.run([gcc, "-print-file-name=libasan.so"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert os.path.isabs(path) and os.path.exists(path), \
        "gcc's libasan is missing (Debian: apt-get install libasan8)"
    return path


@pytest.mark.timeout(600)
def test_native_parsers_under_address_sanitizer(tmp_path):
    libasan = _libasan()
    so = tmp_path / ("_native" + sysconfig.get_config_var("EXT_SUFFIX"))
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-g", "-std=c11",
                    "-fsanitize=address", "-fno-omit-frame-pointer",
                    f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(so)],
                   check=True)
    env = {**os.environ, "LD_PRELOAD": libasan, "PYTHONMALLOC": "malloc",
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:allocator_may_return_null=1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "ROLLOUT_GATEWAY_DATA_PLANE": "auto"}
    tests = [str(ROOT / "tests/unit/test_native_parity.py"),
             str(ROOT / "tests/security/test_decode_properties.py"),
             str(ROOT / "tests/unit/test_rawconn.py"),  # land(): bodies received into it
             str(ROOT / "tests/unit/test_rawhttp_landing.py"),
             "-k", "native or segment or truncation or landing or land"]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(so), *tests], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=540)
    report = proc.stdout[-4000:] + proc.stderr[-8000:]
    assert "AddressSanitizer" not in proc.stderr, report
    assert proc.returncode == 0, report
    assert " passed" in proc.stdout, report
