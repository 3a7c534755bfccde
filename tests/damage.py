# SPDX-License-Identifier: Apache-2.0
"""Spoiling chosen stored blocks behind aiokv's back (tests only): a block is named
by its prompt and its position in the prompt, in one KV-cache group.

- corrupt: one payload byte flipped on disk (the checksum no longer matches);
- missing: the slot's space punched out of the data file (it reads as zeros);
- unreadable: an I/O fault rule (aiokv/data/faults.py) making every read of that
  slot fail with EIO (`read_fault`; the engine runs with it in AIOKV_FAULTS).
"""

from __future__ import annotations

import os

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.slotfile import data_path
from aiokv.scheduler.keys import extend_keys, namespace_id, request_root
from aiokv.store import Store
from aiokv.store.store import ns_dir

FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


class StoredBlocks:
    """The blocks of one cache directory, per KV-cache group (engine 0, rank 0, no
    request factors such as salts)."""

    def __init__(self, cache: str, block_size: int):
        self.cache, self.bs = cache, block_size
        st = Store(cache, readonly=True)
        try:
            self.groups = {}  # group index -> (kind, nsid, slot bytes, entries)
            for ns in st.index.namespaces.values():
                f = ns.fields
                gi = f.get("group", 0)
                kind = f["groups"][gi]["kind"] if "groups" in f else "full"
                self.groups[gi] = (kind, ns.nsid, ns.slot_bytes, {k: ns.where(k) for k in ns.keys()})
            any_ns = next(iter(st.index.namespaces.values()))
            model = {k: v for k, v in any_ns.fields.items() if k != "group"}
            self.root = request_root(namespace_id(model) if "groups" in any_ns.fields else any_ns.nsid, [])
        finally:
            st.close()

    def group(self, kind: str) -> int:
        (gi,) = [g for g, v in self.groups.items() if v[0] == kind][:1]
        return gi

    def key(self, prompt: list[int], i: int) -> bytes:
        return extend_keys([], self.root, prompt, self.bs, i + 1)[i]

    def _where(self, gi: int, prompt: list[int], i: int) -> tuple[str, int, int]:
        kind, nsid, slot_bytes, entries = self.groups[gi]
        where = entries[self.key(prompt, i)]  # KeyError: the block is not stored
        engine, slot = fmt.split(where)
        assert engine == 0, "blocks of one engine only"
        return data_path(ns_dir(self.cache, nsid), 0), slot * slot_bytes, slot_bytes

    def stored(self, gi: int, prompt: list[int], i: int) -> bool:
        return self.key(prompt, i) in self.groups[gi][3]

    def corrupt(self, gi: int, prompt: list[int], i: int) -> None:
        path, off, size = self._where(gi, prompt, i)
        fd = os.open(path, os.O_RDWR)
        try:
            at = off + fmt.HEADER_BYTES + (size - fmt.HEADER_BYTES) // 2
            b = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([b[0] ^ 0x5A]), at)
            os.fsync(fd)
        finally:
            os.close(fd)

    def punch(self, gi: int, prompt: list[int], i: int) -> None:
        path, off, size = self._where(gi, prompt, i)
        fd = os.open(path, os.O_RDWR)
        try:
            _native.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, size)
            os.fsync(fd)
        finally:
            os.close(fd)

    def read_fault(self, gi: int, prompt: list[int], i: int) -> dict:
        """A fault rule: reads of that block's slot fail with EIO."""
        path, off, _ = self._where(gi, prompt, i)
        return {"op": "read", "kind": "eio", "file": self.groups[gi][1].hex() + "/rank0.data", "offset": off}

    def spoil(self, how: str, gi: int, prompt: list[int], i: int) -> dict | None:
        """corrupt / missing / unreadable; returns the fault rule the last needs."""
        if how == "corrupt":
            self.corrupt(gi, prompt, i)
        elif how == "missing":
            self.punch(gi, prompt, i)
        else:
            assert how == "unreadable", how
            return self.read_fault(gi, prompt, i)
        return None
