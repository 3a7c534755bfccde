# SPDX-License-Identifier: Apache-2.0
"""The worker side of a model with several KV-cache groups: one TransferWorker
per group (its own device copies, data file of its namespace, pipelines), all
driven by the process's one event loop and sharing its staging buffers
(worker/host.py), fanned out and merged here.

Contract kept towards the connector, the same as one TransferWorker's:
- a request's load is reported finished once, when every group that had a part
  of it reported that part finished; if any part failed, the request is
  reported failed as a whole (the connector then asks vLLM to recompute it);
- saves go to the group's worker, except for groups this rank does not save
  (replicated KV such as MLA's latent: rank 0 stores it once for all ranks).

"Exactly once" is asserted here, per rank: a second load of a request in a
group while its first is in flight, and a finished report for a load this rank
does not hold in flight, are breaches. vLLM's scheduler asserts on a second
finished_recving (the engine dies), so a breach is never handed on: the
duplicate is dropped, logged as an error and counted (`breaches`, in the
connector's counters as load_report_breaches, which the tests require to be 0).

Threading contract: vLLM's worker thread only, like the TransferWorkers' own
save/load/cancel/poll/close.
"""

from __future__ import annotations

import logging

from aiokv.jobs import Transfer, WorkerReport
from aiokv.worker.results import NOTHING

log = logging.getLogger("aiokv")


class GroupedWorker:
    def __init__(self, workers: dict, save_groups: set[int], host=None):
        self.workers = workers  # group index -> TransferWorker
        self.save_groups = save_groups
        self.host = host  # the WorkerHost they share (closed after them), or None
        self._parts: dict[str, set[int]] = {}  # req -> groups whose part of its load is outstanding
        self._failed: set[str] = set()  # reqs with a failed part, until reported
        self.breaches = 0  # loads not reported exactly once (refused)

    @property
    def device(self):
        return next(iter(self.workers.values())).device

    @property
    def pool(self):
        return next(iter(self.workers.values())).pool

    @property
    def devices(self) -> list:
        return [w.device for w in self.workers.values()]

    def save(self, transfers: list[Transfer]) -> None:
        by_group: dict[int, list[Transfer]] = {}
        for t in transfers:
            if t.group in self.save_groups:
                by_group.setdefault(t.group, []).append(t)
        for g, ts in by_group.items():
            self.workers[g].save(ts)

    def _breach(self, what: str) -> None:
        self.breaches += 1
        log.error("aiokv: %s; refused (a load is reported finished exactly once)", what)

    def load(self, transfers: list[Transfer]) -> None:
        by_group: dict[int, list[Transfer]] = {}
        for t in transfers:
            parts = self._parts.setdefault(t.req_id, set())
            if t.group in parts:
                self._breach(f"a second load of request {t.req_id} in group {t.group} while one is in flight")
                continue
            parts.add(t.group)
            by_group.setdefault(t.group, []).append(t)
        for g, ts in by_group.items():
            self.workers[g].load(ts)

    def cancel(self, req_ids) -> None:
        for w in self.workers.values():
            w.cancel(req_ids)

    def drop_memory(self) -> None:
        for w in self.workers.values():
            w.drop_memory()

    def poll(self) -> tuple[set[str], set[int], set[str], WorkerReport]:
        """(requests finished loading, block ids that failed, requests whose load failed, report).
        With nothing to report the three sets are NOTHING (shared: never change them)."""
        polled = [(g, *w.poll()) for g, w in self.workers.items()]
        if all(done is NOTHING and rep.empty() for _, done, _, rep in polled):
            return NOTHING, NOTHING, NOTHING, polled[0][3]  # (most decode steps: nothing finished or counted)
        finished: set[str] = set()
        errors: set[int] = set()
        report = WorkerReport()
        for g, done, errs, rep in polled:
            errors |= errs
            self._failed.update(r.req_id for r in rep.loads if r.failed)
            report = report.merge(rep)
            for req in done:
                parts = self._parts.get(req)
                if parts is None or g not in parts:
                    self._breach(f"request {req} reported finished loading in group {g} with no load in flight")
                    continue
                parts.discard(g)
                if parts:
                    continue
                del self._parts[req]
                finished.add(req)
        failed = finished & self._failed
        self._failed -= finished
        return finished, errors, failed, report

    def wait_for_jobs(self, timeout: float) -> None:
        for w in self.workers.values():
            if w.in_flight:
                w.wait_for_jobs(timeout)
                return

    @property
    def in_flight(self) -> int:
        return sum(w.in_flight for w in self.workers.values())

    @property
    def staging_in_use(self) -> int:
        if self.host is not None:  # one arena for every group
            return self.host.staging.in_use
        return sum(w.staging_in_use for w in self.workers.values())

    @property
    def stuck(self) -> int:
        """Staging buffers set aside until the kernel gives them back (worker/staging.py)."""
        if self.host is not None:
            return self.host.staging.stuck
        return sum(w.stuck for w in self.workers.values())

    def drain(self, timeout: float = 30.0) -> None:
        for w in self.workers.values():
            w.drain(timeout)

    def close(self) -> None:
        for w in self.workers.values():
            w.close()
        if self.host is not None:
            self.host.close()
