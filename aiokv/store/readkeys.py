# SPDX-License-Identifier: Apache-2.0
"""slot -> key of the blocks an engine's files name (a KeyMap), read from its checkpoint and
journal in bulk: for the views that hand out keys (tools and tests).

Threading contract: read_keys opens the files read-only on the caller's thread (the Store's
I/O thread, or a tool's) and keeps nothing.
"""

from __future__ import annotations

from aiokv.data import format as fmt
from aiokv.store.checkpoint import merged
from aiokv.store.journal import IndexLog
from aiokv.store.logrecords import KeyMap, cat, read_file


def read_keys(ns_dir: str, dir_fd: int) -> KeyMap:
    """slot -> key (a KeyMap) of the blocks an engine's files (checkpoint, journal) name,
    read-only: for the views that hand out keys (tools and tests), in bulk."""
    log = IndexLog(ns_dir, dir_fd, readonly=True)
    try:
        table = log.load_table(1 << 32)
    except fmt.BadBlock:
        return KeyMap()
    raw = read_file(log._journal_name(log.gen), dir_fd) or b""
    raw = raw[fmt.FILE_HDR_BYTES : log.size] if log.size else b""
    parts = [r for r in merged(table, dir_fd, raw) if len(r)]
    return KeyMap(cat(parts) if parts else None)
