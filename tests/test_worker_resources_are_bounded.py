# SPDX-License-Identifier: Apache-2.0
"""Bugs: a TransferWorker that failed to start (e.g. its I/O backend could not be
opened) left its event-loop thread running, its staging arena mapped and (CUDA)
the arena pinned. The CUDA save path allocated a device buffer as large as each
save, outside vLLM's memory budget, and kept a list of those buffers that only
shrank when the last copy happened to be done already.

Invariants: a worker that fails to start leaves no thread, mapping or
registration behind; a CUDA save gathers through one fixed buffer of at most
GATHER_BYTES, whatever its size, and keeps only its last event; its bytes are
the same as a CPU copy's.

Fix: TransferWorker.__init__ undoes what it did when it fails;
CudaDevice gathers chunk by chunk through a buffer allocated once at attach.
The CUDA path runs here on CPU tensors, with torch.cuda's streams and events
replaced by stand-ins (there is no GPU on the test machine; tools/gpu_check.py
runs the real thing).
"""

from __future__ import annotations

import threading

import pytest
import torch

from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.worker import cuda as cudamod
from aiokv.worker.cuda import CudaDevice, gather_rows
from aiokv.worker.device import CpuDevice
from aiokv.worker.transfer import TransferWorker
from tests.conftest import NS
from tests.fakecuda import FakeEvent

NB = 40


class Recording(CpuDevice):
    closed = 0

    def attach(self, pool):
        self.pool = pool
        super().attach(pool)

    def close(self):
        Recording.closed += 1


def _kv():
    return {f"l{i}": torch.randn(NB, 2, 32, 8) for i in range(2)}


def test_worker_that_fails_to_start_leaves_nothing(tmp_path):
    before = {t.name for t in threading.enumerate()}
    dev = Recording(_kv(), NB)
    with pytest.raises(ValueError, match="AIOKV_IO"):
        TransferWorker(dev, str(tmp_path / "ns"), NS, 0, 1 << 20, io="bogus")
    assert {t.name for t in threading.enumerate()} - before == set(), "the loop thread is still running"
    assert dev.pool.arena._map.closed, "the staging arena is still mapped"
    assert Recording.closed == 1, "the device (pinning) was not given back"


def test_cuda_save_gathers_through_one_bounded_buffer(fake_cuda, monkeypatch):
    kv = _kv()
    payload = sum(t[0].numel() * t.element_size() for t in kv.values())
    monkeypatch.setattr(cudamod, "GATHER_BYTES", 3 * payload)  # 3 blocks: a 30-block save takes 10 rounds
    assert gather_rows(payload, 3 * payload) == 3 and gather_rows(payload, 1) == 1
    dev = CudaDevice(kv, NB)
    pool = BufferPool(fmt.slot_bytes(payload), 32)
    dev.attach(pool)
    assert tuple(dev._gather.shape) == (3, payload), "one fixed gather buffer of GATHER_BYTES"
    assert fake_cuda.registered == [pool.arena.addr, dev._crc_host.data_ptr()], "the arena and the CRC array pinned"
    ref = CpuDevice(kv, NB)
    ref_pool = BufferPool(fmt.slot_bytes(payload), 32)
    ref.attach(ref_pool)
    blocks = list(range(5, 35))
    slots = pool.acquire(30)
    allocs = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocs.append(a) or real_empty(*a, **k))
    FakeEvent.made = 0
    for _ in range(3):  # three steps' saves
        dev.copy_out(blocks, slots)
        dev.after_step()
    assert allocs == [], "a save allocated device memory beyond the fixed buffer"
    assert FakeEvent.made == 3 and not hasattr(dev, "_keep"), "one event per save, only the last kept"
    ref_slots = ref_pool.acquire(30)
    ref.copy_out(blocks, ref_slots)
    h = fmt.HEADER_BYTES
    got = pool.arena.tensor().view(32, -1)[slots, h : h + payload]
    want = ref_pool.arena.tensor().view(32, -1)[ref_slots, h : h + payload]
    assert torch.equal(got, want), "chunked gathers must copy exactly what the CPU path copies"
    dev.close()
    dev.close()  # twice (close after a failed start, then again): unpinned once
    assert fake_cuda.registered == []
    pool.close()
    ref_pool.close()
