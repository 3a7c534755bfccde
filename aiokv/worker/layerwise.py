# SPDX-License-Identifier: Apache-2.0
"""Layer-by-layer copy-in of loaded blocks (docs/design.md, "Layer-by-layer loads").

With `layerwise` on, a load is read and verified whole, exactly as without it
(every block's header, payload CRC32C and MAC before anything is used), but the
verified blocks stay in their staging buffers instead of being copied into the KV
cache on the loop thread: the load is reported finished at once, and the next
engine step copies them in, layer by layer, while the forward pass runs:

- `begin` (vLLM's thread, when the step's metadata is bound, before the
  forward): first drops the staged loads of requests this step cancels (their
  blocks may already belong to another request), then starts the copies of
  every other staged load, layer 0 first;
- `wait_layer(name)` (wait_for_layer_load, before that layer's attention)
  returns once that layer of every staged block is in place;
- `end_step` (get_finished, after the forward) makes sure every layer is in
  place, whether or not the forward asked for it, before the step ends.

Why this is never wrong: vLLM marks a loaded block computed (and caches it in
its prefix cache) only after the load is reported finished, and the first
forward pass that can read it is one of a later step, whose `begin` started the
copies and whose attention waits for each layer. What is deferred is only a
memcpy (CPU) or DMA (CUDA) of bytes already verified, which cannot fail the way a
read can; a read or verification failure is still reported with the load, as
block errors, before vLLM uses anything (the blocks from the first failed one on
are not staged: vLLM recomputes them, possibly in the very step that copies).

CPU: a copy thread copies layer after layer (native memcpy, GIL released) and
sets one event per layer. CUDA: the copies run on the device's side stream, one
event per layer; wait_layer makes the compute stream wait on the layer's event
(no host wait); later layers are queued LOOKAHEAD layers ahead of the forward,
so the host cost of queueing them overlaps the GPU's work; the staging buffers go
back to the pool once the last event has completed. A step that may replay a
full CUDA graph (every request computes one token) never calls wait_layer: its
compute stream waits for every layer's copy before the forward (`begin(whole)`).

A load that needs more than half the staging pool is copied in on the loop
thread as before (holding its buffers for a step could starve other loads).

It reaches its worker through two public objects only: the staging owner
(worker/staging.py: buffers taken, given back, kept in the memory tier) and the
reads object (worker/reads.py: reads into staging, counters).

Threading contract: `read` runs on the worker's event-loop thread; `begin`,
`wait_layer`, `end_step` and `cancel` on vLLM's worker thread; the CPU copies on
this object's copy thread. They meet in `_lock`-protected state.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading

import torch

from aiokv.jobs import Transfer

log = logging.getLogger("aiokv")
LOOKAHEAD = 2  # CUDA: layers queued ahead of the one the forward waits for
CANCELLED_MEMORY = 4096  # request ids remembered as cancelled (a cancel may come before the load is staged)


class _Batch:
    """The staged loads one step copies in: block ids, staging buffers, per-layer done markers."""

    def __init__(self, blocks: list[int], bufs: list[int], keys: list[bytes], layers: int):
        self.blocks, self.bufs, self.keys = blocks, bufs, keys
        self.done = [threading.Event() for _ in range(layers)]  # CPU
        self.events: list = []  # CUDA, one per queued layer
        self.idx = None
        self.error: BaseException | None = None


class LayerwiseLoads:
    """One TransferWorker's staged loads. `read` on its event-loop thread; `started`,
    `cancel`, `begin`, `wait_layer`, `end_step` and `close` on vLLM's worker thread."""

    def __init__(self, device, staging, reads, rank: int):
        self.device = device
        self.staging = staging
        self.reads = reads
        self.rank = rank
        self.names = {layer.name: i for i, layer in enumerate(self.device.layers)}
        self._lock = threading.Lock()
        # (req, block ids, staging buffers, keys) verified, not copied yet
        self._staged: list[tuple[str, list[int], list[int], list[bytes]]] = []
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._batch: _Batch | None = None
        self._pending: list[tuple[object, list[int], list[bytes]]] = []  # CUDA: (last event, bufs, keys)
        self._thread: threading.Thread | None = None
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self.counts = collections.Counter()  # staged_loads, staged_blocks, copied_blocks, layer_waits, dropped_blocks

    # ---- loop thread ----
    def fits(self, n: int) -> bool:
        """At most half the staging buffers (the pool less the memory tier's share)."""
        return 0 < n <= (self.staging.count - self.staging.limit) // 2

    async def read(self, t: Transfer, todo: list, failed: set, bad_keys: list, waiting: set | None = None) -> None:
        """Read and verify `todo` [(key, location, block id)] into staging buffers taken
        all at once; stage the verified blocks before the first failed one (waiting: Reads.read's)."""
        bufs = await self.staging.wait(len(todo), whole=True)
        keep, picked = 0, []
        try:
            res = await self.reads.read([(s, k, b) for (k, s, _), b in zip(todo, bufs)], waiting=waiting)
            bad_keys += [(k, s, t.group) for (k, s, _), r in zip(todo, res) if r != 0]
            nb = self.device.num_blocks
            good = {b: (buf, k) for (k, _, b), buf, r in zip(todo, bufs, res) if r == 0 and 0 < b < nb}
            # vLLM recomputes from a request's first block not loaded (a bad read, a key gone,
            # a bucket-tier block that did not arrive): nothing from there on is staged, or
            # its copy could race that recompute
            blocks = []
            for b in t.block_ids:
                if b in good:
                    blocks.append(b)
                elif b in failed:
                    break
            picked = [good[b][0] for b in blocks]
            with self._lock:
                gone = t.req_id in self._cancelled
                if blocks and not gone:
                    self._staged.append((t.req_id, blocks, picked, [good[b][1] for b in blocks]))
                    self.counts.update(staged_loads=1, staged_blocks=len(blocks))
                else:
                    blocks, picked = [], []
            if gone:  # the request was cancelled while its read ran: a cancelled load, not a failed one
                raise asyncio.CancelledError
            keep = len(picked)
            if keep:
                failed.difference_update(blocks)
                self.reads.count(bytes_read=keep * self.reads.slot_bytes)
        finally:
            held = set(picked)
            self.staging.release([s for s in bufs if s not in held])

    # ---- vLLM's thread ----
    def started(self, req_id: str) -> None:
        """A load for req_id is handed in: an earlier cancel of that id (a request that
        ended, its id used again) does not apply to it."""
        with self._lock:
            self._cancelled.pop(req_id, None)

    def cancel(self, req_ids) -> None:
        """These requests are gone: their staged blocks are never copied (vLLM may
        already have handed the block ids to another request)."""
        drop = []
        with self._lock:
            for r in req_ids:
                self._cancelled[r] = None
                self._cancelled.move_to_end(r)
            while len(self._cancelled) > CANCELLED_MEMORY:
                self._cancelled.popitem(last=False)
            keep = []
            for item in self._staged:
                (drop if item[0] in self._cancelled else keep).append(item)
            self._staged = keep
            self.counts.update(dropped_blocks=sum(len(b) for _, b, _, _ in drop))
        for _, _, bufs, _ in drop:
            self.staging.release(bufs)

    def begin(self, whole: bool = False) -> None:
        """Start copying every staged load in (before this step's forward). `whole`:
        the forward may not call wait_layer (CUDA: a replayed full CUDA graph runs
        attention inside the graph): every layer's copy is then ordered before the
        forward's kernels."""
        self._give_back_done()
        if self._batch is not None:  # the previous step's did not end (no get_finished): finish it first
            self.end_step()
        with self._lock:
            staged, self._staged = self._staged, []
        if not staged:
            return
        blocks = [b for _, bs, _, _ in staged for b in bs]
        bufs = [s for _, _, ss, _ in staged for s in ss]
        keys = [k for _, _, _, ks in staged for k in ks]
        batch = self._batch = _Batch(blocks, bufs, keys, len(self.device.layers))
        self.counts.update(copied_blocks=len(blocks))
        if self.device.asynchronous:
            batch.idx = self.device.begin_layers(blocks)
            self._queue_cuda(LOOKAHEAD - 1)
        else:
            with self._wake:
                self._queue.append(batch)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._copier, name=f"aiokv-layers{self.rank}", daemon=True)
                    self._thread.start()
                self._wake.notify()
        if whole and self.device.asynchronous:  # (on the CPU attention always calls wait_layer)
            self._queue_cuda(len(self.device.layers) - 1)
            torch.cuda.current_stream(self.device.device).wait_event(batch.events[-1])

    def wait_layer(self, name: str) -> None:
        batch = self._batch
        i = self.names.get(name)
        if batch is None or i is None:
            return
        self.counts.update(layer_waits=1)
        if self.device.asynchronous:
            self._queue_cuda(i + LOOKAHEAD)
            torch.cuda.current_stream(self.device.device).wait_event(batch.events[i])
        else:
            batch.done[i].wait()
            if batch.error is not None:
                raise RuntimeError("aiokv: a verified load could not be copied into the KV cache") from batch.error

    def end_step(self) -> None:
        """Every layer of this step's copies is in place (CPU), or ordered before
        the compute stream's next kernels (CUDA), when this returns."""
        batch, self._batch = self._batch, None
        if batch is None:
            return
        if self.device.asynchronous:
            self._queue_cuda(len(self.device.layers) - 1, batch)
            torch.cuda.current_stream(self.device.device).wait_event(batch.events[-1])
            self._pending.append((batch.events[-1], batch.bufs, batch.keys))
        else:
            batch.done[-1].wait()  # layers are copied in order: the last one done means all
            if batch.error is not None:
                raise RuntimeError("aiokv: a verified load could not be copied into the KV cache") from batch.error

    def close(self) -> None:
        """Before the worker closes its staging arena: no copy may still read from it."""
        self.end_step()
        for ev, _, _ in self._pending:
            ev.synchronize()
        self._give_back_done()

    def _queue_cuda(self, upto: int, batch: _Batch | None = None) -> None:
        batch = batch or self._batch
        last = min(upto, len(self.device.layers) - 1)
        while len(batch.events) <= last:
            batch.events.append(self.device.copy_in_layer_async(len(batch.events), batch.idx, batch.bufs))

    def _give_back_done(self) -> None:
        """CUDA: staging buffers whose copies have completed are given back."""
        still = []
        for item in self._pending:
            if item[0].query():
                self._done(item[1], item[2])
            else:
                still.append(item)
        self._pending = still

    def _done(self, bufs: list[int], keys: list[bytes], ok: bool = True) -> None:
        """Copied blocks' buffers (verified images of their keys) join the memory tier,
        as after a whole-request load; others are freed."""
        if ok:
            self.staging.keep(list(zip(keys, bufs)), self.reads.ns)
            bufs = []  # (kept buffers can be taken by a job: the release below wakes waiting loads)
        self.staging.release(bufs)

    # ---- copy thread (CPU) ----
    def _copier(self) -> None:
        while True:
            with self._wake:
                while not self._queue:
                    self._wake.wait()
                batch = self._queue.popleft()
            try:
                for i, ev in enumerate(batch.done):
                    self.device.copy_in_layer(i, batch.blocks, batch.bufs)
                    ev.set()
            except BaseException as e:
                # a bug, not a disk fault (the bytes were verified, the ids checked
                # when staged); vLLM already counts these blocks as computed, so
                # the forward must not go on with them: wait_layer raises
                batch.error = e
                log.exception("aiokv: copying loaded blocks into the KV cache failed")
            finally:
                for ev in batch.done:
                    ev.set()
                self._done(batch.bufs, batch.keys, batch.error is None)

    @property
    def held(self) -> int:
        """Staging buffers held by staged or copying loads."""
        with self._lock:
            n = sum(len(s) for _, _, s, _ in self._staged)
        return n + sum(len(s) for _, s, _ in self._pending)
