# SPDX-License-Identifier: Apache-2.0
"""A cache directory opened read-only, beside running engines: for `aiokv inspect` and the
operator's commands (aiokv/ops/), which count what an order is for before they write it.

Every engine's index is replayed with Store(readonly=True) (no lock, no writes; a torn journal
tail just ends the replay). A replay that raced with a checkpoint (the journal it wanted was
deleted, or a namespace was half made) is tried again, up to ATTEMPTS replays in all. What a
user can cause (not a store, unreadable, damaged) is `StoreUnreadable`: one line naming the
fix, which each caller raises as its own error type.

Threading: the caller's thread (the CLI's); the Store opened has no I/O thread.
"""

from __future__ import annotations

import json
import os
import time

from aiokv.store.store import NotAStore, Store

RETRY_PAUSE = 0.05
ATTEMPTS = 3  # replays tried when the engine moved files meanwhile


class StoreUnreadable(Exception):
    """One line for the user (it names the fix)."""


def _not_a_store(root: str, why: str) -> StoreUnreadable:
    return StoreUnreadable(f"aiokv: {root} is not an aiokv store ({why})")


def check_root(root: str) -> None:
    """StoreUnreadable if root is not a cache directory (missing, a file, no aiokv.json)."""
    if not os.path.exists(root):
        raise _not_a_store(root, "no such directory")
    if not os.path.isdir(root):
        raise _not_a_store(root, "not a directory")
    if not os.path.isfile(os.path.join(root, "aiokv.json")):
        raise _not_a_store(root, "no aiokv.json")


def _journal_missing(st: Store) -> list[str]:
    """Namespaces whose current journal file is absent: a replay that raced with
    a checkpoint (which deletes the old generation) or with namespace creation."""
    out = []
    for (nsid, _), fl in st.followers.items():
        if fl.replayed and not os.path.exists(os.path.join(fl.dir, f"journal.{fl.gen}")):
            out.append(nsid.hex())
    return out


def open_readonly(root: str) -> Store:
    """Replay the index without the lock; retried if the engine moved files meanwhile."""
    root = os.path.abspath(root)
    check_root(root)
    for attempt in range(ATTEMPTS):
        try:
            st = Store(root, readonly=True)
        except NotAStore as e:
            raise StoreUnreadable(str(e)) from None
        except json.JSONDecodeError as e:
            if attempt < ATTEMPTS - 1:  # namespace.json being replaced? (it is written to a temp file first)
                time.sleep(RETRY_PAUSE)
                continue
            raise StoreUnreadable(f"aiokv: {root} is not an aiokv store or is damaged (bad JSON: {e})") from None
        except FileNotFoundError as e:
            if attempt < ATTEMPTS - 1:  # a namespace being created, a file vanishing under a checkpoint
                time.sleep(RETRY_PAUSE)
                continue
            raise StoreUnreadable(
                f"aiokv: {root}: {e.strerror}: {e.filename} (a damaged store? an owner opening it rebuilds what it can)"
            ) from None
        except KeyError as e:
            raise StoreUnreadable(f"aiokv: {root}: a namespace.json lacks {e}") from None
        if _journal_missing(st) and attempt < ATTEMPTS - 1:
            st.close()
            time.sleep(RETRY_PAUSE)
            continue
        return st
    raise AssertionError("unreachable")
