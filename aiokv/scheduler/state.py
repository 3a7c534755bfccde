# SPDX-License-Identifier: Apache-2.0
"""The scheduler side's plain data: a step's scheduled requests, a KV-cache group
with its store namespace, what is known of a request, and the counters.

No behaviour beyond construction. Threading contract: the EngineCore scheduler
thread only (SchedulerSide's caller), like everything in aiokv/scheduler/.
"""

from __future__ import annotations

import dataclasses

from aiokv.scheduler.layout import GroupSpec
from aiokv.store.api import SpaceApi
from aiokv.util import counters, counting


@dataclasses.dataclass
class Scheduled:
    """One request in this step's SchedulerOutput, as plain data."""

    req_id: str
    num_computed: int  # tokens computed before this step
    num_scheduled: int  # tokens computed in this step (spec tokens excluded)
    block_ids: tuple[list[int], ...] | None  # per group; new/resumed: whole tables; running: appended ids
    replace: bool  # True: block_ids are the whole tables (new or resumed request)


@dataclasses.dataclass
class Group:
    spec: GroupSpec
    ns: SpaceApi  # (a Namespace, or a DriveNamespace over several drives)


@dataclasses.dataclass
class Req:
    # The request's own token list, vLLM's Request.all_token_ids: prompt then output, appended
    # by vLLM as tokens are sampled, never changed before its end (aiokv reads, never writes it).
    # Held, not copied: the output blocks (save_generated) are saved from it as they fill;
    # a block is keyed and saved only once all its tokens are in it and computed (plan.track).
    tokens: object
    root: bytes
    keys: list[bytes] = dataclasses.field(default_factory=list)
    block_ids: list[list[int]] = dataclasses.field(default_factory=list)  # per group
    next_save: list[int] = dataclasses.field(default_factory=list)  # per group: first block not yet considered
    # admission (admission.py, admit: reused): keys this request met, those of them another met before,
    # and how far its lookups reached
    met: set = dataclasses.field(default_factory=set)
    admit: set = dataclasses.field(default_factory=set)
    looked: int = 0
    # blocks at the front of this life that vLLM's own prefix cache gave it (set at allocation, -1: not
    # known); with admit: reused they are saved too when admitted (plan.track), since the request that
    # computed them met their keys first and could not
    own_cache: int = -1
    prompt: int = 0  # prompt tokens (the list's length when vLLM first asked about the request)
    tenant: str = ""  # its tenant: its cache_salt ("": none); the store registers it at its first commit
    pin: bool = False  # its blocks are pinned (kv_transfer_params {"aiokv": {"pin": true}})
    # tokens computed at which plan.track next has work without a new block: its first unsaved
    # block fills (0: not tracked yet). The connector leaves a running request below it out of
    # the step's plan, so that a decode step costs a comparison per request
    due: int = 0


# what the scheduler side counts: one int per SCHEDULER row of the table of counters
SchedulerCounters = counting.record("SchedulerCounters", counters.SCHEDULER, __name__)
