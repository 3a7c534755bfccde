# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`: opening a cache directory read-only, beside running engines.

Every engine's index is replayed with Store(readonly=True) (no lock, no writes;
a torn journal tail just ends the replay). A replay that raced with a
checkpoint (the journal it wanted was deleted, or a namespace was half made) is
tried again, up to ATTEMPTS replays in all. Errors a user can cause (not a
store, locked, unreadable) are InspectError: one line, exit status 2.

Threading: one thread (the CLI's).
"""

from __future__ import annotations

import json
import os
import time

from aiokv.store.lock import engines
from aiokv.store.store import NotAStore, Store

RETRY_PAUSE = 0.05
ATTEMPTS = 3  # replays tried when the engine moved files meanwhile
SCHEMA = 1  # version of the --format json documents


class InspectError(Exception):
    """One line for the user; `code` is the exit status."""

    def __init__(self, msg: str, code: int = 2):
        super().__init__(msg)
        self.code = code


def _not_a_store(root: str, why: str) -> InspectError:
    return InspectError(f"aiokv: {root} is not an aiokv store ({why})")


def check_root(root: str) -> None:
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


def engines_running(root: str) -> dict[int, int]:
    """engine number -> pid of every engine running on the directory now."""
    return {e: pid for e, pid in engines(root).items() if pid is not None}


def open_readonly(root: str) -> Store:
    """Replay the index without the lock; retried if the engine moved files meanwhile."""
    root = os.path.abspath(root)
    check_root(root)
    for attempt in range(ATTEMPTS):
        try:
            st = Store(root, readonly=True)
        except NotAStore as e:
            raise InspectError(str(e)) from None
        except json.JSONDecodeError as e:
            if attempt < ATTEMPTS - 1:  # namespace.json being replaced? (it is written to a temp file first)
                time.sleep(RETRY_PAUSE)
                continue
            raise InspectError(f"aiokv: {root} is not an aiokv store or is damaged (bad JSON: {e})") from None
        except FileNotFoundError as e:
            if attempt < ATTEMPTS - 1:  # a namespace being created, a file vanishing under a checkpoint
                time.sleep(RETRY_PAUSE)
                continue
            raise InspectError(
                f"aiokv: {root}: {e.strerror}: {e.filename} (a damaged store? an owner opening it rebuilds what it can)"
            ) from None
        except KeyError as e:
            raise InspectError(f"aiokv: {root}: a namespace.json lacks {e}") from None
        if _journal_missing(st) and attempt < ATTEMPTS - 1:
            st.close()
            time.sleep(RETRY_PAUSE)
            continue
        return st
    raise AssertionError("unreachable")
