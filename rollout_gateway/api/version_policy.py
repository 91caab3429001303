"""The version policy at the HTTP edge: the ``x-version-policy`` header on every route,
the ``version_policy`` body field of ``/v1/rollouts`` and ``/generate``, and the
``x-weight-versions`` answer header (``core.version_policy`` holds the type and its words).

Each form is parsed once, here, into the request's ``VERSION_POLICY`` (the samples read it);
a bad value is a 400 naming the forms. A body field and a header that disagree are a 400
too (neither silently wins)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from rollout_gateway.api.errors import error_response
from rollout_gateway.core.trajectory import Trajectory
from rollout_gateway.core.version_policy import VersionPolicy
from rollout_gateway.errors import InvalidArgument
from rollout_gateway.rollouts.sample import VERSION_POLICY

HEADER = b"x-version-policy"
#: answer header: the weight versions that sampled the answer's tokens, ascending
VERSIONS_HEADER = "x-weight-versions"


class VersionPolicyHeader:
    """Pure ASGI middleware: ``x-version-policy`` -> ``VERSION_POLICY`` for the request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        raw = None
        if scope["type"] == "http":
            raw = next((v for k, v in scope["headers"] if k == HEADER), None)
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            policy = VersionPolicy.parse(raw.decode("latin-1"))
        except InvalidArgument as exc:
            answer = error_response(400, exc.code.value,
                                    f"header x-version-policy: {exc.message}")
            return await answer(scope, receive, send)
        token = VERSION_POLICY.set(policy)
        try:
            await self.app(scope, receive, send)
        finally:
            VERSION_POLICY.reset(token)


def apply_body_policy(text: str | None) -> None:
    """A body's ``version_policy`` field, for the request being handled (the samples it
    starts inherit it); InvalidArgument (400) when bad or when the header says otherwise."""
    if text is None:
        return
    try:
        policy = VersionPolicy.parse(text)
    except InvalidArgument as exc:
        raise InvalidArgument(f"version_policy: {exc.message}") from None
    header = VERSION_POLICY.get()
    if header is not None and header != policy:
        raise InvalidArgument(f"version_policy {policy} in the body contradicts header "
                              f"x-version-policy {header}; give one")
    VERSION_POLICY.set(policy)


def versions_header(trajs: Iterable[Trajectory]) -> dict[str, str]:
    """``x-weight-versions``: every weight version that sampled a token of the answer."""
    used: set[int] = set()
    for t in trajs:
        used.update(np.unique(t.tokens.policy_version).tolist())
    return {VERSIONS_HEADER: ",".join(str(v) for v in sorted(used))} if used else {}
