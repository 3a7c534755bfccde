# SPDX-License-Identifier: Apache-2.0
"""What one worker process has once, for all its KV-cache groups: the event loop
(one thread, util/loops.py), the staging buffers (worker/staging.py: one arena,
its buffers the size of the largest group's slot, pinned once) and the checksum
threads. Each group's TransferWorker (its device, namespace, data file, backend,
pipelines) is a plain object driven by this one loop.

A TransferWorker built without a host makes one of its own and closes it with
itself (tests, one group); the connector makes one for all groups and closes it
after them (worker/groups.py).

Threading contract: the constructor, `attach`, `held_delta` and `close` on vLLM's
worker thread; the loop runs on its own thread what the groups hand it; the
staging owner is called from any thread (its own lock).
"""

from __future__ import annotations

import concurrent.futures
import logging

from aiokv.data.buffers import available_memory
from aiokv.util.loops import LoopThread
from aiokv.worker.staging import Staging

log = logging.getLogger("aiokv")


def checksum_threads_for(device, secret, asked: int | None) -> int:
    """Checksum threads a worker runs: `asked` (the checksum_threads setting), or the device's
    default (2 on CUDA; 0 on the CPU build, whose copy makes the CRC and whose cores run the
    model), and at least 1 with a secret: the MAC reads every payload, and on the loop thread
    it holds back the completions that keep the disk busy (docs/benchmarks.md, "What a secret
    costs")."""
    if asked is not None:
        return asked
    return max(device.checksum_threads, 1 if secret else 0)


class WorkerHost:
    def __init__(self, slot_bytes: int, staging_bytes: int, memory_bytes: int, checksum_threads: int, rank: int):
        kept = memory_bytes // slot_bytes  # the memory tier shares the staging arena
        count = max(4, staging_bytes // slot_bytes) + kept
        avail = available_memory()
        if avail and count * slot_bytes > avail:  # populated below: past what is free the OOM killer would come
            raise MemoryError(
                f"staging + memory take {count * slot_bytes >> 20} MiB of host memory in each worker; "
                f"{avail >> 20} MiB is available: lower memory (or staging)"
            )
        self.staging = Staging(slot_bytes, count, kept)
        self.rank = rank
        self.devices: list = []  # attached to the arena: closed (unpinned) last
        self.lives: list = []  # each group's Lifecycle (its backend)
        self.reporter = None  # the group whose report carries memory_held_bytes
        self._held_reported = 0
        self.checksum_threads = checksum_threads
        self.cpu = (
            concurrent.futures.ThreadPoolExecutor(checksum_threads, f"aiokv-crc{rank}")
            if checksum_threads > 0
            else None
        )
        self.lt = None
        try:
            self.lt = LoopThread(f"aiokv-worker{rank}")
            self.lt.call_soon(self.staging.bind, self.lt.loop)
        except BaseException:
            self.staging.close()
            raise

    def attach(self, device) -> None:
        """A group's device copies to and from this arena (CUDA: it is pinned once)."""
        self.devices.append(device)
        device.attach(self.staging.pool)

    def held_delta(self) -> int:
        """The change of the memory tier's level (bytes) since the last call."""
        held = self.staging.kept * self.staging.slot_bytes
        delta, self._held_reported = held - self._held_reported, held
        return delta

    def close(self) -> None:
        """Stop the loop (after every group closed its part); free the arena unless
        I/O stuck in the kernel may still touch it (then the process exit does)."""
        stuck = not self.lt.stop() or self.staging.stuck or any(life.in_flight for life in self.lives)
        if self.cpu is not None:  # idle once the loop has stopped: nothing awaits them any more
            self.cpu.shutdown(wait=not stuck)
        if stuck:
            # the kernel may still write into staging: never unmap or unpin it under the I/O
            log.warning("aiokv: I/O stuck in the kernel at close; its memory is left to the process exit")
            return
        for device in self.devices:
            device.close()
        self.staging.close()
