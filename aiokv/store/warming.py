# SPDX-License-Identifier: Apache-2.0
"""The store's side of `aiokv warm` (aiokv/ops/warm.py): the drives opened as an engine of each
directory, where a key is placed, whether a drive has room for one more block without evicting,
where its slot images go, and its label; for blocks copied in from the fleet's bucket rather
than saved by an engine's workers.

Room: a free slot of the namespace for each block in flight, or room for all of them under the
capacity and on the file system (HEADROOM left to it: a full file system would make the store
evict, space.py). The warm evicts nothing.

Threading: the caller's thread (the CLI's asyncio loop), as the Drives' owner; `slot_files`
is read there and handed to the write threads.
"""

from __future__ import annotations

import os

from aiokv.store.drives import DriveNamespace, Drives, open_drives, place
from aiokv.store.meta import ns_dir
from aiokv.store.namespace import Namespace
from aiokv.store.space import HEADROOM
from aiokv.store.store import Store

OPEN_TIMEOUT = 60.0  # seconds the drives may take to open


def open_for_warm(paths: list[str], capacity: int, secret: str | None) -> Drives:
    """Every directory's Store (the lowest free engine number of each; capacity shared by the
    drives); OSError if none opens."""
    drives, _ = open_drives(paths, lambda p, n: (Store(p, capacity=capacity // n, secret=secret), []), OPEN_TIMEOUT)
    return drives


def engine(drives: Drives) -> int:
    """The engine number the warm holds (its first live drive's)."""
    return drives.stores[drives.live[0]].engine


def described(drives: Drives, nsid: bytes) -> Namespace | None:
    """A namespace as a directory already describes it (payload_bytes, ranks, fields), or None."""
    return next((s.index.namespaces[nsid] for _, _, s in drives.drives() if nsid in s.index.namespaces), None)


def stored(ns: DriveNamespace, key: bytes) -> bool:
    """Whether a drive holds the key's block, committed."""
    return ns.has(key)


def held(ns: DriveNamespace, key: bytes) -> bool:
    """Whether a drive holds the key's block, committed or reserved."""
    return ns.has(key) or ns.reserved(key)


def placed(drives: Drives, key: bytes) -> int:
    """The drive a key is saved on."""
    return place(key, drives.seeds, drives.live)


def room_for(drives: Drives, d: int, ns: DriveNamespace, blocks: int, more_bytes: int) -> bool:
    """Whether drive d takes one more block of ns beside `blocks` of ns and `more_bytes` of any
    namespace in flight there, without evicting anything (see above)."""
    st, part = drives.stores[d], ns.on[d]
    if len(part.alloc.free) > blocks:
        return True
    need = part.slot_cost + more_bytes
    lim = st.space.limit
    if lim is not None and lim - st.space.used() < need:
        return False
    fs = os.statvfs(st.root)
    return fs.f_bavail * fs.f_frsize - HEADROOM >= need


def slot_files(drives: Drives, d: int, nsid: bytes) -> tuple[str, int]:
    """(the namespace's directory on drive d, our engine number there): where the slots that
    drive reserves for us are (data/slotimages.py writes them)."""
    st = drives.stores[d]
    return ns_dir(st.root, nsid), st.engine


def label(drives: Drives, d: int, nsid: bytes, key: bytes, text: bytes) -> None:
    """A block's label (its KV events' description) appended to our labels file on drive d."""
    drives.stores[d].labels.append(nsid, [(key, text)])
