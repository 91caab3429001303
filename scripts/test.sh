#!/usr/bin/env bash
# Set up a fresh environment, make sure Redis answers, and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh dev
bash scripts/ensure-redis.sh
bash scripts/ensure-chromium.sh
bash scripts/sglang-cpu.sh >/dev/null  # the real SGLang server for tests/sglang (cached venv)
. .venv/bin/activate
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q -p no:cacheprovider "$@"
fi
# The whole suite: tests/sglang (mostly real SGLang server start-ups and waits on them) runs in
# a second pytest process beside the rest, so the two overlap on the machine's cores. Its output
# is printed after the main run; the exit status fails if either failed.
sglang_log=$(mktemp -t rollout-gateway-sglang-tests.XXXXXX)
python -m pytest -q -p no:cacheprovider tests/sglang >"$sglang_log" 2>&1 &
sglang_pid=$!
trap 'kill "$sglang_pid" 2>/dev/null || true' EXIT
main_rc=0
python -m pytest -q -p no:cacheprovider tests --ignore=tests/sglang || main_rc=$?
sglang_rc=0
wait "$sglang_pid" || sglang_rc=$?
trap - EXIT
echo "---- tests/sglang (run beside the rest; exit status $sglang_rc) ----"
cat "$sglang_log"
rm -f "$sglang_log"
echo "---- exit status: rest $main_rc, tests/sglang $sglang_rc ----"
if [ "$main_rc" -ne 0 ] || [ "$sglang_rc" -ne 0 ]; then
    exit 1
fi
