# SPDX-License-Identifier: Apache-2.0
"""vLLM plugin entry point (vllm.general_plugins), run in every vLLM process:
registers "AioKVConnector" so kv_connector_module_path can be left out of
--kv-transfer-config, and gives aiokv's log lines vLLM's format and level
(otherwise Python drops INFO lines such as the start line with the version).

Threading contract: register() runs once per process, where vLLM loads its
plugins; use_vllm_logging() on whichever thread builds a connector (idempotent).
"""

import logging
import sys


def register() -> None:
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception:  # vLLM without KV connectors: nothing to register
        return
    if "AioKVConnector" not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector("AioKVConnector", "aiokv.connector", "AioKVConnector")
    use_vllm_logging()


def use_vllm_logging() -> None:
    """Once vLLM has configured logging in this process: aiokv's lines get vLLM's
    format and level, on stderr (where aiokv's warnings always went). Idempotent;
    also called by the connector, since vLLM may configure logging after plugins load."""
    ours, theirs = logging.getLogger("aiokv"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(theirs.handlers[0].formatter)
        ours.addHandler(handler)
        ours.setLevel(theirs.level)
        ours.propagate = False
