#!/usr/bin/env bash
# Create .venv (Python 3.11) and install the project with the given extras.
# torch is pinned to 2.13.0 and installed first so pip takes the local CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-dev}"
py="${PYTHON:-python3.11}"
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[${extras}]"
# the compiled data plane (setup.py builds rollout_gateway/_native.c; a failed build leaves
# the pure-Python one, with the same results): say which one this install runs
python -c 'from rollout_gateway import native; print("rollout-gateway", native.describe())'
