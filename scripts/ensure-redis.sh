#!/usr/bin/env bash
# Start a throwaway Redis on 127.0.0.1:6379 unless one already answers.
set -euo pipefail
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  exit 0
fi
command -v redis-server >/dev/null || { echo "redis-server not found and no Redis on 127.0.0.1:6379" >&2; exit 1; }
mkdir -p /tmp/rollout-gateway-redis
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp/rollout-gateway-redis --logfile /tmp/rollout-gateway-redis/redis.log
for _ in $(seq 50); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
  sleep 0.1
done
echo "Redis did not start" >&2; exit 1
