"""Enums whose values are wire words, converted once at the edge that reads them."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Self

from rollout_gateway.errors import InvalidArgument


class WireEnum(StrEnum):
    """A ``StrEnum`` (its JSON / proto form is the plain word) with one way in from the wire."""

    @classmethod
    def parse(cls, value: object) -> Self:
        """The member ``value`` names (a member passes through); InvalidArgument otherwise."""
        try:
            return cls(value)
        except ValueError:
            noun = re.sub(r"(?<!^)(?=[A-Z])", " ", cls.__name__).lower()  # SwapMode: swap mode
            raise InvalidArgument(f"{noun} must be one of {', '.join(cls)}, "
                                  f"got {value!r}") from None
