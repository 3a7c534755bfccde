# SPDX-License-Identifier: Apache-2.0
"""CRC32C (Castagnoli): every path the machine has (Intel ISA-L's crc32_iscsi where
the extension links it, our three crc32q streams joined by carry-less multiplication)
must give exactly the table-driven software path's results, and all of them the
published check values, for every length, alignment and seed.

Bug this guards against: a wrong fold constant or an off-by-one at a stripe or
fold boundary gives a CRC that differs from every other writer's; each slot
written would then read back as corrupt (a miss), or, worse, blocks written by
one path would not verify under another machine's path. Fix: one result for
every path, pinned here around each boundary (the crc32q streams of 4096, 512 and
64 bytes, 8-byte steps; and the 256-byte and 64-byte steps of the AVX-512 folding
that ISA-L, like aiokv before issue 33, runs on this CPU).
Since issue 33 (CRC32C without borrowed code) the dispatch takes ISA-L wherever it
is linked: test_this_cpu_runs_its_fastest_path says so."""

from __future__ import annotations

import ctypes
import os
import random

import pytest

from aiokv import _native

PATHS = list(_native.CRC_PATHS)  # the CRC paths this CPU runs (the table path always)

# (data, CRC32C) from RFC 3720 (iSCSI) appendix B.4 and the usual check value
VECTORS = [
    (b"", 0x00000000),
    (b"123456789", 0xE3069283),
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"The quick brown fox jumps over the lazy dog", 0x22620404),
    # RFC 3720 B.4: an iSCSI Read (10) command PDU
    (
        bytes.fromhex(
            "01c00000"
            + "00" * 12
            + "14000000"
            + "00000400"
            + "00000014"
            + "00000018"
            + "28"
            + "00" * 7
            + "02"
            + "00" * 7
        ),
        0xD9963A56,
    ),
]


@pytest.mark.parametrize("data,want", VECTORS)
def test_known_vectors(data, want):
    assert _native.crc32c_bytes(data) == want
    assert _native.crc32c_sw(data) == want
    if data:
        buf = ctypes.create_string_buffer(data, len(data))
        assert _native.crc32c(ctypes.addressof(buf), len(data)) == want
        for p in PATHS:
            assert _native.crc32c_path(p, ctypes.addressof(buf), len(data)) == want, p


# lengths around the 3 x 256 and 3 x 8192 interleave boundaries, and payload sizes
LENGTHS = [
    1,
    7,
    8,
    9,
    255,
    256,
    767,
    768,
    769,
    775,
    1536,
    24575,
    24576,
    24577,
    24576 + 768 + 5,
    49152,
    65536,
    65537,
    256 << 10,
    (1 << 20) + 3,
    2 << 20,
]


@pytest.mark.parametrize("n", LENGTHS)
def test_hw_matches_sw_any_length_and_alignment(n):
    rnd = random.Random(n)
    raw = rnd.randbytes(n + 8)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for off in (0, 1, 3, 7):
        data = raw[off : off + n]
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


def test_every_path_every_short_length_and_alignment():
    """0..1100 bytes: every crc32q tail, the fold's minimum (256), each 64-byte
    tail fold and the dispatch threshold (512), at four alignments and a seed."""
    rnd = random.Random(3)
    raw = rnd.randbytes(1100 + 64)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for n in range(0, 1101):
        for off in (0, 1, 5, 63):
            seed = rnd.getrandbits(32) if n % 3 else 0
            want = _native.crc32c_sw(raw[off : off + n], seed)
            for p in PATHS:
                assert _native.crc32c_path(p, base + off, n, seed) == want, (p, n, off)
            assert _native.crc32c(base + off, n, seed) == want, (n, off)


@pytest.mark.parametrize(
    "n",
    [k * 256 + d for k in (2, 3, 4, 16, 64, 257) for d in (-65, -64, -1, 0, 1, 63, 64, 191)]
    + [(1 << 20) - 1, 1 << 20, (2 << 20) + 4096 + 1],
)
def test_every_path_around_fold_boundaries(n):
    rnd = random.Random(n)
    raw = rnd.randbytes(n + 64)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for off in (0, 7, 32):
        seed = rnd.getrandbits(32)
        want = _native.crc32c_sw(raw[off : off + n], seed)
        for p in PATHS:
            assert _native.crc32c_path(p, base + off, n, seed) == want, (p, n, off)


def test_this_cpu_runs_its_fastest_path():
    """The dispatch takes ISA-L's crc32_iscsi wherever the extension links it (ISA-L
    picks its own code by CPUID: AVX-512 folding where the CPU and OS allow it), and
    a build here links it where its header is (setup.py stops otherwise, unless told
    AIOKV_WITHOUT_ISAL=1); without ISA-L, crc32q where the CPU has SSE4.2 and
    PCLMULQDQ: a lost check would silently fall back to the table."""
    flags = open("/proc/cpuinfo").read().split("\nflags")[1].split("\n")[0].split()
    if os.path.exists("/usr/include/isa-l/crc.h") and os.environ.get("AIOKV_WITHOUT_ISAL") != "1":
        assert "isal" in PATHS
    if "isal" in PATHS:
        assert _native.CRC_PATH == "isal"
    elif {"sse4_2", "pclmulqdq"} <= set(flags):
        assert _native.CRC_PATH == "crc32q"
    assert _native.CRC_PATH == PATHS[-1]


def test_unknown_path_is_a_clear_error():
    with pytest.raises(ValueError, match="not one this CPU has"):
        _native.crc32c_path("nope", 0, 0)


@pytest.mark.parametrize(
    "n",
    [s + d for s in (3 * 4096, 2 * 3 * 4096 + 3 * 512, 3 * 4096 + 3 * 512 + 3 * 64) for d in (-9, -1, 0, 1, 8, 9, 63)]
    + [3 * 512 - 1, 3 * 512, 3 * 64 - 1, 3 * 64, 3 * 64 + 8],
)
def test_every_path_around_the_crc32q_stream_boundaries(n):
    """crc32q's rounds of three streams (4096, 512, 64 bytes each), each joined by two
    carry-less shifts, then 8-byte steps and single bytes: every length near where
    one kind of round gives way to the next."""
    rnd = random.Random(n + 1)
    raw = rnd.randbytes(n + 16)
    buf = ctypes.create_string_buffer(raw, len(raw))
    base = ctypes.addressof(buf)
    for off in (0, 3, 8):
        seed = rnd.getrandbits(32)
        want = _native.crc32c_sw(raw[off : off + n], seed)
        for p in PATHS:
            assert _native.crc32c_path(p, base + off, n, seed) == want, (p, n, off)
