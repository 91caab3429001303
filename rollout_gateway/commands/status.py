"""``rollout-gateway status [--url URL]``: the version-lag report of a running gateway as a
table in the terminal (``GET /v1/lag``; ``--json`` prints the report as is)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("ROLLOUT_GATEWAY_URL", DEFAULT_URL),
                   help=f"gateway base URL (env ROLLOUT_GATEWAY_URL; default {DEFAULT_URL})")
    p.add_argument("--json", action="store_true", help="print the /v1/lag JSON as is")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--token", default=os.environ.get("ROLLOUT_GATEWAY_ADMIN_API_KEY"),
                   help="admin token (env ROLLOUT_GATEWAY_ADMIN_API_KEY): also shows the "
                   "answering replica's host")


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [[("-" if c is None else str(c)) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return out


def _dist(d: dict[str, Any]) -> str:
    if not d["tokens"]:
        return "no tokens"
    parts = " ".join(f"{b['lag']}:{b['tokens']}" for b in d["buckets"])
    return f"{d['tokens']} tokens, mean lag {d['mean_lag']:.2f}, max {d['max_lag']}  [lag:tokens {parts}]"


def render(rep: dict[str, Any]) -> str:
    lines = [f"gateway replica {rep['replica'] or '(hidden)'}  "
             f"learner version {rep['learner_version']}  "
             f"max engine lag {rep['max_engine_lag']}  store backlog {rep['store_backlog']}  "
             f"data plane {rep.get('data_plane', '?')}", ""]
    lines += ["version cut: " + "  |  ".join(
        f"v{'?' if c['version'] is None else c['version']} (lag "
        f"{'?' if c['lag'] is None else c['lag']}): " + ", ".join(
            e if e in c["routable"] else f"{e} (out)" for e in c["engines"])
        for c in rep.get("version_cut", [])) or "version cut: no engines"]
    fl = rep.get("fleet")
    if fl is not None:
        last = fl["refits"][0] if fl["refits"] else None
        lines += ["last refit: " + (
            f"{last['swap_id']} v{last['version']} {last['mode']} {last['status']}: " + ", ".join(
                f"{k} {v}" for k, v in last["results"].items())
            if last else "none"),
            f"version policy: {fl['policy_filtered']} filtered, {fl['policy_unroutable']} "
            f"unroutable, {fl['kv_policy_reprefills']} re-prefilled (kept KV refused); "
            f"stale dropped by refits: {fl['stale_published']} published, "
            f"{fl['stale_requeued']} requeued"]
    lines += [""]
    lines += _table(["engine", "state", "version", "lag", "requests"],
                    [[e["id"], e["state"] + (" (fenced)" if e["fenced"] else ""), e["version"],
                      e["lag"], e["outstanding_requests"]] for e in rep["engines"]])
    lines += ["", "tokens by lag (learner version - policy version):"]
    lines += _table(["population", "distribution"],
                    [["in flight", f"{rep['in_flight']['samples']} samples; "
                      + _dist(rep["in_flight"])],
                     ["unconsumed", _dist(rep["unconsumed"])
                      + (" (scan truncated)" if rep["unconsumed"]["truncated"] else "")],
                     ["delivered", _dist(rep["delivered"])]])
    it, st = rep["intra_trajectory"], rep["staleness"]
    lines += ["", f"intra-trajectory: {it['spanning_versions']} of {it['trajectories']} finished "
              f"trajectories span versions (max {it['max_intra_lag']}); "
              f"{it['tokens_after_switch']} tokens after a switch, {it['tokens_on_stale_kv']} "
              "on stale KV",
              f"staleness: {st['tokens_reprefilled']} tokens re-prefilled; at finish dropped/"
              f"masked/recycled {st['at_finish_dropped']}/{st['at_finish_masked']}/"
              f"{st['at_finish_recycled']}; at delivery {st['at_delivery_dropped']}/"
              f"{st['at_delivery_masked']}/{st['at_delivery_recycled']}; dead-lettered "
              f"{st['dead_lettered']}"]
    if rep["pause_windows"]:
        lines += ["", "recent pause windows:"]
        lines += _table(["version", "mode", "engine", "paused at", "seconds"],
                        [[w["version"], w["mode"], w["engine"],
                          time.strftime("%H:%M:%S", time.localtime(w["paused_at"])),
                          "paused" if w["seconds"] is None else f"{w['seconds']:.3f}"]
                         for w in rep["pause_windows"]])
    if rep["groups"]:
        lines += ["", "consumer groups:"]
        lines += _table(["group", "backlog", "pending", "redelivered"],
                        [[g["group"], g["backlog"], g["pending"], g["redelivered"]]
                         for g in rep["groups"]])
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import httpx

    url = args.url.rstrip("/") + "/v1/lag"
    try:
        headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
        r = httpx.get(url, timeout=args.timeout, headers=headers)
    except httpx.HTTPError as exc:
        print(f"rollout-gateway status: cannot reach {url}: {exc}")
        return 1
    if r.status_code != 200:
        print(f"rollout-gateway status: {url} answered {r.status_code}: {r.text[:500]}")
        return 1
    rep = r.json()
    print(json.dumps(rep, indent=2) if args.json else render(rep))
    return 0
