# SPDX-License-Identifier: Apache-2.0
"""A file system that fills up while the journal is appended to loses nothing.

Bug: a journal append that hit ENOSPC raised out of `Store.commit` (the engine
crashed); a torn record left at the journal's tail would have hidden every later
record from the next replay.
Invariant (real ENOSPC from the kernel: a tmpfs filled by another file, while
the data slots already have their space and only the journal needs a new
page): the batch whose record could not be written is not committed (the save
reports it failed, no exception reaches the caller); the journal is cut back to
its last whole record; every block committed before stays committed and loads,
except the oldest ones the store evicted to give the file system room (the
newest survive, in LRU order); every later save succeeds by evicting; a reopen
replays to exactly the same blocks. Nothing is said in the log: a full disk is
counted (`enospc`, vllm:aiokv_disk_full_events_total), not logged per record.
Fix: Store.commit undoes the batch and makes room (Store._make_room) on
ENOSPC/EDQUOT; IndexLog.append cuts a failed or short write back.
"""

from __future__ import annotations

import errno
import logging
import os

import pytest

from aiokv.data import format as fmt
from tests import mounts
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

SB = fmt.slot_bytes(PAYLOAD)
PAGE = 4096


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs (a real ENOSPC once it is full)."""
    with mounts.tmpfs(tmp_path / "mnt", "16m") as mnt:
        yield mnt


def _fill_up(path) -> int:
    """Write a file until the file system refuses (ENOSPC); returns its size."""
    chunk = b"\xff" * PAGE
    n = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, chunk)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e
                return n
            n += PAGE
    finally:
        os.close(fd)


async def _loads_intact(st, ns, blocks, keys) -> bool:
    for i in range(0, len(keys), 32):
        chunk = keys[i : i + 32]
        for j in range(len(chunk)):
            blocks.clear(j)
        if await st.load(ns, [(k, blocks.addr(j)) for j, k in enumerate(chunk)]) != [0] * len(chunk):
            return False
        if not all(blocks.holds(j, k) for j, k in enumerate(chunk)):
            return False
    return True


async def test_enospc_in_the_journal_undoes_the_batch_and_keeps_the_rest(tmpfs, blocks, caplog):
    caplog.set_level(logging.WARNING, logger="aiokv")
    root = str(tmpfs / "s")
    # room for 140 slots (9.5 MiB of the 16): the first growth reserves them all, so the data
    # writes below never need new space; only the journal does. 127 blocks fill the journal's
    # second page; the 13 free slots are less than the room a full disk makes (HEADROOM, 4 MiB):
    # old blocks are evicted too
    cap = 140 * SB
    st = StoreIO(root, capacity=cap, checkpoint_every=10**6)
    ns = st.namespace(NS, PAYLOAD)
    log = st.logs[ns.nsid]
    saved = []
    i = 0
    while len(saved) < 100 or log.size % PAGE:  # one block a commit, until the journal ends on a page
        blocks.fill(0, key(i))
        assert await st.save(ns, [(key(i), blocks.addr(0))]) == [0]
        saved.append(key(i))
        i += 1
        assert i < 140
    assert ns.alloc.free, "a reserved free slot is left for the next save"
    enospc, size = st.stats.enospc, log.size
    _fill_up(tmpfs / "filler")  # another user takes the rest of the disk

    caplog.clear()
    blocks.fill(0, key(1000))
    res = await st.save(ns, [(key(1000), blocks.addr(0))])  # the slot is written; its record is not
    assert res == [-errno.EIO], "written but not committed"
    assert not ns.has(key(1000)) and key(1000) not in ns.pending
    assert st.stats.enospc == enospc + 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [r.getMessage() for r in caplog.records]
    # the journal holds whole records only (the failed one cut off; the evictions' DROPs after it)
    assert os.fstat(log.fd).st_size == log.size and (log.size - fmt.FILE_HDR_BYTES) % fmt.REC_BYTES == 0
    assert log.size >= size
    # room was made by evicting the oldest blocks: the newest survive, and load intact
    kept = [k for k in saved if ns.has(k)]
    assert 0 < len(kept) < len(saved) and st.stats.evictions == len(saved) - len(kept)
    assert kept == saved[-len(kept) :], "not the oldest blocks were evicted"
    assert await _loads_intact(st, ns, blocks, kept)

    # the disk is still full: every later save succeeds, by evicting
    later = [key(2000 + j) for j in range(40)]
    for k in later:
        blocks.fill(0, k)
        assert await st.save(ns, [(k, blocks.addr(0))]) == [0]
    assert all(ns.has(k) for k in later)
    expect = set(ns.keys())
    assert set(later) <= expect and expect - set(later) <= set(kept)
    st.close()

    st = StoreIO(root, capacity=cap)  # a reopen replays to exactly these blocks
    ns = st.namespace(NS, PAYLOAD)
    assert set(ns.keys()) == expect
    assert await _loads_intact(st, ns, blocks, sorted(expect))
    st.close()
