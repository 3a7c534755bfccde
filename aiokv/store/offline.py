# SPDX-License-Identifier: Apache-2.0
"""The operators' orders (control.py) and the engines' files, seen from outside the engines:
applied to the files of an engine that is not running, and read back from an engine's files
(the MARK that says which orders it applied). For aiokv/ops/orders.py (`aiokv clear`, `pin`,
`unpin`).

`apply_orders(root, engine)`: the engine's lock taken (as reclaim.py does; StoreLocked if it
runs), its files opened as their owner, every namespace's index read, which applies the orders
past its MARK at once (control.py's `apply_loaded`: bulk.py's records, then the table), and a
checkpoint written as it closes. `applied_mark(root, nsid, engine)`: the highest order an
engine's files of a namespace say it applied (its checkpoint's header, its journals' MARK
records), without a lock, beside the running engine.

Threading: the caller's thread (the CLI's); the Store opened has no I/O thread and is closed
before the call returns.
"""

from __future__ import annotations

import os

from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS, open_dir
from aiokv.store.lock import StoreLocked
from aiokv.store.logrecords import marks, parse_records
from aiokv.store.meta import ns_dir
from aiokv.store.store import Store


def apply_orders(root: str, engine: int) -> bool:
    """Every order in DIR/control past each namespace's MARK applied to the files of `engine`,
    which is not running (see above); False if it runs (its lock is held: it applies them
    itself)."""
    try:
        st = Store(root, engine=engine)  # (each namespace's index read: the orders past its MARK applied)
    except StoreLocked:
        return False
    st.close(checkpoint=True)
    return True


def applied_mark(root: str, nsid: bytes, engine: int) -> int | None:
    """The control orders an engine's files of a namespace say it applied (its checkpoint's
    header, its journal's MARKs); None if it has no journal there (it does not know the namespace)."""
    d = os.path.join(ns_dir(root, nsid), fmt.engine_dir(engine)).rstrip("/")
    try:
        fd = open_dir(d)
    except OSError:
        return None
    try:
        mark, journal = 0, False
        for name in sorted(os.listdir(fd)):
            if name != "checkpoint" and not name.startswith("journal."):
                continue
            try:
                f = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=fd)
            except OSError:
                continue
            try:
                if name == "checkpoint":
                    mark = max(mark, fmt.file_header_mark(os.pread(f, fmt.FILE_HDR_BYTES, 0)))
                else:
                    journal = True
                    recs, _ = parse_records(os.pread(f, 1 << 30, fmt.FILE_HDR_BYTES))
                    mark = max(mark, marks(recs))
            finally:
                os.close(f)
        return mark if journal else None
    finally:
        os.close(fd)
