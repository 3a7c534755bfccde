# SPDX-License-Identifier: Apache-2.0
"""On the CUDA path the payload CRC32C is made and checked on the device, by torch's ops.

The cost: a CUDA worker's blocks reach the host and the drive by DMA; the only pass of the
host's cores over them was BlockIO's CRC32C (0.06-0.12 core-s per GB here, more than
LMCache's raw_block spends on the whole data path; docs/benchmarks.md), on checksum
threads that a node's several drives keep busy.

The risk of moving it: a device CRC that differs from the format's (every block written
would fail to load: no wrong tokens, but no hits), a check that passes a corrupt payload, a
header CRC written for other bytes, or a device whose ops misbehave taken at its word.

Invariants: devcrc.RowCrc equals aiokv._native.crc32c on every row for lengths around each
round's boundary, pieces or not; CudaDevice (on CPU tensors, torch.cuda's streams and events
stood in for: tests/fakecuda.py) saves slots whose header holds their payload's CRC32C and
that format.check_slot accepts; its loads flag exactly the blocks whose payload changed on
disk, copy the rest bit-exact and keep no corrupt one in memory; a device whose CRC
disagrees with the host's at attach is not used (the host's pass checks, as before).

The fix: worker/devcrc.py, and CudaDevice.crc_in_copy (worker/cuda.py: device_crc at attach,
copy_out, wait_out and copy_in).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.jobs import Transfer
from aiokv.store.store import ns_dir
from aiokv.worker import devcrc
from aiokv.worker.cuda import CudaDevice, device_crc
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS, key
from tests.workers import data_file, flip_payload_bytes, run_jobs

NB = 40


def _crc_rows(x: torch.Tensor) -> list[int]:
    return [_native.crc32c_bytes(x[i].numpy().tobytes()) for i in range(x.shape[0])]


@pytest.mark.parametrize("row", [4, 8, 60, 64, 68, 1020, 1024, 1028, 16384, 16388, 65536 + 4, 3 * 65536])
@pytest.mark.parametrize("piece", [8 << 20, 64])
def test_row_crc_equals_the_native_crc32c(row, piece):
    g = torch.Generator().manual_seed(row)
    x = torch.randint(0, 256, (3, row), dtype=torch.uint8, generator=g)
    x[1] = 0  # a zero row: the zero-length CRC constant alone
    x[2, -4:] = 255
    got = devcrc.RowCrc(row, piece_bytes=piece).rows(x)
    assert got.dtype == torch.int32 and [int(v) & 0xFFFFFFFF for v in got] == _crc_rows(x)
    le = got.view(torch.uint8).view(3, 4)  # the header's 4 bytes, as the device copies them
    assert [int.from_bytes(bytes(le[i].tolist()), "little") for i in range(3)] == _crc_rows(x)


def test_row_crc_sees_every_bit_of_a_row():
    row = 4096
    crc = devcrc.RowCrc(row)
    x = torch.randint(0, 256, (1, row), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    base = int(crc.rows(x)[0])
    flips = x.repeat(64, 1)
    for i in range(64):  # one bit flipped in each of 64 spread positions
        pos = i * (row // 64) + i % 7
        flips[i, pos] ^= 1 << (i % 8)
    assert all(int(v) != base for v in crc.rows(flips))


def test_row_crc_refuses_rows_it_was_not_made_for():
    with pytest.raises(ValueError, match="multiple of 4"):
        devcrc.RowCrc(6)
    with pytest.raises(ValueError, match="uint8 rows"):
        devcrc.RowCrc(8).rows(torch.zeros(2, 12, dtype=torch.uint8))


def _kv():
    g = torch.Generator().manual_seed(3)
    return {f"l{i}": torch.randn(NB, 2, 32, 9, generator=g) for i in range(3)}  # 2304 bytes a layer


def _worker(root: str, kv: dict, kept: int = 0) -> TransferWorker:
    os.makedirs(ns_dir(root, NS), exist_ok=True)
    dev = CudaDevice(kv, NB)
    slot = fmt.slot_bytes(dev.payload_bytes)
    return TransferWorker(dev, ns_dir(root, NS), NS, 0, staging_bytes=16 * slot, memory_bytes=kept * slot)


def test_cuda_saves_carry_the_payload_crc_made_on_the_device_and_loads_flag_exactly_the_flips(
    fake_cuda, tmp_path, monkeypatch
):
    made = []
    real = devcrc.RowCrc.rows
    monkeypatch.setattr(devcrc.RowCrc, "rows", lambda self, x: made.append(x.shape[0]) or real(self, x))
    root, ids, kv = str(tmp_path), range(10), _kv()
    w = _worker(root, kv)
    try:
        assert w._crc_in_copy and w.device.crc_in_copy, "the device makes the payload CRC"
        made.clear()  # (attach checked the device's CRC on two rows)
        _, _, rep = run_jobs(w, w.save, [Transfer("s", [key(i) for i in ids], list(ids), [i + 1 for i in ids])])
        assert len(rep.written()) == 10 and not rep.not_written()
        assert sum(made) == 10, "every saved payload's CRC came from the device"
        saved = {i: [t[i + 1].clone() for t in kv.values()] for i in ids}
    finally:
        w.close()
    (path, disk), sb = data_file(root), w.slot_bytes
    plen = w.device.payload_bytes
    for i in ids:  # a valid slot of docs/format.md: its header's CRC is its payload's
        slot = disk[i * sb : (i + 1) * sb]
        fmt.check_slot(slot, NS, 0, plen, key(i), w.device.layout_tag, None)
        crc = int.from_bytes(slot[fmt.PAYLOAD_CRC_OFFSET : fmt.PAYLOAD_CRC_OFFSET + 4], "little")
        assert crc == _native.crc32c_bytes(slot[fmt.HEADER_BYTES : fmt.HEADER_BYTES + plen])
    bad = {3: 0, 7: plen - 1}  # slot -> payload byte flipped
    flip_payload_bytes(path, sb, bad, 0x10)
    kv = _kv()
    w = _worker(root, kv, kept=16)
    try:
        made.clear()
        first = 20
        done, errors, rep = run_jobs(
            w, w.load, [Transfer("r", [key(i) for i in ids], list(ids), [first + i for i in ids])]
        )
        assert sum(made) == 10, "every loaded payload was checked on the device"
        assert done == {"r"} and errors == {first + s for s in bad}
        assert sorted(k for r in rep.loads for k in r.bad) == sorted(key(s) for s in bad)
        assert rep.counters["loads_ok_blocks"] == 8 and rep.counters["load_failed_blocks"] == 2
        for i in ids:
            if i not in bad:
                assert all(torch.equal(t[first + i], want) for t, want in zip(kv.values(), saved[i]))
        assert all(s is None for s in w.staging.take_kept([key(s) for s in bad], w.memory_ns)), "no corrupt block kept"
        assert w.staging_in_use == 0, "every staging buffer went back"
    finally:
        w.close()


def test_a_device_whose_crc_disagrees_at_start_is_not_used(fake_cuda, tmp_path, monkeypatch):
    real = devcrc.RowCrc.rows
    monkeypatch.setattr(devcrc.RowCrc, "rows", lambda self, x: real(self, x) ^ 1)
    assert device_crc(2304 * 3, "cpu") is None
    root, ids, kv = str(tmp_path), range(6), _kv()
    w = _worker(root, kv)
    try:
        assert not w._crc_in_copy, "a device CRC that disagrees with the host's is not relied on"
        _, _, rep = run_jobs(w, w.save, [Transfer("s", [key(i) for i in ids], list(ids), [i + 1 for i in ids])])
        assert len(rep.written()) == 6
        done, errors, rep = run_jobs(
            w, w.load, [Transfer("r", [key(i) for i in ids], list(ids), [21 + i for i in ids])]
        )
        assert done == {"r"} and not errors, "the host's pass checks the payloads instead"
        assert all(torch.equal(t[21 + i], t[i + 1]) for t in kv.values() for i in ids)
    finally:
        w.close()


def test_payloads_not_a_multiple_of_four_bytes_are_checked_on_the_host():
    assert device_crc(4098, "cpu") is None and device_crc(4096, "cpu") is not None


class _Kernels(TorchDispatchMode):
    """Counts the ops that would launch a kernel on a GPU (not views, slices, detaches)."""

    FREE = ("view", "slice", "detach", "_unsafe_view", "alias", "reshape", "expand", "select")

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in self.FREE:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("row", [256 << 10, 1 << 20, 2 << 20, 4 << 20])
def test_a_gathers_crc_is_a_bounded_number_of_kernels(row):
    """On CUDA each op is a launch on vLLM's thread (copy_out): the CRC of a save's 32 MiB
    gather must stay a few dozen launches, whatever the block size, not one per block or row."""
    x = torch.zeros((32 << 20) // row, row, dtype=torch.uint8)
    crc = devcrc.RowCrc(row)
    with _Kernels() as k:
        crc.rows(x)
    assert 0 < k.n <= 80, f"{k.n} kernels for one gather"
