# SPDX-License-Identifier: Apache-2.0
"""Progress on stderr for the CLI's long runs (`aiokv inspect --verify`, `aiokv warm`): a bar on
a terminal, a plain line now and then in a log, or nothing.

Threading: its caller's thread only.
"""

from __future__ import annotations

import sys
import time


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
