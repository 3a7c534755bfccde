# SPDX-License-Identifier: Apache-2.0
"""A FUSE passthrough file system that can be made to hang, like a sick mount.

    python -m tests.stallfs SOURCE MOUNTPOINT CONTROL [THREADS]

Everything under MOUNTPOINT is SOURCE, except that while the file CONTROL
exists, what its first line holds hangs (the handler waits until CONTROL is removed
or says otherwise; the kernel keeps the caller in the system call meanwhile, as a
hung device does):
- "r" (or empty): reads of files whose name ends in `.data` do not answer;
- "w": nor do writes of them;
- "a": no operation on the mount answers (a hung NFS server, a frozen queue);
- "i": reads of an index's files (checkpoint, journal.<gen>, its image `index`) whose path
  contains CONTROL's second line (all of them without one) do not answer: an engine's store
  opens, and its loader thread waits there (a slow mount at a restart, held until the test says);
- "e": reads of an index's files fail with EIO (after any "i" ends): a load that fails;
- "j": writes of journal files (journal.<gen>) whose path contains CONTROL's second line
  (all of them without one) do not answer: a command stopped at a point the test chooses;
- "x": those writes fail with EIO (after any "j" ends): a held write that never lands.
- "t": reads of files whose name ends in `.safetensors` do not answer (a LoRA adapter's
  weights held while its files are hashed: the walk and stat calls still answer); while
  one such read waits, the file CONTROL.held exists (a test waits for it: the reader is
  inside that read, not merely about to make it).
While the file CONTROL.eio exists, reads of files whose path contains the text it holds
fail with EIO (a bad sector under one engine's journal), answered at once.
THREADS (default 200) is the daemon's thread pool. With a small pool (4) and
"r", the hung reads take every daemon thread and everything else on the mount
hangs behind them (a stat, an open, a journal write): what a real FUSE daemon
or network mount does. Mounted with `direct_io`, so every read reaches the
daemon (no page cache answers for it).

Tests use `mounted()`: it starts the daemon, waits for the mount, and on the
way out resumes reads first, then unmounts (lazily) and stops the daemon, so
no stuck mount or process is left behind.

Threading contract: libfuse calls the handlers from its own threads; the
handlers share nothing but the file descriptors of SOURCE files.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import subprocess
import sys
import time


def _says(control: str, what: str, path: str | None = None) -> bool:
    """Whether CONTROL's first line holds mode `what` (and, for a path, its second line, if any,
    is part of the path)."""
    try:
        with open(control) as f:
            modes, _, where = f.read().partition("\n")
    except FileNotFoundError:
        return False
    where = where.strip()
    return what in (modes or "r") and (path is None or not where or where in path)


def _index_file(path: str) -> bool:
    name = os.path.basename(path)
    return name in ("checkpoint", "index") or name.startswith("journal.")


def _eio(control: str, path: str) -> bool:
    try:
        with open(control + ".eio") as f:
            what = f.read()
    except FileNotFoundError:
        return False
    return bool(what) and what in path


def serve(source: str, mountpoint: str, control: str, threads: int = 200) -> None:
    import mfusepy as fuse

    def hang_all():
        while _says(control, "a"):  # nothing on the mount answers
            time.sleep(0.02)

    def hangs(cls):
        for name, fn in list(vars(cls).items()):
            if callable(fn) and not name.startswith("_"):
                setattr(cls, name, functools.wraps(fn)(lambda *a, _fn=fn, **k: (hang_all(), _fn(*a, **k))[1]))
        return cls

    @hangs
    class Passthrough(fuse.Operations):
        use_ns = True

        def _p(self, path: str) -> str:
            return os.path.join(source, path.lstrip("/"))

        def getattr(self, path, fh=None):
            try:
                st = os.fstat(fh) if fh is not None else os.lstat(self._p(path))
            except OSError as e:
                raise fuse.FuseOSError(e.errno) from None
            return {k: getattr(st, k) for k in ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_blocks")} | {
                "st_atime": st.st_atime_ns,
                "st_mtime": st.st_mtime_ns,
                "st_ctime": st.st_ctime_ns,
            }

        def _os(self, fn, *a):
            try:
                return fn(*a)
            except OSError as e:
                raise fuse.FuseOSError(e.errno) from None

        def readdir(self, path, fh):
            return [".", ".."] + self._os(os.listdir, self._p(path))

        def access(self, path, amode):
            if not os.access(self._p(path), amode):
                raise fuse.FuseOSError(errno.EACCES)
            return 0

        def mkdir(self, path, mode):
            return self._os(os.mkdir, self._p(path), mode)

        def rmdir(self, path):
            return self._os(os.rmdir, self._p(path))

        def unlink(self, path):
            return self._os(os.unlink, self._p(path))

        def rename(self, old, new):
            return self._os(os.rename, self._p(old), self._p(new))

        def chmod(self, path, mode):
            return self._os(os.chmod, self._p(path), mode)

        def chown(self, path, uid, gid):
            return self._os(os.chown, self._p(path), uid, gid)

        def utimens(self, path, times=None):
            return self._os(os.utime, self._p(path), None, times) if times else self._os(os.utime, self._p(path))

        def truncate(self, path, length, fh=None):
            return (
                self._os(os.ftruncate, fh, length) if fh is not None else self._os(os.truncate, self._p(path), length)
            )

        def open(self, path, flags):
            return self._os(os.open, self._p(path), flags & ~os.O_DIRECT)

        def create(self, path, mode, fi=None):
            return self._os(os.open, self._p(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)

        def read(self, path, size, offset, fh):
            if path.endswith(".data"):
                while _says(control, "r"):  # the hung disk
                    time.sleep(0.02)
            elif _index_file(path):
                while _says(control, "i", path):  # the index held where the loader reads it
                    time.sleep(0.02)
                if _says(control, "e"):
                    raise fuse.FuseOSError(errno.EIO)
            elif path.endswith(".safetensors") and _says(control, "t"):
                with contextlib.suppress(OSError):
                    open(control + ".held", "w").close()
                while _says(control, "t"):  # an adapter's weights held
                    time.sleep(0.02)
                with contextlib.suppress(OSError):
                    os.unlink(control + ".held")
            if _eio(control, path):
                raise fuse.FuseOSError(errno.EIO)
            return self._os(os.pread, fh, size, offset)

        def write(self, path, data, offset, fh):
            if path.endswith(".data"):
                while _says(control, "w"):  # a disk that takes no writes either
                    time.sleep(0.02)
            elif os.path.basename(path).startswith("journal."):
                while _says(control, "j", path):  # a journal write held where the test chose
                    time.sleep(0.02)
                if _says(control, "x", path):
                    raise fuse.FuseOSError(errno.EIO)
            return self._os(os.pwrite, fh, data, offset)

        def fallocate(self, path, mode, offset, size, fh):
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            if libc.fallocate(fh, mode, ctypes.c_long(offset), ctypes.c_long(size)) != 0:
                raise fuse.FuseOSError(ctypes.get_errno())
            return 0

        def fsync(self, path, datasync, fh):
            return self._os(os.fdatasync if datasync else os.fsync, fh)

        def flush(self, path, fh):
            return 0

        def release(self, path, fh):
            return self._os(os.close, fh)

        def statfs(self, path):
            st = os.statvfs(source)
            return {
                k: getattr(st, k)
                for k in (
                    "f_bsize",
                    "f_frsize",
                    "f_blocks",
                    "f_bfree",
                    "f_bavail",
                    "f_files",
                    "f_ffree",
                    "f_favail",
                    "f_flag",
                    "f_namemax",
                )
            }

    # 200: enough daemon threads that reads held forever leave some for other calls
    fuse.FUSE(Passthrough(), mountpoint, foreground=True, direct_io=True, max_threads=threads)


def _mounted_at(mountpoint: str) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == mountpoint for line in f)


@contextlib.contextmanager
def mounted(source: str, mountpoint: str, control: str, timeout: float = 20.0, threads: int = 200):
    """The file system mounted at mountpoint for the block (the daemon with
    `threads` threads); always cleaned up."""
    os.makedirs(source, exist_ok=True)
    os.makedirs(mountpoint, exist_ok=True)
    log = open(mountpoint.rstrip("/") + ".log", "w")
    p = subprocess.Popen(
        [sys.executable, "-m", "tests.stallfs", source, mountpoint, control, str(threads)],
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        stdout=log,
        stderr=log,
    )
    try:
        end = time.monotonic() + timeout
        while not _mounted_at(mountpoint):
            if p.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the FUSE daemon did not mount {mountpoint}: see {log.name}")
            time.sleep(0.05)
        yield p
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control)  # resume reads first: nothing may stay stuck in the kernel
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control + ".eio")
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)
        try:
            p.wait(3)
        except subprocess.TimeoutExpired:  # a file still open keeps a lazy unmount's daemon up
            p.kill()
            p.wait(10)
        log.close()


if __name__ == "__main__":
    serve(*sys.argv[1:4], *map(int, sys.argv[4:5]))
