# SPDX-License-Identifier: Apache-2.0
"""Close waits for a slow disk as long as `fs_timeout` calls it answering, and no longer for a hung one.

The bug: at close the store lets its I/O thread write what is queued (journal records, the
checkpoint) only while the file system answers, and "answers" was a module constant,
persist.CLOSE_WAIT = 5 s, that no setting reached. The rest of the store counts the file system
as hung only past the configured `fs_timeout` (the e2e lives run with 30 s). On a loaded machine
a journal fdatasync can take more than 5 s while fs_timeout is 30: a clean shutdown then gave up
behind that one slow call, and the commits queued after it were never written (misses after a
restart, though the disk was answering all along).
The invariant: with each journal call answering within fs_timeout, every block committed before
close is in the journal a restart reads; a file system that does not answer still lets close
return within its bound, with one warning line; and whatever fs_timeout says (86400: "never
hung"), close returns within CLOSE_MAX in all: never the reason the engine hung.
The fix: persist.py: the close's wait for an answer is a Store's own (`Persist.close_wait`):
max(CLOSE_WAIT, fs_timeout), still at most CLOSE_MAX
in all; the load joined at close (loading.py) and the last verifications (scan.py) use the same.
"""

from __future__ import annotations

import logging
import threading
import time

from aiokv.store import Store
from aiokv.store import persist as persist_mod
from tests.conftest import NS, PAYLOAD, key
from tests.workers import until

SLOW = 5.5  # seconds one journal fdatasync takes at shutdown: over the old fixed 5 s, under fs_timeout
FS_TIMEOUT = 8.0


def _commit(st, ns, keys):
    slots = [st.reserve(ns, k) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)))


def _shutdown_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "did not answer at shutdown" in r.getMessage()]


def test_close_waits_for_a_slow_journal_sync_within_fs_timeout_and_loses_no_commit(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    root = str(tmp_path / "s")
    st = Store(root, io_thread=True, fs_timeout=FS_TIMEOUT, sync_interval=0.0)  # (each append syncs)
    ns = st.namespace(NS, PAYLOAD)
    assert until(lambda: not st.fs.pending, 10)
    log = st.logs[NS]
    real_sync, slow, gone = log.sync, [SLOW], threading.Event()

    def sync():  # the journal's next fdatasync is slow (once)
        time.sleep(slow.pop() if slow else 0.0)
        if st.fs._closed:  # close gave up on the I/O thread and returned: the engine's process exits
            gone.wait(60)  # now, so nothing after this point reaches the disk
            return
        real_sync()

    log.sync = sync
    first, second = [key(i) for i in range(8)], [key(i, 1) for i in range(8)]
    _commit(st, ns, first)  # its append's fdatasync takes SLOW seconds
    _commit(st, ns, second)  # queued behind it
    t = time.monotonic()
    st.close()
    took = time.monotonic() - t
    try:
        again = Store(root, readonly=True)  # what a restart reads
        got = again.index.namespaces[NS]
        lost = [k.hex()[:8] for k in first + second if not got.has(k)]
        again.close()
        assert not lost, (
            f"{len(lost)} committed block(s) lost at a clean shutdown whose journal fdatasync took {SLOW} s "
            f"(fs_timeout {FS_TIMEOUT} s: the disk was answering); close returned after {took:.1f} s; "
            f"warning: {_shutdown_warnings(caplog)}"
        )
        assert not _shutdown_warnings(caplog)
        assert took < FS_TIMEOUT + 2.0
    finally:
        gone.set()
        st.fs.thread.join(10)


def _hang(st) -> threading.Event:
    """The file system hangs: the I/O thread is held inside an operation until the event is set."""
    release = threading.Event()
    st.fs.submit(lambda: release.wait(60))
    assert until(lambda: st.fs.pending == 1 and st.fs._current is not None, 5)
    return release


def test_close_on_a_hung_disk_gives_up_after_fs_timeout_and_says_so_once(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    monkeypatch.setattr(persist_mod, "CLOSE_WAIT", 0.2)  # (the least wait, shortened: fs_timeout is above it)
    fs_timeout = 1.0
    st = Store(str(tmp_path / "s"), io_thread=True, fs_timeout=fs_timeout)
    ns = st.namespace(NS, PAYLOAD)
    release = _hang(st)
    try:
        _commit(st, ns, [key(i) for i in range(4)])  # queued behind the hung operation
        t = time.monotonic()
        st.close()
        took = time.monotonic() - t
        assert fs_timeout - 0.1 <= took < fs_timeout + 1.0, (
            f"close on a hung disk returned after {took:.2f} s; it waits for an answer as long as "
            f"fs_timeout ({fs_timeout} s), then gives up"
        )
        said = _shutdown_warnings(caplog)
        assert len(said) == 1, said
    finally:
        release.set()
        st.fs.thread.join(10)


def test_close_on_a_hung_disk_stays_within_close_max_whatever_fs_timeout_says(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    monkeypatch.setattr(persist_mod, "CLOSE_MAX", 1.5)  # (the bound in all, shortened for the test)
    st = Store(str(tmp_path / "s"), io_thread=True, fs_timeout=86400.0)  # "never count it as hung"
    ns = st.namespace(NS, PAYLOAD)
    release = _hang(st)
    try:
        _commit(st, ns, [key(i) for i in range(4)])
        t = time.monotonic()
        st.close()
        took = time.monotonic() - t
        assert took < 1.5 + 1.0, f"close on a hung disk took {took:.1f} s with fs_timeout 86400; CLOSE_MAX is 1.5 s"
        assert len(_shutdown_warnings(caplog)) == 1
    finally:
        release.set()
        st.fs.thread.join(10)
