# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect`, `--keys` and `--verify` hold no Python object per block and write their
lists as they make them (issue 40, item 11).

Bug: `--keys` built a tuple, then a dict, per block and sorted them, and held the whole document
before printing it (about 1 KB a block: 30 GB for a node's 30M blocks); `--verify` built a tuple
per block to read and a Bad and a dict per corrupt block (a wiped drive: every block); the
summary made four arrays of all the blocks' access times beside the index (sorted, as floats)
to count ages. Invariant: beyond the replayed index (what an engine holds: about 30 bytes a
block), `--keys` and `--verify` allocate a few tens of bytes a block, far less than the output
they write, so it cannot be held whole (it is written as it is made: rows.py); the summary
allocates a slot range's worth beside the index, whatever the directory holds. Measured with
tracemalloc (numpy's arrays are traced too) over the CLI's own `main`, in this process, on a
directory built by tools/bench_inspect.py (a real store's checkpoint, index image and journal;
sparse data files, so --verify finds every block corrupt: the worst case of its output).
Fix: summary.py (counted a slot range at a time; the median by counting), keylist.py and
blockkeys.py (LRU order by numpy, keys from the files a batch at a time), slots.py (Bads:
arrays), rows.py (lists written as they are made). Figures at 1M-30M blocks: tools/bench_inspect.py.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tracemalloc

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))

from bench_inspect import build  # noqa: E402

N = 200_000


class _Sink(io.TextIOBase):
    """stdout that keeps only the first and last bytes and counts the rest."""

    def __init__(self):
        self.n, self.head, self.tail = 0, "", ""

    def write(self, s: str) -> int:
        self.n += len(s)
        if len(self.head) < 4096:
            self.head += s[:4096]
        self.tail = (self.tail + s)[-4096:]
        return len(s)


@pytest.fixture(autouse=True)
def small_batches(monkeypatch):
    """Batches far smaller than the directory, so what is held a block shows (raising=False:
    the code before the fix has none of these)."""
    import importlib

    for mod, names in (("keylist", ("BATCH",)), ("slots", ("CHUNK",)), ("bads", ("BATCH",))):
        try:
            m = importlib.import_module(f"aiokv.cli.{mod}")
        except ImportError:
            continue
        for name in names:
            monkeypatch.setattr(m, name, 1 << 12, raising=False)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("inspect") / "c")
    build(d, N, tenants=3)
    return d


def _index_bytes(root: str) -> int:
    """What the replayed index itself holds (tracemalloc, once the CLI has opened it)."""
    from aiokv.cli.opening import open_readonly

    tracemalloc.start()
    try:
        st = open_readonly(root)
        held = tracemalloc.get_traced_memory()[0]
        st.close()
    finally:
        tracemalloc.stop()
    return held


@pytest.mark.parametrize("mode", ["json", "text"])
def test_keys_are_written_as_they_are_made(root, mode):
    """What --keys allocates once the index is open, while it writes every key (main's path:
    keys(), then write_json or the text rendering's lines)."""
    from aiokv.cli import inspect as ins
    from aiokv.cli.main import _emit

    st = ins.open_readonly(root)
    out = _Sink()
    try:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
        with contextlib.redirect_stdout(out):
            doc = ins.keys(st)
            _emit(doc, ins.render_keys(doc), mode)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        st.close()
    beyond = (peak - base) / N
    assert out.n > 100 * N, out.n  # (the output: 120-190 bytes a key)
    assert beyond < 48, f"--keys allocated {beyond:.0f} bytes a block beyond the index, writing {out.n / N:.0f}"
    if mode == "json":
        assert out.head.startswith("{\n") and out.tail.endswith("}\n"), (out.head[:200], out.tail[-200:])
    else:
        assert f"{N + 3} key(s), least recently used first" in out.head


def test_verify_of_a_wiped_drive_holds_no_object_per_block(root, monkeypatch):
    """What --verify allocates beside the index (each opening's own passing peak left out: the
    store's), while it reads every slot and writes every corrupt block."""
    from aiokv.cli import opening
    from aiokv.cli import slots as slots_mod
    from aiokv.cli import verify as verify_mod
    from aiokv.cli.main import main

    def opened(*a, **k):
        st = opening.open_readonly(*a, **k)
        tracemalloc.reset_peak()
        return st

    for m in (slots_mod, verify_mod):
        monkeypatch.setattr(m, "open_readonly", opened)
    index = _index_bytes(root)
    out = _Sink()
    tracemalloc.start()
    try:
        with contextlib.redirect_stdout(out):
            code = main(["inspect", root, "--verify", "--format", "json", "--no-progress"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 1
    assert '"checked_blocks": %d' % (N + 3) in out.head and '"ok": false' in out.tail
    beyond = (peak - index) / N
    assert out.n > 100 * N, out.n
    assert beyond < 160, f"--verify allocated {beyond:.0f} bytes a block beyond the index, writing {out.n / N:.0f}"


def test_summary_counts_a_slot_range_at_a_time(root, monkeypatch):
    import time

    from aiokv.cli import summary as summary_mod
    from aiokv.cli.opening import open_readonly

    monkeypatch.setattr(summary_mod, "CHUNK", 1 << 14, raising=False)
    monkeypatch.setattr(summary_mod, "COLLECT", 1 << 14, raising=False)
    st = open_readonly(root)
    try:
        t0 = time.time_ns()
        tracemalloc.start()
        try:
            doc = summary_mod.summary(st)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        t1 = time.time_ns()
        ((_, ns),) = st.index.namespaces.items()
        atimes = sorted(a for t in ns.tables.values() for a in t.atime[t.live()].tolist())
    finally:
        st.close()
    assert peak < 2_000_000, f"the summary allocated {peak} bytes beside the index ({N} blocks)"
    (n,) = doc["namespaces"]
    assert n["blocks"] == N + 3 and sum(r["blocks"] for r in n["tenants"]) == N + 3
    m = atimes[len(atimes) - 1 - len(atimes) // 2]  # (ages ascending: the one at n // 2)
    assert (t0 - m) / 1e9 - 1e-3 <= n["access"]["median_age_seconds"] <= (t1 - m) / 1e9 + 1e-3
    for name, seconds in summary_mod.AGE_WINDOWS:
        lo, hi = sum(a >= t0 - seconds * 10**9 for a in atimes), sum(a >= t1 - seconds * 10**9 for a in atimes)
        assert hi <= n["access"][f"used_last_{name}"] <= lo, name


def test_the_kth_access_time_is_exact_however_they_are_spread():
    """The median is counted in ranges, then picked among the few in its range: exactly the
    sorted list's, with ties, huge spreads and a range holding most of them."""
    import types

    import numpy as np

    from aiokv.cli import summary as s

    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(1, 30_000))
        kind = trial % 4
        if kind == 0:
            a = rng.integers(1, 2**63, n, dtype=np.uint64)
        elif kind == 1:
            a = (10**18 + rng.integers(0, 5, n)).astype(np.uint64)  # few distinct values
        elif kind == 2:  # half at one time, the rest spread
            a = np.concatenate([np.full(n // 2, 5, np.uint64), rng.integers(6, 2**40, n - n // 2, dtype=np.uint64)])
        else:
            a = rng.integers(1, 3, n, dtype=np.uint64)
        tag = rng.integers(0, 2, n, dtype=np.uint64)  # (empty slots: tag 0)
        t = types.SimpleNamespace(tag=tag, atime=a)
        live = np.sort(a[tag != 0])
        if not len(live):
            continue
        k = int(rng.integers(0, len(live)))
        old = s.CHUNK, s.COLLECT
        s.CHUNK, s.COLLECT = 1000, 500
        try:
            got = s._kth([t], k, len(live), int(live.min()), int(live.max()))
        finally:
            s.CHUNK, s.COLLECT = old
        assert got == int(live[k]), (trial, kind, got, int(live[k]))


def test_keys_from_the_files_are_the_stores_own(tmp_path):
    """BlockKeys (a batch of slots at a time, from the mapped files) names exactly the keys the
    store's own reader does (journal.read_keys: the whole files at once), for two engines whose
    files hold a checkpoint and, after it, commits into reused slots, drops and evictions; and
    --keys lists them in eviction order: last access, then engine, then slot."""
    from aiokv.cli import inspect as ins
    from aiokv.cli.blockkeys import BlockKeys
    from aiokv.store import Store

    root = str(tmp_path / "c")
    nsid, payload = b"k" * 16, 1024
    key = lambda e, i: bytes([e + 1]) * 8 + i.to_bytes(8, "little") * 3  # noqa: E731
    evicted = 0
    for e in (0, 1):
        for life in range(2):  # a checkpoint at the first close; the second life stays in the journal
            st = Store(root, capacity="3MiB", engine=e)  # (room for a few hundred blocks: evictions)
            ns = st.namespace(nsid, payload)
            for i in range(life * 150, life * 150 + 150):
                st.commit(ns, [(key(e, i), st.reserve(ns, key(e, i)))])
                if i % 7 == 6 and ns.block(key(e, i - 3)) is not None:
                    st.drop(ns, [key(e, i - 3)], corrupt=False)
            evicted += st.stats.evictions
            st.close(checkpoint=life == 0)
    assert evicted > 100, evicted  # (slots reused after the checkpoint)
    ro = ins.open_readonly(root)
    try:
        ((_, ns),) = ro.index.namespaces.items()
        assert sorted(ns.tables) == [0, 1]
        for e, t in ns.tables.items():
            live = t.live()
            fl = ro.followers[(nsid, e)]
            bk = BlockKeys(fl.dir_fd, fl.gen)
            try:
                got, klens, found = bk.lookup(live[::-1], t.tag[live[::-1]])  # (any order)
            finally:
                bk.close()
            want = ns.keys_of(e).keys_of(live[::-1], t.tag[live[::-1]])
            assert [bytes(k[:n]) if f else None for k, n, f in zip(got, klens, found)] == want
            assert all(w is not None for w in want) and len(want) > 20, len(want)
        doc = ins.keys(ro)
        rows = list(doc["namespaces"][0]["keys"])
        at = {(e, int(s)): int(ns.tables[e].atime[s]) for e in (0, 1) for s in ns.tables[e].live()}
        assert len(rows) == len(at) == ns.count()
        order = [(at[(r["engine"], r["slot"])], r["engine"], r["slot"]) for r in rows]
        assert order == sorted(order), "not in eviction order"
        assert all(r["key"][:16] == key(r["engine"], 0)[:8].hex() for r in rows), "a key of another engine"
    finally:
        ro.close()
