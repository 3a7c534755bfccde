# SPDX-License-Identifier: Apache-2.0
"""A block device with bad sectors, for faults that come from the kernel.

    python -m tests.badsectors IMAGE_DIR MOUNTPOINT CONTROL

The kernel here has no device-mapper (no dm-error or dm-flakey target), so the
device is built from what it has: a one-file FUSE file system (this module's
daemon) serves IMAGE_DIR/disk.img, a loop device is attached to that file, and
ext4 is made and mounted on the loop device. While CONTROL holds
`{"read": [[start, end], ...], "write": [...]}` (byte ranges of the device), the
daemon answers a read or write of the image that touches a range with EIO, as a
drive with bad sectors there does: the loop driver fails the block request, ext4
fails the system call, and io_uring hands -EIO to aiokv in its completion.
Nothing above the kernel is wrapped. `BadDisk.extents(path)` tells which device
ranges hold a file (FIEMAP, through filefrag), so a test can spoil exactly the
sectors under aiokv's data file and leave ext4's own metadata and journal alone.

Threading contract: libfuse calls the handlers from its own threads; they share
only the image's file descriptors. `BadDisk` is used from the test's thread.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import subprocess
import sys
import time

IMAGE = "disk.img"


def _bad(control: str, op: str, offset: int, size: int) -> bool:
    try:
        with open(control) as f:
            ranges = json.load(f).get(op, [])
    except (FileNotFoundError, ValueError):
        return False
    return any(offset < end and start < offset + size for start, end in ranges)


def serve(image_dir: str, mountpoint: str, control: str) -> None:
    import mfusepy as fuse

    path = os.path.join(image_dir, IMAGE)

    class OneFile(fuse.Operations):
        def getattr(self, p, fh=None):
            if p == "/":
                return {"st_mode": 0o40755, "st_nlink": 2}
            if p != "/" + IMAGE:
                raise fuse.FuseOSError(errno.ENOENT)
            st = os.stat(path)
            return {
                "st_mode": st.st_mode,
                "st_nlink": 1,
                "st_size": st.st_size,
                "st_blocks": st.st_blocks,
                "st_mtime": st.st_mtime,
                "st_atime": st.st_atime,
                "st_ctime": st.st_ctime,
            }

        def readdir(self, p, fh):
            return [".", "..", IMAGE]

        def open(self, p, flags):
            return os.open(path, os.O_RDWR)

        def read(self, p, size, offset, fh):
            if _bad(control, "read", offset, size):
                raise fuse.FuseOSError(errno.EIO)
            return os.pread(fh, size, offset)

        def write(self, p, data, offset, fh):
            if _bad(control, "write", offset, len(data)):
                raise fuse.FuseOSError(errno.EIO)
            return os.pwrite(fh, data, offset)

        def fsync(self, p, datasync, fh):
            os.fsync(fh)
            return 0

        def flush(self, p, fh):
            return 0

        def release(self, p, fh):
            os.close(fh)
            return 0

    fuse.FUSE(OneFile(), mountpoint, foreground=True, direct_io=True, max_threads=32)


class BadDisk:
    """An ext4 file system at `root` on a loop device whose sectors can be made bad."""

    def __init__(self, work: str, size_mib: int = 256):
        self.work = work
        self.images, self.fuse_at, self.root = (os.path.join(work, n) for n in ("images", "fuse", "fs"))
        self.control = os.path.join(work, "bad.json")
        for d in (self.images, self.fuse_at, self.root):
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(self.images, IMAGE), "wb") as f:
            f.truncate(size_mib << 20)
        self.log = open(os.path.join(work, "badsectors.log"), "w")
        self.daemon = self.loop = None
        self.mounted = False

    def start(self) -> "BadDisk":
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "tests.badsectors", self.images, self.fuse_at, self.control],
            cwd=root,
            stdout=self.log,
            stderr=self.log,
        )
        end = time.monotonic() + 20
        while not os.path.exists(os.path.join(self.fuse_at, IMAGE)):
            if self.daemon.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"the bad-sector daemon did not mount: see {self.log.name}")
            time.sleep(0.05)
        self.loop = subprocess.run(
            ["losetup", "-f", "--show", os.path.join(self.fuse_at, IMAGE)], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", self.loop], check=True)
        subprocess.run(["mount", "-o", "errors=continue", self.loop, self.root], check=True)
        self.mounted = True
        return self

    def extents(self, path: str) -> list[tuple[int, int]]:
        """Device byte ranges [start, end) that hold `path`'s data (written or preallocated)."""
        out = subprocess.run(["filefrag", "-v", "-b4096", path], check=True, capture_output=True, text=True).stdout
        ranges = []
        for m in re.finditer(r"^\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+)\.\.\s*(\d+):", out, re.M):
            ranges.append((int(m.group(1)) * 4096, (int(m.group(2)) + 1) * 4096))
        return ranges

    def spoil(self, read=(), write=()) -> None:
        """From now on, I/O touching these device ranges fails with EIO in the kernel."""
        with open(self.control + ".tmp", "w") as f:
            json.dump({"read": list(read), "write": list(write)}, f)
        os.replace(self.control + ".tmp", self.control)

    def heal(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.control)

    def stop(self) -> None:
        self.heal()
        if self.mounted:
            subprocess.run(["umount", "-l", self.root], capture_output=True)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], capture_output=True)
        subprocess.run(["fusermount3", "-u", "-z", self.fuse_at], capture_output=True)
        if self.daemon is not None:
            try:
                self.daemon.wait(5)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait(10)
        self.log.close()


if __name__ == "__main__":
    serve(*sys.argv[1:4])
