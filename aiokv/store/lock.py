"""One engine per cache directory: an flock on DIR/lock that holds the owner's pid.

The process that owns the index takes the lock; a second engine gets one line
naming the holder's pid. Worker processes and read-only openers (inspect) do not
take it. The kernel drops the lock when its holder dies, kill -9 included, so a
stale lock never needs cleaning by hand.

Threading contract: created and released by the Store's owner thread.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time

RETRIES = 10


class StoreLocked(RuntimeError):
    pass


class DirLock:
    def __init__(self, root: str, dir_fd: int | None = None):
        """dir_fd: the root's descriptor (the lock file is opened relative to it)."""
        self.path = os.path.join(root, "lock")
        self.fd = os.open("lock" if dir_fd is not None else self.path,
                          os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            self._take()
        except BaseException:
            holder = os.pread(self.fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self.fd)
            self.fd = None
            if sys.exc_info()[0] is BlockingIOError:
                raise StoreLocked(
                    f"aiokv: cache directory {root} is in use by another engine (pid {holder}); "
                    "stop it or give this engine its own path") from None
            raise
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def _take(self) -> None:
        for attempt in range(RETRIES):
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                # holder_pid() holds a shared lock for an instant: try again briefly
                if attempt == RETRIES - 1:
                    raise
                time.sleep(0.02)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def holder_pid(root: str) -> int | None:
    """The pid of the engine holding the lock, or None when nobody holds it."""
    path = os.path.join(root, "lock")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
