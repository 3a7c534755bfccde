# SPDX-License-Identifier: Apache-2.0
"""LMCache's raw-block disk tier, driven as a contender for tools/bench_store.py --peers
and tools/peer_faults.py. Never a dependency of aiokv: the optional extra `peers`,

    .venv/bin/pip install --no-deps 'lmcache-rust-raw-block-io==0.5.7rc2' 'lmcache==0.5.7rc2'

(--no-deps: a plain install of lmcache pulls CUDA packages; RawBlockCore runs on its CPU stub
device with the torch that vLLM's CPU build brought). Two levels of it:

- RawBlockDevice (lmcache_rust_raw_block_io, Rust, io_uring): `batched_write(offsets, buffers,
  total_lens)` / `batched_read(...)` return a batch id, `wait_iouring(id)` waits for the whole
  batch and returns (per-operation success, errors). It does not cap the I/O in flight itself,
  so a caller keeps `depth` in flight by submitting depth-sized batches (each waited for before
  the next). Raw bytes: no header, no checksum; the bench writes whole slot images (aiokv's
  header + payload) from aiokv's staging buffers, so the same I/Os as aiokv's data path.
- RawBlockCore (lmcache.v1.distributed.l2_adapters.raw_block, Python over the Rust device):
  fixed slots with a 4 KiB header (magic, a 64-bit identity of the key, the payload length),
  an in-memory index checkpointed as JSON in a region at the front of the device, put_many /
  load_many_into; a key is committed to the index once its header and payload writes have
  completed. No checksum of the payload; at restart the checkpoint's entries are kept where
  the slot header's identity and length match (meta_verify_on_load). Here on a file, slot size
  = aiokv's (payload + 4096), io_uring with `iouring_queue_depth` = the bench's depth,
  O_DIRECT with zero-copy (payloads read and written in place from page-aligned buffers).

Payload memory: `Obj` hands RawBlockCore a buffer at a given address (what its MemoryObj
exposes: byte_array, data_ptr, metadata), here the payload part of an aiokv staging buffer.

Threading contract: none of its own; RawBlockDevice and RawBlockCore are called from one
thread here (they are thread-safe themselves).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
import types

INSTALL = "pip install --no-deps 'lmcache-rust-raw-block-io==0.5.7rc2' 'lmcache==0.5.7rc2'"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEER_DIR = os.path.join(ROOT, ".bench-peer")  # ignored by git: the benchmarks' own install of the peer
RAW_BLOCK_PKG = "lmcache-rust-raw-block-io==0.5.7rc2"
META_BYTES = 16 << 20  # RawBlockCore's checkpoint region here (its default is 256 MiB; the JSON fits)


def available() -> tuple[str, str]:
    """('' or why RawBlockDevice is not usable, '' or why RawBlockCore is not)."""
    try:
        import lmcache_rust_raw_block_io  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e} (install: {INSTALL})", "needs RawBlockDevice"
    try:
        _quiet()
        from lmcache.v1.distributed.l2_adapters.raw_block import RawBlockCore  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return "", f"{type(e).__name__}: {e} (install: {INSTALL})"
    return "", ""


def install_device(install: bool = True) -> str:
    """'' if LMCache's RawBlockDevice (lmcache_rust_raw_block_io) imports, from PEER_DIR
    (installed there with pip --target when missing), else why not."""
    if PEER_DIR not in sys.path:
        sys.path.append(PEER_DIR)
    try:
        import lmcache_rust_raw_block_io  # noqa: F401

        return ""
    except ImportError:
        pass
    if not install:
        return f"lmcache_rust_raw_block_io missing (pip install --target {PEER_DIR} {RAW_BLOCK_PKG})"
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", PEER_DIR, RAW_BLOCK_PKG]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        return f"{' '.join(cmd[2:])} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
    import importlib

    importlib.invalidate_caches()
    try:
        import lmcache_rust_raw_block_io  # noqa: F401, F811
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def _quiet() -> None:
    import logging

    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    for name in ("lmcache", "LMCache"):
        logging.getLogger(name).setLevel(logging.WARNING)


def make_file(path: str, size: int) -> None:
    """A fresh file of `size` bytes, allocated (as a raw device's blocks are, and as
    aiokv's store allocates its slots before they are written)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


def view(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_ubyte * n).from_address(addr)).cast("B")


def open_device(path: str, depth: int):
    from lmcache_rust_raw_block_io import RawBlockDevice

    return RawBlockDevice(path, True, use_odirect=True, io_engine="io_uring", iouring_queue_depth=depth)


def device_io(dev, write: bool, offsets: list[int], bufs: list[memoryview], length: int, depth: int) -> list[bool]:
    """Every (offset, buffer) written or read, `depth` at a time: a batch of `depth`
    submitted, waited for, then the next. Per-operation success."""
    call = dev.batched_write if write else dev.batched_read
    out: list[bool] = []
    for i in range(0, len(offsets), depth):
        bid = call(offsets[i : i + depth], bufs[i : i + depth], [length] * len(bufs[i : i + depth]))
        ok, _errors = dev.wait_iouring(bid)
        out += [bool(x) for x in ok]
    return out


def device_phases(path: str, slot: int, n: int, depth: int, addrs: list[int], settle: float) -> dict:
    """RawBlockDevice writing then reading n slot images (header + payload) from the buffers at
    `addrs` to a fresh allocated file, depth-sized batches; each phase after the file system is
    synced and `settle` s of quiet. {write_s, write_cpu_s, read_s, read_cpu_s}."""
    make_file(path, n * slot)
    dev = open_device(path, depth)
    try:
        bufs = [view(a, slot) for a in addrs[:n]]
        offs = [i * slot for i in range(n)]
        out = {}
        for rw in ("write", "read"):
            os.sync()
            if settle > 0:
                time.sleep(settle)
            p0, t0 = time.process_time(), time.perf_counter()
            ok = device_io(dev, rw == "write", offs, bufs, slot, depth)
            out[f"{rw}_s"], out[f"{rw}_cpu_s"] = time.perf_counter() - t0, time.process_time() - p0
            if not all(ok):
                raise RuntimeError(f"RawBlockDevice: {ok.count(False)} {rw}s failed")
        return out
    finally:
        dev.close()
        os.unlink(path)


class Obj:
    """What RawBlockCore reads from a memory object: the payload's bytes (byte_array), its
    address (data_ptr: page-aligned, so its zero-copy O_DIRECT path is taken) and metadata."""

    def __init__(self, addr: int, n: int):
        import torch
        from lmcache.v1.memory_management import MemoryFormat

        self.addr = addr
        self.byte_array = view(addr, n)
        self.metadata = types.SimpleNamespace(
            shape=torch.Size([n // 2]), dtype=torch.bfloat16, cached_positions=None, fmt=MemoryFormat.UNDEFINED
        )

    def data_ptr(self) -> int:
        return self.addr


def core_key(i: int, salt: int = 0):
    """RawBlockCore's key for block i ("object" namespace: the header's identity is a hash of the text)."""
    from lmcache.v1.distributed.l2_adapters.raw_block import RawBlockKeySpec, slot_identity_from_encoded_key

    enc = f"bench@0x00000000@0@{salt:08x}{i:024x}"
    return RawBlockKeySpec(encoded=enc, slot_identity=slot_identity_from_encoded_key(enc, "object"))


def open_core(path: str, slot_bytes: int, n_slots: int, depth: int, periodic: bool = False, interval: int = 60):
    """A RawBlockCore on `path` (made if missing) holding n_slots slots of slot_bytes
    (header 4 KiB included), io_uring at `depth`, O_DIRECT zero-copy, the checkpoint
    region META_BYTES; its defaults otherwise (checkpoint every `interval` s after 100 ms
    of quiet where `periodic`, verify slot headers at load, load the checkpoint at open)."""
    _quiet()
    from lmcache.v1.distributed.l2_adapters.raw_block import RawBlockCore, RawBlockCoreConfig

    size = META_BYTES + n_slots * slot_bytes
    if not os.path.exists(path):
        make_file(path, size)
    cfg = RawBlockCoreConfig(
        device_path=path,
        capacity_bytes=size,
        block_align=4096,
        header_bytes=4096,
        slot_bytes=slot_bytes,
        use_odirect=True,
        enable_zero_copy=True,
        meta_total_bytes=META_BYTES,
        meta_magic=b"LMCIDX01",
        meta_version=1,
        meta_checkpoint_interval_sec=interval,
        meta_idle_quiet_ms=100,
        meta_enable_periodic=periodic,
        meta_verify_on_load=True,
        io_engine="io_uring",
        iouring_queue_depth=depth,
    )
    return RawBlockCore(cfg, key_namespace="object")
