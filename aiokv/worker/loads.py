# SPDX-License-Identifier: Apache-2.0
"""The load pipeline of one worker (loop thread): per request, blocks kept in
host memory are copied in from there, the others read from the data file (or
fetched from the bucket tier), verified and copied into the KV cache; then the
request is reported finished, with the block ids that failed.

  io_uring read -> verify -> staging -> device copy -> report

A load that times out or is cancelled ends at once: its staging buffers are set
aside while the kernel still writes into them (worker/staging.py), and the load
is reported (cancelled loads too, every block as failed, even those already
copied: vLLM holds the blocks until the load is reported, and a load cancelled by
a cache reset is of a request that lives on, which must use nothing of it). With `layerwise` on, a verified load that fits is staged
for the next step's layer-by-layer copy (worker/layerwise.py) instead.

The loop owns the table of running loads (`_tasks`, request -> task): `start`
and `cancel` reach it as commands from vLLM's thread, in the order they were
handed in.

Threading contract: every method runs on the worker's event-loop thread, except
`_load_done`, which vLLM's thread also calls for loads that never reached a
living loop (its report goes through worker/results.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokv.data.window import read_through
from aiokv.jobs import LoadResult, SaveResult, Transfer, WorkerReport
from aiokv.worker.latency import latency_counts
from aiokv.worker.staging import StagingStuck

log = logging.getLogger("aiokv")


class Loads:
    def __init__(
        self,
        staging,
        reads,
        results,
        saves,
        life,
        layers,
        rank: int,
        slot_bytes: int,
        load_timeout: float,
        crc_in_copy: bool,
    ):
        self.staging = staging
        self.reads = reads  # reads into staging, copies into the KV cache (worker/reads.py)
        self.results = results
        self.saves = saves  # write-through of blocks from the bucket tier
        self.life = life  # the data file, the bucket tier (worker/lifecycle.py)
        self.layers = layers  # LayerwiseLoads or None
        self.rank = rank
        self.slot_bytes = slot_bytes  # this group's slot image (a staging buffer may be larger)
        self.load_timeout = load_timeout
        self.crc_in_copy = crc_in_copy  # payload CRCs are checked in the device copy
        self._tasks: dict[str, asyncio.Task] = {}  # req -> its running load

    # ---- commands from vLLM's thread ----
    def start(self, t: Transfer) -> None:
        task = asyncio.ensure_future(self._load(t))
        self._tasks[t.req_id] = task
        # a task cancelled before its first step never runs its body: report it here
        task.add_done_callback(lambda task: self._never_ran(t, task))

    def cancel(self, req_ids) -> None:
        for r in req_ids:
            task = self._tasks.get(r)
            if task is not None:
                task.cancel()  # its finally still reports

    def cancel_all(self) -> None:
        self.cancel(list(self._tasks))

    def _never_ran(self, t: Transfer, task) -> None:
        if self._tasks.get(t.req_id) is task:
            del self._tasks[t.req_id]
            self.results.count(loads_cancelled=1)
            self._load_done(t, sorted(t.block_ids), True)

    # ---- the pipeline ----
    async def _load(self, t: Transfer) -> None:
        t0 = time.monotonic()
        failed = set(t.block_ids)  # until proven loaded
        bad_keys: list[bytes] = []
        cancelled = False
        # a timed-out or cancelled load never waits for the disk (its reads: worker/reads.py);
        # several drives: `waiting` gets those its reads still waited on (data/drives.py)
        waiting: set[int] = set()
        try:
            await asyncio.wait_for(self._load_body(t, failed, bad_keys, waiting), self.load_timeout)
        except asyncio.TimeoutError:
            self.results.count(load_timeouts=1)
            if waiting:  # the drives it waited on failed it, not the others
                self.results.report(WorkerReport(drives={d: [1, 0] for d in waiting}))
            log.warning("aiokv: a load took over %.0f s; it is recomputed instead", self.load_timeout)
        except asyncio.CancelledError:
            cancelled = True  # the request is gone: not a failure of the cache
            self.results.count(loads_cancelled=1)
        except OSError as e:
            if isinstance(e, StagingStuck):
                self.results.count(load_staging_stuck=1)
            log.warning("aiokv: a load failed (%s); its blocks are recomputed", e.strerror or e)
        except Exception:
            log.exception("aiokv: a load failed; its blocks are recomputed")
        finally:
            if not cancelled:  # an aborted request's load says nothing about the disk
                self.results.count(**latency_counts("load", time.monotonic() - t0))
            if self._tasks.get(t.req_id) is asyncio.current_task():
                del self._tasks[t.req_id]
            # cancelled: every block failed, those it copied too (a cache reset cancels the loads of
            # requests that live on, and vLLM keeps a load's blocks before its first failed one)
            self._load_done(t, sorted(t.block_ids if cancelled else failed), cancelled, [k for k, _, _ in bad_keys])

    async def _load_body(self, t: Transfer, failed: set, bad_keys: list, waiting: set) -> None:
        # no location: nothing to read; block 0 is vLLM's null block and is never written
        flags = t.from_bucket or [False] * len(t.keys)
        todo = [(k, s, b) for k, s, b, r in zip(t.keys, t.locations, t.block_ids, flags) if s >= 0 and b > 0 and not r]
        from_bucket = [(k, s, b) for k, s, b, r in zip(t.keys, t.locations, t.block_ids, flags) if r]
        if from_bucket:
            await self._load_from_bucket(t, from_bucket, failed, bad_keys)
        held = self.staging.take_kept([k for k, _, _ in todo], self.reads.ns)  # kept in host memory: no disk read
        mem = [(k, b, buf) for (k, _, b), buf in zip(todo, held) if buf is not None]
        if mem:
            # a plain copy: these buffers were verified (or written) when kept; checking them again
            # in the copy would cost ~10 % more per byte (tools/bench_crc_in_copy.py) for memory faults only
            try:
                await self.reads.copy_in([b for _, b, _ in mem], [buf for _, _, buf in mem])
                failed.difference_update(b for _, b, _ in mem)
                self.results.count(memory_hit_blocks=len(mem))
            finally:
                self.staging.keep([(k, buf) for k, _, buf in mem], self.reads.ns)  # back, as the most recent
            todo = [item for item, buf in zip(todo, held) if buf is None]
        if self.layers is not None and self.layers.fits(len(todo)):
            return await self.layers.read(t, todo, failed, bad_keys, waiting)
        if todo:
            step, ahead = self.reads.window()
            await read_through(
                todo,
                self.staging.wait,
                self.staging.release,
                lambda part, bufs: self._read_chunk(t, part, bufs, failed, bad_keys, waiting),
                step,
                ahead,
            )

    async def _read_chunk(
        self, t: Transfer, chunk: list, bufs: list[int], failed: set, bad_keys: list, waiting: set
    ) -> None:
        """One chunk of a load's disk reads (data/window.py): read into `bufs`, verified,
        copied into the KV cache; then its buffers are kept (the memory tier) or given back."""
        keep: list[tuple[bytes, int]] = []
        try:
            items = [(s, k, b) for (k, s, _), b in zip(chunk, bufs)]
            res = await self.reads.read(items, self.crc_in_copy, waiting)
            good = [(k, s, blk, st) for (k, s, blk), st, r in zip(chunk, bufs, res) if r == 0]
            bad_keys += [(k, s, t.group) for (k, s, _), r in zip(chunk, res) if r != 0]
            if good:
                ok = await self.reads.copy_in([g[2] for g in good], [g[3] for g in good], self.crc_in_copy)
                # CRC in the copy: a payload that did not match its CRC was copied into its KV block
                # anyway. Safe because whole-request loads are asynchronous (the connector
                # says load_async=True): vLLM uses the loaded blocks only up to the first
                # failed one and recomputes the rest in place. So that block stays in
                # `failed`, its key goes to bad_keys, and its buffer goes back to the pool
                # (not to the memory tier), exactly as a block the separate check rejects.
                if not all(ok):
                    bad_keys += [(k, s, t.group) for (k, s, _, _), v in zip(good, ok) if not v]
                    good = [g for g, v in zip(good, ok) if v]
                failed.difference_update(g[2] for g in good)
                keep = [(k, st) for k, _, _, st in good]
            self.results.count(bytes_read=len(good) * self.slot_bytes)
        finally:
            self.staging.keep(keep, self.reads.ns)
            kept_bufs = {st for _, st in keep}
            self.staging.release([st for st in bufs if st not in kept_bufs])

    async def _load_from_bucket(self, t: Transfer, todo: list, failed: set, bad_keys: list) -> None:
        """Blocks from the bucket tier: GET → verify → device; then, without holding up
        the load, written through to their reserved local slots as a save job (committed
        by the scheduler once every rank wrote its part). A block that does not arrive or
        verify is a load failure (recomputed) and its reservation is given back; whatever
        happens, every reservation is reported once."""
        reported: set[bytes] = set()
        try:
            i = 0
            while i < len(todo):
                bufs = await self.staging.wait(len(todo) - i)
                chunk = todo[i : i + len(bufs)]
                handed: list[int] = []
                try:
                    addr, verify = self.staging.addr, self.life.blockio().verify
                    got = await asyncio.gather(
                        *(self.life.bucket_loader.fetch(k, addr(st), verify) for (k, _, _), st in zip(chunk, bufs))
                    )
                    good = [(item, st) for item, st, g in zip(chunk, bufs, got) if g == "ok"]
                    bad_keys += [(k, s, t.group) for (k, s, _), g in zip(chunk, got) if g == "bad"]
                    bad = sum(g == "bad" for g in got)  # arrived but did not verify: tampered, foreign
                    self.results.count(
                        bucket_loaded_blocks=len(good),
                        bucket_bad_blocks=bad,
                        bucket_missed_blocks=len(chunk) - len(good) - bad,
                    )
                    if good:
                        await self.reads.copy_in([b for (_, _, b), _ in good], [st for _, st in good])
                        failed.difference_update(b for (_, _, b), _ in good)
                        self.results.count(bytes_read=len(good) * self.slot_bytes)
                        handed = [st for _, st in good]
                        self.saves.write_through(
                            Transfer(
                                t.req_id,
                                [k for (k, _, _), _ in good],
                                [s for (_, s, _), _ in good],
                                [b for (_, _, b), _ in good],
                                t.group,
                                job=t.job,
                                tenant=t.tenant,
                            ),
                            handed,
                        )
                    reported.update(k for k, _, _ in chunk)
                    self._give_back(t, [(k, s) for (k, s, _), g in zip(chunk, got) if g != "ok"])
                finally:
                    self.staging.release([st for st in bufs if st not in handed])
                i += len(chunk)
        finally:
            # cancelled or failed part-way: give the other reservations back
            self._give_back(t, [(k, s) for k, s, _ in todo if k not in reported])

    def _give_back(self, t: Transfer, items: list[tuple[bytes, int]]) -> None:
        """Reservations for bucket blocks that were not loaded: released by the
        scheduler (reported as not written), not counted as failed saves."""
        if items:
            self.results.save_done(None, WorkerReport(saves=[SaveResult(t.job, self.rank, [], [k for k, _ in items])]))

    def _load_done(self, t: Transfer, failed: list[int], cancelled: bool = False, bad: list[bytes] = ()) -> None:
        n = len(t.block_ids)
        # a cancelled load still reports its blocks failed: vLLM holds them until the load is
        # reported, and a load cut short for a request that lives on (a cache reset) is recomputed
        counts = {
            "loads_ok_blocks": n - len(failed),
            "load_cancelled_blocks" if cancelled else "load_failed_blocks": len(failed),
        }
        self.results.load_done(
            t.req_id,
            failed,
            WorkerReport(loads=[LoadResult(t.job, self.rank, t.req_id, failed, list(bad))], counters=counts),
        )
