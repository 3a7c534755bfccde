# SPDX-License-Identifier: Apache-2.0
"""A clean shutdown at node scale: a checkpoint in progress is an answering file system, and
the whole index is not rewritten at close.

The bug (measured with tools/bench_index.py's directory at 30M blocks, 3.75M more committed, the
I/O thread): close took 5.0 s and warned "the cache directory's file system did not answer at
shutdown". The disk was fine. Close waits while operations finish (`FsThread.drain`), and the
close-time checkpoint was one operation: it rewrote the whole index (about 0.7 µs a block) for
more than close_wait, so close gave up on it. Records queued behind a periodic checkpoint in
flight were lost the same way: misses after the restart. With the checkpoint counted as
answering, that close took 25.8 s, close to CLOSE_MAX: a rewrite of every block at every
shutdown, to save the next start a background replay of at most an eighth of them.

The invariant: a checkpoint that writes chunk after chunk counts as an answer each chunk, so
close waits for it, and for what is queued behind it, without a warning (within CLOSE_MAX); and
a namespace of more than persist.CLOSE_CHECKPOINT_BLOCKS blocks is not checkpointed at close.
Its journal keeps every record, as after a crash, and the next start replays it.

The fix: FsThread.progress, called by checkpoint.write after each chunk; Persist.close
checkpoints only namespaces up to CLOSE_CHECKPOINT_BLOCKS, or whose journal missed a write, or
holds more records than its checkpoints allow (records that came without a commit).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from aiokv import _index
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store import journal as journal_mod
from aiokv.store import persist as persist_mod
from tests.conftest import NS, PAYLOAD, key
from tests.workers import until

PIECE_S = 0.2  # each piece of a checkpoint takes this long: 8 of them, well past close_wait
QUIET = 0.5  # close_wait: seconds without an answer before close gives up


def _commit(st, ns, keys):
    slots = [st.reserve(ns, k) for k in keys]
    assert None not in slots
    st.commit(ns, list(zip(keys, slots)))


def test_close_waits_for_a_checkpoint_in_progress_and_the_records_behind_it(tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.WARNING, logger="aiokv")
    monkeypatch.setattr(persist_mod, "CLOSE_WAIT", QUIET)
    merged, gone = journal_mod.IndexLog._merged, threading.Event()
    st = None

    def slow(self, table, raw=None):  # a big index: written in pieces, each taking PIECE_S
        for chunk in merged(self, table, raw):
            step = max(1, -(-len(chunk) // 8))
            for i in range(0, len(chunk), step):
                time.sleep(PIECE_S)
                if st.fs._closed:  # close gave up and returned: the process exits, nothing more is written
                    gone.wait(60)
                yield chunk[i : i + step]

    monkeypatch.setattr(journal_mod.IndexLog, "_merged", slow)
    root = str(tmp_path / "s")
    st = Store(root, io_thread=True, fs_timeout=QUIET)
    try:
        ns = st.namespace(NS, PAYLOAD)
        assert until(lambda: not st.fs.pending, 10)
        first, second = [key(i) for i in range(16)], [key(i, 1) for i in range(16)]
        _commit(st, ns, first)
        st.checkpoint()  # a periodic checkpoint, in flight at close
        _commit(st, ns, second)  # its records queued behind it
        t = time.monotonic()
        st.close()
        took = time.monotonic() - t
    finally:
        gone.set()
    warned = [r.getMessage() for r in caplog.records if "did not answer at shutdown" in r.getMessage()]
    assert not warned, f"close gave up on a checkpoint in progress after {took:.1f} s: {warned}"
    again = Store(root, readonly=True)  # what a restart reads
    got = again.index.namespaces[NS]
    lost = [k.hex()[:8] for k in first + second if not got.has(k)]
    again.close()
    assert not lost, f"{len(lost)} committed block(s) lost behind a checkpoint in progress at close"


def test_a_namespace_past_close_checkpoint_blocks_is_not_rewritten_at_close(tmp_path, monkeypatch):
    monkeypatch.setattr(persist_mod, "CLOSE_CHECKPOINT_BLOCKS", 10)
    for n, written in ((10, True), (11, False)):
        root = str(tmp_path / f"s{n}")
        st = Store(root, io_thread=True)
        ns = st.namespace(NS, PAYLOAD)
        assert until(lambda st=st: not st.fs.pending, 10)
        keys = [key(i) for i in range(n)]
        _commit(st, ns, keys)
        st.close()
        ckpt = os.path.join(root, "ns", NS.hex(), "checkpoint")
        assert os.path.exists(ckpt) == written, f"{n} blocks: checkpointed at close {not written}"
        st = Store(root)  # the journal replayed, as after a crash
        ns = st.namespace(NS, PAYLOAD)
        assert st.lookup(ns, keys) == n
        st.close()


def test_a_big_namespace_whose_journal_outgrew_its_checkpoints_is_checkpointed_at_close(tmp_path, monkeypatch):
    # records that came without a commit (TOUCHes of other engines' blocks this one loaded) are not
    # checkpointed while serving (only a commit checks): close folds them past the journal's bound
    monkeypatch.setattr(persist_mod, "CLOSE_CHECKPOINT_BLOCKS", 10)
    root = str(tmp_path / "s")
    st = Store(root, io_thread=True, checkpoint_every=16)
    ns = st.namespace(NS, PAYLOAD)
    assert until(lambda: not st.fs.pending, 10)
    keys = [key(i) for i in range(11)]
    _commit(st, ns, keys)  # 11 records: within the bound, no checkpoint
    st.persist.append(ns, _index.commit_records(keys[:6], [0] * 6, time.time_ns(), 0, 0, fmt.REC_TOUCH))
    st.close()  # 17 records, past max(checkpoint_every, blocks / 8)
    assert os.path.exists(os.path.join(root, "ns", NS.hex(), "checkpoint"))
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, keys) == 11 and st.persist.journals[NS].records == 0
    st.close()
