"""The vLLM-facing layer: the only code that imports vLLM.

    connector.py    AioKVConnector: vLLM's calls turned into plain data, both roles
    fingerprint.py  what the namespace is keyed by: weights, adapters
    metrics.py      the counters as vLLM's stats and `vllm:aiokv_*` Prometheus series
    plugin.py       vLLM's general-plugin entry point: registers the connector, logging

`kv_connector_module_path: aiokv.connector` names this package; the class is
loaded on first use, so the plugin entry point imports nothing of vLLM's KV
connector machinery early.
"""


def __getattr__(name):
    if name in ("AioKVConnector", "AioKVMetadata"):
        from aiokv.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'aiokv.connector' has no attribute {name!r}")
