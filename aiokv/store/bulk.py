# SPDX-License-Identifier: Apache-2.0
"""An operator's order (aiokv clear, pin, unpin: control.py) applied to a table in bulk.

No Python object per block: the blocks an order is for are found a window of slots at a time
(`select`: aiokv._index.select, one pass over the window's columns), forgotten (`clear_slots`:
aiokv._index.erase, their hash entries removed and columns zeroed) or their PINNED flag changed
(`flag_slots`) with numpy, and the journal records that say so are made in bulk (`free_records`,
`flags_records`: 64 bytes each, CRC32C sealed in C). A table whose every block a clear is for is
emptied at once (`empty`: new zeroed columns, the old tags handed back).

`apply_to_files` applies the orders past a journal's MARK to a table no other thread sees yet:
our own at opening (the loader thread's, or the opener's), a dead engine's that we hold for
reclaim (the store's I/O thread: reclaim.py). Records go first, in writes of at most CHUNK
records, and the table changes after each write: a write that fails leaves both as they were,
and the order (its MARK never written) to the next opener. The owner's thread applies orders
to the tables it serves from in bounded steps instead (applying.py).

Threading contract: functions of their arguments; a table is changed by the one thread that
owns it (table.py).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store.table import PINNED, Table

CHUNK = 1 << 16  # records made and written at a time (4 MiB)
ALL = np.zeros(0, np.uint8)  # a tenant mask naming every tenant


@dataclasses.dataclass(frozen=True)
class Filter:
    """Which blocks of a table an order is for (aiokv._index.select's arguments)."""

    op: str
    tenants: np.ndarray  # uint8 per tenant id: 1 = its blocks (ALL: every tenant's)
    below: int = 0  # blocks last used before this time (ns) only; 0: any
    fmask: int = 0
    fwant: int = 0


def filter_of(order, tenants: np.ndarray, written_before: bool = False) -> Filter:
    """The filter of an order, its tenants given as a mask over the table's tenant ids (ALL for
    an order naming none); written_before: only blocks last used at or before its time (an index
    rebuilt from the slot headers: control.py)."""
    below = order.before or 0
    if written_before:
        below = min(below, order.time + 1) if below else order.time + 1
    if order.op == "clear":
        return Filter("clear", tenants, below)
    return Filter(order.op, tenants, below, PINNED, 0 if order.op == "pin" else PINNED)


def tenant_mask(ids) -> np.ndarray:
    """A mask over tenant ids naming exactly these (none: a mask naming no tenant)."""
    ids = np.asarray(sorted(ids), np.int64)
    mask = np.zeros(int(ids.max()) + 1 if len(ids) else 1, np.uint8)
    mask[ids] = 1
    return mask


def covers(table: Table, f: Filter) -> bool:
    """Whether a clear is for every block of the table."""
    if f.op != "clear" or f.below or not table.count:
        return False
    if not len(f.tenants):
        return True
    held = np.flatnonzero(table.tenant_blocks)
    return bool(np.all(held < len(f.tenants)) and np.all(f.tenants[held[held < len(f.tenants)]]))


def select(table: Table, f: Filter, lo: int, hi: int, limit: int) -> tuple[np.ndarray, int]:
    """(the slots in [lo, hi) the filter lets through, at most `limit`, ascending; the first
    slot not looked at)."""
    out = np.empty(max(0, min(limit, hi - lo)), np.int64)
    if not len(out):
        return out, lo
    n, nxt = _index.select(
        table.tag, table.atime, table.tenant, table.flags, lo, hi, f.tenants, f.below, f.fmask, f.fwant, out
    )
    return out[:n], nxt


def clear_slots(table: Table, slots: np.ndarray) -> np.ndarray:
    """Forget the blocks in these slots (each holding one); returns their tags."""
    tags = table.tag[slots]
    tenants, flags = table.tenant[slots], table.flags[slots]
    table.count -= _index.erase(table.tag, table.atime, table.tenant, table.flags, table.hash, slots)
    table.count_blocks(tenants, flags, -1)
    table.changed(slots)  # (out of the eviction order)
    return tags


def flag_slots(table: Table, slots: np.ndarray, pin: bool) -> np.ndarray:
    """Pin (or unpin) the blocks in these slots (each holding one, unpinned or pinned as asked);
    returns their flags now."""
    flags = table.flags[slots] | PINNED if pin else table.flags[slots] & ~np.uint8(PINNED)
    table.flags[slots] = flags
    table.pinned += len(slots) if pin else -len(slots)
    table.count_pins(table.tenant[slots], 1 if pin else -1)
    table.changed(slots)  # (out of the eviction order, or back at its place)
    return flags


def empty(table: Table) -> tuple[np.ndarray, list]:
    """Forget every block at once (new zeroed columns: the old ones are never changed again, so
    a reader keeps what it took); returns the old tags (0 where no block was) and the other old
    columns (for the caller to let go where freeing tens of MB does not stall it)."""
    old = table.tag
    rest = [table.atime, table.tenant, table.flags, table.hash]
    n = len(old)
    table.tag, table.atime = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    table.tenant, table.flags = np.zeros(n, np.uint16), np.zeros(n, np.uint8)
    table.hash = np.zeros(len(table.hash), np.uint32)
    table.count, table.pinned = 0, 0
    table.tenant_blocks = np.zeros(len(table.tenant_blocks), np.int64)
    table.tenant_pinned = np.zeros(len(table.tenant_pinned), np.int64)
    table._bind()
    table.emptied()
    return old, rest


def _records(kind: int, slots: np.ndarray, tags: np.ndarray, flags=None) -> bytearray:
    """Records made and sealed in C, the GIL released (the I/O thread makes them while the
    scheduler's thread steps)."""
    out = bytearray(len(slots) * fmt.REC_BYTES)
    flags = b"" if flags is None else np.ascontiguousarray(flags, np.uint8)
    _index.records(
        kind, fmt.MIN_KEY, np.ascontiguousarray(slots, np.int64), np.ascontiguousarray(tags, np.uint64), flags, out
    )
    _index.seal(out, fmt.REC_BYTES)
    return out


def free_records(slots: np.ndarray, tags: np.ndarray) -> bytearray:
    """FREE records (format.pack_free) of these blocks, end to end."""
    return _records(fmt.REC_FREE, slots, tags)


def flags_records(slots: np.ndarray, tags: np.ndarray, flags: np.ndarray) -> bytearray:
    """FLAGS records (format.pack_flags) of these blocks, end to end."""
    return _records(fmt.REC_FLAGS, slots, tags, flags)


def runs(slots: np.ndarray) -> tuple[list[int], list[int]]:
    """(firsts, counts) of the runs of consecutive slots (ascending slots): one punch each."""
    if not len(slots):
        return [], []
    cut = np.flatnonzero(np.diff(slots) != 1) + 1
    firsts = np.concatenate([slots[:1], slots[cut]])
    lasts = np.concatenate([slots[cut - 1], slots[-1:]])
    return firsts.tolist(), (lasts - firsts + 1).tolist()


def apply_to_files(nsid: bytes, table: Table, log, orders, mask_of, written_before=False, room=None, punch=None) -> int:
    """The orders past log.mark applied to a table no other thread sees yet, whose journal is
    `log` (an IndexLog we own): blocks cleared (FREE records, then punch(slots) if given) or
    pinned or unpinned (FLAGS records), then a MARK. mask_of(order): its tenants as a mask over
    the table's ids (tenant_mask; ALL); room: blocks that may still be pinned (None: no bound).
    Raises what a write raises (the table then as its files say). Returns the blocks changed."""
    todo = [o for o in orders if o.number > log.mark]
    if not todo:
        return 0
    changed = 0
    for order in todo:
        if not order.for_ns(nsid):
            continue
        f = filter_of(order, mask_of(order), written_before)
        lo, end = 0, table.slots
        while lo < end and not (order.op == "pin" and room is not None and room <= 0):
            slots, lo = select(table, f, lo, end, CHUNK if room is None or order.op != "pin" else min(CHUNK, room))
            if not len(slots):
                continue
            tags = table.tag[slots]
            if order.op == "clear":
                log.append(free_records(slots, tags))
                clear_slots(table, slots)
                if punch is not None:
                    punch(slots)
            else:
                flags = table.flags[slots] ^ np.uint8(PINNED)
                log.append(flags_records(slots, tags, flags))
                flag_slots(table, slots, order.op == "pin")
                room = None if room is None or order.op != "pin" else room - len(slots)
            changed += len(slots)
    log.append(fmt.pack_mark(todo[-1].number, time.time_ns()), mark=todo[-1].number)
    return changed
