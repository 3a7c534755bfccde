# SPDX-License-Identifier: Apache-2.0
"""Engine numbers on a cache directory: an flock per engine that holds its pid.

Several engines share a directory; each owns the files of one engine number E
(docs/format.md), and holds `flock(LOCK_EX)` on DIR/lock (E = 0, the lock file
of a single-engine directory) or DIR/lock.<E> for as long as it runs. A
starting engine takes the lowest number whose lock is free, so a restarted (or
any new) engine adopts the files of an engine that died; only when all
MAX_ENGINES numbers are in use does it fail, with one line. Worker processes and
read-only openers (inspect) take no lock. The kernel drops a lock when its
holder dies, kill -9 included, so a stale lock never needs cleaning by hand.

Threading contract: created and released by the Store's owner thread.
"""

from __future__ import annotations

import fcntl
import os
import time

from aiokv.data.dirs import FILE_FLAGS
from aiokv.data.format import MAX_ENGINES

RETRIES = 10


class StoreLocked(RuntimeError):
    pass


def lock_name(engine: int) -> str:
    return "lock" if engine == 0 else f"lock.{engine}"


def engine_of_lock(name: str) -> int | None:
    if name == "lock":
        return 0
    tail = name[5:]
    if name.startswith("lock.") and tail.isdigit() and tail == str(int(tail)) and 0 < int(tail) < MAX_ENGINES:
        return int(tail)
    return None


class DirLock:
    def __init__(self, root: str, dir_fd: int | None = None, engine: int | None = None, wait: bool = True):
        """Take the lock of `engine`, or of the lowest free engine number when None.
        dir_fd: the root's descriptor (lock files are opened relative to it).
        wait=False: one try only (a running engine's lock is not waited for)."""
        self.engine = None
        self.fd = None
        for e in [engine] if engine is not None else range(MAX_ENGINES):
            name = lock_name(e)
            fd = os.open(
                name if dir_fd is not None else os.path.join(root, name),
                os.O_RDWR | os.O_CREAT | FILE_FLAGS,
                0o600,
                dir_fd=dir_fd,
            )
            try:
                # an explicit number waits out holder_pid's instant shared lock;
                # otherwise a busy-looking number just means trying the next one
                self._take(fd, RETRIES if engine is not None and wait else 1)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                continue
            except BaseException:
                os.close(fd)
                raise
            self.fd, self.engine = fd, e
            break
        if self.fd is None:
            if engine is not None:
                raise StoreLocked(
                    f"aiokv: engine {engine} of cache directory {root} is running (pid {holder}); stop it first"
                )
            raise StoreLocked(
                f"aiokv: cache directory {root} is in use by {MAX_ENGINES} engines already; "
                "stop one or give this engine its own path"
            )
        self.path = os.path.join(root, lock_name(self.engine))
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    @staticmethod
    def _take(fd: int, tries: int) -> None:
        for attempt in range(tries):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                # holder_pid() holds a shared lock for an instant: try again briefly
                if attempt == tries - 1:
                    raise
                time.sleep(0.02)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def engines(root: str) -> dict[int, int | None]:
    """Every engine number that has a lock file: its pid while it runs, None when dead."""
    try:
        names = os.listdir(root)
    except OSError:
        return {}
    out = {}
    for name in names:
        e = engine_of_lock(name)
        if e is not None:
            out[e] = holder_pid(root, e)
    return dict(sorted(out.items()))


def holder_pid(root: str, engine: int = 0) -> int | None:
    """The pid of the engine holding the lock of `engine`, or None when nobody holds it."""
    path = os.path.join(root, lock_name(engine))
    try:
        fd = os.open(path, os.O_RDONLY | FILE_FLAGS)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            txt = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(txt) if txt.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
