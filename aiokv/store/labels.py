# SPDX-License-Identifier: Apache-2.0
"""Labels: one opaque description per key, kept beside an engine's journal for the
layers above the store (the connector's KV events keep each block's vLLM hashes and
tokens there, so a restarted engine can tell routers what its disk holds).

Each engine appends to its own `labels` file in each namespace (data/format/sidefiles.py:
a file header, then CRC-checked records; a later record of a key replaces an earlier
one); `read` returns what every engine's file of a namespace says that the last read
had not seen yet, so the first read is everything and later ones are the other
engines' new labels. A torn or damaged tail ends a file's read there (the rest is
read again next time); a file replaced or cut is read again from its start. At the
first read the owner rewrites its own file without the labels of keys it no longer
holds, once more than half of it is such labels.

Failure contract: best effort. A label that is not written, or that is lost, costs
only its description (no event for that block after a restart); labels are never
trusted for bytes (a block is served only by its key and its header's checks).

`sink`, when set (the bucket tier's publisher, aiokv/bucket/publisher.py), is handed every
batch `append` takes as well, so that a node warmed from the bucket learns them.

Threading contract: `append`, `read` and `close` are for the store's owner thread (and so is `sink`'s call);
every file call they make runs on the store's I/O thread (fsthread.py), and the
file state (`_fds`, `_seen`) is that thread's alone; `read`'s `done` runs on the
owner's thread (at the store's poll).
"""

from __future__ import annotations

import logging
import os

from aiokv.data import format as fmt
from aiokv.data.dirs import FILE_FLAGS, NotAStore, open_dir

log = logging.getLogger("aiokv")
MAX_READ = 256 << 20  # bytes read of one labels file at once (a hostile file stays bounded)
START_READ = 16 << 20  # bytes a start announcement reads of each file at once (tens of millions of labels: in turns)


class Labels:
    def __init__(self, dirs, fs):
        self.dirs, self.fs = dirs, fs
        self._fds: dict[bytes, int] = {}  # nsid -> our labels file, opened for appends
        self._seen: dict[tuple[bytes, str], tuple[int, int]] = {}  # (nsid, engine dir) -> (inode, bytes read)
        self.sink = None  # sink(nsid, [(key, label)]): a copy of what is appended (the bucket's publisher)

    # ---- the owner's calls ----
    def append(self, nsid: bytes, items: list[tuple[bytes, bytes]]) -> None:
        """Queue labels [(key, label)] to our file of the namespace (best effort)."""
        if self.dirs.readonly or not items:
            return
        if self.sink is not None:
            try:
                self.sink(nsid, items)
            except Exception:
                log.exception("aiokv: handing block labels to the bucket failed; they stay local")
        blob = b"".join(fmt.pack_label(k, v) for k, v in items)
        try:
            self.fs.submit(lambda: self._write(nsid, blob), self._written)
        except OSError:
            pass  # the store is closed: the labels are lost, as the issue of a closed store

    def read(self, nsid: bytes, done, keep=None, held: int = 0, limit: int = MAX_READ) -> None:
        """done({key: label}, more) with what every engine's labels file of the namespace says
        that was not read before, at most `limit` bytes of each file (more: a file has more
        to read; read again for it); `keep(key)` (whether we hold key) and `held` (how many we
        hold), at the first read: compact our file. keep runs on the I/O thread while the
        owner changes what it reads: a wrong answer only keeps a stale label or drops one
        (its block is not announced after a restart)."""

        def finish(got, e):
            if e is not None:
                log.warning("aiokv: reading the block labels failed (%s); trying again later", e)
                got = ({}, False)
            done(*got)

        try:
            self.fs.submit(lambda: self._read(nsid, keep, held, limit), finish)
        except OSError:
            done({}, False)

    def close(self) -> None:
        """Close our labels files (on the I/O thread, as the store's last operations)."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ---- the I/O thread's ----
    @staticmethod
    def _written(_, e) -> None:
        if e is not None:
            log.warning(
                "aiokv: writing block labels failed (%s); those blocks are not announced after a restart",
                os.strerror(e.errno or 0) if isinstance(e, OSError) else e,
            )

    def _write(self, nsid: bytes, blob: bytes) -> None:
        fd = self._fds.get(nsid)
        if fd is None:
            dfd = self.dirs.own_dir_fd(nsid)
            fd = os.open(fmt.LABELS_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | FILE_FLAGS, 0o600, dir_fd=dfd)
            try:
                if os.fstat(fd).st_size < fmt.FILE_HDR_BYTES:
                    os.ftruncate(fd, 0)
                    os.write(fd, fmt.pack_file_header(fmt.LABEL_MAGIC, 0))
            except BaseException:
                os.close(fd)
                raise
            self._fds[nsid] = fd
        os.write(fd, blob)

    def _engine_dirs(self, nsid: bytes) -> list[tuple[str, int, bool]]:
        """(name, directory fd, whether it is ours and must be closed) per engine with files here."""
        nfd = self.dirs.ns_dir_fd(nsid)
        out = [("", nfd, False)]
        for name in os.listdir(nfd):
            if fmt.engine_of_dir(name) is None:
                continue
            try:
                out.append((name, open_dir(os.path.join(self.dirs.root, "ns", nsid.hex(), name), nfd), True))
            except (NotAStore, OSError):
                continue  # a symlink planted there, a directory vanishing: not an engine's
        return out

    def _read(self, nsid: bytes, keep, held: int = 0, limit: int = MAX_READ) -> tuple[dict[bytes, bytes], bool]:
        found: dict[bytes, bytes] = {}
        more = False
        own = fmt.engine_dir(self.dirs.engine) if self.dirs.engine is not None else None
        for name, dfd, close in self._engine_dirs(nsid):
            try:
                got = self._read_file(nsid, name, dfd, limit)
                # (compacted only when read whole: a part says nothing of the rest)
                if got is not None and keep is not None and name == own and not got[2] and len(got[1]) > 2 * held + 64:
                    self._compact(nsid, dfd, {k: v for k, v in got[1].items() if keep(k)})
                if got is not None:
                    found.update(got[1])
                    more = more or got[2]
            finally:
                if close:
                    os.close(dfd)
        return found, more

    def _read_file(self, nsid: bytes, name: str, dfd: int, limit: int = MAX_READ):
        try:
            fd = os.open(fmt.LABELS_NAME, os.O_RDONLY | FILE_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            ino, start = self._seen.get((nsid, name), (st.st_ino, 0))
            if ino != st.st_ino or start > st.st_size:
                start = 0  # replaced or cut: from the start
            if start == 0:
                head = os.pread(fd, fmt.FILE_HDR_BYTES, 0)
                try:
                    fmt.unpack_file_header(head, fmt.LABEL_MAGIC)
                except fmt.BadBlock:
                    return None
                start = fmt.FILE_HDR_BYTES
            buf = os.pread(fd, min(st.st_size - start, limit, MAX_READ), start)
        finally:
            os.close(fd)
        it, out = fmt.iter_labels(buf), {}
        while True:
            try:
                k, v = next(it)
            except StopIteration as stop:
                used = stop.value
                break
            out[k] = v
        self._seen[(nsid, name)] = (st.st_ino, start + used)
        return st.st_ino, out, used > 0 and start + used < st.st_size

    def _compact(self, nsid: bytes, dfd: int, live: dict[bytes, bytes]) -> None:
        """Our labels file rewritten with only `live` (tmp file, fsync, rename over)."""
        tmp = fmt.LABELS_NAME + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dfd)
        try:
            os.write(
                fd, fmt.pack_file_header(fmt.LABEL_MAGIC, 0) + b"".join(fmt.pack_label(k, v) for k, v in live.items())
            )
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, fmt.LABELS_NAME, src_dir_fd=dfd, dst_dir_fd=dfd)
        old = self._fds.pop(nsid, None)
        if old is not None:
            os.close(old)
        st = os.stat(fmt.LABELS_NAME, dir_fd=dfd, follow_symlinks=False)
        self._seen[(nsid, fmt.engine_dir(self.dirs.engine))] = (st.st_ino, st.st_size)
