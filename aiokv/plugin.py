"""vLLM plugin entry point (vllm.general_plugins): registers "AioKVConnector" so
kv_connector_module_path can be left out of --kv-transfer-config."""


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM without KV connectors: nothing to register
        return
    if "AioKVConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("AioKVConnector", "aiokv.connector", "AioKVConnector")
