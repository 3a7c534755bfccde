# SPDX-License-Identifier: Apache-2.0
"""The save pipeline of one worker: device -> staging copy at the end of the step
(vLLM's thread), then the write to the data file and the report (loop thread).

A save takes as many staging buffers as there are (a big prefill is saved in part,
the rest reported failed and counted, never waited for), copies its blocks in
before `submit` returns (vLLM may reuse them once the step ends), and hands the
job to the loop. Written blocks stay in host memory (the memory tier); a save
that takes over `save_timeout` ends at once, its staging buffers set aside while the
kernel still reads them (worker/staging.py).

Threading contract: `submit` on vLLM's worker thread; `start`, `write_through`
and the pipeline on the loop thread; `_save_done` on either (its report goes
through worker/results.py).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import functools
import logging
import time

from aiokv.data.format import NO_TENANT
from aiokv.jobs import SaveResult, Transfer, WorkerReport
from aiokv.util.loops import waited
from aiokv.worker.latency import latency_counts
from aiokv.worker.reads import NOT_IO_ERRORS

log = logging.getLogger("aiokv")


class Saves:
    def __init__(
        self, device, staging, results, life, rank: int, slot_bytes: int, save_timeout: float, crc_in_copy: bool
    ):
        self.device = device
        self.staging = staging
        self.results = results
        self.life = life  # the loop, the data file, the bucket tier's uploader (worker/lifecycle.py)
        self.rank = rank
        self.slot_bytes = slot_bytes  # this group's slot image (a staging buffer may be larger)
        self.ns = None  # the memory tier's name for this group's keys (set by TransferWorker)
        self.save_timeout = save_timeout
        self.crc_in_copy = crc_in_copy  # payload CRCs come with the device copy

    # ---- vLLM's thread ----
    def submit(self, transfers: list[Transfer], dead: bool) -> None:
        """Copy this step's blocks to staging now; write them to disk in the background."""
        for t in transfers:
            if dead:
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
                continue
            # as many as the pool has: a big prefill is saved in part, not dropped
            bufs = self.staging.acquire(len(t.keys), whole=False)
            take = len(bufs) if bufs else 0
            if take < len(t.keys):
                rest = Transfer(
                    t.req_id, t.keys[take:], t.locations[take:], t.block_ids[take:], t.group, job=t.job, tenant=t.tenant
                )
                self.results.count(save_skipped_staging_full=len(rest.keys))
                self._save_done(rest, None, [-errno.ENOBUFS] * len(rest.keys))
                if not take:
                    continue
                t = Transfer(
                    t.req_id, t.keys[:take], t.locations[:take], t.block_ids[:take], t.group, job=t.job, tenant=t.tenant
                )
            try:
                self.device.copy_out(t.block_ids, bufs, crc_in_copy=self.crc_in_copy)
            except Exception:
                log.exception("aiokv: copying blocks out for a save failed; that save is dropped")
                self.staging.release(bufs)
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
                continue
            job = self.results.next_job()
            self.results.saves[job] = t  # handed in: reported failed if the loop dies before it ends
            if not self.life.call_soon(self.start, job, t, bufs):  # the loop is gone: this save fails, vLLM goes on
                log.error("aiokv: the worker loop did not take a save")
                self.results.saves.pop(job, None)
                self.staging.release(bufs)
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
        self.device.after_step()

    # ---- loop thread ----
    def start(self, job: int, t: Transfer, bufs: list[int]) -> None:
        asyncio.ensure_future(self._save(job, t, bufs, crc_in_copy=self.crc_in_copy))

    def write_through(self, t: Transfer, bufs: list[int]) -> None:
        """A save job of blocks just loaded from the bucket tier; it owns `bufs`."""
        job = self.results.next_job()
        self.results.started(job, t)
        asyncio.ensure_future(self._save(job, t, bufs, upload=False))

    async def _save(
        self, job: int, t: Transfer, bufs: list[int], upload: bool = True, crc_in_copy: bool = False
    ) -> None:
        """Write a save job's staging buffers (crc_in_copy: their payload CRCs came with the device copy)."""
        t0 = time.monotonic()
        res = [-errno.EIO] * len(t.keys)
        waiting: set[int] = set()  # several drives: those its writes still waited on (data/drives.py)
        uploader = self.life.uploader
        try:
            if self.device.asynchronous:  # the device copy may still be landing
                await waited(functools.partial(self.device.wait_out, bufs if crc_in_copy else None))
            addr = self.staging.addr
            items = [(s, k, addr(b)) for s, k, b in zip(t.locations, t.keys, bufs)]
            # the tenant is stamped into each slot's header (data/blockio.py); a timed-out save
            # never waits for the disk: its buffers are set aside while the kernel still holds them
            write = self.life.blockio().write(
                items, crc_in_copy, tenant=t.tenant or NO_TENANT, abandon=self.staging.abandon, waiting=waiting
            )
            res = await asyncio.wait_for(write, self.save_timeout)
            if upload and uploader is not None:  # write-behind: a copy of each block written, queued (or dropped)
                for k, b, r in zip(t.keys, bufs, res):
                    if r == 0:
                        uploader.offer(self.life.bucket_loader.name(k), ctypes.string_at(addr(b), self.slot_bytes))
        except asyncio.TimeoutError:
            # dropped from the step's accounting; a write that lands later in a slot the
            # store has given to another key fails that key's verification (a miss)
            res = [-errno.ETIMEDOUT] * len(t.keys)
            self.results.count(save_timeouts=1)
            if waiting:  # the drives it waited on failed it, not the others
                self.results.report(WorkerReport(drives={d: [1, 0] for d in waiting}))
            log.warning("aiokv: a save took over %.0f s; it is dropped", self.save_timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokv: a save failed; only that request's save is dropped")
        finally:
            # written blocks stay in host memory (the memory tier); the rest are freed
            self.staging.keep([(k, b) for k, b, r in zip(t.keys, bufs, res) if r == 0], self.ns)
            self.staging.release([b for b, r in zip(bufs, res) if r != 0])
            self.results.count(**latency_counts("save", time.monotonic() - t0))
            self._save_done(t, bufs, res, job)

    def _save_done(self, t: Transfer, bufs, res: list[int], job: int | None = None) -> None:
        ok = [k for k, r in zip(t.keys, res) if r == 0]
        bad = [k for k, r in zip(t.keys, res) if r != 0]
        counts = dict(
            saves_ok_blocks=len(ok),
            save_failed_blocks=len(bad),
            bytes_written=len(ok) * self.slot_bytes,
            write_errors=sum(r not in NOT_IO_ERRORS for r in res),
        )
        self.results.save_done(job, WorkerReport(saves=[SaveResult(t.job, self.rank, ok, bad)], counters=counts))
