# SPDX-License-Identifier: Apache-2.0
"""Directories of a cache, opened as descriptors and never through a symlink.

Everything under the cache directory is opened, created, renamed and removed
relative to a directory descriptor (dir_fd=), and every directory descriptor
is opened with O_NOFOLLOW: a symlink swapped in anywhere under the cache
directory is refused, never followed. The owner also refuses a directory that
another user owns or that group/others can write (they could plant files).

Also here: the small JSON files (aiokv.json, namespace.json), written atomically.

Threading contract: plain functions, any thread.
"""

from __future__ import annotations

import errno
import json
import os

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# every file under the cache directory is opened with these (and its access mode): the one
# definition the data path, the store's index, control, tenants and labels files and the CLI use
FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class NotAStore(ValueError):
    """A directory aiokv will not use as a cache; the message is one line naming the fix."""


def open_dir(path: str, dir_fd: int | None = None, create: bool = False) -> int:
    """Open the directory `path` (relative to dir_fd: its last component) without
    following a symlink; mkdir it (0700) first if `create`."""
    name = os.path.basename(path) if dir_fd is not None else path
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotAStore(
                f"aiokv: {path} is a symlink or not a directory; aiokv follows no symlinks in its "
                f"cache directory: remove it or give aiokv a new directory"
            ) from None
        raise


def open_under(root: str, *names: str) -> int:
    """The directory root/names..., each step opened with O_NOFOLLOW."""
    fd = open_dir(root)
    path = root
    for name in names:
        path = os.path.join(path, name)
        try:
            nxt = open_dir(path, fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def check_private(fd: int, path: str) -> None:
    """Refuse a directory another user owns or group/others can write."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise NotAStore(
            f"aiokv: cache directory {path} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.geteuid()}); give aiokv a directory of its own"
        )
    if st.st_mode & 0o022:
        raise NotAStore(
            f"aiokv: cache directory {path} can be written by other users (mode "
            f"{st.st_mode & 0o777:o}); run: chmod go-w {path}"
        )


def fsync_dir(fd: int) -> None:
    os.fsync(fd)


def _exists(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_json(name: str, obj: dict, dir_fd: int) -> None:
    tmp = name + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | FILE_FLAGS, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def _read_json(name: str, dir_fd: int, path: str) -> dict:
    fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    with os.fdopen(fd) as f:
        try:
            return json.load(f)
        except ValueError as e:
            raise NotAStore(
                f"aiokv: {os.path.join(path, name)} is damaged (bad JSON: {e}); "
                f"remove {path} or give aiokv a new directory"
            ) from None
