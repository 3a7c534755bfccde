# SPDX-License-Identifier: Apache-2.0
"""Opening: the store marker (aiokv.json), the setup lock, the directories of
the store and of each namespace, namespace.json, and the namespaces opened.

Two objects: `Dirs` owns the directories (their descriptors, the root's file
system's size) and our engine's lock; `Opener` opens and creates namespaces,
handed the parts that fill one (replay.py: our own files; following.py: the
other engines'; space.py: the first slots reserved ahead).

Opening a store checks (or creates, or migrates) aiokv.json and opens every
namespace found under ns/; `namespace` opens or creates one. Creating or
migrating the store, and creating a namespace, happen under the setup lock (an
flock of the root directory: engines starting together), waited for at most
SETUP_WAIT. Every directory is opened relative to a descriptor, never through
a symlink (aiokv/data/dirs.py).

Threading contract: `Dirs.open` and the first `Opener.load`s run in
Store.__init__ on the opener's thread; `Opener.namespace` runs on the owner's
thread, its file-system part (`_namespace`) on the store's I/O thread once it
has started (waited for at most NAMESPACE_WAIT). The directory descriptors are
opened by whichever thread runs that part and read by the I/O thread
afterwards; `Dirs.close` runs where close runs (persist.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time

from aiokv.data import format as fmt
from aiokv.data.dirs import NotAStore, _exists, _read_json, _write_json, check_private, open_dir
from aiokv.store.lock import DirLock
from aiokv.store.namespace import Namespace

NAMESPACE_WAIT = 60.0  # seconds opening a namespace may take on the I/O thread (at start)
SETUP_WAIT = 30.0  # seconds an engine waits for another one creating the store or a namespace
log = logging.getLogger("aiokv")


@contextlib.contextmanager
def setup_lock(root_fd: int, root: str = "the cache directory"):
    """Held while creating or migrating the store or a namespace (moments, at start).
    Waited for at most SETUP_WAIT: an engine hung there must not hang the others."""
    end = time.monotonic() + SETUP_WAIT
    while True:
        try:
            fcntl.flock(root_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > end:
                raise NotAStore(
                    f"aiokv: {root}: another engine has been creating files there for {SETUP_WAIT:.0f} s "
                    "(a hung disk?); check it, or give this engine its own path"
                ) from None
            time.sleep(0.01)
    try:
        yield
    finally:
        fcntl.flock(root_fd, fcntl.LOCK_UN)


def ns_dir(root: str, nsid: bytes) -> str:
    return os.path.join(root, "ns", nsid.hex())


class Dirs:
    """The store's directories and our engine's lock."""

    def __init__(self, root: str, readonly: bool):
        self.root, self.readonly = root, readonly
        self.lock: DirLock | None = None
        self.engine: int | None = None
        self.root_fd: int | None = None
        self.ns_fd: int | None = None
        self.fs_bytes = 0  # the size of the root's file system (set by open)
        self._dir_fds: dict[bytes, int] = {}  # namespace directories
        self._own_fds: dict[bytes, int] = {}  # our engine's directory in each namespace

    def open(self, engine: int | None) -> list[bytes]:
        """Check (or create, or migrate) the store and take our engine's lock (not
        read-only); the namespaces found (those with a namespace.json)."""
        # The root itself is not followed if it is a symlink, nor is anything below it.
        if self.readonly:
            if not os.path.isdir(self.root):
                raise NotAStore(f"aiokv: {self.root} is not an aiokv store (no aiokv.json)")
            self.root_fd = open_dir(self.root)
            if not _exists("aiokv.json", self.root_fd):
                raise NotAStore(f"aiokv: {self.root} is not an aiokv store (no aiokv.json)")
            self._check_meta(_read_json("aiokv.json", self.root_fd, self.root))
        else:
            os.makedirs(os.path.dirname(self.root) or "/", exist_ok=True)
            self.root_fd = open_dir(self.root, create=True)
            check_private(self.root_fd, self.root)
            # Creating or migrating the store, and creating namespaces, is done
            # under an flock of the root directory: engines starting together.
            with setup_lock(self.root_fd, self.root):
                if not _exists("aiokv.json", self.root_fd) and os.listdir(self.root_fd):
                    raise NotAStore(
                        f"aiokv: {self.root} is not empty and not an aiokv store; give aiokv an empty or new directory"
                    )
                self.lock = DirLock(self.root, self.root_fd, engine)
                self.engine = self.lock.engine
                if not _exists("aiokv.json", self.root_fd):
                    _write_json("aiokv.json", {"magic": fmt.STORE_MAGIC, "format": fmt.FORMAT_VERSION}, self.root_fd)
                if self._check_meta(_read_json("aiokv.json", self.root_fd, self.root)) != fmt.FORMAT_VERSION:
                    # format 1 is format 2 with engine 0 alone: nothing moves (docs/format.md)
                    _write_json("aiokv.json", {"magic": fmt.STORE_MAGIC, "format": fmt.FORMAT_VERSION}, self.root_fd)
                    log.info("aiokv: %s migrated to format %d (several engines)", self.root, fmt.FORMAT_VERSION)
        ns_path = os.path.join(self.root, "ns")
        self.ns_fd = open_dir(ns_path, self.root_fd, create=not self.readonly)
        if not self.readonly:
            check_private(self.ns_fd, ns_path)
        st = os.fstatvfs(self.root_fd)
        # a file system that reports no size (ramfs) lives in memory: bounded by it
        self.fs_bytes = st.f_blocks * st.f_frsize or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        found = []
        for name in sorted(os.listdir(self.ns_fd)):
            try:
                nsid = bytes.fromhex(name)
            except ValueError:
                continue  # not ours
            if len(nsid) != fmt.NSID_BYTES:
                continue
            # a namespace whose namespace.json never made it (a crash at creation) holds nothing
            if _exists("namespace.json", self.ns_dir_fd(nsid)):
                found.append(nsid)
        return found

    def _check_meta(self, meta) -> int:
        if not isinstance(meta, dict) or meta.get("magic") != fmt.STORE_MAGIC:
            raise NotAStore(f"aiokv: {self.root} is not an aiokv store (bad aiokv.json)")
        if meta.get("format") not in fmt.READS_FORMATS:
            raise NotAStore(
                f"aiokv: {self.root} has format {meta.get('format')}, this aiokv reads "
                f"{fmt.FORMAT_VERSION}; use a new directory"
            )
        return meta["format"]

    def max_slots(self, ns: Namespace) -> int:
        """Slots that can exist: a data file never holds more than its file system."""
        return self.fs_bytes // ns.slot_bytes

    def ns_dir_fd(self, nsid: bytes, create: bool = False) -> int:
        fd = self._dir_fds.get(nsid)
        if fd is None:
            path = ns_dir(self.root, nsid)
            fd = self._dir_fds[nsid] = open_dir(path, self.ns_fd, create=create)
            if not self.readonly:
                check_private(fd, path)
        return fd

    def own_dir_fd(self, nsid: bytes) -> int:
        """Our engine's directory in a namespace (created 0700 if missing)."""
        fd = self._own_fds.get(nsid)
        if fd is None:
            sub = fmt.engine_dir(self.engine)
            if not sub:
                fd = self.ns_dir_fd(nsid)
            else:
                path = os.path.join(ns_dir(self.root, nsid), sub)
                fd = open_dir(path, self.ns_dir_fd(nsid), create=True)
                check_private(fd, path)
            self._own_fds[nsid] = fd
        return fd

    def read_namespace(self, nsid: bytes):
        """(payload bytes, slot bytes, ranks, fields) of a namespace, from its namespace.json."""
        d, nfd = ns_dir(self.root, nsid), self.ns_dir_fd(nsid)
        try:
            return fmt.check_namespace(_read_json("namespace.json", nfd, d), nsid)
        except fmt.BadBlock as e:
            raise NotAStore(
                f"aiokv: {d}/namespace.json is damaged ({e}); remove {d} (its blocks are lost) "
                "or give aiokv a new directory"
            ) from None

    def create_namespace(self, nsid: bytes, info: dict) -> None:
        """Write a namespace's namespace.json, unless another engine just did."""
        with setup_lock(self.root_fd, self.root):  # another engine may be creating it right now
            dfd = self.ns_dir_fd(nsid, create=True)
            if not _exists("namespace.json", dfd):
                _write_json("namespace.json", dict(info, created=time.time()), dfd)

    def close(self) -> None:
        """Close the directories and give our engine's lock back (the last of close)."""
        own = [fd for nsid, fd in self._own_fds.items() if fd != self._dir_fds.get(nsid)]
        for fd in [*own, *self._dir_fds.values(), self.ns_fd, self.root_fd]:
            if fd is not None:
                os.close(fd)
        self._own_fds.clear()
        self._dir_fds.clear()
        self.ns_fd = self.root_fd = None
        if self.lock is not None:
            self.lock.release()


class Opener:
    """Opens and creates namespaces, handed what fills one: the index, our replay,
    the following of the other engines, the space reserved ahead."""

    def __init__(self, dirs: Dirs, index, replay, following, space, fs):
        self._keys: dict = {}  # (nsid, engine) -> the keys keys_of read last (slot -> key)
        self.dirs, self.index, self.replay, self.following, self.space, self.fs = (
            dirs,
            index,
            replay,
            following,
            space,
            fs,
        )

    def shell(self, nsid: bytes) -> Namespace:
        """A namespace that has a namespace.json, its index still to load (store.py loads it
        in the background): no blocks, not ready; the other engines followed from the I/O
        thread's first look."""
        pb, sb, ranks, fields = self.dirs.read_namespace(nsid)
        ns = Namespace(nsid, pb, sb, ranks, fields, self.dirs.engine)
        ns.keys_of = lambda engine, ns=ns: self.keys_of(ns, engine)
        ns.ready = False
        self.index.namespaces[nsid] = ns
        self.following.add(ns, now=False)
        return ns

    def load(self, nsid: bytes) -> Namespace:
        """Open a namespace that has a namespace.json: replay our files, follow the others'."""
        pb, sb, ranks, fields = self.dirs.read_namespace(nsid)
        ns = Namespace(nsid, pb, sb, ranks, fields, self.dirs.engine)
        ns.keys_of = lambda engine, ns=ns: self.keys_of(ns, engine)
        if not self.dirs.readonly:
            self.replay.load_own(ns)
        self.index.namespaces[nsid] = ns
        self.following.add(ns)
        return ns

    def keys_of(self, ns: Namespace, engine: int):
        """slot -> key of an engine's blocks, read from its files (readkeys.read_keys; for the
        views that hand out keys: tools and tests). Ours are read once what is queued for
        the I/O thread is written (waited for at most NAMESPACE_WAIT)."""
        from aiokv.store.logrecords import KeyMap
        from aiokv.store.readkeys import read_keys

        try:
            if engine == self.dirs.engine:
                if not self.fs.inline:
                    self.fs.call(lambda: None, NAMESPACE_WAIT)
                path = os.path.join(ns_dir(self.dirs.root, ns.nsid), fmt.engine_dir(engine)).rstrip("/")
                got = read_keys(path, self.dirs.own_dir_fd(ns.nsid))
            else:
                fl = self.following.followers.get((ns.nsid, engine))
                got = KeyMap() if fl is None else read_keys(fl.dir, fl.dir_fd)
        except OSError:
            # a disk that stopped answering: the keys read last (a block not among them is left out)
            return self._keys.get((ns.nsid, engine)) or KeyMap()
        self._keys[(ns.nsid, engine)] = got
        return got

    def namespace(self, nsid: bytes, payload_bytes: int, ranks: int = 1, fields: dict | None = None) -> Namespace:
        """Open or create a namespace. nsid is derived by the caller from all that changes the bytes.
        With the I/O thread it opens there (waited for at most NAMESPACE_WAIT: at start)."""
        if self.fs.inline:
            return self._namespace(nsid, payload_bytes, ranks, fields)
        return self.fs.call(
            lambda: self._namespace(nsid, payload_bytes, ranks, fields), NAMESPACE_WAIT, deadline=NAMESPACE_WAIT
        )

    def _namespace(self, nsid: bytes, payload_bytes: int, ranks: int, fields: dict | None) -> Namespace:
        if len(nsid) != fmt.NSID_BYTES:
            raise ValueError(f"aiokv: namespace ids are {fmt.NSID_BYTES} bytes")
        ns = self.index.namespaces.get(nsid)
        if ns is None:
            if self.dirs.readonly:
                raise KeyError(nsid.hex())
            info = {
                "nsid": nsid.hex(),
                "payload_bytes": payload_bytes,
                "ranks": ranks,
                "fields": fields or {},
                "slot_bytes": fmt.slot_bytes(payload_bytes) if type(payload_bytes) is int else None,
            }
            try:
                fmt.check_namespace(info, nsid)
            except fmt.BadBlock as e:
                raise ValueError(f"aiokv: cannot create namespace {nsid.hex()}: {e}") from None
            self.dirs.create_namespace(nsid, info)
            ns = self.load(nsid)
            self.space.grow_ahead(ns)  # space for the first saves, reserved at start (on the I/O thread)
        if ns.payload_bytes != payload_bytes or ns.ranks != ranks:
            raise ValueError(
                f"aiokv: namespace {nsid.hex()} holds {ns.payload_bytes}-byte blocks on "
                f"{ns.ranks} ranks, not {payload_bytes} on {ranks}: its id must cover the layout"
            )
        return ns
