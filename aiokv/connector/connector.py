# SPDX-License-Identifier: Apache-2.0
"""AioKVConnector: the class vLLM instantiates; thin, it forwards each call to
the role it plays.

    --kv-transfer-config '{"kv_connector": "AioKVConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "aiokv.connector",
        "kv_connector_extra_config": {"path": "/mnt/nvme/aiokv", "capacity": "200GiB"}}'

It reads the settings (config.py) and describes the namespace (namespace.py),
then hands scheduler-role calls to SchedulerRole (scheduler_role.py: the
scheduler side, EngineCore process) and worker-role calls to WorkerRole
(worker_role.py: the worker side, each worker process). No policy lives here.

Threading contract: vLLM creates one instance per role. The scheduler-role
instance is called from the EngineCore scheduler thread only; the worker-role
instance from the model runner's thread only (its pipelines run on the event
loop thread owned by TransferWorker). No method lets an exception reach vLLM
on the hot path: failures become misses, recomputes or dropped saves, counted.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from aiokv.config import AioKVConfig
from aiokv.connector.metadata import AioKVMetadata, AioKVWorkerMetadata  # noqa: F401 (exported)
from aiokv.connector.metrics import AioKVPromMetrics, AioKVStats
from aiokv.connector.namespace import ModelNamespace, cannot_use_cached_prefix
from aiokv.connector.plugin import use_vllm_logging
from aiokv.connector.scheduler_role import SchedulerRole
from aiokv.connector.worker_role import WorkerRole
from aiokv.data.mac import require_mac
from aiokv.scheduler.layout import FULL, STATE

log = logging.getLogger("aiokv")


class AioKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        use_vllm_logging()
        self.cfg = AioKVConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        require_mac(self.cfg.secret)  # a secret whose MAC cannot be made here is refused at start
        self.namespace = ns = ModelNamespace(vllm_config, kv_cache_config)
        self.fields, self.groups, self.nsid = ns.fields, ns.groups, ns.nsid
        self.block_size = ns.block_size
        self.ranks = vllm_config.parallel_config.tensor_parallel_size
        # layer-by-layer copy-in (aiokv/worker/layerwise.py): one full-attention group only;
        # other models load whole requests, as without the setting
        self.layerwise = self.cfg.layerwise and len(self.groups) == 1 and self.groups[0].kind == FULL
        if self.cfg.layerwise and not self.layerwise and role == KVConnectorRole.SCHEDULER:
            log.warning(
                "aiokv: layerwise loads need a model with one full-attention KV-cache group; "
                "this one (%s) loads whole requests",
                ", ".join(g.kind for g in self.groups),
            )
        # an engine that cannot compute after a cached prefix is offered none (saves go on: the
        # blocks are this prefix's KV, for engines of the namespace that can use them)
        why = cannot_use_cached_prefix(vllm_config)
        # kv_role (docs/operations.md, "Prefill and decode"): kv_both loads and saves;
        # kv_producer only saves (offers no hits); kv_consumer only loads (saves nothing)
        self.kv_role = self._kv_transfer_config.kv_role or "kv_both"
        self.offer_hits = why is None and self.kv_role != "kv_producer"
        self.scheduler_role = SchedulerRole(self.cfg, ns, self.ranks, self.layerwise, self.offer_hits, self.kv_role)
        self.worker_role = WorkerRole(self.cfg, ns, self.ranks, self.layerwise, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            if why is not None:
                log.warning(
                    "aiokv: %s, so this engine cannot use a cached prefix: aiokv offers no hits and only saves blocks",
                    why,
                )
            elif self.kv_role != "kv_both":
                log.info(
                    "aiokv: kv_role %s: %s",
                    self.kv_role,
                    "saves blocks and offers no hits"
                    if self.kv_role == "kv_producer"
                    else "offers hits and saves nothing",
                )
            if (
                any(g.kind == STATE for g in self.groups)
                and getattr(vllm_config.cache_config, "prefix_cache_retention_interval", None) == 0
            ):
                log.warning(
                    "aiokv: vLLM keeps this model's recurrent states only at prompt ends, so a reply is "
                    "never a hit for the next turn of a chat; set --prefix-cache-retention-interval "
                    "to a multiple of the block size (or None: every block) to save them too "
                    '(docs/operations.md, "Conversations")'
                )
            self.scheduler_role.open(self._kv_transfer_config)
            self.scheduler_role.use_events(vllm_config, kv_cache_config)

    @property
    def sched(self):
        """The SchedulerSide (scheduler role; None: not this role, or aiokv is off)."""
        return self.scheduler_role.sched

    @property
    def worker(self):
        """The GroupedWorker (worker role; None: not this role, or the worker is disabled)."""
        return self.worker_role.worker

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a preempted request's output need not wait for us

    # ---- hooks vLLM 0.33 added or uses on GPUs (0.32 lacks some: then they are never called) ----
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None) -> bool:
        # Sleep unmaps the KV cache under aiokv's in-flight copies and its staged layerwise
        # loads; aiokv does not implement unregister_kv_caches/restore_kv_caches (drain, drop
        # staged loads, re-take the views), so vLLM refuses --enable-sleep-mode with one line
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # layerwise copies are waited for in wait_for_layer_load, which a replayed full CUDA
        # graph skips: vLLM then captures piecewise graphs (attention runs between the pieces)
        return (extra_config or {}).get("layerwise") is True

    # ================= scheduler role (scheduler_role.py) =================
    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        return self.scheduler_role.get_external_cache_hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool:
        return self.scheduler_role.reset_cache()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_role.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler_role.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler_role.build_connector_meta(scheduler_output)

    def take_events(self):
        return self.scheduler_role.take_events()

    def update_connector_output(self, connector_output) -> None:
        self.scheduler_role.update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_role.has_pending_push_work()

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])  # nothing is held past the step: block ids unused

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_role.request_finished(request, block_ids)

    def get_kv_connector_stats(self):
        return self.scheduler_role.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return AioKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AioKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================= worker role (worker_role.py) =================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.worker_role.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.worker_role.start_load_kv(self._connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker_role.bind(connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker_role.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_role.wait_for_save(self._connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_role.get_finished(self._connector_metadata)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.worker_role.take_failed_requests()
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()), finished_recving=set(recving or ()), failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_role.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self):
        return self.worker_role.build_connector_worker_meta()

    # ================= both =================
    def counters(self) -> dict[str, int]:
        """Everything this instance counted so far (tests, the demo)."""
        return {**self.scheduler_role.counters(), **self.worker_role.counters()}

    def shutdown(self) -> None:
        self.worker_role.shutdown()
        self.scheduler_role.shutdown()
