"""SGLang's prefix (radix) cache, for the reference engine: KV and routing rows kept by token prefix.

What SGLang 0.5.23 does (``mem_cache/radix_cache.py``, ``mem_cache/common.py``,
``managers/schedule_batch.py``) and this module reproduces with page size 1 (SGLang's default
on CPU):

- **Match**: a request's prefill looks up the longest cached prefix of ``prompt + output``,
  cut at ``len - 1`` (the last token is always recomputed, to get its logits) and, when
  ``return_logprob`` with ``logprob_start_len >= 0``, at ``logprob_start_len``
  (``Req._compute_max_prefix_len``). Only the first prefill counts it as ``cached_tokens``
  (a retracted request's re-prefill reuses KV but adds nothing: ``retracted_stain``).
- **Insert keeps the oldest values**: inserting a key whose prefix is already cached leaves
  the cached nodes' KV as they are and adds only the new suffix (``_insert_helper``). So KV
  computed under old weights stays in the tree until a flush or eviction.
- **Checkpoint after a prefill**: the request's prompt KV is inserted, and the part the tree
  already held beyond the matched prefix (at least the recomputed last token) is *replaced in
  the request* by the tree's copy (``RadixCache.checkpoint`` rewrites ``req_to_token``): later
  decode steps attend to the tree's (possibly old-weight) KV there. Routing rows are read by
  KV slot (``state_capturer/base.py get_topk``), so they follow the same redirect.
- **Release at finish** (also abort): ``prompt + output`` up to the committed KV is inserted.
  Retraction frees without inserting.
- **Eviction**: least recently used unlocked leaves, when the pool (``max_total_tokens``
  slots: tree + requests' own KV) cannot hold a step's new tokens.
- **Flush** (``reset``) drops everything.

Values are copies: a request's :class:`~reference_engine.model.KVCache` is filled from the
tree, so eviction never changes a running request's numbers (as SGLang's lock refs ensure).
Tree values per node: ``kv`` ``[layers, 2, n, kv_heads, head_dim]`` and ``routed``
``[n, layers, top_k]`` int32.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

import numpy as np
import torch

_clock = itertools.count(1)


class Node:
    __slots__ = ("children", "key", "kv", "last_access", "lock_ref", "parent", "routed")

    def __init__(self, key: list[int], kv: torch.Tensor | None, routed: np.ndarray | None,
                 parent: Node | None) -> None:
        self.key = key
        self.kv = kv
        self.routed = routed
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access = next(_clock)


class RadixCache:
    """A token-prefix tree of KV and routing rows; ``capacity`` is the KV pool in tokens."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.reset()

    # ------------------------------------------------------------------ basics
    def reset(self) -> None:
        self.root = Node([], None, None, None)
        self.root.lock_ref = 1
        self.size = 0  # tokens held by the tree

    def _split(self, child: Node, at: int) -> Node:
        """Split ``child`` after ``at`` tokens; the new parent keeps the first part."""
        new = Node(child.key[:at], child.kv[:, :, :at].clone(), child.routed[:at].copy(),
                   child.parent)
        new.lock_ref = child.lock_ref
        new.last_access = child.last_access
        new.children = {child.key[at]: child}
        child.parent.children[child.key[0]] = new
        child.parent = new
        child.key = child.key[at:]
        child.kv = child.kv[:, :, at:].clone()
        child.routed = child.routed[at:].copy()
        return new

    def _walk(self, tokens: list[int]) -> tuple[int, Node]:
        """Longest cached prefix of ``tokens``: (length, last node), splitting a node the match
        ends inside (as SGLang); touches every node on the path."""
        node, i, now = self.root, 0, next(_clock)
        node.last_access = now
        while i < len(tokens) and tokens[i] in node.children:
            child = node.children[tokens[i]]
            child.last_access = now
            n = 0
            key = child.key
            while n < len(key) and i + n < len(tokens) and key[n] == tokens[i + n]:
                n += 1
            i += n
            if n < len(key):
                node = self._split(child, n)
                break
            node = child
        return i, node

    @staticmethod
    def path(node: Node) -> list[Node]:
        out = []
        while node.parent is not None:
            out.append(node)
            node = node.parent
        out.reverse()
        return out

    def values(self, node: Node) -> tuple[torch.Tensor, np.ndarray]:
        """KV ``[layers, 2, n, kv_heads, head_dim]`` and routing ``[n, layers, top_k]`` of the
        whole prefix ending at ``node`` (n > 0)."""
        nodes = self.path(node)
        return (torch.cat([x.kv for x in nodes], dim=2),
                np.concatenate([x.routed for x in nodes], axis=0))

    # ------------------------------------------------------------------ API
    def match(self, tokens: list[int], limit: int) -> tuple[int, Node]:
        """Cached prefix of ``tokens[:limit]``: (length, last node)."""
        if limit <= 0:
            return 0, self.root
        return self._walk(tokens[:limit])

    def insert(self, tokens: list[int], kv: torch.Tensor, routed: np.ndarray) -> tuple[int, Node]:
        """Insert ``tokens`` with their values (``kv[:, :, i]`` / ``routed[i]`` of token i).
        Cached nodes keep their values; returns (length already cached, last node)."""
        have, node = self._walk(tokens)
        if have < len(tokens):
            new = Node(list(tokens[have:]), kv[:, :, have:len(tokens)].clone(),
                       np.array(routed[have:len(tokens)], dtype=np.int32), node)
            node.children[tokens[have]] = new
            self.size += len(tokens) - have
            node = new
        return have, node

    def lock(self, node: Node) -> None:
        while node.parent is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node | None) -> None:
        while node is not None and node.parent is not None:
            node.lock_ref -= 1
            node = node.parent

    def evictable_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.lock_ref == 0)

    def _nodes(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Drop least recently used unlocked leaves until ``num_tokens`` are freed (or none is
        left to drop); returns the tokens freed."""
        heap: list[tuple[int, int, Node]] = [
            (n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.size -= len(leaf.key)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def stats(self) -> dict[str, Any]:
        return {"cached_tokens_in_tree": self.size, "evictable_tokens": self.evictable_size()}
