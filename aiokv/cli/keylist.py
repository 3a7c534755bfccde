# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect --keys`: every key, least recently used first, made a batch at a time.

The order is eviction's: ascending last access, ties by engine number, then slot (the first key
of a namespace is the next one eviction takes). It is found with numpy over the replayed index
(about 20 bytes a block while the document is written, no Python object per block); the keys
come from the engines' files a batch at a time (blockkeys.py), and the document's lists are
Rows (rows.py): written as they are made.

Threading: one thread (the CLI's), over a Store opened read-only (opening.py), open until the
document is written.
"""

from __future__ import annotations

import numpy as np

from aiokv.cli.blockkeys import BlockKeys
from aiokv.cli.opening import SCHEMA
from aiokv.cli.rows import Rows, plain
from aiokv.store.store import Store

BATCH = 1 << 16  # keys made at a time


def keys(st: Store) -> dict:
    out = [{"nsid": ns.hex, "keys": _rows(st, ns)} for _, ns in sorted(st.index.namespaces.items())]
    return {"schema": SCHEMA, "root": st.root, "order": "least recently used first", "namespaces": out}


def iso_many(atimes) -> list[str | None]:
    """summary.iso of each access time (ns), in bulk."""
    a = np.asarray(atimes, np.uint64)
    txt = np.datetime_as_string(a.astype("datetime64[ns]"), unit="s")
    return [None if z else t + "Z" for t, z in zip(txt.tolist(), (a == 0).tolist())]


def hex_keys(keys: np.ndarray, klens: np.ndarray) -> list[str]:
    """Each key of a (n, 32) uint8 array, its first klens[i] bytes, in lower-case hex."""
    hx = keys.tobytes().hex()
    w = 2 * keys.shape[1]
    return [hx[i * w : i * w + 2 * k] for i, k in enumerate(klens.tolist())]


def _blocks(tables) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(slot, access time) of every block of these tables, in turn, each table's slots
    ascending, and how many each holds; made a slot range at a time (4 + 8 bytes a block)."""
    n = sum(t.count for t in tables)
    where, atimes, sizes, at = np.empty(n, np.uint32), np.empty(n, np.uint64), [], 0
    for t in tables:
        start = at
        for lo in range(0, len(t.tag), 1 << 20):
            s = lo + np.flatnonzero(t.tag[lo : lo + (1 << 20)])
            k = min(len(s), n - at)  # (count and tags agree; never past the arrays)
            where[at : at + k], atimes[at : at + k] = s[:k], t.atime[s[:k]]
            at += k
        sizes.append(at - start)
    return where[:at], atimes[:at], sizes


def _rows(st: Store, ns) -> Rows:
    engines = sorted(ns.tables)
    size, payload = ns.slot_bytes * ns.ranks, ns.payload_bytes * ns.ranks

    def batches():
        where, atimes, sizes = _blocks([ns.tables[e] for e in engines])
        ends = np.cumsum(sizes)
        order = np.argsort(atimes, kind="stable")  # (each engine's slots ascending, engines in turn)
        files = {}
        try:
            for b in range(0, len(order), BATCH):
                idx = order[b : b + BATCH]
                e_of = np.searchsorted(ends, idx, side="right")  # (the engine each is of)
                s_of, a_of = where[idx].astype(np.int64), atimes[idx]
                keys = np.zeros((len(idx), 32), np.uint8)
                klens = np.zeros(len(idx), np.uint8)
                found = np.zeros(len(idx), bool)
                for i in np.unique(e_of).tolist():
                    e, m = engines[i], e_of == i
                    if e not in files:
                        fl = st.followers[(ns.nsid, e)]
                        files[e] = BlockKeys(fl.dir_fd, fl.gen)
                    keys[m], klens[m], found[m] = files[e].lookup(s_of[m], ns.tables[e].tag[s_of[m]])
                n = int(found.sum())
                yield {
                    "key": hex_keys(keys[found], klens[found]),
                    "engine": [engines[i] for i in e_of[found].tolist()],
                    "slot": s_of[found].tolist(),
                    "bytes": [size] * n,
                    "payload_bytes": [payload] * n,
                    "last_access": iso_many(a_of[found]),
                }
        finally:
            for f in files.values():
                f.close()

    def as_json(c: dict) -> list[str]:
        return [
            f'{{"bytes": {size}, "engine": {e}, "key": "{k}", "last_access": {a}, "payload_bytes": {payload}, "slot": {s}}}'
            for e, k, a, s in zip(c["engine"], c["key"], plain(c["last_access"]), c["slot"])
        ]

    return Rows(sum(ns.tables[e].count for e in engines), batches, as_json)
