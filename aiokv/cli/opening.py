# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`: opening a cache directory read-only, beside running engines.

The opening is the store's (aiokv/store/readonly.py: every engine's index replayed without a
lock, retried when a replay raced with a checkpoint); here its errors a user can cause (not a
store, locked, unreadable) become InspectError: one line, exit status 2.

Threading: one thread (the CLI's).
"""

from __future__ import annotations

from aiokv.store import readonly
from aiokv.store.lock import engines
from aiokv.store.store import Store

SCHEMA = 1  # version of the --format json documents


class InspectError(Exception):
    """One line for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def check_root(root: str) -> None:
    try:
        readonly.check_root(root)
    except readonly.StoreUnreadable as e:
        raise InspectError(str(e)) from None


def engines_running(root: str) -> dict[int, int]:
    """engine number -> pid of every engine running on the directory now."""
    return {e: pid for e, pid in engines(root).items() if pid is not None}


def open_readonly(root: str) -> Store:
    """Replay the index without the lock (store/readonly.py); InspectError for what a user can fix."""
    try:
        return readonly.open_readonly(root)
    except readonly.StoreUnreadable as e:
        raise InspectError(str(e)) from None
