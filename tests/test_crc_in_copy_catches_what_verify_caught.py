# SPDX-License-Identifier: Apache-2.0
"""The payload CRC computed inside the CPU device copy catches what the separate pass caught.

Risk: on the CPU build every byte saved or loaded was read once more by a
separate CRC32C pass (BlockIO stamping before a write, verifying after a read),
which alone cost more CPU per GB than the whole budget. Folding that CRC into
the device copy (native memcpy_crc_out / memcpy_crc_in) removes the pass, but
could silently weaken the check: a CRC over other bytes than those written, a
payload flip that no longer fails the load, a bad block kept in the memory tier
or counted as loaded, or headers that differ from docs/format.md.

Invariants: the save with the CRC in the copy copies exactly memcpy_many's bytes and leaves the
payload's CRC32C in the header, for any segment size and layer count, and the
stamped slot passes format.check_slot; the load with the CRC in the copy copies exactly
memcpy_many's bytes and flags exactly the slots whose payload changed; through
a TransferWorker, a payload byte flipped on disk makes that block (only) a
failed load, reported as a bad key and not kept in memory, while the others load.

Fix: CpuDevice.copy_out/copy_in(crc_in_copy=True) over the native copies with the CRC,
BlockIO.write(crc_in_copy=True) / read(crc_in_copy=True), used by
TransferWorker's saves and whole-request disk loads (with a secret too: its
MAC is computed in the stamp and check calls, tests/test_slot_mac_is_keyed_blake3_and_versioned.py).
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.jobs import Transfer
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.workers import cpu_worker, data_file, flip_payload_bytes, run_jobs

RANK, LAYOUT = 0, 0x0123_4567_89AB_CDEF


def _arr(addrs) -> bytes:
    return torch.tensor(list(addrs), dtype=torch.int64).numpy().tobytes()


def _setup(seg: int, layers: int, n: int):
    """n blocks of `layers` random segments of `seg` bytes; 2n staging buffers."""
    g = torch.Generator().manual_seed(seg * 31 + layers)
    kv = [torch.randint(0, 256, (n, seg), dtype=torch.uint8, generator=g) for _ in range(layers)]
    pool = BufferPool(fmt.slot_bytes(seg * layers), 2 * n)
    slots = [pool.addr(s) for s in pool.acquire(2 * n)]
    for a in slots:
        ctypes.memset(a, 0xAB, pool.slot_bytes)
    segs = [t[i].data_ptr() for t in kv for i in range(n)]  # layer-major, as CpuDevice passes them
    return kv, pool, slots, segs


def _payload(addr: int, plen: int) -> bytes:
    return ctypes.string_at(addr + fmt.HEADER_BYTES, plen)


def _refix_pcrc(addr: int) -> None:
    """A well-formed header (its own CRC right) that names another payload CRC."""
    body = bytearray(ctypes.string_at(addr, fmt.HDR.size))
    body[36] ^= 1  # the payload CRC field (format._HDR)
    body += _native.crc32c_bytes(bytes(body)).to_bytes(4, "little")
    ctypes.memmove(addr, bytes(body), len(body))


# odd sizes, a size of one piece exactly, sizes spanning several pieces with a remainder
@pytest.mark.parametrize("seg,layers", [(1, 1), (4095, 3), (16384, 2), (65536, 2), (65537, 1), (200_003, 3)])
def test_crc_in_copy_save_copies_memcpys_bytes_and_stamps_their_crc(seg, layers):
    n = 3
    kv, pool, slots, segs = _setup(seg, layers, n)
    in_copy, plain = slots[:n], slots[n:]
    plen = seg * layers
    try:
        _native.memcpy_crc_out(_arr(in_copy), _arr(segs), seg)
        _native.memcpy_many(
            _arr(a + fmt.HEADER_BYTES + layer * seg for layer in range(layers) for a in plain), _arr(segs), seg
        )
        keys = [key(i) for i in range(n)]
        _native.stamp_slots(in_copy, keys, NS, RANK, plen, LAYOUT, True)
        for i, (f, p) in enumerate(zip(in_copy, plain)):
            assert _payload(f, plen) == _payload(p, plen)
            h = fmt.check_slot((ctypes.c_char * pool.slot_bytes).from_address(f), NS, RANK, plen, keys[i], LAYOUT)
            assert h["payload_crc"] == _native.crc32c_sw(_payload(p, plen))
        # the header is format.pack_header's, exactly as a plain stamp writes it
        _native.stamp_slots(plain, keys, NS, RANK, plen, LAYOUT)
        for f, p in zip(in_copy, plain):
            hf, hp = ctypes.string_at(f, fmt.HEADER_BYTES), ctypes.string_at(p, fmt.HEADER_BYTES)
            seq = slice(80, 88)  # the stamp time differs
            assert hf[: seq.start] == hp[: seq.start] and hf[seq.stop : fmt.HDR.size] == hp[seq.stop : fmt.HDR.size]
            assert hf[fmt.HDR_USED :] == bytes(fmt.HEADER_BYTES - fmt.HDR_USED)
    finally:
        pool.close()


@pytest.mark.parametrize("seg,layers", [(4095, 3), (65537, 2), (200_003, 1)])
def test_crc_in_copy_load_copies_memcpys_bytes_and_flags_exactly_the_corrupt_slots(seg, layers):
    n = 6
    kv, pool, slots, segs = _setup(seg, layers, n)
    src = slots[:n]
    plen = seg * layers
    try:
        _native.memcpy_crc_out(_arr(src), _arr(segs), seg)
        _native.stamp_slots(src, [key(i) for i in range(n)], NS, RANK, plen, LAYOUT, True)
        # slot 1: first payload byte; 3: last; 4: a byte in a later piece; 5: the header names another CRC
        for i, off in ((1, 0), (3, plen - 1), (4, min(65536 + 7, plen - 2))):
            b = ctypes.string_at(src[i] + fmt.HEADER_BYTES + off, 1)[0]
            ctypes.memset(src[i] + fmt.HEADER_BYTES + off, b ^ 0x01, 1)
        _refix_pcrc(src[5])
        want = [_payload(a, plen) for a in src]  # what must land in the segments, bad slots too
        for t in kv:
            t.zero_()
        verdicts = _native.memcpy_crc_in(_arr(segs), _arr(src), seg)
        assert [fmt.SLOT_REASONS[v] for v in verdicts] == [
            "",
            "payload checksum",
            "",
            "payload checksum",
            "payload checksum",
            "payload checksum",
        ]
        for i in range(n):
            assert b"".join(t[i].numpy().tobytes() for t in kv) == want[i]
        # the separate pass says the same of every slot
        assert _native.verify_slots(src, [key(i) for i in range(n)], NS, RANK, plen, LAYOUT) == verdicts
    finally:
        pool.close()


def test_bad_address_arrays_are_clear_errors():
    with pytest.raises(ValueError, match="whole number of segments"):
        _native.memcpy_crc_out(_arr([4096, 8192]), _arr([1, 2, 3]), 8)
    with pytest.raises(ValueError, match="at least one slot"):
        _native.memcpy_crc_in(b"", b"", 8)


# ---- through a TransferWorker ----
NB = 40


def _worker(root: str, kept: int, secret=None) -> tuple[TransferWorker, dict]:
    kv = {f"l{i}": torch.randn(NB, 2, 32, 9) for i in range(3)}  # 2304 bytes a layer: not page-sized
    return cpu_worker(root, kv, 16, kept, secret=secret), kv


_run = run_jobs


@pytest.mark.parametrize("secret", [None, "s3cret"])
def test_a_payload_flip_on_disk_fails_only_that_block_and_is_not_kept(tmp_path, secret):
    """With a secret as without: the CRC is the copy's, and the MAC (in the
    stamp and check) is on every slot and caught the flips too."""
    root, ids = str(tmp_path), range(10)  # more than one write/read batch: the pipelined paths too
    mk = fmt.mac_key(secret) if secret else None
    w, kv = _worker(root, kept=0, secret=secret)
    assert w._crc_in_copy, "the CPU layout copies with checksums, with a secret or without"
    try:
        _, _, rep = _run(w, w.save, [Transfer("s", [key(i) for i in ids], list(ids), [i + 1 for i in ids])])
        assert len(rep.written()) == 10 and not rep.not_written()
        saved = {i: [t[i + 1].clone() for t in kv.values()] for i in ids}
    finally:
        w.close()
    (path, disk), sb = data_file(root), w.slot_bytes
    for i in ids:  # what the save with the CRC in the copy wrote is a valid slot of docs/format.md
        h = fmt.check_slot(disk[i * sb : (i + 1) * sb], NS, 0, w.device.payload_bytes, key(i), w.device.layout_tag, mk)
        assert h["mac_scheme"] == (fmt.MAC_SCHEME if secret else 0)
    bad = {3: 0, 7: w.device.payload_bytes - 1}  # slot -> payload byte flipped
    flip_payload_bytes(path, sb, bad, 0x20)

    if secret:  # the MAC alone catches the flips: a slot whose CRC was fixed up after them is bad still
        with open(path, "r+b") as f:
            for s in bad:
                f.seek(s * sb)
                slot = bytearray(f.read(sb))
                crc = _native.crc32c_bytes(bytes(slot[fmt.HEADER_BYTES : fmt.HEADER_BYTES + w.device.payload_bytes]))
                slot[36:40] = crc.to_bytes(4, "little")
                slot[96:100] = _native.crc32c_bytes(bytes(slot[:96])).to_bytes(4, "little")
                f.seek(s * sb)
                f.write(slot)
    w, kv = _worker(root, kept=16, secret=secret)
    try:
        first = 20
        t = Transfer("r", [key(i) for i in ids], list(ids), [first + i for i in ids])
        done, errors, rep = _run(w, w.load, [t])
        assert done == {"r"} and errors == {first + s for s in bad}
        assert sorted(k for r in rep.loads for k in r.bad) == sorted(key(s) for s in bad)
        assert [r.req_id for r in rep.loads if r.failed] == ["r"]
        assert rep.counters["loads_ok_blocks"] == 8 and rep.counters["load_failed_blocks"] == 2
        for i in ids:
            if i not in bad:
                assert all(torch.equal(t[first + i], want) for t, want in zip(kv.values(), saved[i]))
        assert all(slot is None for slot in w.staging.take_kept([key(s) for s in bad], w.memory_ns)), (
            "a corrupt block is not kept in memory"
        )
        assert w.staging.kept == 8
        assert w.staging_in_use == 0, "every slot went back"
    finally:
        w.close()


def test_random_payload_flips_are_caught_like_verify_slots_catches_them():
    """Many slots, random single flips anywhere in the payload: the verdicts of
    the load's CRC in the copy equal verify_slots' for every slot."""
    seg, layers, n = 3000, 4, 32
    kv, pool, slots, segs = _setup(seg, layers, n)
    src, plen, rnd = slots[:n], seg * layers, random.Random(5)
    try:
        _native.memcpy_crc_out(_arr(src), _arr(segs), seg)
        _native.stamp_slots(src, [key(i % 8) for i in range(n)], NS, RANK, plen, LAYOUT, True)
        for a in src:
            if rnd.random() < 0.5:
                off = fmt.HEADER_BYTES + rnd.randrange(plen)
                ctypes.memset(a + off, ctypes.string_at(a + off, 1)[0] ^ (1 << rnd.randrange(8)), 1)
        want = _native.verify_slots(src, [key(i % 8) for i in range(n)], NS, RANK, plen, LAYOUT)
        assert 0 < sum(want) < len(want) * fmt.SLOT_REASONS.index("payload checksum")
        assert _native.memcpy_crc_in(_arr(segs), _arr(src), seg) == want
    finally:
        pool.close()
