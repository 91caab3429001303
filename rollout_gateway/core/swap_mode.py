"""The swap mode: what happens to requests in flight while an engine's weights change.

One enum, used everywhere inside the gateway. Its values are the wire words (HTTP JSON,
gRPC ``AnnounceRequest.mode``, the registry's stored swap records), so each edge converts
once (``SwapMode.parse``, or pydantic for HTTP) and nothing inside compares strings.
"""

from __future__ import annotations

from rollout_gateway.core.trajectory import Transition
from rollout_gateway.core.wire_enum import WireEnum


class SwapMode(WireEnum):
    """What happens to requests in flight while the weights change."""

    IN_PLACE = "in_place"  # pause keeping KV; continue on new weights over the old KV
    RETRACT = "retract"  # pause dropping KV; re-prefilled under the new weights
    ABORT_RESUME = "abort_resume"  # abort; the gateway resubmits prompt + partial output
    DRAIN = "drain"  # stop admitting, let in-flight requests finish on the old weights

    @property
    def transition(self) -> Transition:
        """How a request's segment after a swap in this mode begins (kv stamping)."""
        return Transition(self.value)  # the same words: in_place, retract, abort_resume, drain
