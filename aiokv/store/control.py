# SPDX-License-Identifier: Apache-2.0
"""The operators' orders to a live directory: clear, pin, unpin (issue 34).

`aiokv clear`, `aiokv pin` and `aiokv unpin` (aiokv/cli/operate.py) do not touch an engine's
files while it runs (each engine writes only its own): they append an **order** to DIR/control
(format.py: numbered records, written and synced under an flock of the file), and every engine
applies it at its next look at the other engines (following.py: every 0.1 s, on the I/O thread;
the owner applies it at its next refresh or lookup):

- to its own blocks of each namespace the order names: a clear forgets them (FREE records), a
  pin or unpin changes their flags (FLAGS records); then a MARK record says the order is
  applied to that namespace. All of a namespace's records of one order and its MARK go in one
  journal write: after a kill -9 either all of them are in the journal or none is, and an order
  past a namespace's MARK is applied (again) when the index is next installed. A clear's slots
  are punched (their space is given back) once the records are queued;
- to its view of the other engines' blocks: a clear stops serving them at once (as if their
  owner had freed them, which it does at its own next look), and, when an engine's files are
  replayed whole, its blocks that its MARK says it has not cleared yet are left out again;
- pins last: new blocks of a pinned tenant are committed pinned (`pinned`).

An engine that is not running applies nothing: `aiokv clear` opens such an engine's files as
their owner (taking its lock, as reclaim.py does) and applies the order there, so a dead
engine's blocks go too; an engine that adopts those files later applies what its MARK has not.
A namespace whose index was rebuilt from the slot headers (its MARK lost with it) is given the
clears again, to the blocks written before each (their access time is then their write time).

`Control` is the owner's (the Store's thread): the orders read so far and the pins they leave;
`read_io` runs on the I/O thread (where there is one) and keeps its own read position.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import os
import pwd
import time

import numpy as np

from aiokv.data import format as fmt
from aiokv.store.table import PINNED

log = logging.getLogger("aiokv")
O_FLAGS = os.O_CLOEXEC | os.O_NOFOLLOW
OPS = ("clear", "pin", "unpin")
LOCK_WAIT = 30.0  # seconds a writer waits for another one appending


@dataclasses.dataclass(frozen=True)
class Order:
    number: int
    time: int  # ns since the epoch
    op: str  # clear | pin | unpin
    nsids: frozenset | None = None  # the namespaces it is for (None: all)
    tenants: frozenset | None = None  # the tenants' tags it is for (None: all; a clear only)
    before: int | None = None  # a clear: blocks last used before this time only (--older-than)

    def body(self) -> bytes:
        return json.dumps(
            {
                "op": self.op,
                "ns": None if self.nsids is None else sorted(n.hex() for n in self.nsids),
                "tenants": None if self.tenants is None else sorted(t.hex() for t in self.tenants),
                "before": self.before,
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, number: int, when: int, body: bytes) -> Order | None:
        """An order from its record; None if it does not make sense (skipped: applied as nothing)."""
        try:
            d = json.loads(body)
            op, ns, tenants, before = d["op"], d.get("ns"), d.get("tenants"), d.get("before")
            if op not in OPS or (op != "clear" and tenants is None):
                return None
            nsids = None if ns is None else frozenset(bytes.fromhex(n) for n in ns)
            tags = None if tenants is None else frozenset(bytes.fromhex(t) for t in tenants)
            if tags is not None and any(len(t) != fmt.TENANT_TAG_BYTES for t in tags):
                return None
            if before is not None and type(before) is not int:
                return None
            return cls(number, when, op, nsids, tags, before)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    def for_ns(self, nsid: bytes) -> bool:
        return self.nsids is None or nsid in self.nsids


def read_orders(root_fd: int, start: int = 0, after: int = 0) -> tuple[list[Order], int, int]:
    """(orders past number `after` read from byte `start` of DIR/control (0: from its header),
    the byte offset read to, the last number seen); none if there is no file."""
    try:
        fd = os.open(fmt.CONTROL_NAME, os.O_RDONLY | O_FLAGS, dir_fd=root_fd)
    except FileNotFoundError:
        return [], start, after
    try:
        if start == 0:
            try:
                fmt.unpack_file_header(os.pread(fd, fmt.FILE_HDR_BYTES, 0), fmt.CONTROL_MAGIC)
            except fmt.BadBlock:
                return [], 0, after
            start = fmt.FILE_HDR_BYTES
        buf = os.pread(fd, fmt.MAX_CONTROL, start)
    finally:
        os.close(fd)
    out, last = [], after
    it = fmt.iter_orders(buf, after)
    while True:
        try:
            number, when, body = next(it)
        except StopIteration as stop:
            return out, start + stop.value, last
        last = number
        order = Order.parse(number, when, body)
        if order is not None:
            out.append(order)
        else:
            log.warning("aiokv: control order %d of the cache directory makes no sense here; it is skipped", number)


def unreadable(root: str, e: OSError) -> str:
    """What an engine says once when DIR/control does not read (and the fix)."""
    path = os.path.join(root, fmt.CONTROL_NAME)
    fix = "; read again at every look"
    if e.errno in (errno.EACCES, errno.EPERM):
        try:
            user = pwd.getpwuid(os.geteuid()).pw_name
        except KeyError:
            user = str(os.geteuid())
        fix = f" (it is not this engine's user's); run: chown {user} {path}"
    return (
        f"the control file {path} cannot be read ({os.strerror(e.errno or 0)}): this engine applies no "
        f"aiokv clear, pin or unpin until it can, and follows the other engines meanwhile{fix}"
    )


def append_order(root_fd: int, op: str, nsids=None, tenants=None, before: int | None = None) -> Order:
    """Append an order to DIR/control (created if missing) and sync it: under an flock of the
    file, a torn tail (a writer killed mid-append) cut off first. Returns the order written."""
    fd = os.open(fmt.CONTROL_NAME, os.O_RDWR | os.O_CREAT | O_FLAGS, 0o600, dir_fd=root_fd)
    try:
        end = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise OSError(errno.EBUSY, "another aiokv command holds the control file") from None
                time.sleep(0.02)
        size = os.fstat(fd).st_size
        head = os.pread(fd, fmt.FILE_HDR_BYTES, 0)
        try:
            fmt.unpack_file_header(head, fmt.CONTROL_MAGIC)
            ok = True
        except fmt.BadBlock:
            ok = False
        if not ok:
            if size >= fmt.FILE_HDR_BYTES:
                raise OSError(errno.EBADMSG, "DIR/control is not an aiokv control file; move it away")
            os.ftruncate(fd, 0)
            os.pwrite(fd, fmt.pack_file_header(fmt.CONTROL_MAGIC, 0), 0)
            os.fsync(fd)
            os.fsync(root_fd)  # (its name survives a power cut)
            size = fmt.FILE_HDR_BYTES
        buf = os.pread(fd, max(size - fmt.FILE_HDR_BYTES, 0), fmt.FILE_HDR_BYTES)
        last, it = 0, fmt.iter_orders(buf)
        while True:
            try:
                last = next(it)[0]
            except StopIteration as stop:
                valid = fmt.FILE_HDR_BYTES + stop.value
                break
        if valid < size:
            os.ftruncate(fd, valid)  # a torn tail: never behind our record
        order = Order(
            last + 1,
            time.time_ns(),
            op,
            None if nsids is None else frozenset(nsids),
            None if tenants is None else frozenset(tenants),
            before,
        )
        rec = fmt.pack_order(order.number, order.time, order.body())
        os.pwrite(fd, rec, valid)
        os.fsync(fd)
        return order
    finally:
        os.close(fd)


class Control:
    def __init__(self, dirs, index, tenants, space, persist, stats, may_pin):
        self.dirs, self.index, self.tenants, self.space = dirs, index, tenants, space
        self.persist, self.stats, self.may_pin = persist, stats, may_pin
        self.orders: list[Order] = []
        self.last = 0  # the number of the last order read
        self._off, self._seen = 0, 0  # the I/O thread's read position (bytes, last number)
        self._unreadable: int | None = None  # the I/O thread's: errno of the last failed read (said once)
        self.opened = time.time_ns()  # orders older than this were in the file when the store opened
        self.blind = False  # the file did not read at opening: the orders in it then are not known yet (take)
        self._pins: dict[tuple[bytes, bytes], bool] = {}  # (nsid, tenant tag) -> pinned (memo)

    # ---- reading (the I/O thread's, or the opener's) ----
    def read_io(self) -> list[Order] | None:
        """Orders appended since the last read, or None. Never raises for the file: one this
        engine cannot read (another user's, EIO) is said once and read again at the next look,
        from the same place (the position moves only with a read that succeeded)."""
        try:
            if os.stat(fmt.CONTROL_NAME, dir_fd=self.dirs.root_fd, follow_symlinks=False).st_size <= self._off:
                return None
            got, off, seen = read_orders(self.dirs.root_fd, self._off, self._seen)
        except FileNotFoundError:
            return None
        except OSError as e:
            if self._unreadable != e.errno:
                self._unreadable = e.errno
                log.warning("aiokv: %s", unreadable(self.dirs.root, e))
            return None
        self._off, self._seen, self._unreadable = off, seen, None
        return got or None

    # ---- the owner's ----
    def take(self, orders: list[Order] | None) -> None:
        """New orders: kept, and applied to every namespace whose index is in place."""
        if not orders:
            return
        # the first orders read after an opening that could not read the file: those older than the
        # opening were in it then, and are taken as if read at opening: not applied to our view of
        # the other engines' blocks, and a clear or unpin to ours only to blocks written before each
        old = set()
        if self.blind:
            self.blind = False
            old = {o.number for o in orders if o.time < self.opened}
        self.orders += orders
        self.last = max(self.last, orders[-1].number)
        self._pins.clear()
        new = [o for o in orders if o.number not in old]
        for ns in list(self.index.namespaces.values()):
            self.view(ns, new)
            if ns.engine is not None and ns.ready:
                self.catch_up(ns, old)

    def pending(self, mark: int) -> list[Order]:
        return [o for o in self.orders if o.number > mark]

    def pinned(self, nsid: bytes, tag: bytes) -> bool:
        """Whether the orders leave a tenant's blocks of a namespace pinned (the last pin or
        unpin that names them decides)."""
        k = (nsid, tag)
        got = self._pins.get(k)
        if got is None:
            got = False
            for o in self.orders:
                if o.op != "clear" and o.for_ns(nsid) and tag in o.tenants:
                    got = o.op == "pin"
            self._pins[k] = got
        return got

    def _ids(self, order: Order) -> np.ndarray | None:
        """The store's ids of the order's tenants (None: every tenant; a tenant without an id
        here holds no block here: registered by nothing)."""
        if order.tenants is None:
            return None
        return np.array(sorted({self.tenants.lookup(t) for t in order.tenants} - {None}), np.uint16)

    def _matching(self, table, order: Order, written_before: bool = False) -> np.ndarray:
        """The slots of a table's blocks an order is for."""
        live = table.live()
        ok = np.ones(len(live), bool)
        ids = self._ids(order)
        if ids is not None:
            ok &= np.isin(table.tenant[live], ids)
        if order.before is not None:
            ok &= table.atime[live] < order.before
        if written_before:
            ok &= table.atime[live] <= order.time
        if order.op == "pin":
            ok &= (table.flags[live] & PINNED) == 0
        elif order.op == "unpin":
            ok &= (table.flags[live] & PINNED) != 0
        return live[ok]

    def catch_up(self, ns, old=frozenset()) -> None:
        """Our own blocks of ns given the orders past its MARK (at install, and as orders come;
        old: numbers of orders applied to the blocks written before each only, as `take` says)."""
        todo = [o for o in self.orders if o.number > ns.mark]
        if not todo or self.dirs.readonly:
            return
        recs, punch = [], []
        for order in todo:
            if not order.for_ns(ns.nsid):
                continue
            t = ns.table
            # (an old pin: as if read at opening, our blocks since would have been committed pinned)
            late = order.number in old and order.op != "pin"
            slots = self._matching(t, order, written_before=ns.rebuilt or late)
            if order.op == "clear":
                for s in slots.tolist():
                    tag = self.index.remove_slot(ns, s)
                    recs.append(fmt.pack_free(s, tag))
                    punch.append(s)
                self.stats.cleared += len(slots)
                if len(slots):
                    log.info(
                        "aiokv: control order %d cleared %d block(s) of namespace %s",
                        order.number,
                        len(slots),
                        ns.hex[:12],
                    )
            else:
                for s in slots.tolist():
                    if order.op == "pin" and not self.may_pin(ns, 1, int(t.tenant[s])):
                        break
                    t.set_flags(s, int(t.flags[s]) ^ PINNED)
                    recs.append(fmt.pack_flags(s, t.tag_at(s), int(t.flags[s])))
        mark = todo[-1].number
        recs.append(fmt.pack_mark(mark, time.time_ns()))
        ns.mark = mark
        self.persist.append(ns, b"".join(recs), mark=mark)
        for s in punch:
            self.space._unback(ns, s)  # (its space given back; the slot is reused once punched)

    def view(self, ns, orders: list[Order]) -> None:
        """The other engines' blocks these clears are for stop being served here (their owners
        free them at their next look)."""
        for order in orders:
            if order.op != "clear" or not order.for_ns(ns.nsid):
                continue
            for e in list(ns.tables):
                slots = self._matching(ns.tables[e], order)
                for s in slots.tolist():
                    ns.peer_free(e, s)
                self.stats.cleared += len(slots)

    def filter_peer(self, ns, table, mark: int) -> None:
        """Another engine's blocks replayed whole from its files (a Table whose tenant ids are
        ours): those that the clears past its MARK are for, left out."""
        for order in self.orders:
            if order.number > mark and order.op == "clear" and order.for_ns(ns.nsid):
                for s in self._matching(table, order).tolist():
                    table.clear(s)
