# SPDX-License-Identifier: Apache-2.0
"""What one KV-cache group's worker has on the process's loop (worker/host.py),
from start to close: its I/O backends (one per drive, each with its own queue
depth), its data file (opened at the first job: the engine that owns the store
creates the directory after the workers have started) and the bucket tier's
uploader and loader.

Start is bounded (opening the backend looks at the cache directory's file
system: START_TIMEOUT); so is close, whatever the disk does: outstanding loads
are cancelled (abandon mode ends them at once), saves get CLOSE_DRAIN_S to land,
pending uploads `flush_timeout`; a backend with I/O stuck in the kernel is left
open (the host then leaves the staging memory under it to the process exit).

Threading contract: the constructor, `call_soon`, `alive` and `close` on vLLM's
worker thread; `blockio` and `_setup`/`_shutdown` on the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging

from aiokv.data.blockio import BlockIO
from aiokv.data.choice import open_backend
from aiokv.data.drives import DriveIO

log = logging.getLogger("aiokv")

START_TIMEOUT = 60.0  # seconds the worker waits at start for its backend (it looks at the file system)
CLOSE_DRAIN_S = 10.0  # close() waits this long for outstanding jobs, then leaves them


class Lifecycle:
    def __init__(
        self,
        host,
        device,
        count,
        ns_dir: str,
        nsid: bytes,
        rank: int,
        slot_bytes: int,
        io: str,
        queue_depth: int,
        secret,
        bucket,
        upload_queue: int,
        flush_timeout: float,
    ):
        self.device, self.staging, self.rank, self.secret = device, host.staging, rank, secret
        # several drives: one namespace directory per drive, in the configured order (data/drives.py)
        self.ns_dirs = [ns_dir] if isinstance(ns_dir, str) else list(ns_dir)
        self.ns_dir, self.nsid, self.slot_bytes = self.ns_dirs[0], nsid, slot_bytes
        self.drive_report = None  # several drives: called with each call's per-drive verdicts (DriveIO)
        self.bucket, self.upload_queue, self.flush_timeout = bucket, upload_queue, flush_timeout
        self.uploader = self.bucket_loader = None
        self.backends: list = []  # one per drive, in the configured order (_setup)
        self.io: BlockIO | None = None
        self.cpu = host.cpu
        self.lt = host.lt
        self.loop, self.thread = self.lt.loop, self.lt.thread
        host.lives.append(self)
        try:  # opening the backend looks at the cache directory's file system: bounded
            self.lt.submit(self._setup(io, queue_depth, count)).result(START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"the cache directory {', '.join(self.ns_dirs)} did not answer within {START_TIMEOUT:.0f} s "
                "(a hung file system?)"
            ) from None

    async def _setup(self, io, depth, count):
        # a backend per drive, each with its own queue depth: a drive that hangs or lags holds only
        # its own operations in the kernel, never the others' (one shared queue filled with a hung
        # drive's reads starved every drive); the thread pool only for a drive whose submissions
        # can block (FUSE, a network file system)
        self.backends = [open_backend(self.loop, io, depth=depth, path=nd) for nd in self.ns_dirs]
        if self.bucket is not None:
            from aiokv.bucket.loader import BucketLoader
            from aiokv.bucket.uploader import Uploader

            # an object already under a block's name that does not verify is replaced by ours, but
            # not with a secret: there a fleet engine's block under another secret (a misconfigured
            # engine's view) and a planted one look alike, and ours must never overwrite the fleet's
            verify = None if self.secret else (lambda key, addr: self.blockio().verify(key, addr))
            self.uploader = Uploader(self.bucket, self.upload_queue, count=count, verify=verify)
            self.bucket_loader = BucketLoader(self.bucket, self.nsid, self.rank, self.slot_bytes)

    def blockio(self) -> BlockIO | DriveIO:
        if self.io is None:
            ios = {
                d: BlockIO(
                    self.backends[d],
                    nd,
                    self.nsid,
                    self.rank,
                    self.device.payload_bytes,
                    self.device.layout_tag,
                    self.secret,
                    cpu=self.cpu,
                )
                for d, nd in enumerate(self.ns_dirs)
            }
            self.io = ios[0] if len(ios) == 1 else DriveIO(ios, self.drive_report)
        return self.io

    @property
    def backend(self):
        """The first drive's backend (the only one with one path); None before _setup."""
        return self.backends[0] if self.backends else None

    @property
    def in_flight(self) -> int:
        """Operations the kernel (or a pool thread) holds, on every drive's backend."""
        return sum(b.in_flight for b in self.backends)

    @property
    def alive(self) -> bool:
        return self.lt.alive

    def call_soon(self, fn, *args) -> bool:
        """A command for the loop thread; False when the loop is gone."""
        return self.lt.call_soon(fn, *args)

    def close(self, cancel_loads, drain) -> None:
        """Cancel the loads (on the loop), `drain()` the saves, flush uploads, close the
        backend unless I/O is stuck in it; the host stops the loop afterwards."""
        if self.lt.alive:
            # loads first (nobody waits for them any more; abandon mode ends them at
            # once), then saves get a bounded while to land, so they can be committed
            self.call_soon(cancel_loads)
            drain()
            try:
                # pending uploads (bucket tier) get flush_timeout more
                self.lt.submit(self._shutdown()).result(5 + (self.flush_timeout if self.uploader is not None else 0))
            except Exception:
                log.warning("aiokv: the worker loop did not shut down in time; left to the process exit")

    async def _shutdown(self) -> None:
        if self.uploader is not None:  # a clean shutdown: pending uploads go out, within flush_timeout
            await self.uploader.flush(self.flush_timeout)
        await asyncio.sleep(0)  # the cancelled loads' tasks end first (abandon: at once)
        if self.in_flight or self.staging.stuck:
            return  # closing it would wait for the kernel; the process exit reclaims it
        for backend in self.backends:
            backend.close()
        if self.io is not None:
            self.io.close()
