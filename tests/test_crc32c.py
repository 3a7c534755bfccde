"""CRC32C (Castagnoli): the hardware path (three interleaved crc32q chains
merged with shift tables) must give exactly the table-driven software path's
results, and both the published check values, for every length and alignment."""
from __future__ import annotations

import ctypes
import random

import pytest

from aiokv import _native

# (data, CRC32C) from RFC 3720 (iSCSI) appendix B.4 and the usual check value
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"The quick brown fox jumps over the lazy dog", 0x22620404),
]


@pytest.mark.parametrize("data,want", VECTORS)
def test_known_vectors(data, want):
    assert _native.crc32c_bytes(data) == want
    assert _native.crc32c_sw(data) == want
    if data:
        buf = ctypes.create_string_buffer(data, len(data))
        assert _native.crc32c(ctypes.addressof(buf), len(data)) == want


# lengths around the 3 x 256 and 3 x 8192 interleave boundaries, and payload sizes
LENGTHS = [1, 7, 8, 9, 255, 256, 767, 768, 769, 775, 1536, 24575, 24576, 24577, 24576 + 768 + 5,
           49152, 65536, 65537, 256 << 10, (1 << 20) + 3, 2 << 20]


@pytest.mark.parametrize("n", LENGTHS)
def test_hw_matches_sw_any_length_and_alignment(n):
    rnd = random.Random(n)
    raw = rnd.randbytes(n + 8)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for off in (0, 1, 3, 7):
        data = raw[off:off + n]
        want = _native.crc32c_sw(data)
        assert _native.crc32c_bytes(data) == want, (n, off)
        assert _native.crc32c(base + off, n) == want, (n, off)  # GIL-free path above 64 KiB
        seed = rnd.getrandbits(32)
        assert _native.crc32c(base + off, n, seed) == _native.crc32c_sw(data, seed), (n, off)


def test_chaining_equals_whole():
    data = random.Random(1).randbytes(100_000)
    for cut in (0, 1, 768, 24576, 50_001, 100_000):
        assert _native.crc32c_bytes(data[cut:], _native.crc32c_bytes(data[:cut])) == _native.crc32c_bytes(data)


def test_single_bit_flips_are_seen():
    data = bytearray(random.Random(2).randbytes(3 * 8192 + 100))
    good = _native.crc32c_bytes(bytes(data))
    for pos in (0, 8191, 8192, 16384, 24575, 24576, len(data) - 1):
        data[pos] ^= 0x10
        assert _native.crc32c_bytes(bytes(data)) != good
        data[pos] ^= 0x10
