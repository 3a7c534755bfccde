# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect --verify`: the corrupt blocks found, in arrays (a wiped drive has tens of
millions of them: never a Python object each), and their rows for the document (rows.py).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import json

import numpy as np

from aiokv.cli.keylist import hex_keys
from aiokv.cli.rows import Rows
from aiokv.data import format as fmt

BATCH = 1 << 14  # corrupt blocks written at a time


class Bads:
    """Corrupt blocks, in arrays: nsid (an index into `nsids`), engine, rank, slot, key (and its
    length), the tag the index held for it, reason (an index into `reasons`)."""

    FIELDS = (("ns", np.uint16), ("engine", np.uint32), ("rank", np.uint16), ("slot", np.int64))
    FIELDS += (("klen", np.uint8), ("tag", np.uint64), ("reason", np.uint16))

    def __init__(self):
        self.nsids: list[bytes] = []
        self.reasons: list[str] = []
        self._codes: dict[str, int] = {}
        self._parts: list[dict] = []
        self.again: np.ndarray | None = None  # (recheck: which rows failed again)
        self.cols = {k: np.zeros(0, t) for k, t in self.FIELDS} | {"key": np.zeros((0, fmt.MAX_KEY), np.uint8)}

    def code(self, reason: str) -> int:
        c = self._codes.get(reason)
        if c is None:
            c = self._codes[reason] = len(self.reasons)
            self.reasons.append(reason)
        return c

    def add(self, nsid: bytes, engine: int, rank: int, slots, keys, klens, tags, reasons) -> None:
        if not len(slots):
            return
        if nsid not in self.nsids:
            self.nsids.append(nsid)
        n = len(slots)
        cols = {"ns": self.nsids.index(nsid), "engine": engine, "rank": rank, "slot": slots}
        cols |= {"key": keys, "klen": klens, "tag": tags, "reason": reasons}
        self._parts.append({k: np.broadcast_to(v, (n, *np.shape(v)[1:])) for k, v in cols.items()})

    def done(self) -> Bads:
        """The parts added joined into `cols` (a column at a time, each part's freed as it is
        joined), sorted by namespace id, rank, slot."""
        parts, self._parts = [self.cols] + self._parts, []
        cols = {}
        for k in list(self.cols):
            cols[k] = np.concatenate([p.pop(k) for p in parts])
        del parts
        nsrank = np.argsort(np.argsort(np.array(self.nsids, dtype=object))) if self.nsids else np.zeros(1, np.int64)
        order = np.lexsort((cols["slot"], cols["rank"], nsrank[cols["ns"]]))
        for k in cols:
            cols[k] = cols[k][order]
        self.cols = cols
        self.again = None
        return self

    def __len__(self) -> int:
        return len(self.cols["slot"]) + sum(len(p["slot"]) for p in self._parts)

    def subset(self, keep) -> Bads:
        if bool(np.all(keep)):
            return self
        out = Bads()
        out.nsids, out.reasons, out._codes = self.nsids, self.reasons, self._codes
        out.cols = {k: v[keep] for k, v in self.cols.items()}
        return out

    def rows(self) -> Rows:
        c = self.cols

        def batches():
            for b in range(0, len(c["slot"]), BATCH):
                s = slice(b, b + BATCH)
                yield {
                    "nsid": [self.nsids[i].hex() for i in c["ns"][s].tolist()],
                    "key": hex_keys(c["key"][s], c["klen"][s]),
                    "engine": c["engine"][s].tolist(),
                    "rank": c["rank"][s].tolist(),
                    "slot": c["slot"][s].tolist(),
                    "reason": [self.reasons[i] for i in c["reason"][s].tolist()],
                }

        def as_json(b: dict) -> list[str]:
            enc = {r: json.dumps(r) for r in set(b["reason"])}
            why = [enc[r] for r in b["reason"]]
            return [
                f'{{"engine": {e}, "key": "{k}", "nsid": "{n}", "rank": {r}, "reason": {w}, "slot": {s}}}'
                for e, k, n, r, w, s in zip(b["engine"], b["key"], b["nsid"], b["rank"], why, b["slot"])
            ]

        return Rows(len(c["slot"]), batches, as_json)

    def keys_by_engine(self) -> dict:
        """engine -> nsid -> {keys} (what a repair drops)."""
        out: dict = {}
        c = self.cols
        for i, key in zip(range(len(c["slot"])), hex_keys(c["key"], c["klen"])):
            ns = self.nsids[int(c["ns"][i])]
            out.setdefault(int(c["engine"][i]), {}).setdefault(ns, set()).add(bytes.fromhex(key))
        return out
