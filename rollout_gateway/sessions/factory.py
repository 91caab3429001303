"""Which session store goes with a trajectory store (kept apart from both stores' modules,
which must not import each other)."""

from __future__ import annotations

from rollout_gateway.sessions.store import MemorySessionStore, SessionStore


def session_store_for(store: object) -> SessionStore:
    """The session store next to a trajectory store: on its Redis (same client and
    prefix) for the Redis store, in memory for the embedded one."""
    from rollout_gateway.store.redis_streams import RedisStore

    if isinstance(store, RedisStore):
        from rollout_gateway.sessions.redis_store import RedisSessionStore

        return RedisSessionStore(store._r, store.layout)
    return MemorySessionStore()
