# SPDX-License-Identifier: Apache-2.0
"""Journal, checkpoint and index-image bytes: the 64-byte records (COMMIT, DROP, TOUCH, FREE,
FLAGS, MARK), the file header every index and side file opens with, and the index image's
header and columns. Part of the on-disk format (aiokv/data/format/, docs/format.md "The index";
the arrays they become: aiokv/store/table.py).

Threading contract: constants and pure functions, any thread.
"""

from __future__ import annotations

import struct

from aiokv import _native
from aiokv.data.format.slot import FILE_VERSION, MAX_KEY, MIN_KEY, BadBlock

__all__ = [
    "REC_COMMIT",
    "REC_DROP",
    "REC_TOUCH",
    "REC_FREE",
    "REC_FLAGS",
    "REC_MARK",
    "REC_KINDS",
    "FLAG_PINNED",
    "REC_BYTES",
    "REC_FIELDS",
    "REC_KEY_AT",
    "REC_KLEN_AT",
    "INDEX_MAGIC",
    "INDEX_VERSION",
    "INDEX_HDR_BYTES",
    "INDEX_COLUMNS",
    "pack_index_header",
    "unpack_index_header",
    "index_offsets",
    "JOURNAL_MAGIC",
    "CKPT_MAGIC",
    "JOURNAL_VERSION",
    "FILE_VERSIONS",
    "FILE_MARK_AT",
    "FILE_HDR_BYTES",
    "pack_record",
    "pack_mark",
    "pack_free",
    "pack_flags",
    "iter_records",
    "pack_file_header",
    "file_header_mark",
    "unpack_file_header",
]

# ---- index records (checkpoint body and journal) ----
REC_COMMIT = 1
REC_DROP = 2
# TOUCH: the engine whose journal holds it used `key` (a hit on a block another
# engine holds) at `atime`; whichever engine holds the key refreshes its LRU
# position. slot is 0.
REC_TOUCH = 3
# FREE (journal version 2): the block in `slot`, whose key has the tag (aiokv/store/table.py)
# in the first 8 bytes of the key field (little-endian; the other 8 zero, key length 16),
# is gone: an eviction, which knows a slot and its tag, not the key. atime is 0.
REC_FREE = 4
# FLAGS (journal version 3): the writer's block in `slot`, whose key has the tag in the key
# field (as FREE's), has the flags of byte 58 from now on (FLAG_PINNED: pinned, never
# evicted); a FLAGS whose tag does not match the slot's block changes nothing. atime is 0.
REC_FLAGS = 5
# MARK (journal version 3): the writer applied the directory's control records (clear, pin,
# unpin: aiokv/store/control.py) up to number `slot` to this namespace, in the records before
# it (written before it, in chunks: after a crash an order's records may be there without its
# MARK, and the order is applied again). Key of length 16, zero; atime: when.
REC_MARK = 6
REC_KINDS = (REC_COMMIT, REC_DROP, REC_TOUCH, REC_FREE, REC_FLAGS, REC_MARK)
FLAG_PINNED = 1  # flags bit 0: pinned (by an operator's pin, or a request's)
# type, key len, slot, last access (ns since epoch), key, then 12 bytes: a checkpoint's
# records carry the key's tag (8 bytes; 0 in journals and in checkpoints of old writers: the
# reader computes it); a COMMIT's (journal version 3) and a checkpoint's record its tenant
# (2 bytes: an id in the writer's tenants file, 0: the tenant "") and flags (1 byte); FLAGS
# records their flags; one zero byte; crc
_REC = struct.Struct("<BB2xIQ32sQHBx")
REC_BYTES = _REC.size + 4
assert REC_BYTES == 64
# the same record as a numpy dtype (aiokv/store/table.py parses records in bulk)
REC_FIELDS = {
    "names": ["kind", "klen", "slot", "atime", "key", "tag", "tenant", "flags", "crc"],
    "formats": ["u1", "u1", "<u4", "<u8", "V32", "<u8", "<u2", "u1", "<u4"],
    "offsets": [0, 1, 4, 8, 16, 48, 56, 58, 60],
    "itemsize": REC_BYTES,
}
REC_KEY_AT, REC_KLEN_AT = 16, 1

# index image: the in-memory index of a checkpoint's blocks as it is laid out in memory
# (aiokv/store/table.py), written beside the checkpoint (same generation and count) so
# that opening reads four arrays instead of parsing a record per block; a cache of the
# checkpoint, never the truth: one that does not match it is ignored (docs/format.md).
INDEX_MAGIC = b"AIOKVIDX"
INDEX_VERSION = 1
# magic, version, generation, count, slots, CRC32C of each column (tag, atime, tenant, flags),
# then the checkpoint file it was written with as the file system saw it: inode, mtime (ns),
# size (a checkpoint changed since, by anyone, is read instead of the image)
_INDEX_HDR = struct.Struct("<8sHxxQQQIIIIQQQ")
INDEX_HDR_BYTES = 128
INDEX_COLUMNS = (("tag", 8), ("atime", 8), ("tenant", 2), ("flags", 1))


def pack_index_header(gen: int, count: int, slots: int, crcs, ckpt: tuple[int, int, int]) -> bytes:
    return _INDEX_HDR.pack(INDEX_MAGIC, INDEX_VERSION, gen, count, slots, *crcs, *ckpt).ljust(INDEX_HDR_BYTES, b"\0")


def unpack_index_header(raw: bytes) -> tuple[int, int, int, tuple, tuple]:
    """(generation, count, slots, column CRCs, checkpoint identity); raises BadBlock if it
    is not an index image."""
    if len(raw) < INDEX_HDR_BYTES:
        raise BadBlock("short index header")
    m, ver, gen, count, slots, c1, c2, c3, c4, ino, mtime, size = _INDEX_HDR.unpack_from(raw)
    if m != INDEX_MAGIC or ver != INDEX_VERSION:
        raise BadBlock("not an index image of this version")
    return gen, count, slots, (c1, c2, c3, c4), (ino, mtime, size)


def index_offsets(slots: int) -> list[int]:
    """Where each column of an index image of `slots` slots starts."""
    out, off = [], INDEX_HDR_BYTES
    for _, size in INDEX_COLUMNS:
        out.append(off)
        off += size * slots
    return out


JOURNAL_MAGIC = b"AIOKVJNL"
CKPT_MAGIC = b"AIOKVCKP"
# Journals of version 2 may hold FREE records; version 1 (read still) cannot. Journals of
# version 3 (issue 34) carry each COMMIT's tenant and flags, and may hold FLAGS and MARK
# records; versions 1 and 2 (read still) carry none: their blocks are the tenant "", unpinned.
# Checkpoints stay version 1: their records' last 12 bytes, which earlier versions wrote zero
# and never read, carry the tag, tenant and flags, and they are sorted by slot (readers expect
# none of it: a checkpoint without them is read as before); their header's bytes 32..39 (zero
# before) the control records applied (MARK), 0: none.
JOURNAL_VERSION = 3
FILE_VERSIONS = {JOURNAL_MAGIC: (1, 2, 3)}  # the versions read, where more than FILE_VERSION
# magic, version, generation, record count, body crc
_FILE_HDR = struct.Struct("<8sHxxQQI")
_FILE_MARK = struct.Struct("<Q")
FILE_MARK_AT = 32  # a checkpoint's MARK (control records applied)
FILE_HDR_BYTES = 64


def pack_record(kind: int, key: bytes, slot: int, atime: int, tenant: int = 0, flags: int = 0) -> bytes:
    body = _REC.pack(kind, len(key), slot, atime, key, 0, tenant, flags)
    return body + struct.pack("<I", _native.crc32c_bytes(body))


def pack_mark(upto: int, when: int) -> bytes:
    """A MARK record: control records up to number `upto` applied (at `when`, ns)."""
    return pack_record(REC_MARK, bytes(MIN_KEY), upto, when)


def pack_free(slot: int, tag: int) -> bytes:
    """A FREE record: the block in `slot`, of key tag `tag`, is gone."""
    return pack_record(REC_FREE, tag.to_bytes(8, "little") + bytes(8), slot, 0)


def pack_flags(slot: int, tag: int, flags: int) -> bytes:
    """A FLAGS record: the block in `slot`, of key tag `tag`, has `flags` from now on."""
    return pack_record(REC_FLAGS, tag.to_bytes(8, "little") + bytes(8), slot, 0, flags=flags)


def iter_records(buf: bytes, verify_each: bool = True):
    """Yield (kind, key, slot, atime) up to the first record that does not verify.

    Returns (via StopIteration value) the byte length of the valid prefix.
    """
    n = len(buf) // REC_BYTES
    crc = _native.crc32c_bytes
    for i in range(n):
        off = i * REC_BYTES
        body = buf[off : off + _REC.size]
        if verify_each and crc(body) != int.from_bytes(buf[off + _REC.size : off + REC_BYTES], "little"):
            return off
        kind, klen, slot, atime, key, _, _, _ = _REC.unpack(body)
        if kind not in REC_KINDS or not MIN_KEY <= klen <= MAX_KEY:
            return off
        yield kind, key[:klen], slot, atime
    return n * REC_BYTES


def pack_file_header(
    magic: bytes, gen: int, count: int = 0, body_crc: int = 0, version: int | None = None, mark: int = 0
) -> bytes:
    if version is None:
        version = JOURNAL_VERSION if magic == JOURNAL_MAGIC else FILE_VERSION
    head = _FILE_HDR.pack(magic, version, gen, count, body_crc).ljust(FILE_MARK_AT, b"\0")
    return (head + _FILE_MARK.pack(mark)).ljust(FILE_HDR_BYTES, b"\0")


def file_header_mark(raw: bytes) -> int:
    """A checkpoint header's MARK: the control records its index has applied (0: none)."""
    return _FILE_MARK.unpack_from(raw, FILE_MARK_AT)[0] if len(raw) >= FILE_MARK_AT + 8 else 0


def unpack_file_header(raw: bytes, magic: bytes) -> tuple[int, int, int]:
    """(generation, count, body crc); raises BadBlock if it is not ours."""
    if len(raw) < FILE_HDR_BYTES:
        raise BadBlock("short file header")
    m, ver, gen, count, crc = _FILE_HDR.unpack_from(raw)
    if m != magic:
        raise BadBlock("file magic")
    reads = FILE_VERSIONS.get(magic, (FILE_VERSION,))
    if ver not in reads:
        raise BadBlock(f"format version {ver} (this aiokv reads {', '.join(map(str, reads))})")
    return gen, count, crc
