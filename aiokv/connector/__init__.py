# SPDX-License-Identifier: Apache-2.0
"""The vLLM-facing layer: the only code that imports vLLM.

    connector.py    AioKVConnector, the class vLLM instantiates: forwards to its role
    scheduler_role.py  the scheduler-role glue (SchedulerSide, the store, vLLM's stats)
    opening.py      what the scheduler role opens at start: the store, the side, KV events
    scheduled.py    a step's SchedulerOutput as plain Scheduled items
    worker_role.py  the worker-role glue (the TransferWorkers of each KV-cache group)
    metadata.py     the step's plan and the workers' report as vLLM carries them
    namespace.py    the namespace description: model, weights, adapters, layout
    fingerprint.py  what the namespace is keyed by: weights, adapters
    adapters.py     LoRA adapters' fingerprints, on an I/O thread of their own
    roots.py        requests' key roots; those waiting for their adapter's fingerprint
    metrics.py      the counters as vLLM's stats and `vllm:aiokv_*` Prometheus series
    plugin.py       vLLM's general-plugin entry point: registers the connector, logging

`kv_connector_module_path: aiokv.connector` names this package; the class is
loaded on first use, so the plugin entry point imports nothing of vLLM's KV
connector machinery early.

Threading contract: each module states its own; vLLM builds one connector per
role and calls the scheduler role's methods from the EngineCore scheduler
thread, the worker role's from the model runner's thread.
"""


def __getattr__(name):
    if name in ("AioKVConnector", "AioKVMetadata"):
        from aiokv.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'aiokv.connector' has no attribute {name!r}")
