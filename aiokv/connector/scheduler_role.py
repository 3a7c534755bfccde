# SPDX-License-Identifier: Apache-2.0
"""The scheduler-role glue: vLLM's scheduler-side connector calls on SchedulerSide.

Opens the store and the SchedulerSide over it (opening.py); turns vLLM's
requests and SchedulerOutput into plain data (keys' roots; Scheduled items,
scheduled.py) and the side's plan into AioKVMetadata; feeds the workers'
reports back; hands vLLM its stats (counter deltas, gauges).

Threading contract: the EngineCore scheduler thread only (the store's I/O
thread is the store's; the bucket's prober runs on its own loop thread).
"""

from __future__ import annotations

import logging
from typing import Any

from aiokv.connector.adapters import Adapters
from aiokv.connector.figures import SchedulerFigures
from aiokv.connector.metadata import AioKVMetadata, AioKVWorkerMetadata
from aiokv.connector.metrics import AioKVStats
from aiokv.connector.opening import (
    engine_transfer_config,
    kv_events,
    log_opened,
    open_side,
    open_stores,
    recompute_failed_loads,
)
from aiokv.connector.roots import Roots
from aiokv.connector.scheduled import scheduled_items
from aiokv.jobs import StepPlan

log = logging.getLogger("aiokv")


def wants_pin(request) -> bool:
    """Whether a request asks for its blocks to be pinned: kv_transfer_params {"aiokv": {"pin": true}}
    (vLLM 0.32 puts SamplingParams.extra_args["kv_transfer_params"] on the Request it hands us)."""
    params = getattr(request, "kv_transfer_params", None)
    ours = params.get("aiokv") if isinstance(params, dict) else None
    return isinstance(ours, dict) and ours.get("pin") is True


class SchedulerRole:
    def __init__(self, cfg, ns, ranks: int, layerwise: bool, offer_hits: bool, kv_role: str):
        self.cfg = cfg
        self.fields, self.groups, self.group_nsids = ns.fields, ns.groups, ns.group_nsids
        self.nsid, self.block_size = ns.nsid, ns.block_size
        self.ranks = ranks
        self.layerwise = layerwise
        self.offer_hits = offer_hits
        self.kv_role = kv_role
        self.ns = ns  # (what opening.py opens the namespaces by)
        self.sched = None
        # LoRA adapters' fingerprints, looked at on their own I/O thread (adapters.py); requests' roots
        self.adapters = Adapters(cfg.fs_timeout)
        self.roots = Roots(self.nsid, self.adapters)
        self.figures = SchedulerFigures(self.ranks)  # what vLLM's stats are handed (figures.py)
        self._queried: dict[str, int] = {}  # request -> tokens asked of us at its last lookup
        self._bucket_tokens: dict[str, int] = {}  # request -> hit tokens from the bucket (hit sources)
        self.events = None  # KV events for routers (events.py); None: vLLM publishes none, or kv_events is off

    def open(self, kv_transfer_config) -> None:
        """The store and the SchedulerSide over it (opening.py); on a cache directory it cannot
        use, aiokv stays off (self.sched None) and vLLM runs without it."""
        recompute_failed_loads(engine_transfer_config(kv_transfer_config), kv_transfer_config, self.cfg)
        opened = open_stores(self.cfg, self.ns, self.ranks)
        if opened is None:
            return
        store, spaces = opened
        self.sched = open_side(self.cfg, store, spaces, self.block_size, self.layerwise, self.kv_role)
        log_opened(self.cfg, store, self.ns, spaces)

    def use_events(self, vllm_config, kv_cache_config) -> None:
        """Emit KV events (events.py) if vLLM publishes them and the kv_events setting is on; an
        engine that offers no hits (kv_producer, or one that cannot use a cached prefix) announces
        nothing: a router must not send it prompts for blocks it will not load."""
        kec = getattr(vllm_config, "kv_events_config", None)
        if (
            self.sched is None
            or not self.cfg.kv_events
            or kec is None
            or not kec.enable_kv_cache_events
            or not self.offer_hits
        ):
            return
        self.events = kv_events(self.sched, vllm_config, kv_cache_config, self.block_size)

    def take_events(self):
        if self.events is None:
            return ()
        try:
            return self.events.take()
        except Exception:
            self._error("take_events (KV events: this step's are lost)")
            return ()

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The hit split by where its blocks come from: the bucket tier (vLLM's
        label for a remote store is external_unspecified) and the local cache directory
        (disk). A hit the worker serves from its host-memory tier is counted as disk: that
        tier is the workers' and the scheduler side cannot know it at lookup time."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        try:
            bucket = min(self._bucket_tokens.pop(request.request_id, 0), num_external_tokens)
        except Exception:
            self._error("get_external_cache_hit_sources (a hit counted as the disk's)")
            bucket = 0  # (labels only: the whole hit is counted as the disk's)
        out = {CacheHitSource.DISK: num_external_tokens - bucket, CacheHitSource.EXTERNAL_UNSPECIFIED: bucket}
        return {k: v for k, v in out.items() if v > 0}

    @property
    def epoch(self) -> str | None:
        """The key epoch reset_cache set (None: the weight files' own blocks); roots.py."""
        return self.roots.epoch

    def reset_cache(self) -> bool:
        """vLLM's reset_prefix_cache(reset_connector=True), and a pause or sleep that
        clears caches (scheduler role; vLLM does not call the workers). The weights
        may have changed in place (an RL update): nothing stored before is served from
        now on, and what is stored from now on is never served to an engine that
        loads the weight files again. New requests' keys are rooted in a fresh random
        epoch; requests alive now never hit or save again (their loads in flight are
        recomputed); the workers drop their memory tier at the next step. Blocks of
        earlier epochs stay on disk until evicted; those of the weight files are hits
        again after a restart. False (vLLM then reports the reset failed) only if
        this went wrong."""
        if self.sched is None:
            return True  # nothing is served
        try:
            self.roots.reset()
            self.sched.new_epoch()
            if self.events is not None:
                self.events.reset()
        except Exception:
            self._error("reset_cache")
            return False
        log.info("aiokv: cache reset (the weights may have changed): blocks stored before are no longer served")
        return True

    # ---- the hooks vLLM's scheduler calls: none lets an exception of aiokv's own work through ----
    def _error(self, hook: str) -> None:
        """aiokv's own work in vLLM's call `hook` raised (call from its except block): counted
        (hook_errors), the first of each hook logged with its traceback. Never raises."""
        try:
            if self.sched is not None:
                self.sched.error(hook)
                return
        except Exception:
            pass
        log.exception("aiokv: %s failed; vLLM goes on", hook)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.events is not None:
            try:
                self.events.request(request)
            except Exception:
                self._error("get_num_new_matched_tokens (KV events)")
        if self.sched is not None and request.request_id not in self.sched.requests:
            try:
                self.sched.describe(request.request_id, request.cache_salt or "", wants_pin(request))
            except Exception:
                self._error("get_num_new_matched_tokens (tenant)")
        if self.sched is None or not self.offer_hits or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        try:
            root = self.roots.of(request)  # None: its adapter is not fingerprinted yet, a miss
            n = (
                0
                if root is None
                else self.sched.match(request.request_id, request.all_token_ids, root, num_computed_tokens)
            )
            self._queried[request.request_id] = request.num_tokens - num_computed_tokens  # counted at alloc
        except Exception:
            self._error("get_num_new_matched_tokens (a lookup: a miss)")
            return 0, False
        return n, bool(n)  # None: the bucket has not answered yet; vLLM asks again next step

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.sched is None:
            return
        try:
            self.figures.queried_tokens += self._queried.pop(request.request_id, 0)
            self._bucket_tokens[request.request_id] = self.sched.bucket_hit_tokens(
                request.request_id, num_external_tokens
            )
            root = self.roots.of(request)
            if root is None:  # its adapter is not fingerprinted yet: no state, nothing saved until it is
                self.figures.lora_misses += self.roots.wait(request, blocks.get_block_ids())
                return
            self.roots.allocated(request.request_id)
            self.sched.on_alloc(
                request.request_id,
                request.all_token_ids,
                root,
                blocks.get_block_ids(),
                num_external_tokens,
            )
        except Exception:
            self._error("update_state_after_alloc (preparing a load: recomputed)")
            if num_external_tokens > 0:  # vLLM now waits for this load: it must be reported, failed
                try:
                    ids = blocks.get_block_ids()
                except Exception:
                    ids = ([],)
                self.sched.fail_load(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> AioKVMetadata:
        try:
            idle = scheduler_output.total_num_scheduled_tokens == 0
        except Exception:
            idle = False  # (the worker then never waits for a job in this step)
        if self.sched is None:
            return AioKVMetadata(StepPlan(), idle=idle)
        try:
            self.roots.poll(self.sched)  # adapters fingerprinted (or seen changed) since the last step
        except Exception:
            self._error("build_connector_meta (LoRA adapters' fingerprints: applied at a later step)")
        decode_like = False
        try:
            items, boundary, decode_like = scheduled_items(scheduler_output, self.sched.requests)
            items = self.roots.rooted(items, self.sched)  # requests whose adapter is fingerprinted now
            plan = self.sched.plan(items, boundary)  # plan() contains its own failures
        except Exception:
            # the step's saves are dropped, the loads queued for it fail (vLLM recomputes them)
            self._error("build_connector_meta (this step's saves are dropped, its loads recomputed)")
            plan = self.sched.fail_step()
        if self.events is not None and plan.saves:
            try:
                self.events.planned(plan.saves, self.sched.requests)
            except Exception:
                self._error("build_connector_meta (KV events: this step's saves are not announced)")
        return AioKVMetadata(plan, decode_like, idle)

    def update_connector_output(self, connector_output) -> None:
        if self.sched is None:
            return
        report, finished = None, None
        try:
            finished = connector_output.finished_recving
            meta = connector_output.kv_connector_worker_meta
            report = meta.report if isinstance(meta, AioKVWorkerMetadata) else None
            if report is None and not finished:
                return  # the workers reported nothing this step (most decode steps)
            if report is not None:
                self.figures.add_worker(report.counters)
                self.sched.store.record(report.drives)  # (several drives: each judges its own)
            self.sched.on_report(report, finished)
        except Exception:
            # its saves are not committed (their slots go back); finished loads give back their pins
            self._error("update_connector_output (the saves it reports are dropped)")
            self.sched.lost_report(report, finished)

    def has_pending_push_work(self) -> bool:
        # keeps the engine stepping until the workers have reported every save
        try:
            return self.sched is not None and self.sched.pending_saves > 0
        except Exception:
            self._error("has_pending_push_work")
            return False

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        try:
            self.roots.finished(request.request_id)
            self._queried.pop(request.request_id, None)
            self._bucket_tokens.pop(request.request_id, None)
            if self.events is not None:
                self.events.finished(request.request_id)
        except Exception:
            self._error("request_finished (bookkeeping)")
        if self.sched is None:
            return False, None
        try:
            return self.sched.finished(request.request_id), None
        except Exception:
            self._error("request_finished")  # (its blocks are freed as usual: none is held)
            return False, None

    def get_kv_connector_stats(self):
        # vLLM sums what it is handed: deltas of counters, gauges when they change (aiokv/connector/metrics.py)
        if self.sched is None:
            return None
        try:
            data = self.figures.take(self.sched, self._scheduler_counters)  # None: nothing moved (O(1))
        except Exception:
            self._error("get_kv_connector_stats (this step's stats are lost)")
            return None
        return AioKVStats(data=data) if data else None

    def _scheduler_counters(self) -> dict[str, int]:
        """Scheduler and store counters since start, and the store's gauges (figures.py)."""
        return self.figures.scheduler_counters(self.sched)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.sched is not None:
            out.update(self.figures.totals)
            out.update(self._scheduler_counters())
            out["pinned"] = self.sched.store.load_pinned()
            out["hits_offered"] = int(self.offer_hits)
        return out

    def shutdown(self) -> None:
        try:
            self.adapters.close()  # (a look still running is a daemon thread's: the process exit ends it)
        except Exception:
            log.exception("aiokv: closing the LoRA adapters' I/O thread failed")
        if self.sched is not None:
            try:
                self.sched.close()  # (never raises)
            except Exception:
                log.exception("aiokv: closing the scheduler side failed")
            self.sched = None
