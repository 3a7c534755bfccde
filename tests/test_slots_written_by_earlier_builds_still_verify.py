# SPDX-License-Identifier: Apache-2.0
"""Slots written by an earlier build of aiokv still verify: the on-disk format holds across rebuilds.

Bug guarded against: a change to how the slot checksums are computed (the CRC32C
code, the BLAKE3 behind the MAC, issue 33 replaced both) that changes a single
bit of their results turns every block already on disk into a miss, and with a
secret into a "MAC" verdict, silently: a store written by the old build reads
back empty, and no test that writes and reads with the same build can see it.
Invariant: tests/fixtures/slots-v1.bin.gz holds two slots exactly as the build
at commit cb0de93 (native CRC32C and BLAKE3, before issue 33) stamped them, payload
3 * 64 KiB + 4321 bytes: slot 0 without a secret (scheme 0, CRC only), slot 1
with the MAC of the secret "fixture secret" (scheme 1). Today's code accepts both
by the one-slot check (format.check_slot) and through BlockIO's reads from a
data file (io_uring, with and without the CRC left to the device copy, on the
loop and on checksum threads); with the secret it refuses the plain slot and
with another secret the MACed one ("MAC"); a flipped payload bit is still caught.
The fixture was made by this script, run with that commit's build:

    pool = BufferPool(fmt.slot_bytes(PLEN), 2); a, b = (pool.addr(s) for s in pool.acquire(2))
    pay = bytes((i * 31 + (i >> 9)) % 251 for i in range(PLEN))  # into both payloads
    _native.stamp_slots([a], [PLAIN_KEY], NS, RANK, PLEN, LAYOUT, False, None)
    _native.stamp_slots([b], [MACED_KEY], NS, RANK, PLEN, LAYOUT, False, fmt.mac_key(SECRET))
    gzip: slot a's HEADER_BYTES + PLEN bytes, then slot b's
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import errno
import gzip
import os

import pytest

from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.data.slotfile import data_path

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "slots-v1.bin.gz")
NS = bytes.fromhex("5107f1c7" * 4)
RANK, LAYOUT, PLEN = 2, 0xF1C7, 3 * 65536 + 4321
PLAIN_KEY, MACED_KEY = b"plain-key-0123456789", b"maced-key-0123456789abcdef"
SECRET = "fixture secret"
SLOT = fmt.HEADER_BYTES + PLEN


def _slots() -> tuple[bytes, bytes]:
    with gzip.open(HERE) as f:
        raw = f.read()
    assert len(raw) == 2 * SLOT
    return raw[:SLOT], raw[SLOT:]


def test_payload_is_what_the_fixture_says():
    plain, maced = _slots()
    want = bytes((i * 31 + (i >> 9)) % 251 for i in range(PLEN))
    assert plain[fmt.HEADER_BYTES :] == want == maced[fmt.HEADER_BYTES :]


def test_one_slot_check_accepts_both_and_refuses_what_it_must():
    plain, maced = _slots()
    mk = fmt.mac_key(SECRET)
    h = fmt.check_slot(plain, NS, RANK, PLEN, PLAIN_KEY, LAYOUT)
    assert h["mac_scheme"] == 0 and h["key"] == PLAIN_KEY
    h = fmt.check_slot(maced, NS, RANK, PLEN, MACED_KEY, LAYOUT, mk)
    assert h["mac_scheme"] == fmt.MAC_SCHEME == 1 and h["key"] == MACED_KEY
    assert fmt.check_slot(maced, NS, RANK, PLEN, MACED_KEY, LAYOUT)["key"] == MACED_KEY  # no secret: CRC only
    with pytest.raises(fmt.BadBlock, match="^MAC$"):
        fmt.check_slot(plain, NS, RANK, PLEN, PLAIN_KEY, LAYOUT, mk)
    with pytest.raises(fmt.BadBlock, match="^MAC$"):
        fmt.check_slot(maced, NS, RANK, PLEN, MACED_KEY, LAYOUT, fmt.mac_key("another secret"))
    for slot, mkey in ((plain, None), (maced, mk)):
        bad = bytearray(slot)
        bad[fmt.HEADER_BYTES + PLEN // 2] ^= 0x10
        with pytest.raises(fmt.BadBlock, match="payload checksum" if mkey is None else "^MAC$"):
            fmt.check_slot(bytes(bad), NS, RANK, PLEN, None, LAYOUT, mkey)


@pytest.mark.parametrize("threads", [0, 2])
@pytest.mark.parametrize("crc_in_copy", [False, True])
async def test_blockio_reads_them_from_a_data_file(tmp_path, crc_in_copy, threads):
    plain, maced = _slots()
    ns_dir = str(tmp_path / "ns" / NS.hex())
    path = data_path(ns_dir, RANK)
    os.makedirs(ns_dir)
    sb = fmt.slot_bytes(PLEN)
    with open(path, "wb") as f:
        f.write(plain.ljust(sb, b"\0") + maced.ljust(sb, b"\0"))
    backend = open_backend(asyncio.get_running_loop(), "uring")
    cpu = concurrent.futures.ThreadPoolExecutor(threads) if threads else None
    pool = BufferPool(sb, 8)
    addrs = [pool.addr(s) for s in pool.acquire(8)]
    ios = {
        s: BlockIO(backend, ns_dir, NS, RANK, PLEN, LAYOUT, secret=s, cpu=cpu) for s in (None, SECRET, "another secret")
    }
    try:
        # eight reads (more than one pipelined chunk's worth of payload: over SPREAD_MIN_BYTES with threads)
        items = [(i % 2, (PLAIN_KEY, MACED_KEY)[i % 2], a) for i, a in enumerate(addrs)]
        assert await ios[None].read(items, crc_in_copy=crc_in_copy) == [0] * 8
        assert ctypes.string_at(addrs[1], SLOT) == maced
        bad = -errno.EBADMSG
        assert await ios[SECRET].read(items, crc_in_copy=crc_in_copy) == [bad, 0] * 4
        assert await ios["another secret"].read(items, crc_in_copy=crc_in_copy) == [bad] * 8
        assert ios[SECRET].verify(MACED_KEY, addrs[1]) and not ios[SECRET].verify(PLAIN_KEY, addrs[0])
    finally:
        for io in ios.values():
            io.close()
        backend.close()
        pool.close()
        if cpu:
            cpu.shutdown()
