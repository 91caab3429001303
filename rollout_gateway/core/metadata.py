"""Trajectory metadata: which keys are the gateway's.

A trajectory's ``metadata`` carries the caller's keys (``metadata`` of ``/v1/rollouts``,
``/generate``, the OpenAI routes) and the keys the gateway writes (staleness verdicts,
publish errors, session facts, rewards held back). The gateway's keys are a namespace of
their own: the names in :data:`GATEWAY_KEYS` and every key that starts with
:data:`GATEWAY_PREFIX`. A request whose metadata names one of them is refused (400 / 422
naming the keys), so a learner may trust any of these keys it finds in a stored
trajectory: only the gateway wrote it.
"""

from __future__ import annotations

from collections.abc import Iterable

#: keys the gateway may add later: reserved now so that no client relies on them
GATEWAY_PREFIX = "gateway."
#: every key the gateway writes (tests/unit/test_metadata_namespace.py checks the sources)
GATEWAY_KEYS = frozenset({
    # staleness (rollouts/gatekeeper.py, sessions/session.py)
    "stale_verdict", "stale_max_lag", "stale_masked_tokens",
    # publishing and old logits (rollouts/rollout.py, old_logits/strategies.py)
    "publish_error", "old_logits_error",
    # agent sessions (sessions/manager.py, sessions/session.py)
    "session_id", "session_branch", "session_turns", "session_ended_by", "chat_template",
    "branched_from", "branch_reason", "reward",
    # the client tenant that made the trajectory, and its request's digest
    # (rollouts/tenancy.py)
    "tenant", "request_digest",
})


def gateway_owned(keys: Iterable[str]) -> list[str]:
    """The keys among ``keys`` that are the gateway's (sorted)."""
    return sorted(k for k in keys if k in GATEWAY_KEYS or k.startswith(GATEWAY_PREFIX))


def client_metadata(md: dict[str, str] | None) -> dict[str, str] | None:
    """A caller's metadata, refused (ValueError, a 422 at the HTTP boundary) when it names
    a key of the gateway's namespace."""
    if md:
        owned = gateway_owned(md)
        if owned:
            shown = ", ".join(repr(k) for k in owned[:8])
            raise ValueError(f"metadata key(s) {shown} belong to the gateway (it writes them; "
                             f"reserved: {', '.join(sorted(GATEWAY_KEYS))} and "
                             f"'{GATEWAY_PREFIX}*'); rename them")
    return md
