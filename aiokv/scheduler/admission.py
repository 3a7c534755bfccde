# SPDX-License-Identifier: Apache-2.0
"""Admission to disk: every block (`admit: all`), or only blocks seen before (`admit: reused`).

Writing every block costs drive endurance: at 2 GB/s of saves a 7.68 TB drive rated for
one drive-write per day is used up in about an hour a day. With `reused`, a block is
written only when its key is seen a second time within a window: the first sighting
is remembered in a memory-only sketch, and a later request that sees the key again
(its prompt looked up, or its own save planned) saves it.

A sighting is a request meeting a key: once per request (preemptions and resumes do
not meet a key again), when its prompt is looked up (match: every key up to its last
usable block) or, for a block beyond what its lookups covered (its reply), when its
save is planned. A save is admitted if the key was in the sketch before this request
met it: a request never admits its own blocks. A block is saved by the request that
meets it again even if vLLM's own prefix cache gave it that block (plan.track's
own_cache): the one that computed it met it first, and a block every request shares
(a system prompt) is otherwise never computed twice, never written, and nothing after
it can ever hit.

The sketch: two generations of a Bloom filter (the doorkeeper of TinyLFU), each taking
`window` sightings before the older one is dropped, so a first sighting is remembered
for between `window` and 2 x `window` later sightings; a key is in it if in either
generation. Keys are BLAKE2b outputs, so their own bytes serve as the filter's hashes:
two 8-byte slices h1, h2 give the K positions (h1 + i x h2) mod m in 64-bit arithmetic
(double hashing), so every window the config accepts (up to 2^30 sightings, m = 10 x
2^30 bits, past 2^32) spreads over all of its bits. False positives (about 1 % at 10
bits per sighting) admit a first sighting: one write too many, never a wrong block.
Memory: 2 x 10 bits per sighting of the window (2.5 MiB at the default 1M, 2.5 GiB at
2^30), zeroed lazily by the kernel: pages become resident only as keys set their bits.

aiokv's memory tier holds only blocks that are on disk (worker/memory.py), so a block
it holds is a hit already; there is no memory-only copy to count.

Pure, no vLLM, no I/O. Threading contract: the EngineCore scheduler thread only (the
SchedulerSide's).
"""

from __future__ import annotations

import mmap

import numpy as np

ALL, REUSED = "all", "reused"
K = 7  # bit positions per key
BITS_PER = 10  # bits per sighting of the window
STEPS = np.arange(K, dtype=np.uint64)[None, :]  # i of the i-th position, h1 + i x h2


class Sketch:
    """Keys seen within the last `window` to 2 x `window` sightings (approximate, no false negatives
    within the window)."""

    def __init__(self, window: int):
        self.window = max(1, window)
        self.m = self.window * BITS_PER
        self._now = self._zeros()
        self._old = self._zeros()
        self._added = 0

    def _zeros(self) -> np.ndarray:
        """A generation's bits: an anonymous mapping the kernel zeroes page by page at first touch.
        Small pages: keys set bits all over it, and with transparent huge pages (numpy asks for
        them for large arrays) each of the first few thousand keys made 2 MiB resident (measured
        at 2^30: 1.3 GB and 3.4 s for 3,000 keys; with 4 KiB pages, tens of MB)."""
        buf = mmap.mmap(-1, (self.m + 7) // 8)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            try:
                buf.madvise(mmap.MADV_NOHUGEPAGE)
            except OSError:
                pass
        return np.frombuffer(buf, dtype=np.uint8)

    def _bits(self, keys: list[bytes]) -> np.ndarray:
        """Per key, its K bit positions in [0, m) (uint64; wrapping 64-bit arithmetic)."""
        raw = np.frombuffer(b"".join(k[:16] for k in keys), dtype="<u8").reshape(len(keys), 2)
        h1, h2 = raw[:, :1], raw[:, 1:] | np.uint64(1)
        return (h1 + STEPS * h2) % np.uint64(self.m)

    def contains(self, keys: list[bytes]) -> np.ndarray:
        if not keys:
            return np.zeros(0, dtype=bool)
        b = self._bits(keys)
        byte, bit = b >> 3, (b & 7).astype(np.uint8)
        mask = np.uint8(1) << bit
        now = ((self._now[byte] & mask) != 0).all(axis=1)
        old = ((self._old[byte] & mask) != 0).all(axis=1)
        return now | old

    def add(self, keys: list[bytes]) -> None:
        if not keys:
            return
        if self._added + len(keys) > self.window:
            self._old, self._now = self._now, self._zeros()
            self._added = 0
        b = self._bits(keys).ravel()
        np.bitwise_or.at(self._now, b >> 3, np.uint8(1) << (b & 7).astype(np.uint8))
        self._added += len(keys)


class Admission:
    """Which of a request's planned saves go to disk. With `all`, every one."""

    def __init__(self, policy: str = ALL, window: int = 1 << 20):
        self.policy = policy
        self.sketch = Sketch(window) if policy == REUSED else None

    def looked_up(self, st, upto: int) -> None:
        """A request's keys up to block `upto` were looked up: those it had not met yet are sighted."""
        if self.sketch is None:
            return
        if upto > st.looked:
            self._sight(st, [k for k in st.keys[st.looked : upto] if k not in st.met])
            st.looked = upto

    def admitted(self, st, keys: list[bytes]) -> list[bool]:
        """Per key of this request's planned saves: written to disk or not. A key the request had
        not met yet (beyond what its lookups covered) is sighted now."""
        if self.sketch is None:
            return [True] * len(keys)
        self._sight(st, [k for k in keys if k not in st.met])
        return [k in st.admit for k in keys]

    def _sight(self, st, keys: list[bytes]) -> None:
        """Keys this request meets for the first time (whatever its preemptions): admitted if
        another request met them before."""
        if not keys:
            return
        seen = self.sketch.contains(keys)
        st.admit.update(k for k, s in zip(keys, seen) if s)
        st.met.update(keys)
        self.sketch.add(keys)
