#!/usr/bin/env bash
# Build (once) a separate virtualenv with the real SGLang 0.5.23 server for the CPU, and print
# its python. Used by tests/sglang (the conformance suite) and by scripts/test.sh.
#
#   bash scripts/sglang-cpu.sh                 # build if needed, then print the venv's python
#   bash scripts/sglang-cpu.sh --print-python  # print it only if the venv is ready, else exit 1
#   bash scripts/sglang-cpu.sh --rebuild       # throw the venv away and build it again
#
# The venv lives outside the repo, cached between runs:
#   ${SGLANG_VENV:-$HOME/.cache/rollout-gateway/sglang-0.5.23-venv}
# A stamp file inside it holds a hash of the versions below and of scripts/sglang_cpu/
# {requirements,constraints}.txt: a second run with the same inputs is a no-op (no python, no
# pip). Bump BUILD when the build steps change in a way the hash would not see.
#
# Why a venv of its own: SGLang pins torch==2.14.1 and ~20 CUDA-only packages that clash with
# ours. sglang is installed with --no-deps; its server-path requirements
# (scripts/sglang_cpu/requirements.txt) under the constraint torch==2.13.0, the local CPU wheel
# (any other torch request would pull a multi-GB CUDA build). The stand-in for the CPU
# sgl_kernel helpers and the two environment fixes are not installed here: they sit in
# scripts/sglang_cpu/pythonpath and reach the server through PYTHONPATH (see
# tests/sglang/_sglang_support.py and docs/gateway.md "Real SGLang in the test bed").
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
venv="${SGLANG_VENV:-$HOME/.cache/rollout-gateway/sglang-0.5.23-venv}"
stamp="$venv/.rollout-gateway-sglang-stamp"
req="$here/sglang_cpu/requirements.txt"
con="$here/sglang_cpu/constraints.txt"
SGLANG_VERSION=0.5.23
TORCHVISION_VERSION=0.28.0
BUILD=1

want="$( { echo "$SGLANG_VERSION $TORCHVISION_VERSION $BUILD"; cat "$req" "$con"; } | sha256sum | cut -d' ' -f1)"
ready() { [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }

mode="${1:-}"
case "$mode" in
  --print-python)
    if ready; then echo "$venv/bin/python"; exit 0; fi
    echo "sglang-cpu: no ready venv at $venv (run bash scripts/sglang-cpu.sh)" >&2
    exit 1 ;;
  --rebuild) rm -f "$stamp" ;;
  "") ;;
  *) echo "usage: $0 [--print-python|--rebuild]" >&2; exit 2 ;;
esac

if ready; then echo "$venv/bin/python"; exit 0; fi

# One builder at a time (a pytest fixture and scripts/test.sh may race on a fresh machine).
mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
flock 9
if ready; then echo "$venv/bin/python"; exit 0; fi

start=$(date +%s)
log="$venv.build.log"
echo "sglang-cpu: building $venv (sglang==$SGLANG_VERSION for the CPU; 1.5-3 min, 2.7 GB; log $log)" >&2
: > "$log"
step() {  # run one build step, its output into the log; on failure show the log's tail
  echo "+ $*" >> "$log"
  if ! "$@" >> "$log" 2>&1; then
    echo "sglang-cpu: failed: $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
rm -rf "$venv"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
step "$py" -m venv "$venv"
vpy="$venv/bin/python"
pip=("$vpy" -m pip install --disable-pip-version-check)
step "${pip[@]}" --upgrade pip
step "${pip[@]}" -c "$con" torch==2.13.0
step "${pip[@]}" --no-deps "sglang==$SGLANG_VERSION"
# torchvision: sglang.srt.configs imports it unconditionally. PyPI's build is linked against
# CUDA torch; with --no-deps it sits beside the CPU torch, its C ops do not load, and the
# sitecustomize in scripts/sglang_cpu/pythonpath skips its fake-op registrations.
step "${pip[@]}" --no-deps "torchvision==$TORCHVISION_VERSION"
# pip reports sglang's CUDA-only requirements as unmet here: expected (they are left out).
step "${pip[@]}" -c "$con" -r "$req"
# Our pins must be SGLang's own: compare with the installed wheel's METADATA.
step "$vpy" - "$req" <<'PY'
import re, sys
from importlib.metadata import requires, version
from packaging.requirements import Requirement
declared = {}
for r in map(Requirement, requires("sglang")):
    if r.marker is None or r.marker.evaluate({"extra": ""}):
        declared[r.name.lower().replace("_", "-")] = r
bad = []
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    ours = Requirement(line)
    theirs = declared.get(ours.name.lower().replace("_", "-"))
    if theirs is not None and theirs.specifier != ours.specifier:
        bad.append(f"{ours} (sglang declares {theirs})")
    got = version(ours.name)
    if theirs is not None and got not in theirs.specifier:
        bad.append(f"{ours.name}=={got} installed, sglang declares {theirs}")
if version("torch") != "2.13.0+cpu":
    bad.append(f"torch {version('torch')} installed, not the 2.13.0 CPU wheel")
if bad:
    sys.exit("pins disagree with sglang's METADATA:\n  " + "\n  ".join(bad))
print("pins agree with sglang", version("sglang"))
PY
# The server stack imports, as the launched server sees it (stand-in and fixes on the path).
step env SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$here/sglang_cpu/pythonpath" "$vpy" -c \
  "import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.models.qwen3_moe"
"$vpy" -m pip freeze > "$venv/rollout-gateway-freeze.txt"
echo "$want" > "$stamp"
echo "sglang-cpu: built in $(( $(date +%s) - start ))s, $(du -sh "$venv" | cut -f1)" >&2
echo "$vpy"
