# SPDX-License-Identifier: Apache-2.0
"""One namespace on every drive present, seen as one (`DriveNamespace`: drives.py's Drives
hands these out): the same calls as a Namespace's (`has`, `where`, `count`, `keys`, ...;
store/api.py), asked of each drive's part, a location carrying the drive's index
(format.on_drive).

Threading contract: a Store's: one owner thread (the EngineCore scheduler thread) calls it.
"""

from __future__ import annotations

from aiokv.data import format as fmt


class DriveNamespace:
    """One namespace on every drive present: (drive, that drive's Namespace) each; a key's
    location is the first drive's holding it."""

    def __init__(self, parts: list):
        """parts: [(drive, Namespace)], at least one."""
        first = parts[0][1]
        self.nsid, self.payload_bytes, self.slot_bytes = first.nsid, first.payload_bytes, first.slot_bytes
        self.ranks, self.fields = first.ranks, first.fields
        self.parts = parts
        self.on = dict(parts)  # drive -> its Namespace

    def has(self, key: bytes) -> bool:
        """Whether any drive's part holds a committed block of key."""
        return any(n.has(key) for _, n in self.parts)

    def where(self, key: bytes) -> int | None:
        """key's location on the first drive holding it, with that drive's index in it."""
        for d, n in self.parts:
            w = n.where(key)
            if w is not None:
                return fmt.on_drive(d, w)
        return None

    def reserved(self, key: bytes) -> bool:
        """Whether any drive's part has a reservation of key not yet committed."""
        return any(n.reserved(key) for _, n in self.parts)

    def count(self) -> int:
        """Blocks every drive's part holds."""
        return sum(n.count() for _, n in self.parts)

    def keys(self) -> list[bytes]:
        """Every drive's keys, each once (read from the files: tools and tests)."""
        return list(dict.fromkeys(k for _, n in self.parts for k in n.keys()))

    def held(self, tag: int) -> bool:
        """Whether any drive holds a block of this key tag (the KV events' removals)."""
        return any(ns.held(tag) for _, ns in self.parts)

    @property
    def ready(self) -> bool:
        """Every drive's index has loaded."""
        return all(ns.ready for _, ns in self.parts)

    def still_loading(self) -> bool:
        """Whether any drive's index is on its way (not in, not failed)."""
        return any(n.still_loading() for _, n in self.parts)
