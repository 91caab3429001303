"""Agent sessions: OpenAI-compatible calls assembled into exact, stamped trajectories."""
