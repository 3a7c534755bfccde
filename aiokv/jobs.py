"""Job records that travel from the scheduler side to the workers and back.

One explicit list of (key, slot, block id) per request and direction, built once
by the scheduler side: the worker never recomputes keys or block
ranges, so the two sides cannot disagree about what is loaded or saved.
Plain dataclasses of lists and bytes: they pickle across vLLM's processes.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Transfer:
    """Blocks of one request moving in one direction."""

    req_id: str
    keys: list[bytes]
    slots: list[int]      # store locations: engine << 32 | slot (format.split), the same in every rank's file
    block_ids: list[int]  # vLLM KV block ids
    group: int = 0        # vLLM KV-cache group (aiokv/scheduler/layout.py): its own store namespace
    # loads: True where the block comes from the shared tier (docs/sharing.md); its slot
    # is then a fresh reservation the worker writes through to and reports as saved
    remote: list[bool] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class StepPlan:
    """What the workers do in one engine step."""

    loads: list[Transfer] = dataclasses.field(default_factory=list)
    saves: list[Transfer] = dataclasses.field(default_factory=list)
    cancel: list[str] = dataclasses.field(default_factory=list)  # requests whose loads stop
    reset: bool = False  # the cache was reset (the weights may have changed): drop the memory tier

    def empty(self) -> bool:
        return not (self.loads or self.saves or self.cancel or self.reset)


@dataclasses.dataclass
class WorkerReport:
    """What workers tell the scheduler side after a step (merged across ranks)."""

    saved: list[tuple[int, bytes, int, int]] = dataclasses.field(default_factory=list)  # (rank, key, slot, group)
    save_failed: list[tuple[int, bytes, int, int]] = dataclasses.field(default_factory=list)
    load_bad: list[tuple[bytes, int, int]] = dataclasses.field(default_factory=list)  # (key, slot, group) not verified
    load_failed: list[str] = dataclasses.field(default_factory=list)  # requests with any block not loaded
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    disabled: bool = False  # this worker could not start; its jobs all fail

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        return WorkerReport(self.saved + other.saved, self.save_failed + other.save_failed,
                            self.load_bad + other.load_bad, self.load_failed + other.load_failed, counters,
                            self.disabled or other.disabled)

    def empty(self) -> bool:
        return not (self.saved or self.save_failed or self.load_bad or self.load_failed or self.counters
                    or self.disabled)
