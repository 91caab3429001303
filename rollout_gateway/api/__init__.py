"""HTTP API (FastAPI), HTTP only: rollouts, SGLang /generate pass-through, OpenAI routes,
weights, versions, engines, lag, dashboard, health, metrics. Routes get the components
they use (``deps``), never the gateway."""
