# SPDX-License-Identifier: Apache-2.0
"""KV events on a shared directory, across restarts, and over damaged label files (no engine).

Bug: a router learns what a node holds only from its events, but blocks another engine
on the same directory commits are hits here too, and that engine may evict them; a
restarted engine must announce what its disk holds, but only under the hashing its
router uses; and a labels file is a file anyone with access may damage.
Invariant: a block another engine commits is announced here once its label is read, and
removed here when that engine evicts it; a restart announces exactly the stored blocks
whose labels verify and were hashed the same way; a damaged or foreign record is never
announced and never raises; what was announced before a cache reset is removed, and
after it nothing but this engine's new saves is announced or waits for a label.
Fix: aiokv/connector/events.py over aiokv/store/labels.py and the index's change list
(after a reset, `_hit` keeps no block without a held label: issue 37, item 8).
"""

from __future__ import annotations

import os
import types

import pytest
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils

from aiokv.connector.events import KVEvents
from aiokv.jobs import Transfer
from aiokv.scheduler.state import Req
from aiokv.store import Store

BS = 4
NSID = bytes(range(16))


@pytest.fixture(autouse=True)
def none_hash(monkeypatch):
    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", sha256("seed"), raising=False)


def _open(root: str, engine: int) -> tuple[Store, object]:
    st = Store(root, capacity="1GiB", engine=engine)
    st.follow_interval = 0.0
    return st, st.namespace(NSID, 4096, fields={"t": 1})


def _events(st, ns) -> KVEvents:
    return KVEvents(st, [(0, ns, "full_attention", None)], BS, BS, "sha256")


def _save(st, ns, ev: KVEvents, rid: str, n: int, first: int = 0) -> list[bytes]:
    """Blocks first..n-1 of request rid saved and committed, as the scheduler side does."""
    tokens = [first * 1000 + i for i in range(n * BS)]
    keys = [os.urandom(32) for _ in range(n)]
    hashes = [sha256((keys[j - 1] if j else None, tuple(tokens[j * BS : (j + 1) * BS]))) for j in range(n)]
    ev.request(types.SimpleNamespace(request_id=rid, block_hashes=hashes, lora_request=None))
    items = [(k, st.reserve(ns, k)) for k in keys]
    ev.planned([Transfer(rid, keys, [s for _, s in items], list(range(n)))], {rid: Req(tokens, b"r", keys=keys)})
    st.commit(ns, items)
    return keys


def _stored(events) -> list:
    return [e for e in events if type(e).__name__ == "BlockStored"]


def _removed(events) -> list:
    return [h for e in events if type(e).__name__ == "BlockRemoved" for h in e.block_hashes]


def test_another_engines_blocks_are_announced_and_removed_here(tmp_path):
    a, nsa = _open(str(tmp_path), 0)
    b, nsb = _open(str(tmp_path), 1)
    ea, eb = _events(a, nsa), _events(b, nsb)
    keys = _save(b, nsb, eb, "q", 3)
    mine = _stored(eb.take())  # b's own events; its labels reach its file
    assert len(mine) == 3 and [e.token_ids for e in mine] == [list(range(i * BS, (i + 1) * BS)) for i in range(3)]
    assert mine[0].parent_block_hash is None and mine[1].parent_block_hash == mine[0].block_hashes[0]
    a.refresh()  # a follows b's journal: the blocks are hits here
    assert all(nsa.has(k) for k in keys)
    got = _stored(ea.take()) + _stored(ea.take())
    assert sorted(e.block_hashes[0] for e in got) == sorted(e.block_hashes[0] for e in mine)
    assert all(e.medium == "STORAGE" and e.group_idx == 0 for e in got)
    # b evicts one (its own copy: drop), a follows and reports it removed
    b.drop(nsb, [keys[1]], corrupt=False)
    a.refresh()
    assert _removed(ea.take()) == [mine[1].block_hashes[0]]
    assert _removed(eb.take()) == [mine[1].block_hashes[0]]
    a.close(), b.close()


def test_a_restart_announces_what_is_stored_under_the_same_hashing(tmp_path, monkeypatch):
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    keys = _save(st, ns, ev, "r", 5)
    first = _stored(ev.take())
    st.drop(ns, [keys[4]], corrupt=False)
    assert len(_removed(ev.take())) == 1
    st.close()

    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    got = _stored(ev.take())
    assert [e.block_hashes for e in got] == [e.block_hashes for e in first[:4]], "the announcement"
    assert [e.token_ids for e in got] == [e.token_ids for e in first[:4]]
    st.close()

    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", sha256("another seed"))
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    assert not _stored(ev.take()) and not ev.announcing, "announced under other hashing"
    st.close()


def test_damaged_labels_are_never_announced_and_never_raise(tmp_path):
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    _save(st, ns, ev, "r", 6)
    assert len(_stored(ev.take())) == 6
    st.close()
    path = os.path.join(str(tmp_path), "ns", NSID.hex(), "labels")
    raw = bytearray(open(path, "rb").read())
    rec = (len(raw) - 64) // 6
    raw[64 + 3 * rec + 20] ^= 0xFF  # the fourth record's body: its CRC fails, the read stops there
    open(path, "wb").write(bytes(raw) + os.urandom(100))  # and a garbage tail
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    assert len(_stored(ev.take())) == 3
    st.close()
    open(path, "wb").write(os.urandom(4096))  # not a labels file at all
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    assert _stored(ev.take()) == []
    # new saves still get labelled (the file is started anew) and announced
    _save(st, ns, ev, "s", 2, first=7)
    assert len(_stored(ev.take())) == 2
    st.close()


def test_a_cache_reset_removes_what_was_announced(tmp_path):
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    _save(st, ns, ev, "r", 3)
    announced = [e.block_hashes[0] for e in _stored(ev.take())]
    ev.reset()
    assert sorted(_removed(ev.take())) == sorted(announced)
    _save(st, ns, ev, "s", 2, first=5)  # after the reset: announced, not labelled for a restart
    assert len(_stored(ev.take())) == 2
    st.close()
    st, ns = _open(str(tmp_path), 0)
    assert len(_stored(_events(st, ns).take())) == 3
    st.close()


def test_a_clear_is_announced_removed_in_bounded_batches(tmp_path, monkeypatch):
    """An `aiokv clear` of 300 announced blocks: each step hands vLLM one BlockRemoved of at
    most a batch (here 64) of hashes, not one event per block at once (issue 40, item 2), and
    every announced block is removed in the end."""
    from aiokv.connector import events as events_mod
    from aiokv.store.control import append_order

    monkeypatch.setattr(events_mod, "REMOVE_BATCH", 64, raising=False)
    monkeypatch.setattr(events_mod, "REMOVE_S", 0.0, raising=False)
    st, ns = _open(str(tmp_path), 0)
    ev = _events(st, ns)
    for r in range(10):
        _save(st, ns, ev, f"r{r}", 30, first=r)
    announced = [e.block_hashes[0] for e in _stored(ev.take())]
    assert len(announced) == 300
    fd = os.open(tmp_path, os.O_RDONLY)
    append_order(fd, "clear")
    os.close(fd)
    got, takes = [], 0
    while len(got) < 300 and takes < 100:
        st.refresh()
        out = [e for e in ev.take() if type(e).__name__ == "BlockRemoved"]
        assert len(out) <= 1 and all(len(e.block_hashes) <= 64 for e in out), [len(e.block_hashes) for e in out]
        got += _removed(out)
        takes += 1
    assert sorted(got) == sorted(announced) and takes >= 300 // 64
    st.close()


def test_several_drives_announce_and_remove_each_drives_blocks(tmp_path):
    from tools.storeio import DrivesIO

    paths = [str(tmp_path / f"d{i}") for i in range(3)]
    for p in paths:
        os.makedirs(p)
    st = DrivesIO(paths, capacity="3GiB")
    ns = st.namespace(NSID, 4096, fields={"t": 1})
    ev = _events(st, ns)
    keys = _save(st, ns, ev, "r", 12)
    got = _stored(ev.take())
    assert len(got) == 12 and len({e.block_hashes[0] for e in got}) == 12
    assert sum(1 for _, _, part in st.parts(ns) if part.table.count) >= 2, "the blocks sit on one drive only"
    st.drop(ns, [keys[3]], corrupt=False)
    gone = _removed(ev.take())
    assert len(gone) == 1 and gone[0] in {e.block_hashes[0] for e in got}
    st.close()
    st = DrivesIO(paths[::-1], capacity="3GiB")  # restarted, the list in another order
    ns = st.namespace(NSID, 4096, fields={"t": 1})
    again = _stored(_events(st, ns).take())
    assert {e.block_hashes[0] for e in again} == {e.block_hashes[0] for e in got} - set(gone)
    st.close()


def test_after_a_reset_other_engines_commits_are_neither_kept_nor_read_for(tmp_path, monkeypatch):
    """Bug (issue 37, item 8): after a cache reset, `_read` ignored every label, so each block
    another engine committed (and each of our saves planned before the reset and committed
    after it) waited in `_unknown` for a label that was never taken, and while any waited the
    labels files were read again every READ_EVERY seconds, for the rest of the run. None of
    those blocks can be a hit here any more (our keys are rooted in a fresh epoch): they are
    not announced, not remembered, and read for no label."""
    from aiokv.connector import events

    monkeypatch.setattr(events, "READ_EVERY", 0.0)  # every take may read: only a need does
    a, nsa = _open(str(tmp_path), 0)
    b, nsb = _open(str(tmp_path), 1)
    ea, eb = _events(a, nsa), _events(b, nsb)
    _save(a, nsa, ea, "r", 2)
    assert len(_stored(ea.take())) == 2
    # a save planned before the reset and committed after it (its label held, not yet written)
    tokens = list(range(50, 50 + 3 * BS))
    late = [os.urandom(32) for _ in range(3)]
    hashes = [sha256((late[j - 1] if j else None, tuple(tokens[j * BS : (j + 1) * BS]))) for j in range(3)]
    ea.request(types.SimpleNamespace(request_id="late", block_hashes=hashes, lora_request=None))
    items = [(k, a.reserve(nsa, k)) for k in late]
    ea.planned([Transfer("late", late, [s for _, s in items], [1, 2, 3])], {"late": Req(tokens, b"r", keys=late)})
    ea.reset()
    assert len(_removed(ea.take())) == 2
    a.commit(nsa, items)
    reads = []
    real = a.labels.read
    monkeypatch.setattr(a.labels, "read", lambda *x, **k: reads.append(1) or real(*x, **k))
    for i in range(5):  # another engine goes on committing, with labels; this one follows
        _save(b, nsb, eb, f"q{i}", 3, first=10 + i)
        assert len(_stored(eb.take())) == 3
        a.refresh()
        assert not _stored(ea.take())
    assert nsa.count() == 2 + 3 + 15  # on disk, committed and followed here
    assert not ea._unknown, f"{len(ea._unknown)} blocks kept waiting for a label after the reset"
    assert reads == [], f"the labels files were read {len(reads)} times after the reset"
    # this engine's own saves after the reset are still announced
    _save(a, nsa, ea, "s", 2, first=90)
    assert len(_stored(ea.take())) == 2
    a.close(), b.close()
