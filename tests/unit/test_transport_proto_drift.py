"""The committed rollout_proto/ must be exactly what scripts/gen_proto.sh generates."""

import filecmp
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_matches_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_proto.sh"), str(tmp_path)], check=True,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert fresh, "generator produced nothing"
    committed = ROOT / "rollout_proto"
    drift = [str(p) for p in fresh
             if not (committed / p).exists()
             or not filecmp.cmp(tmp_path / p, committed / p, shallow=False)]
    assert not drift, f"rollout_proto/ is stale; run scripts/gen_proto.sh ({drift})"
    # and nothing generated is committed without a .proto behind it
    stale = [str(p.relative_to(committed)) for p in (committed / "rollout").rglob("*_pb2*.py*")
             if p.relative_to(committed) not in fresh]
    assert not stale, f"generated files without a .proto: {stale}"
