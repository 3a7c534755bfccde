# SPDX-License-Identifier: Apache-2.0
"""The slot MAC: keyed BLAKE3, in the stamp and check calls, named by a scheme byte.

Bug: with a `secret` the MAC was a keyed BLAKE2b computed in Python on the loop
thread, a slot at a time, after the native stamp and check (about 0.4 GB/s on
one core, and the GIL held between slots), so the safe configuration moved KV
several times slower than the unsafe one, and the CRC in the device copy was
switched off under a secret.
Invariant: the MAC is keyed BLAKE3-256 (BLAKE3's published keyed_hash vectors)
of the payload, then the header's first 96 bytes, keyed by format.mac_key
(BLAKE3's derive_key of the secret under aiokv's context: pinned, since every
engine of a fleet must derive the same key); stamp_slots writes it with scheme
1 at byte 33; check_slot and verify_slots with the key accept exactly the slots
stamped with it: a flipped bit in the payload, in any header field (header CRC
fixed up), in the MAC, a scheme other than 1 (the BLAKE2b slots of earlier
versions) or another secret is a "MAC" verdict; a reader without a secret
still reads a MACed slot, and one with a secret still refuses a slot whose
payload's CRC is wrong under a right MAC (a writer's bug) by the CRC.
The same verdicts when the stamp takes the payload CRC from the header and when
the check leaves it to the device copy (crc_in_copy both: the MAC alone then).
Fix: the MAC computed in the stamp and check calls, GIL released (first
native/blake3, BLAKE3's C code, in native/slots.c; since issue 33 the blake3
package, in format.stamp_slots, verify_slots and check_slot: aiokv/data/mac.py),
format.mac_key, BlockIO passing its key to them.
"""

from __future__ import annotations

import ctypes
import threading
import time

import blake3
import pytest

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data import mac
from aiokv.data.buffers import BufferPool
from tests.conftest import NS, key

RANK, LAYOUT = 3, 0x5EED
VECTOR_KEY = b"whats the Elvish word for friend"
# BLAKE3's test_vectors.json: input bytes i % 251, keyed_hash's first 32 bytes
KEYED_VECTORS = {
    0: "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26",
    1: "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b",
    1023: "c951ecdf03288d0fcc96ee3413563d8a6d3589547f2c2fb36d9786470f1b9d6e",
    1024: "75c46f6f3d9eb4f55ecaaee480db732e6c2105546f1e675003687c31719c7ba4",
    1025: "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69",
    2049: "9f29700902f7c86e514ddc4df1e3049f258b2472b6dd5267f61bf13983b78dd5",
    8193: "954a2a75420c8d6547e3ba5b98d963e6fa6491addc8c023189cc519821b4a1f5",
    31744: "efa53b389ab67c593dba624d898d0f7353ab99e4ac9d42302ee64cbf9939a419",
    102400: "1c35d1a5811083fd7119f5d5d1ba027b4d01c0c6c49fb6ff2cf75393ea5db4a7",
}
# what every engine of a fleet derives from the secret "s3cret" (a change here loses every MACed block)
S3CRET_KEY = "e657c3699f6005dc8e66bdc95c09a15b2450bc5fbf4abec50bc093abd00af3e2"


@pytest.mark.parametrize("n", sorted(KEYED_VECTORS))
def test_keyed_blake3_matches_the_published_vectors(n):
    assert mac.keyed(VECTOR_KEY, bytes(i % 251 for i in range(n))).hex() == KEYED_VECTORS[n]
    cut = n // 3  # in parts, as the MAC hashes a payload, then header fields
    data = bytes(i % 251 for i in range(n))
    assert mac.keyed(VECTOR_KEY, data[:cut], memoryview(data)[cut:]).hex() == KEYED_VECTORS[n]


def test_mac_key_is_pinned_and_depends_on_the_secret():
    assert fmt.mac_key("s3cret").hex() == S3CRET_KEY == fmt.mac_key(b"s3cret").hex()
    assert fmt.mac_key("s3cret!") != fmt.mac_key("s3cret") and len(fmt.mac_key("")) == 32
    with pytest.raises(ValueError, match="32 bytes"):
        fmt.verify_slots([], [], NS, 0, 16, 0, False, b"short")


# sizes: below one BLAKE3 chunk, a chunk exactly, several pieces of the stamp's CRC+MAC pass with a rest
@pytest.fixture(params=[100, 1024, 16384 * 3 + 5, (64 << 10) * 2 + 777])
def slots(request):
    plen = request.param
    pool = BufferPool(fmt.slot_bytes(plen), 8)
    addrs = [pool.addr(s) for s in pool.acquire(8)]
    for i, a in enumerate(addrs):
        ctypes.memmove(a + fmt.HEADER_BYTES, bytes((i * 7 + j) % 256 for j in range(plen)), plen)
    yield plen, addrs
    pool.close()


def _slot(addr: int, plen: int) -> bytes:
    return ctypes.string_at(addr, fmt.HEADER_BYTES + plen)


def _refix(addr: int, offset: int, xor: int) -> None:
    """Flip header byte `offset` (< 96) and fix the header CRC: a well-formed header that says something else."""
    body = bytearray(ctypes.string_at(addr, fmt.HDR.size))
    body[offset] ^= xor
    ctypes.memmove(addr, bytes(body) + _native.crc32c_bytes(bytes(body)).to_bytes(4, "little"), fmt.HDR_USED)


def _one_slot_reason(raw, plen, k, mk) -> str:
    """format.check_slot's verdict on one slot: "" or its BadBlock's reason."""
    try:
        fmt.check_slot(raw, NS, RANK, plen, k, LAYOUT, mk)
    except fmt.BadBlock as e:
        return str(e)
    return ""


def _verdicts(addrs, plen, mk, skip=False) -> list[str]:
    got = fmt.verify_slots(addrs, [key(i) for i in range(len(addrs))], NS, RANK, plen, LAYOUT, skip, mk)
    return [fmt.SLOT_REASONS[v] for v in got]


@pytest.mark.parametrize("crc_in_copy", [False, True])
def test_stamped_mac_is_keyed_blake3_of_payload_then_header_fields(slots, crc_in_copy):
    plen, addrs = slots
    mk = fmt.mac_key("s3cret")
    if crc_in_copy:  # the CRC already in the header (what the device copy leaves there)
        for a in addrs:
            ctypes.memmove(a + 36, _native.crc32c(a + fmt.HEADER_BYTES, plen).to_bytes(4, "little"), 4)
    fmt.stamp_slots(addrs, [key(i) for i in range(8)], NS, RANK, plen, LAYOUT, crc_in_copy, mk)
    for i, a in enumerate(addrs):
        raw = _slot(a, plen)
        h = fmt.check_slot(raw, NS, RANK, plen, key(i), LAYOUT)  # the CRC path still holds
        assert h["mac_scheme"] == fmt.MAC_SCHEME == 1
        want = blake3.blake3(raw[fmt.HEADER_BYTES :] + raw[: fmt.HDR.size], key=mk).digest()
        assert raw[fmt.MAC_OFFSET : fmt.MAC_OFFSET + fmt.MAC_BYTES] == want
        assert raw[fmt.MAC_OFFSET + fmt.MAC_BYTES : fmt.HEADER_BYTES] == bytes(fmt.HEADER_BYTES - 132)
        assert fmt.check_slot(raw, NS, RANK, plen, key(i), LAYOUT, mk)["key"] == key(i)
    assert _verdicts(addrs, plen, mk) == [""] * 8
    assert _verdicts(addrs, plen, mk, skip=True) == [""] * 8
    assert _verdicts(addrs, plen, None) == [""] * 8, "a reader without a secret reads MACed slots"


@pytest.mark.parametrize("skip", [False, True])
def test_every_change_to_a_maced_slot_is_a_mac_verdict(slots, skip):
    plen, addrs = slots
    mk = fmt.mac_key("s3cret")
    fmt.stamp_slots(addrs, [key(i) for i in range(8)], NS, RANK, plen, LAYOUT, False, mk)
    # 0: intact; 1: a payload bit (first byte); 2: a payload bit (last byte); 3: the sequence number
    # (a header field no other check reads); 4: the payload CRC field; 5: the MAC itself; 6: scheme 0
    # (what a BLAKE2b-era slot says); 7: stamped under another secret
    a = addrs
    ctypes.memset(a[1] + fmt.HEADER_BYTES, ctypes.string_at(a[1] + fmt.HEADER_BYTES, 1)[0] ^ 1, 1)
    last = a[2] + fmt.HEADER_BYTES + plen - 1
    ctypes.memset(last, ctypes.string_at(last, 1)[0] ^ 0x80, 1)
    _refix(a[3], 80, 1)
    _refix(a[4], 36, 4)
    ctypes.memset(a[5] + fmt.MAC_OFFSET + 31, ctypes.string_at(a[5] + fmt.MAC_OFFSET + 31, 1)[0] ^ 1, 1)
    _refix(a[6], fmt.MAC_SCHEME_OFFSET, 1)
    fmt.stamp_slots([a[7]], [key(7)], NS, RANK, plen, LAYOUT, False, fmt.mac_key("another"))
    want = [""] + ["MAC"] * 7
    assert _verdicts(addrs, plen, mk, skip) == want
    for i, addr in enumerate(addrs):  # the one-slot check says the same
        assert _one_slot_reason(_slot(addr, plen), plen, key(i), mk) == want[i], i
    # without the secret: the payload flips and the CRC field are CRC verdicts, the rest reads fine
    assert (
        _verdicts(addrs, plen, None, skip)
        == [""]
        + (["", ""] if skip else ["payload checksum"] * 2)
        + [""]
        + ["" if skip else "payload checksum"]
        + [""] * 3
    )


def test_header_only_checks_do_not_need_the_payload():
    """check_header and unpack_header never read a MAC's payload: a header alone is enough."""
    plen = 5000
    pool = BufferPool(fmt.slot_bytes(plen), 1)
    try:
        a = pool.addr(pool.acquire(1)[0])
        fmt.stamp_slots([a], [key(1)], NS, RANK, plen, LAYOUT, False, fmt.mac_key("s3cret"))
        hdr = ctypes.string_at(a, fmt.HDR_USED + fmt.MAC_BYTES)
        assert fmt.check_header(hdr, NS, RANK, plen, key(1), LAYOUT)["mac_scheme"] == 1
        assert fmt.unpack_header(hdr)["key"] == key(1)
        with pytest.raises(fmt.BadBlock, match="payload short"):
            fmt.check_slot(hdr, NS, RANK, plen, key(1), LAYOUT, fmt.mac_key("s3cret"))
    finally:
        pool.close()


def test_a_wrong_payload_crc_under_a_right_mac_is_still_caught(slots):
    """A writer with the key that put a wrong CRC in the header (the copy's CRC over
    other bytes than those stamped): the MAC verifies, the CRC does not; the full
    check says so, the check that leaves the CRC to the copy does not."""
    plen, addrs = slots
    mk = fmt.mac_key("s3cret")
    for i, a in enumerate(addrs):
        crc = _native.crc32c(a + fmt.HEADER_BYTES, plen) ^ (i & 1)  # odd slots: a CRC off by one bit
        ctypes.memmove(a + 36, crc.to_bytes(4, "little"), 4)
    fmt.stamp_slots(addrs, [key(i) for i in range(8)], NS, RANK, plen, LAYOUT, True, mk)
    assert _verdicts(addrs, plen, mk) == ["", "payload checksum"] * 4
    assert _verdicts(addrs, plen, mk, skip=True) == [""] * 8
    assert _one_slot_reason(_slot(addrs[1], plen), plen, key(1), mk) == "payload checksum"


def test_mac_calls_release_the_gil():
    """While verify_slots MACs 1 GiB on one thread, another thread keeps running
    Python: the longest pause it sees during the call is a small part of the call
    (holding the GIL, the call would be one pause as long as itself; measured so
    with a build that holds it: 0.97 of the call, against a small part here on a
    quiet machine; the bound leaves room for a busy one's scheduling)."""
    plen, n = 8 << 20, 128
    pool = BufferPool(fmt.slot_bytes(plen), 4)
    try:
        addrs = [pool.addr(s) for s in pool.acquire(4)] * (n // 4)  # the same 4 slots, checked 32 times each
        mk = fmt.mac_key("s3cret")
        fmt.stamp_slots(addrs[:4], [key(i) for i in range(4)], NS, RANK, plen, LAYOUT, False, mk)
        addrs = addrs[:4] * (n // 4)
        ks = [key(i) for i in range(4)] * (n // 4)
        span, got = [0.0, 0.0], []

        def call():
            span[0] = time.monotonic()
            got.append(list(fmt.verify_slots(addrs, ks, NS, RANK, plen, LAYOUT, False, mk)))
            span[1] = time.monotonic()

        t = threading.Thread(target=call)
        stamps = []
        t.start()
        while t.is_alive():
            stamps.append(time.monotonic())
        t.join()
        assert got == [[0] * n]
        inside = [x for x in stamps if span[0] <= x <= span[1]]
        took = span[1] - span[0]
        edges = [span[0]] + inside + [span[1]]
        gap = max(b - a for a, b in zip(edges, edges[1:]))
        assert took > 0.05 and gap < took / 2 and len(inside) > 100, (took, gap, len(inside))
    finally:
        pool.close()
