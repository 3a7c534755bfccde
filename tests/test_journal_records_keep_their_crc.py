# SPDX-License-Identifier: Apache-2.0
"""A journal record keeps its CRC32C across builds: aiokv._index seals and checks records
with native/crc32c.c, the CRC aiokv._native checks slots with (issue 42: before it, the
index had a table and an SSE4.2 loop of its own).

The bug this guards against: a CRC with another seed or final inversion than the one the
records were sealed with makes every journal written before the change fail its check; the
reader then stops at the first record (records_valid counts 0) and the index comes back
empty, every stored block lost.

The invariant: records sealed by the index before issue 42 (the bytes below, made by its own
CRC then) verify now, and the index makes the same bytes again; the index's record CRC is
_native's crc32c from a zero seed, by every CRC path this machine has, for any record size.

The fix: records.c calls crc32c(0, ...), whose seed and inversions are those of the old
record_crc (all ones before, inverted after).
"""

from __future__ import annotations

import ctypes
import random

from aiokv import _index, _native
from aiokv.data import format as fmt

KINDS = bytes(fmt.REC_KINDS)
KLENS = bytes([fmt.MIN_KEY, fmt.MAX_KEY] * len(fmt.REC_KINDS))

# commit_records([bytes(range(1, 33)), bytes(range(100, 116))], [7, 0xFFFFFFFE],
# 1733500000123456789, tenant=3, flags=1), by the index built before issue 42
SEALED_BEFORE = bytes.fromhex(
    "0120000007000000158d7fcd10a10e18"  # COMMIT, key length 32, slot 7, atime
    "0102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f20"  # key
    "0000000000000000"  # tag 0
    "03000100"  # tenant 3, flags 1
    "a03fcd42"  # CRC
    "01100000feffffff158d7fcd10a10e18"  # COMMIT, key length 16, slot 0xFFFFFFFE, atime
    "6465666768696a6b6c6d6e6f7071727300000000000000000000000000000000"  # key
    "0000000000000000"  # tag 0
    "03000100"  # tenant 3, flags 1
    "1354d1d7"  # CRC
)
CRCS_BEFORE = (0x42CD3FA0, 0xD7D15413)  # their last 4 bytes, little-endian


def test_records_sealed_before_verify_and_are_made_alike():
    assert len(SEALED_BEFORE) == 2 * fmt.REC_BYTES
    crcs = [int.from_bytes(SEALED_BEFORE[i + 60 : i + 64], "little") for i in (0, 64)]
    assert tuple(crcs) == CRCS_BEFORE
    assert _index.records_valid(SEALED_BEFORE, fmt.REC_BYTES, KINDS, KLENS) == 2
    made = _index.commit_records(
        [bytes(range(1, 33)), bytes(range(100, 116))], [7, 0xFFFFFFFE], 1733500000123456789, 3, 1
    )
    assert made == SEALED_BEFORE
    assert made[:64] == fmt.pack_record(fmt.REC_COMMIT, bytes(range(1, 33)), 7, 1733500000123456789, 3, 1)
    resealed = bytearray(SEALED_BEFORE)
    for i in (60, 124):
        resealed[i : i + 4] = bytes(4)
    _index.seal(resealed, fmt.REC_BYTES)
    assert bytes(resealed) == SEALED_BEFORE
    flipped = bytearray(SEALED_BEFORE)
    flipped[64 + 20] ^= 0x10  # the second record's key
    assert _index.records_valid(bytes(flipped), fmt.REC_BYTES, KINDS, KLENS) == 1


def test_the_index_seals_with_native_crc32c_by_every_path():
    rng = random.Random(42)
    for recbytes in (8, 9, 15, 16, 63, 64, 65, 100, 200, 520):
        n = 5
        buf = bytearray(rng.randbytes(recbytes * n))
        _index.seal(buf, recbytes)
        for i in range(n):
            rec = bytes(buf[i * recbytes : (i + 1) * recbytes])
            body, crc = rec[:-4], int.from_bytes(rec[-4:], "little")
            assert crc == _native.crc32c_bytes(body) == _native.crc32c_sw(body), (recbytes, i)
            raw = (ctypes.c_char * len(body)).from_buffer_copy(body)
            for path in _native.CRC_PATHS:
                assert _native.crc32c_path(path, ctypes.addressof(raw), len(body)) == crc, (path, recbytes)
