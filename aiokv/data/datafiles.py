# SPDX-License-Identifier: Apache-2.0
"""The data files of one (namespace, rank) that a BlockIO reads and writes, by engine:
opened at first use, ours to write (created if missing), another engine's read-only
and never created (a missing one: its items are a miss, fd -1, looked for again at
most every MISSING_RETRY seconds).

Files are opened on a short-lived thread of their own, awaited (`ensure_open`): on a
mount that hangs, an `open` must not hold the loop thread (a load's timeout runs
there). Threading contract: one asyncio loop thread (the BlockIO's); the opening
threads only open a file and hand the outcome to that loop.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time

from aiokv.data import format as fmt
from aiokv.data.slotfile import open_data_file, open_engine_dir

MISSING_RETRY = 0.5  # seconds before another engine's missing data file is looked for again


class DataFiles:
    """Open fds of one (namespace, rank)'s data files, [writable][engine]. Threading
    contract: the loop thread of its BlockIO (see the module docstring)."""

    def __init__(self, ns_dir: str, rank: int):
        self.ns_dir = ns_dir
        self.rank = rank
        self.open: tuple[dict[int, int], dict[int, int]] = ({}, {})  # [writable][engine] -> open fd
        self._opening: dict[tuple[bool, int], asyncio.Future] = {}  # an open in flight on its thread
        self._missing: dict[int, float] = {}  # engine -> when its file was found missing (read-only)

    def fds(self) -> list[int]:
        """Every data file open."""
        return [fd for fds in self.open for fd in fds.values()]

    async def ensure_open(self, write: bool, items) -> None:
        """Open the files items need that are not open yet, each on a thread of its own
        (awaited; a cancelled wait leaves the open to finish there and keeps its fd)."""
        fds = self.open[write]
        need = {where >> fmt.ENGINE_SHIFT for where, _, _ in items} - fds.keys()
        if not need:
            return
        now = time.monotonic()
        loop = asyncio.get_running_loop()
        waits = []
        for e in need:
            if not write and now - self._missing.get(e, -MISSING_RETRY) < MISSING_RETRY:
                continue  # missing a moment ago: fd says -1
            fut = self._opening.get((write, e))
            if fut is None:
                fut = self._opening[(write, e)] = loop.create_future()

                def opened(e=e, fut=fut, got=None, err=None):
                    self._opening.pop((write, e), None)
                    if err is None and e not in fds:
                        fds[e] = got
                    elif err is None:
                        os.close(got)  # opened twice meanwhile
                    if isinstance(err, FileNotFoundError) and not write:
                        self._missing[e] = time.monotonic()
                    if not fut.done():
                        fut.set_result(None)

                def target(e=e, opened=opened):
                    try:
                        got = self._open_file(e, write)
                    except BaseException as err:  # reported on the loop; fd raises it again if it must
                        try:
                            loop.call_soon_threadsafe(functools.partial(opened, err=err))  # err dies with the except
                        except RuntimeError:
                            pass  # the loop is closed
                        return
                    try:
                        loop.call_soon_threadsafe(functools.partial(opened, got=got))
                    except RuntimeError:
                        os.close(got)

                threading.Thread(target=target, name="aiokv-open", daemon=True).start()
            waits.append(fut)
        for fut in waits:
            await asyncio.shield(fut)

    def _open_file(self, engine: int, write: bool) -> int:
        """Engine's data file of our rank: ours to write (created if missing), or read-only."""
        dfd = open_engine_dir(self.ns_dir, engine)
        try:
            return open_data_file(dfd, self.rank, write=write, create=write, direct=True, where=self.ns_dir)[0]
        finally:
            os.close(dfd)

    def fd(self, engine: int, write: bool) -> int:
        """Engine's file, opened here if it is not open yet; -1: another engine's file is missing."""
        fd = self.open[write].get(engine)
        if fd is None and not write and time.monotonic() - self._missing.get(engine, -MISSING_RETRY) < MISSING_RETRY:
            return -1
        if fd is None:
            try:
                fd = self._open_file(engine, write)
            except FileNotFoundError:
                if write:
                    raise
                return -1  # not there (yet): a miss, and looked for again next time
            self.open[write][engine] = fd
        return fd

    def close(self) -> None:
        for fd in self.fds():
            os.close(fd)
        for fds in self.open:
            fds.clear()
