# An example learner image (learner_client + torch CPU; add your trainer on top).
#   docker build -f deploy/docker/learner.Dockerfile -t rollout-gateway-learner:dev .
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY rollout_gateway ./rollout_gateway
COPY learner_client ./learner_client
COPY rollout_proto ./rollout_proto
RUN pip install --no-cache-dir ".[learner]"
RUN useradd --uid 10001 --user-group --no-create-home learner
USER 10001
