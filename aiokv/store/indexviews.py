# SPDX-License-Identifier: Apache-2.0
"""Views of a namespace's blocks that read like the dicts they replaced (tools, tests).

Lookups by key are the tables'; iterating reads the keys from the files
(Namespace.keys_of). `entries`, `own` and `peers` of an index.Namespace are these.

Threading contract: the namespace's: one thread (the Store's owner) reads them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from aiokv import _index
from aiokv.store.table import Table

if TYPE_CHECKING:
    from aiokv.store.index import Namespace


def _keys(ns: Namespace, engine: int) -> list[bytes]:
    t = ns.table_of(engine)
    live = t.live()
    return [k for k in ns.keys_of(engine).keys_of(live, t.tag[live]) if k is not None]


class Entries(Mapping):
    """key -> location of every engine's blocks (ours first)."""

    def __init__(self, ns: Namespace):
        self._ns = ns

    def __contains__(self, key) -> bool:
        return isinstance(key, bytes) and _index.locate(self._ns._probes, key) is not None

    def get(self, key, default=None):
        w = self._ns.where(key) if isinstance(key, bytes) else None
        return default if w is None else w

    def __getitem__(self, key):
        w = self.get(key)
        if w is None:
            raise KeyError(key)
        return w

    def __len__(self) -> int:
        return self._ns.count()

    def __iter__(self):
        seen = set()
        for e in self._ns._order:
            for k in _keys(self._ns, e):
                if k not in seen:
                    seen.add(k)
                    yield k


class Own(Mapping):
    """key -> slot of our own blocks."""

    def __init__(self, ns: Namespace):
        self._ns = ns

    def __contains__(self, key) -> bool:
        return isinstance(key, bytes) and self._ns.table.find(key) >= 0

    def __getitem__(self, key):
        s = self._ns.table.find(key) if isinstance(key, bytes) else -1
        if s < 0:
            raise KeyError(key)
        return s

    def __len__(self) -> int:
        return self._ns.table.count

    def __iter__(self):
        if self._ns.engine is None:
            return iter(())
        return iter(_keys(self._ns, self._ns.engine))


class PeerBlocks(Mapping):
    """key -> (slot, atime) of another engine's blocks."""

    def __init__(self, ns: Namespace, engine: int):
        self._ns, self._e = ns, engine

    def _t(self) -> Table:
        return self._ns.tables.get(self._e) or Table()

    def __getitem__(self, key):
        t = self._t()
        s = t.find(key) if isinstance(key, bytes) else -1
        if s < 0:
            raise KeyError(key)
        return s, t.atime_at(s)

    def __contains__(self, key) -> bool:
        return isinstance(key, bytes) and self._t().find(key) >= 0

    def __len__(self) -> int:
        return self._t().count

    def __iter__(self):
        return iter(_keys(self._ns, self._e)) if self._e in self._ns.tables else iter(())


class Peers(Mapping):
    """engine -> its blocks (PeerBlocks), for the other engines holding any."""

    def __init__(self, ns: Namespace):
        self._ns = ns

    def __getitem__(self, engine):
        if engine not in self._ns.tables:
            raise KeyError(engine)
        return PeerBlocks(self._ns, engine)

    def __len__(self) -> int:
        return len(self._ns.tables)

    def __iter__(self):
        return iter(sorted(self._ns.tables))
