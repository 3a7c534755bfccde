# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`: the keys of an engine's blocks, read from its files a batch of slots at a time.

The index in memory holds tags, not keys (aiokv/store/table.py); the keys are in the engine's
checkpoint (records sorted by slot) and journal (the newest COMMIT of a slot wins, as a
checkpoint merges them: aiokv/store/checkpoint.py). `--keys` hands them out in LRU order and `--verify` checks
each slot's header against its key, for tens of millions of blocks: the files are mapped
read-only, what is kept is each checkpoint record's slot (4 bytes) and each journal COMMIT's slot
and position (12 bytes), and the pages a batch touched are let go after it (MADV_DONTNEED), so
the keys never sit in memory all at once. A key is handed out only where the record's tag is the
one the replayed index holds for that slot (a block the engine replaced since is left out, as
checkpoint.merged leaves it out).

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS
from aiokv.store.logrecords import REC, parse_records, record_tags

PASS = 1 << 20  # records read at a time while their slots are taken


class _Mapped:
    """A file mapped read-only: its records (a numpy view) after `skip` header bytes."""

    def __init__(self, dir_fd: int, name: str):
        self.mm, self.recs = None, np.zeros(0, REC)
        try:
            fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
        except FileNotFoundError:
            return
        try:
            size = os.fstat(fd).st_size
            if size > fmt.FILE_HDR_BYTES:
                self.mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)

    def header(self) -> bytes:
        return self.mm[: fmt.FILE_HDR_BYTES] if self.mm is not None else b""

    def body(self, count: int) -> np.ndarray:
        self.recs = np.frombuffer(self.mm, REC, count, fmt.FILE_HDR_BYTES) if count else np.zeros(0, REC)
        return self.recs

    def let_go(self) -> None:
        """Drop the pages mapped so far from this process (the page cache keeps them)."""
        if self.mm is not None:
            self.mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        self.recs = np.zeros(0, REC)  # (the view goes first: a mapping with views cannot close)
        if self.mm is not None:
            self.mm.close()
            self.mm = None


class BlockKeys:
    """slot -> key of one engine's blocks of a namespace (its files: `dir_fd`, journal generation
    `gen`), a batch at a time (`lookup`)."""

    def __init__(self, dir_fd: int, gen: int):
        self._ck = _Mapped(dir_fd, "checkpoint")
        self._jn = _Mapped(dir_fd, f"journal.{gen}")
        self._cslots, self._corder = self._checkpoint_slots()
        self._jslots, self._jpos = self._journal_commits()

    def _checkpoint_slots(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Its records' slots, ascending, and where each is (None: in order: ours are)."""
        try:
            _, count, _ = fmt.unpack_file_header(self._ck.header(), fmt.CKPT_MAGIC)
        except fmt.BadBlock:
            count = 0
        if self._ck.mm is None:
            count = 0
        count = min(count, (len(self._ck.mm) - fmt.FILE_HDR_BYTES) // fmt.REC_BYTES if count else 0)
        recs = self._ck.body(count)
        slots = np.empty(count, np.uint32)
        for i in range(0, count, PASS):
            slots[i : i + PASS] = recs["slot"][i : i + PASS]
            self._ck.let_go()
        if count < 2 or bool(np.all(slots[1:] > slots[:-1])):
            return slots, None
        order = np.argsort(slots, kind="stable")  # an older writer's order
        return slots[order], order

    def _journal_commits(self) -> tuple[np.ndarray, np.ndarray]:
        """The slots of the journal's COMMIT records, ascending (the newest of each slot), and
        their record numbers; only the records that verify, from the first."""
        if self._jn.mm is None:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        body = memoryview(self._jn.mm)[fmt.FILE_HDR_BYTES :]
        try:
            valid, _ = parse_records(body)
            n = len(valid)
            del valid
        finally:
            body.release()
        recs = self._jn.body(n)
        pos = np.flatnonzero(recs["kind"] == fmt.REC_COMMIT)
        slots = recs["slot"][pos].astype(np.uint32)
        self._jn.let_go()
        _, last = np.unique(slots[::-1], return_index=True)  # the newest COMMIT of each slot
        keep = len(slots) - 1 - last
        return slots[keep], pos[keep]

    def lookup(self, slots, tags) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(keys, their lengths, found) for these slots whose blocks have these tags: keys a
        (n, 32) uint8 array; found False where the files name no key of that tag there."""
        n = len(slots)
        by = np.argsort(np.asarray(slots), kind="stable")  # (looked up in slot order: the files' order)
        q = np.asarray(slots)[by].astype(np.uint32)  # (the slot arrays' own type: searchsorted copies no array)
        want = np.asarray(tags, np.uint64)[by]
        keys = np.zeros((n, fmt.MAX_KEY), np.uint8)
        klens = np.zeros(n, np.uint8)
        found = np.zeros(n, bool)
        for where, order, src in ((self._cslots, self._corder, self._ck), (self._jslots, self._jpos, self._jn)):
            if not len(where) or not n:
                continue
            pos = np.minimum(np.searchsorted(where, q), len(where) - 1)
            hit = where[pos] == q
            idx = pos[hit] if order is None else order[pos[hit]]
            recs = src.recs[idx]  # (a copy of just those records)
            ok = record_tags(recs) == want[hit]
            at = by[np.flatnonzero(hit)[ok]]  # the journal's last: it wins
            keys[at] = np.ascontiguousarray(recs["key"][ok]).view(np.uint8).reshape(-1, fmt.MAX_KEY)
            klens[at] = recs["klen"][ok]
            found[at] = True
            src.let_go()
        return keys, klens, found

    def close(self) -> None:
        self._ck.close()
        self._jn.close()
