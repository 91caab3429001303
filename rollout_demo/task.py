"""The demo's verifiable task: a rule-checked reward on the byte tokenizer.

Each prompt names a character class (``"digits:"``, ``"lower:"``, ``"upper:"``) followed by
a few random bytes of noise; the reward of a response is the fraction of its bytes that
belong to the named class. A seeded random toy model puts a few percent of its mass on each
class, so the reward starts low and a learner that conditions on the prompt can reach 1.
Pure Python/numpy: no torch, no I/O.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np

from reference_engine.tokenizer import BOS_ID

CLASSES: dict[str, frozenset[int]] = {
    "digits": frozenset(range(ord("0"), ord("9") + 1)),
    "lower": frozenset(range(ord("a"), ord("z") + 1)),
    "upper": frozenset(range(ord("A"), ord("Z") + 1)),
}
_LOOKUP = {name: np.isin(np.arange(512), sorted(ids)) for name, ids in CLASSES.items()}


def make_prompt(rng: random.Random, classes: Sequence[str] = tuple(CLASSES)) -> tuple[str, list[int]]:
    """``(class name, prompt token ids)``: BOS, the class name, ':' and 0-3 noise letters."""
    name = rng.choice(list(classes))
    noise = "".join(rng.choice("xyzw") for _ in range(rng.randint(0, 3)))
    return name, [BOS_ID, *f"{name}:{noise}".encode()]


def prompt_class(prompt_ids: Sequence[int]) -> str:
    """The class a prompt names (inverse of :func:`make_prompt`)."""
    ids = [int(t) for t in prompt_ids]
    if ids and ids[0] == BOS_ID:
        ids = ids[1:]
    text = bytes(t for t in ids if 0 <= t < 256).decode("latin-1")
    name = text.split(":", 1)[0]
    if name not in CLASSES:
        raise ValueError(f"prompt {text!r} names no known class {sorted(CLASSES)}")
    return name


def reward(prompt_ids: Sequence[int], response_ids: np.ndarray) -> float:
    """Fraction of response tokens in the prompt's class (0 for an empty response)."""
    r = np.asarray(response_ids, dtype=np.int64)
    if r.size == 0:
        return 0.0
    table = _LOOKUP[prompt_class(prompt_ids)]
    return float(table[np.clip(r, 0, table.size - 1)].mean())
