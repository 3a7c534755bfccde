# SPDX-License-Identifier: Apache-2.0
"""Shutdown stays within its bound, and the engine's lock is given back last (issue 40, item 10).

The bug: `Store.close` first waited up to CLOSE_MAX (30 s) for the thread loading the index in
the background, and only then began the close that is itself bounded by CLOSE_MAX; `Drives.close`
closed the drives one after the other. With the index reads of a sick disk hanging, the engine's
shutdown took CLOSE_MAX per drive and more, and once the join gave up the directories and the
engine's lock were closed under a loader that was still reading (and may still cut a torn tail or
write a rebuilt checkpoint): another engine could take that engine number and its files while
the old loader wrote them.
The invariant: the whole close returns within the documented bound (docs/design.md, "Bounded
start and shutdown": close_wait, max(CLOSE_WAIT, fs_timeout), without an answer, CLOSE_MAX in all), whatever the loader does
and however many drives there are; the engine's lock is given back last, never while its loader
may still read or write its files: by close if the loader has ended, else by the loader when it
ends.
The fix: store.py: the loader is waited for after the journals are closed, at most CLOSE_WAIT
within the close deadline; the data files, directories and lock go with the last of close and
the loader to finish (`_release_dirs`); drives.py closes every drive at once (fsthread.at_once).
"""

from __future__ import annotations

import os
import sys
import time

from aiokv.store import Store
from aiokv.store import persist as persist_mod
from aiokv.store.drives import open_drives
from aiokv.store.lock import engines
from tests.conftest import NS, PAYLOAD, key
from tests.stallfs import mounted
from tests.workers import until

DRIVES = 3
CLOSE_WAIT, CLOSE_MAX = 1.0, 3.0  # (the bounds, shortened for the test; fs_timeout is CLOSE_WAIT)


def _fill(path: str) -> None:
    st = Store(path, capacity="64MiB")
    ns = st.namespace(NS, PAYLOAD)
    keys = [key(i) for i in range(8)]
    st.commit(ns, [(k, st.reserve(ns, k)) for k in keys])
    st.close()  # (a checkpoint and a new journal: what the loader reads)


def _loading(store) -> bool:
    """Whether the store's loader thread is inside the read of an index (where it hangs)."""
    t = store._loader
    frame = sys._current_frames().get(t.ident) if t is not None and t.is_alive() else None
    while frame is not None:
        if frame.f_code.co_name == "read_own":
            return True
        frame = frame.f_back
    return False


def test_close_with_hung_index_loaders_on_several_drives_returns_within_its_bound(tmp_path, monkeypatch):
    monkeypatch.setattr(persist_mod, "CLOSE_WAIT", CLOSE_WAIT)
    monkeypatch.setattr(persist_mod, "CLOSE_MAX", CLOSE_MAX)
    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control):
        paths = [str(tmp_path / "mnt" / f"d{d}") for d in range(DRIVES)]
        for p in paths:
            _fill(p)
        with open(control, "w") as f:
            f.write("i")  # the index files' reads hang from now on (the journals still take writes)
        drives, _ = open_drives(
            paths, lambda p, n: (Store(p, capacity="64MiB", io_thread=True, fs_timeout=CLOSE_WAIT), []), 20.0
        )
        try:
            stores = list(drives.stores.values())
            assert len(stores) == DRIVES
            assert until(lambda: all(_loading(s) for s in stores), 10), "the loaders never reached the index read"
            t = time.monotonic()
            drives.close()
            took = time.monotonic() - t
            assert took < CLOSE_MAX + 1.0, (
                f"closing {DRIVES} drives whose index loaders hang took {took:.1f} s; "
                f"the bound is CLOSE_MAX ({CLOSE_MAX:.0f} s) in all"
            )
            held = {p: engines(p).get(0) for p in paths}
            assert all(pid == os.getpid() for pid in held.values()), (
                f"engine 0's lock given back while its loader may still write its files: {held}"
            )
        finally:
            os.unlink(control)  # the reads answer again: the loaders end
        assert until(lambda: all(s._loader is None or not s._loader.is_alive() for s in stores), 10)
        assert until(lambda: all(engines(p).get(0) is None for p in paths), 10), (
            f"the locks were never given back once the loaders ended: {[engines(p) for p in paths]}"
        )
        # and the drives open again as engine 0, their blocks there
        for p in paths:
            st = Store(p, capacity="64MiB")
            assert st.engine == 0 and st.namespace(NS, PAYLOAD).count() == 8
            st.close()
