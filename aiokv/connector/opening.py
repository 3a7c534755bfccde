# SPDX-License-Identifier: Apache-2.0
"""What the scheduler role opens at start: the engine's load-failure policy made
'recompute', the store (one cache directory, or one Store per drive) bounded by
start_timeout, the SchedulerSide over it with its settings (admission, the bucket
tier), and the KV events for routers.

Threading contract: the EngineCore scheduler thread, at start (the connector's
__init__); the stores' file calls run on their I/O threads, the start-time open
on bounded()'s thread (store/fsthread.py).
"""

from __future__ import annotations

import logging

from aiokv import __version__

log = logging.getLogger("aiokv")


def engine_transfer_config(own, depth: int = 8):
    """The kv_transfer_config vLLM's scheduler reads kv_load_failure_policy from: our own,
    or, under vLLM's MultiConnector, the MultiConnector's. Called from our __init__, while
    MultiConnector.__init__ (its `vllm_config`) is on the stack
    (tests/test_prefill_decode_roles_e2e.py fails requests if it is not found).

    Why the caller's frames, in vLLM 0.32 (issue 42 looked for another way and found none):
    - MultiConnector._get_connector_classes_and_configs (vllm/distributed/kv_transfer/
      kv_connector/v1/multi_connector.py, lines 236-240) hands each child
      `copy.copy(vllm_config)` with `kv_transfer_config` replaced by a new
      KVTransferConfig(**entry): nothing a child is given refers back to the engine's
      config or to its kv_transfer_config;
    - Scheduler.__init__ (vllm/v1/core/sched/scheduler.py, lines 171-184) reads the
      engine's `kv_transfer_config.kv_load_failure_policy` once, right after
      KVConnectorFactory.create_connector returns, into `recompute_kv_load_failures`:
      the policy must be changed during our __init__, never later (no connector call
      after it hands us the engine's config);
    - get_current_vllm_config() is no help: the engine core creates its Scheduler outside
      any set_current_vllm_config() (vllm/v1/engine/core.py, line 174; only workers and
      model loading set it), so it holds no config then.
    """
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


def recompute_failed_loads(ktc, own, cfg) -> None:
    """ktc: the engine's kv_transfer_config (engine_transfer_config), own: ours. A cache miss
    must never fail a request: a failed load is recomputed, unless strict_load_failures."""
    if ktc.kv_load_failure_policy == "fail" and not cfg.strict_load_failures:
        ktc.kv_load_failure_policy = "recompute"
        log.info(
            "aiokv: kv_load_failure_policy set to 'recompute' (a failed cache load is recomputed%s); "
            "set strict_load_failures=true in kv_connector_extra_config to keep 'fail'",
            "" if ktc is own else "; under MultiConnector the policy is the engine's, for every connector",
        )


def open_store(cfg, ns, ranks: int, path: str, drives: int = 1):
    """One Store on `path` and its namespace per KV-cache group: (store, [(group, Namespace)]).
    drives: how many drives share the capacity, the quotas and the pins."""
    from aiokv.store import Store

    store = Store(
        path,
        capacity=cfg.capacity // drives,
        io_thread=True,
        fs_timeout=cfg.fs_timeout,
        secret=cfg.secret,  # (tenants are named on disk by tags keyed by it)
    )
    # a drive's share of the quotas and of pin_capacity, as of the capacity
    store.set_quotas({t: max(1, q // drives) for t, q in cfg.quota.items()})
    store.pin_capacity = None if cfg.pin_capacity is None else cfg.pin_capacity // drives
    store.set_request_pins({t: None if b is None else max(1, b // drives) for t, b in cfg.request_pins.items()})
    try:
        spaces = []
        for g, nsid in zip(ns.groups, ns.group_nsids):
            fields = ns.fields if len(ns.groups) == 1 else {**ns.fields, "group": g.index}
            spaces.append(
                (g, store.namespace(nsid, g.payload_bytes, ranks=1 if g.replicated else ranks, fields=fields))
            )
    except BaseException:
        store.close(checkpoint=False)
        raise
    return store, spaces


def open_stores(cfg, ns, ranks: int):
    """(store, [(group, Namespace)]): a Store, or a Drives for several paths (either an
    api.StoreApi); None if the cache directories cannot be used (logged: aiokv is off, vLLM
    runs without it). StoreLocked goes through."""
    from aiokv.store import StoreLocked
    from aiokv.store.fsthread import bounded

    several = len(cfg.paths) > 1
    try:
        # a file system that does not answer must not hang vLLM's start: past start_timeout
        # aiokv is off (as for a directory it cannot use), and the store, if it opens later, closes
        if several:  # one Store per drive (aiokv/store/drives.py); a drive missing is left out
            from aiokv.store.drives import open_drives

            def open_drive(path, drives):
                store, spaces = open_store(cfg, ns, ranks, path, drives)
                return store, [part for _, part in spaces]

            store, parts = open_drives(
                cfg.paths, open_drive, cfg.start_timeout, cfg.breaker_failures, cfg.breaker_cooldown
            )
            return store, list(zip(ns.groups, parts))
        store, spaces = bounded(
            lambda: open_store(cfg, ns, ranks, cfg.path),
            cfg.start_timeout,
            f"the cache directory {cfg.path}",
            late=lambda got: got[0].close(checkpoint=False),
        )
        return store, spaces
    except StoreLocked:
        raise
    except OSError as e:
        log.error(
            "aiokv: cannot use cache director%s %s (%s); aiokv is disabled and vLLM runs without it",
            "ies" if several else "y",
            ", ".join(cfg.paths),
            e.strerror or e,
        )
        return None


def open_side(cfg, store, spaces, block_size: int, layerwise: bool, kv_role: str):
    """The SchedulerSide over the opened store, with its settings: saves (not a kv_consumer),
    admission, the bucket tier."""
    from aiokv.scheduler.side import SchedulerSide
    from aiokv.util.breaker import Breaker

    several = len(cfg.paths) > 1
    # several drives: each judges its own failures (store/drives.py); this one, only a stall of all
    side = SchedulerSide(
        store,
        spaces,
        block_size,
        Breaker(0 if several else cfg.breaker_failures, cfg.breaker_cooldown),
        index_wait=cfg.index_wait,
    )
    side.layerwise = layerwise
    side.saves = kv_role != "kv_consumer"
    side.save_generated = cfg.save_generated
    if cfg.admit != "all":
        from aiokv.scheduler.admission import Admission

        side.admission = Admission(cfg.admit, cfg.admit_window)
    if cfg.bucket:
        use_bucket(cfg, side, store, spaces)
    return side


def use_bucket(cfg, side, store, spaces) -> None:
    """The bucket tier's lookups for the side, and its publisher told what the namespaces hold."""
    from aiokv.bucket.lookup import BucketLookup
    from aiokv.data.format import slot_bytes

    side.bucket = bucket = BucketLookup(
        cfg.bucket,
        cfg.bucket_timeout,
        cfg.probe_timeout,
        [(ns.nsid, ns.ranks, slot_bytes(ns.payload_bytes)) for _, ns in spaces],
        cfg.secret,
    )
    # for nodes warmed from the bucket (aiokv warm): what each namespace holds, and the
    # labels the KV events write for our blocks (bucket/publisher.py)
    bucket.publisher.namespaces((ns.nsid, ns.payload_bytes, ns.ranks, ns.fields) for _, ns in spaces)
    for _, _, st in store.drives():
        st.labels.sink = bucket.publisher.labels


def log_opened(cfg, store, ns, spaces) -> None:
    log.info(
        "aiokv %s: cache %s, namespace %s (%s), %d blocks stored",
        __version__,
        ", ".join(cfg.paths[d] for d, _, _ in store.drives()),
        ns.nsid.hex(),
        ", ".join(g.kind for g in ns.groups),
        sum(part.count() for _, part in spaces),
    )


def kv_events(sched, vllm_config, kv_cache_config, block_size: int):
    """The KV events (events.py) for the side's groups, as vLLM hashes and describes them."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window

    from aiokv.connector.events import KVEvents

    hbs = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1]
    specs = [g.kv_cache_spec for g in kv_cache_config.kv_cache_groups]
    groups = [
        (
            g.spec.index,
            g.ns,
            str(get_kv_cache_spec_kind(specs[g.spec.index]).value),
            get_kv_cache_spec_sliding_window(specs[g.spec.index]),
        )
        for g in sched.groups
    ]
    return KVEvents(sched.store, groups, block_size, hbs, str(vllm_config.cache_config.prefix_caching_hash_algo))
