# SPDX-License-Identifier: Apache-2.0
"""The worker side of one KV-cache group: the process's uvloop event loop (asyncio's where uvloop is missing) on a
dedicated thread runs a save and a load pipeline per request as asyncio tasks. This module is the facade vLLM's
thread calls; the parts are

  worker/host.py       the loop and the staging arena, one per process for every group
  worker/staging.py    the staging buffers and the memory tier (one owner)
  worker/saves.py      the save pipeline          worker/loads.py   the load pipeline
  worker/reads.py      reads into staging, copies into the KV cache (loads, layerwise)
  worker/results.py    the way back to vLLM's thread (a queue), and its view of the jobs
  worker/lifecycle.py  the group's backend and data file on the loop; start and close

  save: device -> staging copy (vLLM's thread, at the end of the step)
        -> io_uring write (loop) -> report (rank, key, slot) written or failed
  load: io_uring read -> verify -> staging -> device copy (loop)
        -> report the request finished, with the block ids that failed
        (a block kept in host memory, worker/memory.py, skips the read)

On a device that checksums inside its copies (Device.crc_in_copy, the CPU
build), the payload CRC32C is computed by the save's copy and checked by the
load's copy: no separate pass over the bytes (worker/device.py). With a secret,
the MAC is computed and checked in BlockIO's stamp and check calls.

Failure contract (docs/reliability.md lists the scenarios and their tests):
- A job's failure affects only its request: a failed save is reported so its
  reservation is released; a failed or timed-out load reports its blocks in
  the load errors and the request as finished receiving, so vLLM recomputes.
- Every load handed in is reported finished exactly once, cancelled ones too,
  and only after none of its I/O can still write into staging or the KV cache.
- The loop never dies of a job: each pipeline catches everything. If the loop
  thread dies anyway, poll() reports every outstanding load as failed and
  every outstanding save as failed, and the worker stops taking jobs.
- Staging buffers come from a bounded pool: a save that finds it full is
  dropped (counted), never waited for; a load waits for buffers, but fails at
  once when every buffer in use is stuck (below).
- A hung disk never hangs vLLM: loads and saves run in the backend's abandon
  mode (data/backend.py). A load that times out or is cancelled, and a save that
  takes over `save_timeout`, end at once (reported failed or cancelled) while
  the staging buffers the kernel still writes into or reads from are set aside
  ("stuck") until their I/O ends; only then do they go back to the pool.
  close() returns within a bound whatever the disk does: it leaves a backend
  with stuck I/O, and the staging memory, to the process exit.

Threading contract: save/load/cancel/poll/close (and in_flight, wait_for_jobs,
drain) are called from the vLLM worker thread; pipelines run on the loop thread.
They share no lock: save, load and cancel reach the loop as commands (in the
order handed in; the loop owns the table of running loads), results come back
through worker/results.py's queue, which poll drains without waiting for the
loop. vLLM's thread alone keeps which jobs it handed in and has not seen
finished. The staging owner has its own lock (worker/staging.py).
"""

from __future__ import annotations

import errno
import logging

from aiokv.data import format as fmt
from aiokv.jobs import Transfer, WorkerReport
from aiokv.util.counters import WORKER
from aiokv.util.counting import names as counter_names
from aiokv.worker.host import WorkerHost, checksum_threads_for
from aiokv.worker.layerwise import LayerwiseLoads
from aiokv.worker.lifecycle import CLOSE_DRAIN_S, START_TIMEOUT, Lifecycle  # noqa: F401 (START_TIMEOUT: here too)
from aiokv.worker.loads import Loads
from aiokv.worker.reads import NOT_IO_ERRORS, Reads  # noqa: F401 (NOT_IO_ERRORS: here too)
from aiokv.worker.results import NOTHING, Results
from aiokv.worker.saves import Saves

log = logging.getLogger("aiokv")

COUNTERS = counter_names(WORKER)  # every counter a worker reports (aiokv/util/counters.py)


class TransferWorker:
    """One KV-cache group's worker. `host` (worker/host.py): the process's loop and
    staging, shared by every group; None: one of its own, closed with this worker
    (staging_bytes, memory_bytes and checksum_threads then size it; with a host
    they are the host's business and ignored here)."""

    def __init__(
        self,
        device,
        ns_dir: str | list[str],
        nsid: bytes,
        rank: int,
        staging_bytes: int,
        io: str = "auto",
        queue_depth: int = 32,
        load_timeout: float = 30.0,
        save_timeout: float = 60.0,
        bucket=None,
        upload_queue: int = 256 << 20,
        flush_timeout: float = 10.0,
        secret: str | None = None,
        memory_bytes: int = 0,
        layerwise: bool = False,
        checksum_threads: int | None = None,
        host: WorkerHost | None = None,
    ):
        self.device = device
        self.secret = secret
        self.rank = rank
        self.slot_bytes = slot_bytes = fmt.slot_bytes(device.payload_bytes)
        self._owns_host = host is None
        if host is None:
            # threads that stamp and verify big chunks off the loop thread (aiokv/data/blockio.py)
            threads = checksum_threads_for(device, secret, checksum_threads)
            host = WorkerHost(slot_bytes, staging_bytes, memory_bytes, threads, rank)
        self.host = host
        if host.reporter is None:
            host.reporter = self  # this group's report carries the memory tier's level
        self.results = Results()
        self._count = self.results.count
        self.staging = host.staging
        self.pool, self.cache = self.staging.pool, self.staging.cache
        self._dead = False
        try:
            host.attach(device)
            self.life = Lifecycle(
                host,
                device,
                self._count,
                ns_dir,
                nsid,
                rank,
                slot_bytes,
                io,
                queue_depth,
                secret,
                bucket,
                upload_queue,
                flush_timeout,
            )
            self.life.drive_report = lambda verdicts: self.results.report(WorkerReport(drives=verdicts))
        except BaseException:
            # nothing may outlive a worker that did not start: loop thread, arena, pinning
            # (a shared host gives them back when its owner closes it)
            if self._owns_host:
                host.close()
            raise
        self._pipelines(nsid, rank, slot_bytes, layerwise, load_timeout, save_timeout)

    def _pipelines(self, nsid: bytes, rank: int, slot_bytes: int, layerwise: bool, load_timeout, save_timeout) -> None:
        """The save and load pipelines (and the reads and layer-by-layer copies they share) over
        the started lifecycle; the device is attached, so its crc_in_copy is settled."""
        device = self.device
        # payload CRCs inside the device copies (with a secret, the MAC's pass is the stamp's and check's)
        crc_in_copy = device.crc_in_copy
        self.reads = Reads(device, self.staging, self.life.blockio, self._count, slot_bytes)
        # verified loads copied in layer by layer during the next forward (worker/layerwise.py)
        self.layers = LayerwiseLoads(device, self.staging, self.reads, rank) if layerwise else None
        self.saves = Saves(device, self.staging, self.results, self.life, rank, slot_bytes, save_timeout, crc_in_copy)
        self.loads = Loads(
            self.staging,
            self.reads,
            self.results,
            self.saves,
            self.life,
            self.layers,
            rank,
            slot_bytes,
            load_timeout,
            crc_in_copy,
        )
        # the groups of a process share one memory tier; a key names a block only within its
        # group's namespace and rank, so the tier knows this group's keys under this name
        self.memory_ns = self.reads.ns = self.saves.ns = (nsid, rank)

    @property
    def _crc_in_copy(self) -> bool:
        """Payload CRCs are computed and checked inside the device copies (tools/bench_crc_in_copy.py turns it)."""
        return self.saves.crc_in_copy

    @_crc_in_copy.setter
    def _crc_in_copy(self, on: bool) -> None:
        self.saves.crc_in_copy = self.loads.crc_in_copy = on

    # ---- what lives on the loop (worker/lifecycle.py), read through ----
    loop, thread, backend, backends, io, cpu, uploader = (
        property(lambda self, n=n: getattr(self.life, n), doc=f"the lifecycle's {n}")
        for n in ("loop", "thread", "backend", "backends", "io", "cpu", "uploader")
    )

    @property
    def checksum_threads(self) -> int:
        return self.host.checksum_threads

    def _blockio(self):
        return self.life.blockio()

    # ---- staging (worker/staging.py) ----
    def drop_memory(self) -> None:
        """The cache was reset: the memory tier keeps nothing from before."""
        self.staging.clear_kept()

    @property
    def staging_in_use(self) -> int:
        """Staging buffers owned by jobs (not those kept in the memory tier)."""
        return self.staging.in_use

    @property
    def stuck(self) -> int:
        """Staging buffers set aside until the kernel gives them back."""
        return self.staging.stuck

    # ---- jobs in ----
    def save(self, transfers: list[Transfer]) -> None:
        """Copy this step's blocks to staging now; write them to disk in the background."""
        self.saves.submit(transfers, self._dead)

    def load(self, transfers: list[Transfer]) -> None:
        if transfers and not self._dead:
            self.device.before_loads()
        for t in transfers:
            if self._dead:
                self.loads._load_done(t, list(t.block_ids))
                continue
            if self.layers is not None:  # a new load under an id seen cancelled before
                self.layers.started(t.req_id)
            self.results.loads[t.req_id] = t  # handed in: reported failed if the loop dies first
            if not self.life.call_soon(self.loads.start, t):  # the loop is gone: report this load failed, never lose it
                log.error("aiokv: the worker loop did not take a load")
                self.loads._load_done(t, list(t.block_ids))

    def cancel(self, req_ids) -> None:
        self.results.cancelled(req_ids)  # a load that ended but is not reported yet: reported whole-failed
        if self.layers is not None:
            self.layers.cancel(req_ids)
        self.life.call_soon(self.loads.cancel, list(req_ids))  # on the loop: cancels the tasks; their finally reports

    # ---- results ----
    def poll(self) -> tuple[set[str], set[int], WorkerReport]:
        """(requests finished loading, block ids that failed to load, report for the scheduler).
        With nothing to report the two sets are NOTHING (shared: never change them)."""
        if not self._dead and not self.thread.is_alive():
            self._die()
        held = self.host.held_delta() if self.host.reporter is self else 0  # a level (one arena): its change
        if not held and self.results.quiet:
            return NOTHING, NOTHING, WorkerReport()  # (most decode steps: nothing to take)
        done, report, counts = self.results.take()
        if held:
            counts.update(memory_held_bytes=held)
        report.counters = dict(counts)
        finished = {r for r, _ in done}
        errors = {b for _, f in done for b in f}
        return finished, errors, report

    def _die(self) -> None:
        log.error("aiokv: the worker loop thread died; outstanding loads are recomputed, saves dropped")
        self._dead = True
        loads, saves = self.results.outstanding()
        for t in loads:
            self.loads._load_done(t, list(t.block_ids))
        for job, t in saves:
            self.saves._save_done(t, None, [-errno.EIO] * len(t.keys), job)

    def wait_for_jobs(self, timeout: float) -> None:
        """Block (GIL released) until some load or save finishes or `timeout` passes;
        returns at once when none is outstanding or one has just finished. An engine
        with nothing to compute but waiting jobs calls this instead of spinning empty
        steps, which would keep the loop thread from the GIL."""
        self.results.job_done.clear()  # before looking: a job that ends after the look sets it again
        if not self.results.in_flight or self.results.loads_done:
            return
        self.results.job_done.wait(timeout)

    @property
    def in_flight(self) -> int:
        return self.results.in_flight

    def drain(self, timeout: float = CLOSE_DRAIN_S) -> None:
        """Wait until no save or load is outstanding (tests, shutdown)."""
        import time

        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end and self.thread.is_alive():
            time.sleep(0.001)

    def close(self) -> None:
        """Returns within about CLOSE_DRAIN_S + 10 s (+ flush_timeout with a bucket tier),
        even with I/O stuck in the kernel. A shared host is closed by its owner, after its groups."""
        self.life.close(self.loads.cancel_all, self.drain)
        if self._owns_host:
            self.host.close()
