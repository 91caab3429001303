#!/usr/bin/env bash
# Set up and run the main job on the embedded defaults: one reference engine,
# the gateway (HTTP :8000, gRPC :50051) and the embedded trajectory store.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh engine
. .venv/bin/activate
exec rollout-gateway up "$@"
