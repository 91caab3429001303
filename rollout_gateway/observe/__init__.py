"""Observability: version-lag figures (``GET /v1/lag``, gRPC ``GetStatus``), their
in-process accumulators and history, and the Prometheus metrics (``/metrics``), all read
through one :class:`~rollout_gateway.observe.view.GatewayView` (never the gateway)."""
