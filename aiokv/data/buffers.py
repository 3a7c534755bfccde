# SPDX-License-Identifier: Apache-2.0
"""Aligned, huge-page-backed host memory for O_DIRECT I/O.

O_DIRECT needs buffers, offsets and lengths aligned to the device's logical block
size; `torch.empty` is only 64-byte aligned. Buffers made of scattered 4 KiB pages
also cost up to half the read bandwidth (the block layer splits each I/O), so the
staging memory is one 2 MiB-aligned anonymous mapping with MADV_HUGEPAGE
(see docs/design.md, "Staging memory").

Threading contract: an Arena is immutable after construction and may be read from
any thread. A BufferPool is called from one thread only (the worker's event loop).
"""

from __future__ import annotations

import ctypes
import errno
import mmap

from aiokv.data.format.slot import ALIGN  # O_DIRECT's alignment, which slots are rounded to

HUGE = 2 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+ (not in Python's mmap module)


def available_memory() -> int:
    """Bytes of memory this process can still take (0: unknown): the kernel's MemAvailable, less
    where a cgroup (a container) allows less."""
    avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            cap = f.read().strip()
        if cap != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                room = max(0, int(cap) - int(f.read()))
            avail = min(avail, room) if avail else room
    except (OSError, ValueError):
        pass
    return avail


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


class Arena:
    """One aligned anonymous mapping. `addr` is 2 MiB aligned, `size` bytes long.

    populate: fault every page in now (huge pages where the kernel gives them)
    instead of at first use. A worker's arena is populated at start: a load
    into never-touched slots pays the page faults and the zeroing inside the
    O_DIRECT read (measured: the first warm loads after a restart took up to
    2x longer with the memory tier on, whose kept buffers are never reused), and
    on CUDA the arena is pinned, i.e. populated, at start anyway."""

    def __init__(self, size: int, populate: bool = False):
        self.size = round_up(max(size, ALIGN), ALIGN)
        self._map = mmap.mmap(-1, self.size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self.offset = (-base) % HUGE
        self.addr = base + self.offset
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE, self.offset, round_up(self.size, HUGE))
            except (OSError, ValueError):
                pass  # transparent huge pages disabled: still correct, slower
        self.view = memoryview(self._map)[self.offset : self.offset + self.size]
        if populate:
            try:
                self._map.madvise(MADV_POPULATE_WRITE, self.offset, round_up(self.size, HUGE))
            except OSError as e:
                if e.errno != errno.EINVAL:  # out of memory: touching it would call the OOM killer
                    self.close()
                    raise MemoryError(f"cannot populate {size} bytes of staging memory ({e.strerror})") from None
                ctypes.memset(self.addr, 0, self.size)  # an older kernel (no MADV_POPULATE_WRITE): touch it
            except ValueError:
                ctypes.memset(self.addr, 0, self.size)

    def tensor(self):
        """The arena as a flat torch uint8 tensor sharing its memory."""
        import torch

        return torch.frombuffer(self.view, dtype=torch.uint8)

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a tensor still views it; the mapping lives until that is gone


class BufferPool:
    """A bounded pool of equal, aligned buffers (staging buffers, one slot image each) carved from one Arena.

    acquire(n) returns n buffer indices or None when the pool cannot give that many:
    callers drop work instead of waiting, so a full pool never stalls the engine.
    """

    def __init__(self, slot_bytes: int, count: int, populate: bool = False):
        if slot_bytes % ALIGN:
            raise ValueError("buffer size must be a multiple of 4096")
        self.slot_bytes = slot_bytes
        self.count = count
        self.arena = Arena(slot_bytes * count, populate)
        self._free = list(range(count - 1, -1, -1))
        self._used: set[int] = set()

    def addr(self, buf: int) -> int:
        return self.arena.addr + buf * self.slot_bytes

    @property
    def available(self) -> int:
        return len(self._free)

    def acquire(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = self._free[-n:]
        del self._free[-n:]
        self._used.update(out)
        return out

    def release(self, bufs: list[int]) -> None:
        for s in bufs:
            if s not in self._used:
                raise RuntimeError(f"staging buffer {s} released twice")
            self._used.remove(s)
            self._free.append(s)

    @property
    def in_use(self) -> int:
        return len(self._used)

    def close(self) -> None:
        self.arena.close()
