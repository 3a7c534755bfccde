# SPDX-License-Identifier: Apache-2.0
"""Space: the capacity and what the directory takes on disk, growing data files
(fallocate) for new slots, punching the slots given back, eviction choice, and
the limit lowered while the disk is full.

`Space` owns the capacity and limit, our data files' descriptors, the bytes
being punched and the grows in flight; it is handed the directories (meta.py),
the index, the I/O thread, the stats, our journals (persist.py: their bytes,
and the DROPs of evictions) and the other engines' bytes (following.py's
`peer_bytes`, read only).

Several engines: `used` counts every engine's files; over the capacity each
engine evicts its own blocks while they are the directory's oldest, and an
engine short of room whose blocks are newer than another's may overshoot by
capacity / SHARE_SLACK meanwhile.

On a file system that cannot punch holes (EOPNOTSUPP: ramfs, NFSv3) nothing given
back frees a byte: after the first refusal (`punch_refused`, said once; probed
before a loaded index is installed) no space is given back and no block is evicted
for it; the slots held are reused.

Threading contract: the decisions (`grow`, `_shrink_to`, `evict`,
`make_room`, `_regain_space`) run on the owner's thread and change only
in-memory state there; their file-system halves (`_grow_io`, `_punch`,
`fallocate`, the free-space check) are submitted to the store's I/O thread
(fsthread.py), or run at once without one, and their outcomes are applied on
the owner's thread at its next poll.
"""

from __future__ import annotations

import errno
import logging
import os
import time

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.slotfile import open_data_file
from aiokv.store import bulk
from aiokv.store.namespace import Namespace
from aiokv.store.reclaim import PUNCH

GROW_BYTES = 64 << 20  # disk space is reserved for new slots this much at a time
HEADROOM = 4 << 20  # left to the file system (journal, other users) when the disk is full
SHARE_SLACK = 16  # overshoot allowed while another engine holds older blocks: capacity / this
GROW_AHEAD = 16  # free slots left when a grow for more starts (io_thread)
log = logging.getLogger("aiokv")


class Space:
    def __init__(self, capacity: int | None, dirs, index, fs, stats, persist, peer_bytes: dict):
        self.capacity = capacity
        self.limit = capacity  # the capacity, or lower while the disk is full
        self.check_interval = 1.0  # seconds between free-space checks while lowered
        self._checked = 0.0
        self.dirs, self.index, self.fs, self.stats, self.persist = dirs, index, fs, stats, persist
        self._peer_bytes = peer_bytes  # (nsid, engine) -> bytes its files take: following.py's
        self._rank_fds: dict[tuple[bytes, int], int] = {}
        self._punching = 0  # bytes of slots queued for punching (not counted as used)
        self._growing: dict[bytes, object] = {}  # nsid -> the grow in flight
        # the file system refused a punch as unsupported (ramfs: EOPNOTSUPP): no space can be given
        # back, so none is tried (set once, by whichever thread punched; read by the owner)
        self.punch_refused = False
        self.victims = index.victim  # which of our blocks the capacity gives up first (the store's quotas set it)

    def used(self) -> int:
        """Bytes the directory takes on disk: our backed slots (less those queued for
        punching), journals and checkpoints, and the other engines' files (as of the
        last refresh)."""
        return self.index.physical_bytes - self._punching + self.persist.disk_bytes() + sum(self._peer_bytes.values())

    @property
    def growing(self) -> int:
        """Grows in flight (namespaces whose new space is still being reserved)."""
        return len(self._growing)

    def growing_in(self, ns: Namespace) -> bool:
        """Whether a grow of this namespace is in flight."""
        return ns.nsid in self._growing

    def peers_older(self) -> bool:
        """Whether another engine holds a block older than our LRU victim (it, not
        we, should give space back)."""
        victim = self.index.victim()
        oldest = [a for a in (n.oldest_peer_atime() for n in self.index.namespaces.values()) if a is not None]
        if not oldest:
            return False
        return victim is None or min(oldest) < self.index.victim_atime(victim)

    def evict(self, ns: Namespace, slot: int, punch: bool) -> bool:
        """Forget our LRU block in `slot`; False if its space was to be punched and could not be."""
        if punch and self.punch_refused:
            return False  # (its space would stay taken: the block is kept)
        tag = self.index.remove_slot(ns, slot)
        self.persist.append(ns, [fmt.pack_free(slot, tag)])
        self.stats.evictions += 1
        if punch:
            return self._unback(ns, slot)
        ns.alloc.release(slot)
        return True

    def _unback(self, ns: Namespace, slot: int) -> bool:
        """Give an in-use slot's disk space back. Where punching fails (a file
        system without hole punching, an I/O error) the slot stays backed and
        counted, on the free list, and False says so (at once, or, with the I/O
        thread, when the punch ran: the slot is neither free nor a hole meanwhile)."""
        cost = ns.slot_cost
        self._punching += cost

        def done(ok, e):
            self._punching -= cost
            if ok:
                ns.alloc.punch(slot)
            else:
                ns.alloc.release(slot)

        op = self.fs.submit(lambda: self._punch(ns, slot), done)
        return not op.finished or bool(op.result)

    def _shrink_to(self, target: int, oldest_only: bool = False) -> None:
        """Punch free slots, then LRU blocks, until at most `target` bytes are used
        or nothing more can be given back; with oldest_only, only while our LRU
        block is the directory's oldest."""
        while self.used() > target and not self.punch_refused:
            for ns in self.index.namespaces.values():
                while ns.alloc.free and self.used() > target:  # unused backed slots go first
                    if not self._unback(ns, ns.alloc.take()):
                        return
            if self.used() <= target or (oldest_only and self.peers_older()):
                return
            victim = self.victims()
            if victim is None or not self.evict(*victim, punch=True):
                return

    def make_room(self, nbytes: int = HEADROOM) -> None:
        """Punch LRU blocks worth nbytes and cap the capacity at what remains,
        until the file system has room again (_regain_space)."""
        self._shrink_to(max(self.used() - nbytes, 0))
        self.limit = self.used()
        self._checked = time.monotonic()

    def shrink_to_limit(self) -> None:
        if self.limit is not None and self.used() > self.limit:
            self._shrink_to(self.limit, oldest_only=True)

    def _regain_space(self) -> None:
        """While a full disk holds the limit under the capacity: raise it again as
        far as the file system has room now (checked at most every check_interval)."""
        now = time.monotonic()
        if self.limit == self.capacity or now - self._checked < self.check_interval:
            return
        self._checked = now
        root_fd = self.dirs.root_fd

        def done(st, e):
            if e is not None:
                if not isinstance(e, OSError):
                    raise e
                if self.fs.inline:
                    raise e
                return
            avail = st.f_bavail * st.f_frsize - HEADROOM
            if avail <= 0 or self.limit == self.capacity:
                return
            new = self.used() + avail
            if self.capacity is None:
                self.limit = None
            elif new > self.limit:
                self.limit = min(new, self.capacity)

        self.fs.once("space", lambda: os.fstatvfs(root_fd), done)

    def rank_fd(self, ns: Namespace, rank: int) -> int:
        fd = self._rank_fds.get((ns.nsid, rank))
        if fd is None:
            fd = open_data_file(self.dirs.own_dir_fd(ns.nsid), rank, write=True, create=True)[0]
            self._rank_fds[(ns.nsid, rank)] = fd
        return fd

    def fallocate(self, ns: Namespace, mode: int, slots, ignore_errors: bool = False, punch: bool = False) -> None:
        sb = ns.slot_bytes
        runs: list[list[int]] = []  # [first, count] of consecutive slots: one call each
        for s in sorted(slots):
            if runs and runs[-1][0] + runs[-1][1] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        for rank in range(ns.ranks):
            fd = self.rank_fd(ns, rank)
            for first, count in runs:
                try:
                    _native.fallocate(fd, mode, first * sb, count * sb)
                except OSError as e:
                    if ignore_errors:
                        continue
                    if punch or e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                        raise
                    if not mode:  # no fallocate here: extend the file sparsely
                        os.ftruncate(fd, max(os.fstat(fd).st_size, (first + count) * sb))

    def cut(self, ns: Namespace, hwm: int) -> None:
        """Truncate the namespace's data files (every rank) at `hwm` slots."""
        for rank in range(ns.ranks):
            os.ftruncate(self.rank_fd(ns, rank), hwm * ns.slot_bytes)

    def punch_runs(self, ns: Namespace, slots) -> bool:
        """Punch `slots` (sorted slot numbers, an array: millions after a clear, no Python object
        each) on every rank, a call per run of consecutive ones; False if any was refused."""
        sb, runs = ns.slot_bytes, bulk.runs(slots)
        try:
            for rank in range(ns.ranks):
                fd = self.rank_fd(ns, rank)
                for first, count in zip(*runs):
                    _native.fallocate(fd, PUNCH, first * sb, count * sb)
        except OSError as e:
            self._refused(e)
            return False
        return True

    def _punch(self, ns: Namespace, slot: int) -> bool:
        """Punch one slot on every rank; False if any rank refused."""
        try:
            self.fallocate(ns, PUNCH, [slot], punch=True)
        except OSError as e:
            self._refused(e)
            return False
        return True

    def probe_punch(self, ns: Namespace) -> None:
        """Learn whether the file system can punch holes before a block is evicted for space
        (a lower capacity at start: with the I/O thread the blocks were gone before the first
        punch failed): a punch past the end of the namespace's first data file, which changes
        nothing. The loader thread's, before it hands the index over (it owns the files then)."""
        if self.punch_refused:
            return
        try:
            fd = open_data_file(self.dirs.own_dir_fd(ns.nsid), 0, write=True)[0]
        except OSError:
            return  # no data file yet: no block to lose
        try:
            _native.fallocate(fd, PUNCH, os.fstat(fd).st_size + ns.slot_bytes, ns.slot_bytes)
        except OSError as e:
            self._refused(e)
        finally:
            os.close(fd)

    def _refused(self, e: OSError) -> None:
        """A punch failed: where the file system cannot punch at all, no more is tried."""
        if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS) and not self.punch_refused:
            self.punch_refused = True
            log.warning(
                "aiokv: %s",
                f"this file system cannot punch holes ({os.strerror(e.errno)}): the cache directory keeps "
                f"the disk space it has taken and reuses it, over its capacity if need be; put it on a "
                f"file system that can (ext4, xfs) to give space back",
            )

    def grow_slots(self, ns: Namespace, ahead: bool = False) -> int:
        """How many slots a grow would reserve now (0: no room under the limit)."""
        room = (self.limit - self.used()) if self.limit is not None else GROW_BYTES
        n = min(max(1, GROW_BYTES // ns.slot_cost), room // ns.slot_cost)
        if n <= 0 and self.peers_older() and not ahead:
            # another engine holds older blocks and sheds them at its next refresh:
            # overshoot by a slot rather than evict our newer ones, up to a bound
            n = 1 if room + max(self.limit // SHARE_SLACK, ns.slot_cost) >= ns.slot_cost else 0
        return max(n, 0)

    def grow(self, ns: Namespace, ahead: bool = False, cut: bool = False) -> bool | None:
        """Reserve disk space for more slots: a chunk, halved on ENOSPC down to one slot.
        None: a grow is in flight on the I/O thread (not waited for past this step's
        budget); ahead: only if there is room, and without waiting; cut: the data files
        are first cut at the high-water mark (an install's: the last life's tail,
        loading.py), in the same I/O."""
        if self.limit is not None and self.limit != self.capacity:
            self._regain_space()
        op = self._growing.get(ns.nsid)
        if op is None:
            n = self.grow_slots(ns, ahead)
            if n <= 0:
                return False
            plans = []
            while n > 0:  # planned here: the allocator is the owner's
                plans.append(ns.alloc.plan_grow(n))
                n //= 2
            hwm = ns.alloc.hwm
            op = self.fs.submit(lambda: self._grow_io(ns, plans, hwm, cut), lambda r, e: self._grow_done(ns, r, e))
            if op.applied:  # ran at once (inline, or from an operation on the I/O thread)
                return bool(op.result and op.result[0])
            # (finished on the I/O thread but not applied yet counts as in flight: its slots
            # are not free until _grow_done, and must not be planned again meanwhile)
            self._growing[ns.nsid] = op
        if ahead or not self.fs.wait_in_step(op):
            return None
        return bool(op.result and op.result[0])

    def grow_ahead(self, ns: Namespace) -> None:
        """With the I/O thread: more space, before it is needed, once few free slots are left."""
        if (
            not self.fs.inline
            and ns.nsid not in self._growing
            and len(ns.alloc.free) < max(GROW_AHEAD, GROW_BYTES // ns.slot_cost // 2)
        ):
            self.grow(ns, ahead=True)

    def _grow_io(self, ns: Namespace, plans: list[list[int]], hwm: int, cut: bool = False):
        """The I/O of grow: (slots backed or None, ENOSPC count, errno of another failure)."""
        enospc = 0
        if cut:
            try:
                self.cut(ns, hwm)
            except OSError as e:
                return None, 0, e.errno or errno.EIO
        for slots in plans:
            try:
                self.fallocate(ns, 0, slots)
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    return None, enospc, e.errno or errno.EIO
                # a failed fallocate may have allocated part of the range: give it back
                self.fallocate(ns, PUNCH, slots, ignore_errors=True)
                self.cut(ns, hwm)
                enospc += 1
                continue
            return slots, enospc, 0
        return None, enospc, 0

    def _grow_done(self, ns: Namespace, r, e) -> None:
        self._growing.pop(ns.nsid, None)
        if e is not None:
            if not isinstance(e, OSError):
                raise e
            r = (None, 0, e.errno or errno.EIO)
        slots, enospc, err = r
        self.stats.enospc += enospc
        if slots:
            ns.alloc.grow(slots)
        elif err:
            # EIO, EROFS, EFBIG...: no new space now; evicting may still make room
            log.warning("aiokv: %s", f"reserving disk space failed ({os.strerror(err)}); saves reuse evicted slots")
        else:
            # the disk is full below our capacity: leave the file system some room
            # (journal, other users) and cap ourselves there
            self.make_room()

    def close(self) -> None:
        """Close our data files (where close runs: persist.py)."""
        for fd in self._rank_fds.values():
            os.close(fd)
        self._rank_fds.clear()
