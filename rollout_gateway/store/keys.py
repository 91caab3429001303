"""Where every Redis key of the store and the registry is named: one place, so that keys a
multi-key operation touches (a Lua script, MULTI/EXEC, XREADGROUP over several streams)
share one Redis Cluster hash slot.

Redis Cluster hashes only the part of a key between the first ``{`` and the next ``}``
(the *hash tag*) when there is one; keys with the same tag live in the same slot, on the
same master. Three kinds of keys:

* :meth:`KeyLayout.key` - the prefix's *home* slot: the version registry, the recycled
  prompts, anything small that is not per trajectory.
* :meth:`KeyLayout.shard_key` - one trajectory shard: its stream, facts stream, groups,
  acked counts, counters and the idempotency markers of the trajectory ids that hash to it
  (:meth:`KeyLayout.shard_of`). Shards' tags are chosen so their slots are spread evenly
  over the 16384 slots (a cluster created with ``redis-cli --cluster create`` gives each
  master one contiguous range): ``shards`` = a multiple of the masters puts the same
  number of shards on each.
* :meth:`KeyLayout.tagged` - keys grouped by a tag of the caller's (e.g. one agent
  session's keys): same tag, same slot; different tags spread over the cluster.

Single-node Redis with one shard keeps the names it always had (``<prefix>:stream``,
``<prefix>:id:<tid>``, ``<prefix>:reg:learner``...), so existing data stays readable.
Every key starts with ``<prefix>:`` in every layout (one ``SCAN MATCH <prefix>:*`` finds
them all).
"""

from __future__ import annotations

import zlib
from functools import cached_property

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

__all__ = ["KeyLayout", "MAX_SHARDS"]

#: bound of the number of trajectory shards (settings, URL option ``shards``)
MAX_SHARDS = 256


class KeyLayout:
    """Key names under ``prefix`` for ``shards`` trajectory shards; ``cluster``: hash tags
    on every key (Redis Cluster)."""

    def __init__(self, prefix: str, *, shards: int = 1, cluster: bool = False) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1..{MAX_SHARDS}, got {shards}")
        if "{" in prefix or "}" in prefix:
            raise ValueError(f"a key prefix may not contain braces, got {prefix!r}")
        self.prefix, self.shards, self.cluster = prefix, shards, cluster

    @property
    def tagged_shards(self) -> bool:
        """Whether shard keys carry a hash tag (and entry ids a shard number)."""
        return self.cluster or self.shards > 1

    def key(self, name: str) -> str:
        """A key in the prefix's home slot."""
        return self.tagged(self.prefix, name) if self.cluster else f"{self.prefix}:{name}"

    def tagged(self, tag: str, name: str) -> str:
        """A key in the slot of ``tag`` (keys with the same tag share a slot)."""
        if "{" in tag or "}" in tag:
            raise ValueError(f"a hash tag may not contain braces, got {tag!r}")
        return f"{self.prefix}:{{{tag}}}:{name}"

    def shard_key(self, shard: int, name: str) -> str:
        """A key of trajectory shard ``shard`` (0 <= shard < shards)."""
        if not self.tagged_shards:
            return f"{self.prefix}:{name}"
        return self.tagged(self._tags[shard], name)

    def shard_of(self, trajectory_id: str) -> int:
        """The shard holding a trajectory id (stable: CRC-32 of the id, mod shards)."""
        if self.shards == 1:
            return 0
        return zlib.crc32(trajectory_id.encode()) % self.shards

    def slot(self, shard: int) -> int:
        """The cluster hash slot of a shard's keys."""
        return key_slot(self.shard_key(shard, "stream").encode())

    @cached_property
    def _tags(self) -> list[str]:
        """Shard k's tag: ``s<k>`` or ``s<k>.<n>``, the first whose slot falls in the k-th
        of ``shards`` equal ranges of the slot space (deterministic, ~shards tries)."""
        tags = []
        for k in range(self.shards):
            lo = k * REDIS_CLUSTER_HASH_SLOTS // self.shards
            hi = (k + 1) * REDIS_CLUSTER_HASH_SLOTS // self.shards
            n = 0
            tag = f"s{k}"
            while not lo <= key_slot(tag.encode()) < hi:
                n += 1
                tag = f"s{k}.{n}"
            tags.append(tag)
        return tags
