#!/usr/bin/env bash
# Set up and run the main job (`rollout-gateway demo`) on the embedded defaults: reference
# engine(s), the gateway (embedded store) and a learner that trains the toy MoE over gRPC
# with a hot-swap after every optimizer step. Report and plots go to ./demo-out.
# Extra arguments go to the demo, e.g. `bash scripts/run.sh --loss estr --compare-sync`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh demo
. .venv/bin/activate
exec rollout-gateway demo "$@"
