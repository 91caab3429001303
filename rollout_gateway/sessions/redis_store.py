"""The session store on Redis: shared by every gateway replica on the same store.

Keys (all named by :class:`RedisKeys`, through the store's key layout, under its prefix):
per session a hash (head, lock owner and lease) and a list (the current branch's records,
framed by :mod:`rollout_gateway.sessions.records`) sharing one hash tag, so each session's
scripts touch one slot; the ended marker (its own key, with a TTL); per tenant a sorted set of
open sessions by last activity (the idle sweeper's index and the per-tenant count). Held
trajectories are the trajectory codec's bytes under their id, indexed by deadline.

A turn costs two round trips: :meth:`claim` (lock + the records this replica has not
seen: none when it served the previous turn) and :meth:`commit` (append the turn's records,
store the head, unlock, bump the idle index), each one script plus index updates
pipelined with it.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError

from rollout_gateway.core import trajectory_codec
from rollout_gateway.sessions import records as rec_codec
from rollout_gateway.sessions.store import Claim, Head, Key, SessionStore
from rollout_gateway.store.keys import KeyLayout
from rollout_gateway.store.redis_client import redis_failures

# KEYS: head, records, ended, outbox; ARGV: now_ms, owner, lease_ms, have_epoch, have_n
_CLAIM = """
local how = redis.call('GET', KEYS[3])
if how then return {'ended', how} end
if redis.call('EXISTS', KEYS[1]) == 0 then return {'absent'} end
local now = tonumber(ARGV[1])
local untl = tonumber(redis.call('HGET', KEYS[1], 'until') or '0')
if untl > now then return {'busy', tostring(untl - now)} end
redis.call('HSET', KEYS[1], 'owner', ARGV[2], 'until', tostring(now + tonumber(ARGV[3])))
local head = redis.call('HGET', KEYS[1], 'head')
local since = 0
if tonumber(redis.call('HGET', KEYS[1], 'epoch')) == tonumber(ARGV[4]) then
  since = tonumber(ARGV[5])
  if since > redis.call('LLEN', KEYS[2]) then since = 0 end
end
return {'ok', head, tostring(since), redis.call('LRANGE', KEYS[2], since, -1),
        redis.call('HVALS', KEYS[4])}
"""

# KEYS: head, ended; ARGV: now_ms, owner, lease_ms, head, epoch
_CREATE = """
local how = redis.call('GET', KEYS[2])
if how then return 'ended' end
if redis.call('EXISTS', KEYS[1]) == 1 then return 'busy' end
redis.call('HSET', KEYS[1], 'head', ARGV[4], 'epoch', ARGV[5], 'owner', ARGV[2],
           'until', tostring(tonumber(ARGV[1]) + tonumber(ARGV[3])))
return 'ok'
"""

# KEYS: head, records, outbox; ARGV: owner, head, epoch, reset, outbox id ('' none),
# outbox bytes, records...
_COMMIT = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[5] ~= '' then redis.call('HSET', KEYS[3], ARGV[5], ARGV[6]) end
if ARGV[4] == '1' then redis.call('DEL', KEYS[2]) end
for i = 7, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HSET', KEYS[1], 'head', ARGV[2], 'epoch', ARGV[3], 'owner', '', 'until', '0')
return 1
"""

# KEYS: head; ARGV: owner, until_ms ('0': release)
_LEASE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then redis.call('HSET', KEYS[1], 'owner', '', 'until', '0')
else redis.call('HSET', KEYS[1], 'until', ARGV[2]) end
return 1
"""

# KEYS: head, records, ended; ARGV: owner, how ('': forget only), remember_s
_FINISH = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
if ARGV[2] ~= '' then redis.call('SET', KEYS[3], ARGV[2], 'EX', ARGV[3]) end
return 1
"""


# KEYS: open index; ARGV: session id, before_ms
_PRUNE = """
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) < tonumber(ARGV[2]) then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


# KEYS: claim; ARGV: owner, ttl_ms ('0': release)
_REQUEST = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if ARGV[2] == '0' then return redis.call('DEL', KEYS[1]) end
return redis.call('PEXPIRE', KEYS[1], ARGV[2])
"""


class RedisKeys:
    """Every Redis key of the session store, named through the store's
    :class:`~rollout_gateway.store.keys.KeyLayout` (one session's keys share a hash tag:
    one slot of a Redis Cluster; different sessions spread over the cluster)."""

    def __init__(self, layout: KeyLayout) -> None:
        self.layout = layout

    def session(self, key: Key) -> tuple[str, str, str]:
        """(head hash, records list, ended marker) of one session."""
        tag = f"session/{key[0]}/{key[1]}"
        return (self.layout.tagged(tag, "h"), self.layout.tagged(tag, "r"),
                self.layout.tagged(tag, "e"))

    def outbox(self, key: Key) -> str:
        """Finished branches of one session waiting to be in the trajectory store."""
        return self.layout.tagged(f"session/{key[0]}/{key[1]}", "o")

    def open(self, tenant: str) -> str:
        """Open sessions of a tenant, by last activity (ms)."""
        return self.layout.tagged(f"sessions/{tenant}", "open")

    def tenants(self) -> str:
        """Tenants that have opened sessions."""
        return self.layout.key("sessions:tenants")

    def ids(self, session_id: str) -> str:
        """Tenants with a session of this id (the admin's lookup)."""
        return self.layout.tagged(f"sid/{session_id}", "tenants")

    def held(self, tid: str) -> str:
        return self.layout.tagged(f"held/{tid}", "held")

    def held_index(self) -> str:
        return self.layout.key("sessions:held")

    def published(self, tid: str) -> str:
        return self.layout.tagged(f"published/{tid}", "published")

    def request(self, rid: str) -> str:
        """The lease of a request_id being run (one run across replicas)."""
        return self.layout.tagged(f"running/{rid}", "running")

    def sweep(self) -> str:
        return self.layout.key("sessions:sweep")


def _ms(t: float) -> int:
    return int(t * 1000)


class RedisSessionStore(SessionStore):
    shared = True

    def __init__(self, client: aioredis.Redis, layout: KeyLayout, clock=time.time) -> None:
        self.r = client
        self.k = RedisKeys(layout)
        self.cluster = layout.cluster
        self.clock = clock
        self._claim = client.register_script(_CLAIM)
        self._create = client.register_script(_CREATE)
        self._commit = client.register_script(_COMMIT)
        self._lease = client.register_script(_LEASE)
        self._finish = client.register_script(_FINISH)
        self._prune = client.register_script(_PRUNE)
        self._request = client.register_script(_REQUEST)

    @asynccontextmanager
    async def _io(self, what: str):
        async with redis_failures(f"redis session {what} failed"):
            yield

    async def claim(self, key, owner, lease_s, have):
        b, n = have if have is not None else (-1, 0)
        async with self._io("claim"):
            got = await self._claim(keys=[*self.k.session(key), self.k.outbox(key)],
                                    args=[_ms(self.clock()), owner, _ms(lease_s), b, n])
        status = got[0].decode()
        if status == "ended":
            return Claim("ended", ended_by=got[1].decode())
        if status == "absent":
            return Claim("absent")
        if status == "busy":
            return Claim("busy", retry_after=int(got[1]) / 1000)
        since = int(got[2])
        return Claim("ok", Head.loads(got[1]), [rec_codec.decode(x) for x in got[3]], since,
                     outbox=[trajectory_codec.decode(x) for x in got[4]])

    async def create(self, head, owner, lease_s, max_total, max_per_tenant):
        key = (head.tenant, head.session_id)
        h, _, e = self.k.session(key)
        zkey, sid = self.k.open(head.tenant), head.session_id
        async with self._io("create"):
            async with self.r.pipeline(transaction=False) as p:
                # the score now (not NX): a sweeper never takes it for an idle leftover
                p.zadd(zkey, {sid: _ms(head.last_active)})
                p.sadd(self.k.tenants(), head.tenant)
                p.zcard(zkey)
                added, _, mine = await p.execute()
            if added and mine > max_per_tenant:
                await self.r.zrem(zkey, sid)
                return "tenant_full"
            if added and sum((await self.open_counts()).values()) > max_total:
                await self.r.zrem(zkey, sid)
                return "full"
            got = (await self._create(keys=[h, e], args=[
                _ms(self.clock()), owner, _ms(lease_s), head.dumps(), head.branches])).decode()
            if got == "ended" and added:
                await self.r.zrem(zkey, sid)
            if got == "ok":
                async with self.r.pipeline(transaction=False) as p:
                    p.sadd(self.k.ids(sid), head.tenant)
                    p.expire(self.k.ids(sid), 7 * 86400)
                    await p.execute()
            return got

    async def _pipelined(self, calls: list[tuple[object, list, list]], extra=None) -> list:
        """Scripts (by sha) and ``extra`` commands in one pipeline: one round trip (redis-py
        adds a SCRIPT EXISTS round trip to every pipeline that names a Script object); a
        script Redis lost (restarted) is loaded again and the pipeline sent again. Redis
        Cluster (redis-py runs no script in a cluster pipeline): each script on its own,
        then ``extra`` pipelined."""
        if self.cluster:
            out = [await script(keys=keys, args=args) for script, keys, args in calls]
            if extra is not None:
                async with self.r.pipeline(transaction=False) as p:
                    extra(p)
                    out += await p.execute()
            return out
        for attempt in (0, 1):
            try:
                async with self.r.pipeline(transaction=False) as p:
                    for script, keys, args in calls:
                        p.evalsha(script.sha, len(keys), *keys, *args)
                    if extra is not None:
                        extra(p)
                    return await p.execute()
            except NoScriptError:
                if attempt:
                    raise
                for script in {c[0] for c in calls}:
                    await self.r.script_load(script.script)
        raise AssertionError("unreachable")

    async def commit(self, key, owner, head, records, reset, outbox=None):
        h, r, _ = self.k.session(key)
        data = [rec_codec.encode(x) for x in records]
        out = [outbox.trajectory_id, trajectory_codec.encode(outbox)] if outbox else ["", ""]
        async with self._io("commit"):
            ok, _ = await self._pipelined(
                [(self._commit, [h, r, self.k.outbox(key)],
                  [owner, head.dumps(), head.branches, "1" if reset else "0", *out, *data])],
                lambda p: p.zadd(self.k.open(key[0]), {key[1]: _ms(head.last_active)}, xx=True))
        return bool(ok)

    async def clear_outbox(self, key, trajectory_id):
        async with self._io("outbox"):
            await self.r.hdel(self.k.outbox(key), trajectory_id)

    async def release(self, key, owner):
        async with self._io("release"):
            await self._lease(keys=[self.k.session(key)[0]], args=[owner, "0"])

    async def renew(self, locks, lease_s):
        if not locks:
            return
        until = str(_ms(self.clock() + lease_s))
        async with self._io("renew"):
            await self._pipelined([(self._lease, [self.k.session(key)[0]], [owner, until])
                                   for key, owner in locks.items()])

    async def _forget(self, key, owner, how, remember_s) -> bool:
        async with self._io("end"):
            ok = await self._finish(keys=list(self.k.session(key)),
                                    args=[owner, how, max(1, int(remember_s))])
            if ok:
                await self.r.zrem(self.k.open(key[0]), key[1])
        return bool(ok)

    async def finish(self, key, owner, how, remember_s):
        return await self._forget(key, owner, how, remember_s)

    async def drop(self, key, owner):
        await self._forget(key, owner, "", 1)

    async def prune(self, key, before):
        async with self._io("prune"):
            await self._prune(keys=[self.k.open(key[0])], args=[key[1], _ms(before)])

    async def idle(self, before, limit):
        out: list[tuple[float, Key]] = []
        async with self._io("idle scan"):
            for t in sorted(x.decode() for x in await self.r.smembers(self.k.tenants())):
                got = await self.r.zrangebyscore(self.k.open(t), 0, _ms(before), start=0,
                                                 num=limit, withscores=True)
                out += [(score, (t, sid.decode())) for sid, score in got]
        return [k for _, k in sorted(out)[:limit]]

    async def open_counts(self):
        async with self._io("count"):
            tenants = sorted(x.decode() for x in await self.r.smembers(self.k.tenants()))
            if not tenants:
                return {}
            async with self.r.pipeline(transaction=False) as p:
                for t in tenants:
                    p.zcard(self.k.open(t))
                counts = await p.execute()
        return {t: n for t, n in zip(tenants, counts, strict=True) if n}

    async def tenants_of(self, session_id):
        async with self._io("lookup"):
            tenants = sorted(x.decode() for x in await self.r.smembers(self.k.ids(session_id)))
            async with self.r.pipeline(transaction=False) as p:
                for t in tenants:
                    p.exists(self.k.session((t, session_id))[0])
                    p.exists(self.k.session((t, session_id))[2])
                got = await p.execute()
        live = [t for i, t in enumerate(tenants) if got[2 * i]]
        return live or [t for i, t in enumerate(tenants) if got[2 * i + 1]]

    async def ended_by(self, key):
        async with self._io("lookup"):
            v = await self.r.get(self.k.session(key)[2])
        return v.decode() if v is not None else None

    async def hold(self, traj, deadline):
        tid = traj.trajectory_id
        async with self._io("hold"):
            async with self.r.pipeline(transaction=False) as p:
                p.set(self.k.held(tid), trajectory_codec.encode(traj))
                p.zadd(self.k.held_index(), {tid: deadline})
                await p.execute()

    async def held(self, trajectory_id):
        async with self._io("held"):
            data = await self.r.get(self.k.held(trajectory_id))
        return trajectory_codec.decode(data) if data is not None else None

    async def unhold(self, trajectory_id):
        async with self._io("unhold"):
            async with self.r.pipeline(transaction=False) as p:
                p.delete(self.k.held(trajectory_id))
                p.zrem(self.k.held_index(), trajectory_id)
                await p.execute()

    async def due(self, now, limit):
        async with self._io("held scan"):
            got = await self.r.zrangebyscore(self.k.held_index(), 0, now, start=0, num=limit)
        return [x.decode() for x in got]

    async def held_count(self):
        async with self._io("count"):
            return int(await self.r.zcard(self.k.held_index()))

    async def mark_published(self, trajectory_id, tenant, remember_s):
        async with self._io("mark"):
            await self.r.set(self.k.published(trajectory_id), tenant, ex=max(1, int(remember_s)))

    async def published_tenant(self, trajectory_id):
        async with self._io("lookup"):
            v = await self.r.get(self.k.published(trajectory_id))
        return v.decode() if v is not None else None

    async def sweep_lease(self, owner, ttl):
        async with self._io("sweep lease"):
            return bool(await self.r.set(self.k.sweep(), owner, nx=True, px=max(1, _ms(ttl))))

    async def claim_request(self, rid, owner, ttl):
        async with self._io("request claim"):
            return bool(await self.r.set(self.k.request(rid), owner, nx=True,
                                          px=max(1, _ms(ttl))))

    async def renew_request(self, rid, owner, ttl):
        async with self._io("request claim"):
            return bool(await self._request(keys=[self.k.request(rid)],
                                            args=[owner, max(1, _ms(ttl))]))

    async def release_request(self, rid, owner):
        async with self._io("request claim"):
            await self._request(keys=[self.k.request(rid)], args=[owner, "0"])
