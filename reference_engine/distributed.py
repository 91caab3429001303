"""Weight updates over torch.distributed (``/init_weights_update_group`` and
``/update_weights_from_distributed``), as SGLang does them, on the gloo backend.

The group is a *custom* process group (not the default one), created like SGLang's
``init_custom_process_group``: TCP rendezvous at ``master_address:master_port``, store
prefixed with ``group_name``, ranks ``0..world_size-1`` with the learner at rank 0 and this
engine at ``rank_offset``. A learner joins with the same recipe (the exact code lives in its
own package) and, for each update, ``dist.broadcast(tensor, src=0, group=pg)`` every tensor
in the order of ``names`` (shapes/dtypes as announced). Rendezvous and receives run off the
event loop. Receiving happens between ``/begin_weight_update`` and ``/end_weight_update``.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from reference_engine.protocol import ProtocolError

TIMEOUT = timedelta(seconds=120)


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int,
                              group_name: str, timeout: timedelta = TIMEOUT) -> Any:
    """A process group outside the default one (so it can coexist with a trainer's)."""
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=timeout)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def _dtype(name: Any) -> torch.dtype:
    s = str(name).removeprefix("torch.")
    dt = getattr(torch, s, None)
    if not isinstance(dt, torch.dtype):
        raise ProtocolError(f"unknown dtype {name!r}")
    return dt


async def init_group(sched: Any, body: dict[str, Any]) -> tuple[bool, str]:
    try:
        addr = str(body["master_address"])
        port = int(body["master_port"])
        rank_offset = int(body.get("rank_offset", 1))
        world_size = int(body["world_size"])
        group_name = str(body.get("group_name") or "weight_update_group")
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"bad init_weights_update_group request: {exc!r}") from exc
    backend = str(body.get("backend") or "gloo")
    if backend != "gloo":
        return False, f"the reference engine runs on CPU and supports only the gloo backend, got {backend!r}"
    if not 0 < rank_offset < world_size:
        raise ProtocolError("rank_offset must be in [1, world_size)")
    if sched.dist_group is not None:
        return False, "an update group is already initialized; destroy it first"
    try:
        pg = await asyncio.to_thread(init_custom_process_group, backend, f"tcp://{addr}:{port}",
                                     world_size, rank_offset, group_name)
    except Exception as exc:  # noqa: BLE001 - report, never crash
        return False, f"Failed to initialize custom process group: {exc}."
    sched.dist_group = (group_name, pg)
    return True, "Succeeded to initialize custom process group."


def _receive(pg: Any, names: list[str], dtypes: list[Any], shapes: list[list[int]]) -> dict:
    out: dict[str, torch.Tensor] = {}
    for name, dt, shape in zip(names, dtypes, shapes):
        t = torch.empty([int(x) for x in shape], dtype=_dtype(dt))
        dist.broadcast(t, src=0, group=pg)
        out[name] = t
    return out


async def update(sched: Any, body: dict[str, Any], weight_version: str | None) -> tuple[bool, str]:
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)):
        raise ProtocolError("names, dtypes and shapes must be lists of equal length")
    for dt in dtypes:
        _dtype(dt)
    if not sched.update_session_open:
        return False, ("update_weights_from_distributed must run between begin_weight_update() "
                       "and end_weight_update()")
    group_name = body.get("group_name")
    if sched.dist_group is None or (group_name and group_name != sched.dist_group[0]):
        return False, (f"Group {group_name} is not initialized. "
                       "Please call `init_weights_update_group` first.")
    pg = sched.dist_group[1]
    return await sched.load_named(lambda: _receive(pg, names, dtypes, shapes), weight_version,
                                  bool(body.get("flush_cache", True)), complete=False,
                                  done="Succeeded to update parameter online.")


def destroy(sched: Any) -> None:
    if sched.dist_group is not None:
        try:
            dist.destroy_process_group(sched.dist_group[1])
        except Exception:  # noqa: BLE001 - best effort at shutdown
            pass
        sched.dist_group = None
