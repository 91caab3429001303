"""Process entry points: serve (gateway) and up (everything on one machine)."""
