# SPDX-License-Identifier: Apache-2.0
"""Bug: with the store's file-system calls on its I/O thread, the scheduler's
thread still waited for that thread: a lookup after follow_interval queued a
look at the other engines and waited for it (up to 50 ms a step), so while the
file system was slow (not yet past fs_timeout) every step paid a round trip,
and beside a writing engine the scheduler-side cost per step went from tens of
microseconds to milliseconds.

Invariant (real files, two engines on one directory, the reader's store with
its I/O thread): while the file system is slow (each look at the other
engine's files takes 40 ms, short of fs_timeout, so not "stalled"), lookups and
refresh return in well under a millisecond each and see the in-memory index; once the I/O thread is free,
what the other engine committed meanwhile becomes hits without the reader
asking for a look (the I/O thread looks on its own, every follow_interval), so
an engine back from idle sees it at its first lookup; the backlog a never-
polling reader holds in memory is bounded.

Fix: the look runs on the I/O thread's own clock (FsThread.every,
aiokv/store/following.py); lookup and refresh only apply what it finished.
"""

from __future__ import annotations

import time

from aiokv.store import Store, following
from aiokv.store.follower import Follower
from tests.conftest import NS, PAYLOAD, key


def _commit(st, ns, keys):
    slots = [st.reserve(ns, k) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)))


def test_lookups_and_refresh_never_wait_for_the_io_thread(tmp_path, monkeypatch):
    root = str(tmp_path / "s")
    reader = Store(root, io_thread=True, fs_timeout=5.0)
    rns = reader.namespace(NS, PAYLOAD)
    writer = Store(root)  # another engine, on the caller's thread
    wns = writer.namespace(NS, PAYLOAD)
    mine = [key(i, 9) for i in range(16)]
    _commit(reader, rns, mine)

    # the file system is slow, short of fs_timeout: every look at the other engine's files
    # takes 40 ms
    poll = Follower.poll
    monkeypatch.setattr(Follower, "poll", lambda self, *a: (time.sleep(0.04), poll(self, *a))[1])
    theirs = [key(i, 1) for i in range(64)]
    _commit(writer, wns, theirs)
    took = []
    end = time.monotonic() + 0.6  # six follow_intervals: each would have queued a look and waited for it
    while time.monotonic() < end:
        t = time.perf_counter()
        assert reader.lookup(rns, mine) == len(mine)
        reader.refresh()
        took.append(time.perf_counter() - t)
        time.sleep(0.005)
    assert not reader.stalled
    took.sort()
    # (sums and a percentile, not the slowest call: a loaded machine preempts a call now and then)
    assert sum(took) < 0.1, f"{sum(took) * 1000:.0f} ms in {len(took)} steps: the steps waited for the I/O thread"
    assert took[len(took) * 9 // 10] < 0.001, took[len(took) * 9 // 10]
    monkeypatch.setattr(Follower, "poll", poll)

    # the reader idles (no calls at all); its I/O thread looks on its own meanwhile: the other
    # engine's next blocks are found without a call of the reader (not a sleep hoping a look ran)
    fresh = [key(i, 2) for i in range(64)]
    handed = reader.following._handed
    _commit(writer, wns, fresh)
    end = time.monotonic() + 30
    while reader.following._handed < handed + len(fresh):
        assert time.monotonic() < end, "the I/O thread did not look while the reader idled"
        time.sleep(0.01)
    t = time.perf_counter()
    assert reader.lookup(rns, fresh) == len(fresh), "the first lookup after idle missed the other engine's blocks"
    assert time.perf_counter() - t < 0.05
    writer.close()
    reader.close()


def test_a_reader_that_never_polls_holds_a_bounded_backlog(tmp_path, monkeypatch):
    monkeypatch.setattr(following, "BACKLOG", 100)
    root = str(tmp_path / "s")
    reader = Store(root, io_thread=True)
    rns = reader.namespace(NS, PAYLOAD)
    reader.follow_interval = 0.01
    writer = Store(root)
    wns = writer.namespace(NS, PAYLOAD)
    for b in range(10):  # 10 batches of 64 records, the reader never polling
        _commit(writer, wns, [key(i, 100 + b) for i in range(64)])
        time.sleep(0.05)
    time.sleep(0.2)
    assert reader.following._handed <= 320, f"{reader.following._handed} records held for a reader that never polled"
    # once it polls, everything arrives (the Followers kept their place)
    end = time.monotonic() + 5
    while rns.count(writer.engine) < 640 and time.monotonic() < end:
        reader.refresh()
        time.sleep(0.02)
    assert rns.count(writer.engine) == 640
    writer.close()
    reader.close()
