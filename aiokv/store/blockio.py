"""Reads and writes of whole slots in one (namespace, rank) data file.

This is the data plane: it needs no index and no lock, so a vLLM worker process
uses it directly on slot numbers chosen by the engine that owns the index.

Failure contract: every item gets its own result: 0, or -errno for an I/O
error or short transfer, or -EBADMSG for a slot that does not verify (wrong
magic, version, namespace, rank, key, length, checksum, or the MAC when a
secret is set). Nothing raises for a
bad block; a bad block is never reported as loaded.

Several engines: items name locations (format.loc: engine << 32 | slot), so a
BlockIO reads any engine's data file of its (namespace, rank), opened at first
use, and writes where it is told (its own engine's, by the Store's design).
Another engine's file is opened read-only and never created; a missing one
makes its items -ENOENT (a miss).

Threading contract: one asyncio loop thread (the one that owns the backend).
Buffers are staging slots: 4096-aligned, `slot_bytes` long, header first.

Pipelining: a call with more than PIPELINE_MIN items runs as several backend
batches of `chunk` items, so the CPU work overlaps the disk: a write stamps
(CRC32C) the next chunk while the previous ones are in the kernel, a read
verifies a chunk as soon as it has arrived while later chunks are still being
read. Cancelling a call returns only once every batch it started has ended
(each batch waits for its own operations, backend.py), so buffers are free.
"""
from __future__ import annotations

import asyncio
import ctypes
import errno
import hmac
import os

from aiokv import _native
from aiokv.io.backend import OP_READ, OP_WRITE, say_once
from aiokv.store import format as fmt
from aiokv.store.dirs import open_under

EBADMSG = -errno.EBADMSG
PIPELINE_MIN = 4  # up to this many items: one backend batch


def open_data_file(ns_dir: str, rank: int, engine: int = 0, create: bool = True) -> tuple[int, bool]:
    """Open (creating, 0600, if `create`; else read-only) engine's data file of a
    rank with O_DIRECT; buffered where the FS lacks it. ns_dir is ROOT/ns/<nsid
    hex>: every directory from ROOT down and the file itself are opened without
    following a symlink (dirs.py)."""
    root = os.path.dirname(os.path.dirname(ns_dir))
    sub = fmt.engine_dir(engine)
    dfd = open_under(root, "ns", os.path.basename(ns_dir), *([sub] if sub else []))
    name = f"rank{rank}.data"
    flags = (os.O_RDWR | os.O_CREAT if create else os.O_RDONLY) | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        try:
            return os.open(name, flags | os.O_DIRECT, 0o600, dir_fd=dfd), True
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
        say_once(f"aiokv: {ns_dir} does not support O_DIRECT; using buffered I/O there")
        return os.open(name, flags, 0o600, dir_fd=dfd), False
    finally:
        os.close(dfd)


def data_path(ns_dir: str, rank: int, engine: int = 0) -> str:
    return os.path.join(ns_dir, fmt.engine_dir(engine), f"rank{rank}.data")


class BlockIO:
    def __init__(self, backend, ns_dir: str, nsid: bytes, rank: int, payload_bytes: int, layout: int = 0,
                 secret: str | bytes | None = None):
        self.backend = backend
        self.layout = layout
        # with a secret every block carries a MAC, and a block without the right one is a miss
        self.mac_key = fmt.mac_key(secret) if secret else None
        self.nsid = nsid
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.slot_bytes = fmt.slot_bytes(payload_bytes)
        self.ns_dir = ns_dir
        self._fds: dict[tuple[int, bool], int] = {}  # (engine, writable) -> open fd
        self._open: tuple[dict[int, int], dict[int, int]] = ({}, {})  # the same by [writable][engine], for _ops

    def _fd(self, engine: int, write: bool) -> int:
        fd = self._fds.get((engine, write))
        if fd is None:
            try:
                fd, _ = open_data_file(self.ns_dir, self.rank, engine, create=write)
            except FileNotFoundError:
                if write:
                    raise
                return -1  # not there (yet): a miss, and looked for again next time
            self._fds[(engine, write)] = self._open[write][engine] = fd
        return fd

    def _ops(self, op: int, items) -> tuple[list[tuple], bool]:
        """Backend operations of items (where, key, addr), in order, and whether
        every engine's file is there (an fd of -1 marks one that is not). One
        list comprehension over the files already open; files are opened (or
        found missing) once per engine, not per item."""
        sb, mask, shift = self.slot_bytes, fmt.SLOT_MASK, fmt.ENGINE_SHIFT
        write = op == OP_WRITE
        fds = self._open[write]
        try:
            return [(op, fds[where >> shift], addr, sb, (where & mask) * sb) for where, _, addr in items], True
        except KeyError:  # a file not opened yet, or missing
            fds = {e: self._fd(e, write) for e in {where >> shift for where, _, _ in items}}
        ops = [(op, fds[where >> shift], addr, sb, (where & mask) * sb) for where, _, addr in items]
        return ops, min(fds.values()) >= 0

    def stamp(self, key: bytes, addr: int) -> None:
        """Fill the header of the staging slot at addr for `key` (payload already there)."""
        self._stamp_many([key], [addr])

    def _stamp_many(self, keys: list, addrs: list) -> None:
        """Stamp many slots: one native call (CRC32C and header of each, GIL
        released), then the MACs where a secret is set."""
        _native.stamp_slots(addrs, keys, self.nsid, self.rank, self.payload_bytes, self.layout)
        if self.mac_key is not None:
            for addr in addrs:
                raw = ctypes.string_at(addr, fmt.HDR_USED)
                ctypes.memmove(addr + fmt.MAC_OFFSET, fmt.block_mac(self.mac_key, raw, self._payload(addr)),
                               fmt.MAC_BYTES)

    def _payload(self, addr: int):
        return (ctypes.c_char * self.payload_bytes).from_address(addr + fmt.HEADER_BYTES)

    def _mac_ok(self, addr: int) -> bool:
        raw = ctypes.string_at(addr, fmt.MAC_OFFSET + fmt.MAC_BYTES)
        return hmac.compare_digest(raw[fmt.MAC_OFFSET:], fmt.block_mac(self.mac_key, raw, self._payload(addr)))

    def verify(self, key: bytes, addr: int) -> bool:
        """Whether the staging slot at addr holds `key` intact (format.check_slot, then the MAC)."""
        try:
            fmt.check_slot((ctypes.c_char * self.slot_bytes).from_address(addr), self.nsid, self.rank,
                           self.payload_bytes, key, self.layout)
        except fmt.BadBlock:
            return False
        return self.mac_key is None or self._mac_ok(addr)

    def _chunk(self) -> int:
        return max(2, getattr(self.backend, "depth", 16) // 4)

    async def write(self, items) -> list[int]:
        """items: (slot, key, addr). Stamps headers, writes, returns per-item 0/-errno."""
        sb = self.slot_bytes
        if len(items) <= PIPELINE_MIN:
            self._stamp_many([key for _, key, _ in items], [addr for _, _, addr in items])
            res = await self.backend.run(self._ops(OP_WRITE, items)[0])
        else:
            res = await self._pipelined(OP_WRITE, items)
        if res.count(sb) == len(res):  # the common case, without a Python step per item
            return [0] * len(res)
        return [0 if r == sb else (r if r < 0 else -errno.EIO) for r in res]

    async def read(self, items) -> list[int]:
        """items: (slot, key, addr). Reads and verifies; per-item 0/-errno/-EBADMSG."""
        if len(items) <= PIPELINE_MIN:
            res = await self._run_reads(items)
            return self._checked(items, res)
        return await self._pipelined(OP_READ, items)

    async def _run_reads(self, items) -> list[int]:
        """Backend reads of items; an item whose engine's file is missing: -ENOENT."""
        ops, all_there = self._ops(OP_READ, items)
        if all_there:
            return await self.backend.run(ops)
        todo = [op for op in ops if op[1] >= 0]
        res = iter(await self.backend.run(todo) if todo else [])
        return [next(res) if op[1] >= 0 else -errno.ENOENT for op in ops]

    def _checked(self, items, res) -> list[int]:
        """Per-item result of reads: the slots that arrived whole are verified in
        one native call (format.check_slot's checks, GIL released), then their MACs."""
        sb = self.slot_bytes
        whole = [i for i, r in enumerate(res) if r == sb]
        out = [r if r < 0 else -errno.EIO for r in res]
        if whole:
            verdicts = _native.verify_slots([items[i][2] for i in whole], [items[i][1] for i in whole], self.nsid,
                                            self.rank, self.payload_bytes, self.layout)
            for i, v in zip(whole, verdicts):
                out[i] = 0 if v == 0 and (self.mac_key is None or self._mac_ok(items[i][2])) else EBADMSG
        return out

    async def _pipelined(self, op: int, items) -> list:
        """Several backend batches: writes stamped chunk by chunk just before their
        batch starts; reads verified chunk by chunk as their batch ends. Returns
        raw byte counts (writes) or per-item results (reads)."""
        run = self.backend.run
        step = self._chunk()
        parts = [items[i:i + step] for i in range(0, len(items), step)]
        futs: list[asyncio.Future] = []
        out: list[int] = []
        try:
            if op == OP_WRITE:
                for k, part in enumerate(parts):
                    self._stamp_many([key for _, key, _ in part], [addr for _, _, addr in part])
                    futs.append(asyncio.ensure_future(run(self._ops(OP_WRITE, part)[0])))
                    if k + 1 < len(parts):
                        await asyncio.sleep(0)  # that batch reaches the kernel before the next is stamped
                for f in futs:
                    out += await f
            else:
                futs = [asyncio.ensure_future(self._run_reads(part)) for part in parts]
                for part, f in zip(parts, futs):
                    out += self._checked(part, await f)
        except BaseException:
            # no buffer may still be in use when this call ends: stop and wait for every batch
            for f in futs:
                f.cancel()
            while not all(f.done() for f in futs):
                try:
                    await asyncio.wait(futs)
                except asyncio.CancelledError:
                    continue
            for f in futs:
                if not f.cancelled():
                    f.exception()  # retrieved: the error that matters is re-raised below
            raise
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        for fds in self._open:
            fds.clear()
