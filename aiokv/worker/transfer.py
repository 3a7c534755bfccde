"""The worker side: one uvloop event loop (asyncio's where uvloop is missing) on a dedicated thread runs a save and
a load pipeline per request as asyncio tasks.

  save: device -> staging copy (vLLM's thread, at the end of the step)
        -> io_uring write (loop) -> report (rank, key, slot) written or failed
  load: io_uring read -> verify -> staging -> device copy (loop)
        -> report the request finished, with the block ids that failed
        (a block kept in host memory, worker/memory.py, skips the read)

On a device that checksums inside its copies (Device.fuses_checksums, the CPU
build) and without a secret, the payload CRC32C is computed by the save's copy
and checked by the load's copy: no separate pass over the bytes (worker/device.py).

Failure contract (docs/reliability.md lists the scenarios and their tests):
- A job's failure affects only its request: a failed save is reported so its
  reservation is released; a failed or timed-out load reports its blocks in
  the load errors and the request as finished receiving, so vLLM recomputes.
- Every load handed in is reported finished exactly once, cancelled ones too,
  and only after none of its I/O can still write into staging or the KV cache.
- The loop never dies of a job: each pipeline catches everything. If the loop
  thread dies anyway, poll() reports every outstanding load as failed and
  every outstanding save as failed, and the worker stops taking jobs.
- Staging slots come from a bounded pool: a save that finds it full is
  dropped (counted), never waited for; a load waits for slots, but fails at
  once when every slot in use is stuck (below).
- A hung disk never hangs vLLM: loads and saves run in the backend's abandon
  mode (data/backend.py). A load that times out or is cancelled, and a save that
  takes over `save_timeout`, end at once (reported failed or cancelled) while
  the staging slots the kernel still writes into or reads from are set aside
  ("stuck") until their I/O ends; only then do they go back to the pool.
  close() returns within a bound whatever the disk does: it leaves a backend
  with stuck I/O, and the staging memory, to the process exit.

Threading contract: save/load/cancel/poll/close are called from the vLLM worker
thread; pipelines run on the loop thread; they meet in `_lock`-protected state.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import ctypes
import errno
import logging
import threading
import time

try:
    import uvloop
except ImportError:  # a machine without it (a bare GPU node): asyncio's own loop, slower per job
    uvloop = None

from aiokv.data.backend import ABANDON, open_backend
from aiokv.jobs import Transfer, WorkerReport
from aiokv.data import format as fmt
from aiokv.data.blockio import BlockIO
from aiokv.worker.layerwise import LayerwiseLoads
from aiokv.worker.latency import latency_counts
from aiokv.worker.reads import NOT_IO_ERRORS, Reads
from aiokv.worker.staging import Staging

log = logging.getLogger("aiokv")

# every counter a worker reports besides its latency histograms (aiokv/connector/metrics.py maps each to a
# Prometheus series or says why not; tests/test_metrics_series_table.py holds the two together)
COUNTERS = ("loads_ok_blocks", "load_failed_blocks", "load_cancelled_blocks", "load_timeouts", "loads_cancelled",
            "load_staging_stuck", "saves_ok_blocks", "save_failed_blocks", "save_skipped_staging_full",
            "save_timeouts", "read_errors", "write_errors", "bytes_read", "bytes_written",
            # the shared tier (docs/sharing.md)
            "remote_loaded_blocks", "remote_missed_blocks", "remote_bad_blocks", "uploaded", "upload_bytes", "upload_already_there",
            "upload_failed", "upload_replaced_bad", "upload_dropped_queue_full", "upload_dropped_unavailable",
            "upload_dropped_at_close",
            # the host-memory tier (worker/memory.py); memory_held_bytes is a level (its deltas may be negative)
            "memory_hit_blocks", "memory_held_bytes")
CLOSE_DRAIN_S = 10.0  # close() waits this long for outstanding jobs, then leaves them


START_TIMEOUT = 60.0  # seconds the worker waits at start for its backend (it looks at the file system)

class TransferWorker:
    def __init__(self, device, ns_dir: str, nsid: bytes, rank: int, staging_bytes: int, io: str = "auto",
                 queue_depth: int = 32, load_timeout: float = 30.0, save_timeout: float = 60.0, shared=None,
                 upload_queue: int = 256 << 20, flush_timeout: float = 10.0, secret: str | None = None,
                 memory_bytes: int = 0, layerwise: bool = False, checksum_threads: int | None = None):
        self.device = device
        # threads that stamp and verify big chunks off the loop thread (aiokv/data/blockio.py);
        # None: the device's default (0 on the CPU build, whose cores run the model)
        self.checksum_threads = device.checksum_threads if checksum_threads is None else checksum_threads
        self.secret = secret
        # the shared tier (docs/sharing.md): a SharedClient, or None
        self.shared, self.upload_queue, self.flush_timeout = shared, upload_queue, flush_timeout
        self.uploader = self.remote = None
        self.rank = rank
        self.load_timeout = load_timeout
        self.save_timeout = save_timeout
        slot_bytes = fmt.slot_bytes(device.payload_bytes)
        kept = memory_bytes // slot_bytes  # the memory tier shares the staging arena
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self.staging = Staging(slot_bytes, max(4, staging_bytes // slot_bytes) + kept, kept,
                               on_stuck=lambda: self._count(load_staging_stuck=1))
        self.pool, self.cache = self.staging.pool, self.staging.cache
        self._held_reported = 0  # memory_held_bytes last reported
        self.reads = Reads(device, self.staging, self._blockio, self._count)
        # verified loads copied in layer by layer during the next forward (worker/layerwise.py)
        self.layers = LayerwiseLoads(device, self.staging, self.reads, rank) if layerwise else None
        self.thread = None
        try:
            device.attach(self.pool)
            self._start(slot_bytes, ns_dir, nsid, io, queue_depth)
        except BaseException:
            # nothing may outlive a worker that did not start: loop thread, arena, pinning
            if self.thread is not None and not self._stop_loop():
                self.loop.close()
            device.close()
            self.staging.close()
            raise

    def _start(self, slot_bytes, ns_dir, nsid, io, queue_depth) -> None:
        # payload CRCs inside the device copies; with a secret the MAC reads the payload anyway
        self._fused = self.device.fuses_checksums and self.secret is None
        self._loads: dict[str, tuple[Transfer, object]] = {}   # req -> (transfer, future)
        self._saves: dict[int, tuple[Transfer, list[int]]] = {}  # save job id -> (transfer, staging)
        self._save_ids = 0
        self._done_loads: list[tuple[str, list[int]]] = []   # (req, failed block ids)
        self._report = WorkerReport()
        self._dead = False
        self.job_done = threading.Event()  # set when a load or save finishes; see wait_for_jobs
        self.backend = None
        self.cpu = (concurrent.futures.ThreadPoolExecutor(self.checksum_threads, f"aiokv-crc{self.rank}")
                    if self.checksum_threads > 0 else None)
        self.loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
        self.loop.set_exception_handler(self._on_loop_error)
        self.thread = threading.Thread(target=self.loop.run_forever, name=f"aiokv-worker{self.rank}", daemon=True)
        self.thread.start()
        self.slot_bytes = slot_bytes
        # The data file is opened at the first job: the engine that owns the
        # store creates the directory after the workers have started.
        self._io_args = (ns_dir, nsid)
        self.io = None
        fut = asyncio.run_coroutine_threadsafe(self._setup(io, queue_depth), self.loop)
        try:  # opening the backend looks at the cache directory's file system: bounded
            fut.result(START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the cache directory {ns_dir} did not answer within {START_TIMEOUT:.0f} s "
                               "(a hung file system?)") from None

    # ---- loop plumbing ----
    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _setup(self, io, depth):
        self.staging.bind(self.loop)
        self.backend = open_backend(self.loop, io, depth=depth, path=self._io_args[0])
        if self.shared is not None:
            from aiokv.bucket.loader import RemoteLoader
            from aiokv.bucket.uploader import Uploader

            # an object already under a block's name that does not verify is replaced by ours, but
            # not with a secret: there a fleet engine's block under another secret (a misconfigured
            # engine's view) and a planted one look alike, and ours must never overwrite the fleet's
            verify = None if self.secret else (lambda key, addr: self._blockio().verify(key, addr))
            self.uploader = Uploader(self.shared, self.upload_queue, count=self._count, verify=verify)
            self.remote = RemoteLoader(self.shared, self._io_args[1], self.rank, self.slot_bytes)

    def _blockio(self) -> BlockIO:
        if self.io is None:
            ns_dir, nsid = self._io_args
            self.io = BlockIO(self.backend, ns_dir, nsid, self.rank, self.device.payload_bytes, self.device.layout_tag,
                              self.secret, cpu=self.cpu)
        return self.io

    def _on_loop_error(self, loop, context):
        log.error("aiokv: unexpected error in the worker loop: %s", context.get("message"),
                  exc_info=context.get("exception"))

    def drop_memory(self) -> None:
        """The cache was reset: the memory tier keeps nothing from before."""
        self.staging.clear_kept()

    @property
    def staging_in_use(self) -> int:
        """Slots owned by jobs (not those kept in the memory tier)."""
        return self.staging.in_use

    @property
    def stuck(self) -> int:
        """Staging slots set aside until the kernel gives them back."""
        return self.staging.stuck

    def _count(self, **kw) -> None:
        with self._lock:
            self._counts.update(kw)

    # ---- saves ----
    def save(self, transfers: list[Transfer]) -> None:
        """Copy this step's blocks to staging now; write them to disk in the background."""
        for t in transfers:
            if self._dead:
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
                continue
            # as many as the pool has: a big prefill is saved in part, not dropped
            slots = self.staging.acquire(len(t.keys), whole=False)
            take = len(slots) if slots else 0
            if take < len(t.keys):
                rest = Transfer(t.req_id, t.keys[take:], t.slots[take:], t.block_ids[take:], t.group)
                self._count(save_skipped_staging_full=len(rest.keys))
                self._save_done(rest, None, [-errno.ENOBUFS] * len(rest.keys))
                if not take:
                    continue
                t = Transfer(t.req_id, t.keys[:take], t.slots[:take], t.block_ids[:take], t.group)
            try:
                self.device.copy_out(t.block_ids, slots, checksum=self._fused)
            except Exception:
                log.exception("aiokv: copying blocks out for a save failed; that save is dropped")
                self.staging.release(slots)
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
                continue
            with self._lock:
                self._save_ids += 1
                job = self._save_ids
                self._saves[job] = (t, slots)
            try:
                asyncio.run_coroutine_threadsafe(self._save(job, t, slots, crc_ready=self._fused), self.loop)
            except Exception:  # the loop is gone: this save fails, vLLM goes on
                log.exception("aiokv: the worker loop did not take a save")
                with self._lock:
                    self._saves.pop(job, None)
                self.staging.release(slots)
                self._save_done(t, None, [-errno.EIO] * len(t.keys))
        self.device.after_step()

    async def _save(self, job: int, t: Transfer, slots: list[int], upload: bool = True,
                    crc_ready: bool = False) -> None:
        """Write a save job's staging slots (crc_ready: their payload CRCs came with the device copy)."""
        t0 = time.monotonic()
        res = [-errno.EIO] * len(t.keys)
        ABANDON.set(self.staging.abandon)
        try:
            if self.device.asynchronous:  # the device copy may still be landing
                await self.loop.run_in_executor(None, self.device.wait_out)
            addr = self.staging.addr
            items = [(s, k, addr(b)) for s, k, b in zip(t.slots, t.keys, slots)]
            res = await asyncio.wait_for(self._blockio().write(items, crc_ready), self.save_timeout)
            if upload and self.uploader is not None:  # write-behind: a copy of each block written, queued (or dropped)
                for k, b, r in zip(t.keys, slots, res):
                    if r == 0:
                        self.uploader.offer(self.remote.name(k), ctypes.string_at(addr(b), self.slot_bytes))
        except asyncio.TimeoutError:
            # dropped from the step's accounting; a write that lands later in a slot the
            # store has given to another key fails that key's verification (a miss)
            res = [-errno.ETIMEDOUT] * len(t.keys)
            self._count(save_timeouts=1)
            log.warning("aiokv: a save took over %.0f s; it is dropped", self.save_timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("aiokv: a save failed; only that request's save is dropped")
        finally:
            # written blocks stay in host memory (the memory tier); the rest are freed
            self.staging.keep([(k, b) for k, b, r in zip(t.keys, slots, res) if r == 0])
            self.staging.release([b for b, r in zip(slots, res) if r != 0])
            with self._lock:
                self._saves.pop(job, None)
            self._count(**latency_counts("save", time.monotonic() - t0))
            self._save_done(t, slots, res)

    def _save_done(self, t: Transfer, slots, res: list[int]) -> None:
        ok = [(self.rank, k, s, t.group) for k, s, r in zip(t.keys, t.slots, res) if r == 0]
        bad = [(self.rank, k, s, t.group) for k, s, r in zip(t.keys, t.slots, res) if r != 0]
        with self._lock:
            self._report.saved += ok
            self._report.save_failed += bad
            self.job_done.set()
            self._counts.update(saves_ok_blocks=len(ok), save_failed_blocks=len(bad),
                                bytes_written=len(ok) * self.slot_bytes,
                                write_errors=sum(r not in NOT_IO_ERRORS for r in res))

    # ---- loads ----
    def load(self, transfers: list[Transfer]) -> None:
        if transfers and not self._dead:
            self.device.before_loads()
        for t in transfers:
            if self._dead:
                self._load_done(t.req_id, list(t.block_ids))
                continue
            if self.layers is not None:  # a new load under an id seen cancelled before
                self.layers.started(t.req_id)
            with self._lock:  # registered before it can finish, so _load_done finds it
                self._loads[t.req_id] = (t, None)
            try:
                fut = asyncio.run_coroutine_threadsafe(self._load(t), self.loop)
            except Exception:  # the loop is gone: report this load failed, never lose it
                log.exception("aiokv: the worker loop did not take a load")
                self._load_done(t.req_id, list(t.block_ids))
                continue
            with self._lock:
                if t.req_id in self._loads:
                    self._loads[t.req_id] = (t, fut)

    def cancel(self, req_ids) -> None:
        if self.layers is not None:
            self.layers.cancel(req_ids)
        for r in req_ids:
            with self._lock:
                entry = self._loads.get(r)
            if entry is not None and entry[1] is not None:
                entry[1].cancel()  # cancels the task on the loop; its finally still reports

    async def _load(self, t: Transfer) -> None:
        t0 = time.monotonic()
        failed = set(t.block_ids)  # until proven loaded
        bad_keys: list[bytes] = []
        cancelled = False
        ABANDON.set(self.staging.abandon)  # a timed-out or cancelled load never waits for the disk
        try:
            await asyncio.wait_for(self._load_body(t, failed, bad_keys), self.load_timeout)
        except asyncio.TimeoutError:
            self._count(load_timeouts=1)
            log.warning("aiokv: a load took over %.0f s; it is recomputed instead", self.load_timeout)
        except asyncio.CancelledError:
            cancelled = True  # the request is gone: not a failure of the cache
            self._count(loads_cancelled=1)
        except OSError as e:
            log.warning("aiokv: a load failed (%s); its blocks are recomputed", e.strerror or e)
        except Exception:
            log.exception("aiokv: a load failed; its blocks are recomputed")
        finally:
            with self._lock:
                self._report.load_bad += bad_keys
            if not cancelled:  # an aborted request's load says nothing about the disk
                self._count(**latency_counts("load", time.monotonic() - t0))
            self._load_done(t.req_id, sorted(failed), cancelled)

    async def _load_body(self, t: Transfer, failed: set, bad_keys: list) -> None:
        # no slot: nothing to read; block 0 is vLLM's null block and is never written
        flags = t.remote or [False] * len(t.keys)
        todo = [(k, s, b) for k, s, b, r in zip(t.keys, t.slots, t.block_ids, flags) if s >= 0 and b > 0 and not r]
        remote = [(k, s, b) for k, s, b, r in zip(t.keys, t.slots, t.block_ids, flags) if r]
        if remote:
            await self._load_remote(t, remote, failed, bad_keys)
        held = self.staging.take_kept([k for k, _, _ in todo])  # blocks kept in host memory: no disk read
        mem = [(k, b, slot) for (k, _, b), slot in zip(todo, held) if slot is not None]
        if mem:
            # a plain copy: these slots were verified (or written) when kept; checking them again
            # in the copy would cost ~10 % more per byte (tools/bench_fused.py) for memory faults only
            try:
                await self.reads.copy_in([b for _, b, _ in mem], [slot for _, _, slot in mem])
                failed.difference_update(b for _, b, _ in mem)
                self._count(memory_hit_blocks=len(mem))
            finally:
                self.staging.keep([(k, slot) for k, _, slot in mem])  # back, as the most recently used
            todo = [item for item, slot in zip(todo, held) if slot is None]
        if self.layers is not None and self.layers.fits(len(todo)):
            return await self.layers.read(t, todo, failed, bad_keys)
        i = 0
        while i < len(todo):
            slots = await self.staging.wait(len(todo) - i)
            chunk = todo[i:i + len(slots)]
            keep: list[tuple[bytes, int]] = []
            try:
                res = await self.reads.read([(s, k, b) for (k, s, _), b in zip(chunk, slots)],
                                            payload_checked=not self._fused)
                good = [(k, s, blk, st) for (k, s, blk), st, r in zip(chunk, slots, res) if r == 0]
                bad_keys += [(k, s, t.group) for (k, s, _), r in zip(chunk, res) if r != 0]
                if good:
                    ok = await self.reads.copy_in([g[2] for g in good], [g[3] for g in good], self._fused)
                    # Fused: a payload that did not match its CRC was copied into its KV block
                    # anyway. Safe because whole-request loads are asynchronous (the connector
                    # says load_async=True): vLLM uses the loaded blocks only up to the first
                    # failed one and recomputes the rest in place. So that block stays in
                    # `failed`, its key goes to bad_keys, and its slot goes back to the pool
                    # (not to the memory tier), exactly as a block the separate check rejects.
                    if not all(ok):
                        bad_keys += [(k, s, t.group) for (k, s, _, _), v in zip(good, ok) if not v]
                        good = [g for g, v in zip(good, ok) if v]
                    failed.difference_update(g[2] for g in good)
                    keep = [(k, st) for k, _, _, st in good]
                self._count(bytes_read=len(good) * self.slot_bytes)
            finally:
                self.staging.keep(keep)
                kept_slots = {st for _, st in keep}
                self.staging.release([st for st in slots if st not in kept_slots])
            i += len(chunk)

    async def _load_remote(self, t: Transfer, todo: list, failed: set, bad_keys: list) -> None:
        """Blocks from the shared tier: GET → verify → device; then, without holding up
        the load, written through to their reserved local slots as a save job (committed
        by the scheduler once every rank wrote its part). A block that does not arrive or
        verify is a load failure (recomputed) and its reservation is given back; whatever
        happens, every reservation is reported once."""
        reported: set[bytes] = set()
        try:
            i = 0
            while i < len(todo):
                slots = await self.staging.wait(len(todo) - i)
                chunk = todo[i:i + len(slots)]
                handed: list[int] = []
                try:
                    addr, verify = self.staging.addr, self._blockio().verify
                    got = await asyncio.gather(*(self.remote.fetch(k, addr(st), verify)
                                                 for (k, _, _), st in zip(chunk, slots)))
                    good = [(item, st) for item, st, g in zip(chunk, slots, got) if g == "ok"]
                    bad_keys += [(k, s, t.group) for (k, s, _), g in zip(chunk, got) if g == "bad"]
                    bad = sum(g == "bad" for g in got)  # arrived but did not verify: tampered, foreign
                    self._count(remote_loaded_blocks=len(good), remote_bad_blocks=bad,
                                remote_missed_blocks=len(chunk) - len(good) - bad)
                    if good:
                        await self.reads.copy_in([b for (_, _, b), _ in good], [st for _, st in good])
                        failed.difference_update(b for (_, _, b), _ in good)
                        self._count(bytes_read=len(good) * self.slot_bytes)
                        handed = [st for _, st in good]
                        self._write_through(Transfer(t.req_id, [k for (k, _, _), _ in good],
                                                     [s for (_, s, _), _ in good], [b for (_, _, b), _ in good],
                                                     t.group), handed)
                    reported.update(k for k, _, _ in chunk)
                    self._give_back(t.group, [(k, s) for (k, s, _), g in zip(chunk, got) if g != "ok"])
                finally:
                    self.staging.release([st for st in slots if st not in handed])
                i += len(chunk)
        finally:
            # cancelled or failed part-way: give the other reservations back
            self._give_back(t.group, [(k, s) for k, s, _ in todo if k not in reported])

    def _write_through(self, t: Transfer, slots: list[int]) -> None:
        """A save job (loop thread) of blocks just loaded from the shared tier; it owns `slots`."""
        with self._lock:
            self._save_ids += 1
            job = self._save_ids
            self._saves[job] = (t, slots)
        asyncio.ensure_future(self._save(job, t, slots, upload=False))

    def _give_back(self, group: int, items: list[tuple[bytes, int]]) -> None:
        """Reservations for shared blocks that were not loaded: released by the
        scheduler (reported as not written), not counted as failed saves."""
        if items:
            with self._lock:
                self._report.save_failed += [(self.rank, k, s, group) for k, s in items]
                self.job_done.set()

    def _load_done(self, req_id: str, failed: list[int], cancelled: bool = False) -> None:
        with self._lock:
            t = self._loads.pop(req_id, None)
            n = len(t[0].block_ids) if t else len(failed)
            # a cancelled load still reports its blocks failed: vLLM holds them until the load is
            # reported, and a load cut short for a request that lives on (a cache reset) is recomputed
            self._done_loads.append((req_id, failed))
            self.job_done.set()
            if failed:
                self._report.load_failed.append(req_id)
            self._counts.update(loads_ok_blocks=n - len(failed))
            self._counts.update(**{"load_cancelled_blocks" if cancelled else "load_failed_blocks": len(failed)})

    # ---- results ----
    def poll(self) -> tuple[set[str], set[int], WorkerReport]:
        """(requests finished loading, block ids that failed to load, report for the scheduler)."""
        if not self._dead and not self.thread.is_alive():
            self._die()
        with self._lock:
            done, self._done_loads = self._done_loads, []
            report, self._report = self._report, WorkerReport()
            held = self.staging.kept * self.slot_bytes  # a level: reported as its change
            if held != self._held_reported:
                self._counts.update(memory_held_bytes=held - self._held_reported)
                self._held_reported = held
            report.counters = dict(self._counts)
            self._counts.clear()
        finished = {r for r, _ in done}
        errors = {b for _, f in done for b in f}
        return finished, errors, report

    def _die(self) -> None:
        log.error("aiokv: the worker loop thread died; outstanding loads are recomputed, saves dropped")
        self._dead = True
        with self._lock:
            loads, self._loads = list(self._loads.values()), {}
            saves, self._saves = list(self._saves.values()), {}
        for t, _ in loads:
            self._load_done(t.req_id, list(t.block_ids))
        for t, _ in saves:
            self._save_done(t, None, [-errno.EIO] * len(t.keys))

    def wait_for_jobs(self, timeout: float) -> None:
        """Block (GIL released) until some load or save finishes or `timeout` passes;
        returns at once when none is outstanding or one has just finished. An engine
        with nothing to compute but waiting jobs calls this instead of spinning empty
        steps, which would keep the loop thread from the GIL."""
        with self._lock:
            if not (self._loads or self._saves) or self._done_loads:
                return
            self.job_done.clear()
        self.job_done.wait(timeout)

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._loads) + len(self._saves)

    def drain(self, timeout: float = CLOSE_DRAIN_S) -> None:
        """Wait until no save or load is outstanding (tests, shutdown)."""
        import time

        end = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < end and self.thread.is_alive():
            time.sleep(0.001)

    def close(self) -> None:
        """Returns within about CLOSE_DRAIN_S + 10 s (+ flush_timeout with a shared tier),
        even with I/O stuck in the kernel."""
        if self.thread.is_alive():
            # loads first (nobody waits for them any more; abandon mode ends them at
            # once), then saves get a bounded while to land, so they can be committed
            with self._lock:
                futs = [fut for _, fut in self._loads.values() if fut is not None]
            for fut in futs:
                fut.cancel()
            self.drain()
            try:
                # pending uploads (shared tier) get flush_timeout more
                asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(
                    5 + (self.flush_timeout if self.uploader is not None else 0))
            except Exception:
                log.warning("aiokv: the worker loop did not shut down in time; left to the process exit")
        stuck = self._stop_loop() or self.stuck or (self.backend is not None and self.backend.in_flight)
        if self.cpu is not None:  # idle once the loop has stopped: nothing awaits them any more
            self.cpu.shutdown(wait=not stuck)
        if stuck:
            # the kernel may still write into staging: never unmap or unpin it under the I/O
            log.warning("aiokv: I/O stuck in the kernel at close; its memory is left to the process exit")
            return
        self.device.close()
        self.staging.close()

    def _stop_loop(self) -> bool:
        """Stops the loop thread; True if it did not stop within the bound."""
        if self.thread is None or not self.thread.is_alive():
            return False
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        return self.thread.is_alive()

    async def _shutdown(self) -> None:
        if self.uploader is not None:  # a clean shutdown: pending uploads go out, within flush_timeout
            await self.uploader.flush(self.flush_timeout)
        await asyncio.sleep(0)  # the cancelled loads' tasks end first (abandon: at once)
        if self.backend.in_flight or self.stuck:
            return  # closing it would wait for the kernel; the process exit reclaims it
        self.backend.close()
        if self.io is not None:
            self.io.close()
