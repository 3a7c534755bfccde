# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect` and `--keys`: what a cache directory holds, as a JSON-ready
document (docs/inspect-json.md): engines, namespaces, blocks, bytes, ages;
or every key, least recently used first.

Threading: one thread (the CLI's), over a Store opened read-only (opening.py).
"""

from __future__ import annotations

import datetime
import os
import time

import numpy as np

from aiokv.cli.opening import SCHEMA
from aiokv.data import format as fmt
from aiokv.data.slotfile import data_path
from aiokv.store.lock import engines
from aiokv.store.store import Store, ns_dir
from aiokv.store.table import PINNED
from aiokv.store.wear import read_all

AGE_WINDOWS = (("hour", 3600), ("day", 86400), ("week", 7 * 86400))


def iso(ns_time: int | None) -> str | None:
    if not ns_time:
        return None
    dt = datetime.datetime.fromtimestamp(ns_time / 1e9, tz=datetime.timezone.utc)
    return dt.isoformat(timespec="seconds").replace("+00:00", "Z")


def _disk_bytes(root: str, ns, engine: int) -> int:
    total = 0
    for rank in range(ns.ranks):
        try:
            total += os.stat(data_path(ns_dir(root, ns.nsid), rank, engine)).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def _ages(atimes, now_ns: int) -> dict:
    """How recently the blocks were last used (loaded or saved): the index keeps one
    access time per block, not a hit count. atimes: a numpy array (ns)."""
    ages = np.sort((now_ns - atimes.astype(np.int64)) / 1e9)
    out = {f"used_last_{name}": int(np.searchsorted(ages, s, side="right")) for name, s in AGE_WINDOWS}
    out["median_age_seconds"] = round(float(ages[len(ages) // 2]), 3) if len(ages) else None
    return out


def _tenants(st: Store, ns, into: dict) -> list[dict]:
    """Blocks, bytes and pinned blocks per tenant of a namespace (every engine's), largest
    first; added into `into` (tenant id -> the directory's row)."""
    rows: dict[int, dict] = {}
    for t in ns.tables.values():
        live = t.live()
        tids, n = np.unique(t.tenant[live], return_counts=True)
        pinned = dict(zip(*np.unique(t.tenant[live][(t.flags[live] & PINNED) != 0], return_counts=True)))
        for tid, c in zip(tids.tolist(), n.tolist()):
            for d in (rows, into):
                r = d.setdefault(tid, _tenant_row(st, tid))
                r["blocks"] += c
                r["bytes"] += c * ns.slot_bytes * ns.ranks
                r["pinned_blocks"] += int(pinned.get(tid, 0))
    return sorted(rows.values(), key=lambda r: (-r["bytes"], r["tenant"]))


def _tenant_row(st: Store, tid: int) -> dict:
    tag = st.tenants.tag_of(tid)
    return {
        "tenant": st.tenants.label(tid),
        "tag": (tag or fmt.NO_TENANT).hex(),
        "blocks": 0,
        "bytes": 0,
        "pinned_blocks": 0,
    }


def summary(st: Store) -> dict:
    root = st.root
    lives = engines(root)
    now = time.time_ns()
    out_ns = []
    per_tenant: dict[int, dict] = {}
    per_engine: dict[int, dict] = {
        e: {"engine": e, "pid": pid, "running": pid is not None, "blocks": 0, "bytes": 0, "disk_bytes": 0}
        for e, pid in lives.items()
    }
    for nsid, ns in sorted(st.index.namespaces.items()):
        tables = [ns.tables[e] for e in sorted(ns.tables)]
        atimes = np.concatenate([t.atime[t.live()] for t in tables]) if tables else np.zeros(0, np.uint64)
        atimes = atimes[atimes != 0]
        held = {e: t.count for e, t in sorted(ns.tables.items())}
        blocks = sum(held.values())
        journals = {}
        disk = 0
        for (n, e), fl in sorted(st.followers.items()):
            if n != nsid:
                continue
            ed = _disk_bytes(root, ns, e)
            disk += ed
            pe = per_engine.setdefault(
                e, {"engine": e, "pid": None, "running": False, "blocks": 0, "bytes": 0, "disk_bytes": 0}
            )
            pe["blocks"] += held.get(e, 0)
            pe["bytes"] += held.get(e, 0) * ns.slot_bytes * ns.ranks
            pe["disk_bytes"] += ed
            journals[str(e)] = {
                "generation": fl.gen,
                "records": fl.records,
                "torn_bytes": fl.log.torn_bytes if fl.log else 0,
            }
        out_ns.append(
            {
                "nsid": ns.hex,
                "fields": ns.fields,
                "blocks": blocks,
                "keys": len(ns.entries),  # blocks (a block two engines hold counts twice)
                "engines": {str(e): n for e, n in held.items()},
                "bytes": blocks * ns.slot_bytes * ns.ranks,
                "payload_bytes": ns.payload_bytes,
                "slot_bytes": ns.slot_bytes,
                "ranks": ns.ranks,
                "disk_bytes": disk,
                "oldest_access": iso(int(atimes.min())) if len(atimes) else None,
                "newest_access": iso(int(atimes.max())) if len(atimes) else None,
                "access": _ages(atimes, now),
                "journals": journals,
                "tenants": _tenants(st, ns, per_tenant),
            }
        )
    running = [e["pid"] for e in per_engine.values() if e["running"]]
    return {
        "schema": SCHEMA,
        "root": root,
        "format": fmt.FORMAT_VERSION,
        # pid of the lowest-numbered running engine (None: none runs); every engine is in "engines"
        "owner_pid": running[0] if running else None,
        "engines": [per_engine[e] for e in sorted(per_engine)],
        # The capacity is the engine's setting, not recorded in the directory.
        "capacity_bytes": st.capacity,
        # bytes the engines committed since the directory's first use, and what that is in drive writes per day
        "wear": read_all(st.dirs.root_fd, st.dirs.fs_bytes),
        "namespaces": out_ns,
        # per tenant (a request's cache_salt; "" for none; "#<tag>" where named under a secret)
        "tenants": sorted(per_tenant.values(), key=lambda r: (-r["bytes"], r["tenant"])),
        "total": {
            "namespaces": len(out_ns),
            "blocks": sum(n["blocks"] for n in out_ns),
            "bytes": sum(n["bytes"] for n in out_ns),
            "disk_bytes": sum(n["disk_bytes"] for n in out_ns),
        },
    }


def keys(st: Store) -> dict:
    out = []
    for _nsid, ns in sorted(st.index.namespaces.items()):
        items = sorted(((a, k, e, s) for e, d in ns.peers.items() for k, (s, a) in d.items()))
        out.append(
            {
                "nsid": ns.hex,
                "keys": [
                    {
                        "key": k.hex(),
                        "engine": e,
                        "slot": s,
                        "bytes": ns.slot_bytes * ns.ranks,
                        "payload_bytes": ns.payload_bytes * ns.ranks,
                        "last_access": iso(a),
                    }
                    for a, k, e, s in items
                ],
            }
        )
    return {"schema": SCHEMA, "root": st.root, "order": "least recently used first", "namespaces": out}
