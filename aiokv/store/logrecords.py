# SPDX-License-Identifier: Apache-2.0
"""The index files' records in bulk: parsed up to the first that does not verify, their
tags and keys (KeyMap: keys by slot), the MARK they reach; a file read whole.

Fixed 64-byte records (docs/format.md, "Index"), each with its own CRC32C, handled as
numpy arrays, never an object per record.

Threading contract: plain functions over the arrays and files they are handed, no state;
called by whichever thread holds those (the Store's I/O thread, a follower's owner, tools).
"""

from __future__ import annotations

import os

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS

REC = np.dtype(fmt.REC_FIELDS)
_KEY0 = np.dtype({"names": ["k0"], "formats": ["<u8"], "offsets": [fmt.REC_KEY_AT], "itemsize": fmt.REC_BYTES})
_KINDS = bytes(fmt.REC_KINDS)
_KLENS = bytes([fmt.MIN_KEY, fmt.MAX_KEY] * len(fmt.REC_KINDS))


def parse_records(buf, verify: bool = True):
    """(records as a numpy array over buf, bytes they take): the records from the first
    up to the first that does not verify (CRC, when verify) or names an unknown kind or a
    key length out of bounds; what iter_records yields, in bulk."""
    n = len(buf) // fmt.REC_BYTES
    view = memoryview(buf)[: n * fmt.REC_BYTES]
    if verify:
        k = _index.records_valid(view, fmt.REC_BYTES, _KINDS, _KLENS)
    else:
        recs = np.frombuffer(view, REC, n)
        bad = ~np.isin(recs["kind"], list(fmt.REC_KINDS)) | (recs["klen"] < fmt.MIN_KEY) | (recs["klen"] > fmt.MAX_KEY)
        k = int(np.argmax(bad)) if bad.any() else n
    return np.frombuffer(view, REC, k), k * fmt.REC_BYTES


def cat(parts) -> np.ndarray:
    """Record arrays end to end (np.concatenate would repack the records' dtype)."""
    return np.frombuffer(b"".join(p.tobytes() for p in parts), REC)


def record_tags(recs) -> np.ndarray:
    """The tag of each record's key (FREE and FLAGS records: the tag they carry; checkpoint
    records: the one they carry, where they carry one)."""
    n = len(recs)
    out = np.zeros(n, np.uint64)
    if n:
        _index.record_tags(recs.view(np.uint8).reshape(-1), fmt.REC_BYTES, fmt.REC_KLEN_AT, fmt.REC_KEY_AT, out)
        given = recs["tag"] != 0
        out[given] = recs["tag"][given]
        free = (recs["kind"] == fmt.REC_FREE) | (recs["kind"] == fmt.REC_FLAGS)
        if free.any():
            out[free] = recs.view(_KEY0)["k0"][free]
    return out


def words(recs) -> np.ndarray:
    """Records as rows of eight uint64 words (a view)."""
    return np.ascontiguousarray(recs).view(np.uint64).reshape(-1, 8)


def word_tags(rows) -> np.ndarray:
    """record_tags of records as word rows."""
    out = np.zeros(len(rows), np.uint64)
    if len(rows):
        rows = np.ascontiguousarray(rows)
        _index.record_tags(rows.view(np.uint8).reshape(-1), fmt.REC_BYTES, fmt.REC_KLEN_AT, fmt.REC_KEY_AT, out)
        given = rows[:, 6] != 0
        out[given] = rows[given, 6]
    return out


def record_key(rec) -> bytes:
    return bytes(rec["key"])[: rec["klen"]]


def marks(recs) -> int:
    """The highest MARK among records (0: none)."""
    m = recs["kind"] == fmt.REC_MARK
    return int(recs["slot"][m].max()) if len(recs) and m.any() else 0


def read_file(name: str, dir_fd: int) -> bytes | None:
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 24)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
    finally:
        os.close(fd)


class KeyMap:
    """The keys of the blocks an engine's files name, in arrays (sorted slots, keys), asked
    in bulk (`keys_of`; readkeys.read_keys makes one). Immutable once made: any thread may
    read it."""

    def __init__(self, recs=None):
        recs = np.zeros(0, REC) if recs is None else recs
        self.slots = recs["slot"].astype(np.int64)
        self.keys = np.ascontiguousarray(recs["key"])
        self.klens = np.ascontiguousarray(recs["klen"])
        self.tags = np.ascontiguousarray(recs["tag"])

    def keys_of(self, slots, tags) -> list[bytes | None]:
        """The key of each slot whose key here has the tag given for it (else None)."""
        slots = np.asarray(slots, np.int64)
        out: list[bytes | None] = [None] * len(slots)
        if not len(self.slots) or not len(slots):
            return out
        pos = np.minimum(np.searchsorted(self.slots, slots), len(self.slots) - 1)
        ok = (self.slots[pos] == slots) & (self.tags[pos] == np.asarray(tags, np.uint64))
        for j in np.flatnonzero(ok).tolist():
            i = int(pos[j])
            out[j] = bytes(self.keys[i])[: self.klens[i]]
        return out
