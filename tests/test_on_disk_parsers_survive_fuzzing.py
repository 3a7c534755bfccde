# SPDX-License-Identifier: Apache-2.0
"""Bug: the on-disk parsers (slot header, journal record, checkpoint and
journal files, namespace.json) were only ever fed files aiokv wrote itself: a
short header raised struct.error, and crafted numbers reached the allocator and
the C checksum unchecked.
Invariant: for any bytes at all, each parser either returns values inside their
bounds or raises its own error (BadBlock, NotAStore): never another exception,
never a hang; a valid file with one byte changed never parses as different
valid content that the change could not produce (header and record CRCs).
Fix: format.py checks lengths and every number before use (check_header,
check_namespace, iter_records), Store bounds slot numbers and sizes.

Seeded (hypothesis, derandomized): a few seconds in the suite. Longer on
demand: AIOKV_FUZZ_EXAMPLES=20000 (examples per parser) and AIOKV_FUZZ_SEED=N
(a different random seed), see docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import tempfile

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from aiokv.data import format as fmt
from aiokv.store import NotAStore, Store
from aiokv.store.journal import IndexLog
from tests.conftest import NS, PAYLOAD, key

EXAMPLES = int(os.environ.get("AIOKV_FUZZ_EXAMPLES", "300"))
SEED = os.environ.get("AIOKV_FUZZ_SEED")


def fuzz(examples: int = EXAMPLES):
    def wrap(f):
        f = settings(
            max_examples=examples,
            derandomize=SEED is None,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )(f)
        return seed(int(SEED))(f) if SEED is not None else f

    return wrap


GOOD_HDR = fmt.pack_header(NS, 0, key(1), PAYLOAD, 0x1234, 7, 99)
GOOD_RECS = b"".join(fmt.pack_record(fmt.REC_COMMIT if i % 3 else fmt.REC_DROP, key(i), i, i) for i in range(8))


def mutated(good: bytes):
    """A valid file with some bytes changed, cut short or extended."""
    return st.tuples(
        st.lists(st.tuples(st.integers(0, len(good) - 1), st.integers(0, 255)), max_size=4),
        st.integers(0, len(good) + 64),
        st.binary(max_size=64),
    ).map(lambda t: _apply(good, *t))


def _apply(good: bytes, edits, cut: int, tail: bytes) -> bytes:
    b = bytearray(good)
    for i, v in edits:
        b[i] = v
    return bytes(b[:cut]) + (tail if cut > len(good) else b"")


@fuzz()
@given(st.one_of(st.binary(max_size=200), mutated(GOOD_HDR + bytes(4096 - len(GOOD_HDR)))))
def test_slot_header(raw):
    try:
        h = fmt.check_header(raw[: fmt.HEADER_BYTES], NS, 0, PAYLOAD)
    except fmt.BadBlock:
        return
    # only a header whose every checked byte is intact gets through
    assert raw[: fmt.HDR_USED] == GOOD_HDR
    assert h["key"] == key(1) and h["payload_len"] == PAYLOAD


@fuzz()
@given(st.one_of(st.binary(max_size=700), mutated(GOOD_RECS)))
def test_journal_records(buf):
    it = fmt.iter_records(buf)
    out = []
    while True:
        try:
            out.append(next(it))
        except StopIteration as stop:
            valid = stop.value
            break
    assert valid == len(out) * fmt.REC_BYTES <= len(buf)
    for kind, k, slot, _atime in out:
        assert kind in fmt.REC_KINDS and fmt.MIN_KEY <= len(k) <= fmt.MAX_KEY
        assert 0 <= slot < 1 << 32
    # every record that parsed is byte for byte one that was written (CRC per record)
    assert buf[:valid] == GOOD_RECS[:valid]


def _index_files(ckpt: bytes | None, journal: bytes | None, tmp: str) -> str:
    d = os.path.join(tmp, "ns")
    os.makedirs(d, exist_ok=True)
    if ckpt is not None:
        with open(os.path.join(d, "checkpoint"), "wb") as f:
            f.write(ckpt)
    if journal is not None:
        with open(os.path.join(d, "journal.1"), "wb") as f:
            f.write(journal)
    return d


GOOD_CKPT = fmt.pack_file_header(
    fmt.CKPT_MAGIC,
    1,
    8,
    __import__("aiokv")._native.crc32c_bytes(b"".join(fmt.pack_record(fmt.REC_COMMIT, key(i), i, i) for i in range(8))),
) + b"".join(fmt.pack_record(fmt.REC_COMMIT, key(i), i, i) for i in range(8))
GOOD_JOURNAL = fmt.pack_file_header(fmt.JOURNAL_MAGIC, 1) + GOOD_RECS


@fuzz()
@given(
    st.one_of(st.none(), st.binary(max_size=300), mutated(GOOD_CKPT)),
    st.one_of(st.none(), st.binary(max_size=300), mutated(GOOD_JOURNAL)),
    st.booleans(),
)
def test_checkpoint_and_journal_files(ckpt, journal, readonly):
    with tempfile.TemporaryDirectory() as tmp:
        d = _index_files(ckpt, journal, tmp)
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        log = IndexLog(d, fd, readonly=readonly)
        try:
            entries = log.load()
        except fmt.BadBlock:
            return
        finally:
            log.close()
            os.close(fd)
        slots = [s for s, _ in entries.values()]
        assert len(set(slots)) == len(slots), "a slot claimed twice"
        for k, (s, _) in entries.items():
            assert fmt.MIN_KEY <= len(k) <= fmt.MAX_KEY and 0 <= s < 1 << 32


GOOD_NS = {"nsid": NS.hex(), "payload_bytes": PAYLOAD, "slot_bytes": fmt.slot_bytes(PAYLOAD), "ranks": 1, "fields": {}}
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=8,
)


@fuzz()
@given(st.one_of(JSON, st.fixed_dictionaries({}, optional={k: JSON for k in GOOD_NS}).map(lambda d: {**GOOD_NS, **d})))
def test_namespace_json(info):
    try:
        pb, sb, ranks, fields = fmt.check_namespace(info, NS)
    except fmt.BadBlock:
        return
    assert 0 < pb <= fmt.MAX_PAYLOAD_BYTES and sb == fmt.slot_bytes(pb) and sb < 1 << 32
    assert 1 <= ranks <= fmt.MAX_RANKS and isinstance(fields, dict)


@fuzz(max(10, EXAMPLES // 10))
@given(
    st.one_of(st.binary(max_size=300), mutated(json.dumps(GOOD_NS).encode())),
    st.one_of(st.none(), mutated(GOOD_CKPT)),
    st.one_of(st.none(), mutated(GOOD_JOURNAL)),
)
def test_whole_store_opens_or_says_why(ns_json, ckpt, journal):
    """The owner opening a directory of fuzzed files: a store, or NotAStore."""
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "s")
        Store(root).close()
        d = os.path.join(root, "ns", NS.hex())
        os.mkdir(d, 0o700)
        with open(os.path.join(d, "namespace.json"), "wb") as f:
            f.write(ns_json)
        _index_files(ckpt, journal, tmp)
        for name in ("checkpoint", "journal.1"):
            src = os.path.join(tmp, "ns", name)
            if os.path.exists(src):
                os.rename(src, os.path.join(d, name))
        try:
            s = Store(root)
        except NotAStore as e:
            assert "\n" not in str(e)
            return
        try:
            for ns in s.index.namespaces.values():
                assert all(0 <= slot < s.dirs.max_slots(ns) for slot in map(ns.where, ns.keys()))
                assert ns.alloc.hwm <= s.dirs.max_slots(ns)
        finally:
            s.close()
