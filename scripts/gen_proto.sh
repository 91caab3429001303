#!/usr/bin/env bash
# Regenerate rollout_proto/ from proto/ (one command). Usage: scripts/gen_proto.sh [OUT_DIR]
# OUT_DIR defaults to the package dir rollout_proto; tests regenerate into a temp dir
# and compare with the committed code.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="${1:-$ROOT/rollout_proto}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY=python
mkdir -p "$OUT/rollout/v1"
"$PY" -m grpc_tools.protoc -I "$ROOT/proto" \
  --python_out="$OUT" --pyi_out="$OUT" --grpc_python_out="$OUT" \
  "$ROOT"/proto/rollout/v1/*.proto
# Make imports package-relative: "from rollout.v1 import x" -> "from rollout_proto.rollout.v1 import x".
for f in "$OUT"/rollout/v1/*.py "$OUT"/rollout/v1/*.pyi; do
  sed -i -e 's/^from rollout\.v1 import /from rollout_proto.rollout.v1 import /' \
         -e 's/^import rollout\.v1\./import rollout_proto.rollout.v1./' "$f"
done
for d in "$OUT/rollout" "$OUT/rollout/v1"; do
  [ -f "$d/__init__.py" ] || : > "$d/__init__.py"
done
