# SPDX-License-Identifier: Apache-2.0
"""Whole slot images written byte for byte: blocks that come stamped and verified from elsewhere
(`aiokv warm`: the fleet's bucket objects, checked by format.check_slot), written to the slot a
store reserved in an engine's data files of a namespace, one file per rank, opened once through
the one data-file opener (slotfile.py: no symlink followed, O_DIRECT where the file system has
it: the images are page-aligned). Nothing is stamped here: the header, CRC and MAC are the
image's own, and the tenant its header names.

Threading contract: `write` runs on worker threads (asyncio.to_thread), each on its own block's
slot and buffers; the files are opened there at first use and closed by `close` once no write
is left (the owner's thread).
"""

from __future__ import annotations

import errno
import os

from aiokv.data import format as fmt
from aiokv.data.slotfile import open_data_file, open_engine_dir


class SlotImages:
    def __init__(self):
        self._fds: dict[tuple[str, int, int], int] = {}  # (namespace directory, engine, rank) -> fd

    def _fd(self, ns_dir: str, engine: int, rank: int) -> int:
        fd = self._fds.get((ns_dir, engine, rank))
        if fd is None:
            dfd = open_engine_dir(ns_dir, engine)
            try:
                fd = open_data_file(dfd, rank, write=True, create=True, direct=True)[0]
            finally:
                os.close(dfd)
            self._fds[(ns_dir, engine, rank)] = fd
        return fd

    def write(self, ns_dir: str, engine: int, where: int, images, slot_bytes: int) -> None:
        """Each rank's image (images[rank], slot_bytes long, aligned) to the slot of location
        `where` (format.loc) in engine's data file of that rank; OSError for a failed or short write."""
        slot = where & fmt.SLOT_MASK
        for rank, buf in enumerate(images):
            n = os.pwrite(self._fd(ns_dir, engine, rank), buf, slot * slot_bytes)
            if n != slot_bytes:
                raise OSError(errno.EIO, f"short write ({n} of {slot_bytes} bytes)")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
