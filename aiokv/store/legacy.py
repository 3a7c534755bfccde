# SPDX-License-Identifier: Apache-2.0
"""For a while only: a namespace's blocks read like a dict, as before issue 42, for the
callers on branches not merged yet (tools/, cli/warm.py, cli/warmcopy.py). Everything else
asks the namespace (`has`, `where`, `block`, `count`, `keys`, `reserved`: store/api.py).
Delete this module, and the `entries`, `own` and `pending` properties that return it, once
those callers ask the namespace too.

Threading contract: the namespace's: one thread (the Store's owner) reads it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from aiokv.data import format as fmt


class OldView(Mapping):
    """key -> value, from the namespace's calls: has(key), get(key) (None: none), count(), keys()."""

    def __init__(self, has: Callable, get: Callable, count: Callable, keys: Callable):
        self._has, self._get, self._count, self._keys = has, get, count, keys

    def __contains__(self, key) -> bool:
        return self._has(key)

    def __getitem__(self, key):
        got = self._get(key) if self._has(key) else None
        if got is None:
            raise KeyError(key)
        return got

    def __len__(self) -> int:
        return self._count()

    def __iter__(self):
        return iter(self._keys())


def entries(ns) -> OldView:
    """key -> location of every engine's (every drive's) blocks, as `ns.entries` read."""
    return OldView(ns.has, ns.where, ns.count, ns.keys)


def own(ns) -> OldView:
    """key -> slot of our own blocks, as `ns.own` read (a Namespace)."""

    def slot(key):
        got = ns.block(key)
        return None if got is None else got[0]

    return OldView(
        lambda k: ns.block(k) is not None,
        slot,
        lambda: ns.table.count,
        lambda: [] if ns.engine is None else ns.keys(ns.engine),
    )


def pending(ns) -> OldView:
    """key -> location reserved on any drive, as a DriveNamespace's `pending` read."""

    def where(key):
        for d, n in ns.parts:
            if key in n.pending:
                return fmt.on_drive(d, n.pending[key])
        return None

    return OldView(ns.reserved, where, lambda: sum(len(n.pending) for _, n in ns.parts), lambda: [])
