# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`: what a cache directory holds, as a JSON-ready document
(docs/inspect-json.md): engines, namespaces, blocks, bytes, ages. Every figure is
counted a slot range of the replayed index at a time (no array of all blocks beside
the index, no Python object per block).

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
CHUNK = 1 << 20  # slots looked at a time
COLLECT = 1 << 20  # access times kept at once to pick the median from


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


def _atimes(tables):
    """The access times of the tables' blocks, a slot range at a time (0, never used: left out)."""
    for t in tables:
        for lo in range(0, len(t.tag), CHUNK):
            a = t.atime[lo : lo + CHUNK][t.tag[lo : lo + CHUNK] != 0]
            a = a[a != 0]
            if len(a):
                yield a


def _access(tables, now_ns: int) -> tuple[dict, int | None, int | None]:
    """How recently the blocks were last used (loaded or saved), and the oldest and newest
    access: the index keeps one access time per block, not a hit count."""
    n, lo, hi, within = 0, None, None, [0] * len(AGE_WINDOWS)
    for a in _atimes(tables):
        n += len(a)
        lo = int(a.min()) if lo is None else min(lo, int(a.min()))
        hi = int(a.max()) if hi is None else max(hi, int(a.max()))
        age = np.int64(now_ns) - a.astype(np.int64)
        for i, (_, s) in enumerate(AGE_WINDOWS):
            within[i] += int(np.count_nonzero(age <= s * 10**9))
    out = {f"used_last_{name}": within[i] for i, (name, _) in enumerate(AGE_WINDOWS)}
    # the median age: ages ascending, the one at n // 2 (the access time of rank n - 1 - n // 2)
    out["median_age_seconds"] = round((now_ns - _kth(tables, n - 1 - n // 2, n, lo, hi)) / 1e9, 3) if n else None
    return out, lo, hi


def _kth(tables, k: int, n: int, lo: int, hi: int) -> int:
    """The k-th smallest (from 0) of the n access times of the tables' blocks, all in [lo, hi]:
    counted in at most 65,536 ranges a pass over them, until the range holding it holds few
    enough to keep (memory: one slot range and those few)."""
    while n > COLLECT:
        shift = max(0, (hi - lo).bit_length() - 16)
        counts = np.zeros(((hi - lo) >> shift) + 1, np.int64)
        for a in _atimes(tables):
            a = a[(a >= lo) & (a <= hi)]
            counts += np.bincount(((a - np.uint64(lo)) >> np.uint64(shift)).astype(np.intp), minlength=len(counts))
        upto = np.cumsum(counts)
        b = int(np.searchsorted(upto, k, side="right"))
        k -= int(upto[b - 1]) if b else 0
        n = int(counts[b])
        lo, hi = lo + (b << shift), min(hi, lo + ((b + 1) << shift) - 1)
        if shift == 0:
            return lo
    got = np.concatenate([a[(a >= lo) & (a <= hi)] for a in _atimes(tables)])
    return int(np.partition(got, k)[k])


def _tenants(st: Store, ns, into: dict) -> list[dict]:
    """Blocks, bytes and pinned blocks per tenant of a namespace (every engine's), largest
    first; added into `into` (tenant id -> the directory's row)."""
    blocks, pinned = np.zeros(1 << 16, np.int64), np.zeros(1 << 16, np.int64)
    for t in ns.tables.values():
        for lo in range(0, len(t.tag), CHUNK):
            live = t.tag[lo : lo + CHUNK] != 0
            tids = t.tenant[lo : lo + CHUNK][live]
            blocks += np.bincount(tids, minlength=1 << 16)
            pinned += np.bincount(tids[(t.flags[lo : lo + CHUNK][live] & PINNED) != 0], minlength=1 << 16)
    rows: dict[int, dict] = {}
    for tid in np.flatnonzero(blocks).tolist():
        c, p = int(blocks[tid]), int(pinned[tid])
        for d in (rows, into):
            r = d.setdefault(tid, _tenant_row(st, tid))
            r["blocks"] += c
            r["bytes"] += c * ns.slot_bytes * ns.ranks
            r["pinned_blocks"] += p
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
        access, oldest, newest = _access(tables, now)
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
                "keys": ns.count(),  # blocks (a block two engines hold counts twice)
                "engines": {str(e): n for e, n in held.items()},
                "bytes": blocks * ns.slot_bytes * ns.ranks,
                "payload_bytes": ns.payload_bytes,
                "slot_bytes": ns.slot_bytes,
                "ranks": ns.ranks,
                "disk_bytes": disk,
                "oldest_access": iso(oldest),
                "newest_access": iso(newest),
                "access": access,
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
