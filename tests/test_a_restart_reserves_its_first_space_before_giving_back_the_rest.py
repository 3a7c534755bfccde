# SPDX-License-Identifier: Apache-2.0
"""A restarted engine reserves the space for its first saves ahead of giving back the rest.

The bug: when a restarted namespace's index was installed (store/loading.py), every slot the index
does not name was queued on the I/O thread to be punched, the files cut at the last used slot, and
only then the first grow. Its free list was empty meanwhile, so the first saves found no slot and
a grow in flight, and a step waits for a grow only WAIT_PER_STEP: on a loaded or slow disk, or
behind the punch of the millions of slots a clear leaves, a restart's first requests were not
saved (`store_skipped_fs_busy`; seen in CI: all 24 saves of a restarted life's first step).

The invariant: once a restarted namespace's index is in, its first grow does not wait for the
give-back of the last life's unnamed slots: it reserves the lowest of them (the last life's free
ones are backed already), cutting the last life's tail itself; the rest is punched after it; the
disk space the files hold is then what the allocator counts (nothing left over, nothing counted
twice).

The fix: Loader.loaded keeps the lowest grow's worth of unnamed slots for a grow queued first
(Space.grow's `cut`) and gives back only the rest (Replay.give_back_io without the cut).
"""

from __future__ import annotations

import os
import threading

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store import replay as replay_mod
from aiokv.store import space as space_mod
from tests.conftest import refresh_until

NS = b"g" * 16
PAYLOAD = 4096
SB = fmt.slot_bytes(PAYLOAD)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def _allocated(root: str) -> int:
    """Bytes our data files hold on disk."""
    n = 0
    for d, _, files in os.walk(root):
        n += sum(os.stat(os.path.join(d, f)).st_blocks * 512 for f in files if f == fmt.data_file(0))
    return n


def test_a_restarts_first_saves_find_space_while_the_rest_is_still_given_back(tmp_path, monkeypatch):
    monkeypatch.setattr(space_mod, "GROW_BYTES", 8 * SB)  # a grow is 8 slots (64 MiB in use)
    root = str(tmp_path / "c")
    st = Store(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    st.commit(ns, [(key(i), st.reserve(ns, key(i))) for i in range(36)])  # slots 0-35; 36-39 grown, free
    freed = [ns.where(key(i)) for i in range(10, 30)]
    assert sorted(freed) == list(range(10, 30))
    for slot in freed:  # the last life's free slots among its blocks
        assert st.space.evict(ns, slot, punch=False)
    assert _allocated(root) == 40 * SB
    st.close()

    go, held, gave_back = threading.Event(), threading.Event(), threading.Event()
    give_back_io = replay_mod.Replay.give_back_io

    def slow(self, *a, **kw):  # the punch of a clear's millions of slots, or a slow disk
        held.set()
        assert go.wait(30)
        try:
            return give_back_io(self, *a, **kw)
        finally:
            gave_back.set()

    monkeypatch.setattr(replay_mod.Replay, "give_back_io", slow)
    st = Store(root, capacity="1GiB", io_thread=True)
    try:
        ns = st.namespace(NS, PAYLOAD)
        refresh_until(st, lambda: ns.ready and held.is_set(), "the index did not load")
        refresh_until(st, lambda: not st.space.growing, "the first grow waited for the give-back", timeout=10)
        where = st.reserve(ns, key(1000))
        assert where is not None and st.stats.skipped_fs_busy == 0
        assert where == 10, "the lowest of the last life's free slots is reused first (backed already)"
        st.commit(ns, [(key(1000), where)])
        go.set()
        refresh_until(st, lambda: gave_back.is_set() and not st.fs.pending, "the give-back did not end")
        st.refresh()
        # the last life's tail (36-39) cut, 18-29 punched, 10-17 kept, and the grow ahead its save
        # queued behind the give-back (36-43, once 7 were left free): on disk exactly what is counted
        assert (ns.alloc.hwm, ns.alloc.in_use, len(ns.alloc.free), ns.alloc.hole_count) == (44, 17, 15, 12)
        assert sorted(ns.alloc.free) == [*range(11, 18), *range(36, 44)]
        assert _allocated(root) == ns.alloc.backed * SB == 32 * SB
        assert st.lookup(ns, [key(i) for i in range(36) if not 10 <= i < 30] + [key(1000)]) == 17
    finally:
        go.set()
        st.close()
    st = Store(root, capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(36) if not 10 <= i < 30] + [key(1000)]) == 17
    st.close()
