# SPDX-License-Identifier: Apache-2.0
"""The index image (format.INDEX_NAME): a checkpoint's blocks as four columns by slot,
written beside the checkpoint from its own records and read at opening instead of them
when it was written with that very checkpoint file and verifies (docs/format.md).

Threading contract: an IndexImage is used by the one thread writing its checkpoint (the
Store's I/O thread, or the owner at close); read_image by the thread opening the log.
"""

from __future__ import annotations

import os

import numpy as np

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS
from aiokv.store.table import Table, hash_size


def index_image_bytes(dir_fd: int) -> int:
    """Bytes an engine's index image takes (0: none)."""
    try:
        return os.stat(fmt.INDEX_NAME, dir_fd=dir_fd, follow_symlinks=False).st_size
    except OSError:
        return 0


class IndexImage:
    """An index image being written beside a checkpoint (format.INDEX_NAME), from the
    checkpoint's own records, a chunk (sorted by slot) at a time; slots no record names
    are zero (the file is sparse there)."""

    ZEROS = bytes(1 << 20)

    def __init__(self, dfd: int, slots: int):
        self.dfd, self.slots = dfd, slots
        self.offs = fmt.index_offsets(slots)
        self.size = self.offs[-1] + slots
        self.crcs = [0] * len(fmt.INDEX_COLUMNS)
        self.at = 0  # columns written (and CRC'd) up to this slot
        self.fd = os.open(
            fmt.INDEX_NAME + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dfd
        )
        os.ftruncate(self.fd, self.offs[-1] + slots)

    def _zeros(self, upto: int) -> None:
        """The columns' CRCs over zeros from self.at to upto (the file holds them: sparse)."""
        for c, (_, size) in enumerate(fmt.INDEX_COLUMNS):
            left = (upto - self.at) * size
            while left > 0:
                n = min(left, len(self.ZEROS))
                self.crcs[c] = _native.crc32c_bytes(memoryview(self.ZEROS)[:n], self.crcs[c])
                left -= n
        self.at = upto

    def add(self, recs) -> None:
        slots = recs["slot"].astype(np.int64)
        lo, hi = int(slots[0]), min(int(slots[-1]) + 1, self.slots)
        keep = slots < hi
        self._zeros(lo)
        for c, ((name, size), off) in enumerate(zip(fmt.INDEX_COLUMNS, self.offs)):
            col = np.zeros(
                hi - lo, {"tag": np.uint64, "atime": np.uint64, "tenant": np.uint16, "flags": np.uint8}[name]
            )
            col[slots[keep] - lo] = recs[name][keep]
            data = memoryview(col.view(np.uint8))
            self.crcs[c] = _native.crc32c_bytes(data, self.crcs[c])
            pos = off + lo * size
            while data:
                w = os.pwrite(self.fd, data, pos)
                data, pos = data[w:], pos + w
        self.at = hi

    def finish(self, gen: int, count: int, ckpt: tuple[int, int, int]) -> None:
        self._zeros(self.slots)
        os.pwrite(self.fd, fmt.pack_index_header(gen, count, self.slots, self.crcs, ckpt), 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None

    def drop(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            os.unlink(fmt.INDEX_NAME + ".tmp", dir_fd=self.dfd)
        except OSError:
            pass


def read_image(fd: int, dir_fd: int, max_slot: int):
    """The Table of the checkpoint (open as fd) from its index image, if there is one
    written with this very checkpoint file (generation, count, and the file's inode,
    mtime and size: a checkpoint changed since is read instead), whose columns verify
    and fit max_slot; else None (the records are read). The checkpoint's own CRC is not
    read here: damage to its body alone (bit rot under an intact header, mtime and
    image) costs the keys of those records at the next checkpoint (their tags do not
    match: left out, misses), and `aiokv inspect`, which reads the records, reports it.
    (Table, its generation, its MARK, the checkpoint's bytes) or None."""
    try:
        head = os.pread(fd, fmt.FILE_HDR_BYTES, 0)
        gen, count, _ = fmt.unpack_file_header(head, fmt.CKPT_MAGIC)
        ifd = os.open(fmt.INDEX_NAME, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except (OSError, fmt.BadBlock):
        return None
    try:
        igen, icount, slots, crcs, ident = fmt.unpack_index_header(os.pread(ifd, fmt.INDEX_HDR_BYTES, 0))
        offs = fmt.index_offsets(slots)
        st = os.fstat(fd)
        if (
            (igen, icount) != (gen, count)
            or ident != (st.st_ino, st.st_mtime_ns, st.st_size)  # the checkpoint changed since
            or slots > max_slot
            or os.fstat(ifd).st_size < offs[-1] + slots
        ):
            return None
        t = Table(slots)
        for (name, _), off, crc in zip(fmt.INDEX_COLUMNS, offs, crcs):
            col = memoryview(getattr(t, name).view(np.uint8))
            done = 0
            while done < len(col):
                r = os.preadv(ifd, [col[done:]], off + done)
                if r <= 0:
                    return None
                done += r
            if _native.crc32c_bytes(col) != crc:
                return None
    except (OSError, fmt.BadBlock):
        return None
    finally:
        os.close(ifd)
    live = t.live()
    if len(live) != count:
        return None
    t.count = count
    t.hash = np.zeros(hash_size(count), np.uint32)
    t._bind()
    t.probe.build(live.astype(np.uint64))
    t.recount()
    return t, gen, fmt.file_header_mark(head), fmt.FILE_HDR_BYTES + count * fmt.REC_BYTES
