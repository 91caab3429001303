# The gateway alone: no torch. Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t rollout-gateway:dev .
# Ports: HTTP 8000 (API, /v1/lag, /dashboard, /metrics, /livez, /health), gRPC 50051.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY rollout_gateway ./rollout_gateway
COPY learner_client ./learner_client
COPY rollout_proto ./rollout_proto
RUN pip install --no-cache-dir . && python -m compileall -q /app
RUN useradd --uid 10001 --user-group --no-create-home gateway
USER 10001
EXPOSE 8000 50051
# listening beyond loopback needs ROLLOUT_GATEWAY_ADMIN_API_KEY, ROLLOUT_GATEWAY_LEARNER_API_KEY
# and ROLLOUT_GATEWAY_CLIENT_API_KEY
# (docker run -e ...); serve refuses to start without them (docs/gateway.md, "Security")
ENTRYPOINT ["rollout-gateway", "serve", "--host", "0.0.0.0", "--grpc-host", "0.0.0.0"]
