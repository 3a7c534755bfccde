# SPDX-License-Identifier: Apache-2.0
"""Several drives' parts seen as one (drives.py's Drives hands these out): a namespace on
every drive present (`DriveNamespace`), a key -> location view over the drives' dicts with
the drive's index in each location (`KeyUnion`: format.on_drive), every drive's namespaces and
pins (`Indexes`), their space used (`SpaceUsed`).

Threading contract: a Store's: one owner thread (the EngineCore scheduler thread) reads them.
"""

from __future__ import annotations

from aiokv.data import format as fmt


class KeyUnion:
    """Read-only key -> location view over the drives' dicts (entries, pending):
    the first drive holding a key answers, with its index in the location."""

    def __init__(self, parts: list[tuple[int, dict]]):
        self.parts = parts

    def get(self, key, default=None):
        for d, m in self.parts:
            w = m.get(key)
            if w is not None:
                return fmt.on_drive(d, w)
        return default

    def __contains__(self, key) -> bool:
        return any(key in m for _, m in self.parts)

    def __getitem__(self, key):
        w = self.get(key)
        if w is None:
            raise KeyError(key)
        return w

    def __len__(self) -> int:
        return sum(len(m) for _, m in self.parts)

    def __iter__(self):
        for _, m in self.parts:
            yield from m


class DriveNamespace:
    """One namespace on every drive present: (drive, that drive's Namespace) each."""

    def __init__(self, parts: list):
        first = parts[0][1]
        self.nsid, self.payload_bytes, self.slot_bytes = first.nsid, first.payload_bytes, first.slot_bytes
        self.ranks, self.fields = first.ranks, first.fields
        self.parts = parts
        self.on = dict(parts)  # drive -> its Namespace
        self.entries = KeyUnion([(d, ns.entries) for d, ns in parts])
        self.pending = KeyUnion([(d, ns.pending) for d, ns in parts])

    def held(self, tag: int) -> bool:
        """Whether any drive holds a block of this key tag (the KV events' removals)."""
        return any(ns.held(tag) for _, ns in self.parts)

    @property
    def ready(self) -> bool:
        """Every drive's index has loaded."""
        return all(ns.ready for _, ns in self.parts)


class Indexes:
    """What the connector reads of `store.index`: every drive's namespaces and pins."""

    def __init__(self, stores: dict):
        self._stores = stores

    @property
    def namespaces(self) -> dict:
        return {(d, nsid): ns for d, s in self._stores.items() for nsid, ns in s.index.namespaces.items()}

    @property
    def pins(self) -> dict:
        return {(d, pk): n for d, s in self._stores.items() for pk, n in s.index.pins.items() if n}


class SpaceUsed:
    """What the connector reads of `store.space`: the bytes every drive uses."""

    def __init__(self, stores: dict):
        self._stores = stores

    def used(self) -> int:
        return sum(s.space.used() for s in self._stores.values())
