# SPDX-License-Identifier: Apache-2.0
"""Which I/O backend a caller gets: open_backend.

io_uring is probed at start; where it is refused (EPERM/ENOSYS under a
container's seccomp profile) the thread-pool backend takes over, said once in the
log. So it does, said once, where the files are on FUSE or a network file system:
there an io_uring submission itself can block the event loop's thread (FUSE puts
a thread that submits past its queue of background requests to sleep until the
daemon answers; a hung daemon never does), while a pool thread may block alone.
AIOKV_IO=uring|threads (or the `io` setting) forces one.

Imports go one way: this module imports the backends (uring.py, threads.py, and
the test-only faults.py), which import backend.py (the interface), which
imports neither.
"""

from __future__ import annotations

import asyncio
import errno
import os

from aiokv.data.backend import IOBackend, say_once

# file systems where submitting to io_uring can sleep in the submitting thread
BLOCKING_SUBMIT_FS = ("fuse", "nfs", "nfs4", "cifs", "smb3", "9p", "ceph")


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, file system type) of the mount that holds `path`."""
    path = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                _, mnt, fstype = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, fstype
    except OSError:
        pass
    return best, kind


def open_backend(
    loop: asyncio.AbstractEventLoop, kind: str | None = None, depth: int = 64, path: str | None = None
) -> IOBackend:
    """The io_uring backend if the kernel allows it and `path` (where the files
    are) is not on FUSE or a network file system, else the thread-pool one
    (wrapped by the test-only fault injector when tests deliberately ask for it)."""
    kind = kind or os.environ.get("AIOKV_IO", "auto")
    if kind == "auto" and path is not None:
        mnt, fs = mount_of(path)
        if fs.split(".")[0] in BLOCKING_SUBMIT_FS:
            # one line per mount point (not per namespace directory: one per KV-cache group)
            say_once(
                f"aiokv: the cache at {mnt} is on {fs}, where an io_uring submission can block; "
                "using the thread-pool I/O backend"
            )
            kind = "threads"
    backend = _open_backend(loop, kind, depth)
    if os.environ.get("AIOKV_FAULTS"):
        from aiokv.data.faults import FaultyBackend, rules_from_env

        rules = rules_from_env()
        if rules:
            return FaultyBackend(backend, rules)
    return backend


def _open_backend(loop: asyncio.AbstractEventLoop, kind: str | None, depth: int) -> IOBackend:
    kind = kind or os.environ.get("AIOKV_IO", "auto")
    if kind not in ("auto", "uring", "threads"):
        raise ValueError(f"aiokv: AIOKV_IO={kind!r} is not one of auto, uring, threads")
    if kind in ("auto", "uring"):
        from aiokv import _native

        if not getattr(_native, "HAVE_URING", 1):  # built without liburing (setup.py)
            if kind == "uring":
                raise OSError(
                    errno.ENOSYS,
                    "aiokv was built without io_uring (AIOKV_WITHOUT_URING=1); "
                    "rebuild it with liburing-dev installed, or use io=threads",
                )
            say_once("aiokv: built without io_uring; using the thread-pool I/O backend")
            kind = "threads"
    if kind in ("auto", "uring"):
        try:
            from aiokv.data.uring import UringBackend

            return UringBackend(loop, depth=depth)
        except OSError as e:
            if kind == "uring":
                raise
            say_once(f"aiokv: io_uring unavailable ({os.strerror(e.errno or 0)}); using the thread-pool I/O backend")
    from aiokv.data.threads import ThreadBackend

    return ThreadBackend(loop, threads=min(depth, 16))
