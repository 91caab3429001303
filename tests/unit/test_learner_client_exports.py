import subprocess
import sys

import learner_client


def test_every_export_resolves():
    for name in learner_client.__all__:
        assert getattr(learner_client, name) is not None, name


def test_import_is_cheap_and_never_touches_the_gateway():
    code = ("import sys, learner_client\n"
            "assert 'torch' not in sys.modules\n"
            "learner_client.collate; learner_client.TrajectoryClient; learner_client.LOSSES\n"
            "assert not [m for m in sys.modules if m.startswith('rollout_gateway')], 'imported gateway'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_unknown_name_is_an_attribute_error():
    try:
        learner_client.nope  # noqa: B018
    except AttributeError as exc:
        assert "nope" in str(exc)
    else:
        raise AssertionError("expected AttributeError")


def test_the_two_sides_meet_only_at_the_wire():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[2]
    for pkg, other in (("learner_client", "rollout_gateway"), ("rollout_gateway", "learner_client")):
        pat = re.compile(rf"^\s*(from|import)\s+{other}\b", re.M)
        bad = [str(p) for p in (root / pkg).rglob("*.py") if pat.search(p.read_text())]
        assert not bad, f"{pkg} imports {other}: {bad}"
