# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect --verify`: reading and checking committed slots, read-only.

Each engine's blocks are taken a slot range at a time (CHUNK), their keys from its files
(blockkeys.py), and read through the I/O backend (IN_FLIGHT reads in flight, at most
STAGING_LIMIT of staging memory) from data files opened by the one opener
(slotfile.open_data_file, O_RDONLY), then checked by the one slot check (the native
check_slot: header, payload CRC32C; the layout tag is not checked, inspect does not know
the reader's KV layout). The corrupt blocks are kept in arrays (Bads: a wiped drive has
tens of millions), never a Python object each. A block that fails while an engine is
writing is re-checked against a fresh replay (`recheck`), so a slot the engine evicted
and rewrote meanwhile is not reported as corrupt.

Threading: one thread (the CLI's); the reads run on an event loop of their own
(`run`).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import os

import numpy as np

from aiokv import _native
from aiokv.cli.bads import Bads
from aiokv.cli.blockkeys import BlockKeys
from aiokv.cli.opening import engines_running, open_readonly
from aiokv.cli.progress import Progress
from aiokv.data import format as fmt
from aiokv.data import slotfile
from aiokv.data.backend import OP_READ
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.data.slotfile import open_data_file, open_engine_dir
from aiokv.store.store import NotAStore, ns_dir

IN_FLIGHT = 32  # verify reads in flight
STAGING_LIMIT = 256 << 20  # staging memory for verify reads, at most
CHUNK = 1 << 16  # slots whose keys are taken at a time


def _open_data(root: str, nsid: bytes, rank: int, engine: int) -> int:
    """Engine's data file of a rank, read-only (O_DIRECT where the file system has it)."""
    try:
        dfd = open_engine_dir(ns_dir(root, nsid), engine)
    except NotAStore:
        raise OSError(errno.ELOOP, "a symlink or not a directory") from None
    try:
        return open_data_file(dfd, rank, direct=True)[0]
    finally:
        os.close(dfd)


def check_slot(addr: int, nsid: bytes, rank: int, key: bytes, payload_len: int) -> str | None:
    """None if the slot at addr holds `key` intact (slotfile.check_slot); else what is wrong."""
    try:
        slotfile.check_slot(
            (ctypes.c_char * (fmt.HEADER_BYTES + payload_len)).from_address(addr), nsid, rank, payload_len, key
        )
    except fmt.BadBlock as e:
        return _reason(str(e))
    return None


def _reason(why: str) -> str:
    return why if why.startswith(("header", "payload")) else f"header {why}"


class _Reader:
    """Reads and checks slots of one namespace, IN_FLIGHT at a time (reasons: codes of `bad`)."""

    def __init__(self, backend, ns, bad: Bads, progress):
        self.backend, self.ns, self.bad, self.progress = backend, ns, bad, progress
        self.sb = ns.slot_bytes
        self.depth = max(1, min(IN_FLIGHT, STAGING_LIMIT // self.sb))
        self.pool = BufferPool(self.sb, self.depth)
        mem = (ctypes.c_char * (self.sb * self.depth)).from_address(self.pool.addr(0))
        self.view = memoryview(mem).cast("B")

    def close(self) -> None:
        self.view.release()
        self.pool.close()

    async def check(self, rank: int, fd, slots, keys, klens) -> tuple[np.ndarray, np.ndarray]:
        """Read and check these slots of one rank (fd: its data file, or why not): (which are
        bad, their reasons' codes)."""
        n, sb = len(slots), self.sb
        verdict = np.zeros(n, np.uint16)
        bad = np.zeros(n, bool)
        if not n:
            return bad, verdict
        if isinstance(fd, str):
            if self.progress:
                self.progress.add(n, 0)
            return ~bad, verdict + self.bad.code(fd)
        keyview = memoryview(np.ascontiguousarray(keys, np.uint8).reshape(-1))
        workers = min(4, self.depth)
        per = max(1, self.depth // workers)
        groups = iter(range(0, n, per))
        where = slots.tolist()
        kl = klens.tolist()

        async def worker(w: int) -> None:
            base = w * per
            for start in groups:
                stop = min(start + per, n)
                ops = [
                    (OP_READ, fd, self.pool.addr(base + i), sb, where[j] * sb) for i, j in enumerate(range(start, stop))
                ]
                res = await self.backend.run(ops)
                for i, r in enumerate(res):
                    j = start + i
                    if r < 0:
                        why = f"I/O error: {os.strerror(-r)}"
                    elif r != sb:
                        why = "short read (data file truncated)"
                    else:
                        slot = self.view[(base + i) * sb : (base + i + 1) * sb]
                        key = keyview[j * fmt.MAX_KEY : j * fmt.MAX_KEY + kl[j]]
                        v = _native.check_slot(
                            slot, self.ns.nsid, rank, self.ns.payload_bytes, key, None, _native.CHECK_SLOT
                        )
                        if not v:
                            continue
                        why = _reason(fmt.slot_reason(v, slot))
                    verdict[j], bad[j] = self.bad.code(why), True
                if self.progress:
                    self.progress.add(stop - start, (stop - start) * sb)

        await asyncio.gather(*(worker(w) for w in range(min(workers, -(-n // per)))))
        return bad, verdict


def _open_ranks(root: str, ns, engine: int) -> dict[int, int | str]:
    fds: dict[int, int | str] = {}
    for rank in range(ns.ranks):
        try:
            fds[rank] = _open_data(root, ns.nsid, rank, engine)
        except FileNotFoundError:
            fds[rank] = "data file missing"
        except OSError as e:
            fds[rank] = f"cannot open data file: {e.strerror}"
    return fds


async def verify_store(st, progress: Progress | None, bad: Bads, only: Bads | None = None) -> None:
    """Read and check every committed block of every rank of the store opened read-only, into
    `bad`; or (`only`, done) those of its blocks the store still holds at the same slot, marking
    in `only.again` the ones still bad (their reasons as found now)."""
    backend = open_backend(asyncio.get_running_loop())
    codes = bad if only is None else only
    try:
        for _, ns in sorted(st.index.namespaces.items()):
            reader = _Reader(backend, ns, codes, progress)
            try:
                for e in sorted(ns.tables):
                    fds = _open_ranks(root=st.root, ns=ns, engine=e)
                    try:
                        for rank, slots, keys, klens, tags, rows in _work(st, ns, e, only):
                            failed, why = await reader.check(rank, fds[rank], slots, keys, klens)
                            if only is None:
                                bad.add(
                                    ns.nsid,
                                    e,
                                    rank,
                                    slots[failed],
                                    keys[failed],
                                    klens[failed],
                                    tags[failed],
                                    why[failed],
                                )
                            else:
                                only.again[rows] = failed
                                only.cols["reason"][rows[failed]] = why[failed]
                    finally:
                        for fd in fds.values():
                            if isinstance(fd, int):
                                os.close(fd)
            finally:
                reader.close()
    finally:
        backend.close()


def _work(st, ns, engine: int, only: Bads | None):
    """(rank, slots, keys, key lengths, tags, rows of `only` or None) of the engine's blocks, a
    slot range at a time; with `only`, its rows the index still holds at the same slot (tag)."""
    t = ns.tables[engine]
    if only is not None:
        c = only.cols
        if ns.nsid not in only.nsids:
            return
        mine = np.flatnonzero((c["engine"] == engine) & (c["ns"] == only.nsids.index(ns.nsid)))
        for lo in range(0, len(mine), CHUNK):
            rows = mine[lo : lo + CHUNK]
            s = c["slot"][rows]
            held = s < len(t.tag)
            held[held] = t.tag[s[held]] == c["tag"][rows[held]]
            rows = rows[held]
            for rank in range(ns.ranks):
                r = rows[c["rank"][rows] == rank]
                yield rank, c["slot"][r], c["key"][r], c["klen"][r], c["tag"][r], r
        return
    fl = st.followers[(ns.nsid, engine)]
    keys_of = BlockKeys(fl.dir_fd, fl.gen)
    try:
        for lo in range(0, len(t.tag), CHUNK):
            slots = lo + np.flatnonzero(t.tag[lo : lo + CHUNK])
            if not len(slots):
                continue
            tags = t.tag[slots]
            keys, klens, found = keys_of.lookup(slots, tags)
            for rank in range(ns.ranks):
                yield rank, slots[found], keys[found], klens[found], tags[found], None
    finally:
        keys_of.close()


def run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def recheck(root: str, bad: Bads, rounds: int = 3) -> Bads:
    """Keep only failures still committed at the same slot that still fail.

    A running engine may evict a key and rewrite its slot between our replay and
    our read; each round replays again, so only a block that stays committed and
    stays bad is reported. Without an engine one round settles it."""
    for _ in range(rounds):
        bad = still_bad(root, bad)
        if not len(bad) or not engines_running(root):
            break
    return bad


def still_bad(root: str, bad: Bads) -> Bads:
    """Of `bad`, the blocks a fresh replay still has committed at the same slot that fail again."""
    st = open_readonly(root)
    try:
        bad.again = np.zeros(len(bad), bool)
        run_loop(verify_store(st, None, bad, only=bad))
        return bad.subset(bad.again)
    finally:
        bad.again = None
        st.close()
