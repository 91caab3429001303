#!/usr/bin/env bash
# Start a throwaway Redis on 127.0.0.1:6379 unless one already answers.
set -euo pipefail
# the Redis Cluster tests (tests/integration/_cluster_support.py) start their own nodes:
# they need both programs even when a Redis already answers
for tool in redis-server redis-cli; do
  command -v "$tool" >/dev/null || { echo "$tool not found: install Redis >= 7 (apt-get install redis-server)" >&2; exit 1; }
done
if redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  exit 0
fi
mkdir -p /tmp/rollout-gateway-redis
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
  --dir /tmp/rollout-gateway-redis --logfile /tmp/rollout-gateway-redis/redis.log
for _ in $(seq 50); do
  redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1 && exit 0
  sleep 0.1
done
echo "Redis did not start" >&2; exit 1
