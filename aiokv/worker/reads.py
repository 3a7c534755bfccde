# SPDX-License-Identifier: Apache-2.0
"""What a load pipeline needs from its worker, and nothing more: reads of store
slots into staging buffers, and copies from staging into the KV cache.

Whole-request loads (worker/loads.py) and layer-by-layer loads (worker/layerwise.py)
both read through this object; the second copies in by itself, on vLLM's thread.

Threading contract: `read` and `copy_in` run on the worker's event-loop thread
(the data file is opened there at the first job; an asynchronous device's copies are waited
for on a thread of the loop's executor, and so is a synchronous device's copy of at least
COPY_THREAD_BYTES); `count` on any thread.
"""

from __future__ import annotations

from aiokv.data.backend import NOT_IO_ERRORS  # noqa: F401  (saves.py reads it here)
from aiokv.data.window import shape
from aiokv.util.loops import waited

# A CPU copy into the KV cache of at least this many bytes (a chunk of a load: data/window.py) runs
# on a thread of the loop's executor, so the loop thread reaps the reads that complete meanwhile and
# refills the ring; a smaller one runs on the loop thread, where the hop to a thread and back costs
# more than the copy holds the ring up. Loads with the copy (tools/bench_store.py --copy-in, CRC in
# the copy), read bandwidth x fio's, on the loop thread / on a thread: 1 MiB blocks at depth 32
# (8 MiB chunks) 0.71 / 0.84, 2 MiB at depth 16-32 (8-16 MiB) 0.67-0.71 / 0.81-0.82; chunks of
# 1-4 MiB 0.69-0.86 / 0.69-0.76 (docs/benchmarks.md, "Where the time goes").
COPY_THREAD_BYTES = 8 << 20


class Reads:
    def __init__(self, device, staging, blockio, count, slot_bytes: int):
        self.device = device
        self.staging = staging
        self.slot_bytes = slot_bytes  # this group's slot image (a staging buffer may be larger)
        self.ns = None  # the memory tier's name for this group's keys (set by TransferWorker)
        self._blockio = blockio  # () -> BlockIO (opened at the first job)
        self.count = count  # count(**increments) into the worker's counters

    async def read(
        self, items: list[tuple[int, bytes, int]], crc_in_copy: bool = False, waiting: set | None = None
    ) -> list[int]:
        """Read [(store location, key, staging buffer)]; per item 0 or -errno (read errors counted).
        A cancelled read never waits for the disk: its buffers are set aside while the kernel
        still holds them (staging.abandon, data/backend.py's abandon mode). waiting: the load's
        set of the drives a cancelled read still waited on (data/drives.py), or None."""
        addr = self.staging.addr
        res = await self._blockio().read(
            [(s, k, addr(b)) for s, k, b in items], crc_in_copy, abandon=self.staging.abandon, waiting=waiting
        )
        self.count(read_errors=sum(r not in NOT_IO_ERRORS for r in res))
        return res

    def window(self) -> tuple[int, int]:
        """(items per chunk, chunks at once) of a load's reads through a window (data/window.py)."""
        return shape(self._blockio())

    async def copy_in(self, block_ids, bufs, crc_in_copy: bool = False) -> list[bool]:
        """Per block whether it may count as loaded: always, unless `crc_in_copy` (the
        payload CRCs are checked in the copy, Device.copy_in) found it corrupt."""
        if self.device.asynchronous:  # DMA: queued here, waited for off the loop (CudaDevice.copy_in_queued)
            ev, result = self.device.copy_in_queued(block_ids, bufs, crc_in_copy)
            await waited(ev.synchronize)
            ok = result()
            return ok if crc_in_copy else [True] * len(block_ids)
        # The CPU's copy, in one go: a cancellation cannot interrupt it half-way (on a thread,
        # `waited` raises it only once the copy is done). Small ones on the loop thread: no hop to
        # another thread waits for the GIL a second time. Big ones (COPY_THREAD_BYTES) on a thread,
        # so the ring is refilled meanwhile.
        if len(block_ids) * self.slot_bytes >= COPY_THREAD_BYTES:
            return await waited(self._copy_in_now, block_ids, bufs, crc_in_copy)
        return self._copy_in_now(block_ids, bufs, crc_in_copy)

    def _copy_in_now(self, block_ids, bufs, crc_in_copy: bool) -> list[bool]:
        """A synchronous device's copy_in (its answer per block, as copy_in's)."""
        if crc_in_copy:
            return self.device.copy_in(block_ids, bufs, crc_in_copy=True)
        self.device.copy_in(block_ids, bufs)
        return [True] * len(block_ids)
