# SPDX-License-Identifier: Apache-2.0
"""The index at the sizes users run (issue 36).

Bug: every block was Python objects (a dict entry, an LRU entry, a key: 584 bytes of
RSS a block), and opening replayed them all on the caller's thread before vLLM could
start (4.5 s a million blocks, past start_timeout at 15M).

Invariants: the compact index (aiokv/store/table.py: tags, not keys, in numpy arrays)
answers lookups as a dict of keys would, evicts in exact LRU order (so its hit ratio
is exact LRU's); what an older aiokv wrote (unsorted checkpoints without tags, version-1
journals) is read, and rewritten in today's order; an eviction (which names a slot and
its tag, not the key) survives a restart; an engine opening a directory serves at once
while the index loads in the background: misses and dropped saves meanwhile, hits
once the log line says it is loaded.

Fix: Table + aiokv._index (native/aiokv_index.c), FREE records, checkpoints sorted by
slot carrying tags, the loader thread (store.py).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import threading
import time

import numpy as np

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.store import Store
from aiokv.store import replay as replay_mod
from aiokv.store.logrecords import parse_records
from aiokv.store.table import Table, tag_of
from tests.conftest import refresh_until

NS = b"c" * 16
PAYLOAD = 4096
SB = fmt.slot_bytes(PAYLOAD)


def key(i: int) -> bytes:
    return i.to_bytes(8, "little") * 4


def test_a_table_answers_as_a_dict_and_evicts_in_lru_order():
    rnd = random.Random(7)
    t = Table()
    model: dict[bytes, int] = {}  # key -> slot
    lru: collections.OrderedDict = collections.OrderedDict()  # key -> None, oldest first
    clock = 0
    free = list(range(300))
    for _ in range(20_000):
        k = key(rnd.randrange(500))
        clock += 1
        op = rnd.random()
        if op < 0.5 and k not in model and free:
            s = free.pop(rnd.randrange(len(free)))
            t.put(s, tag_of(k), clock)
            model[k] = s
            lru[k] = None
        elif op < 0.7 and k in model:
            assert t.touch(model[k], clock)
            lru.move_to_end(k)
        elif op < 0.85 and lru:
            victim = next(iter(lru))
            s = t.oldest()
            assert s == model[victim], "the oldest block is the LRU one"
            assert t.clear(s) == tag_of(victim)
            del model[victim], lru[victim]
            free.append(s)
        elif k in model:
            s = model.pop(k)
            del lru[k]
            t.clear(s)
            free.append(s)
        assert t.count == len(model)
    for i in range(500):
        assert t.find(key(i)) == model.get(key(i), -1)


def test_hit_ratio_equals_exact_lru_on_a_chat_trace():
    """A trace shaped like tools/bench_chat.py's: conversations that come back, each turn
    the whole history as a prefix; a cache of a tenth of the blocks. Hits with the index's
    eviction order against an OrderedDict's exact LRU: the same."""
    rnd = random.Random(3)
    convs = [[] for _ in range(200)]
    cap = 400
    lru: collections.OrderedDict = collections.OrderedDict()
    t, free, clock = Table(), list(range(cap)), 0
    hits_lru = hits_table = lookups = 0
    for _ in range(1500):
        c = rnd.randrange(len(convs)) if rnd.random() < 0.5 else rnd.randrange(20)
        conv = convs[c]
        conv += [rnd.getrandbits(64).to_bytes(8, "little") * 4 for _ in range(rnd.randrange(1, 4))]
        for k in conv:  # the prefix, looked up block by block until the first miss
            lookups += 1
            a, b = k in lru, t.find(k) >= 0
            hits_lru, hits_table = hits_lru + a, hits_table + b
            if a:
                lru.move_to_end(k)
            if b:
                clock += 1
                t.touch(t.find(k), clock)
            if not a:
                if len(lru) >= cap:
                    lru.popitem(last=False)
                lru[k] = None
            if not b:
                if not free:
                    s = t.oldest()
                    t.clear(s)
                    free.append(s)
                clock += 1
                t.put(free.pop(), tag_of(k), clock)
    assert hits_table == hits_lru and 0 < hits_lru < lookups, (hits_table, hits_lru, lookups)


def test_an_older_writers_checkpoint_is_read_and_rewritten_sorted_with_tags(tmp_path):
    root = str(tmp_path / "s")
    st = Store(root)
    st.namespace(NS, PAYLOAD)
    st.close()
    d = os.path.join(root, "ns", NS.hex())
    # what aiokv wrote before: records in no order, no tags, a version-1 journal
    order = [5, 1, 7, 0, 3]
    body = b"".join(fmt.pack_record(fmt.REC_COMMIT, key(i), i, 1000 + i) for i in order)
    with open(os.path.join(d, "checkpoint"), "wb") as f:
        f.write(fmt.pack_file_header(fmt.CKPT_MAGIC, 1, len(order), _native.crc32c_bytes(body), version=1) + body)
    journal = fmt.pack_file_header(fmt.JOURNAL_MAGIC, 1, version=1) + b"".join(
        [fmt.pack_record(fmt.REC_DROP, key(7), 7, 0), fmt.pack_record(fmt.REC_COMMIT, key(9), 9, 2000)]
    )
    for n in os.listdir(d):
        if n.startswith("journal."):
            os.unlink(os.path.join(d, n))
    with open(os.path.join(d, "journal.1"), "wb") as f:
        f.write(journal)
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    want = {key(i): i for i in (5, 1, 0, 3, 9)}
    assert (
        {k: ns.where(k) for k in ns.keys()} == want
        and st.lookup(ns, [key(0), key(1)]) == 2
        and st.lookup(ns, [key(7)]) == 0
    )
    st.close()  # a checkpoint: sorted by slot, each record carrying its key's tag
    with open(os.path.join(d, "checkpoint"), "rb") as f:
        raw = f.read()
    recs, _ = parse_records(raw[fmt.FILE_HDR_BYTES :], verify=True)
    assert recs["slot"].tolist() == sorted(want.values())
    assert recs["tag"].tolist() == [tag_of(key(s)) for s in sorted(want.values())]
    st = Store(root)
    again = st.namespace(NS, PAYLOAD)
    assert {k: again.where(k) for k in again.keys()} == want
    st.close()


def test_an_eviction_is_a_free_record_that_survives_a_restart(tmp_path):
    root = str(tmp_path / "s")
    st = Store(root, capacity=4 * SB + 4096)
    ns = st.namespace(NS, PAYLOAD)
    for i in range(8):
        where = st.reserve(ns, key(i))
        assert where is not None
        st.commit(ns, [(key(i), where)])
    kept = [i for i in range(8) if ns.has(key(i))]
    assert 0 < len(kept) < 8 and kept == list(range(8 - len(kept), 8)), "the oldest went first"
    jname = [n for n in os.listdir(os.path.join(root, "ns", NS.hex())) if n.startswith("journal.")][0]
    with open(os.path.join(root, "ns", NS.hex(), jname), "rb") as f:
        recs, _ = parse_records(f.read()[fmt.FILE_HDR_BYTES :])
    assert (recs["kind"] == fmt.REC_FREE).sum() == 8 - len(kept)
    st.lock.release()  # as a crash: no checkpoint, the journal replayed
    st = Store(root, capacity=4 * SB + 4096)
    ns = st.namespace(NS, PAYLOAD)
    assert [i for i in range(8) if ns.has(key(i))] == kept
    st.close()


def test_an_engine_serves_at_once_while_its_index_loads(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="aiokv")
    root = str(tmp_path / "s")
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    ns.alloc.grow(range(500))
    items = [(key(i), ns.alloc.take()) for i in range(500)]
    for k, s in items:
        ns.pending[k] = s
    st.commit(ns, items)
    st.close()
    go = threading.Event()
    read_own = replay_mod.Replay.read_own

    def slow(self, ns):  # a big index: loading takes until the test says
        assert go.wait(10)
        return read_own(self, ns)

    monkeypatch.setattr(replay_mod.Replay, "read_own", slow)
    t = time.monotonic()
    st = Store(root, io_thread=True)
    ns = st.namespace(NS, PAYLOAD)
    assert time.monotonic() - t < 2, "opening waited for the index"
    assert not ns.ready and st.loading == 1
    assert st.lookup(ns, [key(0)]) == 0, "no hits while loading"
    assert st.reserve(ns, key(1000)) is None and st.stats.skipped_loading == 1, "saves are dropped while loading"
    go.set()
    end = time.monotonic() + 10
    while not ns.ready and time.monotonic() < end:
        st.refresh()
        time.sleep(0.01)
    assert ns.ready and st.loading == 0
    assert st.lookup(ns, [key(i) for i in range(500)]) == 500, "hits once loaded"
    assert any("is loaded (500 blocks" in r.getMessage() for r in caplog.records)
    # its first space reserved (on a loaded disk it may take past a step's wait)
    refresh_until(st, lambda: not st.space.growing, "the data file did not grow")
    where = st.reserve(ns, key(1000))
    assert where is not None
    st.close()


def test_tags_of_distinct_structured_keys_are_distinct():
    """Keys like the tests' and tools' (counters, repeated words) mix into distinct tags:
    a collision would be a miss, and the index counts on them being rare (2**-64 a pair)."""
    keys = [key(i) for i in range(200_000)] + [i.to_bytes(16, "little") for i in range(200_000)]
    tags = np.array([tag_of(k) for k in keys], np.uint64)
    assert len(np.unique(tags)) == len(keys) and (tags != 0).all()


def test_a_start_announcement_reads_the_labels_in_turns_and_stays_bounded(tmp_path, monkeypatch):
    """At tens of millions of blocks a labels file is gigabytes: the start announcement reads
    it a part at a time, the next part once the backlog has gone out, and announces every
    stored block in the end."""
    import types

    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils

    from aiokv.connector import events as events_mod
    from aiokv.jobs import Transfer
    from aiokv.scheduler.state import Req

    monkeypatch.setattr(kv_cache_utils, "NONE_HASH", sha256("seed"), raising=False)
    bs, n = 4, 60
    st = Store(str(tmp_path), capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    ev = events_mod.KVEvents(st, [(0, ns, "full_attention", None)], bs, bs, "sha256")
    tokens = list(range(n * bs))
    keys = [os.urandom(32) for _ in range(n)]
    hashes = [sha256((keys[j - 1] if j else None, tuple(tokens[j * bs : (j + 1) * bs]))) for j in range(n)]
    ev.request(types.SimpleNamespace(request_id="r", block_hashes=hashes, lora_request=None))
    items = [(k, st.reserve(ns, k)) for k in keys]
    ev.planned([Transfer("r", keys, [s for _, s in items], list(range(n)))], {"r": Req(tokens, b"r", keys=keys)})
    st.commit(ns, items)
    assert len([e for e in ev.take() if type(e).__name__ == "BlockStored"]) == n
    st.close()
    monkeypatch.setattr(events_mod, "START_READ", 1000)  # a few labels a read
    monkeypatch.setattr(events_mod, "ANNOUNCE_BATCH", 3)
    st = Store(str(tmp_path), capacity="1GiB")
    ns = st.namespace(NS, PAYLOAD)
    ev = events_mod.KVEvents(st, [(0, ns, "full_attention", None)], bs, bs, "sha256")
    got, most = [], 0
    for _ in range(200):
        out = [e for e in ev.take() if type(e).__name__ == "BlockStored"]
        assert len(out) <= 3
        most = max(most, len(ev._backlog))
        got += out
    assert len(got) == n and len({h for e in got for h in e.block_hashes}) == n, "every stored block, once"
    assert most <= 4 * 3 + 1000 // 64, "the backlog stayed bounded"
    st.close()


def test_opening_reads_the_index_image_of_its_very_checkpoint_only(tmp_path, monkeypatch):
    """Opening reads four arrays (the index image written with the checkpoint) instead of a
    record a block; an image whose checkpoint changed since (or that does not verify) is
    ignored and the checkpoint's records are read."""
    from aiokv.store import journal as journal_mod

    root = str(tmp_path / "s")
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    ns.alloc.grow(range(300))
    items = [(key(i), ns.alloc.take()) for i in range(300)]
    for k, s in items:
        ns.pending[k] = s
    st.commit(ns, items)
    st.close()
    d = os.path.join(root, "ns", NS.hex())
    assert os.path.exists(os.path.join(d, fmt.INDEX_NAME))
    records = []
    real = journal_mod.IndexLog._read_checkpoint
    monkeypatch.setattr(
        journal_mod.IndexLog, "_read_checkpoint", lambda self, *a: (records.append(1), real(self, *a))[1]
    )
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(300)]) == 300 and not records, "the image, not the records"
    st.close(checkpoint=False)
    os.utime(os.path.join(d, "checkpoint"), ns=(1, 1))  # the checkpoint changed since its image
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(300)]) == 300 and records, "the records, not a stale image"
    st.close(checkpoint=False)
    with open(os.path.join(d, fmt.INDEX_NAME), "r+b") as f:  # a damaged image (and a stale one): records again
        f.seek(fmt.INDEX_HDR_BYTES + 8)
        f.write(b"\xff")
    records.clear()
    st = Store(root)
    ns = st.namespace(NS, PAYLOAD)
    assert st.lookup(ns, [key(i) for i in range(300)]) == 300
    st.close()
