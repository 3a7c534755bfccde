# SPDX-License-Identifier: Apache-2.0
"""Test-only fault injection in the I/O layer.

Inert in production: open_backend() wraps the real backend only when both
AIOKV_FAULTS (the rules) and AIOKV_FAULTS_ACK (exactly ACK below) are set, so
it cannot be switched on by accident; when it is, it says so loudly, once.

AIOKV_FAULTS is a JSON list of rules; each applies to operations of one kind:
    {"op": "read"|"write", "kind": "eio"|"enospc"|"short"|"late"|"flip"|"raise",
     "every": N (default 1: every matching op), "skip": K (first K matching ops pass),
     "limit": M (at most M faults), "delay": seconds (for "late"),
     "file": S (only operations on files whose path contains S, e.g. "rank1.data"),
     "offset": B (only operations at byte offset B of their file: one slot)}
- eio / enospc: the operation is not performed; it returns -EIO / -ENOSPC.
- short: the operation moves 4096 bytes less than asked (a real short transfer).
- late: the operation completes `delay` seconds late.
- flip: the operation runs, then one byte of its buffer is flipped (for a
  read: the bytes handed back are wrong; for a write: the bytes on disk are).
- raise: no operation of the batch is performed; the backend's run raises
  RuntimeError (an error that is no OSError: a bug below the caller).

Threading contract: as the wrapped backend (its loop's thread only).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os

from aiokv.data.backend import OP_READ, IOBackend, say_once

ACK = "inject I/O faults"
KINDS = ("eio", "enospc", "short", "late", "flip", "raise")
FIRED: dict[str, int] = {}  # "read:late" -> faults injected in this process (tests show theirs happened)


class Rule:
    def __init__(self, spec: dict):
        self.op = {"read": OP_READ, "write": 1}[spec["op"]]
        self.kind = spec["kind"]
        if self.kind not in KINDS:
            raise ValueError(f"aiokv: fault kind {self.kind!r} is not one of {KINDS}")
        self.every = int(spec.get("every", 1))
        self.skip = int(spec.get("skip", 0))
        self.limit = spec.get("limit")
        self.delay = float(spec.get("delay", 0.5))
        self.file = spec.get("file")
        self.offset = spec.get("offset")
        self.seen = 0
        self.fired = 0

    def hits(self, op) -> bool:
        if (
            op[0] != self.op
            or (self.offset is not None and op[4] != self.offset)
            or (self.file and self.file not in _path(op[1]))
        ):
            return False
        self.seen += 1
        n = self.seen - self.skip
        if n <= 0 or n % self.every or (self.limit is not None and self.fired >= self.limit):
            return False
        self.fired += 1
        name = f"{'read' if self.op == OP_READ else 'write'}:{self.kind}"
        FIRED[name] = FIRED.get(name, 0) + 1
        return True


def rules_from_env() -> list[Rule] | None:
    raw = os.environ.get("AIOKV_FAULTS")
    if not raw or os.environ.get("AIOKV_FAULTS_ACK") != ACK:
        return None
    rules = [Rule(r) for r in json.loads(raw)]
    say_once(f"aiokv: FAULT INJECTION ACTIVE ({raw}); this is for tests only")
    return rules


def _path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _flip(addr: int, length: int) -> None:
    b = ctypes.c_ubyte.from_address(addr + min(length - 1, 4096 + 7))  # a payload byte when there is one
    b.value ^= 0x01


class FaultyBackend(IOBackend):
    """Wraps a real backend and breaks chosen operations."""

    def __init__(self, inner: IOBackend, rules: list[Rule]):
        super().__init__(inner.loop)
        self.inner = inner
        self.rules = rules
        self.name = f"{inner.name}+faults"

    @property
    def in_flight(self) -> int:
        return self.inner.in_flight

    @property
    def merge_bytes(self) -> int:
        return self.inner.merge_bytes

    @property
    def depth(self) -> int:
        return self.inner.depth

    @property
    def min_bytes(self) -> int:
        return self.inner.min_bytes

    async def run(self, ops, abandon=None) -> list[int]:
        rules = [next((r for r in self.rules if r.hits(op)), None) for op in ops]
        plan = [r.kind if r is not None else None for r in rules]
        if "raise" in plan:
            raise RuntimeError("aiokv: injected fault (raise)")
        real = [i for i, k in enumerate(plan) if k not in ("eio", "enospc")]
        for i in real:
            if plan[i] == "flip" and ops[i][0] != OP_READ:
                _flip(ops[i][2], ops[i][3])  # the bytes that reach the disk are wrong
        sent = []
        for i in real:
            o = ops[i]
            sent.append((o[0], o[1], o[2], o[3] - 4096, o[4]) if plan[i] == "short" and o[3] > 4096 else o)
        res = await self.inner.run(sent, abandon)
        out = [-errno.EIO if k == "eio" else -errno.ENOSPC for k in plan]
        delay = 0.0
        for i, r in zip(real, res):
            out[i] = r
            if plan[i] == "flip" and ops[i][0] == OP_READ and r > 0:
                _flip(ops[i][2], r)  # the bytes handed back are wrong
            if plan[i] == "late":
                delay = max(delay, rules[i].delay)  # the delay of the rule that fired
        if delay:
            await asyncio.sleep(delay)
        return out

    def _start(self, batch, ops):  # run() is overridden whole
        raise NotImplementedError

    def _cancel(self, batch):
        raise NotImplementedError

    def close(self) -> None:
        self.inner.close()
