# SPDX-License-Identifier: Apache-2.0
"""The two messages vLLM carries for aiokv between its processes.

AioKVMetadata: the scheduler side's plan of a step (loads, saves, cancels),
scheduler -> workers. AioKVWorkerMetadata: a worker's report (blocks written
or failed, keys that did not verify, counters), workers -> scheduler, summed
across TP ranks by vLLM's aggregation.

Threading contract: built on one thread (the scheduler thread, or a worker's
model runner thread), then only read; vLLM serializes them between processes.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

from aiokv.jobs import StepPlan, WorkerReport

QUIET = StepPlan()  # the plan of a step with nothing to do (shared: never changed)


class AioKVMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan, decode_like: bool = False, idle: bool = False):
        # a step with nothing to do carries no plan: most decode steps, pickled for every step
        self._plan = None if plan.empty() else plan
        # every request of the step computes one token (plus its speculative ones): vLLM may
        # replay a full CUDA graph, in which attention does not call wait_for_layer_load
        self.decode_like = decode_like
        # the step schedules no token: vLLM runs no forward and only collects transfers.
        # Told by the scheduler side because the worker cannot tell: Model Runner V2 calls
        # start_load_kv without attention metadata on every step.
        self.idle = idle

    @property
    def plan(self) -> StepPlan:
        return QUIET if self._plan is None else self._plan


class AioKVWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport):
        self.report = report

    def aggregate(self, other: "AioKVWorkerMetadata") -> "AioKVWorkerMetadata":
        return AioKVWorkerMetadata(self.report.merge(other.report))
