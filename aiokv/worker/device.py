# SPDX-License-Identifier: Apache-2.0
"""Device copies: whole KV blocks between vLLM's KV tensors and staging buffers.

The layout (which dimension counts blocks, a block's bytes in the payload):
aiokv/worker/kv_layout.py.

Two implementations of one interface:
- CpuDevice (every test): copies run synchronously. copy_out returns when the
  staging buffers hold the blocks, so vLLM may free or reuse the blocks as soon
  as the step that saved them has ended.
- CudaDevice (aiokv/worker/cuda.py): copies by DMA on side streams; copy_out
  returns before the bytes are in staging (`asynchronous`), and the save
  pipeline calls wait_out(bufs) before it writes them.

The CRC in the copy (`crc_in_copy`): a device whose copies pass every byte
through the CPU anyway (CpuDevice with contiguous blocks) computes the payload
CRC32C inside them, a cache-sized piece at a time, instead of a second pass
over the buffer in BlockIO. copy_out(..., crc_in_copy=True) leaves each payload's CRC
in its header's payload-CRC field (then BlockIO.write(..., crc_in_copy=True));
copy_in(..., crc_in_copy=True) copies and returns, per block, whether the payload
matched the CRC in its header (after BlockIO.read(..., crc_in_copy=True)).
A block that did not match has been copied all the same: the caller must
report it as a failed load. CudaDevice makes and checks the CRC on the GPU
(worker/devcrc.py); an asynchronous device's CRCs are in the headers once
wait_out(bufs) has returned. The torch-gather fallback of CpuDevice has
crc_in_copy False and is never asked.

Layer by layer (aiokv/worker/layerwise.py): copy_in_layer (CPU) copies one
layer of verified blocks; copy_in_layer_async (CUDA) queues one layer's copies
on the side stream and returns its event, for the compute stream to wait on
before that layer's attention.

Threading contract: copy_out/after_step/begin_layers/copy_in_layer_async run on
the vLLM worker's main thread; copy_in on the worker's event-loop thread (CUDA: its copies
queued there, CudaDevice.copy_in_queued, and waited for on a thread of the loop's executor,
worker/reads.py); wait_out on a thread of the loop's executor; copy_in_layer on the layerwise
copy thread.
"""

from __future__ import annotations

import ctypes
import hashlib

import torch

from aiokv import _native
from aiokv.data import format as fmt
from aiokv.data.buffers import BufferPool
from aiokv.worker.kv_layout import Layer, LayoutError


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

    def wait_out(self, bufs: list[int] | None = None) -> None:
        """Block until the last copy_out has landed in staging memory; with `bufs` (a save's
        buffers, copied out with crc_in_copy=True), until their headers hold their CRCs too."""

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
            return raw_bytes(dev), raw_bytes(rows)
        stg = torch.cat([rows + col for _, _, col, _ in flat])
        return raw_bytes(dev), raw_bytes(stg), self._flat[0][3]

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


def raw_bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes (no numpy: a bare GPU machine may not have it)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def make_device(kv_caches, num_blocks: int, dims=None, batch_copy=None) -> Device:
    """kv_caches: {layer name: tensor} or [(layer name, tensor)]; dims: per tensor, the
    dimension that counts blocks, or None (Layer); batch_copy: for a CUDA device, vLLM's
    swap_blocks_batch where the connector found it (worker/cuda.py), or None."""
    items = list(kv_caches.items() if isinstance(kv_caches, dict) else kv_caches)
    if not items:
        raise LayoutError("aiokv: no KV tensor was registered for this KV-cache group's layers")
    devices = {t.device for _, t in items}
    if len(devices) != 1:
        raise LayoutError(
            f"aiokv: a KV-cache group's tensors are on several devices ({sorted(map(str, devices))}); "
            "this layout is not supported"
        )
    if items[0][1].is_cuda:
        from aiokv.worker.cuda import CudaDevice  # (it builds on Device: imported here, not at the top)

        return CudaDevice(items, num_blocks, dims=dims, batch_copy=batch_copy)
    return CpuDevice(items, num_blocks, dims=dims)
