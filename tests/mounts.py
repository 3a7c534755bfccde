# SPDX-License-Identifier: Apache-2.0
"""Small real file systems for tests (as root, as CI runs): a tmpfs of a given size
(a real ENOSPC once full) and an ext4 on a loop device. Each is unmounted on the
way out, whatever the test did."""

from __future__ import annotations

import contextlib
import os
import subprocess

import pytest


def _root(what: str) -> None:
    if os.geteuid() != 0:
        pytest.fail(f"this test mounts {what} and must run as root (CI does)")


@contextlib.contextmanager
def tmpfs(where, size: str):
    _root("a tmpfs")
    os.makedirs(where, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "none", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


@contextlib.contextmanager
def loop_ext4(where, size: str, options: str = ""):
    """ext4 of `size` at `where`, on a loop device over `where`.img; mount `options` added."""
    _root("a loop file system")
    img = f"{where}.img"
    subprocess.run(["truncate", "-s", size, img], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", img], check=True)
    os.makedirs(where, exist_ok=True)
    subprocess.run(["mount", "-o", "loop" + (f",{options}" if options else ""), img, str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)
