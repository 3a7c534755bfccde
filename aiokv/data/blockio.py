# SPDX-License-Identifier: Apache-2.0
"""Reads and writes of whole slots in one (namespace, rank) data file.

This is the data plane: it needs no index and no lock, so a vLLM worker process
uses it directly on slot numbers chosen by the engine that owns the index.

Failure contract: every item gets its own result: 0, or -errno for an I/O
error or short transfer, or -EBADMSG for a slot that does not verify (wrong
magic, version, namespace, rank, key, length, checksum, or the MAC when a
secret is set). Nothing raises for a
bad block; a bad block is never reported as loaded (with read's
crc_in_copy=True, the payload's checksum is left to the caller's device copy).

Several engines: items name locations (format.loc: engine << 32 | slot), so a
BlockIO reads any engine's data file of its (namespace, rank), opened at first
use, and writes where it is told (its own engine's, by the Store's design).
Another engine's file is opened read-only and never created; a missing one
makes its items -ENOENT (a miss). The files are datafiles.py's: opened on a
short-lived thread of their own, awaited, so that on a mount that hangs an
`open` never holds the loop thread (a load's timeout runs there); a missing
file is looked for again at most every MISSING_RETRY seconds.

Threading contract: one asyncio loop thread (the one that owns the backend).
Buffers are staging buffers (data/buffers.py): 4096-aligned, `slot_bytes` long (one slot image),
header first.

The CRC in the copy (`crc_in_copy`): a device that copies and checksums in one pass
(worker/device.py) leaves the payload CRC in the header on saves, so
`write(..., crc_in_copy=True)` does not read the payload again; on loads it checks
the payload CRC while copying, so `read(..., crc_in_copy=True)` checks everything else (the
header: format.check_header). Either way a slot on disk is what docs/format.md
says. With a secret the stamp and check calls (format.stamp_slots,
verify_slots) also hash each payload for its MAC, in the same call.

Pipelining: a call with more than PIPELINE_MIN items runs as several backend
batches of `chunk` items, so the CPU work overlaps the disk: a write stamps
(CRC32C) the next chunk while the previous ones are in the kernel (on the
checksum threads up to a queue depth ahead, so the ring always has stamped
writes to replace each completion with), a read verifies a chunk as soon as it
has arrived while later chunks are still being read. Cancelling a call returns only once every batch it started has ended
(each batch waits for its own operations, backend.py), so buffers are free.

Checksum threads (`cpu`, an Executor; None: everything on the loop thread): a
stamp or verify call over at least SPREAD_MIN_BYTES of payload runs on those
threads (the calls release the GIL), so the loop thread only submits and
reaps, and the chunks of one call are checked on several cores at once. Where
the device copy checks the payloads (crc_in_copy=True) the
calls read only headers and stay on the loop, unless a secret's MAC (computed
and checked in the same calls) reads the payloads. A call cancelled while a thread
is still stamping or verifying its slots returns only once that thread is done
with them, like the I/O above.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno

from aiokv.data import format as fmt
from aiokv.data.backend import OP_READ, OP_WRITE
from aiokv.data.datafiles import DataFiles
from aiokv.data.slotfile import check_slot
from aiokv.util.loops import settle, waited

EBADMSG = -errno.EBADMSG
PIPELINE_MIN = 4  # up to this many items: one backend batch
# payload bytes from which a stamp/verify call goes to the checksum threads: a hand-off
# costs tens of microseconds, as much as checking about half a MiB that is not in cache
SPREAD_MIN_BYTES = 1 << 20
CHUNK_MIN_BYTES = 4 << 20  # see BlockIO._chunk
# a call's chunks checked on the checksum threads: at least this much payload each (see BlockIO._chunk;
# 0: CHUNK_MIN_BYTES, as before issue 36), and stamped up to this many queue depths ahead of the
# kernel (0: stamped-or-written within one queue depth, as before); docs/benchmarks.md, "Beside LMCache's NVMe tier"
SPREAD_CHUNK_BYTES = 4 << 20
STAMP_AHEAD_DEPTHS = 1


class BlockIO:
    def __init__(
        self,
        backend,
        ns_dir: str,
        nsid: bytes,
        rank: int,
        payload_bytes: int,
        layout: int = 0,
        secret: str | bytes | None = None,
        cpu=None,
    ):
        self.backend = backend
        self.cpu = cpu  # checksum threads (see the module docstring) or None
        self.layout = layout
        # with a secret every block carries a MAC, and a block without the right one is a miss
        self.mac_key = fmt.mac_key(secret) if secret else None
        self.nsid = nsid
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.slot_bytes = fmt.slot_bytes(payload_bytes)
        self.ns_dir = ns_dir
        self.files = DataFiles(ns_dir, rank)  # the data files, by engine (datafiles.py)

    def fds(self) -> list[int]:
        """Every data file this BlockIO has open."""
        return self.files.fds()

    def _ops(self, op: int, items) -> tuple[list[tuple], bool]:
        """Backend operations of items (where, key, addr), in order, and whether
        every engine's file is there (an fd of -1 marks one that is not). One
        list comprehension over the files already open; files are opened (or
        found missing) once per engine, not per item."""
        sb, mask, shift = self.slot_bytes, fmt.SLOT_MASK, fmt.ENGINE_SHIFT
        write = op == OP_WRITE
        fds = self.files.open[write]
        try:
            return [(op, fds[where >> shift], addr, sb, (where & mask) * sb) for where, _, addr in items], True
        except KeyError:  # a file not opened yet, or missing
            fds = {e: self.files.fd(e, write) for e in {where >> shift for where, _, _ in items}}
        ops = [(op, fds[where >> shift], addr, sb, (where & mask) * sb) for where, _, addr in items]
        return ops, min(fds.values()) >= 0

    def stamp(self, key: bytes, addr: int) -> None:
        """Fill the header of the staging buffer at addr for `key` (payload already there)."""
        fmt.stamp_slots([addr], [key], self.nsid, self.rank, self.payload_bytes, self.layout, False, self.mac_key)

    def _reads_payload(self, crc_in_copy: bool, n: int) -> int:
        """Payloads a slot call over n slots reads: none when their CRC is the
        copy's and there is no MAC to compute."""
        return 0 if crc_in_copy and self.mac_key is None else n

    async def _stamp_many(self, keys: list, addrs: list, crc_in_copy: bool, tenant: bytes) -> None:
        """Stamp many slots: one call (format.stamp_slots: CRC32C and header of each,
        and the MAC where a secret is set, GIL released; crc_in_copy: the payload
        CRC is already in each header; tenant: the tag each header carries)."""
        await self._slot_call(
            self._reads_payload(crc_in_copy, len(addrs)),
            fmt.stamp_slots,
            addrs,
            keys,
            self.nsid,
            self.rank,
            self.payload_bytes,
            self.layout,
            crc_in_copy,
            self.mac_key,
            tenant,
        )

    def _spreads(self, payloads: int) -> bool:
        """Whether a slot call over that many payloads goes to the checksum threads."""
        return self.cpu is not None and payloads * self.payload_bytes >= SPREAD_MIN_BYTES

    async def _slot_call(self, payloads: int, fn, *args):
        """fn(*args), a slot call (format.stamp_slots, verify_slots: the GIL released
        while they read payloads) over `payloads` payloads: inline, or on the
        checksum threads when it is big enough to be worth the hand-off. Cancelled,
        it returns only once the thread has let go of the slots (the caller may
        free them then)."""
        if not self._spreads(payloads):
            return fn(*args)
        return await waited(fn, *args, executor=self.cpu)

    def verify(self, key: bytes, addr: int) -> bool:
        """Whether the staging buffer at addr holds `key` intact (check_slot: the format's checks, then the MAC)."""
        try:
            check_slot(
                (ctypes.c_char * self.slot_bytes).from_address(addr),
                self.nsid,
                self.rank,
                self.payload_bytes,
                key,
                self.layout,
                self.mac_key,
            )
        except fmt.BadBlock:
            return False
        return True

    def _chunk(self, spread: bool = False) -> int:
        """Items per backend batch of a pipelined call: a quarter of the queue depth,
        but at least CHUNK_MIN_BYTES of payload (up to the depth): each batch costs a
        task and a wake-up, which at small blocks cost more than the finer overlap
        saved (4 MiB, not 1: 3-9 % less CPU per block at 256 KiB depth 16 and 1 MiB
        depth 4, the same GB/s; docs/benchmarks.md "Where the time goes"). Where the chunks go to the
        checksum threads (spread), at least SPREAD_CHUNK_BYTES (up to the depth):
        each is also a hand-off to a thread and back (25-50 µs of CPU on this VM),
        and the threads, at over 10 GB/s each, keep ahead of a disk anyway (writes:
        see _pipelined); a read's last chunk is checked after it has arrived, 4 MiB
        in about 0.2 ms."""
        depth = getattr(self.backend, "depth", 16)
        least = (SPREAD_CHUNK_BYTES or CHUNK_MIN_BYTES) if spread else CHUNK_MIN_BYTES
        return max(2, depth // 4, min(depth, -(-least // self.payload_bytes)))

    def _entries(self, n: int) -> int:
        """Kernel entries (the depth's unit) a batch of n adjacent slots takes: n, or fewer
        where the backend merges adjacent writes (its merge_bytes: data/uring.py, data/threads.py)."""
        per = self.backend.merge_bytes // self.slot_bytes
        return -(-n // per) if per > 1 else n

    async def write(
        self, items, crc_in_copy: bool = False, *, tenant: bytes = fmt.NO_TENANT, abandon=None, waiting=None
    ) -> list[int]:
        """items: (slot, key, addr). Stamps headers, writes, returns per-item 0/-errno.
        crc_in_copy: each payload's CRC32C is already at its header's payload-CRC
        field (Device.copy_out(..., crc_in_copy=True)); the payloads are not read.
        tenant: the tag (format.tenant_tag) stamped into each slot's header (a save's,
        worker/saves.py). abandon: the backend's abandon-mode callback (data/backend.py)
        or None. waiting: DriveIO's (data/drives.py); one drive adds nothing to it."""
        sb = self.slot_bytes
        await self.files.ensure_open(True, items)
        if len(items) <= PIPELINE_MIN:
            await self._stamp_many([key for _, key, _ in items], [addr for _, _, addr in items], crc_in_copy, tenant)
            res = await self.backend.run(self._ops(OP_WRITE, items)[0], abandon)
        else:
            res = await self._pipelined(OP_WRITE, items, crc_in_copy, tenant, abandon)
        if res.count(sb) == len(res):  # the common case, without a Python step per item
            return [0] * len(res)
        return [0 if r == sb else (r if r < 0 else -errno.EIO) for r in res]

    async def read(self, items, crc_in_copy: bool = False, *, abandon=None, waiting=None) -> list[int]:
        """items: (slot, key, addr). Reads and verifies; per-item 0/-errno/-EBADMSG.
        crc_in_copy=True: everything but the payload CRC is checked (the
        header, and the MAC with a secret); the caller must check that CRC
        before it trusts the payload (Device.copy_in(..., crc_in_copy=True)).
        abandon, waiting: as for `write`."""
        await self.files.ensure_open(False, items)
        if len(items) <= PIPELINE_MIN:
            res = await self._run_reads(items, abandon)
            return await self._checked(items, res, crc_in_copy)
        return await self._pipelined(OP_READ, items, crc_in_copy, fmt.NO_TENANT, abandon)

    async def _run_reads(self, items, abandon) -> list[int]:
        """Backend reads of items; an item whose engine's file is missing: -ENOENT."""
        ops, all_there = self._ops(OP_READ, items)
        if all_there:
            return await self.backend.run(ops, abandon)
        todo = [op for op in ops if op[1] >= 0]
        res = iter(await self.backend.run(todo, abandon) if todo else [])
        return [next(res) if op[1] >= 0 else -errno.ENOENT for op in ops]

    async def _checked(self, items, res, crc_in_copy: bool = False) -> list[int]:
        """Per-item result of reads: the slots that arrived whole are verified in
        one call (format.verify_slots: the slot check format.check_slot makes,
        the MAC with a secret among its checks, over the batch, GIL released;
        without the payload CRC with crc_in_copy)."""
        sb, n = self.slot_bytes, len(res)
        whole = range(n) if res.count(sb) == n else [i for i, r in enumerate(res) if r == sb]
        out = [r if r < 0 else -errno.EIO for r in res]
        if not whole:
            return out
        pick = items if len(whole) == n else [items[i] for i in whole]
        verdicts = await self._slot_call(
            self._reads_payload(crc_in_copy, len(whole)),
            fmt.verify_slots,
            [it[2] for it in pick],
            [it[1] for it in pick],
            self.nsid,
            self.rank,
            self.payload_bytes,
            self.layout,
            crc_in_copy,
            self.mac_key,
        )
        if len(whole) == n and not any(verdicts):
            return [0] * n  # the common case, without a Python step per item
        for i, v in zip(whole, verdicts):
            out[i] = 0 if v == 0 else EBADMSG
        return out

    async def _pipelined(self, op: int, items, crc_in_copy: bool, tenant: bytes, abandon) -> list:
        """Several backend batches: writes stamped chunk by chunk just before their
        batch starts; reads verified chunk by chunk as their batch ends. Returns
        raw byte counts (writes) or per-item results (reads)."""
        run = self.backend.run
        spread = self._spreads(self._reads_payload(crc_in_copy, self._chunk()))
        step = self._chunk(spread)
        parts = [items[i : i + step] for i in range(0, len(items), step)]
        futs: list[asyncio.Future] = []
        out: list[int] = []
        try:
            if op == OP_WRITE and not spread:
                # stamped here, on the loop thread: each batch reaches the kernel before the next is stamped
                for k, part in enumerate(parts):
                    await self._stamp_many(
                        [key for _, key, _ in part], [addr for _, _, addr in part], crc_in_copy, tenant
                    )
                    futs.append(asyncio.ensure_future(run(self._ops(OP_WRITE, part)[0], abandon)))
                    if k + 1 < len(parts):
                        await asyncio.sleep(0)
            elif op == OP_WRITE:
                # chunks stamped on the checksum threads, each batch started when its chunk is stamped,
                # stamping up to STAMP_AHEAD_DEPTHS queue depths ahead of the kernel: the ring keeps
                # `depth` writes in the kernel and queues the stamped rest, so each completion is
                # replaced at once from stamped slots, not after a hand-off to a thread and back (with
                # stamped-or-written bounded by one depth, the kernel held less than the depth while
                # each chunk was stamped: 0.71-0.91 x RawBlockDevice, docs/benchmarks.md, "Beside LMCache's NVMe tier").
                # Bounded, so that stamping runs at the disk's pace and leaves the cores to the loop.
                # Counted in kernel entries: merged, a chunk of 256 KiB slots is one entry, and a bound
                # in chunks held the kernel at 1-2 entries (secret saves at 256 KiB: 0.64-0.82 x fio).
                depth = getattr(self.backend, "depth", 16)
                room = asyncio.Semaphore(max(2, -(-depth * (1 + STAMP_AHEAD_DEPTHS) // self._entries(step))))
                futs = [
                    asyncio.ensure_future(self._stamp_and_write(part, crc_in_copy, room, tenant, abandon))
                    for part in parts
                ]
            else:
                # each chunk verified as soon as it has arrived (on the checksum threads when big enough)
                futs = [asyncio.ensure_future(self._read_and_check(part, crc_in_copy, abandon)) for part in parts]
            for f in futs:
                out += await f
        except BaseException:
            # no buffer may still be in use when this call ends: stop and wait for every batch
            for f in futs:
                f.cancel()
            await settle(futs)
            for f in futs:
                if not f.cancelled():
                    f.exception()  # retrieved: the error that matters is re-raised below
            raise
        return out

    async def _stamp_and_write(
        self, part, crc_in_copy: bool, room: asyncio.Semaphore, tenant: bytes, abandon
    ) -> list[int]:
        async with room:
            await self._stamp_many([key for _, key, _ in part], [addr for _, _, addr in part], crc_in_copy, tenant)
            return await self.backend.run(self._ops(OP_WRITE, part)[0], abandon)

    async def _read_and_check(self, part, crc_in_copy: bool, abandon) -> list[int]:
        return await self._checked(part, await self._run_reads(part, abandon), crc_in_copy)

    def close(self) -> None:
        self.files.close()
