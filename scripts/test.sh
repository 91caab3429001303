#!/usr/bin/env bash
# Set up a fresh environment, make sure Redis answers, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh dev
bash scripts/ensure-redis.sh
bash scripts/ensure-chromium.sh
bash scripts/sglang-cpu.sh >/dev/null  # the real SGLang server for tests/sglang (cached venv)
. .venv/bin/activate
exec python -m pytest -q -p no:cacheprovider "$@"
