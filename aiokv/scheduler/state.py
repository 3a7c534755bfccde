"""The scheduler side's plain data: a step's scheduled requests, a KV-cache group
with its store namespace, what is known of a request, and the counters.

No behaviour beyond construction. Threading contract: the EngineCore scheduler
thread only (SchedulerSide's caller), like everything in aiokv/scheduler/.
"""
from __future__ import annotations

import dataclasses

from aiokv.scheduler.layout import GroupSpec
from aiokv.store.index import Namespace


@dataclasses.dataclass
class Scheduled:
    """One request in this step's SchedulerOutput, as plain data."""

    req_id: str
    num_computed: int         # tokens computed before this step
    num_scheduled: int        # tokens computed in this step (spec tokens excluded)
    block_ids: tuple[list[int], ...] | None  # per group; new/resumed: whole tables; running: appended ids
    replace: bool             # True: block_ids are the whole tables (new or resumed request)


@dataclasses.dataclass
class Group:
    spec: GroupSpec
    ns: Namespace


@dataclasses.dataclass
class Req:
    tokens: object            # the live token list of the request (prompt + output)
    root: bytes
    keys: list[bytes] = dataclasses.field(default_factory=list)
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per group
    next_save: list[int] = dataclasses.field(default_factory=list)  # per group: first block not yet considered


@dataclasses.dataclass
class SchedulerCounters:
    hit_requests: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    load_blocks: int = 0      # blocks in the loads of every KV-cache group (hit_blocks when there is one)
    saves_planned: int = 0
    saves_committed: int = 0
    save_failures: int = 0
    load_bad_blocks: int = 0
    loads_cancelled: int = 0
    breaker_opens: int = 0
    saves_skipped_breaker: int = 0
    bucket_hit_blocks: int = 0
    reports_ignored: int = 0  # worker results for a job (or a block of it) no longer held: 0 expected
