# SPDX-License-Identifier: Apache-2.0
"""One slot check for every reader, batch and single slot alike; the native stamp is format.py's header.

Bug guarded against: the hot path verified whole chunks of slots in C (one
call, GIL released) while the store's verify, inspect and single-slot
BlockIO.verify used a second definition, format.check_slot in Python. Two
definitions of "this slot is valid for (nsid, rank, payload length, key,
layout)" can drift: a header C writes that Python rejects (every block a miss
after a restart, or reported corrupt by `aiokv inspect`), or a bad block C
accepts (wrong bytes loaded). Another drift: _native.stamp_slots writing other
bytes than format.pack_header.
Invariant: _native.stamp_slots writes exactly format.pack_header's bytes (and
zeroes the rest of the header); for a valid slot and every kind of bad one,
format.check_slot (one slot) and _native.verify_slots (a batch) give the same
verdict, in the order docs/format.md gives, named by SLOT_REASONS; with
crc_in_copy (the payload CRC checked in the device copy instead) the verdict
is format.check_header's; a reader that leaves the key or layout out (None)
has it not checked, and a buffer too short is a verdict, never a read past it.
Fix: one check, slot_verdict in native/slots.c, behind both entries
(_native.check_slot, _native.verify_slots); one layout (format.HDR, mirrored
by HDR_OFF_*); its verdicts named once (format.SLOT_REASONS).
"""

from __future__ import annotations

import ctypes
import random
import struct
import time

import pytest

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool

NS = bytes(range(16))
OTHER_NS = bytes(range(1, 17))
PAYLOAD = 3 * 4096 + 100  # not a multiple of the page: the padding is not hashed
RANK, LAYOUT = 3, 0x1234_5678_9ABC_DEF0
SB = fmt.slot_bytes(PAYLOAD)


def key(i: int, n: int = 32) -> bytes:
    return bytes([i + 1]) * n


@pytest.fixture
def pool():
    p = BufferPool(SB, 64)
    yield p
    p.close()


def _fill(pool, slot: int, seed: int) -> int:
    """Random payload and a garbage header; returns the slot's address."""
    addr = pool.addr(slot)
    ctypes.memset(addr, 0xAA, fmt.HEADER_BYTES)
    ctypes.memmove(addr + fmt.HEADER_BYTES, random.Random(seed).randbytes(PAYLOAD), PAYLOAD)
    return addr


def _stamp(addrs, keys, rank=RANK, layout=LAYOUT):
    _native.stamp_slots(addrs, keys, NS, rank, PAYLOAD, layout)


def _python_reason(addr, k, nsid=NS, rank=RANK, payload_len=PAYLOAD, layout=LAYOUT) -> str:
    try:
        fmt.check_slot((ctypes.c_char * SB).from_address(addr), nsid, rank, payload_len, k, layout)
    except fmt.BadBlock as e:
        return str(e)
    return ""


def test_stamp_writes_format_headers_byte_for_byte(pool):
    keys = [key(i, 16 + i) for i in range(17)]  # every key length 16..32
    addrs = [_fill(pool, i, i) for i in range(len(keys))]
    t0 = time.time_ns()
    _stamp(addrs, keys)
    t1 = time.time_ns()
    for k, addr in zip(keys, addrs):
        raw = ctypes.string_at(addr, fmt.HEADER_BYTES)
        seq = fmt.unpack_header(raw)["seq"]
        assert t0 <= seq <= t1  # the wall clock in ns, as time.time_ns()
        crc = _native.crc32c_sw(ctypes.string_at(addr + fmt.HEADER_BYTES, PAYLOAD))
        want = fmt.pack_header(NS, RANK, k, PAYLOAD, crc, seq, LAYOUT)
        assert raw == want + bytes(fmt.HEADER_BYTES - len(want))
        assert _python_reason(addr, k) == ""


def _refix(addr: int, **fields) -> None:
    """Rewrite header fields and recompute the header CRC: a well-formed header that says something else."""
    names = ("magic", "version", "hbytes", "rank", "nsid", "klen", "macs", "pcrc", "plen", "key", "seq", "layout")
    vals = dict(zip(names, fmt.HDR.unpack(ctypes.string_at(addr, fmt.HDR.size))))
    vals.update(fields)
    body = fmt.HDR.pack(*(vals[n] for n in names))
    ctypes.memmove(addr, body + struct.pack("<I", _native.crc32c_bytes(body)), fmt.HDR_USED)


def _poke(addr: int, off: int) -> None:
    b = ctypes.string_at(addr + off, 1)[0]
    ctypes.memset(addr + off, b ^ 0x40, 1)


K = key(0)
# (name, how the slot is spoiled, what the reader asks for (overrides), expected reason)
CASES = [
    ("valid", lambda a: None, {}, ""),
    ("payload first byte", lambda a: _poke(a, fmt.HEADER_BYTES), {}, "payload checksum"),
    ("payload last byte", lambda a: _poke(a, fmt.HEADER_BYTES + PAYLOAD - 1), {}, "payload checksum"),
    ("payload padding", lambda a: _poke(a, fmt.HEADER_BYTES + PAYLOAD), {}, ""),  # not part of the block
    ("MAC area", lambda a: _poke(a, fmt.MAC_OFFSET), {}, ""),  # read only with a secret
    ("payload crc field", lambda a: _refix(a, pcrc=1), {}, "payload checksum"),
    *[(f"header byte {o}", lambda a, o=o: _poke(a, o), {}, "header checksum") for o in (0, 9, 33, 50, 95, 96, 99)],
    ("magic", lambda a: _refix(a, magic=b"AIOKVBLX"), {}, "magic"),
    ("version", lambda a: _refix(a, version=2), {}, "format version"),
    ("header bytes", lambda a: _refix(a, hbytes=512), {}, "format version"),
    ("layout", lambda a: _refix(a, layout=LAYOUT + 1), {}, "header names another layout"),
    ("nsid", lambda a: _refix(a, nsid=OTHER_NS), {}, "header names another nsid"),
    ("rank", lambda a: _refix(a, rank=RANK + 1), {}, "header names another rank"),
    ("key bytes", lambda a: _refix(a, key=key(9)), {}, "header names another key"),
    ("key length short", lambda a: _refix(a, klen=31), {}, "header names another key"),
    ("key length 0", lambda a: _refix(a, klen=0), {}, "header names another key"),
    ("key length past 32", lambda a: _refix(a, klen=200), {}, ""),  # key[:klen]: the same 32 bytes
    ("payload length", lambda a: _refix(a, plen=PAYLOAD - 1), {}, "header names another payload len"),
    ("reader's layout", lambda a: None, {"layout": 0}, "header names another layout"),
    ("reader's nsid", lambda a: None, {"nsid": OTHER_NS}, "header names another nsid"),
    ("reader's rank", lambda a: None, {"rank": 0}, "header names another rank"),
    ("reader's key", lambda a: None, {"k": key(5)}, "header names another key"),
    ("reader's shorter key", lambda a: None, {"k": K[:16]}, "header names another key"),
    ("reader's payload length", lambda a: None, {"payload_len": PAYLOAD - 4096}, "header names another payload len"),
    ("zeros", lambda a: ctypes.memset(a, 0, fmt.HEADER_BYTES), {}, "header checksum"),
]


def _spoiled_cases(pool, seed: int) -> list[tuple]:
    """Each of CASES on its own stamped slot, spoiled as it says: (name, addr,
    the reader's expectations, the reason wanted)."""
    addrs = [_fill(pool, i, seed + i) for i in range(len(CASES))]
    _stamp(addrs, [K] * len(addrs))
    for (_, spoil, _, _), addr in zip(CASES, addrs):
        spoil(addr)
    return [
        (name, addr, {"nsid": NS, "rank": RANK, "payload_len": PAYLOAD, "layout": LAYOUT, "k": K, **ask}, want)
        for (name, _, ask, want), addr in zip(CASES, addrs)
    ]


def test_native_verdicts_equal_check_slot_for_every_kind_of_bad_slot(pool):
    cases = _spoiled_cases(pool, 100)
    # one batch per reader expectation, as BlockIO asks
    for name, addr, ask, want in cases:
        py = _python_reason(addr, **ask)
        assert py.startswith(want) and (py == "") == (want == ""), (name, py)
        (v,) = _native.verify_slots([addr], [ask["k"]], ask["nsid"], ask["rank"], ask["payload_len"], ask["layout"])
        assert fmt.SLOT_REASONS[v] == want, (name, fmt.SLOT_REASONS[v])
    # and all in one batch: verdicts in item order
    plain = [i for i, c in enumerate(CASES) if not c[2]]
    got = _native.verify_slots([cases[i][1] for i in plain], [K] * len(plain), NS, RANK, PAYLOAD, LAYOUT)
    assert [fmt.SLOT_REASONS[v] for v in got] == [CASES[i][3] for i in plain]


def test_random_corruption_agrees(pool):
    """Random byte flips anywhere in the first 128 header bytes or the payload."""
    rnd = random.Random(7)
    addrs = [_fill(pool, i, 200 + i) for i in range(48)]
    keys = [key(i % 5, 16 + i % 17) for i in range(48)]
    _stamp(addrs, keys)
    for addr in addrs:
        for _ in range(rnd.randint(0, 2)):
            _poke(addr, rnd.choice([rnd.randrange(128), fmt.HEADER_BYTES + rnd.randrange(PAYLOAD)]))
    got = _native.verify_slots(addrs, keys, NS, RANK, PAYLOAD, LAYOUT)
    for v, addr, k in zip(got, addrs, keys):
        py = _python_reason(addr, k)
        assert py.startswith(fmt.SLOT_REASONS[v]) and (v == 0) == (py == ""), (v, py)


def test_bad_arguments_are_clear_errors_and_touch_nothing(pool):
    addr = _fill(pool, 0, 1)
    before = ctypes.string_at(addr, SB)
    with pytest.raises(ValueError, match="keys are 16-32 bytes"):
        _stamp([addr, addr], [K, b"short"])
    with pytest.raises(ValueError, match="differ in length"):
        _stamp([addr], [K, K])
    with pytest.raises(ValueError, match="nsid must be 16 bytes"):
        _native.stamp_slots([addr], [K], NS[:8], RANK, PAYLOAD, LAYOUT)
    with pytest.raises(TypeError):
        _stamp([addr], ["not bytes" * 4])
    assert ctypes.string_at(addr, SB) == before
    assert _native.verify_slots([], [], NS, RANK, PAYLOAD, LAYOUT) == b""


def test_header_only_verdicts_equal_check_header(pool):
    """verify_slots(..., crc_in_copy=True), used when the device copy checks the
    payload CRC, is check_slot without its last check: format.check_header."""
    for name, addr, ask, want in _spoiled_cases(pool, 300):
        try:
            fmt.check_header(
                ctypes.string_at(addr, fmt.HDR_USED),
                ask["nsid"],
                ask["rank"],
                ask["payload_len"],
                ask["k"],
                ask["layout"],
            )
            py = ""
        except fmt.BadBlock as e:
            py = str(e)
        (v,) = _native.verify_slots(
            [addr], [ask["k"]], ask["nsid"], ask["rank"], ask["payload_len"], ask["layout"], True
        )
        assert fmt.SLOT_REASONS[v] == ("" if want == "payload checksum" else want), (name, v)
        assert py.startswith(fmt.SLOT_REASONS[v]) and (py == "") == (v == 0), (name, py)


def test_a_reader_may_leave_key_and_layout_out(pool):
    """key or layout None (scan's header-only reads, inspect): that field is not
    checked, every other one is, in the same order."""
    for name, addr, ask, want in _spoiled_cases(pool, 400):
        view = (ctypes.c_char * SB).from_address(addr)
        for leave in ("k", "layout"):
            got = _python_reason(addr, **{**ask, leave: None})
            skipped = {"k": "header names another key", "layout": "header names another layout"}[leave]
            assert got.startswith("" if want == skipped else want) and (got == "") == (want in ("", skipped)), (
                name,
                leave,
                got,
            )
        if not want:
            h = fmt.check_slot(view, NS, RANK, PAYLOAD)
            assert (h["key"], h["layout"], h["payload_len"], h["rank"], h["nsid"]) == (K, LAYOUT, PAYLOAD, RANK, NS)


def test_short_buffers_and_odd_keys_are_verdicts(pool):
    addr = _fill(pool, 0, 500)
    _stamp([addr], [K])
    whole = ctypes.string_at(addr, SB)
    for raw, want in (
        (whole[: fmt.HDR_USED - 1], "header short"),
        (b"", "header short"),
        (whole[: fmt.HEADER_BYTES + PAYLOAD - 1], "payload short"),
        (whole[: fmt.HEADER_BYTES - 1], "payload short"),
        (whole[: fmt.HEADER_BYTES + PAYLOAD], ""),
    ):
        try:
            fmt.check_slot(raw, NS, RANK, PAYLOAD, K, LAYOUT)
            got = ""
        except fmt.BadBlock as e:
            got = str(e)
        assert got == want, (len(raw), got)
    # the header alone needs only its own bytes
    assert fmt.check_header(whole[: fmt.HDR_USED], NS, RANK, PAYLOAD, K, LAYOUT)["key"] == K
    assert fmt.unpack_header(whole[: fmt.HDR_USED])["key"] == K
    # a key given as any buffer is compared by its bytes; one longer than any header's never matches
    assert fmt.check_slot(whole, NS, RANK, PAYLOAD, bytearray(K), LAYOUT)["key"] == K
    with pytest.raises(fmt.BadBlock, match="^header names another key$"):
        fmt.check_slot(whole, NS, RANK, PAYLOAD, K + b"x", LAYOUT)
    with pytest.raises(ValueError, match="nsid must be 16 bytes"):
        fmt.check_slot(whole, NS[:8], RANK, PAYLOAD, K, LAYOUT)


def test_unpack_header_checks_only_the_header_itself(pool):
    """unpack_header: the first checks (length, header CRC, magic, version), none of the reader's."""
    cases = _spoiled_cases(pool, 600)
    own = ("", "header short", "header checksum", "magic", "format version")
    for name, addr, _ask, want in cases:
        raw = ctypes.string_at(addr, fmt.HDR_USED)
        try:
            fmt.unpack_header(raw)
            got = ""
        except fmt.BadBlock as e:
            got = str(e)
        assert got.startswith(want if want in own else "") and (got == "") == (want not in own[1:]), (name, got)
    version = next(addr for name, addr, _, _ in cases if name == "version")
    with pytest.raises(fmt.BadBlock, match="^format version 2$"):
        fmt.unpack_header(ctypes.string_at(version, fmt.HDR_USED))
