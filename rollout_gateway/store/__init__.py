"""Trajectory store: one interface (base.TrajectoryStore), a Redis Streams
implementation and an embedded in-process one."""
