# SPDX-License-Identifier: Apache-2.0
"""Every save the store turns away is counted under its cause, and only a committed block is
ever evicted for a new one.

Bug: a save refused because the namespace's index was still loading, or because the disk space
for it was still being reserved on the I/O thread, was counted only in attributes nothing
exported: the operator saw fewer saves planned than wanted and no cause. And the e2e test of
the capacity bound assumed a full capacity always had something to evict: on a slow disk every
slot of a small capacity can still be being written (reserved, not committed) when the next
saves come; those are dropped as no_space, none is evicted, and the test failed in CI
(store_evictions = 0).

Invariant: a reservation refused is counted once, by cause (`save_dropped_blocks{cause}`:
no_space, index_loading, space_busy); a block still being written is never evicted; once
blocks are committed, a full capacity evicts the least recently used for each new save.

Fix: the two causes are store stats (rows of the table of counters); the e2e tests settle the
first blocks before asking for eviction.

Bug (a review found it looking for the causes): a namespace reopened at a restart came out of its
background load with no free slot (the index's unused slots are given back), and nothing reserved
space for it until its first save asked: that save, and every other one of the step, was skipped
(space_busy) whenever the reservation took longer than the step's 50 ms wait (a busy disk). A new
namespace reserves ahead at creation; the reopened one now does too, once its index is installed.
"""

from __future__ import annotations

import threading
import time

from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store.space import Space
from aiokv.store.store import StoreStats
from aiokv.util import counters
from aiokv.util.counting import store_counters
from tests.conftest import NS, PAYLOAD, key

SB = fmt.slot_bytes(PAYLOAD)


def _fill(st, ns) -> list:
    """Reserve new keys until the capacity refuses one; the reservations made."""
    got = []
    while (where := st.reserve(ns, key(len(got)))) is not None:
        got.append((key(len(got)), where))
        assert len(got) < 1000
    return got


def test_a_block_still_being_written_is_never_evicted_and_the_refusal_is_no_space(tmp_path):
    st = Store(str(tmp_path / "s"), capacity=8 * SB + (1 << 20))  # (room for the journal too)
    ns = st.namespace(NS, PAYLOAD)
    pending = _fill(st, ns)
    assert pending, "the capacity holds some slots"
    assert st.stats.skipped_no_space == 1 and st.stats.evictions == 0, "nothing committed: nothing evicted"
    assert all(ns.pending.get(k) == w for k, w in pending), "no reservation taken back"
    st.commit(ns, pending)
    n = len(pending)
    more = [(key(1000 + i), st.reserve(ns, key(1000 + i))) for i in range(3)]
    assert all(w is not None for _, w in more), "committed blocks make room"
    assert st.stats.evictions == 3 and st.blocks() == n - 3
    assert st.lookup(ns, [key(0), key(1), key(2)]) == 0 and st.lookup(ns, [key(3)]) == 1, "the oldest went first"
    st.abort(ns, more, failed=False)
    st.close()


def test_saves_while_space_is_being_reserved_are_counted_as_space_busy(tmp_path, monkeypatch):
    go = threading.Event()
    grow_io = Space._grow_io

    def slow(self, *a, **kw):
        assert go.wait(10)
        return grow_io(self, *a, **kw)

    st = Store(str(tmp_path / "s"), io_thread=True)
    ns = st.namespace(NS, PAYLOAD)  # (its first space is reserved while it opens)
    end = time.monotonic() + 10
    while not ns.ready and time.monotonic() < end:
        st.refresh()
        time.sleep(0.01)
    assert ns.ready
    while ns.alloc.take() is not None:  # the space it opened with, used up
        pass
    monkeypatch.setattr(Space, "_grow_io", slow)  # the next reservation of space is held
    assert st.reserve(ns, key(0)) is None and st.reserve(ns, key(1)) is None
    assert st.stats.skipped_fs_busy == 2 and st.stats.skipped_loading == 0
    go.set()
    end = time.monotonic() + 10
    while (where := st.reserve(ns, key(2))) is None and time.monotonic() < end:
        st.refresh()
        time.sleep(0.01)
    assert where is not None, "once the space is reserved, saves go on"
    st.abort(ns, [(key(2), where)], failed=False)
    st.close()


def test_each_cause_is_a_labelled_series_of_save_dropped_blocks():
    causes = {r.key: dict(r.labels)["cause"] for r in counters.TABLE if r.series == "save_dropped_blocks"}
    assert causes["store_skipped_loading"] == "index_loading"
    assert causes["store_skipped_fs_busy"] == "space_busy"
    assert causes["store_skipped_no_space"] == "no_space"
    assert len(set(causes.values())) == len(causes), "two counters under one cause"
    figures = store_counters(StoreStats())
    assert {"store_skipped_loading", "store_skipped_fs_busy"} <= set(figures)


def test_a_namespace_reopened_in_the_background_has_space_for_its_first_saves(tmp_path, monkeypatch):
    grow_io = Space._grow_io

    def slow(self, *a, **kw):  # a busy disk: longer than a step may wait (store.WAIT_PER_STEP)
        time.sleep(0.5)
        return grow_io(self, *a, **kw)

    monkeypatch.setattr(Space, "_grow_io", slow)
    root = str(tmp_path / "s")
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    got = [(key(i), st.reserve(ns, key(i))) for i in range(4)]
    st.commit(ns, got)
    st.close()
    st = Store(root, io_thread=True)
    ns = st.namespace(NS, PAYLOAD)
    end = time.monotonic() + 10
    while (not ns.ready or st.fs.pending) and time.monotonic() < end:  # loaded, and the I/O thread idle
        st.refresh()
        time.sleep(0.01)
    assert ns.ready and not st.fs.pending
    st.refresh()  # a step's upkeep: its wait for space begins
    where = st.reserve(ns, key(5000))
    assert where is not None and st.stats.skipped_fs_busy == 0, "the first save after a restart was skipped"
    st.abort(ns, [(key(5000), where)], failed=False)
    st.close()
