# SPDX-License-Identifier: Apache-2.0
"""Data files and slots, for every reader and writer of them: the one opener of a
data file (`open_data_file`, in an engine's directory opened by
`open_engine_dir`), the one check of a slot's bytes (`check_slot`: the on-disk
format's rules, format.check_slot: the native slot check, the MAC with a
secret among them; BlockIO checks a batch by the same check, format.verify_slots) and the one
slot reader of an open file (`read_slot`). BlockIO (blockio.py, the workers'
data path), the store's scan and verify (aiokv/store/scan.py) and `aiokv inspect
--verify` go through them; the file's name is format.data_file.

Threading contract: plain functions, any thread (they block: the store calls
them on its I/O thread, BlockIO on a thread of its own for opens).
"""

from __future__ import annotations

import errno
import os

from aiokv.data import format as fmt
from aiokv.data.backend import say_once
from aiokv.data.dirs import FILE_FLAGS, open_under


def open_data_file(
    dir_fd: int, rank: int, write: bool = False, create: bool = False, direct: bool = False, where: str | None = None
) -> tuple[int, bool]:
    """The one opener of a data file (BlockIO, the store, inspect): rank's file in
    the engine directory dir_fd, never through a symlink, read-only or (write)
    read-write, created 0600 if `create`. direct: with O_DIRECT, buffered where the
    file system lacks it (said once, naming `where`, if given). Returns (fd,
    whether it is O_DIRECT)."""
    flags = (os.O_RDWR | (os.O_CREAT if create else 0) if write else os.O_RDONLY) | FILE_FLAGS
    name = fmt.data_file(rank)
    if direct:
        try:
            return os.open(name, flags | os.O_DIRECT, 0o600, dir_fd=dir_fd), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        if where is not None:
            say_once(f"aiokv: {where} does not support O_DIRECT; using buffered I/O there")
    return os.open(name, flags, 0o600, dir_fd=dir_fd), False


def open_engine_dir(ns_dir: str, engine: int = 0) -> int:
    """Engine's directory in the namespace directory ns_dir (ROOT/ns/<nsid hex>):
    every directory from ROOT down opened without following a symlink (dirs.py)."""
    root = os.path.dirname(os.path.dirname(ns_dir))
    sub = fmt.engine_dir(engine)
    return open_under(root, "ns", os.path.basename(ns_dir), *([sub] if sub else []))


def data_path(ns_dir: str, rank: int, engine: int = 0) -> str:
    return os.path.join(ns_dir, fmt.engine_dir(engine), fmt.data_file(rank))


# The one check of a slot's bytes, for every reader (BlockIO, the bucket tier through
# BlockIO.verify, the store's scan and verify, inspect): format.check_slot (the native
# check: header, then payload CRC32C; with a secret's key the MAC too; a batch of
# staging buffers: format.verify_slots, the same check).
check_slot = fmt.check_slot


def read_slot(
    fd: int, slot: int, nsid: bytes, rank: int, payload_bytes: int, key: bytes | None = None, header_only: bool = False
) -> dict:
    """The one slot reader of an open data file (pread, any thread): slot `slot`,
    checked by check_slot, or with header_only its header alone
    (format.check_header). Returns the header; raises BadBlock (a short read too)
    or OSError."""
    sb = fmt.slot_bytes(payload_bytes)
    if header_only:
        return fmt.check_header(os.pread(fd, fmt.TENANT_END, slot * sb), nsid, rank, payload_bytes, key)
    raw = os.pread(fd, sb, slot * sb)
    if len(raw) != sb:
        raise fmt.BadBlock("short read (data file truncated)")
    return check_slot(raw, nsid, rank, payload_bytes, key)
