# SPDX-License-Identifier: Apache-2.0
"""The worker-role glue: vLLM's worker-side connector calls on aiokv's workers.

register_kv_caches builds one TransferWorker per KV-cache group (GroupedWorker);
each step the scheduler side's plan (AioKVMetadata) is started (loads, cancels,
layer-by-layer copies), saved (wait_for_save) and polled (get_finished), and
the workers' report goes back as AioKVWorkerMetadata. A worker that did not
start is disabled: its promised loads are reported failed, its saves dropped.

Threading contract: the model runner's thread only (the pipelines run on the
event loop thread each TransferWorker owns).
"""

from __future__ import annotations

import logging
from typing import Any

from aiokv.connector.metadata import AioKVMetadata, AioKVWorkerMetadata
from aiokv.jobs import LoadResult, SaveResult, StepPlan, WorkerReport
from aiokv.scheduler.layout import FULL, GroupSpec

log = logging.getLogger("aiokv")
IDLE_WAIT_S = 0.002  # how long an engine step with nothing to compute waits for a load


def per_block_errors(groups: list[GroupSpec]) -> bool:
    """Whether failed loads go to vLLM block by block (load_failures): one full-attention group."""
    return len(groups) == 1 and groups[0].kind == FULL


def load_failures(per_block: bool, errors: set[int], failed: set[str]) -> tuple[set[int], set[str]]:
    """How vLLM is told about loads that failed: (block ids for get_block_ids_with_load_errors,
    requests for failed_recving).

    vLLM's per-block path cuts a request back to its first failed block and computes on from
    there over the block table it has. That is right only when the table holds every block
    before it, i.e. for one full-attention group: a sliding-window group holds null blocks
    before the window that ends at the hit (the window ending at the cut reaches into them), a
    recurrent group holds one state, and with several groups vLLM refuses the path. Everything
    but one full-attention group is therefore recomputed whole (failed_recving). Block 0 is
    vLLM's null block, shared by every table: it is never reported (vLLM would cut every request
    whose table holds it); a failed load that carried one falls back to the whole-request path.
    """
    if per_block and 0 not in errors:
        return set(errors), set()
    return set(), set(failed)


def vllm_batch_copy():
    """vLLM's swap_blocks_batch (a list of raw copies in one driver call, CUDA builds) where this
    build of vLLM registered it, else None: a CUDA device then copies a row at a time
    (worker/cuda.py, which checks it at attach before relying on it)."""
    try:
        import torch
        from vllm import _custom_ops as ops

        if hasattr(torch.ops._C_cache_ops, "swap_blocks_batch"):
            return getattr(ops, "swap_blocks_batch", None)
    except Exception:  # another vLLM, or no compiled ops: rows one by one
        pass
    return None


def block_dims(kv_cache_config, index: int, tensors) -> list[int | None]:
    """Per KV tensor of group `index` ([(layer name, tensor)], as kv_tensors gives them): the
    dimension that counts blocks, as vLLM lays the layer's tensor out; None where vLLM does not
    describe it (the worker then goes by sizes: worker/kv_layout.py Layer).

    Asked of vLLM, not guessed from sizes (a block count equal to another dimension's size
    would be ambiguous): both model runners allocate each layer's tensor by
    compute_layer_kv_cache_shape_bytes(spec, blocks) (its last dimension in bytes, viewed
    as the dtype); called for two probe block counts, the one dimension that moves counts
    blocks. Plain ints go down to the worker (nothing below the connector imports vLLM)."""
    try:
        from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs, compute_layer_kv_cache_shape_bytes
    except ImportError:  # another vLLM: sizes decide
        return [None] * len(tensors)
    names = [n for n, _ in tensors]
    out: list[int | None] = []
    for name, t in tensors:
        dim = None
        try:
            spec = kv_cache_config.kv_cache_groups[index].kv_cache_spec
            if isinstance(spec, UniformTypeKVCacheSpecs):
                spec = spec.kv_cache_specs[name]
            if names.count(name) == 1 and getattr(spec, "has_layer_views", True):
                a, b = (tuple(compute_layer_kv_cache_shape_bytes(spec, n)) for n in PROBE_BLOCKS)
                moved = [d for d, (x, y) in enumerate(zip(a, b)) if x != y]
                if len(a) == len(b) == t.dim() and len(moved) == 1:
                    dim = moved[0]
        except Exception:  # a spec vLLM cannot shape this way: sizes decide
            dim = None
        out.append(dim)
    return out


PROBE_BLOCKS = (1, 2)  # block counts the layout is asked for (any two differ in the block dimension only)


class WorkerRole:
    def __init__(self, cfg, ns, ranks: int, layerwise: bool, kv_cache_config):
        self.cfg = cfg
        self.groups, self.group_nsids = ns.groups, ns.group_nsids
        self.ranks = ranks
        self.layerwise = layerwise
        self.kv_cache_config = kv_cache_config
        self.worker = None
        self._layers = None  # the worker's LayerwiseLoads
        self._errors: set[int] = set()
        self._report: WorkerReport | None = None
        self._failed_recv: set[str] = set()
        self._failed_blocks: set[int] = set()  # their blocks (a disabled worker)
        self._failed_now: set[str] = set()  # loads failed, reported as failed_recving (load_failures)
        # one full-attention group: failed loads are reported block by block (load_failures)
        self.per_block_errors = per_block_errors(self.groups)
        self._rank = 0

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # vLLM's V1 runner hands dict[str, Tensor]; Model Runner V2 the dict[str, Any] of its
        # init_kv_cache (per-layer views of one buffer; other values for specs aiokv refuses)
        from aiokv.worker.groups import GroupedWorker

        rank = 0
        workers: dict = {}
        host = None
        try:
            if self.ranks > 1:  # a wrong rank would read another rank's shard: no fallback
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
            self._rank = rank
            bucket = None
            if self.cfg.bucket:  # one client (and breaker) for this worker's groups
                from aiokv.bucket.client import BucketClient

                bucket = BucketClient(self.cfg.bucket, self.cfg.bucket_timeout)
            devices = self._devices(kv_caches)
            host = self._host(devices, rank)
            for g, nsid, device in zip(self.groups, self.group_nsids, devices):
                workers[g.index] = self._transfer_worker(g, nsid, device, rank, bucket, host)
            self._layers = workers[self.groups[0].index].layers
            self.worker = GroupedWorker(workers, {g.index for g in self.groups if rank == 0 or not g.replicated}, host)
        except Exception as e:
            # Loads the scheduler promises are then reported failed, saves dropped, and
            # the scheduler side is told to stop offering hits and saving.
            log.error("aiokv: worker %d disabled: %s", rank, e)
            for w in workers.values():
                try:
                    w.close()
                except Exception:
                    pass
            if host is not None:
                try:
                    host.close()
                except Exception:
                    pass
            self.worker = None
            self._layers = None
            self._report = WorkerReport(disabled=True)

    def _devices(self, kv_caches: dict[str, Any]) -> list:
        """One device per KV-cache group, over its layers' tensors; refused (ValueError) where
        the tensors' bytes per block are not what the KV cache spec says."""
        from aiokv.worker.device import make_device
        from aiokv.worker.kv_layout import kv_tensors

        devices, batch = [], vllm_batch_copy()
        for g in self.groups:
            tensors = kv_tensors(kv_caches, g.layer_names)
            dims = block_dims(self.kv_cache_config, g.index, tensors)
            device = make_device(tensors, self.kv_cache_config.num_blocks, dims, batch_copy=batch)
            if device.payload_bytes != g.payload_bytes:
                raise ValueError(
                    f"aiokv: the KV tensors of group {g.index} hold {device.payload_bytes} bytes "
                    f"per block, the KV cache spec says {g.payload_bytes}; this layout is not "
                    "supported"
                )
            devices.append(device)
        return devices

    def _host(self, devices: list, rank: int):
        """One event loop and one staging arena for every group (slots of the largest group's size)."""
        from aiokv.data import format as fmt
        from aiokv.worker.host import WorkerHost, checksum_threads_for

        threads = checksum_threads_for(devices[0], self.cfg.secret, self.cfg.checksum_threads)
        return WorkerHost(
            max(fmt.slot_bytes(d.payload_bytes) for d in devices),
            max(1, self.cfg.staging),
            self.cfg.memory,
            threads,
            rank,
        )

    def _transfer_worker(self, g: GroupSpec, nsid: bytes, device, rank: int, bucket, host):
        """Group `g`'s TransferWorker, on the shared host, as the configuration says."""
        from aiokv.store.store import ns_dir
        from aiokv.worker.transfer import TransferWorker

        # replicated KV (MLA) is stored once, as rank 0's, and read by every rank
        # several drives: the namespace's directory on each, in the configured order (data/drives.py)
        dirs = [ns_dir(p, nsid) for p in self.cfg.paths]
        return TransferWorker(
            device,
            dirs[0] if len(dirs) == 1 else dirs,
            nsid,
            0 if g.replicated else rank,
            self.cfg.staging,
            self.cfg.io,
            self.cfg.queue_depth,
            self.cfg.load_timeout,
            self.cfg.save_timeout,
            bucket,
            self.cfg.upload_queue,
            self.cfg.flush_timeout,
            self.cfg.secret,
            self.cfg.memory,
            layerwise=self.layerwise,
            host=host,
        )

    def start_load_kv(self, meta) -> None:
        # forward_context says nothing about the step (V2 passes an empty one on every step)
        plan = _plan(meta)
        if self.worker is None:
            report = self._disabled_report()
            for t in plan.loads:  # promised but impossible: recompute
                self._failed_blocks.update(t.block_ids)
                self._failed_recv.add(t.req_id)
                report.loads.append(LoadResult(t.job, self._rank, t.req_id, list(t.block_ids)))
            return
        if plan.cancel:
            self.worker.cancel(plan.cancel)
        if plan.loads:
            self.worker.load(plan.loads)

    def bind(self, connector_metadata) -> None:
        if self.worker is not None and _plan(connector_metadata).reset:  # the cache was reset: nothing kept
            self.worker.drop_memory()
        if self._layers is not None:
            # before the forward (vLLM starts async loads only after it): cancelled
            # requests' staged loads are dropped first, then the others start copying in
            plan = _plan(connector_metadata)
            if plan.cancel:
                self.worker.cancel(plan.cancel)
            self._layers.begin(whole=getattr(connector_metadata, "decode_like", True))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads are verified whole before vLLM schedules the request; with layerwise
        # on, their copy into this layer may still be under way (worker/layerwise.py)
        if self._layers is not None:
            self._layers.wait_layer(layer_name)

    def wait_for_save(self, meta) -> None:
        plan = _plan(meta)
        if not plan.saves:
            return
        if self.worker is not None:
            self.worker.save(plan.saves)
        else:
            report = self._disabled_report()
            for t in plan.saves:
                report.saves.append(SaveResult(t.job, self._rank, [], list(t.keys)))

    def _disabled_report(self) -> WorkerReport:
        if self._report is None:
            self._report = WorkerReport(disabled=True)
        return self._report

    def get_finished(self, meta) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            done, self._failed_recv = self._failed_recv, set()
            blocks, self._failed_blocks = self._failed_blocks, set()
            self._take_load_failures(blocks, done)
            return None, done or None
        if self._layers is not None:
            self._layers.end_step()  # every staged block of this step is in place
        if isinstance(meta, AioKVMetadata) and meta.idle:
            # a step without a forward pass (vLLM only collects transfers): wait a little for
            # a job rather than spin empty steps; a step that computes never waits here
            self.worker.wait_for_jobs(IDLE_WAIT_S)
        finished, errors, failed, report = self.worker.poll()
        self._take_load_failures(errors, failed)
        self._report = report
        return None, finished or None

    def _take_load_failures(self, errors: set[int], failed: set[str]) -> None:
        if not errors and not failed:
            return  # (most steps)
        blocks, reqs = load_failures(self.per_block_errors, errors, failed)
        self._errors |= blocks  # per block: vLLM keeps the blocks that did load
        self._failed_now |= reqs  # whole requests: vLLM recomputes them from the start

    def take_failed_requests(self) -> set[str]:
        """Requests whose load failed since the last call (KVConnectorTransferResults.failed_recving)."""
        failed, self._failed_now = self._failed_now, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_connector_worker_meta(self):
        report, self._report = self._report, None
        if report is None or report.empty():
            return None
        return AioKVWorkerMetadata(report)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.worker is not None:
            out["worker_in_flight"] = self.worker.in_flight
            out["staging_in_use"] = self.worker.staging_in_use
            out["load_report_breaches"] = self.worker.breaches  # refused duplicates (worker/groups.py): 0
        if self._layers is not None:
            out.update({f"layerwise_{k}": v for k, v in self._layers.counts.items()})
        return out

    def shutdown(self) -> None:
        if self._layers is not None:
            try:
                self._layers.close()
            except Exception:
                log.exception("aiokv: finishing layer-by-layer copies at shutdown failed")
            self._layers = None
        if self.worker is not None:
            self.worker.close()
            self.worker = None


def _plan(meta) -> StepPlan:
    return meta.plan if isinstance(meta, AioKVMetadata) else StepPlan()
