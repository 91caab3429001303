"""Ground truth for the gateway's stamps in front of real SGLang, and the gateway as users run it.

:class:`GatewayServe` starts ``rollout-gateway serve --engine e0=<url> ...`` (the console script of
this virtualenv, this checkout's code) as a process, as docs/gateway.md "In front of real SGLang"
launches it: nothing but the engines and the two ports.

:class:`GroundTruth` decides, from the physics alone (what SGLang returned: the sampled ids and
their logprobs), which weights computed every token and which KV it attended to, then counts
where the gateway's stamps disagree. It never reads the stamps to build the truth:

* Every way a token can have been computed in these tests is a *chain* over the sequence
  ``prompt + output``: positions ``< s`` computed by version ``a`` (their KV and routing), positions
  ``>= s`` by version ``b`` attending to that KV (``s = 0``: all ``b``; ``s = len``: all ``a``). A
  fresh request, an in-place swap at any token (lagged or not), a prefix-cache hit on another
  version's KV (``s`` inside the prompt), a retract or abort_resume re-prefill (a new chain from
  the swap on) and a drain are all chains; every ``s`` is recomputed by the reference model
  (float32, the same weights SGLang loaded).
* Token ``i`` is explained by the chains whose logprob of ``ids[p + i]`` at position ``p + i - 1``
  equals SGLang's to ``tol``; the chain gives its true ``policy_version`` (the weights at that
  position) and ``kv_version`` (the oldest weights among the KV it attended to). A token no chain
  explains, or explained by chains that disagree on the stamps none of which is the stamped one,
  is counted (``unexplained``, ``ambiguous``): the test then cannot vouch for it and fails. A
  token two chains with different stamps explain equally (the same logprob to ``tol`` under
  both versions) is no evidence either way: stamped as one of them, it is noted, not failed.
* Routed-experts row ``j`` is true when it is the routing of the forward that sampled the next
  token from position ``j`` (rows of the prompt: the first prefill's): the routing under which the
  stamped logprob was produced, what routing replay (R3) must reproduce. After a retract SGLang
  returns the re-prefill's rows for the positions before the swap instead (research §4); the
  gateway's own ``stitch_routing`` keeps the first request's rows for a resumed sample, the same
  rule as here.

:class:`Stamped` is one trajectory as a client got it (``/v1/rollouts`` JSON, ``/generate``
``meta_info``, a learner's gRPC ``Rollout``), with the stamps of the stream chunks that led to it.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import httpx
import numpy as np

from reference_engine.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]
CFG = ModelConfig()
LAYERS, TOP_K = CFG.num_hidden_layers, CFG.num_experts_per_tok
#: logprob agreement SGLang (float32) vs the reference model: measured 4e-6..1e-5
TOL = 1e-4

#: mismatch counters every check reports (all must be 0)
KINDS = ("unexplained", "ambiguous", "policy_version", "kv_version", "logprob", "routed_rows",
         "segments", "entropy", "top_logprobs", "input_logprobs", "chunk_stamps")


# ---------------------------------------------------------------------------------------------
# the gateway as a process


def _free_ports(n: int) -> list[int]:
    from rollout_gateway.commands.engine_process import free_ports

    return free_ports(n)


#: gateways started and not stopped yet (their logs go into a failed test's report)
LIVE_GATEWAYS: list[GatewayServe] = []


class GatewayServe:
    """``rollout-gateway serve --engine id=url ... --port P --grpc-port G`` (embedded store and
    registry, every other setting at its default), this checkout's code on ``PYTHONPATH``."""

    def __init__(self, engines: dict[str, str], *, env: dict[str, str] | None = None,
                 log_dir: Path | None = None, name: str = "gateway") -> None:
        self.engines = dict(engines)
        self.port, self.grpc_port = _free_ports(2)
        exe = Path(sys.executable).with_name("rollout-gateway")
        self.args = [str(exe), "serve", "--port", str(self.port),
                     "--grpc-port", str(self.grpc_port)]
        for eid, url in engines.items():
            self.args += ["--engine", f"{eid}={url}"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUT_GATEWAY_")}
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env.update(env or {})
        fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir)
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, n: int = 6000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def start(self, timeout: float = 120.0) -> GatewayServe:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env)
        LIVE_GATEWAYS.append(self)
        deadline = time.monotonic() + timeout
        with httpx.Client(base_url=self.url, timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                try:  # serving, and every engine registered and in rotation
                    if c.get("/health").status_code == 200:
                        got = {e["id"]: e for e in c.get("/v1/engines").json()["engines"]}
                        if set(got) == set(self.engines) and all(
                                e["state"] == "healthy" for e in got.values()):
                            return self
                except httpx.HTTPError:
                    pass
                try:
                    self.proc.wait(0.1)
                except subprocess.TimeoutExpired:
                    pass
        self.stop()
        raise RuntimeError(f"gateway did not come up with {list(self.engines)} healthy:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self in LIVE_GATEWAYS:
            LIVE_GATEWAYS.remove(self)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------
# HTTP helpers (async: streams run while a swap is posted)


async def sse(client: httpx.AsyncClient, path: str, body: dict, on_event=None) -> list[dict]:
    """POST ``body`` with ``stream: true``; the ``data:`` events until ``[DONE]``, each passed
    to ``on_event`` as it arrives."""
    events = []
    async with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code != 200:
            raise AssertionError(f"{path}: HTTP {r.status_code}: {(await r.aread())[:2000]!r}")
        buf = b""
        async for chunk in r.aiter_bytes():
            # SSE lines end at b"\n" only: httpx's aiter_lines also splits at U+0085 / U+2028,
            # which JSON leaves unescaped inside the byte-level model's generated text
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.rstrip(b"\r").decode()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return events
                ev = json.loads(data)
                events.append(ev)
                if on_event is not None:
                    on_event(ev)
    return events


async def post_json(client: httpx.AsyncClient, path: str, body: dict) -> Any:
    r = await client.post(path, json=body)
    assert r.status_code == 200, f"{path}: HTTP {r.status_code}: {r.text[:3000]}"
    return r.json()


class ChunkGate:
    """Counts stream chunks per stream; ``wait(k)`` returns once every stream registered has
    delivered at least ``k`` chunks (an event, not a sleep)."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.streams: set = set()
        self.engine_of: dict = {}  # stream -> the engine of its latest chunk, where known
        self._changed = asyncio.Event()

    def register(self, key) -> None:
        self.streams.add(key)

    def hit(self, key, engine: str | None = None) -> None:
        self.counts[key] += 1
        if engine is not None:
            self.engine_of[key] = engine
        self._changed.set()

    async def _until(self, done, timeout: float, what: str) -> None:
        async def loop():
            while not done():
                self._changed.clear()
                await self._changed.wait()
        try:
            await asyncio.wait_for(loop(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"no {what} within {timeout}s: chunks {dict(self.counts)}, "
                                 f"engines {self.engine_of}") from None

    async def wait(self, k: int, timeout: float = 120.0) -> None:
        await self._until(lambda: all(self.counts[s] >= k for s in self.streams), timeout,
                          f"{k} chunks on every stream")

    async def wait_on(self, engine: str, k: int, timeout: float = 120.0) -> None:
        """Until some stream whose chunks come from ``engine`` has delivered ``k`` (the
        others, on other engines, may not have started: a test that must catch ``engine``
        mid-generation cannot wait for them)."""
        await self._until(lambda: any(self.counts[s] >= k for s, e in self.engine_of.items()
                                      if e == engine), timeout, f"{k} chunks from {engine}")


# ---------------------------------------------------------------------------------------------
# what a client got


@dataclass
class Chunk:
    """Stamped tokens of one stream chunk: output indices ``offset ..``."""

    offset: int
    token_ids: list[int]
    logprobs: list[float]
    policy_version: list[int]
    kv_version: list[int]


@dataclass
class Stamped:
    """One trajectory as delivered (whatever the route), plus the chunks streamed before it."""

    label: str
    prompt: list[int]
    out: list[int]
    logprobs: np.ndarray
    policy_version: np.ndarray
    kv_version: np.ndarray
    segments: list[dict]
    temperature: float = 1.0
    entropy: np.ndarray | None = None
    entropy_bound: float | None = None
    rows: np.ndarray | None = None  # [R, L, K] for positions routed_start ..
    routed_start: int = 0
    #: ``routed_experts_start_len`` the caller asked for: rows before it are not owed
    routed_asked: int = 0
    top: list | None = None  # output_top_logprobs: per token [[lp, id, text], ...]
    input_lp: list | None = None  # input_token_logprobs from input_start
    input_top: list | None = None
    input_start: int = 0
    chunks: list[Chunk] = field(default_factory=list)

    @property
    def p(self) -> int:
        return len(self.prompt)

    @property
    def n(self) -> int:
        return len(self.out)


def _rows_b64(b64: str, dtype: str = "<i4") -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), dtype=np.dtype(dtype)).reshape(-1, LAYERS, TOP_K)


def from_rollout(t: dict, temperature: float, label: str, chunks: list[Chunk] = ()) -> Stamped:
    """A ``/v1/rollouts`` trajectory (JSON)."""
    re_ = t.get("routed_experts")
    return Stamped(
        label=label, prompt=list(t["prompt_token_ids"]), out=list(t["token_ids"]),
        logprobs=np.array([np.nan if x is None else x for x in t["logprobs"]], np.float64),
        policy_version=np.array(t["policy_version"]), kv_version=np.array(t["kv_version"]),
        segments=t["segments"], temperature=temperature,
        entropy=np.array([np.nan if x is None else x for x in t["entropy"]], np.float64),
        entropy_bound=t.get("entropy_error_bound") if t["entropy_kind"] == "topk_estimate"
        else (0.0 if t["entropy_kind"] == "exact" else None),
        rows=None if re_ is None else np.frombuffer(
            base64.b64decode(re_["data_b64"]), dtype=np.dtype(re_["dtype"])).reshape(
            re_["shape"]).astype(np.int64),
        routed_start=0 if re_ is None else re_["start"], chunks=list(chunks))


def rollout_chunks(events: list[dict], sample_index: int) -> list[Chunk]:
    return [Chunk(e["offset"], e["token_ids"], e["logprobs"], e["policy_version"],
                  e["kv_version"]) for e in events
            if e.get("type") == "chunk" and e["sample_index"] == sample_index]


def from_generate(out: dict, prompt: list[int] | None, temperature: float, label: str,
                  chunks: list[Chunk] = (), logprob_start_len: int = -1) -> Stamped:
    """A ``/generate`` answer (SGLang's shape plus the gateway's ``meta_info`` stamps)."""
    m = out["meta_info"]
    ilp = m.get("input_token_logprobs")
    if prompt is None:  # a text prompt: the ids SGLang tokenized, from the input logprobs
        assert logprob_start_len == 0 and ilp is not None
        prompt = [row[1] for row in ilp]
    ent = m.get("output_token_entropy")
    return Stamped(
        label=label, prompt=list(prompt), out=list(out["output_ids"]),
        logprobs=np.array([r[0] for r in m["output_token_logprobs"]], np.float64),
        policy_version=np.array(m["policy_versions"]), kv_version=np.array(m["kv_versions"]),
        segments=m["segments"], temperature=temperature,
        entropy=None if ent is None else np.array(ent, np.float64),
        entropy_bound=m.get("entropy_error_bound") if m.get("entropy_kind") == "topk_estimate"
        else None,
        rows=_rows_b64(m["routed_experts"]).astype(np.int64) if m.get("routed_experts") else None,
        top=m.get("output_top_logprobs"), input_lp=ilp, input_top=m.get("input_top_logprobs"),
        input_start=max(logprob_start_len, 0), chunks=list(chunks))


def generate_chunks(events: list[dict], index: int | None, incremental: bool) -> list[Chunk]:
    """The stamped tokens of every non-final chunk of a ``/generate`` stream (cumulative:
    every chunk restates the whole output; incremental: deltas)."""
    chunks, sofar = [], 0
    for e in events:
        if "error" in e:
            raise AssertionError(f"/generate stream error: {e}")
        if index is not None and e.get("index") != index:
            continue
        m = e["meta_info"]
        ids = list(e["output_ids"])
        lps = [r[0] for r in m["output_token_logprobs"]]
        off = sofar if incremental else 0
        chunks.append(Chunk(off, ids, lps, list(m["policy_versions"]), list(m["kv_versions"])))
        sofar = off + len(ids) if incremental else len(ids)
    return chunks


def from_wire(r, temperature: float, label: str) -> Stamped:
    """A learner's gRPC delivery (``learner_client.wire.Rollout``)."""
    return Stamped(
        label=label, prompt=[int(x) for x in r.prompt_token_ids],
        out=[int(x) for x in r.token_ids], logprobs=np.asarray(r.logprobs, np.float64),
        policy_version=np.asarray(r.policy_version), kv_version=np.asarray(r.kv_version),
        segments=[{"start": s.start, "end": s.end, "policy_version": s.policy_version,
                   "engine_id": s.engine_id, "began": s.began, "ended": s.ended}
                  for s in r.segments],
        temperature=temperature, entropy=np.asarray(r.entropy, np.float64),
        entropy_bound=r.entropy_error_bound if r.entropy_kind == "topk_estimate" else None,
        rows=None if r.routed_experts is None else np.asarray(r.routed_experts, np.int64),
        routed_start=r.routed_start)


# ---------------------------------------------------------------------------------------------
# the truth


@dataclass
class Chain:
    a: int  # weights of positions < s
    b: int  # weights of positions >= s
    s: int
    logits: Any  # torch [T, V]
    topk: np.ndarray  # [T, L, K]

    def stamps(self, pos: int) -> tuple[int, int]:
        """(policy_version, kv_version) of the token sampled from position ``pos``."""
        pv = self.a if pos < self.s else self.b
        kv = self.a if self.s > 0 else self.b
        return pv, kv

    @property
    def name(self) -> str:
        if self.s <= 0:
            return f"all v{self.b}"
        if self.s >= self.logits.shape[0]:
            return f"all v{self.a}"
        return f"v{self.a}<{self.s}<=v{self.b}"


@dataclass
class Report:
    """Mismatch counts of one or more trajectories (``KINDS``), and what was learnt."""

    counts: Counter = field(default_factory=Counter)
    checked: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    #: per trajectory: output index of the first token computed by each version (truth) and
    #: as stamped
    boundaries: list[dict] = field(default_factory=list)

    def add(self, other: Report) -> Report:
        self.counts.update(other.counts)
        self.checked.update(other.checked)
        self.notes += other.notes
        self.boundaries += other.boundaries
        return self

    def miss(self, kind: str, n: int, note: str | None = None) -> None:
        if n:
            self.counts[kind] += int(n)
            if note:
                self.notes.append(note)

    @property
    def total(self) -> int:
        return sum(self.counts[k] for k in KINDS)

    def table(self) -> str:
        lines = [f"{'check':<16}{'checked':>9}{'mismatched':>12}"]
        for k in KINDS:
            lines.append(f"{k:<16}{self.checked[k]:>9}{self.counts[k]:>12}")
        return "\n".join(lines)

    def summary(self, title: str) -> str:
        out = [f"== {title}: {self.total} mismatches", self.table()]
        out += [f"  {b['label']}: first token of each version: true {b['truth']}, stamped "
                f"{b['stamped']} (chains {b['chains']})" for b in self.boundaries]
        out += [f"  ! {n}" for n in self.notes[:40]]
        if len(self.notes) > 40:
            out.append(f"  ... {len(self.notes) - 40} more")
        return "\n".join(out)


def _out_logprobs(logits, p: int, out, temp: float) -> np.ndarray:
    """The logprob of each output token ``out`` (a tensor) under ``logits`` of prompt +
    output (prompt length ``p``), at temperature ``temp``."""
    import torch

    from reference_engine.sampling import scaled_logprobs

    n = out.shape[0]
    logp = scaled_logprobs(logits[p - 1:p + n - 1], torch.full((n,), temp))
    return logp.gather(1, out[:, None])[:, 0].numpy()


class GroundTruth:
    """Recomputation under each version's weights (``model_of(version)``: the reference model
    with that checkpoint; ``sglang_reference``)."""

    def __init__(self, model_of, tol: float = TOL) -> None:
        self.model_of = model_of
        self.tol = tol

    # -- chains ---------------------------------------------------------------------------

    def chains(self, ids: list[int], versions: tuple[int, ...]) -> list[Chain]:
        import torch

        from reference_engine.model import KVCache

        t = torch.tensor(ids, dtype=torch.long)
        T = len(ids)
        out: list[Chain] = []
        fulls = {}
        for v in versions:
            m = self.model_of(str(v))
            cache = KVCache()
            o = m.forward_chunks([t], [cache])
            fulls[v] = (m.logits(o.hidden), o.topk.numpy(), cache)
            out.append(Chain(v, v, T, fulls[v][0], fulls[v][1]))
        for a in versions:  # older weights first, newer after: every switch point
            for b in versions:
                if b <= a:
                    continue
                la, ta, ca = fulls[a]
                mb = self.model_of(str(b))
                starts = list(range(1, T - 1))
                caches = []
                for s in starts:
                    c = KVCache(k=[x[:s].clone() for x in ca.k], v=[x[:s].clone() for x in ca.v],
                                length=s)
                    caches.append(c)
                o = mb.forward_chunks([t[s:] for s in starts], caches)
                lb = mb.logits(o.hidden)
                tb = o.topk.numpy()
                for s, off in zip(starts, o.offsets):
                    n = T - s
                    out.append(Chain(a, b, s, torch.cat((la[:s], lb[off:off + n])),
                                     np.concatenate((ta[:s], tb[off:off + n]))))
        return out

    #: a near tie flips one expert of one position (and perhaps of the layers after it)
    TIE_POSITIONS = 2

    def _near_tie(self, st: Stamped, ids: list[int], chains: list[Chain], diff: np.ndarray,
                  temp: float) -> tuple[Chain, np.ndarray, list[int]] | None:
        """SGLang runs batched, the recomputation alone: floats add in another order, and a
        router whose top-k is a near tie can pick another expert in one of them; the token's
        logprob then differs by ~1e-2 and no chain explains it. That is what happened when
        the recorded routed experts differ from a one-version chain's at no more than
        ``TIE_POSITIONS`` input positions, the first at or before the first unexplained
        token, and replaying the recorded routing under that version reproduces *every*
        stamped logprob: returns (the replay chain, its logprobs, the positions). None
        otherwise (then the tokens stay unexplained)."""
        import torch

        p, n = st.p, st.n
        unexplained = np.flatnonzero(~(diff <= self.tol).any(axis=0))
        if not unexplained.size or st.rows is None or st.routed_start != 0 \
                or st.rows.shape[0] != p + n - 1:
            return None
        best = chains[int(np.argmin(diff[:, unexplained[0]]))]
        if best.a != best.b:
            return None  # a switch inside: not this simple case
        rows = st.rows.astype(np.int64)
        where = np.flatnonzero((rows != best.topk[:p + n - 1]).any(axis=(1, 2)))
        if not where.size or where.size > self.TIE_POSITIONS \
                or where[0] > p - 1 + unexplained[0]:
            return None
        forced = best.topk.copy()
        forced[:p + n - 1] = rows
        m = self.model_of(str(best.b))
        logits, _ = m.forward_full(torch.tensor(ids, dtype=torch.long), torch.as_tensor(forced))
        tie_lp = _out_logprobs(logits, p, torch.tensor(st.out), temp).astype(np.float64)
        if not (np.abs(tie_lp - st.logprobs) <= self.tol).all():
            return None
        return Chain(best.a, best.b, best.s, logits, forced), tie_lp, where.tolist()

    # -- one trajectory ---------------------------------------------------------------------

    def check(self, st: Stamped, versions: tuple[int, ...], *,
              engines: set[str] | None = None,
              began_at_switch: set[str] | None = None) -> Report:
        """Every stamp of ``st`` against the truth; ``versions``: the weight versions the
        engines ran during the test (ascending); ``began_at_switch``: the ``began`` a segment
        may carry where the true version changes (the swap mode)."""
        import torch

        from reference_engine.sampling import entropy_of, scaled_logprobs

        rep = Report()
        p, n = st.p, st.n
        ids = st.prompt + st.out
        tag = st.label
        assert n > 0, f"{tag}: no output"
        chains = self.chains(ids, versions)
        temp = 1.0 if st.temperature == 0 else st.temperature
        pos = np.arange(p - 1, p + n - 1)
        target = torch.tensor(st.out)
        lp = []  # [C, n] logprob of every output token under each chain
        for c in chains:
            lp.append(_out_logprobs(c.logits, p, target, temp))
        lp = np.stack(lp).astype(np.float64)
        diff = np.abs(lp - st.logprobs[None, :])
        tie = self._near_tie(st, ids, chains, diff, temp)
        if tie is not None:  # first: the chain every token is then judged by
            chain, tie_lp, where = tie
            chains.insert(0, chain)
            diff = np.vstack([np.abs(tie_lp - st.logprobs)[None, :], diff])
            rep.notes.append(f"{tag}: routing near tie: the recorded routed experts differ from "
                             f"the recomputation's ({chain.name}) at input positions {where}; "
                             f"replaying them reproduces every stamped logprob")

        true_pv = np.full(n, -1)
        true_kv = np.full(n, -1)
        chosen: list[Chain | None] = [None] * n
        # each chain is a whole-trajectory hypothesis: of the chains that explain a token,
        # the one explaining most of the trajectory judges it (then its routed rows), not
        # the one closest on that token alone: two switch points both on the new weights by
        # then can give a late token the same logprob (to tol) and different routing
        explains = (diff <= self.tol).sum(axis=1)
        for i in range(n):
            ok = np.flatnonzero(diff[:, i] <= self.tol)
            rep.checked["unexplained"] += 1
            rep.checked["ambiguous"] += 1
            if ok.size == 0:
                best = int(np.argmin(diff[:, i]))
                rep.miss("unexplained", 1, f"{tag}: token {i} logprob {st.logprobs[i]:.6f}: no "
                         f"chain explains it (closest {chains[best].name}, off by "
                         f"{diff[best, i]:.2e})")
                continue
            implied = {chains[c].stamps(int(pos[i])) for c in ok}
            stamped = (int(st.policy_version[i]), int(st.kv_version[i]))
            if len(implied) > 1 and stamped in implied:
                # two versions give this token the same logprob (to tol): it is no evidence
                # either way, and the stamps are one of the explanations; noted, not failed
                ok = np.array([c for c in ok if chains[c].stamps(int(pos[i])) == stamped])
                implied = {stamped}
                rep.notes.append(f"{tag}: token {i}: chains {[chains[c].name for c in ok]} "
                                 f"and others explain it equally; stamped {stamped}, one of them")
            if len(implied) > 1:
                rep.miss("ambiguous", 1, f"{tag}: token {i}: chains "
                         f"{[chains[c].name for c in ok]} disagree on its stamps")
                continue
            (true_pv[i], true_kv[i]), = implied
            chosen[i] = chains[int(max(ok, key=lambda c: (explains[c], -diff[c, i])))]
        known = true_pv >= 0

        # policy_version / kv_version / logprob
        rep.checked["policy_version"] += n
        rep.checked["kv_version"] += n
        rep.checked["logprob"] += n
        bad = known & (st.policy_version != true_pv)
        rep.miss("policy_version", bad.sum(), f"{tag}: policy_version stamped "
                 f"{st.policy_version.tolist()} true {true_pv.tolist()}" if bad.any() else None)
        bad = known & (st.kv_version != true_kv)
        rep.miss("kv_version", bad.sum(), f"{tag}: kv_version stamped {st.kv_version.tolist()} "
                 f"true {true_kv.tolist()}" if bad.any() else None)
        # the logprob against recomputation under the *stamped* versions: some chain with
        # the stamped (policy, kv) reproduces it
        nbad = 0
        for i in range(n):
            want = (int(st.policy_version[i]), int(st.kv_version[i]))
            if not any(diff[c, i] <= self.tol and chains[c].stamps(int(pos[i])) == want
                       for c in range(len(chains))):
                nbad += 1
        rep.miss("logprob", nbad, f"{tag}: {nbad} logprobs differ from recomputation under the "
                 f"stamped versions by more than {self.tol:g}" if nbad else None)
        first_new = {}
        for v in versions:
            hit_t = np.flatnonzero(true_pv == v)
            hit_s = np.flatnonzero(st.policy_version == v)
            if hit_t.size or hit_s.size:
                first_new[v] = (int(hit_t[0]) if hit_t.size else None,
                                int(hit_s[0]) if hit_s.size else None)
        rep.boundaries.append({"label": tag, "versions": len(set(true_pv[known].tolist())),
                               "truth": {v: t for v, (t, _) in first_new.items()},
                               "stamped": {v: s for v, (_, s) in first_new.items()},
                               "chains": sorted({c.name for c in chosen if c is not None})})

        # routed experts: row j = the routing of the forward that sampled from position j
        if st.rows is not None and all(c is not None for c in chosen):
            want_rows = np.empty((p + n - 1, LAYERS, TOP_K), np.int64)
            want_rows[:p - 1] = chosen[0].topk[:p - 1]
            for i in range(n):
                want_rows[p - 1 + i] = chosen[i].topk[p - 1 + i]
            got = st.rows
            lo = st.routed_start
            rep.checked["routed_rows"] += want_rows.shape[0] - st.routed_asked
            if got.shape[0] + lo != want_rows.shape[0] or lo != st.routed_asked:
                rep.miss("routed_rows", want_rows.shape[0], f"{tag}: routed_experts rows "
                         f"{lo}..{lo + got.shape[0]} for {want_rows.shape[0]} positions")
            else:
                # which experts ran, not their rank: a near tie of two selected experts'
                # router scores can order them either way, and the layer's output is the same
                got_set, want_set = np.sort(got, axis=-1), np.sort(want_rows[lo:], axis=-1)
                rowbad = np.flatnonzero((got_set != want_set).any(axis=(1, 2))) + lo
                whose = [c.name for c in chains if rowbad.size and np.array_equal(
                    got_set[rowbad - lo], np.sort(c.topk[rowbad], axis=-1))]
                rep.miss("routed_rows", rowbad.size,
                         f"{tag}: routed rows differ from the sampling forward's at positions "
                         f"{rowbad.tolist()} (prompt {p}, output {n}); they are the rows of "
                         f"{whose or 'no chain'}" if rowbad.size else None)
        elif st.rows is None:
            rep.miss("routed_rows", 1, f"{tag}: no routed_experts")

        # segments: tile the output in order, one true version each, a boundary wherever the
        # true version changes, the swap's transition there
        rep.checked["segments"] += len(st.segments)
        segs = st.segments
        seg_bad = []
        if not segs or segs[0]["start"] != 0 or segs[-1]["end"] != n:
            seg_bad.append(f"do not cover 0..{n}")
        for x, y in itertools.pairwise(segs):
            if x["end"] != y["start"]:
                seg_bad.append(f"gap/overlap {x['end']}->{y['start']}")
            if x.get("ended") != y.get("began"):
                seg_bad.append(f"ended {x.get('ended')} != next began {y.get('began')}")
        if segs and segs[0].get("began") != "start":
            seg_bad.append(f"first began {segs[0].get('began')}")
        cuts = {s["start"] for s in segs}
        for s in segs:
            rng = slice(s["start"], s["end"])
            if (st.policy_version[rng] != s["policy_version"]).any():
                seg_bad.append(f"segment {s['start']}..{s['end']} v{s['policy_version']} "
                               f"disagrees with its policy_version column")
            tv = set(true_pv[rng][known[rng]].tolist())
            if tv - {s["policy_version"]}:
                seg_bad.append(f"segment {s['start']}..{s['end']} v{s['policy_version']} holds "
                               f"tokens of v{sorted(tv)}")
            if engines is not None and s.get("engine_id") not in engines:
                seg_bad.append(f"segment engine {s.get('engine_id')}")
        for i in range(1, n):
            if known[i] and known[i - 1] and true_pv[i] != true_pv[i - 1]:
                if i not in cuts:
                    seg_bad.append(f"no segment boundary at the true switch {i}")
                elif began_at_switch is not None:
                    s = next(s for s in segs if s["start"] == i)
                    if s.get("began") not in began_at_switch:
                        seg_bad.append(f"segment at {i} began {s.get('began')}, "
                                       f"expected {sorted(began_at_switch)}")
        rep.miss("segments", len(seg_bad), f"{tag}: segments {seg_bad}: "
                 f"{[(s['start'], s['end'], s['policy_version'], s.get('began')) for s in segs]}"
                 if seg_bad else None)

        # entropy (estimate within its bound), top-k rows, input logprobs
        if st.entropy is not None and st.entropy_bound is not None and len(st.entropy) != n:
            rep.checked["entropy"] += n
            rep.miss("entropy", abs(n - len(st.entropy)) or n,
                     f"{tag}: {len(st.entropy)} entropies for {n} tokens")
        elif st.entropy is not None and st.entropy_bound is not None:
            rep.checked["entropy"] += int(known.sum())
            nb = 0
            for i in np.flatnonzero(known):
                c = chosen[i]
                logp = scaled_logprobs(c.logits[pos[i]][None], torch.full((1,), temp))
                exact = float(entropy_of(logp)[0])
                if not abs(st.entropy[i] - exact) <= st.entropy_bound + self.tol:
                    nb += 1
            rep.miss("entropy", nb, f"{tag}: {nb} entropies outside the stated bound" if nb
                     else None)
        if st.top is not None and len(st.top) != n:
            rep.checked["top_logprobs"] += n
            rep.miss("top_logprobs", abs(n - len(st.top)) or n,
                     f"{tag}: {len(st.top)} output_top_logprobs rows for {n} tokens")
        elif st.top is not None:
            rep.checked["top_logprobs"] += n
            nb = 0
            for i in np.flatnonzero(known):
                c = chosen[i]
                row = scaled_logprobs(c.logits[pos[i]][None], torch.full((1,), temp))[0].numpy()
                top = st.top[i]
                vals = np.array([e[0] for e in top])
                want = np.sort(row)[::-1][:len(top)]
                at = np.array([row[e[1]] for e in top])
                if not top or np.abs(vals - want).max() > self.tol or \
                        np.abs(vals - at).max() > self.tol:
                    nb += 1
            nb += int((~known).sum())
            rep.miss("top_logprobs", nb, f"{tag}: {nb} output_top_logprobs rows wrong" if nb
                     else None)
        if st.input_lp is not None:
            c = chosen[0]
            nb = 0
            if c is None:
                nb = len(st.input_lp)
            else:
                row1 = scaled_logprobs(c.logits[:p], torch.ones(p)).numpy()  # T = 1 (SGLang)
                k0 = st.input_start
                rows = st.input_lp
                rep.checked["input_logprobs"] += len(rows)
                if len(rows) != p - k0:
                    nb += abs(p - k0 - len(rows)) or 1
                for k, r in enumerate(rows):
                    j = k0 + k
                    if r[1] != ids[j]:
                        nb += 1
                    elif k == 0:
                        nb += r[0] is not None
                    elif abs(r[0] - row1[j - 1][ids[j]]) > self.tol:
                        nb += 1
                if st.input_top is not None:
                    for k, top in enumerate(st.input_top):
                        j = k0 + k
                        if k == 0:
                            nb += top is not None
                            continue
                        vals = np.array([e[0] for e in top])
                        want = np.sort(row1[j - 1])[::-1][:len(top)]
                        at = np.array([row1[j - 1][e[1]] for e in top])
                        if np.abs(vals - want).max() > self.tol or \
                                np.abs(vals - at).max() > self.tol:
                            nb += 1
            rep.miss("input_logprobs", nb, f"{tag}: {nb} input logprob rows wrong" if nb
                     else None)

        # stream chunks: the same tokens and logprobs as the final answer, true stamps
        if st.chunks:
            nb, seen, why, example = 0, 0, Counter(), None
            # SGLang labels a streamed chunk with its tokenizer manager's version when it
            # emits it (tokenizer_manager.py), not with the weights that computed it: a
            # request the scheduler finished under v before an in-place swap to v' whose
            # last chunks reach the tokenizer manager after the swap (a loaded machine) has
            # them labelled v'. Only the final chunk's spans are the scheduler's; the final
            # stamps are checked above. Accepted here, counted, only in that case: every
            # known token and every final stamp of the request on one version older than
            # the chunk's label (docs/gateway.md, "In front of real SGLang").
            on = set(true_pv[known].tolist())
            finished_on = on.pop() if len(on) == 1 else None
            if finished_on is not None and (st.policy_version != finished_on).any():
                finished_on = None
            late = 0
            for ch in st.chunks:
                for k, tok in enumerate(ch.token_ids):
                    i = ch.offset + k
                    seen += 1
                    wrong = []
                    if i >= n or tok != st.out[i]:
                        wrong.append("token")
                    elif abs(ch.logprobs[k] - st.logprobs[i]) > self.tol:
                        wrong.append("logprob")
                    elif known[i]:
                        if finished_on is not None and ch.policy_version[k] > finished_on:
                            late += 1
                        elif ch.policy_version[k] != true_pv[i]:
                            wrong.append("policy_version")
                        if ch.kv_version[k] != true_kv[i]:
                            wrong.append("kv_version")
                    if wrong:
                        nb += 1
                        why.update(wrong)
                        if example is None:
                            example = (f"chunk at {ch.offset}: pv {ch.policy_version} kv "
                                       f"{ch.kv_version}; true pv "
                                       f"{true_pv[ch.offset:ch.offset + len(ch.token_ids)].tolist()}"
                                       f" kv {true_kv[ch.offset:ch.offset + len(ch.token_ids)].tolist()}")
            if late:
                rep.notes.append(f"{tag}: {late}/{seen} streamed chunk tokens labelled after an "
                                 f"in-place swap although the request finished on "
                                 f"v{finished_on} (emission-time labels; final stamps exact)")
            rep.checked["chunk_stamps"] += seen
            rep.miss("chunk_stamps", nb, f"{tag}: {nb}/{seen} streamed chunk tokens wrong "
                     f"({dict(why)}), first: {example}" if nb else None)
        return rep

    def check_all(self, items: list[Stamped], versions: tuple[int, ...], **kw) -> Report:
        rep = Report()
        for st in items:
            rep.add(self.check(st, versions, **kw))
        return rep
