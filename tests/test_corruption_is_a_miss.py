# SPDX-License-Identifier: Apache-2.0
"""Bug: a bit flip, a truncated or deleted data file, or a torn journal tail
gets served as a block (wrong KV) or crashes the opener.
Invariant: damaged data is a miss: never bytes other than those stored under
the key; the damaged key is dropped and counted, everything else still loads.
Fix: every slot carries a verified header (magic, version, namespace, rank, key,
length, CRC32C) and the journal's records carry CRCs; replay stops at a torn one.
"""

from __future__ import annotations

import errno
import os

from aiokv.data import format as fmt
from tests.conftest import NS, PAYLOAD, key
from tools.storeio import StoreIO

N = 16


async def _fill(root, blocks):
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    for i in range(N):
        blocks.fill(i, key(i))
    assert await st.save(ns, [(key(i), blocks.addr(i)) for i in range(N)]) == [0] * N
    slots = {k: ns.where(k) for k in ns.keys()}
    st.close()
    return slots, os.path.join(root, "ns", NS.hex())


async def _load_all(root, blocks):
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    for i in range(N):
        blocks.clear(i)
    res = await st.load(ns, [(key(i), blocks.addr(i)) for i in range(N)])
    for i, r in enumerate(res):
        if r == 0:
            assert blocks.holds(i, key(i)), "a load that succeeded returned wrong bytes"
    return st, ns, res


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


async def test_bit_flip_in_payload_and_header(tmp_path, blocks, backend_kind):
    root = str(tmp_path / "s")
    slots, d = await _fill(root, blocks)
    sb = fmt.slot_bytes(PAYLOAD)
    data = os.path.join(d, "rank0.data")
    _flip(data, slots[key(3)] * sb + fmt.HEADER_BYTES + 12345)  # payload
    _flip(data, slots[key(7)] * sb + 40)  # header
    st, ns, res = await _load_all(root, blocks)
    assert res[3] == -errno.EBADMSG and res[7] == -errno.EBADMSG
    assert [r for i, r in enumerate(res) if i not in (3, 7)] == [0] * (N - 2)
    assert st.stats.corrupt_dropped == 2
    assert st.lookup(ns, [key(3)]) == 0 and st.lookup(ns, [key(7)]) == 0
    st.close()
    st = StoreIO(root)  # the drop is durable
    ns = st.namespace(NS, PAYLOAD)
    assert not ns.has(key(3)) and ns.has(key(0))
    st.close()


async def test_block_moved_to_another_slot_is_a_miss(tmp_path, blocks):
    """A slot holding a valid block of a different key must not be served."""
    root = str(tmp_path / "s")
    slots, d = await _fill(root, blocks)
    sb = fmt.slot_bytes(PAYLOAD)
    with open(os.path.join(d, "rank0.data"), "r+b") as f:
        f.seek(slots[key(1)] * sb)
        other = f.read(sb)
        f.seek(slots[key(2)] * sb)
        f.write(other)
    st, ns, res = await _load_all(root, blocks)
    assert res[2] == -errno.EBADMSG and res[1] == 0
    st.close()


async def test_truncated_data_file(tmp_path, blocks, backend_kind):
    root = str(tmp_path / "s")
    slots, d = await _fill(root, blocks)
    sb = fmt.slot_bytes(PAYLOAD)
    keep = sorted(slots.values())[N // 2]
    os.truncate(os.path.join(d, "rank0.data"), keep * sb + 100)
    st, ns, res = await _load_all(root, blocks)
    ok = sum(r == 0 for r in res)
    assert ok == sum(1 for s in slots.values() if s < keep)
    assert st.stats.corrupt_dropped == N - ok
    st.close()


async def test_deleted_data_file(tmp_path, blocks, backend_kind):
    root = str(tmp_path / "s")
    slots, d = await _fill(root, blocks)
    os.unlink(os.path.join(d, "rank0.data"))
    st, ns, res = await _load_all(root, blocks)
    assert all(r != 0 for r in res)
    assert st.lookup(ns, [key(i) for i in range(N)]) == 0
    # the store keeps working: save again and load
    blocks.fill(0, key(0))
    assert await st.save(ns, [(key(0), blocks.addr(0))]) == [0]
    st.close()


async def test_torn_journal_tail(tmp_path, blocks):
    root = str(tmp_path / "s")
    st = StoreIO(root)
    ns = st.namespace(NS, PAYLOAD)
    for i in range(N):
        blocks.fill(i, key(i))
    await st.save(ns, [(key(i), blocks.addr(i)) for i in range(N)])
    # no close(): no checkpoint, everything is in the journal
    log = st.logs[NS]
    jpath = os.path.join(log.dir, f"journal.{log.gen}")
    st.lock.release()
    size = os.path.getsize(jpath)
    assert size == fmt.FILE_HDR_BYTES + N * fmt.REC_BYTES
    with open(jpath, "r+b") as f:  # tear the last record in half, flip a bit in the one before
        f.truncate(size - fmt.REC_BYTES // 2)
    st2 = StoreIO(root)
    ns2 = st2.namespace(NS, PAYLOAD)
    assert ns2.count() == N - 1
    assert st2.logs[NS].torn_bytes == fmt.REC_BYTES // 2
    assert os.path.getsize(jpath) == fmt.FILE_HDR_BYTES + (N - 1) * fmt.REC_BYTES  # tail cut
    st2.close()


async def test_corrupt_checkpoint_rebuilds_from_blocks(tmp_path, blocks):
    root = str(tmp_path / "s")
    slots, d = await _fill(root, blocks)
    _flip(os.path.join(d, "checkpoint"), fmt.FILE_HDR_BYTES + 5)
    try:
        StoreIO(root, readonly=True)
        raise AssertionError("a read-only opener must report a corrupt checkpoint")
    except fmt.BadBlock as e:
        assert "checkpoint" in str(e)
    st, ns, res = await _load_all(root, blocks)  # the owner rebuilds from slot headers
    assert res == [0] * N
    assert {k: ns.where(k) for k in ns.keys()} == slots
    st.close()
