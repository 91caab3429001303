"""Whose a rollout is: the tenant stamp, tenant-namespaced request ids and the request
digest that makes a repeated ``request_id`` mean the same request.

- Every trajectory carries ``metadata["tenant"]`` (set by the gateway after the caller's
  metadata, so a client cannot set it).
- A ``request_id`` is the tenant's own: tenant ``default`` keeps the trajectory ids
  ``<request_id>:<i>``, another tenant's are ``<tenant>/<request_id>:<i>`` (``/`` is in
  neither a tenant name nor a request id, so two tenants' ids never meet).
- ``metadata["request_digest"]`` (with a ``request_id``) holds a short hash per request
  field; a repeat of the ``request_id`` with another body is refused (409) naming the
  fields that differ.
"""

from __future__ import annotations

import hashlib
from typing import Any

import orjson

from rollout_gateway.errors import AlreadyExists
from rollout_gateway.rollouts.models import RolloutRequest
from rollout_gateway.settings import DEFAULT_TENANT

TENANT_KEY = "tenant"
DIGEST_KEY = "request_digest"
#: the fields that make two requests with one request_id the same request (``stream``
#: is how the answer is delivered, not what is asked for)
DIGEST_FIELDS = ("prompt", "input_ids", "n", "sampling_params", "group_id", "session_id",
                 "metadata", "publish", "return_routed_experts", "version_policy")


def request_base(tenant: str, request_id: str) -> str:
    """The prefix of a request's trajectory ids (and its key while it runs)."""
    return request_id if tenant == DEFAULT_TENANT else f"{tenant}/{request_id}"


def _h(value: Any) -> str:
    raw = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(raw, digest_size=6).hexdigest()


def digest(req: RolloutRequest) -> str:
    """``field=hash`` per field of :data:`DIGEST_FIELDS`, comma-separated."""
    d = req.model_dump(include=set(DIGEST_FIELDS), exclude_none=False)
    if isinstance(d.get("sampling_params"), dict):  # what was set, not the defaults
        d["sampling_params"] = req.sampling_params.model_dump(exclude_unset=True)
    return ",".join(f"{f}={_h(d.get(f))}" for f in DIGEST_FIELDS)


def _parse(s: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in s.split(",") if "=" in p)


def check_same(request_id: str, stored: str | None, now: str) -> None:
    """Refuse (409) a repeat of ``request_id`` whose body differs from the stored run's.
    ``stored`` None: a trajectory stored without a digest (before digests): accepted."""
    if not stored:
        return
    a, b = _parse(stored), _parse(now)
    fields = [f for f in DIGEST_FIELDS if a.get(f) != b.get(f)]
    if fields:
        raise AlreadyExists(
            f"request_id {request_id!r} was used for another request (different "
            f"{', '.join(fields)}); repeat the same body to get its stored answer, or use a "
            "new request_id", details={"request_id": request_id, "fields": fields})
