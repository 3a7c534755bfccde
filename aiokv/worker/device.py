# SPDX-License-Identifier: Apache-2.0
"""Device copies: whole KV blocks between vLLM's KV tensors and staging buffers.

The layout (which dimension counts blocks, a block's bytes in the payload):
aiokv/worker/kv_layout.py.

Two implementations of one interface:
- CpuDevice (every test): copies run synchronously. copy_out returns when the
  staging buffers hold the blocks, so vLLM may free or reuse the blocks as soon
  as the step that saved them has ended.
- CudaDevice: gathers on the GPU and copies to pinned staging memory on a side
  stream; copy_out records an event that the compute stream waits on before the
  next step's kernels can overwrite any block (so blocks freed after the step
  are safe), and the save pipeline waits for the event before writing to disk.
  copy_in scatters on the side stream and synchronises before the load is
  reported. Checked by tools/gpu_check.py on a CUDA machine.

The CRC in the copy (`crc_in_copy`): a device whose copies pass every byte
through the CPU anyway (CpuDevice with contiguous blocks) computes the payload
CRC32C inside them, a cache-sized piece at a time, instead of a second pass
over the buffer in BlockIO. copy_out(..., crc_in_copy=True) leaves each payload's CRC
in its header's payload-CRC field (then BlockIO.write(..., crc_in_copy=True));
copy_in(..., crc_in_copy=True) copies and returns, per block, whether the payload
matched the CRC in its header (after BlockIO.read(..., crc_in_copy=True)).
A block that did not match has been copied all the same: the caller must
report it as a failed load. CudaDevice makes and checks the CRC on the GPU
(worker/devcrc.py) over the rows its copies gather, where its answer equals
the host's at attach (device_crc). The torch-gather fallback of CpuDevice has
crc_in_copy False and is never asked.

Layer by layer (aiokv/worker/layerwise.py): copy_in_layer (CPU) copies one
layer of verified blocks; copy_in_layer_async (CUDA) queues one layer's copies
on the side stream and returns its event, for the compute stream to wait on
before that layer's attention.

Threading contract: copy_out/after_step/begin_layers/copy_in_layer_async run on
the vLLM worker's main thread; copy_in and wait_out on the worker's event-loop thread;
copy_in_layer on the layerwise copy thread.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging

import torch

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.worker.devcrc import RowCrc
from aiokv.worker.kv_layout import Layer, LayoutError

log = logging.getLogger("aiokv")

GATHER_BYTES = 32 << 20  # device memory a CUDA save gathers through, at most (outside vLLM's budget)


class Device:
    """Copies blocks of the registered layers to and from staging buffers."""

    asynchronous = False  # True: copy_out returns before the bytes are in staging
    crc_in_copy = False  # True: copy_out/copy_in take crc_in_copy=True (set by attach)
    # default count of threads that checksum off the worker's loop thread (TransferWorker)
    checksum_threads = 0

    def __init__(self, kv_caches, num_blocks: int, pool: BufferPool | None = None, dims=None):
        """kv_caches: {layer name: tensor}, or [(layer name, tensor)] (kv_tensors: a layer may
        have several tensors, in order); dims: per tensor, in that order, the dimension that
        counts blocks, or None (Layer)."""
        self.num_blocks = num_blocks
        items = list(kv_caches.items() if isinstance(kv_caches, dict) else kv_caches)
        dims = list(dims) if dims is not None else [None] * len(items)
        self.layers = [Layer(n, t, num_blocks, d) for (n, t), d in zip(items, dims)]
        if not self.layers:
            raise LayoutError("aiokv: no KV tensor was registered for this KV-cache group's layers")
        self.payload_bytes = sum(layer.nbytes for layer in self.layers)
        sig = repr([layer.signature for layer in self.layers]).encode()
        # the layout tag binds the in-memory layout into every block header
        self.layout_tag = int.from_bytes(hashlib.blake2b(sig, digest_size=8).digest(), "little")
        self.pool = pool

    def attach(self, pool: BufferPool) -> None:
        self.pool = pool
        self._rows = pool.arena.tensor().view(pool.count, pool.slot_bytes)

    def _cols(self):
        off = fmt.HEADER_BYTES
        for layer in self.layers:
            yield layer, off, off + layer.nbytes
            off += layer.nbytes

    def copy_out(self, block_ids: list[int], bufs: list[int], crc_in_copy: bool = False) -> None:
        """KV blocks -> staging buffers' payloads; crc_in_copy (only where the device has it):
        each payload's CRC32C is also left in its buffer's header, for BlockIO.write(crc_in_copy=True)."""
        raise NotImplementedError

    def wait_out(self) -> None:
        """Block until the last copy_out has landed in staging memory."""

    def after_step(self) -> None:
        """Called once per step after copy_out, before the next step's kernels."""

    def before_loads(self) -> None:
        """Called on vLLM's thread when loads are handed to the loop (orders them after its kernels)."""

    def copy_in(self, block_ids: list[int], bufs: list[int], crc_in_copy: bool = False) -> list[bool] | None:
        """Staging buffers' payloads -> KV blocks. crc_in_copy (only where the device has it):
        returns per block whether its payload matched the CRC in its buffer's header
        (a block that did not was copied anyway: a failed load); else None."""
        raise NotImplementedError

    def copy_in_layer(self, index: int, block_ids: list[int], bufs: list[int]) -> None:
        """Only layer `index` of the blocks, staging -> KV cache (synchronous devices)."""
        raise NotImplementedError

    def close(self) -> None:
        """Give back what attach() took (pinned registrations)."""


class CpuDevice(Device):
    """Layers whose blocks are contiguous (the CPU backend's layout) are copied
    with one native call per step (memcpy per block and layer, GIL released);
    others with torch gathers/scatters."""

    def attach(self, pool: BufferPool) -> None:
        super().attach(pool)
        flat = []
        for layer, a, _ in self._cols():
            if layer.view[0].is_contiguous():
                flat.append((layer.view.data_ptr(), layer.view.stride(0) * layer.view.element_size(), a, layer.nbytes))
        self._flat = flat if len(flat) == len(self.layers) and len({f[3] for f in flat}) == 1 else None
        self.crc_in_copy = self._flat is not None

    def _addrs(self, block_ids, bufs, flat=None, bases=False):
        """(device addresses, staging addresses, bytes per layer) as int64 arrays,
        layer-major (of the layers in `flat`, default all); with `bases`
        (device addresses, buffer addresses): the arguments of the copies with the CRC."""
        # raw addresses: an id out of range would be memory corruption, not an IndexError
        if (
            len(block_ids) != len(bufs)
            or min(block_ids) < 0
            or max(block_ids) >= self.num_blocks
            or min(bufs) < 0
            or max(bufs) >= self.pool.count
        ):
            raise IndexError(f"aiokv: block ids or staging buffers out of range ({len(block_ids)} blocks)")
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        rows = torch.tensor(bufs, dtype=torch.int64) * self.pool.slot_bytes + self.pool.arena.addr
        flat = self._flat if flat is None else flat
        dev = torch.cat([base + blocks * stride for base, stride, _, _ in flat])
        if bases:
            return _raw(dev), _raw(rows)
        stg = torch.cat([rows + col for _, _, col, _ in flat])
        return _raw(dev), _raw(stg), self._flat[0][3]

    def copy_out(self, block_ids, bufs, crc_in_copy=False):
        if crc_in_copy:
            dev, stg = self._crc_addrs(block_ids, bufs)
            _native.memcpy_crc_out(stg, dev, self._flat[0][3])
        else:
            self._copy(block_ids, bufs, out=True)

    def copy_in(self, block_ids, bufs, crc_in_copy=False):
        if crc_in_copy:
            dev, stg = self._crc_addrs(block_ids, bufs)
            return [v == 0 for v in _native.memcpy_crc_in(dev, stg, self._flat[0][3])]
        self._copy(block_ids, bufs, out=False)

    def _crc_addrs(self, block_ids, bufs):
        if not self.crc_in_copy:
            raise ValueError(
                "aiokv: this KV layout is copied by torch, without checksums; "
                "call copy_out/copy_in with crc_in_copy=False"
            )
        return self._addrs(block_ids, bufs, bases=True)

    def copy_in_layer(self, index, block_ids, bufs):
        self._copy(block_ids, bufs, out=False, only=index)

    def _copy(self, block_ids, bufs, out: bool, only: int | None = None) -> None:
        """KV blocks -> staging buffers (out) or back, whole blocks of every layer
        (or of layer `only`)."""
        if self._flat is not None:
            flat = None if only is None else self._flat[only : only + 1]
            dev, stg, nbytes = self._addrs(block_ids, bufs, flat)
            _native.memcpy_many(stg, dev, nbytes) if out else _native.memcpy_many(dev, stg, nbytes)
            return
        blocks = torch.tensor(block_ids, dtype=torch.long)
        rows = torch.tensor(bufs, dtype=torch.long)
        n = len(block_ids)
        for i, (layer, a, b) in enumerate(self._cols()):
            if only is not None and i != only:
                continue
            if out:
                self._rows[:, a:b].index_copy_(
                    0, rows, layer.view.index_select(0, blocks).reshape(n, -1).view(torch.uint8)
                )
            else:
                src = self._rows[:, a:b].index_select(0, rows).view(layer.dtype).view(n, *layer.block_shape)
                layer.view.index_copy_(0, blocks, src)


def _raw(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes (no numpy: a bare GPU machine may not have it)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def gather_rows(payload_bytes: int, limit: int = GATHER_BYTES) -> int:
    """Blocks the fixed device gather buffer holds (at least one)."""
    return max(1, limit // payload_bytes)


class CudaDevice(Device):
    """Saves gather through one fixed device buffer of `gather_rows` blocks, reused
    chunk after chunk on the copy stream (stream order makes the reuse safe), so a
    save of any size takes GATHER_BYTES of device memory at most, allocated once at
    start, and the CRC's temporaries (devcrc.py: about 9 x its 16 MiB pieces) while it
    runs; a load copies GATHER_BYTES of blocks at a time. Only the last copy's event is kept."""

    asynchronous = True
    # the copies are DMA and the host's cores are free: the checksums of a node's several
    # drives would be more than one loop thread can do (docs/benchmarks.md, "One worker's ceiling")
    checksum_threads = 2

    def attach(self, pool: BufferPool) -> None:
        super().attach(pool)
        # pin the staging arena once (not many small pinned buffers) so copies are DMA; the
        # KV-cache groups of one process share it (worker/host.py): the first device pins it
        if getattr(pool, "pinned_by", None) is None:
            rc = torch.cuda.cudart().cudaHostRegister(pool.arena.addr, pool.arena.size, 0)
            if int(rc) != 0:
                raise RuntimeError(f"aiokv: cudaHostRegister of the staging arena failed ({rc})")
            self._registered = True
            pool.pinned_by = self
        self.device = self.layers[0].view.device
        self.out_stream = torch.cuda.Stream(self.device)
        self.in_stream = torch.cuda.Stream(self.device)
        self._out_event = None
        rows = min(gather_rows(self.payload_bytes, GATHER_BYTES), pool.count)
        with torch.cuda.stream(self.out_stream):  # its memory belongs to the copy stream
            self._gather = torch.empty(rows, self.payload_bytes, dtype=torch.uint8, device=self.device)
        self._crc = device_crc(self.payload_bytes, self.device)
        self.crc_in_copy = self._crc is not None

    def copy_out(self, block_ids, bufs, crc_in_copy=False):
        h, at = fmt.HEADER_BYTES, fmt.PAYLOAD_CRC_OFFSET
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
                for i, s in enumerate(part):
                    self._rows[s, h : h + self.payload_bytes].copy_(buf[i], non_blocking=True)
                if crc_in_copy:  # each payload's CRC32C, made here, into its header (devcrc.py)
                    crc = self._crc.rows(buf[:n]).view(torch.uint8).view(n, 4)
                    for i, s in enumerate(part):
                        self._rows[s, at : at + 4].copy_(crc[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.out_stream)
        self._out_event = ev  # the copy stream is in order: the last event covers every copy

    def after_step(self) -> None:
        # the next step's kernels may overwrite freed blocks only after our reads
        if self._out_event is not None:
            torch.cuda.current_stream(self.device).wait_event(self._out_event)

    def wait_out(self) -> None:
        ev = self._out_event
        if ev is not None:
            ev.synchronize()

    def before_loads(self) -> None:
        # vLLM computes on its own (non-default) stream: the loads' copies must come
        # after the kernels already queued there, which may still touch freed blocks
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._compute_event = ev

    def copy_in(self, block_ids, bufs, crc_in_copy=False):
        torch.cuda.set_device(self.device)  # called from the loop thread
        h, at, step = fmt.HEADER_BYTES, fmt.PAYLOAD_CRC_OFFSET, len(self._gather)
        ok: list[bool] = []
        with torch.cuda.stream(self.in_stream):
            if getattr(self, "_compute_event", None) is not None:
                self.in_stream.wait_event(self._compute_event)
            for c in range(0, len(block_ids), step):  # as many blocks at a time as a save gathers
                part = bufs[c : c + step]
                n = len(part)
                idx = torch.tensor(block_ids[c : c + step], dtype=torch.long, device=self.device)
                # allocated on the side stream: the allocator reuses it only after this stream's work
                dev = torch.empty(n, self.payload_bytes, dtype=torch.uint8, device=self.device)
                for i, s in enumerate(part):  # rows of the pinned arena: DMA, no pass of the host's over them
                    dev[i].copy_(self._rows[s, h : h + self.payload_bytes], non_blocking=True)
                if crc_in_copy:  # checked against each header's CRC (a mismatch: copied, and a failed load)
                    want = self._rows[torch.tensor(part, dtype=torch.long), at : at + 4].contiguous()
                    want = want.view(torch.int32).view(n)
                    ok += (self._crc.rows(dev).cpu() == want).tolist()
                for layer, a, b in self._cols():
                    layer.view.index_copy_(0, idx, dev[:, a - h : b - h].view(layer.dtype).view(n, *layer.block_shape))
        self.in_stream.synchronize()
        return ok if crc_in_copy else None

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
            for i, s in enumerate(bufs):  # rows of the pinned arena: DMA, no host gather
                dev[i].copy_(self._rows[s, a:b], non_blocking=True)
            layer.view.index_copy_(0, idx, dev.view(layer.dtype).view(n, *layer.block_shape))
            ev = torch.cuda.Event()
            ev.record(self.in_stream)
        return ev

    def close(self) -> None:
        if getattr(self, "_registered", False):  # attach may have failed before pinning (or another device pinned)
            torch.cuda.cudart().cudaHostUnregister(self.pool.arena.addr)
            self._registered = False
            self.pool.pinned_by = None


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
        if got == [_native.crc32c_bytes(_raw(row)) for row in sample]:
            return crc
        log.warning("aiokv: the device's CRC32C disagreed with the host's at start; the host checks payloads")
    except Exception:
        log.exception("aiokv: the device's CRC32C failed at start; the host checks payloads")
    return None


def make_device(kv_caches, num_blocks: int, dims=None) -> Device:
    """kv_caches: {layer name: tensor} or [(layer name, tensor)]; dims: per tensor, the
    dimension that counts blocks, or None (Layer)."""
    items = list(kv_caches.items() if isinstance(kv_caches, dict) else kv_caches)
    if not items:
        raise LayoutError("aiokv: no KV tensor was registered for this KV-cache group's layers")
    devices = {t.device for _, t in items}
    if len(devices) != 1:
        raise LayoutError(
            f"aiokv: a KV-cache group's tensors are on several devices ({sorted(map(str, devices))}); "
            "this layout is not supported"
        )
    cls = CudaDevice if items[0][1].is_cuda else CpuDevice
    return cls(items, num_blocks, dims=dims)
