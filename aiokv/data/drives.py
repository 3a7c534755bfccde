# SPDX-License-Identifier: Apache-2.0
"""Reads and writes of whole slots over several drives: one BlockIO per drive's
namespace directory, behind BlockIO's own interface (`read`, `write`, `verify`).

Locations from several drives carry the drive's index above the engine's bits
(format.on_drive, aiokv/store/drives.py); `DriveIO` splits a call's items by
drive, hands each drive's BlockIO its items with the drive taken off their
locations, runs the drives' parts at once and puts the results back in order.
One drive's trouble stays its own: a file that cannot be opened or created
fails only its items (-errno), and each call's verdict per drive is handed to
`report` as {drive: [I/O failures, blocks read whole and verified]} (the
scheduler side's per-drive breakers). An item naming a drive this DriveIO has
not got is -ENOENT (a miss). A call that ends by an exception (cancelled, or a
part's error that is no OSError) first cancels and waits for every drive's part:
none of its I/O is left in the kernel once it has ended.

Which drives a timed-out call was still waiting on: a caller that passes a set
as `waiting` (worker/loads.py, worker/saves.py: the job's own) finds there, once
the call was cancelled, the drives whose part had not ended; it judges whether
that was a timeout (a failure of those drives) or an abort (nothing). A call's
`tenant` and `abandon` go to each drive's BlockIO as they are.

Threading contract: BlockIO's (one asyncio loop thread).
"""

from __future__ import annotations

import asyncio
import errno

from aiokv.data import format as fmt
from aiokv.data.backend import NOT_IO_ERRORS
from aiokv.util.loops import settle


class DriveIO:
    def __init__(self, ios: dict, report=None):
        """ios: drive index -> that drive's BlockIO (same namespace, rank and layout);
        report(verdicts) after each call, or None."""
        self.ios = ios
        first = next(iter(ios.values()))
        self.slot_bytes, self.payload_bytes = first.slot_bytes, first.payload_bytes
        self.report = report

    def fds(self) -> list[int]:
        return [fd for io in self.ios.values() for fd in io.fds()]

    def verify(self, key: bytes, addr: int) -> bool:
        return next(iter(self.ios.values())).verify(key, addr)

    def stamp(self, key: bytes, addr: int) -> None:
        next(iter(self.ios.values())).stamp(key, addr)

    async def read(self, items, crc_in_copy: bool = False, *, abandon=None, waiting=None) -> list[int]:
        """As BlockIO.read; waiting: None, or the set that gets the drives a cancelled call waited on."""
        return await self._split(False, items, (crc_in_copy, fmt.NO_TENANT, abandon), waiting)

    async def write(
        self, items, crc_in_copy: bool = False, *, tenant: bytes = fmt.NO_TENANT, abandon=None, waiting=None
    ) -> list[int]:
        """As BlockIO.write; waiting: as for `read`."""
        return await self._split(True, items, (crc_in_copy, tenant, abandon), waiting)

    async def _split(self, write: bool, items, how: tuple, waiting: set | None) -> list[int]:
        """how: (crc_in_copy, tenant, abandon), for each drive's part."""
        out = [-errno.ENOENT] * len(items)
        parts: dict[int, tuple[list[int], list]] = {}
        for i, (where, key, addr) in enumerate(items):
            d, w = fmt.drive_of(where)
            if d in self.ios:
                idx, sub = parts.setdefault(d, ([], []))
                idx.append(i)
                sub.append((w, key, addr))
        tasks = {d: asyncio.ensure_future(self._part(self.ios[d], write, sub, how)) for d, (_, sub) in parts.items()}
        try:
            await asyncio.gather(*tasks.values())
        except BaseException as e:
            # however the call ends (cancelled, or one drive's part raised an error that is no
            # OSError), no part of it may still be running: the caller gives the buffers back
            if isinstance(e, asyncio.CancelledError):
                if waiting is not None:
                    # (gather has cancelled its parts by now: those that had not ended are the cancelled ones)
                    waiting.update(d for d, t in tasks.items() if not t.done() or t.cancelled())
            for t in tasks.values():
                t.cancel()
            await settle(list(tasks.values()))  # no buffer is in use once this call has ended
            for t in tasks.values():
                if not t.cancelled():
                    t.exception()  # retrieved: the error that matters is re-raised below
            raise
        verdicts = {}
        for d, t in tasks.items():
            res = t.result()
            for i, r in zip(parts[d][0], res):
                out[i] = r
            verdicts[d] = [sum(r not in NOT_IO_ERRORS for r in res), 0 if write else res.count(0)]
        if self.report is not None and verdicts:
            self.report(verdicts)
        return out

    @staticmethod
    async def _part(io, write: bool, sub, how: tuple) -> list[int]:
        crc_in_copy, tenant, abandon = how
        try:
            if write:
                return await io.write(sub, crc_in_copy, tenant=tenant, abandon=abandon)
            return await io.read(sub, crc_in_copy, abandon=abandon)
        except OSError as e:  # this drive's file cannot be opened or created: its items only
            return [-(e.errno or errno.EIO)] * len(sub)

    def close(self) -> None:
        for io in self.ios.values():
            io.close()
