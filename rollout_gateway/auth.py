"""Who may do what: bearer tokens, roles and per-job consumer groups (pure, no I/O).

Three roles, one token each (settings ``admin_api_key``, ``learner_api_key``,
``client_api_key``), sent as ``Authorization: Bearer <token>`` over HTTP and as the
``authorization`` metadata over gRPC:

- **admin**: weight swaps, engine admin, configuration, gRPC ``AnnounceVersion``; the admin
  token is accepted wherever another role is asked for.
- **learner**: gRPC ``Pull``/``Ack``/``Nack``/``ExtendLease``/``CreateGroup``/``GetStatus``/``WatchVersions``.
  ``learner_jobs`` adds tokens bound to consumer groups: such a token touches only groups
  named in its ``groups`` (exact names, or prefixes written ``name*``), so one training job
  cannot pull or ack another job's trajectories.
- **client**: ``/v1/rollouts``, ``/generate`` and the OpenAI routes; open unless
  ``client_api_key`` or ``client_tenants`` is set. Each client token belongs to a tenant
  (``client_api_key``: ``default``; ``client_tenants``: one named token each): sessions,
  request ids and held trajectories are the tenant's own (:attr:`Principal.tenant`).

A role whose credentials are not configured is open (local development on loopback;
``serve``/``up`` refuse a non-loopback bind without the admin and learner keys unless told
``--insecure``). Tokens are compared in constant time (:func:`hmac.compare_digest`) and are
``SecretStr`` in the settings, so they never appear in logs or reprs.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from rollout_gateway.errors import PermissionDenied, Unauthenticated
from rollout_gateway.settings import DEFAULT_TENANT


class Role(StrEnum):
    ADMIN = "admin"
    LEARNER = "learner"
    CLIENT = "client"


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller. ``groups`` None = every consumer group. ``tenant``: a
    client's tenant (None for the admin and learners)."""

    role: Role
    groups: tuple[str, ...] | None = None
    tenant: str | None = None

    @property
    def sees_all(self) -> bool:
        """The admin: acts on every tenant's sessions and trajectories."""
        return self.role is Role.ADMIN

    @property
    def owner(self) -> str:
        """The tenant whose namespace this caller's own calls live in (the admin's and an
        open role's: ``default``)."""
        return self.tenant or DEFAULT_TENANT

    def may_use_group(self, group: str) -> bool:
        if self.groups is None:
            return True
        return any(group.startswith(p[:-1]) if p.endswith("*") else group == p
                   for p in self.groups)


#: the caller of an open role (no credentials configured for it)
ANONYMOUS_ADMIN = Principal(Role.ADMIN)
#: the caller of an open client role: tenant ``default``, sees only its own
OPEN_CLIENT = Principal(Role.CLIENT, tenant=DEFAULT_TENANT)


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value (scheme case-insensitive)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _secret(v) -> str | None:
    if v is None:
        return None
    s = v.get_secret_value() if hasattr(v, "get_secret_value") else str(v)
    return s or None


class Authenticator:
    """Checks tokens against the configured ones.

    ``jobs`` are (token, groups) pairs of learner tokens bound to consumer groups;
    ``tenants`` (name, token) pairs of client tokens (``client`` is tenant ``default``)."""

    def __init__(self, *, admin: object = None, learner: object = None, client: object = None,
                 jobs: Iterable[tuple[object, Iterable[str]]] = (),
                 tenants: Iterable[tuple[str, object]] = ()) -> None:
        self._admin = _secret(admin)
        self._learner = _secret(learner)
        self._client = _secret(client)
        self._jobs = [(t, tuple(g)) for t, g in ((_secret(t), g) for t, g in jobs) if t]
        self._all: list[tuple[bytes, Principal]] = []
        if self._admin:
            self._all.append((self._admin.encode(), Principal(Role.ADMIN)))
        if self._learner:
            self._all.append((self._learner.encode(), Principal(Role.LEARNER)))
        for tok, groups in self._jobs:
            self._all.append((tok.encode(), Principal(Role.LEARNER, groups)))
        self._tenants = [(n, t) for n, t in ((n, _secret(t)) for n, t in tenants) if t]
        if self._client:
            self._all.append((self._client.encode(), Principal(Role.CLIENT,
                                                               tenant=DEFAULT_TENANT)))
        for name, tok in self._tenants:
            self._all.append((tok.encode(), Principal(Role.CLIENT, tenant=name)))

    @classmethod
    def from_settings(cls, s) -> Authenticator:
        return cls(admin=s.admin_api_key, learner=s.learner_api_key, client=s.client_api_key,
                   jobs=[(j.token, j.groups) for j in s.learner_jobs],
                   tenants=[(t.name, t.token) for t in s.client_tenants])

    def open_for(self, role: Role) -> bool:
        """No credential is configured that this role could be asked for."""
        if role is Role.ADMIN:
            return self._admin is None
        if role is Role.LEARNER:
            return self._learner is None and not self._jobs
        return self._client is None and not self._tenants

    @property
    def enabled(self) -> bool:
        return bool(self._all)

    def identify(self, token: str | None) -> Principal | None:
        """The principal a token belongs to, or None. Compares against every configured
        token (no early exit), each in constant time."""
        if token is None:
            return None
        got = token.encode("utf-8", "surrogateescape")
        found: Principal | None = None
        for want, principal in self._all:
            if hmac.compare_digest(got, want) and found is None:
                found = principal
        return found

    def is_admin(self, authorization: str | None) -> bool:
        """The caller presented the admin token (False when no admin key is configured)."""
        if self._admin is None:
            return False
        p = self.identify(bearer(authorization))
        return p is not None and p.role is Role.ADMIN

    def require(self, authorization: str | None, role: Role) -> Principal:
        """The caller's principal if it may act as ``role``; else Unauthenticated (no or
        unknown token) or PermissionDenied (a valid token of another role)."""
        if self.open_for(role):
            p = self.identify(bearer(authorization))
            # an open role still honours a group-bound learner token's limits
            if p is not None and p.role in (role, Role.ADMIN):
                return p
            return OPEN_CLIENT if role is Role.CLIENT else ANONYMOUS_ADMIN
        p = self.identify(bearer(authorization))
        if p is None:
            raise Unauthenticated(f"this needs the {role.value} token: send "
                                  f"'Authorization: Bearer <{role.value} token>'")
        if p.role is Role.ADMIN or p.role is role:
            return p
        raise PermissionDenied(f"a {p.role.value} token may not do this; it needs the "
                               f"{role.value} token")

    def tenant_of(self, authorization: str | None) -> str | None:
        """The tenant a request's token belongs to (``default`` for the admin's and for an
        open client role), or None for a token that is no client's (the route refuses it)."""
        p = self.identify(bearer(authorization))
        if p is None:
            return DEFAULT_TENANT if self.open_for(Role.CLIENT) else None
        return p.owner

    @staticmethod
    def check_group(principal: Principal, group: str) -> None:
        if not principal.may_use_group(group):
            raise PermissionDenied(f"this learner token is not allowed consumer group {group!r}")
