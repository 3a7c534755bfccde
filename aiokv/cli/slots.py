# SPDX-License-Identifier: Apache-2.0
"""`aiokv inspect --verify`: reading and checking committed slots, read-only.

Each slot is read through the I/O backend (IN_FLIGHT reads in flight, at most
STAGING_LIMIT of staging memory), from data files opened by the one opener
(slotfile.open_data_file, O_RDONLY), and checked by the one slot check
(slotfile.check_slot: header, payload CRC32C; the layout tag is not checked,
inspect does not know the reader's KV layout). A block that fails while an
engine is writing is re-checked against a fresh replay (`recheck`), so a slot
the engine evicted and rewrote meanwhile is not reported as corrupt.

Threading: one thread (the CLI's); the reads run on an event loop of their own
(`run`).
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import os
import sys
import time

from aiokv.cli.opening import engines_running, open_readonly
from aiokv.data import format as fmt
from aiokv.data import slotfile
from aiokv.data.backend import OP_READ
from aiokv.data.buffers import BufferPool
from aiokv.data.choice import open_backend
from aiokv.data.slotfile import open_data_file, open_engine_dir
from aiokv.store.store import NotAStore, Store, ns_dir

IN_FLIGHT = 32  # verify reads in flight
STAGING_LIMIT = 256 << 20  # staging memory for verify reads, at most


@dataclasses.dataclass(frozen=True)
class Bad:
    nsid: bytes
    key: bytes
    rank: int
    slot: int
    reason: str
    engine: int = 0

    def as_dict(self) -> dict:
        return {
            "nsid": self.nsid.hex(),
            "key": self.key.hex(),
            "engine": self.engine,
            "rank": self.rank,
            "slot": self.slot,
            "reason": self.reason,
        }


class Progress:
    """Progress on stderr. A bar (tqdm) when stderr is a terminal (enabled None) or enabled is
    True; with `plain` seconds and stderr not a terminal (a log: an init container, a unit's
    journal), a plain line instead, at most every `plain` seconds and one at the end; enabled
    False: nothing. Threading: its caller's thread only."""

    def __init__(
        self,
        total_blocks: int,
        total_bytes: int,
        enabled: bool | None = None,
        desc: str = "verifying",
        plain: float | None = None,
    ):
        from tqdm import tqdm

        tty = sys.stderr.isatty()
        self.desc, self.total_blocks, self.total_bytes = desc, total_blocks, total_bytes
        self.blocks = self.nbytes = 0
        self.plain = plain if enabled is None and not tty else None
        self._last = time.monotonic()
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=desc,
            file=sys.stderr,
            leave=False,
            dynamic_ncols=True,
            mininterval=0.2,
            disable=not (tty if enabled is None else enabled),
        )

    def add(self, blocks: int, nbytes: int) -> None:
        self.bar.update(nbytes)
        self.blocks += blocks
        self.nbytes += nbytes
        if self.plain is not None and time.monotonic() - self._last >= self.plain:
            self._line()

    def _line(self) -> None:
        self._last = time.monotonic()
        print(
            f"aiokv: {self.desc}: {self.blocks} of {self.total_blocks} block(s), "
            f"{self.nbytes / (1 << 20):.1f} of {self.total_bytes / (1 << 20):.1f} MiB",
            file=sys.stderr,
            flush=True,
        )

    def end(self) -> None:
        self.bar.close()
        if self.plain is not None:
            self._line()


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
        return str(e) if str(e).startswith(("header", "payload")) else f"header {e}"
    return None


async def _verify_ns(backend, root: str, ns, items, progress: Progress | None) -> list[Bad]:
    """items: (rank, key, location). Reads each slot and checks it; returns the bad ones."""
    sb = ns.slot_bytes
    depth = max(1, min(IN_FLIGHT, STAGING_LIMIT // sb, len(items)))
    bad: list[Bad] = []
    fds: dict[tuple[int, int], int | str] = {}  # (engine, rank) -> fd or why not
    for engine, rank in sorted({(fmt.split(w)[0], r) for r, _, w in items}):
        try:
            fds[(engine, rank)] = _open_data(root, ns.nsid, rank, engine)
        except FileNotFoundError:
            fds[(engine, rank)] = "data file missing"
        except OSError as e:
            fds[(engine, rank)] = f"cannot open data file: {e.strerror}"
    todo = []
    for rank, key, where in sorted(items, key=lambda x: (x[0], x[2])):
        engine, slot = fmt.split(where)
        fd = fds[(engine, rank)]
        if isinstance(fd, str):
            bad.append(Bad(ns.nsid, key, rank, slot, fd, engine))
            if progress:
                progress.add(1, 0)
        else:
            todo.append((rank, key, slot, fd, engine))
    pool = BufferPool(sb, depth) if todo else None
    try:
        workers = min(4, depth)
        per = max(1, depth // workers)
        it = iter(range(0, len(todo), per))

        async def worker(w: int) -> None:
            bufs = [pool.addr(w * per + i) for i in range(per)]
            for start in it:
                chunk = todo[start : start + per]
                ops = [(OP_READ, fd, bufs[i], sb, s * sb) for i, (_, _, s, fd, _) in enumerate(chunk)]
                res = await backend.run(ops)
                for i, (r, (rank, key, slot, _, engine)) in enumerate(zip(res, chunk)):
                    if r < 0:
                        why = f"I/O error: {os.strerror(-r)}"
                    elif r != sb:
                        why = "short read (data file truncated)"
                    else:
                        why = check_slot(bufs[i], ns.nsid, rank, key, ns.payload_bytes)
                    if why:
                        bad.append(Bad(ns.nsid, key, rank, slot, why, engine))
                if progress:
                    progress.add(len(chunk), len(chunk) * sb)

        if todo:
            await asyncio.gather(*(worker(w) for w in range(min(workers, -(-len(todo) // per)))))
    finally:
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)
        if pool is not None:
            pool.close()
    return bad


async def verify_items(root: str, namespaces: dict, work: dict, progress: Progress | None) -> list[Bad]:
    """work: nsid -> [(rank, key, location)], or a Work that makes them a chunk at a time."""
    backend = open_backend(asyncio.get_running_loop())
    try:
        bad: list[Bad] = []
        for nsid, items in work.items():
            for part in items.chunks() if isinstance(items, Work) else [items]:
                if part:
                    bad += await _verify_ns(backend, root, namespaces[nsid], part, progress)
        return bad
    finally:
        backend.close()


def run_loop(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


class Work:
    """(rank, key, location) of every copy in one namespace's engines' files, made a chunk
    at a time (a directory of tens of millions of blocks is never one list)."""

    CHUNK = 1 << 16

    def __init__(self, ns):
        self.ns = ns

    def __len__(self) -> int:
        return sum(t.count for t in self.ns.tables.values()) * self.ns.ranks

    def chunks(self):
        ns = self.ns
        for e in sorted(ns.tables):
            t, keys = ns.tables[e], ns.keys_of(e)
            live = t.live()
            for i in range(0, len(live), self.CHUNK):
                part = live[i : i + self.CHUNK]
                found = keys.keys_of(part, t.tag[part])
                yield [
                    (r, k, fmt.loc(e, s))
                    for s, k in zip(part.tolist(), found)
                    if k is not None
                    for r in range(ns.ranks)
                ]


def work_of(st: Store) -> dict:
    """nsid -> Work: every copy in every engine's files."""
    return {nsid: Work(ns) for nsid, ns in st.index.namespaces.items()}


def still_committed(st, bad: list) -> dict:
    """nsid -> [(rank, key, location)] of the bad blocks whose key its engine still keeps in that slot."""
    work: dict = {}
    for b in bad:
        ns = st.index.namespaces.get(b.nsid)
        got = ns.peers.get(b.engine, {}).get(b.key) if ns is not None else None
        if got is not None and got[0] == b.slot:
            work.setdefault(b.nsid, []).append((b.rank, b.key, fmt.loc(b.engine, b.slot)))
    return work


def recheck(root: str, bad: list[Bad], rounds: int = 3) -> list[Bad]:
    """Keep only failures still committed at the same slot that still fail.

    A running engine may evict a key and rewrite its slot between our replay and
    our read; each round replays again, so only a block that stays committed and
    stays bad is reported. Without an engine one round settles it."""
    for _ in range(rounds):
        bad = still_bad(root, bad)
        if not bad or not engines_running(root):
            break
    return bad


def still_bad(root: str, bad: list[Bad]) -> list[Bad]:
    """Of `bad`, the blocks a fresh replay still has committed at the same slot that fail again."""
    st = open_readonly(root)
    try:
        work = still_committed(st, bad)
        return run_loop(verify_items(root, st.index.namespaces, work, None)) if work else []
    finally:
        st.close()
