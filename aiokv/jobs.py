# SPDX-License-Identifier: Apache-2.0
"""Job records that travel from the scheduler side to the workers and back.

One explicit list of (key, location, block id) per request, group and direction, built
once by the scheduler side, which gives it a job id: the worker never recomputes
keys or block ranges, so the two sides cannot disagree about what is loaded or
saved, and every result names the job (and the rank) it is about, never a
(key, location) to be matched against whatever the scheduler holds by then.
Plain dataclasses of lists and bytes: they pickle across vLLM's processes.

Threading contract: none of their own (plain data); built on the scheduler thread,
read and filled on the worker's threads under the worker's own rules.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Transfer:
    """Blocks of one request moving in one direction, in one KV-cache group: one job.

    A load may carry fewer keys than block ids (a load that could not be prepared
    carries none): the blocks past its keys have nothing to read and fail."""

    req_id: str
    keys: list[bytes]
    locations: list[int]  # where each block is: engine << 32 | slot (format.loc), the same in every rank's file
    block_ids: list[int]  # vLLM KV block ids
    group: int = 0  # vLLM KV-cache group (aiokv/scheduler/layout.py): its own store namespace
    # loads: True where the block comes from the bucket tier (docs/sharing.md); its location
    # is then a fresh reservation the worker writes through to and reports as saved
    from_bucket: list[bool] = dataclasses.field(default_factory=list)
    job: int = 0  # the scheduler side's id for it (from 1, never reused); results name it
    # the request's tenant (its cache_salt) as its tag (format.tenant_tag; b"": the tenant ""), which
    # a save (or a load's write-through) stamps into each slot's header (format.TENANT_OFFSET)
    tenant: bytes = b""


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
class SaveResult:
    """Blocks of one job a rank wrote, or did not (a save, or a load's write-through of
    blocks from the bucket tier; a part of a job may be reported in each of several steps)."""

    job: int
    rank: int
    written: list[bytes] = dataclasses.field(default_factory=list)  # keys of the job's blocks
    failed: list[bytes] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LoadResult:
    """One load job finished on a rank (cancelled ones too)."""

    job: int
    rank: int
    req_id: str
    failed: list[int] = dataclasses.field(default_factory=list)  # block ids not loaded
    bad: list[bytes] = dataclasses.field(default_factory=list)  # keys whose stored copy did not verify


@dataclasses.dataclass
class WorkerReport:
    """What workers tell the scheduler side after a step (merged across ranks)."""

    saves: list[SaveResult] = dataclasses.field(default_factory=list)
    loads: list[LoadResult] = dataclasses.field(default_factory=list)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)
    disabled: bool = False  # this worker could not start; its jobs all fail
    # several drives (aiokv/store/drives.py): drive -> [I/O failures, blocks loaded] since the last report
    drives: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        return WorkerReport(
            self.saves + other.saves,
            self.loads + other.loads,
            counters,
            self.disabled or other.disabled,
            add_drives(dict(self.drives), other.drives),
        )

    def empty(self) -> bool:
        return not (self.saves or self.loads or self.counters or self.disabled or self.drives)

    def written(self) -> list[tuple[int, int, bytes]]:
        """(job, rank, key) of every block reported written."""
        return [(r.job, r.rank, k) for r in self.saves for k in r.written]

    def not_written(self) -> list[tuple[int, int, bytes]]:
        """(job, rank, key) of every block reported not written."""
        return [(r.job, r.rank, k) for r in self.saves for k in r.failed]


def add_drives(into: dict, new: dict) -> dict:
    """Per-drive verdicts `new` added into `into` (WorkerReport.drives); returns `into`."""
    for d, v in new.items():
        got = into.get(d, [0, 0])
        into[d] = [got[0] + v[0], got[1] + v[1]]
    return into
