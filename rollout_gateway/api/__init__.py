"""HTTP API (FastAPI): rollouts, SGLang /generate pass-through, weights, versions, engines, health, metrics."""
