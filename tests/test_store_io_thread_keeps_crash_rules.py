# SPDX-License-Identifier: Apache-2.0
"""Bug: the store's file-system calls ran on its owner's thread (vLLM's), so a
hung mount hung the engine. Moving them onto an I/O thread must not loosen the
crash-consistency rules (docs/format.md).

Invariant (real files, a store with its I/O thread, a file system "hung" by
holding the I/O thread inside an operation): commits are in the index at once
and in the journal once the thread wrote them (a restart sees them); while the
thread is stuck, `stalled` turns true after fs_timeout and the breaker opens
once, closing returns within its bound, and what was queued behind the stuck
operation is not in the journal, so a restart does not offer it (a miss, never
a block the journal does not name); the breaker probes again when the file
system answers.

Fix: aiokv/store/fsthread.py, the Store's io_thread mode, Breaker.file_system.
"""

from __future__ import annotations

import os
import threading
import time

from aiokv.store import Store
from aiokv.store import persist as persist_mod
from aiokv.util.breaker import CLOSED, HALF_OPEN, OPEN, Breaker
from tests.conftest import NS, PAYLOAD, key


def _commit(st, ns, keys):
    slots = [st.reserve(ns, k) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)))


def test_commits_reach_the_journal_and_a_hung_thread_loses_only_what_it_held(tmp_path, monkeypatch):
    monkeypatch.setattr(persist_mod, "CLOSE_WAIT", 0.5)
    root = str(tmp_path / "s")
    st = Store(root, io_thread=True, fs_timeout=0.2)
    ns = st.namespace(NS, PAYLOAD)
    before = [key(i) for i in range(50)]
    _commit(st, ns, before)
    assert all(ns.has(k) for k in before)  # in the index at once
    deadline = time.monotonic() + 5
    while st.fs.pending and time.monotonic() < deadline:
        time.sleep(0.01)
    peek = Store(root, readonly=True)  # another opener: only what the journal holds
    assert all(peek.index.namespaces[NS].has(k) for k in before)
    peek.close()

    # the file system hangs: the I/O thread is held inside an operation
    release = threading.Event()
    st.fs.submit(lambda: release.wait(30))
    breaker = Breaker(cooldown=600)
    t = time.monotonic()
    while not st.stalled:
        assert time.monotonic() - t < 5, "stalled never turned true"
        time.sleep(0.02)
    breaker.file_system(st.stalled)
    assert breaker.state == OPEN and breaker.opens == 1 and not breaker.allow_hit(0) and not breaker.allow_saves()
    breaker.file_system(st.stalled)
    assert breaker.opens == 1
    after = [key(i, 1) for i in range(20)]
    t = time.monotonic()
    _commit(st, ns, after)  # queued behind the hung operation: never waits for it
    st.refresh()
    st.flush_if_due()
    assert time.monotonic() - t < 0.5
    assert all(ns.has(k) for k in after)
    t = time.monotonic()
    st.close()
    assert time.monotonic() - t < 2, "close waited for the hung file system"

    again = Store(root, readonly=True)
    got = again.index.namespaces[NS]
    assert all(got.has(k) for k in before), "a commit written before the hang was lost"
    assert not any(got.has(k) for k in after), "a commit that was never written is offered after a restart"
    again.close()
    release.set()  # the file system answers: the abandoned thread writes nothing more after close
    breaker.file_system(False)
    assert breaker.state == HALF_OPEN and breaker.allow_hit(0)
    breaker.record({"loads_ok_blocks": 1})
    assert breaker.state == CLOSED


def test_a_journal_write_that_fails_on_the_thread_takes_the_commit_back(tmp_path):
    st = Store(str(tmp_path / "s"), io_thread=True)
    ns = st.namespace(NS, PAYLOAD)
    log = st.logs[NS]
    real = log.append

    def failing(recs):
        raise OSError(5, "EIO")

    log.append = failing
    keys = [key(i) for i in range(8)]
    _commit(st, ns, keys)
    op = st.fs.submit(lambda: None)
    assert st.fs.wait(op, 5)
    assert not any(ns.has(k) for k in keys) and st.stats.save_failures == 8 and st.stats.commits == 0
    assert ns.alloc.in_use == 0  # the slots are back
    log.append = real
    _commit(st, ns, keys)
    st.close()
    again = Store(str(tmp_path / "s"), readonly=True)
    assert all(again.index.namespaces[NS].has(k) for k in keys)
    again.close()
    assert os.path.isdir(str(tmp_path / "s"))


def test_opening_a_store_on_a_mount_that_does_not_answer_gives_up_in_time(tmp_path):
    """The connector's start (bounded(open_store, start_timeout)) on a hung mount: one clear error in time."""
    import pytest

    from aiokv.store.fsthread import FsTimeout, bounded
    from tests.stallfs import mounted

    control = str(tmp_path / "stall")
    with mounted(str(tmp_path / "src"), str(tmp_path / "mnt"), control, threads=4):
        root = str(tmp_path / "mnt" / "c")
        Store(root).close()
        with open(control, "w") as f:
            f.write("a")  # nothing on the mount answers
        closed = []
        t = time.monotonic()
        with pytest.raises(FsTimeout) as e:
            bounded(
                lambda: Store(root, io_thread=True),
                1.0,
                f"the cache directory {root}",
                late=lambda st: (st.close(), closed.append(1)),
            )
        assert time.monotonic() - t < 3
        assert "did not answer within 1 s" in str(e.value) and "\n" not in str(e.value)
        os.unlink(control)  # it answers: the late store is closed, its lock released
        t = time.monotonic()
        while not closed and time.monotonic() - t < 10:
            time.sleep(0.05)
        assert closed
        Store(root, engine=0).close()  # engine 0's lock is free again
