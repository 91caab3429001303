# The reference engine (toy Qwen3-MoE on CPU, SGLang protocol). For CI-like clusters without GPUs.
#   docker build -f deploy/docker/engine.Dockerfile -t rollout-gateway-engine:dev .
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY rollout_gateway ./rollout_gateway
COPY learner_client ./learner_client
COPY rollout_proto ./rollout_proto
RUN pip install --no-cache-dir ".[engine]"
EXPOSE 30000
ENTRYPOINT ["rollout-gateway", "engine", "--host", "0.0.0.0", "--port", "30000"]
