# SPDX-License-Identifier: Apache-2.0
"""The CUDA device: whole KV blocks between vLLM's KV tensors on a GPU and pinned staging buffers.

Saves gather on the GPU and copy to pinned staging memory on a side stream; copy_out records
an event that the compute stream waits on before the next step's kernels can overwrite any
block (so blocks freed after the step are safe), and the save pipeline waits for the event
(wait_out) before writing to disk. copy_in copies on another side stream and synchronises
before the load is reported; copy_in_queued leaves the wait to the caller (the worker's loop
waits off its thread: worker/reads.py). Layer by layer: begin_layers and copy_in_layer_async.

The payload CRC32C is made and checked on the GPU (devcrc.py), where its answer equals the
host's at attach (device_crc); else BlockIO's pass on the host checks, as before. A save's
CRCs are scattered into a device array indexed by staging buffer, which one copy per save
brings to a pinned host array; wait_out(bufs) puts each buffer's into its header, on the
caller's thread, so vLLM's thread queues a few ops per gather for the CRC, not a copy per block.

The rows between the device and the pinned arena: with `batch_copy` (vLLM's swap_blocks_batch,
handed in by the connector: one driver call for a list of (source, destination, size) copies,
cuMemcpyBatchAsync on CUDA 12.8 and later), one call a gather, its addresses computed by tensor
ops, no Python per block on vLLM's thread; it is used only where it copied a test pattern right
at attach (batch_copy_checked), else each row is its own copy_, as before.

Checked by tools/gpu_check.py on a CUDA machine; here on CPU tensors with torch.cuda's streams
and events stood in for (tests/fakecuda.py).

Threading contract: attach, copy_out, after_step, before_loads, begin_layers and
copy_in_layer_async run on the vLLM worker's main thread; copy_in and copy_in_queued on the
worker's event-loop thread (the latter's event waited for on a thread of the loop's executor);
wait_out on a thread of the loop's executor. The CRC arrays are written by the copy
stream and read by wait_out after the event of the save that wrote them: a buffer's entry
changes only when a later save holds that buffer, after this save's wait_out.
"""

from __future__ import annotations

import logging

import torch

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.worker.devcrc import RowCrc
from aiokv.worker.device import Device, raw_bytes

log = logging.getLogger("aiokv")
GATHER_BYTES = 32 << 20  # device memory a CUDA save gathers through, at most (outside vLLM's budget)


def gather_rows(payload_bytes: int, limit: int = GATHER_BYTES) -> int:
    """Blocks the fixed device gather buffer holds (at least one)."""
    return max(1, limit // payload_bytes)


class CudaDevice(Device):
    """Saves gather through one fixed device buffer of `gather_rows` blocks, reused
    chunk after chunk on the copy stream (stream order makes the reuse safe), so a
    save of any size takes GATHER_BYTES of device memory at most, allocated once at
    start, and the CRC's temporaries (devcrc.py: about 9 x its 16 MiB pieces) while it
    runs; a load copies GATHER_BYTES of blocks at a time. Only the last copy's event is kept.
    batch_copy: vLLM's swap_blocks_batch(src_ptrs, dst_ptrs, sizes), or None (a copy_ a row)."""

    def __init__(self, kv_caches, num_blocks: int, pool: BufferPool | None = None, dims=None, batch_copy=None):
        super().__init__(kv_caches, num_blocks, pool, dims)
        self._batch_offered = batch_copy
        self._batch = None  # the batch copy, once attach has seen it copy right

    asynchronous = True
    # the copies are DMA and the host's cores are free: the checksums of a node's several
    # drives would be more than one loop thread can do (docs/benchmarks.md, "One worker's ceiling")
    checksum_threads = 2

    def attach(self, pool: BufferPool) -> None:
        super().attach(pool)
        # pin the staging arena once (not many small pinned buffers) so copies are DMA; the
        # KV-cache groups of one process share it (worker/host.py): the first device pins it
        if getattr(pool, "pinned_by", None) is None:
            pin_host(pool.arena.addr, pool.arena.size, "the staging arena")
            self._registered = True
            pool.pinned_by = self
        self.device = self.layers[0].view.device
        self.out_stream = torch.cuda.Stream(self.device)
        self.in_stream = torch.cuda.Stream(self.device)
        self._out_event = None
        rows = min(gather_rows(self.payload_bytes, GATHER_BYTES), pool.count)
        with torch.cuda.stream(self.out_stream):  # its memory belongs to the copy stream
            self._gather = torch.empty(rows, self.payload_bytes, dtype=torch.uint8, device=self.device)
        self._batch = batch_copy_checked(self._batch_offered, self.device, self.out_stream)
        self._crc = device_crc(self.payload_bytes, self.device)
        self.crc_in_copy = self._crc is not None
        if self.crc_in_copy:  # each staging buffer's CRC: on the device, then pinned on the host
            self._crc_dev = torch.zeros(pool.count, dtype=torch.int32, device=self.device)
            host = torch.zeros(pool.count, dtype=torch.int32)
            pin_host(host.data_ptr(), 4 * pool.count, "the CRC array")
            self._crc_host = host  # (close unregisters it: only once registered)

    def copy_out(self, block_ids, bufs, crc_in_copy=False):
        h = fmt.HEADER_BYTES
        compute = torch.cuda.current_stream(self.device)
        buf = self._gather
        with torch.cuda.stream(self.out_stream):
            self.out_stream.wait_stream(compute)  # the forward that wrote the blocks comes first
            for c in range(0, len(block_ids), len(buf)):
                ids, part = block_ids[c : c + len(buf)], bufs[c : c + len(buf)]
                n = len(ids)
                # allocated on this stream, so the allocator cannot hand its memory to the
                # compute stream while our gathers still read it
                idx = torch.tensor(ids, dtype=torch.long, device=self.device)
                for layer, a, b in self._cols():
                    buf[:n, a - h : b - h] = layer.view.index_select(0, idx).reshape(n, -1).view(torch.uint8)
                self._rows_out(buf, part)
                if crc_in_copy:  # each payload's CRC32C, made here (devcrc.py), by staging buffer
                    slots = torch.tensor(part, dtype=torch.long, device=self.device)
                    self._crc_dev.index_copy_(0, slots, self._crc.rows(buf[:n]))
            if crc_in_copy:  # one copy for the save; wait_out puts them into the headers
                self._crc_host.copy_(self._crc_dev, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.out_stream)
        self._out_event = ev  # the copy stream is in order: the last event covers every copy

    def after_step(self) -> None:
        # the next step's kernels may overwrite freed blocks only after our reads
        if self._out_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._out_event)

    def wait_out(self, bufs: list[int] | None = None) -> None:
        ev = self._out_event
        if ev is not None:
            ev.synchronize()
        if bufs and self.crc_in_copy:  # their CRCs (copy_out(..., crc_in_copy=True)) into their headers
            at, idx = fmt.PAYLOAD_CRC_OFFSET, torch.tensor(bufs, dtype=torch.long)
            self._rows[idx, at : at + 4] = self._crc_host[idx].view(torch.uint8).view(len(bufs), 4)

    def before_loads(self) -> None:
        # vLLM computes on its own (non-default) stream: the loads' copies must come
        # after the kernels already queued there, which may still touch freed blocks
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_event = ev

    def copy_in(self, block_ids, bufs, crc_in_copy=False):
        ev, result = self.copy_in_queued(block_ids, bufs, crc_in_copy)
        ev.synchronize()
        return result()

    def copy_in_queued(self, block_ids, bufs, crc_in_copy=False):
        """copy_in's copies and checks queued on the side stream, nothing waited for: (the event
        recorded after them, result), where result(), once the event has completed, is copy_in's
        answer. The worker's loop waits for the event off its thread (worker/reads.py), so the
        DMA does not hold up the completions of other jobs' I/O."""
        torch.cuda.set_device(self.device)  # called from the loop thread
        h, at, step = fmt.HEADER_BYTES, fmt.PAYLOAD_CRC_OFFSET, len(self._gather)
        checks = []
        with torch.cuda.stream(self.in_stream):
            if getattr(self, "_compute_event", None) is not None:
                self.in_stream.wait_event(self._compute_event)
            for c in range(0, len(block_ids), step):  # as many blocks at a time as a save gathers
                part = bufs[c : c + step]
                n = len(part)
                idx = torch.tensor(block_ids[c : c + step], dtype=torch.long, device=self.device)
                # allocated on the side stream: the allocator reuses it only after this stream's work
                dev = torch.empty(n, self.payload_bytes, dtype=torch.uint8, device=self.device)
                self._rows_in(dev, part, h)  # rows of the pinned arena: DMA, no pass of the host's over them
                if crc_in_copy:  # checked against each header's CRC (a mismatch: copied, and a failed load)
                    want = self._rows[torch.tensor(part, dtype=torch.long), at : at + 4].contiguous()
                    want = want.view(torch.int32).view(n).to(self.device, non_blocking=True)
                    checks.append(self._crc.rows(dev) == want)
                for layer, a, b in self._cols():
                    layer.view.index_copy_(0, idx, dev[:, a - h : b - h].view(layer.dtype).view(n, *layer.block_shape))
            # the checks' answers, one copy to the host for the whole load (pinned: it lands in stream order)
            ok = torch.cat(checks).to("cpu", non_blocking=True) if checks else None
            ev = torch.cuda.Event()
            ev.record(self.in_stream)
        return ev, (lambda: ok.tolist() if ok is not None else [] if crc_in_copy else None)

    def begin_layers(self, block_ids):
        """Start of a layer-by-layer copy-in (vLLM's thread, before the forward):
        the side stream first waits for the kernels already queued on the compute
        stream (they may still touch blocks freed earlier). Returns the block ids
        on the device, for copy_in_layer_async."""
        compute = torch.cuda.current_stream(self.device)  # (inside the context it would be in_stream)
        with torch.cuda.stream(self.in_stream):
            self.in_stream.wait_stream(compute)
            return torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)

    def copy_in_layer_async(self, index: int, idx, bufs: list[int]):
        """Queue layer `index` of verified blocks, pinned staging -> KV cache, on
        the side stream; returns the event recorded after it. Nothing here waits:
        the compute stream waits on the event before that layer's attention, and
        the staging buffers are given back once the last event has completed."""
        layer, a, b = list(self._cols())[index]
        n = len(bufs)
        with torch.cuda.stream(self.in_stream):
            # allocated on the side stream: the allocator reuses it only after this stream's work
            dev = torch.empty(n, b - a, dtype=torch.uint8, device=self.device)
            self._rows_in(dev, bufs, a)  # rows of the pinned arena: DMA, no host gather
            layer.view.index_copy_(0, idx, dev.view(layer.dtype).view(n, *layer.block_shape))
            ev = torch.cuda.Event()
            ev.record(self.in_stream)
        return ev

    def _rows_out(self, buf, bufs: list[int]) -> None:
        """On the current (copy) stream: buf's first len(bufs) rows into the payloads of these
        staging buffers."""
        h, n = fmt.HEADER_BYTES, len(bufs)
        if self._batch is None:
            for i, s in enumerate(bufs):
                self._rows[s, h : h + self.payload_bytes].copy_(buf[i], non_blocking=True)
            return
        src = row_addrs(buf, torch.arange(n))
        self._batch(
            src, row_addrs(self._rows, torch.tensor(bufs), h), torch.full((n,), buf.shape[1], dtype=torch.int64)
        )

    def _rows_in(self, dev, bufs: list[int], at: int) -> None:
        """On the current (side) stream: bytes [at, at + row) of these staging buffers into the
        rows of dev (contiguous, a row per buffer)."""
        n, width = len(bufs), dev.shape[1]
        if self._batch is None:
            for i, s in enumerate(bufs):
                dev[i].copy_(self._rows[s, at : at + width], non_blocking=True)
            return
        src = row_addrs(self._rows, torch.tensor(bufs), at)
        self._batch(src, row_addrs(dev, torch.arange(n)), torch.full((n,), width, dtype=torch.int64))

    def close(self) -> None:
        if getattr(self, "_crc_host", None) is not None:
            torch.cuda.cudart().cudaHostUnregister(self._crc_host.data_ptr())
            self._crc_host = None
        if getattr(self, "_registered", False):  # attach may have failed before pinning (or another device pinned)
            torch.cuda.cudart().cudaHostUnregister(self.pool.arena.addr)
            self._registered = False
            self.pool.pinned_by = None


def pin_host(addr: int, size: int, what: str) -> None:
    """Page-lock host memory for DMA (cudaHostRegister); RuntimeError naming `what` if refused."""
    rc = torch.cuda.cudart().cudaHostRegister(addr, size, 0)
    if int(rc) != 0:
        raise RuntimeError(f"aiokv: cudaHostRegister of {what} failed ({rc})")


def row_addrs(rows: torch.Tensor, index: torch.Tensor, at: int = 0) -> torch.Tensor:
    """The addresses (int64, on the CPU) of byte `at` of these rows of a 2-D byte tensor."""
    return index.to(torch.int64) * rows.stride(0) + (rows.data_ptr() + at)


def batch_copy_checked(batch, device, stream):
    """`batch` (swap_blocks_batch(src_ptrs, dst_ptrs, sizes)) where it copies rows right between
    `device` and pinned host memory, both ways, on `stream`: a scattered pattern out and back,
    compared here at start; else None (each row is then its own copy_), said in one line."""
    if batch is None:
        return None
    n, width = 3, 4096
    host = torch.zeros(2 * n, width, dtype=torch.uint8)
    try:
        pin_host(host.data_ptr(), host.numel(), "the batch copy's check")
    except RuntimeError as e:
        log.warning("%s; rows are copied one by one", e)
        return None
    try:
        want = torch.randint(0, 256, (n, width), dtype=torch.uint8)
        where, back = torch.tensor([4, 1, 3]), torch.zeros(n, width, dtype=torch.uint8, device=device)
        src = want.to(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # src and back are made on that stream
        with torch.cuda.stream(stream):
            sizes = torch.full((n,), width, dtype=torch.int64)
            batch(row_addrs(src, torch.arange(n)), row_addrs(host, where), sizes)
            batch(row_addrs(host, where.flip(0)), row_addrs(back, torch.arange(n)), sizes)
        stream.synchronize()
        if torch.equal(host[where], want) and not host[[0, 2, 5]].any() and torch.equal(back.cpu(), want.flip(0)):
            return batch
        log.warning(
            "aiokv: the batch copy (vLLM's swap_blocks_batch) copied wrong at start; rows are copied one by one"
        )
    except Exception:
        log.exception("aiokv: the batch copy (vLLM's swap_blocks_batch) failed at start; rows are copied one by one")
    finally:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    return None


def device_crc(payload_bytes: int, device) -> RowCrc | None:
    """The payloads' CRC32C on `device` (devcrc.py), or None where it cannot serve: a payload
    not a multiple of 4 bytes, or a device whose answer differs from aiokv._native's on two
    random payloads here at start (then BlockIO's pass on the host checks them, as before)."""
    if payload_bytes % 4:
        return None
    try:
        crc = RowCrc(payload_bytes, device)
        sample = torch.randint(0, 256, (2, payload_bytes), dtype=torch.uint8)
        got = [int(v) & 0xFFFFFFFF for v in crc.rows(sample.to(device)).cpu()]
        if got == [_native.crc32c_bytes(raw_bytes(row)) for row in sample]:
            return crc
        log.warning("aiokv: the device's CRC32C disagreed with the host's at start; the host checks payloads")
    except Exception:
        log.exception("aiokv: the device's CRC32C failed at start; the host checks payloads")
    return None
