# SPDX-License-Identifier: Apache-2.0
"""Drive wear: the bytes each engine has committed to a cache directory since it was
first used, kept across restarts in `DIR/wear.<E>` (JSON: {"since": first use, seconds
since the epoch, "bytes": committed}), so that `aiokv inspect` can estimate the drive
writes per day the cache costs (an estimate: committed blocks, all ranks, as written;
writes that failed and the index's own files are not counted).

Each engine writes only its own file, atomically (a temporary file renamed over it),
at most every SAVE_EVERY seconds and at close; a file that is damaged or missing counts
from now (its bytes are lost, never the cache).

Threading contract: `count` and `due` on the store's owner thread; `save` on the
store's I/O thread (queued by the owner), `read_all` anywhere (readers).
"""

from __future__ import annotations

import json
import os
import time

from aiokv.data.dirs import FILE_FLAGS, _write_json

SAVE_EVERY = 60.0  # seconds between writes of an engine's wear file
DAY = 86400.0


def wear_name(engine: int) -> str:
    return f"wear.{engine}"


def _read(name: str, dir_fd: int) -> dict | None:
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        try:
            got = json.loads(f.read(4096))
        except ValueError:
            return None
    ok = isinstance(got, dict) and isinstance(got.get("since"), (int, float)) and isinstance(got.get("bytes"), int)
    return got if ok and got["bytes"] >= 0 else None


class Wear:
    def __init__(self, dir_fd: int, engine: int):
        self.dir_fd, self.engine = dir_fd, engine
        got = _read(wear_name(engine), dir_fd)
        self.since = got["since"] if got else time.time()
        self.bytes = got["bytes"] if got else 0
        self._saved = time.monotonic()

    def count(self, nbytes: int) -> None:
        self.bytes += nbytes

    def due(self) -> bool:
        return time.monotonic() - self._saved >= SAVE_EVERY

    def snapshot(self) -> dict:
        self._saved = time.monotonic()
        return {"since": self.since, "bytes": self.bytes}

    def save(self, snap: dict) -> None:
        _write_json(wear_name(self.engine), snap, self.dir_fd)


def read_all(dir_fd: int, fs_bytes: int, now: float | None = None) -> dict:
    """Every engine's wear of the directory, and the estimate of drive writes per day."""
    total, since = 0, None
    for name in os.listdir(dir_fd):
        if name.startswith("wear.") and name[5:].isdigit():
            got = _read(name, dir_fd)
            if got:
                total += got["bytes"]
                since = got["since"] if since is None else min(since, got["since"])
    days = max((now or time.time()) - since, 3600.0) / DAY if since is not None else None
    return {
        "written_bytes": total,
        "since": since,
        "drive_bytes": fs_bytes,
        "drive_writes_per_day": round(total / days / fs_bytes, 6) if days and fs_bytes else None,
    }
