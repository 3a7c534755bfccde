# SPDX-License-Identifier: Apache-2.0
"""Following the other engines on the directory.

Each other engine's checkpoint and journal of a namespace is read by a
Follower (follower.py) as it grows; what it says is applied to the in-memory
index (their new blocks become hits here, their evicted ones misses), and the
bytes their files take are counted against the directory's capacity.

`Following` owns the Followers, the other engines' directories and bytes
(`peer_bytes`, which space.py reads and reclaim.py corrects), when it last
looked and the backlog counts; it is handed the directories (meta.py), the
index and the I/O thread.

Two halves: `_follow_io` reads the files (the file-system half) and
`_apply` changes the index (the in-memory half). Without the store's I/O
thread both run on the caller's thread, from refresh and lookups, at most every
`interval` (Store.follow_interval). With it, the I/O thread runs the file-system
half on its own every interval (FsThread.every), whatever the scheduler does, and the
scheduler applies the last finished look at its next call (`fs.poll()` in
refresh and lookup): it never waits for a look, and an engine back from idle
sees what the others committed up to one interval ago.

Threading contract: `_follow_io`, the Followers and `followers`/`_peer_fds` are
the I/O thread's once it has started (before: the opener's); `_apply`, the
index and `peer_bytes` are the owner's. The I/O thread reads only the
namespaces' fixed fields (nsid, ranks, slot sizes) and `_spaces`, a tuple the
owner replaces (never changes) when it opens a namespace (`add`). What the
owner asks of a Follower (`forget`, after its view drifted) is queued to the
I/O thread.
The backlog (records found and not yet applied, while the scheduler idles) is
`_handed - _applied`, each counter written by one thread only; past BACKLOG the
I/O thread stops looking until the owner catches up.

A look that fails part-way loses nothing (issue 40): each engine is followed apart, so one
engine's bad files (EIO, EACCES, ESTALE, a bug) never stop the others or the orders. A poll
that raises reads again from where it began (`_poll`); a failure after a poll, or while the
owner applies that engine's records, replays its files whole at a later look (`forget`),
looked at again after FAIL_PAUSE, doubled while it keeps failing (`_failing`, the I/O
thread's). Orders that `control.take` could not take are handed to it again (`_untaken`,
the owner's); the control file's position moves only with a read that succeeded (control.py).
"""

from __future__ import annotations

import logging
import os
import time

from aiokv.data import format as fmt
from aiokv.data.dirs import NotAStore, open_dir
from aiokv.store.follower import Follower
from aiokv.store.namespace import Namespace

log = logging.getLogger("aiokv")
FOLLOW_INTERVAL = 0.1  # seconds between looks at the other engines' journals
MIN_INTERVAL = 0.01  # seconds: the I/O thread's looks, however low the interval is set
BACKLOG = 100_000  # records handed over and not yet applied past which the I/O thread stops looking
REPLAY_DEADLINE = 30.0  # seconds a look that replays another engine's files whole may take before it counts as a stall
FAIL_PAUSE = 0.5  # seconds before an engine whose files failed is looked at again (doubled per failure in a row)
FAIL_PAUSE_MAX = 30.0  # the longest such pause; a streak of failures ends after this long without one


def data_bytes(dir_fd: int, ns: Namespace) -> int:
    """Bytes an engine's data files of a namespace take on disk."""
    total = 0
    for rank in range(ns.ranks):
        try:
            total += os.stat(fmt.data_file(rank), dir_fd=dir_fd, follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


class Following:
    def __init__(self, dirs, index, fs, tenants):
        self.dirs, self.index, self.fs, self.tenants = dirs, index, fs, tenants
        self.control = None  # the operators' orders (control.py), read at each look; set by the store
        self.interval = FOLLOW_INTERVAL
        self.followed = 0.0  # time.monotonic() of the last look (with the I/O thread: the last applied)
        self.followers: dict[tuple[bytes, int], Follower] = {}  # (nsid, engine) -> its files
        self._peer_fds: dict[tuple[bytes, int], int] = {}  # (nsid, engine) -> its directory
        self.peer_bytes: dict[tuple[bytes, int], int] = {}  # (nsid, engine) -> bytes its files take
        self._spaces: tuple[Namespace, ...] = ()  # the namespaces, for the I/O thread
        self._io_seen: dict[tuple[bytes, int], int] = {}  # the I/O thread's: bytes last handed over per engine
        self._handed = 0  # records the I/O thread handed over (it alone writes this)
        self._applied = 0  # records the owner applied (it alone writes this)
        self._failing: dict[tuple[bytes, int | None], tuple[int, float]] = {}  # the I/O thread's: failures, pause end
        self._untaken: list = []  # the owner's: orders control.take raised on, handed to it again
        self._take_said = False

    def add(self, ns: Namespace, now: bool = True) -> None:
        """A namespace opened (meta.py): followed from now on, and at once (now)."""
        self._spaces = tuple(self.index.namespaces.values())  # replaced, never changed: the I/O thread reads it
        if now:
            self.follow(ns)

    def _peer_engines(self, ns: Namespace) -> list[int]:
        """Engine numbers with files in this namespace, other than ours."""
        nfd = self.dirs.ns_dir_fd(ns.nsid)
        found = []
        names = os.listdir(nfd)
        if self.dirs.engine != 0 and any(n == "checkpoint" or n.startswith("journal.") for n in names):
            found.append(0)
        for n in names:
            e = fmt.engine_of_dir(n)
            if e is not None and e != self.dirs.engine:
                found.append(e)
        return found

    def follow(self, ns: Namespace) -> None:
        """Apply what the other engines committed and dropped since the last look (at once)."""
        self._apply(ns, self._follow_io(ns))

    def _follow_io(self, ns: Namespace) -> list:
        """The file-system half: what each engine's files say, as
        [(engine, follower, what poll returned, its touches after a replay, its bytes, its
        tenants file if it changed (read after its journal: every id its records name is there))].
        An engine whose files fail is left out of this look and loses nothing (`_follow_engine`)."""
        out, now = [], time.monotonic()
        try:
            engines = [] if self._waiting((ns.nsid, None), now) else self._peer_engines(ns)
        except OSError as err:
            if self.dirs.readonly:
                raise
            self._failed(ns, None, err)
            return out
        for e in engines:
            if self._waiting((ns.nsid, e), now):
                continue
            try:
                got = self._follow_engine(ns, e)
            except Exception as err:
                if self.dirs.readonly:
                    raise  # (inspect and the commands say what they could not read)
                self._failed(ns, e, err)
                continue
            if got is not None:
                out.append(got)
        return out

    def _follow_engine(self, ns: Namespace, e: int):
        """One engine's part of a look (None: nothing to follow there). Raises with nothing lost:
        a poll that raised reads again from where it began; one that read but could not be
        handed over (its tenants file did not read) replays that engine's files whole next time."""
        nsid, key = ns.nsid, (ns.nsid, e)
        fl = self.followers.get(key)
        if fl is None:
            sub = fmt.engine_dir(e)
            path = os.path.join(self.dirs.root, "ns", nsid.hex(), sub).rstrip("/")
            try:
                dfd = self.dirs.ns_dir_fd(nsid) if not sub else open_dir(path, self.dirs.ns_dir_fd(nsid))
            except (NotAStore, FileNotFoundError):
                return None  # a symlink planted there, a directory vanishing: not an engine's
            if sub:
                self._peer_fds[key] = dfd
            fl = self.followers[key] = Follower(path, dfd)
        if not fl.replayed or fl._ckpt_ident() != fl.ckpt:  # (a whole replay, maybe: not a stall)
            self.fs.allow(REPLAY_DEADLINE)
        nbytes = data_bytes(fl.dir_fd, ns)  # (before the poll: a failure here loses nothing)
        try:
            got = self._poll(fl, ns)
        except fmt.BadBlock as err:
            if self.dirs.readonly:
                raise
            log.warning("aiokv: %s; its blocks are misses here until its engine rebuilds it", err)
            got = ("reset", None)
        except FileNotFoundError:
            return None  # a checkpoint replaced under us: the next look replays it
        try:
            touches = fl.log.touches if got is not None and got[0] == "reset" and fl.log is not None else None
            if got is not None and got[0] == "reset" and got[1] is not None and not self.dirs.readonly:
                got[1].build_order()  # its eviction order, here on the I/O thread (O(blocks))
            tenants = self.tenants.read_peer_io(e)
        except BaseException:
            fl.forget()  # what the poll read is not handed over: its files are replayed whole next time
            raise
        return e, fl, got, touches, fl.disk_bytes + nbytes, tenants

    def _poll(self, fl: Follower, ns: Namespace):
        """fl.poll(); one that raises hands nothing over and loses nothing: the next reads again
        from where it began, or, if it was replacing its view of the files (a roll, a replay),
        replays them whole."""
        before, off, records = (fl.fd, fl.gen, fl.log, fl.replayed), fl.off, fl.records
        try:
            return fl.poll(self.dirs.max_slots(ns))
        except BaseException:
            if (fl.fd, fl.gen, fl.log, fl.replayed) == before:
                fl.off, fl.records = off, records
            else:
                fl.forget()
            raise

    def _waiting(self, key, now: float) -> bool:
        """Whether an engine (or a namespace's directory: engine None) whose files failed is
        still paused; a streak of failures ends after FAIL_PAUSE_MAX without one."""
        f = self._failing.get(key)
        if f is None:
            return False
        if now > f[1] + FAIL_PAUSE_MAX:
            del self._failing[key]
        return now < f[1]

    def _failed(self, ns: Namespace, e: int | None, err: BaseException) -> None:
        """An engine's files (or the namespace's directory) failed in a look (the I/O thread's,
        or inline): looked at again after a pause, said once per streak of failures."""
        key = (ns.nsid, e)
        n = self._failing.get(key, (0, 0.0))[0]
        pause = min(FAIL_PAUSE * 2**n, FAIL_PAUSE_MAX)
        self._failing[key] = (n + 1, time.monotonic() + pause)
        if n:
            return
        what = f"engine {e}'s files" if e is not None else "the directory"
        if isinstance(err, OSError):
            log.warning(
                "aiokv: reading %s of namespace %s failed (%s); its blocks stay as last read (every load "
                "verifies), the other engines are followed, and it is read again after a pause",
                what,
                ns.hex[:12],
                os.strerror(err.errno) if err.errno else err,
            )
        else:
            log.error(
                "aiokv: following %s of namespace %s failed; read again after a pause", what, ns.hex[:12], exc_info=err
            )

    def _apply(self, ns: Namespace, found: list) -> None:
        """The in-memory half (the owner's thread), each engine apart: one whose records could
        not be applied is replayed whole at a later look (its tenants file read again too).
        The hits the engines recorded (TOUCH) are applied last, once every engine's blocks of
        this look are in: an engine's hits on a higher-numbered engine's blocks replayed in the
        same look are not lost."""
        hits = []
        for f in found:
            try:
                hits.append(self._apply_engine(ns, *f))
            except Exception as err:
                e, fl = f[0], f[1]

                def redo(ns=ns, e=e, fl=fl, err=err):  # (the I/O thread's)
                    fl.forget()
                    self.tenants.reread_peer_io(e)
                    self._failed(ns, e, err)

                try:
                    redo() if self.fs.inline else self.fs.submit(redo)
                except OSError:
                    pass  # the store is closed
        for touched in hits:
            if touched is not None and len(touched[0]):
                ns.touch_tags(*touched)

    def _apply_engine(self, ns: Namespace, e, fl, got, touches, nbytes, tenants):
        """One engine's part of a look; returns its hits (tags, atimes) for _apply, or None."""
        touched = None
        if tenants is not None:
            self.tenants.adopt(e, tenants)
        if got is not None:
            kind, what = got[0], got[1]
            if kind == "reset":
                if what is not None:  # its tenant ids, as ours; what its owner has not cleared yet, left out
                    what.retenant(self.tenants.remap(e, what.tenant))
                    if self.control is not None:
                        self.control.filter_peer(ns, what, getattr(what, "mark", 0))
                ns.peer_reset(e, what)
                touched = touches  # (tags, atimes) of the replay's TOUCH records, or None
            else:
                touched = ns.peer_apply(
                    e, what, self.dirs.max_slots(ns), self.tenants.remap(e, what["tenant"]) if len(what) else None
                )
                if kind == "roll" and got[2] != (ns.tables[e].count if e in ns.tables else 0):
                    # our view of that engine drifted: replay its files next time
                    fl.forget() if self.fs.inline else self.fs.submit(fl.forget)
        self.peer_bytes[(ns.nsid, e)] = nbytes
        return touched

    def start(self) -> None:
        """With the I/O thread: it looks at the other engines every interval on its own."""
        self.fs.every(lambda: max(self.interval, MIN_INTERVAL), self._follow_spaces_io, self._look_done)

    def _follow_spaces_io(self):
        """One look of the I/O thread at every namespace: what changed since its last
        look, or None if nothing did (nothing is handed over then)."""
        if self._handed - self._applied > BACKLOG:
            # an idle scheduler has not picked up what was found: look again once it has
            # (the Followers keep their place; nothing is missed, only held on disk meanwhile)
            return None
        out, seen, n = [], self._io_seen, 0
        orders = self.control.read_io() if self.control is not None else None  # (moves only when it read)
        for ns in self._spaces:
            found = [
                f
                for f in self._follow_io(ns)
                if f[2] is not None or f[5] is not None or seen.get((ns.nsid, f[0])) != f[4]
            ]
            for f in found:
                seen[(ns.nsid, f[0])] = f[4]
                n += (
                    (f[2][1].count if f[2][0] == "reset" else len(f[2][1]))
                    if f[2] is not None and f[2][1] is not None
                    else 0
                )
            if found:
                out.append((ns, found))
        self._handed += n
        return (out, n, orders) if out or orders or self._untaken else None  # (untaken: the owner's, retried)

    def _look_done(self, found, e) -> None:
        """A look of the I/O thread finished (the owner's thread, at poll)."""
        if isinstance(e, OSError):
            log.warning("aiokv: following the other engines failed (%s); trying again later", os.strerror(e.errno or 0))
        elif e is not None:
            log.error("aiokv: following the other engines failed; trying again later", exc_info=e)
        else:
            found, n, orders = found
            self._applied += n
            self._take(orders)  # (first: a replay below is filtered by them too)
            for ns, got in found:
                self._apply(ns, got)
        self.followed = time.monotonic()

    def follow_all(self) -> None:
        """Without the I/O thread: follow every namespace now if the interval has passed."""
        now = time.monotonic()
        if now - self.followed < self.interval:
            return
        self.followed = now
        try:
            if self.control is not None:
                self._take(self.control.read_io())
            for ns in list(self.index.namespaces.values()):
                self.follow(ns)
        except OSError as e:
            log.warning("aiokv: following the other engines failed (%s); trying again later", os.strerror(e.errno or 0))
        except Exception:  # lookups call this: a bug here must not reach vLLM
            log.exception("aiokv: following the other engines failed; trying again later")

    def _take(self, orders) -> None:
        """New orders to control.take (the owner's); those it raised on are handed to it again
        with the next ones (an order it kept before raising is not handed twice)."""
        if self.control is None:
            return
        orders = [o for o in self._untaken + (orders or []) if o.number > self.control.last]
        self._untaken = []
        if not orders:
            return
        try:
            self.control.take(orders)
            self._take_said = False
        except Exception:
            self._untaken = orders
            if not self._take_said:
                self._take_said = True
                log.exception(
                    "aiokv: applying control order(s) up to %d failed; tried again at the next look", orders[-1].number
                )

    def close(self) -> None:
        """Close the Followers and the other engines' directories (where close runs: persist.py)."""
        for fl in self.followers.values():
            fl.close()
        self.followers.clear()
        for fd in self._peer_fds.values():
            os.close(fd)
        self._peer_fds.clear()
