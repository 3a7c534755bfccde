# SPDX-License-Identifier: Apache-2.0
"""A disk that dies (EIO) or turns read-only (EROFS) under a running store never
raises into the engine.

Bug: store errors other than ENOSPC (EIO, EROFS from fallocate, from a journal
write or its fdatasync, from a checkpoint) escaped from the calls vLLM's
scheduler thread makes (reserving slots, committing saves, closing), and a
checkpoint that failed at close left the journal, the data files and the
engine's lock held.
Invariant, with the condition made by the kernel: an ext4 file system shut down
(EXT4_IOC_SHUTDOWN: every operation EIO, as after a dead device) or turned
read-only by an error (errors=remount-ro, then ext4's trigger_fs_error: EROFS):
the scheduler side's plan, report and close calls and the store's save, flush
and close return normally; nothing new is committed (a save fails or is
skipped); what was committed before stays committed for a read-only opener once
the disk is back; each kind of failure is said in a line, not one per block.
Fix: Store.commit (journal errors undo the batch), Store._grow (fallocate errors
end the growth), IndexLog.append/Store.flush_if_due (fdatasync errors logged),
Store.close (a failed checkpoint is logged; the journal keeps everything), and
SchedulerSide's guards around every store call.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import subprocess

import pytest

from aiokv.data import format as fmt
from aiokv.jobs import SaveResult, WorkerReport
from aiokv.scheduler.keys import request_root
from aiokv.scheduler.side import Scheduled, SchedulerSide
from aiokv.store import Store
from aiokv.store import space as space_mod
from tests import mounts
from tests.conftest import NS, PAYLOAD

SB = fmt.slot_bytes(PAYLOAD)
EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


@pytest.fixture
def ext4(tmp_path):
    """(mountpoint, fail): a 32 MiB ext4 on a loop device; fail(kind) breaks it for real."""
    mnt = tmp_path / "mnt"

    def fail(kind: str) -> None:
        if kind == "eio":
            fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
            finally:
                os.close(fd)
        else:
            dev = subprocess.run(
                ["findmnt", "-no", "SOURCE", str(mnt)], capture_output=True, text=True, check=True
            ).stdout.strip()
            with open(f"/sys/fs/ext4/{os.path.basename(dev)}/trigger_fs_error", "w") as f:
                f.write("aiokv test: turn read-only\n")

    with mounts.loop_ext4(mnt, "32M", "errors=remount-ro"):
        yield mnt, fail


def _side(root: str) -> SchedulerSide:
    st = Store(root, capacity="16MiB", sync_interval=3600)  # the journal stays dirty: its fdatasync comes late
    return SchedulerSide(st, st.namespace(NS, PAYLOAD), 16)


def _step(side: SchedulerSide, req: str, nblocks: int):
    """A new request of nblocks full blocks scheduled whole: its saves planned (reserved)."""
    tokens = [hash((req, i)) % 30000 for i in range(nblocks * 16 + 1)]
    root = request_root(NS, [])
    side.match(req, tokens, root, 0)
    ids = list(range(1, nblocks + 2))
    side.on_alloc(req, tokens, root, (ids,), 0)
    return side.plan([Scheduled(req, 0, len(tokens), (ids,), True)]).saves


def _report(saves, written: bool) -> WorkerReport:
    """The workers' report of these saves: written, or failed by the disk (as the workers see
    a dead disk: write errors, which the breaker counts)."""
    if written:
        return WorkerReport(saves=[SaveResult(t.job, 0, list(t.keys)) for t in saves])
    return WorkerReport(
        saves=[SaveResult(t.job, 0, [], list(t.keys)) for t in saves],
        counters={"write_errors": sum(len(t.keys) for t in saves)},
    )


@pytest.mark.parametrize("kind", ["eio", "erofs"])
def test_dead_or_read_only_disk_never_raises(ext4, kind, caplog, monkeypatch):
    monkeypatch.setattr(space_mod, "GROW_BYTES", 8 * SB)  # space is reserved 8 slots at a time
    caplog.set_level(logging.WARNING, logger="aiokv")
    mnt, fail = ext4
    root = str(mnt / "cache")
    side = _side(root)
    store, ns = side.store, side.groups[0].ns
    saves = _step(side, "a", 8)
    side.on_report(_report(saves, True), set())
    before = set(ns.keys())
    assert len(before) == 8 and not ns.alloc.free
    journal = store.logs[ns.nsid]
    assert journal._dirty, "the commits wait for their fdatasync"
    late = _step(side, "b", 4)  # reserved (new space: fallocate) and written before the disk fails
    assert len(late[0].keys) == 4

    fail(kind)
    caplog.clear()
    side.on_report(_report(late, True), set())  # the commit's journal write fails
    assert not (set(ns.keys()) - before) and side.pending_saves == 0, "nothing is committed on a dead disk"
    journal.sync_interval = 0
    for _ in range(20):  # engine steps: the journal's fdatasync is due at each
        store.flush_if_due()
    for i in range(6):  # more requests: new space is needed (fallocate); the workers' writes fail
        saves = _step(side, f"c{i}", 10)
        side.on_report(_report(saves, False), set())
    assert not (set(ns.keys()) - before) and side.pending_saves == 0
    assert side.counters.saves_skipped_breaker > 0, "the breaker stopped the saves"
    side.close()  # the checkpoint and the journal's last fdatasync fail
    assert store.lock is None or store.lock.fd is None, "the close left the engine's lock held"
    assert not store.logs or all(j.fd is None for j in store.logs.values()), "the close left a journal open"

    records = caplog.records
    lines = [r.getMessage() for r in records]
    assert not [r for r in records if r.exc_info], "an exception reached a guard: " + repr(lines)
    # each kind of failure said, in a line, not at every step or block
    for what in (
        "journal write failed",
        "journal fdatasync failed",
        "reserving disk space failed",
        "checkpoint at close failed",
    ):
        said = [m for m in lines if what in m]
        assert 1 <= len(said) <= 3, (what, lines)
    assert len(lines) <= 10, lines
